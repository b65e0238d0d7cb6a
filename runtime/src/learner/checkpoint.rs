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
//! A LoRA run's `step-NNNNNN/` holds its adapter in PEFT's layout instead of `model.safetensors`
//! (`adapter_model.safetensors`, `adapter_config.json` naming the base model's folder;
//! docs/lora.md): PEFT, vLLM and moult load it onto the base model.
//!
//! A trainer of several ranks whose weights are sharded (`sharding: Full`) writes no
//! `model.safetensors` or `optimizer.safetensors`: each rank writes its shards, with no gather,
//! to `shards/rank-R-of-N.safetensors`, and rank 0 writes `shards/layout.json`
//! ([`crate::trainer::train::ShardLayout`]). Loading puts the whole tensors back together, so
//! any number of ranks resumes from it; [`export`] writes the model folder engines serve
//! (docs/distributed.md, "Checkpoints").
//!
//! Writes are atomic: the folder is written under a temporary name, synced, renamed (and the
//! rename synced), and only then does `latest.json` (itself written and renamed) point at it. A
//! run killed at any moment leaves the previous checkpoint intact. A save that fails (a full
//! disk) removes its partial folder, prunes older checkpoints down to the newest and tries once
//! more; the newest complete checkpoint is never deleted. When `latest.json` names a folder that
//! is gone or incomplete, [`latest`] falls back to the newest complete `step-*` folder.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use tch::Tensor;

use crate::error::{Result, RunError};
use crate::model::{lora, CausalLm, ModelConfig};
use crate::records::files::{io, numbered, sync, write_atomic};
use crate::rollout::RolloutState;
use crate::trainer::ranks::SHARDS;
use crate::trainer::train::{ShardLayout, Trainer, Whole};

/// The model folder's files a checkpoint carries along, so it is servable as it is.
const MODEL_FILES: [&str; 7] = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
    // A vision-language model's image preprocessing (docs/vision.md).
    "preprocessor_config.json",
];

/// The layout of a sharded checkpoint, in its `shards/` folder.
const LAYOUT: &str = "layout.json";

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
/// its folder. A failed write (a full disk) is tried once more after pruning older checkpoints
/// down to the newest complete one.
pub fn save(
    root: &Path,
    model_dir: &Path,
    trainer: &Trainer,
    meta: &CheckpointMeta,
) -> Result<PathBuf> {
    std::fs::create_dir_all(root).map_err(|e| io("creating", root, e))?;
    let dir = step_dir(root, meta.step);
    let tmp = root.join(format!(".step-{:06}.tmp{}", meta.step, std::process::id()));
    let write = || write_folder(&tmp, &dir, |tmp| fill(tmp, model_dir, trainer, meta));
    if let Err(first) = write() {
        let Some((_, newest)) = latest(root).ok().flatten() else {
            return Err(first);
        };
        tracing::warn!("{first}; pruning older checkpoints and trying again");
        prune(root, newest.step, 1);
        write()?;
    }
    sync(root)?;
    let pointer = serde_json::json!({"step": meta.step, "path": dir.file_name().map(|n| n.to_string_lossy().into_owned())});
    write_atomic(&root.join("latest.json"), pointer.to_string().as_bytes())?;
    prune(root, meta.step, KEEP);
    Ok(dir)
}

/// A checkpoint's files in `tmp`: the weights and moments (whole, or this rank's shards and
/// the others'), the model's files and the metadata.
fn fill(tmp: &Path, model_dir: &Path, trainer: &Trainer, meta: &CheckpointMeta) -> Result<()> {
    if trainer.weights_sharded() {
        let layout = trainer.save_shards(tmp)?;
        write_json(&tmp.join(SHARDS).join(LAYOUT), &layout)?;
        sync(&tmp.join(SHARDS))?;
    } else {
        let weights = trainer.weights().map_err(crate::model::Error::from)?;
        lora::write_weights(tmp, trainer.model(), model_dir, &weights)?;
        let moments = trainer.moments().map_err(crate::model::Error::from)?;
        let moments: Vec<(String, Tensor)> = (moments.into_iter().enumerate())
            .flat_map(|(i, (m, v))| [(format!("m.{i}"), m), (format!("v.{i}"), v)])
            .collect();
        write_tensors(&tmp.join("optimizer.safetensors"), &moments)?;
    }
    copy_model_files(model_dir, tmp)?;
    write_json(&tmp.join("moult.json"), meta)
}

