//! The rollout pool with a stand-in episode runner (no engine): the runner labels each episode's
//! tokens with the policy version current when it ran, and takes a chosen time.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use serde_json::{json, Map};

use super::*;
use crate::loopback::Segment;

#[derive(Debug, Default)]
struct FakeRunner {
    version: Arc<AtomicU64>,
    running: AtomicUsize,
    peak: AtomicUsize,
    started: AtomicUsize,
}

impl EpisodeRunner for FakeRunner {
    fn run(
        &self,
        index: usize,
        task: Json,
        _sampling: Option<SamplingOverride>,
    ) -> BoxFuture<'_, Episode> {
        Box::pin(async move {
            self.started.fetch_add(1, Ordering::SeqCst);
            let now = self.running.fetch_add(1, Ordering::SeqCst) + 1;
            self.peak.fetch_max(now, Ordering::SeqCst);
            let v = self.version.load(Ordering::SeqCst);
            let ms = task["ms"].as_u64().unwrap_or(1);
            tokio::time::sleep(Duration::from_millis(ms)).await;
            self.running.fetch_sub(1, Ordering::SeqCst);
            let failed = task["fail"].as_bool().unwrap_or(false) && index % 2 == 1;
            // A task may name a token id to put in its episodes (outside the vocabulary: bad).
            let token = task["token"].as_i64().unwrap_or(3);
            // `"varied": true`: rewards alternate within the group (a learning signal).
            let reward = if task["varied"].as_bool().unwrap_or(false) {
                (index % 2) as f64
            } else {
                1.0
            };
            Episode {
                index,
                session: format!("s{index}"),
                task,
                status: if failed {
                    EpisodeStatus::Failed
                } else {
                    EpisodeStatus::Completed
                },
                reason: failed.then(|| "crashed".to_string()),
                reward,
                info: Map::new(),
                seconds: 0.0,
                segments: vec![Segment {
                    token_ids: vec![1, 2, token],
                    loss_mask: vec![0, 1, 1],
                    logprobs: vec![0.0, -0.1, -0.2],
                    versions: vec![None, Some(v), Some(v)],
                    routed_experts: vec![],
                    images: Vec::new(),
                    turns: 1,
                    teacher_logprobs: None,
                }],
            }
        })
    }
}

fn opts(group_size: usize, batch_size: usize, max_staleness: u64) -> RolloutOptions {
    RolloutOptions {
        group_size,
        batch_size,
        max_staleness,
        limits: Default::default(),
        dynamic_sampling: None,
    }
}

#[tokio::test]
async fn groups_complete_whole_in_completion_order_and_the_cursor_wraps() {
    let runner = Arc::new(FakeRunner::default());
    // Task 0 is slow: later tasks' groups finish first and go ahead of it.
    let data = Arc::new(vec![json!({"ms": 300}), json!({"ms": 5}), json!({"ms": 5})]);
    let (pool, mut queue) = RolloutPool::start(
        runner.clone(),
        data,
        opts(3, 2, 1),
        RolloutState::default(),
        0,
    )
    .unwrap();
    let batch = next_batch(&pool, &mut queue, &opts(3, 2, 1)).await.unwrap();
    assert_eq!(batch.len(), 2);
    assert!(
        batch.iter().all(|g| g.task_index != 0),
        "the slow group carried over"
    );
    for g in &batch {
        assert_eq!(g.episodes.len(), 3);
        assert!(g.episodes.iter().all(|e| e.task == g.task));
    }
    let next = next_batch(&pool, &mut queue, &opts(3, 2, 1)).await.unwrap();
    assert!(next.iter().any(|g| g.task_index == 0));
    let s = pool.state();
    assert!(
        s.epoch >= 1,
        "three tasks drawn more than once: the cursor wrapped ({s:?})"
    );
}

#[tokio::test]
async fn admission_bounds_groups_in_flight_and_queued() {
    let runner = Arc::new(FakeRunner::default());
    let data = Arc::new(vec![json!({"ms": 20}); 5]);
    let o = opts(2, 2, 1);
    let (pool, mut queue) =
        RolloutPool::start(runner.clone(), data, o.clone(), RolloutState::default(), 0).unwrap();
    // Nobody trains: the pool fills its (1 + 1) * 2 = 4 group slots and stops.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(pool.stats().groups_started, 4);
    assert_eq!(runner.started.load(Ordering::SeqCst), 8);
    // Taking a batch and dropping it (trained) frees two slots.
    let batch = next_batch(&pool, &mut queue, &o).await.unwrap();
    drop(batch);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(pool.stats().groups_started, 6);
    assert!(runner.peak.load(Ordering::SeqCst) <= 8);
}

#[tokio::test]
async fn no_token_older_than_max_staleness_reaches_the_trainer() {
    let runner = Arc::new(FakeRunner::default());
    let data = Arc::new((0..7).map(|i| json!({"ms": 3 + i * 4})).collect::<Vec<_>>());
    let o = opts(2, 3, 1);
    let (pool, mut queue) =
        RolloutPool::start(runner.clone(), data, o.clone(), RolloutState::default(), 0).unwrap();
    for step in 0..8u64 {
        let batch = next_batch(&pool, &mut queue, &o).await.unwrap();
        let now = pool.version();
        for g in &batch {
            let oldest = g.oldest_version.unwrap();
            assert!(
                now - oldest <= o.max_staleness,
                "step {step}: version {oldest} at {now}"
            );
        }
        let hist = staleness_histogram(&batch, now);
        assert!(hist.keys().all(|&age| age <= 1));
        // "Train", then publish a new version (sometimes jumping ahead, as after a restart).
        let next = now + if step == 4 { 3 } else { 1 };
        runner.version.store(next, Ordering::SeqCst);
        pool.set_version(next);
    }
    assert!(
        pool.stats().dropped_stale > 0,
        "the version jump made some groups stale"
    );
}

