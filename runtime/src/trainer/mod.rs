//! The trainer (DESIGN §5, issue 6; being built): one trainable policy. Today: recomputing the
//! sampled tokens' log-probabilities with gradient ([`logprobs`]) and the optimizer step
//! ([`optim`]: AdamW, gradient clipping, learning-rate schedule), and the policy loss of a batch
//! ([`step`]) composed from the estimators, IS corrections and losses of [`crate::algorithms`].

pub mod logprobs;
pub mod optim;
pub mod step;
