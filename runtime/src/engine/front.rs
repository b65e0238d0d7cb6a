//! The token-checking front of an engine that checks nothing itself: a vLLM server in its pod
//! (docs/security.md, "Engines answer only their run"). vLLM listens on the pod's loopback; the
//! front listens on the pod's address and passes every request through unchanged, streams
//! included, once it carries the run token (`GET /health` and `GET /metrics` pass without it, for
//! kubelet probes and Prometheus). The token itself is not passed on.

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::Response;

use crate::serve::ApiError;

/// Headers of one hop only, which a proxy does not pass on (RFC 9110 7.6.1), and the token.
const NOT_PASSED: [header::HeaderName; 7] = [
    header::CONNECTION,
    header::HOST,
    header::TRANSFER_ENCODING,
    header::TE,
    header::TRAILER,
    header::UPGRADE,
    header::AUTHORIZATION,
];

fn passed(headers: &HeaderMap) -> HeaderMap {
    let mut headers = headers.clone();
    for name in &NOT_PASSED {
        headers.remove(name);
    }
    headers
}

#[derive(Debug, Clone)]
struct Upstream {
    /// `http://127.0.0.1:PORT`, without a trailing `/`.
    base: String,
    http: reqwest::Client,
}

async fn forward(State(up): State<Upstream>, request: Request) -> Result<Response, ApiError> {
    let (parts, body) = request.into_parts();
    let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    let answer = (up.http)
        .request(parts.method, format!("{}{path}", up.base))
        .headers(passed(&parts.headers))
        .body(reqwest::Body::wrap_stream(body.into_data_stream()))
        .send()
        .await
        .map_err(|e| {
            let message = format!("the engine behind this front did not answer: {e}");
            ApiError::new(StatusCode::BAD_GATEWAY, message)
        })?;
    let mut response = Response::builder().status(answer.status());
    if let Some(headers) = response.headers_mut() {
        *headers = passed(answer.headers());
    }
    (response.body(axum::body::Body::from_stream(answer.bytes_stream())))
        .map_err(|e| ApiError::new(StatusCode::BAD_GATEWAY, e.to_string()))
}

/// Why a front does not start.
#[derive(Debug, thiserror::Error)]
pub enum FrontError {
    #[error("--upstream must be a URL starting with http://; got `{0}`")]
    Upstream(String),
    #[error(
        "moult engine-front checks the run token, and {} is not set: it would let anyone \
         through (docs/security.md)",
        crate::auth::TOKEN_ENV
    )]
    NoToken,
}

/// Every route of the engine at `upstream` (an `http://` URL), behind the run-token check,
/// which this process must have.
pub fn routes(upstream: &str) -> Result<axum::Router, FrontError> {
    if !upstream.starts_with("http://") {
        return Err(FrontError::Upstream(upstream.to_string()));
    }
    crate::auth::token().ok_or(FrontError::NoToken)?;
    let up = Upstream {
        base: upstream.trim_end_matches('/').to_string(),
        // No proxy from the environment: the engine is on this pod's loopback. No overall
        // timeout: generations and weight updates are bounded by their callers.
        http: reqwest::Client::builder()
            .no_proxy()
            .connect_timeout(std::time::Duration::from_secs(10))
            .build()
            .expect("an HTTP client with default settings builds"),
    };
    Ok(crate::auth::protect(
        axum::Router::new().fallback(forward).with_state(up),
    ))
}
