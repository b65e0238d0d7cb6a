//! Rollout and weight-sync benchmarks, printed as tables of ratios measured in one invocation
//! (this machine is noisy; compare within a run, never against a fixed number):
//!
//! 1. engine utilisation during a run with long-tailed generation lengths: the fraction of time
//!    the engines have work, synchronous (maxStaleness 0, pause `wait`) vs asynchronous with
//!    partial rollout (maxStaleness 1, pause `keep`), with a simulated training step and a real
//!    weight sync after every batch;
//! 2. weight sync: how long engines stay paused per update and the transfer rate, vs a plain
//!    in-memory copy of the same bytes, for a model of Qwen3-0.6B's width, over the TCP stream
//!    and through a folder (the Filesystem transport).
//!
//! 3. LoRA: a LoRA run's update (the adapter's tensors only) against the whole model's, over TCP.
//!
//! `cargo bench -p moult-runtime --bench rollout` (after `source scripts/env.sh`); `-- --quick`
//! runs part 1 only, `-- --weight-sync` part 2 only, `-- --lora-sync` part 3 (only by name: the
//! parts before leave too much memory in use). Documented in docs/benchmarks.md.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use futures::StreamExt;
use moult_operator::api::WeightTransport;
use moult_runtime::agents::{Episode, EpisodeStatus};
use moult_runtime::chat::SamplingOverride;
use moult_runtime::engine::client::{EngineClient, Generated};
use moult_runtime::loopback::Segment;
use moult_runtime::model::CausalLm;
use moult_runtime::rollout::{
    next_batch, EpisodeRunner, RolloutOptions, RolloutPool, RolloutState,
};
use moult_runtime::router::{policy, server, EnginePool, Router};
use moult_runtime::weight_sync::orchestrate::WeightSync;
use moult_runtime::weight_sync::publish::{PublishOptions, Publisher};
use moult_runtime::weight_sync::stream::WeightStream;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use tch::Tensor;

mod common;
use common::{qwen3_width_model, start_engine, start_engine_lora, tiny_model};

/// One "episode": a single generation through the router, its length drawn from the task.
struct Generate {
    client: EngineClient,
}

impl EpisodeRunner for Generate {
    fn run(
        &self,
        index: usize,
        task: Value,
        _sampling: Option<SamplingOverride>,
    ) -> BoxFuture<'_, Episode> {
        Box::pin(async move {
            let len = task["tokens"].as_u64().unwrap() as usize;
            let prompt: Vec<i64> = (0..8)
                .map(|i| ((index * 31 + i * 7) % 2000) as i64)
                .collect();
            let sampling = json!({"max_tokens": len, "ignore_eos": true});
            let mut stream = self
                .client
                .generate(
                    format!("ep{index}"),
                    &prompt,
                    &[],
                    &sampling,
                    Some(&format!("s{index}")),
                )
                .await
                .unwrap();
            let mut segment = Segment::default();
            while let Some(event) = stream.next().await {
                match event.unwrap() {
                    Generated::Token {
                        id,
                        logprob,
                        version,
                        ..
                    } => {
                        segment.token_ids.push(id);
                        segment.loss_mask.push(1);
                        segment.logprobs.push(logprob);
                        segment.versions.push(Some(version));
                    }
                    Generated::Finished { .. } => break,
                }
            }
            Episode {
                index,
                session: String::new(),
                task,
                status: EpisodeStatus::Completed,
                reason: None,
                reward: 0.0,
                info: Default::default(),
                seconds: 0.0,
                segments: vec![segment],
            }
        })
    }
}

