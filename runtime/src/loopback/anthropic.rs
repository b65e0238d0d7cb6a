//! Anthropic messages onto the internal chat request, and the answer back in the shapes the
//! `anthropic` SDK reads: a `message` object, or the `message_start` … `message_stop` event
//! stream (as in `tests/fixtures/anthropic_sse/`).

use axum::response::sse::Event as SseEvent;
use axum::response::{IntoResponse, Response};

use serde::Deserialize;
use serde_json::{json, Map, Value as Json};

use super::error::LoopbackError;
use super::service::ChatService;
use super::turn::{Finish, TurnEvent, TurnOutput, TurnResult};
use super::{bounded, invalid, random_id, At, Protocol};
use crate::chat::{
    check_sampling, ChatRequest, ChatSampling, Image, InvalidRequest, Message, Part, Role, Tool,
    ToolCall,
};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MessagesRequest {
    pub model: String,
    pub max_tokens: i64,
    pub messages: Vec<Json>,
    pub system: Option<Json>,
    pub tools: Option<Vec<Tool>>,
    pub tool_choice: Option<ToolChoice>,
    pub stop_sequences: Option<Vec<String>>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub stream: Option<bool>,
    /// `{"type": "enabled" | "adaptive" | "disabled"}`: the template's `enable_thinking`.
    pub thinking: Option<Json>,
    /// Only without `format` (structured output needs constrained decoding).
    pub output_config: Option<Json>,
    /// Accepted and ignored: bookkeeping and placement with no effect on generation.
    pub metadata: Option<Json>,
    pub service_tier: Option<Json>,
    pub cache_control: Option<Json>,
    pub container: Option<Json>,
    pub diagnostics: Option<Json>,
    pub inference_geo: Option<Json>,
    pub speed: Option<Json>,
    pub user_profile_id: Option<Json>,
    pub workspace_id: Option<Json>,
}

#[derive(Debug, Deserialize)]
pub struct ToolChoice {
    #[serde(rename = "type")]
    pub kind: String,
}

/// The text of `system` or of a `tool_result`'s content: a string or text blocks.
fn blocks_text(at: &At) -> Result<String, InvalidRequest> {
    match at.value {
        Some(Json::String(s)) => return Ok(s.clone()),
        Some(Json::Array(_)) => {}
        _ => return Err(at.refuse("must be a string or an array of text blocks")),
    }
    let mut text = String::new();
    for block in at.items() {
        let kind = block.key("type");
        match (kind.str(), block.key("text").str()) {
            (Some("text"), Some(t)) => text.push_str(t),
            (Some(other), _) if other != "text" => {
                let message =
                    format!("blocks of type `{other}` are not supported here: only `text`");
                return Err(kind.refuse(message));
            }
            _ => {
                let message = "a text block needs `type: \"text\"` and a string `text`";
                return Err(block.refuse(message));
            }
        }
    }
    Ok(text)
}

/// One Anthropic message as internal messages: tool results become `tool` messages.
fn push_messages(m: &At, out: &mut Vec<Message>) -> Result<(), InvalidRequest> {
    let at = m.key("role");
    let role = match at.str() {
        Some("user") => Role::User,
        Some("assistant") => Role::Assistant,
        Some(other) => {
            return Err(at.refuse(format!("unknown role `{other}`: expected user or assistant (the system prompt goes in `system`)")))
        }
        None => return Err(at.refuse("a message needs a string `role`")),
    };
    let content = m.key("content");
    match content.value {
        None => return Err(content.refuse("a message needs content")),
        Some(Json::String(s)) => {
            out.push(Message::text(role, s.clone()));
            return Ok(());
        }
        Some(Json::Array(_)) => {}
        Some(_) => {
            let message = "content must be a string or an array of content blocks";
            return Err(content.refuse(message));
        }
    }
    // An assistant message's text, calls and thinking; a user message's text and images in order.
    let mut assistant = Message::new(role);
    let mut parts = Vec::new();
    for b in content.items() {
        let kind = b.key("type");
        let untyped = || b.refuse("a content block needs a `type`");
        let name = kind.str().ok_or_else(untyped)?;
        match (name, role) {
            ("text", _) => {
                let t = b.string("text", "a text block needs a string `text`")?;
                assistant.content.get_or_insert_default().push_str(&t);
                parts.push(Part::Text { text: t });
            }
            ("image", Role::User) => parts.push(Part::Image {
                image: image_block(&b)?,
            }),
            ("tool_use", Role::Assistant) => {
                let id = b.string("id", "a tool_use block needs an `id`")?;
                let name = b.string("name", "a tool_use block needs a `name`")?;
                let input = b.key("input");
                let arguments = match input.value {
                    None => Json::Object(Map::new()),
                    Some(input @ Json::Object(_)) => input.clone(),
                    Some(_) => return Err(input.refuse("tool_use input must be an object")),
                };
                assistant.tool_calls.push(ToolCall {
                    id,
                    name,
                    arguments,
                });
            }
            ("thinking", Role::Assistant) => {
                assistant.reasoning_content = b.key("thinking").str().map(str::to_string);
            }
            ("tool_result", Role::User) => {
                let message = "a tool_result block needs the `tool_use_id` it answers";
                let id = b.string("tool_use_id", message)?;
                let content = match b.key("content") {
                    c if c.value.is_none_or(Json::is_null) => String::new(),
                    c => blocks_text(&c)?,
                };
                out.push(Message {
                    tool_call_id: Some(id),
                    ..Message::text(Role::Tool, content)
                });
            }
            (other, _) => {
                return Err(kind.refuse(format!(
                    "content blocks of type `{other}` are not supported in {} messages",
                    role.as_str()
                )))
            }
        }
    }
    if role == Role::Assistant {
        out.push(assistant);
    } else if !parts.is_empty() {
        out.push(Message::with_parts(role, parts));
    }
    Ok(())
}

