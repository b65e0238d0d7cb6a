//! The engines behind a router: membership, health and load.
//!
//! Engines join and leave while a run goes on (`kubectl scale`, a dead pod). Each engine's load
//! (requests and tokens outstanding) is counted by guards that requests hold, so a request that
//! ends in any way gives its load back. Health is decided in one place: the checker marks an
//! engine down after consecutive failed `/health` probes (or at once when a request could not
//! reach it) and up again when a probe succeeds; routing only ever sees engines that are up.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use serde::Serialize;

use crate::engine::client::EngineClient;

/// One engine's state, shared by the pool and the requests it serves.
#[derive(Debug)]
pub struct Engine {
    pub client: EngineClient,
    healthy: AtomicBool,
    /// Consecutive failed probes.
    failures: AtomicU64,
    requests: AtomicU64,
    tokens: AtomicU64,
}

impl Engine {
    fn new(url: &str) -> Self {
        Self {
            client: EngineClient::new(url),
            healthy: AtomicBool::new(true),
            failures: AtomicU64::new(0),
            requests: AtomicU64::new(0),
            tokens: AtomicU64::new(0),
        }
    }

    pub fn url(&self) -> &str {
        self.client.url()
    }

    pub fn healthy(&self) -> bool {
        self.healthy.load(Ordering::Relaxed)
    }

    /// Requests in flight on this engine.
    pub fn requests(&self) -> u64 {
        self.requests.load(Ordering::Relaxed)
    }

    /// Tokens outstanding (prompt plus the most it may still generate) on this engine.
    pub fn tokens(&self) -> u64 {
        self.tokens.load(Ordering::Relaxed)
    }

    /// Counts a request's load until the guard drops.
    pub fn track(self: &Arc<Self>, tokens: u64) -> LoadGuard {
        self.requests.fetch_add(1, Ordering::Relaxed);
        self.tokens.fetch_add(tokens, Ordering::Relaxed);
        LoadGuard {
            engine: self.clone(),
            tokens,
        }
    }

    /// A request could not reach the engine: take it out until a probe succeeds.
    pub fn mark_down(&self) {
        if self.healthy.swap(false, Ordering::Relaxed) {
            tracing::warn!(engine = %self.url(), "engine down");
        }
    }

    fn probe_result(&self, ok: bool, failures_to_down: u64) {
        if ok {
            self.failures.store(0, Ordering::Relaxed);
            if !self.healthy.swap(true, Ordering::Relaxed) {
                tracing::info!(engine = %self.url(), "engine back");
            }
        } else if self.failures.fetch_add(1, Ordering::Relaxed) + 1 >= failures_to_down {
            self.mark_down();
        }
    }
}

/// A request's share of an engine's load.
#[derive(Debug)]
pub struct LoadGuard {
    engine: Arc<Engine>,
    tokens: u64,
}

impl Drop for LoadGuard {
    fn drop(&mut self) {
        self.engine.requests.fetch_sub(1, Ordering::Relaxed);
        self.engine.tokens.fetch_sub(self.tokens, Ordering::Relaxed);
    }
}

/// What `GET /engines` shows.
#[derive(Debug, Clone, Serialize)]
pub struct EngineStatus {
    pub url: String,
    pub healthy: bool,
    pub requests: u64,
    pub tokens: u64,
}

/// Settings of the health checker.
#[derive(Debug, Clone)]
pub struct HealthOptions {
    pub interval: Duration,
    pub timeout: Duration,
    /// Consecutive failed probes before an engine is taken out.
    pub failures_to_down: u64,
}

impl Default for HealthOptions {
    fn default() -> Self {
        Self {
            interval: Duration::from_secs(2),
            timeout: Duration::from_secs(2),
            failures_to_down: 2,
        }
    }
}

/// The engines of a router.
#[derive(Debug, Default)]
pub struct EnginePool {
    engines: RwLock<Vec<Arc<Engine>>>,
}

impl EnginePool {
    pub fn new(urls: &[String]) -> Self {
        let pool = Self::default();
        for url in urls {
            pool.add(url);
        }
        pool
    }

    /// Adds an engine (no-op if present); returns whether it was new.
    pub fn add(&self, url: &str) -> bool {
        let url = url.trim_end_matches('/');
        let mut engines = self.engines.write().expect("pool lock");
        if engines.iter().any(|e| e.url() == url) {
            return false;
        }
        tracing::info!(engine = %url, "engine joined");
        engines.push(Arc::new(Engine::new(url)));
        true
    }

    /// Removes an engine: no new requests go to it; those in flight finish there.
    pub fn remove(&self, url: &str) -> bool {
        let url = url.trim_end_matches('/');
        let mut engines = self.engines.write().expect("pool lock");
        let before = engines.len();
        engines.retain(|e| e.url() != url);
        if engines.len() < before {
            tracing::info!(engine = %url, "engine left");
        }
        engines.len() < before
    }

    /// Every engine, up or down, in joining order.
    pub fn all(&self) -> Vec<Arc<Engine>> {
        self.engines.read().expect("pool lock").clone()
    }

    /// The engines that are up.
    pub fn healthy(&self) -> Vec<Arc<Engine>> {
        self.all().into_iter().filter(|e| e.healthy()).collect()
    }

    pub fn status(&self) -> Vec<EngineStatus> {
        self.all()
            .iter()
            .map(|e| EngineStatus {
                url: e.url().to_string(),
                healthy: e.healthy(),
                requests: e.requests(),
                tokens: e.tokens(),
            })
            .collect()
    }

    /// Probes every engine's `/health` once.
    pub async fn probe_all(&self, http: &reqwest::Client, opts: &HealthOptions) {
        let engines = self.all();
        futures::future::join_all(engines.iter().map(|e| async move {
            let ok = http
                .get(format!("{}/health", e.url()))
                .timeout(opts.timeout)
                .send()
                .await
                .is_ok_and(|r| r.status().is_success());
            e.probe_result(ok, opts.failures_to_down);
        }))
        .await;
    }

    /// Probes forever, every `interval` (spawn it; it ends when the pool is dropped).
    pub async fn check_health(self: Arc<Self>, opts: HealthOptions) {
        let http = reqwest::Client::new();
        let weak = Arc::downgrade(&self);
        drop(self);
        loop {
            let Some(pool) = weak.upgrade() else { return };
            pool.probe_all(&http, &opts).await;
            drop(pool);
            tokio::time::sleep(opts.interval).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn membership_and_load_guards() {
        let pool = EnginePool::new(&["http://a:1/".into(), "http://b:1".into()]);
        assert!(!pool.add("http://a:1"));
        assert_eq!(pool.all().len(), 2);
        let a = pool.all()[0].clone();
        {
            let _g = a.track(100);
            assert_eq!((a.requests(), a.tokens()), (1, 100));
        }
        assert_eq!((a.requests(), a.tokens()), (0, 0));
        a.mark_down();
        assert_eq!(pool.healthy().len(), 1);
        a.probe_result(true, 2);
        assert_eq!(pool.healthy().len(), 2);
        a.probe_result(false, 2);
        assert!(a.healthy(), "one failed probe is not enough");
        a.probe_result(false, 2);
        assert!(!a.healthy());
        assert!(pool.remove("http://b:1/"));
        assert_eq!(pool.all().len(), 1);
    }
}
