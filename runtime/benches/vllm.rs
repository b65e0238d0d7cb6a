//! The built-in engine vs vLLM (the pinned CPU build), printed as a table of ratios measured in
//! one invocation (this machine is noisy; compare within a run, never against a fixed number):
//! decode throughput for a batch of requests submitted together, the same model, prompts and
//! sampling on both, over the same token-in/token-out HTTP API, one engine at a time.
//!
//! With `--router`, the router's overhead instead: one vLLM engine answered directly, through
//! `moult router` and through `vllm-router` (PyPI, installed beside vLLM by
//! scripts/setup-vllm.sh), the same requests: added latency (p50/p99, requests one at a time)
//! and requests/s with 16 clients at once.
//!
//! `MOULT_VLLM_PYTHON=... cargo bench -p moult-runtime --bench vllm` (after `source
//! scripts/env.sh`; scripts/setup-vllm.sh prints the python); `-- --large` adds the Qwen3-0.6B
//! shape; `-- --router` measures the routers. Documented in docs/benchmarks.md.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use moult_runtime::local::vllm::{free_port, VllmProcess};
use serde_json::json;

mod common;
use common::{qwen3_width_model, root, start_engine};

/// The tiny Qwen3 both engines serve (head_dim 32), made by the vLLM virtualenv's transformers.
fn tiny_vllm_model() -> std::path::PathBuf {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("vllm-models");
    let python = moult_runtime::local::vllm::python();
    let status = std::process::Command::new(python)
        .arg(root().join("tests/python/make_vllm_models.py"))
        .arg(&dir)
        .status()
        .expect("run make_vllm_models.py with MOULT_VLLM_PYTHON");
    assert!(status.success());
    dir.join("qwen3-tiny")
}

/// Tokens per second of `batch` requests of `new_tokens` each, submitted together to `url`.
async fn throughput(url: &str, batch: usize, new_tokens: usize) -> f64 {
    let http = reqwest::Client::new();
    let started = Instant::now();
    let requests = (0..batch).map(|i| {
        let prompt: Vec<i64> = (0..32).map(|j| ((i * 131 + j * 7) % 2000) as i64).collect();
        let body = json!({"token_ids": prompt, "sampling_params": {"max_tokens": new_tokens,
            "temperature": 1.0, "ignore_eos": true, "seed": i}});
        let http = http.clone();
        let url = format!("{url}/inference/v1/generate");
        async move {
            let r: serde_json::Value = http
                .post(url)
                .json(&body)
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            let n = r["choices"][0]["token_ids"].as_array().map_or(0, Vec::len);
            assert_eq!(n, new_tokens, "{r}");
        }
    });
    futures::future::join_all(requests).await;
    (batch * new_tokens) as f64 / started.elapsed().as_secs_f64()
}

/// vLLM serving `model` on a free port with `threads` unpinned intra-op threads.
async fn start_vllm(model: &std::path::Path, threads: usize) -> VllmProcess {
    let port = free_port().unwrap();
    let log = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("bench-vllm.log");
    let args: Vec<String> = [
        "--model",
        &model.display().to_string(),
        "--host",
        "127.0.0.1",
        "--port",
        &port.to_string(),
        "--enable-scale-out",
        "--logprobs-mode",
        "processed_logprobs",
        "--dtype",
        "float32",
        "--kv-cache-memory-bytes",
        "1073741824",
        "--enforce-eager",
        "--max-model-len",
        "2048",
        "--skip-tokenizer-init",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    VllmProcess::spawn(&args, port, &log, Some(threads))
        .await
        .unwrap()
}

async fn compare(name: &str, model: &std::path::Path, threads: usize, new_tokens: usize) {
    let batches = [1usize, 8, 32];
    let builtin = start_engine(model, threads).await;
    throughput(&builtin, 1, 8).await; // warm-up
    let mut ours = Vec::new();
    for &b in &batches {
        ours.push(throughput(&builtin, b, new_tokens).await);
    }
    // The same intra-op threads as the built-in engine, unpinned.
    let vllm = start_vllm(model, threads).await;
    throughput(&vllm.url, 1, 8).await;
    for (k, &b) in batches.iter().enumerate() {
        let theirs = throughput(&vllm.url, b, new_tokens).await;
        println!(
            "| {name} | {b} | {new_tokens} | {:.1} | {theirs:.1} | {:.2}x |",
            ours[k],
            ours[k] / theirs
        );
    }
    drop(vllm);
}

/// One short generation (8 tokens, greedy) through `url`; panics unless it answered in full.
async fn short_request(http: &reqwest::Client, url: &str, i: usize) {
    let prompt: Vec<i64> = (0..16).map(|j| ((i * 131 + j * 7) % 2000) as i64).collect();
    // With logprobs, as every RL client asks (and `moult router` asks for them anyway).
    let body = json!({"token_ids": prompt, "sampling_params": {"max_tokens": 8,
        "temperature": 0.0, "ignore_eos": true, "logprobs": 0}});
    let r = http
        .post(format!("{url}/inference/v1/generate"))
        .header("x-moult-session", format!("s{}", i % 8))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success(), "{url}: {}", r.status());
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(
        v["choices"][0]["token_ids"].as_array().map_or(0, Vec::len),
        8,
        "{v}"
    );
}

