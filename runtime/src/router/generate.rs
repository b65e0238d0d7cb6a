//! Generation through the router, with failover.
//!
//! A request runs on the engine the policy picks. If that engine cannot be reached, or its
//! stream breaks before the request finished (the engine died), the engine is marked down and the
//! request continues on another healthy engine from the original prompt plus every token
//! generated so far, with `max_tokens` and `min_tokens` reduced by what is already there. The
//! client sees one uninterrupted generation whose tokens each carry the logprob and weight
//! version of the engine that sampled them (docs/architecture.md#the-three-invariants: nothing is lost, duplicated or re-sampled
//! without record). Routed experts come from the engine that finished the request, which
//! recomputes the routing of every earlier position. An engine that refuses for now (503 while
//! paused in `wait` mode, 429 when full) is asked again after a backoff; an engine's own refusal
//! of the request (a 4xx: bad input) is the client's answer; a client that goes away stops the
//! engine request.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use futures::StreamExt;
use serde_json::{Map, Value as Json};
use tokio::sync::mpsc;

use super::{RouteRequest, Router};
use crate::engine::client::{ContentPart, EngineError, Generated};
use crate::engine::pool::adapter_version;
use crate::engine::ApiError;

/// One generation's request, as the client sent it.
#[derive(Debug, Clone)]
pub struct RoutedRequest {
    /// The id the client gave (or the router made): what the client's answers carry and what
    /// its aborts name. The engines know the request by an id of the router's own.
    pub request_id: String,
    pub prompt: Vec<i64>,
    /// The prompt's images; a continuation on another engine sends them again.
    pub content_parts: Vec<ContentPart>,
    /// `sampling_params`, forwarded as given (the engine validates them).
    pub params: Map<String, Json>,
    pub session: Option<String>,
}

/// What the router emits for a generation: the engines' tokens as they sampled them, then the
/// finish (of the engine that finished it), or an error.
pub type Events = mpsc::Receiver<Result<Generated, ApiError>>;
type EventSender = mpsc::Sender<Result<Generated, ApiError>>;

/// Events buffered between an engine stream and a slow client.
const ROUTED_BUFFER: usize = 64;

/// How long a request waits while every engine refuses it for now (503/429) before it fails.
const BUSY_PATIENCE: Duration = Duration::from_secs(120);

/// Runs `req` with failover; events arrive on the receiver. Dropping the receiver stops the
/// engine request.
pub fn start(router: Arc<Router>, req: RoutedRequest) -> Events {
    let (tx, rx) = mpsc::channel(ROUTED_BUFFER);
    let engine_id = Router::request_id();
    let holder = (req.request_id.clone(), req.session.clone());
    (router.running.lock().expect("running lock")).insert(engine_id.clone(), holder);
    tokio::spawn(async move {
        if let Err(e) = run(&router, &engine_id, req, &tx).await {
            let _ = tx.send(Err(e)).await;
        }
        (router.running.lock().expect("running lock")).remove(&engine_id);
    });
    rx
}

/// An engine's refusal as the client's answer, with the engine's status (`fallback` when that
/// is no HTTP status).
fn refused(status: u16, message: String, fallback: StatusCode) -> ApiError {
    ApiError::new(StatusCode::from_u16(status).unwrap_or(fallback), message)
}

