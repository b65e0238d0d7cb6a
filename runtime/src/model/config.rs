//! The Hugging Face `config.json` of a checkpoint of an implemented family (Qwen3, Qwen3-MoE,
//! Qwen2/Qwen2.5, Llama 3.x, Mistral), parsed and checked. The families differ by configuration:
//! q/k norms (Qwen3), attention and MLP biases (Qwen2's q/k/v, Llama's `attention_bias` and
//! `mlp_bias`), rope scaling (`llama3`), an explicit `head_dim` (docs/models.md).
//!
//! Contract: a [`ModelConfig`] that constructs is one the model code implements exactly. Every
//! option we do not implement (another architecture, sliding windows, another rope scaling,
//! another activation) is refused here with a message naming the field, so a checkpoint never
//! loads into a forward that silently differs from transformers'.

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
    /// `Qwen2ForCausalLM` (Qwen2, Qwen2.5): q/k/v biases, no q/k norms.
    Qwen2,
    /// `LlamaForCausalLM` (Llama 3.x): optional biases, `llama3` rope scaling.
    Llama,
    /// `MistralForCausalLM`: no biases, an explicit `head_dim`.
    Mistral,
}

/// How the rotary frequencies are scaled (`rope_scaling` / `rope_parameters`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RopeScaling {
    /// Llama 3.1's: low frequencies divided by `factor`, high ones kept, a smooth ramp between.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: f64,
    },
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
    /// RMSNorm on each head's queries and keys before rope (Qwen3's `q_norm`/`k_norm`).
    pub qk_norm: bool,
    /// Biases of `q_proj`, `k_proj`, `v_proj`; of `o_proj`; of the MLP's three projections.
    pub qkv_bias: bool,
    pub o_bias: bool,
    pub mlp_bias: bool,
    pub rope_scaling: Option<RopeScaling>,
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
    mlp_bias: bool,
    #[serde(default)]
    use_sliding_window: bool,
    sliding_window: Option<usize>,
    /// transformers >= 5: the attention of each layer (`full_attention`, `sliding_attention`).
    #[serde(default)]
    layer_types: Vec<String>,
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

