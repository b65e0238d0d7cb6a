//! Chat: rendering conversations into the text the model was trained on, and that text into token
//! ids, exactly as Hugging Face transformers does (docs/loopback.md); the internal chat request both
//! protocols map onto; tool calls in model output; incremental detokenization for streaming.

mod detok;
mod messages;
mod pyjson;
mod template;
mod tokenizer;
mod tool_parser;

pub use detok::DecodeStream;
pub use messages::{
    arguments_object, check_sampling, ChatRequest, ChatSampling, Image, InvalidRequest, Message,
    Part, Role, SamplingOverride, Tool, ToolCall,
};
pub use template::{ChatTemplate, RenderOptions, TemplateError};
pub use tokenizer::{Tokenizer, TokenizerError};
pub use tool_parser::{
    parser_for_template, Hermes, Llama3Json, MistralTools, NoTools, ParsedOutput, Pythonic,
    ToolCallParser,
};
