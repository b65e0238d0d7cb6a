//! Cluster mode's per-step overhead: the main recipe (examples/successor) run by `moult run` (every
//! role in one process) and by the cluster roles as separate processes (`moult engine`,
//! `moult coordinator`, `moult trainer`, `moult agents`) talking HTTP and the TCP weight stream
//! with the run's token, as they do in the operator's pods: the same manifest, steps and
//! binary, one after the other, compared as ratios (this machine is noisy).
//!
//! `cargo bench -p moult-runtime --bench cluster` (after `source scripts/env.sh`); `-- --quick`
//! for fewer steps. Documented in docs/benchmarks.md. What the Kubernetes side adds (apply to
//! first reward in the RLRun's status) is measured by the cluster end-to-end test.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use common::Outcome;

fn moult() -> Command {
    Command::new(env!("CARGO_BIN_EXE_moult"))
}

fn single_process(manifest: &Path, out: &Path, steps: u64) -> Outcome {
    let _ = std::fs::remove_dir_all(out);
    let started = Instant::now();
    let mut child = moult()
        .arg("run")
        .arg(manifest)
        .arg("--out")
        .arg(out)
        .args(["--steps", &steps.to_string(), "--seed", "0", "--quiet"])
        .spawn()
        .expect("run moult");
    let outcome = common::follow(&out.join("metrics.jsonl"), steps, started, &mut []);
    assert!(child.wait().unwrap().success(), "moult run failed");
    outcome
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let steps: u64 = if quick { 15 } else { 40 };
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("bench-cluster");
    std::fs::create_dir_all(&dir).unwrap();
    // One manifest for both, with this many steps (the trainer reads totalSteps from it;
    // `moult run` gets --steps too).
    let (recipe, manifest) = common::successor_manifest(None);
    let manifest = manifest
        .replace("totalSteps: 60", &format!("totalSteps: {steps}"))
        .replace("intervalSteps: 10", &format!("intervalSteps: {steps}"));
    let manifest_path = dir.join("rlrun.yaml");
    std::fs::write(&manifest_path, manifest).unwrap();

    let single = single_process(&manifest_path, &dir.join("single"), steps);
    let split = common::run_roles(
        &manifest_path,
        &recipe.join("model"),
        &recipe.join("tasks.jsonl"),
        &dir.join("roles"),
        steps,
        None,
    );
    // Steady state: the mean step time after the first three (start-up and warm-up).
    let per_step = |o: &Outcome| {
        let s: Vec<f64> = o.steps[3..]
            .iter()
            .map(|r| r["step_seconds"].as_f64().unwrap())
            .collect();
        s.iter().sum::<f64>() / s.len() as f64
    };
    let sync = |o: &Outcome| {
        o.steps[3..]
            .iter()
            .map(|r| r["sync_seconds"].as_f64().unwrap())
            .sum::<f64>()
            / (o.steps.len() - 3) as f64
    };
    let reward = |o: &Outcome| {
        let tail = &o.steps[o.steps.len().saturating_sub(5)..];
        let last = tail
            .iter()
            .map(|r| r["reward_mean"].as_f64().unwrap())
            .sum::<f64>()
            / tail.len() as f64;
        format!(
            "{:.3} -> {last:.3}",
            o.steps[0]["reward_mean"].as_f64().unwrap()
        )
    };
    println!(
        "cluster roles as processes vs moult run, {steps} steps of examples/successor (1 engine)"
    );
    println!("| mode | wall s | to first step s | s/step (after 3) | weight sync s/step | reward: first -> last 5 |");
    println!("| --- | --- | --- | --- | --- | --- |");
    for (name, o) in [
        ("moult run (one process)", &single),
        ("cluster roles (4 processes, HTTP + token)", &split),
    ] {
        println!(
            "| {name} | {:.1} | {:.1} | {:.3} | {:.3} | {} |",
            o.seconds,
            o.first_step,
            per_step(o),
            sync(o),
            reward(o)
        );
    }
    println!(
        "cluster mode's step time: {:.2}x moult run's ({:+.0} ms per step)",
        per_step(&split) / per_step(&single),
        (per_step(&split) - per_step(&single)) * 1000.0
    );
}
