//! The vision-language part of a Qwen2.5-VL `config.json`: the vision tower (`vision_config`),
//! the special token ids, and the M-RoPE sections of the text model's rotary embedding.
//!
//! transformers 5 writes the text settings under `text_config`; 4.x (the Hub's checkpoints)
//! writes them at the top level with `rope_scaling: {"type": "mrope", "mrope_section": [...]}`.
//! [`split`] reads either into a flat text config, which the text model's parser
//! ([`crate::model::ModelConfig`]) reads as Qwen2's, and a checked [`VlConfig`].

use serde::Deserialize;
use serde_json::{Map, Value};

use crate::model::mlp::Activation;
use crate::model::{Error, Result};

/// The vision tower of Qwen2.5-VL (transformers' `Qwen2_5_VLVisionConfig`).
#[derive(Debug, Clone, PartialEq)]
pub struct VisionConfig {
    /// Blocks (`depth`).
    pub depth: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_heads: usize,
    /// Pixels per patch side.
    pub patch_size: usize,
    /// Patches per merged token side (2: a token is 2x2 patches).
    pub spatial_merge_size: usize,
    /// Frames per patch (a still image is repeated over them).
    pub temporal_patch_size: usize,
    /// The side of an attention window, in pixels (112: 4x4 merged tokens).
    pub window_size: usize,
    /// Blocks that attend over the whole image; the others attend within windows.
    pub fullatt_block_indexes: Vec<usize>,
    /// Width of the merger's output: the text model's hidden size.
    pub out_hidden_size: usize,
    pub in_channels: usize,
    /// The blocks' gated MLP activation (`hidden_act`).
    pub activation: Activation,
    /// The 2-D rotary base (`rope_parameters.rope_theta`, 10000 by default).
    pub rope_theta: f64,
}

impl VisionConfig {
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_heads
    }

    /// Values per patch row of `pixel_values`: `in_channels * temporal_patch_size * patch_size²`.
    pub fn patch_dim(&self) -> usize {
        self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size
    }

    /// The side of a window in merged tokens (transformers' `vit_merger_window_size`).
    pub fn window_tokens(&self) -> usize {
        self.window_size / self.spatial_merge_size / self.patch_size
    }
}

/// What a vision-language checkpoint adds to its text model.
#[derive(Debug, Clone, PartialEq)]
pub struct VlConfig {
    pub vision: VisionConfig,
    /// `<|image_pad|>`: each image's placeholder tokens, replaced by its merged patches.
    pub image_token_id: i64,
    /// `<|video_pad|>` (videos are not supported: docs/vision.md).
    pub video_token_id: i64,
    /// `<|vision_start|>` and `<|vision_end|>` around each image's placeholders.
    pub vision_start_token_id: i64,
    pub vision_end_token_id: i64,
    /// M-RoPE: how many of the head's rotary frequencies turn with the temporal, height and
    /// width positions, in that order (they sum to `head_dim / 2`).
    pub mrope_section: [usize; 3],
}

#[derive(Debug, Deserialize)]
struct RawVision {
    depth: Option<usize>,
    hidden_size: Option<usize>,
    intermediate_size: Option<usize>,
    num_heads: Option<usize>,
    patch_size: Option<usize>,
    spatial_merge_size: Option<usize>,
    temporal_patch_size: Option<usize>,
    window_size: Option<usize>,
    fullatt_block_indexes: Option<Vec<usize>>,
    out_hidden_size: Option<usize>,
    /// transformers 4.x's checkpoints say `in_chans`.
    #[serde(alias = "in_chans")]
    in_channels: Option<usize>,
    hidden_act: Option<String>,
    rope_parameters: Option<Value>,
}

/// The architectures whose vision tower is implemented, for error messages.
pub const VL_ARCHITECTURES: &str = "Qwen2_5_VLForConditionalGeneration";

/// Whether `config.json` (parsed) is a Qwen2.5-VL checkpoint.
pub fn is_qwen2_5_vl(value: &Value) -> bool {
    let arch = value
        .get("architectures")
        .and_then(|a| a.get(0))
        .and_then(Value::as_str);
    let model_type = value.get("model_type").and_then(Value::as_str);
    arch == Some("Qwen2_5_VLForConditionalGeneration")
        || (arch.is_none() && model_type == Some("qwen2_5_vl"))
}

