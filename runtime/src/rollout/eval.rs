//! Evaluation on held-out tasks (docs/run.md, "Evaluation"): every task of `spec.eval`'s file
//! runs `samples` times through the run's own agents and engines, at the evaluation's sampling,
//! with the policy of one step; nothing of it is trained on. The same [`EpisodeRunner`] runs
//! them as runs training episodes (the local agent pool, or the agent pods of a cluster), so an
//! evaluation sees exactly what training sees, and it works the same in both modes.

use std::sync::Arc;
use std::time::Instant;

use futures::StreamExt;
use serde::{Deserialize, Serialize};
use serde_json::Value as Json;

use super::EpisodeRunner;
use crate::agents::EpisodeStatus;
use crate::chat::SamplingOverride;

/// What an evaluation runs, and when.
#[derive(Debug, Clone)]
pub struct EvalOptions {
    /// The held-out tasks.
    pub tasks: Arc<Vec<Json>>,
    /// Steps between evaluations.
    pub interval: u64,
    /// Episodes per task: the k of pass@k.
    pub samples: usize,
    /// Sampling of every turn of an evaluation episode.
    pub sampling: SamplingOverride,
    /// The reward at which an episode passes.
    pub pass_reward: f64,
    /// Episodes of one evaluation running at once at most.
    pub concurrency: usize,
}

impl EvalOptions {
    /// Whether the policy after `step` of `total` steps is evaluated: before the first step,
    /// every `interval` steps, and after the last.
    pub fn due(&self, step: u64, total: u64) -> bool {
        step % self.interval.max(1) == 0 || step == total
    }
}

/// One evaluation: `metrics`' `eval.jsonl` line, and the fields a step record carries.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EvalResult {
    /// Steps trained when the evaluated policy was made.
    pub step: u64,
    pub policy_version: u64,
    /// Mean reward over every episode (a failed episode counts as reward 0).
    pub eval_reward_mean: f64,
    /// Fraction of tasks with at least one passing episode among their `eval_k`.
    pub eval_pass_at_k: f64,
    /// Fraction of episodes that passed (pass@1).
    pub eval_pass_at_1: f64,
    pub eval_k: usize,
    pub eval_tasks: usize,
    pub eval_episodes: usize,
    /// Episodes that failed (crashed, timed out): counted as reward 0, not passed.
    pub eval_failed: usize,
    pub eval_seconds: f64,
}

/// Runs the evaluation of the policy of `step` (served as `version`); `progress` hears how many
/// of how many episodes are done after each one.
pub async fn evaluate(
    runner: &dyn EpisodeRunner,
    opts: &EvalOptions,
    (step, version): (u64, u64),
    progress: &(dyn Fn(usize, usize) + Send + Sync),
) -> EvalResult {
    let started = Instant::now();
    let (tasks, k) = (opts.tasks.len(), opts.samples.max(1));
    let total = tasks * k;
    let mut episodes = futures::stream::iter((0..total).map(|i| {
        let task = opts.tasks[i / k].clone();
        async move { (i / k, runner.run(i, task, Some(opts.sampling)).await) }
    }))
    .buffer_unordered(opts.concurrency.max(1));
    let (mut done, mut failed, mut passed, mut reward) = (0, 0, 0, 0.0);
    let mut task_passed = vec![false; tasks];
    while let Some((task, episode)) = episodes.next().await {
        if episode.status == EpisodeStatus::Failed {
            // Counted as reward 0, not passed.
            tracing::warn!(task, reason = ?episode.reason, "an evaluation episode failed");
            failed += 1;
        } else {
            let pass = episode.reward >= opts.pass_reward;
            (reward, passed) = (reward + episode.reward, passed + usize::from(pass));
            task_passed[task] |= pass;
        }
        done += 1;
        progress(done, total);
    }
    let n = total.max(1) as f64;
    EvalResult {
        step,
        policy_version: version,
        eval_reward_mean: reward / n,
        eval_pass_at_k: task_passed.iter().filter(|p| **p).count() as f64 / tasks.max(1) as f64,
        eval_pass_at_1: passed as f64 / n,
        eval_k: k,
        eval_tasks: tasks,
        eval_episodes: total,
        eval_failed: failed,
        eval_seconds: started.elapsed().as_secs_f64(),
    }
}

