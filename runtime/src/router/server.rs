//! The router's HTTP API: the engine API (docs/engine.md) in front of the pool, plus `/engines`.
//!
//! - `POST /inference/v1/generate`: routed by the policy (session from the `x-moult-session`
//!   header), with failover; streamed or not, in the engine's own shapes;
//! - `POST /inference/v1/abort_requests`: the running requests of those ids that the caller
//!   started (the same `x-moult-session`, or none for both), sent to every engine;
//! - `POST /pause`, `/resume`, `/start_weight_update`, `/update_weights`,
//!   `/finish_weight_update`, and vLLM's `/collective_rpc` and `/update_weight_version` (an
//!   update from a folder): fanned out to every healthy engine; the answer is an error (502,
//!   naming the engines) unless every engine agreed. After a finished update (or a new version
//!   set), only engines that serve its version get generation requests (one that joins or
//!   returns later waits for the next update);
//! - `POST /init_weight_transfer_engine`: fanned out with each engine's `rank_offset` placed after
//!   the previous engines' ranks (their `/get_world_size`), so one trainer serves them all;
//! - `GET /is_paused` (all paused), `/get_world_size` (sum), `/weight_info` (per engine),
//!   `/health` (200 while an engine is up), `/metrics`, `/v1/models`;
//! - `GET /engines`, `POST /engines {"url"}` (join), `DELETE /engines {"url"}` (leave).

use std::convert::Infallible;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::Json;
use futures::StreamExt;
use serde::Deserialize;
use serde_json::{json, Map, Value};
use tokio_stream::wrappers::ReceiverStream;

use super::generate::{start, RoutedRequest};
use super::{Engine, Router};
use crate::engine::api::{AbortRequest, Choice, GenerateResponse, TokenLogprob, TopLogprob, Usage};
use crate::engine::client::{
    ContentPart, Generated, ADAPTER_BODY_LIMIT, GENERATE_BODY_LIMIT, SESSION_HEADER,
};
use crate::engine::ApiError;

/// `POST /inference/v1/generate` as the router reads it: the engine validates the rest.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct GenerateBody {
    request_id: Option<String>,
    token_ids: Vec<i64>,
    /// The prompt's images (vLLM's form), forwarded to whichever engine serves the request.
    #[serde(default)]
    content_parts: Vec<ContentPart>,
    #[serde(default)]
    sampling_params: Map<String, Value>,
    #[serde(default)]
    stream: bool,
    #[serde(default)]
    model: Option<String>,
}

/// A generate response (or stream chunk) of one choice.
fn one_choice(request_id: String, choice: Choice, usage: Option<Usage>) -> GenerateResponse {
    GenerateResponse {
        request_id,
        choices: vec![choice],
        usage,
        prompt_logprobs: None,
    }
}

fn unfinished() -> ApiError {
    let message = "the generation ended without finishing";
    ApiError::new(StatusCode::BAD_GATEWAY, message)
}

/// The `x-moult-session` a request was sent under.
fn session(headers: &HeaderMap) -> Option<String> {
    let value = headers.get(SESSION_HEADER)?.to_str().ok()?;
    Some(value.to_string())
}

fn parse<T: serde::de::DeserializeOwned>(body: &Bytes) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| ApiError::bad_request(format!("invalid request: {e}")))
}

