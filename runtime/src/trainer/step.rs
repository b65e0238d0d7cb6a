//! The policy loss of one batch (docs/algorithms.md), composed from the pure functions of
//! [`crate::algorithms`]: recompute log-probabilities, weigh each token by the IS correction
//! between the behaviour policy and π_old, apply the chosen loss, aggregate.

use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};

use super::logprobs::token_logprobs_and_entropy;
use crate::algorithms::correction::Correction;
use crate::algorithms::losses::{aggregate, cispo, gspo, kl_k3, ppo_clip, Aggregation};
use crate::algorithms::masked_mean;
use crate::model::{CausalLm, ImageInput, SeqInput};

/// One trajectory segment with its advantage, owned (what the run hands the trainer).
#[derive(Debug)]
pub struct Sample {
    pub tokens: Vec<i64>,
    /// 1 where the engine sampled the token.
    pub loss_mask: Vec<u8>,
    /// The engine's logprob of each token (0 where the mask is 0).
    pub behaviour_logprobs: Vec<f32>,
    /// The sequence's advantage (GRPO, RLOO, ...), broadcast to its sampled tokens.
    pub advantage: f64,
    /// Per-token advantages (on-policy distillation), `tokens.len()` long; replace `advantage`.
    pub token_advantages: Option<Vec<f32>>,
    /// MoE routing to replay, `[tokens.len(), sparse_layers, top_k]`.
    pub replay: Option<Tensor>,
    /// A vision-language model's images, preprocessed, at their placeholders in `tokens`.
    pub images: Vec<ImageInput>,
}

impl Sample {
    /// Tokens the engine sampled (trained on).
    pub fn sampled(&self) -> usize {
        self.loss_mask.iter().filter(|&&m| m == 1).count()
    }
}

/// The policy loss (`algorithm.loss.kind`): the manifest's own enum.
pub use moult_operator::api::LossKind;

/// How the loss is computed.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LossConfig {
    pub kind: LossKind,
    pub eps_low: f64,
    pub eps_high: f64,
    pub aggregation: Aggregation,
    /// IS correction between behaviour and π_old; `None` trusts the behaviour policy.
    pub correction: Option<Correction>,
    /// The sampling temperature the engine used (logprobs are taken at it).
    pub temperature: f64,
}

/// What one loss computation reports (the step's metrics).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct LossMetrics {
    pub loss: f64,
    /// Mean |log ρ| over sampled tokens: how far the engine is from the trainer.
    pub mean_abs_log_rho: f64,
    /// Fraction of sampled tokens whose IS coefficient is 0.
    pub masked_fraction: f64,
    /// Mean entropy of the policy's next-token distribution over sampled tokens.
    pub entropy: f64,
    /// Mean k3 KL to the reference policy over sampled tokens (0 without a KL penalty).
    pub kl: f64,
    pub tokens: f64,
}

/// A KL penalty `coef · k3(π_θ, π_ref)` (aggregated like the loss): `coef` and the reference
/// policy's logprobs, `[batch, width]` with `width` the longest sample's length (as
/// [`super::logprobs::token_logprobs`] pads).
pub type KlPenalty = (f64, Tensor);

/// The sequences of `samples` to score, each from position 0 with its routing and images.
pub(crate) fn scored(samples: &[Sample]) -> Vec<SeqInput<'_>> {
    (samples.iter())
        .map(|s| SeqInput {
            tokens: &s.tokens,
            slot: None,
            replay: s.replay.as_ref(),
            images: &s.images,
        })
        .collect()
}

/// The loss (with gradient) of `samples`, with a KL penalty when given, and metrics. π_old is
/// the policy before this batch's one optimizer step: the forward's own logprobs, detached.
pub fn policy_loss(
    model: &CausalLm,
    samples: &[Sample],
    cfg: &LossConfig,
    kl: Option<&KlPenalty>,
) -> crate::model::Result<(Tensor, LossMetrics)> {
    let seqs = scored(samples);
    let (logp, entropy) = token_logprobs_and_entropy(model, &seqs, cfg.temperature, true)?;
    let entropy = entropy.expect("asked for");
    Ok(loss_of(&logp, &entropy, samples, cfg, kl))
}

