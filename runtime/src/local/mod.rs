//! `moult run`: a whole RL run from one RLRun manifest on this machine (docs/run.md). A shell
//! over the run core: it starts the serving side as tasks of this process ([`stack`]: built-in
//! engines or vLLM processes ([`vllm`]) behind the router, the loopback server and the agent
//! pool), the rollout pool over it, and runs the one step loop of [`crate::learner::steps`] with
//! the rollout pool's batches ([`LocalSteps`]), or a folder of dumped ones (`--replay`). It decides
//! nothing about learning. Generation never stops for training: the rollout pool keeps up to
//! `maxStaleness + 1` batches in flight (`--sync` turns that off, for comparison).

pub mod stack;
pub mod vllm;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
use tch::Device;
use tokio_util::sync::CancellationToken;

use crate::config::{ordered, RunConfig};
use crate::error::{Result, RunError};
use crate::learner::checkpoint::CheckpointMeta;
use crate::learner::steps::{run_steps, Steps, Trained};
use crate::learner::Learner;
use crate::records::console::Console;
use crate::records::files::write_atomic;
use crate::records::metrics::{self, StepRecord};
use crate::rollout::eval::{self, EvalOptions, EvalResult};
use crate::rollout::{next_batch, EpisodeRunner, RolloutPool, RolloutState};
use crate::stages::{self, dump, StepBatch};

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
/// `<out>/checkpoints`), or until `stop` (then with a checkpoint of the last step trained).
pub async fn run(cfg: RunConfig, opts: RunOptions, stop: CancellationToken) -> Result<Summary> {
    let started = Instant::now();
    let out = &opts.out;
    std::fs::create_dir_all(out).map_err(|e| RunError::file("creating", out, e))?;
    let console = &opts.console;
    // The status line's ticker ends with the run.
    let _ticker = AbortOnDrop(console.tick());
    console.phase("loading the model");
    let checkpoints = Some(out.join("checkpoints"));
    let mut learner =
        Learner::load(cfg.clone(), checkpoints, opts.device, console.clone(), None).await?;
    learner.stop = stop.clone();
    let cluster_only = crate::config::cluster_only_fields(&cfg.run.spec);
    if !cluster_only.is_empty() {
        console.line(&format!(
            "moult run: set for a cluster, not used here: {}",
            cluster_only.join("; ")
        ));
    }
    if let Some(note) = learner.resume_note() {
        console.line(&format!("moult run: {note}"));
    }
    let resume = learner.resumed().map(|(_, m)| (m.rollout, m.seed));
    let (state, seed) = resume.unwrap_or((RolloutState::default(), opts.seed));
    let progress = Progress::new(learner.resumed(), started);
    if progress.step >= cfg.total_steps {
        console.line(&format!(
            "moult run: {} already finished ({} steps)",
            cfg.name, progress.step
        ));
    }
    console.set_step(progress.step);
    if let Some(dir) = &opts.replay {
        learner.offline = true;
        learner.log_to(out)?;
        let mut dumps = dump::steps(dir)?;
        let (held, total) = (dumps.len(), cfg.total_steps);
        if (held as u64) < total {
            let dir = dir.display();
            console.line(&format!("moult run: {dir} holds {held} steps: replaying those, not the {total} the run asks for"));
        }
        dumps.truncate(cfg.total_steps as usize);
        let mut steps = ReplaySteps {
            dumps,
            console,
            progress,
        };
        run_steps(&mut learner, &mut steps, &[]).await?;
        return summarize(&cfg, out, &learner, steps.progress);
    }
    console.phase("starting engines and agents");
    let mut stack = stack::Stack::start(&cfg, opts.device, &out.join("scratch"), console).await?;
    let publish = stack.publish_options(&cfg, out, opts.device)?;
    learner.connect(&publish).await?;
    if resume.is_some() || cfg.run.spec.versioned_adapters() {
        // The engines loaded the original model (and none of a LoRA run's adapters on a pool or
        // vLLM): bring them to the checkpoint's version.
        learner.publish(progress.version, false).await?;
    }
    let dataset = Arc::new(ordered(&cfg.tasks, seed));
    let (pool, queue) = RolloutPool::start(
        stack.agents.clone(),
        dataset,
        cfg.rollout.clone(),
        state,
        progress.version,
    )?;
    learner.log_to(out)?;
    let parts = stages::Parts {
        teacher: stack.teacher.take(),
        judge: stack.judge.take(),
        dumps: Some(dump::folder(out)),
        dump_rollouts: opts.dump_rollouts,
    };
    let stages = stages::ordered(&cfg.run.spec, parts);
    let mut steps = LocalSteps {
        cfg: &cfg,
        console,
        agents: stack.agents.as_ref(),
        pool: &pool,
        queue,
        seed,
        progress,
        stop: &stop,
    };
    run_steps(&mut learner, &mut steps, &stages).await?;
    // The policy the run ends with, evaluated.
    if steps.progress.step == cfg.total_steps {
        steps.evaluate_if_due(&mut learner).await?;
    }
    console.phase("stopping");
    // Abandon the episodes in flight before the servers go, so they end quietly.
    pool.stop();
    let progress = steps.progress;
    stack.shutdown().await;
    summarize(&cfg, out, &learner, progress)
}

