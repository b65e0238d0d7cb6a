//! The loop of `moult run` (see the module above); the training side is the [`Learner`] the
//! cluster's trainer uses too.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
use tch::Device;

use super::checkpoint::CheckpointMeta;
use super::config::RunConfig;
use super::console::Console;
use super::learner::{Batch, Learner, Trained};
use super::metrics::{self, StepRecord};
use super::{dump, local, ordered, RunError};
use crate::rollout::eval::{self, EvalOptions, EvalResult};
use crate::rollout::{next_batch, EpisodeRunner, RolloutPool, RolloutState};

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
    /// Write every trained batch to `<out>/rollouts/` ([`super::dump`]).
    pub dump_rollouts: bool,
    /// Train on the batches dumped in this folder, in order, instead of generating: no engines,
    /// no agents, no weight sync.
    pub replay: Option<PathBuf>,
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
    /// Over the steps this process trained, weighted by their wall-clock: the fraction of time
    /// the engines had work, the fraction the trainer computed, and the seconds engines sat
    /// paused for weight sync (docs/run.md, "How busy engines and trainer were").
    pub engine_busy_fraction: f64,
    pub trainer_busy_fraction: f64,
    pub engine_paused_seconds: f64,
    pub resumed_from: Option<u64>,
    pub last_checkpoint: Option<PathBuf>,
    pub interrupted: bool,
    /// With `spec.eval`: the first and the newest evaluation (every one is in `eval.jsonl`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub first_eval: Option<EvalResult>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_eval: Option<EvalResult>,
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
    let console = &opts.console;
    // The status line's ticker ends with the run.
    let _ticker = crate::AbortOnDrop(console.tick());
    console.phase("loading the model");
    let ckpt_root = out.join("checkpoints");
    let mut learner =
        Learner::load(cfg.clone(), Some(ckpt_root), opts.device, console.clone()).await?;
    let resume = learner.resumed().cloned();
    let cluster_only = crate::run::config::cluster_only_fields(&cfg.run.spec);
    if !cluster_only.is_empty() {
        console.line(&format!(
            "moult run: set for a cluster, not used here: {}",
            cluster_only.join("; ")
        ));
    }
    if let Some(note) = learner.resume_note() {
        console.line(&format!("moult run: {note}"));
    }
    let (state, seed) = match &resume {
        Some((_, m)) => (m.rollout, m.seed),
        None => (RolloutState::default(), opts.seed),
    };
    let mut progress = Progress::new(resume.as_ref(), started);
    if progress.step >= cfg.total_steps {
        console.line(&format!(
            "moult run: {} already finished ({} steps)",
            cfg.name, progress.step
        ));
    }
    console.set_step(progress.step);
    let device = opts.device;

    if let Some(dir) = &opts.replay {
        return replay(cfg, &opts, dir, learner, progress).await;
    }
    console.phase("starting engines and agents");
    let scratch = out.join("scratch");
    let stack = local::Stack::start(&cfg, device, &scratch, console).await?;
    learner
        .connect(&stack.publish_options(&cfg, out, device)?)
        .await?;
    if resume.is_some() {
        // The engines loaded the original model: bring them to the checkpoint's version.
        learner.publish(progress.version, false).await?;
    }
    let dataset = Arc::new(ordered(&cfg.tasks, seed));
    let (pool, mut queue) = RolloutPool::start(
        stack.agents.clone(),
        dataset,
        cfg.rollout.clone(),
        state,
        progress.version,
    )
    .map_err(|e| RunError::Setup(e.to_string()))?;
    learner.log_to(out)?;
    let mut step_started = Instant::now();
    tokio::pin!(shutdown);

    while progress.step < cfg.total_steps {
        // 0. With `spec.eval`, the policy of this step on the held-out tasks, when due
        // (generation for training goes on meanwhile; the trainer waits).
        if let Some(e) = &cfg.eval {
            if e.due(progress.step, cfg.total_steps) {
                tokio::select! {
                    r = evaluate(console, stack.agents.as_ref(), e, &progress) => learner.record_eval(r)?,
                    () = &mut shutdown => { progress.interrupted = true; break; }
                }
            }
        }
        // 1. A batch of finished groups (generated while the previous step trained).
        let batch = tokio::select! {
            b = watch_generation(console, &pool, next_batch(&pool, &mut queue, &cfg.rollout)) => b,
            () = &mut shutdown => { progress.interrupted = true; break; }
        };
        let Some(mut batch) = batch else {
            return Err(RunError::Setup("the rollout pool stopped".into()));
        };
        // With a served teacher, every token of the batch is scored by its engine.
        let taught = match &stack.teacher {
            Some(teacher) => {
                console.phase("the teacher scores the batch");
                Some(teacher.score_batch(&mut batch, progress.step + 1).await?)
            }
            None => None,
        };
        // With a judge, every reply of the batch is scored at once and the rewards mixed.
        let judged = match &stack.judge {
            Some(judge) => {
                console.phase("judging the batch");
                Some(judge.score_batch(&mut batch, progress.step + 1).await?)
            }
            None => None,
        };
        if opts.dump_rollouts || cfg.run.spec.trainer.dump_rollouts {
            dump::write(
                &dump::folder(out),
                &dump::DumpRef {
                    step: progress.step + 1,
                    served: progress.version,
                    stats: pool.stats(),
                    rollout: pool.state(),
                    seed,
                    groups: &batch,
                },
            )?;
        }
        // 2. Advantages, samples, one optimizer step; the new weights to the engines (pause,
        // transfer, resume) as the trainer's step count; the record; a checkpoint when due.
        let trained = learner
            .train(
                Batch {
                    groups: &batch,
                    served: progress.version,
                    stats: pool.stats(),
                    rollout: pool.state(),
                    seed,
                    judged,
                    taught,
                    started: step_started,
                },
                |trainer| std::future::ready(trainer.steps()),
            )
            .await?;
        progress.trained(learner.step(), &trained);
        pool.set_version(progress.version);
        drop(batch); // frees the groups' admission slots: generation goes on
        step_started = Instant::now();
        let done = progress.step - progress.first_step;
        let eta = Duration::from_secs_f64(
            started.elapsed().as_secs_f64() / done as f64
                * (cfg.total_steps - progress.step) as f64,
        );
        console.line(&metrics::progress_line(
            &trained.record,
            cfg.total_steps,
            Some(eta),
        ));
        console.set_step(progress.step);
    }
    // The policy the run ends with, evaluated.
    if let Some(e) = &cfg.eval {
        let last = learner.evals().last().map(|r| r.step);
        if !progress.interrupted && progress.step == cfg.total_steps && last != Some(progress.step)
        {
            tokio::select! {
                r = evaluate(console, stack.agents.as_ref(), e, &progress) => learner.record_eval(r)?,
                () = &mut shutdown => progress.interrupted = true,
            }
        }
    }
    console.phase("stopping");
    // Abandon the episodes in flight before the servers go, so they end quietly.
    pool.stop();
    drop(queue);
    stack.shutdown().await;
    summarize(&cfg, out, &learner, progress)
}

