//! Checkpoints of a run: the policy's weights, the optimizer's moments, the data cursor, the
//! policy version and the run's seed, so a restarted run continues where the last checkpoint
//! left it, with versions that keep increasing.
//!
//! Layout under the checkpoint folder:
//! - `step-NNNNNN/`: a complete Hugging Face model folder (`model.safetensors`, the source
//!   model's `config.json`, tokenizer and chat template, so `moult engine --model` serves it),
//!   plus `optimizer.safetensors` (`m.I`/`v.I` per trainable tensor) and `moult.json`
//!   ([`CheckpointMeta`]);
//! - `latest.json`: which step folder is the newest complete one.
//!
//! Writes are atomic: the folder is written under a temporary name, synced, renamed, and only
//! then does `latest.json` (itself written and renamed) point at it. A run killed at any moment
//! leaves the previous checkpoint intact.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use tch::Tensor;

use super::files::{io, sync_file, write_atomic};
use super::RunError;
use crate::rollout::RolloutState;
use crate::trainer::train::Trainer;

/// The model folder's files a checkpoint carries along, so it is servable as it is.
const MODEL_FILES: [&str; 6] = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
];

/// Checkpoints kept; older ones are deleted once a newer one is complete.
const KEEP: usize = 2;

/// What a checkpoint says about the run besides tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckpointMeta {
    /// Training steps done.
    pub step: u64,
    /// The policy version the weights are.
    pub policy_version: u64,
    /// Where the data cursor stood (groups in flight at that moment are not replayed).
    pub rollout: RolloutState,
    /// The run's seed: with the cursor it fixes the task order of every later epoch.
    pub seed: u64,
}

fn step_dir(root: &Path, step: u64) -> PathBuf {
    root.join(format!("step-{step:06}"))
}

/// Writes a checkpoint of `trainer` (whose model came from `model_dir`) under `root`; returns
/// its folder.
pub fn save(
    root: &Path,
    model_dir: &Path,
    trainer: &Trainer,
    meta: &CheckpointMeta,
) -> Result<PathBuf, RunError> {
    std::fs::create_dir_all(root).map_err(|e| io("creating", root, e))?;
    let dir = step_dir(root, meta.step);
    let tmp = root.join(format!(".step-{:06}.tmp{}", meta.step, std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).map_err(|e| io("creating", &tmp, e))?;
    let weights = trainer.weights();
    let model_file = tmp.join("model.safetensors");
    Tensor::write_safetensors(&weights, &model_file).map_err(|e| io("writing", &model_file, e))?;
    let moments: Vec<(String, Tensor)> = trainer
        .moments()
        .iter()
        .enumerate()
        .flat_map(|(i, (m, v))| {
            [
                (format!("m.{i}"), m.shallow_clone()),
                (format!("v.{i}"), v.shallow_clone()),
            ]
        })
        .collect();
    let optim_file = tmp.join("optimizer.safetensors");
    Tensor::write_safetensors(&moments, &optim_file).map_err(|e| io("writing", &optim_file, e))?;
    for name in MODEL_FILES {
        let src = model_dir.join(name);
        if src.is_file() {
            std::fs::copy(&src, tmp.join(name)).map_err(|e| io("copying", &src, e))?;
        }
    }
    let meta_file = tmp.join("moult.json");
    std::fs::write(
        &meta_file,
        serde_json::to_vec_pretty(meta).expect("meta serializes"),
    )
    .map_err(|e| io("writing", &meta_file, e))?;
    for entry in std::fs::read_dir(&tmp).map_err(|e| io("listing", &tmp, e))? {
        let path = entry.map_err(|e| io("listing", &tmp, e))?.path();
        sync_file(&path)?;
    }
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::rename(&tmp, &dir).map_err(|e| io("renaming", &tmp, e))?;
    let pointer = serde_json::json!({"step": meta.step, "path": dir.file_name().map(|n| n.to_string_lossy().into_owned())});
    write_atomic(&root.join("latest.json"), pointer.to_string().as_bytes())?;
    prune(root, meta.step);
    Ok(dir)
}

/// Deletes all but the newest [`KEEP`] complete checkpoints (never `latest`), and leftovers of
/// interrupted writes.
fn prune(root: &Path, latest: u64) {
    let Ok(entries) = std::fs::read_dir(root) else {
        return;
    };
    let mut steps: Vec<u64> = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with(".step-") {
            let _ = std::fs::remove_dir_all(entry.path());
        } else if let Some(step) = name.strip_prefix("step-").and_then(|s| s.parse().ok()) {
            steps.push(step);
        }
    }
    steps.sort_unstable();
    steps.retain(|&s| s != latest);
    let drop = steps.len().saturating_sub(KEEP - 1);
    for step in &steps[..drop] {
        let _ = std::fs::remove_dir_all(step_dir(root, *step));
    }
}

/// The newest complete checkpoint under `root`, if any.
pub fn latest(root: &Path) -> Result<Option<(PathBuf, CheckpointMeta)>, RunError> {
    let pointer = root.join("latest.json");
    let text = match std::fs::read_to_string(&pointer) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io("reading", &pointer, e)),
    };
    let v: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| io("parsing", &pointer, e))?;
    let name = v["path"]
        .as_str()
        .ok_or_else(|| io("reading", &pointer, "no `path`"))?;
    let dir = root.join(name);
    let meta_file = dir.join("moult.json");
    let meta: CheckpointMeta = std::fs::read(&meta_file)
        .map_err(|e| io("reading", &meta_file, e))
        .and_then(|b| serde_json::from_slice(&b).map_err(|e| io("parsing", &meta_file, e)))?;
    Ok(Some((dir, meta)))
}

/// The optimizer moments of the checkpoint in `dir`, in trainable-tensor order.
pub fn load_moments(dir: &Path, device: tch::Device) -> Result<Vec<(Tensor, Tensor)>, RunError> {
    let file = dir.join("optimizer.safetensors");
    let mut named: std::collections::HashMap<String, Tensor> = Tensor::read_safetensors(&file)
        .map_err(|e| io("reading", &file, e))?
        .into_iter()
        .collect();
    let count = named.len() / 2;
    (0..count)
        .map(|i| {
            let mut take = |k: &str| {
                named
                    .remove(&format!("{k}.{i}"))
                    .map(|t| t.to_device(device))
                    .ok_or_else(|| io("reading", &file, format!("no tensor `{k}.{i}`")))
            };
            Ok((take("m")?, take("v")?))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prune_keeps_the_newest_and_clears_interrupted_writes() {
        let root = std::env::temp_dir().join(format!("moult-ckpt-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        for step in [5, 10, 15, 20] {
            std::fs::create_dir_all(step_dir(&root, step)).unwrap();
        }
        std::fs::create_dir_all(root.join(".step-000025.tmp1")).unwrap();
        prune(&root, 20);
        let mut left: Vec<String> = std::fs::read_dir(&root)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        assert_eq!(left, vec!["step-000015", "step-000020"]);
        std::fs::remove_dir_all(&root).unwrap();
    }
}
