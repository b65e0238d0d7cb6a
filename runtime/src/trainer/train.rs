//! One training step over a batch of trajectory segments: π_old once, then the loss in
//! micro-batches whose gradients accumulate, gradient clipping, one AdamW step at the scheduled
//! learning rate. The result is exactly the step on the whole batch at once: each micro-batch's
//! loss is weighed by its share of the batch (tokens for token-mean, sequences for
//! sequence-mean and GSPO).
//!
//! With several ranks (rank 0 leading the others, `ranks.rs`) each rank trains on its contiguous
//! part of the batch, with the same shares of the whole batch, and the optimizer state, the
//! gradients and (with `Sharding::Full`) the weights are sharded across the ranks (`shard.rs`;
//! the forward and backward of sharded weights in `layered.rs`): N ranks compute the step one
//! rank would (docs/distributed.md).

use std::time::Instant;

use serde::Serialize;
use tch::Tensor;

use super::layered::{Layered, Part};
use super::logprobs::token_logprobs;
use super::optim::{clip_grad_norm, AdamW, LrSchedule};
use super::shard::{ShardGrad, Shards};
pub use super::shard::{ShardLayout, Sharding, Whole};
use super::step::{
    old_logprobs, padded, policy_loss_with, scored, LossConfig, LossExtras, LossKind, TrainSample,
};
use crate::algorithms::losses::Aggregation;
use crate::dist::{Collectives, ReduceOp, Solo};
use crate::model::{CausalLm, ImageInput, NamedSlice};

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
}

/// One trajectory segment with its advantage, owned (what the run hands the trainer).
#[derive(Debug)]
pub struct Sample {
    pub tokens: Vec<i64>,
    pub loss_mask: Vec<u8>,
    pub behaviour_logprobs: Vec<f32>,
    /// The sequence's advantage.
    pub advantage: f64,
    /// Per-token advantages (on-policy distillation), `tokens.len()` long; replace `advantage`.
    pub token_advantages: Option<Vec<f32>>,
    /// MoE routing to replay, `[tokens.len(), sparse_layers, top_k]`.
    pub replay: Option<Tensor>,
    /// A vision-language model's images, preprocessed, at their placeholders in `tokens`.
    pub images: Vec<ImageInput>,
}

impl Sample {
    fn view(&self) -> TrainSample<'_> {
        TrainSample {
            tokens: &self.tokens,
            loss_mask: &self.loss_mask,
            behaviour_logprobs: &self.behaviour_logprobs,
            advantage: self.advantage,
            replay: self.replay.as_ref(),
            images: &self.images,
        }
    }

    fn sampled(&self) -> usize {
        self.loss_mask.iter().filter(|&&m| m == 1).count()
    }
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
    model: CausalLm,
    params: Vec<Tensor>,
    /// One rank's optimizer; unused when `shards` holds the sharded one.
    optimizer: AdamW,
    group: Box<dyn Collectives>,
    shards: Option<Shards>,
    /// Where each checkpoint name lies in `params` (the model forgets its names when its weights
    /// are sharded).
    names: Vec<NamedSlice>,
    /// The frozen initial policy, when a KL penalty needs it.
    reference: Option<CausalLm>,
    opts: TrainerOptions,
    steps: u64,
    threads: usize,
}

