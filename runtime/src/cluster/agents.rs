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

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::protocol::Lease;
use super::{env_path, post_json, retry};
use crate::agents::{AgentPool, EpisodeStatus, PoolOptions};
use crate::config::Sources;
use crate::error::RunError;

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

/// This pod's `/metrics`: episodes finished, by status, and running.
#[derive(Debug, Clone, Default)]
struct Counts {
    finished: Family<[(&'static str, &'static str); 1], Counter>,
    running: Gauge,
}

/// Runs the agent pod's workers until `shutdown`.
pub async fn run(
    opts: AgentsProcessOptions,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), RunError> {
    let (mut run, _) = super::manifest(&opts.config)?;
    if !opts.command.is_empty() {
        run.spec.agent.command = opts.command.clone();
    }
    let model_dir = env_path("MOULT_MODEL").unwrap_or_else(|| PathBuf::from(&run.spec.model.path));
    // The agent's relative paths are the image's: from the working directory.
    let dir = std::env::current_dir().map_err(|source| RunError::Start {
        what: "the working directory".into(),
        source,
    })?;
    let cfg = super::pod_config(
        run,
        &Sources {
            dir,
            model_dir: Some(model_dir.clone()),
            tasks: None,
            eval_tasks: None,
            judge: None,
            agent: true,
            teacher: None,
        },
    )?;
    let concurrency = match std::env::var("MOULT_CONCURRENCY") {
        Ok(v) if !v.trim().is_empty() => v
            .trim()
            .parse::<usize>()
            .ok()
            .filter(|n| *n > 0)
            .ok_or_else(|| RunError::Env {
                name: "MOULT_CONCURRENCY".into(),
                problem: format!("must be a whole number above 0; got `{v}`"),
            })?,
        _ => cfg.concurrency,
    };
    let coordinator = opts.coordinator.trim_end_matches('/').to_string();
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0))
        .await
        .map_err(|source| RunError::Start {
            what: "binding 127.0.0.1".into(),
            source,
        })?;
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    let scratch_dir = std::env::temp_dir().join(format!("moult-agents-{}", std::process::id()));
    let agent = cfg
        .agent
        .clone()
        .ok_or_else(|| RunError::Setup("the run config has no agent".into()))?;
    let pool_opts = PoolOptions {
        concurrency,
        timeout: cfg.episode_timeout,
        loopback_url: String::new(),
        env_loop: cfg.env_loop.clone(),
        scratch_dir,
    };
    let model = (model_dir.as_path(), cfg.name.clone());
    let stop = stopped(stop_rx.clone());
    let pool = AgentPool::serve(&coordinator, model, agent, pool_opts, listener, stop)?;
    let counts = Counts::default();
    let mut registry = Registry::default();
    let (finished, running) = (counts.finished.clone(), counts.running.clone());
    registry.register(
        "moult_agents_episodes",
        "Episodes finished by this pod",
        finished,
    );
    registry.register(
        "moult_agents_running",
        "Episodes running in this pod",
        running,
    );
    super::serve_health(
        &opts.metrics_addr,
        Arc::new(registry),
        stopped(stop_rx.clone()),
    )
    .await?;
    eprintln!(
        "moult agents: {} episodes at once for {}, loopback {}, coordinator {coordinator}",
        concurrency,
        cfg.name,
        pool.loopback_url()
    );
    let http = super::coordinator_client();
    // The leases of the episodes running here, renewed every few seconds so that the coordinator
    // knows this pod is alive (and gives them to another pod soon after it is not).
    let held = Arc::new(std::sync::Mutex::new(
        std::collections::BTreeSet::<u64>::new(),
    ));
    let renewer = {
        let (http, url, held) = (
            http.clone(),
            format!("{coordinator}/v1/agents/renew"),
            held.clone(),
        );
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(RENEW_EVERY).await;
                let leases: Vec<u64> = held.lock().expect("lease set").iter().copied().collect();
                if leases.is_empty() {
                    continue;
                }
                if let Err(e) =
                    post_json(&http, &url, &serde_json::json!({ "leases": leases })).await
                {
                    tracing::warn!("renewing {} leases: {e}", leases.len());
                }
            }
        })
    };
    let draining = tokio::sync::watch::channel(false);
    let mut workers = tokio::task::JoinSet::new();
    for _ in 0..concurrency {
        let (pool, http, coordinator, counts, held) = (
            pool.clone(),
            http.clone(),
            coordinator.clone(),
            counts.clone(),
            held.clone(),
        );
        let mut draining = draining.1.clone();
        workers.spawn(async move {
            loop {
                let lease = tokio::select! {
                    lease = next_lease(&http, &coordinator) => lease,
                    _ = draining.wait_for(|d| *d) => return,
                };
                held.lock().expect("lease set").insert(lease.lease);
                counts.running.inc();
                let episode = pool.episode(lease.index, lease.task, lease.sampling).await;
                counts.running.dec();
                let status = match episode.status {
                    EpisodeStatus::Completed => "completed",
                    EpisodeStatus::Failed => "failed",
                };
                counts.finished.get_or_create(&[("status", status)]).inc();
                let url = format!("{coordinator}/v1/agents/episodes/{}", lease.lease);
                let answer = retry(&format!("returning episode {}", lease.index), || {
                    post_json(&http, &url, &episode)
                })
                .await;
                held.lock().expect("lease set").remove(&lease.lease);
                if answer["accepted"] == false {
                    tracing::warn!(
                        episode = lease.index,
                        "the coordinator had given episode {} to another pod (its lease expired)",
                        lease.index
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
    let running = counts.running.get();
    eprintln!("moult agents: stopping; finishing {running} running episodes");
    let drained = tokio::time::timeout(DRAIN_FOR, async {
        while workers.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        eprintln!("moult agents: episodes still running after {DRAIN_FOR:?}: abandoned");
    }
    workers.shutdown().await;
    renewer.abort();
    let _ = stop_tx.send(true);
    Ok(())
}

/// Leases the next episode, waiting (and retrying) as long as it takes.
async fn next_lease(http: &reqwest::Client, coordinator: &str) -> Lease {
    let url = format!("{coordinator}/v1/agents/lease");
    loop {
        let answer = retry(&format!("POST {url}"), || async {
            let r = http
                .post(&url)
                .send()
                .await
                .map_err(|e| format!("{url}: {e}"))?;
            let status = r.status();
            if status == reqwest::StatusCode::NO_CONTENT {
                return Ok(None);
            }
            let text = r.text().await.map_err(|e| format!("{url}: {e}"))?;
            if !status.is_success() {
                return Err(format!("{url}: {status}: {text}"));
            }
            serde_json::from_str::<Lease>(&text)
                .map(Some)
                .map_err(|e| format!("{url}: not a lease: {e}"))
        })
        .await;
        if let Some(lease) = answer {
            return lease;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
