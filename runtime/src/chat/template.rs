//! Chat templates rendered as transformers' `apply_chat_template` renders them.
//!
//! transformers compiles a template with jinja2 `trim_blocks` and `lstrip_blocks`, the
//! `loopcontrols` extension, Python string methods on values, its own `tojson` (Python
//! `json.dumps`), and the globals `raise_exception` and `strftime_now`; it passes `messages`,
//! `tools`, `documents`, `add_generation_prompt`, the special tokens and any extra keyword
//! (`enable_thinking`). minijinja's defaults differ on each of these, so each is set here, and
//! the parity tests against transformers are the judge (docs/loopback.md).

use std::path::Path;

use minijinja::value::{Kwargs, Serde, Value, ValueKind as Kind};
use minijinja::{Environment, ErrorKind};
use serde_json::{Map, Value as Json};

use super::pyjson::{dumps, DumpOptions};

/// Errors of loading or rendering a chat template.
#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    #[error("{path}: {message}")]
    Load { path: String, message: String },
    #[error("the chat template does not compile: {0}")]
    Compile(#[source] minijinja::Error),
    #[error("rendering the chat template failed: {0}")]
    Render(#[source] minijinja::Error),
}

/// A compiled chat template with the special tokens it may reference.
#[derive(Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    special_tokens: Map<String, Json>,
    /// Where the template came from, for messages (a file, or "the chat template").
    origin: String,
    /// Whether the source reads the `tools` variable at all.
    reads_tools: bool,
}

/// What a render call passes besides the messages.
#[derive(Debug, Clone, Default)]
pub struct RenderOptions {
    pub tools: Option<Json>,
    pub documents: Option<Json>,
    pub add_generation_prompt: bool,
    /// Extra template variables (`enable_thinking`, ...).
    pub extra: Map<String, Json>,
}

fn tojson(value: Value, kwargs: Kwargs) -> Result<Value, minijinja::Error> {
    let invalid = |message: String| minijinja::Error::new(ErrorKind::InvalidOperation, message);
    let json = serde_json::to_value(&value).map_err(|e| invalid(format!("tojson: {e}")))?;
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let _ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let separators = match kwargs.get::<Option<Vec<String>>>("separators")?.as_deref() {
        None => None,
        Some([item, key]) => Some((item.clone(), key.clone())),
        Some(_) => return Err(invalid("tojson: separators must be a pair".into())),
    };
    kwargs.assert_all_used()?;
    let opts = DumpOptions {
        indent,
        sort_keys: sort_keys.unwrap_or(false),
        separators,
    };
    Ok(Value::from(dumps(&json, &opts)))
}

fn raise_exception(message: String) -> Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
}

/// `strftime_now(format)`: the current UTC date and time, for the directives templates use.
fn strftime_now(format: String) -> String {
    strftime(chrono::Utc::now().timestamp(), &format)
}

/// Formats Unix seconds (UTC) as Python's `strftime` does; a format chrono cannot read is
/// returned as it is.
fn strftime(secs: i64, format: &str) -> String {
    use std::fmt::Write as _;
    let time = chrono::DateTime::from_timestamp(secs, 0).unwrap_or_default();
    let mut out = String::new();
    let written = write!(out, "{}", time.format(format));
    written.map_or_else(|_| format.to_string(), |()| out)
}

/// transformers fills `reasoning_content` (and `thinking`) from whichever reasoning field a
/// message carries, so templates reading any of the names see it.
fn alias_reasoning(messages: &Json) -> Json {
    let mut messages = messages.clone();
    let all = messages.as_array_mut().into_iter().flatten();
    for obj in all.filter_map(Json::as_object_mut) {
        let keys = ["reasoning_content", "thinking", "reasoning"];
        let set = |key: &&str| obj.get(*key).filter(|v| !v.is_null()).cloned();
        if let Some(r) = keys.iter().find_map(set) {
            if !obj.contains_key("thinking") {
                obj.shift_insert(0, "thinking".into(), r.clone());
            }
            obj.insert("reasoning_content".into(), r);
        }
    }
    messages
}

