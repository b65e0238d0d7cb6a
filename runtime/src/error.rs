//! Why a run (or one of its roles) stopped early: the one error type of the run core
//! (`config`, `records`, `stages`, `learner`) and of the two modes above it (`local`, `cluster`).
//! Each variant carries what the user can act on as data: the manifest field, the file, the
//! environment variable, the part that failed.

use std::path::PathBuf;

/// Why a run stopped early.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// A field of the manifest (or a command-line flag) asks for what this run cannot do.
    #[error("{field}: {reason}")]
    Field { field: String, reason: String },
    /// The manifest file is not a usable RLRun (not YAML, no `kind: RLRun`, invalid).
    #[error("{}: {reason}", path.display())]
    Manifest { path: PathBuf, reason: String },
    /// A file or folder of the run could not be read or written.
    #[error("{action} {}: {source}", path.display())]
    File {
        action: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// An environment variable a role reads is missing or malformed (the operator sets them in
    /// the pod spec).
    #[error("setting up: {name} {problem}")]
    Env { name: String, problem: String },
    /// Something this process starts (a server's port, a process) did not start.
    #[error("setting up: {what}: {source}")]
    Start {
        what: String,
        #[source]
        source: std::io::Error,
    },
    /// A compute thread (the trainer's, a model load) panicked or was cancelled.
    #[error("setting up: a compute thread failed: {0}")]
    Thread(#[from] tokio::task::JoinError),
    /// The agent pool could not be made (an agent command that cannot run here).
    #[error("setting up: {0}")]
    Agents(#[from] crate::agents::AgentError),
    /// The rollout pool could not start (its options).
    #[error("setting up: {0}")]
    Rollout(#[from] crate::rollout::RolloutError),
    /// A part of the run (a judge, a teacher, vLLM, the rollout pool, a batch the trainer
    /// cannot use) did not do its part; the message says which and why.
    #[error("setting up: {0}")]
    Setup(String),
    /// A batch the trainer cannot learn from (it is quarantined; docs/security.md, "Bad data").
    #[error("a batch the trainer cannot learn from: {0}")]
    Batch(String),
    /// A checkpoint that cannot be used or written.
    #[error("checkpoint: {0}")]
    Checkpoint(String),
    #[cfg(feature = "torch")]
    #[error(transparent)]
    Model(#[from] crate::model::Error),
    #[cfg(feature = "torch")]
    #[error("setting up: {0}")]
    Tensor(#[from] tch::TchError),
    #[cfg(feature = "torch")]
    #[error("weight sync: {0}")]
    Sync(crate::weight_sync::SyncError),
}

/// The run core's results: a [`RunError`] unless said otherwise.
pub type Result<T, E = RunError> = std::result::Result<T, E>;

#[cfg(feature = "torch")]
impl From<crate::weight_sync::SyncError> for RunError {
    /// A manifest asking for what cannot work is the manifest's error; a weight path that could
    /// not be opened is a setup error (worth trying again); the rest failed a sync.
    fn from(e: crate::weight_sync::SyncError) -> Self {
        use crate::weight_sync::SyncError;
        match e {
            SyncError::Manifest(field, reason) => Self::field(field, reason),
            SyncError::Setup(e) => Self::Setup(e.to_string()),
            e => Self::Sync(e),
        }
    }
}

impl RunError {
    /// `field: reason`, the refusal of a manifest field or flag.
    pub fn field(field: impl Into<String>, reason: impl std::fmt::Display) -> Self {
        Self::Field {
            field: field.into(),
            reason: reason.to_string(),
        }
    }

    /// A failed read or write of `path`.
    pub fn file(action: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::File {
            action,
            path: path.into(),
            source,
        }
    }

    /// The environment variable `name` is missing or malformed: `problem` says which.
    pub fn env(name: &str, problem: impl Into<String>) -> Self {
        let (name, problem) = (name.into(), problem.into());
        Self::Env { name, problem }
    }

    /// Starting `what` (a server's port, a process) failed with the error it is given.
    pub fn start(what: impl Into<String>) -> impl Fn(std::io::Error) -> Self {
        let what = what.into();
        move |source| Self::Start {
            what: what.clone(),
            source,
        }
    }

    /// Whether the batch being learned from is at fault (its data, not the trainer): it is set
    /// aside and the run goes on with the next.
    pub fn is_batch(&self) -> bool {
        #[cfg(feature = "torch")]
        use crate::model::Error as Model;
        match self {
            Self::Batch(_) => true,
            // Its tokens or shapes, or its size (out of memory on a batch larger than the rest).
            #[cfg(feature = "torch")]
            Self::Tensor(_) | Self::Model(Model::Input(_) | Model::Torch(_)) => true,
            _ => false,
        }
    }

    /// Whether the manifest (or a flag) is at fault: trying again cannot help.
    pub fn is_manifest(&self) -> bool {
        matches!(self, Self::Field { .. } | Self::Manifest { .. })
    }
}
