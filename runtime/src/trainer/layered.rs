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

use super::logprobs::{picked, Targets};
use super::shard::ShardGrad;
use super::step::{loss_of, scored, KlPenalty, LossConfig, LossMetrics, Sample};
use super::train::Trainer;
use crate::model::{Result, Stages};

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

/// A micro-batch's forward: its stages, which rows are targets, the last layer's hidden states,
/// and each layer's input and routing (when kept for the backward).
struct Forwarded<'m> {
    stages: Stages<'m>,
    targets: Targets,
    h: Tensor,
    saved: Vec<(Tensor, Option<Tensor>)>,
}

impl Trainer {
    fn layers(&self) -> usize {
        self.model.config().num_hidden_layers
    }

    /// The unit of the LM head's weight: its own when untied, else the embedding.
    fn head_unit(&self) -> usize {
        if self.shards().units() > LAYERS + self.layers() {
            LAYERS + self.layers()
        } else {
            EMBED
        }
    }

    /// The trainable tensors of unit `u` (whole only while it is gathered).
    fn unit_params(&self, u: usize) -> Vec<Tensor> {
        let params = &self.params[self.shards().tensors(u)];
        params.iter().map(Tensor::shallow_clone).collect()
    }

    /// Runs `f` with `units` gathered, then frees them.
    fn with_units<T>(&self, units: &[usize], f: impl FnOnce() -> Result<T>) -> Result<T> {
        for &u in units {
            let _ = self.shards().gather(u, &self.params, self.group.as_ref())?;
        }
        let out = f();
        for &u in units {
            self.shards().release(u, &self.params);
        }
        out
    }

    /// The layers without gradient, keeping each layer's input and routing for the backward;
    /// `None` on an idle pass.
    fn forward_layers(&self, samples: Option<&[Sample]>) -> Result<Option<Forwarded<'_>>> {
        let seqs = samples.map(scored);
        let stages = (seqs.as_deref())
            .map(|s| self.model.stages(s))
            .transpose()?;
        let _guard = tch::no_grad_guard();
        let mut h = self.with_units(&[EMBED], || Ok(stages.as_ref().map(Stages::embed)))?;
        let mut saved = Vec::new();
        for l in 0..self.layers() {
            let out = self.with_units(&[LAYERS + l], || match (&stages, &h) {
                (Some(s), Some(x)) => s.layer(l, x, None).map(Some),
                _ => Ok(None),
            })?;
            if let (Some(x), Some((y, routing))) = (h.take(), out) {
                saved.push((x, routing));
                h = Some(y);
            }
        }
        Ok(stages
            .zip(h)
            .zip(seqs)
            .map(|((stages, h), seqs)| Forwarded {
                targets: Targets::new(&seqs, h.device()),
                stages,
                h,
                saved,
            }))
    }

    /// One micro-batch's forward and backward (its loss with the KL penalty `kl`, when there is
    /// one); its gradient, weighed by `weight` (its share of the batch), goes into `acc`. `None`
    /// runs an idle pass. Returns the micro-batch's loss metrics.
    pub(super) fn train_sharded(
        &self,
        samples: Option<&[Sample]>,
        cfg: &LossConfig,
        kl: Option<&KlPenalty>,
        weight: f64,
        acc: &mut ShardGrad,
    ) -> Result<Option<LossMetrics>> {
        let forwarded = self.forward_layers(samples)?;
        let head_units = [NORM, self.head_unit()];
        let head_params: Vec<Tensor> = (head_units.iter())
            .flat_map(|&u| self.unit_params(u))
            .collect();
        // The head: the loss, then its backward in chunks.
        let head = self.with_units(&head_units, || {
            let (Some(f), Some(samples)) = (&forwarded, samples) else {
                return Ok(None);
            };
            let (logp, entropy) = f.head_rows(cfg.temperature);
            let logp = f.targets.padded(&logp).set_requires_grad(true);
            let entropy = f.targets.padded(&entropy);
            let (loss, metrics) = loss_of(&logp, &entropy, samples, cfg, kl);
            let dlogp = Tensor::run_backward(&[loss * weight], &[&logp], false, false).remove(0);
            let dpicked = dlogp.reshape([-1]).index_select(0, &f.targets.at);
            let grads = f.head_backward(&head_params, cfg.temperature, &dpicked);
            Ok(Some((metrics, grads)))
        })?;
        let (metrics, grads) = head.unzip();
        let mut grads = grads.unwrap_or_else(|| nones(head_params.len() + 1));
        // `None` on an idle pass. A micro-batch with no target rows (every sequence one token
        // long) has a zero gradient.
        let dh = grads.remove(0);
        let mut grad_h = (forwarded.as_ref()).map(|f| dh.unwrap_or_else(|| f.h.zeros_like()));
        for u in head_units {
            let g: Vec<Option<Tensor>> = grads.drain(..self.shards().tensors(u).len()).collect();
            self.shards().reduce_unit(u, &g, acc, self.group.as_ref())?;
        }
        // The layers, from the top, each recomputed from its input; then the embedding.
        let (stages, mut saved) =
            forwarded.map_or((None, Vec::new()), |f| (Some(f.stages), f.saved));
        let s = || stages.as_ref().expect("a forward ran");
        for l in (0..self.layers()).rev() {
            let (x, routing) = saved.pop().unzip();
            grad_h = self.backward_unit(LAYERS + l, x.as_ref(), grad_h.as_ref(), acc, |x| {
                let routing = routing.flatten();
                Ok(s().layer(l, x.expect("an input"), routing.as_ref())?.0)
            })?;
        }
        self.backward_unit(EMBED, None, grad_h.as_ref(), acc, |_| Ok(s().embed()))?;
        Ok(metrics)
    }

    /// Unit `u`'s backward, the unit gathered: `forward` recomputes its output from its input
    /// `x` (none for the embedding), whose vector-Jacobian product with `g` gives the gradients
    /// of `x` (returned; zeros where `x` does not reach the output) and of the unit's weights
    /// (reduce-scattered into `acc`). `None` for `g` runs an idle pass.
    fn backward_unit(
        &self,
        u: usize,
        x: Option<&Tensor>,
        g: Option<&Tensor>,
        acc: &mut ShardGrad,
        forward: impl FnOnce(Option<&Tensor>) -> Result<Tensor>,
    ) -> Result<Option<Tensor>> {
        let params = self.unit_params(u);
        let x = x.map(|x| x.detach().set_requires_grad(true));
        let grads = self.with_units(&[u], || {
            let Some(g) = g else {
                return Ok(None);
            };
            let root = (forward(x.as_ref())? * g).sum(g.kind());
            let inputs: Vec<&Tensor> = x.iter().chain(&params).collect();
            let grads = Tensor::run_backward(&[root], &inputs, false, false);
            Ok(Some(grads.into_iter().map(defined).collect()))
        })?;
        let mut grads = grads.unwrap_or_else(|| nones(x.iter().count() + params.len()));
        let dx = x.map(|_| grads.remove(0));
        self.shards()
            .reduce_unit(u, &grads, acc, self.group.as_ref())?;
        Ok(g.zip(dx)
            .map(|(g, dx)| dx.unwrap_or_else(|| g.zeros_like())))
    }
}

