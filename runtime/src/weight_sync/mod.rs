//! Weight sync (docs/engine.md): moving a new policy's weights from the trainer to every engine.
//!
//! - [`nccl_handshake`]: the messages of the NCCL data plane to vLLM engines (unique id as base64,
//!   rank offsets, world size), pure and tested everywhere;
//! - [`nccl_control`]: the engines' weight-transfer endpoints that drive that data plane;
//! - `nccl` (cargo feature `cuda`): the trainer's side of that data plane on cudarc's NCCL, and
//!   the NCCL transport's publisher.
//!
//! - [`orchestrate`]: the TCP transport: pause, transfer (TCP data plane to built-in engines),
//!   finish with the version, resume;
//! - [`folder`]: the Filesystem transport (safetensors in a shared folder, reloaded by engines);
//! - [`publish`]: the one publisher `moult run` and `moult trainer` use, over all three;
//! - [`stream`]: the buckets an update is made of, as a trainer gathers them.
//!
//! This module owns what every transport shares: the engine API's control calls ([`Control`]),
//! what an update cost ([`SyncReport`]) and why one failed ([`SyncError`]). The TCP data plane
//! itself lives in [`crate::engine::weights`].

pub mod folder;
#[cfg(feature = "cuda")]
pub mod nccl;
pub mod nccl_control;
pub mod nccl_handshake;
pub mod orchestrate;
pub mod publish;
pub mod stream;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use reqwest::Method;
use serde_json::{json, Value};

use crate::auth::CallError;
use crate::trainer::bytes_of;

/// A cause of any kind, kept as the error's source.
type Cause = Box<dyn std::error::Error + Send + Sync>;

/// Why a weight sync failed: the step and its cause; or, on connecting, a manifest asking for
/// what cannot work ([`SyncError::Manifest`]) or engines that could not be reached
/// ([`SyncError::Setup`], worth trying again).
#[derive(Debug, thiserror::Error)]
pub enum SyncError {
    /// An engine-API call (to the router, a coordinator or an engine) failed at a step.
    #[error("weight sync, {0}: {1}")]
    Call(&'static str, #[source] CallError),
    /// A step of the data plane failed (accepting, sending, connecting).
    #[error("weight sync, {0}: {1}")]
    Failed(&'static str, #[source] Cause),
    /// Listening on an address failed.
    #[error("weight sync, listen: {0}: {1}")]
    Listen(String, #[source] std::io::Error),
    /// Writing a version folder failed: what was done, to which path.
    #[error("weight sync, write: {what} {}: {source}", path.display())]
    Write {
        what: &'static str,
        path: PathBuf,
        source: Cause,
    },
    #[error("weight sync, gather: the trainer stopped before it had gathered every weight (its log says why)")]
    Gather,
    #[error(
        "weight sync: the run is stopping (SIGTERM or Ctrl-C); the weights stay with the trainer"
    )]
    Stopped,
    #[error("weight sync, engines: no engine is up behind the router")]
    NoEngines,
    #[error("weight sync: the data plane is not connected (call connect_tcp first)")]
    NotConnected,
    /// The NCCL data plane failed (inside [`SyncError::Held`]).
    #[error(transparent)]
    Nccl(#[from] nccl_handshake::NcclSyncError),
    /// An NCCL update failed after the engines began loading: they stay paused.
    #[error("weight sync, nccl: {0} (engines stay paused until an update completes)")]
    Held(Box<SyncError>),
    /// The manifest asks for a combination that cannot work: the spec field to change, and why.
    #[error("{0}: {1}")]
    Manifest(&'static str, String),
    /// The weight path could not be opened (the engines could not be reached).
    #[error("{0}")]
    Setup(Box<SyncError>),
}

/// Weight sync's results: a [`SyncError`] unless said otherwise.
pub type Result<T, E = SyncError> = std::result::Result<T, E>;

impl SyncError {
    /// `step` failed with the error it is given.
    pub(crate) fn at<E: std::error::Error + Send + Sync + 'static>(
        step: &'static str,
    ) -> impl FnOnce(E) -> Self {
        move |e| Self::Failed(step, Box::new(e))
    }
}

/// What one update cost.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct SyncReport {
    /// From the pause call to the end of the resume call: engines produced nothing meanwhile.
    pub paused: Duration,
    /// The transfer alone (start to finish of the weight update).
    pub transfer: Duration,
    pub bytes: usize,
    pub buckets: usize,
}

impl SyncReport {
    /// Counts one bucket sent (or written).
    fn count(&mut self, bucket: &[(String, tch::Tensor)]) {
        self.buckets += 1;
        self.bytes += bucket.iter().map(|(_, t)| bytes_of(t)).sum::<usize>();
    }
}

/// The engine API's control calls (pause, resume, the weight-update routes) to a router, a
/// coordinator (whose router fans them out) or one engine; every transport drives updates with it.
#[derive(Debug, Clone)]
pub struct Control {
    http: reqwest::Client,
    target: String,
}

impl Control {
    pub fn new(target: &str) -> Self {
        Self {
            http: crate::auth::client(),
            target: target.trim_end_matches('/').to_string(),
        }
    }

