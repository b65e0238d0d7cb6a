//! The controller's error type.

/// What can go wrong while reconciling a run or holding the lease.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("Kubernetes API call failed: {context}: {source}")]
    Kube {
        context: String,
        #[source]
        source: kube::Error,
    },
    #[error("the RLRun has no {0}")]
    MissingMetadata(&'static str),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Attaches what was being done to a kube error.
pub(crate) trait Context<T> {
    fn context(self, what: impl FnOnce() -> String) -> Result<T>;
}

impl<T> Context<T> for std::result::Result<T, kube::Error> {
    fn context(self, what: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|source| Error::Kube {
            context: what(),
            source,
        })
    }
}
