//! The streaming rollout pool (docs/architecture.md): keeps prompt groups in flight so
//! engines never starve, completes a group when all its samples are done, and hands finished
//! groups to the trainer's queue, enforcing the staleness bound.
//!
//! - A **group** is `group_size` episodes of one task; it completes when every sample has, in any
//!   order (slow tails carry over: the trainer takes whatever groups are done).
//! - **Admission control**: at most `(max_staleness + 1) * batch_size` groups are generating,
//!   queued or being trained on at once (a group holds its slot until the trainer drops it). So
//!   the queue is bounded, and with `max_staleness` 0 generation waits for training (on-policy).
//! - **Staleness**: a finished group whose oldest sampled token is more than `max_staleness`
//!   versions behind the current policy is dropped (counted), never handed to the trainer.
//! - **Dynamic sampling** (DAPO), when on: a group whose rewards are all equal is dropped
//!   (counted as filtered) and its slot goes to a new group, until the step has looked at
//!   `max_groups_per_step` groups; then such groups are taken as they come, so a run never stalls.
//! - **Failures**: a group with a failed episode is dropped whole (its reason logged and counted):
//!   group-normalised advantages need every sample. So is a group with an episode that fails
//!   [`validate::check`] (malformed data from agent code), counted apart, whether it fails when
//!   it finishes or, against limits learned since (a coordinator hears the policy's vocabulary
//!   and positions in the trainer's hello), when its batch is drawn.
//! - The **data cursor** (next task, epoch) is part of the state, so a restarted run continues
//!   where it stopped ([`RolloutState`]).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use futures::future::BoxFuture;
use serde::{Deserialize, Serialize};
use serde_json::Value as Json;
use tokio::sync::{mpsc, Semaphore};

use crate::agents::{AgentPool, Episode, EpisodeStatus};
use crate::chat::SamplingOverride;

pub mod eval;
pub mod validate;
pub use validate::EpisodeLimits;

/// Why the rollout pool cannot start.
#[derive(Debug, thiserror::Error)]
pub enum RolloutError {
    #[error("the dataset has no tasks")]
    EmptyDataset,
    #[error("{0}")]
    Options(String),
}

/// Runs one episode of a task (the agent pool, or a stand-in in unit tests); with `sampling`,
/// every turn of the episode samples that way (an evaluation episode, [`eval`]).
pub trait EpisodeRunner: Send + Sync + 'static {
    fn run(
        &self,
        index: usize,
        task: Json,
        sampling: Option<SamplingOverride>,
    ) -> BoxFuture<'_, Episode>;
}

impl EpisodeRunner for AgentPool {
    fn run(
        &self,
        index: usize,
        task: Json,
        sampling: Option<SamplingOverride>,
    ) -> BoxFuture<'_, Episode> {
        Box::pin(self.episode(index, task, sampling))
    }
}

/// Settings of the rollout pool (the RLRun's `algorithm` section).
#[derive(Debug, Clone)]
pub struct RolloutOptions {
    /// Samples per task (GRPO's group).
    pub group_size: usize,
    /// Groups per training batch.
    pub batch_size: usize,
    /// How many policy versions behind a trained-on token may be.
    pub max_staleness: u64,
    /// What every finished episode is checked against ([`validate::check`]).
    pub limits: EpisodeLimits,
    /// Dynamic sampling: drop groups whose rewards are all equal, looking at this many finished
    /// groups per step at most; off when `None`.
    pub dynamic_sampling: Option<usize>,
}

impl RolloutOptions {
    /// Groups in flight or queued at most: `(max_staleness + 1)` batches.
    pub fn max_groups(&self) -> usize {
        (self.max_staleness as usize + 1) * self.batch_size
    }
}

/// Where the data stands: checkpointed with the run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RolloutState {
    /// The next task to start (index into the dataset).
    pub cursor: usize,
    /// Full passes over the dataset so far.
    pub epoch: usize,
}

