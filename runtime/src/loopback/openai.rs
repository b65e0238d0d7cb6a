//! OpenAI chat completions onto the internal chat request, and the answer back in the shapes the
//! `openai` SDK reads: `chat.completion`, and `chat.completion.chunk` SSE frames ending in
//! `data: [DONE]`.

use axum::response::sse::Event as SseEvent;
use axum::response::{IntoResponse, Response};

use serde::Deserialize;
use serde_json::{json, Map, Value as Json};

use super::error::LoopbackError;
use super::service::ChatService;
use super::turn::{ChoiceOutput, Finish, TokenInfo, TurnEvent, TurnOutput, TurnResult};
use super::{bounded, invalid, random_id, At, Protocol};
use crate::chat::{
    arguments_object, check_sampling, ChatRequest, ChatSampling, Image, InvalidRequest, Message,
    Part, Role, Tool, ToolCall,
};

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

/// A message of `role` with `content`: a string, null, or an array of `{"type": "text", "text"}`
/// parts and, in user messages, `{"type": "image_url", "image_url": {"url": "data:..."}}` parts.
fn with_content(role: Role, content: &At) -> Result<Message, InvalidRequest> {
    match content.value {
        None | Some(Json::Null) => return Ok(Message::new(role)),
        Some(Json::String(s)) => return Ok(Message::text(role, s.clone())),
        Some(Json::Array(_)) => {}
        _ => {
            let message = "content must be a string, an array of content parts, or null";
            return Err(content.refuse(message));
        }
    }
    let parts = content.items().map(|part| {
        let kind = part.key("type");
        match kind.str() {
            Some("text") => Ok(Part::Text {
                text: part.string("text", "a text part needs a string `text`")?,
            }),
            Some("image_url") if role == Role::User => Ok(Part::Image {
                image: image_url(&part.key("image_url"))?,
            }),
            Some("image_url") => Err(kind.refuse("images are accepted in user messages only")),
            Some(other) => Err(kind.refuse(format!(
                "content parts of type `{other}` are not supported: only `text` and `image_url`"
            ))),
            None => Err(part.refuse("a content part needs a `type` (`text` or `image_url`)")),
        }
    });
    Ok(Message::with_parts(role, parts.collect::<Result<_, _>>()?))
}

/// The image of an `image_url` part's `image_url`: `{"url": "data:..."}` or the URL itself.
fn image_url(at: &At) -> Result<Image, InvalidRequest> {
    let data_url = match at.value {
        Some(Json::String(s)) => s.clone(),
        Some(_) => at.string("url", "an image_url part needs a string `url`")?,
        None => return Err(at.refuse("an image_url part needs `image_url: {url}`")),
    };
    Image::from_data_url(&data_url).map_err(|e| at.key("url").refuse(e.to_string()))
}

fn message(m: &At) -> Result<Message, InvalidRequest> {
    if !m.value.is_some_and(Json::is_object) {
        return Err(m.refuse("each message must be an object"));
    }
    let at = m.key("role");
    let role = match at.str() {
        Some("system") | Some("developer") => Role::System,
        Some("user") => Role::User,
        Some("assistant") => Role::Assistant,
        Some("tool") => Role::Tool,
        Some(other) => {
            return Err(at.refuse(format!(
                "unknown role `{other}`: expected system, developer, user, assistant or tool"
            )))
        }
        None => return Err(at.refuse("a message needs a string `role`")),
    };
    let content = m.key("content");
    let mut message = with_content(role, &content)?;
    let calls = m.key("tool_calls");
    match calls.value {
        None | Some(Json::Null) => {}
        Some(_) if role != Role::Assistant => {
            return Err(calls.refuse("only assistant messages carry tool_calls"))
        }
        Some(Json::Array(_)) => {}
        Some(_) => return Err(calls.refuse("tool_calls must be an array")),
    }
    for call in calls.items() {
        let function = call.key("function");
        if function.value.is_none() {
            return Err(call.refuse("a tool call needs a `function`"));
        }
        let arguments = function.key("arguments");
        message.tool_calls.push(ToolCall {
            id: call.key("id").str().unwrap_or_default().to_string(),
            name: function.string("name", "a tool call needs a string name")?,
            arguments: arguments_object(&arguments.path, arguments.value)?,
        });
    }
    if message.content.is_none() && message.tool_calls.is_empty() && role != Role::Assistant {
        let message = format!("a {} message needs content", role.as_str());
        return Err(content.refuse(message));
    }
    let field = |key| m.key(key).str().map(str::to_string);
    message.tool_call_id = field("tool_call_id");
    if role == Role::Tool && message.tool_call_id.is_none() {
        let message = "a tool message needs the tool_call_id it answers";
        return Err(m.key("tool_call_id").refuse(message));
    }
    message.name = field("name");
    message.reasoning_content = field("reasoning_content");
    Ok(message)
}

