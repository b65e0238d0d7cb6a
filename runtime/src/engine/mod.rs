//! The built-in engine: continuous-batching generation on libtorch behind vLLM's own HTTP API
//! (docs/engine.md), so that it and an unmodified vLLM server are interchangeable.
//!
//! - [`core`] owns the model on a dedicated thread: the batch, the KV caches, sampling, pause
//!   states and weight swaps. Everything else talks to it through [`EngineHandle`].
//! - [`http`] serves the API; [`weights`] is the weight-transfer data plane (TCP) on both ends.
//! - [`api`] holds the wire shapes and request validation; [`client`] is the other side: a
//!   client of this API (the built-in engine, vLLM or the router), for the loopback server and
//!   the router.
//! - [`front`] is the run-token check in front of an engine that has none (vLLM in its pod).
//! - [`pool`]: what an engine of an `EnginePool` adds: runs' credentials, their own adapters,
//!   a fair share of batch slots (docs/lora.md, "Engine pools").

pub mod api;
pub mod client;
#[cfg(feature = "torch")]
pub mod core;
pub mod front;
#[cfg(feature = "torch")]
pub mod http;
#[cfg(feature = "torch")]
mod metrics;
pub mod npy;
pub mod pool;
pub mod sampling;
#[cfg(feature = "torch")]
pub mod weights;

#[cfg(feature = "torch")]
pub use self::core::{EngineHandle, EngineOptions, Event, ModelInfo, PauseMode, VisionInfo};
/// The engine API's error, which every server of the runtime answers with (it lives in
/// [`crate::serve`], below the credential check that answers with it too).
pub use crate::serve::ApiError;
