//! Reading safetensors checkpoints: one `model.safetensors`, or shards listed in
//! `model.safetensors.index.json`, memory-mapped and turned into tensors of the requested dtype
//! on the requested device. Names are kept exactly as the checkpoint spells them.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use safetensors::{Dtype, SafeTensors};
use tch::{Device, Kind, Tensor};

use super::{Error, Result};

/// Parses a dtype name as transformers and vLLM write it (`float32`, `bfloat16`, `float16`).
pub fn parse_dtype(name: &str) -> Option<Kind> {
    match name.trim_start_matches("torch.") {
        "float32" | "float" | "f32" => Some(Kind::Float),
        "bfloat16" | "bf16" => Some(Kind::BFloat16),
        "float16" | "half" | "f16" => Some(Kind::Half),
        "float64" | "double" | "f64" => Some(Kind::Double),
        _ => None,
    }
}

/// The transformers name of a floating dtype.
pub fn dtype_name(kind: Kind) -> &'static str {
    match kind {
        Kind::Float => "float32",
        Kind::BFloat16 => "bfloat16",
        Kind::Half => "float16",
        Kind::Double => "float64",
        _ => "unsupported",
    }
}

fn kind_of(dtype: Dtype) -> Option<Kind> {
    match dtype {
        Dtype::F32 => Some(Kind::Float),
        Dtype::BF16 => Some(Kind::BFloat16),
        Dtype::F16 => Some(Kind::Half),
        Dtype::F64 => Some(Kind::Double),
        _ => None,
    }
}

/// The weights file of a LoRA adapter's folder (PEFT's name; `super::lora`).
pub(super) const ADAPTER_WEIGHTS: &str = "adapter_model.safetensors";

/// The checkpoint files of a model folder, in a stable order.
fn checkpoint_files(dir: &Path) -> Result<Vec<PathBuf>> {
    // A LoRA adapter folder's one file (super::lora) is read the same way.
    for single in ["model.safetensors", ADAPTER_WEIGHTS].map(|f| dir.join(f)) {
        if single.is_file() {
            return Ok(vec![single]);
        }
    }
    let index_path = dir.join("model.safetensors.index.json");
    let text = std::fs::read_to_string(&index_path).map_err(|_| Error::Checkpoint {
        path: dir.to_path_buf(),
        message: "holds neither model.safetensors nor model.safetensors.index.json".into(),
    })?;
    let index: serde_json::Value = serde_json::from_str(&text).map_err(|e| Error::Checkpoint {
        path: index_path.clone(),
        message: format!("not valid JSON: {e}"),
    })?;
    let map = index
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| Error::Checkpoint {
            path: index_path.clone(),
            message: "has no `weight_map` object".into(),
        })?;
    let mut files: Vec<PathBuf> = map
        .values()
        .filter_map(|v| v.as_str())
        .map(|f| dir.join(f))
        .collect();
    files.sort();
    files.dedup();
    Ok(files)
}

/// Loads every tensor of a model folder, converted to `kind` and moved to `device`.
pub fn load_safetensors_dir(
    dir: &Path,
    kind: Kind,
    device: Device,
) -> Result<BTreeMap<String, Tensor>> {
    let mut out = BTreeMap::new();
    for path in checkpoint_files(dir)? {
        // Read, not memory-mapped: mapping needs `unsafe`, and each shard is dropped as soon as
        // its tensors are converted, so peak memory is the model plus one shard.
        let bytes = std::fs::read(&path).map_err(|source| Error::Io {
            path: path.clone(),
            source,
        })?;
        tensors_from_bytes(&bytes, &path, kind, device, &mut out)?;
    }
    Ok(out)
}

/// Adds the tensors of the safetensors file `bytes` (read from `path`, named in errors) to
/// `out`, converted to `kind` on `device`.
pub(super) fn tensors_from_bytes(
    bytes: &[u8],
    path: &Path,
    kind: Kind,
    device: Device,
    out: &mut BTreeMap<String, Tensor>,
) -> Result<()> {
    let st = SafeTensors::deserialize(bytes).map_err(|e| Error::Checkpoint {
        path: path.into(),
        message: format!("not a valid safetensors file: {e}"),
    })?;
    for (name, view) in st.tensors() {
        let src_kind = kind_of(view.dtype()).ok_or_else(|| Error::Weight {
            name: name.clone(),
            message: format!(
                "dtype {:?} is not supported (float32, bfloat16, float16)",
                view.dtype()
            ),
        })?;
        let shape: Vec<i64> = view.shape().iter().map(|&d| d as i64).collect();
        let tensor = Tensor::f_from_data_size(view.data(), &shape, src_kind)?
            .f_to_kind(kind)?
            .f_to_device(device)?;
        out.insert(name, tensor);
    }
    Ok(())
}

/// Takes named weights out of the loaded map, checking each shape.
pub(super) struct WeightTaker {
    /// The weights not taken yet: empty once a model has used the whole checkpoint.
    pub(super) map: BTreeMap<String, Tensor>,
    /// The weights taken, by name (a stacked part as its rows of the stack).
    pub(super) taken: BTreeMap<String, Tensor>,
}

impl WeightTaker {
    pub(super) fn new(map: BTreeMap<String, Tensor>) -> Self {
        Self {
            map,
            taken: BTreeMap::new(),
        }
    }

    pub(super) fn take(&mut self, name: &str, shape: &[usize]) -> Result<Tensor> {
        let tensor = self.map.remove(name).ok_or_else(|| Error::Weight {
            name: name.into(),
            message: "missing from the checkpoint".into(),
        })?;
        let expected: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
        if tensor.size() != expected {
            return Err(Error::Weight {
                name: name.into(),
                message: format!(
                    "has shape {:?}, the config implies {expected:?}",
                    tensor.size()
                ),
            });
        }
        self.taken.insert(name.to_string(), tensor.shallow_clone());
        Ok(tensor)
    }

    /// [`WeightTaker::take`] when the config says the weight exists (a bias, a norm).
    pub(super) fn take_if(
        &mut self,
        present: bool,
        name: &str,
        shape: &[usize],
    ) -> Result<Option<Tensor>> {
        present.then(|| self.take(name, shape)).transpose()
    }

    /// [`WeightTaker::take_stacked`] when the config says the weights exist.
    pub(super) fn take_stacked_if<const N: usize>(
        &mut self,
        present: bool,
        parts: &[(String, [usize; N])],
    ) -> Result<Option<Tensor>> {
        present.then(|| self.take_stacked(parts)).transpose()
    }

    /// Takes several `[rows_i, ...]` weights (or biases) and stacks them into one
    /// `[Σ rows_i, ...]` tensor; each name then refers to its rows of the stack.
    pub(super) fn take_stacked<const N: usize>(
        &mut self,
        parts: &[(String, [usize; N])],
    ) -> Result<Tensor> {
        let tensors = parts
            .iter()
            .map(|(name, shape)| self.take(name, shape))
            .collect::<Result<Vec<_>>>()?;
        let stacked = Tensor::cat(&tensors, 0);
        let mut offset = 0;
        for (name, shape) in parts {
            let rows = shape[0] as i64;
            self.taken
                .insert(name.clone(), stacked.narrow(0, offset, rows));
            offset += rows;
        }
        Ok(stacked)
    }
}
