//! LoRA adapters on the decoder's linear layers, in PEFT's layout (docs/lora.md).
//!
//! A targeted module computes `y = x Wᵀ + s · (x Aᵀ) Bᵀ` with `A: [r, in]`, `B: [out, r]` and
//! `s = alpha / r` (`alpha / √r` with rsLoRA): PEFT's `lora.Linear` in eval mode. A new
//! adapter starts as PEFT's does, `A ~ U(±1/√in)` and `B = 0`, so it computes the base model
//! until it is trained. A stacked linear (q/k/v, gate/up, see [`super::linear::Linear`]) holds
//! one part per targeted module, over that module's rows of the stack.
//!
//! On disk an adapter is a folder PEFT and vLLM load: `adapter_config.json` and
//! `adapter_model.safetensors`, tensors named
//! `base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight`. MoE experts are adapted one
//! by one (`…mlp.experts.5.gate_proj.lora_A.weight`), the layout vLLM serves by default and PEFT
//! converts on load; PEFT's fused-expert layout (`…mlp.experts.lora_A.weight`) is not read.

use std::collections::BTreeMap;
use std::path::Path;

use rand::{Rng, SeedableRng};
use tch::{Device, Kind, Tensor};

use super::loader::load_safetensors_dir;
use super::{Error, Result};

/// The modules an adapter may target: the seven projections of every decoder layer (the
/// experts' too, by the same names).
pub const TARGETS: [&str; 7] = [
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
];

/// The adapter's file names in a folder, PEFT's.
pub const CONFIG_FILE: &str = "adapter_config.json";
pub const WEIGHTS_FILE: &str = super::loader::ADAPTER_WEIGHTS;

/// An adapter's shape: PEFT's `LoraConfig` fields moult reads and writes.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LoraConfig {
    /// `r`.
    pub rank: i64,
    /// `lora_alpha`.
    pub alpha: f64,
    /// `use_rslora`: scale by `alpha / √r` instead of `alpha / r`.
    #[serde(default)]
    pub rslora: bool,
    /// `lora_dropout`: the probability of dropping an input of `A` in a forward that computes
    /// gradients (the trainer's), as PEFT's train mode; never at inference.
    #[serde(default)]
    pub dropout: f64,
    /// `target_modules`: names of [`TARGETS`]; a module is targeted when its name ends with one.
    pub targets: Vec<String>,
}

impl LoraConfig {
    /// The factor `s` of the adapter's output.
    pub fn scale(&self) -> f64 {
        if self.rslora {
            self.alpha / (self.rank as f64).sqrt()
        } else {
            self.alpha / self.rank as f64
        }
    }

    /// Refuses a rank below 1, a non-positive or non-finite alpha, and targets outside
    /// [`TARGETS`] (or none).
    pub fn check(&self) -> Result<()> {
        let bad = |m: String| Err(Error::Config(format!("LoRA adapter: {m}")));
        if self.rank < 1 {
            return bad(format!("rank must be at least 1, got {}", self.rank));
        }
        if !(self.alpha.is_finite() && self.alpha > 0.0) {
            return bad(format!("alpha must be positive, got {}", self.alpha));
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return bad(format!("dropout must be in [0, 1), got {}", self.dropout));
        }
        if self.targets.is_empty() {
            return bad(format!(
                "targetModules is empty; name some of {}",
                TARGETS.join(", ")
            ));
        }
        if let Some(t) = self.targets.iter().find(|t| !TARGETS.contains(&t.as_str())) {
            return bad(format!(
                "target module `{t}` is not one moult adapts; accepted: {}",
                TARGETS.join(", ")
            ));
        }
        Ok(())
    }

    /// Whether the module named `module` (`model.layers.0.self_attn.q_proj`) is targeted, as
    /// PEFT matches a list of target names.
    pub fn adapts(&self, module: &str) -> bool {
        let last = module.rsplit('.').next().unwrap_or(module);
        self.targets.iter().any(|t| t == last)
    }

    /// `adapter_config.json` as PEFT writes it for this adapter of the model `base` (the value
    /// PEFT and vLLM check: exactly what they load without warnings or refusals).
    pub fn to_peft(&self, base: &str) -> serde_json::Value {
        serde_json::json!({
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": base,
            "revision": null,
            "r": self.rank,
            "lora_alpha": self.alpha,
            "lora_dropout": self.dropout,
            "use_rslora": self.rslora,
            "use_dora": false,
            "bias": "none",
            "fan_in_fan_out": false,
            "init_lora_weights": true,
            "inference_mode": true,
            "target_modules": self.targets,
            "modules_to_save": null,
            "rank_pattern": {},
            "alpha_pattern": {},
        })
    }

