//! `moult trainer`: one trainer rank of a cluster run. It resumes from the newest checkpoint on
//! its volume (`MOULT_CHECKPOINTS`), says hello to the coordinator (`MOULT_COORDINATOR`), and
//! then for each step: takes the batch and hands it to the [`Learner`] (the same code as `moult
//! run`), which trains, publishes the weights to the engines through the coordinator's router
//! under a version the coordinator issues (over the run's weight transport: the TCP stream from
//! `POD_IP`, the shared folder at `MOULT_WEIGHTS_DIR`, or NCCL), writes `metrics.jsonl` and
//! checkpoints beside its checkpoints; then it commits the step.
//!
//! A stopped trainer (SIGTERM: a suspend, a preemption, a drain) checkpoints the last step it
//! trained before it exits; a killed one loses at most the steps since its last checkpoint.
//! Restarted, it loads the newest checkpoint, publishes those weights under a new version (versions only increase), and trains
//! on. Every call to the coordinator is retried until it answers.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use futures::FutureExt;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use moult_operator::api::CheckpointStatus;
use prometheus_client::registry::Registry;
use serde::{de::DeserializeOwned, Serialize};
use serde_json::Value;
use tch::Device;
use tokio_util::sync::CancellationToken;

use super::protocol::{Commit, Hello, HelloReply, Quarantined, Version};
use super::{env_number, env_path, env_var, mounted, retry, Coordinator, Gauge};
use crate::auth::CallError;
use crate::config::{RunConfig, Sources};
use crate::dist::Rendezvous;
use crate::error::{Result, RunError};
use crate::learner::steps::{run_steps, Steps, Trained};
use crate::learner::{Followers, Learner};
use crate::records::console::Console;
use crate::rollout::{EpisodeLimits, RolloutState};
use crate::stages::{self, StepBatch};
use crate::weight_sync::publish::PublishOptions;

/// The trainer's `/metrics`.
struct Gauges {
    step: Gauge,
    version: Gauge,
    busy: Gauge,
    engine_busy: Gauge,
}

impl Gauges {
    fn register(registry: &mut Registry) -> Self {
        let mut gauge = |name, help| super::gauge(registry, name, help);
        let version = "Version of the weights last published";
        let busy = "Fraction of the last step's wall-clock the trainer computed";
        let engine_busy = "Fraction of the last step's wall-clock the engines had work";
        Self {
            step: gauge("moult_trainer_step", "Training steps done"),
            version: gauge("moult_trainer_policy_version", version),
            busy: gauge("moult_trainer_busy_fraction", busy),
            engine_busy: gauge("moult_trainer_engine_busy_fraction", engine_busy),
        }
    }
}

/// How often the trainer looks for an engine that missed the last weight update.
const BEHIND_POLL: Duration = Duration::from_secs(5);

/// How `moult trainer` runs.
#[derive(Debug, Clone)]
pub struct TrainerProcessOptions {
    pub config: PathBuf,
    /// `/health` and `/metrics` listen here.
    pub metrics_addr: String,
    pub device: Device,
}

/// The trainer's calls to the coordinator beside the [`Steps`]' own.
impl Coordinator {
    /// `GET path`, once.
    async fn get<T: DeserializeOwned>(&self, path: &str) -> Result<T, CallError> {
        let url = format!("{}{path}", self.url);
        crate::auth::call(&url, self.http.get(&url)).await
    }

    /// The batch of `step`; `None` if the coordinator does not expect that step (it restarted):
    /// say hello again.
    async fn batch(&self, step: u64) -> Option<StepBatch> {
        let path = format!("/v1/trainer/batch?step={step}");
        let url = format!("{}{path}", self.url);
        loop {
            let answer = retry(&format!("GET {url}"), || async {
                match self.get(&path).await {
                    Err(CallError::Status { status, body, .. })
                        if status == reqwest::StatusCode::CONFLICT =>
                    {
                        Ok(Err(body))
                    }
                    answer => answer.map(Ok),
                }
            })
            .await;
            match answer {
                Ok(Some(batch)) => return Some(batch),
                Ok(None) => {} // not ready yet (204)
                Err(conflict) => {
                    tracing::warn!("{url}: {conflict}");
                    return None;
                }
            }
        }
    }

    /// Returns once an engine is up behind the router but serves other weights than the last
    /// update sent (it joined, or was replaced, after that update): the router sends it no
    /// generation until an update reaches it, so with no other engine the run would wait for a
    /// batch that never comes. Polls every [`BEHIND_POLL`].
    async fn engine_behind(&self) {
        loop {
            tokio::time::sleep(BEHIND_POLL).await;
            let pool: Value = self.get("/engines").await.unwrap_or_default();
            let mut engines = pool["engines"].as_array().into_iter().flatten();
            if engines.any(|e| e["healthy"] == true && e["routable"] == false) {
                return;
            }
        }
    }

