//! What a finished turn answers, protocol-neutral: each sample's content, tool calls, finish
//! reason and tokens. The OpenAI and Anthropic adapters write it in their own shapes, and a
//! session keeps recent answers for identical retries.

use std::sync::Arc;

use super::error::LoopbackError;
use crate::chat::ToolCall;

/// Why a sample ended, in protocol-neutral terms.
#[derive(Debug, Clone, PartialEq)]
pub enum Finish {
    /// The model ended its turn (EOS or a stop id).
    Stop,
    /// `max_tokens` or the context length.
    Length,
    /// The model called tools.
    ToolCalls,
    /// A stop string matched (it is not part of the content).
    StopSequence(String),
}

/// One sampled token as reported with OpenAI `logprobs`.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenInfo {
    pub id: i64,
    pub logprob: f32,
    pub top: Vec<(i64, f32)>,
}

/// One sample of a finished turn, as the client sees it.
#[derive(Debug, Clone)]
pub struct ChoiceOutput {
    pub content: Option<String>,
    pub tool_calls: Vec<ToolCall>,
    pub finish: Finish,
    pub completion_tokens: usize,
    pub tokens: Vec<TokenInfo>,
}

/// A finished turn: what the protocols answer, and what an identical retry is answered with.
#[derive(Debug, Clone)]
pub struct TurnOutput {
    pub prompt_tokens: usize,
    pub choices: Vec<ChoiceOutput>,
}

/// How a turn ends: its answer (shared with the retry cache), or why it failed.
pub type TurnResult = Result<Arc<TurnOutput>, LoopbackError>;

/// Content text of sample `choice` that is final and may be streamed.
#[derive(Debug, Clone, PartialEq)]
pub struct TurnEvent {
    pub choice: usize,
    pub text: String,
}