async fn generate(
    State(router): State<Arc<Router>>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let body: GenerateBody = parse(&body)?;
    let _ = body.model;
    if body.token_ids.is_empty() {
        return Err(ApiError::bad_request("token_ids must not be empty").with_param("token_ids"));
    }
    let request_id = body.request_id.unwrap_or_else(Router::request_id);
    let prompt_len = body.token_ids.len();
    // Every routed token carries its logprob (the built-in engine always sends them; vLLM only
    // when asked): ask for them when the client did not (docs/router.md, "The engine API").
    let mut params = body.sampling_params;
    if params.get("prompt_logprobs").is_some_and(|v| !v.is_null()) {
        // Generation through the router streams from the engines, and no engine streams them.
        return Err(ApiError::bad_request(
            "prompt_logprobs are not routed: ask an engine directly, without streaming (docs/router.md)",
        )
        .with_param("sampling_params.prompt_logprobs"));
    }
    if params.get("logprobs").is_none_or(Value::is_null) {
        params.insert("logprobs".into(), Value::from(0));
    }
    let req = RoutedRequest {
        request_id: request_id.clone(),
        prompt: body.token_ids,
        content_parts: body.content_parts,
        params,
        session: session(&headers),
    };
    let mut rx = start(router, req);
    if !body.stream {
        let mut choice = Choice::empty();
        while let Some(event) = rx.recv().await {
            if let Some(usage) = add(&mut choice, event?, prompt_len, 0) {
                return Ok(Json(one_choice(request_id, choice, Some(usage))).into_response());
            }
        }
        return Err(unfinished());
    }
    // The first event decides between an error status and a stream. The stream ends with the
    // generation (its sender goes after the finish or an error), each of which ends in `[DONE]`.
    let first = rx.recv().await.ok_or_else(unfinished)??;
    let events = futures::stream::once(async { Ok(first) }).chain(ReceiverStream::new(rx));
    // A chunk holds one token, whose version span counts from the first generated.
    let mut sent = 0;
    let stream = events.flat_map(move |event| {
        let (data, last) = match event {
            Ok(event) => {
                let mut choice = Choice::empty();
                let usage = add(&mut choice, event, prompt_len, sent);
                for span in &mut choice.weight_versions {
                    (span.start, span.end) = (span.start + sent, span.end + sent);
                }
                sent += choice.token_ids.len();
                let last = usage.is_some();
                let chunk = one_choice(request_id.clone(), choice, usage);
                (serde_json::to_string(&chunk).expect("serializable"), last)
            }
            Err(e) => (
                json!({"error": {"message": e.message, "code": e.status.as_u16()}}).to_string(),
                true,
            ),
        };
        let done = last.then(|| "[DONE]".to_string());
        let data = [Some(data), done].into_iter().flatten();
        futures::stream::iter(data.map(|d| Ok::<_, Infallible>(SseEvent::default().data(d))))
    });
    Ok(Sse::new(stream).into_response())
}

/// Adds a routed event to `choice`: a token, or the finish (then the usage is known, counting
/// `before` tokens sent in earlier chunks).
fn add(choice: &mut Choice, event: Generated, prompt_len: usize, before: usize) -> Option<Usage> {
    match event {
        Generated::Token {
            id,
            logprob,
            top,
            version,
        } => {
            let top_logprobs = (top.into_iter())
                .map(|(token_id, logprob)| TopLogprob { token_id, logprob })
                .collect();
            let logprob = TokenLogprob {
                token_id: id,
                logprob,
                top_logprobs,
            };
            choice.push_token(logprob, version);
            None
        }
        Generated::Finished {
            reason,
            routed_experts,
        } => {
            choice.finish_reason = Some(reason);
            choice.routed_experts = routed_experts;
            Some(Usage::new(prompt_len, before + choice.token_ids.len()))
        }
    }
}

/// A body a call to the engines carries.
#[derive(Debug, Clone)]
enum Body {
    None,
    Json(Value),
    Bytes(Bytes),
}

/// Sends the same call to every engine in `engines`; the answers in order, or an error naming
/// the engines that failed.
async fn fan_out(
    engines: &[Arc<Engine>],
    method: Method,
    path_and_query: &str,
    bodies: Vec<Body>,
) -> Result<Vec<Value>, ApiError> {
    if engines.is_empty() {
        return Err(ApiError::unavailable("no healthy engine"));
    }
    let calls = engines.iter().zip(bodies).map(|(e, body)| async {
        let url = format!("{}{}", e.url(), path_and_query);
        let req = router_http().request(method.clone(), &url);
        let req = match body {
            Body::None => req,
            Body::Json(body) => req.json(&body),
            Body::Bytes(bytes) => req.body(bytes),
        };
        let r = req.send().await.map_err(|err| format!("{url}: {err}"))?;
        let status = r.status();
        let text = r.text().await.unwrap_or_default();
        if !status.is_success() {
            return Err(format!("{url}: {status} {text}"));
        }
        Ok(serde_json::from_str(&text).unwrap_or(Value::String(text)))
    });
    let results = futures::future::join_all(calls).await;
    let errors: Vec<String> = results.iter().filter_map(|r| r.clone().err()).collect();
    if !errors.is_empty() {
        let (failed, all) = (errors.len(), engines.len());
        let message = format!("{failed} of {all} engines failed: {}", errors.join("; "));
        return Err(ApiError::new(StatusCode::BAD_GATEWAY, message));
    }
    Ok(results.into_iter().flatten().collect())
}

