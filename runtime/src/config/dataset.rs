//! Task files (docs/run.md, "Datasets"): JSON lines, or Parquet files as Hugging Face datasets
//! store them (one task per row, nested columns as JSON objects and lists), from one file, a
//! folder, or a `*` pattern; with `columns`, each task holds the fields the mapping names, taken
//! from their columns. Files are read in name order, rows in file order; the run shuffles the
//! whole with its seed (`super::ordered`).

use std::fs::File;
use std::path::{Path, PathBuf};

use moult_operator::api::{DatasetFormat, DatasetSpec};
use parquet::file::reader::SerializedFileReader;
use serde_json::{Map, Value as Json};

use super::read_jsonl;
use crate::error::{Result, RunError};

/// The tasks of `spec`, whose path resolves to `path` here; errors name `field` (the manifest
/// field that gave the path, `spec.agent.dataset` or `spec.eval.dataset`).
pub fn read(spec: &DatasetSpec, path: &Path, field: &str) -> Result<Vec<Json>> {
    let path_field = format!("{field}.path");
    let files = files(path, &path_field)?;
    let mut tasks = Vec::new();
    for file in &files {
        let parquet = file.extension().is_some_and(|e| e == "parquet");
        let by_name = if parquet {
            DatasetFormat::Parquet
        } else {
            DatasetFormat::Jsonl
        };
        let rows = match spec.format.unwrap_or(by_name) {
            DatasetFormat::Jsonl => read_jsonl(file, &path_field)?,
            DatasetFormat::Parquet => read_parquet(file, &path_field)?,
        };
        for (i, row) in rows.into_iter().enumerate() {
            tasks.push(map_columns(row, &spec.columns).map_err(|why| {
                RunError::field(
                    format!("{field}.columns"),
                    format!("{} row {}: {why}", file.display(), i + 1),
                )
            })?);
        }
    }
    if tasks.is_empty() {
        let why = format!("{} holds no tasks", path.display());
        return Err(RunError::field(&path_field, why));
    }
    Ok(tasks)
}

/// The files `path` names: itself, the `.jsonl`/`.json`/`.parquet` files of a folder, or those
/// its file name's one `*` matches; in name order.
fn files(path: &Path, field: &str) -> Result<Vec<PathBuf>> {
    let refuse = |why: String| RunError::field(field, why);
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
    // A pattern's folder, and what comes before its `*` and after it; or a folder's task files.
    let (dir, pattern) = if let Some((pre, post)) = name.split_once('*') {
        if post.contains('*') {
            return Err(RunError::field(field, "one `*` at most, in the file name"));
        }
        (path.parent().unwrap_or(Path::new(".")), Some((pre, post)))
    } else if path.is_dir() {
        (path, None)
    } else if path.is_file() {
        return Ok(vec![path.to_path_buf()]);
    } else {
        return Err(refuse(format!("{} does not exist", path.display())));
    };
    let entries = std::fs::read_dir(dir)
        .map_err(|e| refuse(format!("cannot read the folder {}: {e}", dir.display())))?;
    let mut found: Vec<PathBuf> = entries
        .flatten()
        .filter(|e| e.path().is_file())
        .filter(|e| {
            e.file_name().to_str().is_some_and(|n| match pattern {
                Some((pre, post)) => {
                    n.len() >= pre.len() + post.len() && n.starts_with(pre) && n.ends_with(post)
                }
                None => [".jsonl", ".json", ".parquet"]
                    .iter()
                    .any(|ext| n.ends_with(ext)),
            })
        })
        .map(|e| e.path())
        .collect();
    found.sort();
    if found.is_empty() {
        return Err(refuse(format!("no task files match {}", path.display())));
    }
    Ok(found)
}

