//! The agent pods as the rollout pool's [`EpisodeRunner`]: episodes wait in a queue, agent pods
//! lease them, and return them finished.
//!
//! A lease lasts a short time (30 s by default) and the agent pod renews the leases of the episodes
//! it runs every few seconds ([`RemoteAgents::renew`]); one that runs out (its pod died, or lost the
//! coordinator) goes back to the front of the queue under a new lease id, and an answer that
//! arrives later for the old id is ignored, so an episode is neither lost nor counted twice.
//! Lease ids are 128 random bits: no pod can guess another's lease to return or renew it, and
//! answers meant for a previous coordinator are ignored too.
//! An episode whose group was abandoned (the run ended) is skipped, not leased.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use serde_json::Value as Json;
use tokio::sync::{oneshot, Notify};

use super::protocol::{Lease, RemoteStats};
use crate::agents::{Episode, EpisodeStatus};
use crate::chat::SamplingOverride;
use crate::rollout::EpisodeRunner;

#[derive(Debug)]
struct Work {
    /// What an agent pod gets, under the id of its newest lease.
    lease: Lease,
    reply: oneshot::Sender<Episode>,
}

#[derive(Debug, Default)]
struct Queue {
    waiting: VecDeque<Work>,
    leased: HashMap<String, (Work, Instant)>,
    /// The counts of the status (its queue lengths are read when it is asked for).
    counts: RemoteStats,
}

/// Episodes for agent pods to lease.
#[derive(Debug)]
pub struct RemoteAgents {
    queue: Mutex<Queue>,
    ready: Notify,
    lease_time: Duration,
}

impl RemoteAgents {
    /// `lease_time`: how long a lease lasts unless its agent pod renews it.
    pub fn new(lease_time: Duration) -> Self {
        Self {
            queue: Mutex::new(Queue::default()),
            ready: Notify::new(),
            lease_time,
        }
    }

    /// Moves leases that ran out back to the front of the queue.
    fn reap(&self, q: &mut Queue, now: Instant) {
        let expired: Vec<String> = (q.leased.iter())
            .filter(|(_, (_, deadline))| *deadline <= now)
            .map(|(id, _)| id.clone())
            .collect();
        for id in expired {
            let (work, _) = q.leased.remove(&id).expect("listed above");
            tracing::warn!(
                lease = %id,
                episode = work.lease.index,
                "an agent did not return its episode in time: running it again"
            );
            q.counts.leases_expired += 1;
            q.waiting.push_front(work);
            self.ready.notify_one();
        }
    }

    fn try_lease(&self) -> Option<Lease> {
        let mut q = self.queue.lock().expect("queue lock");
        let now = Instant::now();
        self.reap(&mut q, now);
        while let Some(mut work) = q.waiting.pop_front() {
            if work.reply.is_closed() {
                continue; // its group was abandoned
            }
            work.lease.lease = format!("{:032x}", rand::random::<u128>());
            let lease = work.lease.clone();
            q.leased
                .insert(lease.lease.clone(), (work, now + self.lease_time));
            return Some(lease);
        }
        None
    }

    /// The next episode to run, waiting up to `wait` for one.
    pub async fn lease(&self, wait: Duration) -> Option<Lease> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let notified = self.ready.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let now = tokio::time::Instant::now();
            let lease = self.try_lease();
            if lease.is_some() || now >= deadline {
                return lease;
            }
            // Wake up for new work, an expiring lease, or the end of the wait.
            let tick = deadline.min(now + Duration::from_secs(1));
            let _ = tokio::time::timeout_at(tick, notified).await;
        }
    }

    /// An agent pod still runs the episodes of `leases`: they last another lease time. Returns the
    /// leases it does not hold (any more): their episodes went to another pod, so it may stop them.
    pub fn renew(&self, leases: &[String]) -> Vec<String> {
        let mut q = self.queue.lock().expect("queue lock");
        let deadline = Instant::now() + self.lease_time;
        (leases.iter())
            .filter(|id| match q.leased.get_mut(id.as_str()) {
                Some((_, d)) => {
                    *d = deadline;
                    false
                }
                None => true,
            })
            .cloned()
            .collect()
    }

    /// An agent pod returns the episode of `lease`; false if the lease is unknown (it expired and
    /// went to another pod, or was answered already): the answer is ignored.
    pub fn complete(&self, lease: &str, mut episode: Episode) -> bool {
        let mut q = self.queue.lock().expect("queue lock");
        let Some((work, _)) = q.leased.remove(lease) else {
            q.counts.episodes_ignored += 1;
            return false;
        };
        q.counts.episodes_returned += 1;
        episode.index = work.lease.index;
        let _ = work.reply.send(episode);
        true
    }

    pub fn stats(&self) -> RemoteStats {
        let q = self.queue.lock().expect("queue lock");
        RemoteStats {
            episodes_waiting: q.waiting.len(),
            episodes_leased: q.leased.len(),
            ..q.counts
        }
    }
}

