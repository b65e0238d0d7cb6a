//! An engine of an `EnginePool` (docs/lora.md, "Engine pools"): one base model shared by many
//! LoRA runs, each generating with and uploading only its own adapters, and sharing the engine's
//! batch slots by a token-based fair share.
//!
//! The engine holds the pool's token (`MOULT_TOKEN`), which opens everything, as a run token
//! does. A run presents its pool credential instead (`<run>.<HMAC>`,
//! [`moult_operator::credentials::pool_credential`]), checked without a list of runs; it opens
//! only [`TENANT_ROUTES`], and within them only the run's own adapters, named `<run>-v<N>` for
//! policy version `N`. The tokens of such a request carry the version `N`, whatever the engine's
//! own weight version.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Instant;

use axum::extract::Request;
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use serde::Serialize;

use crate::serve::ApiError;

/// What a pool engine holds at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolLimits {
    /// Adapters loaded at once (two per run while it switches versions).
    pub max_adapters: usize,
    /// The largest rank an adapter may have.
    pub max_rank: i64,
}

/// What an EnginePool's `maxAdapters` and `maxRank` set.
impl From<&moult_operator::api::EnginePoolSpec> for PoolLimits {
    fn from(spec: &moult_operator::api::EnginePoolSpec) -> Self {
        Self {
            max_adapters: spec.max_adapters as usize,
            max_rank: spec.max_rank.into(),
        }
    }
}

/// The run whose pool credential a request carries (set by [`gate`]).
#[derive(Debug, Clone)]
pub struct Tenant(pub Arc<str>);

/// The routes (method and path) a run's pool credential opens; a path ending in `/` takes one
/// more segment (the adapter's name).
pub const TENANT_ROUTES: [(&str, &str); 9] = [
    ("POST", "/inference/v1/generate"),
    ("POST", "/inference/v1/abort_requests"),
    ("PUT", "/v1/adapters/"),
    ("POST", "/v1/unload_lora_adapter"),
    ("GET", "/v1/models"),
    ("GET", "/v1/pool/share"),
    ("GET", "/weight_info"),
    ("GET", "/get_world_size"),
    ("GET", "/health"),
];

fn tenant_route(method: &str, path: &str) -> bool {
    TENANT_ROUTES.iter().any(|&(m, p)| {
        let one_more = |rest: &str| !rest.is_empty() && !rest.contains('/');
        m == method
            && match p.ends_with('/') {
                true => path.strip_prefix(p).is_some_and(one_more),
                false => path == p,
            }
    })
}

/// The run and version `N` of an adapter named `<run>-v<N>`, as a LoRA run names each of its
/// versions on an EnginePool or vLLM (docs/lora.md).
pub fn adapter_version(name: &str) -> Option<(&str, u64)> {
    let (run, digits) = name.rsplit_once("-v")?;
    let plain = !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit());
    Some((run, digits.parse().ok().filter(|_| plain)?))
}

/// The version of adapter `name` if it is one of `run`'s: `<run>-v<N>`.
pub fn version_of(run: &str, name: &str) -> Option<u64> {
    adapter_version(name)
        .filter(|&(r, _)| r == run)
        .map(|(_, v)| v)
}

/// The run `run` may use the adapter `name`: its version, or a 403 saying whose adapters it may
/// use.
pub fn own(run: &str, name: Option<&str>, param: &str) -> Result<u64, ApiError> {
    name.and_then(|n| version_of(run, n)).ok_or_else(|| {
        let named = name.map_or("none".to_string(), |n| format!("`{n}`"));
        ApiError::new(
            StatusCode::FORBIDDEN,
            format!("run `{run}` may use only its own adapters, named `{run}-v<N>`; {param} names {named} (docs/lora.md)"),
        )
        .with_param(param)
    })
}

/// Checks a pool credential ahead of the run-token check: a request carrying one on a route
/// [`TENANT_ROUTES`] opens goes on as the pool's own, marked with its [`Tenant`]; on another
/// route it is refused (403). Anything else is left to the run-token check. A no-op in a
/// process without a token.
pub async fn gate(mut request: Request, next: Next) -> Response {
    let Some(pool_token) = crate::auth::token() else {
        return next.run(request).await;
    };
    let given = crate::auth::bearer(request.headers().get(header::AUTHORIZATION))
        .map(|g| g.trim().to_string());
    let Some(run) = given
        .and_then(|g| moult_operator::credentials::pool_run(pool_token, &g).map(Arc::<str>::from))
    else {
        return next.run(request).await;
    };
    let (method, path) = (request.method().as_str(), request.uri().path());
    if !tenant_route(method, path) {
        let message = format!(
            "a pool run's credential does not open {method} {path}: runs generate and load their own adapters, nothing else (docs/lora.md)"
        );
        return ApiError::new(StatusCode::FORBIDDEN, message).into_response();
    }
    let own = HeaderValue::from_str(&format!("Bearer {pool_token}")).expect("a token header");
    request.headers_mut().insert(header::AUTHORIZATION, own);
    request.extensions_mut().insert(Tenant(run));
    next.run(request).await
}