/// A run's new adapter, `<run>-v<N>` (docs/lora.md): `PUT /v1/adapters/{name}` (the adapter in
/// the body: an EnginePool's built-in engines) or vLLM's `POST /v1/load_lora_adapter` (a folder
/// the engines read), sent to every healthy engine. Once all hold it the run's requests name it,
/// and go only to engines that serve version `N`; version `N - 2` is unloaded (a run holds two
/// while it switches; requests still running with it finish first).
async fn new_adapter(
    State(router): State<Arc<Router>>,
    method: Method,
    uri: Uri,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    let engines = healthy(&router).await;
    let (name, body) = match uri.path().strip_prefix("/v1/adapters/") {
        Some(name) => (name.to_string(), Body::Bytes(body)),
        None => {
            let body: Value = parse(&body)?;
            let name = body["lora_name"].as_str().unwrap_or_default().to_string();
            (name, Body::Json(body))
        }
    };
    fan_out(&engines, method, uri.path(), vec![body; engines.len()]).await?;
    let (run, version) = crate::engine::pool::adapter_version(&name).unwrap_or_default();
    router.pool.updated(&engines, version);
    if let Some(old) = version.checked_sub(2) {
        unload(&engines, &format!("{run}-v{old}")).await;
    }
    *router.model.lock().expect("model lock") = Some(name);
    Ok(Json(json!({"status": "ok", "engines": engines.len()})))
}

/// Unloads the adapter `name` from `engines` (one already gone is no error).
async fn unload(engines: &[Arc<Engine>], name: &str) {
    let bodies = vec![Body::Json(json!({ "lora_name": name })); engines.len()];
    let _ = fan_out(engines, Method::POST, "/v1/unload_lora_adapter", bodies).await;
}

/// Unloads a LoRA run's adapters on an EnginePool or vLLM (its newest version and the one
/// before) as the run stops (docs/lora.md); nothing for any other run.
pub async fn unload_adapters(router: &Router) {
    let Some((run, version)) = router.adapter() else {
        return;
    };
    let engines = router.pool.healthy();
    for v in [Some(version), version.checked_sub(1)]
        .into_iter()
        .flatten()
    {
        unload(&engines, &format!("{run}-v{v}")).await;
    }
}

/// A control call sent unchanged to every healthy engine; answers with the first engine's reply.
async fn broadcast(
    State(router): State<Arc<Router>>,
    method: Method,
    uri: Uri,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    let engines = healthy(&router).await;
    let body: Option<Value> = (!body.is_empty()).then(|| parse(&body)).transpose()?;
    let path = uri.path_and_query().map_or(uri.path(), |p| p.as_str());
    // The version engines serve once the call succeeded: the NCCL/TCP transports finish with it,
    // vLLM's reload from a folder sets it with `update_weight_version`.
    let field = match uri.path() {
        "/finish_weight_update" => Some("weight_version"),
        "/update_weight_version" => Some("new_version"),
        _ => None,
    };
    let finished_version =
        field.and_then(|f| crate::engine::api::reported_version(&body.as_ref()?[f]));
    let bodies = vec![body.map_or(Body::None, Body::Json); engines.len()];
    let answers = fan_out(&engines, method, path, bodies).await?;
    // Engines have stopped generating once a pause answered (a `wait` pause answers when their
    // requests are done), and start again on resume.
    match uri.path() {
        "/pause" => router.pool.set_paused(true),
        "/resume" => router.pool.set_paused(false),
        _ => {}
    }
    if let Some(version) = finished_version {
        // These engines serve `version` now; others wait for the next update to be routed to.
        router.pool.updated(&engines, version);
    }
    Ok(Json(answers.into_iter().next().unwrap_or(Value::Null)))
}

fn router_http() -> reqwest::Client {
    static HTTP: std::sync::OnceLock<reqwest::Client> = std::sync::OnceLock::new();
    HTTP.get_or_init(crate::auth::engine_client).clone()
}

