//! Qwen2.5-VL's vision tower (transformers' `Qwen2_5_VisionTransformerPretrainedModel`): patch
//! embedding, 2-D rotary embedding, blocks attending within windows or over the whole image, and
//! the patch merger, over several images of different sizes at once.
//!
//! 1. `x = pixel_values · patch_embed.proj` (its Conv3d, whose kernel equals its stride, is one
//!    matmul per patch row).
//! 2. Rows are reordered window by window: a window is `window_tokens²` merged tokens (2x2
//!    patches each), tiled over each image's merged grid row-major, partial at the right and
//!    bottom edges (transformers' `get_vision_window_index`). Blocks of `fullatt_block_indexes`
//!    attend over each image (each frame), the others within each window; no attention crosses
//!    images.
//! 3. Block: `x += proj(attn(rope(q), rope(k), v))` on `norm1(x)`, then `x += mlp(norm2(x))`,
//!    RMSNorms with eps 1e-6, a gated MLP with biases; the rotation is computed in float32:
//!    `cos/sin` of `[h·f, w·f, h·f, w·f]`, `f_i = theta^(-4i/head_dim)` for the patch's row `h`
//!    and column `w`.
//! 4. Merger: `mlp.2(gelu(mlp.0(ln_q(x) viewed as [tokens, 4·hidden])))`, then rows back in
//!    image order: one output row per placeholder token, `[Σ tokens, out_hidden_size]`.

use tch::{Kind, Tensor};

use super::config::VisionConfig;
use crate::model::linear::Linear;
use crate::model::loader::WeightTaker;
use crate::model::mlp::gated_mlp;
use crate::model::{Error, Result};
use crate::vision::ProcessedImage;

/// transformers' `Qwen2_5_VLRMSNorm(eps=1e-6)` in the tower and the merger.
const EPS: f64 = 1e-6;

#[derive(Debug)]
struct Block {
    norm1: Tensor,
    norm2: Tensor,
    qkv: Linear,
    proj: Linear,
    /// `gate_proj` and `up_proj` stacked (weights and biases).
    gate_up_proj: Linear,
    down_proj: Linear,
}

/// The loaded tower, weights under the checkpoint's `visual.` names.
#[derive(Debug)]
pub(crate) struct VisionTower {
    cfg: VisionConfig,
    /// `visual.patch_embed.proj.weight`, `[hidden, channels, frames, patch, patch]`.
    patch_embed: Tensor,
    blocks: Vec<Block>,
    ln_q: Tensor,
    mlp0: Linear,
    mlp2: Linear,
}

/// Where each row goes and which rows attend together, for one batch of images.
struct Layout {
    /// Merged-token index (in image order) of each merged token in window order.
    window_index: Vec<i64>,
    /// Patch rows per window, in window order.
    windows: Vec<i64>,
    /// Patch rows per image frame.
    frames: Vec<i64>,
    /// Each patch row's (row, column) in its image's patch grid, in image order.
    hw: Vec<i64>,
}