/// `moult run`'s batches: the rollout pool's, generated while the step before trained; with
/// `spec.eval`, each evaluation that is due before them.
struct LocalSteps<'a> {
    cfg: &'a RunConfig,
    console: &'a Console,
    agents: &'a dyn EpisodeRunner,
    pool: &'a RolloutPool,
    queue: tokio::sync::mpsc::Receiver<crate::rollout::Group>,
    seed: u64,
    progress: Progress,
    stop: &'a CancellationToken,
}

impl LocalSteps<'_> {
    /// The policy of the last step trained on the held-out tasks, when `spec.eval` says it is due
    /// and it is not evaluated yet (generation for training goes on meanwhile; the trainer
    /// waits). A shutdown interrupts it, and the run.
    async fn evaluate_if_due(&mut self, learner: &mut Learner) -> Result<()> {
        let (cfg, at) = (self.cfg, (self.progress.step, self.progress.version));
        let due = cfg.eval.as_ref().filter(|e| e.due(at.0, cfg.total_steps));
        let Some(e) = due.filter(|_| !learner.evals().iter().any(|r| r.step == at.0)) else {
            return Ok(());
        };
        tokio::select! {
            r = evaluate(self.console, self.agents, e, at) => learner.record_eval(r)?,
            () = self.stop.cancelled() => {}
        }
        Ok(())
    }
}

impl Steps for LocalSteps<'_> {
    async fn next(&mut self, step: u64, learner: &mut Learner) -> Result<Option<StepBatch>> {
        self.evaluate_if_due(learner).await?;
        if self.stop.is_cancelled() {
            return Ok(None);
        }
        let batch = next_batch(self.pool, &mut self.queue, &self.cfg.rollout);
        let groups = tokio::select! {
            groups = watch_generation(self.console, self.pool, batch) => groups,
            () = self.stop.cancelled() => return Ok(None),
        };
        let groups = groups.ok_or_else(|| RunError::Setup("the rollout pool stopped".into()))?;
        Ok(Some(StepBatch::drawn(step, groups, self.pool, self.seed)))
    }

    async fn done(&mut self, trained: Trained, batch: StepBatch) -> Result<()> {
        self.pool.set_version(trained.record.policy_version);
        drop(batch); // frees the groups' admission slots: generation goes on
        let total = self.cfg.total_steps;
        self.progress.trained(&trained, self.console, total, true);
        Ok(())
    }

    async fn quarantined(&mut self, _: u64, _: RunError) -> Result<()> {
        self.pool.quarantined();
        Ok(())
    }
}

/// `moult run --replay DIR`'s batches: the dumped ones in order (from where a checkpoint in the
/// output folder left off), on the manifest's model and algorithm, without engines: the same
/// data, so two algorithms, or two builds, can be compared step by step.
struct ReplaySteps<'a> {
    /// The dumped batches, as many as the run has steps.
    dumps: Vec<(u64, PathBuf)>,
    console: &'a Console,
    progress: Progress,
}

impl Steps for ReplaySteps<'_> {
    async fn next(&mut self, step: u64, _: &mut Learner) -> Result<Option<StepBatch>> {
        let Some((_, path)) = self.dumps.get(step as usize - 1) else {
            return Ok(None);
        };
        self.console.phase("reading the dumped batch");
        // What a judge or teacher found is the recorded run's, not this one's.
        Ok(Some(StepBatch {
            judged: None,
            taught: None,
            ..dump::read(path)?
        }))
    }

    async fn done(&mut self, trained: Trained, _: StepBatch) -> Result<()> {
        let total = self.dumps.len() as u64;
        self.progress.trained(&trained, self.console, total, false);
        Ok(())
    }
}

