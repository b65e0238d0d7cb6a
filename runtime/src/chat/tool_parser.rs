//! Tool calls in model output, parsed per model family.
//!
//! A parser splits a finished output into content and tool calls, and, while an output is still
//! streaming, says how much of it is certainly content (so a half-written `<tool_call>` tag is
//! never sent to the client as text). [`Hermes`] is the `<tool_call>{json}</tool_call>` form of
//! Qwen2.5, Qwen3 and Hermes models; [`Llama3Json`] the bare `{"name": ..., "parameters": ...}`
//! calls of Llama 3.x; [`MistralTools`] the `[TOOL_CALLS][{...}]` list of Mistral models;
//! [`Pythonic`] the `[f(a=1, b="x")]` list of Python calls that Llama 3.2 writes when prompted so
//! and vLLM's Gemma 3 tool template asks for. The
//! loopback decodes output with special tokens skipped, as vLLM does by default, so a marker that
//! is a special token of its tokenizer (Llama's `<|python_tag|>`, Mistral's `[TOOL_CALLS]`) may
//! or may not be in the text: both parsers take either.

use serde_json::{Map, Value as Json};

use super::messages::{arguments_object, ToolCall};

/// A finished output split into what the client sees.
#[derive(Debug, Clone, PartialEq)]
pub struct ParsedOutput {
    /// Text before the first tool call (`None` when empty).
    pub content: Option<String>,
    /// Calls with empty ids; the server assigns them.
    pub tool_calls: Vec<ToolCall>,
}

impl ParsedOutput {
    /// `tool_calls` after `content` (`None` when empty).
    fn new(content: &str, tool_calls: Vec<ToolCall>) -> Self {
        Self {
            content: (!content.is_empty()).then(|| content.to_string()),
            tool_calls,
        }
    }
}

/// The `calls` after `content` (trimmed at its end), or all of `text` as content when there are
/// none (output that only looks like calls).
fn calls_or_text(text: &str, content: &str, calls: Option<Vec<ToolCall>>) -> ParsedOutput {
    match calls {
        Some(calls) if !calls.is_empty() => ParsedOutput::new(content.trim_end(), calls),
        _ => NoTools.parse(text),
    }
}

/// A model family's tool-call syntax.
pub trait ToolCallParser: Send + Sync + std::fmt::Debug {
    /// Splits a complete output. Output that only looks like a call (invalid JSON, no name) stays
    /// content, as vLLM's parsers do.
    fn parse(&self, text: &str) -> ParsedOutput;

    /// The length in bytes of the prefix of a still-growing `text` that is certainly content.
    fn content_prefix_len(&self, text: &str) -> usize;
}

/// No tool syntax: everything is content.
#[derive(Debug, Default)]
pub struct NoTools;

impl ToolCallParser for NoTools {
    fn parse(&self, text: &str) -> ParsedOutput {
        ParsedOutput::new(text, Vec::new())
    }

    fn content_prefix_len(&self, text: &str) -> usize {
        text.len()
    }
}

/// `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, any number of them.
#[derive(Debug, Default)]
pub struct Hermes;

const START: &str = "<tool_call>";
const END: &str = "</tool_call>";

/// A call object `{"name", "arguments"}` (or `"parameters"`).
fn call_from_json(v: &Json) -> Option<ToolCall> {
    let name = v.get("name")?.as_str()?.to_string();
    // Some models write the arguments as a JSON string, as OpenAI clients send them.
    let arguments = v.get("arguments").or_else(|| v.get("parameters"));
    let arguments = arguments_object("arguments", arguments).ok()?;
    Some(ToolCall {
        id: String::new(),
        name,
        arguments,
    })
}

impl ToolCallParser for Hermes {
    fn parse(&self, text: &str) -> ParsedOutput {
        let Some(first) = text.find(START) else {
            return NoTools.parse(text);
        };
        let (mut calls, mut rest) = (Vec::new(), &text[first..]);
        while let Some((_, body)) = rest.split_once(START) {
            // Cut off by max_tokens: parse what is there.
            let (body, next) = body.split_once(END).unwrap_or((body, ""));
            let value = serde_json::from_str(body.trim()).ok();
            match value.and_then(|v| call_from_json(&v)) {
                Some(call) => calls.push(call),
                None => return NoTools.parse(text),
            }
            rest = next;
        }
        ParsedOutput::new(text[..first].trim_end(), calls)
    }

    fn content_prefix_len(&self, text: &str) -> usize {
        content_before(text, START)
    }
}

