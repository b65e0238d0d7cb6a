//! Policy losses (docs/algorithms.md). Inputs are `[batch, time]`: `logp` the current policy's
//! log-probabilities of the sampled tokens (with gradient), `logp_old` π_old's (no gradient),
//! `advantages` per token (a sequence's advantage repeated over its tokens, or per-token ones),
//! `coef` the IS-correction coefficients ([`super::correction`], no gradient), and `mask`.

use serde::{Deserialize, Serialize};
use tch::Tensor;

use super::masked_mean;

/// How per-token losses become one number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Aggregation {
    /// Σ_{i,t} m_it l_it / Σ_{i,t} m_it: every token weighs the same (DAPO).
    TokenMean,
    /// mean_i (Σ_t m_it l_it / Σ_t m_it): every sequence weighs the same (GRPO's original).
    SeqMean,
    /// Σ_{i,t} m_it l_it / (B · L): every token weighs the same and the divisor is a constant,
    /// L `normalizer` tokens per sequence (Dr. GRPO, Liu et al. 2025), so that the loss does not
    /// favour short correct or long wrong answers as a per-sequence token mean does.
    SeqMeanTokenSumNorm { normalizer: usize },
}

/// Aggregates per-token losses `[batch, time]` under `mask`.
pub fn aggregate(loss: &Tensor, mask: &Tensor, how: Aggregation) -> Tensor {
    match how {
        Aggregation::TokenMean => {
            (loss * mask).sum(loss.kind()) / mask.sum(loss.kind()).clamp_min(1.0)
        }
        Aggregation::SeqMean => masked_mean(loss, mask).mean(loss.kind()),
        Aggregation::SeqMeanTokenSumNorm { normalizer } => {
            let sequences = loss.size().first().copied().unwrap_or(1).max(1);
            (loss * mask).sum(loss.kind()) / (sequences as f64 * normalizer.max(1) as f64)
        }
    }
}

/// PPO-clip with asymmetric ε (Schulman et al. 2017; DAPO's clip-higher, Yu et al. 2025):
/// `l_t = −coef_t · min(r_t A_t, clip(r_t, 1 − ε_low, 1 + ε_high) A_t)`, r_t = exp(logp − logp_old).
pub fn ppo_clip(
    logp: &Tensor,
    logp_old: &Tensor,
    advantages: &Tensor,
    coef: &Tensor,
    eps_low: f64,
    eps_high: f64,
) -> Tensor {
    let ratio = (logp - logp_old).exp();
    clipped_surrogate(&ratio, advantages, eps_low, eps_high) * coef.detach()
}

/// `−min(r·A, clip(r, 1 − ε_low, 1 + ε_high)·A)`, the objective PPO and GSPO share.
fn clipped_surrogate(ratio: &Tensor, advantages: &Tensor, eps_low: f64, eps_high: f64) -> Tensor {
    let unclipped = ratio * advantages;
    let clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * advantages;
    -(unclipped.minimum(&clipped))
}

/// GSPO (Zheng et al. 2025): one ratio per sequence, the geometric mean of its token ratios,
/// `s_i = exp(mean_t (logp − logp_old))`, clipped as PPO:
/// `l_i = −c_i · min(s_i A_i, clip(s_i, 1 − ε_low, 1 + ε_high) A_i)` with `A_i` the sequence's
/// advantage (`[batch]`) and `c_i` its mean IS coefficient. Returns `[batch]` (already one per
/// sequence: average it).
pub fn gspo(
    logp: &Tensor,
    logp_old: &Tensor,
    advantages: &Tensor,
    coef: &Tensor,
    mask: &Tensor,
    eps_low: f64,
    eps_high: f64,
) -> Tensor {
    let s = masked_mean(&(logp - logp_old), mask).exp();
    let c = masked_mean(&coef.detach(), mask);
    clipped_surrogate(&s, advantages, eps_low, eps_high) * c
}

/// CISPO (MiniMax-M1, 2025): the clipped ratio as a stopped weight on the policy gradient, so
/// no token's gradient is ever dropped:
/// `l_t = −coef_t · sg(clip(r_t, 1 − ε_low, 1 + ε_high)) · A_t · logp_t`.
pub fn cispo(
    logp: &Tensor,
    logp_old: &Tensor,
    advantages: &Tensor,
    coef: &Tensor,
    eps_low: f64,
    eps_high: f64,
) -> Tensor {
    let weight = (logp - logp_old)
        .exp()
        .clamp(1.0 - eps_low, 1.0 + eps_high)
        .detach();
    -(weight * advantages * logp) * coef.detach()
}

/// A KL penalty per token, the k3 estimator (Schulman 2020) of KL(π_θ ‖ π_ref):
/// `k3_t = exp(logp_ref − logp) − (logp_ref − logp) − 1` (non-negative, unbiased).
pub fn kl_k3(logp: &Tensor, logp_ref: &Tensor) -> Tensor {
    let d = logp_ref - logp;
    d.exp() - &d - 1.0
}
