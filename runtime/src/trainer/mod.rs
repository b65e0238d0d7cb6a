//! The trainer (DESIGN §5, issue 6; being built): one trainable policy. Today: recomputing the
//! sampled tokens' log-probabilities with gradient ([`logprobs`]) and the optimizer step
//! ([`optim`]: AdamW, gradient clipping, learning-rate schedule); the losses, estimators and IS
//! corrections it will combine are in [`crate::algorithms`].

pub mod logprobs;
pub mod optim;
