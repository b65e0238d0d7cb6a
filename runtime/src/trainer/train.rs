//! One training step over a batch of trajectory segments: the loss in micro-batches whose
//! gradients accumulate, gradient clipping, one AdamW step at the scheduled learning rate. The
//! weights move once per batch, so π_old is each micro-batch's own forward, detached. The result
//! is exactly the step on the whole batch at once: each micro-batch's loss is weighed by its
//! share of the batch (tokens for token-mean, sequences for sequence-mean and GSPO).
//!
//! With several ranks (rank 0 leading the others, `ranks.rs`) each rank trains on its contiguous
//! part of the batch, with the same shares of the whole batch, and the optimizer state, the
//! gradients and (with `Sharding::Full`) the weights are sharded across the ranks (`shard.rs`;
//! the forward and backward of sharded weights in `layered.rs`): N ranks compute the step one
//! rank would (docs/distributed.md).

use std::time::Instant;

use serde::Serialize;
use tch::Tensor;

use super::bytes_of;
use super::logprobs::token_logprobs;
use super::optim::{clip_grad_norm, AdamW, LrSchedule};
use super::shard::{ShardGrad, Shards};
pub use super::shard::{ShardLayout, Sharding, Whole};
pub use super::step::Sample;
use super::step::{policy_loss, scored, LossConfig, LossKind, LossMetrics};
use crate::algorithms::losses::Aggregation;
use crate::dist::{Collectives, ReduceOp, Solo};
use crate::model::{lora::LoraConfig, CausalLm, NamedSlice};

/// A trainer that cannot be built as asked, or a checkpoint that does not fit it.
#[derive(Debug, thiserror::Error)]
pub enum TrainerError {
    #[error("a KL penalty needs the reference model")]
    NoReference,
    #[error("micro_batch_tokens must be at least 1")]
    NoMicroBatch,
    #[error("spec.trainer.sharding: Full does not shard a vision-language policy's vision tower yet: train it with sharding: Optimizer, or on one rank (docs/vision.md)")]
    ShardedVisionTower,
    #[error("spec.trainer.freezeVisionTower: the policy has no vision tower (it is not a vision-language model)")]
    NoVisionTower,
    #[error("bfloat16 compute needs sharded weights: spec.trainer.nodes of 2 or more, with sharding: Full (docs/distributed.md)")]
    UnshardedBf16,
    /// A checkpoint's optimizer moments: for how many tensors, and how many the model has.
    #[error("the checkpoint has optimizer moments for {0} tensors, the model {1}")]
    Moments(usize, usize),
    #[error(transparent)]
    Model(#[from] crate::model::Error),
}

/// How the trainer trains.
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct TrainerOptions {
    pub loss: LossConfig,
    pub schedule: LrSchedule,
    pub weight_decay: f64,
    /// Gradients are clipped to this global norm.
    pub max_grad_norm: Option<f64>,
    /// Tokens (sampled or not) per forward/backward; gradients accumulate over the batch. Bounds
    /// activation memory independently of the batch size.
    pub micro_batch_tokens: usize,
    /// Weight of the k3 KL penalty to the reference (initial) policy; 0 for none.
    pub kl_coef: f64,
    /// What several ranks shard (ignored with one).
    #[serde(default)]
    pub sharding: Sharding,
    /// Compute in bfloat16 (weights gathered as bfloat16), keeping float32 shards, gradient
    /// reduction and AdamW: sharded weights only.
    #[serde(default)]
    pub bf16_compute: bool,
    /// A vision-language policy's vision tower stays as it is (no gradient, no update).
    #[serde(default)]
    pub freeze_vision: bool,
    /// Train this LoRA adapter of the model, the base frozen (docs/lora.md): a new one unless
    /// the model comes with one (a checkpoint). Several ranks then shard only the optimizer
    /// state (`Sharding::Optimizer`), whatever `sharding` says: the adapter is small, the frozen
    /// base is what a rank could not shard anyway.
    pub lora: Option<LoraConfig>,
}

/// What one step did (the step's metrics).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct StepStats {
    pub loss: f64,
    pub mean_abs_log_rho: f64,
    pub masked_fraction: f64,
    pub entropy: f64,
    pub kl: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    pub learning_rate: f64,
    pub sequences: usize,
    /// Sampled (trained-on) tokens.
    pub sampled_tokens: usize,
    /// Every token forwarded.
    pub tokens: usize,
    pub micro_batches: usize,
    pub seconds: f64,
    /// Of `seconds`, the time in collectives between ranks (0 with one rank).
    pub collective_seconds: f64,
    /// Of `collective_seconds`, the all-gathers of weights (the rest reduces gradients and
    /// metrics).
    pub gather_seconds: f64,
    /// The loss or the gradient norm was not finite (NaN or infinite): the weights were left as
    /// they were instead of becoming NaN.
    pub skipped: bool,
}