    /// Reads PEFT's `adapter_config.json`, refusing what moult does not compute (`path` names
    /// the file in errors).
    pub fn from_peft(value: &serde_json::Value, path: &Path) -> Result<Self> {
        let bad = |message: String| Error::Checkpoint {
            path: path.into(),
            message,
        };
        let field = |k: &str| value.get(k).filter(|v| !v.is_null());
        if let Some(t) = field("peft_type").and_then(|v| v.as_str()) {
            if t != "LORA" {
                return Err(bad(format!(
                    "peft_type is {t:?}; moult reads LORA adapters"
                )));
            }
        }
        for (key, off) in [
            ("bias", "none"),
            ("use_dora", "false"),
            ("lora_bias", "false"),
        ] {
            if let Some(v) = field(key) {
                let v = v.as_str().map_or_else(|| v.to_string(), str::to_string);
                if v != off {
                    return Err(bad(format!("{key} is {v}; moult computes only {off}")));
                }
            }
        }
        for key in ["rank_pattern", "alpha_pattern", "target_parameters"] {
            if field(key).is_some_and(|v| v.as_object().is_none_or(|o| !o.is_empty())) {
                return Err(bad(format!(
                    "{key} is set; moult reads adapters with one rank and alpha for every module (the fused-expert layout is not read: docs/lora.md)"
                )));
            }
        }
        let targets = match field("target_modules") {
            Some(serde_json::Value::Array(a)) => a
                .iter()
                .map(|v| v.as_str().map(str::to_string))
                .collect::<Option<Vec<_>>>(),
            _ => None,
        }
        .ok_or_else(|| bad("target_modules must be a list of module names".into()))?;
        let config = Self {
            rank: field("r").and_then(|v| v.as_i64()).unwrap_or(8),
            alpha: field("lora_alpha").and_then(|v| v.as_f64()).unwrap_or(8.0),
            rslora: field("use_rslora")
                .and_then(|v| v.as_bool())
                .unwrap_or(false),
            dropout: field("lora_dropout")
                .and_then(|v| v.as_f64())
                .unwrap_or(0.0),
            targets,
        };
        config.check().map_err(|e| bad(e.to_string()))?;
        Ok(config)
    }
}

/// A run's `spec.model.lora`, defaults filled in (the operator's `moult engine --lora` value).
impl From<&moult_operator::api::LoraSpec> for LoraConfig {
    fn from(spec: &moult_operator::api::LoraSpec) -> Self {
        serde_json::from_value(spec.adapter()).expect("LoraSpec::adapter is a LoraConfig")
    }
}

/// The name PEFT saves module `module`'s `A` (`which = 'A'`) or `B` under.
pub fn peft_name(module: &str, which: char) -> String {
    format!("base_model.model.{module}.lora_{which}.weight")
}

/// Whether `dir` holds a LoRA adapter (PEFT's `adapter_config.json`).
pub fn is_adapter(dir: &Path) -> bool {
    dir.join(CONFIG_FILE).is_file()
}

/// Reads an adapter folder: its config, the base model folder it adapts
/// (`base_model_name_or_path`, relative to `dir` when relative) and its tensors in `kind` on
/// `device`, by PEFT name.
pub fn read_adapter(
    dir: &Path,
    kind: Kind,
    device: Device,
) -> Result<(LoraConfig, std::path::PathBuf, BTreeMap<String, Tensor>)> {
    let path = dir.join(CONFIG_FILE);
    let text = std::fs::read_to_string(&path).map_err(|source| Error::Io {
        path: path.clone(),
        source,
    })?;
    let value: serde_json::Value = serde_json::from_str(&text).map_err(|e| Error::Checkpoint {
        path: path.clone(),
        message: e.to_string(),
    })?;
    let config = LoraConfig::from_peft(&value, &path)?;
    let base = value["base_model_name_or_path"]
        .as_str()
        .unwrap_or_default();
    if base.is_empty() {
        return Err(Error::Checkpoint {
            path,
            message: "base_model_name_or_path does not name the base model's folder".into(),
        });
    }
    let weights = load_safetensors_dir(dir, kind, device)?;
    Ok((config, dir.join(base), weights))
}

/// Writes the weights `weights` of `model` into the folder `dir`: `model.safetensors`, or for a
/// model with a LoRA adapter the adapter's two files, naming `base` as its base model.
pub fn write_weights(
    dir: &Path,
    model: &super::CausalLm,
    base: &Path,
    weights: &[(String, Tensor)],
) -> Result<()> {
    match model.lora() {
        Some(config) => write_adapter(dir, config, base, weights),
        None => Ok(Tensor::write_safetensors(
            weights,
            dir.join("model.safetensors"),
        )?),
    }
}

