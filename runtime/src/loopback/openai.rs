//! OpenAI chat completions onto the internal chat request, and the answer back in the shapes the
//! `openai` SDK reads: `chat.completion`, and `chat.completion.chunk` SSE frames ending in
//! `data: [DONE]`.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};

use serde::Deserialize;
use serde_json::{json, Map, Value as Json};

use super::error::LoopbackError;
use super::service::ChatService;
use super::turn::{ChoiceOutput, Finish, TurnOutput};
use super::{async_stream, invalid, str_field};
use crate::chat::{
    arguments_object, check_sampling, ChatRequest, ChatSampling, Image, InvalidRequest, Message,
    Part, Role, Tool, ToolCall,
};

const PROTOCOL: &str = "openai";
const MAX_N: i64 = 16;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CompletionRequest {
    pub model: Option<String>,
    pub messages: Vec<Json>,
    pub tools: Option<Vec<ToolJson>>,
    pub tool_choice: Option<Json>,
    pub parallel_tool_calls: Option<bool>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub max_tokens: Option<i64>,
    pub max_completion_tokens: Option<i64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    /// vLLM's extension.
    pub top_k: Option<i64>,
    pub n: Option<i64>,
    pub stop: Option<Json>,
    pub seed: Option<i64>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<i64>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    /// vLLM's extension: extra chat-template variables (`enable_thinking`).
    pub chat_template_kwargs: Option<Map<String, Json>>,
    /// Accepted and ignored: bookkeeping fields with no effect on generation.
    pub user: Option<Json>,
    pub metadata: Option<Json>,
    pub store: Option<bool>,
}

#[derive(Debug, Deserialize)]
pub struct StreamOptions {
    pub include_usage: Option<bool>,
}

#[derive(Debug, Deserialize)]
pub struct ToolJson {
    #[serde(rename = "type")]
    pub kind: String,
    pub function: FunctionJson,
}

#[derive(Debug, Deserialize)]
pub struct FunctionJson {
    pub name: String,
    pub description: Option<String>,
    pub parameters: Option<Json>,
}

/// A `content` field: a string, null, or an array of `{"type": "text", "text"}` parts and, where
/// `images` allows them, `{"type": "image_url", "image_url": {"url": "data:..."}}` parts. Returns
/// the text (the text parts joined) and, when there was an image, every part in order.
fn content_parts(
    value: &Json,
    param: &str,
    images: bool,
) -> Result<(Option<String>, Vec<Part>), InvalidRequest> {
    match value {
        Json::Null => Ok((None, Vec::new())),
        Json::String(s) => Ok((Some(s.clone()), Vec::new())),
        Json::Array(items) => {
            let mut parts = Vec::with_capacity(items.len());
            for (j, part) in items.iter().enumerate() {
                let kind = str_field(part, "type");
                match kind {
                    Some("text") => {
                        let text = str_field(part, "text").ok_or_else(|| {
                            invalid(
                                format!("{param}[{j}].text"),
                                "a text part needs a string `text`",
                            )
                        })?;
                        parts.push(Part::Text { text: text.into() });
                    }
                    Some("image_url") if images => {
                        let p = format!("{param}[{j}].image_url");
                        let url = match part.get("image_url") {
                            Some(Json::String(url)) => url.as_str(),
                            Some(obj) => str_field(obj, "url").ok_or_else(|| {
                                invalid(format!("{p}.url"), "an image_url part needs a string `url`")
                            })?,
                            None => {
                                return Err(invalid(&p, "an image_url part needs `image_url: {url}`"))
                            }
                        };
                        let image = Image::from_data_url(url)
                            .map_err(|e| invalid(format!("{p}.url"), e.to_string()))?;
                        parts.push(Part::Image { image });
                    }
                    Some("image_url") => {
                        return Err(invalid(
                            format!("{param}[{j}].type"),
                            "images are accepted in user messages only",
                        ))
                    }
                    Some(other) => {
                        return Err(invalid(
                            format!("{param}[{j}].type"),
                            format!(
                                "content parts of type `{other}` are not supported: only `text` and `image_url`"
                            ),
                        ))
                    }
                    None => {
                        return Err(invalid(
                            format!("{param}[{j}]"),
                            "a content part needs a `type` (`text` or `image_url`)",
                        ))
                    }
                }
            }
            let message = Message::with_parts(Role::User, parts);
            Ok((message.content, message.parts))
        }
        _ => Err(invalid(
            param,
            "content must be a string, an array of content parts, or null",
        )),
    }
}

