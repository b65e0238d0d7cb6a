//! Files written so that a crash never leaves half of one: write a temporary file, sync it,
//! rename it over the old one.

use std::fs::File;
use std::path::Path;

use crate::error::RunError;

pub(crate) fn io(what: &str, path: &Path, e: impl std::fmt::Display) -> RunError {
    RunError::Checkpoint(format!("{what} {}: {e}", path.display()))
}

pub(crate) fn sync_file(path: &Path) -> Result<(), RunError> {
    File::open(path)
        .and_then(|f| f.sync_all())
        .map_err(|e| io("syncing", path, e))
}

/// Syncs the folder `dir` itself, so that the names created or renamed in it survive a crash
/// of the machine (a renamed file's data is synced, but the rename lives in its folder).
pub(crate) fn sync_dir(dir: &Path) -> Result<(), RunError> {
    sync_file(dir)
}

/// Writes `text` to `path` atomically (temporary file, sync, rename, sync of the folder).
pub(crate) fn write_atomic(path: &Path, text: &[u8]) -> Result<(), RunError> {
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, text).map_err(|e| io("writing", &tmp, e))?;
    sync_file(&tmp)?;
    std::fs::rename(&tmp, path).map_err(|e| io("renaming", &tmp, e))?;
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => sync_dir(dir),
        _ => Ok(()),
    }
}
