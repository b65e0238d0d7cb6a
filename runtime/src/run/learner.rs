//! The learner: the training side of a run, one implementation for `moult run` ([`super::run`])
//! and `moult trainer` (the cluster's trainer pod). It loads the policy (from the newest
//! checkpoint, or the model folder), and for each batch of finished groups: advantages → the exact
//! token segments as samples → (distillation: the teacher's scores) → one optimizer step →
//! publish the weights to the engines under the next version ([`Publisher`], whatever the
//! transport) → the step's metrics record → `metrics.jsonl` → a checkpoint when one is due.
//!
//! What differs between the two callers stays with them: where batches come from (the local
//! rollout pool, or the coordinator), who numbers versions (the trainer's step count, or the
//! coordinator), and how often a failed publish is tried again (locally never: the engines are
//! this process's; on a cluster engines come and go).

use std::collections::BTreeMap;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use tch::{Device, Kind};

use super::checkpoint::{self, CheckpointMeta};
use super::config::RunConfig;
use super::console::Console;
use super::judge::JudgeStats;
use super::metrics::{MetricsLog, StepRecord};
use super::teacher::TeacherStats;
use super::{samples, RunError};
use crate::dist::{self, Rendezvous};
use crate::model::CausalLm;
use crate::rollout::eval::EvalResult;
use crate::rollout::{staleness_histogram, Group, RolloutState, RolloutStats};
use crate::router::Activity;
use crate::trainer::ranks::{self, Setup};
use crate::trainer::train::Trainer;
use crate::weight_sync::publish::{PublishOptions, Publisher};

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, RunError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| RunError::Setup(format!("a compute thread failed: {e}")))
}

/// One batch to learn from, with what its step record and checkpoint say about it.
pub(crate) struct Batch<'a> {
    pub groups: &'a [Group],
    /// The version the engines served when the batch was handed out (staleness counts from it).
    pub served: u64,
    /// The rollout pool's counters, for the record.
    pub stats: RolloutStats,
    /// Where the data stood after these groups were drawn (checkpointed with the step).
    pub rollout: RolloutState,
    /// The seed of the task order (checkpointed, so a resumed run draws the same tasks).
    pub seed: u64,
    /// The judge's verdict on the batch, when the run has one.
    pub judged: Option<JudgeStats>,
    /// How a served teacher scored the batch (its segments carry the scores), when it did.
    pub taught: Option<TeacherStats>,
    /// When the step began (waiting for the batch included).
    pub started: Instant,
}

/// What one step produced.
pub(crate) struct Trained {
    pub record: StepRecord,
    /// The checkpoint written after this step, if one was due.
    pub checkpoint: Option<PathBuf>,
}

/// The training side of a run.
pub(crate) struct Learner {
    cfg: RunConfig,
    /// `None` only while it computes on a blocking thread.
    trainer: Option<Trainer>,
    /// The other trainer ranks, when this process is rank 0 of several.
    _followers: Option<Followers>,
    teacher: Option<CausalLm>,
    publisher: Option<Publisher>,
    log: Option<MetricsLog>,
    ckpt_root: Option<PathBuf>,
    resume: Option<(PathBuf, CheckpointMeta)>,
    console: Console,
    step: u64,
    started: Instant,
    /// How many times a failed publish is tried (with a pause between tries).
    pub publish_tries: usize,
    /// No engines to publish to (a replay of dumped batches): publishing does nothing.
    pub offline: bool,
    /// Where the engines' activity is read (the router or coordinator weights go through), and
    /// the last reading: each step's busy fractions cover the time since.
    activity: Option<ActivityReader>,
    /// The newest evaluation not yet in a step record: the next record carries it.
    pending_eval: Option<EvalResult>,
}

/// Reads how busy the engines have been from the router's `GET /engines`.
struct ActivityReader {
    http: reqwest::Client,
    url: String,
    last: (Instant, Activity),
}