impl CompletionRequest {
    pub fn into_chat(self) -> Result<ChatRequest, InvalidRequest> {
        if self.messages.is_empty() {
            return Err(invalid("messages", "messages must not be empty"));
        }
        let messages = self.messages.iter().enumerate();
        let messages = messages.map(|(i, m)| message(&At::new(m, format!("messages[{i}]"))));
        let messages = messages.collect::<Result<Vec<_>, _>>()?;
        let tools = self.tools.unwrap_or_default().into_iter().enumerate();
        let tools = tools.map(|(i, ToolJson { kind, function: f })| match kind.as_str() {
            "function" => Ok(Tool {
                name: f.name,
                description: f.description,
                parameters: f
                    .parameters
                    .unwrap_or(json!({"type": "object", "properties": {}})),
            }),
            _ => Err(invalid(
                format!("tools[{i}].type"),
                format!("tool type `{kind}` is not supported: only `function`"),
            )),
        });
        let tools = tools.collect::<Result<_, _>>()?;
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
            Some(Json::Array(items)) => {
                let message = "stop must be a non-empty string or an array of them";
                let item = |v: Json| v.as_str().filter(|s| !s.is_empty()).map(str::to_string);
                let stop = items.into_iter().map(item).collect::<Option<_>>();
                stop.ok_or_else(|| invalid("stop", message))?
            }
            Some(_) => {
                let message = "stop must be a string or an array of strings";
                return Err(invalid("stop", message));
            }
        };
        if stop.len() > 4 {
            return Err(invalid("stop", "at most 4 stop sequences"));
        }
        let n = self.n.map_or(Ok(1), |n| bounded("n", n, 1, Some(MAX_N)))?;
        let top_logprobs = match (self.logprobs.unwrap_or(false), self.top_logprobs) {
            (false, None) => None,
            (false, Some(_)) => {
                return Err(invalid("top_logprobs", "top_logprobs needs logprobs: true"))
            }
            (true, k) => Some(bounded("top_logprobs", k.unwrap_or(0), 0, Some(20))?),
        };
        let positive = |param, v: Option<i64>| v.map(|v| bounded(param, v, 1, None)).transpose();
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

/// The calls as OpenAI answers them: arguments as a JSON string, and in a stream with `index`.
fn tool_calls_json(calls: &[ToolCall], streaming: bool) -> Json {
    let call = |(i, c): (usize, &ToolCall)| {
        let mut v = c.to_openai(c.arguments.to_string().into());
        if streaming {
            v["index"] = json!(i);
        }
        v
    };
    calls.iter().enumerate().map(call).collect()
}

fn usage(out: &TurnOutput) -> Json {
    let completion: usize = out.choices.iter().map(|c| c.completion_tokens).sum();
    json!({"prompt_tokens": out.prompt_tokens, "completion_tokens": completion,
           "total_tokens": out.prompt_tokens + completion})
}

/// An OpenAI answer: a `chat.completion`, or its `chat.completion.chunk` frames (a role chunk
/// per choice, content deltas as they come, then per choice its tool calls and finish reason,
/// the usage chunk if asked, and `[DONE]`; an error after the stream started is an `error`
/// object frame).
pub struct Answer {
    id: String,
    created: u64,
    n: usize,
    logprobs: bool,
    include_usage: bool,
}

impl Answer {
    /// A `chat.completion.chunk` with `choices`.
    fn chunk(&self, service: &ChatService, choices: Json) -> Json {
        json!({"id": self.id, "object": "chat.completion.chunk", "created": self.created,
               "model": service.model_name(), "choices": choices})
    }