/// The weights of the model folder `dir` by checkpoint name, in float32 on the CPU: its
/// `model.safetensors`, or for an adapter folder its base model's with the adapter merged in
/// (`W + s·B A` on each adapted module).
pub fn merged_weights(dir: &Path) -> Result<Vec<(String, Tensor)>> {
    if !is_adapter(dir) {
        return Ok(Tensor::read_safetensors(dir.join("model.safetensors"))?);
    }
    let (config, base, adapter) = read_adapter(dir, Kind::Float, Device::Cpu)?;
    let mut weights = load_safetensors_dir(&base, Kind::Float, Device::Cpu)?;
    for (name, a) in &adapter {
        let Some(module) = name.strip_suffix(".lora_A.weight") else {
            continue;
        };
        let missing = |name: String| Error::Weight {
            message: "is missing: the adapter and its base model do not match".into(),
            name,
        };
        let b = adapter.get(&format!("{module}.lora_B.weight"));
        let b = b.ok_or_else(|| missing(format!("{module}.lora_B.weight")))?;
        let key = format!("{}.weight", module.trim_start_matches("base_model.model."));
        let w = weights.get_mut(&key).ok_or_else(|| missing(key.clone()))?;
        *w = &*w + b.matmul(a) * config.scale();
    }
    Ok(weights.into_iter().collect())
}

/// The weights file of the model folder `dir`: the adapter's when it holds one.
pub fn weights_file(dir: &Path) -> &'static str {
    if is_adapter(dir) {
        WEIGHTS_FILE
    } else {
        "model.safetensors"
    }
}

/// Writes an adapter folder's two files into `dir` (made when missing): `config` as PEFT's
/// `adapter_config.json` for the base model folder `base`, and `weights` (PEFT names) as
/// `adapter_model.safetensors`.
pub fn write_adapter(
    dir: &Path,
    config: &LoraConfig,
    base: &Path,
    weights: &[(String, Tensor)],
) -> Result<()> {
    let path = dir.join(CONFIG_FILE);
    std::fs::create_dir_all(dir).map_err(|source| Error::Io {
        path: dir.into(),
        source,
    })?;
    let base = std::fs::canonicalize(base).unwrap_or_else(|_| base.to_path_buf());
    let json = config.to_peft(&base.to_string_lossy());
    let text = serde_json::to_string_pretty(&json).expect("plain data serializes");
    std::fs::write(&path, text).map_err(|source| Error::Io { path, source })?;
    Tensor::write_safetensors(weights, dir.join(WEIGHTS_FILE))?;
    Ok(())
}

/// The `__metadata__` key of an adapter sent as one safetensors file ([`adapter_bytes`]).
const CONFIG_METADATA: &str = "adapter_config";

/// An adapter as one safetensors file, its `adapter_config.json` (for the base `base`) in the
/// file's metadata, its tensors in float32: what a run uploads to a pool's engines (docs/lora.md,
/// "Engine pools").
pub fn adapter_bytes(config: &LoraConfig, base: &str, weights: &[(String, Tensor)]) -> Vec<u8> {
    let data: Vec<(String, Vec<u8>, Vec<usize>)> = (weights.iter())
        .map(|(name, t)| {
            let t = t.to_device(Device::Cpu).to_kind(Kind::Float).contiguous();
            let values = Vec::<f32>::try_from(t.flatten(0, -1)).expect("a float tensor");
            let shape = t.size().iter().map(|&d| d as usize).collect();
            (
                name.clone(),
                values.iter().flat_map(|v| v.to_le_bytes()).collect(),
                shape,
            )
        })
        .collect();
    let views = data.iter().map(|(name, bytes, shape)| {
        let view =
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), bytes);
        (name.as_str(), view.expect("the shape fits the data"))
    });
    let metadata = [(
        CONFIG_METADATA.to_string(),
        config.to_peft(base).to_string(),
    )];
    safetensors::serialize(views, Some(metadata.into_iter().collect()))
        .expect("float32 tensors serialize")
}

/// Reads [`adapter_bytes`]' file back: the adapter's shape, and its tensors in `kind` on
/// `device` (errors name `what` as the file).
pub fn adapter_from_bytes(
    bytes: &[u8],
    what: &Path,
    kind: Kind,
    device: Device,
) -> Result<(LoraConfig, BTreeMap<String, Tensor>)> {
    let bad = |message: String| Error::Checkpoint {
        path: what.into(),
        message,
    };
    let (_, metadata) = safetensors::SafeTensors::read_metadata(bytes)
        .map_err(|e| bad(format!("not a valid safetensors file: {e}")))?;
    let config = (metadata.metadata().as_ref())
        .and_then(|m| m.get(CONFIG_METADATA))
        .ok_or_else(|| bad(format!("its metadata has no `{CONFIG_METADATA}`")))?;
    let config =
        serde_json::from_str(config).map_err(|e| bad(format!("{CONFIG_METADATA}: {e}")))?;
    let config = LoraConfig::from_peft(&config, what)?;
    let mut weights = BTreeMap::new();
    super::loader::tensors_from_bytes(bytes, what, kind, device, &mut weights)?;
    Ok((config, weights))
}