/// How long a step waits for the router's activity reading.
const ACTIVITY_TIMEOUT: Duration = Duration::from_secs(5);

impl ActivityReader {
    async fn read(http: &reqwest::Client, url: &str) -> Option<Activity> {
        let v: serde_json::Value = http
            .get(url)
            .timeout(ACTIVITY_TIMEOUT)
            .send()
            .await
            .ok()?
            .json()
            .await
            .ok()?;
        serde_json::from_value(v.get("activity")?.clone()).ok()
    }

    /// Busy fraction of the engines and their paused seconds since the last reading, and the
    /// window's length; `None` when the router did not answer (the window then goes on).
    async fn since_last(&mut self) -> Option<(f64, f64, f64)> {
        let now = Self::read(&self.http, &self.url).await?;
        let (at, last) = std::mem::replace(&mut self.last, (Instant::now(), now));
        let window = at.elapsed().as_secs_f64().max(1e-9);
        let busy = (now.busy_seconds - last.busy_seconds).max(0.0);
        let fraction = (busy / (window * now.engines.max(1) as f64)).clamp(0.0, 1.0);
        let paused = (now.paused_seconds - last.paused_seconds).clamp(0.0, window);
        Some((fraction, paused, window))
    }
}

impl Learner {
    /// The policy of a run whose checkpoints live under `ckpt_root`: from the newest one there,
    /// or the model folder; the teacher of distillation too.
    pub async fn load(
        cfg: RunConfig,
        ckpt_root: Option<PathBuf>,
        device: Device,
        console: Console,
    ) -> Result<Self, RunError> {
        Self::load_rank0(cfg, ckpt_root, device, console, None).await
    }

    /// [`Learner::load`] as rank 0 of `trainer.nodes` ranks that join at `rendezvous` (trainer
    /// pods); without one, the other ranks are started as processes of this machine.
    pub async fn load_rank0(
        cfg: RunConfig,
        ckpt_root: Option<PathBuf>,
        device: Device,
        console: Console,
        rendezvous: Option<Rendezvous>,
    ) -> Result<Self, RunError> {
        let resume = match &ckpt_root {
            Some(root) => checkpoint::latest(root)?,
            None => None,
        };
        let (trainer, followers) = load_trainer(&cfg, resume.as_ref(), device, rendezvous).await?;
        let teacher = load_teacher(&cfg, &trainer, device).await?;
        Ok(Self {
            step: resume.as_ref().map_or(0, |(_, m)| m.step),
            cfg,
            trainer: Some(trainer),
            _followers: followers,
            teacher,
            publisher: None,
            log: None,
            ckpt_root,
            resume,
            console,
            started: Instant::now(),
            publish_tries: 1,
            offline: false,
            activity: None,
            pending_eval: None,
        })
    }

    /// The checkpoint this learner resumed from.
    pub fn resumed(&self) -> Option<&(PathBuf, CheckpointMeta)> {
        self.resume.as_ref()
    }

    /// What a process resuming from a checkpoint says ("resuming NAME from DIR (step S, ...)").
    pub fn resume_note(&self) -> Option<String> {
        self.resume.as_ref().map(|r| resume_note(&self.cfg, r))
    }

    /// Steps trained so far (the checkpoint's, when resumed).
    pub fn step(&self) -> u64 {
        self.step
    }

    /// Opens the weight path to the engines.
    pub async fn connect(&mut self, opts: &PublishOptions) -> Result<(), RunError> {
        self.publisher = Some(Publisher::connect(opts).await?);
        let http = crate::auth::client();
        let url = format!("{}/engines", opts.target.trim_end_matches('/'));
        let first = ActivityReader::read(&http, &url).await.unwrap_or_default();
        self.activity = Some(ActivityReader {
            http,
            url,
            last: (Instant::now(), first),
        });
        Ok(())
    }

