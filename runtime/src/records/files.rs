//! Files written so that a crash never leaves half of one: write a temporary file, sync it,
//! rename it over the old one. And the numbered entries of a folder (checkpoints, rollout dumps).

use std::fs::File;
use std::path::{Path, PathBuf};

use crate::error::{Result, RunError};

pub(crate) fn io(what: &str, path: &Path, e: impl std::fmt::Display) -> RunError {
    RunError::Checkpoint(format!("{what} {}: {e}", path.display()))
}

/// Syncs the file or folder at `path`. A folder is synced so that the names created or renamed in
/// it survive a crash of the machine (a renamed file's data is synced, but the rename lives in
/// its folder).
pub(crate) fn sync(path: &Path) -> Result<()> {
    File::open(path)
        .and_then(|f| f.sync_all())
        .map_err(|e| io("syncing", path, e))
}

/// Writes `text` to `path` atomically (temporary file, sync, rename, sync of the folder).
pub(crate) fn write_atomic(path: &Path, text: &[u8]) -> Result<()> {
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, text).map_err(|e| io("writing", &tmp, e))?;
    sync(&tmp)?;
    std::fs::rename(&tmp, path).map_err(|e| io("renaming", &tmp, e))?;
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => sync(dir),
        _ => Ok(()),
    }
}

/// The entries of `dir` named `<prefix><number><suffix>`, in the order of their numbers.
pub(crate) fn numbered(
    dir: &Path,
    prefix: &str,
    suffix: &str,
) -> std::io::Result<Vec<(u64, PathBuf)>> {
    let number = |n: String| n.strip_prefix(prefix)?.strip_suffix(suffix)?.parse().ok();
    let mut found: Vec<(u64, PathBuf)> = (std::fs::read_dir(dir)?.flatten())
        .filter_map(|e| Some((number(e.file_name().into_string().ok()?)?, e.path())))
        .collect();
    found.sort();
    Ok(found)
}
