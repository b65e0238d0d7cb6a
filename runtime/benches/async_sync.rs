//! Asynchronous vs synchronous RL, end to end (`moult run` vs `moult run --sync`), wall-clock to
//! the same reward on a workload with long-tailed episode lengths: the main recipe
//! (examples/successor) with tasks whose number of turns is long-tailed (most episodes take 1–3
//! turns, a few up to 16), as agentic episodes are. Synchronous RL waits for the slowest episode
//! of every batch and leaves the engine idle while training; asynchronous RL keeps generating
//! the next batch meanwhile (maxStaleness 1, partial rollout).
//!
//! `cargo bench -p moult-runtime --bench async_sync` (after `source scripts/env.sh`);
//! `-- --quick` for fewer steps. Both runs use the same seed, manifest and binary, one after the
//! other; the table compares them as ratios (this machine is noisy). Documented in
//! docs/benchmarks.md.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use rand::{Rng, SeedableRng};
use serde_json::Value;

/// Long-tailed turn counts: P(turns = k) ∝ k^-2 on 1..=16.
fn long_tail_tasks(n: usize, seed: u64) -> String {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let weights: Vec<f64> = (1..=16).map(|k| 1.0 / (k * k) as f64).collect();
    let total: f64 = weights.iter().sum();
    let mut out = String::new();
    for _ in 0..n {
        let mut u = rng.gen::<f64>() * total;
        let mut turns = 16;
        for (k, w) in weights.iter().enumerate() {
            if u < *w {
                turns = k + 1;
                break;
            }
            u -= w;
        }
        let numbers: Vec<u32> = (0..turns).map(|_| rng.gen_range(0..10)).collect();
        out += &serde_json::json!({ "numbers": numbers }).to_string();
        out.push('\n');
    }
    out
}

struct Outcome {
    seconds: f64,
    steps: Vec<Value>,
}

fn run(manifest: &Path, out: &Path, steps: u64, sync: bool) -> Outcome {
    let _ = std::fs::remove_dir_all(out);
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_moult"));
    cmd.arg("run").arg(manifest).arg("--out").arg(out).args([
        "--steps",
        &steps.to_string(),
        "--seed",
        "1",
        "--quiet",
    ]);
    if sync {
        cmd.arg("--sync");
    }
    let started = Instant::now();
    let status = cmd.status().expect("run moult");
    assert!(status.success(), "moult run failed");
    Outcome {
        seconds: started.elapsed().as_secs_f64(),
        steps: common::metrics_records(&out.join("metrics.jsonl")),
    }
}

/// Seconds (the run's own clock) until the mean reward of 3 consecutive steps reaches `target`.
fn time_to(steps: &[Value], target: f64) -> Option<f64> {
    steps.windows(3).find_map(|w| {
        let mean = w
            .iter()
            .map(|r| r["reward_mean"].as_f64().unwrap())
            .sum::<f64>()
            / 3.0;
        (mean >= target).then(|| w[2]["elapsed_seconds"].as_f64().unwrap())
    })
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let steps = if quick { 20 } else { 60 };
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("bench-async-sync");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("tasks.jsonl"), long_tail_tasks(512, 7)).unwrap();
    let (_, manifest) = common::successor_manifest(Some(&dir.join("tasks.jsonl")));
    let manifest = manifest.replace("maxTurns: 3", "maxTurns: 16");
    let manifest_path = dir.join("rlrun.yaml");
    std::fs::write(&manifest_path, manifest).unwrap();

    let a = run(&manifest_path, &dir.join("async"), steps, false);
    let s = run(&manifest_path, &dir.join("sync"), steps, true);
    let last = |o: &Outcome| {
        let tail = &o.steps[o.steps.len().saturating_sub(5)..];
        tail.iter()
            .map(|r| r["reward_mean"].as_f64().unwrap())
            .sum::<f64>()
            / tail.len() as f64
    };
    let first = |o: &Outcome| o.steps[0]["reward_mean"].as_f64().unwrap();
    // The target: halfway from the start to the lower of the two final rewards.
    let target = (first(&a).max(first(&s)) + last(&a).min(last(&s))) / 2.0;
    let per_step = |o: &Outcome| {
        o.steps.last().unwrap()["elapsed_seconds"].as_f64().unwrap() / o.steps.len() as f64
    };
    let staleness = |o: &Outcome| {
        o.steps
            .iter()
            .map(|r| r["staleness_mean"].as_f64().unwrap())
            .sum::<f64>()
            / o.steps.len() as f64
    };
    println!("async vs sync RL, {steps} steps of examples/successor with long-tailed turns (1-16, P(k) ~ 1/k^2)");
    println!("| mode | wall s | s/step | reward: first -> last 5 | time to reward {target:.2} | mean staleness |");
    println!("| --- | --- | --- | --- | --- | --- |");
    for (name, o) in [
        ("async (maxStaleness 1, partial rollout)", &a),
        ("sync (--sync)", &s),
    ] {
        println!(
            "| {name} | {:.0} | {:.2} | {:.3} -> {:.3} | {} | {:.2} |",
            o.seconds,
            per_step(o),
            first(o),
            last(o),
            time_to(&o.steps, target).map_or("not reached".into(), |t| format!("{t:.0} s")),
            staleness(o)
        );
    }
    println!(
        "speed-up per step: {:.2}x; to reward {target:.2}: {}",
        per_step(&s) / per_step(&a),
        match (time_to(&a.steps, target), time_to(&s.steps, target)) {
            (Some(ta), Some(ts)) => format!("{:.2}x", ts / ta),
            _ => "n/a (a run did not reach it)".into(),
        }
    );
}