    /// Waits until at least one engine is behind the router.
    async fn engines(&self) -> usize {
        let mut logged = false;
        loop {
            let world = self.get::<Value>("/get_world_size").await.ok();
            match world.and_then(|v| v["world_size"].as_u64()) {
                Some(n) if n > 0 => return n as usize,
                _ if !logged => {
                    eprintln!("moult trainer: waiting for engines behind {}", self.url);
                    logged = true;
                }
                _ => {}
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }
}

/// A trainer pod of rank > 0: serves its health, joins rank 0, and trains as it commands until it
/// says stop (then waits for `stop`) or is lost (then fails, and the pod starts again).
async fn follow(
    rendezvous: Rendezvous,
    opts: &TrainerProcessOptions,
    stop: CancellationToken,
) -> Result<()> {
    let rank = rendezvous.rank;
    let mut metrics = Registry::default();
    let help = "This pod's trainer rank";
    super::gauge(&mut metrics, "moult_trainer_rank", help).set(rank as f64);
    let _health = super::serve_health(&opts.metrics_addr, metrics).await?;
    let (world, host, port) = (rendezvous.world, &rendezvous.host, rendezvous.port);
    eprintln!("moult trainer: rank {rank} of {world} joins rank 0 at {host}:{port}");
    let device = opts.device;
    let followed = tokio::task::spawn_blocking(move || -> Result<u64> {
        let group = join(&rendezvous, device)?;
        let mut trainer = crate::trainer::ranks::follower(group, device)?;
        Ok(trainer.follow()?)
    });
    if let Some(done) = stop.run_until_cancelled(followed).await {
        let steps = done.map_err(|e| RunError::Setup(format!("trainer rank {rank}: {e}")))??;
        eprintln!("moult trainer: rank {rank}: rank 0 stopped the trainer at step {steps}");
    }
    Ok(())
}

/// Joins rank 0, trying again for as long as a restarted rank 0 may take to come back (or a rank 0
/// still loading its model): a rank that starts again after a loss may first reach the rank 0
/// that has not yet noticed (it fails at its next collective and starts again), so one attempt is
/// short and the next follows.
pub fn join(rendezvous: &Rendezvous, device: Device) -> Result<Box<dyn crate::dist::Collectives>> {
    const ATTEMPT: Duration = Duration::from_secs(30);
    let deadline = Instant::now() + Duration::from_secs(600).max(rendezvous.timeout);
    let attempt = Rendezvous {
        timeout: ATTEMPT.min(rendezvous.timeout),
        ..rendezvous.clone()
    };
    loop {
        match attempt.connect_bounded(device) {
            Ok(group) => {
                group
                    .set_timeout(rendezvous.timeout)
                    .map_err(|e| RunError::Setup(e.to_string()))?;
                return Ok(group);
            }
            Err(e) if Instant::now() < deadline => {
                eprintln!("moult trainer: {e}; trying again");
                std::thread::sleep(Duration::from_secs(1));
            }
            Err(e) => return Err(RunError::Setup(e.to_string())),
        }
    }
}

/// Runs the trainer until the run's last step, then idles until `stop` (so that a pod restart
/// policy does not start it over). Stopped earlier, it checkpoints the last step it trained
/// ([`run_steps`]) and returns.
pub async fn run(opts: TrainerProcessOptions, stop: CancellationToken) -> Result<()> {
    let (manifest, config_dir) = super::manifest(&opts.config)?;
    let beside = Sources::beside_manifest(&manifest, &config_dir);
    // The teacher of distillation, where the operator mounted it (a served teacher has engines
    // of its own: the trainer has nothing to load).
    let teacher = &manifest.spec.algorithm.teacher;
    let served_teacher = teacher.as_ref().is_some_and(|t| t.replicas.is_some());
    let sources = Sources {
        model_dir: mounted("MOULT_MODEL", beside.model_dir),
        teacher: mounted("MOULT_TEACHER", beside.teacher.filter(|_| !served_teacher)),
        dir: beside.dir,
        ..Sources::default()
    };
    let cfg = RunConfig::from_sources(manifest, &sources)?;
    // Trainer ranks (docs/distributed.md): one pod per node (the StatefulSet's pod index), one
    // rank per GPU of it (this process the first; it starts the others, as torchrun does), and
    // rank 0's stable address through the headless Service.
    let pods = env_number("WORLD_SIZE", 1, 0)? as usize;
    let pod = env_number("RANK", 0, 0)? as usize;
    let per_pod = cfg.ranks_per_node;
    let world = pods * per_pod;
    let rendezvous = if world > 1 {
        Some(Rendezvous {
            host: env_var("MASTER_ADDR")?,
            port: u16::try_from(env_number("MASTER_PORT", 29500, 0)?)
                .map_err(|_| RunError::env("MASTER_PORT", "must be a port number"))?,
            rank: pod * per_pod,
            world,
            timeout: Duration::from_secs(env_number("MOULT_TRAINER_TIMEOUT_SECONDS", 120, 0)?),
        })
    } else {
        None
    };
    // This pod's other ranks, alive as long as this process.
    let _node_ranks = (rendezvous.as_ref())
        .filter(|_| per_pod > 1)
        .map(|r| Followers::start(r, r.rank + 1..r.rank + per_pod, opts.device))
        .transpose()?;
    if let Some(r) = rendezvous.clone().filter(|r| r.rank > 0) {
        return follow(r, &opts, stop).await;
    }
    let coordinator = Coordinator::new(&env_var("MOULT_COORDINATOR")?);
    let pod_ip = std::env::var("POD_IP").unwrap_or_else(|_| "127.0.0.1".into());
    // Checkpoints and metrics of this run, on the checkpoint volume.
    let out = env_path("MOULT_CHECKPOINTS").map(|root| root.join(&cfg.name));
    let ckpt_root = out.as_ref().map(|o| o.join("checkpoints"));
    let mut metrics = Registry::default();
    let gauges = Gauges::register(&mut metrics);
    let _health = super::serve_health(&opts.metrics_addr, metrics).await?;

    // A pod's log gets lines, not a progress bar.
    let console = Console::hidden();
    let mut learner =
        Learner::load(cfg.clone(), ckpt_root, opts.device, console, rendezvous).await?;
    learner.stop = stop.clone();
    if let Some(note) = learner.resume_note() {
        eprintln!("moult trainer: {note}");
    }
    // The engines hold weights for as long as a cluster needs: keep trying while they come back.
    learner.publish_tries = 20;
    gauges.step.set(learner.step() as f64);
    let (name, step, total, url) = (&cfg.name, learner.step(), cfg.total_steps, &coordinator.url);
    eprintln!("moult trainer: {name} from step {step} of {total}; coordinator {url}");

    let Some(engines) = stop.run_until_cancelled(coordinator.engines()).await else {
        return Ok(());
    };
    let dtype = crate::model::ModelConfig::from_dir(&cfg.model_dir)?.dtype;
    let publish = PublishOptions::new(
        &cfg.run,
        dtype.as_deref(),
        coordinator.url.clone(),
        opts.device,
        (pod_ip, moult_operator::children::WEIGHT_STREAM_PORT as u16),
        // The Filesystem transport's volume, by the path engines mount it under too.
        env_path("MOULT_WEIGHTS_DIR").map(|root| root.join(&cfg.name)),
    )?;
    let mut wait = Duration::from_millis(500);
    loop {
        match learner.connect(&publish).await {
            Ok(()) => break,
            Err(e) if e.is_manifest() => return Err(e),
            Err(e) => {
                tracing::warn!("connecting the weight path: {e}; retrying in {wait:?}");
                tokio::select! {
                    () = tokio::time::sleep(wait) => {}
                    () = stop.cancelled() => return Ok(()),
                }
                wait = (wait * 2).min(Duration::from_secs(10));
            }
        }
    }
    let (backend, transport) = (&cfg.run.spec.engines.backend, &publish.transport);
    eprintln!("moult trainer: weights to {engines} {backend:?} engine(s) over {transport:?}");
    if let Some(out) = &out {
        learner.log_to(out)?;
    }
    // The trainer's stages: those that need its volume.
    let parts = stages::Parts {
        dumps: out.as_deref().map(stages::dump::folder),
        ..stages::Parts::default()
    };
    let stages = stages::ordered(&cfg.run.spec, parts);
    let mut steps = CoordinatorSteps {
        coordinator: &coordinator,
        limits: cfg.rollout.limits,
        hello_needed: true,
        published: None,
        data: learner.resumed().map(|(_, m)| m.rollout),
        gauges: &gauges,
        stop: &stop,
    };
    run_steps(&mut learner, &mut steps, &stages).await?;
    if learner.step() < total {
        return Ok(()); // shut down
    }
    eprintln!("moult trainer: {name} finished its {total} steps");
    stop.cancelled().await;
    Ok(())
}

/// A trainer pod's batches: from the coordinator, which numbers the versions and takes each
/// finished step's commit. Before the first batch (and after the coordinator restarted) the
/// trainer says hello: its step and data cursor; the answer may ask it to publish its weights
/// under a new version (a resumed trainer). While it waits, an engine that missed the last
/// update (a replaced pod, a scale-up) is sent the current weights again.
struct CoordinatorSteps<'a> {
    coordinator: &'a Coordinator,
    limits: EpisodeLimits,
    hello_needed: bool,
    /// The version of the last update this trainer sent (none yet: the engines' own weights).
    published: Option<u64>,
    /// Where the data stood at the last batch (or the checkpoint), for a coordinator that restarts.
    data: Option<RolloutState>,
    gauges: &'a Gauges,
    stop: &'a CancellationToken,
}

/// How long a stopping trainer keeps trying a call to the coordinator (which may be gone too).
const STOPPING_CALLS: Duration = Duration::from_secs(5);

impl CoordinatorSteps<'_> {
    /// `POST path` until the coordinator takes it, or until [`STOPPING_CALLS`] after a stop.
    async fn post<T: DeserializeOwned>(&self, path: &str, body: &impl Serialize) -> Option<T> {
        let stopped = (self.stop.cancelled()).then(|()| tokio::time::sleep(STOPPING_CALLS));
        tokio::select! {
            answer = self.coordinator.post(path, body) => Some(answer),
            () = stopped => None,
        }
    }