    /// Writes every step record to `<out>/metrics.jsonl` from now on.
    pub fn log_to(&mut self, out: &Path) -> Result<(), RunError> {
        std::fs::create_dir_all(out)
            .map_err(|e| RunError::Io(format!("creating {}: {e}", out.display())))?;
        self.log = Some(MetricsLog::open(out, self.step)?);
        Ok(())
    }

    pub fn records(&self) -> &[StepRecord] {
        self.log.as_ref().map_or(&[], |l| l.records())
    }

    /// The evaluations logged so far (this process's, and a resumed run's earlier ones).
    pub fn evals(&self) -> &[EvalResult] {
        self.log.as_ref().map_or(&[], |l| l.evals())
    }

    /// Logs an evaluation (`eval.jsonl`, TensorBoard at its step); the next step record carries
    /// its numbers. An evaluation of a step already logged (a batch handed out again after a
    /// restart) is skipped.
    pub fn record_eval(&mut self, eval: EvalResult) -> Result<(), RunError> {
        if self.evals().iter().any(|e| e.step == eval.step) {
            return Ok(());
        }
        self.console.line(&crate::rollout::eval::line(&eval));
        if let Some(log) = &mut self.log {
            log.push_eval(eval.clone())?;
        }
        self.pending_eval = Some(eval);
        Ok(())
    }

    fn trainer(&self) -> &Trainer {
        self.trainer
            .as_ref()
            .expect("the trainer is back from its compute thread")
    }

