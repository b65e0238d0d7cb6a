//! The credentials of a cluster run (docs/security.md says who holds which, and what each opens).
//!
//! The operator puts a random token in a Secret. The coordinator, trainer and engines get it as
//! `MOULT_TOKEN` (the run token); agent pods get only `MOULT_AGENT_TOKEN`, the agent credential
//! derived from it ([`moult_operator::credentials::agent_credential`]). When a process has the
//! run token, every HTTP server of it refuses requests without `Authorization: Bearer <run
//! token>` (401), except `GET /health` and `GET /metrics`, which kubelet probes and Prometheus
//! call without credentials; the coordinator also takes the agent credential on the routes an
//! agent needs ([`AGENT_ROUTES`]: leasing and returning episodes, generating) and refuses it
//! everywhere else (403). Every HTTP client of the process sends the process's credential. The
//! weight stream's TCP handshake proves the run token both ways without sending it (comparing
//! proofs with [`same_secret`]). Without either variable (a local run on loopback) nothing is
//! checked.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use axum::extract::Request;
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::serve::ApiError;

/// The environment variable that holds the run token.
pub const TOKEN_ENV: &str = "MOULT_TOKEN";
/// The environment variable that holds the agent credential (agent pods only).
pub const AGENT_TOKEN_ENV: &str = "MOULT_AGENT_TOKEN";

/// The environment variable that holds a run's credential on an EnginePool's engines (the
/// operator sets it from the run's Secret).
pub use moult_operator::children::POOL_CREDENTIAL_ENV;

/// Every environment variable that holds a credential: agent code never inherits these.
pub const CREDENTIAL_ENVS: [&str; 3] = [TOKEN_ENV, AGENT_TOKEN_ENV, POOL_CREDENTIAL_ENV];

/// The routes (method and path) the agent credential opens on the coordinator: what `moult
/// agents` calls. A path ending in `/` takes one more segment (the lease id).
pub const AGENT_ROUTES: [(&str, &str); 5] = [
    ("POST", "/v1/agents/lease"),
    ("POST", "/v1/agents/renew"),
    ("POST", "/v1/agents/episodes/"),
    ("POST", "/inference/v1/generate"),
    ("POST", "/inference/v1/abort_requests"),
];

fn read_env(name: &str) -> Option<String> {
    let value = std::env::var(name).ok()?;
    Some(value.trim().to_string()).filter(|t| !t.is_empty())
}

/// The run token, if this process has one (read once).
pub fn token() -> Option<&'static str> {
    static TOKEN: OnceLock<Option<String>> = OnceLock::new();
    TOKEN.get_or_init(|| read_env(TOKEN_ENV)).as_deref()
}

/// The agent credential: derived from the run token where this process has it, else the one
/// given to an agent pod (read once).
pub fn agent_token() -> Option<&'static str> {
    static AGENT: OnceLock<Option<String>> = OnceLock::new();
    let agent = AGENT.get_or_init(|| match token() {
        Some(t) => Some(moult_operator::credentials::agent_credential(t)),
        None => read_env(AGENT_TOKEN_ENV),
    });
    agent.as_deref()
}

/// What this process's HTTP clients send: the run token, or the agent credential in an agent pod.
fn client_credential() -> Option<&'static str> {
    token().or_else(agent_token)
}

/// A run's credential on its EnginePool's engines (docs/lora.md, "Engine pools"): the one `moult
/// run` derived (set once, before any engine client is made), or `MOULT_POOL_CREDENTIAL`.
pub static POOL_CREDENTIAL: OnceLock<Option<String>> = OnceLock::new();

/// An HTTP client for engines: it sends the run's pool credential on an EnginePool, else this
/// process's credential.
pub fn engine_client() -> reqwest::Client {
    let pool = POOL_CREDENTIAL.get_or_init(|| read_env(POOL_CREDENTIAL_ENV));
    build(builder_with(pool.as_deref().or_else(client_credential)))
}

/// An HTTP client that sends this process's credential with every request (when there is one).
pub fn client_builder() -> reqwest::ClientBuilder {
    builder_with(client_credential())
}

