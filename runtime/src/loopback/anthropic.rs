//! Anthropic messages onto the internal chat request, and the answer back in the shapes the
//! `anthropic` SDK reads: a `message` object, or the `message_start` … `message_stop` event
//! stream (as in `tests/fixtures/anthropic_sse/`).

use std::sync::Arc;

use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};

use serde::Deserialize;
use serde_json::{json, Map, Value as Json};

use super::error::LoopbackError;
use super::service::ChatService;
use super::turn::{Finish, TurnOutput};
use super::{async_stream, invalid, str_field};
use crate::chat::{
    check_sampling, ChatRequest, ChatSampling, Image, InvalidRequest, Message, Part, Role, Tool,
    ToolCall,
};

const PROTOCOL: &str = "anthropic";

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MessagesRequest {
    pub model: String,
    pub max_tokens: i64,
    pub messages: Vec<Json>,
    pub system: Option<Json>,
    pub tools: Option<Vec<ToolJson>>,
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
pub struct ToolJson {
    pub name: String,
    pub description: Option<String>,
    pub input_schema: Json,
    /// Accepted and ignored.
    #[serde(default, rename = "type")]
    pub _kind: Option<String>,
    #[serde(default, rename = "cache_control")]
    pub _cache_control: Option<Json>,
}

#[derive(Debug, Deserialize)]
pub struct ToolChoice {
    #[serde(rename = "type")]
    pub kind: String,
    pub name: Option<String>,
    pub disable_parallel_tool_use: Option<bool>,
}

/// The text of `system` or of a `tool_result`'s content: a string or text blocks.
fn blocks_text(value: &Json, param: &str) -> Result<String, InvalidRequest> {
    match value {
        Json::String(s) => Ok(s.clone()),
        Json::Array(blocks) => {
            let mut text = String::new();
            for (j, b) in blocks.iter().enumerate() {
                match (str_field(b, "type"), str_field(b, "text")) {
                    (Some("text"), Some(t)) => text.push_str(t),
                    (Some(other), _) if other != "text" => {
                        return Err(invalid(
                            format!("{param}[{j}].type"),
                            format!("blocks of type `{other}` are not supported here: only `text`"),
                        ))
                    }
                    _ => {
                        return Err(invalid(
                            format!("{param}[{j}]"),
                            "a text block needs `type: \"text\"` and a string `text`",
                        ))
                    }
                }
            }
            Ok(text)
        }
        _ => Err(invalid(
            param,
            "must be a string or an array of text blocks",
        )),
    }
}

/// One Anthropic message as internal messages: tool results become `tool` messages.
fn push_messages(value: &Json, i: usize, out: &mut Vec<Message>) -> Result<(), InvalidRequest> {
    let param = format!("messages[{i}]");
    let role = match str_field(value, "role") {
        Some("user") => Role::User,
        Some("assistant") => Role::Assistant,
        Some(other) => {
            return Err(invalid(format!("{param}.role"), format!("unknown role `{other}`: expected user or assistant (the system prompt goes in `system`)")))
        }
        None => return Err(invalid(format!("{param}.role"), "a message needs a string `role`")),
    };
    let content = value
        .get("content")
        .ok_or_else(|| invalid(format!("{param}.content"), "a message needs content"))?;
    let blocks = match content {
        Json::String(s) => {
            out.push(Message::text(role, s.clone()));
            return Ok(());
        }
        Json::Array(blocks) => blocks,
        _ => {
            return Err(invalid(
                format!("{param}.content"),
                "content must be a string or an array of content blocks",
            ))
        }
    };
    let mut text: Option<String> = None;
    // A user message's text and images in order.
    let mut parts = Vec::new();
    let mut tool_calls = Vec::new();
    let mut reasoning = None;
    for (j, b) in blocks.iter().enumerate() {
        let p = format!("{param}.content[{j}]");
        let kind =
            str_field(b, "type").ok_or_else(|| invalid(&p, "a content block needs a `type`"))?;
        match (kind, role) {
            ("text", _) => {
                let t = str_field(b, "text").ok_or_else(|| {
                    invalid(format!("{p}.text"), "a text block needs a string `text`")
                })?;
                text.get_or_insert_with(String::new).push_str(t);
                parts.push(Part::Text { text: t.into() });
            }
            ("image", Role::User) => parts.push(Part::Image {
                image: image_block(b, &p)?,
            }),
            ("tool_use", Role::Assistant) => {
                let id = str_field(b, "id")
                    .ok_or_else(|| invalid(format!("{p}.id"), "a tool_use block needs an `id`"))?;
                let name = str_field(b, "name").ok_or_else(|| {
                    invalid(format!("{p}.name"), "a tool_use block needs a `name`")
                })?;
                let input = b
                    .get("input")
                    .cloned()
                    .unwrap_or_else(|| Json::Object(Map::new()));
                if !input.is_object() {
                    return Err(invalid(
                        format!("{p}.input"),
                        "tool_use input must be an object",
                    ));
                }
                tool_calls.push(ToolCall {
                    id: id.into(),
                    name: name.into(),
                    arguments: input,
                });
            }
            ("thinking", Role::Assistant) => {
                reasoning = str_field(b, "thinking").map(str::to_string);
            }
            ("tool_result", Role::User) => {
                let id = str_field(b, "tool_use_id").ok_or_else(|| {
                    invalid(
                        format!("{p}.tool_use_id"),
                        "a tool_result block needs the `tool_use_id` it answers",
                    )
                })?;
                let content = match b.get("content") {
                    None | Some(Json::Null) => String::new(),
                    Some(c) => blocks_text(c, &format!("{p}.content"))?,
                };
                out.push(Message {
                    tool_call_id: Some(id.into()),
                    ..Message::text(Role::Tool, content)
                });
            }
            (other, _) => {
                return Err(invalid(
                    format!("{p}.type"),
                    format!(
                        "content blocks of type `{other}` are not supported in {} messages",
                        role.as_str()
                    ),
                ))
            }
        }
    }
    if role == Role::Assistant {
        out.push(Message {
            content: text,
            tool_calls,
            reasoning_content: reasoning,
            ..Message::text(role, "")
        });
    } else if !parts.is_empty() {
        out.push(Message::with_parts(role, parts));
    }
    Ok(())
}

/// An `image` block: `{"type": "image", "source": {"type": "base64", "media_type", "data"}}`.
fn image_block(block: &Json, param: &str) -> Result<Image, InvalidRequest> {
    let source = block
        .get("source")
        .ok_or_else(|| invalid(format!("{param}.source"), "an image block needs a `source`"))?;
    match str_field(source, "type") {
        Some("base64") => {}
        Some("url") => {
            return Err(invalid(
                format!("{param}.source.type"),
                "images by URL are not fetched: send the image inline as `source: {type: \"base64\", media_type, data}` (docs/vision.md)",
            ))
        }
        _ => {
            return Err(invalid(
                format!("{param}.source.type"),
                "an image source needs `type: \"base64\"`",
            ))
        }
    }
    let field = |name: &str| {
        source.get(name).and_then(Json::as_str).ok_or_else(|| {
            invalid(
                format!("{param}.source.{name}"),
                format!("a base64 image source needs a string `{name}`"),
            )
        })
    };
    let (media_type, data) = (field("media_type")?, field("data")?);
    Image::from_base64(media_type, data)
        .map_err(|e| invalid(format!("{param}.source"), e.to_string()))
}

impl MessagesRequest {
    pub fn into_chat(self) -> Result<ChatRequest, InvalidRequest> {
        if self.messages.is_empty() {
            return Err(invalid("messages", "messages must not be empty"));
        }
        if self.max_tokens < 1 {
            return Err(invalid(
                "max_tokens",
                format!("max_tokens must be at least 1, got {}", self.max_tokens),
            ));
        }
        let mut messages = Vec::new();
        if let Some(system) = &self.system {
            messages.push(Message::text(Role::System, blocks_text(system, "system")?));
        }
        for (i, m) in self.messages.iter().enumerate() {
            push_messages(m, i, &mut messages)?;
        }
        let tools = self
            .tools
            .unwrap_or_default()
            .into_iter()
            .map(|t| Tool {
                name: t.name,
                description: t.description,
                parameters: t.input_schema,
            })
            .collect();
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
            return Err(invalid(
                "stop_sequences",
                "stop sequences must not be empty strings",
            ));
        }
        let mut template_kwargs = Map::new();
        if let Some(thinking) = &self.thinking {
            let enabled = match str_field(thinking, "type") {
                Some("enabled") | Some("adaptive") => true,
                Some("disabled") => false,
                _ => {
                    return Err(invalid(
                        "thinking.type",
                        "thinking.type must be enabled, adaptive or disabled",
                    ))
                }
            };
            template_kwargs.insert("enable_thinking".into(), Json::Bool(enabled));
        }
        if self
            .output_config
            .as_ref()
            .is_some_and(|c| c.get("format").is_some_and(|f| !f.is_null()))
        {
            return Err(invalid("output_config.format", "structured output needs constrained decoding, which the loopback server does not do"));
        }
        Ok(ChatRequest {
            messages,
            tools,
            parse_tool_calls,
            sampling: ChatSampling {
                max_tokens: Some(self.max_tokens as usize),
                temperature: self.temperature,
                top_p: self.top_p,
                top_k: self.top_k,
                seed: None,
                stop,
                logprobs: None,
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

/// The `message` object.
pub fn message_json(service: &ChatService, id: &str, out: &TurnOutput) -> Json {
    let c = &out.choices[0];
    let mut content = Vec::new();
    if let Some(text) = c.content.as_deref().filter(|t| !t.is_empty()) {
        content.push(json!({"type": "text", "text": text}));
    }
    for call in &c.tool_calls {
        content.push(
            json!({"type": "tool_use", "id": call.id, "name": call.name, "input": call.arguments}),
        );
    }
    if content.is_empty() {
        content.push(json!({"type": "text", "text": ""}));
    }
    let (reason, sequence) = stop_reason(&c.finish);
    json!({
        "id": id,
        "type": "message",
        "role": "assistant",
        "model": service.model_name(),
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": {"input_tokens": out.prompt_tokens, "output_tokens": c.completion_tokens},
    })
}

/// An event of the stream: named by its `type`.
fn event(data: Json) -> SseEvent {
    let name = data["type"].as_str().unwrap_or_default().to_string();
    SseEvent::default().event(name).data(data.to_string())
}

/// `POST /s/{session}/v1/messages`.
pub async fn messages(
    service: Arc<ChatService>,
    session: String,
    req: MessagesRequest,
) -> Response {
    let stream = req.stream.unwrap_or(false);
    let chat = match req.into_chat() {
        Ok(c) => c,
        Err(e) => return LoopbackError::from(e).anthropic(),
    };
    let id = format!("msg_{}", super::random_id());
    if !stream {
        return match service.turn(&session, PROTOCOL, "toolu_", chat, None).await {
            Ok(out) => axum::Json(message_json(&service, &id, &out)).into_response(),
            Err(e) => e.anthropic(),
        };
    }
    let (mut rx, turn) = service.spawn_turn(session, PROTOCOL, "toolu_", chat);
    let frames = async_stream(move |out| async move {
        let send = |data: Json| out.send(event(data));
        let model = service.model_name().to_string();
        let start = json!({"type": "message_start", "message": {
            "id": id, "type": "message", "role": "assistant", "content": [], "model": model,
            "stop_reason": null, "stop_sequence": null, "usage": {"input_tokens": 0, "output_tokens": 0}}});
        if send(start).await.is_err() {
            return;
        }
        let mut text_open = false;
        while let Some(ev) = rx.recv().await {
            if !text_open {
                text_open = true;
                let start = json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}});
                if send(start).await.is_err() {
                    return;
                }
                let _ = send(json!({"type": "ping"})).await;
            }
            let delta = json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": ev.text}});
            if send(delta).await.is_err() {
                return;
            }
        }
        let result = match turn.await {
            Ok(r) => r,
            Err(join) => Err(LoopbackError::Engine(
                crate::engine::client::EngineError::Stream(join.to_string()),
            )),
        };
        let answer = match result {
            Ok(a) => a,
            Err(e) => {
                let kind = if e.status().is_client_error() {
                    "invalid_request_error"
                } else {
                    "api_error"
                };
                let _ = send(
                    json!({"type": "error", "error": {"type": kind, "message": e.to_string()}}),
                )
                .await;
                return;
            }
        };
        let c = &answer.choices[0];
        let mut index = 0;
        if text_open {
            let _ = send(json!({"type": "content_block_stop", "index": 0})).await;
            index = 1;
        }
        for call in &c.tool_calls {
            let _ = send(json!({"type": "content_block_start", "index": index,
                "content_block": {"type": "tool_use", "id": call.id, "name": call.name, "input": {}}}))
            .await;
            let _ = send(json!({"type": "content_block_delta", "index": index,
                "delta": {"type": "input_json_delta", "partial_json": call.arguments.to_string()}}))
            .await;
            let _ = send(json!({"type": "content_block_stop", "index": index})).await;
            index += 1;
        }
        let (reason, sequence) = stop_reason(&c.finish);
        let _ = send(json!({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": {"input_tokens": answer.prompt_tokens, "output_tokens": c.completion_tokens}}))
        .await;
        let _ = send(json!({"type": "message_stop"})).await;
    });
    Sse::new(frames).into_response()
}
