//! The RL algorithms (docs/algorithms.md) as pure functions over tensors, each with its formula, each
//! tested against a plain loop over numbers (`tests.rs`). The trainer composes them.
//!
//! Notation: μ the behaviour (engine) policy, π_old the trainer's recomputation at batch start,
//! π_θ the current policy; ρ_t = π_old(a_t)/μ(a_t), r_t = π_θ(a_t)/π_old(a_t). Per-token tensors
//! are `[batch, time]` with a float `mask` (1 for sampled tokens, 0 for prompt, observation and
//! padding); per-sequence tensors are `[batch]`.

pub mod advantages;
pub mod correction;
pub mod losses;

#[cfg(test)]
mod tests;

use tch::Tensor;

/// Σ_t mask_t · x_t per sequence, `[batch]`.
pub fn masked_sum(x: &Tensor, mask: &Tensor) -> Tensor {
    (x * mask).sum_dim_intlist([-1i64].as_slice(), false, x.kind())
}

/// Σ_t mask_t · x_t / Σ_t mask_t per sequence (0 for an empty sequence), `[batch]`.
pub fn masked_mean(x: &Tensor, mask: &Tensor) -> Tensor {
    let count = mask
        .sum_dim_intlist([-1i64].as_slice(), false, x.kind())
        .clamp_min(1.0);
    masked_sum(x, mask) / count
}
