//! Pillow's bicubic resize of 8-bit images (`Image.resize(size, Image.BICUBIC)`), to the bit.
//!
//! Pillow (libImaging/Resample.c) resamples in two separable passes, rounding and clipping to u8
//! between them, and skips a pass whose dimension is unchanged. The horizontal pass runs first
//! unless the height shrinks while the width does not (Pillow 13; Pillow 12 ran it first except
//! for images over 100 times taller than wide, so results differ by rounding there). Each
//! output pixel `i` of a pass is a weighted sum of the input pixels around its centre
//! `c = (i + 0.5) * scale`, `scale = in / out`:
//!
//! ```text
//! support = 2 * max(scale, 1)                      (bicubic: 2; widened when shrinking: antialias)
//! window  = [trunc(c - support + 0.5), trunc(c + support + 0.5))  clipped to [0, in)
//! w_j     = cubic((j - c + 0.5) / max(scale, 1)),  then w_j /= sum(w)
//! cubic(x) = (a+2)|x|^3 - (a+3)|x|^2 + 1    for |x| < 1
//!          = a(|x|^3 - 5|x|^2 + 8|x| - 4)    for 1 <= |x| < 2,   0 beyond;   a = -0.5
//! ```
//!
//! The weights are then fixed point with 22 fractional bits (`PRECISION_BITS = 32 - 8 - 2`,
//! rounded half away from zero), each sum starts at half a unit (`1 << 21`) and the result is
//! `sum >> 22` clipped to 0..=255. Weights are computed in f64 in Pillow's order of operations.

use super::RgbImage;

/// Fractional bits of the fixed-point weights.
const PRECISION_BITS: u32 = 32 - 8 - 2;

/// The bicubic filter's support at scale 1.
const BICUBIC_SUPPORT: f64 = 2.0;

/// Keys' cubic convolution kernel with `a = -0.5` (Pillow's `bicubic_filter`).
fn bicubic(x: f64) -> f64 {
    const A: f64 = -0.5;
    let x = x.abs();
    if x < 1.0 {
        ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
    } else if x < 2.0 {
        (((x - 5.0) * x + 8.0) * x - 4.0) * A
    } else {
        0.0
    }
}

/// The fixed-point weights of one pass: output pixel `i` reads input pixels
/// `start[i]..start[i] + len[i]` with weights `weights[i * max_len..][..len[i]]`.
struct Coefficients {
    start: Vec<usize>,
    len: Vec<usize>,
    max_len: usize,
    weights: Vec<i32>,
}

impl Coefficients {
    /// Pillow's `precompute_coeffs` then `normalize_coeffs_8bpc`, for the whole input range.
    fn new(in_size: usize, out_size: usize) -> Self {
        // Pillow passes the box as f32 and the scale as their f64 difference over the size.
        let scale = f64::from(in_size as f32) / out_size as f64;
        let filter_scale = scale.max(1.0);
        let support = BICUBIC_SUPPORT * filter_scale;
        let max_len = support.ceil() as usize * 2 + 1;
        let inv_filter_scale = 1.0 / filter_scale;
        let mut start = Vec::with_capacity(out_size);
        let mut len = Vec::with_capacity(out_size);
        let mut weights = vec![0i32; out_size * max_len];
        let mut w = vec![0.0f64; max_len];
        for i in 0..out_size {
            let center = (i as f64 + 0.5) * scale;
            // C's `(int)` truncates toward zero; a negative start is clipped to 0 either way.
            let lo = ((center - support + 0.5) as i64).max(0) as usize;
            let hi = ((center + support + 0.5) as i64).min(in_size as i64) as usize;
            let n = hi - lo;
            let mut total = 0.0;
            for (j, w_j) in w[..n].iter_mut().enumerate() {
                *w_j = bicubic(((j + lo) as f64 - center + 0.5) * inv_filter_scale);
                total += *w_j;
            }
            for (j, &w_j) in w[..n].iter().enumerate() {
                let normalised = if total != 0.0 { w_j / total } else { w_j };
                weights[i * max_len + j] = to_fixed(normalised);
            }
            start.push(lo);
            len.push(n);
        }
        Self {
            start,
            len,
            max_len,
            weights,
        }
    }

