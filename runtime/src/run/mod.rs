//! `moult run`: a whole RL run from one RLRun manifest on this machine (docs/architecture.md, "locally").
//! Built-in engines (or vLLM processes, [`vllm`]) behind the router, the loopback server and agent
//! pool ([`local`]), the streaming rollout pool, and the learner (`learner`, shared with the
//! cluster's trainer pod): the trainer and weight sync over the run's transport.
//!
//! The loop ([`run`]) reads on one screen: take a batch of finished groups → (with a judge, its
//! scores as rewards, [`judge`]) → advantages → train → publish the new weights (pause/keep,
//! transfer, resume) → log → checkpoint. Generation never stops for training: the rollout pool
//! keeps up to `maxStaleness + 1` batches in flight, so episodes for the next step run while this
//! one trains (`--sync` turns that off for comparison).
//!
//! Without the `torch` feature (the agent-pod build) only what pods that do not train need is
//! here: the manifest's settings ([`config`]), metrics records ([`metrics`]) and [`judge`].

#[cfg(feature = "torch")]
pub mod checkpoint;
pub mod config;
pub mod console;
pub mod dataset;
#[cfg(feature = "torch")]
mod driver;
pub mod dump;
pub(crate) mod files;
pub mod judge;
#[cfg(feature = "torch")]
pub(crate) mod learner;
#[cfg(feature = "torch")]
pub mod local;
pub mod metrics;
#[cfg(feature = "torch")]
pub mod samples;
pub mod teacher;
pub mod tensorboard;
#[cfg(feature = "torch")]
pub mod vllm;

use std::path::{Path, PathBuf};

use rand::seq::SliceRandom;
use rand::SeedableRng;

#[cfg(feature = "torch")]
pub use driver::{evaluate_checkpoint, run, RunOptions, Summary};

/// Why a run stopped early.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The manifest (or a file it names) is unusable; the message names the field.
    #[error("{0}")]
    Manifest(String),
    #[error("setting up: {0}")]
    Setup(String),
    #[cfg(feature = "torch")]
    #[error(transparent)]
    Model(#[from] crate::model::Error),
    #[cfg(feature = "torch")]
    #[error("weight sync: {0}")]
    Sync(crate::weight_sync::SyncError),
    #[error("checkpoint: {0}")]
    Checkpoint(String),
    #[error("{0}")]
    Io(String),
}

#[cfg(feature = "torch")]
impl From<crate::weight_sync::SyncError> for RunError {
    /// A manifest asking for what cannot work is the manifest's error; a weight path that could
    /// not be opened is a setup error (worth trying again); the rest failed a sync.
    fn from(e: crate::weight_sync::SyncError) -> Self {
        use crate::weight_sync::SyncError;
        match e {
            SyncError::Manifest(..) => Self::Manifest(e.to_string()),
            SyncError::Setup(e) => Self::Setup(e.to_string()),
            e => Self::Sync(e),
        }
    }
}

/// The dataset in the run's fixed order (a seeded shuffle, so a resumed run's cursor means the
/// same task).
pub(crate) fn ordered(tasks: &[serde_json::Value], seed: u64) -> Vec<serde_json::Value> {
    let mut tasks = tasks.to_vec();
    tasks.shuffle(&mut rand_chacha::ChaCha8Rng::seed_from_u64(seed));
    tasks
}

/// `<out>` of a run by default: `runs/<name>`.
pub fn default_out(name: &str) -> PathBuf {
    Path::new("runs").join(name)
}
