//! Asynchronous vs synchronous RL, end to end (maxStaleness 1 and 2 with partial rollout vs 0), wall-clock to
//! the same reward on a workload with long-tailed episode lengths: the main recipe
//! (examples/successor) with tasks whose number of turns is long-tailed (most episodes take 1–3
//! turns, a few up to 16), as agentic episodes are. Synchronous RL waits for the slowest episode
//! of every batch and leaves the engine idle while training; asynchronous RL keeps generating
//! the next batch meanwhile (maxStaleness 1, partial rollout).
//!
//! The roles run as separate processes (the cluster's `moult engine`, `moult coordinator`,
//! `moult trainer`, `moult agents`), first pinned to separate CPUs, engine on one and trainer on
//! the other, as generation and training on separate devices are, then not pinned, for contrast;
//! every run reports how busy its engines and trainer were.
//!
//! `cargo bench -p moult-runtime --bench async_sync` (after `source scripts/env.sh`);
//! `-- --quick` for fewer steps, `-- --steps N` for N. All runs use the same manifest, tasks and binary, one after the
//! other; the table compares them as ratios (this machine is noisy). Documented in
//! docs/benchmarks.md.

mod common;

use std::path::PathBuf;

use common::{Outcome, Pinning};
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

/// Seconds of the run's own clock after its first step. The first step is the same in every
/// mode (processes start, engines warm up, env processes start, the first batch is generated
/// from nothing and trained on) and takes several seconds: counting it would dilute what the
/// modes differ in, how steps overlap once the run is going.
fn after_first(steps: &[Value], i: usize) -> f64 {
    steps[i]["elapsed_seconds"].as_f64().unwrap() - steps[0]["elapsed_seconds"].as_f64().unwrap()
}

/// Seconds after the first step until the mean reward of 3 consecutive steps reaches `target`.
fn time_to(steps: &[Value], target: f64) -> Option<f64> {
    (2..steps.len()).find_map(|i| {
        let mean = steps[i - 2..=i]
            .iter()
            .map(|r| r["reward_mean"].as_f64().unwrap())
            .sum::<f64>()
            / 3.0;
        (mean >= target).then(|| after_first(steps, i))
    })
}

/// How a run overlaps generation and training.
struct Mode {
    name: &'static str,
    max_staleness: u32,
    partial_rollout: bool,
}

const MODES: [Mode; 3] = [
    Mode {
        name: "async, maxStaleness 1, partial rollout",
        max_staleness: 1,
        partial_rollout: true,
    },
    Mode {
        name: "async, maxStaleness 2, partial rollout",
        max_staleness: 2,
        partial_rollout: true,
    },
    Mode {
        name: "sync (maxStaleness 0, no partial rollout)",
        max_staleness: 0,
        partial_rollout: false,
    },
];

/// The engine on CPU 0, the trainer on CPU 1, as two devices would hold them; the coordinator
/// and the agents beside the engine (see docs/benchmarks.md for why).
const PINNED: Pinning = Pinning {
    engine: "0",
    trainer: "1",
    rest: "0",
};

fn mean_of(o: &Outcome, field: &str) -> f64 {
    o.steps
        .iter()
        .map(|r| r[field].as_f64().unwrap_or(0.0))
        .sum::<f64>()
        / o.steps.len().max(1) as f64
}