/// Splits a Qwen2.5-VL `config.json` into the text model's config, flat as a Qwen2 config (with
/// `architectures: ["Qwen2_5_VLForConditionalGeneration"]`, the M-RoPE sections removed from its
/// rope parameters), and the vision-language part.
pub fn split(value: &Value) -> Result<(Value, VlConfig)> {
    let Some(top) = value.as_object() else {
        return Err(Error::Config("config.json is not a JSON object".into()));
    };
    let mut text: Map<String, Value> = top.clone();
    text.remove("vision_config");
    if let Some(nested) = top.get("text_config").filter(|v| !v.is_null()) {
        let Some(nested) = nested.as_object() else {
            return Err(Error::Config("`text_config` is not a JSON object".into()));
        };
        text.remove("text_config");
        for (k, v) in nested {
            // The outer config owns these (transformers 5 ties embeddings at the top level).
            if matches!(k.as_str(), "architectures" | "model_type") {
                continue;
            }
            if k == "tie_word_embeddings" && top.contains_key(k) {
                // Pre-5 saves kept it inside text_config; either true ties (transformers' BC).
                let either = v.as_bool().unwrap_or(false) || top[k].as_bool().unwrap_or(false);
                text.insert(k.clone(), Value::Bool(either));
                continue;
            }
            text.insert(k.clone(), v.clone());
        }
    }
    let mrope_section = take_mrope_section(&mut text)?;
    let token = |name: &str, default: i64| -> Result<i64> {
        match top.get(name).filter(|v| !v.is_null()) {
            None => Ok(default),
            Some(v) => v
                .as_i64()
                .filter(|&id| id >= 0)
                .ok_or_else(|| Error::Config(format!("`{name}` must be a token id, got {v}"))),
        }
    };
    // transformers' Qwen2_5_VLConfig defaults.
    let vl = VlConfig {
        vision: vision_config(top.get("vision_config"))?,
        image_token_id: token("image_token_id", 151655)?,
        video_token_id: token("video_token_id", 151656)?,
        vision_start_token_id: token("vision_start_token_id", 151652)?,
        vision_end_token_id: token("vision_end_token_id", 151653)?,
        mrope_section,
    };
    Ok((Value::Object(text), vl))
}

/// Takes `mrope_section` out of the text config's `rope_parameters` (transformers 5) or
/// `rope_scaling` (4.x, whose `type: mrope` is the default rope with sections), leaving rope
/// parameters the text parser reads as plain ones.
fn take_mrope_section(text: &mut Map<String, Value>) -> Result<[usize; 3]> {
    let mut section = None;
    for field in ["rope_parameters", "rope_scaling"] {
        let Some(params) = text.get_mut(field).and_then(Value::as_object_mut) else {
            continue;
        };
        if let Some(s) = params.remove("mrope_section") {
            let parsed: Vec<usize> = serde_json::from_value(s.clone()).map_err(|_| {
                Error::Config(format!(
                    "`{field}.mrope_section` must be three integers, got {s}"
                ))
            })?;
            let [t, h, w] = parsed[..] else {
                return Err(Error::Config(format!(
                    "`{field}.mrope_section` must have three entries (temporal, height, width), got {s}"
                )));
            };
            section = Some([t, h, w]);
        }
        for key in ["rope_type", "type"] {
            if params.get(key).and_then(Value::as_str) == Some("mrope") {
                params.insert(key.into(), Value::String("default".into()));
            }
        }
    }
    // transformers' Qwen2_5_VLRotaryEmbedding default.
    Ok(section.unwrap_or([16, 24, 24]))
}