async fn run(
    router: &Router,
    engine_id: &str,
    req: RoutedRequest,
    tx: &EventSender,
) -> Result<(), ApiError> {
    let param = |name: &str| req.params.get(name).and_then(Json::as_i64);
    let (max_tokens, min_tokens) = (param("max_tokens"), param("min_tokens"));
    let route = RouteRequest {
        session: req.session.as_deref(),
        tokens: (req.prompt.len() + max_tokens.unwrap_or(0).max(0) as usize) as u64,
    };
    let mut generated: Vec<i64> = Vec::new();
    let mut failed: Vec<String> = Vec::new();
    let mut busy_since: Option<Instant> = None;
    let mut backoff = Duration::from_millis(20);
    // A request runs to its end with the adapter it started with (a LoRA run on an EnginePool
    // or on vLLM), whose version `<run>-v<N>` its tokens carry: vLLM knows only its own.
    let model = router.model.lock().expect("model lock").clone();
    let adapter = model.as_deref().and_then(adapter_version);
    let adapter_version = adapter.map(|(_, version)| version);
    loop {
        let done = generated.len() as i64;
        if done > 0 && max_tokens.is_some_and(|m| done >= m) {
            // The engine died after its last token but before its finish: nothing is left to
            // generate, whether another engine is up or not.
            let finished = Generated::Finished {
                reason: "length".into(),
                routed_experts: None,
            };
            let _ = tx.send(Ok(finished)).await;
            return Ok(());
        }
        // None healthy: the request waits for one (`Router::wait_for`).
        let engine = router.wait_for(|| router.pick(&route, &failed), || tx.is_closed());
        let Some(engine) = engine.await else {
            let failed = failed.join(", ");
            let message = match failed.as_str() {
                "" => "no healthy engine".to_string(),
                _ => format!("no healthy engine left to continue the request (failed: {failed})"),
            };
            return Err(ApiError::unavailable(message));
        };
        let _load = engine.track(route.tokens);
        let mut params = req.params.clone();
        let mut prompt = req.prompt.clone();
        if done > 0 {
            router.failovers.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(request = %req.request_id, engine = %engine.url(), generated = done, "continuing on another engine");
            prompt.extend_from_slice(&generated);
            for (name, limit) in [("max_tokens", max_tokens), ("min_tokens", min_tokens)] {
                if let Some(m) = limit {
                    params.insert(name.into(), Json::from((m - done).max(0)));
                }
            }
        }
        let (client, parts, session) = (&engine.client, &req.content_parts, req.session.as_deref());
        let (id, model) = (engine_id.to_string(), model.as_deref());
        let stream = client.generate_with(id, &prompt, parts, &params, session, model);
        let mut stream = match stream.await {
            Ok(s) => s,
            Err(EngineError::Refused { status, message }) if status == 503 || status == 429 => {
                // Refusing for now (paused in `wait` or `abort` mode, queue full): wait and ask
                // again, as Retry-After says; a weight sync ends such pauses within seconds.
                if busy_since.get_or_insert_with(Instant::now).elapsed() > BUSY_PATIENCE {
                    return Err(ApiError::unavailable(format!(
                        "every engine refused for {BUSY_PATIENCE:?}: {message}"
                    )));
                }
                drop(_load);
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(1));
                continue;
            }
            Err(EngineError::Refused { status, message }) if status < 500 => {
                return Err(refused(status, message, StatusCode::BAD_REQUEST));
            }
            Err(e) => {
                // Unreachable, or failing: take it out for this request and try the next one.
                tracing::warn!(engine = %engine.url(), error = %e, "engine failed a request");
                if matches!(e, EngineError::Unreachable { .. }) {
                    engine.mark_down();
                }
                failed.push(engine.url().to_string());
                continue;
            }
        };
        loop {
            match stream.next().await {
                Some(Ok(mut token @ Generated::Token { id, .. })) => {
                    if let Generated::Token { version, .. } = &mut token {
                        *version = adapter_version.unwrap_or(*version);
                    }
                    generated.push(id);
                    if tx.send(Ok(token)).await.is_err() {
                        // The client went away; dropping the stream aborts the engine request.
                        return Ok(());
                    }
                }
                Some(Ok(finished)) => {
                    let _ = tx.send(Ok(finished)).await;
                    return Ok(());
                }
                Some(Err(EngineError::Refused { status, message })) => {
                    return Err(refused(status, message, StatusCode::BAD_GATEWAY));
                }
                Some(Err(e)) => {
                    tracing::warn!(engine = %engine.url(), error = %e, "engine died mid-generation");
                    break;
                }
                None => {
                    tracing::warn!(engine = %engine.url(), "engine stream ended unfinished");
                    break;
                }
            }
        }
        engine.mark_down();
        failed.push(engine.url().to_string());
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;

    use axum::response::IntoResponse;

    use super::*;
    use crate::router::{EnginePool, LeastOutstandingTokens};

    /// Two tokens (5 and 6, version 0) in one chunk; then the finish when `finishes`, else the
    /// stream closes as a dying engine's does.
    const TOKENS: &str = r#"data: {"request_id":"r","choices":[{"token_ids":[5,6],"logprobs":{"content":[{"token_id":5,"logprob":-1.0},{"token_id":6,"logprob":-2.0}]},"finish_reason":null,"weight_versions":[{"version":0,"start":0,"end":2}]}]}"#;
    const FINISH: &str = r#"data: {"request_id":"r","choices":[{"token_ids":[],"logprobs":{"content":[]},"finish_reason":"stop","weight_versions":[]}]}"#;

    /// An engine that refuses its first `busy` generations with 429 (queue full), then streams
    /// [`TOKENS`] (and [`FINISH`] when `finishes`); a router with it as its only engine.
    async fn router_over_fake_engine(busy: usize, finishes: bool) -> Arc<Router> {
        let calls = Arc::new(AtomicUsize::new(0));
        let generate = move || async move {
            if calls.fetch_add(1, Ordering::Relaxed) < busy {
                let refusal = r#"{"error":{"message":"the queue is full","code":429}}"#;
                return (StatusCode::TOO_MANY_REQUESTS, refusal).into_response();
            }
            let finish = if finishes { FINISH } else { "" };
            format!("{TOKENS}\n\n{finish}\n\n").into_response()
        };
        let app =
            axum::Router::new().route("/inference/v1/generate", axum::routing::post(generate));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await });
        let pool = Arc::new(EnginePool::new(&[url]));
        Arc::new(Router::new(pool, Box::new(LeastOutstandingTokens)))
    }

    async fn events(router: Arc<Router>, max_tokens: i64) -> Vec<Result<Generated, ApiError>> {
        let mut params = Map::new();
        params.insert("max_tokens".into(), Json::from(max_tokens));
        let req = RoutedRequest {
            request_id: "r".into(),
            prompt: vec![1, 2, 3],
            content_parts: Vec::new(),
            params,
            session: None,
        };
        let mut rx = start(router, req);
        let mut out = Vec::new();
        while let Some(event) = rx.recv().await {
            out.push(event);
        }
        out
    }

    fn ids_and_finish(events: &[Result<Generated, ApiError>]) -> (Vec<i64>, Option<&str>) {
        let mut ids = Vec::new();
        let mut finish = None;
        for event in events {
            match event {
                Ok(Generated::Token { id, .. }) => ids.push(*id),
                Ok(Generated::Finished { reason, .. }) => finish = Some(reason.as_str()),
                Err(e) => panic!("the request failed: {e}"),
            }
        }
        (ids, finish)
    }

    #[tokio::test]
    async fn an_engine_whose_queue_is_full_is_asked_again() {
        let router = router_over_fake_engine(2, true).await;
        let events = events(router, 2).await;
        assert_eq!(ids_and_finish(&events), (vec![5, 6], Some("stop")));
    }

    #[tokio::test]
    async fn an_engine_that_dies_after_its_last_token_finishes_the_request() {
        let router = router_over_fake_engine(0, false).await;
        let events = events(router.clone(), 2).await;
        assert_eq!(ids_and_finish(&events), (vec![5, 6], Some("length")));
        assert_eq!(
            router.failovers(),
            0,
            "nothing was left to continue elsewhere"
        );
    }
}
