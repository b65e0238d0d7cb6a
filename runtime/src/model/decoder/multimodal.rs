//! The vision-language half of [`CausalLm`] (Qwen2.5-VL, docs/vision.md): images given with a
//! batch's sequences ([`SeqInput::images`]) are checked against their placeholder tokens, the
//! vision tower encodes those whose placeholders the batch runs (a prefill chunk that holds part
//! of an image encodes the whole image and keeps its part), its rows replace those tokens'
//! embeddings (transformers' `masked_scatter`), and every token of a sequence with images rotates
//! at its multimodal position (`super::super::vl::mrope_positions`). A batch without images runs
//! exactly the text model's forward.

use std::path::Path;
use std::sync::Arc;

use tch::Tensor;

use super::{CausalLm, Packed, SeqInput, Span};
use crate::model::vl::{self, ImageInput};
use crate::model::{Error, Result};
use crate::vision::{image_placeholder_tokens, ImageProcessorConfig, ProcessedImage};

/// An image whose placeholders (some or all) lie in a packed batch.
#[derive(Debug)]
pub(super) struct PackedImage {
    image: Arc<ProcessedImage>,
    /// Packed row of the first of its placeholders in the batch.
    row: i64,
    /// Its placeholders `skip..skip + take` are in the batch.
    skip: i64,
    take: i64,
}

impl CausalLm {
    /// Keeps the vision tower as it is while the rest trains: its forward runs without gradient,
    /// so its weights get none and the optimizer leaves them alone (moments and weight decay
    /// included: `AdamW` skips a tensor without a gradient). They stay in
    /// [`CausalLm::trainable`], [`CausalLm::params`] and checkpoints, so weight syncs and saved
    /// checkpoints still carry the whole model. No effect on a text-only model.
    pub fn freeze_vision(&mut self) {
        self.vision_frozen = true;
    }

    /// Whether [`CausalLm::freeze_vision`] was called (and the model has a vision tower).
    pub fn vision_frozen(&self) -> bool {
        self.vision_frozen && self.vision.is_some()
    }

    /// The index, in [`CausalLm::trainable_units`], of the vision tower's unit (the last).
    pub fn vision_unit(&self) -> Option<usize> {
        self.vision
            .as_ref()
            .map(|_| self.trainable_units().len() - 1)
    }

    /// Whether the LM head shares the embedding's weight (then it has no unit of its own in
    /// [`CausalLm::trainable_units`]).
    pub fn tied_head(&self) -> bool {
        self.untied_head().is_none()
    }

    /// The folder's image preprocessing (`preprocessor_config.json`), for a vision-language
    /// model loaded with [`CausalLm::load`] from a folder that has one.
    pub fn image_processor(&self) -> Option<&ImageProcessorConfig> {
        self.image_processor.as_ref()
    }

    /// Places a sequence's images, in prompt order, at their placeholder runs in `tokens`
    /// ([`vl::place_images`] with this model's image token and merge size); an error says how
    /// the runs and the images' placeholder counts differ. Refused for a text-only model.
    pub fn place_images(
        &self,
        tokens: &[i64],
        images: Vec<Arc<ProcessedImage>>,
    ) -> Result<Vec<ImageInput>> {
        let Some(vl) = &self.cfg.vl else {
            return Err(self.text_only());
        };
        let placed = vl::place_images(
            tokens,
            vl.image_token_id,
            vl.vision.spatial_merge_size,
            images,
        )?;
        let tower = self.vision.as_ref().expect("a vision config has a tower");
        for image in &placed {
            tower.check(&image.image)?;
        }
        Ok(placed)
    }

    fn text_only(&self) -> Error {
        Error::Input(format!(
            "images were given, but {:?} is a text-only model (docs/vision.md)",
            self.cfg.architecture
        ))
    }

