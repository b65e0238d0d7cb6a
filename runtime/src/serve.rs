//! How every HTTP server of the runtime serves its connections (docs/security.md): HTTP/1.1
//! with a header-read timeout, so a client that opens a connection and never finishes its
//! request headers is disconnected instead of holding the connection (and its task) forever.
//! `axum::serve` sets no timer, which leaves hyper's timeout off. Shutdown is graceful: the
//! listener closes, and running requests (streams included) finish. Refusals are answered in one
//! shape, vLLM's ([`ApiError`]), by the engine, the router, the coordinator and the credential
//! check in front of each of them.

use std::future::Future;
use std::time::Duration;

use axum::body::Body;
use axum::extract::Request;
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use serde_json::json;
use tower::ServiceExt;

/// How long a client has to send a request's headers.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(30);

/// How long a server that stops lets its running requests finish (a generation waiting for an
/// engine that is gone would hold it for as long as its patience).
pub const DRAIN_FOR: Duration = Duration::from_secs(10);

/// Serves `app` on `listener` until `shutdown` resolves, then lets running requests finish for
/// up to [`DRAIN_FOR`].
pub async fn serve(
    listener: tokio::net::TcpListener,
    app: axum::Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    serve_with(listener, app, shutdown, HEADER_READ_TIMEOUT).await
}

/// [`serve`] with another header-read timeout (tests).
pub async fn serve_with(
    listener: tokio::net::TcpListener,
    app: axum::Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
    header_read_timeout: Duration,
) -> std::io::Result<()> {
    let graceful = GracefulShutdown::new();
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(Some(header_read_timeout));
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let stream = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of file descriptors and the like: wait, as axum::serve does.
                    tracing::warn!(error = %e, "accepting a connection");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        let service = app
            .clone()
            .map_request(|req: Request<Incoming>| req.map(Body::new));
        let connection =
            builder.serve_connection(TokioIo::new(stream), TowerToHyperService::new(service));
        let connection = graceful.watch(connection);
        tokio::spawn(async move {
            // A client that goes away or sends garbage ends its connection; nothing to report.
            let _ = connection.await;
        });
    }
    drop(listener);
    let drained = tokio::time::timeout(DRAIN_FOR, graceful.shutdown()).await;
    if drained.is_err() {
        tracing::warn!("requests still running {DRAIN_FOR:?} after the stop: closed");
    }
    Ok(())
}

/// An error answered to an API client, in vLLM's JSON error shape:
/// `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{message} ({status})")]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub param: Option<String>,
}

impl ApiError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            param: None,
        }
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }

    /// A retryable refusal (paused engine, full queue): 503 with `Retry-After`.
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, message)
    }

    pub fn with_param(mut self, param: &str) -> Self {
        self.param = Some(param.into());
        self
    }

    fn kind(&self) -> &'static str {
        match self.status {
            StatusCode::BAD_REQUEST | StatusCode::UNPROCESSABLE_ENTITY => "BadRequestError",
            StatusCode::UNAUTHORIZED => "AuthenticationError",
            StatusCode::NOT_FOUND => "NotFoundError",
            StatusCode::CONFLICT => "ConflictError",
            StatusCode::TOO_MANY_REQUESTS => "RateLimitError",
            StatusCode::SERVICE_UNAVAILABLE => "ServiceUnavailableError",
            StatusCode::NOT_IMPLEMENTED => "NotImplementedError",
            _ => "InternalServerError",
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({
            "error": {
                "message": self.message,
                "type": self.kind(),
                "param": self.param,
                "code": self.status.as_u16(),
            }
        });
        let mut response = (self.status, axum::Json(body)).into_response();
        if matches!(
            self.status,
            StatusCode::SERVICE_UNAVAILABLE | StatusCode::TOO_MANY_REQUESTS
        ) {
            response
                .headers_mut()
                .insert("retry-after", HeaderValue::from_static("1"));
        }
        response
    }
}

/// `registry` as Prometheus text: what each server's `GET /metrics` answers.
pub fn metrics_text(registry: &prometheus_client::registry::Registry) -> String {
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, registry)
        .expect("writing to a String cannot fail");
    text
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    #[tokio::test]
    async fn a_client_that_never_finishes_its_headers_is_disconnected() {
        let app = axum::Router::new().route("/health", axum::routing::get(|| async { "ok" }));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(serve_with(
            listener,
            app,
            async {
                let _ = stopped.await;
            },
            Duration::from_millis(500),
        ));

        // A whole request is answered.
        let mut ok = tokio::net::TcpStream::connect(addr).await.unwrap();
        ok.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut answer = String::new();
        ok.read_to_string(&mut answer).await.unwrap();
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");

        // Headers that never end: the server hangs up (after its timeout, well before ours).
        let mut slow = tokio::net::TcpStream::connect(addr).await.unwrap();
        slow.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n")
            .await
            .unwrap();
        let started = Instant::now();
        let mut rest = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(20), slow.read_to_end(&mut rest)).await;
        assert!(
            read.is_ok(),
            "the slow client was still connected after 20 s"
        );
        assert!(started.elapsed() >= Duration::from_millis(400));
        assert!(!String::from_utf8_lossy(&rest).contains("200 OK"));

        // Shutdown ends the server.
        stop.send(()).unwrap();
        tokio::time::timeout(Duration::from_secs(20), server)
            .await
            .expect("the server stops")
            .unwrap()
            .unwrap();
    }
}
