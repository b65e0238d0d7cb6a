//! The loopback server's errors, with their HTTP status and the field they name; each protocol
//! turns them into its own error shape once (`Protocol::error` of [`super::openai`] and
//! [`super::anthropic`]).

use axum::http::StatusCode;

use crate::chat::{InvalidRequest, TemplateError, TokenizerError};
use crate::engine::client::EngineError;

#[derive(Debug, thiserror::Error)]
pub enum LoopbackError {
    #[error(transparent)]
    Invalid(#[from] InvalidRequest),
    #[error("the request body is larger than the limit of {0} bytes")]
    TooLarge(usize),
    #[error("{0}")]
    NotFound(String),
    #[error("too many sessions: at most {0} are kept; take or delete finished ones")]
    TooManySessions(usize),
    #[error("this session has taken its {0} turns, the most one session may take")]
    TurnLimit(usize),
    #[error("this session has reached its limit of {0} recorded tokens")]
    TokenLimit(usize),
    #[error("the chat template cannot render this conversation: {0}")]
    Template(#[from] TemplateError),
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// The client went away mid-turn; nothing is answered.
    #[error("the client disconnected")]
    ClientGone,
    #[error("the turn failed: {0}")]
    Panicked(String),
}

impl LoopbackError {
    pub fn status(&self) -> StatusCode {
        match self {
            Self::Invalid(_) | Self::Template(_) => StatusCode::BAD_REQUEST,
            Self::TooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            Self::NotFound(_) => StatusCode::NOT_FOUND,
            Self::TooManySessions(_) | Self::TurnLimit(_) | Self::TokenLimit(_) => {
                StatusCode::TOO_MANY_REQUESTS
            }
            Self::Tokenizer(_) | Self::ClientGone | Self::Panicked(_) => {
                StatusCode::INTERNAL_SERVER_ERROR
            }
            Self::Engine(EngineError::Refused { status, .. }) => {
                StatusCode::from_u16(*status).unwrap_or(StatusCode::BAD_GATEWAY)
            }
            Self::Engine(_) => StatusCode::BAD_GATEWAY,
        }
    }

    pub fn param(&self) -> Option<&str> {
        let Self::Invalid(e) = self else { return None };
        e.param.as_deref()
    }
}