/// How long a run has computed nothing before an engine with no room for another adapter unloads
/// its adapters.
pub const IDLE_SECS: f64 = 120.0;

/// How long a token counts fully toward a run's recent usage: it counts half after this long.
const HALF_LIFE_SECS: f64 = 30.0;

/// One run's use of the engine.
#[derive(Debug, Clone, Copy)]
struct Usage {
    /// Prompt and generated tokens computed for it, ever.
    tokens: u64,
    /// The same, each token's weight halving every [`HALF_LIFE_SECS`], as of `at`.
    recent: f64,
    at: Instant,
}

impl Usage {
    fn recent(&self, now: Instant) -> f64 {
        let age = now.saturating_duration_since(self.at).as_secs_f64();
        self.recent * 0.5f64.powf(age / HALF_LIFE_SECS)
    }
}

/// The runs' use of one engine: who is admitted next when requests wait for batch slots.
///
/// The fair share is on tokens: a waiting request of the run with the least recent usage
/// (prompt plus generated tokens, decayed with a half-life of [`HALF_LIFE_SECS`]) takes the next
/// free slot; requests of one run keep their order. A run alone gets every slot; two runs that
/// both keep the engine busy get about half the tokens each. Tokens stand in for engine time
/// (a prefill token costs less than a decode step): the share reported is the proxy.
#[derive(Debug, Default)]
pub struct Fairness {
    runs: BTreeMap<Arc<str>, Usage>,
}

/// One run's share of an engine, as `GET /v1/pool/share` answers it.
#[derive(Debug, Clone, Serialize, serde::Deserialize, PartialEq)]
pub struct Share {
    /// Prompt and generated tokens computed for the run, ever.
    pub tokens: u64,
    /// Its fraction of the engine's recent tokens (0 to 1).
    pub share: f64,
}

impl Fairness {
    /// Counts `tokens` computed for `run`.
    pub fn charge(&mut self, run: &Arc<str>, tokens: u64) {
        let now = Instant::now();
        let usage = self.runs.entry(run.clone()).or_insert(Usage {
            tokens: 0,
            recent: 0.0,
            at: now,
        });
        usage.recent = usage.recent(now) + tokens as f64;
        (usage.tokens, usage.at) = (usage.tokens + tokens, now);
    }

    /// Which of the waiting requests' runs goes next: the index of the first request of the run
    /// with the least recent usage (requests of no run count as a run of their own).
    pub fn next<'a>(&self, waiting: impl Iterator<Item = Option<&'a Arc<str>>>) -> Option<usize> {
        let now = Instant::now();
        let recent = |run: Option<&Arc<str>>| {
            run.and_then(|r| self.runs.get(r))
                .map_or(0.0, |u| u.recent(now))
        };
        let mut best: Option<(usize, f64)> = None;
        for (i, run) in waiting.enumerate() {
            let r = recent(run);
            if best.is_none_or(|(_, b)| r < b) {
                best = Some((i, r));
            }
        }
        best.map(|(i, _)| i)
    }

    /// The run among `runs` that has been idle longest, if it has been for [`IDLE_SECS`]: whose
    /// adapters an engine with no room left unloads (a run that stopped without unloading them).
    pub fn idlest<'a>(&self, runs: impl Iterator<Item = &'a str>) -> Option<&'a str> {
        let now = Instant::now();
        let idle = |run: &str| {
            (self.runs.get(run)).map_or(f64::INFINITY, |u| {
                now.saturating_duration_since(u.at).as_secs_f64()
            })
        };
        let (run, seconds) = runs
            .map(|r| (r, idle(r)))
            .max_by(|a, b| a.1.total_cmp(&b.1))?;
        (seconds >= IDLE_SECS).then_some(run)
    }

    /// Every run's share (or only `run`'s).
    pub fn shares(&self, run: Option<&str>) -> BTreeMap<String, Share> {
        let now = Instant::now();
        let total: f64 = self.runs.values().map(|u| u.recent(now)).sum();
        (self.runs.iter())
            .filter(|(r, _)| run.is_none_or(|run| &***r == run))
            .map(|(r, u)| {
                let share = if total > 0.0 {
                    u.recent(now) / total
                } else {
                    0.0
                };
                let tokens = u.tokens;
                (r.to_string(), Share { tokens, share })
            })
            .collect()
    }
}

/// An EnginePool on this machine (`moult pool`; docs/lora.md, "Two runs on one pool"): its
/// engines, each a `moult engine` process holding the pool's token, and where `moult run` finds
/// them for a run whose `spec.engines.poolRef` names the pool.
#[derive(Debug, Serialize, serde::Deserialize)]
pub struct LocalPool {
    /// The base model the engines serve (absolute).
    pub model: PathBuf,
    pub engines: Vec<String>,
    pub token: String,
}

impl LocalPool {
    /// Where the pool `name` of this machine is described (readable by its user only).
    pub fn file(name: &str) -> PathBuf {
        std::env::temp_dir()
            .join("moult-pools")
            .join(format!("{name}.json"))
    }