/// Samples `/metrics` of each engine every 10 ms; the fraction of samples with work running.
async fn busy_fraction(engines: Vec<String>, stop: Arc<AtomicBool>) -> f64 {
    let http = reqwest::Client::new();
    let (mut busy, mut total) = (0usize, 0usize);
    while !stop.load(Ordering::Relaxed) {
        for e in &engines {
            let text = http
                .get(format!("{e}/metrics"))
                .send()
                .await
                .unwrap()
                .text()
                .await
                .unwrap();
            let running: f64 = text
                .lines()
                .filter(|l| l.starts_with("vllm:num_requests_running"))
                .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .sum();
            total += 1;
            busy += usize::from(running > 0.0);
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    busy as f64 / total.max(1) as f64
}

/// Long-tailed lengths: Pareto(α = 1.2) from 16 tokens, capped at 768.
fn lengths(n: usize) -> Vec<Value> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
    (0..n)
        .map(|_| {
            let u: f64 = rng.gen_range(0.0001..1.0);
            let len = (16.0 / u.powf(1.0 / 1.2)).min(768.0) as u64;
            json!({ "tokens": len })
        })
        .collect()
}

struct RunResult {
    seconds: f64,
    busy: f64,
    tokens: usize,
    paused_ms: f64,
    dropped: u64,
}

/// `max_staleness` 0 runs synchronously (pause `wait`); more runs with partial rollout.
async fn run(max_staleness: u64, steps: usize, train: Duration) -> RunResult {
    let asynchronous = max_staleness > 0;
    let model = tiny_model();
    let engines = vec![start_engine(&model, 1).await, start_engine(&model, 1).await];
    let pool = Arc::new(EnginePool::new(&engines));
    let router = Arc::new(Router::new(pool, policy::by_name("least-tokens").unwrap()));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(server::serve(listener, router, std::future::pending()));
    let runner = Arc::new(Generate {
        client: EngineClient::new(&url),
    });
    let opts = RolloutOptions {
        group_size: 4,
        batch_size: 4,
        max_staleness,
        limits: Default::default(),
        dynamic_sampling: None,
    };
    let (rollout, mut queue) = RolloutPool::start(
        runner,
        Arc::new(lengths(64)),
        opts.clone(),
        RolloutState::default(),
        0,
    )
    .unwrap();
    let base = CausalLm::load(&model, tch::Kind::Float, tch::Device::Cpu).unwrap();
    let weights: Vec<(String, Tensor)> = base
        .params()
        .iter()
        .map(|(n, t)| (n.clone(), t.detach().copy()))
        .collect();
    let mut sync = WeightSync::new(&url);
    sync.connect_tcp("127.0.0.1:0", "127.0.0.1").await.unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = tokio::spawn(busy_fraction(engines, stop.clone()));
    let started = Instant::now();
    let (mut tokens, mut paused) = (0, Duration::ZERO);
    for step in 1..=steps as u64 {
        let batch = next_batch(&rollout, &mut queue, &opts).await.unwrap();
        tokens += batch
            .iter()
            .flat_map(|g| g.episodes.iter())
            .map(|e| e.segments[0].token_ids.len())
            .sum::<usize>();
        tokio::time::sleep(train).await; // the training step
        paused += sync
            .update_stream(WeightStream::whole(&weights), step, asynchronous)
            .await
            .unwrap()
            .paused;
        rollout.set_version(step);
        drop(batch); // the step is over: its groups' slots are free
    }
    let seconds = started.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    let dropped = rollout.stats().dropped_stale;
    // Stop drawing groups and let those in flight end before the next run.
    drop(queue);
    tokio::time::sleep(Duration::from_secs(2)).await;
    RunResult {
        seconds,
        busy: sampler.await.unwrap(),
        tokens,
        paused_ms: paused.as_secs_f64() * 1e3 / steps as f64,
        dropped,
    }
}

async fn utilisation() {
    const STEPS: usize = 8;
    let train = Duration::from_millis(300);
    println!("## Engine utilisation, long-tailed generation lengths\n");
    println!(
        "2 engines (tiny model, 1 thread each), batches of 4 groups x 4 samples, lengths Pareto(1.2) from 16 capped at 768 tokens, a {} ms training step and a weight sync after each of {STEPS} batches.\n",
        train.as_millis()
    );
    println!("| mode | seconds | engines busy | trained tokens/s | groups dropped (stale) | paused per sync (ms) | vs synchronous |");
    println!("| --- | --- | --- | --- | --- | --- | --- |");
    let sync = run(0, STEPS, train).await;
    let base = sync.tokens as f64 / sync.seconds;
    let mut rows = vec![("synchronous (maxStaleness 0, pause wait)".to_string(), sync)];
    for staleness in [1, 2] {
        let name = format!("asynchronous (maxStaleness {staleness}, partial rollout)");
        rows.push((name, run(staleness, STEPS, train).await));
    }
    for (name, r) in &rows {
        println!(
            "| {name} | {:.2} | {:.0}% | {:.0} | {} | {:.1} | {:.2}x |",
            r.seconds,
            r.busy * 100.0,
            r.tokens as f64 / r.seconds,
            r.dropped,
            r.paused_ms,
            (r.tokens as f64 / r.seconds) / base
        );
    }
    println!();
}

/// A router (least-tokens) in front of `engines`, serving on a loopback port: its URL.
async fn serve_router(engines: &[String]) -> String {
    let pool = Arc::new(EnginePool::new(engines));
    let router = Arc::new(Router::new(pool, policy::by_name("least-tokens").unwrap()));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(server::serve(listener, router, std::future::pending()));
    url
}

async fn weight_sync_rate() {
    let model = qwen3_width_model(4);
    println!("## Weight sync, Qwen3-0.6B width with 4 layers (float32)\n");
    let base = CausalLm::load(&model, tch::Kind::Float, tch::Device::Cpu).unwrap();
    let weights: Vec<(String, Tensor)> = base
        .params()
        .iter()
        .map(|(n, t)| (n.clone(), t.detach().copy()))
        .collect();
    let bytes: usize = weights.iter().map(|(_, t)| t.numel() * 4).sum();
    // The baseline: copying the same bytes in memory once.
    let targets: Vec<Tensor> = weights.iter().map(|(_, t)| t.zeros_like()).collect();
    let memcpy = {
        let started = Instant::now();
        for (dst, (_, src)) in targets.iter().zip(&weights) {
            dst.shallow_clone().copy_(src);
        }
        started.elapsed().as_secs_f64()
    };
    println!("| path | engines | GB per update | whole update (ms) | paused per update (ms) | transfer (ms) | GB/s | vs memcpy |");
    println!("| --- | --- | --- | --- | --- | --- | --- | --- |");
    let gb = bytes as f64 / 1e9;
    println!(
        "| memcpy (baseline) | - | {gb:.2} | - | - | {:.0} | {:.2} | 1.00x |",
        memcpy * 1e3,
        gb / memcpy
    );
    let folder = std::env::temp_dir().join(format!("moult-bench-weights-{}", std::process::id()));
    for (transport, label) in [
        (WeightTransport::Tcp, "TCP via router"),
        (WeightTransport::Filesystem, "folder via router"),
    ] {
        for engines in [1usize, 2] {
            let mut urls = Vec::new();
            for _ in 0..engines {
                urls.push(start_engine(&model, 1).await);
            }
            let url = serve_router(&urls).await;
            let mut sync = Publisher::connect(&PublishOptions {
                target: url,
                transport,
                device: tch::Device::Cpu,
                host: "127.0.0.1".into(),
                port: 0,
                folder: Some(folder.clone()),
                engine_kind: tch::Kind::Float,
                pool: None,
            })
            .await
            .unwrap();
            let whole = || WeightStream::whole(&weights);
            sync.update_stream(whole(), 1, true).await.unwrap(); // warm-up (buffers)
            let mut reports = Vec::new();
            for v in 2..5 {
                let started = Instant::now();
                let r = sync.update_stream(whole(), v, true).await.unwrap();
                reports.push((started.elapsed().as_secs_f64(), r));
            }
            let mean = |f: &dyn Fn(&(f64, moult_runtime::weight_sync::SyncReport)) -> f64| {
                reports.iter().map(f).sum::<f64>() / reports.len() as f64
            };
            let whole = mean(&|r| r.0);
            let paused = mean(&|r| r.1.paused.as_secs_f64());
            let transfer = mean(&|r| r.1.transfer.as_secs_f64());
            let moved = gb * engines as f64;
            println!(
                "| {label} | {engines} | {moved:.2} | {:.0} | {:.0} | {:.0} | {:.2} | {:.2}x |",
                whole * 1e3,
                paused * 1e3,
                transfer * 1e3,
                moved / transfer,
                (moved / transfer) / (gb / memcpy)
            );
        }
    }
    let _ = std::fs::remove_dir_all(&folder);
    println!();
}

/// A LoRA run's update (docs/lora.md): the adapter's tensors alone over the TCP data plane to
/// one engine serving it, vs the whole model's, in the same invocation.
async fn lora_sync(model: &std::path::Path) {
    use moult_runtime::model::lora::{LoraConfig, TARGETS};
    println!("### LoRA adapters vs full weights (TCP via router, 1 engine)\n");
    println!("| weights | MB per update | whole update (ms) | paused per update (ms) | bytes vs full | paused vs full |");
    println!("| --- | --- | --- | --- | --- | --- |");
    let (mut full_paused, mut full_bytes) = (None, 0);
    for rank in [None, Some(8), Some(32)] {
        let lora = rank.map(|rank| LoraConfig {
            rank,
            alpha: 2.0 * rank as f64,
            rslora: false,
            dropout: 0.0,
            targets: TARGETS.map(String::from).into(),
        });
        let mut trainer = CausalLm::load(model, tch::Kind::Float, tch::Device::Cpu).unwrap();
        if let Some(l) = &lora {
            trainer.attach_lora(l, None, 0).unwrap();
        }
        let weights: Vec<(String, Tensor)> = (trainer.params().iter())
            .map(|(n, t)| (n.clone(), t.detach().copy()))
            .collect();
        let bytes: usize = weights.iter().map(|(_, t)| t.numel() * 4).sum();
        let engine = start_engine_lora(model, 1, lora).await;
        let url = serve_router(&[engine]).await;
        let mut sync = Publisher::connect(&PublishOptions {
            target: url,
            transport: WeightTransport::Tcp,
            device: tch::Device::Cpu,
            host: "127.0.0.1".into(),
            port: 0,
            folder: None,
            engine_kind: tch::Kind::Float,
            pool: None,
        })
        .await
        .unwrap();
        let whole = || WeightStream::whole(&weights);
        sync.update_stream(whole(), 1, true).await.unwrap(); // warm-up (buffers)
        let (mut took, mut paused) = (0.0, 0.0);
        for v in 2..5 {
            let started = Instant::now();
            let r = sync.update_stream(whole(), v, true).await.unwrap();
            took += started.elapsed().as_secs_f64() / 3.0;
            paused += r.paused.as_secs_f64() / 3.0;
        }
        let base = *full_paused.get_or_insert(paused);
        if rank.is_none() {
            full_bytes = bytes;
        }
        let label = rank.map_or("full model".to_string(), |r| {
            format!("LoRA rank {r}, 7 projections")
        });
        println!(
            "| {label} | {:.1} | {:.1} | {:.1} | {:.4}x | {:.4}x |",
            bytes as f64 / 1e6,
            took * 1e3,
            paused * 1e3,
            bytes as f64 / full_bytes as f64,
            paused / base
        );
    }
    println!();
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    println!(
        "cores: {}\n",
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let sync_only = std::env::args().any(|a| a == "--weight-sync");
    let lora_only = std::env::args().any(|a| a == "--lora-sync");
    if lora_only {
        // Alone: the part before leaves its engines' memory in use.
        rt.block_on(lora_sync(&qwen3_width_model(4)));
    } else if !sync_only {
        rt.block_on(utilisation());
    }
    if !quick && !lora_only {
        rt.block_on(weight_sync_rate());
    }
    // Dropping the servers drops the engine handles, which ends the engine threads before the
    // process (and libtorch's globals) goes away.
    rt.shutdown_timeout(Duration::from_secs(2));
    std::thread::sleep(Duration::from_millis(300));
}
