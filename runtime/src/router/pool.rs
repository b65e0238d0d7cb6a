//! The engines behind a router: membership, health and load.
//!
//! Engines join and leave while a run goes on (`kubectl scale`, a dead pod). Each engine's load
//! (requests and tokens outstanding) is counted by guards that requests hold, so a request that
//! ends in any way gives its load back. Health is decided in one place: the checker marks an
//! engine down after consecutive failed `/health` probes (or at once when a request could not
//! reach it) and up again when a probe succeeds.
//!
//! Weights too: once the pool has seen a weight update (`expected` version), an engine whose
//! `/weight_info` reports another version (it joined, or came back, after the update) still gets
//! control calls, so the next weight sync reaches it, but no generation until it serves the
//! current version. Routing only ever sees engines that are up and current.

use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::engine::api::reported_version;
use crate::engine::client::EngineClient;

/// One engine, shared by the pool and the requests it serves.
#[derive(Debug)]
pub struct Engine {
    pub client: EngineClient,
    state: Mutex<EngineState>,
}

/// Time accumulated over the intervals in which something held.
#[derive(Debug, Default)]
struct Stopwatch {
    since: Option<Instant>,
    total: Duration,
}

impl Stopwatch {
    /// Runs from now while `on`, stops (adding the interval) when not.
    fn set(&mut self, on: bool) {
        match (on, self.since) {
            (true, None) => self.since = Some(Instant::now()),
            (false, Some(since)) => {
                self.total += since.elapsed();
                self.since = None;
            }
            _ => {}
        }
    }

    fn seconds(&self) -> f64 {
        (self.total + self.since.map_or(Duration::ZERO, |s| s.elapsed())).as_secs_f64()
    }
}

/// What the pool knows of an engine: its health, the weights it serves, and its load: requests
/// in flight and tokens outstanding (prompt plus the most they may still generate), and its busy
/// clock, which runs while it has requests in flight and is not paused (requests held through a
/// pause are in flight, but the engine does nothing with them).
#[derive(Debug, Default)]
struct EngineState {
    /// Taken out (failed probes, or a request that could not reach it) until a probe succeeds.
    down: bool,
    /// Consecutive failed probes.
    failures: u64,
    /// The weight version it serves, as last seen.
    version: Option<u64>,
    requests: u64,
    tokens: u64,
    paused: bool,
    busy: Stopwatch,
}

impl EngineState {
    /// Starts or stops the busy clock as the state now says.
    fn settle(&mut self) {
        self.busy.set(self.requests > 0 && !self.paused);
    }
}

impl Engine {
    fn state(&self) -> MutexGuard<'_, EngineState> {
        self.state.lock().expect("engine state lock")
    }

    /// Seconds this engine has had requests in flight while not paused.
    pub fn busy_seconds(&self) -> f64 {
        self.state().busy.seconds()
    }

    /// The weight version it serves, if known.
    pub fn version(&self) -> Option<u64> {
        self.state().version
    }

    pub fn set_version(&self, version: u64) {
        self.state().version = Some(version);
    }

    pub fn url(&self) -> &str {
        self.client.url()
    }

    pub fn healthy(&self) -> bool {
        !self.state().down
    }

    /// Requests in flight on this engine.
    pub fn requests(&self) -> u64 {
        self.state().requests
    }

    /// Tokens outstanding (prompt plus the most it may still generate) on this engine.
    pub fn tokens(&self) -> u64 {
        self.state().tokens
    }

    /// Counts a request's load until the guard drops.
    pub fn track(self: &Arc<Self>, tokens: u64) -> LoadGuard {
        let mut state = self.state();
        state.requests += 1;
        state.tokens += tokens;
        state.settle();
        drop(state);
        LoadGuard {
            engine: self.clone(),
            tokens,
        }
    }

    /// A request could not reach the engine: take it out until a probe succeeds.
    pub fn mark_down(&self) {
        if !std::mem::replace(&mut self.state().down, true) {
            tracing::warn!(engine = %self.url(), "engine down");
        }
    }

    fn probe_result(&self, ok: bool, failures_to_down: u64) {
        let mut state = self.state();
        if ok {
            state.failures = 0;
            if std::mem::take(&mut state.down) {
                tracing::info!(engine = %self.url(), "engine back");
            }
            return;
        }
        state.failures += 1;
        if state.failures >= failures_to_down {
            drop(state);
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
        let mut state = self.engine.state();
        state.requests -= 1;
        state.tokens -= self.tokens;
        state.settle();
    }
}