/// The content of a growing `text` whose calls start at `marker`: what comes before the marker,
/// or before a suffix that may be its start, and before the whitespace there (a finished
/// output's content ends trimmed before its first call).
fn content_before(text: &str, marker: &str) -> usize {
    let ends = |k: &usize| text.ends_with(&marker[..*k]);
    let partial = (1..marker.len()).rev().find(ends).unwrap_or(0);
    let end = text.find(marker).unwrap_or(text.len() - partial);
    text[..end].trim_end().len()
}

/// Llama 3.x: the whole output is one call or several separated by `;`, each
/// `{"name": ..., "parameters": {...}}` (or `"arguments"`), optionally after `<|python_tag|>`.
/// An output that does not start with `{` is content (vLLM's `llama3_json`).
#[derive(Debug, Default)]
pub struct Llama3Json;

const PYTHON_TAG: &str = "<|python_tag|>";

/// Consecutive JSON values of `text` separated by whitespace or `separator`; `None` if anything
/// else is in between or a value does not parse.
fn json_values(text: &str, separator: char) -> Option<Vec<Json>> {
    let mut values = Vec::new();
    let mut rest = text.trim();
    while !rest.is_empty() {
        let mut stream = serde_json::Deserializer::from_str(rest).into_iter::<Json>();
        values.push(stream.next()?.ok()?);
        rest = rest[stream.byte_offset()..].trim_start();
        rest = rest.strip_prefix(separator).unwrap_or(rest).trim_start();
    }
    Some(values)
}

impl ToolCallParser for Llama3Json {
    fn parse(&self, text: &str) -> ParsedOutput {
        let t = text.trim_start();
        let body = t.strip_prefix(PYTHON_TAG).unwrap_or(t).trim_start();
        if !body.starts_with('{') {
            return NoTools.parse(text);
        }
        let calls =
            json_values(body, ';').and_then(|values| values.iter().map(call_from_json).collect());
        calls_or_text(text, "", calls)
    }

    fn content_prefix_len(&self, text: &str) -> usize {
        // Only an output that starts as a call is one: hold back whitespace (a prefix of the tag),
        // the tag or a part of it, and anything after a leading `{`.
        let t = text.trim_start();
        let call = t.starts_with('{') || PYTHON_TAG.starts_with(t) || t.starts_with(PYTHON_TAG);
        if call {
            return 0;
        }
        text.len()
    }
}

/// Mistral: `[TOOL_CALLS]` then a JSON list of `{"name": ..., "arguments": {...}, "id": ...}`,
/// after any content. With the marker skipped (a special token), an output that starts with a
/// JSON list of calls is calls.
#[derive(Debug, Default)]
pub struct MistralTools;

const TOOL_CALLS: &str = "[TOOL_CALLS]";

impl ToolCallParser for MistralTools {
    fn parse(&self, text: &str) -> ParsedOutput {
        let (content, body) = match text.find(TOOL_CALLS) {
            Some(at) => (&text[..at], &text[at + TOOL_CALLS.len()..]),
            None if text.trim_start().starts_with('[') => ("", text),
            None => return NoTools.parse(text),
        };
        // One list of calls, or calls one by one.
        let calls = json_values(body, ',').and_then(|values| {
            let items = values.into_iter().flat_map(|v| match v {
                Json::Array(items) => items,
                item => vec![item],
            });
            items.map(|item| call_from_json(&item)).collect()
        });
        calls_or_text(text, content, calls)
    }

    fn content_prefix_len(&self, text: &str) -> usize {
        if text.trim_start().starts_with('[') {
            return 0;
        }
        content_before(text, TOOL_CALLS)
    }
}

/// Python calls: the whole output, from its first character, is a list `[f(a=1, b="x"), g()]`
/// of calls with keyword arguments whose values are Python literals (strings in either quotes,
/// numbers, `True`, `False`, `None`, lists and dicts of them), as vLLM's `pythonic` parser reads
/// it with Python's `ast`. Anything else (text around the list, an empty list, a positional
/// argument, a name such as `true`) is content. One difference: vLLM takes a negative number
/// (`-1`, a unary minus in Python's syntax tree) for a non-literal and the whole output for
/// content; here it is the number.
#[derive(Debug, Default)]
pub struct Pythonic;

impl ToolCallParser for Pythonic {
    fn parse(&self, text: &str) -> ParsedOutput {
        calls_or_text(text, "", python_calls(text))
    }

    fn content_prefix_len(&self, text: &str) -> usize {
        // Only an output that opens with `[` can be calls (vLLM streams anything else as it comes).
        let call = text.is_empty() || text.starts_with('[');
        if call {
            return 0;
        }
        text.len()
    }
}

