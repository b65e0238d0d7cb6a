//! Tool calls in model output, parsed per model family.
//!
//! A parser splits a finished output into content and tool calls, and, while an output is still
//! streaming, says how much of it is certainly content (so a half-written `<tool_call>` tag is
//! never sent to the client as text). [`Hermes`] is the `<tool_call>{json}</tool_call>` form of
//! Qwen2.5, Qwen3 and Hermes models; other families implement [`ToolCallParser`].

use serde_json::{Map, Value as Json};

use super::messages::ToolCall;

/// A finished output split into what the client sees.
#[derive(Debug, Clone, PartialEq)]
pub struct ParsedOutput {
    /// Text before the first tool call (`None` when empty).
    pub content: Option<String>,
    /// Calls without ids; the server assigns them.
    pub tool_calls: Vec<ParsedCall>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct ParsedCall {
    pub name: String,
    pub arguments: Json,
}

impl ParsedCall {
    pub fn with_id(self, id: String) -> ToolCall {
        ToolCall {
            id,
            name: self.name,
            arguments: self.arguments,
        }
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
        ParsedOutput {
            content: (!text.is_empty()).then(|| text.to_string()),
            tool_calls: Vec::new(),
        }
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

fn call_from_json(body: &str) -> Option<ParsedCall> {
    let v: Json = serde_json::from_str(body.trim()).ok()?;
    let name = v.get("name")?.as_str()?.to_string();
    let arguments = match v.get("arguments").or_else(|| v.get("parameters")) {
        None | Some(Json::Null) => Json::Object(Map::new()),
        Some(a @ Json::Object(_)) => a.clone(),
        // Some models write the arguments as a JSON string.
        Some(Json::String(s)) => match serde_json::from_str::<Json>(s) {
            Ok(a @ Json::Object(_)) => a,
            _ => return None,
        },
        Some(_) => return None,
    };
    Some(ParsedCall { name, arguments })
}

impl ToolCallParser for Hermes {
    fn parse(&self, text: &str) -> ParsedOutput {
        let Some(first) = text.find(START) else {
            return NoTools.parse(text);
        };
        let mut calls = Vec::new();
        let mut rest = &text[first..];
        while let Some(start) = rest.find(START) {
            let body_start = &rest[start + START.len()..];
            let (body, next) = match body_start.find(END) {
                Some(end) => (&body_start[..end], &body_start[end + END.len()..]),
                // Cut off by max_tokens: parse what is there.
                None => (body_start, ""),
            };
            match call_from_json(body) {
                Some(call) => calls.push(call),
                None => return NoTools.parse(text),
            }
            rest = next;
        }
        let content = text[..first].trim_end();
        ParsedOutput {
            content: (!content.is_empty()).then(|| content.to_string()),
            tool_calls: calls,
        }
    }

    fn content_prefix_len(&self, text: &str) -> usize {
        // Hold back a suffix that may be the start of a tag, and the whitespace before it (a
        // finished output's content ends trimmed before its first call).
        let end = text.find(START).unwrap_or_else(|| {
            (1..START.len())
                .rev()
                .find(|&k| text.ends_with(&START[..k]))
                .map_or(text.len(), |k| text.len() - k)
        });
        text[..end].trim_end().len()
    }
}

/// The parser for a chat template: Hermes when the template speaks `<tool_call>`, else none.
pub fn parser_for_template(source: &str) -> Box<dyn ToolCallParser> {
    if source.contains(START) {
        Box::new(Hermes)
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
                ParsedCall {
                    name: "get_weather".into(),
                    arguments: json!({"city": "Paris"})
                },
                ParsedCall {
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
    fn streaming_holds_back_a_partial_tag() {
        assert_eq!(Hermes.content_prefix_len("hello <tool"), 5);
        assert_eq!(Hermes.content_prefix_len("hello <tool_call>{"), 5);
        assert_eq!(Hermes.content_prefix_len("hello\n"), 5);
        assert_eq!(Hermes.content_prefix_len("hello <b>"), 9);
        assert_eq!(Hermes.content_prefix_len("a<"), 1);
    }
}
