//! Data from outside the run's processes: the routed experts an engine reports with each token
//! (base64 `.npy`, from a vLLM pod) and the task files a manifest names (JSON lines or Parquet,
//! often downloaded from a hub).

use std::cell::RefCell;
use std::path::PathBuf;

use base64::Engine as _;
use moult_operator::api::DatasetSpec;
use moult_runtime::config::dataset::read;
use moult_runtime::engine::npy::{decode_routed_experts, encode_routed_experts};

/// An engine's `.npy` bytes: refused, or `[tokens, layers, top_k]` ids that encode back to the
/// same array.
pub fn routed_experts(data: &[u8]) {
    let b64 = base64::engine::general_purpose::STANDARD.encode(data);
    let Ok((shape, ids)) = decode_routed_experts(&b64) else {
        return;
    };
    assert_eq!(ids.len(), shape.iter().product::<usize>());
    let experts = ids.iter().map(|&i| i as usize + 1).max().unwrap_or(1);
    let again = encode_routed_experts(&ids, shape[0], shape[1], shape[2], experts);
    assert_eq!(decode_routed_experts(&again), Ok((shape, ids)));
}

thread_local! {
    static DIR: RefCell<Option<PathBuf>> = const { RefCell::new(None) };
}

/// A task file, as JSON lines or Parquet (the first byte picks; with its next bit set the
/// tasks are mapped through `columns`): refused naming the field, or tasks, each with exactly
/// the mapped fields.
pub fn tasks(data: &[u8]) {
    let Some((&pick, bytes)) = data.split_first() else {
        return;
    };
    let dir = DIR.with(|d| {
        d.borrow_mut()
            .get_or_insert_with(|| {
                let dir =
                    std::env::temp_dir().join(format!("moult-fuzz-tasks-{}", std::process::id()));
                std::fs::create_dir_all(&dir).expect("a scratch folder");
                dir
            })
            .clone()
    });
    let file = dir.join(if pick & 1 == 0 {
        "tasks.jsonl"
    } else {
        "tasks.parquet"
    });
    std::fs::write(&file, bytes).expect("write the task file");
    let mapped = pick & 2 != 0;
    let spec: DatasetSpec = serde_json::from_value(serde_json::json!({
        "path": file.to_string_lossy(),
        "columns": if mapped { serde_json::json!({"question": "problem", "answer": "solution"}) } else { serde_json::json!({}) },
    }))
    .expect("a dataset spec");
    // The reader turns the parquet crate's panics on malformed files into errors.
    let read = crate::panics_caught_inside(|| read(&spec, &file, "spec.agent.dataset"));
    let Ok(tasks) = read else {
        return;
    };
    assert!(!tasks.is_empty());
    if mapped {
        for task in &tasks {
            let mut keys: Vec<&String> = task.as_object().expect("an object").keys().collect();
            keys.sort();
            assert_eq!(keys, ["answer", "question"]);
        }
    }
}