/// The calls of `text` if all of it (but trailing whitespace) is a Python list of calls.
fn python_calls(text: &str) -> Option<Vec<ToolCall>> {
    if !text.starts_with('[') {
        return None;
    }
    let s = text.trim_end().as_bytes();
    let (mut p, mut calls) = (PyParser { s, at: 1 }, Vec::new());
    p.items(b']', |p| p.call().map(|c| calls.push(c)))?;
    (p.at == p.s.len()).then_some(calls)
}

/// A cursor over Python source that reads calls and literals.
struct PyParser<'a> {
    s: &'a [u8],
    at: usize,
}

impl PyParser<'_> {
    fn peek(&self) -> Option<u8> {
        self.s.get(self.at).copied()
    }

    fn skip_ws(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.at += 1;
        }
    }

    /// `c`, after any whitespace.
    fn eat(&mut self, c: u8) -> Option<()> {
        self.skip_ws();
        (self.peek() == Some(c)).then(|| self.at += 1)
    }

    fn ident(&mut self) -> Option<String> {
        let start = self.at;
        // A letter first, as vLLM's pattern for calls and keywords wants.
        if !self.peek()?.is_ascii_alphabetic() {
            return None;
        }
        while matches!(self.peek(), Some(c) if c.is_ascii_alphanumeric() || c == b'_') {
            self.at += 1;
        }
        Some(String::from_utf8_lossy(&self.s[start..self.at]).into_owned())
    }

    /// `name(key=value, ...)`.
    fn call(&mut self) -> Option<ToolCall> {
        let name = self.ident()?;
        self.eat(b'(')?;
        let mut arguments = Map::new();
        self.items(b')', |p| {
            let key = p.ident()?;
            p.eat(b'=')?;
            p.skip_ws();
            arguments.insert(key, p.value()?);
            Some(())
        })?;
        Some(ToolCall {
            id: String::new(),
            name,
            arguments: Json::Object(arguments),
        })
    }

    /// A Python literal as JSON.
    fn value(&mut self) -> Option<Json> {
        match self.peek()? {
            b'"' | b'\'' => self.string().map(Json::String),
            b'[' => {
                self.at += 1;
                let mut items = Vec::new();
                self.items(b']', |p| p.value().map(|v| items.push(v)))?;
                Some(Json::Array(items))
            }
            b'{' => {
                self.at += 1;
                let mut map = Map::new();
                self.items(b'}', |p| {
                    // Keys are literals; JSON (as `json.dumps`) writes them as strings.
                    let key = match p.value()? {
                        Json::String(k) => k,
                        k @ (Json::Number(_) | Json::Bool(_) | Json::Null) => k.to_string(),
                        _ => return None,
                    };
                    p.eat(b':')?;
                    p.skip_ws();
                    map.insert(key, p.value()?);
                    Some(())
                })?;
                Some(Json::Object(map))
            }
            b'-' | b'+' | b'.' | b'0'..=b'9' => self.number(),
            _ => match self.ident()?.as_str() {
                "True" => Some(Json::Bool(true)),
                "False" => Some(Json::Bool(false)),
                "None" => Some(Json::Null),
                // A name (`true`, a variable) is not a literal.
                _ => None,
            },
        }
    }

    /// Comma-separated items up to `close` (a trailing comma allowed), each read by `item`.
    fn items(&mut self, close: u8, mut item: impl FnMut(&mut Self) -> Option<()>) -> Option<()> {
        loop {
            if self.eat(close).is_some() {
                return Some(());
            }
            item(self)?;
            if self.eat(b',').is_none() {
                return self.eat(close);
            }
        }
    }

    fn number(&mut self) -> Option<Json> {
        let start = self.at;
        while matches!(self.peek(), Some(c) if c.is_ascii_digit() || b"+-.eE_".contains(&c)) {
            self.at += 1;
        }
        let text = std::str::from_utf8(&self.s[start..self.at]).ok()?;
        let text = text.replace('_', "");
        let text = text.strip_prefix('+').unwrap_or(&text);
        if let Ok(i) = text.parse::<i64>() {
            return Some(Json::from(i));
        }
        serde_json::Number::from_f64(text.parse().ok()?).map(Json::Number)
    }

    /// A single- or double-quoted string with Python's escapes.
    fn string(&mut self) -> Option<String> {
        let quote = self.peek()?;
        self.at += 1;
        let mut out = Vec::new();
        loop {
            let c = self.peek()?;
            self.at += 1;
            match c {
                c if c == quote => break,
                b'\n' => return None,
                b'\\' => {
                    let e = self.peek()?;
                    self.at += 1;
                    let digits = match e {
                        b'x' => 2,
                        b'u' => 4,
                        b'U' => 8,
                        b'\n' => continue,
                        _ => {
                            out.extend(match e {
                                b'n' => &b"\n"[..],
                                b't' => b"\t",
                                b'r' => b"\r",
                                b'0' => b"\0",
                                b'\\' | b'\'' | b'"' => &self.s[self.at - 1..self.at],
                                // Python keeps an unknown escape as it is.
                                _ => &self.s[self.at - 2..self.at],
                            });
                            continue;
                        }
                    };
                    let hex = std::str::from_utf8(self.s.get(self.at..self.at + digits)?).ok()?;
                    let ch = char::from_u32(u32::from_str_radix(hex, 16).ok()?)?;
                    self.at += digits;
                    out.extend(ch.encode_utf8(&mut [0; 4]).as_bytes());
                }
                c => out.push(c),
            }
        }
        String::from_utf8(out).ok()
    }
}

