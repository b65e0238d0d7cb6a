//! The Hugging Face `config.json` of a Qwen3 or Qwen3-MoE checkpoint, parsed and checked.
//!
//! Contract: a [`ModelConfig`] that constructs is one the model code implements exactly. Every
//! option we do not implement (another architecture, sliding windows, rope scaling, attention
//! bias, another activation) is refused here with a message naming the field, so a checkpoint
//! never loads into a forward that silently differs from transformers'.

use std::path::Path;

use serde::Deserialize;

use crate::model::{Error, Result};

/// Which of the implemented model families a checkpoint is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    /// `Qwen3ForCausalLM`.
    Qwen3,
    /// `Qwen3MoeForCausalLM`.
    Qwen3Moe,
}

/// The sparse-MLP part of a Qwen3-MoE config.
#[derive(Debug, Clone, PartialEq)]
pub struct MoeConfig {
    pub num_experts: usize,
    pub num_experts_per_tok: usize,
    pub moe_intermediate_size: usize,
    /// Renormalise the top-k gate probabilities to sum to one (Qwen3-MoE: true).
    pub norm_topk_prob: bool,
    /// Every `decoder_sparse_step`-th layer is sparse, except those in `mlp_only_layers`.
    pub decoder_sparse_step: usize,
    pub mlp_only_layers: Vec<usize>,
}

/// A checked model configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub architecture: Architecture,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    /// The checkpoint's own dtype (`torch_dtype`/`dtype`), if it names one.
    pub dtype: Option<String>,
    pub eos_token_ids: Vec<i64>,
    pub moe: Option<MoeConfig>,
}

/// `eos_token_id` is a single id or a list in HF configs.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum OneOrMany {
    One(i64),
    Many(Vec<i64>),
}

impl OneOrMany {
    fn into_vec(self) -> Vec<i64> {
        match self {
            OneOrMany::One(id) => vec![id],
            OneOrMany::Many(ids) => ids,
        }
    }
}

/// The raw JSON, with every field we read or must check.
#[derive(Debug, Deserialize)]
struct RawConfig {
    architectures: Option<Vec<String>>,
    model_type: Option<String>,
    vocab_size: Option<usize>,
    hidden_size: Option<usize>,
    intermediate_size: Option<usize>,
    num_hidden_layers: Option<usize>,
    num_attention_heads: Option<usize>,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    rms_norm_eps: Option<f64>,
    rope_theta: Option<f64>,
    /// transformers >= 5 writes `rope_parameters: {rope_type, rope_theta}` instead.
    rope_parameters: Option<serde_json::Value>,
    rope_scaling: Option<serde_json::Value>,
    max_position_embeddings: Option<usize>,
    #[serde(default)]
    tie_word_embeddings: bool,
    #[serde(default)]
    attention_bias: bool,
    #[serde(default)]
    use_sliding_window: bool,
    hidden_act: Option<String>,
    torch_dtype: Option<String>,
    dtype: Option<String>,
    eos_token_id: Option<OneOrMany>,
    /// transformers >= 5 saves this as `num_local_experts`.
    #[serde(alias = "num_local_experts")]
    num_experts: Option<usize>,
    num_experts_per_tok: Option<usize>,
    moe_intermediate_size: Option<usize>,
    norm_topk_prob: Option<bool>,
    decoder_sparse_step: Option<usize>,
    #[serde(default)]
    mlp_only_layers: Vec<usize>,
    quantization_config: Option<serde_json::Value>,
}

fn required(value: Option<usize>, field: &str) -> Result<usize> {
    match value {
        Some(0) => Err(Error::Config(format!("`{field}` must be positive, got 0"))),
        Some(v) => Ok(v),
        None => Err(Error::Config(format!("`{field}` is missing"))),
    }
}

