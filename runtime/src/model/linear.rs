//! A linear layer `y = x Wᵀ (+ b)` whose weight may also be kept packed for oneDNN.
//!
//! On CPU, oneDNN with a weight already in its blocked layout runs the decode-shaped matmuls
//! (a few rows times a wide weight) 1.6–2.5x faster than the dense path, which re-packs the
//! weight on every call; it costs ~30 µs more per call, a loss on tiny layers (measured in
//! docs/benchmarks.md). Packing is an inference-only choice the engine makes
//! ([`super::CausalLm::pack_for_inference`]); the dense weight stays the source of truth (it
//! is what checkpoints name and weight updates write), and the packed copy is refreshed after
//! every update. With gradients required, the dense path is always used.
//!
//! A LoRA adapter on the layer (`super::lora`) adds its low-rank output to either path.

use tch::Tensor;

use super::lora::{Adapter, Rows};

#[derive(Debug)]
pub(crate) struct Linear {
    pub weight: Tensor,
    pub bias: Option<Tensor>,
    packed: Option<Tensor>,
    /// LoRA adapters by slot (slot 0: the model's own, `CausalLm::attach_lora`).
    pub adapters: Vec<Option<Adapter>>,
}

impl Linear {
    pub fn new(weight: Tensor) -> Self {
        Self::with_bias(weight, None)
    }

    pub fn with_bias(weight: Tensor, bias: Option<Tensor>) -> Self {
        Self {
            weight,
            bias,
            packed: None,
            adapters: Vec::new(),
        }
    }

    /// The base output, plus each adapter's on the rows `rows` gives it.
    pub fn forward_rows(&self, x: &Tensor, rows: &Rows) -> Tensor {
        let mut y = self.forward(x);
        for (slot, idx) in rows.groups() {
            let Some(Some(adapter)) = self.adapters.get(*slot) else {
                continue;
            };
            let out = y.size()[1];
            y = match idx {
                None => y + adapter.delta(x, out),
                Some(idx) => y.index_add(0, idx, &adapter.delta(&x.index_select(0, idx), out)),
            };
        }
        y
    }

    /// `x Wᵀ (+ b)`, without adapters.
    pub fn forward(&self, x: &Tensor) -> Tensor {
        match &self.packed {
            Some(packed) if !x.requires_grad() => {
                let y = x
                    .contiguous()
                    .to_mkldnn()
                    .mkldnn_linear(packed, None::<Tensor>)
                    .to_dense(None, false);
                match &self.bias {
                    Some(b) => y + b,
                    None => y,
                }
            }
            _ => x.linear(&self.weight, self.bias.as_ref()),
        }
    }

    /// Puts `adapter` in slot `slot` (`None` empties it).
    pub fn set_adapter(&mut self, slot: usize, adapter: Option<Adapter>) {
        if self.adapters.len() <= slot {
            self.adapters.resize_with(slot + 1, || None);
        }
        self.adapters[slot] = adapter;
    }

    /// The weight, then the bias if there is one: what an optimizer updates.
    pub fn tensors(&self) -> impl Iterator<Item = &Tensor> {
        std::iter::once(&self.weight).chain(self.bias.as_ref())
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
