//! The moult runtime: the model code and the built-in engine, a vLLM-compatible
//! token-in/token-out server on libtorch (docs/engine.md); chat templates and tokenizers; the
//! loopback server agents talk to, with exact token accounting (docs/loopback.md); the two agent
//! forms and the agent pool (docs/agents.md); image preprocessing for vision-language models
//! (docs/vision.md).

pub mod agents;
#[cfg(feature = "torch")]
pub mod algorithms;
pub mod auth;
pub mod chat;
pub mod cluster;
pub mod config;
#[cfg(feature = "torch")]
pub mod dist;
pub mod engine;
pub mod error;
#[cfg(feature = "torch")]
pub mod learner;
#[cfg(feature = "torch")]
pub mod local;
pub mod loopback;
#[cfg(feature = "torch")]
pub mod model;
pub mod records;
pub mod rollout;
pub mod router;
pub mod serve;
pub mod stages;
#[cfg(feature = "torch")]
pub mod trainer;
pub mod vision;
#[cfg(feature = "torch")]
pub mod weight_sync;