impl EpisodeRunner for RemoteAgents {
    fn run(
        &self,
        index: usize,
        task: Json,
        sampling: Option<SamplingOverride>,
    ) -> BoxFuture<'_, Episode> {
        let (reply, answer) = oneshot::channel();
        let lease = Lease {
            lease: String::new(),
            index,
            task: task.clone(),
            sampling,
        };
        let mut q = self.queue.lock().expect("queue lock");
        q.waiting.push_back(Work { lease, reply });
        drop(q);
        self.ready.notify_one();
        Box::pin(async move {
            answer.await.unwrap_or_else(|_| Episode {
                index,
                session: String::new(),
                task,
                status: EpisodeStatus::Failed,
                reason: Some("the coordinator dropped the episode".into()),
                reward: 0.0,
                info: serde_json::Map::new(),
                seconds: 0.0,
                segments: Vec::new(),
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn finished(reward: f64) -> Episode {
        Episode {
            index: 999,
            session: "s".into(),
            task: Json::Null,
            status: EpisodeStatus::Completed,
            reason: None,
            reward,
            info: serde_json::Map::new(),
            seconds: 0.1,
            segments: Vec::new(),
        }
    }

    #[tokio::test]
    async fn an_expired_lease_is_run_again_and_its_late_answer_ignored() {
        let agents = Arc::new(RemoteAgents::new(Duration::from_millis(200)));
        let runner = agents.clone();
        // An evaluation episode: its sampling goes with every lease of it.
        let sampling = SamplingOverride {
            temperature: Some(0.0),
            max_tokens: Some(9),
        };
        let episode = tokio::spawn(async move {
            runner
                .run(7, serde_json::json!({"q": 1}), Some(sampling))
                .await
        });
        let first = agents.lease(Duration::from_secs(2)).await.expect("work");
        assert_eq!((first.index, first.task["q"].as_i64()), (7, Some(1)));
        assert_eq!(first.sampling, Some(sampling));
        assert!(agents.lease(Duration::from_millis(50)).await.is_none());
        // The first agent goes silent: after the lease time the episode goes to another.
        let second = agents
            .lease(Duration::from_secs(2))
            .await
            .expect("re-leased");
        assert_eq!((second.index, second.sampling), (7, Some(sampling)));
        assert_ne!(second.lease, first.lease);
        assert!(!agents.complete(&first.lease, finished(0.0)), "late answer");
        assert!(agents.complete(&second.lease, finished(1.0)));
        assert!(!agents.complete(&second.lease, finished(1.0)), "repeat");
        let ep = episode.await.unwrap();
        assert_eq!((ep.index, ep.reward), (7, 1.0));
        let s = agents.stats();
        assert_eq!(
            (s.leases_expired, s.episodes_returned, s.episodes_ignored),
            (1, 1, 2)
        );
        assert_eq!((s.episodes_waiting, s.episodes_leased), (0, 0));
    }

    #[tokio::test]
    async fn renewed_leases_outlive_the_lease_time() {
        let agents = Arc::new(RemoteAgents::new(Duration::from_millis(300)));
        let runner = agents.clone();
        let episode = tokio::spawn(async move { runner.run(3, Json::Null, None).await });
        let lease = agents.lease(Duration::from_secs(2)).await.expect("work");
        for _ in 0..5 {
            tokio::time::sleep(Duration::from_millis(150)).await;
            assert!(agents.renew(std::slice::from_ref(&lease.lease)).is_empty());
        }
        // 750 ms after leasing, renewed: nobody else got it.
        assert!(agents.lease(Duration::from_millis(50)).await.is_none());
        let guess = format!(
            "{:032x}",
            u128::from_str_radix(&lease.lease, 16).unwrap() + 1
        );
        let unknown = agents.renew(std::slice::from_ref(&guess));
        assert_eq!(unknown, std::slice::from_ref(&guess));
        assert!(
            !agents.complete(&guess, finished(1.0)),
            "a guessed lease returns nothing"
        );
        assert_eq!(lease.lease.len(), 32, "128 bits");
        assert!(agents.complete(&lease.lease, finished(1.0)));
        assert_eq!(episode.await.unwrap().reward, 1.0);
        assert_eq!(agents.stats().leases_expired, 0);
    }

    #[tokio::test]
    async fn abandoned_episodes_are_not_leased() {
        let agents = Arc::new(RemoteAgents::new(Duration::from_secs(60)));
        let runner = agents.clone();
        let abandoned = tokio::spawn(async move { runner.run(1, Json::Null, None).await });
        tokio::task::yield_now().await;
        while agents.stats().episodes_waiting == 0 {
            tokio::task::yield_now().await;
        }
        abandoned.abort();
        let _ = abandoned.await;
        assert!(agents.lease(Duration::from_millis(50)).await.is_none());
    }
}
