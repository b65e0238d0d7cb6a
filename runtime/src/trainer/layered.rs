//! The forward and backward of a trainer whose weights are sharded (`Sharding::Full`, ZeRO-3;
//! docs/distributed.md), one unit of weights at a time.
//!
//! A unit's weights are whole only while it runs: gathered from every rank just before, freed
//! right after. The forward runs without gradient and keeps each decoder layer's input. The
//! loss is taken from the sampled tokens' logprobs, computed by the LM head in chunks of rows,
//! so `[tokens × vocab]` logits never exist whole. The backward then goes from the top: the
//! head's chunks again, with gradient, then each layer gathered again and recomputed from its
//! saved input (replaying the routing its forward used), its vector-Jacobian product giving the
//! gradient of its input and of its weights; each unit's gradients are reduce-scattered as soon
//! as they exist and freed. libtorch runs each piece's backward (`run_backward`), so the
//! gradients are autograd's, as one rank's are.
//!
//! Every rank issues the same collectives in the same order: a rank with fewer micro-batches
//! than another runs idle passes (`None` parts) that gather and reduce without computing.

use tch::{Kind, Tensor};

use super::logprobs::{picked, seq_inputs, Scored, Targets};
use super::shard::{ShardGrad, Shards};
use super::step::{loss_of, scored, LossConfig, LossExtras, LossMetrics, TrainSample};
use crate::dist::Collectives;
use crate::model::{CausalLm, Result, Stages};

/// Logits computed at once by the head, rows × vocabulary: 32 Mi elements (128 MiB in float32)
/// unless `MOULT_HEAD_CHUNK_ELEMENTS` says otherwise (docs/distributed.md).
fn head_chunk_elements() -> i64 {
    static ELEMENTS: std::sync::OnceLock<i64> = std::sync::OnceLock::new();
    *ELEMENTS.get_or_init(|| {
        std::env::var("MOULT_HEAD_CHUNK_ELEMENTS")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|&n: &i64| n > 0)
            .unwrap_or(1 << 25)
    })
}

/// The first unit of [`CausalLm::trainable_units`] (the embedding), the second (the final
/// norm); decoder layer `l` is unit `LAYERS + l`.
const EMBED: usize = 0;
const NORM: usize = 1;
const LAYERS: usize = 2;

/// One micro-batch's part of a training step.
pub(super) struct Part<'a, 'b> {
    pub samples: &'a [TrainSample<'b>],
    /// π_old of the samples.
    pub old: &'a Tensor,
    pub cfg: &'a LossConfig,
    pub extras: &'a LossExtras<'a>,
    /// The micro-batch's share of the whole batch's loss.
    pub weight: f64,
}

/// The forward's output: the last layer's hidden states, each layer's input and routing.
struct Forwarded {
    h: Tensor,
    saved: Vec<(Tensor, Option<Tensor>)>,
}

pub(super) struct Layered<'a> {
    pub model: &'a CausalLm,
    pub shards: &'a Shards,
    pub params: &'a [Tensor],
    pub group: &'a dyn Collectives,
}