/// What `GET /engines` shows.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EngineStatus {
    pub url: String,
    pub healthy: bool,
    /// Up and serving the pool's current weights: it gets generation requests.
    pub routable: bool,
    pub version: Option<u64>,
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

/// A busy machine (a CPU shared with the trainer, the agents and other runs) can hold an engine's
/// `/health` up for seconds, vLLM's and the built-in one's alike (a run died of it with five
/// recipes on 2 cores): an engine is marked down after three probes of 10 s fail. One that is
/// gone fails its probes at once (connection refused), so it is out within three intervals.
impl Default for HealthOptions {
    fn default() -> Self {
        Self {
            interval: Duration::from_secs(2),
            timeout: Duration::from_secs(10),
            failures_to_down: 3,
        }
    }
}

/// How busy a pool's engines have been since it started (docs/run.md, "How busy engines and
/// trainer were"): cumulative, so that the difference of two readings covers the time between
/// them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Activity {
    /// Engines in the pool now.
    pub engines: usize,
    /// Seconds engines had requests in flight while not paused, summed over engines (those that
    /// left included).
    pub busy_seconds: f64,
    /// Seconds the pool was paused (for weight sync).
    pub paused_seconds: f64,
}

/// The pool's own clock and the weights it expects.
#[derive(Debug, Default)]
struct PoolState {
    /// Runs while the pool is paused.
    paused: Stopwatch,
    /// Busy seconds of engines that left the pool.
    retired_busy: f64,
    /// The version of the last weight update that went out (none yet: any version is current).
    expected: Option<u64>,
}

