//! The vision-language parts of a model (docs/vision.md, "The model"): Qwen2.5-VL's config
//! ([`config`]), its vision tower ([`tower`]), where a sequence's images sit among its tokens
//! ([`ImageInput`], [`place_images`]) and the multimodal rotary positions that follow from that
//! ([`mrope_positions`]).
//!
//! Contract: a sequence's images are given with the index of their first placeholder token
//! (`offset`), so any part of the sequence (a prefill chunk, one decoded token) has its
//! embeddings and positions without the tokens before it. Positions are transformers'
//! `get_rope_index`: text tokens count up by one on all three axes (temporal, height, width); an
//! image's placeholders, row-major over its merged grid `(t, h, w)`, take
//! `(p + t', p + h', p + w')` where `p` is the position after the text before it, and the text
//! after it continues from `p + max(h, w)`. After the last image a token at index `i` is at
//! `i + delta` on every axis (transformers' `rope_deltas`, negative: an image of `n` tokens
//! advances positions by less than `n`).

pub mod config;
pub(crate) mod tower;

use std::ops::Range;
use std::sync::Arc;

pub use config::{VisionConfig, VlConfig};

use super::{Error, Result};
use crate::vision::{image_placeholder_tokens, ProcessedImage};

/// One image of a sequence: its preprocessed patches and where its placeholders start.
#[derive(Clone, PartialEq)]
pub struct ImageInput {
    /// Index, in the whole sequence, of the image's first placeholder (`<|image_pad|>`) token;
    /// the next [`ImageInput::tokens`] tokens are its placeholders.
    pub offset: usize,
    /// `pixel_values` and `grid_thw` as `crate::vision::preprocess_bytes` returns them.
    pub image: Arc<ProcessedImage>,
}

/// The offset and grid, not the patches' values (megabytes of them).
impl std::fmt::Debug for ImageInput {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ImageInput")
            .field("offset", &self.offset)
            .field("grid_thw", &self.image.grid_thw)
            .finish_non_exhaustive()
    }
}

impl ImageInput {
    /// The placeholder tokens the image takes with `merge_size`x`merge_size` merging.
    pub fn tokens(&self, merge_size: usize) -> usize {
        image_placeholder_tokens(self.image.grid_thw, merge_size as u32)
    }

    /// The sequence indices of its placeholders.
    pub fn span(&self, merge_size: usize) -> Range<usize> {
        self.offset..self.offset + self.tokens(merge_size)
    }
}

/// The runs of `image_token_id` in `tokens`.
fn placeholder_runs(tokens: &[i64], image_token_id: i64) -> Vec<Range<usize>> {
    let mut runs: Vec<Range<usize>> = Vec::new();
    for (i, &t) in tokens.iter().enumerate() {
        if t != image_token_id {
            continue;
        }
        match runs.last_mut() {
            Some(run) if run.end == i => run.end += 1,
            _ => runs.push(i..i + 1),
        }
    }
    runs
}

/// `tokens` with each image's placeholder expanded, as vLLM expands them: a prompt may hold one
/// `image_token_id` per image (what a chat template renders; vLLM's form) or each image's whole
/// run (transformers' processor's form). When there is one run per image, a run of one token
/// becomes the image's [`image_placeholder_tokens`]; anything else is left for
/// [`place_images`] to judge.
pub fn expand_placeholders(
    tokens: Vec<i64>,
    image_token_id: i64,
    merge_size: usize,
    images: &[Arc<ProcessedImage>],
) -> Vec<i64> {
    let runs = placeholder_runs(&tokens, image_token_id);
    if runs.len() != images.len() || runs.iter().all(|r| r.len() != 1) {
        return tokens;
    }
    let mut out = Vec::with_capacity(tokens.len());
    let mut at = 0;
    for (run, image) in runs.iter().zip(images) {
        out.extend_from_slice(&tokens[at..run.start]);
        let wanted = image_placeholder_tokens(image.grid_thw, merge_size as u32);
        let len = if run.len() == 1 { wanted } else { run.len() };
        out.extend(std::iter::repeat_n(image_token_id, len));
        at = run.end;
    }
    out.extend_from_slice(&tokens[at..]);
    out
}

/// Finds the placeholders of `images` (in prompt order) in `tokens`: each image's must be one
/// run of `image_token_id` of exactly its [`image_placeholder_tokens`], and every run must
/// belong to an image. The error says what the runs and the images are, for a client to mend
/// its request.
pub fn place_images(
    tokens: &[i64],
    image_token_id: i64,
    merge_size: usize,
    images: Vec<Arc<ProcessedImage>>,
) -> Result<Vec<ImageInput>> {
    let runs = placeholder_runs(tokens, image_token_id);
    let wanted: Vec<usize> = images
        .iter()
        .map(|im| image_placeholder_tokens(im.grid_thw, merge_size as u32))
        .collect();
    let found: Vec<usize> = runs.iter().map(|r| r.len()).collect();
    if found != wanted {
        return Err(Error::Input(format!(
            "the token ids hold {} run(s) of image placeholder tokens (id {image_token_id}) of {found:?} tokens, but {} image(s) were given, taking {wanted:?} (an image of grid (t, h, w) takes t*h*w/{} placeholders between <|vision_start|> and <|vision_end|>; docs/vision.md)",
            runs.len(),
            images.len(),
            merge_size * merge_size,
        )));
    }
    Ok(runs
        .into_iter()
        .zip(images)
        .map(|(run, image)| ImageInput {
            offset: run.start,
            image,
        })
        .collect())
}

