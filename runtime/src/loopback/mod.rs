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
use futures::Stream;
use serde::de::DeserializeOwned;
use serde_json::json;
use tokio::sync::mpsc;

pub use crate::engine::client::EngineClient;
pub use error::LoopbackError;
pub use service::{
    ChatService, ImageInputs, ServiceOptions, DEFAULT_MAX_SESSION_TOKENS, DEFAULT_MAX_TURNS,
};
pub use session::{Segment, SegmentImage, Session};

use crate::chat::{ChatRequest, InvalidRequest};
use turn::{TurnEvent, TurnOutput};

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
    let body = body.map_err(|e| {
        if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
            LoopbackError::TooLarge(max_body)
        } else {
            InvalidRequest::body(e.body_text()).into()
        }
    })?;
    if let Err(e) = std::str::from_utf8(&body) {
        let at = e.valid_up_to();
        return Err(
            InvalidRequest::body(format!("the body is not valid UTF-8 (at byte {at})")).into(),
        );
    }
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

/// A field of a JSON object, if it is a string.
fn str_field<'a>(value: &'a serde_json::Value, key: &str) -> Option<&'a str> {
    value.get(key).and_then(serde_json::Value::as_str)
}

/// The string field `key` of `value`, or a refusal naming `{param}.{key}` with `message`.
fn required<'a>(
    value: &'a serde_json::Value,
    param: &str,
    key: &str,
    message: &str,
) -> Result<&'a str, InvalidRequest> {
    str_field(value, key).ok_or_else(|| invalid(format!("{param}.{key}"), message))
}

/// `value` of `param` as a count, if it is at least `min` (and at most `max`).
fn bounded(param: &str, value: i64, min: i64, max: Option<i64>) -> Result<usize, InvalidRequest> {
    match max {
        _ if value >= min && max.is_none_or(|max| value <= max) => Ok(value as usize),
        Some(max) => Err(invalid(
            param,
            format!("{param} must be between {min} and {max}, got {value}"),
        )),
        None => Err(invalid(
            param,
            format!("{param} must be at least {min}, got {value}"),
        )),
    }
}

/// A field's refusal, for the adapters' field-by-field checks.
fn invalid(param: impl Into<String>, message: impl Into<String>) -> InvalidRequest {
    InvalidRequest::new(param, message)
}

/// A stream fed by a task through a bounded channel: the task ends (and drops what it holds,
/// the turn's event receiver included) as soon as the client stops reading.
fn async_stream<F, Fut>(f: F) -> impl Stream<Item = Result<SseEvent, std::convert::Infallible>>
where
    F: FnOnce(mpsc::Sender<SseEvent>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    // One frame in flight is enough: the producer waits for the client either way.
    let (tx, rx) = mpsc::channel(1);
    let task = tokio::spawn(f(tx));
    // The producer ends when the client's stream is dropped.
    let guard = crate::AbortOnDrop(task);
    futures::stream::unfold((rx, guard), |(mut rx, guard)| async move {
        rx.recv().await.map(|ev| (Ok(ev), (rx, guard)))
    })
}

/// What differs between the protocols when they answer a turn; [`respond`] does the rest.
trait Protocol: Sized + Send + 'static {
    type Request: DeserializeOwned;
    /// The answer's shape, for the retry cache.
    const NAME: &'static str;
    /// How tool-call ids start (`call_`, `toolu_`).
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
    fn close(
        &mut self,
        service: &ChatService,
        out: Result<Arc<TurnOutput>, LoopbackError>,
    ) -> Vec<SseEvent>;
}

/// `POST` of a chat request in protocol `P`: runs the turn, and answers it whole or streams it.
async fn respond<P: Protocol>(
    State(state): State<AppState>,
    Path(session): Path<String>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let read = parse::<P::Request>(body, state.max_body).and_then(|r| Ok(P::read(r)?));
    let (chat, stream, mut answer) = match read {
        Ok(read) => read,
        Err(e) => return P::error(&e),
    };
    let service = state.service;
    if !stream {
        return match service
            .turn(&session, P::NAME, P::CALL_ID, chat, None)
            .await
        {
            Ok(out) => Json(answer.answer(&service, &out)).into_response(),
            Err(e) => P::error(&e),
        };
    }
    let (mut rx, turn) = service.spawn_turn(session, P::NAME, P::CALL_ID, chat);
    let frames = async_stream(move |tx| async move {
        let mut frames = answer.open(&service);
        loop {
            for frame in frames {
                if tx.send(frame).await.is_err() {
                    return;
                }
            }
            frames = match rx.recv().await {
                Some(ev) => answer.content(&service, ev),
                None => break,
            };
        }
        for frame in answer.close(&service, turn.await) {
            if tx.send(frame).await.is_err() {
                return;
            }
        }
    });
    Sse::new(frames).into_response()
}

async fn models(State(state): State<AppState>) -> Json<serde_json::Value> {
    Json(openai::models(&state.service))
}

async fn trajectory(State(state): State<AppState>, Path(session): Path<String>) -> Response {
    match state.service.trajectory(&session).await {
        Some((turns, segments)) => {
            Json(json!({"session": session, "turns": turns, "segments": segments})).into_response()
        }
        None => LoopbackError::NotFound(format!("no session `{session}`")).openai(),
    }
}

async fn delete_session(State(state): State<AppState>, Path(session): Path<String>) -> Response {
    match state.service.take(&session).await {
        Some(_) => StatusCode::NO_CONTENT.into_response(),
        None => LoopbackError::NotFound(format!("no session `{session}`")).openai(),
    }
}

async fn not_found(uri: axum::http::Uri) -> Response {
    LoopbackError::NotFound(format!(
        "no route {uri}: agents use /s/{{session}}/v1/chat/completions (OpenAI) or /s/{{session}}/v1/messages (Anthropic)"
    ))
    .openai()
}

/// The loopback server's routes.
pub fn router(service: Arc<ChatService>, max_body: usize) -> Router {
    let state = AppState { service, max_body };
    Router::new()
        .route(
            "/s/{session}/v1/chat/completions",
            post(respond::<openai::Answer>),
        )
        .route("/s/{session}/v1/models", get(models))
        .route(
            "/s/{session}/v1/messages",
            post(respond::<anthropic::Answer>),
        )
        .route("/s/{session}/trajectory", get(trajectory))
        .route("/s/{session}", axum::routing::delete(delete_session))
        .route("/v1/models", get(models))
        .route("/health", get(|| async { StatusCode::OK }))
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(max_body))
        .with_state(state)
}

/// Serves on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: tokio::net::TcpListener,
    service: Arc<ChatService>,
    max_body: usize,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    crate::serve::serve(listener, router(service, max_body), shutdown).await
}