/// The healthy engines; while there are none, a control call waits for one as a generation
/// does (an engine too busy for its health checks for a while comes back).
async fn healthy(router: &Router) -> Vec<Arc<Engine>> {
    let some = || Some(router.pool.healthy()).filter(|e| !e.is_empty());
    router.wait_for(some, || false).await.unwrap_or_default()
}

/// `GET path` of every healthy engine: the engines and their answers, in order.
async fn get_all(router: &Router, path: &str) -> Result<(Vec<Arc<Engine>>, Vec<Value>), ApiError> {
    let engines = healthy(router).await;
    let answers = fan_out(&engines, Method::GET, path, vec![Body::None; engines.len()]).await?;
    Ok((engines, answers))
}

fn world_size(answer: &Value) -> u64 {
    answer["world_size"].as_u64().unwrap_or(1)
}

/// A `GET` of every healthy engine, the answers combined: `/is_paused` (all paused),
/// `/get_world_size` (the sum), `/weight_info` (each engine's).
async fn gather(State(router): State<Arc<Router>>, uri: Uri) -> Result<Json<Value>, ApiError> {
    let (engines, answers) = get_all(&router, uri.path()).await?;
    Ok(Json(match uri.path() {
        "/is_paused" => {
            let all = answers.iter().all(|a| a["is_paused"] == Value::Bool(true));
            json!({ "is_paused": all })
        }
        "/get_world_size" => json!({ "world_size": answers.iter().map(world_size).sum::<u64>() }),
        _ => {
            let per_engine = engines.iter().zip(answers);
            let per_engine = per_engine.map(|(e, a)| json!({"url": e.url(), "weight_info": a}));
            json!({ "engines": per_engine.collect::<Vec<_>>() })
        }
    }))
}

async fn init_weight_transfer(
    State(router): State<Arc<Router>>,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    let body: Value = parse(&body)?;
    let mut offset = body["init_info"]["rank_offset"].as_u64().unwrap_or(1);
    let (engines, sizes) = get_all(&router, "/get_world_size").await?;
    let bodies = sizes.iter().map(|size| {
        let mut b = body.clone();
        b["init_info"]["rank_offset"] = json!(offset);
        offset += world_size(size);
        Body::Json(b)
    });
    let path = "/init_weight_transfer_engine";
    fan_out(&engines, Method::POST, path, bodies.collect()).await?;
    Ok(Json(json!({"status": "ok", "engines": engines.len()})))
}

async fn abort(
    State(router): State<Arc<Router>>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    let req: AbortRequest = parse(&body)?;
    let ids = router.started_by(&req.request_ids, session(&headers).as_deref());
    if ids.is_empty() {
        return Ok(Json(json!({"status": "ok"})));
    }
    let engines = router.pool.healthy();
    let bodies = vec![Body::Json(json!({ "request_ids": ids })); engines.len()];
    // Aborting an id an engine does not know is fine; failures only mean the engine is gone.
    let path = "/inference/v1/abort_requests";
    let _ = fan_out(&engines, Method::POST, path, bodies).await;
    Ok(Json(json!({"status": "ok"})))
}

async fn health(State(router): State<Arc<Router>>) -> StatusCode {
    if router.pool.routable().is_empty() {
        StatusCode::SERVICE_UNAVAILABLE
    } else {
        StatusCode::OK
    }
}

async fn models(State(router): State<Arc<Router>>) -> Result<Json<Value>, ApiError> {
    let first: Vec<_> = router.pool.routable().into_iter().take(1).collect();
    let answers = fan_out(&first, Method::GET, "/v1/models", vec![Body::None]).await?;
    Ok(Json(answers.into_iter().next().unwrap_or(Value::Null)))
}

/// Prometheus metrics, read from the pool at scrape time.
async fn metrics(State(router): State<Arc<Router>>) -> String {
    let mut registry = prometheus_client::registry::Registry::default();
    register_metrics(&router, &mut registry);
    crate::serve::metrics_text(&registry)
}

