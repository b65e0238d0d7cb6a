//! The built-in engine vs vLLM (the pinned CPU build), printed as a table of ratios measured in
//! one invocation (this machine is noisy; compare within a run, never against a fixed number):
//! decode throughput for a batch of requests submitted together, the same model, prompts and
//! sampling on both, over the same token-in/token-out HTTP API, one engine at a time.
//!
//! `MOULT_VLLM_PYTHON=... cargo bench -p moult-runtime --bench vllm` (after `source
//! scripts/env.sh`; scripts/setup-vllm.sh prints the python); `-- --large` adds the Qwen3-0.6B
//! shape. Documented in docs/benchmarks.md.

use std::time::Instant;

use moult_runtime::run::vllm::{free_port, VllmProcess};
use serde_json::json;

mod common;
use common::{qwen3_width_model, root, start_engine};

/// The tiny Qwen3 both engines serve (head_dim 32), made by the vLLM virtualenv's transformers.
fn tiny_vllm_model() -> std::path::PathBuf {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("vllm-models");
    let python = moult_runtime::run::vllm::python();
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

async fn compare(name: &str, model: &std::path::Path, threads: usize, new_tokens: usize) {
    let batches = [1usize, 8, 32];
    let builtin = start_engine(model, threads).await;
    throughput(&builtin, 1, 8).await; // warm-up
    let mut ours = Vec::new();
    for &b in &batches {
        ours.push(throughput(&builtin, b, new_tokens).await);
    }
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
    // The same intra-op threads as the built-in engine, unpinned.
    let vllm = VllmProcess::spawn(&args, port, &log, Some(threads))
        .await
        .unwrap();
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

fn main() {
    let large = std::env::args().any(|a| a == "--large");
    println!(
        "cores: {}\n",
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
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
    rt.shutdown_timeout(std::time::Duration::from_secs(2));
    std::thread::sleep(std::time::Duration::from_millis(300));
}
