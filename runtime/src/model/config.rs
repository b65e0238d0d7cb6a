//! The Hugging Face `config.json` of a checkpoint of an implemented family (Qwen3, Qwen3-MoE,
//! Qwen2/Qwen2.5, Llama 3.x, Mistral, Gemma 3), parsed and checked. The families differ by
//! configuration: q/k norms (Qwen3, Gemma 3), attention and MLP biases (Qwen2's q/k/v, Llama's
//! `attention_bias` and `mlp_bias`), rope scaling (`llama3`, `linear`), an explicit `head_dim`,
//! sliding-window layers (Mistral, Gemma 3) and Gemma's norms, embedding scale, GeGLU and
//! attention scale (docs/models.md).
//!
//! Contract: a [`ModelConfig`] that constructs is one the model code implements exactly. Every
//! option we do not implement (another architecture, sliding windows, another rope scaling,
//! another activation) is refused here with a message naming the field, so a checkpoint never
//! loads into a forward that silently differs from transformers'.

use std::path::Path;

use serde::Deserialize;

use super::mlp::Activation;
use super::vl::config as vl_config;
use super::vl::VlConfig;
use super::{Error, Result};

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
    /// `MistralForCausalLM`: no biases, an explicit `head_dim`, optionally a sliding window on
    /// every layer.
    Mistral,
    /// `Gemma3ForCausalLM` (text only): `(1 + w)` norms around both sublayers, a scaled
    /// embedding, GeGLU, `query_pre_attn_scalar`, local (sliding) layers with their own rope base.
    Gemma3,
    /// `Qwen2_5_VLForConditionalGeneration`: a Qwen2 text model with multimodal rotary positions
    /// (M-RoPE) and a vision tower whose merged patches replace the image placeholder tokens
    /// ([`ModelConfig::vl`], docs/vision.md).
    Qwen2_5Vl,
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
    /// Every frequency divided by `factor` (Gemma 3's global layers from 4B up).
    Linear { factor: f64 },
}

/// The rotary embedding of a kind of layer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RopeConfig {
    pub theta: f64,
    pub scaling: Option<RopeScaling>,
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
    /// The rope of full-attention layers (and of sliding ones without their own).
    pub rope: RopeConfig,
    /// Gemma 3's local layers rotate with their own base (`rope_local_base_freq`).
    pub sliding_rope: Option<RopeConfig>,
    /// Layers marked sliding attend to the last `sliding_window` positions, themselves
    /// included (transformers' `kv_idx > q_idx - sliding_window`).
    pub sliding_window: Option<usize>,
    /// Per layer: whether it is a sliding-window layer.
    pub sliding_layers: Vec<bool>,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    /// RMSNorm on each head's queries and keys before rope (Qwen3's `q_norm`/`k_norm`).
    pub qk_norm: bool,
    /// Biases of `q_proj`, `k_proj`, `v_proj`; of `o_proj`; of the MLP's three projections.
    pub qkv_bias: bool,
    pub o_bias: bool,
    pub mlp_bias: bool,
    pub activation: Activation,
    /// Gemma's RMSNorms scale by `1 + weight` (weights stored as offsets from one), in float32.
    pub norm_weight_offset: bool,
    /// Gemma's sandwich: norms on the attention's and the MLP's outputs too
    /// (`post_attention_layernorm`, `post_feedforward_layernorm`; the MLP's input norm is then
    /// `pre_feedforward_layernorm`).
    pub sandwich_norms: bool,
    /// Embeddings multiplied by this (Gemma: `sqrt(hidden_size)`, rounded to the model's dtype).
    pub embed_scale: Option<f64>,
    /// Attention scores scaled by this instead of `1/sqrt(head_dim)` (Gemma 3:
    /// `query_pre_attn_scalar^-0.5`).
    pub attn_scale: Option<f64>,
    /// Logits become `cap * tanh(logits / cap)` (`final_logit_softcapping`).
    pub final_logit_softcapping: Option<f64>,
    /// The checkpoint's own dtype (`torch_dtype`/`dtype`), if it names one.
    pub dtype: Option<String>,
    pub eos_token_ids: Vec<i64>,
    pub moe: Option<MoeConfig>,
    /// The vision tower, image tokens and M-RoPE sections of a vision-language model.
    pub vl: Option<VlConfig>,
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
    /// Gemma's name for `hidden_act`.
    hidden_activation: Option<String>,
    /// Gemma 3: a layer every `sliding_window_pattern` is global, when `layer_types` is absent.
    sliding_window_pattern: Option<usize>,
    /// Gemma 3 (transformers 4): the base of the local layers' rope.
    rope_local_base_freq: Option<f64>,
    query_pre_attn_scalar: Option<f64>,
    final_logit_softcapping: Option<f64>,
    attn_logit_softcapping: Option<f64>,
    #[serde(default)]
    use_bidirectional_attention: bool,
    /// Present in vision-language checkpoints (Gemma3ForConditionalGeneration).
    vision_config: Option<serde_json::Value>,
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
const SUPPORTED: &str = "Qwen3ForCausalLM, Qwen3MoeForCausalLM, Qwen2ForCausalLM, LlamaForCausalLM, MistralForCausalLM, Gemma3ForCausalLM, Qwen2_5_VLForConditionalGeneration";