/// Fills the folder `tmp` with `fill`, syncs its files and itself, and renames it to `dest`
/// (replacing it): `dest` appears complete or not at all. A failed write removes `tmp`.
fn write_folder(tmp: &Path, dest: &Path, fill: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let _ = std::fs::remove_dir_all(tmp);
    let written = (|| {
        std::fs::create_dir_all(tmp).map_err(|e| io("creating", tmp, e))?;
        fill(tmp)?;
        for entry in std::fs::read_dir(tmp).map_err(|e| io("listing", tmp, e))? {
            let path = entry.map_err(|e| io("listing", tmp, e))?.path();
            // The shard files are synced by the ranks that wrote them, their folder above.
            if path.is_file() {
                sync(&path)?;
            }
        }
        sync(tmp)?;
        let _ = std::fs::remove_dir_all(dest);
        std::fs::rename(tmp, dest).map_err(|e| io("renaming", tmp, e))
    })();
    if written.is_err() {
        let _ = std::fs::remove_dir_all(tmp);
    }
    written
}

fn write_tensors(file: &Path, tensors: &[(String, Tensor)]) -> Result<()> {
    Tensor::write_safetensors(tensors, file).map_err(|e| io("writing", file, e))
}

/// Copies the [`MODEL_FILES`] `from` has into `to`.
fn copy_model_files(from: &Path, to: &Path) -> Result<()> {
    for name in MODEL_FILES {
        let src = from.join(name);
        if src.is_file() {
            std::fs::copy(&src, to.join(name)).map_err(|e| io("copying", &src, e))?;
        }
    }
    Ok(())
}

/// Deletes all but the newest `keep` complete checkpoints (never `latest`), and leftovers of
/// interrupted writes.
fn prune(root: &Path, latest: u64, keep: usize) {
    let Ok(entries) = std::fs::read_dir(root) else {
        return;
    };
    for entry in entries.flatten() {
        if entry.file_name().to_string_lossy().starts_with(".step-") {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
    let mut steps = step_folders(root);
    steps.retain(|&s| s != latest);
    let drop = steps.len().saturating_sub(keep.saturating_sub(1));
    for step in &steps[..drop] {
        let _ = std::fs::remove_dir_all(step_dir(root, *step));
    }
}

/// The newest complete checkpoint under `root`, if any: the one `latest.json` names, or, when
/// that folder is gone or incomplete (deleted by hand, a disk that lost it), the newest complete
/// `step-*` folder, with a warning.
pub fn latest(root: &Path) -> Result<Option<(PathBuf, CheckpointMeta)>> {
    let pointer = root.join("latest.json");
    let text = match std::fs::read_to_string(&pointer) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io("reading", &pointer, e)),
    };
    let named = serde_json::from_str::<serde_json::Value>(&text)
        .map_err(|e| io("parsing", &pointer, e))
        .and_then(|v| {
            let name = v["path"].as_str();
            complete(&root.join(name.ok_or_else(|| io("reading", &pointer, "no `path`"))?))
        });
    let why = match named {
        Ok(found) => return Ok(Some(found)),
        Err(RunError::Checkpoint(why)) => why,
        Err(why) => why.to_string(),
    };
    let mut newest = step_folders(root).into_iter().rev();
    let Some((dir, meta)) = newest.find_map(|step| complete(&step_dir(root, step)).ok()) else {
        return Err(RunError::Checkpoint(format!(
            "{why}, and no other complete checkpoint is under {}",
            root.display()
        )));
    };
    let shown = dir.display();
    tracing::warn!("{why}; resuming from {shown}, the newest complete checkpoint");
    Ok(Some((dir, meta)))
}