fn message(value: &Json, i: usize) -> Result<Message, InvalidRequest> {
    let param = format!("messages[{i}]");
    if !value.is_object() {
        return Err(invalid(&param, "each message must be an object"));
    }
    let role = match str_field(value, "role") {
        Some("system") | Some("developer") => Role::System,
        Some("user") => Role::User,
        Some("assistant") => Role::Assistant,
        Some("tool") => Role::Tool,
        Some(other) => {
            return Err(invalid(
                format!("{param}.role"),
                format!(
                    "unknown role `{other}`: expected system, developer, user, assistant or tool"
                ),
            ))
        }
        None => {
            return Err(invalid(
                format!("{param}.role"),
                "a message needs a string `role`",
            ))
        }
    };
    let (content, parts) = content_parts(
        value.get("content").unwrap_or(&Json::Null),
        &format!("{param}.content"),
        role == Role::User,
    )?;
    let mut tool_calls = Vec::new();
    if let Some(calls) = value.get("tool_calls").filter(|v| !v.is_null()) {
        if role != Role::Assistant {
            return Err(invalid(
                format!("{param}.tool_calls"),
                "only assistant messages carry tool_calls",
            ));
        }
        let calls = calls
            .as_array()
            .ok_or_else(|| invalid(format!("{param}.tool_calls"), "tool_calls must be an array"))?;
        for (j, call) in calls.iter().enumerate() {
            let p = format!("{param}.tool_calls[{j}]");
            let function = call
                .get("function")
                .ok_or_else(|| invalid(&p, "a tool call needs a `function`"))?;
            let name = str_field(function, "name").ok_or_else(|| {
                invalid(
                    format!("{p}.function.name"),
                    "a tool call needs a string name",
                )
            })?;
            let arguments = match function.get("arguments") {
                None | Some(Json::Null) => Json::Object(Map::new()),
                Some(Json::String(s)) => arguments_object(&format!("{p}.function.arguments"), s)?,
                Some(v @ Json::Object(_)) => v.clone(),
                Some(_) => {
                    return Err(invalid(
                        format!("{p}.function.arguments"),
                        "arguments must be a JSON string (or object)",
                    ))
                }
            };
            tool_calls.push(ToolCall {
                id: str_field(call, "id").unwrap_or_default().to_string(),
                name: name.to_string(),
                arguments,
            });
        }
    }
    if content.is_none() && tool_calls.is_empty() && role != Role::Assistant {
        return Err(invalid(
            format!("{param}.content"),
            format!("a {} message needs content", role.as_str()),
        ));
    }
    let tool_call_id = str_field(value, "tool_call_id").map(str::to_string);
    if role == Role::Tool && tool_call_id.is_none() {
        return Err(invalid(
            format!("{param}.tool_call_id"),
            "a tool message needs the tool_call_id it answers",
        ));
    }
    Ok(Message {
        role,
        content,
        parts,
        tool_calls,
        tool_call_id,
        name: str_field(value, "name").map(str::to_string),
        reasoning_content: str_field(value, "reasoning_content").map(str::to_string),
    })
}

fn positive(param: &str, value: Option<i64>) -> Result<Option<usize>, InvalidRequest> {
    match value {
        None => Ok(None),
        Some(v) if v >= 1 => Ok(Some(v as usize)),
        Some(v) => Err(invalid(
            param,
            format!("{param} must be at least 1, got {v}"),
        )),
    }
}

impl CompletionRequest {
    /// Whether the answer streams, and whether the stream ends with a usage chunk.
    pub fn streaming(&self) -> (bool, bool) {
        let stream = self.stream.unwrap_or(false);
        let usage = self
            .stream_options
            .as_ref()
            .and_then(|o| o.include_usage)
            .unwrap_or(false);
        (stream, usage)
    }