/// The router's metrics (engines, health, load, failovers), added to `registry`.
pub fn register_metrics(router: &Router, registry: &mut prometheus_client::registry::Registry) {
    use prometheus_client::metrics::counter::Counter;
    use prometheus_client::metrics::family::Family;
    use prometheus_client::metrics::gauge::Gauge;
    let engines = router.pool.all();
    let healthy = engines.iter().filter(|e| e.healthy()).count();
    for (name, help, n) in [
        ("moult_router_engines", "Engines in the pool", engines.len()),
        ("moult_router_engines_healthy", "Engines up", healthy),
        (
            "moult_router_engines_routable",
            "Engines up and serving the current weights",
            router.pool.routable().len(),
        ),
    ] {
        let gauge: Gauge = Gauge::default();
        gauge.set(n as i64);
        registry.register(name, help, gauge);
    }
    let failovers: Counter = Counter::default();
    failovers.inc_by(router.failovers());
    let help = "Requests continued on another engine";
    registry.register("moult_router_failovers", help, failovers);
    let running = Family::<[(&'static str, String); 1], Gauge>::default();
    for e in &engines {
        let engine = [("engine", e.url().to_string())];
        running.get_or_create(&engine).set(e.requests() as i64);
    }
    let help = "Requests in flight per engine";
    registry.register("moult_router_requests_running", help, running);
    let activity = router.pool.activity();
    for (name, help, seconds) in [
        (
            "moult_router_engine_busy_seconds",
            "Seconds engines had requests in flight while not paused, summed over engines",
            activity.busy_seconds,
        ),
        (
            "moult_router_engine_paused_seconds",
            "Seconds the engines were paused for weight sync",
            activity.paused_seconds,
        ),
    ] {
        let counter: Counter<f64, std::sync::atomic::AtomicU64> = Counter::default();
        counter.inc_by(seconds);
        registry.register(name, help, counter);
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct EngineUrl {
    url: String,
}

async fn list_engines(State(router): State<Arc<Router>>) -> Json<Value> {
    Json(json!({ "engines": router.pool.status(), "activity": router.pool.activity() }))
}

async fn add_engine(
    State(router): State<Arc<Router>>,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    let EngineUrl { url } = parse(&body)?;
    if !(url.starts_with("http://") || url.starts_with("https://")) {
        let message = format!("url must start with http:// or https://, got `{url}`");
        return Err(ApiError::bad_request(message).with_param("url"));
    }
    Ok(Json(json!({ "added": router.pool.add(&url) })))
}

async fn remove_engine(
    State(router): State<Arc<Router>>,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    let EngineUrl { url } = parse(&body)?;
    if !router.pool.remove(&url) {
        let message = format!("no engine {url}");
        return Err(ApiError::new(StatusCode::NOT_FOUND, message));
    }
    Ok(Json(json!({ "removed": true })))
}

/// The router's routes.
pub fn routes(router: Arc<Router>) -> axum::Router {
    let own = axum::Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics));
    api_routes(router.clone()).merge(own.with_state(router))
}

/// The router's routes but `/health` (which says whether any engine is routable) and `/metrics`:
/// for a server that is healthy by other rules and has metrics of its own, such as the coordinator
/// of a cluster run.
pub fn api_routes(router: Arc<Router>) -> axum::Router {
    axum::Router::new()
        .route(
            "/inference/v1/generate",
            post(generate).layer(DefaultBodyLimit::max(GENERATE_BODY_LIMIT)),
        )
        .route("/inference/v1/abort_requests", post(abort))
        .route("/pause", post(broadcast))
        .route("/resume", post(broadcast))
        .route("/start_weight_update", post(broadcast))
        .route("/update_weights", post(broadcast))
        .route("/finish_weight_update", post(broadcast))
        // vLLM's update from a folder: `reload_weights` through collective_rpc, then the version.
        .route("/collective_rpc", post(broadcast))
        .route("/update_weight_version", post(broadcast))
        .route("/init_weight_transfer_engine", post(init_weight_transfer))
        .route("/is_paused", get(gather))
        .route("/get_world_size", get(gather))
        .route("/weight_info", get(gather))
        .route("/v1/models", get(models))
        .route(
            "/v1/adapters/{name}",
            put(new_adapter).layer(DefaultBodyLimit::max(ADAPTER_BODY_LIMIT)),
        )
        .route("/v1/load_lora_adapter", post(new_adapter))
        .route(
            "/engines",
            get(list_engines).post(add_engine).delete(remove_engine),
        )
        .with_state(router)
}

/// Serves the router on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: tokio::net::TcpListener,
    router: Arc<Router>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    crate::serve::serve(listener, crate::auth::protect(routes(router)), shutdown).await
}