fn builder_with(credential: Option<&str>) -> reqwest::ClientBuilder {
    // A peer that does not accept a connection in this long is down, not slow. (Requests have
    // no overall timeout here: generation streams and weight updates may rightly take minutes,
    // and are bounded by their callers, docs/security.md; clients whose calls are short set
    // one, as agents and the trainer do for the coordinator.)
    let builder = reqwest::Client::builder().connect_timeout(std::time::Duration::from_secs(10));
    match credential.and_then(|t| HeaderValue::from_str(&format!("Bearer {t}")).ok()) {
        Some(mut value) => {
            value.set_sensitive(true);
            let mut headers = reqwest::header::HeaderMap::new();
            headers.insert(reqwest::header::AUTHORIZATION, value);
            builder.default_headers(headers)
        }
        None => builder,
    }
}

/// [`client_builder`] built.
pub fn client() -> reqwest::Client {
    build(client_builder())
}

/// The client of one of these builders (with a timeout or not): their settings always build.
pub fn build(builder: reqwest::ClientBuilder) -> reqwest::Client {
    (builder.build()).expect("an HTTP client with default settings builds")
}

/// Why a call to a peer failed: it did not arrive, was refused, or answered other than expected.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    #[error("{url}: {source}")]
    Send {
        url: String,
        #[source]
        source: reqwest::Error,
    },
    #[error("{url}: {status}: {body}")]
    Status {
        url: String,
        status: reqwest::StatusCode,
        body: String,
    },
    #[error("{url}: unexpected answer: {source}")]
    Answer {
        url: String,
        #[source]
        source: serde_json::Error,
    },
}

/// Sends `request` (to `url`), which must answer 2xx; its JSON answer, where an empty one (a 204,
/// "nothing yet") reads as `null`.
pub(crate) async fn call<T: serde::de::DeserializeOwned>(
    url: &str,
    request: reqwest::RequestBuilder,
) -> Result<T, CallError> {
    let send = |source| CallError::Send {
        url: url.to_string(),
        source,
    };
    let r = request.send().await.map_err(send)?;
    let status = r.status();
    let body = r.text().await.map_err(send)?;
    let url = url.to_string();
    if !status.is_success() {
        return Err(CallError::Status { url, status, body });
    }
    let json = if body.is_empty() { "null" } else { &body };
    serde_json::from_str(json).map_err(|source| CallError::Answer { url, source })
}

/// Paths anyone may call: probes and metrics scrapes.
fn open(path: &str) -> bool {
    matches!(path, "/health" | "/metrics")
}

/// Whether the agent credential opens `method path`.
fn agent_route(method: &str, path: &str) -> bool {
    AGENT_ROUTES.iter().any(|(m, p)| {
        *m == method
            && match p.strip_suffix('/') {
                // One more segment, and a plain one: no `..` or empty segment to walk elsewhere.
                Some(prefix) => {
                    let id = path.strip_prefix(prefix).and_then(|r| r.strip_prefix('/'));
                    id.is_some_and(|id| !matches!(id, "" | "." | "..") && !id.contains('/'))
                }
                None => path == *p,
            }
    })
}

/// Whether `header` (an `Authorization` value) carries `token`, compared in constant time.
fn authorized(header: Option<&HeaderValue>, token: &str) -> bool {
    bearer(header).is_some_and(|given| same_secret(given.trim().as_bytes(), token.as_bytes()))
}

/// The credential an `Authorization: Bearer <credential>` header carries.
pub(crate) fn bearer(header: Option<&HeaderValue>) -> Option<&str> {
    header?.to_str().ok()?.strip_prefix("Bearer ")
}

/// Whether two secrets (or proofs of one) are equal, compared in constant time.
pub(crate) fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Who may call which route of a server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Policy {
    /// The run token only (engines, the trainer's and agents' metrics servers, a router).
    Run,
    /// The run token, and the agent credential on [`AGENT_ROUTES`] (the coordinator).
    RunAndAgents,
}

