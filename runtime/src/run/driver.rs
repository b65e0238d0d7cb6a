//! The loop of `moult run` (see the module above); the training side is the [`Learner`] the
//! cluster's trainer uses too.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
use tch::Device;

use super::config::RunConfig;
use super::console::Console;
use super::learner::{Batch, Learner};
use super::metrics::{self, StepRecord};
use super::{local, ordered, RunError};
use crate::rollout::{next_batch, RolloutPool, RolloutState};

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
    /// Over the steps this process trained, weighted by their wall-clock: the fraction of time
    /// the engines had work, the fraction the trainer computed, and the seconds engines sat
    /// paused for weight sync (docs/run.md, "How busy engines and trainer were").
    pub engine_busy_fraction: f64,
    pub trainer_busy_fraction: f64,
    pub engine_paused_seconds: f64,
    pub resumed_from: Option<u64>,
    pub last_checkpoint: Option<PathBuf>,
    pub interrupted: bool,
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
    let (mut step, mut version, state, seed) = match &resume {
        Some((_, m)) => (m.step, m.policy_version, m.rollout, m.seed),
        None => (0, 0, RolloutState::default(), opts.seed),
    };
    if step >= cfg.total_steps {
        console.line(&format!(
            "moult run: {} already finished ({step} steps)",
            cfg.name
        ));
    }
    console.set_step(step);
    let device = opts.device;

    console.phase("starting engines and agents");
    let scratch = out.join("scratch");
    let stack = local::Stack::start(&cfg, device, &scratch, console).await?;
    learner
        .connect(&stack.publish_options(&cfg, out, device)?)
        .await?;
    if resume.is_some() {
        // The engines loaded the original model: bring them to the checkpoint's version.
        learner.publish(version, false).await?;
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
    learner.log_to(out)?;
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
        // 2. Advantages, samples, one optimizer step; the new weights to the engines (pause,
        // transfer, resume) as the trainer's step count; the record; a checkpoint when due.
        let trained = learner
            .train(
                Batch {
                    groups: &batch,
                    served: version,
                    stats: pool.stats(),
                    rollout: pool.state(),
                    seed,
                    judged,
                    started: step_started,
                },
                |trainer| std::future::ready(trainer.steps()),
            )
            .await?;
        step = learner.step();
        version = trained.record.policy_version;
        pool.set_version(version);
        drop(batch); // frees the groups' admission slots: generation goes on
        step_started = Instant::now();
        let done = step - first_step;
        let eta = Duration::from_secs_f64(
            started.elapsed().as_secs_f64() / done as f64 * (cfg.total_steps - step) as f64,
        );
        console.line(&metrics::progress_line(
            &trained.record,
            cfg.total_steps,
            Some(eta),
        ));
        console.set_step(step);
        if trained.checkpoint.is_some() {
            last_checkpoint = trained.checkpoint;
        }
    }
    console.phase("stopping");
    // Abandon the episodes in flight before the servers go, so they end quietly.
    pool.stop();
    drop(queue);
    stack.shutdown().await;
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
