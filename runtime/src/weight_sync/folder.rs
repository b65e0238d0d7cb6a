//! The Filesystem weight transport (docs/weight-sync.md, "Weight transports"): the trainer writes the
//! new weights as safetensors, in the engines' dtype, to a folder every engine can read (a
//! ReadWriteMany volume on a cluster, a directory locally), then pauses the engines, has each
//! reload from that folder (vLLM's `POST /collective_rpc` with `reload_weights`; the built-in
//! engine serves the same call), sets the version, and resumes them.
//!
//! The folder is written while the engines still generate, and appears under its final name
//! only once complete, so no engine ever reads half a file. A reload that fails is tried again
//! from the same complete folder; engines that could not finish it are left paused rather than
//! resumed on weights that may be half-replaced (the update fails, and the next one, or a
//! restart, brings them to whole weights).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::json;
use tch::{Device, Kind, Tensor};

use super::orchestrate::{step, Control, SyncError, SyncReport};

/// How often a failed reload is tried again before the update fails.
const RELOAD_TRIES: usize = 3;

/// Publishes through a shared folder.
#[derive(Debug)]
pub struct FolderPublisher {
    control: Control,
    root: PathBuf,
    kind: Kind,
}

/// The folder of `version` under `root`.
pub fn version_dir(root: &Path, version: u64) -> PathBuf {
    root.join(format!("v{version}"))
}

/// Writes `tensors` (converted to `kind`, on the CPU) as `<root>/v<version>/model.safetensors`,
/// through a hidden folder renamed into place, and returns the folder and the bytes written.
pub fn write_version(
    root: &Path,
    version: u64,
    tensors: &[(String, Tensor)],
    kind: Kind,
) -> Result<(PathBuf, usize), String> {
    let io = |what: &str, p: &Path, e: std::io::Error| format!("{what} {}: {e}", p.display());
    std::fs::create_dir_all(root).map_err(|e| io("creating", root, e))?;
    let partial = root.join(format!(".v{version}.partial"));
    let dir = version_dir(root, version);
    for stale in [&partial, &dir] {
        if stale.exists() {
            std::fs::remove_dir_all(stale).map_err(|e| io("removing", stale, e))?;
        }
    }
    std::fs::create_dir_all(&partial).map_err(|e| io("creating", &partial, e))?;
    let converted: Vec<(String, Tensor)> = tensors
        .iter()
        .map(|(n, t)| {
            let t = t.to_device(Device::Cpu).to_kind(kind).contiguous();
            (n.clone(), t)
        })
        .collect();
    let bytes = converted
        .iter()
        .map(|(_, t)| t.numel() * t.kind().elt_size_in_bytes())
        .sum();
    let file = partial.join("model.safetensors");
    Tensor::write_safetensors(&converted, &file)
        .map_err(|e| format!("writing {}: {e}", file.display()))?;
    std::fs::rename(&partial, &dir).map_err(|e| io("renaming into", &dir, e))?;
    Ok((dir, bytes))
}

/// Removes every version folder under `root` but `keep` (and leftovers of interrupted writes).
fn remove_other_versions(root: &Path, keep: &Path) {
    let Ok(entries) = std::fs::read_dir(root) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name();
        let name = name.to_string_lossy();
        let ours = name.starts_with('v') && name[1..].parse::<u64>().is_ok()
            || name.starts_with(".v") && name.ends_with(".partial");
        if ours && path != keep {
            if let Err(e) = std::fs::remove_dir_all(&path) {
                tracing::warn!("removing old weights {}: {e}", path.display());
            }
        }
    }
}

impl FolderPublisher {
    /// Updates for the engines behind `target` from folders under `root` (a path every engine
    /// reads under the same name), written in `kind`.
    pub fn new(target: &str, root: PathBuf, kind: Kind) -> Self {
        Self {
            control: Control::new(target),
            root,
            kind,
        }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Writes `tensors` as `version`, then pause (`keep` with partial rollout, else `wait`),
    /// reload, set the version, resume. Older version folders are removed once every engine
    /// has the new one.
    pub async fn update(
        &mut self,
        tensors: &[(String, Tensor)],
        version: u64,
        partial_rollout: bool,
    ) -> Result<SyncReport, SyncError> {
        let started = Instant::now();
        let (root, kind) = (self.root.clone(), self.kind);
        let shallow: Vec<(String, Tensor)> = tensors
            .iter()
            .map(|(n, t)| (n.clone(), t.shallow_clone()))
            .collect();
        let (dir, bytes) =
            tokio::task::spawn_blocking(move || write_version(&root, version, &shallow, kind))
                .await
                .map_err(|e| step("write")(e.to_string()))?
                .map_err(step("write"))?;
        let written = started.elapsed();

        let paused_at = Instant::now();
        self.control.pause(partial_rollout).await?;
        // An engine that failed may hold part of the new weights: no resume then, the engines
        // stay paused (docs/weight-sync.md, "Weight transports").
        self.reload(&dir).await?;
        let transfer = paused_at.elapsed();
        let versioned = self.control.set_version(version).await;
        let resumed = self.control.resume().await;
        let paused = paused_at.elapsed();
        versioned?;
        resumed?;
        remove_other_versions(&self.root, &dir);
        tracing::debug!(
            version,
            ?written,
            ?paused,
            bytes,
            "weights published from a folder"
        );
        Ok(SyncReport {
            paused,
            transfer,
            bytes,
            buckets: 1,
        })
    }

    async fn reload(&self, dir: &Path) -> Result<(), SyncError> {
        let body = json!({"method": "reload_weights",
            "kwargs": {"weights_path": dir.display().to_string()}});
        let mut tries = 0;
        loop {
            match self.control.post("/collective_rpc", body.clone()).await {
                Ok(_) => return Ok(()),
                Err(e) if tries + 1 < RELOAD_TRIES => {
                    tries += 1;
                    tracing::warn!("reloading weights from {}: {e}; again", dir.display());
                    tokio::time::sleep(Duration::from_millis(500 * tries as u64)).await;
                }
                Err(e) => return Err(step("collective_rpc reload_weights")(e)),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_version_folder_appears_whole_in_the_engines_dtype_and_old_ones_go() {
        let root = std::env::temp_dir().join(format!("moult-folder-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let w = Tensor::from_slice(&[1.5f32, -2.25, 3.0]).reshape([3, 1]);
        let tensors = vec![("model.norm.weight".to_string(), w)];
        let (v1, bytes) = write_version(&root, 1, &tensors, Kind::BFloat16).unwrap();
        assert_eq!(bytes, 6, "three bfloat16 values");
        let read = Tensor::read_safetensors(v1.join("model.safetensors")).unwrap();
        assert_eq!(read[0].0, "model.norm.weight");
        assert_eq!(read[0].1.kind(), Kind::BFloat16);
        assert_eq!(read[0].1.size(), [3, 1]);
        let back: Vec<f32> = Vec::try_from(read[0].1.to_kind(Kind::Float).flatten(0, -1)).unwrap();
        assert_eq!(back, [1.5, -2.25, 3.0]);
        let (v2, _) = write_version(&root, 2, &tensors, Kind::Float).unwrap();
        std::fs::create_dir_all(root.join(".v3.partial")).unwrap();
        std::fs::create_dir_all(root.join("unrelated")).unwrap();
        remove_other_versions(&root, &v2);
        let mut left: Vec<String> = std::fs::read_dir(&root)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        assert_eq!(left, ["unrelated", "v2"]);
        std::fs::remove_dir_all(&root).unwrap();
    }
}