fn vision_config(value: Option<&Value>) -> Result<VisionConfig> {
    let value = value
        .filter(|v| !v.is_null())
        .ok_or_else(|| Error::Config("`vision_config` is missing".into()))?;
    let raw: RawVision = serde_json::from_value(value.clone())
        .map_err(|e| Error::Config(format!("`vision_config`: {e}")))?;
    // transformers' Qwen2_5_VLVisionConfig defaults.
    let positive = |v: Option<usize>, default: usize, field: &str| -> Result<usize> {
        match v.unwrap_or(default) {
            0 => Err(Error::Config(format!(
                "`vision_config.{field}` must be positive, got 0"
            ))),
            v => Ok(v),
        }
    };
    let depth = positive(raw.depth, 32, "depth")?;
    let hidden_size = positive(raw.hidden_size, 3584, "hidden_size")?;
    let num_heads = positive(raw.num_heads, 16, "num_heads")?;
    if hidden_size % num_heads != 0 || (hidden_size / num_heads) % 4 != 0 {
        return Err(Error::Config(format!(
            "`vision_config.hidden_size` ({hidden_size}) must be `num_heads` ({num_heads}) heads of a multiple of 4 dimensions (the 2-D rotary embedding's height and width halves)"
        )));
    }
    let patch_size = positive(raw.patch_size, 14, "patch_size")?;
    let spatial_merge_size = positive(raw.spatial_merge_size, 2, "spatial_merge_size")?;
    let window_size = positive(raw.window_size, 112, "window_size")?;
    if window_size < patch_size * spatial_merge_size {
        return Err(Error::Config(format!(
            "`vision_config.window_size` ({window_size}) must be at least a merged token's side, patch_size * spatial_merge_size = {}",
            patch_size * spatial_merge_size
        )));
    }
    let fullatt_block_indexes = raw.fullatt_block_indexes.unwrap_or(vec![7, 15, 23, 31]);
    if let Some(&bad) = fullatt_block_indexes.iter().find(|&&b| b >= depth) {
        return Err(Error::Config(format!(
            "`vision_config.fullatt_block_indexes` names block {bad}, but the tower has {depth} (`depth`)"
        )));
    }
    let hidden_act = raw.hidden_act.as_deref().unwrap_or("silu");
    let Some(activation) = Activation::from_config_name(hidden_act) else {
        return Err(Error::Config(format!(
            "`vision_config.hidden_act: {hidden_act}` is not supported; supported: {}",
            Activation::SUPPORTED
        )));
    };
    let mut rope_theta = 10_000.0;
    if let Some(params) = raw.rope_parameters.as_ref().filter(|v| !v.is_null()) {
        match params.get("rope_type").and_then(Value::as_str) {
            None | Some("axial") | Some("default") => {}
            Some(other) => {
                return Err(Error::Config(format!(
                    "`vision_config.rope_parameters.rope_type: {other}` is not supported; the vision tower's rope is `axial`"
                )))
            }
        }
        if let Some(theta) = params.get("rope_theta").and_then(Value::as_f64) {
            rope_theta = theta;
        }
    }
    Ok(VisionConfig {
        depth,
        hidden_size,
        intermediate_size: positive(raw.intermediate_size, 3420, "intermediate_size")?,
        num_heads,
        patch_size,
        spatial_merge_size,
        temporal_patch_size: positive(raw.temporal_patch_size, 2, "temporal_patch_size")?,
        window_size,
        fullatt_block_indexes,
        out_hidden_size: positive(raw.out_hidden_size, 3584, "out_hidden_size")?,
        in_channels: positive(raw.in_channels, 3, "in_channels")?,
        activation,
        rope_theta,
    })
}

#[cfg(test)]
mod tests {
    use crate::model::{Architecture, ModelConfig};

