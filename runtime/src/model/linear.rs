//! A linear layer `y = x Wᵀ` whose weight may also be kept packed for oneDNN.
//!
//! On CPU, oneDNN with a weight already in its blocked layout runs the decode-shaped matmuls
//! (a few rows times a wide weight) 1.6–2.5x faster than the dense path, which re-packs the
//! weight on every call; it costs ~30 µs more per call, a loss on tiny layers (measured in
//! docs/benchmarks.md). Packing is an inference-only choice the engine makes
//! ([`super::Qwen3Model::pack_for_inference`]); the dense weight stays the source of truth (it
//! is what checkpoints name and weight updates write), and the packed copy is refreshed after
//! every update. With gradients required, the dense path is always used.

use tch::Tensor;

#[derive(Debug)]
pub(crate) struct Linear {
    pub weight: Tensor,
    packed: Option<Tensor>,
}

impl Linear {
    pub fn new(weight: Tensor) -> Self {
        Self {
            weight,
            packed: None,
        }
    }

    pub fn forward(&self, x: &Tensor) -> Tensor {
        match &self.packed {
            Some(packed) if !x.requires_grad() => x
                .contiguous()
                .to_mkldnn()
                .mkldnn_linear(packed, None::<Tensor>)
                .to_dense(None, false),
            _ => x.linear::<Tensor>(&self.weight, None),
        }
    }

    /// Makes the packed copy from the dense weight.
    pub fn pack(&mut self) {
        self.packed = Some(self.weight.contiguous().to_mkldnn());
    }

    /// Rewrites an existing packed copy from the dense weight, in place (no new allocation).
    pub fn refresh(&self) {
        if let Some(packed) = &self.packed {
            let _ = self.weight.contiguous().to_mkldnn_out(packed, None);
        }
    }
}