#[tokio::test]
async fn a_group_with_a_failed_episode_is_dropped_whole() {
    let runner = Arc::new(FakeRunner::default());
    let data = Arc::new(vec![json!({"ms": 2, "fail": true}), json!({"ms": 2})]);
    let o = opts(2, 2, 1);
    let (pool, mut queue) =
        RolloutPool::start(runner, data, o.clone(), RolloutState::default(), 0).unwrap();
    let batch = next_batch(&pool, &mut queue, &o).await.unwrap();
    assert!(
        batch.iter().all(|g| g.task_index == 1),
        "only the healthy task's groups"
    );
    assert!(pool.stats().dropped_failed >= 1);
}

#[tokio::test]
async fn a_group_with_a_malformed_episode_is_dropped_and_the_rest_go_on() {
    let runner = Arc::new(FakeRunner::default());
    let data = Arc::new(vec![json!({"ms": 2, "token": 1000}), json!({"ms": 2})]);
    let mut o = opts(2, 3, 1);
    o.limits.vocab_size = Some(1000);
    let (pool, mut queue) =
        RolloutPool::start(runner, data, o.clone(), RolloutState::default(), 0).unwrap();
    let batch = next_batch(&pool, &mut queue, &o).await.unwrap();
    assert!(
        batch.iter().all(|g| g.task_index == 1),
        "only well-formed groups"
    );
    let stats = pool.stats();
    assert!(stats.dropped_invalid >= 1, "{stats:?}");
    assert_eq!(
        stats.dropped_failed, 0,
        "malformed is counted apart from failed"
    );
}

#[tokio::test]
async fn groups_admitted_before_the_limits_were_known_are_checked_when_drawn() {
    let runner = Arc::new(FakeRunner::default());
    let data = Arc::new(vec![json!({"ms": 2, "token": 1000}), json!({"ms": 2})]);
    let o = opts(2, 2, 1);
    let (pool, mut queue) =
        RolloutPool::start(runner, data, o.clone(), RolloutState::default(), 0).unwrap();
    // Both tasks' groups finish and are admitted while the vocabulary is unknown.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(pool.stats().dropped_invalid, 0);
    // Then the trainer's hello brings it (a coordinator): no batch carries token 1000.
    pool.learn_limits(EpisodeLimits {
        vocab_size: Some(1000),
        max_positions: None,
        experts: None,
    });
    for _ in 0..2 {
        let batch = next_batch(&pool, &mut queue, &o).await.unwrap();
        assert!(
            batch.iter().all(|g| g.task_index == 1),
            "only well-formed groups"
        );
    }
    let stats = pool.stats();
    assert!(stats.dropped_invalid >= 1, "{stats:?}");
    assert_eq!(stats.dropped_stale, 0, "counted as malformed, not stale");
}

#[tokio::test]
async fn bad_settings_are_refused() {
    let runner = Arc::new(FakeRunner::default());
    let err = RolloutPool::start(
        runner.clone(),
        Arc::new(vec![]),
        opts(2, 2, 1),
        RolloutState::default(),
        0,
    )
    .unwrap_err();
    assert!(err.to_string().contains("no tasks"));
    let err = RolloutPool::start(
        runner,
        Arc::new(vec![json!({})]),
        opts(0, 2, 1),
        RolloutState::default(),
        0,
    )
    .unwrap_err();
    assert!(err.to_string().contains("groupSize"));
}

#[tokio::test]
async fn dynamic_sampling_drops_equal_reward_groups_and_keeps_batches_full() {
    let runner = Arc::new(FakeRunner::default());
    // Every other task is solved by every sample: no signal.
    let data = Arc::new(vec![
        json!({"ms": 2}),
        json!({"ms": 2, "varied": true}),
        json!({"ms": 2}),
        json!({"ms": 2, "varied": true}),
    ]);
    let mut o = opts(2, 3, 0);
    o.dynamic_sampling = Some(1000);
    let (pool, mut queue) =
        RolloutPool::start(runner, data, o.clone(), RolloutState::default(), 0).unwrap();
    for _ in 0..3 {
        let batch = next_batch(&pool, &mut queue, &o).await.unwrap();
        assert_eq!(batch.len(), 3, "the batch is full");
        assert!(
            batch.iter().all(|g| !rewards_all_equal(&g.episodes)),
            "no trained group has equal rewards"
        );
    }
    // Nine varied groups came from nine solved ones drawn between them (give or take the ones
    // in flight).
    let filtered = pool.stats().groups_filtered;
    assert!((8..=12).contains(&filtered), "{:?}", pool.stats());
}

#[tokio::test]
async fn dynamic_sampling_takes_equal_groups_once_the_step_looked_at_its_cap() {
    let runner = Arc::new(FakeRunner::default());
    let data = Arc::new(vec![json!({"ms": 2})]);
    let mut o = opts(2, 2, 0);
    o.dynamic_sampling = Some(3);
    let (pool, mut queue) =
        RolloutPool::start(runner, data, o.clone(), RolloutState::default(), 0).unwrap();
    for step in 1..=2u64 {
        let batch = next_batch(&pool, &mut queue, &o).await.unwrap();
        assert_eq!(batch.len(), 2, "no signal anywhere, yet the run goes on");
        assert_eq!(pool.stats().groups_filtered, 3 * step, "{:?}", pool.stats());
    }
}
