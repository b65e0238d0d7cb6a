//! An RGB image to the `pixel_values` and `image_grid_thw` of a Qwen2-VL / Qwen2.5-VL vision
//! tower, as transformers' `Qwen2VLImageProcessorPil._preprocess` computes them:
//!
//! 1. resize to [`smart_resize`]'s size (multiples of `patch_size * merge_size` within the pixel
//!    bounds) with Pillow's bicubic filter ([`resize_bicubic`]);
//! 2. rescale and normalise: `((f64(u8) * rescale_factor) as f32 - mean) / std`, the first step
//!    in f64 like numpy's `rescale`, the second in f32 like its `normalize`;
//! 3. cut into patches: `pixel_values` has shape `[t * h * w, 3 * temporal_patch_size *
//!    patch_size^2]`, rows ordered by merged group then patch within the group
//!    (`(gh, gw, mh, mw)`), each row by `(channel, frame, row, column)`; a still image fills
//!    both frames with itself and has `t = 1`.

use super::{decode_image, resize_bicubic, ImageProcessorConfig, Result, RgbImage, VisionError};

/// The most an image's longer side may exceed its shorter side (transformers' limit).
const MAX_ASPECT_RATIO: f64 = 200.0;

/// One image ready for the vision tower.
#[derive(Debug, Clone, PartialEq)]
pub struct ProcessedImage {
    /// Row-major `[rows, patch_dim]` with `rows = t * h * w` of [`Self::grid_thw`].
    pub pixel_values: Vec<f32>,
    /// `image_grid_thw`: frames, patch rows, patch columns.
    pub grid_thw: [u32; 3],
    /// Values per row: `3 * temporal_patch_size * patch_size^2`.
    pub patch_dim: usize,
}

impl ProcessedImage {
    /// Rows of `pixel_values`: one per patch.
    pub fn rows(&self) -> usize {
        self.grid_thw.iter().map(|&d| d as usize).product()
    }
}

/// The `<|image_pad|>` tokens an image takes in the prompt: its patches over the `merge_size^2`
/// patches merged into each token (`grid_t * grid_h * grid_w / merge_size^2`).
pub fn image_placeholder_tokens(grid_thw: [u32; 3], merge_size: u32) -> usize {
    let patches: usize = grid_thw.iter().map(|&d| d as usize).product();
    patches / (merge_size as usize).pow(2)
}

/// The size transformers' `smart_resize` (models/qwen2_vl/image_processing_qwen2_vl.py) gives
/// a `height` x `width` image: both sides multiples of `factor`, the area within
/// `[min_pixels, max_pixels]`, the aspect ratio kept as nearly as that allows.
///
/// ```text
/// h, w = round_half_even(height / factor) * factor, (same for width)
/// if h * w > max_pixels: beta = sqrt(height * width / max_pixels),
///                        h = max(factor, floor(height / beta / factor) * factor)   (same for w)
/// elif h * w < min_pixels: beta = sqrt(min_pixels / (height * width)),
///                        h = ceil(height * beta / factor) * factor                  (same for w)
/// ```
///
/// Errors: an empty image, an aspect ratio over 200, and a side rounded to 0 (only possible
/// with `min_pixels = 0`, where transformers would fail in PIL).
pub fn smart_resize(
    height: u32,
    width: u32,
    factor: u32,
    min_pixels: u64,
    max_pixels: u64,
) -> Result<(u32, u32)> {
    if height == 0 || width == 0 {
        return Err(VisionError::EmptyImage { height, width });
    }
    let (h, w, f) = (height as f64, width as f64, factor as f64);
    if h.max(w) / h.min(w) > MAX_ASPECT_RATIO {
        return Err(VisionError::AspectRatio { height, width });
    }
    let area = height as u64 * width as u64;
    let factor_px = factor as u64;
    // Python's `round` on a float rounds half to even.
    let mut h_bar = (h / f).round_ties_even() as u64 * factor_px;
    let mut w_bar = (w / f).round_ties_even() as u64 * factor_px;
    if h_bar.saturating_mul(w_bar) > max_pixels {
        let beta = (area as f64 / max_pixels as f64).sqrt();
        h_bar = factor_px.max((h / beta / f).floor() as u64 * factor_px);
        w_bar = factor_px.max((w / beta / f).floor() as u64 * factor_px);
    } else if h_bar.saturating_mul(w_bar) < min_pixels {
        let beta = (min_pixels as f64 / area as f64).sqrt();
        h_bar = (h * beta / f).ceil() as u64 * factor_px;
        w_bar = (w * beta / f).ceil() as u64 * factor_px;
    }
    if h_bar == 0 || w_bar == 0 {
        return Err(VisionError::TooSmall {
            height,
            width,
            factor,
            min_pixels,
        });
    }
    match (u32::try_from(h_bar), u32::try_from(w_bar)) {
        (Ok(h_bar), Ok(w_bar)) => Ok((h_bar, w_bar)),
        _ => Err(VisionError::TooLarge {
            height,
            width,
            min_pixels,
        }),
    }
}