/// A finished group: `group_size` completed episodes of one task. It holds its admission slot
/// until the trainer drops it, so groups generating, queued and being trained on together never
/// exceed `max_groups` (with `max_staleness` 0, generation waits for training: on-policy RL).
#[derive(Debug, Serialize, Deserialize)]
pub struct Group {
    /// The task's index in the dataset and the epoch it was drawn in.
    pub task_index: usize,
    pub epoch: usize,
    pub task: Json,
    pub episodes: Vec<Episode>,
    /// The oldest policy version among the group's sampled tokens.
    pub oldest_version: Option<u64>,
    /// Not sent: a group that crossed the network (to a trainer pod) is a copy; its slot stays
    /// with the coordinator's original.
    #[serde(skip)]
    _slot: Option<tokio::sync::OwnedSemaphorePermit>,
    /// The limits its episodes passed [`validate::check`] under: a batch draw checks again
    /// only a group admitted before the limits it knows now.
    #[serde(skip)]
    checked: EpisodeLimits,
}

impl Group {
    /// Whether a token of the group is more than `max_staleness` versions behind `now`.
    fn stale(&self, now: u64, max_staleness: u64) -> bool {
        self.oldest_version
            .is_some_and(|o| now.saturating_sub(o) > max_staleness)
    }

    /// Why the group may not be trained on, if an episode of it is malformed (logged).
    fn invalid(&self, limits: &EpisodeLimits, now: u64) -> Option<validate::Invalid> {
        let invalid = (self.episodes.iter()).find_map(|e| validate::check(e, limits, now).err());
        if let Some(reason) = &invalid {
            tracing::warn!(task = self.task_index, %reason, "group dropped: a malformed episode");
        }
        invalid
    }
}

/// What the pool counted so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RolloutStats {
    pub groups_started: u64,
    pub groups_done: u64,
    pub dropped_stale: u64,
    pub dropped_failed: u64,
    /// Groups dropped because an episode was malformed ([`validate::check`]).
    #[serde(default)]
    pub dropped_invalid: u64,
    /// Groups dropped by dynamic sampling: every reward equal.
    #[serde(default)]
    pub groups_filtered: u64,
    /// Batches the trainer could not learn from, set aside (docs/security.md, "Bad data").
    #[serde(default)]
    pub batches_quarantined: u64,
}

/// The segments of `batch` the trainer learns from (those with sampled tokens), in batch order,
/// with where they are: (group, episode, segment index). A served teacher scores exactly these,
/// and the learner makes one sample of each.
pub fn trained_segments(
    batch: &[Group],
) -> impl Iterator<Item = (usize, usize, usize, &crate::loopback::Segment)> {
    batch.iter().enumerate().flat_map(|(g, group)| {
        let episodes = group.episodes.iter().enumerate();
        episodes.flat_map(move |(e, episode)| {
            let segments = episode.segments.iter().enumerate();
            let trained = segments.filter(|(_, seg)| seg.sampled_tokens() > 0);
            trained.map(move |(s, seg)| (g, e, s, seg))
        })
    })
}

/// Every episode of the group has the same reward, exactly (no learning signal against a group
/// baseline).
pub fn rewards_all_equal(episodes: &[Episode]) -> bool {
    episodes.windows(2).all(|w| w[0].reward == w[1].reward)
}

/// The oldest version that sampled any token of `episodes`.
pub fn oldest_version(episodes: &[Episode]) -> Option<u64> {
    token_versions(episodes).min()
}

/// The version of every sampled token of `episodes`.
fn token_versions(episodes: &[Episode]) -> impl Iterator<Item = u64> + '_ {
    (episodes.iter())
        .flat_map(|e| e.segments.iter())
        .flat_map(|s| s.versions.iter().flatten())
        .copied()
}

#[derive(Debug)]
struct Shared {
    state: Mutex<RolloutState>,
    stats: Mutex<RolloutStats>,
    /// The policy version engines serve now (set by the weight sync).
    version: AtomicU64,
    /// What episodes are checked against (the vocabulary may be learned after the start).
    limits: Mutex<EpisodeLimits>,
    /// Groups dynamic sampling looked at since the last batch was taken.
    looked_at: AtomicU64,
}

/// The streaming rollout pool. [`RolloutPool::start`] runs it; finished groups arrive on the
/// receiver in completion order.
#[derive(Debug, Clone)]
pub struct RolloutPool {
    shared: Arc<Shared>,
    /// The task that draws tasks; it owns every group's task, so aborting it stops them all.
    driver: tokio::task::AbortHandle,
}