/// The model folder `dir` names for serving, and its checkpoint metadata: a checkpoint folder
/// (`step-N`), a checkpoint root (its newest complete checkpoint), or any model folder (no
/// metadata).
pub fn model_folder(dir: &Path) -> Result<(PathBuf, Option<CheckpointMeta>)> {
    let (latest, config) = (dir.join("latest.json"), dir.join("config.json"));
    if !latest.is_file() && !config.is_file() {
        let why = format!("{} is neither a model folder (no config.json) nor a checkpoint folder (no latest.json)", dir.display());
        return Err(RunError::Checkpoint(why));
    }
    if !latest.is_file() && !dir.join("moult.json").is_file() {
        return Ok((dir.to_path_buf(), None));
    }
    let (found, meta) = checkpoint_at(dir)?;
    // No engine loads shards as they are.
    if let Some(layout) = sharded(&found)? {
        let (found, world, dir) = (found.display(), layout.world, dir.display());
        return Err(RunError::Checkpoint(format!(
            "{found} is a checkpoint written in shards by {world} trainer ranks; `moult export \
             {dir} OUT` writes a model folder engines serve (docs/distributed.md, \"Checkpoints\")"
        )));
    }
    Ok((found, Some(meta)))
}

/// The checkpoint `dir` names: a checkpoint root's newest complete one, or `dir` itself.
fn checkpoint_at(dir: &Path) -> Result<(PathBuf, CheckpointMeta)> {
    if dir.join("latest.json").is_file() {
        return latest(dir)?.ok_or_else(|| {
            RunError::Checkpoint(format!("no complete checkpoint under {}", dir.display()))
        });
    }
    complete(dir)
}

/// The layout of the sharded checkpoint in `dir`; `None` for a checkpoint of whole tensors.
fn sharded(dir: &Path) -> Result<Option<ShardLayout>> {
    let file = dir.join(SHARDS).join(LAYOUT);
    file.is_file().then(|| read_json(&file)).transpose()
}

fn write_json(file: &Path, value: &impl Serialize) -> Result<()> {
    let json = serde_json::to_vec_pretty(value).expect("plain data serializes");
    std::fs::write(file, json).map_err(|e| io("writing", file, e))
}

fn read_json<T: serde::de::DeserializeOwned>(file: &Path) -> Result<T> {
    let bytes = std::fs::read(file).map_err(|e| io("reading", file, e))?;
    serde_json::from_slice(&bytes).map_err(|e| io("parsing", file, e))
}

/// The weights by checkpoint name and the optimizer's moments (empty before the first step) of
/// the checkpoint in `dir`, whole, however many ranks wrote it.
fn load_tensors(dir: &Path) -> Result<Whole> {
    let Some(layout) = sharded(dir)? else {
        return Ok((lora::merged_weights(dir)?, load_moments(dir)?));
    };
    let files = (0..layout.world)
        .map(|rank| read_tensors(&dir.join(SHARDS).join(layout.file_name(rank))))
        .collect::<Result<_, _>>()?;
    (layout.unshard(files)).map_err(|e| RunError::Checkpoint(format!("{}: {e}", dir.display())))
}

/// The policy and the optimizer's moments of the checkpoint in `dir`, in `kind` on `device`.
pub fn load_policy(
    dir: &Path,
    kind: tch::Kind,
    device: tch::Device,
) -> Result<(CausalLm, Vec<(Tensor, Tensor)>)> {
    let (model, moments) = if sharded(dir)?.is_none() {
        (CausalLm::load(dir, kind, device)?, load_moments(dir)?)
    } else {
        let (weights, moments) = load_tensors(dir)?;
        let weights = (weights.into_iter())
            .map(|(n, t)| (n, t.to_kind(kind).to_device(device)))
            .collect();
        let cfg = ModelConfig::from_dir(dir)?;
        (CausalLm::from_weights(cfg, weights, kind, device)?, moments)
    };
    let to = |(m, v): (Tensor, Tensor)| (m.to_device(device), v.to_device(device));
    Ok((model, moments.into_iter().map(to).collect()))
}

