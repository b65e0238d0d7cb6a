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
use crate::engine::api::TokenLogprob;
use crate::engine::client::{ContentPart, EngineError, Generated};
use crate::engine::ApiError;

/// What the router emits for a generation: tokens, numbered from the first generated one.
#[derive(Debug, Clone, PartialEq)]
pub enum Routed {
    Token {
        index: usize,
        logprob: TokenLogprob,
        version: u64,
    },
    Finished {
        reason: String,
        routed_experts: Option<String>,
        completion_tokens: usize,
    },
}

/// One generation's request, as the client sent it.
#[derive(Debug, Clone)]
pub struct RoutedRequest {
    pub request_id: String,
    pub prompt: Vec<i64>,
    /// The prompt's images; a continuation on another engine sends them again.
    pub content_parts: Vec<ContentPart>,
    /// `sampling_params`, forwarded as given (the engine validates them).
    pub params: Map<String, Json>,
    pub session: Option<String>,
}

/// Events buffered between an engine stream and a slow client.
const ROUTED_BUFFER: usize = 64;

/// How long a request waits while every engine refuses it for now (503/429) before it fails.
const BUSY_PATIENCE: Duration = Duration::from_secs(120);
/// How often a request waiting for a healthy engine looks again.
const ENGINE_POLL: Duration = Duration::from_millis(250);

/// Runs `req` with failover; events arrive on the receiver. Dropping the receiver stops the
/// engine request.
pub fn start(router: Arc<Router>, req: RoutedRequest) -> mpsc::Receiver<Result<Routed, ApiError>> {
    let (tx, rx) = mpsc::channel(ROUTED_BUFFER);
    tokio::spawn(async move {
        if let Err(e) = run(&router, req, &tx).await {
            let _ = tx.send(Err(e)).await;
        }
    });
    rx
}

/// The engine for `route`; when none is healthy, polls for one for up to the router's
/// engine patience (engines still loading, or all restarting), so that such a gap delays the
/// request instead of failing it. None when the patience ran out or the client went away.
async fn pick_patiently(
    router: &Router,
    route: &RouteRequest<'_>,
    failed: &[String],
    tx: &mpsc::Sender<Result<Routed, ApiError>>,
) -> Option<Arc<super::Engine>> {
    let since = Instant::now();
    loop {
        if let Some(engine) = router.pick(route, failed) {
            return Some(engine);
        }
        if since.elapsed() >= router.engine_patience || tx.is_closed() {
            return None;
        }
        tokio::time::sleep(ENGINE_POLL).await;
    }
}

async fn run(
    router: &Router,
    req: RoutedRequest,
    tx: &mpsc::Sender<Result<Routed, ApiError>>,
) -> Result<(), ApiError> {
    let max_tokens = req.params.get("max_tokens").and_then(Json::as_i64);
    let min_tokens = req.params.get("min_tokens").and_then(Json::as_i64);
    let mut generated: Vec<i64> = Vec::new();
    let mut failed: Vec<String> = Vec::new();
    let mut busy_since: Option<Instant> = None;
    let mut backoff = Duration::from_millis(20);
    loop {
        let tokens = (req.prompt.len() + max_tokens.unwrap_or(0).max(0) as usize) as u64;
        let route = RouteRequest {
            session: req.session.as_deref(),
            tokens,
        };
        let Some(engine) = pick_patiently(router, &route, &failed, tx).await else {
            return Err(ApiError::unavailable(if failed.is_empty() {
                "no healthy engine".to_string()
            } else {
                format!(
                    "no healthy engine left to continue the request (failed: {})",
                    failed.join(", ")
                )
            }));
        };
        let _load = engine.track(tokens);
        let mut params = req.params.clone();
        let mut prompt = req.prompt.clone();
        if !generated.is_empty() {
            router.failovers.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(request = %req.request_id, engine = %engine.url(), generated = generated.len(), "continuing on another engine");
            prompt.extend_from_slice(&generated);
            if let Some(m) = max_tokens {
                let left = m - generated.len() as i64;
                if left <= 0 {
                    let _ = tx
                        .send(Ok(Routed::Finished {
                            reason: "length".into(),
                            routed_experts: None,
                            completion_tokens: generated.len(),
                        }))
                        .await;
                    return Ok(());
                }
                params.insert("max_tokens".into(), Json::from(left));
            }
            if let Some(m) = min_tokens {
                params.insert(
                    "min_tokens".into(),
                    Json::from((m - generated.len() as i64).max(0)),
                );
            }
        }
        let stream = engine
            .client
            .generate(
                req.request_id.clone(),
                &prompt,
                &req.content_parts,
                &params,
                req.session.as_deref(),
            )
            .await;
        let mut stream = match stream {
            Ok(s) => s,
            Err(EngineError::Refused { status, message }) if status < 500 => {
                return Err(ApiError::new(
                    StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_REQUEST),
                    message,
                ));
            }
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
                Some(Ok(Generated::Token {
                    id,
                    logprob,
                    top,
                    version,
                })) => {
                    let index = generated.len();
                    generated.push(id);
                    let logprob = TokenLogprob {
                        token_id: id,
                        logprob,
                        top_logprobs: top
                            .into_iter()
                            .map(|(token_id, logprob)| crate::engine::api::TopLogprob {
                                token_id,
                                logprob,
                            })
                            .collect(),
                    };
                    let event = Routed::Token {
                        index,
                        logprob,
                        version,
                    };
                    if tx.send(Ok(event)).await.is_err() {
                        // The client went away; dropping the stream aborts the engine request.
                        return Ok(());
                    }
                }
                Some(Ok(Generated::Finished {
                    reason,
                    routed_experts,
                })) => {
                    let _ = tx
                        .send(Ok(Routed::Finished {
                            reason,
                            routed_experts,
                            completion_tokens: generated.len(),
                        }))
                        .await;
                    return Ok(());
                }
                Some(Err(EngineError::Refused { status, message })) => {
                    return Err(ApiError::new(
                        StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY),
                        message,
                    ));
                }
                ended => {
                    match ended {
                        Some(Err(e)) => {
                            tracing::warn!(engine = %engine.url(), error = %e, "engine died mid-generation");
                        }
                        _ => {
                            tracing::warn!(engine = %engine.url(), "engine stream ended unfinished")
                        }
                    }
                    engine.mark_down();
                    failed.push(engine.url().to_string());
                    break;
                }
            }
        }
    }
}
