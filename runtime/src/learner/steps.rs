//! The step loop, the one both modes run (docs/architecture.md, "A step, end to end"): next
//! batch → batch stages → learn → publish → record → checkpoint. What differs between `moult run`
//! and a cluster's trainer pod is where batches come from, who numbers versions and where a
//! finished step is reported: a [`Steps`] of each mode (`local`, `cluster`, and a replay of
//! dumped batches).
//!
//! A stop ([`Learner::stop`]: SIGTERM, Ctrl-C) ends the loop without losing a trained step: while
//! it waits for a batch or runs the batch stages, the step is abandoned; while it learns, the
//! step is finished but not published (the engines may be gone). Either way the last step trained
//! is checkpointed, and a resumed run goes on at the step after it (docs/operator.md, "Stopping,
//! suspending, preempting").

use std::path::PathBuf;
use std::time::Instant;

use super::Learner;
use crate::error::{Result, RunError};
use crate::records::metrics::StepRecord;
use crate::stages::{Stage, StepBatch};

/// Where a run's batches come from and where its finished steps go.
pub(crate) trait Steps {
    /// The batch of `step`, once there is one; `None` when the run stops here (shutdown, or no
    /// more data). It may publish through `learner` first (engines that need the current weights).
    async fn next(&mut self, step: u64, learner: &mut Learner) -> Result<Option<StepBatch>>;

    /// The policy version the weights of `step` are published as: by default the step itself
    /// (a cluster's coordinator numbers versions of its own).
    async fn version(&mut self, step: u64) -> u64 {
        step
    }

    /// `step` is trained, published, recorded and (when due) checkpointed.
    async fn done(&mut self, step: Trained, batch: StepBatch) -> Result<()>;

    /// The batch of `step` was set aside (`error` says why): the next call to
    /// [`Steps::next`] draws the step's batch again. By default the run stops with `error` (a
    /// replay has no other batch for the step).
    async fn quarantined(&mut self, step: u64, error: RunError) -> Result<()> {
        let _ = step;
        Err(error)
    }
}

/// The run stops at this many batches in a row the trainer cannot learn from: the fault is then
/// not the data.
const QUARANTINED_IN_A_ROW: usize = 3;

/// What one step produced.
#[derive(Debug)]
pub(crate) struct Trained {
    pub record: StepRecord,
    /// The checkpoint written after this step, if one was due.
    pub checkpoint: Option<PathBuf>,
}

/// Trains until the run's last step, or until `steps` has no next batch.
pub(crate) async fn run_steps(
    learner: &mut Learner,
    steps: &mut impl Steps,
    stages: &[Box<dyn Stage>],
) -> Result<()> {
    let mut quarantined = 0;
    while learner.step < learner.cfg.total_steps {
        let started = Instant::now();
        let step = learner.step + 1;
        // 1. A batch of finished groups (generated while the previous step trained); none when
        // the run stops (it keeps the last step it trained).
        let Some(mut batch) = steps.next(step, learner).await? else {
            return learner.checkpoint_on_stop().await.map(drop);
        };
        // 2. The batch stages, in order: a teacher's scores, a judge's rewards, a dump, ...; a
        // stop abandons the step.
        let staged = async {
            for stage in stages {
                learner.console.phase(stage.phase());
                stage.apply(&mut batch).await?;
            }
            Ok::<_, RunError>(())
        };
        tokio::select! {
            staged = staged => staged?,
            () = learner.stop.cancelled() => return learner.checkpoint_on_stop().await.map(drop),
        }
        // 3. Advantages, samples, one optimizer step; a batch the trainer cannot learn from (or
        // that stopped trainers before) is set aside, and the step drawn again.
        let learned = match batch.stops_trainers() {
            Some(e) => Err(e),
            None => learner.learn(&batch.groups).await,
        };
        let learned = match learned {
            Err(e) if e.is_batch() && quarantined + 1 < QUARANTINED_IN_A_ROW => {
                quarantined += 1;
                learner.quarantine(&batch, &e)?;
                steps.quarantined(step, e).await?;
                continue;
            }
            learned => learned?,
        };
        quarantined = 0;
        // 4. The new weights to the engines (pause, transfer, resume) under the next version; a
        // run that is stopping keeps them for its checkpoint instead (the engines may be gone).
        let version = tokio::select! {
            biased;
            () = learner.stop.cancelled() => None,
            version = steps.version(step) => Some(version),
        };
        let published = match version {
            Some(v) => (learner.publish(v, learner.cfg.partial_rollout).await?).map(|s| (v, s)),
            None => None,
        };
        let (version, sync) = published.unwrap_or((learner.version, 0.0));
        // 5. The step's record (metrics.jsonl, TensorBoard), then a checkpoint when one is due
        // (or the run is stopping).
        let record = learner
            .record(&batch, learned, version, sync, started)
            .await?;
        let checkpoint = learner.checkpoint_if_due(&batch, version).await?;
        steps.done(Trained { record, checkpoint }, batch).await?;
    }
    Ok(())
}