/// An `image` block: `{"type": "image", "source": {"type": "base64", "media_type", "data"}}`.
fn image_block(block: &At) -> Result<Image, InvalidRequest> {
    let source = block.key("source");
    if source.value.is_none() {
        return Err(source.refuse("an image block needs a `source`"));
    }
    let kind = source.key("type");
    match kind.str() {
        Some("base64") => {}
        Some("url") => return Err(kind.refuse("images by URL are not fetched: send the image inline as `source: {type: \"base64\", media_type, data}` (docs/vision.md)")),
        _ => return Err(kind.refuse("an image source needs `type: \"base64\"`")),
    }
    let field = |name| {
        let message = format!("a base64 image source needs a string `{name}`");
        source.string(name, &message)
    };
    let (media_type, data) = (field("media_type")?, field("data")?);
    Image::from_base64(&media_type, &data).map_err(|e| source.refuse(e.to_string()))
}

impl MessagesRequest {
    pub fn into_chat(self) -> Result<ChatRequest, InvalidRequest> {
        if self.messages.is_empty() {
            return Err(invalid("messages", "messages must not be empty"));
        }
        let max_tokens = bounded("max_tokens", self.max_tokens, 1, None)?;
        let mut messages = Vec::new();
        if let Some(system) = &self.system {
            let system = blocks_text(&At::new(system, "system".into()))?;
            messages.push(Message::text(Role::System, system));
        }
        for (i, m) in self.messages.iter().enumerate() {
            push_messages(&At::new(m, format!("messages[{i}]")), &mut messages)?;
        }
        let parse_tool_calls = match self.tool_choice.as_ref().map(|c| c.kind.as_str()) {
            None | Some("auto") => true,
            Some("none") => false,
            Some("any") | Some("tool") => {
                return Err(invalid("tool_choice.type", "tool_choice `any` or `tool` needs constrained decoding, which the loopback server does not do: use `auto` (the default) or `none`"))
            }
            Some(other) => return Err(invalid("tool_choice.type", format!("unknown tool_choice type `{other}`: expected auto or none"))),
        };
        check_sampling(self.temperature, 1.0, self.top_p)?;
        let stop = self.stop_sequences.unwrap_or_default();
        if stop.iter().any(String::is_empty) {
            let message = "stop sequences must not be empty strings";
            return Err(invalid("stop_sequences", message));
        }
        let mut template_kwargs = Map::new();
        if let Some(thinking) = &self.thinking {
            let enabled = match thinking["type"].as_str() {
                Some("enabled") | Some("adaptive") => true,
                Some("disabled") => false,
                _ => {
                    let message = "thinking.type must be enabled, adaptive or disabled";
                    return Err(invalid("thinking.type", message));
                }
            };
            template_kwargs.insert("enable_thinking".into(), Json::Bool(enabled));
        }
        if !self.output_config.unwrap_or_default()["format"].is_null() {
            return Err(invalid("output_config.format", "structured output needs constrained decoding, which the loopback server does not do"));
        }
        Ok(ChatRequest {
            messages,
            tools: self.tools.unwrap_or_default(),
            parse_tool_calls,
            sampling: ChatSampling {
                max_tokens: Some(max_tokens),
                temperature: self.temperature,
                top_p: self.top_p,
                top_k: self.top_k,
                stop,
                ..ChatSampling::default()
            },
            n: 1,
            template_kwargs,
        })
    }
}

fn stop_reason(f: &Finish) -> (&'static str, Option<&str>) {
    match f {
        Finish::Stop => ("end_turn", None),
        Finish::Length => ("max_tokens", None),
        Finish::ToolCalls => ("tool_use", None),
        Finish::StopSequence(s) => ("stop_sequence", Some(s)),
    }
}