    async fn hello(&mut self, step: u64, learner: &mut Learner) -> Result<()> {
        let hello = Hello {
            step,
            rollout: self.data,
            limits: self.limits,
        };
        let reply: Option<HelloReply> = self.post("/v1/trainer/hello", &hello).await;
        if let Some(version) = reply.and_then(|r| r.publish_as) {
            if learner.publish(version, false).await?.is_none() {
                return Ok(()); // stopped
            }
            self.published = Some(version);
            let _: Option<Value> = self
                .post("/v1/trainer/published", &Version { version })
                .await;
            self.gauges.version.set(version as f64);
            eprintln!(
                "moult trainer: engines serve the weights of step {step} as version {version}"
            );
        }
        self.hello_needed = false;
        Ok(())
    }
}

impl Steps for CoordinatorSteps<'_> {
    async fn next(&mut self, step: u64, learner: &mut Learner) -> Result<Option<StepBatch>> {
        loop {
            if self.hello_needed {
                self.hello(step - 1, learner).await?;
            }
            let batch = tokio::select! {
                b = self.coordinator.batch(step) => b,
                // An engine that missed the last update: send it the current weights again
                // under the same version, then wait for the batch again.
                () = self.coordinator.engine_behind(), if self.published.is_some() => {
                    let version = self.published.expect("checked by the guard");
                    match learner.publish(version, false).await {
                        Ok(None) => {}
                        Ok(Some(_)) => eprintln!(
                            "moult trainer: an engine that joined after version {version} has it now"
                        ),
                        Err(e) => tracing::warn!(version, "bringing a new engine up to date: {e}"),
                    }
                    continue;
                }
                () = self.stop.cancelled() => return Ok(None),
            };
            let Some(mut batch) = batch else {
                self.hello_needed = true;
                continue;
            };
            self.data = Some(batch.rollout);
            if let Some(eval) = batch.eval.take() {
                learner.record_eval(eval)?;
            }
            return Ok(Some(batch));
        }
    }

    async fn version(&mut self, _: u64) -> u64 {
        // The coordinator numbers versions (they only increase, across restarts).
        let Version { version } = self.coordinator.post("/v1/trainer/version", &()).await;
        version
    }

    async fn done(&mut self, trained: Trained, _: StepBatch) -> Result<()> {
        let Trained { record, checkpoint } = trained;
        let (step, version) = (record.step, record.policy_version);
        self.gauges.busy.set(record.trainer_busy_fraction);
        self.gauges.engine_busy.set(record.engine_busy_fraction);
        let checkpoint = checkpoint.map(|dir| CheckpointStatus {
            step,
            path: dir.display().to_string(),
            time: Time(k8s_openapi::jiff::Timestamp::now()),
        });
        let commit = Commit {
            step,
            version,
            record,
            checkpoint,
        };
        let _: Option<Value> = self.post("/v1/trainer/commit", &commit).await;
        self.gauges.step.set(step as f64);
        self.gauges.version.set(version as f64);
        self.published = Some(version);
        Ok(())
    }

    async fn quarantined(&mut self, step: u64, error: RunError) -> Result<()> {
        let body = Quarantined {
            step,
            error: error.to_string(),
        };
        let _: Option<Value> = self.post("/v1/trainer/quarantine", &body).await;
        Ok(())
    }
}