/// The engines of a router.
#[derive(Debug, Default)]
pub struct EnginePool {
    engines: RwLock<Vec<Arc<Engine>>>,
    state: Mutex<PoolState>,
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
        let engine = Engine {
            client: EngineClient::engine(url),
            state: Mutex::default(),
        };
        // One that joins during a pause gets the pause too (the next resume reaches it).
        engine.state().paused = self.state().paused.since.is_some();
        engines.push(Arc::new(engine));
        true
    }

    /// Removes an engine: no new requests go to it; those in flight finish there.
    pub fn remove(&self, url: &str) -> bool {
        let url = url.trim_end_matches('/');
        let mut engines = self.engines.write().expect("pool lock");
        let Some(i) = engines.iter().position(|e| e.url() == url) else {
            return false;
        };
        let gone = engines.remove(i);
        self.state().retired_busy += gone.busy_seconds();
        tracing::info!(engine = %url, "engine left");
        true
    }

    fn state(&self) -> MutexGuard<'_, PoolState> {
        self.state.lock().expect("pool state lock")
    }

    /// The engines were told to pause (`true`) or resume: their busy clocks stop or restart,
    /// and the pool's pause clock runs while paused.
    pub fn set_paused(&self, paused: bool) {
        // Not held while taking the engines' lock (`add` takes them in the other order).
        self.state().paused.set(paused);
        for e in self.all() {
            let mut state = e.state();
            state.paused = paused;
            state.settle();
        }
    }

    /// How busy the engines have been since the pool started.
    pub fn activity(&self) -> Activity {
        let engines = self.all();
        let state = self.state();
        Activity {
            engines: engines.len(),
            busy_seconds: state.retired_busy
                + engines.iter().map(|e| e.busy_seconds()).sum::<f64>(),
            paused_seconds: state.paused.seconds(),
        }
    }

    /// Every engine, up or down, in joining order.
    pub fn all(&self) -> Vec<Arc<Engine>> {
        self.engines.read().expect("pool lock").clone()
    }

    /// The engines that are up (control calls go to all of them).
    pub fn healthy(&self) -> Vec<Arc<Engine>> {
        self.all().into_iter().filter(|e| e.healthy()).collect()
    }

    /// A weight update to `version` reached `engines`.
    pub fn updated(&self, engines: &[Arc<Engine>], version: u64) {
        self.state().expected = Some(version);
        for e in engines {
            e.set_version(version);
        }
    }

    /// Whether `e` gets generation: up, and serving the version of the last weight update (any,
    /// before the first).
    fn is_routable(&self, e: &Engine) -> bool {
        let expected = self.state().expected;
        e.healthy() && (expected.is_none() || e.version() == expected)
    }

    /// The engines that are up and serve the current weights (generation goes to these).
    pub fn routable(&self) -> Vec<Arc<Engine>> {
        self.all()
            .into_iter()
            .filter(|e| self.is_routable(e))
            .collect()
    }

    pub fn status(&self) -> Vec<EngineStatus> {
        self.all()
            .iter()
            .map(|e| EngineStatus {
                url: e.url().to_string(),
                healthy: e.healthy(),
                routable: self.is_routable(e),
                version: e.version(),
                requests: e.requests(),
                tokens: e.tokens(),
            })
            .collect()
    }

    /// Probes every engine's `/health` once.
    pub async fn probe_all(&self, http: &reqwest::Client, opts: &HealthOptions) {
        let engines = self.all();
        let get = |e: &Engine, path| http.get(format!("{}{path}", e.url())).timeout(opts.timeout);
        futures::future::join_all(engines.iter().map(|e| async move {
            let health = get(e, "/health").send().await;
            let ok = health.is_ok_and(|r| r.status().is_success());
            e.probe_result(ok, opts.failures_to_down);
            // An engine up but not known to serve the current weights: ask which it serves.
            if ok && !self.is_routable(e) {
                let info = get(e, "/weight_info").send();
                let info = async { info.await.ok()?.json::<serde_json::Value>().await.ok() };
                if let Some(v) = info
                    .await
                    .and_then(|v| reported_version(&v["weight_version"]))
                {
                    e.set_version(v);
                }
            }
        }))
        .await;
    }

    /// Probes forever, every `interval` (spawn it; it ends when the pool is dropped).
    pub async fn check_health(self: Arc<Self>, opts: HealthOptions) {
        let http = crate::auth::engine_client();
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
        // After an update only the engines that got it are routable.
        a.probe_result(true, 2);
        let b = pool.all()[1].clone();
        assert_eq!(pool.routable().len(), 2);
        pool.updated(std::slice::from_ref(&a), 3);
        assert_eq!(pool.routable().len(), 1);
        b.set_version(3);
        assert_eq!(pool.routable().len(), 2);
        assert!(pool.remove("http://b:1/"));
        assert_eq!(pool.all().len(), 1);
    }

    /// An engine's busy clock runs while it has requests in flight and is not paused; the
    /// pool's pause clock while paused; an engine that leaves keeps its busy time counted.
    #[test]
    fn busy_and_paused_clocks() {
        let pool = EnginePool::new(&["http://a:1".into(), "http://b:1".into()]);
        let (a, b) = (pool.all()[0].clone(), pool.all()[1].clone());
        let nap = || std::thread::sleep(Duration::from_millis(50));
        nap();
        assert_eq!(
            pool.activity().busy_seconds,
            0.0,
            "idle engines are not busy"
        );
        let g1 = a.track(1);
        let g2 = a.track(1);
        nap();
        drop(g1);
        nap();
        drop(g2);
        let busy_a = a.busy_seconds();
        assert!((0.1..0.5).contains(&busy_a), "{busy_a}");
        nap();
        assert_eq!(
            a.busy_seconds(),
            busy_a,
            "the clock stopped with the last request"
        );

        // Paused with a request held: neither busy nor counting, the pause clock runs.
        let held = b.track(1);
        pool.set_paused(true);
        let before = b.busy_seconds();
        nap();
        assert_eq!(b.busy_seconds(), before);
        assert!(pool.activity().paused_seconds >= 0.05);
        pool.set_paused(false);
        let paused = pool.activity().paused_seconds;
        nap();
        assert_eq!(pool.activity().paused_seconds, paused, "resumed");
        assert!(b.busy_seconds() >= before + 0.05, "busy again once resumed");
        drop(held);

        let total = pool.activity().busy_seconds;
        assert!(pool.remove("http://b:1"));
        let after = pool.activity();
        assert_eq!(after.engines, 1);
        assert!(
            (after.busy_seconds - total).abs() < 1e-9,
            "{after:?} vs {total}"
        );
    }
}