/// An Anthropic answer: a `message` object, or the `message_start` … `message_stop` events
/// (the text block opens with the first content; an error after the stream started is an
/// `error` event).
pub struct Answer {
    id: String,
    text_open: bool,
}

/// An event of the stream: named by its `type`.
fn event(data: Json) -> SseEvent {
    let name = data["type"].as_str().unwrap_or_default().to_string();
    SseEvent::default().event(name).data(data.to_string())
}

impl Protocol for Answer {
    type Request = MessagesRequest;
    const CALL_ID: &'static str = "toolu_";

    fn read(req: MessagesRequest) -> Result<(ChatRequest, bool, Self), InvalidRequest> {
        let (stream, id) = (req.stream.unwrap_or(false), format!("msg_{}", random_id()));
        let text_open = false;
        Ok((req.into_chat()?, stream, Self { id, text_open }))
    }

    /// `{"type": "error", "error": {type, message}}`.
    fn error(e: &LoopbackError) -> Response {
        let status = e.status();
        let kind = match status.as_u16() {
            400 => "invalid_request_error",
            404 => "not_found_error",
            413 => "request_too_large",
            429 => "rate_limit_error",
            503 | 529 => "overloaded_error",
            _ => "api_error",
        };
        let message = e.param().map_or(e.to_string(), |p| format!("{p}: {e}"));
        let body = json!({"type": "error", "error": {"type": kind, "message": message}});
        (status, axum::Json(body)).into_response()
    }

    fn answer(&self, service: &ChatService, out: &TurnOutput) -> Json {
        let c = &out.choices[0];
        let text = c.content.as_deref().filter(|t| !t.is_empty());
        let text = text.map(|text| json!({"type": "text", "text": text}));
        let call = |c: &ToolCall| json!({"type": "tool_use", "id": c.id, "name": c.name, "input": c.arguments});
        let calls = c.tool_calls.iter().map(call);
        let mut content: Vec<Json> = text.into_iter().chain(calls).collect();
        if content.is_empty() {
            content.push(json!({"type": "text", "text": ""}));
        }
        let (reason, sequence) = stop_reason(&c.finish);
        json!({"id": self.id, "type": "message", "role": "assistant", "model": service.model_name(),
               "content": content, "stop_reason": reason, "stop_sequence": sequence,
               "usage": {"input_tokens": out.prompt_tokens, "output_tokens": c.completion_tokens}})
    }

    fn open(&mut self, service: &ChatService) -> Vec<SseEvent> {
        vec![event(json!({"type": "message_start", "message": {
            "id": self.id, "type": "message", "role": "assistant", "content": [],
            "model": service.model_name(), "stop_reason": null, "stop_sequence": null,
            "usage": {"input_tokens": 0, "output_tokens": 0}}}))]
    }

    fn content(&mut self, _: &ChatService, ev: TurnEvent) -> Vec<SseEvent> {
        let mut frames = Vec::new();
        if !self.text_open {
            self.text_open = true;
            frames.push(event(json!({"type": "content_block_start", "index": 0,
                "content_block": {"type": "text", "text": ""}})));
            frames.push(event(json!({"type": "ping"})));
        }
        frames.push(event(json!({"type": "content_block_delta", "index": 0,
            "delta": {"type": "text_delta", "text": ev.text}})));
        frames
    }

    fn close(&mut self, _: &ChatService, out: TurnResult) -> Vec<SseEvent> {
        let answer = match out {
            Ok(a) => a,
            Err(e) => {
                let kind = if e.status().is_client_error() {
                    "invalid_request_error"
                } else {
                    "api_error"
                };
                let error = json!({"type": kind, "message": e.to_string()});
                return vec![event(json!({"type": "error", "error": error}))];
            }
        };
        let c = &answer.choices[0];
        let mut frames = Vec::new();
        if self.text_open {
            frames.push(event(json!({"type": "content_block_stop", "index": 0})));
        }
        for (index, call) in (usize::from(self.text_open)..).zip(&c.tool_calls) {
            frames.push(event(json!({"type": "content_block_start", "index": index,
                "content_block": {"type": "tool_use", "id": call.id, "name": call.name, "input": {}}})));
            frames.push(event(json!({"type": "content_block_delta", "index": index,
                "delta": {"type": "input_json_delta", "partial_json": call.arguments.to_string()}})));
            frames.push(event(json!({"type": "content_block_stop", "index": index})));
        }
        let (reason, sequence) = stop_reason(&c.finish);
        frames.push(event(json!({"type": "message_delta",
            "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": {"input_tokens": answer.prompt_tokens, "output_tokens": c.completion_tokens}})));
        frames.push(event(json!({"type": "message_stop"})));
        frames
    }
}