fn required(value: Option<usize>, field: &str) -> Result<usize> {
    match value {
        Some(0) => Err(Error::Config(format!("`{field}` must be positive, got 0"))),
        Some(v) => Ok(v),
        None => Err(Error::Config(format!("`{field}` is missing"))),
    }
}

/// Reads one rope parameter set (`rope_scaling` of transformers 4, `rope_parameters` of 5, or one
/// layer type's entry of Gemma 3's): its theta, if it names one, and its scaling.
fn rope_params(
    field: &str,
    params: &serde_json::Value,
) -> Result<(Option<f64>, Option<RopeScaling>)> {
    let theta = params.get("rope_theta").and_then(|v| v.as_f64());
    let rope_type = params
        .get("rope_type")
        .or_else(|| params.get("type"))
        .and_then(|v| v.as_str())
        .unwrap_or("default");
    let number = |key: &str| {
        params.get(key).and_then(|v| v.as_f64()).ok_or_else(|| {
            Error::Config(format!(
                "`{field}.{key}` is missing (rope_type {rope_type})"
            ))
        })
    };
    let scaling = match rope_type {
        "default" => None,
        "linear" => {
            let factor = number("factor")?;
            if factor <= 0.0 {
                return Err(Error::Config(format!(
                    "`{field}.factor` must be positive, got {factor}"
                )));
            }
            Some(RopeScaling::Linear { factor })
        }
        "llama3" => {
            let (low_freq_factor, high_freq_factor) =
                (number("low_freq_factor")?, number("high_freq_factor")?);
            if high_freq_factor <= low_freq_factor {
                return Err(Error::Config(format!(
                    "`{field}.high_freq_factor` ({high_freq_factor}) must exceed `low_freq_factor` ({low_freq_factor})"
                )));
            }
            Some(RopeScaling::Llama3 {
                factor: number("factor")?,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings: number("original_max_position_embeddings")?,
            })
        }
        other => {
            return Err(Error::Config(format!(
                "`{field}.rope_type: {other}` is not supported; supported: default, linear, llama3 (docs/models.md)"
            )))
        }
    };
    if let Some(p) = params.get("partial_rotary_factor").and_then(|v| v.as_f64()) {
        if p != 1.0 {
            return Err(Error::Config(format!(
                "`{field}.partial_rotary_factor: {p}` is not supported: rotary embeddings cover the whole head"
            )));
        }
    }
    Ok((theta, scaling))
}

/// The rope of full-attention layers, and Gemma 3's of its local layers. Older configs say
/// `rope_theta` and `rope_scaling` (Gemma 3: the global layers'; `rope_local_base_freq` the local
/// ones'); transformers >= 5 writes `rope_parameters`, theta inside, keyed by layer type for
/// Gemma 3.
fn rope_configs(raw: &RawConfig, gemma: bool) -> Result<(RopeConfig, Option<RopeConfig>)> {
    let present = |v: &Option<serde_json::Value>| v.clone().filter(|v| !v.is_null());
    let mut global = (raw.rope_theta, None);
    let mut local = (raw.rope_local_base_freq, None);
    if let Some(params) = present(&raw.rope_scaling) {
        global = (global.0, rope_params("rope_scaling", &params)?.1);
    }
    if let Some(params) = present(&raw.rope_parameters) {
        let by_layer_type =
            params.get("full_attention").is_some() || params.get("sliding_attention").is_some();
        if by_layer_type {
            for (kind, slot) in [
                ("full_attention", &mut global),
                ("sliding_attention", &mut local),
            ] {
                if let Some(p) = params.get(kind).filter(|v| !v.is_null()) {
                    let (theta, scaling) = rope_params(&format!("rope_parameters.{kind}"), p)?;
                    *slot = (theta.or(slot.0), scaling.or(slot.1));
                }
            }
        } else {
            let (theta, scaling) = rope_params("rope_parameters", &params)?;
            global = (theta.or(global.0), scaling.or(global.1));
        }
    }
    if !gemma {
        let rope = RopeConfig {
            theta: global.0.unwrap_or(10_000.0),
            scaling: global.1,
        };
        return Ok((rope, None));
    }
    if let Some(scaling) = local.1 {
        return Err(Error::Config(format!(
            "`rope_parameters.sliding_attention` scales its rope ({scaling:?}); Gemma 3's local layers use the default rope"
        )));
    }
    // transformers' Gemma3TextConfig defaults: 1e6 global, 1e4 local.
    let rope = RopeConfig {
        theta: global.0.unwrap_or(1_000_000.0),
        scaling: global.1,
    };
    let sliding = RopeConfig {
        theta: local.0.unwrap_or(10_000.0),
        scaling: None,
    };
    Ok((rope, Some(sliding)))
}