/// The architectures a checkpoint may name, as an error message lists them.
const SUPPORTED: &str =
    "Qwen3ForCausalLM, Qwen3MoeForCausalLM, Qwen2ForCausalLM, LlamaForCausalLM, MistralForCausalLM";

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
            "Qwen2ForCausalLM" | "qwen2" => Architecture::Qwen2,
            "LlamaForCausalLM" | "llama" => Architecture::Llama,
            "MistralForCausalLM" | "mistral" => Architecture::Mistral,
            other => {
                return Err(Error::Config(format!(
                "architecture `{other}` is not supported; supported: {SUPPORTED} (docs/models.md)"
            )))
            }
        };
        use Architecture::*;
        // Biases: Qwen2 always has q/k/v ones; Qwen3 and Llama follow `attention_bias` (all four
        // projections); only Llama has `mlp_bias`; Mistral has none.
        let (qkv_bias, o_bias) = match architecture {
            Qwen2 => (true, false),
            Qwen3 | Qwen3Moe | Llama => (raw.attention_bias, raw.attention_bias),
            Mistral => (false, false),
        };
        if raw.attention_bias && architecture == Mistral {
            return Err(Error::Config(
                "`attention_bias: true` is not supported for MistralForCausalLM (transformers has no such option)".into(),
            ));
        }
        if raw.mlp_bias && architecture != Llama {
            return Err(Error::Config(format!(
                "`mlp_bias: true` is not supported for {arch_name}; only LlamaForCausalLM has it"
            )));
        }
        if raw.use_sliding_window {
            return Err(Error::Config(
                "`use_sliding_window: true` is not supported: sliding-window attention is not implemented (docs/models.md)".into(),
            ));
        }
        if let Some(layer) = raw.layer_types.iter().position(|t| t != "full_attention") {
            return Err(Error::Config(format!(
                "`layer_types[{layer}]: {}` is not supported: only full attention is implemented (docs/models.md)",
                raw.layer_types[layer]
            )));
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
        let mut rope_theta = raw.rope_theta;
        let mut rope_scaling = None;
        // Older configs say `rope_scaling`, transformers >= 5 `rope_parameters` (with the theta).
        for (field, params) in [
            ("rope_scaling", &raw.rope_scaling),
            ("rope_parameters", &raw.rope_parameters),
        ] {
            let Some(params) = params.as_ref().filter(|v| !v.is_null()) else {
                continue;
            };
            if let Some(theta) = params.get("rope_theta").and_then(|v| v.as_f64()) {
                rope_theta = Some(theta);
            }
            let rope_type = params
                .get("rope_type")
                .or_else(|| params.get("type"))
                .and_then(|v| v.as_str())
                .unwrap_or("default");
            match rope_type {
                "default" => {}
                "llama3" => {
                    let number = |key: &str| {
                        params.get(key).and_then(|v| v.as_f64()).ok_or_else(|| {
                            Error::Config(format!("`{field}.{key}` is missing (rope_type llama3)"))
                        })
                    };
                    let (low_freq_factor, high_freq_factor) =
                        (number("low_freq_factor")?, number("high_freq_factor")?);
                    if high_freq_factor <= low_freq_factor {
                        return Err(Error::Config(format!(
                            "`{field}.high_freq_factor` ({high_freq_factor}) must exceed `low_freq_factor` ({low_freq_factor})"
                        )));
                    }
                    rope_scaling = Some(RopeScaling::Llama3 {
                        factor: number("factor")?,
                        low_freq_factor,
                        high_freq_factor,
                        original_max_position_embeddings: number(
                            "original_max_position_embeddings",
                        )?,
                    });
                }
                other => {
                    return Err(Error::Config(format!(
                        "`{field}.rope_type: {other}` is not supported; supported: default, llama3 (docs/models.md)"
                    )))
                }
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
            Qwen3 | Qwen2 | Llama | Mistral => None,
            Qwen3Moe => {
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
        let max_position_embeddings =
            required(raw.max_position_embeddings, "max_position_embeddings")?;
        if let (Mistral, Some(window)) = (architecture, raw.sliding_window) {
            // Mistral slides every layer's window; one as long as the context never slides.
            if window < max_position_embeddings {
                return Err(Error::Config(format!(
                    "`sliding_window: {window}` (shorter than max_position_embeddings {max_position_embeddings}) is not supported: sliding-window attention is not implemented (docs/models.md)"
                )));
            }
        }
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
            max_position_embeddings,
            tie_word_embeddings: raw.tie_word_embeddings,
            qk_norm: matches!(architecture, Qwen3 | Qwen3Moe),
            qkv_bias,
            o_bias,
            mlp_bias: raw.mlp_bias,
            rope_scaling,
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

    /// A Llama 3.2-1B-shaped config (its model card's shapes and rope scaling), as transformers
    /// 4.x writes it.
    fn llama_3_2() -> serde_json::Value {
        serde_json::json!({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "attention_bias": false, "mlp_bias": false, "head_dim": 64, "hidden_act": "silu",
            "hidden_size": 2048, "intermediate_size": 8192, "max_position_embeddings": 131072,
            "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8,
            "pretraining_tp": 1, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
            "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                "original_max_position_embeddings": 8192, "rope_type": "llama3"},
            "tie_word_embeddings": true, "torch_dtype": "bfloat16", "vocab_size": 128256,
            "eos_token_id": [128001, 128008, 128009]
        })
    }

    #[test]
    fn each_family_reads_as_what_sets_it_apart() {
        let llama = ModelConfig::from_json(&llama_3_2().to_string()).unwrap();
        assert_eq!(llama.architecture, Architecture::Llama);
        assert!(!llama.qk_norm && !llama.qkv_bias && !llama.o_bias && !llama.mlp_bias);
        assert_eq!(
            llama.rope_scaling,
            Some(RopeScaling::Llama3 {
                factor: 32.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 8192.0
            })
        );
        assert_eq!((llama.rope_theta, llama.head_dim), (500000.0, 64));
        // transformers >= 5 writes the same as `rope_parameters`, theta inside.
        let mut v = llama_3_2();
        let mut params = v["rope_scaling"].take();
        params["rope_theta"] = serde_json::json!(500000.0);
        v["rope_parameters"] = params;
        v.as_object_mut().unwrap().remove("rope_theta");
        let again = ModelConfig::from_json(&v.to_string()).unwrap();
        assert_eq!(again, llama);
        // Llama's biases follow attention_bias (all four projections) and mlp_bias.
        let mut v = llama_3_2();
        v["attention_bias"] = serde_json::json!(true);
        v["mlp_bias"] = serde_json::json!(true);
        let biased = ModelConfig::from_json(&v.to_string()).unwrap();
        assert!(biased.qkv_bias && biased.o_bias && biased.mlp_bias);

        // Qwen2.5-7B-Instruct's shapes: q/k/v biases always, no q/k norms, no head_dim.
        let qwen2 = ModelConfig::from_json(
            &serde_json::json!({
                "architectures": ["Qwen2ForCausalLM"], "hidden_act": "silu", "hidden_size": 3584,
                "intermediate_size": 18944, "max_position_embeddings": 32768,
                "max_window_layers": 28, "num_attention_heads": 28, "num_hidden_layers": 28,
                "num_key_value_heads": 4, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
                "sliding_window": 131072, "tie_word_embeddings": false, "use_sliding_window": false,
                "vocab_size": 152064, "eos_token_id": 151645
            })
            .to_string(),
        )
        .unwrap();
        assert_eq!(qwen2.architecture, Architecture::Qwen2);
        assert!(qwen2.qkv_bias && !qwen2.o_bias && !qwen2.qk_norm);
        assert_eq!(qwen2.head_dim, 128);

        // Mistral-Nemo's explicit head_dim (not hidden/heads), and a window that never slides.
        let mistral = |window: serde_json::Value| {
            ModelConfig::from_json(
                &serde_json::json!({
                    "architectures": ["MistralForCausalLM"], "head_dim": 128, "hidden_act": "silu",
                    "hidden_size": 5120, "intermediate_size": 14336,
                    "max_position_embeddings": 1024000, "num_attention_heads": 32,
                    "num_hidden_layers": 40, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
                    "rope_theta": 1000000.0, "sliding_window": window, "vocab_size": 131072
                })
                .to_string(),
            )
        };
        let nemo = mistral(serde_json::Value::Null).unwrap();
        assert_eq!(
            (nemo.architecture, nemo.head_dim),
            (Architecture::Mistral, 128)
        );
        assert!(!nemo.qkv_bias && !nemo.qk_norm);
        let err = mistral(serde_json::json!(4096)).unwrap_err().to_string();
        assert!(err.contains("sliding_window: 4096"), "{err}");
    }

    #[test]
    fn refuses_unsupported_options_by_name() {
        let base = fixture("qwen3_0.6b_config.json");
        let mut v: serde_json::Value = serde_json::from_str(&base).unwrap();
        v["architectures"] = serde_json::json!(["GptOssForCausalLM"]);
        let err = ModelConfig::from_json(&v.to_string())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("GptOssForCausalLM") && err.contains("LlamaForCausalLM"),
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