    /// Publishes the current weights as `version` (pause `keep` with `partial_rollout`), trying
    /// [`publish_tries`](Self::publish_tries) times; returns the seconds it took.
    pub async fn publish(&mut self, version: u64, partial_rollout: bool) -> Result<f64, RunError> {
        if self.offline {
            return Ok(0.0);
        }
        let started = Instant::now();
        let mut tries = 0;
        loop {
            let publisher = self
                .publisher
                .as_mut()
                .ok_or_else(|| RunError::Setup("the weight path is not connected".into()))?;
            let trainer = self.trainer.take().expect("the trainer is here");
            let (trainer, gathered, sent) = publisher
                .publish_trainer(trainer, version, partial_rollout)
                .await;
            self.trainer = Some(trainer);
            // A lost rank ends the run (the trainer cannot go on); a failed send is tried again.
            gathered.map_err(crate::model::Error::from)?;
            match sent {
                Ok(_) => return Ok(started.elapsed().as_secs_f64()),
                Err(e) if tries + 1 < self.publish_tries => {
                    tries += 1;
                    tracing::warn!(version, tries, "publishing the weights: {e}; trying again");
                    tokio::time::sleep(Duration::from_secs(2)).await;
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// One step on `batch`: learn, publish under the version `next_version` gives (called once
    /// the optimizer step is done, with the trainer), record, log, and checkpoint when due.
    pub async fn train<F, Fut>(
        &mut self,
        batch: Batch<'_>,
        next_version: F,
    ) -> Result<Trained, RunError>
    where
        F: FnOnce(&Trainer) -> Fut,
        Fut: Future<Output = u64>,
    {
        self.console.phase("training");
        let staleness: BTreeMap<u64, usize> = staleness_histogram(batch.groups, batch.served)
            .into_iter()
            .collect();
        let trainer = self.trainer.take().expect("the trainer is here");
        let (trainer, teacher, learned) =
            learn(&self.cfg, trainer, self.teacher.take(), batch.groups).await?;
        self.trainer = Some(trainer);
        self.teacher = teacher;
        let version = next_version(self.trainer()).await;
        self.console.phase("weight sync");
        let sync = self.publish(version, self.cfg.partial_rollout).await?;
        self.step += 1;
        // The engines' activity over the step; the trainer's busy time over the same window.
        let (engine_busy_fraction, engine_paused_seconds, window) = match &mut self.activity {
            Some(reader) => reader.since_last().await.unwrap_or_else(|| {
                tracing::warn!("the router did not say how busy the engines were");
                (0.0, 0.0, batch.started.elapsed().as_secs_f64())
            }),
            None => (0.0, 0.0, batch.started.elapsed().as_secs_f64()),
        };
        let trainer_busy_fraction = (learned.compute_seconds / window.max(1e-9)).clamp(0.0, 1.0);
        let record = step_record(
            batch.groups,
            &learned,
            staleness,
            StepTimes {
                step: batch.started.elapsed().as_secs_f64(),
                sync,
                elapsed: self.started.elapsed().as_secs_f64(),
            },
            (self.step, version),
            batch.stats,
        );
        let judged = batch.judged;
        let record = StepRecord {
            engine_busy_fraction,
            trainer_busy_fraction,
            engine_paused_seconds,
            agent_reward_mean: judged.map(|j| j.agent_reward_mean),
            judge_score_mean: judged.map(|j| j.judge_score_mean),
            judge_unparsed: judged.map(|j| j.unparsed),
            judge_failed: judged.map(|j| j.failed),
            judge_seconds: judged.map(|j| j.seconds),
            teacher_seconds: batch.taught.map(|t| t.seconds),
            trainer_world_size: self.trainer().world_size(),
            ..record
        }
        .with_eval(self.pending_eval.take().as_ref());
        if let Some(log) = &mut self.log {
            log.push(record.clone())?;
        }
        let step = self.step;
        let due = self
            .cfg
            .checkpoint_every
            .is_some_and(|every| step % every == 0 || step == self.cfg.total_steps);
        let checkpoint = match (&self.ckpt_root, due) {
            (Some(root), true) => {
                self.console.phase("saving a checkpoint");
                let meta = CheckpointMeta {
                    step,
                    policy_version: version,
                    rollout: batch.rollout,
                    seed: batch.seed,
                };
                let trainer = self.trainer.take().expect("the trainer is here");
                let (trainer, saved) = save_checkpoint(root, &self.cfg, trainer, meta).await?;
                self.trainer = Some(trainer);
                Some(saved?)
            }
            _ => None,
        };
        Ok(Trained { record, checkpoint })
    }
}

impl Drop for Learner {
    fn drop(&mut self) {
        // Rank 0 of several: the other ranks stop (local ones' processes end as the followers
        // drop; trainer pods exit and their StatefulSet starts them again, to wait for rank 0).
        if let Some(trainer) = self.trainer.as_ref().filter(|t| t.world_size() > 1) {
            if let Err(e) = trainer.stop_followers() {
                tracing::warn!("stopping the other trainer ranks: {e}");
            }
        }
    }
}

/// What a process resuming from a checkpoint says.
fn resume_note(cfg: &RunConfig, (dir, meta): &(PathBuf, CheckpointMeta)) -> String {
    format!(
        "resuming {} from {} (step {}, version {})",
        cfg.name,
        dir.display(),
        meta.step,
        meta.policy_version
    )
}

/// The trainer: from the checkpoint's weights and moments (`resume`), or the model folder. With
/// several ranks (`trainer.nodes`), this process is rank 0: the others join at `rendezvous`, or,
/// without one, are started as processes of this machine (docs/distributed.md).
async fn load_trainer(
    cfg: &RunConfig,
    resume: Option<&(PathBuf, CheckpointMeta)>,
    device: Device,
    rendezvous: Option<Rendezvous>,
) -> Result<(Trainer, Option<Followers>), RunError> {
    let trainer_opts = cfg.trainer.clone();
    // A KL penalty is to the initial policy: the model folder's weights, frozen.
    let reference_dir = (cfg.trainer.kl_coef > 0.0).then(|| cfg.model_dir.clone());
    let reference = reference_dir.clone();
    let model_dir = cfg.model_dir.clone();
    let resume = resume.map(|(d, meta)| (d.clone(), meta.step));
    let (model, moments, reference) = blocking(move || -> Result<_, RunError> {
        let (model, moments) = match resume {
            Some((dir, step)) => {
                let (model, moments) = checkpoint::load_policy(&dir, Kind::Float, device)?;
                (model, Some((step, moments)))
            }
            None => (CausalLm::load(&model_dir, Kind::Float, device)?, None),
        };
        let reference = reference
            .map(|d| CausalLm::load(&d, Kind::Float, device))
            .transpose()?;
        Ok((model, moments, reference))
    })
    .await??;
    if cfg.trainer_ranks > 1 {
        let (followers, rendezvous) = match rendezvous {
            Some(r) => (None, r),
            None => {
                let (f, r) = Followers::start_all(cfg.trainer_ranks, device)?;
                (Some(f), r)
            }
        };
        let setup = Setup {
            model_dir: cfg.model_dir.clone(),
            reference_dir,
            dtype: "float32".into(),
            options: trainer_opts,
        };
        let trainer = blocking(move || -> Result<Trainer, RunError> {
            let group = rendezvous
                .connect_on(device)
                .map_err(|e| RunError::Setup(e.to_string()))?;
            Ok(ranks::leader(model, reference, setup, moments, group)?)
        })
        .await??;
        return Ok((trainer, followers));
    }
    let mut trainer =
        Trainer::new(model, reference, trainer_opts).map_err(|e| RunError::Setup(e.to_string()))?;
    if let Some((step, moments)) = moments {
        trainer
            .restore(step, moments)
            .map_err(|e| RunError::Checkpoint(e.to_string()))?;
    }
    Ok((trainer, None))
}

/// Trainer ranks as processes of this machine (`moult trainer-rank`), as torchrun starts a node's
/// ranks: the ranks after the first for `moult run`, a trainer pod's ranks after its first on a
/// node with several GPUs. They follow rank 0 and end when it stops them, when this process
/// drops them, or when it dies.
pub(crate) struct Followers {
    children: Vec<std::process::Child>,
}

impl Followers {
    /// `moult run`: starts ranks 1..world on this machine; returns them and rank 0's rendezvous
    /// (it listens on a free port). On a GPU, rank r computes on the r-th GPU from rank 0's.
    fn start_all(world: usize, device: Device) -> Result<(Self, Rendezvous), RunError> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(|e| RunError::Setup(format!("finding a port for the trainer ranks: {e}")))?
            .port();
        let rendezvous = Rendezvous {
            host: "127.0.0.1".into(),
            port,
            rank: 0,
            world,
            timeout: Duration::from_secs(120),
        };
        let followers = Self::start(&rendezvous, 1..world, device)?;
        Ok((followers, rendezvous))
    }

    /// Starts `ranks` of `at`'s group on this machine, the i-th of them (counting from `at`'s
    /// own rank, this process) on the i-th GPU from `device`'s, or on the CPU.
    pub(crate) fn start(
        at: &Rendezvous,
        ranks: std::ops::Range<usize>,
        device: Device,
    ) -> Result<Self, RunError> {
        let exe = std::env::var_os("MOULT_BIN")
            .map(PathBuf::from)
            .map_or_else(std::env::current_exe, Ok)
            .map_err(|e| RunError::Setup(format!("finding the moult binary: {e}")))?;
        let device_of = |rank: usize| -> Result<String, RunError> {
            match device {
                Device::Cpu => Ok("cpu".to_string()),
                Device::Cuda(first) => {
                    let gpu = first + rank - at.rank;
                    let count = tch::Cuda::device_count().max(0) as usize;
                    if gpu >= count {
                        return Err(RunError::Manifest(format!(
                            "spec.trainer.gpusPerNode: trainer rank {rank} computes on GPU {gpu}, and this machine has {count} (one rank per GPU; docs/distributed.md)"
                        )));
                    }
                    Ok(format!("cuda:{gpu}"))
                }
                other => Err(RunError::Setup(format!(
                    "trainer ranks run on the CPU or CUDA GPUs, not {other:?}"
                ))),
            }
        };
        let mut followers = Self {
            children: Vec::new(),
        };
        for rank in ranks {
            let device = device_of(rank)?;
            let child = std::process::Command::new(&exe)
                .args(["trainer-rank", "--device", &device])
                .env(dist::ENV_RANK, rank.to_string())
                .env(dist::ENV_WORLD, at.world.to_string())
                .env(dist::ENV_MASTER, format!("{}:{}", at.host, at.port))
                .env(dist::ENV_TIMEOUT, at.timeout.as_secs().to_string())
                .stdin(std::process::Stdio::null())
                .stdout(std::process::Stdio::null())
                .spawn()
                .map_err(|e| {
                    RunError::Setup(format!(
                        "starting trainer rank {rank} ({} trainer-rank): {e}",
                        exe.display()
                    ))
                })?;
            followers.children.push(child);
        }
        Ok(followers)
    }
}

impl Drop for Followers {
    fn drop(&mut self) {
        // Told to stop (the learner's drop), they exit on their own; give them a moment.
        let deadline = Instant::now() + Duration::from_secs(5);
        for child in &mut self.children {
            while Instant::now() < deadline && matches!(child.try_wait(), Ok(None)) {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// The teacher of on-policy distillation, if the run has one; it must share the student's
/// vocabulary.
async fn load_teacher(
    cfg: &RunConfig,
    student: &Trainer,
    device: Device,
) -> Result<Option<CausalLm>, RunError> {
    // A served teacher's engines score the batches before they get here.
    let Some(dir) = cfg
        .teacher_dir
        .clone()
        .filter(|_| cfg.served_teacher.is_none())
    else {
        return Ok(None);
    };
    let student_vocab = student.model().config().vocab_size;
    let teacher = blocking(move || CausalLm::load(&dir, Kind::Float, device)).await??;
    if teacher.config().vocab_size != student_vocab {
        return Err(RunError::Manifest(format!(
            "spec.algorithm.teacher.path: the teacher's vocabulary ({}) is not the student's ({student_vocab}): they must share a tokenizer",
            teacher.config().vocab_size
        )));
    }
    Ok(Some(teacher))
}

/// Saves a checkpoint of `trainer` under `root` on a compute thread; the trainer comes back
/// whether or not the save worked.
async fn save_checkpoint(
    root: &Path,
    cfg: &RunConfig,
    trainer: Trainer,
    meta: CheckpointMeta,
) -> Result<(Trainer, Result<PathBuf, RunError>), RunError> {
    let (root, model_dir) = (root.to_path_buf(), cfg.model_dir.clone());
    blocking(move || {
        let saved = checkpoint::save(&root, &model_dir, &trainer, &meta);
        (trainer, saved)
    })
    .await
}

/// What one optimizer step on a batch produced.
struct Learned {
    advantages: Vec<Vec<f64>>,
    stats: crate::trainer::train::StepStats,
    teacher_kl: Option<f64>,
    overlong_penalty_mean: Option<f64>,
    train_seconds: f64,
    /// Everything the step computed: advantages, samples, the teacher, the optimizer step.
    compute_seconds: f64,
}

/// Advantages, the exact token segments as trainer samples, the teacher's scores (distillation),
/// and one optimizer step. The trainer and teacher move to a compute thread and back.
async fn learn(
    cfg: &RunConfig,
    mut trainer: Trainer,
    teacher: Option<CausalLm>,
    batch: &[Group],
) -> Result<(Trainer, Option<CausalLm>, Learned), RunError> {
    let computing = Instant::now();
    let (advantages, overlong_penalty_mean) =
        samples::advantages(cfg.estimator, cfg.overlong.as_ref(), batch)?;
    let images = trainer.model().image_processor().cloned();
    let mut train_samples =
        samples::samples(batch, &advantages, cfg.routing_replay, images.as_ref())?;
    let (teacher, teacher_kl) = match teacher {
        Some(t) => {
            let temperature = cfg.trainer.loss.temperature;
            let (t, scored, kl) = blocking(move || {
                let kl = samples::distill(&t, &mut train_samples, temperature);
                (t, train_samples, kl)
            })
            .await?;
            train_samples = scored;
            (Some(t), Some(kl?))
        }
        // A served teacher's scores came with the batch.
        None if cfg.served_teacher.is_some() => (
            None,
            Some(samples::distill_served(batch, &mut train_samples)?),
        ),
        None => (None, None),
    };
    let started = Instant::now();
    let (trainer, stats) = blocking(move || {
        let stats = trainer.step(&train_samples);
        (trainer, stats)
    })
    .await?;
    let stats = stats?;
    let learned = Learned {
        advantages,
        stats,
        teacher_kl,
        overlong_penalty_mean,
        train_seconds: started.elapsed().as_secs_f64(),
        compute_seconds: computing.elapsed().as_secs_f64(),
    };
    Ok((trainer, teacher, learned))
}

struct StepTimes {
    step: f64,
    sync: f64,
    elapsed: f64,
}

/// `x`, or 0 when it is NaN or infinite (a record holds JSON numbers only).
fn finite_or_zero(x: f64) -> f64 {
    if x.is_finite() {
        x
    } else {
        0.0
    }
}

/// The metrics record of a step: the batch, what training it produced, and the times.
fn step_record(
    batch: &[Group],
    learned: &Learned,
    staleness: BTreeMap<u64, usize>,
    times: StepTimes,
    (step, version): (u64, u64),
    rollout: RolloutStats,
) -> StepRecord {
    let rewards: Vec<f64> = batch
        .iter()
        .flat_map(|g| g.episodes.iter().map(|e| e.reward))
        .collect();
    let (reward_mean, reward_std) = samples::mean_std(&rewards);
    let Learned {
        advantages,
        stats,
        teacher_kl,
        overlong_penalty_mean,
        train_seconds,
        ..
    } = learned;
    let (advantage_mean, advantage_std) = samples::mean_std(&advantages.concat());
    let stale_tokens: usize = staleness.values().sum();
    StepRecord {
        step,
        policy_version: version,
        reward_mean,
        reward_std,
        episodes: rewards.len(),
        advantage_mean,
        advantage_std,
        loss: finite_or_zero(stats.loss),
        mean_abs_log_rho: stats.mean_abs_log_rho,
        masked_fraction: stats.masked_fraction,
        entropy: stats.entropy,
        kl: stats.kl,
        grad_norm: finite_or_zero(stats.grad_norm),
        update_skipped: stats.skipped,
        learning_rate: stats.learning_rate,
        teacher_kl: *teacher_kl,
        overlong_penalty_mean: *overlong_penalty_mean,
        agent_reward_mean: None,
        judge_score_mean: None,
        judge_unparsed: None,
        judge_failed: None,
        judge_seconds: None,
        teacher_seconds: None,
        trainer_world_size: 1,
        staleness_mean: staleness
            .iter()
            .map(|(k, n)| *k as f64 * *n as f64)
            .sum::<f64>()
            / stale_tokens.max(1) as f64,
        staleness,
        sequences: stats.sequences,
        sampled_tokens: stats.sampled_tokens,
        response_tokens_mean: stats.sampled_tokens as f64 / rewards.len().max(1) as f64,
        tokens_per_second: stats.sampled_tokens as f64 / times.step.max(1e-9),
        step_seconds: times.step,
        train_seconds: *train_seconds,
        sync_seconds: times.sync,
        dropped_stale: rollout.dropped_stale,
        dropped_failed: rollout.dropped_failed,
        dropped_invalid: rollout.dropped_invalid,
        groups_filtered: rollout.groups_filtered,
        elapsed_seconds: times.elapsed,
        engine_busy_fraction: 0.0,
        trainer_busy_fraction: 0.0,
        engine_paused_seconds: 0.0,
        eval_step: None,
        eval_reward_mean: None,
        eval_pass_at_k: None,
    }
}