/// The sliding window and which layers use it: `layer_types` when the config lists them;
/// otherwise Gemma 3's pattern (every `sliding_window_pattern`-th layer global, default 6) and
/// Mistral's every layer. A window at least as long as the context never slides.
fn sliding_layers(
    raw: &RawConfig,
    architecture: Architecture,
    layers: usize,
) -> Result<(Option<usize>, Vec<bool>)> {
    let max_positions = raw.max_position_embeddings.unwrap_or(usize::MAX);
    let window = raw.sliding_window;
    if window == Some(0) {
        return Err(Error::Config(
            "`sliding_window` must be positive, got 0".into(),
        ));
    }
    let sliding: Vec<bool> = if !raw.layer_types.is_empty() {
        if raw.layer_types.len() != layers {
            return Err(Error::Config(format!(
                "`layer_types` has {} entries, but the model has {layers} layers",
                raw.layer_types.len()
            )));
        }
        raw.layer_types
            .iter()
            .enumerate()
            .map(|(l, t)| match t.as_str() {
                "full_attention" => Ok(false),
                "sliding_attention" if window.is_some() => Ok(true),
                "sliding_attention" => Err(Error::Config(format!(
                    "`layer_types[{l}]: sliding_attention` needs `sliding_window`, which is not set"
                ))),
                other => Err(Error::Config(format!(
                    "`layer_types[{l}]: {other}` is not supported; supported: full_attention, sliding_attention (docs/models.md)"
                ))),
            })
            .collect::<Result<_>>()?
    } else {
        match architecture {
            Architecture::Gemma3 => {
                let pattern = raw.sliding_window_pattern.unwrap_or(6);
                if pattern == 0 {
                    return Err(Error::Config(
                        "`sliding_window_pattern` must be positive, got 0".into(),
                    ));
                }
                (0..layers)
                    .map(|l| window.is_some() && (l + 1) % pattern != 0)
                    .collect()
            }
            Architecture::Mistral => vec![window.is_some(); layers],
            _ => vec![false; layers],
        }
    };
    // The layer types stay as they are: Gemma 3's local layers keep their rope either way.
    let window = window.filter(|&w| w < max_positions && sliding.contains(&true));
    Ok((window, sliding))
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
        let value: serde_json::Value = serde_json::from_str(text)
            .map_err(|e| Error::Config(format!("not a valid config.json: {e}")))?;
        // A vision-language checkpoint: its text model reads as a flat config, the rest apart.
        let (value, vl) = if vl_config::is_qwen2_5_vl(&value) {
            let (text, vl) = vl_config::split(&value)?;
            (text, Some(vl))
        } else {
            (value, None)
        };
        let raw: RawConfig = serde_json::from_value(value)
            .map_err(|e| Error::Config(format!("not a valid config.json: {e}")))?;
        let arch_name = raw
            .architectures
            .as_ref()
            .and_then(|a| a.first().cloned())
            .or_else(|| raw.model_type.clone())
            .ok_or_else(|| {
                Error::Config("neither `architectures` nor `model_type` is set".into())
            })?;
        if raw.vision_config.is_some() {
            return Err(Error::Config(format!(
                "`vision_config`: {arch_name} has a vision tower, which is not supported; the vision-language models that load are {}, and text-only checkpoints of the families in docs/models.md (Gemma 3 1B is Gemma3ForCausalLM)",
                vl_config::VL_ARCHITECTURES
            )));
        }
        let architecture = match arch_name.as_str() {
            "Qwen3ForCausalLM" | "qwen3" => Architecture::Qwen3,
            "Qwen3MoeForCausalLM" | "qwen3_moe" => Architecture::Qwen3Moe,
            "Qwen2ForCausalLM" | "qwen2" => Architecture::Qwen2,
            "LlamaForCausalLM" | "llama" => Architecture::Llama,
            "MistralForCausalLM" | "mistral" => Architecture::Mistral,
            "Gemma3ForCausalLM" | "gemma3_text" => Architecture::Gemma3,
            "Qwen2_5_VLForConditionalGeneration" | "qwen2_5_vl" => Architecture::Qwen2_5Vl,
            other => {
                return Err(Error::Config(format!(
                "architecture `{other}` is not supported; supported: {SUPPORTED} (docs/models.md)"
            )))
            }
        };
        use Architecture::*;
        let gemma = architecture == Gemma3;
        // Biases: Qwen2 always has q/k/v ones; Qwen3, Llama and Gemma 3 follow `attention_bias`
        // (all four projections); only Llama has `mlp_bias`; Mistral has none.
        let (qkv_bias, o_bias) = match architecture {
            Qwen2 | Qwen2_5Vl => (true, false),
            Qwen3 | Qwen3Moe | Llama | Gemma3 => (raw.attention_bias, raw.attention_bias),
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
                "`use_sliding_window: true` is not supported for Qwen2/Qwen3 (their `max_window_layers` rule is not implemented); sliding windows load for Mistral and Gemma 3 (docs/models.md)".into(),
            ));
        }
        if raw.use_bidirectional_attention {
            return Err(Error::Config(
                "`use_bidirectional_attention: true` is not supported: a causal LM attends causally (docs/models.md)".into(),
            ));
        }
        if let Some(cap) = raw.attn_logit_softcapping {
            return Err(Error::Config(format!(
                "`attn_logit_softcapping: {cap}` is not supported: attention-score soft-capping is not implemented (docs/models.md)"
            )));
        }
        let activation = match raw.hidden_activation.as_ref().or(raw.hidden_act.as_ref()) {
            None if gemma => Activation::GeluTanh,
            None => Activation::Silu,
            Some(act) => match Activation::from_config_name(act) {
                Some(activation) => activation,
                None => {
                    let field = if raw.hidden_activation.is_some() {
                        "hidden_activation"
                    } else {
                        "hidden_act"
                    };
                    return Err(Error::Config(format!(
                        "`{field}: {act}` is not supported; supported: {}",
                        Activation::SUPPORTED
                    )));
                }
            },
        };
        if raw.quantization_config.is_some() {
            return Err(Error::Config(
                "quantized checkpoints (`quantization_config`) are not supported".into(),
            ));
        }
        let (rope, sliding_rope) = rope_configs(&raw, gemma)?;
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
        let (sliding_window, sliding_layers) =
            sliding_layers(&raw, architecture, num_hidden_layers)?;
        let moe = match architecture {
            Qwen3 | Qwen2 | Llama | Mistral | Gemma3 | Qwen2_5Vl => None,
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
        // transformers' Gemma3TextConfig default is 256.
        let head_scale = gemma.then(|| raw.query_pre_attn_scalar.unwrap_or(256.0));
        if let Some(scalar) = head_scale.filter(|&s| s <= 0.0) {
            return Err(Error::Config(format!(
                "`query_pre_attn_scalar` must be positive, got {scalar}"
            )));
        }
        if let Some(vl) = &vl {
            if vl.mrope_section.iter().sum::<usize>() * 2 != head_dim {
                return Err(Error::Config(format!(
                    "`rope_parameters.mrope_section` {:?} must sum to head_dim / 2 = {} (the rotary frequencies of a head)",
                    vl.mrope_section,
                    head_dim / 2
                )));
            }
        }
        if let Some(cap) = raw.final_logit_softcapping.filter(|&c| c <= 0.0) {
            return Err(Error::Config(format!(
                "`final_logit_softcapping` must be positive, got {cap}"
            )));
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
            rope,
            sliding_rope,
            sliding_window,
            sliding_layers,
            max_position_embeddings,
            tie_word_embeddings: raw.tie_word_embeddings,
            qk_norm: matches!(architecture, Qwen3 | Qwen3Moe | Gemma3),
            qkv_bias,
            o_bias,
            mlp_bias: raw.mlp_bias,
            activation,
            norm_weight_offset: gemma,
            sandwich_norms: gemma,
            embed_scale: gemma.then(|| (hidden_size as f64).sqrt()),
            attn_scale: head_scale.map(|s| s.powf(-0.5)),
            final_logit_softcapping: raw.final_logit_softcapping,
            dtype: raw.dtype.or(raw.torch_dtype),
            eos_token_ids: raw
                .eos_token_id
                .map(OneOrMany::into_vec)
                .unwrap_or_default(),
            moe,
            vl,
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
            llama.rope.scaling,
            Some(RopeScaling::Llama3 {
                factor: 32.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 8192.0
            })
        );
        assert_eq!((llama.rope.theta, llama.head_dim), (500000.0, 64));
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
        assert_eq!(nemo.sliding_window, None);
        // Mistral 7B v0.1's window slides on every layer.
        let v01 = mistral(serde_json::json!(4096)).unwrap();
        assert_eq!(v01.sliding_window, Some(4096));
        assert!(v01.sliding_layers.iter().all(|&s| s) && v01.sliding_rope.is_none());
    }

    /// Gemma 3 1B's shapes, as transformers 4 writes its config (`rope_local_base_freq`,
    /// `sliding_window_pattern`, no `layer_types`).
    fn gemma_3_1b() -> serde_json::Value {
        serde_json::json!({
            "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
            "attention_bias": false, "attn_logit_softcapping": null, "bos_token_id": 2,
            "eos_token_id": [1, 106], "final_logit_softcapping": null, "head_dim": 256,
            "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152,
            "intermediate_size": 6912, "max_position_embeddings": 32768,
            "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1,
            "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-6, "rope_local_base_freq": 10000,
            "rope_scaling": null, "rope_theta": 1000000, "sliding_window": 512,
            "sliding_window_pattern": 6, "torch_dtype": "bfloat16", "vocab_size": 262144
        })
    }

    #[test]
    fn gemma_3_reads_its_norms_windows_and_two_ropes() {
        let g = ModelConfig::from_json(&gemma_3_1b().to_string()).unwrap();
        assert_eq!(g.architecture, Architecture::Gemma3);
        assert!(g.qk_norm && g.norm_weight_offset && g.sandwich_norms);
        assert_eq!(g.activation, Activation::GeluTanh);
        assert_eq!(g.embed_scale, Some(1152f64.sqrt()));
        assert_eq!(g.attn_scale, Some(1.0 / 16.0));
        assert_eq!(
            g.rope,
            RopeConfig {
                theta: 1e6,
                scaling: None
            }
        );
        assert_eq!(
            g.sliding_rope,
            Some(RopeConfig {
                theta: 1e4,
                scaling: None
            })
        );
        assert_eq!(g.sliding_window, Some(512));
        // Every sixth layer is global: 5, 11, 17, 23.
        let global: Vec<usize> = (0..26).filter(|&l| !g.sliding_layers[l]).collect();
        assert_eq!(global, vec![5, 11, 17, 23]);

        // transformers >= 5: `layer_types` and `rope_parameters` keyed by layer type; the 4B's
        // linear scaling of the global rope.
        let mut v = gemma_3_1b();
        let o = v.as_object_mut().unwrap();
        for key in [
            "rope_theta",
            "rope_local_base_freq",
            "rope_scaling",
            "sliding_window_pattern",
        ] {
            o.remove(key);
        }
        let types: Vec<&str> = (0..26)
            .map(|l| {
                if (l + 1) % 6 == 0 {
                    "full_attention"
                } else {
                    "sliding_attention"
                }
            })
            .collect();
        o.insert("layer_types".into(), serde_json::json!(types));
        o.insert(
            "rope_parameters".into(),
            serde_json::json!({
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}
            }),
        );
        let v5 = ModelConfig::from_json(&v.to_string()).unwrap();
        assert_eq!(v5.sliding_layers, g.sliding_layers);
        assert_eq!(v5.rope.scaling, Some(RopeScaling::Linear { factor: 8.0 }));
        assert_eq!(v5.sliding_rope, g.sliding_rope);

        // What Gemma 3 configs may ask for that is not implemented, named.
        for (key, value, named) in [
            (
                "attn_logit_softcapping",
                serde_json::json!(50.0),
                "attn_logit_softcapping",
            ),
            (
                "use_bidirectional_attention",
                serde_json::json!(true),
                "use_bidirectional_attention",
            ),
            (
                "vision_config",
                serde_json::json!({"model_type": "siglip_vision_model"}),
                "vision tower",
            ),
            (
                "hidden_activation",
                serde_json::json!("relu"),
                "hidden_activation: relu",
            ),
        ] {
            let mut v = gemma_3_1b();
            v[key] = value;
            let err = ModelConfig::from_json(&v.to_string())
                .unwrap_err()
                .to_string();
            assert!(err.contains(named), "{key}: {err}");
        }
        let mut v = gemma_3_1b();
        v["layer_types"] = serde_json::json!(vec!["chunked_attention"; 26]);
        let err = ModelConfig::from_json(&v.to_string())
            .unwrap_err()
            .to_string();
        assert!(err.contains("layer_types[0]: chunked_attention"), "{err}");
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
