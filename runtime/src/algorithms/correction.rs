//! Off-policy (importance-sampling) correction between the behaviour policy μ that sampled and
//! π_old the trainer recomputes, Molt's level × mode scheme (docs/algorithms.md).
//!
//! With ρ_t = π_old(a_t)/μ(a_t) and a level's statistic u:
//! - level `token`: u_t = ρ_t; `seq`: u = Π_t ρ_t; `geo`: u = exp(mean_t log ρ_t);
//! - mode `mask`: coef_t = ρ_t if low ≤ u ≤ high else 0 (for seq/geo a sequence-level gate in
//!   front of the token weights); `clip`: coef_t = clamp(u, low, high); `trunc`:
//!   coef_t = min(u, high).
//!
//! `seq` and `geo` only with `mask` (the configuration refuses the others). Typical: geo + mask
//! [0.99, 1.01]; token + trunc C = 2; token + mask [0.5, 5] (IcePop).

use serde::{Deserialize, Serialize};
use tch::Tensor;

use super::{masked_mean, masked_sum};

/// The statistic and the mode: the manifest's own enums (`spec.algorithm.isCorrection`, whose CEL
/// rules refuse what docs/algorithms.md rules out before a `Correction` is made).
pub use moult_operator::api::{IsLevel as Level, IsMode as Mode};

/// An IS correction: level, mode and thresholds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Correction {
    pub level: Level,
    pub mode: Mode,
    /// Lower threshold (mask and clip).
    pub low: f64,
    pub high: f64,
}

impl Correction {
    /// The per-token coefficients `[batch, time]` (0 where `mask` is 0), from
    /// `log_rho` = log π_old(a_t) − log μ(a_t).
    pub fn coefficients(&self, log_rho: &Tensor, mask: &Tensor) -> Tensor {
        let rho = log_rho.exp();
        let inside = |x: &Tensor, low: f64, high: f64| {
            x.ge(low).logical_and(&x.le(high)).to_kind(rho.kind())
        };
        let coef = match (self.level, self.mode) {
            (Level::Token, Mode::Mask) => &rho * inside(&rho, self.low, self.high),
            (Level::Token, Mode::Clip) => rho.clamp(self.low, self.high),
            (Level::Token, Mode::Trunc) => rho.clamp_max(self.high),
            (Level::Seq | Level::Geo, _) => {
                // The sequence statistic u, in log space: Σ log ρ (seq) or mean log ρ (geo).
                let log_u = match self.level {
                    Level::Seq => masked_sum(log_rho, mask),
                    _ => masked_mean(log_rho, mask),
                };
                &rho * inside(&log_u, self.low.ln(), self.high.ln()).unsqueeze(-1)
            }
        };
        coef * mask
    }
}