/// The trainable policy with its optimizer.
#[derive(Debug)]
pub struct Trainer {
    pub(super) model: CausalLm,
    /// The tensors the optimizer updates, in [`CausalLm::trainable`] order.
    pub(super) params: Vec<Tensor>,
    /// One rank's optimizer; unused when `shards` holds the sharded one.
    pub(super) optimizer: AdamW,
    pub(super) group: Box<dyn Collectives>,
    pub(super) shards: Option<Shards>,
    /// Where each checkpoint name lies in `params` (the model forgets its names when its weights
    /// are sharded).
    pub(super) names: Vec<NamedSlice>,
    /// The frozen initial policy, when a KL penalty needs it.
    reference: Option<CausalLm>,
    opts: TrainerOptions,
    steps: u64,
    threads: usize,
}

/// Rank `rank`'s contiguous part of a batch of `world` ranks: cut where the running token count
/// crosses each rank's equal share.
fn rank_part(samples: &[Sample], rank: usize, world: usize) -> &[Sample] {
    let starts: Vec<usize> = (samples.iter())
        .scan(0, |seen, s| {
            *seen += s.tokens.len();
            Some(*seen - s.tokens.len())
        })
        .collect();
    let total: usize = samples.iter().map(|s| s.tokens.len()).sum();
    let cut = |r: usize| {
        if r == world {
            samples.len()
        } else {
            starts.partition_point(|&before| before < total * r / world)
        }
    };
    let (start, end) = (cut(rank), cut(rank + 1));
    &samples[start..end.max(start)]
}

/// Splits `samples` into consecutive runs of at most `budget` tokens (a longer sample alone).
fn micro_batches(samples: &[Sample], budget: usize) -> Vec<&[Sample]> {
    let mut out = Vec::new();
    let (mut start, mut tokens) = (0, 0);
    for (i, s) in samples.iter().enumerate() {
        if i > start && tokens + s.tokens.len() > budget {
            out.push(&samples[start..i]);
            (start, tokens) = (i, 0);
        }
        tokens += s.tokens.len();
    }
    if start < samples.len() {
        out.push(&samples[start..]);
    }
    out
}

impl Trainer {
    /// Trains `model` (its weights get gradients) from optimizer step `steps` on; `reference`
    /// is needed when `opts.kl_coef` > 0.
    pub fn new(
        model: CausalLm,
        reference: Option<CausalLm>,
        opts: TrainerOptions,
    ) -> Result<Self, TrainerError> {
        Self::with_group(model, reference, opts, Box::new(Solo))
    }

    /// One rank of a trainer of `group.world()` ranks, not yet in sync with the others: made by
    /// the leader and the followers of `ranks.rs`.
    pub(super) fn with_group(
        mut model: CausalLm,
        reference: Option<CausalLm>,
        mut opts: TrainerOptions,
        group: Box<dyn Collectives>,
    ) -> Result<Self, TrainerError> {
        if let (Some(lora), None) = (&opts.lora, model.lora()) {
            model.attach_lora(lora, None, 0)?;
        }
        // LoRA: the adapter replicated, its optimizer state sharded (docs/lora.md).
        if opts.lora.is_some() {
            opts.sharding = Sharding::Optimizer;
        }
        if opts.kl_coef > 0.0 && reference.is_none() {
            return Err(TrainerError::NoReference);
        }
        if opts.micro_batch_tokens == 0 {
            return Err(TrainerError::NoMicroBatch);
        }
        let full = group.world() > 1 && opts.sharding == Sharding::Full;
        match (model.vision_unit().is_some(), opts.freeze_vision) {
            (true, _) if full => return Err(TrainerError::ShardedVisionTower),
            (true, true) => model.freeze_vision(),
            (false, true) => return Err(TrainerError::NoVisionTower),
            _ => {}
        }
        if opts.bf16_compute && !full {
            return Err(TrainerError::UnshardedBf16);
        }
        let params: Vec<Tensor> = (model.trainable().into_iter())
            .map(|t| t.set_requires_grad(true))
            .collect();
        let names = model.named_slices();
        let adamw = || AdamW::new((0.9, 0.999), 1e-8, opts.weight_decay);
        let compute = opts.bf16_compute.then_some(tch::Kind::BFloat16);
        let shards = (group.world() > 1).then(|| {
            let units = model.trainable_units();
            let (rank, world) = (group.rank(), group.world());
            Shards::new(&params, units, opts.sharding, rank, world, adamw(), compute)
        });
        if full {
            model.forget_names();
        }
        if let Some(kind) = compute {
            model.compute_in(kind);
        }
        Ok(Self {
            names,
            threads: crate::model::compute_threads(model.config()),
            model,
            params,
            optimizer: adamw(),
            group,
            shards,
            reference,
            opts,
            steps: 0,
        })
    }

