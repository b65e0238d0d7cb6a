//! The built-in engine: continuous-batching generation on libtorch behind vLLM's own HTTP API
//! (docs/engine.md), so that it and an unmodified vLLM server are interchangeable.
//!
//! - [`core`] owns the model on a dedicated thread: the batch, the KV caches, sampling, pause
//!   states and weight swaps. Everything else talks to it through [`EngineHandle`].
//! - [`http`] serves the API; [`weights`] is the weight-transfer data plane (TCP) on both ends.
//! - [`api`] holds the wire shapes and request validation; [`client`] is the other side: a
//!   client of this API (the built-in engine, vLLM or the router), for the loopback server and
//!   the router.

pub mod api;
pub mod client;
#[cfg(feature = "torch")]
pub mod core;
#[cfg(feature = "torch")]
pub mod http;
#[cfg(feature = "torch")]
mod metrics;
pub mod npy;
pub mod sampling;
#[cfg(feature = "torch")]
pub mod weights;

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;

#[cfg(feature = "torch")]
pub use self::core::{
    EngineHandle, EngineOptions, Event, FinishReason, ModelInfo, PauseMode, VisionInfo,
};

/// An error answered to an API client, in vLLM's JSON error shape:
/// `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub param: Option<String>,
}

impl ApiError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            param: None,
        }
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }

    /// A retryable refusal (paused engine, full queue): 503 with `Retry-After`.
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, message)
    }

    pub fn with_param(mut self, param: &str) -> Self {
        self.param = Some(param.into());
        self
    }

    fn kind(&self) -> &'static str {
        match self.status {
            StatusCode::BAD_REQUEST | StatusCode::UNPROCESSABLE_ENTITY => "BadRequestError",
            StatusCode::UNAUTHORIZED => "AuthenticationError",
            StatusCode::NOT_FOUND => "NotFoundError",
            StatusCode::CONFLICT => "ConflictError",
            StatusCode::TOO_MANY_REQUESTS => "RateLimitError",
            StatusCode::SERVICE_UNAVAILABLE => "ServiceUnavailableError",
            StatusCode::NOT_IMPLEMENTED => "NotImplementedError",
            _ => "InternalServerError",
        }
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.message, self.status)
    }
}

impl std::error::Error for ApiError {}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({
            "error": {
                "message": self.message,
                "type": self.kind(),
                "param": self.param,
                "code": self.status.as_u16(),
            }
        });
        let mut response = (self.status, axum::Json(body)).into_response();
        if matches!(
            self.status,
            StatusCode::SERVICE_UNAVAILABLE | StatusCode::TOO_MANY_REQUESTS
        ) {
            response
                .headers_mut()
                .insert("retry-after", axum::http::HeaderValue::from_static("1"));
        }
        response
    }
}