/// For each of `urls`: (p50, p99) latency in ms of `n` requests one at a time, and requests/s of
/// 16 clients sending `n` in all. The paths take turns (request by request for latency, block by
/// block for the rate, twice), so this machine's drift weighs on all of them alike.
async fn latency_and_rate(urls: &[&str], n: usize) -> Vec<(f64, f64, f64)> {
    let http = reqwest::Client::new();
    for url in urls {
        for i in 0..10 {
            short_request(&http, url, i).await; // warm-up
        }
    }
    let mut ms = vec![Vec::with_capacity(n); urls.len()];
    for i in 0..n {
        for (k, url) in urls.iter().enumerate() {
            let t = Instant::now();
            short_request(&http, url, i).await;
            ms[k].push(t.elapsed().as_secs_f64() * 1e3);
        }
    }
    let mut seconds = vec![0.0; urls.len()];
    for _round in 0..2 {
        for (k, url) in urls.iter().enumerate() {
            let started = Instant::now();
            let clients = (0..16).map(|c| {
                let http = http.clone();
                async move {
                    for j in 0..n / 32 {
                        short_request(&http, url, c * 1000 + j).await;
                    }
                }
            });
            futures::future::join_all(clients).await;
            seconds[k] += started.elapsed().as_secs_f64();
        }
    }
    ms.iter_mut()
        .zip(&seconds)
        .map(|(ms, s)| {
            ms.sort_by(f64::total_cmp);
            let pct = |q: f64| ms[((ms.len() - 1) as f64 * q).round() as usize];
            (pct(0.5), pct(0.99), (n / 32 * 32) as f64 / s)
        })
        .collect()
}

/// A router process; killed on drop.
struct RouterProcess(Child);

impl Drop for RouterProcess {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

async fn wait_healthy(url: &str) {
    for _ in 0..600 {
        if let Ok(r) = reqwest::get(format!("{url}/health")).await {
            if r.status().is_success() {
                return;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("{url} did not become healthy");
}

async fn routers() {
    let vllm = start_vllm(&tiny_vllm_model(), 1).await;
    let moult_port = free_port().unwrap();
    let moult = RouterProcess(
        Command::new(env!("CARGO_BIN_EXE_moult"))
            .args([
                "router",
                "--engine",
                &vllm.url,
                "--port",
                &moult_port.to_string(),
            ])
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let moult_url = format!("http://127.0.0.1:{moult_port}");
    // vllm-router sits beside vLLM's python in the same virtualenv.
    let python = moult_runtime::local::vllm::python();
    let vllm_router_bin = python.with_file_name("vllm-router");
    let theirs_port = free_port().unwrap();
    let theirs = RouterProcess(
        Command::new(&vllm_router_bin)
            .args(["--worker-urls", &vllm.url, "--host", "127.0.0.1", "--port"])
            .arg(theirs_port.to_string())
            .args(["--policy", "consistent_hash", "--log-level", "warning"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "{}: {e} (scripts/setup-vllm.sh installs vllm-router)",
                    vllm_router_bin.display()
                )
            }),
    );
    let theirs_url = format!("http://127.0.0.1:{theirs_port}");
    wait_healthy(&moult_url).await;
    wait_healthy(&theirs_url).await;
    const N: usize = 320;
    let measured = latency_and_rate(&[&vllm.url, &moult_url, &theirs_url], N).await;
    let direct = measured[0];
    let rows = [
        ("moult router", measured[1]),
        ("vllm-router 0.1.17", measured[2]),
    ];
    println!(
        "| direct to vLLM | {:.2} | {:.2} | - | - | {:.1} | 1.00x |",
        direct.0, direct.1, direct.2
    );
    for (name, (p50, p99, rate)) in rows {
        println!(
            "| {name} | {p50:.2} | {p99:.2} | {:+.2} | {:+.2} | {rate:.1} | {:.2}x |",
            p50 - direct.0,
            p99 - direct.1,
            rate / direct.2
        );
    }
    drop((moult, theirs, vllm));
}

fn main() {
    let large = std::env::args().any(|a| a == "--large");
    let router = std::env::args().any(|a| a == "--router");
    println!(
        "cores: {}\n",
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    if router {
        println!("## Router overhead in front of one vLLM engine (8-token greedy generations)\n");
        println!("| path | p50 ms | p99 ms | added p50 ms | added p99 ms | requests/s (16 clients) | vs direct |");
        println!("| --- | --- | --- | --- | --- | --- | --- |");
        rt.block_on(routers());
        println!();
        rt.shutdown_timeout(Duration::from_secs(2));
        return;
    }
    println!("## Decode throughput: built-in engine vs vLLM (CPU build), tokens/s end to end\n");
    println!("| model | batch | new tokens | moult | vLLM | moult / vLLM |");
    println!("| --- | --- | --- | --- | --- | --- |");
    rt.block_on(compare(
        "tiny (3 layers, d=64, head_dim 32)",
        &tiny_vllm_model(),
        1,
        128,
    ));
    if large {
        rt.block_on(compare("Qwen3-0.6B shape", &qwen3_width_model(28), 2, 32));
    }
    println!();
    rt.shutdown_timeout(Duration::from_secs(2));
    std::thread::sleep(Duration::from_millis(300));
}