    pub fn into_chat(self) -> Result<ChatRequest, InvalidRequest> {
        if self.messages.is_empty() {
            return Err(invalid("messages", "messages must not be empty"));
        }
        let messages = self
            .messages
            .iter()
            .enumerate()
            .map(|(i, m)| message(m, i))
            .collect::<Result<Vec<_>, _>>()?;
        let mut tools = Vec::new();
        for (i, t) in self.tools.unwrap_or_default().into_iter().enumerate() {
            if t.kind != "function" {
                return Err(invalid(
                    format!("tools[{i}].type"),
                    format!("tool type `{}` is not supported: only `function`", t.kind),
                ));
            }
            tools.push(Tool {
                name: t.function.name,
                description: t.function.description,
                parameters: t
                    .function
                    .parameters
                    .unwrap_or_else(|| json!({"type": "object", "properties": {}})),
            });
        }
        let parse_tool_calls = match &self.tool_choice {
            None => true,
            Some(Json::String(s)) if s == "auto" => true,
            Some(Json::String(s)) if s == "none" => false,
            Some(Json::String(s)) if s == "required" => {
                return Err(invalid("tool_choice", "tool_choice `required` needs constrained decoding, which the loopback server does not do: use `auto` (the default) or `none`"))
            }
            Some(Json::Object(_)) => {
                return Err(invalid("tool_choice", "a named tool_choice needs constrained decoding, which the loopback server does not do: use `auto` (the default) or `none`"))
            }
            Some(_) => return Err(invalid("tool_choice", "tool_choice must be `auto` or `none`")),
        };
        for (name, v) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if v.is_some_and(|v| v != 0.0) {
                return Err(invalid(name, format!("{name} is not supported (it would change the sampling distribution the trainer corrects for): leave it at 0")));
            }
        }
        let stop = match self.stop {
            None | Some(Json::Null) => Vec::new(),
            Some(Json::String(s)) => vec![s],
            Some(Json::Array(items)) => items
                .into_iter()
                .map(|v| match v {
                    Json::String(s) if !s.is_empty() => Ok(s),
                    _ => Err(invalid(
                        "stop",
                        "stop must be a non-empty string or an array of them",
                    )),
                })
                .collect::<Result<_, _>>()?,
            Some(_) => {
                return Err(invalid(
                    "stop",
                    "stop must be a string or an array of strings",
                ))
            }
        };
        if stop.len() > 4 {
            return Err(invalid("stop", "at most 4 stop sequences"));
        }
        let n = match self.n {
            None => 1,
            Some(n) if (1..=MAX_N).contains(&n) => n as usize,
            Some(n) => {
                return Err(invalid(
                    "n",
                    format!("n must be between 1 and {MAX_N}, got {n}"),
                ))
            }
        };
        let top_logprobs = match (self.logprobs.unwrap_or(false), self.top_logprobs) {
            (false, None) => None,
            (false, Some(_)) => {
                return Err(invalid("top_logprobs", "top_logprobs needs logprobs: true"))
            }
            (true, None) => Some(0),
            (true, Some(k)) if (0..=20).contains(&k) => Some(k as usize),
            (true, Some(k)) => {
                return Err(invalid(
                    "top_logprobs",
                    format!("top_logprobs must be between 0 and 20, got {k}"),
                ))
            }
        };
        let max_tokens = positive("max_completion_tokens", self.max_completion_tokens)?
            .or(positive("max_tokens", self.max_tokens)?);
        check_sampling(self.temperature, 2.0, self.top_p)?;
        Ok(ChatRequest {
            messages,
            tools,
            parse_tool_calls,
            sampling: ChatSampling {
                max_tokens,
                temperature: self.temperature,
                top_p: self.top_p,
                top_k: self.top_k,
                seed: self.seed.map(|s| s as u64),
                stop,
                logprobs: top_logprobs,
            },
            n,
            template_kwargs: self.chat_template_kwargs.unwrap_or_default(),
        })
    }
}

fn finish_reason(f: &Finish) -> &'static str {
    match f {
        Finish::Stop | Finish::StopSequence(_) => "stop",
        Finish::Length => "length",
        Finish::ToolCalls => "tool_calls",
    }
}

fn tool_calls_json(calls: &[ToolCall], streaming: bool) -> Json {
    Json::Array(
        calls
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let mut v = json!({
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments.to_string()},
                });
                if streaming {
                    v["index"] = json!(i);
                }
                v
            })
            .collect(),
    )
}

fn logprobs_json(service: &ChatService, choice: &ChoiceOutput) -> Json {
    let token = |id: i64| service.tokenizer().decode(&[id], false).unwrap_or_default();
    let content: Vec<Json> = choice
        .tokens
        .iter()
        .map(|t| {
            let text = token(t.id);
            json!({
                "token": text,
                "logprob": t.logprob,
                "bytes": text.as_bytes(),
                "top_logprobs": t.top.iter().map(|&(id, lp)| {
                    let text = token(id);
                    json!({"token": text, "logprob": lp, "bytes": text.as_bytes()})
                }).collect::<Vec<_>>(),
            })
        })
        .collect();
    json!({ "content": content })
}