/// `moult eval`: the manifest's evaluation (`spec.eval`) of the policy in `checkpoint` (a
/// checkpoint folder, a run's checkpoint root, or any model folder; the manifest's model when
/// `None`), on engines and agents of this machine, as a run evaluates during training.
pub async fn evaluate_checkpoint(
    mut cfg: RunConfig,
    opts: &RunOptions,
    checkpoint: Option<&std::path::Path>,
) -> Result<EvalResult, RunError> {
    let eval = cfg.eval.clone().ok_or_else(|| {
        RunError::Manifest(
            "spec.eval: moult eval needs it (the held-out tasks and how to sample them; \
             docs/run.md, \"Evaluation\")"
                .into(),
        )
    })?;
    let (step, version) = match checkpoint {
        Some(dir) => {
            let (dir, meta) = super::checkpoint::model_folder(dir)?;
            opts.console
                .line(&format!("moult eval: the policy in {}", dir.display()));
            cfg.model_dir = dir;
            meta.map_or((0, 0), |m| (m.step, m.policy_version))
        }
        None => (0, 0),
    };
    // Evaluation rewards are the agents' own: no judge.
    cfg.judge = None;
    let console = &opts.console;
    let _ticker = crate::AbortOnDrop(console.tick());
    console.phase("starting engines and agents");
    std::fs::create_dir_all(&opts.out)
        .map_err(|e| RunError::Io(format!("creating {}: {e}", opts.out.display())))?;
    let stack = local::Stack::start(&cfg, opts.device, &opts.out.join("scratch"), console).await?;
    let progress = Progress {
        first_step: step,
        step,
        version,
        resumed_from: None,
        last_checkpoint: None,
        interrupted: false,
        started: Instant::now(),
    };
    let result = evaluate(console, stack.agents.as_ref(), &eval, &progress).await;
    stack.shutdown().await;
    Ok(result)
}

