//! What the benchmarks share: a near-instant stub engine and a load generator.
#![allow(dead_code)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::response::sse::{Event, Sse};
use axum::routing::post;
use axum::Router;
use serde_json::{json, Value};

/// A stub engine: every generate request gets one token and its finish at once.
pub async fn stub_engine() -> String {
    async fn generate(
    ) -> Sse<futures::stream::Iter<std::vec::IntoIter<Result<Event, std::convert::Infallible>>>>
    {
        let token = json!({"request_id": "x", "choices": [{"index": 0, "token_ids": [9707],
            "logprobs": {"content": [{"token_id": 9707, "logprob": -0.1}]}, "finish_reason": null,
            "routed_experts": null, "weight_versions": [{"version": 0, "start": 0, "end": 1}]}]});
        let end = json!({"request_id": "x", "choices": [{"index": 0, "token_ids": [],
            "logprobs": {"content": []}, "finish_reason": "length", "routed_experts": null,
            "weight_versions": []}], "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}});
        Sse::new(futures::stream::iter(vec![
            Ok(Event::default().data(token.to_string())),
            Ok(Event::default().data(end.to_string())),
            Ok(Event::default().data("[DONE]")),
        ]))
    }
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let app = Router::new()
        .route("/health", axum::routing::get(|| async { "ok" }))
        .route("/inference/v1/generate", post(generate));
    tokio::spawn(async move { axum::serve(listener, app).await });
    url
}

/// Sends every `(path, body)` to `url` from `concurrency` clients; the elapsed time and each
/// request's latency in µs.
pub async fn hammer(
    url: String,
    bodies: Vec<(String, Value)>,
    concurrency: usize,
) -> (Duration, Vec<f64>) {
    let client = reqwest::Client::new();
    let bodies = Arc::new(bodies);
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let start = Instant::now();
    let workers: Vec<_> = (0..concurrency)
        .map(|_| {
            let (client, url, bodies, next) =
                (client.clone(), url.clone(), bodies.clone(), next.clone());
            tokio::spawn(async move {
                let mut latencies = Vec::new();
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let Some((path, body)) = bodies.get(i) else {
                        break;
                    };
                    let sent = Instant::now();
                    let r = client
                        .post(format!("{url}{path}"))
                        .json(body)
                        .send()
                        .await
                        .unwrap();
                    assert!(r.status().is_success(), "{path}: {}", r.status());
                    r.bytes().await.unwrap();
                    latencies.push(sent.elapsed().as_secs_f64() * 1e6);
                }
                latencies
            })
        })
        .collect();
    let mut latencies = Vec::new();
    for w in workers {
        latencies.extend(w.await.unwrap());
    }
    (start.elapsed(), latencies)
}

/// The `p`-quantile (0..=1) of `values`.
pub fn quantile(values: &[f64], p: f64) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[((v.len() - 1) as f64 * p).round() as usize]
}
