//! Cluster mode (docs/architecture.md): each role of a run as its own process, in the pods the
//! operator makes, wired over the network with the run's token ([`crate::auth`]).
//!
//! - `moult coordinator` ([`coordinator`]): the router in front of the engines it finds through
//!   the engine Service's EndpointSlices ([`discovery`]), the rollout pool and its data cursor,
//!   the queue of episodes the agent pods lease ([`remote`]), the batches the trainer takes, the
//!   issue of policy versions, and the RLRun's status ([`status`]).
//! - `moult trainer` ([`trainer`]): takes batch N, trains, publishes the weights to the engines
//!   through the coordinator's router (pause, TCP weight stream, resume), checkpoints, commits
//!   step N. Restarted, it resumes from its newest checkpoint and republishes.
//! - `moult agents` ([`agents`]): leases episodes, runs them with the agent pool against its own
//!   loopback server (which generates through the coordinator's router), returns them.
//! - `moult engine`: the built-in engine (or vLLM), unchanged.
//!
//! The wire types are in [`protocol`]. What crosses the network is never lost or doubled: a
//! batch stays with the coordinator until the trainer commits its step (a restarted trainer gets
//! the same groups again), an episode's lease is re-queued when its agent pod goes silent and a
//! late answer to an expired lease is ignored, and every call is retried until its peer is back.

pub mod agents;
pub mod coordinator;
pub mod discovery;
pub mod protocol;
pub mod remote;
pub mod status;
#[cfg(feature = "torch")]
pub mod trainer;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use moult_operator::api::RLRun;
use prometheus_client::registry::Registry;
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::net::TcpListener;
use tokio::sync::oneshot;

use crate::auth::{call, CallError};
use crate::config::read_manifest;
use crate::error::{Result, RunError};

/// A required environment variable; the error names it and who sets it.
pub(crate) fn env_var(name: &str) -> Result<String> {
    let problem = "is not set: the operator sets it in the pod spec (set it by hand to run this role outside a cluster)";
    let set = std::env::var(name).ok().filter(|v| !v.trim().is_empty());
    set.ok_or_else(|| RunError::env(name, problem))
}

/// An optional path from the environment.
pub(crate) fn env_path(name: &str) -> Option<PathBuf> {
    std::env::var_os(name)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
}

/// A whole number of at least `min` from the environment; `default` when it is not set.
pub(crate) fn env_number(name: &str, default: u64, min: u64) -> Result<u64> {
    let v = std::env::var(name).unwrap_or_default();
    if v.trim().is_empty() {
        return Ok(default);
    }
    let above = (min > 0).then(|| format!(" above {}", min - 1));
    let above = above.unwrap_or_default();
    let n = v.trim().parse().ok().filter(|n| *n >= min);
    n.ok_or_else(|| RunError::env(name, format!("must be a whole number{above}; got `{v}`")))
}

/// `path` (beside the manifest), or where the operator mounted it: the path in the environment
/// variable `name`.
pub(crate) fn mounted(name: &str, path: Option<PathBuf>) -> Option<PathBuf> {
    path.map(|p| env_path(name).unwrap_or(p))
}

/// A listener on `addr`; `what` names it in the error.
pub(crate) async fn bind(addr: &str, what: String) -> Result<TcpListener> {
    let bound = TcpListener::bind(addr).await;
    bound.map_err(RunError::start(what))
}

/// The manifest at `config` and its folder.
pub(crate) fn manifest(config: &Path) -> Result<(RLRun, PathBuf)> {
    let dir = config.parent().map_or(PathBuf::from("."), PathBuf::from);
    Ok((read_manifest(config)?, dir))
}

/// Retries `f` until it succeeds, waiting 0.5 s doubling to 10 s between tries and logging each
/// failure as `what`; for calls to a peer that may be restarting.
pub(crate) async fn retry<T, E: std::fmt::Display, F, Fut>(what: &str, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, E>>,
{
    let mut wait = Duration::from_millis(500);
    let mut tries = 0u32;
    loop {
        match f().await {
            Ok(v) => return v,
            Err(e) => {
                tries += 1;
                // The first failures of a peer that is starting are expected: keep quiet.
                if tries > 2 {
                    tracing::warn!(tries, "{what}: {e}; retrying in {wait:?}");
                }
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(Duration::from_secs(10));
            }
        }
    }
}

/// The longest any call of agents and the trainer to the coordinator may take: its calls are
/// short or long polls of a few seconds, or bodies of at most 256 MiB (docs/security.md); a
/// coordinator that answers nothing for this long is treated as down, and the call retried.
pub(crate) const COORDINATOR_CALL_TIMEOUT: Duration = Duration::from_secs(300);

/// The calls of agents and the trainer to the coordinator at `url`: this process's credential,
/// and at most [`COORDINATOR_CALL_TIMEOUT`] per call.
#[derive(Debug, Clone)]
pub(crate) struct Coordinator {
    http: reqwest::Client,
    pub url: String,
}

impl Coordinator {
    pub fn new(url: &str) -> Self {
        let http = crate::auth::client_builder().timeout(COORDINATOR_CALL_TIMEOUT);
        let http = crate::auth::build(http);
        let url = url.trim_end_matches('/').to_string();
        Self { http, url }
    }

    /// `POST path` with `body`, once ([`call`]).
    pub async fn send<T: DeserializeOwned>(
        &self,
        path: &str,
        body: &impl Serialize,
    ) -> Result<T, CallError> {
        let url = format!("{}{path}", self.url);
        call(&url, self.http.post(&url).json(body)).await
    }

    /// `POST path` with `body` until the coordinator takes it.
    pub async fn post<T: DeserializeOwned>(&self, path: &str, body: &impl Serialize) -> T {
        let what = format!("POST {}{path}", self.url);
        retry(&what, || self.send(path, body)).await
    }
}

/// A gauge of a role's `/metrics` (prometheus-client's, shared by its clones).
pub(crate) type Gauge = prometheus_client::metrics::gauge::Gauge<f64, std::sync::atomic::AtomicU64>;

/// Registers a new gauge `name` in `registry`; the gauge to set.
pub(crate) fn gauge(registry: &mut Registry, name: &str, help: &str) -> Gauge {
    let gauge = Gauge::default();
    registry.register(name, help, gauge.clone());
    gauge
}

/// The `/health` and `/metrics` server of a role that serves nothing else (trainer, agents); it
/// stops when the returned sender is dropped.
pub(crate) async fn serve_health(addr: &str, metrics: Registry) -> Result<oneshot::Sender<()>> {
    use axum::routing::get;
    let listener = bind(addr, format!("--metrics-addr {addr}")).await?;
    let metrics = Arc::new(metrics);
    let text = get(move || async move { crate::serve::metrics_text(&metrics) });
    let app = axum::Router::new()
        .route("/health", get(|| async { "ok" }))
        .route("/metrics", text);
    let (stop, stopped) = oneshot::channel::<()>();
    let app = crate::auth::protect(app);
    tokio::spawn(crate::serve::serve(listener, app, stopped.map(drop)));
    Ok(stop)
}