/// The console line of an evaluation.
pub fn line(r: &EvalResult) -> String {
    let failed = match r.eval_failed {
        0 => String::new(),
        n => format!(" ({n} failed)"),
    };
    format!(
        "eval  step {:>4} | reward {:.3} | pass@{} {:.3} | pass@1 {:.3} | {} tasks, {} episodes{failed} | {:.1}s",
        r.step,
        r.eval_reward_mean,
        r.eval_k,
        r.eval_pass_at_k,
        r.eval_pass_at_1,
        r.eval_tasks,
        r.eval_episodes,
        r.eval_seconds,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agents::Episode;
    use futures::future::BoxFuture;
    use serde_json::{json, Map};
    use std::sync::Mutex;

    /// Rewards from the task's `rewards` list by sample; a reward of -1 fails the episode.
    /// Remembers the sampling each episode was asked to use.
    #[derive(Default)]
    struct Scripted {
        sampling: Mutex<Vec<Option<SamplingOverride>>>,
    }

    impl EpisodeRunner for Scripted {
        fn run(
            &self,
            index: usize,
            task: Json,
            sampling: Option<SamplingOverride>,
        ) -> BoxFuture<'_, Episode> {
            self.sampling.lock().unwrap().push(sampling);
            Box::pin(async move {
                let rewards = task["rewards"].as_array().unwrap();
                let reward = rewards[index % rewards.len()].as_f64().unwrap();
                Episode {
                    index,
                    session: format!("s{index}"),
                    status: if reward < 0.0 {
                        EpisodeStatus::Failed
                    } else {
                        EpisodeStatus::Completed
                    },
                    reason: None,
                    reward,
                    info: Map::new(),
                    seconds: 0.0,
                    segments: Vec::new(),
                    task,
                }
            })
        }
    }

    #[tokio::test]
    async fn pass_at_k_counts_tasks_with_any_passing_sample_and_failures_as_zero() {
        // Three tasks × 2 samples: one passes twice, one once, one never (a failure among them).
        let tasks = vec![
            json!({"rewards": [1.0, 1.0]}),
            json!({"rewards": [0.0, 1.0]}),
            json!({"rewards": [0.5, -1.0]}),
        ];
        let sampling = SamplingOverride {
            temperature: Some(0.0),
            max_tokens: Some(7),
        };
        let opts = EvalOptions {
            tasks: Arc::new(tasks),
            interval: 5,
            samples: 2,
            sampling,
            pass_reward: 1.0,
            concurrency: 2,
        };
        let runner = Scripted::default();
        let seen = Mutex::new(Vec::new());
        let r = evaluate(&runner, &opts, (10, 12), &|done, total| {
            seen.lock().unwrap().push((done, total))
        })
        .await;
        assert_eq!((r.step, r.policy_version), (10, 12));
        assert_eq!((r.eval_k, r.eval_tasks, r.eval_episodes), (2, 3, 6));
        assert!((r.eval_reward_mean - 3.5 / 6.0).abs() < 1e-12);
        assert!((r.eval_pass_at_k - 2.0 / 3.0).abs() < 1e-12);
        assert!((r.eval_pass_at_1 - 3.0 / 6.0).abs() < 1e-12);
        assert_eq!(r.eval_failed, 1);
        assert_eq!(
            *seen.lock().unwrap(),
            (1..=6).map(|d| (d, 6)).collect::<Vec<_>>()
        );
        // Every episode ran at the evaluation's sampling.
        assert_eq!(*runner.sampling.lock().unwrap(), vec![Some(sampling); 6]);
    }

    #[test]
    fn due_before_the_first_step_every_interval_and_after_the_last() {
        let opts = EvalOptions {
            tasks: Arc::new(Vec::new()),
            interval: 4,
            samples: 1,
            sampling: SamplingOverride::default(),
            pass_reward: 1.0,
            concurrency: 1,
        };
        let due: Vec<u64> = (0..=10).filter(|s| opts.due(*s, 10)).collect();
        assert_eq!(due, [0, 4, 8, 10]);
    }
}
