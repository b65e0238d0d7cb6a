//! Why a run (or one of its roles) stopped early: the one error type of the run core
//! (`config`, `learner`, `stages`, `records`) and of the two modes above it (`local`, `cluster`).
//! Each variant names what the user can act on: the manifest field, the file, the peer.

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
    Sync(#[from] crate::weight_sync::orchestrate::SyncError),
    #[error("checkpoint: {0}")]
    Checkpoint(String),
    #[error("{0}")]
    Io(String),
}
