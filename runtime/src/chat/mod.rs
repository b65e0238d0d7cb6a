//! Chat: rendering conversations into the text the model was trained on, and that text into token
//! ids, exactly as Hugging Face transformers does (DESIGN §4.2). The loopback server (issue 4) builds on this.

mod pyjson;
mod template;
mod tokenizer;

pub use pyjson::{dumps as python_json_dumps, DumpOptions};
pub use template::{ChatTemplate, RenderOptions, TemplateError};
pub use tokenizer::{Tokenizer, TokenizerError};