    /// The start and weights of output pixel `i`.
    fn of(&self, i: usize) -> (usize, &[i32]) {
        let at = i * self.max_len;
        (self.start[i], &self.weights[at..at + self.len[i]])
    }
}

/// A weight to fixed point, rounded half away from zero (Pillow truncates `w * 2^22 ± 0.5`).
fn to_fixed(w: f64) -> i32 {
    let scaled = w * (1u32 << PRECISION_BITS) as f64;
    if w < 0.0 {
        (scaled - 0.5) as i32
    } else {
        (scaled + 0.5) as i32
    }
}

/// A fixed-point sum back to a sample: `sum >> 22` clipped to the u8 range (Pillow's `clip8`).
fn clip8(sum: i64) -> u8 {
    (sum >> PRECISION_BITS).clamp(0, 255) as u8
}

/// Half a unit: the sums start here so the final shift rounds to nearest.
const HALF: i64 = 1 << (PRECISION_BITS - 1);

/// `image` resized to `width` x `height` with Pillow's bicubic filter (see the module docs).
pub fn resize_bicubic(image: &RgbImage, width: u32, height: u32) -> RgbImage {
    let resize_width = |im: RgbImage| {
        if width == im.width {
            im
        } else {
            horizontal(&im, width as usize)
        }
    };
    let resize_height = |im: RgbImage| {
        if height == im.height {
            im
        } else {
            vertical(&im, height as usize)
        }
    };
    // Pillow 13 runs the vertical pass first when the height shrinks and the width does not
    // (fewer rows for the horizontal pass); the order changes the rounding between passes.
    if height < image.height && width >= image.width {
        resize_width(resize_height(image.clone()))
    } else {
        resize_height(resize_width(image.clone()))
    }
}

fn horizontal(image: &RgbImage, out_width: usize) -> RgbImage {
    let in_width = image.width as usize;
    let rows = image.height as usize;
    let coefficients = Coefficients::new(in_width, out_width);
    let mut pixels = vec![0u8; rows * out_width * 3];
    for y in 0..rows {
        let row_in = &image.pixels[y * in_width * 3..(y + 1) * in_width * 3];
        let row_out = &mut pixels[y * out_width * 3..(y + 1) * out_width * 3];
        for x in 0..out_width {
            let (start, weights) = coefficients.of(x);
            let mut sums = [HALF; 3];
            for (j, &w) in weights.iter().enumerate() {
                let at = (start + j) * 3;
                for (c, sum) in sums.iter_mut().enumerate() {
                    *sum += row_in[at + c] as i64 * w as i64;
                }
            }
            for (c, sum) in sums.into_iter().enumerate() {
                row_out[x * 3 + c] = clip8(sum);
            }
        }
    }
    RgbImage {
        width: out_width as u32,
        height: image.height,
        pixels,
    }
}

