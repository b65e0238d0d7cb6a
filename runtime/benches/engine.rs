//! Engine benchmarks, printed as tables of ratios measured in one invocation (this machine is
//! noisy; compare within a run, never against a fixed number):
//!
//! 1. decode throughput of our engine vs transformers' `generate` (same model, batch, prompt);
//! 2. per-token decode latency at context 64 vs 1024 (the KV cache keeps it nearly flat);
//! 3. weight update over the TCP data plane vs a plain in-memory copy of the same bytes.
//!
//! `cargo bench -p moult-runtime --bench engine` (after `source scripts/env.sh`);
//! `-- --quick` runs the tiny model only, `-- --large` the Qwen3-0.6B-shaped one only, `-- --llama`
//! a Llama 3.2-1B-shaped one, `-- --gemma` a Gemma 3-1B-shaped one (docs/models.md), `-- --weights`
//! the weight update of the Qwen3-0.6B-shaped one alone. Documented in docs/benchmarks.md.

use std::path::{Path, PathBuf};
use std::time::Instant;

use moult_runtime::engine::sampling::SamplingParams;
use moult_runtime::engine::weights::{update_info, WeightListener, DEFAULT_PACKED_BUFFER_BYTES};
use moult_runtime::engine::{http, EngineHandle, EngineOptions, Event};
use moult_runtime::model::CausalLm;
use tch::{Device, Kind, Tensor};

mod common;
use common::{root, run_python};

/// The benchmark models, created once under cargo's target directory.
fn models() -> (PathBuf, PathBuf) {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("bench-models");
    let tiny = dir.join("qwen3-tiny");
    if !tiny.join("model.safetensors").exists() {
        run_python(&[
            root()
                .join("tests/python/make_tiny_models.py")
                .to_str()
                .unwrap(),
            dir.to_str().unwrap(),
        ]);
    }
    let qwen = random_model(
        "qwen3-0.6b-random",
        "Qwen3-0.6B",
        &root().join("tests/fixtures/qwen3_0.6b_config.json"),
    );
    (tiny, qwen)
}

/// A model of `config`'s shape with random weights (transformers), created once as
/// `bench-models/<name>`.
fn random_model(name: &str, shape: &str, config: &Path) -> PathBuf {
    let out = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("bench-models")
        .join(name);
    if !out.join("model.safetensors").exists() {
        eprintln!("creating a {shape}-shaped model with random weights (transformers)...");
        run_python(&[
            root()
                .join("tests/python/make_random_model.py")
                .to_str()
                .unwrap(),
            config.to_str().unwrap(),
            out.to_str().unwrap(),
        ]);
    }
    out
}

/// The other families' shapes, with random weights, created once: Llama 3.2-1B's (its model
/// card: 16 layers, hidden 2048, 32 heads of 64 with 8 key/value heads, MLP 8192, vocabulary
/// 128256, tied embeddings, llama3 rope scaling) and Gemma 3-1B's (26 layers, hidden 1152, 4
/// heads of 256 with 1 key/value head, MLP 6912, vocabulary 262144, tied embeddings, five local
/// layers with a 512-token window per global one).
fn family_model(family: &str) -> (&'static str, PathBuf) {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("bench-models");
    std::fs::create_dir_all(&dir).unwrap();
    let (name, label, shape) = match family {
        "llama" => (
            "llama3.2-1b",
            "Llama 3.2-1B shape",
            serde_json::json!({
                "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
                "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
                "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256,
                "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
                "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                "tie_word_embeddings": true, "hidden_act": "silu"
            }),
        ),
        "gemma" => (
            "gemma3-1b",
            "Gemma 3-1B shape",
            serde_json::json!({
                "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
                "hidden_size": 1152, "intermediate_size": 6912, "num_hidden_layers": 26,
                "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
                "vocab_size": 262144, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
                "query_pre_attn_scalar": 256, "sliding_window": 512, "sliding_window_pattern": 6,
                "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
                "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": true
            }),
        ),
        other => panic!("no benchmark shape for the family {other}"),
    };
    let config = dir.join(format!("{name}-config.json"));
    std::fs::write(&config, shape.to_string()).unwrap();
    (
        label,
        random_model(&format!("{name}-random"), label, &config),
    )
}

