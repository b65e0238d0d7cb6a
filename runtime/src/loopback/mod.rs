//! The loopback server (docs/loopback.md): what agents talk to, bound to 127.0.0.1 only.
//!
//! - `POST /s/{session}/v1/chat/completions`, `GET /s/{session}/v1/models`: OpenAI ([`openai`]);
//! - `POST /s/{session}/v1/messages`: Anthropic ([`anthropic`]);
//! - `GET /s/{session}/trajectory`: the session's recorded segments, for debugging;
//! - `DELETE /s/{session}`: forget a session.
//!
//! Both protocols map onto one internal chat request; [`service`] runs a turn and [`session`]
//! does the exact token accounting. Errors answer in each protocol's own shape ([`error`]).

pub mod anthropic;
pub mod error;
pub mod openai;
pub mod service;
pub mod session;
pub mod text_stream;
pub mod turn;

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::StatusCode;
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures::{stream, StreamExt};
use serde::de::DeserializeOwned;
use serde_json::json;

pub use crate::engine::client::EngineClient;
pub use error::LoopbackError;
pub use service::{
    ChatService, ImageInputs, ServiceOptions, DEFAULT_MAX_SESSION_TOKENS, DEFAULT_MAX_TURNS,
};
pub use session::{Segment, SegmentImage, Session};

use crate::chat::{ChatRequest, InvalidRequest};
use anthropic::Answer as Anthropic;
use openai::Answer as OpenAi;
use turn::{TurnEvent, TurnOutput, TurnResult};

/// Request bodies larger than this are refused with 413: long agent conversations are a few MB
/// at most, and the server must not buffer unbounded input.
pub const DEFAULT_MAX_BODY_BYTES: usize = 16 << 20;

/// A random id for responses and tool calls (`chatcmpl-…`, `msg_…`, `call_…`).
pub fn random_id() -> String {
    use rand::Rng;
    let chars = rand::thread_rng().sample_iter(rand::distributions::Alphanumeric);
    chars.take(24).map(char::from).collect()
}

#[derive(Debug, Clone)]
struct AppState {
    service: Arc<ChatService>,
    max_body: usize,
}

/// Parses a JSON body; errors name the offending path (`messages[2].content`).
fn parse<T: DeserializeOwned>(
    body: Result<Bytes, BytesRejection>,
    max_body: usize,
) -> Result<T, LoopbackError> {
    let body = body.map_err(|e| match e.status() {
        StatusCode::PAYLOAD_TOO_LARGE => LoopbackError::TooLarge(max_body),
        _ => InvalidRequest::body(e.body_text()).into(),
    })?;
    std::str::from_utf8(&body).map_err(|e| {
        let at = e.valid_up_to();
        InvalidRequest::body(format!("the body is not valid UTF-8 (at byte {at})"))
    })?;
    let value: serde_json::Value = serde_json::from_slice(&body)
        .map_err(|e| InvalidRequest::body(format!("the body is not valid JSON: {e}")))?;
    if !value.is_object() {
        return Err(InvalidRequest::body("the body must be a JSON object").into());
    }
    serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        LoopbackError::Invalid(InvalidRequest {
            param: (path != ".").then_some(path),
            message: format!("invalid request: {}", e.into_inner()),
        })
    })
}

/// A value of a request body and its path (`messages[2].content`): the adapters walk the body
/// with it, so every refusal names the field it refuses.
#[derive(Debug, Clone)]
struct At<'a> {
    /// `None`: the field is absent.
    value: Option<&'a serde_json::Value>,
    path: String,
}

impl<'a> At<'a> {
    fn new(value: &'a serde_json::Value, path: String) -> Self {
        let value = Some(value);
        Self { value, path }
    }

    /// Field `key` of this object.
    fn key(&self, key: &str) -> Self {
        let value = self.value.and_then(|v| v.get(key));
        let path = format!("{}.{key}", self.path);
        Self { value, path }
    }

    /// The items of this array (none if it is not one).
    fn items(&self) -> impl Iterator<Item = At<'a>> + '_ {
        let items = self.value.and_then(serde_json::Value::as_array);
        let items = items.into_iter().flatten().enumerate();
        items.map(|(i, v)| At::new(v, format!("{}[{i}]", self.path)))
    }

    fn str(&self) -> Option<&'a str> {
        self.value.and_then(serde_json::Value::as_str)
    }

    /// The string field `key` of this object, or a refusal of it with `message`.
    fn string(&self, key: &str, message: &str) -> Result<String, InvalidRequest> {
        let at = self.key(key);
        Ok(at.str().ok_or_else(|| at.refuse(message))?.to_string())
    }

    fn refuse(&self, message: impl Into<String>) -> InvalidRequest {
        InvalidRequest::new(&self.path, message)
    }
}

