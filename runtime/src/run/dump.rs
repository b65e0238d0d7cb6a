//! Rollout dumps (docs/run.md, "Rollout dumps and replay"): every batch a run trains on, as it
//! trained on it (each episode's exact tokens, loss mask, behaviour logprobs, versions and
//! reward), one JSON file per step under `<out>/rollouts/`; and reading them back, so that
//! `moult run --replay` trains on identical data (debugging, comparing algorithms).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::files::write_atomic;
use super::RunError;
use crate::rollout::{Group, RolloutState, RolloutStats};

/// The folder of a run's dumps under its output folder.
pub fn folder(out: &Path) -> PathBuf {
    out.join("rollouts")
}

fn file_name(step: u64) -> String {
    format!("step-{step:06}.json")
}

/// One step's batch, as written.
#[derive(Debug, Serialize)]
pub struct DumpRef<'a> {
    /// The step this batch was trained as (1 for the first).
    pub step: u64,
    /// The version the engines served when the batch was handed out.
    pub served: u64,
    pub stats: RolloutStats,
    pub rollout: RolloutState,
    pub seed: u64,
    pub groups: &'a [Group],
}

/// One step's batch, as read back.
#[derive(Debug, Deserialize)]
pub struct Dump {
    pub step: u64,
    pub served: u64,
    pub stats: RolloutStats,
    pub rollout: RolloutState,
    pub seed: u64,
    pub groups: Vec<Group>,
}

/// Writes `batch` to `<dir>/step-NNNNNN.json` (whole or not at all).
pub fn write(dir: &Path, batch: &DumpRef<'_>) -> Result<(), RunError> {
    std::fs::create_dir_all(dir)
        .map_err(|e| RunError::Io(format!("creating {}: {e}", dir.display())))?;
    let bytes = serde_json::to_vec(batch).expect("a batch serializes");
    write_atomic(&dir.join(file_name(batch.step)), &bytes)
}

/// The dumps in `dir`, by step: every `step-NNNNNN.json`, which must number 1, 2, 3, ... with
/// no gap (a replay trains them in order, each on the weights the one before left).
pub fn steps(dir: &Path) -> Result<Vec<(u64, PathBuf)>, RunError> {
    let entries = std::fs::read_dir(dir).map_err(|e| {
        RunError::Setup(format!(
            "--replay {}: {e} (a folder `moult run --dump-rollouts` wrote: <out>/rollouts)",
            dir.display()
        ))
    })?;
    let mut steps: Vec<(u64, PathBuf)> = entries
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let step = name
                .strip_prefix("step-")?
                .strip_suffix(".json")?
                .parse()
                .ok()?;
            Some((step, e.path()))
        })
        .collect();
    steps.sort();
    if steps.is_empty() {
        return Err(RunError::Setup(format!(
            "--replay {}: no step-NNNNNN.json in it (write them with `moult run --dump-rollouts`)",
            dir.display()
        )));
    }
    for (i, (step, _)) in steps.iter().enumerate() {
        if *step != i as u64 + 1 {
            return Err(RunError::Setup(format!(
                "--replay {}: the dumps go from step {} to step {step}: each step trains on the weights the one before left, so none may be missing",
                dir.display(),
                i
            )));
        }
    }
    Ok(steps)
}

/// Reads one dump.
pub fn read(path: &Path) -> Result<Dump, RunError> {
    let bytes = std::fs::read(path)
        .map_err(|e| RunError::Io(format!("reading {}: {e}", path.display())))?;
    serde_json::from_slice(&bytes)
        .map_err(|e| RunError::Setup(format!("{} is not a rollout dump: {e}", path.display())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dumps_must_number_from_one_without_gaps() {
        let dir = std::env::temp_dir().join(format!("moult-dump-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        assert!(steps(&dir).is_err(), "a missing folder");
        for step in [1, 2, 4] {
            let dump = DumpRef {
                step,
                served: step - 1,
                stats: RolloutStats::default(),
                rollout: RolloutState::default(),
                seed: 7,
                groups: &[],
            };
            write(&dir, &dump).unwrap();
        }
        std::fs::write(dir.join("notes.txt"), "not a dump").unwrap();
        let err = steps(&dir).unwrap_err().to_string();
        assert!(err.contains("from step 2 to step 4"), "{err}");
        std::fs::remove_file(dir.join(file_name(4))).unwrap();
        let found = steps(&dir).unwrap();
        assert_eq!(found.iter().map(|(s, _)| *s).collect::<Vec<_>>(), [1, 2]);
        let back = read(&found[1].1).unwrap();
        assert_eq!((back.step, back.served, back.seed), (2, 1, 7));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