fn vertical(image: &RgbImage, out_height: usize) -> RgbImage {
    let row_len = image.width as usize * 3;
    let coefficients = Coefficients::new(image.height as usize, out_height);
    let mut pixels = vec![0u8; out_height * row_len];
    let mut sums = vec![0i64; row_len];
    for y in 0..out_height {
        let (start, weights) = coefficients.of(y);
        sums.fill(HALF);
        for (j, &w) in weights.iter().enumerate() {
            let row_in = &image.pixels[(start + j) * row_len..(start + j + 1) * row_len];
            for (sum, &v) in sums.iter_mut().zip(row_in) {
                *sum += v as i64 * w as i64;
            }
        }
        for (out, &sum) in pixels[y * row_len..(y + 1) * row_len].iter_mut().zip(&sums) {
            *out = clip8(sum);
        }
    }
    RgbImage {
        width: image.width,
        height: out_height as u32,
        pixels,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn image(width: u32, height: u32, f: impl Fn(u32, u32, u32) -> u8) -> RgbImage {
        let mut pixels = Vec::new();
        for y in 0..height {
            for x in 0..width {
                pixels.extend((0..3).map(|c| f(x, y, c)));
            }
        }
        RgbImage {
            width,
            height,
            pixels,
        }
    }

    #[test]
    fn the_kernel_is_keys_cubic_with_a_minus_half() {
        assert_eq!(bicubic(0.0), 1.0);
        assert_eq!(bicubic(1.0), 0.0);
        assert_eq!(bicubic(-2.0), 0.0);
        assert_eq!(bicubic(0.5), 0.5625);
        assert_eq!(bicubic(-1.5), -0.0625);
    }

    #[test]
    fn weights_of_each_output_pixel_sum_to_one_in_fixed_point() {
        for (from, to) in [(37, 56), (1023, 1036), (3900, 3892), (513, 140), (1, 56)] {
            let coefficients = Coefficients::new(from, to);
            for i in 0..to {
                let (start, weights) = coefficients.of(i);
                assert!(start + weights.len() <= from);
                let total: i64 = weights.iter().map(|&w| w as i64).sum();
                assert!(
                    (total - (1 << PRECISION_BITS)).abs() <= 4,
                    "{from}->{to} [{i}]: {total}"
                );
            }
        }
    }

    #[test]
    fn a_flat_image_stays_flat_at_any_size() {
        let flat = image(37, 53, |_, _, c| [12, 200, 255][c as usize]);
        let resized = resize_bicubic(&flat, 84, 28);
        assert_eq!((resized.width, resized.height), (84, 28));
        assert!(resized.pixels.chunks(3).all(|p| p == [12, 200, 255]));
    }

    #[test]
    fn a_row_and_a_column_resize_as_pillow_resizes_them() {
        // Pillow 13: `Image.fromarray(row).resize((13, 1), Image.BICUBIC)` and `.resize((3, 1))`;
        // the 0s and 255s of the upscale are overshoot clipped.
        let row = [0u8, 255, 0, 255, 255, 0, 10, 200];
        let up = [0u8, 109, 254, 71, 39, 234, 255, 236, 56, 0, 6, 129, 214];
        let down = [112u8, 171, 78];
        let wide = image(8, 1, |x, _, _| row[x as usize]);
        let tall = image(1, 8, |_, y, _| row[y as usize]);
        let grey = |im: RgbImage| im.pixels.iter().step_by(3).copied().collect::<Vec<u8>>();
        assert_eq!(grey(resize_bicubic(&wide, 13, 1)), up);
        assert_eq!(grey(resize_bicubic(&wide, 3, 1)), down);
        assert_eq!(grey(resize_bicubic(&tall, 1, 13)), up);
    }

    #[test]
    fn shrinking_height_while_widening_runs_the_vertical_pass_first() {
        // Pillow 13: a 5x7 grey image `(x*53 + y*97 + x*y*31) % 256` resized to 8x4; with the
        // horizontal pass first, 10 of these 32 values round differently.
        let source = image(5, 7, |x, y, _| ((x * 53 + y * 97 + x * y * 31) % 256) as u8);
        let expected = [
            [45u8, 74, 107, 74, 75, 119, 171, 203],
            [132, 126, 116, 110, 101, 91, 120, 142],
            [123, 118, 119, 158, 179, 170, 111, 68],
            [149, 132, 105, 93, 73, 47, 25, 14],
        ];
        let resized = resize_bicubic(&source, 8, 4);
        let grey: Vec<u8> = resized.pixels.iter().step_by(3).copied().collect();
        assert_eq!(grey, expected.concat());
    }

    #[test]
    fn same_size_is_a_copy() {
        let noise = image(5, 4, |x, y, c| (x * 31 + y * 17 + c * 7) as u8);
        assert_eq!(resize_bicubic(&noise, 5, 4), noise);
    }
}
