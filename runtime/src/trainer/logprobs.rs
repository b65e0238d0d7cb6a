//! Recomputing the log-probabilities of sampled tokens under the trainer's weights (π_θ while
//! training; detached, π_old), with gradient, in one packed forward (docs/architecture.md#the-three-invariants
//! invariant 3: the same model code as the engine, MoE routing replayed from the engine).

use tch::{Kind, Tensor};

use crate::model::{CausalLm, LogitsFor, SeqInput};

/// `logp[i, t]` = log π(tokens_i[t] | tokens_i[..t]) under `model` at `temperature` (the
/// engine's processed logprob without top-k/top-p), `[batch, max_len]` padded with 0; position 0
/// (no prefix) is 0. Differentiable with respect to the model's parameters. Each sequence runs
/// from position 0 (`slot: None`), with its MoE routing to replay and its images.
pub fn token_logprobs(
    model: &CausalLm,
    seqs: &[SeqInput<'_>],
    temperature: f64,
) -> crate::model::Result<Tensor> {
    Ok(token_logprobs_and_entropy(model, seqs, temperature, false)?.0)
}

/// [`token_logprobs`] and, `with_entropy`, without gradient, the entropy of each position's
/// next-token distribution `H[i, t] = −Σ_v π(v | tokens_i[..t]) log π(v | tokens_i[..t])`
/// (aligned like the logprobs: `H[i, t]` is the entropy of the distribution `tokens_i[t]` was
/// drawn from).
pub fn token_logprobs_and_entropy(
    model: &CausalLm,
    seqs: &[SeqInput<'_>],
    temperature: f64,
    with_entropy: bool,
) -> crate::model::Result<(Tensor, Option<Tensor>)> {
    let logits = model.forward(seqs, None, LogitsFor::All)?.logits;
    let targets = Targets::new(seqs, logits.device());
    let rows = logits.index_select(0, &targets.rows);
    let (picked, entropy) = picked(&rows, &targets.next, temperature, with_entropy);
    Ok((targets.padded(&picked), entropy.map(|h| targets.padded(&h))))
}

/// Which packed rows predict which tokens, and where each lands in the padded `[batch, width]`
/// output. Row r of sequence i (packed row `offset + r`) predicts its token r + 1, at
/// `[i, r + 1]`; one pass over the packed rows, not one per sequence.
pub(super) struct Targets {
    /// Packed rows that predict a token.
    pub rows: Tensor,
    /// The token each predicts.
    pub next: Tensor,
    /// Where each lands in the flattened output.
    pub at: Tensor,
    batch: i64,
    width: i64,
}

impl Targets {
    pub fn new(seqs: &[SeqInput<'_>], device: tch::Device) -> Self {
        let width = seqs.iter().map(|s| s.tokens.len()).max().unwrap_or(0) as i64;
        let (mut rows, mut next, mut at) = (Vec::new(), Vec::new(), Vec::new());
        let mut offset = 0i64;
        for (i, s) in seqs.iter().enumerate() {
            let n = s.tokens.len() as i64;
            for r in 0..n - 1 {
                rows.push(offset + r);
                next.push(s.tokens[r as usize + 1]);
                at.push(i as i64 * width + r + 1);
            }
            offset += n;
        }
        let index = |v: &[i64]| Tensor::from_slice(v).to_device(device);
        Self {
            rows: index(&rows),
            next: index(&next),
            at: index(&at),
            batch: seqs.len() as i64,
            width,
        }
    }

    /// One value per target row into `[batch, width]`, 0 elsewhere.
    pub fn padded(&self, values: &Tensor) -> Tensor {
        Tensor::zeros([self.batch * self.width], (Kind::Float, values.device()))
            .index_add(0, &self.at, values)
            .view([self.batch, self.width])
    }
}

/// The logprob of each row's `next` token under `logits` (`[rows, vocab]`) at `temperature`
/// and, without gradient, each row's entropy.
pub(super) fn picked(
    logits: &Tensor,
    next: &Tensor,
    temperature: f64,
    with_entropy: bool,
) -> (Tensor, Option<Tensor>) {
    let logp = (logits.to_kind(Kind::Float) / temperature).log_softmax(-1, Kind::Float);
    let picked = logp.gather(1, &next.unsqueeze(1), false).squeeze_dim(1);
    let entropy = with_entropy.then(|| {
        tch::no_grad(|| {
            -(logp.exp() * &logp).sum_dim_intlist([-1i64].as_slice(), false, Kind::Float)
        })
    });
    (picked, entropy)
}