/// The loss of `samples` from their logprobs under the policy `logp` (with gradient; detached,
/// they are π_old's) and the entropies of their positions, as [`policy_loss`] computes it after
/// the forward.
pub(super) fn loss_of(
    logp: &Tensor,
    entropy: &Tensor,
    samples: &[Sample],
    cfg: &LossConfig,
    kl: Option<&KlPenalty>,
) -> (Tensor, LossMetrics) {
    let (b, width) = (samples.len() as i64, logp.size()[1]);
    let (device, logp_old) = (logp.device(), &logp.detach());
    // One row per sample, padded with 0 to `width`.
    let rows = |row: &dyn Fn(&Sample) -> Vec<f32>| {
        let rows: Vec<f32> = (samples.iter())
            .flat_map(|s| {
                let mut r = row(s);
                r.resize(width as usize, 0.0);
                r
            })
            .collect();
        Tensor::from_slice(&rows).view([b, width]).to_device(device)
    };
    let mask = rows(&|s| s.loss_mask.iter().map(|&m| f32::from(m)).collect());
    let behaviour = rows(&|s| s.behaviour_logprobs.clone());
    // Per-token advantages (on-policy distillation) replace the sequences' when every sample
    // has them; GSPO takes their masked mean per sequence.
    let (adv_seq, adv_tok) = if samples.iter().all(|s| s.token_advantages.is_some()) {
        let adv_tok = rows(&|s| s.token_advantages.clone().unwrap_or_default()) * &mask;
        (masked_mean(&adv_tok, &mask), adv_tok)
    } else {
        let adv_seq: Vec<f32> = samples.iter().map(|s| s.advantage as f32).collect();
        let adv_seq = Tensor::from_slice(&adv_seq).to_device(device);
        let adv_tok = adv_seq.unsqueeze(1) * &mask;
        (adv_seq, adv_tok)
    };
    let log_rho = (logp_old - &behaviour) * &mask;
    let coef = match &cfg.correction {
        Some(c) => c.coefficients(&log_rho, &mask),
        None => mask.shallow_clone(),
    };
    let (eps_low, eps_high) = (cfg.eps_low, cfg.eps_high);
    let per_token_or_seq = match cfg.kind {
        LossKind::Gspo => {
            gspo(logp, logp_old, &adv_seq, &coef, &mask, eps_low, eps_high).mean(Kind::Float)
        }
        kind => {
            let loss = if kind == LossKind::Cispo {
                cispo
            } else {
                ppo_clip
            };
            let l = loss(logp, logp_old, &adv_tok, &coef, eps_low, eps_high);
            aggregate(&l, &mask, cfg.aggregation)
        }
    };
    let (per_token_or_seq, kl) = match kl {
        Some((coef, logp_ref)) => {
            let k3 = kl_k3(logp, &logp_ref.to_device(device)) * &mask;
            let kl = aggregate(&k3, &mask, cfg.aggregation);
            let mean_kl = aggregate(&k3, &mask, Aggregation::TokenMean).double_value(&[]);
            (per_token_or_seq + kl * *coef, mean_kl)
        }
        None => (per_token_or_seq, 0.0),
    };
    let tokens = mask.sum(Kind::Float).double_value(&[]);
    let token_mean = |x: &Tensor| (x * &mask).sum(Kind::Float).double_value(&[]) / tokens.max(1.0);
    let metrics = LossMetrics {
        loss: per_token_or_seq.double_value(&[]),
        mean_abs_log_rho: token_mean(&log_rho.abs()),
        masked_fraction: token_mean(&coef.eq(0.0).to_kind(Kind::Float)),
        entropy: token_mean(entropy),
        kl,
        tokens,
    };
    (per_token_or_seq, metrics)
}