    /// The router, coordinator or engine the calls go to.
    pub fn url(&self) -> &str {
        &self.target
    }

    /// `method path` with an optional JSON body: the answer's JSON (`null` when it has none or
    /// is not JSON), or the URL, status and body of a refusal.
    pub async fn request(
        &self,
        method: Method,
        path: &str,
        body: Option<&Value>,
    ) -> Result<Value, CallError> {
        let url = format!("{}{}", self.target, path);
        let mut req = self.http.request(method, &url);
        if let Some(body) = body {
            req = req.json(body);
        }
        match crate::auth::call(&url, req).await {
            Err(CallError::Answer { .. }) => Ok(Value::Null),
            answer => answer,
        }
    }

    /// `GET /<step>`, a failure named after `step`.
    pub async fn get(&self, step: &'static str) -> Result<Value> {
        let answer = self.request(Method::GET, &format!("/{step}"), None).await;
        answer.map_err(|e| SyncError::Call(step, e))
    }

    /// `POST /<step>` with `body`, a failure named after `step`.
    pub async fn post(&self, step: &'static str, body: Value) -> Result<Value> {
        let path = format!("/{step}");
        let answer = self.request(Method::POST, &path, Some(&body)).await;
        answer.map_err(|e| SyncError::Call(step, e))
    }

    /// Pauses every engine: `keep` freezes requests in flight (partial rollout), `wait` lets
    /// them finish under the old weights first.
    pub async fn pause(&self, partial_rollout: bool) -> Result<()> {
        let mode = if partial_rollout { "keep" } else { "wait" };
        let path = format!("/pause?mode={mode}");
        let answer = self.request(Method::POST, &path, None).await;
        answer.map(drop).map_err(|e| SyncError::Call("pause", e))
    }

    pub async fn resume(&self) -> Result<()> {
        let answer = self.request(Method::POST, "/resume", None).await;
        answer.map(drop).map_err(|e| SyncError::Call("resume", e))
    }

    /// One update whose engines may hold part of the new weights until it is done: pause
    /// (`keep` with partial rollout, else `wait`), `transfer` (which counts what it sent in the
    /// report it is given), then tell every engine, and the router in front of them (which then
    /// routes only to engines that have it), the version they now serve, and resume. A failed
    /// transfer leaves the engines paused rather than serving half-replaced weights
    /// (docs/weight-sync.md, "Weight transports"); the next update, or a restart, brings them to
    /// whole weights.
    pub async fn paused_update(
        &self,
        version: u64,
        partial_rollout: bool,
        transfer: impl std::future::Future<Output = Result<SyncReport>>,
    ) -> Result<SyncReport> {
        let paused_at = Instant::now();
        self.pause(partial_rollout).await?;
        let started = Instant::now();
        let mut report = transfer.await?;
        report.transfer = started.elapsed();
        let body = json!({"new_version": version.to_string()});
        let versioned = self.post("update_weight_version", body).await;
        let resumed = self.resume().await;
        report.paused = paused_at.elapsed();
        versioned?;
        resumed?;
        Ok(report)
    }
}