    /// Qwen2.5-VL-7B-Instruct's config.json as the Hub has it (transformers 4.x: flat text
    /// settings, `rope_scaling` of type `mrope`, `in_chans`).
    fn qwen2_5_vl_7b() -> serde_json::Value {
        serde_json::from_str(
            r#"{
            "architectures": ["Qwen2_5_VLForConditionalGeneration"], "attention_dropout": 0.0,
            "bos_token_id": 151643, "eos_token_id": 151645, "vision_start_token_id": 151652,
            "vision_end_token_id": 151653, "vision_token_id": 151654, "image_token_id": 151655,
            "video_token_id": 151656, "hidden_act": "silu", "hidden_size": 3584,
            "initializer_range": 0.02, "intermediate_size": 18944,
            "max_position_embeddings": 128000, "max_window_layers": 28, "model_type": "qwen2_5_vl",
            "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
            "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
            "tie_word_embeddings": false, "torch_dtype": "bfloat16",
            "transformers_version": "4.41.2", "use_cache": true, "use_sliding_window": false,
            "vision_config": {
                "depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420,
                "num_heads": 16, "in_chans": 3, "out_hidden_size": 3584, "patch_size": 14,
                "spatial_merge_size": 2, "spatial_patch_size": 14, "window_size": 112,
                "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2,
                "temporal_patch_size": 2
            },
            "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
            "vocab_size": 152064
        }"#,
        )
        .unwrap()
    }

    #[test]
    fn reads_qwen2_5_vl_as_the_hub_and_transformers_5_write_it() {
        let c = ModelConfig::from_json(&qwen2_5_vl_7b().to_string()).unwrap();
        assert_eq!(c.architecture, Architecture::Qwen2_5Vl);
        assert!(c.qkv_bias && !c.o_bias && !c.qk_norm && !c.tie_word_embeddings);
        assert_eq!(
            (c.hidden_size, c.head_dim, c.vocab_size),
            (3584, 128, 152064)
        );
        assert_eq!(c.rope.theta, 1e6);
        assert_eq!(c.rope.scaling, None);
        let vl = c.vl.as_ref().unwrap();
        assert_eq!(vl.mrope_section, [16, 24, 24]);
        assert_eq!(
            (vl.image_token_id, vl.vision_start_token_id),
            (151655, 151652)
        );
        let v = &vl.vision;
        assert_eq!(
            (v.depth, v.hidden_size, v.num_heads, v.head_dim()),
            (32, 1280, 16, 80)
        );
        assert_eq!(
            (v.window_tokens(), v.patch_dim(), v.in_channels),
            (4, 1176, 3)
        );
        assert_eq!(v.fullatt_block_indexes, vec![7, 15, 23, 31]);

        // transformers 5: text settings under text_config, rope_parameters with the sections.
        let mut v5 = qwen2_5_vl_7b();
        let top = v5.as_object_mut().unwrap();
        let mut text = serde_json::Map::new();
        for key in [
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_hidden_layers",
            "num_key_value_heads",
            "rms_norm_eps",
            "max_position_embeddings",
            "vocab_size",
            "eos_token_id",
        ] {
            text.insert(key.into(), top.remove(key).unwrap());
        }
        top.remove("rope_scaling");
        top.remove("rope_theta");
        text.insert(
            "rope_parameters".into(),
            serde_json::json!({"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]}),
        );
        text.insert(
            "layer_types".into(),
            serde_json::json!(vec!["full_attention"; 28]),
        );
        top.insert("text_config".into(), serde_json::Value::Object(text));
        let c5 = ModelConfig::from_json(&v5.to_string()).unwrap();
        assert_eq!(c5.vl, c.vl);
        assert_eq!(
            (c5.hidden_size, c5.num_hidden_layers, c5.rope.theta),
            (3584, 28, 1e6)
        );
        assert_eq!(c5.eos_token_ids, vec![151645]);
    }

    #[test]
    fn refuses_what_the_tower_does_not_implement_by_name() {
        for (path, value, named) in [
            (
                "hidden_act",
                serde_json::json!("quick_gelu"),
                "vision_config.hidden_act",
            ),
            (
                "fullatt_block_indexes",
                serde_json::json!([40]),
                "fullatt_block_indexes",
            ),
            ("window_size", serde_json::json!(14), "window_size"),
            ("num_heads", serde_json::json!(7), "hidden_size"),
        ] {
            let mut v = qwen2_5_vl_7b();
            v["vision_config"][path] = value;
            let err = ModelConfig::from_json(&v.to_string())
                .unwrap_err()
                .to_string();
            assert!(err.contains(named), "{path}: {err}");
        }
        let mut v = qwen2_5_vl_7b();
        v["rope_scaling"]["mrope_section"] = serde_json::json!([16, 24, 20]);
        let err = ModelConfig::from_json(&v.to_string())
            .unwrap_err()
            .to_string();
        assert!(err.contains("mrope_section"), "{err}");
        // Qwen2-VL's tower (no windows, quick_gelu, a LayerNorm) is another architecture.
        let mut v = qwen2_5_vl_7b();
        v["architectures"] = serde_json::json!(["Qwen2VLForConditionalGeneration"]);
        let err = ModelConfig::from_json(&v.to_string())
            .unwrap_err()
            .to_string();
        assert!(err.contains("Qwen2_5_VLForConditionalGeneration"), "{err}");
    }
}
