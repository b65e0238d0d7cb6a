//! The loop of `moult run` and the training steps the trainer process shares with it (see the
//! module above).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
use tch::{Device, Kind};

use super::checkpoint::{self, CheckpointMeta};
use super::config::RunConfig;
use super::console::Console;
use super::metrics::{self, MetricsLog, StepRecord};
use super::{local, ordered, samples, RunError};
use crate::model::Qwen3Model;
use crate::rollout::{next_batch, staleness_histogram, RolloutPool, RolloutState};
use crate::trainer::train::Trainer;
use crate::weight_sync::orchestrate::WeightSync;

/// How `moult run` runs the manifest.
#[derive(Debug, Clone)]
pub struct RunOptions {
    /// Metrics, plot, summary and checkpoints go here.
    pub out: PathBuf,
    /// Where the trainer and engines compute.
    pub device: Device,
    /// Fixes the task order (and, with the data cursor, every later epoch's).
    pub seed: u64,
    /// Where progress lines and the status line go.
    pub console: Console,
}

/// What a finished (or interrupted) run reports.
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    pub name: String,
    pub steps: u64,
    pub total_steps: u64,
    pub policy_version: u64,
    /// Mean reward of the first step this process trained, and of the last five steps.
    pub first_reward: Option<f64>,
    pub final_reward: Option<f64>,
    /// With a judge: the same two means of the agents' own rewards (before the judge's score).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub first_agent_reward: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub final_agent_reward: Option<f64>,
    pub seconds: f64,
    pub resumed_from: Option<u64>,
    pub last_checkpoint: Option<PathBuf>,
    pub interrupted: bool,
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, RunError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| RunError::Setup(format!("a compute thread failed: {e}")))
}