/// What a request with `authorization` may do under `policy`, given the run token `run` and
/// the agent credential `agent`: `None` to serve it, or the refusal.
fn decide(
    policy: Policy,
    run: &str,
    agent: Option<&str>,
    method: &str,
    path: &str,
    authorization: Option<&HeaderValue>,
) -> Option<(StatusCode, String)> {
    if open(path) || authorized(authorization, run) {
        return None;
    }
    if agent.is_some_and(|agent| authorized(authorization, agent)) {
        if policy == Policy::RunAndAgents && agent_route(method, path) {
            return None;
        }
        return Some((
            StatusCode::FORBIDDEN,
            format!(
                "the agent credential does not open {method} {path}: agents may lease and return \
                 episodes and generate, nothing else (docs/security.md)"
            ),
        ));
    }
    Some((
        StatusCode::UNAUTHORIZED,
        format!("this endpoint needs the run's token: send `Authorization: Bearer ${TOKEN_ENV}`"),
    ))
}

/// What the holders of the agent credential may have open at once on the coordinator, and the
/// requests refused for each ([`Limit`]); beyond a limit a request is answered 429
/// (docs/security.md, "Holders and rates").
#[derive(Debug, Default)]
pub struct AgentGate {
    most: [u64; 3],
    held: [AtomicU64; 3],
    refused: [AtomicU64; 3],
}

/// The limits of an [`AgentGate`], by index.
#[derive(Debug, Clone, Copy)]
pub enum Limit {
    Requests,
    Generations,
    EpisodeBytes,
}

impl AgentGate {
    /// At most `most[limit]` of each [`Limit`]: requests open, generations, episode bytes.
    pub fn new(most: [u64; 3]) -> Arc<Self> {
        Arc::new(Self {
            most,
            ..Self::default()
        })
    }

    /// The requests refused for `limit`.
    pub fn refused(&self, limit: Limit) -> u64 {
        self.refused[limit as usize].load(Ordering::Relaxed)
    }

    /// `amount` more of `limit`, held until the [`Hold`] drops; or the refusal, counted.
    fn take(self: &Arc<Self>, limit: Limit, amount: u64) -> Result<Hold, (StatusCode, String)> {
        let (i, most) = (limit as usize, self.most[limit as usize]);
        let more = |held: u64| held.checked_add(amount).filter(|&n| n <= most);
        let Err(before) = self.held[i].fetch_update(Ordering::AcqRel, Ordering::Acquire, more)
        else {
            return Ok(Hold(self.clone(), i, amount));
        };
        self.refused[i].fetch_add(1, Ordering::Relaxed);
        let what = [
            "requests open",
            "generations",
            "bytes of episodes being received",
        ][i];
        let field = ["requests", "generations", "episodeMiB"][i];
        let message = format!(
            "the agent pods have {before} {what} at once, and {amount} more would pass the most \
             they may have, {most} (spec.coordinator.agentLimits.{field}); retry later"
        );
        Err((StatusCode::TOO_MANY_REQUESTS, message))
    }

    /// What an agent's `request` holds while it is served.
    fn admit(self: &Arc<Self>, request: &Request) -> Result<Vec<Hold>, (StatusCode, String)> {
        let mut holds = vec![self.take(Limit::Requests, 1)?];
        let path = request.uri().path();
        if path == "/inference/v1/generate" {
            holds.push(self.take(Limit::Generations, 1)?);
        } else if path.starts_with("/v1/agents/episodes/") {
            // A body of unknown length may be as large as every byte allowed.
            let length = (request.headers().get(header::CONTENT_LENGTH))
                .and_then(|v| v.to_str().ok()?.parse().ok());
            let bytes = length.unwrap_or(self.most[Limit::EpisodeBytes as usize]);
            holds.push(self.take(Limit::EpisodeBytes, bytes)?);
        }
        Ok(holds)
    }
}

/// A share of an [`AgentGate`]'s limit, given back when dropped.
#[derive(Debug)]
struct Hold(Arc<AgentGate>, usize, u64);

