//! Where a run's records go: one JSON line per step in `metrics.jsonl` (and `eval.jsonl`) with
//! TensorBoard event files beside them ([`metrics`], [`tensorboard`]), what the terminal shows
//! ([`console`]), and files written whole or not at all ([`files`]).

pub mod console;
pub(crate) mod files;
pub mod metrics;
pub mod tensorboard;