/// The evaluation of the policy `progress` stands at, with the console saying how far it is.
async fn evaluate(
    console: &Console,
    runner: &dyn EpisodeRunner,
    opts: &EvalOptions,
    progress: &Progress,
) -> EvalResult {
    console.phase("evaluating");
    eval::evaluate(
        runner,
        opts,
        (progress.step, progress.version),
        &|done, total| console.detail(format!("evaluating: {done}/{total} episodes")),
    )
    .await
}

/// Where a run's loop stands, for its summary.
struct Progress {
    /// The step this process started from (a checkpoint's, or 0).
    first_step: u64,
    /// Steps trained, and the policy version they left.
    step: u64,
    version: u64,
    resumed_from: Option<u64>,
    last_checkpoint: Option<PathBuf>,
    interrupted: bool,
    started: Instant,
}

impl Progress {
    fn new(resume: Option<&(PathBuf, CheckpointMeta)>, started: Instant) -> Self {
        let (step, version) = resume.map_or((0, 0), |(_, m)| (m.step, m.policy_version));
        Self {
            first_step: step,
            step,
            version,
            resumed_from: resume.map(|(_, m)| m.step),
            last_checkpoint: resume.map(|(d, _)| d.clone()),
            interrupted: false,
            started,
        }
    }

    /// After a step: `step` steps are trained.
    fn trained(&mut self, step: u64, trained: &Trained) {
        self.step = step;
        self.version = trained.record.policy_version;
        if let Some(dir) = &trained.checkpoint {
            self.last_checkpoint = Some(dir.clone());
        }
    }
}

/// Writes `reward.svg` and `summary.json`; the summary.
fn summarize(
    cfg: &RunConfig,
    out: &std::path::Path,
    learner: &Learner,
    progress: Progress,
) -> Result<Summary, RunError> {
    let Progress {
        first_step,
        step,
        version,
        resumed_from,
        last_checkpoint,
        interrupted,
        started,
    } = progress;
    let records = learner.records();
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
        engine_busy_fraction: time_weighted(&trained, |r| r.engine_busy_fraction),
        trainer_busy_fraction: time_weighted(&trained, |r| r.trainer_busy_fraction),
        engine_paused_seconds: trained.iter().map(|r| r.engine_paused_seconds).sum(),
        resumed_from,
        last_checkpoint,
        interrupted,
        first_eval: learner.evals().first().cloned(),
        last_eval: learner.evals().last().cloned(),
    };
    super::files::write_atomic(
        &out.join("summary.json"),
        &serde_json::to_vec_pretty(&summary).expect("summary serializes"),
    )?;
    Ok(summary)
}

/// `moult run --replay DIR`: trains on the dumped batches in order (from where a checkpoint in
/// the output folder left off), on the manifest's model and algorithm, without engines: the
/// same data, so two algorithms, or two builds, can be compared step by step.
async fn replay(
    cfg: RunConfig,
    opts: &RunOptions,
    dir: &std::path::Path,
    mut learner: Learner,
    mut progress: Progress,
) -> Result<Summary, RunError> {
    let (out, console) = (&opts.out, &opts.console);
    let steps = dump::steps(dir)?;
    let first_step = progress.first_step;
    let total = cfg.total_steps.min(steps.len() as u64);
    if total < cfg.total_steps {
        console.line(&format!(
            "moult run: {} holds {} steps: replaying those, not the {} the run asks for",
            dir.display(),
            steps.len(),
            cfg.total_steps
        ));
    }
    learner.offline = true;
    learner.log_to(out)?;
    for (_, path) in steps
        .iter()
        .skip(first_step as usize)
        .take((total - first_step.min(total)) as usize)
    {
        let step_started = Instant::now();
        console.phase("reading the dumped batch");
        let batch = dump::read(path)?;
        let trained = learner
            .train(
                Batch {
                    groups: &batch.groups,
                    served: batch.served,
                    stats: batch.stats,
                    rollout: batch.rollout,
                    seed: batch.seed,
                    judged: None,
                    taught: None,
                    started: step_started,
                },
                |trainer| std::future::ready(trainer.steps()),
            )
            .await?;
        progress.trained(learner.step(), &trained);
        console.line(&metrics::progress_line(&trained.record, total, None));
        console.set_step(progress.step);
    }
    summarize(&cfg, out, &learner, progress)
}

/// The mean of `f` over `records`, each weighted by its step's wall-clock.
fn time_weighted(records: &[StepRecord], f: impl Fn(&StepRecord) -> f64) -> f64 {
    let total: f64 = records.iter().map(|r| r.step_seconds).sum();
    if total <= 0.0 {
        return 0.0;
    }
    records.iter().map(|r| f(r) * r.step_seconds).sum::<f64>() / total
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