/// Every row of a Parquet file as a JSON object (column name → value).
fn read_parquet(file: &Path, field: &str) -> Result<Vec<Json>> {
    let cannot = |e: &dyn std::fmt::Display| {
        let why = format!("{}: not a readable Parquet file: {e}", file.display());
        RunError::field(field, why)
    };
    let f = File::open(file)
        .map_err(|e| RunError::field(field, format!("cannot read {}: {e}", file.display())))?;
    // The parquet crate panics on some malformed files (found by fuzzing): a panic is an error
    // naming the file, as any other unreadable file.
    let read = std::panic::catch_unwind(|| {
        let reader = SerializedFileReader::new(f).map_err(|e| cannot(&e))?;
        let rows = reader.into_iter().map(|row| row.map(|r| r.to_json_value()));
        rows.map(|row| row.map_err(|e| cannot(&e))).collect()
    });
    read.unwrap_or_else(|_| Err(cannot(&"the Parquet reader failed on its metadata")))
}

/// Why a row cannot become a task under `columns`.
#[derive(Debug, thiserror::Error)]
enum Unmapped {
    #[error("is not an object, so it has no columns to map")]
    NotAnObject,
    #[error("no column `{from}` (for the task field `{to}`); it has {have:?}")]
    NoColumn {
        from: String,
        to: String,
        have: Vec<String>,
    },
}

/// The task a row makes: the row itself, or with `columns`, each named field from its column.
fn map_columns(
    row: Json,
    columns: &std::collections::BTreeMap<String, String>,
) -> Result<Json, Unmapped> {
    if columns.is_empty() {
        return Ok(row);
    }
    let Json::Object(mut fields) = row else {
        return Err(Unmapped::NotAnObject);
    };
    let mut task = Map::new();
    for (to, from) in columns {
        let Some(v) = fields.remove(from) else {
            let mut have: Vec<String> = fields.keys().cloned().collect();
            have.sort();
            let (from, to) = (from.clone(), to.clone());
            return Err(Unmapped::NoColumn { from, to, have });
        };
        task.insert(to.clone(), v);
    }
    Ok(Json::Object(task))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn spec(path: &str) -> DatasetSpec {
        DatasetSpec {
            path: path.into(),
            claim_name: None,
            format: None,
            columns: Default::default(),
        }
    }

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("moult-dataset-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn folders_and_patterns_read_their_files_in_name_order_with_mapped_columns() {
        let dir = scratch("files");
        std::fs::write(dir.join("b.jsonl"), "{\"q\": 2, \"a\": \"x\"}\n").unwrap();
        std::fs::write(dir.join("a.jsonl"), "{\"q\": 1, \"a\": \"y\"}\n\n").unwrap();
        std::fs::write(dir.join("notes.txt"), "not tasks").unwrap();
        let field = "spec.agent.dataset";
        let all = read(&spec(""), &dir, field).unwrap();
        assert_eq!(all, [json!({"q": 1, "a": "y"}), json!({"q": 2, "a": "x"})]);
        let mut mapped = spec("");
        mapped.columns = [("question".to_string(), "q".to_string())].into();
        let tasks = read(&mapped, &dir.join("b*.jsonl"), field).unwrap();
        assert_eq!(tasks, [json!({"question": 2})]);
        // A missing column names itself, the task field, the file and row, and what there is.
        mapped.columns = [("question".to_string(), "problem".to_string())].into();
        let err = read(&mapped, &dir, field).unwrap_err().to_string();
        assert!(
            err.contains("spec.agent.dataset.columns")
                && err.contains("a.jsonl row 1")
                && err.contains("`problem`")
                && err.contains("[\"a\", \"q\"]"),
            "{err}"
        );
        let err = read(&spec(""), &dir.join("c*.jsonl"), field)
            .unwrap_err()
            .to_string();
        assert!(err.contains("no task files match"), "{err}");
        let err = read(&spec(""), &dir.join("nope.jsonl"), field)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("spec.agent.dataset.path") && err.contains("does not exist"),
            "{err}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_file_that_is_not_parquet_is_refused_by_name() {
        let dir = scratch("bad-parquet");
        let file = dir.join("train.parquet");
        std::fs::write(&file, "{\"q\": 1}\n").unwrap();
        let err = read(&spec(""), &file, "spec.eval.dataset")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("spec.eval.dataset.path") && err.contains("not a readable Parquet file"),
            "{err}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
