//! Our Qwen2-VL / Qwen2.5-VL image preprocessing (`moult_runtime::vision`) gives the
//! `pixel_values` and `image_grid_thw` of transformers' `Qwen2VLImageProcessorPil` for the
//! same files, under the processor's defaults and custom min/max pixels read from the
//! `preprocessor_config.json` transformers saved (needs the Python virtualenv with
//! transformers).
//!
//! The PNG cases (RGB, grey, grey+alpha, RGBA, palette with and without transparency, 16-bit
//! grey; tiny, odd, very wide, exact and large sizes) must match within 1e-6. The JPEG case is
//! looser: PIL decodes with libjpeg-turbo and the `image` crate with zune-jpeg, whose IDCT and
//! chroma upsampling may round differently, so samples can differ by a few levels before any
//! preprocessing happens.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use moult_runtime::vision::{
    image_placeholder_tokens, preprocess_bytes, ImageProcessorConfig, VisionError,
};
use safetensors::{Dtype, SafeTensors};
use serde::Deserialize;

/// PNG inputs decode to the same samples and every later step repeats transformers' arithmetic.
const PNG_TOLERANCE: f32 = 1e-6;
/// One u8 level is 1 / 255 / std ≈ 0.015 after normalisation; a JPEG decoder may round a
/// sample a few levels differently and bicubic resampling spreads that to its neighbours.
const JPEG_MAX_TOLERANCE: f32 = 0.1;
const JPEG_MEAN_TOLERANCE: f32 = 0.01;

/// The output folder of `tests/python/make_image_reference.py`, made once and cached.
fn reference_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| common::made_by("make_image_reference.py", &[]))
}

#[derive(Deserialize)]
struct Manifest {
    settings: HashMap<String, serde_json::Value>,
    cases: Vec<Case>,
}

#[derive(Deserialize)]
struct Case {
    name: String,
    file: String,
    /// transformers' error message per setting it refused the image under.
    errors: HashMap<String, String>,
}

/// How far our `pixel_values` are from transformers': the largest and the mean absolute
/// difference.
struct Difference {
    max: f32,
    mean: f32,
}

fn difference(ours: &[f32], theirs: &[f32]) -> Difference {
    assert_eq!(ours.len(), theirs.len(), "pixel_values lengths differ");
    let (mut max, mut total) = (0.0f32, 0.0f64);
    for (a, b) in ours.iter().zip(theirs) {
        let d = (a - b).abs();
        max = max.max(d);
        total += d as f64;
    }
    Difference {
        max,
        mean: (total / ours.len().max(1) as f64) as f32,
    }
}

fn f32s(tensors: &SafeTensors, name: &str) -> (Vec<usize>, Vec<f32>) {
    let view = tensors
        .tensor(name)
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    assert_eq!(view.dtype(), Dtype::F32, "{name}");
    let values = view
        .data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    (view.shape().to_vec(), values)
}

fn i64s(tensors: &SafeTensors, name: &str) -> Vec<i64> {
    let view = tensors
        .tensor(name)
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    assert_eq!(view.dtype(), Dtype::I64, "{name}");
    view.data()
        .chunks_exact(8)
        .map(|b| i64::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

#[test]
fn transformers_qwen2_vl_pil_processor_gives_the_same_pixel_values_and_grids() {
    let dir = reference_dir();
    let manifest: Manifest =
        serde_json::from_slice(&std::fs::read(dir.join("manifest.json")).unwrap()).unwrap();
    let reference = std::fs::read(dir.join("reference.safetensors")).unwrap();
    let tensors = SafeTensors::deserialize(&reference).unwrap();
    assert_eq!(manifest.settings.len(), 2, "default and custom settings");

    let mut png_max = 0.0f32;
    let mut compared = 0;
    let mut report = Vec::new();
    for setting in manifest.settings.keys() {
        let config = ImageProcessorConfig::from_model_dir(&dir.join(setting)).unwrap();
        for case in &manifest.cases {
            let bytes = std::fs::read(dir.join(&case.file)).unwrap();
            let ours = preprocess_bytes(&bytes, &config);
            if let Some(message) = case.errors.get(setting) {
                let err = ours.err().unwrap_or_else(|| {
                    panic!(
                        "{setting}/{}: transformers refused it ({message}), we did not",
                        case.name
                    )
                });
                assert!(
                    matches!(err, VisionError::AspectRatio { .. }),
                    "{setting}/{}: {err} (transformers: {message})",
                    case.name
                );
                continue;
            }
            let ours = ours.unwrap_or_else(|e| panic!("{setting}/{}: {e}", case.name));
            let key = format!("{setting}/{}", case.name);
            let grid = i64s(&tensors, &format!("image_grid_thw/{key}"));
            let ours_grid: Vec<i64> = ours.grid_thw.iter().map(|&d| d as i64).collect();
            assert_eq!(ours_grid, grid, "{key}: image_grid_thw");
            let (shape, theirs) = f32s(&tensors, &format!("pixel_values/{key}"));
            assert_eq!(
                shape,
                [ours.rows(), ours.patch_dim],
                "{key}: pixel_values shape"
            );
            assert_eq!(
                image_placeholder_tokens(ours.grid_thw, config.merge_size) * 4,
                ours.rows(),
                "{key}: one placeholder token per 2x2 merged patches"
            );
            let diff = difference(&ours.pixel_values, &theirs);
            report.push(format!(
                "{key:<40} grid {:?}  max |diff| {:.3e}  mean {:.3e}",
                ours.grid_thw, diff.max, diff.mean
            ));
            if case.file.ends_with(".png") {
                assert!(diff.max <= PNG_TOLERANCE, "{key}: max |diff| {}", diff.max);
                png_max = png_max.max(diff.max);
            } else {
                assert!(
                    diff.max <= JPEG_MAX_TOLERANCE,
                    "{key}: max |diff| {}",
                    diff.max
                );
                assert!(
                    diff.mean <= JPEG_MEAN_TOLERANCE,
                    "{key}: mean |diff| {}",
                    diff.mean
                );
            }
            compared += 1;
        }
    }
    report.sort();
    println!("{}", report.join("\n"));
    println!("PNG max |diff| over {compared} comparisons: {png_max:.3e}");
    assert!(compared >= 28, "only {compared} images compared");
}
