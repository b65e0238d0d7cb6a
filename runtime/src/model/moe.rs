//! The Qwen3-MoE sparse MLP block, with routed-expert capture and routing replay.
//!
//! Router (transformers' `Qwen3MoeTopKRouter`): `p = softmax(x Wg^T)` in float32, the top-k
//! experts by `p`, gate weights `p_i` over the chosen experts, renormalised to sum to one when
//! `norm_topk_prob`. Output: `Σ_i g_i · down_i(silu(gate_i(x)) ⊙ up_i(x))`.
//!
//! Replay (docs/algorithms.md, R3): the chosen experts come from the caller instead of the top-k, while
//! the gate weights are still computed from the current router logits, so the router keeps
//! receiving gradients: `g_i = 1[i ∈ R]·exp(s_i) / Σ_j 1[j ∈ R]·exp(s_j)` when `norm_topk_prob`
//! (Qwen3-MoE's setting), and `g_i = softmax(s)_i` over all experts otherwise, exactly the
//! weights the un-replayed forward would use had it chosen `R`.

use tch::{Device, Kind, Tensor};

use super::linear::Linear;
use super::lora::Rows;
use super::mlp::{gated_mlp, Activation};
use super::{Error, Result};

#[derive(Debug)]
pub(crate) struct Expert {
    /// `gate_proj` and `up_proj` stacked.
    pub gate_up_proj: Linear,
    pub down_proj: Linear,
}

impl Expert {
    fn forward(&self, x: &Tensor, rows: &Rows) -> Tensor {
        gated_mlp(
            x,
            &self.gate_up_proj,
            &self.down_proj,
            Activation::Silu,
            rows,
        )
    }
}

#[derive(Debug)]
pub(crate) struct SparseMoe {
    pub gate: Tensor,
    pub experts: Vec<Expert>,
    pub top_k: i64,
    pub norm_topk_prob: bool,
}

impl SparseMoe {
    /// `x: [tokens, hidden]`; `replay: [tokens, top_k]` expert ids. Returns the block output and
    /// the expert ids used, `[tokens, top_k]` int64 (sorted by gate probability when routed here).
    /// Each token's adapter is the one `rows` gives it.
    pub fn forward(
        &self,
        x: &Tensor,
        replay: Option<&Tensor>,
        rows: &Rows,
    ) -> Result<(Tensor, Tensor)> {
        let tokens = x.size()[0];
        let num_experts = self.experts.len() as i64;
        let logits = x.linear::<Tensor>(&self.gate, None);
        let probs = logits.softmax(-1, Kind::Float);
        let ids = match replay {
            None => probs.topk(self.top_k, -1, true, true).1,
            Some(r) => {
                if r.size() != [tokens, self.top_k] {
                    return Err(Error::Input(format!(
                        "replayed experts have shape {:?}, expected [{tokens}, {}]",
                        r.size(),
                        self.top_k
                    )));
                }
                let r = r.to_kind(Kind::Int64).to_device(x.device());
                let (lo, hi) = (r.min().int64_value(&[]), r.max().int64_value(&[]));
                if lo < 0 || hi >= num_experts {
                    return Err(Error::Input(format!(
                        "replayed expert id out of range [0, {num_experts}): saw {lo}..={hi}"
                    )));
                }
                r
            }
        };
        let mut weights = probs.gather(1, &ids, false);
        if self.norm_topk_prob {
            weights = &weights / weights.sum_dim_intlist(-1, true, Kind::Float);
        }
        let weights = weights.to_kind(logits.kind()).reshape([-1]);

        // Group (token, slot) pairs by expert on the host: the expert loop is sequential anyway.
        let flat: Vec<i64> = Vec::try_from(ids.reshape([-1]).to_device(Device::Cpu))?;
        let mut by_expert: Vec<(Vec<i64>, Vec<i64>)> =
            vec![(Vec::new(), Vec::new()); self.experts.len()];
        for (pos, &e) in flat.iter().enumerate() {
            let (toks, slots) = &mut by_expert[e as usize];
            toks.push(pos as i64 / self.top_k);
            slots.push(pos as i64);
        }
        let mut out = x.zeros_like();
        for (expert, (toks, slots)) in self.experts.iter().zip(&by_expert) {
            if toks.is_empty() {
                continue;
            }
            let tok = Tensor::from_slice(toks).to_device(x.device());
            let slot = Tensor::from_slice(slots).to_device(x.device());
            let y = expert.forward(&x.index_select(0, &tok), &rows.subset(toks, x.device()))
                * weights.index_select(0, &slot).unsqueeze(-1);
            out = out.index_add(0, &tok, &y);
        }
        Ok((out, ids))
    }
}