    /// The frame of a chunk with one choice's piece.
    fn delta(
        &self,
        service: &ChatService,
        index: usize,
        delta: Json,
        last: Option<&ChoiceOutput>,
    ) -> SseEvent {
        let logprobs = last.map_or(Json::Null, |c| self.logprobs(service, c));
        let finish = last.map(|c| finish_reason(&c.finish));
        let choice =
            json!({"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish});
        frame(self.chunk(service, json!([choice])))
    }

    fn logprobs(&self, service: &ChatService, choice: &ChoiceOutput) -> Json {
        if !self.logprobs {
            return Json::Null;
        }
        let entry = |id: i64, logprob: f32| {
            let text = service.tokenizer().decode(&[id], false).unwrap_or_default();
            json!({"token": text, "logprob": logprob, "bytes": text.as_bytes()})
        };
        let token = |t: &TokenInfo| {
            let mut v = entry(t.id, t.logprob);
            v["top_logprobs"] = t.top.iter().map(|&(id, lp)| entry(id, lp)).collect();
            v
        };
        json!({ "content": choice.tokens.iter().map(token).collect::<Json>() })
    }
}

fn frame(body: Json) -> SseEvent {
    SseEvent::default().data(body.to_string())
}

impl Protocol for Answer {
    type Request = CompletionRequest;
    const CALL_ID: &'static str = "call_";

    fn read(req: CompletionRequest) -> Result<(ChatRequest, bool, Self), InvalidRequest> {
        let stream = req.stream.unwrap_or(false);
        let include_usage = req.stream_options.as_ref().and_then(|o| o.include_usage);
        let logprobs = req.logprobs.unwrap_or(false);
        let chat = req.into_chat()?;
        let answer = Self {
            id: format!("chatcmpl-{}", random_id()),
            created: chrono::Utc::now().timestamp().max(0) as u64,
            n: chat.n,
            logprobs,
            include_usage: include_usage.unwrap_or(false),
        };
        Ok((chat, stream, answer))
    }

    /// `{"error": {message, type, param, code}}`.
    fn error(e: &LoopbackError) -> Response {
        let status = e.status();
        let kind = match status.as_u16() {
            400 | 413 => "invalid_request_error",
            404 => "not_found_error",
            429 => "rate_limit_error",
            503 => "service_unavailable",
            _ => "server_error",
        };
        let (message, param) = (e.to_string(), e.param());
        let body =
            json!({"error": {"message": message, "type": kind, "param": param, "code": null}});
        (status, axum::Json(body)).into_response()
    }

    fn answer(&self, service: &ChatService, out: &TurnOutput) -> Json {
        let choice = |(i, c): (usize, &ChoiceOutput)| {
            let mut message = json!({"role": "assistant", "content": c.content});
            if !c.tool_calls.is_empty() {
                message["tool_calls"] = tool_calls_json(&c.tool_calls, false);
            }
            let (logprobs, finish) = (self.logprobs(service, c), finish_reason(&c.finish));
            json!({"index": i, "message": message, "logprobs": logprobs, "finish_reason": finish})
        };
        let choices: Json = out.choices.iter().enumerate().map(choice).collect();
        json!({"id": self.id, "object": "chat.completion", "created": self.created,
               "model": service.model_name(), "choices": choices, "usage": usage(out)})
    }

    fn open(&mut self, service: &ChatService) -> Vec<SseEvent> {
        let role = json!({"role": "assistant", "content": ""});
        let role = |i| self.delta(service, i, role.clone(), None);
        (0..self.n).map(role).collect()
    }

    fn content(&mut self, service: &ChatService, ev: TurnEvent) -> Vec<SseEvent> {
        vec![self.delta(service, ev.choice, json!({"content": ev.text}), None)]
    }

    fn close(&mut self, service: &ChatService, out: TurnResult) -> Vec<SseEvent> {
        let out = match out {
            Ok(out) => out,
            Err(e) => {
                let code = e.status().as_u16();
                return vec![frame(json!({"error": {"message": e.to_string(),
                    "type": "server_error", "param": e.param(), "code": code}}))];
            }
        };
        let mut frames = Vec::new();
        for (i, c) in out.choices.iter().enumerate() {
            if !c.tool_calls.is_empty() {
                let calls = json!({"tool_calls": tool_calls_json(&c.tool_calls, true)});
                frames.push(self.delta(service, i, calls, None));
            }
            frames.push(self.delta(service, i, json!({}), Some(c)));
        }
        if self.include_usage {
            let mut last = self.chunk(service, json!([]));
            last["usage"] = usage(&out);
            frames.push(frame(last));
        }
        frames.push(SseEvent::default().data("[DONE]"));
        frames
    }
}

/// `GET /v1/models`.
pub fn models(service: &ChatService) -> Json {
    json!({"object": "list", "data": [{"id": service.model_name(), "object": "model", "created": 0, "owned_by": "moult"}]})
}