impl Drop for Hold {
    fn drop(&mut self) {
        self.0.held[self.1].fetch_sub(self.2, Ordering::AcqRel);
    }
}

async fn check(
    policy: Policy,
    gate: Option<Arc<AgentGate>>,
    request: Request,
    next: Next,
) -> Response {
    let Some(run) = token() else {
        return next.run(request).await;
    };
    let authorization = request.headers().get(header::AUTHORIZATION);
    let path = request.uri().path();
    let refusal = decide(
        policy,
        run,
        agent_token(),
        request.method().as_str(),
        path,
        authorization,
    );
    // Served, and neither open nor the run token's: the agent credential's.
    let agent = !open(path) && !authorized(authorization, run);
    let refusal = match (refusal, gate.filter(|_| agent)) {
        (None, Some(gate)) => match gate.admit(&request) {
            // The holds last until the answer is sent (a stream's last chunk).
            Ok(holds) => {
                let response = next.run(request).await;
                return response.map(|body| {
                    use futures::StreamExt;
                    let sent = body.into_data_stream().inspect(move |_| _ = &holds);
                    axum::body::Body::from_stream(sent)
                });
            }
            Err(refusal) => Some(refusal),
        },
        (refusal, _) => refusal,
    };
    match refusal {
        None => next.run(request).await,
        Some((status, message)) => {
            let mut response = ApiError::new(status, message).into_response();
            if status == StatusCode::UNAUTHORIZED {
                response
                    .headers_mut()
                    .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            }
            response
        }
    }
}

/// `routes` with the run-token check in front (a no-op in a process without the run token).
pub fn protect(routes: axum::Router) -> axum::Router {
    routes.layer(axum::middleware::from_fn(|r, n| {
        check(Policy::Run, None, r, n)
    }))
}

