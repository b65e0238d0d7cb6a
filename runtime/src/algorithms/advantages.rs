//! Advantage estimators (docs/algorithms.md). Rewards are per sequence; an advantage per sequence is
//! broadcast to its tokens by the loss.

use tch::Tensor;

/// GRPO's group-normalised advantage (Shao et al. 2024, DeepSeekMath):
/// `A_i = (R_i − mean_g(R)) / (std_g(R) + ε)` over the `G` samples of each group, or without the
/// division when `scale` is false (Dr. GRPO, Liu et al. 2025). `rewards`: `[groups, G]`.
/// The standard deviation is the population one (divide by G), as verl computes it unbiased=False.
pub fn grpo(rewards: &Tensor, scale: bool, eps: f64) -> Tensor {
    let mean = rewards.mean_dim([-1i64].as_slice(), true, rewards.kind());
    let centred = rewards - &mean;
    if !scale {
        return centred;
    }
    let std = rewards.std_dim([-1i64].as_slice(), false, true);
    centred / (std + eps)
}

/// RLOO (Ahmadian et al. 2024): each sample's baseline is the mean of the other `G − 1` samples
/// of its group: `A_i = R_i − (Σ_{j≠i} R_j) / (G − 1)` = `G/(G−1) · (R_i − mean_g(R))`.
/// `rewards`: `[groups, G]`, `G ≥ 2`.
pub fn rloo(rewards: &Tensor) -> Tensor {
    let g = rewards.size()[1];
    assert!(g >= 2, "RLOO needs at least 2 samples per group, got {g}");
    let sum = rewards.sum_dim_intlist([-1i64].as_slice(), true, rewards.kind());
    rewards - (sum - rewards) / (g - 1) as f64
}

/// REINFORCE++ (Hu 2025): rewards normalised over the whole batch, not per group:
/// `A_i = (R_i − mean_batch(R)) / (std_batch(R) + ε)`. `rewards`: any shape.
pub fn reinforce_pp(rewards: &Tensor, eps: f64) -> Tensor {
    let mean = rewards.mean(rewards.kind());
    let std = rewards.std(false);
    (rewards - mean) / (std + eps)
}

/// On-policy distillation (Agarwal et al. 2024; Thinking Machines 2025): a per-token advantage,
/// the teacher's log-probability of the student's token minus the student's own,
/// `A_t = log π_teacher(a_t) − log π_student(a_t)` (reverse KL as a reward), 0 where `mask` is 0.
/// All `[batch, time]`.
pub fn distillation(teacher_logprobs: &Tensor, student_logprobs: &Tensor, mask: &Tensor) -> Tensor {
    (teacher_logprobs - student_logprobs) * mask
}