/// The grid an image of `height` x `width` pixels is cut into (`image_grid_thw`: one frame of
/// the resized size over the patch size), without decoding or resizing it.
pub fn grid_of(height: u32, width: u32, config: &ImageProcessorConfig) -> Result<[u32; 3]> {
    let (h, w) = smart_resize(
        height,
        width,
        config.factor(),
        config.min_pixels,
        config.max_pixels,
    )?;
    Ok([1, h / config.patch_size, w / config.patch_size])
}

/// The placeholder tokens PNG or JPEG `bytes` take in a prompt (what [`preprocess_bytes`] would
/// give, without resizing): the image is decoded, so bytes the engine could not read are refused
/// here already.
pub fn placeholder_tokens_of(bytes: &[u8], config: &ImageProcessorConfig) -> Result<usize> {
    let image = decode_image(bytes)?;
    let grid = grid_of(image.height, image.width, config)?;
    Ok(image_placeholder_tokens(grid, config.merge_size))
}

/// Decodes PNG or JPEG bytes and preprocesses the image.
pub fn preprocess_bytes(bytes: &[u8], config: &ImageProcessorConfig) -> Result<ProcessedImage> {
    preprocess(&decode_image(bytes)?, config)
}

/// Resizes, normalises and patches one image (see the module docs).
pub fn preprocess(image: &RgbImage, config: &ImageProcessorConfig) -> Result<ProcessedImage> {
    let (height, width) = smart_resize(
        image.height,
        image.width,
        config.factor(),
        config.min_pixels,
        config.max_pixels,
    )?;
    let resized = resize_bicubic(image, width, height);
    let normalised = normalisation_table(config);

    let patch = config.patch_size as usize;
    let merge = config.merge_size as usize;
    let frames = config.temporal_patch_size as usize;
    let (grid_h, grid_w) = (height as usize / patch, width as usize / patch);
    let patch_dim = config.patch_dim();
    let mut pixel_values = Vec::with_capacity(grid_h * grid_w * patch_dim);
    for group_row in 0..grid_h / merge {
        for group_col in 0..grid_w / merge {
            for merged_row in 0..merge {
                for merged_col in 0..merge {
                    let top = (group_row * merge + merged_row) * patch;
                    let left = (group_col * merge + merged_col) * patch;
                    for (c, table) in normalised.iter().enumerate() {
                        for _frame in 0..frames {
                            for y in top..top + patch {
                                for x in left..left + patch {
                                    pixel_values.push(table[resized.sample(y, x, c) as usize]);
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    Ok(ProcessedImage {
        pixel_values,
        grid_thw: [1, grid_h as u32, grid_w as u32],
        patch_dim,
    })
}

/// The normalised value of every u8 sample, per channel: numpy's `rescale` (`image.astype(f64)
/// * scale`, then `astype(f32)`) followed by its `normalize` in f32 (`(image - mean) / std`).
fn normalisation_table(config: &ImageProcessorConfig) -> [[f32; 256]; 3] {
    let mut table = [[0.0f32; 256]; 3];
    for (c, row) in table.iter_mut().enumerate() {
        for (v, out) in row.iter_mut().enumerate() {
            let rescaled = (v as f64 * config.rescale_factor) as f32;
            *out = (rescaled - config.image_mean[c]) / config.image_std[c];
        }
    }
    table
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIN: u64 = 56 * 56;
    const MAX: u64 = 28 * 28 * 1280;

    #[test]
    fn smart_resize_matches_transformers_on_edge_cases() {
        // transformers 5.24 `smart_resize(h, w, 28, 3136, 1003520)`.
        let cases = [
            ((1, 1), (56, 56)),
            ((1, 200), (28, 812)),
            ((37, 53), (56, 84)),
            ((61, 200), (56, 196)),
            ((513, 1023), (504, 1036)),
            ((900, 1200), (840, 1148)),
            ((20, 3900), (28, 3892)),
            ((42, 42), (56, 56)),
            ((4000, 3000), (1148, 840)),
            ((10000, 10000), (980, 980)),
            ((28, 5600), (28, 5600)),
        ];
        for ((h, w), expected) in cases {
            assert_eq!(
                smart_resize(h, w, 28, MIN, MAX).unwrap(),
                expected,
                "{h}x{w}"
            );
        }
    }

    #[test]
    fn smart_resize_rounds_halves_to_even_like_python() {
        // 70 / 28 = 2.5 rounds to 2, 98 / 28 = 3.5 to 4: (84, 112) if halves rounded up.
        assert_eq!(smart_resize(70, 98, 28, MIN, MAX).unwrap(), (56, 112));
    }

    #[test]
    fn smart_resize_refuses_aspect_ratios_over_200() {
        assert!(smart_resize(1, 200, 28, MIN, MAX).is_ok());
        for (h, w) in [(1, 201), (201, 1), (10, 2001)] {
            let err = smart_resize(h, w, 28, MIN, MAX).unwrap_err();
            assert!(
                matches!(err, VisionError::AspectRatio { .. }),
                "{h}x{w}: {err}"
            );
            assert!(err.to_string().contains("200"), "{err}");
        }
    }

    #[test]
    fn smart_resize_refuses_empty_images_and_sides_rounded_to_zero() {
        let err = smart_resize(0, 10, 28, MIN, MAX).unwrap_err();
        assert!(matches!(err, VisionError::EmptyImage { .. }), "{err}");
        // transformers returns (0, 1008) here and PIL then fails on the empty size.
        let err = smart_resize(10, 1000, 28, 0, MAX).unwrap_err();
        assert!(matches!(err, VisionError::TooSmall { .. }), "{err}");
        assert!(err.to_string().contains("too small"), "{err}");
    }

    #[test]
    fn placeholder_tokens_are_patches_over_merged_groups() {
        assert_eq!(image_placeholder_tokens([1, 4, 6], 2), 6);
        assert_eq!(image_placeholder_tokens([1, 60, 82], 2), 1230);
        assert_eq!(image_placeholder_tokens([2, 4, 4], 1), 32);
    }

    #[test]
    fn patches_are_ordered_by_merged_group_then_channel_frame_row_column() {
        // A 56x56 image (no resize at the minimum size) whose red channel encodes the position:
        // red = x + 2y, green = 0, blue = 255.
        let mut pixels = Vec::new();
        for y in 0..56u32 {
            for x in 0..56u32 {
                pixels.extend([(x + 2 * y) as u8, 0, 255]);
            }
        }
        let image = RgbImage {
            width: 56,
            height: 56,
            pixels,
        };
        let config = ImageProcessorConfig {
            image_mean: [0.0; 3],
            image_std: [1.0; 3],
            ..Default::default()
        };
        let out = preprocess(&image, &config).unwrap();
        assert_eq!(out.grid_thw, [1, 4, 4]);
        assert_eq!(out.pixel_values.len(), 16 * 1176);
        let red = |v: f32| (v * 255.0).round() as u32;
        // Row 1 is the second patch of the first 2x2 group: top 0, left 14.
        let row = &out.pixel_values[1176..2 * 1176];
        assert_eq!(red(row[0]), 14);
        assert_eq!(red(row[14 + 3]), 17 + 2);
        // Frame 2 of red repeats frame 1; green then blue follow.
        assert_eq!(row[196..392], row[..196]);
        assert!(row[392..784].iter().all(|&v| v == 0.0));
        assert!(row[784..].iter().all(|&v| v == 1.0));
        // Row 2 is the group's bottom-left patch (top 14, left 0), row 4 starts the group to the
        // right (top 0, left 28), row 8 the group below (top 28, left 0).
        assert_eq!(red(out.pixel_values[2 * 1176]), 28);
        assert_eq!(red(out.pixel_values[4 * 1176]), 28);
        assert_eq!(red(out.pixel_values[8 * 1176]), 56);
    }
}
