//! Prometheus metrics under vLLM's names, so dashboards and autoscalers built for vLLM read the
//! built-in engine unchanged.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;

use super::api::FinishReason;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct FinishedLabels {
    finished_reason: String,
}

/// The engine's metrics; clones share the same values.
#[derive(Debug, Clone, Default)]
pub(crate) struct EngineMetrics {
    pub running: Gauge,
    pub waiting: Gauge,
    kv_usage: Gauge<f64, AtomicU64>,
    pub prompt_tokens: Counter,
    pub generation_tokens: Counter,
    request_success: Family<FinishedLabels, Counter>,
}

impl EngineMetrics {
    pub fn set_kv_usage(&self, fraction: f64) {
        self.kv_usage.set(fraction);
    }

    pub fn finished(&self, reason: FinishReason) {
        self.request_success
            .get_or_create(&FinishedLabels {
                finished_reason: reason.as_str().to_string(),
            })
            .inc();
    }

    /// A registry holding these metrics, for the `/metrics` endpoint.
    pub fn registry(&self, model_name: &str) -> Registry {
        let mut registry = Registry::with_labels(
            [(
                std::borrow::Cow::Borrowed("model_name"),
                std::borrow::Cow::Owned(model_name.to_string()),
            )]
            .into_iter(),
        );
        registry.register(
            "vllm:num_requests_running",
            "Requests in the running batch",
            self.running.clone(),
        );
        registry.register(
            "vllm:num_requests_waiting",
            "Requests waiting to run",
            self.waiting.clone(),
        );
        registry.register(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage: cached tokens over max_batch * max_model_len (1 = full)",
            self.kv_usage.clone(),
        );
        registry.register(
            "vllm:prompt_tokens",
            "Prompt tokens admitted",
            self.prompt_tokens.clone(),
        );
        registry.register(
            "vllm:generation_tokens",
            "Tokens generated",
            self.generation_tokens.clone(),
        );
        registry.register(
            "vllm:request_success",
            "Finished requests by finish reason",
            self.request_success.clone(),
        );
        registry
    }
}
