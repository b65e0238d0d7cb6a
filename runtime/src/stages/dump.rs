//! Rollout dumps (docs/run.md, "Rollout dumps and replay"): every batch a run trains on, as it
//! trained on it (each episode's exact tokens, loss mask, behaviour logprobs, versions and
//! reward), one JSON file per step under `<out>/rollouts/`; and reading them back, so that
//! `moult run --replay` trains on identical data (debugging, comparing algorithms).

use std::path::{Path, PathBuf};

use futures::future::BoxFuture;

use super::{Stage, StepBatch};
use crate::error::{Result, RunError};
use crate::records::files::{numbered, write_atomic};

/// The stage that writes each batch, as the trainer will see it, into this folder.
#[derive(Debug)]
pub struct Dump(pub PathBuf);

impl Stage for Dump {
    fn phase(&self) -> &'static str {
        "writing the batch to the rollout dump"
    }

    fn apply<'a>(&'a self, batch: &'a mut StepBatch) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move { write(&self.0, batch) })
    }
}

/// The folder of a run's dumps under its output folder.
pub fn folder(out: &Path) -> PathBuf {
    out.join("rollouts")
}

fn file_name(step: u64) -> String {
    format!("step-{step:06}.json")
}

/// Writes `batch` to `<dir>/step-NNNNNN.json` (whole or not at all).
pub fn write(dir: &Path, batch: &StepBatch) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| RunError::file("creating", dir, e))?;
    let bytes = serde_json::to_vec(batch).expect("a batch serializes");
    write_atomic(&dir.join(file_name(batch.step)), &bytes)
}

/// The dumps in `dir`, by step: every `step-NNNNNN.json`, which must number 1, 2, 3, ... with
/// no gap (a replay trains them in order, each on the weights the one before left).
pub fn steps(dir: &Path) -> Result<Vec<(u64, PathBuf)>> {
    let refuse = |why: String| RunError::Setup(format!("--replay {}: {why}", dir.display()));
    let what = "a folder `moult run --dump-rollouts` wrote: <out>/rollouts";
    let steps = numbered(dir, "step-", ".json").map_err(|e| refuse(format!("{e} ({what})")))?;
    if steps.is_empty() {
        let why = "no step-NNNNNN.json in it (write them with `moult run --dump-rollouts`)";
        return Err(refuse(why.into()));
    }
    for (i, (step, _)) in steps.iter().enumerate() {
        if *step != i as u64 + 1 {
            let why = format!("the dumps go from step {i} to step {step}: each step trains on the weights the one before left, so none may be missing");
            return Err(refuse(why));
        }
    }
    Ok(steps)
}

/// Reads one dump back as the batch it was.
pub fn read(path: &Path) -> Result<StepBatch> {
    let bytes = std::fs::read(path).map_err(|e| RunError::file("reading", path, e))?;
    serde_json::from_slice(&bytes)
        .map_err(|e| RunError::Setup(format!("{} is not a rollout dump: {e}", path.display())))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rollout::{RolloutState, RolloutStats};

    #[test]
    fn dumps_must_number_from_one_without_gaps() {
        let dir = std::env::temp_dir().join(format!("moult-dump-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        assert!(steps(&dir).is_err(), "a missing folder");
        for step in [1, 2, 4] {
            let dump = StepBatch {
                step,
                groups: Vec::new(),
                version: step - 1,
                rollout: RolloutState::default(),
                stats: RolloutStats::default(),
                seed: 7,
                eval: None,
                judged: None,
                taught: None,
                restarts: 0,
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
        assert_eq!((back.step, back.version, back.seed), (2, 1, 7));
        // A dump an earlier version wrote names the served version `served`.
        let old = r#"{"step":3,"served":2,"stats":{"groups_started":0,"groups_done":0,"dropped_stale":0,"dropped_failed":0},"rollout":{"cursor":0,"epoch":0},"seed":7,"groups":[]}"#;
        std::fs::write(dir.join(file_name(3)), old).unwrap();
        assert_eq!(read(&dir.join(file_name(3))).unwrap().version, 2);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