fn usage(out: &TurnOutput) -> Json {
    json!({
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": out.completion_tokens(),
        "total_tokens": out.prompt_tokens + out.completion_tokens(),
    })
}

fn created() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The `chat.completion` object.
pub fn completion_json(
    service: &ChatService,
    id: &str,
    out: &TurnOutput,
    with_logprobs: bool,
) -> Json {
    let choices: Vec<Json> = out
        .choices
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let mut message = json!({"role": "assistant", "content": c.content});
            if !c.tool_calls.is_empty() {
                message["tool_calls"] = tool_calls_json(&c.tool_calls, false);
            }
            json!({
                "index": i,
                "message": message,
                "logprobs": if with_logprobs { logprobs_json(service, c) } else { Json::Null },
                "finish_reason": finish_reason(&c.finish),
            })
        })
        .collect();
    json!({
        "id": id,
        "object": "chat.completion",
        "created": created(),
        "model": service.model_name(),
        "choices": choices,
        "usage": usage(out),
    })
}

/// `POST /s/{session}/v1/chat/completions`.
pub async fn chat_completions(
    service: Arc<ChatService>,
    session: String,
    req: CompletionRequest,
) -> Response {
    let (stream, include_usage) = req.streaming();
    let with_logprobs = req.logprobs.unwrap_or(false);
    let chat = match req.into_chat() {
        Ok(c) => c,
        Err(e) => return LoopbackError::from(e).openai(),
    };
    let id = format!("chatcmpl-{}", super::random_id());
    if !stream {
        return match service.turn(&session, PROTOCOL, "call_", chat, None).await {
            Ok(out) => {
                axum::Json(completion_json(&service, &id, &out, with_logprobs)).into_response()
            }
            Err(e) => e.openai(),
        };
    }
    let n = chat.n;
    let (mut rx, turn) = service.spawn_turn(session, PROTOCOL, "call_", chat);
    // The SSE frames: a role chunk per choice, content deltas as they come, then per choice its
    // tool calls and finish reason, the usage chunk if asked, and `[DONE]`. An error after the
    // stream started is sent as an `error` object frame.
    let frames = async_stream(move |tx| async move {
        let model = service.model_name().to_string();
        let created = created();
        let chunk = |choices: Json| json!({"id": id, "object": "chat.completion.chunk", "created": created, "model": model, "choices": choices});
        let send = |body: Json| tx.send(SseEvent::default().data(body.to_string()));
        for i in 0..n {
            let role = json!({"role": "assistant", "content": ""});
            if send(chunk(delta(i, role, Json::Null, None))).await.is_err() {
                return;
            }
        }
        while let Some(ev) = rx.recv().await {
            let content = json!({"content": ev.text});
            if send(chunk(delta(ev.choice, content, Json::Null, None)))
                .await
                .is_err()
            {
                return;
            }
        }
        let out = match turn.await {
            Ok(Ok(out)) => out,
            Ok(Err(e)) => {
                let _ = send(json!({"error": {"message": e.to_string(), "type": "server_error", "param": e.param(), "code": e.status().as_u16()}})).await;
                return;
            }
            Err(join) => {
                let _ = send(json!({"error": {"message": format!("the turn failed: {join}"), "type": "server_error", "param": null, "code": 500}})).await;
                return;
            }
        };
        for (i, c) in out.choices.iter().enumerate() {
            if !c.tool_calls.is_empty() {
                let calls = json!({"tool_calls": tool_calls_json(&c.tool_calls, true)});
                let _ = send(chunk(delta(i, calls, Json::Null, None))).await;
            }
            let logprobs = if with_logprobs {
                logprobs_json(&service, c)
            } else {
                Json::Null
            };
            let finish = Some(finish_reason(&c.finish));
            let _ = send(chunk(delta(i, json!({}), logprobs, finish))).await;
        }
        if include_usage {
            let mut last = chunk(json!([]));
            last["usage"] = usage(&out);
            let _ = send(last).await;
        }
        let _ = tx.send(SseEvent::default().data("[DONE]")).await;
    });
    Sse::new(frames).into_response()
}

/// The `choices` of a `chat.completion.chunk` with one choice's piece.
fn delta(index: usize, delta: Json, logprobs: Json, finish_reason: Option<&str>) -> Json {
    json!([{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}])
}

/// `GET /v1/models`.
pub fn models(service: &ChatService) -> Json {
    json!({"object": "list", "data": [{"id": service.model_name(), "object": "model", "created": 0, "owned_by": "moult"}]})
}