impl ModelConfig {
    /// Reads `config.json` from a model folder.
    /// End-of-sequence ids are those of `config.json` and, when present, of
    /// `generation_config.json` (where Qwen3 lists `<|im_end|>` besides `<|endoftext|>`).
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|source| Error::Io {
            path: path.clone(),
            source,
        })?;
        let mut cfg = Self::from_json(&text).map_err(|e| match e {
            Error::Config(msg) => Error::Config(format!("{}: {msg}", path.display())),
            other => other,
        })?;
        let generation = dir.join("generation_config.json");
        if let Ok(text) = std::fs::read_to_string(&generation) {
            #[derive(Deserialize)]
            struct GenerationConfig {
                eos_token_id: Option<OneOrMany>,
            }
            let g: GenerationConfig = serde_json::from_str(&text).map_err(|e| {
                Error::Config(format!(
                    "{}: not valid JSON with an optional eos_token_id: {e}",
                    generation.display()
                ))
            })?;
            cfg.eos_token_ids
                .extend(g.eos_token_id.map(OneOrMany::into_vec).unwrap_or_default());
            cfg.eos_token_ids.sort_unstable();
            cfg.eos_token_ids.dedup();
        }
        Ok(cfg)
    }

    /// Parses and checks the text of a `config.json`.
    pub fn from_json(text: &str) -> Result<Self> {
        let raw: RawConfig = serde_json::from_str(text)
            .map_err(|e| Error::Config(format!("not a valid config.json: {e}")))?;
        let arch_name = raw
            .architectures
            .as_ref()
            .and_then(|a| a.first().cloned())
            .or_else(|| raw.model_type.clone())
            .ok_or_else(|| {
                Error::Config("neither `architectures` nor `model_type` is set".into())
            })?;
        let architecture = match arch_name.as_str() {
            "Qwen3ForCausalLM" | "qwen3" => Architecture::Qwen3,
            "Qwen3MoeForCausalLM" | "qwen3_moe" => Architecture::Qwen3Moe,
            other => {
                return Err(Error::Config(format!(
                    "architecture `{other}` is not supported; supported: Qwen3ForCausalLM, Qwen3MoeForCausalLM"
                )))
            }
        };
        if raw.attention_bias {
            return Err(Error::Config(
                "`attention_bias: true` is not supported".into(),
            ));
        }
        if raw.use_sliding_window {
            return Err(Error::Config(
                "`use_sliding_window: true` is not supported".into(),
            ));
        }
        if let Some(act) = &raw.hidden_act {
            if act != "silu" {
                return Err(Error::Config(format!(
                    "`hidden_act: {act}` is not supported; supported: silu"
                )));
            }
        }
        if raw.quantization_config.is_some() {
            return Err(Error::Config(
                "quantized checkpoints (`quantization_config`) are not supported".into(),
            ));
        }
        if let Some(scaling) = raw.rope_scaling.as_ref().filter(|v| !v.is_null()) {
            return Err(Error::Config(format!(
                "`rope_scaling: {scaling}` is not supported; only the default rotary embedding is"
            )));
        }
        let mut rope_theta = raw.rope_theta;
        if let Some(params) = raw.rope_parameters.as_ref().filter(|v| !v.is_null()) {
            let rope_type = params
                .get("rope_type")
                .and_then(|v| v.as_str())
                .unwrap_or("default");
            if rope_type != "default" {
                return Err(Error::Config(format!(
                    "`rope_parameters.rope_type: {rope_type}` is not supported; supported: default"
                )));
            }
            if let Some(theta) = params.get("rope_theta").and_then(|v| v.as_f64()) {
                rope_theta = Some(theta);
            }
        }
        let hidden_size = required(raw.hidden_size, "hidden_size")?;
        let num_attention_heads = required(raw.num_attention_heads, "num_attention_heads")?;
        let num_key_value_heads = required(
            raw.num_key_value_heads.or(Some(num_attention_heads)),
            "num_key_value_heads",
        )?;
        if num_attention_heads % num_key_value_heads != 0 {
            return Err(Error::Config(format!(
                "`num_attention_heads` ({num_attention_heads}) must be a multiple of `num_key_value_heads` ({num_key_value_heads})"
            )));
        }
        let head_dim = match raw.head_dim {
            Some(d) => required(Some(d), "head_dim")?,
            None => hidden_size / num_attention_heads,
        };
        if head_dim % 2 != 0 {
            return Err(Error::Config(format!(
                "`head_dim` must be even for rotary embeddings, got {head_dim}"
            )));
        }
        let num_hidden_layers = required(raw.num_hidden_layers, "num_hidden_layers")?;
        let moe = match architecture {
            Architecture::Qwen3 => None,
            Architecture::Qwen3Moe => {
                let num_experts = required(raw.num_experts, "num_experts")?;
                let num_experts_per_tok = required(raw.num_experts_per_tok, "num_experts_per_tok")?;
                if num_experts_per_tok > num_experts {
                    return Err(Error::Config(format!(
                        "`num_experts_per_tok` ({num_experts_per_tok}) exceeds `num_experts` ({num_experts})"
                    )));
                }
                if num_experts > usize::from(u16::MAX) + 1 {
                    return Err(Error::Config(format!(
                        "`num_experts` ({num_experts}) exceeds 65536, the most routed-expert ids can carry"
                    )));
                }
                if let Some(&bad) = raw
                    .mlp_only_layers
                    .iter()
                    .find(|&&l| l >= num_hidden_layers)
                {
                    return Err(Error::Config(format!(
                        "`mlp_only_layers` names layer {bad}, but the model has {num_hidden_layers} layers"
                    )));
                }
                Some(MoeConfig {
                    num_experts,
                    num_experts_per_tok,
                    moe_intermediate_size: required(
                        raw.moe_intermediate_size,
                        "moe_intermediate_size",
                    )?,
                    norm_topk_prob: raw.norm_topk_prob.unwrap_or(false),
                    decoder_sparse_step: required(
                        raw.decoder_sparse_step.or(Some(1)),
                        "decoder_sparse_step",
                    )?,
                    mlp_only_layers: raw.mlp_only_layers,
                })
            }
        };
        Ok(Self {
            architecture,
            vocab_size: required(raw.vocab_size, "vocab_size")?,
            hidden_size,
            intermediate_size: required(raw.intermediate_size, "intermediate_size")?,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            rms_norm_eps: raw.rms_norm_eps.unwrap_or(1e-6),
            rope_theta: rope_theta.unwrap_or(10_000.0),
            max_position_embeddings: required(
                raw.max_position_embeddings,
                "max_position_embeddings",
            )?,
            tie_word_embeddings: raw.tie_word_embeddings,
            dtype: raw.dtype.or(raw.torch_dtype),
            eos_token_ids: raw
                .eos_token_id
                .map(OneOrMany::into_vec)
                .unwrap_or_default(),
            moe,
        })
    }

    /// Whether layer `layer` has a sparse (MoE) MLP, per transformers' Qwen3-MoE rule.
    pub fn is_sparse_layer(&self, layer: usize) -> bool {
        match &self.moe {
            None => false,
            Some(moe) => {
                !moe.mlp_only_layers.contains(&layer)
                    && moe.num_experts > 0
                    && (layer + 1) % moe.decoder_sparse_step == 0
            }
        }
    }

    /// Number of layers whose routing is captured and replayed.
    pub fn num_sparse_layers(&self) -> usize {
        (0..self.num_hidden_layers)
            .filter(|&l| self.is_sparse_layer(l))
            .count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(name: &str) -> String {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/fixtures")
            .join(name);
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    }

    #[test]
    fn parses_real_qwen3_configs() {
        let dense = ModelConfig::from_json(&fixture("qwen3_0.6b_config.json")).unwrap();
        assert_eq!(dense.architecture, Architecture::Qwen3);
        assert_eq!(
            (dense.hidden_size, dense.num_hidden_layers, dense.head_dim),
            (1024, 28, 128)
        );
        assert_eq!(
            (dense.num_attention_heads, dense.num_key_value_heads),
            (16, 8)
        );
        assert!(dense.tie_word_embeddings);
        assert_eq!(dense.vocab_size, 151_936);

        let moe = ModelConfig::from_json(&fixture("qwen3_30b_a3b_config.json")).unwrap();
        let m = moe.moe.as_ref().unwrap();
        assert_eq!((m.num_experts, m.num_experts_per_tok), (128, 8));
        assert!(m.norm_topk_prob);
        assert_eq!(moe.num_sparse_layers(), moe.num_hidden_layers);
    }

    #[test]
    fn refuses_unsupported_options_by_name() {
        let base = fixture("qwen3_0.6b_config.json");
        let mut v: serde_json::Value = serde_json::from_str(&base).unwrap();
        v["architectures"] = serde_json::json!(["LlamaForCausalLM"]);
        let err = ModelConfig::from_json(&v.to_string())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("LlamaForCausalLM") && err.contains("Qwen3ForCausalLM"),
            "{err}"
        );

        let mut v: serde_json::Value = serde_json::from_str(&base).unwrap();
        v["rope_scaling"] = serde_json::json!({"rope_type": "yarn", "factor": 4.0});
        let err = ModelConfig::from_json(&v.to_string())
            .unwrap_err()
            .to_string();
        assert!(err.contains("rope_scaling"), "{err}");

        let mut v: serde_json::Value = serde_json::from_str(&base).unwrap();
        v["use_sliding_window"] = serde_json::json!(true);
        let err = ModelConfig::from_json(&v.to_string())
            .unwrap_err()
            .to_string();
        assert!(err.contains("use_sliding_window"), "{err}");

        let mut v: serde_json::Value = serde_json::from_str(&base).unwrap();
        v["num_key_value_heads"] = serde_json::json!(5);
        let err = ModelConfig::from_json(&v.to_string())
            .unwrap_err()
            .to_string();
        assert!(err.contains("num_key_value_heads"), "{err}");
    }

    #[test]
    fn generation_config_adds_end_of_sequence_ids() {
        let dir = std::env::temp_dir().join(format!("moult-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("config.json"), fixture("qwen3_0.6b_config.json")).unwrap();
        std::fs::write(
            dir.join("generation_config.json"),
            fixture("qwen3_0.6b_generation_config.json"),
        )
        .unwrap();
        let cfg = ModelConfig::from_dir(&dir).unwrap();
        // config.json: 151645 (<|im_end|>); generation_config.json: [151645, 151643].
        assert_eq!(cfg.eos_token_ids, vec![151_643, 151_645]);
        std::fs::write(
            dir.join("generation_config.json"),
            "{\"eos_token_id\": \"x\"}",
        )
        .unwrap();
        let err = ModelConfig::from_dir(&dir).unwrap_err().to_string();
        assert!(err.contains("generation_config.json"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn sparse_layer_rule_matches_transformers() {
        let mut v: serde_json::Value =
            serde_json::from_str(&fixture("qwen3_30b_a3b_config.json")).unwrap();
        v["decoder_sparse_step"] = serde_json::json!(2);
        v["mlp_only_layers"] = serde_json::json!([3]);
        let cfg = ModelConfig::from_json(&v.to_string()).unwrap();
        assert!(!cfg.is_sparse_layer(0));
        assert!(cfg.is_sparse_layer(1));
        assert!(!cfg.is_sparse_layer(3));
        assert!(cfg.is_sparse_layer(5));
    }
}