impl Forwarded<'_> {
    /// The rows of each chunk of the head: at most [`head_chunk_elements`] logits at once.
    fn chunks(&self) -> Vec<(i64, i64)> {
        let rows = self.targets.rows.size()[0];
        let step = (head_chunk_elements() / self.stages.vocab_size() as i64).max(1);
        (0..rows)
            .step_by(step as usize)
            .map(|start| (start, step.min(rows - start)))
            .collect()
    }

    /// The picked logprobs (and entropies) of target rows `start..start + len`, from `h`.
    fn chunk(
        &self,
        h: &Tensor,
        (start, len): (i64, i64),
        temperature: f64,
        with_entropy: bool,
    ) -> (Tensor, Option<Tensor>) {
        let hc = h.index_select(0, &self.targets.rows.narrow(0, start, len));
        let next = self.targets.next.narrow(0, start, len);
        picked(&self.stages.head(&hc), &next, temperature, with_entropy)
    }

    /// The picked logprob and the entropy of every target row, through the head in chunks,
    /// without gradient; the head's units must be gathered.
    fn head_rows(&self, temperature: f64) -> (Tensor, Tensor) {
        let _guard = tch::no_grad_guard();
        let (mut logp, mut entropy) = (Vec::new(), Vec::new());
        for chunk in self.chunks() {
            let (p, e) = self.chunk(&self.h, chunk, temperature, true);
            logp.push(p);
            entropy.extend(e);
        }
        let cat = |v: Vec<Tensor>| {
            if v.is_empty() {
                Tensor::zeros([0], (Kind::Float, self.h.device()))
            } else {
                Tensor::cat(&v, 0)
            }
        };
        (cat(logp), cat(entropy))
    }

    /// The head's backward, chunk by chunk (each chunk's logits freed before the next): the
    /// gradients of the last hidden states, then of the head's weights `params`, given
    /// `dpicked`, the loss's gradient with respect to each target row's picked logprob.
    fn head_backward(
        &self,
        params: &[Tensor],
        temperature: f64,
        dpicked: &Tensor,
    ) -> Vec<Option<Tensor>> {
        let h = self.h.detach().set_requires_grad(true);
        let inputs: Vec<&Tensor> = std::iter::once(&h).chain(params).collect();
        let mut sums: Vec<Option<Tensor>> = nones(inputs.len());
        for (start, len) in self.chunks() {
            let (p, _) = self.chunk(&h, (start, len), temperature, false);
            // Σ p·∂L/∂p over the chunk's rows: its gradient is the loss's.
            let root = (p * dpicked.narrow(0, start, len)).sum(Kind::Float);
            let grads = Tensor::run_backward(&[root], &inputs, false, false);
            for (sum, g) in sums.iter_mut().zip(grads.into_iter().map(defined)) {
                match (sum.as_mut(), g) {
                    // In place: the LM head's gradient is as large as the head.
                    (Some(s), Some(g)) => {
                        let _ = s.g_add_(&g);
                    }
                    (None, g) => *sum = g,
                    (Some(_), None) => {}
                }
            }
        }
        sums
    }
}

/// `Some` for a defined gradient (autograd leaves a tensor the root does not reach undefined).
fn defined(t: Tensor) -> Option<Tensor> {
    t.defined().then_some(t)
}

fn nones(n: usize) -> Vec<Option<Tensor>> {
    (0..n).map(|_| None).collect()
}
