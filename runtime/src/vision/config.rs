//! The image processor settings of a model folder's `preprocessor_config.json`, read as
//! transformers' `Qwen2VLImageProcessor` reads them: `min_pixels`/`max_pixels` at the top level
//! win over `size: {shortest_edge, longest_edge}` (the newer spelling), and an absent field takes
//! the processor class's default. Settings this implementation does not follow (another
//! resampling filter, a step turned off) are refused with the field's name.

use std::path::Path;

use serde::Deserialize;

use super::{Result, VisionError};

/// transformers' `OPENAI_CLIP_MEAN` (utils/constants.py), the Qwen2-VL processor's default.
const CLIP_MEAN: [f64; 3] = [0.48145466, 0.4578275, 0.40821073];
/// transformers' `OPENAI_CLIP_STD`.
const CLIP_STD: [f64; 3] = [0.26862954, 0.26130258, 0.27577711];
/// PIL's `Image.BICUBIC`, the only `resample` value accepted.
const PIL_BICUBIC: u32 = 3;

/// How images are resized, rescaled, normalised and cut into patches (docs/vision.md).
#[derive(Debug, Clone, PartialEq)]
pub struct ImageProcessorConfig {
    /// The fewest pixels a resized image has (`size.shortest_edge` in newer files).
    pub min_pixels: u64,
    /// The most pixels a resized image has (`size.longest_edge` in newer files).
    pub max_pixels: u64,
    /// The side of a square patch, in pixels.
    pub patch_size: u32,
    /// Frames per patch; a still image is repeated to fill them.
    pub temporal_patch_size: u32,
    /// Patches merged per side into one language-model token.
    pub merge_size: u32,
    /// Per-channel mean, as f32 (numpy casts the config's floats to the image's float32).
    pub image_mean: [f32; 3],
    /// Per-channel standard deviation, as f32.
    pub image_std: [f32; 3],
    /// Multiplies the u8 samples, in f64, before the cast to f32.
    pub rescale_factor: f64,
}

impl Default for ImageProcessorConfig {
    /// `Qwen2VLImageProcessor`'s class defaults, which Qwen2.5-VL uses. (Qwen2.5-VL's own
    /// `preprocessor_config.json` raises `max_pixels` to 12845056.)
    fn default() -> Self {
        Self {
            min_pixels: 56 * 56,
            max_pixels: 28 * 28 * 1280,
            patch_size: 14,
            temporal_patch_size: 2,
            merge_size: 2,
            image_mean: CLIP_MEAN.map(|v| v as f32),
            image_std: CLIP_STD.map(|v| v as f32),
            rescale_factor: 1.0 / 255.0,
        }
    }
}

/// `preprocessor_config.json` as written; unknown fields (`image_processor_type`, ...) are ignored.
#[derive(Deserialize)]
struct RawConfig {
    min_pixels: Option<u64>,
    max_pixels: Option<u64>,
    size: Option<RawSize>,
    patch_size: Option<u32>,
    temporal_patch_size: Option<u32>,
    merge_size: Option<u32>,
    image_mean: Option<PerChannel>,
    image_std: Option<PerChannel>,
    rescale_factor: Option<f64>,
    resample: Option<u32>,
    do_resize: Option<bool>,
    do_rescale: Option<bool>,
    do_normalize: Option<bool>,
    do_convert_rgb: Option<bool>,
}

#[derive(Deserialize)]
struct RawSize {
    shortest_edge: Option<u64>,
    longest_edge: Option<u64>,
    // Older Qwen2-VL files repeat the top-level keys here.
    min_pixels: Option<u64>,
    max_pixels: Option<u64>,
}

/// A mean or std: one value for every channel, or one per channel.
#[derive(Deserialize)]
#[serde(untagged)]
enum PerChannel {
    One(f64),
    Each(Vec<f64>),
}

