//! PNG and JPEG bytes to 8-bit RGB, as transformers sees a file opened with PIL.
//!
//! transformers' `convert_to_rgb` (image_transforms.py) turns an image with an alpha channel or a
//! `transparency` entry (PNG tRNS) into RGBA and composites it onto opaque white with
//! `PIL.Image.alpha_composite`; every other image goes through `convert("RGB")`. The `image`
//! crate's PNG decoder expands palettes and tRNS into RGB(A) the way PIL's `convert("RGBA")`
//! does, so what is left to match is how PIL reads 16-bit PNGs: RGB(A) and grey+alpha keep the
//! high byte of each sample, 16-bit grey (PIL mode `I;16`) is clipped to 255 by `convert("RGB")`.

use image::DynamicImage;

use super::{Result, VisionError};

/// An 8-bit RGB image, rows top to bottom, pixels interleaved (`[r, g, b, r, g, b, ...]`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RgbImage {
    pub width: u32,
    pub height: u32,
    pub pixels: Vec<u8>,
}

impl RgbImage {
    /// The sample of channel `c` at row `y`, column `x`.
    pub fn sample(&self, y: usize, x: usize, c: usize) -> u8 {
        self.pixels[(y * self.width as usize + x) * 3 + c]
    }
}

/// The most pixels an image may declare to be decoded: 8K UHD (7680 × 4320). A few hundred
/// bytes of PNG or JPEG header can declare billions (a decompression bomb: seconds of CPU and
/// hundreds of megabytes per request, found by fuzzing), and every vision model moult serves
/// scales an image down to a few million pixels anyway.
pub const MAX_PIXELS: u64 = 7680 * 4320;

/// Decodes PNG or JPEG bytes (the format is read from the bytes, not trusted from a media type),
/// refusing an image of more than [`MAX_PIXELS`] before decoding any of it.
pub fn decode_image(bytes: &[u8]) -> Result<RgbImage> {
    let format = match image::guess_format(bytes) {
        Ok(format @ (image::ImageFormat::Png | image::ImageFormat::Jpeg)) => format,
        _ => return Err(VisionError::UnsupportedFormat),
    };
    let reader = || image::ImageReader::with_format(std::io::Cursor::new(bytes), format);
    let (width, height) = reader().into_dimensions().map_err(VisionError::Decode)?;
    if u64::from(width) * u64::from(height) > MAX_PIXELS {
        let max = MAX_PIXELS;
        return Err(VisionError::TooManyPixels { height, width, max });
    }
    let decoded = reader().decode().map_err(VisionError::Decode)?;
    let (width, height) = (decoded.width(), decoded.height());
    let pixels = match decoded {
        DynamicImage::ImageRgb8(im) => im.into_raw(),
        DynamicImage::ImageLuma8(im) => im.into_raw().iter().flat_map(|&l| [l, l, l]).collect(),
        DynamicImage::ImageRgba8(im) => over_white(im.as_raw().chunks_exact(4).map(rgba)),
        DynamicImage::ImageLumaA8(im) => over_white(im.as_raw().chunks_exact(2).map(grey_alpha)),
        DynamicImage::ImageRgb16(im) => im.as_raw().iter().map(|&v| high_byte(v)).collect(),
        DynamicImage::ImageLuma16(im) => im
            .as_raw()
            .iter()
            .flat_map(|&v| [v.min(255) as u8; 3])
            .collect(),
        DynamicImage::ImageRgba16(im) => {
            let high: Vec<u8> = im.as_raw().iter().map(|&v| high_byte(v)).collect();
            over_white(high.chunks_exact(4).map(rgba))
        }
        DynamicImage::ImageLumaA16(im) => {
            let high: Vec<u8> = im.as_raw().iter().map(|&v| high_byte(v)).collect();
            over_white(high.chunks_exact(2).map(grey_alpha))
        }
        other => {
            return Err(VisionError::UnsupportedPixelLayout {
                layout: format!("{:?}", other.color()),
            })
        }
    };
    Ok(RgbImage {
        width,
        height,
        pixels,
    })
}

fn high_byte(v: u16) -> u8 {
    (v >> 8) as u8
}

fn rgba(p: &[u8]) -> [u8; 4] {
    [p[0], p[1], p[2], p[3]]
}

fn grey_alpha(p: &[u8]) -> [u8; 4] {
    [p[0], p[0], p[0], p[1]]
}

/// RGBA pixels composited onto opaque white, the way transformers' `convert_to_rgb` does it:
/// `alpha_composite(white, image).convert("RGB")`.
fn over_white(pixels: impl Iterator<Item = [u8; 4]>) -> Vec<u8> {
    pixels.flat_map(composite_over_white).collect()
}

/// Pillow's `ImagingAlphaComposite` (libImaging/AlphaComposite.c) for a source pixel over an opaque
/// white destination: 7 extra bits of fixed-point precision and its rounded division by 255,
/// `((v >> 8) + v) >> 8`. A fully transparent pixel is the destination (white).
fn composite_over_white([r, g, b, a]: [u8; 4]) -> [u8; 3] {
    const PRECISION_BITS: u32 = 7;
    const WHITE: u32 = 255;
    if a == 0 {
        return [255; 3];
    }
    let a = a as u32;
    let blend = WHITE * (255 - a);
    let out_alpha_255 = a * 255 + blend;
    let coef1 = a * 255 * 255 * (1 << PRECISION_BITS) / out_alpha_255;
    let coef2 = 255 * (1 << PRECISION_BITS) - coef1;
    let channel = |src: u8| {
        let v = src as u32 * coef1 + WHITE * coef2 + (0x80 << PRECISION_BITS);
        ((((v >> 8) + v) >> 8) >> PRECISION_BITS) as u8
    };
    [channel(r), channel(g), channel(b)]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opaque_pixels_keep_their_colour_and_transparent_ones_turn_white() {
        for v in 0..=255u8 {
            assert_eq!(
                composite_over_white([v, 255 - v, v / 2, 255]),
                [v, 255 - v, v / 2]
            );
            assert_eq!(composite_over_white([v, 0, 0, 0]), [255; 3]);
        }
    }

    #[test]
    fn half_transparent_black_is_mid_grey() {
        // 0 * 128/255 + 255 * 127/255 = 127 (Pillow's integer rounding).
        assert_eq!(composite_over_white([0, 0, 0, 128]), [127; 3]);
        // Pillow 13: `alpha_composite(white, (10, 200, 77, 3))`.
        assert_eq!(composite_over_white([10, 200, 77, 3]), [252, 254, 253]);
    }

    #[test]
    fn bytes_that_are_not_png_or_jpeg_are_refused() {
        let err = decode_image(b"GIF89a\x01\x00\x01\x00").unwrap_err();
        assert!(matches!(err, VisionError::UnsupportedFormat), "{err}");
        let err = decode_image(b"\x89PNG\r\n\x1a\ntruncated").unwrap_err();
        assert!(matches!(err, VisionError::Decode(_)), "{err}");
    }

    #[test]
    fn an_image_declaring_more_than_8k_pixels_is_refused_before_decoding() {
        // 770 bytes of JPEG declaring 1280x65535 pixels: 10 s and 250 MB to decode (fuzzing).
        let bomb = include_bytes!("../../../fuzz/corpus/image_preprocess/finding-jpeg-bomb");
        let err = decode_image(bomb).unwrap_err();
        assert!(
            matches!(
                err,
                VisionError::TooManyPixels {
                    height: 1280,
                    width: 65535,
                    ..
                }
            ),
            "{err}"
        );
        assert!(err.to_string().contains("1280x65535"), "{err}");
    }
}
