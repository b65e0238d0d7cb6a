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

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::json;
use tch::{Device, Kind, Tensor};

use super::stream::WeightStream;
use super::{Control, Result, SyncError, SyncReport};

/// How often a failed reload is tried again before the update fails.
const RELOAD_TRIES: u64 = 3;

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

/// The file of one bucket of a version written in several.
fn bucket_file(index: usize) -> String {
    format!("model-{:05}.safetensors", index + 1)
}

/// `what` (creating, removing, ...) `path` failed.
fn io<E: std::error::Error + Send + Sync + 'static>(
    what: &'static str,
    path: &Path,
) -> impl FnOnce(E) -> SyncError {
    let path = path.to_path_buf();
    move |e| SyncError::Write {
        what,
        path,
        source: Box::new(e),
    }
}

/// Writes the buckets of `weights` (converted to `kind`, on the CPU) as `<root>/v<version>/`,
/// one file per bucket, through a hidden folder (replacing what an interrupted attempt left)
/// renamed into place once the stream ended whole; returns the folder and what was written.
pub async fn write_version(
    root: &Path,
    version: u64,
    mut weights: WeightStream,
    kind: Kind,
) -> Result<(PathBuf, SyncReport)> {
    let root = root.to_path_buf();
    tokio::task::spawn_blocking(move || {
        let partial = root.join(format!(".v{version}.partial"));
        let dir = version_dir(&root, version);
        for stale in [&partial, &dir] {
            if stale.exists() {
                std::fs::remove_dir_all(stale).map_err(io("removing", stale))?;
            }
        }
        // Creates `root` too, when it is new.
        std::fs::create_dir_all(&partial).map_err(io("creating", &partial))?;
        // What was written, and each weight's file.
        let (mut report, mut files) = (SyncReport::default(), BTreeMap::new());
        while let Some(bucket) = weights.blocking_next()? {
            let converted: Vec<(String, Tensor)> = bucket
                .into_iter()
                .map(|(n, t)| (n, t.to_device(Device::Cpu).to_kind(kind).contiguous()))
                .collect();
            let name = bucket_file(report.buckets);
            let file = partial.join(&name);
            Tensor::write_safetensors(&converted, &file).map_err(io("writing", &file))?;
            report.count(&converted);
            files.extend(converted.into_iter().map(|(n, _)| (n, name.clone())));
        }
        // Named as a Hugging Face folder: `model.safetensors`, or numbered files and
        // `model.safetensors.index.json`.
        if report.buckets == 1 {
            let to = partial.join("model.safetensors");
            std::fs::rename(partial.join(bucket_file(0)), &to).map_err(io("renaming into", &to))?;
        } else {
            let index = json!({"metadata": {"total_size": report.bytes}, "weight_map": files});
            let file = partial.join("model.safetensors.index.json");
            std::fs::write(&file, index.to_string()).map_err(io("writing", &file))?;
        }
        std::fs::rename(&partial, &dir).map_err(io("renaming into", &dir))?;
        Ok((dir, report))
    })
    .await
    .map_err(SyncError::at("write"))?
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

    /// Writes the buckets of `weights` as `version` as they come, one file per bucket, while the
    /// engines still generate; then pause (`keep` with partial rollout, else `wait`), reload, set
    /// the version, resume. An engine that failed to reload may hold part of the new weights:
    /// the engines stay paused then. Older version folders are removed once every engine has
    /// the new one.
    pub async fn update(
        &mut self,
        weights: WeightStream,
        version: u64,
        partial_rollout: bool,
    ) -> Result<SyncReport> {
        let started = Instant::now();
        let (dir, written) = write_version(&self.root, version, weights, self.kind).await?;
        let written_in = started.elapsed();
        let reload = async { self.reload(&dir).await.map(|()| written) };
        let report = self
            .control
            .paused_update(version, partial_rollout, reload)
            .await?;
        remove_other_versions(&self.root, &dir);
        tracing::debug!(
            version,
            written = ?written_in,
            paused = ?report.paused,
            bytes = report.bytes,
            buckets = report.buckets,
            "weights published from a folder"
        );
        Ok(report)
    }

    /// `reload_weights` from `dir` on every engine, tried again on failure.
    async fn reload(&self, dir: &Path) -> Result<()> {
        let body = json!({"method": "reload_weights",
            "kwargs": {"weights_path": dir.display().to_string()}});
        let mut tries = 1;
        loop {
            let post = self
                .control
                .request(reqwest::Method::POST, "/collective_rpc", Some(&body));
            match post.await {
                Ok(_) => return Ok(()),
                Err(e) if tries < RELOAD_TRIES => {
                    tracing::warn!("reloading weights from {}: {e}; again", dir.display());
                    tokio::time::sleep(Duration::from_millis(500 * tries)).await;
                    tries += 1;
                }
                Err(e) => return Err(SyncError::Call("collective_rpc reload_weights", e)),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(dir: &Path, file: &str) -> Vec<(String, Tensor)> {
        Tensor::read_safetensors(dir.join(file)).unwrap()
    }

    #[tokio::test]
    async fn a_version_folder_appears_whole_in_the_engines_dtype_and_old_ones_go() {
        let root = std::env::temp_dir().join(format!("moult-folder-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let w = Tensor::from_slice(&[1.5f32, -2.25, 3.0]).reshape([3, 1]);
        let tensors = vec![("model.norm.weight".to_string(), w)];
        let whole = WeightStream::whole(&tensors);
        let (v1, written) = write_version(&root, 1, whole, Kind::BFloat16)
            .await
            .unwrap();
        assert_eq!(
            (written.bytes, written.buckets),
            (6, 1),
            "three bfloat16 values, one file"
        );
        let read = read(&v1, "model.safetensors");
        assert_eq!(read[0].0, "model.norm.weight");
        assert_eq!(read[0].1.kind(), Kind::BFloat16);
        assert_eq!(read[0].1.size(), [3, 1]);
        let back: Vec<f32> = Vec::try_from(read[0].1.to_kind(Kind::Float).flatten(0, -1)).unwrap();
        assert_eq!(back, [1.5, -2.25, 3.0]);
        let (v2, _) = write_version(&root, 2, WeightStream::whole(&tensors), Kind::Float)
            .await
            .unwrap();
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

    #[tokio::test]
    async fn a_streamed_version_is_a_sharded_folder_and_a_short_stream_leaves_none() {
        let root = std::env::temp_dir().join(format!("moult-folder-s-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let t = |x: f32| Tensor::from_slice(&[x, x]);
        let (tx, stream) = WeightStream::channel();
        let producer = tokio::task::spawn_blocking(move || {
            tx.send(vec![("a".into(), t(1.0)), ("b".into(), t(2.0))]);
            tx.send(vec![("c".into(), t(3.0))]);
            tx.done();
        });
        let (dir, written) = write_version(&root, 4, stream, Kind::Float).await.unwrap();
        producer.await.unwrap();
        assert_eq!((written.bytes, written.buckets), (24, 2));
        let index: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(dir.join("model.safetensors.index.json")).unwrap(),
        )
        .unwrap();
        assert_eq!(
            index["weight_map"],
            json!({"a": "model-00001.safetensors", "b": "model-00001.safetensors",
                "c": "model-00002.safetensors"})
        );
        assert_eq!(read(&dir, "model-00002.safetensors")[0].0, "c");
        // The engines' loader reads it like any sharded Hugging Face folder.
        let loaded = crate::model::load_safetensors_dir(&dir, Kind::Float, Device::Cpu).unwrap();
        assert_eq!(loaded.keys().collect::<Vec<_>>(), ["a", "b", "c"]);

        // A trainer that stops short: an error, and no version folder appears.
        let (tx, stream) = WeightStream::channel();
        let producer = tokio::task::spawn_blocking(move || {
            tx.send(vec![("a".into(), t(1.0))]);
        });
        let err = write_version(&root, 5, stream, Kind::Float)
            .await
            .unwrap_err()
            .to_string();
        producer.await.unwrap();
        assert!(err.contains("stopped before"), "{err}");
        assert!(!version_dir(&root, 5).exists());
        std::fs::remove_dir_all(&root).unwrap();
    }
}