/// `value` of `param` as a count, if it is at least `min` (and at most `max`).
fn bounded(param: &str, value: i64, min: i64, max: Option<i64>) -> Result<usize, InvalidRequest> {
    let message = match max {
        _ if value >= min && max.is_none_or(|max| value <= max) => return Ok(value as usize),
        Some(max) => format!("{param} must be between {min} and {max}, got {value}"),
        None => format!("{param} must be at least {min}, got {value}"),
    };
    Err(invalid(param, message))
}

/// A field's refusal, for the adapters' field-by-field checks.
fn invalid(param: impl Into<String>, message: impl Into<String>) -> InvalidRequest {
    InvalidRequest::new(param, message)
}

/// What differs between the protocols when they answer a turn; [`respond`] does the rest.
trait Protocol: Sized + Send + 'static {
    type Request: DeserializeOwned;
    /// How tool-call ids start (`call_`, `toolu_`); also tells the protocols' answers apart in
    /// the retry cache.
    const CALL_ID: &'static str;
    /// The internal request, whether the answer streams, and the answer's own state.
    fn read(req: Self::Request) -> Result<(ChatRequest, bool, Self), InvalidRequest>;
    /// An error in the protocol's shape.
    fn error(e: &LoopbackError) -> Response;
    /// The whole answer of a finished turn.
    fn answer(&self, service: &ChatService, out: &TurnOutput) -> serde_json::Value;
    /// The stream's frames before any content.
    fn open(&mut self, service: &ChatService) -> Vec<SseEvent>;
    /// The frames of a piece of content.
    fn content(&mut self, service: &ChatService, ev: TurnEvent) -> Vec<SseEvent>;
    /// The last frames, once the turn finished or failed.
    fn close(&mut self, service: &ChatService, out: TurnResult) -> Vec<SseEvent>;
}

/// `POST` of a chat request in protocol `P`: runs the turn, and answers it whole or streams it.
async fn respond<P: Protocol>(
    State(state): State<AppState>,
    Path(session): Path<String>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let read = parse::<P::Request>(body, state.max_body).and_then(|r| Ok(P::read(r)?));
    let (chat, streams, mut answer) = match read {
        Ok(read) => read,
        Err(e) => return P::error(&e),
    };
    let service = state.service;
    if !streams {
        return match service.turn(&session, P::CALL_ID, chat, None).await {
            Ok(out) => Json(answer.answer(&service, &out)).into_response(),
            Err(e) => P::error(&e),
        };
    }
    let (rx, turn) = service.spawn_turn(session, P::CALL_ID, chat);
    let opening = stream::iter(answer.open(&service));
    // The content as it comes, then the last frames. A client that goes away drops this stream
    // and the turn's event receiver with it, which cancels the turn.
    let rest = stream::unfold(
        (rx, Some(turn), answer, service),
        |(mut rx, mut turn, mut answer, service)| async move {
            let frames = match rx.recv().await {
                Some(ev) => answer.content(&service, ev),
                None => answer.close(&service, turn.take()?.await),
            };
            Some((stream::iter(frames), (rx, turn, answer, service)))
        },
    );
    let frames = opening.chain(rest.flatten());
    Sse::new(frames.map(Ok::<_, std::convert::Infallible>)).into_response()
}

async fn models(State(state): State<AppState>) -> Json<serde_json::Value> {
    Json(openai::models(&state.service))
}

async fn trajectory(State(state): State<AppState>, Path(session): Path<String>) -> Response {
    match state.service.trajectory(&session).await {
        Some((turns, segments)) => {
            Json(json!({"session": session, "turns": turns, "segments": segments})).into_response()
        }
        None => OpenAi::error(&LoopbackError::NotFound(format!("no session `{session}`"))),
    }
}

async fn delete_session(State(state): State<AppState>, Path(session): Path<String>) -> Response {
    match state.service.take(&session).await {
        Some(_) => StatusCode::NO_CONTENT.into_response(),
        None => OpenAi::error(&LoopbackError::NotFound(format!("no session `{session}`"))),
    }
}

async fn not_found(uri: axum::http::Uri) -> Response {
    let message = format!("no route {uri}: agents use /s/{{session}}/v1/chat/completions (OpenAI) or /s/{{session}}/v1/messages (Anthropic)");
    OpenAi::error(&LoopbackError::NotFound(message))
}

/// The loopback server's routes, served with [`crate::serve::serve`].
pub fn router(service: Arc<ChatService>, max_body: usize) -> Router {
    let state = AppState { service, max_body };
    Router::new()
        .route("/s/{session}/v1/chat/completions", post(respond::<OpenAi>))
        .route("/s/{session}/v1/models", get(models))
        .route("/s/{session}/v1/messages", post(respond::<Anthropic>))
        .route("/s/{session}/trajectory", get(trajectory))
        .route("/s/{session}", axum::routing::delete(delete_session))
        .route("/v1/models", get(models))
        .route("/health", get(|| async { StatusCode::OK }))
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(max_body))
        .with_state(state)
}