impl VisionTower {
    pub(crate) fn load(cfg: &VisionConfig, w: &mut WeightTaker) -> Result<Self> {
        let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
        let p = cfg.patch_size;
        let patch_embed = w.take(
            "visual.patch_embed.proj.weight",
            &[h, cfg.in_channels, cfg.temporal_patch_size, p, p],
        )?;
        let blocks = (0..cfg.depth)
            .map(|b| {
                let n = format!("visual.blocks.{b}");
                let linear = |w: &mut WeightTaker, name: &str, out: usize, inp: usize| {
                    Ok::<_, Error>(Linear::with_bias(
                        w.take(&format!("{n}.{name}.weight"), &[out, inp])?,
                        Some(w.take(&format!("{n}.{name}.bias"), &[out])?),
                    ))
                };
                Ok(Block {
                    norm1: w.take(&format!("{n}.norm1.weight"), &[h])?,
                    norm2: w.take(&format!("{n}.norm2.weight"), &[h])?,
                    qkv: linear(w, "attn.qkv", 3 * h, h)?,
                    proj: linear(w, "attn.proj", h, h)?,
                    gate_up_proj: Linear::with_bias(
                        w.take_stacked(&[
                            (format!("{n}.mlp.gate_proj.weight"), [i, h]),
                            (format!("{n}.mlp.up_proj.weight"), [i, h]),
                        ])?,
                        Some(w.take_stacked(&[
                            (format!("{n}.mlp.gate_proj.bias"), [i]),
                            (format!("{n}.mlp.up_proj.bias"), [i]),
                        ])?),
                    ),
                    down_proj: linear(w, "mlp.down_proj", h, i)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let merged = h * cfg.spatial_merge_size.pow(2);
        Ok(Self {
            cfg: cfg.clone(),
            patch_embed,
            blocks,
            ln_q: w.take("visual.merger.ln_q.weight", &[h])?,
            mlp0: Linear::with_bias(
                w.take("visual.merger.mlp.0.weight", &[merged, merged])?,
                Some(w.take("visual.merger.mlp.0.bias", &[merged])?),
            ),
            mlp2: Linear::with_bias(
                w.take("visual.merger.mlp.2.weight", &[cfg.out_hidden_size, merged])?,
                Some(w.take("visual.merger.mlp.2.bias", &[cfg.out_hidden_size])?),
            ),
        })
    }

    /// The tensors that own the tower's weights, in a fixed order (the model's trainable
    /// tensors end with them).
    pub(crate) fn tensors(&self) -> Vec<&Tensor> {
        let mut out = vec![&self.patch_embed];
        for b in &self.blocks {
            out.extend([&b.norm1, &b.norm2]);
            out.extend(b.qkv.tensors());
            out.extend(b.proj.tensors());
            out.extend(b.gate_up_proj.tensors());
            out.extend(b.down_proj.tensors());
        }
        out.push(&self.ln_q);
        out.extend(self.mlp0.tensors());
        out.extend(self.mlp2.tensors());
        out
    }

    /// Checks that an image is one this tower takes: its rows hold `patch_dim` values and its
    /// grid is whole merged tokens.
    pub(crate) fn check(&self, image: &ProcessedImage) -> Result<()> {
        let c = &self.cfg;
        let [t, h, w] = image.grid_thw.map(|d| d as usize);
        let m = c.spatial_merge_size;
        if t == 0 || h == 0 || w == 0 || h % m != 0 || w % m != 0 {
            return Err(Error::Input(format!(
                "an image's grid {:?} is not whole {m}x{m} merged tokens",
                image.grid_thw
            )));
        }
        if image.patch_dim != c.patch_dim() || image.pixel_values.len() != t * h * w * c.patch_dim()
        {
            return Err(Error::Input(format!(
                "an image's pixel_values hold {} values of rows of {}, the tower takes {} rows of {} (in_channels * temporal_patch_size * patch_size²)",
                image.pixel_values.len(),
                image.patch_dim,
                t * h * w,
                c.patch_dim()
            )));
        }
        Ok(())
    }

    /// The merged patches of `images`, one row per placeholder token, images in order:
    /// `[Σ t·h·w / merge², out_hidden_size]` in the weights' kind.
    pub(crate) fn forward(&self, images: &[&ProcessedImage]) -> Tensor {
        let c = &self.cfg;
        let kind = self.patch_embed.kind();
        let device = self.patch_embed.device();
        let unit = (c.spatial_merge_size * c.spatial_merge_size) as i64;
        let pixels: Vec<Tensor> = images
            .iter()
            .map(|im| Tensor::from_slice(&im.pixel_values).view([-1, c.patch_dim() as i64]))
            .collect();
        let pixels = Tensor::cat(&pixels, 0).to_device(device).to_kind(kind);
        let rows = pixels.size()[0];
        let hidden = c.hidden_size as i64;
        let x = pixels.linear(&self.patch_embed.view([hidden, -1]), None::<Tensor>);

        let layout = self.layout(images);
        let window_index = Tensor::from_slice(&layout.window_index).to_device(device);
        // Rows move by whole merged tokens.
        let to_windows = |t: &Tensor| {
            let width = t.size()[1];
            t.view([rows / unit, unit, width])
                .index_select(0, &window_index)
                .view([rows, width])
        };
        let mut x = to_windows(&x);
        let (cos, sin) = self.rotary(&layout.hw, device);
        let (cos, sin) = (to_windows(&cos), to_windows(&sin));
        for (b, block) in self.blocks.iter().enumerate() {
            let segments = if c.fullatt_block_indexes.contains(&b) {
                &layout.frames
            } else {
                &layout.windows
            };
            x = self.block(block, &x, segments, &cos, &sin);
        }
        let merged = x
            .rms_norm([hidden], Some(&self.ln_q), EPS)
            .view([rows / unit, unit * hidden]);
        let out = self.mlp2.forward(&self.mlp0.forward(&merged).gelu("none"));
        // Back from window order to image order.
        out.index_select(0, &window_index.argsort(0, false))
    }

    // `x + y` out of place: autograd needs the block's input.
    #[allow(clippy::assign_op_pattern)]
    fn block(
        &self,
        block: &Block,
        x: &Tensor,
        segments: &[i64],
        cos: &Tensor,
        sin: &Tensor,
    ) -> Tensor {
        let c = &self.cfg;
        let (n, heads, d) = (x.size()[0], c.num_heads as i64, c.head_dim() as i64);
        let hidden = c.hidden_size as i64;
        let qkv = block
            .qkv
            .forward(&x.rms_norm([hidden], Some(&block.norm1), EPS))
            .view([n, 3, heads, d]);
        let rotate = |t: Tensor| {
            // transformers' apply_rotary_pos_emb_vision: in float32, cast back.
            let t32 = t.to_kind(Kind::Float);
            let half = d / 2;
            let rotated = Tensor::cat(
                &[t32.narrow(2, half, half).neg(), t32.narrow(2, 0, half)],
                2,
            );
            (t32 * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)).to_kind(t.kind())
        };
        let q = rotate(qkv.select(1, 0));
        let k = rotate(qkv.select(1, 1));
        let v = qkv.select(1, 2);
        let mut outs = Vec::with_capacity(segments.len());
        let mut start = 0;
        for &len in segments {
            let part = |t: &Tensor| t.narrow(0, start, len).transpose(0, 1).unsqueeze(0);
            let o = Tensor::scaled_dot_product_attention(
                &part(&q),
                &part(&k),
                &part(&v),
                None::<Tensor>,
                0.0,
                false,
                None,
                false,
            );
            outs.push(o.squeeze_dim(0).transpose(0, 1).reshape([len, heads * d]));
            start += len;
        }
        let x = x + block.proj.forward(&Tensor::cat(&outs, 0));
        let mlp = gated_mlp(
            &x.rms_norm([hidden], Some(&block.norm2), EPS),
            &block.gate_up_proj,
            &block.down_proj,
            c.activation,
            &crate::model::lora::Rows::default(),
        );
        x + mlp
    }

    /// cos and sin `[rows, head_dim]` (float32) of each patch row at (row, column) `hw`.
    fn rotary(&self, hw: &[i64], device: tch::Device) -> (Tensor, Tensor) {
        let c = &self.cfg;
        let spatial = (c.head_dim() / 2) as i64;
        // transformers' compute_axial_rope_parameters, in float32.
        let exponent = Tensor::arange_start_step(0, spatial, 2, (Kind::Int64, tch::Device::Cpu))
            .to_kind(Kind::Float)
            / (spatial as f64);
        let inv_freq = Tensor::from(c.rope_theta as f32)
            .pow(&exponent)
            .reciprocal();
        let pos = Tensor::from_slice(hw).view([-1, 2]).to_kind(Kind::Float);
        let freqs = pos.unsqueeze(2) * inv_freq.view([1, 1, -1]);
        let hw_freqs = freqs.flatten(1, 2);
        let emb = Tensor::cat(&[&hw_freqs, &hw_freqs], 1).to_device(device);
        (emb.cos(), emb.sin())
    }

    /// The window order, attention segments and patch positions of `images` (transformers'
    /// `get_vision_window_index`, `get_vision_cu_seqlens` and `get_vision_position_ids`).
    fn layout(&self, images: &[&ProcessedImage]) -> Layout {
        let m = self.cfg.spatial_merge_size;
        let unit = (m * m) as i64;
        let side = self.cfg.window_tokens();
        let mut layout = Layout {
            window_index: Vec::new(),
            windows: Vec::new(),
            frames: Vec::new(),
            hw: Vec::new(),
        };
        let mut base = 0i64;
        for image in images {
            let [t, h, w] = image.grid_thw.map(|d| d as usize);
            let (lh, lw) = (h / m, w / m);
            for frame in 0..t {
                let first = base + (frame * lh * lw) as i64;
                for wy in (0..lh).step_by(side) {
                    for wx in (0..lw).step_by(side) {
                        let mut count = 0;
                        for y in wy..(wy + side).min(lh) {
                            for x in wx..(wx + side).min(lw) {
                                layout.window_index.push(first + (y * lw + x) as i64);
                                count += 1;
                            }
                        }
                        layout.windows.push(count * unit);
                    }
                }
                layout.frames.push((h * w) as i64);
                // Patch rows come merged token by merged token (block-major).
                for by in 0..lh {
                    for bx in 0..lw {
                        for my in 0..m {
                            for mx in 0..m {
                                layout.hw.push((by * m + my) as i64);
                                layout.hw.push((bx * m + mx) as i64);
                            }
                        }
                    }
                }
            }
            base += (t * lh * lw) as i64;
        }
        layout
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tower(window_size: usize) -> VisionTower {
        let cfg = VisionConfig {
            depth: 0,
            hidden_size: 8,
            intermediate_size: 8,
            num_heads: 1,
            patch_size: 14,
            spatial_merge_size: 2,
            temporal_patch_size: 2,
            window_size,
            fullatt_block_indexes: vec![],
            out_hidden_size: 8,
            in_channels: 3,
            activation: crate::model::mlp::Activation::Silu,
            rope_theta: 10000.0,
        };
        VisionTower {
            cfg,
            patch_embed: Tensor::zeros([8, 3, 2, 14, 14], (Kind::Float, tch::Device::Cpu)),
            blocks: vec![],
            ln_q: Tensor::ones([8], (Kind::Float, tch::Device::Cpu)),
            mlp0: Linear::new(Tensor::zeros([32, 32], (Kind::Float, tch::Device::Cpu))),
            mlp2: Linear::new(Tensor::zeros([8, 32], (Kind::Float, tch::Device::Cpu))),
        }
    }

    fn image(grid: [u32; 3]) -> ProcessedImage {
        ProcessedImage {
            pixel_values: vec![0.0; grid.iter().map(|&d| d as usize).product::<usize>() * 1176],
            grid_thw: grid,
            patch_dim: 1176,
        }
    }

    /// transformers' `get_vision_window_index` for grids (1, 6, 10) and (1, 4, 4) with a 2x2
    /// merged-token window (window_size 56), printed by the reference:
    /// window_index [0, 1, 5, 6, 2, 3, 7, 8, 4, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18],
    /// cu_window_seqlens [0, 16, 32, 40, 48, 56, 60, 76].
    #[test]
    fn windows_tile_each_merged_grid_row_major_with_partial_edges() {
        let t = tower(56);
        let a = image([1, 6, 10]);
        let b = image([1, 4, 4]);
        let layout = t.layout(&[&a, &b]);
        assert_eq!(
            layout.window_index,
            vec![0, 1, 5, 6, 2, 3, 7, 8, 4, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]
        );
        let cu: Vec<i64> = std::iter::once(0)
            .chain(layout.windows.iter().scan(0, |s, &l| {
                *s += l;
                Some(*s)
            }))
            .collect();
        assert_eq!(cu, vec![0, 16, 32, 40, 48, 56, 60, 76]);
        assert_eq!(layout.frames, vec![60, 16]);
        // The first merged token's 2x2 patches, then the second's.
        assert_eq!(
            &layout.hw[..16],
            &[0, 0, 0, 1, 1, 0, 1, 1, 0, 2, 0, 3, 1, 2, 1, 3]
        );
    }
}