/// Runs `cfg` to its `totalSteps` (resuming from the newest checkpoint under
/// `<out>/checkpoints`), or until `shutdown` resolves.
pub async fn run(
    cfg: RunConfig,
    opts: RunOptions,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<Summary, RunError> {
    let started = Instant::now();
    let out = &opts.out;
    std::fs::create_dir_all(out)
        .map_err(|e| RunError::Io(format!("creating {}: {e}", out.display())))?;
    let ckpt_root = out.join("checkpoints");
    let resume = checkpoint::latest(&ckpt_root)?;
    let (mut step, mut version, state, seed) = match &resume {
        Some((_, m)) => (m.step, m.policy_version, m.rollout, m.seed),
        None => (0, 0, RolloutState::default(), opts.seed),
    };
    let console = &opts.console;
    if step >= cfg.total_steps {
        console.line(&format!(
            "moult run: {} already finished ({step} steps)",
            cfg.name
        ));
    }
    console.set_step(step);
    // The status line's ticker ends with the run.
    let _ticker = crate::AbortOnDrop(console.tick());

    let device = opts.device;
    console.phase("loading the model");
    let mut trainer = load_trainer(&cfg, resume.as_ref(), device).await?;
    if let Some(resume) = &resume {
        console.line(&format!("moult run: {}", resume_note(&cfg, resume)));
    }
    let mut teacher = load_teacher(&cfg, &trainer, device).await?;

    console.phase("starting engines and agents");
    let scratch = out.join("scratch");
    let stack = local::Stack::start(&cfg, device, &scratch).await?;
    let mut sync = WeightSync::new(&stack.router_url);
    sync.connect_tcp("127.0.0.1:0", "127.0.0.1").await?;
    if resume.is_some() {
        // The engines loaded the original model: bring them to the checkpoint's version.
        sync.update(&trainer.weights(), version, false).await?;
    }
    let dataset = Arc::new(ordered(&cfg.tasks, seed));
    let (pool, mut queue) = RolloutPool::start(
        stack.agents.clone(),
        dataset,
        cfg.rollout.clone(),
        state,
        version,
    )
    .map_err(|e| RunError::Setup(e.to_string()))?;
    let mut log = MetricsLog::open(out, step)?;
    let first_step = step;
    let mut last_checkpoint = resume.as_ref().map(|(d, _)| d.clone());
    let mut step_started = Instant::now();
    tokio::pin!(shutdown);
    let mut interrupted = false;

    while step < cfg.total_steps {
        // 1. A batch of finished groups (generated while the previous step trained).
        let batch = tokio::select! {
            b = watch_generation(console, &pool, next_batch(&pool, &mut queue, &cfg.rollout)) => b,
            () = &mut shutdown => { interrupted = true; break; }
        };
        let Some(mut batch) = batch else {
            return Err(RunError::Setup("the rollout pool stopped".into()));
        };
        // With a judge, every reply of the batch is scored at once and the rewards mixed.
        let judged = match &stack.judge {
            Some(judge) => {
                console.phase("judging the batch");
                Some(judge.score_batch(&mut batch, step + 1).await?)
            }
            None => None,
        };
        console.phase("training");
        // 2. Advantages, the exact token segments as samples, one optimizer step.
        let staleness: BTreeMap<u64, usize> =
            staleness_histogram(&batch, version).into_iter().collect();
        let learned;
        (trainer, teacher, learned) = learn(&cfg, trainer, teacher, &batch).await?;
        step += 1;
        version = trainer.steps();
        // 3. Publish: engines pause (keeping their requests), take the weights, resume.
        console.phase("weight sync");
        let sync_started = Instant::now();
        sync.update(&trainer.weights(), version, cfg.partial_rollout)
            .await?;
        pool.set_version(version);
        let sync_seconds = sync_started.elapsed().as_secs_f64();
        // 4. Log.
        let record = step_record(
            &batch,
            &learned,
            staleness,
            StepTimes {
                step: step_started.elapsed().as_secs_f64(),
                sync: sync_seconds,
                elapsed: started.elapsed().as_secs_f64(),
            },
            (step, version),
            pool.stats(),
        );
        let record = StepRecord {
            agent_reward_mean: judged.map(|j| j.agent_reward_mean),
            judge_score_mean: judged.map(|j| j.judge_score_mean),
            judge_unparsed: judged.map(|j| j.unparsed),
            judge_failed: judged.map(|j| j.failed),
            judge_seconds: judged.map(|j| j.seconds),
            ..record
        };
        drop(batch); // frees the groups' admission slots: generation goes on
        step_started = Instant::now();
        let done = step - first_step;
        let eta = Duration::from_secs_f64(
            started.elapsed().as_secs_f64() / done as f64 * (cfg.total_steps - step) as f64,
        );
        console.line(&metrics::progress_line(&record, cfg.total_steps, Some(eta)));
        console.set_step(step);
        log.push(record)?;
        // 5. Checkpoint.
        if cfg
            .checkpoint_every
            .is_some_and(|every| step % every == 0 || step == cfg.total_steps)
        {
            let meta = CheckpointMeta {
                step,
                policy_version: version,
                rollout: pool.state(),
                seed,
            };
            console.phase("saving a checkpoint");
            let saved;
            (trainer, saved) = save_checkpoint(&ckpt_root, &cfg, trainer, meta).await?;
            last_checkpoint = Some(saved?);
        }
    }
    console.phase("stopping");
    // Abandon the episodes in flight before the servers go, so they end quietly.
    pool.stop();
    drop(queue);
    stack.shutdown().await;
    let records = log.records();
    let trained: Vec<StepRecord> = records
        .iter()
        .filter(|r| r.step > first_step)
        .cloned()
        .collect();
    let svg = metrics::reward_svg(records, &format!("{}: reward per step", cfg.name));
    std::fs::write(out.join("reward.svg"), svg)
        .map_err(|e| RunError::Io(format!("writing reward.svg: {e}")))?;
    let summary = Summary {
        name: cfg.name.clone(),
        steps: step,
        total_steps: cfg.total_steps,
        policy_version: version,
        first_reward: trained.first().map(|r| r.reward_mean),
        final_reward: metrics::recent_reward(records, 5),
        first_agent_reward: trained.first().and_then(|r| r.agent_reward_mean),
        final_agent_reward: recent_agent_reward(records, 5),
        seconds: started.elapsed().as_secs_f64(),
        resumed_from: resume.map(|(_, m)| m.step),
        last_checkpoint,
        interrupted,
    };
    super::files::write_atomic(
        &out.join("summary.json"),
        &serde_json::to_vec_pretty(&summary).expect("summary serializes"),
    )?;
    Ok(summary)
}

/// What a process resuming from a checkpoint says.
pub(crate) fn resume_note(cfg: &RunConfig, (dir, meta): &(PathBuf, CheckpointMeta)) -> String {
    format!(
        "resuming {} from {} (step {}, version {})",
        cfg.name,
        dir.display(),
        meta.step,
        meta.policy_version
    )
}

/// Awaits `batch` while the console says how many groups finished since the wait began.
async fn watch_generation<T>(
    console: &Console,
    pool: &RolloutPool,
    batch: impl std::future::Future<Output = T>,
) -> T {
    let before = pool.stats().groups_done;
    console.phase("generating episodes");
    tokio::pin!(batch);
    let mut every = tokio::time::interval(Duration::from_millis(500));
    loop {
        tokio::select! {
            out = &mut batch => return out,
            _ = every.tick() => {
                let done = pool.stats().groups_done - before;
                console.detail(format!("generating episodes: {done} groups finished"));
            }
        }
    }
}

/// The trainer: from the checkpoint's weights and moments (`resume`), or the model folder.
pub(crate) async fn load_trainer(
    cfg: &RunConfig,
    resume: Option<&(PathBuf, CheckpointMeta)>,
    device: Device,
) -> Result<Trainer, RunError> {
    let dir = resume.map_or(cfg.model_dir.clone(), |(d, _)| d.clone());
    let trainer_opts = cfg.trainer.clone();
    // A KL penalty is to the initial policy: the model folder's weights, frozen.
    let reference = (cfg.trainer.kl_coef > 0.0).then(|| cfg.model_dir.clone());
    let mut trainer = blocking(move || -> Result<Trainer, RunError> {
        let model = Qwen3Model::load(&dir, Kind::Float, device)?;
        let reference = reference
            .map(|d| Qwen3Model::load(&d, Kind::Float, device))
            .transpose()?;
        Trainer::new(model, reference, trainer_opts).map_err(RunError::Setup)
    })
    .await??;
    if let Some((dir, meta)) = resume {
        let moments = checkpoint::load_moments(dir, device)?;
        trainer
            .restore(meta.step, moments)
            .map_err(RunError::Checkpoint)?;
    }
    Ok(trainer)
}

/// The teacher of on-policy distillation, if the run has one; it must share the student's
/// vocabulary.
pub(crate) async fn load_teacher(
    cfg: &RunConfig,
    student: &Trainer,
    device: Device,
) -> Result<Option<Qwen3Model>, RunError> {
    let Some(dir) = cfg.teacher_dir.clone() else {
        return Ok(None);
    };
    let student_vocab = student.model().config().vocab_size;
    let teacher = blocking(move || Qwen3Model::load(&dir, Kind::Float, device)).await??;
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
pub(crate) async fn save_checkpoint(
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
pub(crate) struct Learned {
    pub advantages: Vec<Vec<f64>>,
    pub stats: crate::trainer::train::StepStats,
    pub teacher_kl: Option<f64>,
    pub train_seconds: f64,
}

/// Advantages, the exact token segments as trainer samples, the teacher's scores (distillation),
/// and one optimizer step. The trainer and teacher move to a compute thread and back.
pub(crate) async fn learn(
    cfg: &RunConfig,
    mut trainer: Trainer,
    teacher: Option<Qwen3Model>,
    batch: &[crate::rollout::Group],
) -> Result<(Trainer, Option<Qwen3Model>, Learned), RunError> {
    let advantages = samples::advantages(cfg.estimator, batch)?;
    let mut train_samples = samples::samples(batch, &advantages, cfg.routing_replay)?;
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
        train_seconds: started.elapsed().as_secs_f64(),
    };
    Ok((trainer, teacher, learned))
}

/// Mean agent reward (before the judge) of the last `n` steps that recorded one.
fn recent_agent_reward(records: &[StepRecord], n: usize) -> Option<f64> {
    let recent: Vec<f64> = records
        .iter()
        .rev()
        .filter_map(|r| r.agent_reward_mean)
        .take(n)
        .collect();
    (!recent.is_empty()).then(|| recent.iter().sum::<f64>() / recent.len() as f64)
}

pub(crate) struct StepTimes {
    pub step: f64,
    pub sync: f64,
    pub elapsed: f64,
}

/// The metrics record of a step: the batch, what training it produced, and the times.
pub(crate) fn step_record(
    batch: &[crate::rollout::Group],
    learned: &Learned,
    staleness: BTreeMap<u64, usize>,
    times: StepTimes,
    (step, version): (u64, u64),
    rollout: crate::rollout::RolloutStats,
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
        train_seconds,
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
        loss: stats.loss,
        mean_abs_log_rho: stats.mean_abs_log_rho,
        masked_fraction: stats.masked_fraction,
        entropy: stats.entropy,
        kl: stats.kl,
        grad_norm: stats.grad_norm,
        learning_rate: stats.learning_rate,
        teacher_kl: *teacher_kl,
        agent_reward_mean: None,
        judge_score_mean: None,
        judge_unparsed: None,
        judge_failed: None,
        judge_seconds: None,
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
        elapsed_seconds: times.elapsed,
    }
}
