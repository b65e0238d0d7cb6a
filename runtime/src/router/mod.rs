//! The router (docs/architecture.md): one engine API in front of a pool of engines (built-in or vLLM).
//!
//! - [`pool`]: membership (engines join and leave while a run goes on), health and load;
//! - [`policy`]: which healthy engine a request goes to (consistent hashing on the session with
//!   bounded load, or least outstanding tokens);
//! - [`generate`]: generation with failover: when an engine dies mid-generation, the request
//!   continues on another engine from the prompt plus the tokens already generated, so no
//!   episode is lost and every token keeps the logprob and version of the engine that sampled it;
//! - [`server`]: the HTTP API: generate and abort routed, control calls (pause, resume, weight
//!   transfer) fanned out to every engine, and `/engines` to inspect and change the pool.

pub mod generate;
pub mod policy;
pub mod pool;
pub mod server;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

pub use policy::{ConsistentHash, LeastOutstandingTokens, RouteRequest, RoutingPolicy};
pub use pool::{Activity, Engine, EnginePool, HealthOptions};

/// How long a run's requests wait for a healthy engine (in the coordinator and `moult run`):
/// long enough for a large model to load on a fresh engine pod.
pub const RUN_ENGINE_PATIENCE: Duration = Duration::from_secs(30 * 60);

/// The router of a run (the coordinator's, `moult run`'s) over `pool`: sessions stick to an
/// engine (consistent hash), engines are health-checked, and requests wait
/// up to [`RUN_ENGINE_PATIENCE`] for an engine while none is up (engines still loading the model)
/// instead of failing. Spawns the health checks: call it inside the runtime.
pub fn for_run(pool: Arc<EnginePool>) -> Arc<Router> {
    tokio::spawn(pool.clone().check_health(HealthOptions::default()));
    let router = Router::new(pool, Box::new(ConsistentHash::default()));
    Arc::new(router.with_engine_patience(RUN_ENGINE_PATIENCE))
}

/// A pool of engines and the policy that spreads requests over it.
#[derive(Debug)]
pub struct Router {
    pub pool: Arc<EnginePool>,
    policy: Box<dyn RoutingPolicy>,
    /// Requests continued on another engine after theirs failed.
    failovers: AtomicU64,
    /// The generations running through the router, by the id the engines know them by (the
    /// router's own, unguessable): the id their client gave and their session. An abort reaches
    /// only those its caller started (docs/router.md).
    running: Mutex<HashMap<String, (String, Option<String>)>>,
    /// How long a request waits for an engine when none is healthy (engines still loading, or
    /// all restarting) before it is refused with 503; zero refuses at once.
    engine_patience: Duration,
    /// The adapter a LoRA run's requests name on an EnginePool or vLLM (its newest version,
    /// docs/lora.md); none: the engines' served model.
    model: Mutex<Option<String>>,
}

impl Router {
    pub fn new(pool: Arc<EnginePool>, policy: Box<dyn RoutingPolicy>) -> Self {
        Self {
            pool,
            policy,
            failovers: AtomicU64::new(0),
            running: Mutex::default(),
            engine_patience: Duration::ZERO,
            model: Mutex::default(),
        }
    }

    /// Requests wait up to `patience` for a healthy engine instead of failing at once when
    /// there is none (docs/router.md#health-and-membership).
    pub fn with_engine_patience(mut self, patience: Duration) -> Self {
        self.engine_patience = patience;
        self
    }

    /// What `get` finds, looking again every quarter second for up to the engine patience
    /// while it finds nothing (engines still loading, or all down for a moment), unless
    /// `gone` says the caller left.
    async fn wait_for<T>(&self, get: impl Fn() -> Option<T>, gone: impl Fn() -> bool) -> Option<T> {
        let since = std::time::Instant::now();
        loop {
            match get() {
                None if since.elapsed() < self.engine_patience && !gone() => {}
                found => return found,
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// The engine for `request` among those up and current, skipping `exclude` (engines that
    /// already failed it).
    pub fn pick(&self, request: &RouteRequest<'_>, exclude: &[String]) -> Option<Arc<Engine>> {
        let engines: Vec<Arc<Engine>> = self
            .pool
            .routable()
            .into_iter()
            .filter(|e| !exclude.iter().any(|x| x == e.url()))
            .collect();
        (!engines.is_empty()).then(|| engines[self.policy.pick(request, &engines)].clone())
    }

    pub fn failovers(&self) -> u64 {
        self.failovers.load(Ordering::Relaxed)
    }

    /// A new request id: 128 random bits, so no client can name another's request.
    fn request_id() -> String {
        format!("rt-{:032x}", rand::random::<u128>())
    }

    /// A pool run's share of its EnginePool's engine time (docs/lora.md, "Fair share"): the
    /// mean over the engines up of its share of each one's recent tokens; `None` when none
    /// answers.
    pub async fn pool_share(&self) -> Option<f64> {
        let http = crate::auth::engine_client();
        let shares = self.pool.routable().into_iter().map(|e| {
            let get = http.get(format!("{}/v1/pool/share", e.url()));
            let get = get.timeout(Duration::from_secs(5)).send();
            async { get.await.ok()?.json::<serde_json::Value>().await.ok() }
        });
        let answers = futures::future::join_all(shares).await;
        let shares: Vec<f64> = (answers.into_iter().flatten())
            .filter_map(|a| a["runs"].as_object()?.values().next()?["share"].as_f64())
            .collect();
        (!shares.is_empty()).then(|| shares.iter().sum::<f64>() / shares.len() as f64)
    }

    /// The adapter a LoRA run's requests name, `<run>-v<N>` (docs/lora.md): the run and `N`.
    fn adapter(&self) -> Option<(String, u64)> {
        let model = self.model.lock().expect("model lock");
        let name = model.as_deref()?;
        crate::engine::pool::adapter_version(name).map(|(run, v)| (run.to_string(), v))
    }

    /// The engines' ids of the running requests that a client gave one of `client_ids` and
    /// started under `session`.
    fn started_by(&self, client_ids: &[String], session: Option<&str>) -> Vec<String> {
        let running = self.running.lock().expect("running lock");
        (running.iter())
            .filter(|(_, (id, s))| s.as_deref() == session && client_ids.contains(id))
            .map(|(engine_id, _)| engine_id.clone())
            .collect()
    }
}