    /// Starts `replicas` engines of `moult` (this program) serving `model` within `limits`,
    /// each with `threads` libtorch threads, holding a new random pool token; returns them
    /// once all listen.
    pub fn start(
        moult: &Path,
        model: &Path,
        replicas: usize,
        limits: PoolLimits,
        threads: usize,
    ) -> std::io::Result<(Vec<Child>, Self)> {
        use std::io::BufRead;
        let token = format!("{:032x}", rand::random::<u128>());
        let mut children = Vec::new();
        let mut engines = Vec::new();
        for _ in 0..replicas {
            let mut child = Command::new(moult)
                .args(["engine", "--port", "0", "--threads", &threads.to_string()])
                .args(["--pool-max-adapters", &limits.max_adapters.to_string()])
                .args(["--max-lora-rank", &limits.max_rank.to_string(), "--model"])
                .arg(model)
                .env(crate::auth::TOKEN_ENV, &token)
                .stdout(Stdio::piped())
                .spawn()?;
            let mut lines = std::io::BufReader::new(child.stdout.take().expect("piped")).lines();
            let first = lines.next().transpose()?.unwrap_or_default();
            // Its later lines, if any, go nowhere rather than into a closed pipe.
            std::thread::spawn(move || lines.for_each(drop));
            children.push(child);
            match first.strip_prefix("moult engine listening on ") {
                Some(url) => engines.push(url.to_string()),
                None => {
                    let message = format!("an engine did not start (its log is above): {first}");
                    return Err(std::io::Error::other(message));
                }
            }
        }
        let model = std::fs::canonicalize(model)?;
        Ok((
            children,
            Self {
                model,
                engines,
                token,
            },
        ))
    }

    /// Writes where the pool `name` is, for its user only.
    pub fn write(&self, name: &str) -> std::io::Result<PathBuf> {
        use std::os::unix::fs::OpenOptionsExt;
        let file = Self::file(name);
        std::fs::create_dir_all(file.parent().expect("a folder"))?;
        let mut out = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&file)?;
        std::io::Write::write_all(&mut out, serde_json::to_string(self)?.as_bytes())?;
        Ok(file)
    }

    /// The pool `name` running on this machine, if one is.
    pub fn find(name: &str) -> Option<Self> {
        let text = std::fs::read_to_string(Self::file(name)).ok()?;
        serde_json::from_str(&text).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_run_owns_only_its_versioned_names() {
        assert_eq!(version_of("a", "a-v3"), Some(3));
        assert_eq!(version_of("a", "a-v"), None);
        assert_eq!(version_of("a", "ab-v3"), None);
        assert_eq!(version_of("a", "a-v3x"), None);
        assert_eq!(version_of("a-v1", "a-v1-v2"), Some(2));
        assert_eq!(adapter_version("a-v1-v2"), Some(("a-v1", 2)));
        assert_eq!(adapter_version("a-v+5"), None, "digits only");
        assert_eq!(own("a", Some("a-v7"), "model").unwrap(), 7);
        let err = own("a", Some("b-v7"), "model").unwrap_err();
        assert_eq!(err.status, StatusCode::FORBIDDEN);
        assert!(err.message.contains("`b-v7`"), "{}", err.message);
        assert!(own("a", None, "model").is_err());
    }

    #[test]
    fn tenant_routes_are_the_listed_ones() {
        assert!(tenant_route("POST", "/inference/v1/generate"));
        assert!(tenant_route("PUT", "/v1/adapters/a-v1"));
        assert!(!tenant_route("PUT", "/v1/adapters/"));
        assert!(!tenant_route("PUT", "/v1/adapters/a/b"));
        assert!(!tenant_route("POST", "/pause"));
        assert!(!tenant_route("POST", "/v1/load_lora_adapter"));
        assert!(!tenant_route("GET", "/inference/v1/generate"));
    }

    #[test]
    fn the_run_with_least_recent_usage_goes_next() {
        let (a, b): (Arc<str>, Arc<str>) = ("a".into(), "b".into());
        let mut fair = Fairness::default();
        fair.charge(&a, 100);
        fair.charge(&b, 10);
        let waiting = [Some(&a), Some(&a), Some(&b), None];
        assert_eq!(fair.next(waiting.iter().copied()), Some(3), "no usage yet");
        assert_eq!(fair.next(waiting[..3].iter().copied()), Some(2));
        fair.charge(&b, 200);
        assert_eq!(fair.next(waiting[..3].iter().copied()), Some(0));
        let shares = fair.shares(None);
        assert_eq!(shares["a"].tokens, 100);
        assert_eq!(shares["b"].tokens, 210);
        assert!((shares["a"].share + shares["b"].share - 1.0).abs() < 1e-9);
        assert!((shares["a"].share - 100.0 / 310.0).abs() < 1e-3);
        assert_eq!(fair.shares(Some("b")).len(), 1);
        // Room goes to no run active within IDLE_SECS; a run never seen has been idle forever.
        assert_eq!(fair.idlest(["a", "b"].into_iter()), None);
        assert_eq!(fair.idlest(["a", "gone"].into_iter()), Some("gone"));
    }
}
