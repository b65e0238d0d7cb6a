//! A trainer of N ranks vs one (docs/distributed.md), printed as a table of ratios measured in
//! one invocation: for one rank and for 2 and 4 rank processes under each sharding (`Full`,
//! ZeRO-3; `Optimizer`, ZeRO-2), on the same model and the same global batch: the step time and
//! where it goes (gathering weights, the other collectives, computing), the state each rank
//! keeps between steps (its weights and AdamW moments), and each rank's peak resident memory
//! while training (the peak is reset after loading, which every rank does whole).
//!
//! `cargo bench -p moult-runtime --bench trainer_ranks` (after `source scripts/env.sh`);
//! `-- --quick` runs the tiny model; `-- --activations` measures the activations' memory per
//! token and layer instead (see [`activations`]). The default model is Qwen3-0.6B's shape (28 layers,
//! vocabulary 151936, random weights; ranks of it under `Optimizer` hold 12 GB each and do not
//! fit two to a 24 GB machine, so those rows run with `--quick` only). Every rank computes with all cores, so ranks on one
//! machine compete for them: step times say where the work goes, not how it would scale on one
//! GPU per rank.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use moult_runtime::algorithms::losses::Aggregation;
use moult_runtime::dist::{Rendezvous, ENV_MASTER, ENV_RANK, ENV_TIMEOUT, ENV_WORLD};
use moult_runtime::model::CausalLm;
use moult_runtime::trainer::optim::{Decay, LrSchedule};
use moult_runtime::trainer::ranks::{follower, leader, Setup};
use moult_runtime::trainer::step::{LossConfig, LossKind};
use moult_runtime::trainer::train::{Sample, Sharding, Trainer, TrainerOptions};
use serde_json::{json, Value};
use tch::{Device, Kind};

mod common;
use common::{qwen3_width_model, tiny_model};

const ENV_MODEL: &str = "MOULT_BENCH_RANK_MODEL";
const ENV_OUT: &str = "MOULT_BENCH_RANK_OUT";
const ENV_SHARDING: &str = "MOULT_BENCH_RANK_SHARDING";
/// Sequences in the global batch (4 unless set).
const ENV_SEQS: &str = "MOULT_BENCH_RANK_SEQS";
const WARMUP: usize = 1;
const STEPS: usize = 2;

fn options() -> TrainerOptions {
    let sharding = match std::env::var(ENV_SHARDING).as_deref() {
        Ok("optimizer") => Sharding::Optimizer,
        _ => Sharding::Full,
    };
    TrainerOptions {
        loss: LossConfig {
            kind: LossKind::PpoClip,
            eps_low: 0.2,
            eps_high: 0.28,
            aggregation: Aggregation::TokenMean,
            correction: None,
            temperature: 1.0,
        },
        schedule: LrSchedule {
            peak: 1e-5,
            warmup_steps: 0,
            total_steps: 100,
            decay: Decay::Constant,
            min_ratio: 1.0,
        },
        weight_decay: 0.01,
        max_grad_norm: Some(1.0),
        // Every batch here in one micro-batch per rank.
        micro_batch_tokens: 4096,
        kl_coef: 0.0,
        sharding,
        bf16_compute: false,
        freeze_vision: false,
        lora: None,
    }
}

/// The global batch: 4 sequences (or `ENV_SEQS`) of a 32-token prompt and a 64-token response.
fn batch(step: usize, vocab: usize) -> Vec<Sample> {
    let seqs = std::env::var(ENV_SEQS)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(4);
    (0..seqs)
        .map(|i| {
            let tokens: Vec<i64> = (0..96)
                .map(|j| ((i * 7919 + j * 104_729 + step * 31) % vocab) as i64)
                .collect();
            Sample {
                loss_mask: (0..96).map(|j| (j >= 32) as u8).collect(),
                behaviour_logprobs: vec![-5.0; 96],
                advantage: if i % 2 == 0 { 1.0 } else { -1.0 },
                token_advantages: None,
                replay: None,
                images: Vec::new(),
                tokens,
            }
        })
        .collect()
}