fn engine(model: &Path, max_batch: usize) -> (EngineHandle, std::thread::JoinHandle<()>) {
    let m = CausalLm::load(model, Kind::Float, Device::Cpu).unwrap();
    let opts = EngineOptions {
        max_batch,
        max_model_len: 2048,
        max_prefill_tokens: 2048,
        max_waiting: 1024,
        return_routed_experts: false,
        eos_token_ids: vec![],
        threads: None,
        packed_weights: None,
        pool: None,
    };
    EngineHandle::spawn(m, "bench".into(), opts)
}

fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

fn prompt(seed: usize, len: usize) -> Vec<i64> {
    (0..len)
        .map(|i| ((seed * 7919 + i * 104_729) % 2000) as i64)
        .collect()
}

/// Runs `batch` requests at once; returns (seconds, per-request token arrival instants).
async fn run_batch(
    handle: &EngineHandle,
    batch: usize,
    prompt_len: usize,
    new_tokens: usize,
) -> (f64, Vec<Vec<Instant>>) {
    let params = SamplingParams {
        max_tokens: new_tokens,
        ignore_eos: true,
        ..Default::default()
    };
    let start = Instant::now();
    let mut receivers = Vec::new();
    for i in 0..batch {
        receivers.push(
            handle
                .generate(
                    format!("b{i}-{start:?}"),
                    prompt(i, prompt_len),
                    params.clone(),
                    0,
                )
                .unwrap(),
        );
    }
    // One task per request, so that each token is timestamped when it arrives.
    let tasks: Vec<_> = receivers
        .into_iter()
        .map(|mut rx| {
            tokio::spawn(async move {
                let mut times = Vec::new();
                while let Some(event) = rx.recv().await {
                    match event {
                        Event::Token { .. } => times.push(Instant::now()),
                        Event::Finished { .. } => break,
                        other => panic!("unexpected {other:?}"),
                    }
                }
                times
            })
        })
        .collect();
    let mut arrivals = Vec::new();
    for task in tasks {
        let times = task.await.unwrap();
        assert_eq!(times.len(), new_tokens);
        arrivals.push(times);
    }
    (start.elapsed().as_secs_f64(), arrivals)
}

fn throughput(rt: &tokio::runtime::Runtime, name: &str, model: &Path, new_tokens: usize) {
    let prompt_len = 32;
    let (handle, _t) = engine(model, 32);
    rt.block_on(run_batch(&handle, 2, prompt_len, 4)); // warm-up
    for batch in [1, 8, 32] {
        let (secs, arrivals) = rt.block_on(run_batch(&handle, batch, prompt_len, new_tokens));
        let ours = (batch * new_tokens) as f64 / secs;
        // Decode only: from the moment every request has its first token to the last token.
        let first = arrivals.iter().map(|t| t[0]).max().unwrap();
        let last = arrivals.iter().map(|t| t[new_tokens - 1]).max().unwrap();
        let ours_decode =
            (batch * (new_tokens - 1)) as f64 / last.duration_since(first).as_secs_f64();
        // transformers at its best: one intra-op thread or all (small models favour one).
        let (theirs, theirs_decode) = [1, cores()]
            .iter()
            .map(|threads| {
                let line = run_python(&[
                    root()
                        .join("tests/python/bench_transformers.py")
                        .to_str()
                        .unwrap(),
                    model.to_str().unwrap(),
                    &batch.to_string(),
                    &prompt_len.to_string(),
                    &new_tokens.to_string(),
                    &threads.to_string(),
                ]);
                let v: serde_json::Value = serde_json::from_str(line.trim()).unwrap();
                (
                    v["tokens_per_s"].as_f64().unwrap(),
                    v["decode_tokens_per_s"].as_f64().unwrap(),
                )
            })
            .fold((0.0, 0.0), |(a, b), (c, d)| {
                (f64::max(a, c), f64::max(b, d))
            });
        println!(
            "| {name} | {batch} | {prompt_len} | {new_tokens} | {ours:.1} | {theirs:.1} | {:.2}x | {ours_decode:.1} | {theirs_decode:.1} | {:.2}x |",
            ours / theirs,
            ours_decode / theirs_decode
        );
    }
}