/// Which adapter each row of a packed batch computes with: several adapters share one forward,
/// each adding its output to its own rows (docs/lora.md, "Several adapters in one engine").
#[derive(Debug, Default)]
pub(crate) struct Rows {
    /// Per row: the adapter's slot, `None` for the base alone.
    per_row: Vec<Option<usize>>,
    /// Per slot in use: its rows, `None` when it has every row.
    groups: Vec<(usize, Option<Tensor>)>,
}

impl Rows {
    pub fn new(per_row: Vec<Option<usize>>, device: Device) -> Self {
        let mut by_slot: BTreeMap<usize, Vec<i64>> = BTreeMap::new();
        for (row, slot) in per_row.iter().enumerate() {
            if let Some(slot) = slot {
                by_slot.entry(*slot).or_default().push(row as i64);
            }
        }
        let groups = (by_slot.into_iter())
            .map(|(slot, rows)| {
                let all = rows.len() == per_row.len();
                (
                    slot,
                    (!all).then(|| Tensor::from_slice(&rows).to_device(device)),
                )
            })
            .collect();
        Self { per_row, groups }
    }

    /// The rows `rows` of this batch, in that order (the tokens routed to an expert).
    pub fn subset(&self, rows: &[i64], device: Device) -> Self {
        if self.groups.is_empty() {
            return Self::default();
        }
        Self::new(
            rows.iter().map(|&r| self.per_row[r as usize]).collect(),
            device,
        )
    }

    /// The slots in use, each with its rows (`None`: every row).
    pub fn groups(&self) -> &[(usize, Option<Tensor>)] {
        &self.groups
    }
}

/// A module an adapter may target: its name (`model.layers.0.self_attn.q_proj`), its input
/// size and its rows of the output.
pub(crate) type Module = (String, i64, i64);

/// One targeted module's part of a (possibly stacked) linear: its rows of the output, `A`, `B`.
#[derive(Debug)]
pub(crate) struct Part {
    pub start: i64,
    pub rows: i64,
    pub a: Tensor,
    pub b: Tensor,
}

/// A linear's adapter: its parts in row order, the scale `s` and the dropout.
#[derive(Debug)]
pub(crate) struct Adapter {
    pub parts: Vec<Part>,
    pub scale: f64,
    pub dropout: f64,
}

impl Adapter {
    /// `s · (x Aᵀ) Bᵀ` for every part, `[rows of x, out]`, zero on rows no part covers.
    pub fn delta(&self, x: &Tensor, out: i64) -> Tensor {
        let n = x.size()[0];
        let mut pieces = Vec::with_capacity(2 * self.parts.len() + 1);
        let mut at = 0;
        for p in &self.parts {
            if p.start > at {
                pieces.push(x.new_zeros([n, p.start - at], (x.kind(), x.device())));
            }
            let mut xa = x.matmul(&p.a.tr());
            // Dropout only where gradients flow (the trainer's forward), as PEFT's train mode.
            if self.dropout > 0.0 && xa.requires_grad() {
                xa = x.dropout(self.dropout, true).matmul(&p.a.tr());
            }
            pieces.push(xa.matmul(&p.b.tr()));
            at = p.start + p.rows;
        }
        if out > at {
            pieces.push(x.new_zeros([n, out - at], (x.kind(), x.device())));
        }
        let delta = if pieces.len() == 1 {
            pieces.pop().expect("one piece")
        } else {
            Tensor::cat(&pieces, 1)
        };
        delta * self.scale
    }

    /// `A` then `B` of each part: the adapter's trainable tensors.
    pub fn tensors(&self) -> impl Iterator<Item = &Tensor> {
        self.parts.iter().flat_map(|p| [&p.a, &p.b])
    }
}

/// A new adapter's tensors for the modules `modules` (name, `in`, `out`), PEFT's
/// initialisation from `seed`: `A ~ U(±1/√in)`, `B = 0`.
pub(crate) fn init(
    config: &LoraConfig,
    modules: &[Module],
    seed: u64,
    kind: Kind,
    device: Device,
) -> BTreeMap<String, Tensor> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let r = config.rank;
    let mut out = BTreeMap::new();
    for (module, fan_in, fan_out) in modules {
        let bound = 1.0 / (*fan_in as f32).sqrt();
        let a: Vec<f32> = (0..r * fan_in)
            .map(|_| rng.gen_range(-bound..bound))
            .collect();
        let a = Tensor::from_slice(&a).view([r, *fan_in]);
        out.insert(peft_name(module, 'A'), a.to_kind(kind).to_device(device));
        let b = Tensor::zeros([*fan_out, r], (kind, device));
        out.insert(peft_name(module, 'B'), b);
    }
    out
}
