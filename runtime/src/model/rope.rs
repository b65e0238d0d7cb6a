//! Rotary position embeddings, computed as transformers' default rope does.
//!
//! `inv_freq_i = 1 / theta^(2i/d)`, `angle = pos * inv_freq` (float32), `emb = [angle, angle]`;
//! `rope(x) = x * cos(emb) + rotate_half(x) * sin(emb)` with `rotate_half([a, b]) = [-b, a]`.
//! With `llama3` scaling the frequencies are rescaled first, as transformers'
//! `_compute_llama3_parameters` does (in float32); `linear` divides them all by its factor.

use tch::{Device, Kind, Tensor};

use super::config::{RopeConfig, RopeScaling};

/// Precomputed cos/sin tables for positions `0..max_positions`, shape `[max_positions, head_dim]`.
#[derive(Debug)]
pub struct Rope {
    cos: Tensor,
    sin: Tensor,
}

impl Rope {
    pub fn new(
        head_dim: usize,
        RopeConfig { theta, scaling }: RopeConfig,
        max_positions: usize,
        kind: Kind,
        device: Device,
    ) -> Self {
        let d = head_dim as i64;
        let exponent = Tensor::arange_start_step(0, d, 2, (Kind::Int64, Device::Cpu))
            .to_kind(Kind::Float)
            / (d as f64);
        let mut inv_freq = Tensor::from(theta as f32).pow(&exponent).reciprocal();
        if let Some(RopeScaling::Linear { factor }) = scaling {
            inv_freq /= factor;
        }
        if let Some(RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings: old_len,
        }) = scaling
        {
            // Wavelengths longer than the original context / low_freq_factor are slowed by
            // `factor`, shorter than / high_freq_factor kept, and those between interpolated.
            let (low_wavelen, high_wavelen) =
                (old_len / low_freq_factor, old_len / high_freq_factor);
            let wavelen = inv_freq.reciprocal() * (2.0 * std::f64::consts::PI);
            let scaled = (&inv_freq / factor).where_self(&wavelen.gt(low_wavelen), &inv_freq);
            let smooth = ((wavelen.reciprocal() * old_len) - low_freq_factor)
                / (high_freq_factor - low_freq_factor);
            let smoothed = (smooth.ones_like() - &smooth) * &scaled / factor + &smooth * &scaled;
            let medium = wavelen
                .lt(high_wavelen)
                .logical_not()
                .logical_and(&wavelen.gt(low_wavelen).logical_not());
            inv_freq = smoothed.where_self(&medium, &scaled);
        }
        let positions = Tensor::arange(max_positions as i64, (Kind::Float, Device::Cpu));
        let angles = positions.unsqueeze(1) * inv_freq.unsqueeze(0);
        let emb = Tensor::cat(&[&angles, &angles], -1);
        Self {
            cos: emb.cos().to_kind(kind).to_device(device),
            sin: emb.sin().to_kind(kind).to_device(device),
        }
    }

    pub fn max_positions(&self) -> usize {
        self.cos.size()[0] as usize
    }

    /// The rotation at `positions: [tokens]`, to apply to every layer's queries and keys.
    pub fn at(&self, positions: &Tensor) -> RopeAt {
        RopeAt {
            cos: self.cos.index_select(0, positions).unsqueeze(1),
            sin: self.sin.index_select(0, positions).unsqueeze(1),
        }
    }
}

impl Rope {
    /// The rotation at multimodal positions `positions: [3, tokens]` (temporal, height, width):
    /// frequency `j` of each half of the head turns with the axis whose `section` holds it
    /// (transformers' Qwen2.5-VL `recomposition_frequencies`: the first `section[0]` frequencies
    /// with the temporal position, the next `section[1]` with the height, the rest with the
    /// width). With the three positions equal this is [`Rope::at`].
    pub fn at_mrope(&self, positions: &Tensor, section: [usize; 3]) -> RopeAt {
        let half = self.cos.size()[1] / 2;
        let pick = |table: &Tensor| {
            let rows: Vec<Tensor> = (0..3)
                .map(|axis| table.index_select(0, &positions.get(axis)))
                .collect();
            let mut parts = Vec::with_capacity(6);
            for first in [0, half] {
                let mut start = first;
                for (axis, &len) in section.iter().enumerate() {
                    parts.push(rows[axis].narrow(1, start, len as i64));
                    start += len as i64;
                }
            }
            Tensor::cat(&parts, 1).unsqueeze(1)
        };
        RopeAt {
            cos: pick(&self.cos),
            sin: pick(&self.sin),
        }
    }
}

/// cos/sin rows `[tokens, 1, head_dim]` for one forward's positions.
#[derive(Debug)]
pub struct RopeAt {
    cos: Tensor,
    sin: Tensor,
}

impl RopeAt {
    /// Rotates `x: [tokens, heads, head_dim]`.
    pub fn apply(&self, x: &Tensor) -> Tensor {
        let half = x.size()[2] / 2;
        let rotated = Tensor::cat(&[&x.narrow(2, half, half).neg(), &x.narrow(2, 0, half)], 2);
        x * &self.cos + rotated * &self.sin
    }
}