/// Checks that `images` are sorted and do not overlap, and that the tokens `tokens` (indices
/// `past..`) are placeholders exactly where an image's span covers them.
pub(crate) fn check_span(
    images: &[ImageInput],
    merge_size: usize,
    image_token_id: i64,
    tokens: &[i64],
    past: usize,
) -> Result<()> {
    let mut end = 0;
    for image in images {
        let span = image.span(merge_size);
        if span.start < end {
            return Err(Error::Input(format!(
                "images must be given in prompt order without overlapping: one starts at token {} before the previous one ends at {end}",
                span.start
            )));
        }
        end = span.end;
        let lo = span.start.max(past);
        let hi = span.end.min(past + tokens.len());
        if let Some(i) = (lo..hi).find(|&i| tokens[i - past] != image_token_id) {
            return Err(Error::Input(format!(
                "token {i} lies in the placeholders of the image at {} ({} tokens) but is {}, not the image token {image_token_id}",
                span.start,
                span.len(),
                tokens[i - past]
            )));
        }
    }
    Ok(())
}

/// The M-RoPE positions (temporal, height, width) of the sequence indices `range`, appended to
/// `out`, for a sequence whose images are `images` (sorted, as [`check_span`] checks).
pub(crate) fn mrope_positions(
    images: &[ImageInput],
    merge_size: usize,
    range: Range<usize>,
    out: &mut [Vec<i64>; 3],
) {
    // `pos`: the position of index `idx`, the first index after the last image passed.
    let (mut pos, mut idx) = (0i64, 0usize);
    let text = |from: usize, to: usize, pos: i64, idx: usize, out: &mut [Vec<i64>; 3]| {
        for i in from.max(range.start)..to.min(range.end) {
            let p = pos + (i - idx) as i64;
            out.iter_mut().for_each(|axis| axis.push(p));
        }
    };
    for image in images {
        let span = image.span(merge_size);
        if span.start >= range.end {
            break;
        }
        text(idx, span.start, pos, idx, out);
        pos += (span.start - idx) as i64;
        let [_, h, w] = image.image.grid_thw.map(|d| d as usize / merge_size);
        for i in span.start.max(range.start)..span.end.min(range.end) {
            let k = i - span.start;
            let (t, y, x) = (k / (h * w), (k / w) % h, k % w);
            out[0].push(pos + t as i64);
            out[1].push(pos + y as i64);
            out[2].push(pos + x as i64);
        }
        pos += h.max(w) as i64;
        idx = span.end;
    }
    text(idx, range.end, pos, idx, out);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn image(h: u32, w: u32) -> Arc<ProcessedImage> {
        Arc::new(ProcessedImage {
            pixel_values: Vec::new(),
            grid_thw: [1, h, w],
            patch_dim: 1176,
        })
    }

    /// transformers' `get_rope_index` for [text x3, image (1, 4, 6) (6 tokens), text x2,
    /// image (1, 2, 2) (1 token), text x2]: text 0..3; the image at 3 with rows 3..4 and
    /// columns 3..5, then text from 3 + max(2, 3) = 6; the second image at 8, text from 9.
    #[test]
    fn positions_follow_transformers_rope_index_in_any_chunking() {
        let im = 151655;
        let mut tokens = vec![1, 2, 3];
        tokens.extend([im; 6]);
        tokens.extend([4, 5, im, 6, 7]);
        let images = place_images(&tokens, im, 2, vec![image(4, 6), image(2, 2)]).unwrap();
        assert_eq!(
            images.iter().map(|i| i.offset).collect::<Vec<_>>(),
            vec![3, 11]
        );
        let mut whole: [Vec<i64>; 3] = Default::default();
        mrope_positions(&images, 2, 0..tokens.len(), &mut whole);
        assert_eq!(whole[0], vec![0, 1, 2, 3, 3, 3, 3, 3, 3, 6, 7, 8, 9, 10]);
        assert_eq!(whole[1], vec![0, 1, 2, 3, 3, 3, 4, 4, 4, 6, 7, 8, 9, 10]);
        assert_eq!(whole[2], vec![0, 1, 2, 3, 4, 5, 3, 4, 5, 6, 7, 8, 9, 10]);
        // Decoding past the end continues at index + delta (here 10 - 13 = -3).
        let mut next: [Vec<i64>; 3] = Default::default();
        mrope_positions(&images, 2, 20..21, &mut next);
        assert_eq!(next, [vec![17], vec![17], vec![17]]);
        // Any chunking gives the same positions.
        for cut in 0..tokens.len() {
            let mut parts: [Vec<i64>; 3] = Default::default();
            mrope_positions(&images, 2, 0..cut, &mut parts);
            mrope_positions(&images, 2, cut..tokens.len(), &mut parts);
            assert_eq!(parts, whole, "cut at {cut}");
        }
        check_span(&images, 2, im, &tokens[5..], 5).unwrap();
        let err = check_span(&images, 2, im, &[1, 2], 7).unwrap_err();
        assert!(err.to_string().contains("token 7"), "{err}");
    }

    #[test]
    fn placeholder_counts_must_match_the_images() {
        let im = 7;
        let tokens = [1, im, im, im, 2];
        for images in [vec![image(4, 6)], vec![], vec![image(2, 6), image(2, 2)]] {
            let err = place_images(&tokens, im, 2, images)
                .unwrap_err()
                .to_string();
            assert!(err.contains("[3]"), "{err}");
        }
        assert!(place_images(&tokens, im, 2, vec![image(2, 6)]).is_ok());
        assert!(place_images(&[1, 2], im, 2, vec![]).unwrap().is_empty());
    }
}
