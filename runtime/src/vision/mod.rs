//! Vision inputs for vision-language models (docs/vision.md): image bytes from a chat message's
//! data URL, decoded to RGB and preprocessed into the patches and grid a Qwen2-VL / Qwen2.5-VL
//! vision tower takes.
//!
//! The contract is equality with Hugging Face: for a PNG, [`preprocess`] returns the same
//! `pixel_values` and `image_grid_thw` as transformers' `Qwen2VLImageProcessorPil` (bit for bit
//! in practice; the parity test allows 1e-6), because each step repeats the reference's
//! arithmetic: Pillow's `convert_to_rgb` (alpha composited onto white), Pillow's fixed-point
//! bicubic resampling, and numpy's float64 rescale then float32 normalisation. Pure Rust: no
//! libtorch, so the data-only build (`--no-default-features`) has it too.

mod config;
mod data_url;
mod decode;
mod preprocess;
mod resample;

pub use config::ImageProcessorConfig;
pub use data_url::{parse_data_url, DataUrlImage};
pub use decode::{decode_image, RgbImage};
pub use preprocess::{
    grid_of, image_placeholder_tokens, placeholder_tokens_of, preprocess, preprocess_bytes,
    smart_resize, ProcessedImage,
};
pub use resample::resize_bicubic;

use std::path::PathBuf;

/// What goes wrong between an image URL and its patches; each message names the input or the
/// config field at fault.
#[derive(Debug, thiserror::Error)]
pub enum VisionError {
    #[error(
        "image URLs with scheme `{scheme}` are not fetched: send the image inline as a \
         `data:image/png;base64,...` or `data:image/jpeg;base64,...` URL (docs/vision.md)"
    )]
    RemoteUrl { scheme: String },
    #[error(
        "unsupported image URL scheme `{scheme}`: only `data:` URLs are accepted \
         (`data:image/png;base64,...` or `data:image/jpeg;base64,...`)"
    )]
    UnsupportedScheme { scheme: String },
    #[error("malformed data URL: {reason}")]
    MalformedDataUrl { reason: &'static str },
    #[error("unsupported image media type `{media_type}`: accepted are image/png and image/jpeg")]
    UnsupportedMediaType { media_type: String },
    #[error("the image data URL is not valid base64")]
    Base64(#[source] base64::DecodeError),
    #[error("the image bytes are neither PNG nor JPEG (the accepted formats)")]
    UnsupportedFormat,
    #[error("cannot decode the image")]
    Decode(#[source] image::ImageError),
    #[error(
        "the image declares {height}x{width} pixels, more than the {max} moult decodes (8K UHD): \
         scale it down before sending it (docs/vision.md)"
    )]
    TooManyPixels { height: u32, width: u32, max: u64 },
    #[error("unsupported pixel layout {layout} (PNG and JPEG decode to 8- or 16-bit channels)")]
    UnsupportedPixelLayout { layout: String },
    #[error("the image is empty ({height}x{width} pixels)")]
    EmptyImage { height: u32, width: u32 },
    #[error(
        "the image's aspect ratio must be at most 200 (as in transformers' Qwen2-VL processor), \
         got {height}x{width} pixels"
    )]
    AspectRatio { height: u32, width: u32 },
    #[error(
        "the image ({height}x{width} pixels) is too small: it resizes to a side of 0 pixels \
         with factor {factor} and min_pixels {min_pixels}"
    )]
    TooSmall {
        height: u32,
        width: u32,
        factor: u32,
        min_pixels: u64,
    },
    #[error(
        "the image ({height}x{width} pixels) resizes to a side over 2^32 pixels with min_pixels \
         {min_pixels}"
    )]
    TooLarge {
        height: u32,
        width: u32,
        min_pixels: u64,
    },
    #[error("cannot read {}", path.display())]
    ConfigRead {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}: field `{field}`: {source}", path.display())]
    ConfigParse {
        path: PathBuf,
        field: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("image processor config: field `{field}`: {reason}")]
    ConfigInvalid { field: &'static str, reason: String },
}

pub type Result<T, E = VisionError> = std::result::Result<T, E>;
