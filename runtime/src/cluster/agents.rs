//! `moult agents --config F --coordinator URL [-- COMMAND...]`: an agent pod of a cluster run.
//!
//! It serves the loopback server on 127.0.0.1 (generating through the coordinator's router, with
//! the run's token) and runs `MOULT_CONCURRENCY` workers, each leasing an episode from the
//! coordinator, running it with the agent pool (the same [`AgentPool`] as `moult run`: the
//! manifest's agent, or COMMAND when given) and returning it. A coordinator that is away is
//! waited for; an episode whose answer cannot be delivered is retried until the coordinator
//! takes it (or says the lease expired, when it went to another pod). The leases of running
//! episodes are renewed every 5 s; a pod that is stopped (SIGTERM) leases nothing more and
//! finishes and returns its running episodes for up to 25 s.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use std::future::pending;

use futures::FutureExt;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use serde_json::Value;

use super::protocol::{Lease, Leases};
use super::{env_number, env_path, retry, Coordinator};
use crate::agents::{AgentPool, EpisodeStatus};
use crate::config::{RunConfig, Sources};
use crate::error::{Result, RunError};

/// How often the leases of running episodes are renewed (well within the coordinator's lease time).
const RENEW_EVERY: Duration = Duration::from_secs(5);
/// How long a stopping pod finishes its running episodes (within Kubernetes' default 30 s grace).
const DRAIN_FOR: Duration = Duration::from_secs(25);

/// How `moult agents` runs in a pod.
#[derive(Debug, Clone)]
pub struct AgentsProcessOptions {
    pub config: PathBuf,
    pub coordinator: String,
    /// The agent's command, overriding the manifest's `spec.agent.command`.
    pub command: Vec<String>,
    /// `/health` and `/metrics` listen here.
    pub metrics_addr: String,
}

/// Runs the agent pod's workers until `shutdown`.
pub async fn run(
    opts: AgentsProcessOptions,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<()> {
    let (mut run, _) = super::manifest(&opts.config)?;
    if !opts.command.is_empty() {
        run.spec.agent.command = opts.command.clone();
    }
    let model_dir = env_path("MOULT_MODEL").unwrap_or_else(|| PathBuf::from(&run.spec.model.path));
    // The agent's relative paths are the image's: from the working directory.
    let dir = std::env::current_dir().map_err(RunError::start("the working directory"))?;
    let sources = Sources {
        dir,
        model_dir: Some(model_dir.clone()),
        agent: true,
        ..Sources::default()
    };
    let cfg = RunConfig::from_sources(run, &sources)?;
    let concurrency = env_number("MOULT_CONCURRENCY", cfg.concurrency as u64, 1)? as usize;
    let coordinator = Coordinator::new(&opts.coordinator);
    let listener = super::bind("127.0.0.1:0", "binding 127.0.0.1".into()).await?;
    let scratch_dir = std::env::temp_dir().join(format!("moult-agents-{}", std::process::id()));
    let (agent, mut pool_opts) = cfg.agent_pool(concurrency, scratch_dir)?;
    // Model-written code in sandbox pods (spec.agent.sandbox), through a proxy on 127.0.0.1.
    let serve = |listener, app| drop(tokio::spawn(crate::serve::serve(listener, app, pending())));
    let jail = pool_opts.jail.as_mut();
    let sandboxes = moult_sandbox_pods::from_env(crate::auth::agent_token(), serve, jail).await;
    pool_opts.sandboxes = sandboxes.map_err(RunError::Setup)?;
    let model = (model_dir.as_path(), cfg.name.clone());
    // The loopback server stops when this function returns (its sender goes).
    let (_stop_loopback, stop) = tokio::sync::oneshot::channel::<()>();
    let stop = stop.map(drop);
    let pool = AgentPool::serve(&coordinator.url, model, agent, pool_opts, listener, stop)?;
    // This pod's `/metrics`: episodes finished, by status, and running.
    let finished = Family::<[(&'static str, &'static str); 1], Counter>::default();
    let running = Gauge::<i64, std::sync::atomic::AtomicI64>::default();
    let mut registry = Registry::default();
    let help = "Episodes finished by this pod";
    registry.register("moult_agents_episodes", help, finished.clone());
    let help = "Episodes running in this pod";
    registry.register("moult_agents_running", help, running.clone());
    let _health = super::serve_health(&opts.metrics_addr, registry).await?;
    let (name, loopback, url) = (&cfg.name, pool.loopback_url(), &coordinator.url);
    eprintln!(
        "moult agents: {concurrency} episodes at once for {name}, loopback {loopback}, coordinator {url}"
    );
    // The leases of the episodes running here, renewed every few seconds so that the coordinator
    // knows this pod is alive (and gives them to another pod soon after it is not).
    let held = Arc::new(Mutex::new(BTreeSet::<String>::new()));
    let renewer = {
        let (coordinator, held) = (coordinator.clone(), held.clone());
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(RENEW_EVERY).await;
                let leases: Vec<String> = held.lock().expect("lease set").iter().cloned().collect();
                if leases.is_empty() {
                    continue;
                }
                let n = leases.len();
                let renew = Leases { leases };
                if let Err(e) = coordinator.send::<Value>("/v1/agents/renew", &renew).await {
                    tracing::warn!("renewing {n} leases: {e}");
                }
            }
        })
    };
    let draining = tokio::sync::watch::channel(false);
    let mut workers = tokio::task::JoinSet::new();
    for _ in 0..concurrency {
        let (pool, coordinator, held) = (pool.clone(), coordinator.clone(), held.clone());
        let (finished, running) = (finished.clone(), running.clone());
        let mut draining = draining.1.clone();
        workers.spawn(async move {
            loop {
                let lease = tokio::select! {
                    lease = next_lease(&coordinator) => lease,
                    _ = draining.wait_for(|d| *d) => return,
                };
                held.lock().expect("lease set").insert(lease.lease.clone());
                running.inc();
                let episode = pool.episode(lease.index, lease.task, lease.sampling).await;
                running.dec();
                let status = match episode.status {
                    EpisodeStatus::Completed => "completed",
                    EpisodeStatus::Failed => "failed",
                };
                finished.get_or_create(&[("status", status)]).inc();
                let (path, index) = (format!("/v1/agents/episodes/{}", lease.lease), lease.index);
                let what = format!("returning episode {index}");
                let answer: Value = retry(&what, || coordinator.send(&path, &episode)).await;
                held.lock().expect("lease set").remove(&lease.lease);
                if answer["accepted"] == false {
                    tracing::warn!(
                        episode = index,
                        "the coordinator had given episode {index} to another pod (its lease expired)"
                    );
                }
                if *draining.borrow() {
                    return;
                }
            }
        });
    }
    shutdown.await;
    // Drain: lease nothing more, finish and return the episodes running (for a while; what is
    // still running then is abandoned, and its leases expire and go to other pods).
    let _ = draining.0.send(true);
    let n = running.get();
    eprintln!("moult agents: stopping; finishing {n} running episodes");
    let drained = tokio::time::timeout(DRAIN_FOR, async {
        while workers.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        eprintln!("moult agents: episodes still running after {DRAIN_FOR:?}: abandoned");
    }
    workers.shutdown().await;
    renewer.abort();
    Ok(())
}

/// Leases the next episode, waiting (and retrying) as long as it takes.
async fn next_lease(coordinator: &Coordinator) -> Lease {
    loop {
        if let Some(lease) = coordinator.post("/v1/agents/lease", &()).await {
            return lease;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