/// Writes the policy of a checkpoint (`src`: a `step-N` folder, or a checkpoint root for its
/// newest) to `out` as a model folder engines serve: `model.safetensors` with whole tensors (a
/// LoRA run's adapter merged into its base) and the model's config and tokenizer files. Returns
/// the checkpoint's folder. `out` must not exist yet; it appears complete or not at all.
pub fn export(src: &Path, out: &Path) -> Result<PathBuf> {
    let (dir, _) = checkpoint_at(src)?;
    if out.exists() {
        let why = format!("{} exists; export writes a new folder", out.display());
        return Err(RunError::Checkpoint(why));
    }
    let (weights, _) = load_tensors(&dir)?;
    let name = out
        .file_name()
        .map_or_else(|| "export".into(), |n| n.to_string_lossy().into_owned());
    let tmp = out.with_file_name(format!(".{name}.tmp{}", std::process::id()));
    write_folder(&tmp, out, |tmp| {
        write_tensors(&tmp.join("model.safetensors"), &weights)?;
        copy_model_files(&dir, tmp)
    })?;
    Ok(dir)
}

/// The checkpoint in `dir` if it is complete (its metadata and its tensor files: the model's
/// and the optimizer's, or every rank's shard file and their layout).
fn complete(dir: &Path) -> Result<(PathBuf, CheckpointMeta)> {
    // Joined to `dir`, an absolute path stays as it is.
    let files: Vec<PathBuf> = match sharded(dir)? {
        Some(layout) => (0..layout.world)
            .map(|rank| dir.join(SHARDS).join(layout.file_name(rank)))
            .collect(),
        None => [lora::weights_file(dir), "optimizer.safetensors"]
            .map(PathBuf::from)
            .into(),
    };
    if let Some(file) = files.into_iter().find(|f| !dir.join(f).is_file()) {
        let (dir, file) = (dir.display(), file.display());
        return Err(RunError::Checkpoint(format!("{dir} has no {file}")));
    }
    Ok((dir.to_path_buf(), read_json(&dir.join("moult.json"))?))
}

/// The steps of the `step-*` folders under `root`, ascending.
fn step_folders(root: &Path) -> Vec<u64> {
    let folders = numbered(root, "step-", "").unwrap_or_default();
    folders.into_iter().map(|(step, _)| step).collect()
}

/// The optimizer moments of the checkpoint in `dir`, in trainable-tensor order.
fn load_moments(dir: &Path) -> Result<Vec<(Tensor, Tensor)>> {
    let file = dir.join("optimizer.safetensors");
    let mut named: HashMap<String, Tensor> = read_tensors(&file)?.into_iter().collect();
    (0..named.len() / 2)
        .map(|i| {
            let mut take = |key: String| {
                let missing = || io("reading", &file, format!("no tensor `{key}`"));
                named.remove(&key).ok_or_else(missing)
            };
            Ok((take(format!("m.{i}"))?, take(format!("v.{i}"))?))
        })
        .collect()
}

