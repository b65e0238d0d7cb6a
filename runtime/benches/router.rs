//! Router benchmarks, printed as tables of ratios measured in one invocation (this machine is
//! noisy; compare within a run, never against a fixed number): added latency (p50, p99) of a
//! generate request through the router vs. the engine directly, and the most requests per second
//! the router serves on one core, against a near-instant stub engine (one token per request).
//!
//! `cargo bench -p moult-runtime --bench router` (after `source scripts/env.sh`). Documented in
//! docs/benchmarks.md.

use std::sync::Arc;

use moult_runtime::router::{policy, server, EnginePool, Router};
use serde_json::{json, Value};

mod common;
use common::{hammer, quantile, stub_engine};

fn bodies(n: usize, sessions: bool) -> Vec<(String, Value)> {
    (0..n)
        .map(|i| {
            let mut body = json!({"request_id": format!("r{i}"), "token_ids": [1, 2, 3, 4, 5, 6, 7, 8],
                "sampling_params": {"max_tokens": 1}});
            if sessions {
                body["stream"] = json!(false);
            }
            ("/inference/v1/generate".to_string(), body)
        })
        .collect()
}

fn main() {
    println!(
        "cores: {}\n",
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    // Clients, stub engine and router each get a runtime of one thread, so both paths cross
    // threads the same way and the router's share is one core.
    let one_thread = || {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap()
    };
    let clients = one_thread();
    let engine_rt = one_thread();
    let engine = engine_rt.block_on(stub_engine());
    let router_rt = one_thread();
    let url = router_rt.block_on(async {
        let pool = Arc::new(EnginePool::new(std::slice::from_ref(&engine)));
        let router = Arc::new(Router::new(
            pool,
            policy::by_name("consistent-hash").unwrap(),
        ));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(server::serve(listener, router, std::future::pending()));
        url
    });
    const N: usize = 3000;
    println!("## Router overhead, near-instant engine (one token per request)\n");
    println!("| path | clients | requests | p50 µs | p99 µs | requests/s | vs engine alone |");
    println!("| --- | --- | --- | --- | --- | --- | --- |");
    for concurrency in [1, 16] {
        // Warm both paths.
        clients.block_on(hammer(engine.clone(), bodies(200, false), concurrency));
        clients.block_on(hammer(url.clone(), bodies(200, false), concurrency));
        let (d, dl) = clients.block_on(hammer(engine.clone(), bodies(N, false), concurrency));
        let (r, rl) = clients.block_on(hammer(url.clone(), bodies(N, false), concurrency));
        let (drps, rrps) = (N as f64 / d.as_secs_f64(), N as f64 / r.as_secs_f64());
        println!(
            "| engine alone | {concurrency} | {N} | {:.0} | {:.0} | {drps:.0} | 1.00x |",
            quantile(&dl, 0.5),
            quantile(&dl, 0.99)
        );
        println!(
            "| router (1 core) → engine | {concurrency} | {N} | {:.0} | {:.0} | {rrps:.0} | {:.2}x |",
            quantile(&rl, 0.5),
            quantile(&rl, 0.99),
            rrps / drps
        );
    }
    println!(
        "\nAdded latency is the router's p50 minus the engine's at one client; requests/s at 16 \
         clients is what one router core sustains."
    );
}