    /// The policy. With sharded weights its tensors are empty between steps (each rank keeps
    /// only its shards): [`Trainer::weights`] gathers them.
    pub fn model(&self) -> &CausalLm {
        &self.model
    }

    /// Optimizer steps taken (the policy version this trainer holds).
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// The ranks training together (1 for one).
    pub fn world_size(&self) -> usize {
        self.group.world()
    }

    /// Bytes of weights and AdamW moments this rank keeps between steps: all of them with one
    /// rank; with several its shard of the moments and the whole weights, or with sharded
    /// weights its shards of both.
    pub fn state_bytes(&self) -> usize {
        let whole: usize = self.params.iter().map(bytes_of).sum();
        match &self.shards {
            Some(shards) if shards.full() => shards.state_bytes(),
            Some(shards) => shards.state_bytes() + whole,
            None => self.optimizer.state_bytes() + whole,
        }
    }

    /// The state sharded across several ranks (there are several).
    pub(super) fn shards(&self) -> &Shards {
        self.shards.as_ref().expect("several ranks")
    }

    /// Whether each rank keeps only its shards of the weights.
    pub fn weights_sharded(&self) -> bool {
        self.shards.as_ref().is_some_and(Shards::full)
    }

    /// Sharded weights: keeps this rank's shards and frees the whole tensors (once every rank
    /// holds the same weights).
    pub(super) fn shard_weights(&mut self) {
        if let (Some(shards), Sharding::Full) = (self.shards.as_mut(), self.opts.sharding) {
            shards.shard_weights(&self.params);
        }
    }

    /// Continues from a checkpoint taken after `steps` steps.
    pub fn restore(
        &mut self,
        steps: u64,
        moments: Vec<(Tensor, Tensor)>,
    ) -> Result<(), TrainerError> {
        if !moments.is_empty() && moments.len() != self.params.len() {
            return Err(TrainerError::Moments(moments.len(), self.params.len()));
        }
        match &mut self.shards {
            Some(shards) => shards.restore(steps as i64, &moments),
            None => self.optimizer.restore(steps as i64, moments),
        }
        self.steps = steps;
        Ok(())
    }