    /// Reads `dir/preprocessor_config.json` for a vision-language model, checking that it cuts
    /// images as the tower takes them.
    pub(super) fn read_image_processor(&mut self, dir: &Path) -> Result<()> {
        let Some(vl) = &self.cfg.vl else {
            return Ok(());
        };
        let path = dir.join("preprocessor_config.json");
        if !path.exists() {
            return Ok(());
        }
        let config = ImageProcessorConfig::from_model_dir(dir).map_err(|e| Error::Checkpoint {
            path: path.clone(),
            message: e.to_string(),
        })?;
        let v = &vl.vision;
        for (field, theirs, ours) in [
            // Preprocessing makes RGB patches.
            ("in_channels", 3, v.in_channels),
            ("patch_size", config.patch_size as usize, v.patch_size),
            (
                "merge_size",
                config.merge_size as usize,
                v.spatial_merge_size,
            ),
            (
                "temporal_patch_size",
                config.temporal_patch_size as usize,
                v.temporal_patch_size,
            ),
        ] {
            if theirs != ours {
                return Err(Error::Checkpoint {
                    path,
                    message: format!(
                        "`{field}` is {theirs}, but config.json's vision tower takes {ours}"
                    ),
                });
            }
        }
        self.image_processor = Some(config);
        Ok(())
    }

    /// Checks a sequence's images against its tokens `past..past + tokens.len()`.
    pub(super) fn check_images(&self, seq: &SeqInput<'_>, past: usize) -> Result<()> {
        if seq.images.is_empty() {
            return Ok(());
        }
        let (Some(vl), Some(tower)) = (&self.cfg.vl, &self.vision) else {
            return Err(self.text_only());
        };
        for image in seq.images {
            tower.check(&image.image)?;
        }
        vl::check_span(
            seq.images,
            vl.vision.spatial_merge_size,
            vl.image_token_id,
            seq.tokens,
            past,
        )
    }

    /// The batch's multimodal positions `[3, tokens]` (when a sequence has images) and the
    /// images whose placeholders it runs.
    pub(super) fn pack_images(
        &self,
        seqs: &[SeqInput<'_>],
        spans: &[Span],
    ) -> (Option<Tensor>, Vec<PackedImage>) {
        let Some(vl) = self
            .cfg
            .vl
            .as_ref()
            .filter(|_| seqs.iter().any(|s| !s.images.is_empty()))
        else {
            return (None, Vec::new());
        };
        let merge = vl.vision.spatial_merge_size;
        let mut positions: [Vec<i64>; 3] = Default::default();
        let mut images = Vec::new();
        for (seq, span) in seqs.iter().zip(spans) {
            let (past, n) = (span.past as usize, span.n as usize);
            vl::mrope_positions(seq.images, merge, past..past + n, &mut positions);
            for image in seq.images {
                let placeholders = image.span(merge);
                let (lo, hi) = (placeholders.start.max(past), placeholders.end.min(past + n));
                if lo < hi {
                    images.push(PackedImage {
                        image: image.image.clone(),
                        row: span.offset + (lo - past) as i64,
                        skip: (lo - placeholders.start) as i64,
                        take: (hi - lo) as i64,
                    });
                }
            }
        }
        let mrope = Tensor::stack(
            &positions.map(|p| Tensor::from_slice(&p).to_device(self.device)),
            0,
        );
        (Some(mrope), images)
    }

    /// The batch's embeddings, its image placeholders' replaced by the vision tower's output.
    pub(super) fn embed_packed(&self, packed: &Packed) -> Tensor {
        let h = self.embed(&packed.ids);
        let Some(tower) = self.vision.as_ref().filter(|_| !packed.images.is_empty()) else {
            return h;
        };
        let merge = self
            .cfg
            .vl
            .as_ref()
            .expect("a tower has a config")
            .vision
            .spatial_merge_size;
        let inputs: Vec<&ProcessedImage> = packed.images.iter().map(|p| &*p.image).collect();
        let features = if self.vision_frozen {
            tch::no_grad(|| tower.forward(&inputs))
        } else {
            tower.forward(&inputs)
        };
        let (mut src, mut dst) = (Vec::new(), Vec::new());
        let mut first = 0i64;
        for p in &packed.images {
            src.extend(first + p.skip..first + p.skip + p.take);
            dst.extend(p.row..p.row + p.take);
            first += image_placeholder_tokens(p.image.grid_thw, merge as u32) as i64;
        }
        let src = Tensor::from_slice(&src).to_device(self.device);
        let dst = Tensor::from_slice(&dst).to_device(self.device);
        h.index_copy(0, &dst, &features.index_select(0, &src).to_kind(h.kind()))
    }
}