/// `moult eval`: the manifest's evaluation (`spec.eval`) of the policy in `checkpoint` (a
/// checkpoint folder, a run's checkpoint root, or any model folder; the manifest's model when
/// `None`), on engines and agents of this machine, as a run evaluates during training.
pub async fn evaluate_checkpoint(
    mut cfg: RunConfig,
    opts: &RunOptions,
    checkpoint: Option<&std::path::Path>,
) -> Result<EvalResult> {
    let why = "moult eval needs it (the held-out tasks and how to sample them; docs/run.md, \"Evaluation\")";
    let eval = (cfg.eval.clone()).ok_or_else(|| RunError::field("spec.eval", why))?;
    let (step, version) = match checkpoint {
        Some(dir) => {
            let (dir, meta) = crate::learner::checkpoint::model_folder(dir)?;
            let policy = dir.display();
            opts.console
                .line(&format!("moult eval: the policy in {policy}"));
            cfg.model_dir = dir;
            meta.map_or((0, 0), |m| (m.step, m.policy_version))
        }
        None => (0, 0),
    };
    // Evaluation rewards are the agents' own: no judge.
    cfg.judge = None;
    let console = &opts.console;
    let _ticker = AbortOnDrop(console.tick());
    console.phase("starting engines and agents");
    std::fs::create_dir_all(&opts.out).map_err(|e| RunError::file("creating", &opts.out, e))?;
    let stack = stack::Stack::start(&cfg, opts.device, &opts.out.join("scratch"), console).await?;
    let result = evaluate(console, stack.agents.as_ref(), &eval, (step, version)).await;
    stack.shutdown().await;
    Ok(result)
}

/// The evaluation of the policy of `(step, version)`, with the console saying how far it is.
async fn evaluate(
    console: &Console,
    runner: &dyn EpisodeRunner,
    opts: &EvalOptions,
    at: (u64, u64),
) -> EvalResult {
    console.phase("evaluating");
    let detail =
        |done: usize, total: usize| console.detail(format!("evaluating: {done}/{total} episodes"));
    eval::evaluate(runner, opts, at, &detail).await
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
            started,
        }
    }

    /// After a step of `total`: its progress line, with how long the steps left will take (at
    /// the pace of those this process trained) when `eta`.
    fn trained(&mut self, trained: &Trained, console: &Console, total: u64, eta: bool) {
        self.step = trained.record.step;
        self.version = trained.record.policy_version;
        if let Some(dir) = &trained.checkpoint {
            self.last_checkpoint = Some(dir.clone());
        }
        let pace =
            self.started.elapsed().as_secs_f64() / (self.step - self.first_step).max(1) as f64;
        let eta = eta.then(|| Duration::from_secs_f64(pace * (total - self.step) as f64));
        console.line(&metrics::progress_line(&trained.record, total, eta));
        console.set_step(self.step);
    }
}

/// Writes `reward.svg` and `summary.json`; the summary.
fn summarize(
    cfg: &RunConfig,
    out: &std::path::Path,
    learner: &Learner,
    progress: Progress,
) -> Result<Summary> {
    let records = learner.records();
    let trained: Vec<StepRecord> = records
        .iter()
        .filter(|r| r.step > progress.first_step)
        .cloned()
        .collect();
    let svg = metrics::reward_svg(records, &format!("{}: reward per step", cfg.name));
    write_atomic(&out.join("reward.svg"), svg.as_bytes())?;
    let summary = Summary {
        name: cfg.name.clone(),
        steps: progress.step,
        total_steps: cfg.total_steps,
        policy_version: progress.version,
        first_reward: trained.first().map(|r| r.reward_mean),
        final_reward: metrics::recent_mean(records, 5, |r| Some(r.reward_mean)),
        first_agent_reward: trained.first().and_then(|r| r.agent_reward_mean),
        final_agent_reward: metrics::recent_mean(records, 5, |r| r.agent_reward_mean),
        seconds: progress.started.elapsed().as_secs_f64(),
        engine_busy_fraction: time_weighted(&trained, |r| r.engine_busy_fraction),
        trainer_busy_fraction: time_weighted(&trained, |r| r.trainer_busy_fraction),
        engine_paused_seconds: trained.iter().map(|r| r.engine_paused_seconds).sum(),
        resumed_from: progress.resumed_from,
        last_checkpoint: progress.last_checkpoint,
        interrupted: learner.stop.is_cancelled(),
        first_eval: learner.evals().first().cloned(),
        last_eval: learner.evals().last().cloned(),
    };
    let json = serde_json::to_vec_pretty(&summary).expect("summary serializes");
    write_atomic(&out.join("summary.json"), &json)?;
    Ok(summary)
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

/// Aborts a background task when dropped: a task that lives exactly as long as its owner (a
/// run's status line).
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}
