//! `moult agents --config F --coordinator URL [-- COMMAND...]`: an agent pod of a cluster run.
//!
//! It serves the loopback server on 127.0.0.1 (generating through the coordinator's router, with
//! the run's token) and runs `MOULT_CONCURRENCY` workers, each leasing an episode from the
//! coordinator, running it with the agent pool (the same [`AgentPool`] as `moult run`: the
//! manifest's agent, or COMMAND when given) and returning it. A coordinator that is away is
//! waited for; an episode whose answer cannot be delivered is retried until the coordinator
//! takes it (or says the lease expired, when it went to another pod).

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::protocol::Lease;
use super::{env_path, post_json, retry};
use crate::agents::{AgentPool, EpisodeStatus, PoolOptions};
use crate::chat::{ChatTemplate, Tokenizer};
use crate::loopback::{ChatService, EngineClient, ServiceOptions};
use crate::run::config::Sources;
use crate::run::RunError;

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

#[derive(Debug, Default)]
struct Counts {
    completed: AtomicU64,
    failed: AtomicU64,
    running: AtomicU64,
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
    let dir = std::env::current_dir()
        .map_err(|e| RunError::Setup(format!("the working directory: {e}")))?;
    let cfg = super::pod_config(
        run,
        &Sources {
            dir,
            model_dir: Some(model_dir.clone()),
            tasks: None,
            agent: true,
        },
    )?;
    let concurrency = match std::env::var("MOULT_CONCURRENCY") {
        Ok(v) if !v.trim().is_empty() => v
            .trim()
            .parse::<usize>()
            .ok()
            .filter(|n| *n > 0)
            .ok_or_else(|| {
                RunError::Setup(format!(
                    "MOULT_CONCURRENCY must be a whole number above 0; got `{v}`"
                ))
            })?,
        _ => cfg.concurrency,
    };
    let coordinator = opts.coordinator.trim_end_matches('/').to_string();
    let setup = |e: &dyn std::fmt::Display| RunError::Setup(e.to_string());
    let service = Arc::new(ChatService::new(
        EngineClient::new(&coordinator),
        Tokenizer::from_model_dir(&model_dir).map_err(|e| setup(&e))?,
        ChatTemplate::from_model_dir(&model_dir).map_err(|e| setup(&e))?,
        ServiceOptions {
            max_sessions: concurrency * 2,
            model_name: cfg.name.clone(),
        },
    ));
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0))
        .await
        .map_err(|e| setup(&format!("binding 127.0.0.1: {e}")))?;
    let loopback_url = format!("http://{}", listener.local_addr().map_err(|e| setup(&e))?);
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let stopped = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    tokio::spawn(crate::loopback::serve(
        listener,
        service.clone(),
        crate::loopback::DEFAULT_MAX_BODY_BYTES,
        stopped(stop_rx.clone()),
    ));
    let scratch_dir = std::env::temp_dir().join(format!("moult-agents-{}", std::process::id()));
    let agent = cfg
        .agent
        .clone()
        .ok_or_else(|| RunError::Setup("the run config has no agent".into()))?;
    let pool = Arc::new(
        AgentPool::new(
            service,
            agent,
            PoolOptions {
                concurrency,
                timeout: cfg.episode_timeout,
                loopback_url: loopback_url.clone(),
                env_loop: cfg.env_loop.clone(),
                scratch_dir,
            },
        )
        .map_err(|e| setup(&e))?,
    );
    let counts = Arc::new(Counts::default());
    let metrics = {
        let c = counts.clone();
        Arc::new(move || {
            format!(
                "# HELP moult_agents_episodes Episodes finished by this pod.\n# TYPE moult_agents_episodes counter\nmoult_agents_episodes_total{{status=\"completed\"}} {}\nmoult_agents_episodes_total{{status=\"failed\"}} {}\n# HELP moult_agents_running Episodes running in this pod.\n# TYPE moult_agents_running gauge\nmoult_agents_running {}\n# EOF\n",
                c.completed.load(Ordering::Relaxed),
                c.failed.load(Ordering::Relaxed),
                c.running.load(Ordering::Relaxed),
            )
        })
    };
    super::serve_health(&opts.metrics_addr, metrics, stopped(stop_rx.clone())).await?;
    eprintln!(
        "moult agents: {} episodes at once for {}, loopback {loopback_url}, coordinator {coordinator}",
        concurrency, cfg.name
    );
    let http = crate::auth::client();
    let mut workers = tokio::task::JoinSet::new();
    for _ in 0..concurrency {
        let (pool, http, coordinator, counts) = (
            pool.clone(),
            http.clone(),
            coordinator.clone(),
            counts.clone(),
        );
        workers.spawn(async move {
            loop {
                let lease = next_lease(&http, &coordinator).await;
                counts.running.fetch_add(1, Ordering::Relaxed);
                let episode = pool.episode(lease.index, lease.task).await;
                counts.running.fetch_sub(1, Ordering::Relaxed);
                match episode.status {
                    EpisodeStatus::Completed => &counts.completed,
                    EpisodeStatus::Failed => &counts.failed,
                }
                .fetch_add(1, Ordering::Relaxed);
                let url = format!("{coordinator}/v1/agents/episodes/{}", lease.lease);
                let answer = retry(&format!("returning episode {}", lease.index), || {
                    post_json(&http, &url, &episode)
                })
                .await;
                if answer["accepted"] == false {
                    tracing::warn!(
                        episode = lease.index,
                        "the coordinator had given episode {} to another pod (its lease expired)",
                        lease.index
                    );
                }
            }
        });
    }
    shutdown.await;
    // Episodes in flight are abandoned: their leases expire and other pods run them.
    workers.shutdown().await;
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
