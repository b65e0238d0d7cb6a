//! Agents (docs/agents.md) and the agent pool that runs their episodes.
//!
//! - [`env`]: the `Env` form (Gymnasium-shaped; the framework owns the LLM loop), as a Rust trait
//!   with built-in envs;
//! - [`process`]: agents that are programs: a `ChatAgent` process per episode (the user's own
//!   loop against the loopback server), external envs over JSON lines, and the embedded Python
//!   package that runs a module exporting `AgentRunner`;
//! - [`AgentPool`]: many episodes at once under a concurrency limit and a per-episode timeout. A
//!   crashed, failing or timed-out agent yields a failed [`Episode`] with its reason, never a stuck
//!   pool; its session is closed, which stops its engine requests. An external env process whose
//!   episode completed serves a later one (`reset` starts it), which saves starting an
//!   interpreter per episode; one whose episode failed or timed out is killed, never reused.

pub mod env;
pub mod process;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value as Json};
use tokio::sync::{mpsc, Semaphore};

use moult_jail::Jail;

use crate::chat::SamplingOverride;
use crate::loopback::{self, ChatService, Segment, ServiceOptions};
use env::{run_env_episode, EnvLoopOptions};
use process::{run_chat_agent, AgentCommand, ExternalEnv};

/// Why an episode failed, or a pool could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("{0}")]
    Config(String),
    /// The agent process crashed, exited non-zero or reported nothing.
    #[error("{0}")]
    Crashed(String),
    /// The environment refused or failed a call.
    #[error("env: {0}")]
    Env(String),
    /// Generating the model's reply failed.
    #[error("model: {0}")]
    Model(String),
    #[error("timed out after {0:?} (agent.timeout)")]
    TimedOut(Duration),
    /// The policy's tokenizer or chat template could not be read.
    #[error("{0}")]
    ModelDir(#[from] crate::loopback::service::ModelDirError),
    /// The loopback server's socket.
    #[error("the loopback server: {0}")]
    Loopback(#[from] std::io::Error),
}

/// The agents' results: an [`AgentError`] unless said otherwise.
pub type Result<T, E = AgentError> = std::result::Result<T, E>;

/// Which agent the pool runs.
#[derive(Debug, Clone)]
pub enum Agent {
    /// A built-in Rust env, by name.
    BuiltinEnv(String),
    /// An env in another process (JSON lines); a process serves episodes one after another.
    ExternalEnv(AgentCommand),
    /// The user's program, one process per episode.
    Chat(AgentCommand),
}

impl Agent {
    /// The agent a built-in env's name stands for (`agent.env`, `builtin:NAME` on the command
    /// line): `math` runs through moult's Python runner, the others in-process.
    pub fn builtin(name: &str) -> Result<Self> {
        match name {
            "math" => AgentCommand::python("python3", "moult.math").map(Agent::ExternalEnv),
            other => env::builtin(other).map(|_| Agent::BuiltinEnv(other.to_string())),
        }
    }
}

/// Settings of an agent pool.
#[derive(Debug, Clone, Default)]
pub struct PoolOptions {
    /// Episodes running at once.
    pub concurrency: usize,
    /// Wall-clock limit of one episode.
    pub timeout: Duration,
    /// The loopback server's address (`http://127.0.0.1:PORT`), handed to ChatAgents.
    pub loopback_url: String,
    pub env_loop: EnvLoopOptions,
    /// Where ChatAgents write their results.
    pub scratch_dir: PathBuf,
    /// The jail each episode's program starts in (`agent.isolation: Episode`); `None`: a process
    /// group (docs/security.md#episodes).
    pub jail: Option<Jail>,
    /// Where episodes' `moult.sandbox.run` calls go on a cluster with `spec.agent.sandbox`: a
    /// sandbox pod each (docs/security.md#sandbox-pods); `None`: a jail of their own here.
    pub sandboxes: Option<Arc<moult_sandbox_pods::Proxy>>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EpisodeStatus {
    Completed,
    Failed,
}

/// One finished episode: its reward and the exact token segments it recorded.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Episode {
    pub index: usize,
    pub session: String,
    pub task: Json,
    pub status: EpisodeStatus,
    /// Why it failed (crash, timeout, env error).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    pub reward: f64,
    #[serde(default)]
    pub info: Map<String, Json>,
    pub seconds: f64,
    pub segments: Vec<Segment>,
}

/// Runs episodes against one loopback service.
#[derive(Debug)]
pub struct AgentPool {
    service: Arc<ChatService>,
    agent: Agent,
    opts: PoolOptions,
    slots: Arc<Semaphore>,
    /// External env processes whose last episode completed, ready for the next one. At most
    /// `concurrency`: a pool keeps no more processes than it runs episodes at once.
    idle_envs: Mutex<Vec<ExternalEnv>>,
}

impl AgentPool {
    pub fn new(service: Arc<ChatService>, agent: Agent, opts: PoolOptions) -> Result<Self> {
        if opts.concurrency == 0 {
            return Err(AgentError::Config("concurrency must be at least 1".into()));
        }
        if let Agent::BuiltinEnv(name) = &agent {
            env::builtin(name)?;
        } else if let Some(jail) = &opts.jail {
            jail.probe(process::sandbox()).map_err(|why| AgentError::Config(format!("agent.isolation is `Episode`, but {why}: set `agent.isolation: Process` (`moult agents --isolation process`) to run agent programs without a jail of their own (docs/security.md#episodes)")))?;
        }
        std::fs::create_dir_all(&opts.scratch_dir).map_err(|e| {
            AgentError::Config(format!("cannot create {}: {e}", opts.scratch_dir.display()))
        })?;
        Ok(Self {
            service,
            slots: Arc::new(Semaphore::new(opts.concurrency)),
            idle_envs: Mutex::new(Vec::new()),
            agent,
            opts,
        })
    }

    /// A pool whose agents talk to a loopback server of their own on `listener` (127.0.0.1), in
    /// front of the engine (or router) at `engine`, rendering with `model_dir`'s tokenizer and
    /// chat template under the model name `name`; the server runs until `shutdown`, and
    /// `opts.loopback_url` becomes its address.
    pub fn serve(
        engine: &str,
        (model_dir, name): (&Path, String),
        agent: Agent,
        mut opts: PoolOptions,
        listener: tokio::net::TcpListener,
        shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> Result<Arc<Self>> {
        // Sessions of running episodes, plus those closing.
        let sessions = ServiceOptions::pool(opts.concurrency * 2, name);
        let service = Arc::new(ChatService::from_model_dir(engine, model_dir, sessions)?);
        let addr = listener.local_addr()?;
        opts.loopback_url = format!("http://{addr}");
        // Episodes' jails may reach the loopback server.
        opts.jail.iter_mut().for_each(|j| j.ports.push(addr.port()));
        let app = loopback::router(service.clone(), loopback::DEFAULT_MAX_BODY_BYTES);
        tokio::spawn(crate::serve::serve(listener, app, shutdown));
        Ok(Arc::new(Self::new(service, agent, opts)?))
    }

    /// The loopback server's address its agents are given.
    pub fn loopback_url(&self) -> &str {
        &self.opts.loopback_url
    }

    /// Runs every task; episodes arrive as they finish (not in task order).
    pub fn run(self: Arc<Self>, tasks: Vec<Json>) -> mpsc::Receiver<Episode> {
        // Finished episodes buffered before the consumer reads them: one per running episode is
        // enough to never stall a finished one.
        let (tx, rx) = mpsc::channel(self.opts.concurrency.max(1));
        tokio::spawn(async move {
            for (index, task) in tasks.into_iter().enumerate() {
                // In task order: each episode starts once a slot is free, and holds it.
                let slot = self.slot().await;
                let (pool, tx) = (self.clone(), tx.clone());
                tokio::spawn(async move {
                    let episode = pool.episode_in(slot, index, task, None).await;
                    let _ = tx.send(episode).await;
                });
            }
        });
        rx
    }

    async fn slot(&self) -> tokio::sync::OwnedSemaphorePermit {
        let slots = self.slots.clone();
        let permit = slots.acquire_owned().await;
        permit.expect("the pool's semaphore is never closed")
    }

    /// Runs one episode to its end, whatever happens to the agent; with `sampling`, every turn
    /// samples that way (an evaluation episode). At most `concurrency` episodes run at once,
    /// whoever asks for them (training and evaluation share the slots); the episode's time
    /// limit counts from when it gets one.
    pub async fn episode(
        &self,
        index: usize,
        task: Json,
        sampling: Option<SamplingOverride>,
    ) -> Episode {
        let slot = self.slot().await;
        self.episode_in(slot, index, task, sampling).await
    }

    /// [`Self::episode`] in the slot `_slot`, held until it ends.
    async fn episode_in(
        &self,
        _slot: tokio::sync::OwnedSemaphorePermit,
        index: usize,
        task: Json,
        sampling: Option<SamplingOverride>,
    ) -> Episode {
        let session = format!("ep{index}-{}", loopback::random_id());
        let started = Instant::now();
        let timeout = self.opts.timeout;
        let outcome = match self.service.open(&session, sampling) {
            Ok(()) => tokio::time::timeout(timeout, self.play(&session, &task))
                .await
                .unwrap_or(Err(AgentError::TimedOut(timeout))),
            Err(e) => Err(AgentError::Crashed(format!(
                "the loopback session could not be opened: {e}"
            ))),
        };
        // Closing the session cancels a turn still running (a killed agent's, a timed-out one's).
        let segments = self.service.take(&session).await.unwrap_or_default();
        let (status, reason, reward, info) = match outcome {
            Ok((reward, info)) => (EpisodeStatus::Completed, None, reward, info),
            Err(e) => (EpisodeStatus::Failed, Some(e.to_string()), 0.0, Map::new()),
        };
        Episode {
            index,
            session,
            task,
            status,
            reason,
            reward,
            info,
            seconds: started.elapsed().as_secs_f64(),
            segments,
        }
    }

    async fn play(&self, session: &str, task: &Json) -> Result<(f64, Map<String, Json>)> {
        let env_loop = &self.opts.env_loop;
        // The episode's sandbox pod, released when this returns.
        let (pod, pod_vars) = moult_sandbox_pods::lease(self.opts.sandboxes.as_ref(), task);
        match &self.agent {
            Agent::BuiltinEnv(name) => {
                let mut env = env::builtin(name)?;
                run_env_episode(&self.service, session, env.as_mut(), task, env_loop).await
            }
            Agent::ExternalEnv(cmd) => {
                let idle = self.idle_envs.lock().expect("idle envs lock").pop();
                let mut env = match idle {
                    Some(env) => env,
                    None => {
                        ExternalEnv::spawn(&cmd.with_env(pod_vars), self.jail(task, None)).await?
                    }
                };
                // An error or a timeout drops (kills) the process here; only a completed episode
                // hands it back.
                let out = run_env_episode(&self.service, session, &mut env, task, env_loop).await?;
                let mut idle = self.idle_envs.lock().expect("idle envs lock");
                // A jailed process serves one episode: the next one gets a fresh jail (and a
                // fresh sandbox pod).
                if idle.len() < self.opts.concurrency && self.opts.jail.is_none() && pod.is_none() {
                    idle.push(env);
                }
                Ok(out)
            }
            Agent::Chat(cmd) => {
                let base = &self.opts.loopback_url;
                let openai = format!("{base}/s/{session}/v1");
                let anthropic = format!("{base}/s/{session}");
                let vars = [
                    ("MOULT_SESSION_ID", session.to_string()),
                    ("MOULT_OPENAI_BASE_URL", openai.clone()),
                    ("MOULT_ANTHROPIC_BASE_URL", anthropic.clone()),
                    ("MOULT_MODEL", self.service.model_name().to_string()),
                    // Unmodified SDK clients pick these up.
                    ("OPENAI_BASE_URL", openai),
                    ("OPENAI_API_KEY", "moult".into()),
                    ("ANTHROPIC_BASE_URL", anthropic),
                    ("ANTHROPIC_API_KEY", "moult".into()),
                ];
                let vars = vars.map(|(k, v)| (k.to_string(), v));
                let vars = vars.into_iter().chain(pod_vars);
                let dir = self.opts.scratch_dir.join(session);
                let jail = self.jail(task, Some(&dir));
                run_chat_agent(cmd, vars.collect(), task, &dir, jail.as_ref()).await
            }
        }
    }

    /// The jail of an episode of `task`, when the pool jails them: it may write `writable` and
    /// reach the pool's ports (the loopback server's, the sandbox pods' proxy's) and those the
    /// task lists in `ports`.
    fn jail(&self, task: &Json, writable: Option<&Path>) -> Option<Jail> {
        let mut jail = self.opts.jail.clone()?;
        jail.writable.extend(writable.map(Path::to_path_buf));
        let listed = task["ports"].as_array().into_iter().flatten();
        jail.ports
            .extend(listed.filter_map(|p| u16::try_from(p.as_u64()?).ok()));
        Some(jail)
    }
}