fn read_tensors(file: &Path) -> Result<Vec<(String, Tensor)>> {
    Tensor::read_safetensors(file).map_err(|e| io("reading", file, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A complete-looking checkpoint folder for `step` (the tensor files are not read here).
    fn fake_checkpoint(root: &Path, step: u64) {
        let dir = step_dir(root, step);
        std::fs::create_dir_all(&dir).unwrap();
        for file in ["model.safetensors", "optimizer.safetensors"] {
            std::fs::write(dir.join(file), b"x").unwrap();
        }
        let meta = CheckpointMeta {
            step,
            policy_version: step,
            rollout: RolloutState::default(),
            seed: 7,
        };
        std::fs::write(dir.join("moult.json"), serde_json::to_vec(&meta).unwrap()).unwrap();
    }

    #[test]
    fn a_pointer_to_a_missing_or_incomplete_step_falls_back_to_the_newest_complete_one() {
        let root = std::env::temp_dir().join(format!("moult-ckpt-latest-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        assert!(latest(&root).unwrap().is_none(), "no checkpoint yet");
        fake_checkpoint(&root, 5);
        fake_checkpoint(&root, 10);
        let point_at = |step: u64| {
            let pointer = serde_json::json!({"step": step, "path": format!("step-{step:06}")});
            write_atomic(&root.join("latest.json"), pointer.to_string().as_bytes()).unwrap();
        };
        point_at(10);
        assert_eq!(latest(&root).unwrap().unwrap().1.step, 10);
        // The step it names was deleted.
        point_at(15);
        assert_eq!(latest(&root).unwrap().unwrap().1.step, 10);
        // The newest folder lost a file: the one before.
        std::fs::remove_file(step_dir(&root, 10).join("optimizer.safetensors")).unwrap();
        assert_eq!(latest(&root).unwrap().unwrap().1.step, 5);
        // Nothing complete at all is an error that says why.
        std::fs::remove_dir_all(step_dir(&root, 5)).unwrap();
        let err = latest(&root).unwrap_err().to_string();
        assert!(err.contains("no other complete checkpoint"), "{err}");
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn model_folder_takes_a_checkpoint_a_checkpoint_root_or_any_model_folder() {
        let root = std::env::temp_dir().join(format!("moult-ckpt-model-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        fake_checkpoint(&root, 4);
        fake_checkpoint(&root, 8);
        for step in [4, 8] {
            std::fs::write(step_dir(&root, step).join("config.json"), b"{}").unwrap();
        }
        let pointer = serde_json::json!({"step": 8, "path": "step-000008"});
        write_atomic(&root.join("latest.json"), pointer.to_string().as_bytes()).unwrap();
        // The root: its newest checkpoint.
        let (dir, meta) = model_folder(&root).unwrap();
        assert_eq!((dir, meta.map(|m| m.step)), (step_dir(&root, 8), Some(8)));
        // One step's folder: that one.
        let (dir, meta) = model_folder(&step_dir(&root, 4)).unwrap();
        assert_eq!(
            (dir, meta.map(|m| m.policy_version)),
            (step_dir(&root, 4), Some(4))
        );
        // A plain model folder: no metadata.
        let plain = root.join("model");
        std::fs::create_dir_all(&plain).unwrap();
        std::fs::write(plain.join("config.json"), b"{}").unwrap();
        assert_eq!(model_folder(&plain).unwrap(), (plain.clone(), None));
        // Anything else says what it is not.
        let err = model_folder(&root.join("nothing")).unwrap_err().to_string();
        assert!(err.contains("neither a model folder"), "{err}");
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn a_sharded_checkpoint_is_complete_with_every_rank_file_and_not_served_as_it_is() {
        let root = std::env::temp_dir().join(format!("moult-ckpt-sharded-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        fake_checkpoint(&root, 3);
        let dir = step_dir(&root, 3);
        for file in ["model.safetensors", "optimizer.safetensors"] {
            std::fs::remove_file(dir.join(file)).unwrap();
        }
        std::fs::write(dir.join("config.json"), "{}").unwrap();
        let layout = ShardLayout {
            world: 2,
            units: Vec::new(),
            names: Vec::new(),
            moments: false,
        };
        std::fs::create_dir_all(dir.join(SHARDS)).unwrap();
        std::fs::write(
            dir.join(SHARDS).join(LAYOUT),
            serde_json::to_vec(&layout).unwrap(),
        )
        .unwrap();
        std::fs::write(dir.join(SHARDS).join(layout.file_name(0)), b"x").unwrap();
        // Rank 1's file is missing: not a checkpoint to resume from.
        let missing = complete(&dir).unwrap_err().to_string();
        assert!(missing.contains("rank-00001-of-00002"), "{missing}");
        std::fs::write(dir.join(SHARDS).join(layout.file_name(1)), b"x").unwrap();
        assert_eq!(complete(&dir).unwrap().1.step, 3);
        // Engines load whole tensors: serving it says to export it first.
        let refused = model_folder(&dir).unwrap_err().to_string();
        assert!(
            refused.contains("2 trainer ranks") && refused.contains("moult export"),
            "{refused}"
        );
        assert!(
            export(&dir, &root.join("step-000003")).is_err(),
            "export over a folder"
        );
        let _ = std::fs::remove_dir_all(&root);
    }

    #[test]
    fn prune_keeps_the_newest_and_clears_interrupted_writes() {
        let root = std::env::temp_dir().join(format!("moult-ckpt-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        for step in [5, 10, 15, 20] {
            std::fs::create_dir_all(step_dir(&root, step)).unwrap();
        }
        std::fs::create_dir_all(root.join(".step-000025.tmp1")).unwrap();
        prune(&root, 20, KEEP);
        let mut left: Vec<String> = std::fs::read_dir(&root)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        assert_eq!(left, vec!["step-000015", "step-000020"]);
        std::fs::remove_dir_all(&root).unwrap();
    }
}