impl RolloutPool {
    /// Starts drawing tasks from `dataset` at `state`, running `group_size` episodes per task with
    /// `runner`. The returned receiver is the trainer's queue.
    pub fn start(
        runner: Arc<dyn EpisodeRunner>,
        dataset: Arc<Vec<Json>>,
        opts: RolloutOptions,
        state: RolloutState,
        version: u64,
    ) -> Result<(Self, mpsc::Receiver<Group>), RolloutError> {
        if dataset.is_empty() {
            return Err(RolloutError::EmptyDataset);
        }
        if opts.group_size == 0 || opts.batch_size == 0 {
            return Err(RolloutError::Options(format!(
                "groupSize and batchSize must be at least 1, got {} and {}",
                opts.group_size, opts.batch_size
            )));
        }
        let shared = Arc::new(Shared {
            state: Mutex::new(state),
            stats: Mutex::new(RolloutStats::default()),
            version: AtomicU64::new(version),
            limits: Mutex::new(opts.limits),
            looked_at: AtomicU64::new(0),
        });
        // Admission: a permit per group from its start until the trainer took it (or it was
        // dropped), so in flight + queued never exceeds max_groups.
        let permits = Arc::new(Semaphore::new(opts.max_groups()));
        // The queue itself never blocks a finished group: the permits already bound it.
        let (tx, rx) = mpsc::channel(opts.max_groups());
        let pool_shared = shared.clone();
        let driver = tokio::spawn(async move {
            let mut next_episode = 0usize;
            // Dropping the set (when this task is aborted) aborts every running group.
            let mut groups = tokio::task::JoinSet::new();
            loop {
                while groups.try_join_next().is_some() {}
                let Ok(permit) = permits.clone().acquire_owned().await else {
                    return;
                };
                if tx.is_closed() {
                    return;
                }
                let (task_index, epoch) = {
                    let mut s = shared.state.lock().expect("state lock");
                    let at = (s.cursor, s.epoch);
                    s.cursor = (s.cursor + 1) % dataset.len();
                    s.epoch += usize::from(s.cursor == 0);
                    at
                };
                shared.stats.lock().expect("stats lock").groups_started += 1;
                let task = dataset[task_index].clone();
                let first = next_episode;
                next_episode += opts.group_size;
                let (runner, shared, tx, opts) =
                    (runner.clone(), shared.clone(), tx.clone(), opts.clone());
                groups.spawn(async move {
                    let runs =
                        (0..opts.group_size).map(|k| runner.run(first + k, task.clone(), None));
                    let episodes = futures::future::join_all(runs).await;
                    if tx.is_closed() {
                        // The run is over: whatever happened to these episodes is moot.
                        return;
                    }
                    let group = Group {
                        task_index,
                        epoch,
                        oldest_version: oldest_version(&episodes),
                        task,
                        episodes,
                        _slot: Some(permit),
                        checked: EpisodeLimits::default(),
                    };
                    // A dropped group frees its slot at once; an admitted one when the trainer
                    // is done with it.
                    if let Some(group) = Self::admit(&shared, &opts, group) {
                        let _ = tx.send(group).await;
                    }
                });
            }
        });
        let pool = Self {
            shared: pool_shared,
            driver: driver.abort_handle(),
        };
        Ok((pool, rx))
    }

    /// Checks a finished group against failures, malformed episodes and the staleness bound.
    fn admit(shared: &Shared, opts: &RolloutOptions, mut group: Group) -> Option<Group> {
        let limits = *shared.limits.lock().expect("limits lock");
        let mut stats = shared.stats.lock().expect("stats lock");
        stats.groups_done += 1;
        let (task, episodes) = (group.task_index, &group.episodes);
        if let Some(failed) = episodes.iter().find(|e| e.status == EpisodeStatus::Failed) {
            stats.dropped_failed += 1;
            tracing::warn!(task, reason = ?failed.reason, "group dropped: an episode failed");
            return None;
        }
        let now = shared.version.load(Ordering::Relaxed);
        if group.invalid(&limits, now).is_some() {
            stats.dropped_invalid += 1;
            return None;
        }
        if group.stale(now, opts.max_staleness) {
            stats.dropped_stale += 1;
            let oldest = group.oldest_version;
            tracing::debug!(task, oldest, now, "group dropped: too stale");
            return None;
        }
        if let Some(cap) = opts.dynamic_sampling {
            let looked_at = shared.looked_at.fetch_add(1, Ordering::Relaxed) + 1;
            if looked_at <= cap as u64 && rewards_all_equal(episodes) {
                stats.groups_filtered += 1;
                let reward = episodes.first().map(|e| e.reward);
                tracing::debug!(task, reward, "group dropped: every reward is equal");
                return None;
            }
        }
        group.checked = limits;
        Some(group)
    }