impl ImageProcessorConfig {
    /// Reads `<dir>/preprocessor_config.json`.
    pub fn from_model_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("preprocessor_config.json");
        let text = std::fs::read_to_string(&path).map_err(|source| VisionError::ConfigRead {
            path: path.clone(),
            source,
        })?;
        Self::from_json(&text, &path)
    }

    /// Parses the text of a `preprocessor_config.json` (`path` names it in errors).
    pub fn from_json(text: &str, path: &Path) -> Result<Self> {
        let raw: RawConfig =
            serde_path_to_error::deserialize(&mut serde_json::Deserializer::from_str(text))
                .map_err(|e| VisionError::ConfigParse {
                    path: path.to_path_buf(),
                    field: e.path().to_string(),
                    source: e.into_inner(),
                })?;
        Self::from_raw(raw)
    }

    fn from_raw(raw: RawConfig) -> Result<Self> {
        let defaults = Self::default();
        for (field, value) in [
            ("do_resize", raw.do_resize),
            ("do_rescale", raw.do_rescale),
            ("do_normalize", raw.do_normalize),
            ("do_convert_rgb", raw.do_convert_rgb),
        ] {
            if value == Some(false) {
                return Err(invalid(field, "only `true` is supported".into()));
            }
        }
        if let Some(resample) = raw.resample.filter(|&r| r != PIL_BICUBIC) {
            return Err(invalid(
                "resample",
                format!("only {PIL_BICUBIC} (bicubic) is supported, got {resample}"),
            ));
        }
        // transformers: the file's `size` replaces the default size as a whole; top-level
        // `min_pixels`/`max_pixels` then override its two edges.
        let (shortest, longest) = match &raw.size {
            Some(size) => (
                size.shortest_edge.or(size.min_pixels),
                size.longest_edge.or(size.max_pixels),
            ),
            None => (Some(defaults.min_pixels), Some(defaults.max_pixels)),
        };
        let min_pixels = raw.min_pixels.or(shortest);
        let max_pixels = raw.max_pixels.or(longest);
        let min_pixels = positive("min_pixels (size.shortest_edge)", min_pixels)?;
        let max_pixels = positive("max_pixels (size.longest_edge)", max_pixels)?;
        if min_pixels > max_pixels {
            return Err(invalid(
                "min_pixels",
                format!("{min_pixels} exceeds max_pixels {max_pixels}"),
            ));
        }
        let count = |field, value: Option<u32>, default: u32| match value {
            Some(0) => Err(invalid(field, "must be at least 1".into())),
            value => Ok(value.unwrap_or(default)),
        };
        let rescale_factor = raw.rescale_factor.unwrap_or(defaults.rescale_factor);
        if !(rescale_factor.is_finite() && rescale_factor > 0.0) {
            return Err(invalid(
                "rescale_factor",
                format!("must be a positive number, got {rescale_factor}"),
            ));
        }
        let image_std = per_channel("image_std", raw.image_std, CLIP_STD)?;
        if image_std.contains(&0.0) {
            return Err(invalid("image_std", "a standard deviation of 0".into()));
        }
        Ok(Self {
            min_pixels,
            max_pixels,
            patch_size: count("patch_size", raw.patch_size, defaults.patch_size)?,
            temporal_patch_size: count(
                "temporal_patch_size",
                raw.temporal_patch_size,
                defaults.temporal_patch_size,
            )?,
            merge_size: count("merge_size", raw.merge_size, defaults.merge_size)?,
            image_mean: per_channel("image_mean", raw.image_mean, CLIP_MEAN)?,
            image_std,
            rescale_factor,
        })
    }

    /// The side resized images are multiples of: a merged group of patches.
    pub fn factor(&self) -> u32 {
        self.patch_size * self.merge_size
    }

    /// Values per row of `pixel_values`: channels x frames x patch pixels.
    pub fn patch_dim(&self) -> usize {
        3 * self.temporal_patch_size as usize * (self.patch_size as usize).pow(2)
    }
}

fn invalid(field: &'static str, reason: String) -> VisionError {
    VisionError::ConfigInvalid { field, reason }
}