/// The parser for a chat template, by the tool syntax it renders: Hermes for `<tool_call>`,
/// Mistral for `[TOOL_CALLS]`, Python calls when it asks for
/// `[func_name1(params_name1=params_value1, ...)]` (vLLM's pythonic templates), Llama 3's JSON
/// when it asks for `{"name": ..., "parameters": ...}`, else none.
pub fn parser_for_template(source: &str) -> Box<dyn ToolCallParser> {
    if source.contains(START) {
        Box::new(Hermes)
    } else if source.contains(TOOL_CALLS) {
        Box::new(MistralTools)
    } else if source.contains("[func_name1(") {
        Box::new(Pythonic)
    } else if source.contains(PYTHON_TAG) || source.contains("\"parameters\": dictionary") {
        Box::new(Llama3Json)
    } else {
        Box::new(NoTools)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn hermes_splits_content_and_calls() {
        let out = Hermes.parse(
            "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>",
        );
        assert_eq!(out.content.as_deref(), Some("Let me check."));
        assert_eq!(
            out.tool_calls,
            vec![
                ToolCall {
                    id: String::new(),
                    name: "get_weather".into(),
                    arguments: json!({"city": "Paris"})
                },
                ToolCall {
                    id: String::new(),
                    name: "now".into(),
                    arguments: json!({})
                }
            ]
        );
    }

    #[test]
    fn hermes_keeps_invalid_calls_as_content() {
        let text = "<tool_call>\n{\"name\": oops}\n</tool_call>";
        let out = Hermes.parse(text);
        assert_eq!(out.content.as_deref(), Some(text));
        assert!(out.tool_calls.is_empty());
        assert_eq!(Hermes.parse("").content, None);
    }

    #[test]
    fn hermes_parses_a_call_cut_off_before_its_end_tag() {
        let out = Hermes.parse("<tool_call>\n{\"name\": \"f\", \"arguments\": \"{\\\"a\\\": 1}\"}");
        assert_eq!(out.tool_calls[0].arguments, json!({"a": 1}));
    }

    #[test]
    fn llama3_calls_are_the_whole_output_as_json() {
        let out = Llama3Json.parse(
            "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}; {\"name\": \"now\", \"parameters\": {}}",
        );
        assert_eq!(out.content, None);
        assert_eq!(
            out.tool_calls,
            vec![
                ToolCall {
                    id: String::new(),
                    name: "get_weather".into(),
                    arguments: json!({"city": "Paris"})
                },
                ToolCall {
                    id: String::new(),
                    name: "now".into(),
                    arguments: json!({})
                }
            ]
        );
        // With the python tag kept, and `arguments` as some fine-tunes write it.
        let out = Llama3Json.parse("<|python_tag|>{\"name\": \"f\", \"arguments\": {\"a\": 1}}");
        assert_eq!(out.tool_calls[0].arguments, json!({"a": 1}));
        // Prose, prose that mentions JSON, and JSON that is not a call stay content.
        for text in [
            "The weather is fine.",
            "Use {\"name\": \"f\"} like this.",
            "{\"answer\": 42}",
            "{\"name\": \"f\", \"parameters\": {}} and then",
        ] {
            let out = Llama3Json.parse(text);
            assert_eq!(out.content.as_deref(), Some(text));
            assert!(out.tool_calls.is_empty(), "{text}");
        }
        assert_eq!(Llama3Json.content_prefix_len("  {\"name\""), 0);
        assert_eq!(Llama3Json.content_prefix_len("<|python"), 0);
        assert_eq!(Llama3Json.content_prefix_len("Sure"), 4);
    }

    #[test]
    fn mistral_calls_follow_the_marker_or_open_the_output() {
        let calls = "[{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}, \"id\": \"a1b2c3d4e\"}, {\"name\": \"now\", \"arguments\": \"{}\"}]";
        for (text, content) in [
            (format!("[TOOL_CALLS]{calls}"), None),
            (format!("Checking. [TOOL_CALLS]{calls}"), Some("Checking.")),
            // The marker is a special token: skipped in decoding.
            (calls.to_string(), None),
        ] {
            let out = MistralTools.parse(&text);
            assert_eq!(out.content.as_deref(), content, "{text}");
            assert_eq!(out.tool_calls.len(), 2, "{text}");
            assert_eq!(out.tool_calls[0].arguments, json!({"city": "Paris"}));
            assert_eq!(out.tool_calls[1].name, "now");
        }
        for text in ["No calls here.", "[1, 2, 3]", "[TOOL_CALLS]not json"] {
            let out = MistralTools.parse(text);
            assert_eq!(out.content.as_deref(), Some(text));
            assert!(out.tool_calls.is_empty());
        }
        assert_eq!(MistralTools.content_prefix_len("Checking. [TOOL_"), 9);
        assert_eq!(MistralTools.content_prefix_len("[{\"na"), 0);
    }

    #[test]
    fn pythonic_calls_are_a_python_list_of_calls() {
        let out = Pythonic.parse(
            "[get_weather(city='Paris', days=3, hourly=True), now(), find(q=\"a \\\"b\\\"\\n\\u00e9\", \
             tags=['x', 2.5, None, -1], opts={'k': [1, {\"n\": False}], 3: 'three'},)]\n",
        );
        assert_eq!(out.content, None);
        assert_eq!(
            out.tool_calls,
            vec![
                ToolCall {
                    id: String::new(),
                    name: "get_weather".into(),
                    arguments: json!({"city": "Paris", "days": 3, "hourly": true})
                },
                ToolCall {
                    id: String::new(),
                    name: "now".into(),
                    arguments: json!({})
                },
                ToolCall {
                    id: String::new(),
                    name: "find".into(),
                    arguments: json!({
                        "q": "a \"b\"\né",
                        "tags": ["x", 2.5, null, -1],
                        "opts": {"k": [1, {"n": false}], "3": "three"}
                    })
                }
            ]
        );
        // Not calls: prose, text around the list, an empty list, positional arguments, names,
        // a list of non-calls, a call cut off.
        for text in [
            "The weather is fine.",
            "Sure: [f(a=1)]",
            " [f(a=1)]",
            "[f(a=1)] done",
            "[]",
            "[f(1)]",
            "[f(a=true)]",
            "[1, 2]",
            "[f(a=1)",
            "[f(a='x)]",
            "[obj.f(a=1)]",
        ] {
            let out = Pythonic.parse(text);
            assert_eq!(out.content.as_deref(), Some(text), "{text}");
            assert!(out.tool_calls.is_empty(), "{text}");
        }
        assert_eq!(Pythonic.content_prefix_len(""), 0);
        assert_eq!(Pythonic.content_prefix_len("[get_wea"), 0);
        assert_eq!(Pythonic.content_prefix_len("Sure [f("), 8);
    }

    #[test]
    fn each_familys_template_gets_its_parser() {
        let fixture = |name: &str| {
            std::fs::read_to_string(
                std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                    .join("../tests/fixtures")
                    .join(name),
            )
            .unwrap()
        };
        for (template, parser) in [
            ("qwen3_chat_template.jinja", "Hermes"),
            ("qwen2.5_7b_instruct_chat_template.jinja", "Hermes"),
            ("llama3.1_8b_instruct_chat_template.jinja", "Llama3Json"),
            ("llama3.2_3b_instruct_chat_template.jinja", "Llama3Json"),
            (
                "mistral_nemo_instruct_2407_chat_template.jinja",
                "MistralTools",
            ),
        ] {
            let chosen = format!("{:?}", parser_for_template(&fixture(template)));
            assert_eq!(chosen, parser, "{template}");
        }
    }

    #[test]
    fn streaming_holds_back_a_partial_tag() {
        assert_eq!(Hermes.content_prefix_len("hello <tool"), 5);
        assert_eq!(Hermes.content_prefix_len("hello <tool_call>{"), 5);
        assert_eq!(Hermes.content_prefix_len("hello\n"), 5);
        assert_eq!(Hermes.content_prefix_len("hello <b>"), 9);
        assert_eq!(Hermes.content_prefix_len("a<"), 1);
    }
}