impl Layered<'_> {
    fn layers(&self) -> usize {
        self.model.config().num_hidden_layers
    }

    /// The unit of the LM head's weight: its own when untied, else the embedding.
    fn head_unit(&self) -> usize {
        if self.shards.units() > LAYERS + self.layers() {
            LAYERS + self.layers()
        } else {
            EMBED
        }
    }

    /// Runs `f` with `units` gathered, then frees them.
    fn with<T>(&self, units: &[usize], f: impl FnOnce() -> Result<T>) -> Result<T> {
        for &u in units {
            let _ = self.shards.gather(u, self.params, self.group)?;
        }
        let out = f();
        for &u in units {
            self.shards.release(u, self.params);
        }
        out
    }

    /// The layers without gradient; `None` on an idle pass. `save` keeps each layer's input and
    /// routing for the backward.
    fn forward(&self, stages: Option<&Stages<'_>>, save: bool) -> Result<Option<Forwarded>> {
        let _guard = tch::no_grad_guard();
        let mut h = self.with(&[EMBED], || Ok(stages.map(|s| s.embed())))?;
        let mut saved = Vec::new();
        for l in 0..self.layers() {
            let out = self.with(&[LAYERS + l], || match (stages, &h) {
                (Some(s), Some(x)) => s.layer(l, x, None).map(Some),
                _ => Ok(None),
            })?;
            if let (Some(x), Some((y, routing))) = (h.take(), out) {
                if save {
                    saved.push((x, routing));
                }
                h = Some(y);
            }
        }
        Ok(h.map(|h| Forwarded { h, saved }))
    }

    /// The rows of each chunk of the head: at most [`head_chunk_elements`] logits at once.
    fn chunks(stages: &Stages<'_>, targets: &Targets) -> Vec<(i64, i64)> {
        let rows = targets.rows.size()[0];
        let step = (head_chunk_elements() / stages.vocab_size() as i64).max(1);
        (0..rows)
            .step_by(step as usize)
            .map(|start| (start, step.min(rows - start)))
            .collect()
    }

    /// The picked logprobs (and entropies) of target rows `start..start + len`.
    fn chunk(
        stages: &Stages<'_>,
        h: &Tensor,
        targets: &Targets,
        (start, len): (i64, i64),
        temperature: f64,
        with_entropy: bool,
    ) -> (Tensor, Option<Tensor>) {
        let hc = h.index_select(0, &targets.rows.narrow(0, start, len));
        picked(
            &stages.head(&hc),
            &targets.next.narrow(0, start, len),
            temperature,
            with_entropy,
        )
    }

    /// The picked logprob and the entropy of every target row, through the head in chunks,
    /// without gradient; the head's units must be gathered.
    fn head_rows(
        stages: &Stages<'_>,
        h: &Tensor,
        targets: &Targets,
        temperature: f64,
    ) -> (Tensor, Tensor) {
        let _guard = tch::no_grad_guard();
        let (mut logp, mut entropy) = (Vec::new(), Vec::new());
        for (start, len) in Self::chunks(stages, targets) {
            let (p, e) = Self::chunk(stages, h, targets, (start, len), temperature, true);
            logp.push(p);
            entropy.extend(e);
        }
        let cat = |v: Vec<Tensor>| {
            if v.is_empty() {
                Tensor::zeros([0], (Kind::Float, h.device()))
            } else {
                Tensor::cat(&v, 0)
            }
        };
        (cat(logp), cat(entropy))
    }

    /// The head's backward, chunk by chunk (each chunk's logits freed before the next): the
    /// gradients of `inputs` (the last hidden states `h`, then the head's weights) given
    /// `dpicked`, the loss's gradient with respect to each target row's picked logprob.
    fn head_backward(
        stages: &Stages<'_>,
        h: &Tensor,
        inputs: &[&Tensor],
        targets: &Targets,
        temperature: f64,
        dpicked: &Tensor,
    ) -> Vec<Option<Tensor>> {
        let mut sums: Vec<Option<Tensor>> = nones(inputs.len());
        for (start, len) in Self::chunks(stages, targets) {
            let (p, _) = Self::chunk(stages, h, targets, (start, len), temperature, false);
            // Σ p·∂L/∂p over the chunk's rows: its gradient is the loss's.
            let root = (p * dpicked.narrow(0, start, len)).sum(Kind::Float);
            let grads = Tensor::run_backward(&[root], inputs, false, false);
            for (sum, g) in sums.iter_mut().zip(grads) {
                if g.defined() {
                    match sum {
                        // In place: the LM head's gradient is as large as the head.
                        Some(s) => {
                            let _ = s.g_add_(&g);
                        }
                        None => *sum = Some(g),
                    }
                }
            }
        }
        sums
    }

    /// π's logprobs of `seqs` without gradient (`[batch, width]`, as
    /// [`super::logprobs::token_logprobs`]); `None` runs an idle pass.
    pub fn logprobs(
        &self,
        seqs: Option<&[Scored<'_>]>,
        temperature: f64,
    ) -> Result<Option<Tensor>> {
        let model = self.model;
        let stages = seqs.map(|s| model.stages(&seq_inputs(s))).transpose()?;
        let forwarded = self.forward(stages.as_ref(), false)?;
        let units = [NORM, self.head_unit()];
        let _guard = tch::no_grad_guard();
        self.with(&units, || {
            Ok(match (&stages, forwarded, seqs) {
                (Some(s), Some(f), Some(seqs)) => {
                    let targets = Targets::new(seqs, f.h.device());
                    let (logp, _) = Self::head_rows(s, &f.h, &targets, temperature);
                    Some(targets.padded(&logp))
                }
                _ => None,
            })
        })
    }

    /// One micro-batch's forward and backward; its weighted gradient goes into `acc`. `None`
    /// runs an idle pass. Returns the micro-batch's loss metrics.
    pub fn train(
        &self,
        part: Option<&Part<'_, '_>>,
        acc: &mut ShardGrad,
    ) -> Result<Option<LossMetrics>> {
        let model = self.model;
        let scored: Option<Vec<Scored<'_>>> = part.map(|p| scored(p.samples));
        let stages = scored
            .as_deref()
            .map(|s| model.stages(&seq_inputs(s)))
            .transpose()?;
        let forwarded = self.forward(stages.as_ref(), true)?;
        let head_units = [NORM, self.head_unit()];
        let all_params = self.params;
        let unit_params = |shards: &Shards, u: usize| -> Vec<Tensor> {
            all_params[shards.tensors(u)]
                .iter()
                .map(Tensor::shallow_clone)
                .collect()
        };
        let head_params: Vec<Vec<Tensor>> = head_units
            .iter()
            .map(|&u| unit_params(self.shards, u))
            .collect();
        // The head: the loss, then its backward in chunks.
        let head = self.with(&head_units, || {
            let (Some(s), Some(f), Some(seqs), Some(part)) = (&stages, &forwarded, &scored, part)
            else {
                return Ok(None);
            };
            let targets = Targets::new(seqs, f.h.device());
            let (logp, entropy) = Self::head_rows(s, &f.h, &targets, part.cfg.temperature);
            let logp = targets.padded(&logp).set_requires_grad(true);
            let (loss, metrics) = loss_of(
                &logp,
                &targets.padded(&entropy),
                part.samples,
                part.old,
                part.cfg,
                part.extras,
            );
            let dlogp =
                Tensor::run_backward(&[loss * part.weight], &[&logp], false, false).remove(0);
            let dpicked = dlogp.reshape([-1]).index_select(0, &targets.at);
            let h = f.h.detach().set_requires_grad(true);
            let inputs: Vec<&Tensor> = std::iter::once(&h)
                .chain(head_params.iter().flatten())
                .collect();
            let grads =
                Self::head_backward(s, &h, &inputs, &targets, part.cfg.temperature, &dpicked);
            Ok(Some((metrics, grads)))
        })?;
        let (metrics, mut grads) = match head {
            Some((m, g)) => (Some(m), g),
            None => (None, Vec::new()),
        };
        // `None` on an idle pass. A micro-batch with no target rows (every sequence one token
        // long) has a zero gradient.
        let mut grad_h = (!grads.is_empty()).then(|| {
            grads
                .remove(0)
                .unwrap_or_else(|| forwarded.as_ref().expect("a forward ran").h.zeros_like())
        });
        for (&u, p) in head_units.iter().zip(&head_params) {
            let g: Vec<Option<Tensor>> = if grads.is_empty() {
                nones(p.len())
            } else {
                grads.drain(..p.len()).collect()
            };
            self.shards.reduce_unit(u, &g, acc, self.group)?;
        }
        // The layers, from the top, each recomputed from its input.
        let mut saved = forwarded.map(|f| f.saved).unwrap_or_default();
        for l in (0..self.layers()).rev() {
            let u = LAYERS + l;
            let params = unit_params(self.shards, u);
            let input = saved.pop();
            let grads = self.with(&[u], || {
                let (Some(s), Some((x, routing)), Some(g)) = (&stages, &input, &grad_h) else {
                    return Ok(None);
                };
                let x = x.detach().set_requires_grad(true);
                let (y, _) = s.layer(l, &x, routing.as_ref())?;
                let root = (y * g).sum(g.kind());
                let inputs: Vec<&Tensor> = std::iter::once(&x).chain(&params).collect();
                Ok(Some(Tensor::run_backward(&[root], &inputs, false, false)))
            })?;
            let mut grads: Vec<Option<Tensor>> = match grads {
                Some(g) => g.into_iter().map(defined).collect(),
                None => nones(params.len() + 1),
            };
            let dx = grads.remove(0);
            if grad_h.is_some() {
                grad_h = Some(dx.unwrap_or_else(|| grad_h.as_ref().expect("set").zeros_like()));
            }
            self.shards.reduce_unit(u, &grads, acc, self.group)?;
        }
        // The embedding.
        let params = unit_params(self.shards, EMBED);
        let grads = self.with(&[EMBED], || {
            let (Some(s), Some(g)) = (&stages, &grad_h) else {
                return Ok(None);
            };
            let root = (s.embed() * g).sum(g.kind());
            let inputs: Vec<&Tensor> = params.iter().collect();
            Ok(Some(Tensor::run_backward(&[root], &inputs, false, false)))
        })?;
        let grads: Vec<Option<Tensor>> = match grads {
            Some(g) => g.into_iter().map(defined).collect(),
            None => nones(params.len()),
        };
        self.shards.reduce_unit(EMBED, &grads, acc, self.group)?;
        Ok(metrics)
    }
}

/// `Some` for a defined gradient (autograd leaves a tensor the root does not reach undefined).
fn defined(t: Tensor) -> Option<Tensor> {
    t.defined().then_some(t)
}

fn nones(n: usize) -> Vec<Option<Tensor>> {
    (0..n).map(|_| None).collect()
}