/// transformers refuses a missing or zero `shortest_edge`/`longest_edge` when it resizes.
fn positive(field: &'static str, value: Option<u64>) -> Result<u64> {
    match value {
        Some(v) if v > 0 => Ok(v),
        Some(_) => Err(invalid(field, "must be at least 1".into())),
        None => Err(invalid(
            field,
            "missing: `size` needs both `shortest_edge` and `longest_edge`".into(),
        )),
    }
}

fn per_channel(
    field: &'static str,
    value: Option<PerChannel>,
    default: [f64; 3],
) -> Result<[f32; 3]> {
    let values = match value {
        None => default,
        Some(PerChannel::One(v)) => [v; 3],
        Some(PerChannel::Each(v)) => <[f64; 3]>::try_from(v.as_slice())
            .map_err(|_| invalid(field, format!("needs 3 values (R, G, B), got {}", v.len())))?,
    };
    Ok(values.map(|v| v as f32))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<ImageProcessorConfig> {
        ImageProcessorConfig::from_json(text, Path::new("preprocessor_config.json"))
    }

    #[test]
    fn an_empty_file_has_the_qwen2_vl_class_defaults() {
        let config = parse("{}").unwrap();
        assert_eq!(config, ImageProcessorConfig::default());
        assert_eq!((config.min_pixels, config.max_pixels), (3136, 1003520));
        assert_eq!(config.factor(), 28);
        assert_eq!(config.patch_dim(), 1176);
    }

    #[test]
    fn qwen2_5_vl_file_with_top_level_pixels_overriding_size() {
        let config = parse(
            r#"{"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14,
                "temporal_patch_size": 2, "merge_size": 2,
                "size": {"min_pixels": 1, "max_pixels": 2},
                "image_mean": [0.48145466, 0.4578275, 0.40821073],
                "image_std": [0.26862954, 0.26130258, 0.27577711],
                "image_processor_type": "Qwen2VLImageProcessor",
                "processor_class": "Qwen2_5_VLProcessor"}"#,
        )
        .unwrap();
        assert_eq!((config.min_pixels, config.max_pixels), (3136, 12845056));
    }

    #[test]
    fn newer_files_spell_the_bounds_as_size_edges() {
        let config = parse(
            r#"{"size": {"shortest_edge": 6272, "longest_edge": 50176}, "resample": 3,
                "do_resize": true, "rescale_factor": 0.00392156862745098, "image_mean": 0.5}"#,
        )
        .unwrap();
        assert_eq!((config.min_pixels, config.max_pixels), (6272, 50176));
        assert_eq!(config.image_mean, [0.5; 3]);
    }

    #[test]
    fn errors_name_the_field() {
        let cases = [
            (r#"{"patch_size": "14"}"#, "patch_size"),
            (r#"{"patch_size": 0}"#, "patch_size"),
            (r#"{"size": {"shortest_edge": 3136}}"#, "longest_edge"),
            (r#"{"max_pixels": 0}"#, "max_pixels"),
            (r#"{"min_pixels": 5000, "max_pixels": 4000}"#, "min_pixels"),
            (r#"{"image_mean": [0.5, 0.5]}"#, "image_mean"),
            (r#"{"image_std": [0.5, 0, 0.5]}"#, "image_std"),
            (r#"{"resample": 2}"#, "resample"),
            (r#"{"do_normalize": false}"#, "do_normalize"),
            (r#"{"rescale_factor": -1}"#, "rescale_factor"),
        ];
        for (text, field) in cases {
            let err = parse(text).unwrap_err().to_string();
            assert!(err.contains(field), "{text}: {err}");
        }
    }

    #[test]
    fn a_missing_file_names_its_path() {
        let err =
            ImageProcessorConfig::from_model_dir(Path::new("/nonexistent/model")).unwrap_err();
        assert!(
            err.to_string()
                .contains("/nonexistent/model/preprocessor_config.json"),
            "{err}"
        );
    }
}