    /// Stops drawing tasks and abandons the episodes in flight (their agents are killed and
    /// their engine requests aborted): the end of a run.
    pub fn stop(&self) {
        self.driver.abort();
    }

    /// Later episodes are checked against these limits too, where they are known (a
    /// coordinator learns them from the trainer, which has the model).
    pub fn learn_limits(&self, learned: EpisodeLimits) {
        let mut limits = self.shared.limits.lock().expect("limits lock");
        limits.vocab_size = learned.vocab_size.or(limits.vocab_size);
        limits.max_positions = learned.max_positions.or(limits.max_positions);
        limits.experts = learned.experts.or(limits.experts);
    }

    /// The trainer set a batch aside instead of learning from it (its groups are dropped).
    pub fn quarantined(&self) {
        let mut stats = self.shared.stats.lock().expect("stats lock");
        stats.batches_quarantined += 1;
    }

    /// The engines now serve `version` (called after each weight sync).
    pub fn set_version(&self, version: u64) {
        self.shared.version.store(version, Ordering::Relaxed);
    }

    pub fn version(&self) -> u64 {
        self.shared.version.load(Ordering::Relaxed)
    }

    /// The data cursor, for checkpoints.
    pub fn state(&self) -> RolloutState {
        *self.shared.state.lock().expect("state lock")
    }

    /// Moves the data cursor: the next group is drawn at `state` (groups already drawn run on).
    /// For a coordinator that restarted and learns from the trainer where the data stood.
    pub fn seek(&self, state: RolloutState) {
        *self.shared.state.lock().expect("state lock") = state;
    }

    pub fn stats(&self) -> RolloutStats {
        *self.shared.stats.lock().expect("stats lock")
    }
}

/// Takes the next `batch_size` groups from the trainer's queue, dropping any that went stale
/// while they waited (the policy moved on since they finished). `None` when the pool stopped.
pub async fn next_batch(
    pool: &RolloutPool,
    queue: &mut mpsc::Receiver<Group>,
    opts: &RolloutOptions,
) -> Option<Vec<Group>> {
    let mut batch = Vec::with_capacity(opts.batch_size);
    fill_batch(pool, queue, opts, &mut batch).await?;
    Some(batch)
}

/// [`next_batch`] into `batch`, which may hold groups already: every group taken is in `batch`
/// at once, so the future can be cancelled (a deadline) and called again without losing any.
/// `None` when the pool stopped.
pub async fn fill_batch(
    pool: &RolloutPool,
    queue: &mut mpsc::Receiver<Group>,
    opts: &RolloutOptions,
    batch: &mut Vec<Group>,
) -> Option<()> {
    loop {
        while batch.len() < opts.batch_size {
            batch.push(queue.recv().await?);
        }
        // Groups taken earlier may have gone stale meanwhile, and groups admitted before the
        // policy's limits were known are checked against them now.
        let now = pool.version();
        let limits = *pool.shared.limits.lock().expect("limits lock");
        let before = batch.len();
        batch.retain(|g| !g.stale(now, opts.max_staleness));
        let stale = before - batch.len();
        batch.retain_mut(|g| {
            let valid = g.checked == limits || g.invalid(&limits, now).is_none();
            g.checked = limits;
            valid
        });
        let invalid = before - stale - batch.len();
        if batch.len() == before {
            break;
        }
        let mut stats = pool.shared.stats.lock().expect("stats lock");
        stats.dropped_stale += stale as u64;
        stats.dropped_invalid += invalid as u64;
    }
    // The next step's dynamic sampling starts counting afresh.
    pool.shared.looked_at.store(0, Ordering::Relaxed);
    Some(())
}

/// Tally of versions in a batch (for the staleness histogram the trainer reports).
pub fn staleness_histogram(batch: &[Group], now: u64) -> BTreeMap<u64, usize> {
    let mut h = BTreeMap::new();
    for v in batch.iter().flat_map(|g| token_versions(&g.episodes)) {
        *h.entry(now.saturating_sub(v)).or_insert(0) += 1;
    }
    h
}

#[cfg(test)]
mod tests;