fn latency(rt: &tokio::runtime::Runtime, name: &str, model: &Path) {
    let (handle, _t) = engine(model, 4);
    rt.block_on(run_batch(&handle, 1, 16, 4));
    let new_tokens = 33;
    let mut per_token = Vec::new();
    for context in [64, 1024] {
        let (_, arrivals) = rt.block_on(run_batch(&handle, 1, context, new_tokens));
        let t = &arrivals[0];
        // Decode steps only: from the first token (end of prefill) to the last.
        let ms =
            t[new_tokens - 1].duration_since(t[0]).as_secs_f64() * 1e3 / (new_tokens - 1) as f64;
        per_token.push(ms);
    }
    println!(
        "| {name} | {:.2} | {:.2} | {:.2}x |",
        per_token[0],
        per_token[1],
        per_token[1] / per_token[0]
    );
}

fn weight_update(rt: &tokio::runtime::Runtime, name: &str, model: &Path) {
    let (handle, _t) = engine(model, 4);
    let source = CausalLm::load(model, Kind::Float, Device::Cpu).unwrap();
    let tensors: Vec<(String, Tensor)> = source
        .params()
        .iter()
        .map(|(n, t)| (n.clone(), t.shallow_clone()))
        .collect();
    let bytes: usize = tensors.iter().map(|(_, t)| t.numel() * 4).sum();
    // Buckets of about 256 MiB, as a trainer would send them.
    let mut buckets: Vec<Vec<(String, Tensor)>> = vec![Vec::new()];
    let mut size = 0;
    for (n, t) in &tensors {
        if size > 256 << 20 {
            buckets.push(Vec::new());
            size = 0;
        }
        size += t.numel() * 4;
        buckets
            .last_mut()
            .unwrap()
            .push((n.clone(), t.shallow_clone()));
    }
    let client = reqwest::Client::new();
    let (first, steady) = rt.block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(http::serve(listener, handle.clone(), std::future::pending()));
        let weights = WeightListener::bind("127.0.0.1:0").unwrap();
        let port = weights.local_addr().unwrap().port();
        let accept = std::thread::spawn(move || weights.accept(1).unwrap());
        let post = |path: &str, body: serde_json::Value| {
            let req = client.post(format!("{base}{path}")).json(&body);
            async move {
                let resp = req.send().await.unwrap();
                assert!(resp.status().is_success(), "{}", resp.text().await.unwrap());
            }
        };
        let init = serde_json::json!({"init_info": {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2}});
        post("/init_weight_transfer_engine", init).await;
        let mut sender = Some(accept.join().unwrap());
        let mut times = Vec::new();
        // The first update also allocates both ends' buffers; later ones reuse them.
        for version in 1..=2u64 {
            let start = Instant::now();
            post("/start_weight_update", serde_json::json!({})).await;
            for bucket in &buckets {
                let info = update_info(bucket);
                let bucket: Vec<(String, Tensor)> =
                    bucket.iter().map(|(n, t)| (n.clone(), t.shallow_clone())).collect();
                let mut s = sender.take().unwrap();
                let send = std::thread::spawn(move || {
                    s.send_bucket(&bucket, DEFAULT_PACKED_BUFFER_BYTES).unwrap();
                    s
                });
                post("/update_weights", serde_json::json!({"update_info": info})).await;
                sender = Some(send.join().unwrap());
            }
            post("/finish_weight_update", serde_json::json!({"weight_version": version})).await;
            times.push(start.elapsed().as_secs_f64());
        }
        (times[0], times[1])
    });
    // Baseline: one plain copy of the same bytes between two buffers already in memory.
    let src = vec![1u8; bytes];
    let mut dst = vec![2u8; bytes];
    let t0 = Instant::now();
    dst.copy_from_slice(&src);
    let copy_secs = t0.elapsed().as_secs_f64();
    assert_eq!(dst[bytes - 1], 1);
    // The bucket tags' share: one HMAC-SHA256 pass over the same bytes (each end makes one per
    // engine connection, beside the transfer).
    let t0 = Instant::now();
    let mut mac = <hmac::Hmac<sha2::Sha256> as hmac::Mac>::new_from_slice(&[7; 32]).unwrap();
    hmac::Mac::update(&mut mac, &src);
    std::hint::black_box(hmac::Mac::finalize(mac));
    let mac_secs = t0.elapsed().as_secs_f64();
    let gb = bytes as f64 / 1e9;
    println!(
        "| {name} | {gb:.3} | {first:.3} | {steady:.3} | {:.2} | {:.2} | {:.2}x | {:.2} | {:.0}% |",
        gb / steady,
        gb / copy_secs,
        copy_secs / steady,
        gb / mac_secs,
        100.0 * mac_secs / steady
    );
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let (tiny_on, large_on) = match (
        args.iter().any(|a| a == "--quick"),
        args.iter().any(|a| a == "--large"),
    ) {
        (true, _) => (true, false),
        (false, true) => (false, true),
        (false, false) => (true, true),
    };
    // `--llama`, `--gemma`: those families' shapes alone (docs/models.md).
    let families: Vec<(&str, PathBuf)> = ["llama", "gemma"]
        .into_iter()
        .filter(|f| args.iter().any(|a| *a == format!("--{f}")))
        .map(family_model)
        .collect();
    let (tiny_on, large_on) = if families.is_empty() {
        (tiny_on, large_on)
    } else {
        (false, false)
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let (tiny, qwen) = models();
    println!("cores: {}\n", cores());
    if args.iter().any(|a| a == "--weights") {
        weight_update_table(&rt, &[("Qwen3-0.6B shape", &qwen)]);
        return;
    }

    println!(
        "## Throughput (tokens/s, T=1): end to end, and decode only (after every first token)\n"
    );
    println!(
        "| model | batch | prompt | new tokens | moult | transformers | ratio | moult decode | transformers decode | decode ratio |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    if tiny_on {
        throughput(&rt, "tiny (3 layers, d=64)", &tiny, 128);
    }
    if large_on {
        throughput(&rt, "Qwen3-0.6B shape", &qwen, 32);
    }
    for (label, model) in &families {
        throughput(&rt, label, model, 32);
    }

    println!("\n## Per-token decode latency (ms/token, batch 1)\n");
    println!("| model | context 64 | context 1024 | 1024 / 64 |");
    println!("| --- | --- | --- | --- |");
    if tiny_on {
        latency(&rt, "tiny", &tiny);
    }
    if large_on {
        latency(&rt, "Qwen3-0.6B shape", &qwen);
    }
    for (label, model) in &families {
        latency(&rt, label, model);
    }

    let mut updated: Vec<(&str, &Path)> = Vec::new();
    if tiny_on {
        updated.push(("tiny", &tiny));
    }
    if large_on {
        updated.push(("Qwen3-0.6B shape", &qwen));
    }
    weight_update_table(&rt, &updated);
}

fn weight_update_table(rt: &tokio::runtime::Runtime, models: &[(&str, &Path)]) {
    println!("\n## Weight update over TCP (f32, all weights, one engine, 256 MiB buckets)\n");
    println!(
        "| model | GB | first update s | next update s | TCP GB/s | memcpy GB/s | TCP / memcpy | HMAC GB/s | one HMAC pass / next update |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    for (label, model) in models {
        weight_update(rt, label, model);
    }
}