/// The mean of `field` over the steps, each weighted by its wall-clock.
fn time_weighted(o: &Outcome, field: &str) -> f64 {
    let total: f64 = o
        .steps
        .iter()
        .map(|r| r["step_seconds"].as_f64().unwrap())
        .sum();
    o.steps
        .iter()
        .map(|r| r[field].as_f64().unwrap_or(0.0) * r["step_seconds"].as_f64().unwrap())
        .sum::<f64>()
        / total.max(1e-9)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    // `--steps N` for a smoke test of the bench itself.
    let steps: u64 = args
        .iter()
        .position(|a| a == "--steps")
        .and_then(|i| args.get(i + 1)?.parse().ok())
        .unwrap_or(if quick { 20 } else { 60 });
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("bench-async-sync");
    std::fs::create_dir_all(&dir).unwrap();
    let tasks = dir.join("tasks.jsonl");
    std::fs::write(&tasks, long_tail_tasks(512, 7)).unwrap();
    let (recipe, manifest) = common::successor_manifest(Some(&tasks));
    let manifest = manifest
        .replace("maxTurns: 3", "maxTurns: 16")
        .replace("totalSteps: 60", &format!("totalSteps: {steps}"))
        .replace("intervalSteps: 10", &format!("intervalSteps: {steps}"));
    let mut runs = Vec::new();
    for (pinning, pinned) in [(Some(PINNED), "pinned"), (None, "not pinned")] {
        for mode in &MODES {
            let text = manifest.replace(
                "maxStaleness: 1",
                &format!(
                    "maxStaleness: {}\n    partialRollout: {}",
                    mode.max_staleness, mode.partial_rollout
                ),
            );
            let name = format!("{}-{}", mode.max_staleness, pinned.replace(' ', "-"));
            let path = dir.join(format!("rlrun-{name}.yaml"));
            std::fs::write(&path, text).unwrap();
            eprintln!("running {} ({pinned}) ...", mode.name);
            let outcome = common::run_roles(
                &path,
                &recipe.join("model"),
                &tasks,
                &dir.join(&name),
                steps,
                pinning,
            );
            runs.push((mode, pinned, outcome));
        }
    }
    let last = |o: &Outcome| {
        let tail = &o.steps[o.steps.len().saturating_sub(5)..];
        tail.iter()
            .map(|r| r["reward_mean"].as_f64().unwrap())
            .sum::<f64>()
            / tail.len() as f64
    };
    let first = |o: &Outcome| o.steps[0]["reward_mean"].as_f64().unwrap();
    // The target: halfway from the highest start to the lowest final reward of all runs.
    let start = runs
        .iter()
        .map(|(_, _, o)| first(o))
        .fold(f64::MIN, f64::max);
    let end = runs
        .iter()
        .map(|(_, _, o)| last(o))
        .fold(f64::MAX, f64::min);
    let target = (start + end) / 2.0;
    // Wall-clock per step after the first (see `after_first`).
    let per_step =
        |o: &Outcome| after_first(&o.steps, o.steps.len() - 1) / (o.steps.len() - 1).max(1) as f64;
    println!("async vs sync RL, cluster roles as processes, {steps} steps of examples/successor with long-tailed turns (1-16, P(k) ~ 1/k^2); s/step and time to reward count from the end of step 1 (startup: {})", runs.iter().map(|(_, _, o)| format!("{:.1}", o.steps[0]["elapsed_seconds"].as_f64().unwrap())).collect::<Vec<_>>().join(", ") + " s");
    println!("| mode | CPUs | s/step | reward: first -> last 5 | time to reward {target:.2} | engines busy | trainer busy | train s/step | sync s/step | paused s/step | mean staleness |");
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    for (mode, pinned, o) in &runs {
        println!(
            "| {} | {pinned} | {:.2} | {:.3} -> {:.3} | {} | {:.2} | {:.2} | {:.3} | {:.3} | {:.3} | {:.2} |",
            mode.name,
            per_step(o),
            first(o),
            last(o),
            time_to(&o.steps, target).map_or("not reached".into(), |t| format!("{t:.0} s")),
            time_weighted(o, "engine_busy_fraction"),
            time_weighted(o, "trainer_busy_fraction"),
            mean_of(o, "train_seconds"),
            mean_of(o, "sync_seconds"),
            mean_of(o, "engine_paused_seconds"),
            mean_of(o, "staleness_mean"),
        );
    }
    for pinned in ["pinned", "not pinned"] {
        let of = |staleness: u32| {
            runs.iter()
                .find(|(m, p, _)| m.max_staleness == staleness && *p == pinned)
                .map(|(_, _, o)| o)
                .unwrap()
        };
        let sync = of(0);
        for staleness in [1, 2] {
            let a = of(staleness);
            println!(
                "{pinned}: async (maxStaleness {staleness}) vs sync: {:.2}x per step; to reward {target:.2}: {}",
                per_step(sync) / per_step(a),
                match (time_to(&a.steps, target), time_to(&sync.steps, target)) {
                    (Some(ta), Some(ts)) => format!("{:.2}x", ts / ta),
                    _ => "n/a (a run did not reach it)".into(),
                }
            );
        }
    }
}
