//! Model code: the decoder-only causal LMs of docs/models.md (Qwen3, Qwen3-MoE, Qwen2, Llama 3,
//! Mistral, Gemma 3) and the vision-language Qwen2.5-VL (`vl`, docs/vision.md) on libtorch,
//! loaded from a Hugging Face model folder.
//!
//! Contract: [`CausalLm::forward`] takes a *packed* batch (each sequence contributes its new
//! tokens, with or without a KV cache) and returns logits that match transformers' forward
//! for the same checkpoint. The same function serves the engine (cache, last-position logits)
//! and the trainer (no cache, all positions, optional routing replay), so the two cannot
//! drift apart (docs/architecture.md#the-three-invariants, forward consistency).

mod config;
mod decoder;
mod kv_cache;
mod linear;
mod loader;
pub mod lora;
mod mlp;
mod moe;
mod rope;
mod vl;

use std::path::PathBuf;

pub use config::{Architecture, ModelConfig, MoeConfig};
pub use decoder::{CausalLm, ForwardOutput, LogitsFor, NamedSlice, SeqInput, Stages};
pub use kv_cache::KvCache;
pub use loader::{dtype_name, load_safetensors_dir, parse_dtype};
pub use vl::{expand_placeholders, place_images, ImageInput, VisionConfig, VlConfig};

/// libtorch intra-op threads for computing with a model: one for small models (hidden size under
/// 512), whose operations are too small to gain from a pool (waking one costs tens of
/// microseconds per operation, and its spinning threads starve the other roles of a local run),
/// all cores otherwise. Set it on each compute thread: OpenMP's count is per thread, and a new
/// thread inherits whatever count was set last.
pub fn compute_threads(cfg: &ModelConfig) -> usize {
    if cfg.hidden_size < 512 {
        1
    } else {
        std::thread::available_parallelism().map_or(1, |n| n.get())
    }
}

/// Errors of loading and running a model.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("unsupported or invalid model config: {0}")]
    Config(String),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Checkpoint { path: PathBuf, message: String },
    #[error("weight `{name}`: {message}")]
    Weight { name: String, message: String },
    #[error("invalid forward input: {0}")]
    Input(String),
    #[error(transparent)]
    Torch(#[from] tch::TchError),
    /// A collective between the trainer's ranks failed (docs/distributed.md).
    #[error(transparent)]
    Dist(#[from] crate::dist::Error),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
