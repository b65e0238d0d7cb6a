//! Recomputing the log-probabilities of sampled tokens under the trainer's weights (π_old at the
//! start of a batch, π_θ while training), with gradient, in one packed forward (DESIGN §3
//! invariant 3: the same model code as the engine, MoE routing replayed from the engine).

use tch::{Kind, Tensor};

use crate::model::{LogitsFor, Qwen3Model, SeqInput};

/// One sequence to score: its tokens and, for MoE models, the routing to replay
/// (`[tokens.len(), sparse_layers, top_k]` expert ids).
#[derive(Debug)]
pub struct Scored<'a> {
    pub tokens: &'a [i64],
    pub replay: Option<&'a Tensor>,
}

/// `logp[i, t]` = log π(tokens_i[t] | tokens_i[..t]) under `model` at `temperature` (the
/// engine's processed logprob without top-k/top-p), `[batch, max_len]` padded with 0; position 0
/// (no prefix) is 0. Differentiable with respect to the model's parameters.
pub fn token_logprobs(
    model: &Qwen3Model,
    seqs: &[Scored<'_>],
    temperature: f64,
) -> crate::model::Result<Tensor> {
    Ok(scored(model, seqs, temperature, false)?.0)
}

/// [`token_logprobs`] and, without gradient, the entropy of each position's next-token
/// distribution `H[i, t] = −Σ_v π(v | tokens_i[..t]) log π(v | tokens_i[..t])` (aligned like the
/// logprobs: `H[i, t]` is the entropy of the distribution `tokens_i[t]` was drawn from).
pub fn token_logprobs_and_entropy(
    model: &Qwen3Model,
    seqs: &[Scored<'_>],
    temperature: f64,
) -> crate::model::Result<(Tensor, Tensor)> {
    let (logp, entropy) = scored(model, seqs, temperature, true)?;
    Ok((logp, entropy.expect("asked for")))
}

fn scored(
    model: &Qwen3Model,
    seqs: &[Scored<'_>],
    temperature: f64,
    with_entropy: bool,
) -> crate::model::Result<(Tensor, Option<Tensor>)> {
    let inputs: Vec<SeqInput<'_>> = seqs
        .iter()
        .map(|s| SeqInput {
            tokens: s.tokens,
            slot: None,
            replay: s.replay,
        })
        .collect();
    let logits = model.forward(&inputs, None, LogitsFor::All)?.logits;
    let width = seqs.iter().map(|s| s.tokens.len()).max().unwrap_or(0) as i64;
    let mut rows = Vec::with_capacity(seqs.len());
    let mut entropies = Vec::new();
    let mut offset = 0i64;
    for s in seqs {
        let n = s.tokens.len() as i64;
        // Rows 0..n-1 predict tokens 1..n.
        let seq_logits = logits.narrow(0, offset, n - 1).to_kind(Kind::Float);
        let logp = (seq_logits / temperature).log_softmax(-1, Kind::Float);
        let next = Tensor::from_slice(&s.tokens[1..]).to_device(logp.device());
        let picked = logp.gather(1, &next.unsqueeze(1), false).squeeze_dim(1);
        let zero = Tensor::zeros([1], (Kind::Float, logp.device()));
        let pad = Tensor::zeros([width - n], (Kind::Float, logp.device()));
        if with_entropy {
            let h = tch::no_grad(|| {
                -(logp.exp() * &logp).sum_dim_intlist([-1i64].as_slice(), false, Kind::Float)
            });
            entropies.push(Tensor::cat(&[&zero, &h, &pad], 0));
        }
        rows.push(Tensor::cat(&[zero, picked, pad], 0));
        offset += n;
    }
    let entropy = with_entropy.then(|| Tensor::stack(&entropies, 0));
    Ok((Tensor::stack(&rows, 0), entropy))
}
