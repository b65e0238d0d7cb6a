//! The operator's Prometheus metrics and its `/metrics`, `/healthz` and `/readyz` endpoints.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use axum::Router;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WriteLabels {
    /// apply, delete or status.
    pub verb: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabels {
    /// ok or error.
    pub result: String,
}

/// Every metric the operator exports.
pub struct Metrics {
    pub registry: Registry,
    pub reconciles: Family<ResultLabels, Counter>,
    /// API writes (applies, deletes, status patches) the reconciler made.
    pub writes: Family<WriteLabels, Counter>,
    pub reconcile_seconds: Histogram,
    /// 1 while this replica holds the lease (or runs without leader election).
    pub leader: Gauge,
    /// Set once the controller runs; `/readyz` answers 200 from then on.
    pub ready: AtomicBool,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("moult_operator");
        let reconciles = Family::<ResultLabels, Counter>::default();
        let writes = Family::<WriteLabels, Counter>::default();
        let reconcile_seconds = Histogram::new(exponential_buckets(0.001, 2.0, 16));
        let leader = Gauge::default();
        registry.register("reconciles", "Reconciles by result", reconciles.clone());
        registry.register(
            "writes",
            "API writes made by reconciles, by verb",
            writes.clone(),
        );
        registry.register(
            "reconcile_duration_seconds",
            "Time one reconcile takes",
            reconcile_seconds.clone(),
        );
        registry.register(
            "leader",
            "1 while this replica is the leader",
            leader.clone(),
        );
        Metrics {
            registry,
            reconciles,
            writes,
            reconcile_seconds,
            leader,
            ready: AtomicBool::new(false),
        }
    }
}

impl Metrics {
    pub fn write(&self, verb: &str, n: usize) {
        self.writes
            .get_or_create(&WriteLabels { verb: verb.into() })
            .inc_by(n as u64);
    }

    pub fn encode(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)
            .expect("writing to a String cannot fail");
        out
    }
}

/// Serves the endpoints on `listener` until the process ends.
pub async fn serve(
    listener: tokio::net::TcpListener,
    metrics: Arc<Metrics>,
) -> std::io::Result<()> {
    let app = Router::new()
        .route(
            "/metrics",
            get(|State(m): State<Arc<Metrics>>| async move { m.encode() }),
        )
        .route("/healthz", get(|| async { "ok" }))
        .route(
            "/readyz",
            get(|State(m): State<Arc<Metrics>>| async move {
                if m.ready.load(Ordering::Relaxed) {
                    (StatusCode::OK, "ok")
                } else {
                    (StatusCode::SERVICE_UNAVAILABLE, "waiting for the lease")
                }
            }),
        )
        .with_state(metrics);
    axum::serve(listener, app).await
}

/// Binds the metrics address (port 0 picks a free one; the bound address is logged).
pub async fn bind(addr: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    tracing::info!(addr = %listener.local_addr()?, "serving /metrics, /healthz and /readyz");
    Ok(listener)
}
