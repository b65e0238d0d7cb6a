//! The trainer (docs/architecture.md): one trainable policy. Recomputing the sampled tokens'
//! log-probabilities with gradient ([`logprobs`]), the policy loss of a batch ([`step`]) composed
//! from the estimators, IS corrections and losses of [`crate::algorithms`], the optimizer
//! ([`optim`]: AdamW, gradient clipping, learning-rate schedule), and the whole step with
//! micro-batching and gradient accumulation ([`train`]); with several ranks, rank 0 leading the
//! others ([`ranks`]) and the state sharded across them (`shard`, `layered`;
//! docs/distributed.md).

mod layered;
pub mod logprobs;
pub mod optim;
pub mod ranks;
mod shard;
pub mod step;
pub mod train;

use tch::Tensor;

/// The bytes a tensor's values take.
pub fn bytes_of(t: &Tensor) -> usize {
    t.numel() * t.kind().elt_size_in_bytes()
}