/// Rank `rank`'s contiguous part of a batch of `world` ranks: cut where the running token count
/// crosses each rank's equal share.
fn rank_part(samples: &[Sample], rank: usize, world: usize) -> &[Sample] {
    let total: usize = samples.iter().map(|s| s.tokens.len()).sum();
    let cut = |r: usize| {
        let target = total * r / world;
        let mut seen = 0;
        samples
            .iter()
            .position(|s| {
                let before = seen;
                seen += s.tokens.len();
                before >= target
            })
            .unwrap_or(samples.len())
    };
    let (start, end) = (
        cut(rank),
        if rank + 1 == world {
            samples.len()
        } else {
            cut(rank + 1)
        },
    );
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
        model: CausalLm,
        reference: Option<CausalLm>,
        opts: TrainerOptions,
        group: Box<dyn Collectives>,
    ) -> Result<Self, TrainerError> {
        if opts.kl_coef > 0.0 && reference.is_none() {
            return Err(TrainerError::NoReference);
        }
        if opts.micro_batch_tokens == 0 {
            return Err(TrainerError::NoMicroBatch);
        }
        let mut model = model;
        if model.vision_unit().is_some() {
            if opts.freeze_vision {
                model.freeze_vision();
            }
            if group.world() > 1 && opts.sharding == Sharding::Full {
                return Err(TrainerError::ShardedVisionTower);
            }
        } else if opts.freeze_vision {
            return Err(TrainerError::NoVisionTower);
        }
        let params: Vec<Tensor> = model
            .trainable()
            .into_iter()
            .map(|t| t.set_requires_grad(true))
            .collect();
        let names = model.named_slices();
        let adamw = || AdamW::new((0.9, 0.999), 1e-8, opts.weight_decay);
        let shards = (group.world() > 1).then(|| {
            Shards::new(
                &params,
                model.trainable_units(),
                opts.sharding,
                group.rank(),
                group.world(),
                adamw(),
            )
        });
        let full = shards.is_some() && opts.sharding == Sharding::Full;
        if opts.bf16_compute && !full {
            return Err(TrainerError::UnshardedBf16);
        }
        let mut shards = shards;
        if full {
            model.forget_names();
            if opts.bf16_compute {
                model.compute_in(tch::Kind::BFloat16);
                if let Some(s) = shards.as_mut() {
                    s.gather_in(tch::Kind::BFloat16);
                }
            }
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

    /// Bytes of AdamW moments this rank holds: all of them with one rank, its shard's with
    /// several.
    pub fn optimizer_state_bytes(&self) -> usize {
        match &self.shards {
            Some(shards) => shards.state_bytes(),
            None => self.optimizer.state_bytes(),
        }
    }

    /// Whether each rank keeps only its shards of the weights.
    pub fn weights_sharded(&self) -> bool {
        self.shards.as_ref().is_some_and(Shards::full)
    }

    /// The forward and backward of sharded weights.
    fn layered(&self) -> Layered<'_> {
        Layered {
            model: &self.model,
            shards: self.shards.as_ref().expect("several ranks"),
            params: &self.params,
            group: self.group.as_ref(),
        }
    }

    /// Bytes of weights this rank keeps between steps: the whole model's, or with sharded
    /// weights its shards'.
    pub fn weight_bytes(&self) -> usize {
        match &self.shards {
            Some(shards) if shards.full() => shards.weight_bytes(),
            _ => self
                .params
                .iter()
                .map(|p| p.numel() * p.kind().elt_size_in_bytes())
                .sum(),
        }
    }

    /// Sharded weights: keeps this rank's shards and frees the whole tensors (once every rank
    /// holds the same weights).
    pub(super) fn shard_weights(&mut self) {
        if let Some(shards) = self.shards.as_mut() {
            if self.opts.sharding == Sharding::Full {
                shards.shard_weights(&self.params);
            }
        }
    }

    /// The weights by checkpoint name, handed to `emit` in buckets: with sharded weights one
    /// unit (a layer) at a time as it is gathered, a collective called by every rank
    /// ([`Trainer::weight_buckets`] on rank 0 commands the others); else all at once.
    pub(super) fn gather_weights(
        &self,
        emit: &mut dyn FnMut(Vec<(String, Tensor)>),
    ) -> crate::dist::Result<()> {
        match &self.shards {
            Some(shards) if shards.full() => {
                shards.gather_units(&self.params, &self.names, self.group.as_ref(), emit)
            }
            _ => {
                emit(
                    self.model
                        .params()
                        .iter()
                        .map(|(n, t)| (n.clone(), t.detach()))
                        .collect(),
                );
                Ok(())
            }
        }
    }

    /// Sharded weights: the layout of this trainer's sharded checkpoint.
    pub(super) fn shard_layout(&self) -> ShardLayout {
        self.shards
            .as_ref()
            .expect("several ranks")
            .layout(&self.names)
    }

    /// Sharded weights: this rank's file of a sharded checkpoint.
    pub(super) fn shard_tensors(&self) -> Vec<(String, Tensor)> {
        self.shards.as_ref().expect("several ranks").shard_tensors()
    }

    pub(super) fn group(&self) -> &dyn Collectives {
        self.group.as_ref()
    }

    /// The tensors the optimizer updates, in [`CausalLm::trainable`] order.
    pub(super) fn trainable(&self) -> &[Tensor] {
        &self.params
    }

    /// The group's bound on one collective.
    pub(super) fn timeout(&self) -> std::time::Duration {
        self.group.timeout()
    }

    /// One rank's whole moments (empty before the first step, or when sharded).
    pub(super) fn local_moments(&self) -> Vec<(Tensor, Tensor)> {
        match &self.shards {
            Some(_) => Vec::new(),
            None => self
                .optimizer
                .moments()
                .iter()
                .map(|(m, v)| (m.shallow_clone(), v.shallow_clone()))
                .collect(),
        }
    }

    /// The moments, whole; with several ranks a collective every rank calls.
    pub(super) fn gather_moments(&self) -> crate::dist::Result<Vec<(Tensor, Tensor)>> {
        match &self.shards {
            Some(shards) => {
                shards.gathered_moments(shards.master_kind(&self.params), self.group.as_ref())
            }
            None => Ok(self.local_moments()),
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
        let cfg = self.opts.loss;
        let (rank, world) = (self.group.rank(), self.group.world());
        let parts = micro_batches(
            rank_part(samples, rank, world),
            self.opts.micro_batch_tokens,
        );
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
        // Sharded weights: every rank runs as many micro-batches as the one with the most (an
        // idle pass gathers and reduces with the others, computing nothing).
        let layered = self.weights_sharded();
        let passes = if layered {
            let n = Tensor::from_slice(&[parts.len() as f64]);
            self.group.all_reduce(&n, ReduceOp::Max)?;
            n.double_value(&[0]) as usize
        } else {
            parts.len()
        };
        let views: Vec<Vec<TrainSample<'_>>> = parts
            .iter()
            .map(|p| p.iter().map(Sample::view).collect())
            .collect();
        // π_old for every micro-batch before any weight moves.
        let mut olds = Vec::with_capacity(passes);
        for i in 0..passes {
            let part = views.get(i);
            olds.push(if layered {
                let seqs = part.map(|p| scored(p));
                self.layered().logprobs(seqs.as_deref(), cfg.temperature)?
            } else {
                let part = part.expect("a part");
                Some(old_logprobs(&self.model, part, cfg.temperature)?)
            });
        }
        let mut stats = StepStats {
            sequences: samples.len(),
            sampled_tokens: total_sampled,
            tokens: samples.iter().map(|s| s.tokens.len()).sum(),
            micro_batches: parts.len(),
            ..StepStats::default()
        };
        let mut acc: Option<ShardGrad> = self
            .shards
            .as_ref()
            .filter(|s| s.full())
            .map(|s| s.new_grad(s.master_kind(&self.params)));
        for (i, old) in olds.iter().enumerate() {
            let (Some(part), Some(old)) = (parts.get(i).copied(), old) else {
                self.layered()
                    .train(None, acc.as_mut().expect("sharded weights"))?;
                continue;
            };
            let views = &views[i];
            let width = old.size()[1];
            let token_advantages = part.iter().all(|s| s.token_advantages.is_some()).then(|| {
                let rows = part.iter().flat_map(|s| s.token_advantages.clone());
                let rows = padded(rows, width as usize, 0.0);
                Tensor::from_slice(&rows).view([part.len() as i64, width])
            });
            let reference = match (&self.reference, self.opts.kl_coef > 0.0) {
                (Some(reference), true) => Some(tch::no_grad(|| {
                    token_logprobs(reference, &scored(views), cfg.temperature)
                })?),
                _ => None,
            };
            let extras = LossExtras {
                token_advantages: token_advantages.as_ref(),
                kl: reference.as_ref().map(|r| (self.opts.kl_coef, r)),
            };
            let w = share(part);
            let m = match acc.as_mut() {
                Some(acc) => {
                    let part = Part {
                        samples: views,
                        old,
                        cfg: &cfg,
                        extras: &extras,
                        weight: w,
                    };
                    self.layered()
                        .train(Some(&part), acc)?
                        .expect("a part's pass has metrics")
                }
                None => {
                    let (loss, m) = policy_loss_with(&self.model, views, old, &cfg, &extras)?;
                    (loss * w).backward();
                    m
                }
            };
            // Token-weighted means of the per-token metrics.
            let t = m.tokens / total_sampled.max(1) as f64;
            stats.loss += m.loss * w;
            stats.mean_abs_log_rho += m.mean_abs_log_rho * t;
            stats.masked_fraction += m.masked_fraction * t;
            stats.entropy += m.entropy * t;
            stats.kl += m.kl * t;
        }
        let max_norm = self.opts.max_grad_norm.unwrap_or(f64::INFINITY);
        let mut shard_grad = None;
        match &self.shards {
            None => stats.grad_norm = clip_grad_norm(&self.params, max_norm),
            Some(shards) => {
                // Every rank's part of the metrics and the gradient, summed.
                let group = self.group.as_ref();
                let sums = Tensor::from_slice(&[
                    stats.loss,
                    stats.mean_abs_log_rho,
                    stats.masked_fraction,
                    stats.entropy,
                    stats.kl,
                    parts.len() as f64,
                ]);
                let metrics_sum = Instant::now();
                group.all_reduce(&sums, ReduceOp::Sum)?;
                let metrics_sum = metrics_sum.elapsed().as_secs_f64();
                let sums = Vec::<f64>::try_from(&sums).expect("a double vector");
                stats.loss = sums[0];
                stats.mean_abs_log_rho = sums[1];
                stats.masked_fraction = sums[2];
                stats.entropy = sums[3];
                stats.kl = sums[4];
                stats.micro_batches = sums[5] as usize;
                let mut g = match acc.take() {
                    Some(mut g) => {
                        shards.finish_grad(&mut g, group)?;
                        g
                    }
                    None => shards.reduce_grads(&self.params, group)?,
                };
                stats.grad_norm = shards.grad_norm(&g, group)?;
                if stats.grad_norm > max_norm && stats.grad_norm > 0.0 {
                    shards.scale(&mut g, max_norm / stats.grad_norm);
                }
                shard_grad = Some(g);
                // The micro-batches' gathers and reductions, and these.
                let (seconds, gathers) = shards.take_seconds();
                stats.collective_seconds = seconds + metrics_sum;
                stats.gather_seconds = gathers;
            }
        }
        stats.learning_rate = self.opts.schedule.at(self.steps + 1);
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
            let (seconds, gathers) = shards.take_seconds();
            stats.collective_seconds += seconds;
            stats.gather_seconds += gathers;
        } else {
            self.optimizer.step(&self.params, stats.learning_rate);
        }
        for p in &self.params {
            let mut g = p.grad();
            if g.defined() {
                let _ = g.zero_();
            }
        }
        self.steps += 1;
        stats.seconds = started.elapsed().as_secs_f64();
        Ok(stats)
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