    /// One optimizer step on `samples` (every rank's part of it, each rank on its own). Callers
    /// use [`Trainer::step`], which first hands the batch to the other ranks.
    pub(super) fn step_on(&mut self, samples: &[Sample]) -> crate::model::Result<StepStats> {
        let started = Instant::now();
        // Steps run on whichever compute thread is free: set its pool each time.
        tch::set_num_threads(self.threads as i32);
        let (cfg, group) = (self.opts.loss, self.group.as_ref());
        let mine = rank_part(samples, group.rank(), group.world());
        let parts = micro_batches(mine, self.opts.micro_batch_tokens);
        let total_sampled: usize = samples.iter().map(Sample::sampled).sum();
        let share = |part: &[Sample]| match (cfg.kind, cfg.aggregation) {
            (LossKind::Gspo, _)
            | (_, Aggregation::SeqMean | Aggregation::SeqMeanTokenSumNorm { .. }) => {
                part.len() as f64 / samples.len().max(1) as f64
            }
            (_, Aggregation::TokenMean) => {
                part.iter().map(Sample::sampled).sum::<usize>() as f64 / total_sampled.max(1) as f64
            }
        };
        let mut acc: Option<ShardGrad> = (self.shards.as_ref())
            .filter(|s| s.full())
            .map(Shards::new_grad);
        // Sharded weights: every rank runs as many micro-batches as the one with the most (an
        // idle pass gathers and reduces with the others, computing nothing).
        let passes = if acc.is_some() {
            let n = Tensor::from_slice(&[parts.len() as f64]);
            group.all_reduce(&n, ReduceOp::Max)?;
            n.double_value(&[0]) as usize
        } else {
            parts.len()
        };
        // Summed over the micro-batches: the loss weighed by each one's share, the per-token
        // metrics by its sampled tokens; and the micro-batches.
        let mut sums = [0.0, 0.0, 0.0, 0.0, 0.0, parts.len() as f64];
        for i in 0..passes {
            let part = parts.get(i).copied();
            let w = part.map_or(0.0, share);
            if let Some(m) = self.pass(part, w, acc.as_mut())? {
                let t = m.tokens / total_sampled.max(1) as f64;
                let terms = [m.loss * w, m.mean_abs_log_rho * t, m.masked_fraction * t];
                let terms = terms.into_iter().chain([m.entropy * t, m.kl * t]);
                sums.iter_mut().zip(terms).for_each(|(sum, x)| *sum += x);
            }
        }
        let max_norm = self.opts.max_grad_norm.unwrap_or(f64::INFINITY);
        let (grad_norm, shard_grad) = match &self.shards {
            None => (clip_grad_norm(&self.params, max_norm), None),
            Some(shards) => {
                // Every rank's part of the metrics and the gradient, summed.
                let summed = Tensor::from_slice(&sums);
                shards.timed(|| group.all_reduce(&summed, ReduceOp::Sum))?;
                sums.copy_from_slice(&Vec::<f64>::try_from(&summed).expect("a double vector"));
                let mut g = acc.map_or_else(|| shards.reduce_grads(&self.params, group), Ok)?;
                shards.finish_grad(&mut g, group)?;
                (shards.clip(&mut g, max_norm, group)?, Some(g))
            }
        };
        let [loss, mean_abs_log_rho, masked_fraction, entropy, kl, micro_batches] = sums;
        let mut stats = StepStats {
            loss,
            mean_abs_log_rho,
            masked_fraction,
            entropy,
            kl,
            grad_norm,
            learning_rate: self.opts.schedule.at(self.steps + 1),
            sequences: samples.len(),
            sampled_tokens: total_sampled,
            tokens: samples.iter().map(|s| s.tokens.len()).sum(),
            micro_batches: micro_batches as usize,
            ..StepStats::default()
        };
        // One non-finite value (an overflow, a NaN that got into the batch) would make every
        // weight NaN through AdamW, and the engines would serve them: skip the update instead
        // (docs/security.md, "Bad data").
        stats.skipped = !(stats.loss.is_finite() && stats.grad_norm.is_finite());
        if stats.skipped {
            tracing::warn!(
                loss = stats.loss,
                grad_norm = stats.grad_norm,
                "a non-finite loss or gradient: the step leaves the weights as they were"
            );
        } else if let (Some(shards), Some(g)) = (&mut self.shards, &shard_grad) {
            shards.step(&self.params, g, stats.learning_rate, self.group.as_ref())?;
        } else {
            self.optimizer.step(&self.params, stats.learning_rate);
        }
        if let Some(shards) = &self.shards {
            // The micro-batches' gathers and reductions, the step's, and the optimizer's.
            (stats.collective_seconds, stats.gather_seconds) = shards.take_seconds();
        }
        for mut g in self.params.iter().map(Tensor::grad).filter(Tensor::defined) {
            let _ = g.zero_();
        }
        self.steps += 1;
        stats.seconds = started.elapsed().as_secs_f64();
        Ok(stats)
    }

    /// One micro-batch's forward and backward, its gradient weighed by `weight` into the
    /// weights' gradients or, with sharded weights, into `acc`. `None` runs a sharded rank's
    /// idle pass.
    fn pass(
        &self,
        samples: Option<&[Sample]>,
        weight: f64,
        acc: Option<&mut ShardGrad>,
    ) -> crate::model::Result<Option<LossMetrics>> {
        let (cfg, coef) = (&self.opts.loss, self.opts.kl_coef);
        // A KL penalty's weight and the reference policy's logprobs of the samples.
        let kl = match (&self.reference, samples) {
            (Some(reference), Some(s)) if coef > 0.0 => {
                let logp = tch::no_grad(|| token_logprobs(reference, &scored(s), cfg.temperature));
                Some((coef, logp?))
            }
            _ => None,
        };
        match (acc, samples) {
            (Some(acc), samples) => self.train_sharded(samples, cfg, kl.as_ref(), weight, acc),
            (None, Some(samples)) => {
                let (loss, m) = policy_loss(&self.model, samples, cfg, kl.as_ref())?;
                (loss * weight).backward();
                Ok(Some(m))
            }
            (None, None) => Ok(None),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(len: usize) -> Sample {
        Sample {
            tokens: vec![1; len],
            loss_mask: vec![1; len],
            behaviour_logprobs: vec![0.0; len],
            advantage: 0.0,
            token_advantages: None,
            replay: None,
            images: Vec::new(),
        }
    }

    #[test]
    fn micro_batches_respect_the_token_budget_and_keep_order() {
        let samples: Vec<Sample> = [3, 4, 2, 9, 1, 1].iter().map(|&n| sample(n)).collect();
        let lens: Vec<Vec<usize>> = micro_batches(&samples, 7)
            .iter()
            .map(|p| p.iter().map(|s| s.tokens.len()).collect())
            .collect();
        // 9 exceeds the budget alone: it gets a micro-batch of its own.
        assert_eq!(lens, vec![vec![3, 4], vec![2], vec![9], vec![1, 1]]);
        assert_eq!(micro_batches(&samples, 100).len(), 1);
        assert!(micro_batches(&[], 10).is_empty());
    }
}
