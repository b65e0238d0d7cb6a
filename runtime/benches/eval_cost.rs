//! What evaluation (`spec.eval`) and dynamic sampling (`algorithm.dynamicSampling`) cost a run of
//! the main recipe (examples/successor) per step, as ratios to the same run without them, and
//! how many extra groups dynamic sampling draws. Each variant is one `moult run` of the same
//! manifest, tasks, seed and binary, one after the other (this machine is noisy: compare the
//! ratios, not the seconds).
//!
//! `cargo bench -p moult-runtime --bench eval_cost [-- --steps N]` (after `source
//! scripts/env.sh`). Documented in docs/benchmarks.md.

mod common;

use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use serde_json::Value;

struct Variant {
    name: &'static str,
    /// Added to the manifest's `spec`.
    eval: bool,
    dynamic_sampling: bool,
}

const VARIANTS: [Variant; 3] = [
    Variant {
        name: "baseline",
        eval: false,
        dynamic_sampling: false,
    },
    Variant {
        name: "eval every 10 steps (16 tasks x 4 samples)",
        eval: true,
        dynamic_sampling: false,
    },
    Variant {
        name: "dynamic sampling",
        eval: false,
        dynamic_sampling: true,
    },
];

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let steps: u64 = args
        .iter()
        .position(|a| a == "--steps")
        .and_then(|i| args.get(i + 1)?.parse().ok())
        .unwrap_or(40);
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("bench-eval-cost");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let (recipe, manifest) = common::successor_manifest(None);
    let base: Value = serde_yaml_ng::from_str(&manifest).unwrap();
    let mut rows = Vec::new();
    for v in &VARIANTS {
        let mut run = base.clone();
        if v.eval {
            run["spec"]["eval"] = serde_json::json!({
                "dataset": {"path": recipe.join("eval.jsonl")},
                "intervalSteps": 10,
                "samples": 4,
            });
        }
        if v.dynamic_sampling {
            run["spec"]["algorithm"]["dynamicSampling"] = serde_json::json!({});
        }
        let name = v.name.split(' ').next().unwrap();
        let path = dir.join(format!("rlrun-{name}.yaml"));
        std::fs::write(&path, serde_json::to_string_pretty(&run).unwrap()).unwrap();
        let out = dir.join(name);
        eprintln!("running {} ({steps} steps) ...", v.name);
        let started = Instant::now();
        let status = Command::new(env!("CARGO_BIN_EXE_moult"))
            .arg("run")
            .arg(&path)
            .arg("--out")
            .arg(&out)
            .args(["--steps", &steps.to_string(), "--seed", "1", "--quiet"])
            .status()
            .unwrap();
        assert!(status.success(), "{}", v.name);
        let seconds = started.elapsed().as_secs_f64();
        let records = common::metrics_records(&out.join("metrics.jsonl"));
        assert_eq!(records.len() as u64, steps);
        let evals = std::fs::read_to_string(out.join("eval.jsonl"))
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str::<Value>(l).unwrap())
            .collect::<Vec<_>>();
        rows.push((v, seconds, records, evals));
    }
    let base_seconds = rows[0].1;
    let batch = base["spec"]["algorithm"]["batchSize"].as_u64().unwrap();
    println!("evaluation and dynamic sampling, {steps} steps of examples/successor (batchSize {batch}, groupSize 8), wall-clock of the whole `moult run` (start-up included) per step");
    println!("| variant | s/step | ratio to baseline | evaluations (s each) | groups drawn per trained group | reward: first 3 -> last 5 |");
    println!("| --- | --- | --- | --- | --- | --- |");
    for (v, seconds, records, evals) in &rows {
        let reward = |rs: &[Value]| {
            rs.iter()
                .map(|r| r["reward_mean"].as_f64().unwrap())
                .sum::<f64>()
                / rs.len() as f64
        };
        let filtered = records.last().unwrap()["groups_filtered"].as_u64().unwrap();
        let trained = batch * steps;
        let eval_seconds = evals
            .iter()
            .map(|e| e["eval_seconds"].as_f64().unwrap())
            .sum::<f64>()
            / evals.len().max(1) as f64;
        println!(
            "| {} | {:.2} | {:.2} | {} | {:.2} ({filtered} dropped) | {:.3} -> {:.3} |",
            v.name,
            seconds / steps as f64,
            seconds / base_seconds,
            if evals.is_empty() {
                "-".into()
            } else {
                format!("{} ({eval_seconds:.1})", evals.len())
            },
            (trained + filtered) as f64 / trained as f64,
            reward(&records[..3]),
            reward(&records[records.len() - 5..]),
        );
    }
}