impl ChatTemplate {
    /// Compiles `source` with the special tokens it may reference (`bos_token`, ...).
    pub fn new(source: &str, special_tokens: Map<String, Json>) -> Result<Self, TemplateError> {
        let mut env = Environment::new();
        let mut syntax = env.syntax().to_builder();
        syntax.trim_blocks(true).lstrip_blocks(true);
        env.set_syntax(syntax.build().map_err(TemplateError::Compile)?);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson);
        // Python's notion: none is not iterable (minijinja iterates it as empty), and templates
        // guard `tools | length` with `tools is iterable`.
        env.add_test("iterable", |v: Value| {
            matches!(
                v.kind(),
                Kind::String | Kind::Seq | Kind::Map | Kind::Iterable | Kind::Bytes
            )
        });
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned("chat_template", source.to_string())
            .map_err(TemplateError::Compile)?;
        // A static look at the variables the template may read: one that never reads `tools`
        // renders a request's tools nowhere (Gemma 3's official template).
        let template = env.get_template("chat_template");
        let template = template.map_err(TemplateError::Compile)?;
        let reads_tools = template.undeclared_variables(false).contains("tools");
        Ok(Self {
            env,
            source: source.to_string(),
            special_tokens,
            origin: "the chat template".to_string(),
            reads_tools,
        })
    }

    /// The template of a model folder: `chat_template.jinja` if present (as transformers saves it
    /// today), else `chat_template` in `tokenizer_config.json` (a string, or a list of named
    /// templates of which `default` is taken); special tokens from `tokenizer_config.json`.
    pub fn from_model_dir(dir: &Path) -> Result<Self, TemplateError> {
        let config_path = dir.join("tokenizer_config.json");
        let load = |path: &Path, message: &str| TemplateError::Load {
            path: path.display().to_string(),
            message: message.to_string(),
        };
        let config: Map<String, Json> = match std::fs::read_to_string(&config_path) {
            Ok(text) => serde_json::from_str(&text)
                .map_err(|e| load(&config_path, &format!("not a JSON object: {e}")))?,
            Err(_) => Map::new(),
        };
        // A special token is a string or an `AddedToken` object.
        let token = |v: &Json| v.get("content").unwrap_or(v).as_str().map(Json::from);
        let names = ["bos_token", "eos_token", "pad_token", "unk_token"];
        let special = |k: &str| Some((k.to_string(), token(config.get(k)?)?));
        let special_tokens = names.into_iter().filter_map(special).collect();
        let file = dir.join("chat_template.jinja");
        let (source, origin) = match std::fs::read_to_string(&file) {
            Ok(text) => (text, file.display().to_string()),
            Err(_) => {
                let default = |t: &&Json| t["name"] == "default";
                let source = match config.get("chat_template") {
                    Some(s @ Json::String(_)) => Some(s),
                    Some(Json::Array(named)) => named.iter().find(default).map(|t| &t["template"]),
                    _ => return Err(load(dir, "has neither chat_template.jinja nor a chat_template in tokenizer_config.json")),
                };
                let message = "chat_template lists named templates but none is called `default`";
                let source = source.and_then(Json::as_str);
                let source = source.ok_or_else(|| load(&config_path, message))?;
                let origin = format!("the chat_template of {}", config_path.display());
                (source.to_string(), origin)
            }
        };
        let mut template = Self::new(&source, special_tokens)?;
        template.origin = origin;
        Ok(template)
    }

    /// The template's Jinja source.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Where the template was read from (its file), for messages.
    pub fn origin(&self) -> &str {
        &self.origin
    }

    /// Whether the template reads `tools` anywhere. One that does not (Gemma 3's official
    /// template) never shows a request's tools to the model.
    pub fn reads_tools(&self) -> bool {
        self.reads_tools
    }

    /// Renders `messages` (a JSON array of message objects, as transformers takes them).
    pub fn render(&self, messages: &Json, opts: &RenderOptions) -> Result<String, TemplateError> {
        let mut ctx = self.special_tokens.clone();
        ctx.extend(opts.extra.clone());
        ctx.insert("messages".into(), alias_reasoning(messages));
        let (tools, documents) = (opts.tools.clone(), opts.documents.clone());
        ctx.insert("tools".into(), tools.unwrap_or_default());
        ctx.insert("documents".into(), documents.unwrap_or_default());
        let generation_prompt = Json::Bool(opts.add_generation_prompt);
        ctx.insert("add_generation_prompt".into(), generation_prompt);
        let template = self.env.get_template("chat_template");
        let rendered = template.and_then(|t| t.render(Value::from(Serde(&ctx))));
        rendered.map_err(TemplateError::Render)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strftime_formats_known_dates() {
        // 2026-11-30 08:17:19 UTC was a Monday.
        let t = 1_796_026_639;
        assert_eq!(strftime(t, "%d %b %Y"), "30 Nov 2026");
        assert_eq!(
            strftime(t, "%A %B %d, %H:%M:%S %j %%"),
            "Monday November 30, 08:17:19 334 %"
        );
        assert_eq!(strftime(0, "%Y-%m-%d %a"), "1970-01-01 Thu");
        assert_eq!(strftime(951_782_400, "%Y-%m-%d %j"), "2000-02-29 060");
    }

    #[test]
    fn only_templates_that_read_tools_say_so() {
        let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures");
        for entry in std::fs::read_dir(&fixtures).unwrap() {
            let path = entry.unwrap().path();
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            if !name.ends_with(".jinja") {
                continue;
            }
            let source = std::fs::read_to_string(&path).unwrap();
            let template = ChatTemplate::new(&source, Map::new()).unwrap();
            // Every family's template renders tools except Gemma 3's official one, DeepSeek
            // V3.1's (which renders past tool calls but never the tool list) and Qwen2-VL's.
            let without = [
                "gemma3_it_chat_template.jinja",
                "deepseek_v3.1_chat_template.jinja",
                "qwen2_vl_chat_template.jinja",
            ];
            assert_eq!(
                template.reads_tools(),
                !without.contains(&name.as_str()),
                "{name}"
            );
        }
        let plain = ChatTemplate::new("{% set tools = 1 %}{{ tools }}", Map::new()).unwrap();
        assert!(!plain.reads_tools());
        let guarded = ChatTemplate::new(
            "{% if tools is not defined %}{% set tools = none %}{% endif %}{{ tools }}",
            Map::new(),
        )
        .unwrap();
        assert!(guarded.reads_tools());
    }
}
