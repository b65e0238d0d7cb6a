//! The per-run token of a cluster run (docs/operator.md: internal endpoints need it).
//!
//! The operator puts a random token in a Secret and every pod of the run gets it as
//! `MOULT_TOKEN`. When it is set, every HTTP server of the process (engine, router, coordinator,
//! the trainer's and agents' metrics) refuses requests without `Authorization: Bearer <token>`
//! (401), except `GET /health` and `GET /metrics`, which kubelet probes and Prometheus call
//! without credentials; and every HTTP client of the process sends it. The weight stream's TCP
//! handshake carries it too ([`crate::engine::weights`]). Without `MOULT_TOKEN` (a local run on
//! loopback) nothing is checked.

use std::sync::OnceLock;

use axum::extract::Request;
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::engine::ApiError;

/// The environment variable that holds the token.
pub const TOKEN_ENV: &str = "MOULT_TOKEN";

/// The run's token, if this process has one (read once).
pub fn token() -> Option<&'static str> {
    static TOKEN: OnceLock<Option<String>> = OnceLock::new();
    TOKEN
        .get_or_init(|| {
            std::env::var(TOKEN_ENV)
                .ok()
                .map(|t| t.trim().to_string())
                .filter(|t| !t.is_empty())
        })
        .as_deref()
}

/// An HTTP client that sends the run's token with every request (when there is one).
pub fn client_builder() -> reqwest::ClientBuilder {
    let builder = reqwest::Client::builder();
    match token().and_then(|t| HeaderValue::from_str(&format!("Bearer {t}")).ok()) {
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
    client_builder()
        .build()
        .expect("an HTTP client with default settings builds")
}

/// Paths anyone may call: probes and metrics scrapes.
fn open(path: &str) -> bool {
    matches!(path, "/health" | "/metrics")
}

/// Whether `header` (an `Authorization` value) carries `token`, compared in constant time.
fn authorized(header: Option<&HeaderValue>, token: &str) -> bool {
    let Some(given) = header
        .and_then(|h| h.to_str().ok())
        .and_then(|h| h.strip_prefix("Bearer "))
    else {
        return false;
    };
    let (a, b) = (given.trim().as_bytes(), token.as_bytes());
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn check(request: Request, next: Next) -> Response {
    match token() {
        Some(t)
            if !open(request.uri().path())
                && !authorized(request.headers().get(header::AUTHORIZATION), t) =>
        {
            let mut response = ApiError::new(
                StatusCode::UNAUTHORIZED,
                format!("this endpoint needs the run's token: send `Authorization: Bearer ${TOKEN_ENV}`"),
            )
            .into_response();
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            response
        }
        _ => next.run(request).await,
    }
}

/// `routes` with the token check in front (a no-op without a token).
pub fn protect(routes: axum::Router) -> axum::Router {
    routes.layer(axum::middleware::from_fn(check))
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
}
