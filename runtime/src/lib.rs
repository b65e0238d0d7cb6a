//! The moult runtime. Today: the model code and the built-in engine, a vLLM-compatible
//! token-in/token-out server on libtorch (DESIGN §4.1, §5).

pub mod chat;
pub mod engine;
pub mod model;
