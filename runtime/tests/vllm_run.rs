//! `moult run` with vLLM engines: the successor recipe's vLLM variant
//! (examples/successor/rlrun-vllm.yaml) learns as it does on the built-in engine. The real binary
//! starts a real vLLM server (the pinned CPU build), generates every episode on it through the
//! router, and publishes each step's weights through the Filesystem transport (safetensors under
//! `<out>/weights`, reloaded by vLLM between pause and resume).
//!
//! Needs `MOULT_VLLM_PYTHON` (scripts/test.sh sets it).

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

/// `moult run` of the successor recipe's `manifest` (on model-hd32, made first) for `steps` steps
/// into `<target tmp>/<out>`: the output folder and the step records. One at a time: each starts
/// a vLLM server, and both make the same model folder.
fn run_recipe(manifest: &str, out: &str, steps: usize) -> (PathBuf, Vec<Value>) {
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let recipe = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/successor");
    let status = Command::new(common::python())
        .arg(recipe.join("make_model.py"))
        .arg(recipe.join("model-hd32"))
        .args(["--head-dim", "32"])
        .status()
        .expect("run make_model.py");
    assert!(status.success(), "make_model.py --head-dim 32 failed");
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join(out);
    let _ = std::fs::remove_dir_all(&out);
    let status = common::moult()
        .arg("run")
        .arg(recipe.join(manifest))
        .args(["--out".as_ref(), out.as_os_str()])
        .args(["--steps", &steps.to_string(), "--seed", "1", "--quiet"])
        .status()
        .unwrap();
    let log = std::fs::read_to_string(out.join("moult.log")).unwrap_or_default();
    assert!(status.success(), "moult run failed; its log:\n{log}");
    let records: Vec<Value> = std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).expect("metrics lines are JSON"))
        .collect();
    assert_eq!(records.len(), steps);
    (out, records)
}

#[test]
fn vllm_successor_recipe_learns_under_moult_run() {
    assert!(
        std::env::var_os("MOULT_VLLM_PYTHON").is_some(),
        "MOULT_VLLM_PYTHON is not set: install the pinned vLLM with `bash scripts/setup-vllm.sh` \
         and set it to the python that prints (scripts/test.sh does both)"
    );
    const STEPS: usize = 40;
    let (out, records) = run_recipe("rlrun-vllm.yaml", "vllm-run", STEPS);
    let rewards: Vec<f64> = records
        .iter()
        .map(|r| r["reward_mean"].as_f64().unwrap())
        .collect();
    let last5 = rewards[STEPS - 5..].iter().sum::<f64>() / 5.0;
    println!("rewards: {rewards:?}");
    assert!(
        rewards[0] <= 0.4,
        "the base starts near chance: {rewards:?}"
    );
    assert!(
        last5 >= 0.85,
        "the last five steps average {last5}: {rewards:?}"
    );
    // Every step published a version, and only the newest folder is kept.
    for (i, r) in records.iter().enumerate() {
        assert_eq!(r["policy_version"].as_u64(), Some(i as u64 + 1));
        assert!(r["sync_seconds"].as_f64().unwrap() > 0.0);
    }
    let folders: Vec<String> = std::fs::read_dir(out.join("weights"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(folders, [format!("v{STEPS}")]);
    // vLLM served the episodes: its log is beside the run's.
    let vllm_log = std::fs::read_to_string(out.join("vllm-0.log")).unwrap();
    assert!(vllm_log.contains("/inference/v1/generate"), "{vllm_log}");
    let _ = std::fs::remove_dir_all(&out);
}

/// A LoRA run on vLLM engines (examples/successor/rlrun-vllm-lora.yaml, docs/lora.md): vLLM
/// runs with `--enable-lora`; each step's adapter is written as a PEFT folder and loaded under a
/// new name, `<run>-v<N>`, which the run's requests then name, the version before the previous
/// unloaded. On step 1 vLLM's logprobs with the adapter are the trainer's; the reward rises.
#[test]
fn vllm_lora_run_loads_each_version_as_a_new_adapter_and_learns() {
    const STEPS: usize = 25;
    let (out, records) = run_recipe("rlrun-vllm-lora.yaml", "vllm-lora-run", STEPS);
    let log_rho = records[0]["mean_abs_log_rho"].as_f64().unwrap();
    assert!(
        log_rho < 1e-4,
        "vLLM with the adapter and the trainer agree on step 1: {log_rho}"
    );
    let rewards: Vec<f64> = (records.iter())
        .map(|r| r["reward_mean"].as_f64().unwrap())
        .collect();
    let (first, last5) = (rewards[0], rewards[STEPS - 5..].iter().sum::<f64>() / 5.0);
    println!("rewards: {rewards:?}");
    assert!(
        first <= 0.4 && last5 >= first + 0.3,
        "the reward rises: {rewards:?}"
    );
    // The newest versions' folders stay (vLLM may read one again while it holds it).
    let mut folders: Vec<String> = std::fs::read_dir(out.join("weights"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    folders.sort();
    let newest: Vec<String> = (STEPS - 3..=STEPS)
        .map(|v| format!("successor-vllm-lora-v{v}"))
        .collect();
    assert_eq!(folders, newest);
    let vllm_log = std::fs::read_to_string(out.join("vllm-0.log")).unwrap();
    for route in ["/v1/load_lora_adapter", "/v1/unload_lora_adapter"] {
        assert!(vllm_log.contains(route), "vLLM served {route}");
    }
    let _ = std::fs::remove_dir_all(&out);
}
