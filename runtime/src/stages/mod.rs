//! Batch stages: what happens to a step's batch of finished groups between the rollout pool and
//! the trainer, in one ordered list ([`ordered`]): a served teacher scores every token
//! ([`teacher`]), a judge mixes its scores into the rewards ([`judge`]), and the batch is written
//! as it will be trained on ([`dump`]). Adding a stage is one file here and one line in
//! [`ordered`] (docs/extending.md, "A new batch stage").
//!
//! `moult run` applies the whole list. On a cluster each process builds the list of the parts it
//! has, so every stage runs once per step in both modes: the coordinator, before it hands the
//! batch out, the stages that need the run's engines (teacher, judge); the trainer those that need
//! its volume (the dump).

pub mod dump;
pub mod judge;
pub mod teacher;

use std::path::PathBuf;

use futures::future::BoxFuture;
use serde::{Deserialize, Serialize};

use moult_operator::api::RLRunSpec;

use crate::error::{Result, RunError};
use crate::rollout::eval::EvalResult;
use crate::rollout::{Group, RolloutPool, RolloutState, RolloutStats};
use judge::{Judge, JudgeStats};
use teacher::{Teacher, TeacherStats};

/// The groups of one training step, and what is known about them (the coordinator hands this to
/// the trainer pod as JSON; `moult run` passes it along in memory).
#[derive(Debug, Default, Serialize, Deserialize)]
pub struct StepBatch {
    pub step: u64,
    pub groups: Vec<Group>,
    /// The version the engines served when the batch was handed out (staleness is counted from
    /// it). `served` in dumps that earlier versions wrote.
    #[serde(alias = "served")]
    pub version: u64,
    /// The data cursor after these groups were drawn (checkpointed with the step).
    pub rollout: RolloutState,
    pub stats: RolloutStats,
    /// The seed of the task order (checkpointed with the step).
    #[serde(default)]
    pub seed: u64,
    /// The evaluation of the policy this step starts from (`spec.eval`), when one was due.
    pub eval: Option<EvalResult>,
    /// With `spec.judge`: the judge's verdict on the batch (the groups' rewards hold its
    /// scores already).
    pub judged: Option<JudgeStats>,
    /// With a served distillation teacher: how its engines scored the batch (every trained
    /// segment carries its scores).
    pub taught: Option<TeacherStats>,
    /// Trainers that started again while they held this batch (handed out, never committed):
    /// a batch that keeps stopping the trainer is set aside ([`StepBatch::stops_trainers`]).
    #[serde(default)]
    pub restarts: u32,
}

impl StepBatch {
    /// The batch of `step`: `groups`, just drawn from `pool` (whose version, data cursor and
    /// counts it records), in the task order of `seed`.
    pub fn drawn(step: u64, groups: Vec<Group>, pool: &RolloutPool, seed: u64) -> Self {
        Self {
            step,
            groups,
            version: pool.version(),
            rollout: pool.state(),
            stats: pool.stats(),
            seed,
            ..Self::default()
        }
    }

    /// Why the trainer should set this batch aside without learning from it: it was handed out
    /// twice before and each trainer stopped on it (a crash the trainer could not report).
    pub fn stops_trainers(&self) -> Option<RunError> {
        (self.restarts >= 2).then(|| {
            RunError::Batch(format!(
                "the trainer stopped {} times while it held this batch, without committing it",
                self.restarts
            ))
        })
    }
}

/// One stage of the batch pipeline. It may change the groups (rewards, segments' scores) and
/// note what it found in the batch's fields; an error stops `moult run` and, on a cluster, has
/// the coordinator apply the stages again after a pause.
pub trait Stage: Send + Sync + std::fmt::Debug {
    /// What the run's status line says while the stage works ("judging the batch").
    fn phase(&self) -> &'static str;

    fn apply<'a>(&'a self, batch: &'a mut StepBatch) -> BoxFuture<'a, Result<()>>;
}

/// What a process has for the stages; a stage is in the list when its part is here.
#[derive(Debug, Default)]
pub struct Parts {
    pub teacher: Option<Teacher>,
    pub judge: Option<Judge>,
    /// Where this process would write rollout dumps, and whether `--dump-rollouts` asks for them
    /// (`spec.trainer.dumpRollouts` does too).
    pub dumps: Option<PathBuf>,
    pub dump_rollouts: bool,
}

/// The stages of a run, in the order they apply: the teacher scores the tokens the agents
/// sampled, the judge the replies, and the dump writes the batch as the trainer will see it.
/// A stage with a spec field reads it from `spec`.
pub fn ordered(spec: &RLRunSpec, parts: Parts) -> Vec<Box<dyn Stage>> {
    let dump = parts.dump_rollouts || spec.trainer.dump_rollouts;
    let dumps = parts.dumps.filter(|_| dump);
    let stages: [Option<Box<dyn Stage>>; 3] = [
        parts.teacher.map(|teacher| Box::new(teacher) as _),
        parts.judge.map(|judge| Box::new(judge) as _),
        dumps.map(|dir| Box::new(dump::Dump(dir)) as _),
    ];
    stages.into_iter().flatten().collect()
}

/// Applies `stages` to `batch`, in order.
pub async fn apply(stages: &[Box<dyn Stage>], batch: &mut StepBatch) -> Result<()> {
    for stage in stages {
        stage.apply(batch).await?;
    }
    Ok(())
}