/// Resets this process's peak resident memory to what it holds now.
fn reset_peak_rss() {
    // Linux: writing 5 to clear_refs resets VmHWM.
    let _ = std::fs::write("/proc/self/clear_refs", "5");
    trace_rss("training starts");
}

/// With MOULT_BENCH_TRACE_RSS set, prints this process's resident memory now and at its peak.
fn trace_rss(at: &str) {
    if std::env::var_os("MOULT_BENCH_TRACE_RSS").is_some() {
        eprintln!(
            "pid {}: {at}: RSS {:.2} GB, peak {:.2} GB",
            std::process::id(),
            status_bytes("VmRSS:") as f64 / 1e9,
            peak_rss() as f64 / 1e9
        );
    }
}

/// This process's peak resident memory (VmHWM), bytes.
fn peak_rss() -> u64 {
    status_bytes("VmHWM:")
}

/// A memory line of /proc/self/status, bytes.
fn status_bytes(key: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

/// A rank process: trains, then writes its measurements to `<out>.<rank>.json`.
fn as_rank(out: &str) {
    let model_dir = PathBuf::from(std::env::var_os(ENV_MODEL).unwrap());
    let load = || CausalLm::load(&model_dir, Kind::Float, Device::Cpu).unwrap();
    let (rank, mut trainer) = match Rendezvous::from_env().unwrap() {
        None => (0, Trainer::new(load(), None, options()).unwrap()),
        Some(r) => {
            let group = r.connect_on(Device::Cpu).unwrap();
            if group.rank() > 0 {
                let rank = group.rank();
                let mut trainer = follower(group, Device::Cpu).unwrap();
                reset_peak_rss();
                trainer.follow().unwrap();
                report(out, rank, &trainer, None);
                return;
            }
            let setup = Setup {
                model_dir: model_dir.clone(),
                reference_dir: None,
                dtype: "float32".into(),
                options: options(),
            };
            (0, leader(load(), None, setup, None, group).unwrap())
        }
    };
    reset_peak_rss();
    let vocab = trainer.model().config().vocab_size;
    for s in 0..WARMUP {
        trainer.step(&batch(s, vocab)).unwrap();
    }
    let (mut seconds, mut collective, mut gather) = (0.0, 0.0, 0.0);
    for s in 0..STEPS {
        let started = Instant::now();
        let stats = trainer.step(&batch(WARMUP + s, vocab)).unwrap();
        trace_rss("after a step");
        seconds += started.elapsed().as_secs_f64();
        collective += stats.collective_seconds;
        gather += stats.gather_seconds;
    }
    let _ = trainer.stop_followers();
    let n = STEPS as f64;
    report(
        out,
        rank,
        &trainer,
        Some((seconds / n, collective / n, gather / n)),
    );
}

fn report(out: &str, rank: usize, trainer: &Trainer, times: Option<(f64, f64, f64)>) {
    let mut v = json!({
        "peak_rss": peak_rss(),
        "state_bytes": trainer.state_bytes(),
    });
    if let Some((step, collective, gather)) = times {
        v["step_seconds"] = json!(step);
        v["collective_seconds"] = json!(collective);
        v["gather_seconds"] = json!(gather);
    }
    std::fs::write(format!("{out}.{rank}.json"), v.to_string()).unwrap();
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Runs `world` ranks; returns each rank's report.
fn run(model: &Path, world: usize, sharding: &str, seqs: usize) -> Vec<Value> {
    let out = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("bench-ranks-{world}-{}", std::process::id()));
    let master = format!("127.0.0.1:{}", free_port());
    let children: Vec<_> = (0..world)
        .map(|rank| {
            let mut cmd = Command::new(std::env::current_exe().unwrap());
            cmd.env(ENV_OUT, &out)
                .env(ENV_MODEL, model)
                .env(ENV_SHARDING, sharding)
                .env(ENV_SEQS, seqs.to_string());
            if world > 1 {
                cmd.env(ENV_RANK, rank.to_string())
                    .env(ENV_WORLD, world.to_string())
                    .env(ENV_MASTER, &master)
                    .env(ENV_TIMEOUT, "600");
            }
            cmd.spawn().unwrap()
        })
        .collect();
    for (rank, mut child) in children.into_iter().enumerate() {
        assert!(
            child.wait().unwrap().success(),
            "rank {rank} of {world} failed"
        );
    }
    (0..world)
        .map(|r| {
            let file = format!("{}.{r}.json", out.display());
            let v = serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
            let _ = std::fs::remove_file(&file);
            v
        })
        .collect()
}

fn main() {
    if let Ok(out) = std::env::var(ENV_OUT) {
        as_rank(&out);
        return;
    }
    let quick = std::env::args().any(|a| a == "--quick");
    if std::env::args().any(|a| a == "--activations") {
        activations();
        return;
    }
    let (label, model) = if quick {
        ("tiny (3 layers, d=64)", tiny_model())
    } else {
        (
            "Qwen3-0.6B shape (28 layers, random weights)",
            qwen3_width_model(28),
        )
    };
    println!("model: {label}; global batch 4 x 96 tokens; {STEPS} steps after {WARMUP} warm-up\n");
    println!("| sharding | ranks | step s | vs 1 rank | gathering weights s | other collectives s | computing s | weights + moments per rank GB | vs 1 rank | peak RSS training, per rank GB | vs 1 rank |");
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    let mut base: Option<(f64, f64, f64)> = None;
    let mut runs = vec![("-", 1), ("full", 2), ("full", 4)];
    if quick {
        // Two ranks that each hold whole Qwen3-0.6B weights and gradients (12 GB each) do not
        // fit in 24 GB.
        runs.extend([("optimizer", 2), ("optimizer", 4)]);
    }
    for (sharding, world) in runs {
        let reports = run(&model, world, sharding, 4);
        let step = reports[0]["step_seconds"].as_f64().unwrap();
        let collective = reports[0]["collective_seconds"].as_f64().unwrap();
        let gather = reports[0]["gather_seconds"].as_f64().unwrap();
        let most = |key: &str| {
            reports
                .iter()
                .map(|r| r[key].as_f64().unwrap())
                .fold(0.0, f64::max)
        };
        let (state, rss) = (most("state_bytes"), most("peak_rss"));
        let (s0, m0, r0) = *base.get_or_insert((step, state, rss));
        println!(
            "| {sharding} | {world} | {step:.2} | {:.2}x | {gather:.2} | {:.2} | {:.2} | {:.2} | {:.3} | {:.2} | {:.2} |",
            step / s0,
            collective - gather,
            step - collective,
            state / 1e9,
            state / m0,
            rss / 1e9,
            rss / r0
        );
    }
}

/// `--activations`: the memory a step's activations take per token, from the peak resident
/// memory of the same trainer at two batch sizes (one micro-batch per rank), on a 4-layer slice
/// of the Qwen3-0.6B shape: one rank (every layer's activations and the whole batch's logits
/// kept for the backward) and two ranks with sharded weights (each layer's input kept, one
/// layer's activations and one chunk of logits at a time).
fn activations() {
    const LAYERS: usize = 4;
    let model = qwen3_width_model(LAYERS);
    println!("model: Qwen3-0.6B width, {LAYERS} layers; sequences of 96 tokens; 1 warm-up step, {STEPS} steps\n");
    println!(
        "| trainer | tokens per rank | peak RSS training GB | activations per token and layer KB |"
    );
    println!("| --- | --- | --- | --- |");
    for (label, sharding, world) in [("one rank", "-", 1), ("Full, 2 ranks", "full", 2)] {
        let mut first: Option<(f64, f64)> = None;
        for seqs in [4, 16] {
            let rss = run(&model, world, sharding, seqs)
                .iter()
                .map(|r| r["peak_rss"].as_f64().unwrap())
                .fold(0.0, f64::max);
            let tokens = (seqs * 96 / world) as f64;
            let per = match first {
                None => {
                    first = Some((tokens, rss));
                    "-".to_string()
                }
                Some((t0, r0)) => {
                    format!("{:.0}", (rss - r0) / (tokens - t0) / 1e3)
                }
            };
            println!("| {label} | {tokens} | {:.2} | {per} |", rss / 1e9);
        }
    }
}