/// [`protect`], with the agent credential accepted on [`AGENT_ROUTES`] within `gate`'s limits:
/// the coordinator's server.
pub fn protect_for_agents(routes: axum::Router, gate: Arc<AgentGate>) -> axum::Router {
    routes.layer(axum::middleware::from_fn(move |r, n| {
        check(Policy::RunAndAgents, Some(gate.clone()), r, n)
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_token_must_match_exactly() {
        let h = |s: &str| HeaderValue::from_str(s).unwrap();
        assert!(authorized(Some(&h("Bearer s3cret")), "s3cret"));
        assert!(!authorized(Some(&h("Bearer s3cre")), "s3cret"));
        assert!(!authorized(Some(&h("Bearer s3cretx")), "s3cret"));
        assert!(!authorized(Some(&h("Basic s3cret")), "s3cret"));
        assert!(!authorized(None, "s3cret"));
        assert!(open("/health") && open("/metrics") && !open("/pause"));
    }

    #[test]
    fn the_agent_gate_refuses_past_each_limit_and_counts_it() {
        let gate = AgentGate::new([3, 1, 100]);
        let request = |path: &str, length: Option<u64>| {
            let mut r = Request::post(path);
            if let Some(n) = length {
                r = r.header(header::CONTENT_LENGTH, n);
            }
            r.body(axum::body::Body::empty()).unwrap()
        };
        let status = |r: Result<Vec<Hold>, (StatusCode, String)>| r.err().map(|e| e.0);
        let generating = gate
            .admit(&request("/inference/v1/generate", None))
            .unwrap();
        // One generation at most: the second is refused, and holds nothing after.
        let refused = gate.admit(&request("/inference/v1/generate", None));
        assert_eq!(status(refused), Some(StatusCode::TOO_MANY_REQUESTS));
        assert_eq!(gate.refused(Limit::Generations), 1);
        let sixty = gate
            .admit(&request("/v1/agents/episodes/l1", Some(60)))
            .unwrap();
        let (_, message) = gate
            .admit(&request("/v1/agents/episodes/l2", Some(41)))
            .unwrap_err();
        assert!(message.contains("have 60 bytes of episodes"), "{message}");
        assert!(
            message.contains("spec.coordinator.agentLimits.episodeMiB"),
            "{message}"
        );
        // A body of unknown length needs the whole allowance.
        let unknown = gate.admit(&request("/v1/agents/episodes/l3", None));
        assert_eq!(status(unknown), Some(StatusCode::TOO_MANY_REQUESTS));
        assert_eq!(gate.refused(Limit::EpisodeBytes), 2);
        // Two requests open (a generation, an episode); the third is the last one allowed.
        let lease = gate.admit(&request("/v1/agents/lease", None)).unwrap();
        let (_, message) = gate.admit(&request("/v1/agents/renew", None)).unwrap_err();
        assert!(message.contains("3 requests open"), "{message}");
        assert_eq!(gate.refused(Limit::Requests), 1);
        // Holds go back when dropped: everything is allowed again.
        drop((generating, sixty, lease));
        assert!(gate.held.iter().all(|h| h.load(Ordering::Relaxed) == 0));
        gate.admit(&request("/inference/v1/generate", None))
            .unwrap();
        gate.admit(&request("/v1/agents/episodes/l4", None))
            .unwrap();
        // A length that would overflow the count is refused like any other too large.
        let huge = gate.admit(&request("/v1/agents/episodes/l5", Some(u64::MAX)));
        assert_eq!(status(huge), Some(StatusCode::TOO_MANY_REQUESTS));
        assert!(gate.held.iter().all(|h| h.load(Ordering::Relaxed) == 0));
    }

    #[test]
    fn the_agent_credential_opens_the_agent_routes_of_the_coordinator_only() {
        let agent = moult_operator::credentials::agent_credential("s3cret");
        let bearer = |t: &str| HeaderValue::from_str(&format!("Bearer {t}")).unwrap();
        let decide = |policy, method, path, t: &str| {
            decide(
                policy,
                "s3cret",
                Some(&agent),
                method,
                path,
                Some(&bearer(t)),
            )
            .map(|r| r.0)
        };
        use Policy::*;
        for (method, path) in [
            ("POST", "/v1/agents/lease"),
            ("POST", "/v1/agents/renew"),
            ("POST", "/v1/agents/episodes/lease-7"),
            ("POST", "/inference/v1/generate"),
            ("POST", "/inference/v1/abort_requests"),
        ] {
            assert_eq!(decide(RunAndAgents, method, path, &agent), None, "{path}");
            assert_eq!(decide(RunAndAgents, method, path, "s3cret"), None, "{path}");
            // Engines and routers of their own take the run token alone.
            assert_eq!(
                decide(Run, method, path, &agent),
                Some(StatusCode::FORBIDDEN),
                "{path}"
            );
        }
        for (method, path) in [
            ("POST", "/engines"),
            ("GET", "/engines"),
            ("DELETE", "/engines"),
            ("POST", "/pause"),
            ("POST", "/resume"),
            ("POST", "/update_weights"),
            ("POST", "/init_weight_transfer_engine"),
            ("POST", "/collective_rpc"),
            ("POST", "/update_weight_version"),
            ("POST", "/v1/trainer/commit"),
            ("GET", "/v1/trainer/batch"),
            ("POST", "/v1/trainer/hello"),
            ("GET", "/v1/status"),
            ("GET", "/v1/agents/lease"),
            ("POST", "/v1/agents/episodes/"),
            ("POST", "/v1/agents/episodes/../../engines"),
            ("POST", "/v1/agents/episodes/a/b"),
            ("POST", "/v1/agents/episodes/.."),
            ("POST", "/v1/agents/lease/"),
            ("POST", "/inference/v1/generate/../../pause"),
        ] {
            assert_eq!(
                decide(RunAndAgents, method, path, &agent),
                Some(StatusCode::FORBIDDEN),
                "{method} {path}"
            );
            assert_eq!(decide(RunAndAgents, method, path, "s3cret"), None);
            assert_eq!(
                decide(RunAndAgents, method, path, "guess"),
                Some(StatusCode::UNAUTHORIZED)
            );
        }
        assert_eq!(decide(RunAndAgents, "GET", "/health", "guess"), None);
    }
}
