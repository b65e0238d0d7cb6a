//! The optimizer step: AdamW, gradient clipping by global norm, and the learning-rate schedule.
//! Written over plain tensors because the policy's weights are the model's own (checkpoint
//! names), not a `tch::nn::VarStore`.

use serde::{Deserialize, Serialize};
use tch::Tensor;

use super::bytes_of;

/// AdamW (Loshchilov & Hutter 2019), as `torch.optim.AdamW` computes it:
/// `θ ← θ − lr·λ·θ`; `m ← β1 m + (1 − β1) g`; `v ← β2 v + (1 − β2) g²`;
/// `θ ← θ − lr · (m / (1 − β1^t)) / (sqrt(v / (1 − β2^t)) + ε)`.
#[derive(Debug)]
pub struct AdamW {
    pub betas: (f64, f64),
    pub eps: f64,
    pub weight_decay: f64,
    step: i64,
    /// (m, v) per parameter, in the order the parameters are given.
    state: Vec<(Tensor, Tensor)>,
}

impl AdamW {
    pub fn new(betas: (f64, f64), eps: f64, weight_decay: f64) -> Self {
        Self {
            betas,
            eps,
            weight_decay,
            step: 0,
            state: Vec::new(),
        }
    }

    /// Steps taken so far (part of a checkpoint with the moments).
    pub fn steps(&self) -> i64 {
        self.step
    }

    /// The moments `(m, v)` per parameter (empty before the first step), for checkpoints.
    pub fn moments(&self) -> &[(Tensor, Tensor)] {
        &self.state
    }

    /// Bytes the moments take.
    pub fn state_bytes(&self) -> usize {
        self.state
            .iter()
            .map(|(m, v)| bytes_of(m) + bytes_of(v))
            .sum()
    }

    /// Continues from a checkpoint: `steps` taken and the moments per parameter (in the order
    /// the parameters are given to [`AdamW::step`]).
    pub fn restore(&mut self, steps: i64, moments: Vec<(Tensor, Tensor)>) {
        self.step = steps;
        self.state = moments;
    }

    /// One update of `params` (each with `.grad()` filled) at learning rate `lr`.
    pub fn step(&mut self, params: &[Tensor], lr: f64) {
        self.step_with(params, &grads(params), lr);
    }

    /// One update of `params` with the given gradients; a tensor without one (`None`: no token
    /// reached it, as an unrouted expert) is left alone, moments and weight decay included.
    pub fn step_with(&mut self, params: &[Tensor], grads: &[Option<Tensor>], lr: f64) {
        assert_eq!(params.len(), grads.len(), "one gradient slot per parameter");
        if self.state.is_empty() {
            let zeros = |p: &Tensor| (p.zeros_like(), p.zeros_like());
            self.state = params.iter().map(zeros).collect();
        }
        assert_eq!(
            self.state.len(),
            params.len(),
            "the same parameters every step"
        );
        self.step += 1;
        let (b1, b2) = self.betas;
        let bias1 = 1.0 - b1.powi(self.step as i32);
        let bias2 = 1.0 - b2.powi(self.step as i32);
        tch::no_grad(|| {
            for ((p, g), (m, v)) in params.iter().zip(grads).zip(&mut self.state) {
                let Some(g) = g else { continue };
                let mut p = p.shallow_clone();
                if self.weight_decay != 0.0 {
                    let _ = p.g_mul_scalar_(1.0 - lr * self.weight_decay);
                }
                let _ = m.lerp_(g, 1.0 - b1);
                let _ = v.lerp_(&(g * g), 1.0 - b2);
                let mut denom = v.sqrt();
                let _ = denom
                    .g_div_scalar_(bias2.sqrt())
                    .g_add_scalar_(self.eps)
                    .g_div_scalar_(-lr / bias1);
                let _ = p.addcdiv_(m, &denom);
            }
        });
    }
}

/// Each tensor's gradient; `None` where it has none (no loss reached it).
pub(super) fn grads(params: &[Tensor]) -> Vec<Option<Tensor>> {
    let grad = |p: &Tensor| Some(p.grad()).filter(Tensor::defined);
    params.iter().map(grad).collect()
}

/// Scales every gradient so their global L2 norm is at most `max_norm`; returns the norm before
/// clipping (the `grad_norm` metric).
pub fn clip_grad_norm(params: &[Tensor], max_norm: f64) -> f64 {
    let grads: Vec<Tensor> = grads(params).into_iter().flatten().collect();
    let square = |g: &Tensor| g.norm().double_value(&[]).powi(2);
    let squares: f64 = grads.iter().map(square).sum();
    let norm = squares.sqrt();
    if norm > max_norm && norm > 0.0 {
        tch::no_grad(|| {
            for mut g in grads {
                let _ = g.g_mul_scalar_(max_norm / norm);
            }
        });
    }
    norm
}

/// The learning rate over training: linear warm-up from 0, then constant, linear or cosine decay
/// to `min_ratio · peak` at `total_steps`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LrSchedule {
    pub peak: f64,
    pub warmup_steps: u64,
    pub total_steps: u64,
    pub decay: Decay,
    pub min_ratio: f64,
}

/// How the learning rate falls after the warm-up: the manifest's own enum
/// (`algorithm.optimizer.decay`).
pub use moult_operator::api::LrDecay as Decay;

impl LrSchedule {
    /// The learning rate of step `step` (1-based: the first update is step 1).
    pub fn at(&self, step: u64) -> f64 {
        if self.warmup_steps > 0 && step <= self.warmup_steps {
            return self.peak * step as f64 / self.warmup_steps as f64;
        }
        let span = self.total_steps.saturating_sub(self.warmup_steps).max(1) as f64;
        let progress = (step.saturating_sub(self.warmup_steps) as f64 / span).min(1.0);
        let floor = self.min_ratio * self.peak;
        match self.decay {
            Decay::Constant => self.peak,
            Decay::Linear => floor + (self.peak - floor) * (1.0 - progress),
            Decay::Cosine => {
                floor + (self.peak - floor) * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind};

    /// torch.optim.AdamW on one scalar, written out.
    fn reference(theta0: f64, grads: &[f64], lr: f64, b1: f64, b2: f64, eps: f64, wd: f64) -> f64 {
        let (mut theta, mut m, mut v) = (theta0, 0.0, 0.0);
        for (t, g) in grads.iter().enumerate() {
            let t = (t + 1) as i32;
            theta *= 1.0 - lr * wd;
            m = b1 * m + (1.0 - b1) * g;
            v = b2 * v + (1.0 - b2) * g * g;
            let mhat = m / (1.0 - b1.powi(t));
            let vhat = v / (1.0 - b2.powi(t));
            theta -= lr * mhat / (vhat.sqrt() + eps);
        }
        theta
    }

    #[test]
    fn adamw_matches_torchs_formula() {
        let grads = [0.5, -1.0, 2.0, 0.1, -0.3];
        let p = Tensor::from_slice(&[1.5f64]).set_requires_grad(true);
        let mut opt = AdamW::new((0.9, 0.999), 1e-8, 0.01);
        for g in grads {
            // d/dθ (g · θ) = g
            (&p * g).sum(Kind::Double).backward();
            opt.step(std::slice::from_ref(&p), 0.1);
            let mut grad = p.grad();
            let _ = grad.zero_();
        }
        let want = reference(1.5, &grads, 0.1, 0.9, 0.999, 1e-8, 0.01);
        assert!(
            (p.double_value(&[0]) - want).abs() < 1e-12,
            "{} vs {want}",
            p.double_value(&[0])
        );
        assert_eq!(opt.steps(), 5);
    }

    #[test]
    fn clipping_scales_to_the_global_norm() {
        let a = Tensor::zeros([2], (Kind::Double, Device::Cpu)).set_requires_grad(true);
        let b = Tensor::zeros([1], (Kind::Double, Device::Cpu)).set_requires_grad(true);
        // Gradients (3, 0) and (4): global norm 5.
        (&a * Tensor::from_slice(&[3.0f64, 0.0]))
            .sum(Kind::Double)
            .backward();
        (&b * 4.0).sum(Kind::Double).backward();
        let params = [a.shallow_clone(), b.shallow_clone()];
        assert!((clip_grad_norm(&params, 1.0) - 5.0).abs() < 1e-12);
        let ga: Vec<f64> = Vec::try_from(a.grad()).unwrap();
        let gb: Vec<f64> = Vec::try_from(b.grad()).unwrap();
        assert!((ga[0] - 0.6).abs() < 1e-12 && (gb[0] - 0.8).abs() < 1e-12);
        // Under the limit nothing changes.
        assert!((clip_grad_norm(&params, 10.0) - 1.0).abs() < 1e-12);
    }

    #[test]
    fn schedules_warm_up_then_decay_to_the_floor() {
        let s = |decay| LrSchedule {
            peak: 1.0,
            warmup_steps: 10,
            total_steps: 110,
            decay,
            min_ratio: 0.1,
        };
        assert!((s(Decay::Cosine).at(5) - 0.5).abs() < 1e-12);
        assert!((s(Decay::Cosine).at(10) - 1.0).abs() < 1e-12);
        assert!((s(Decay::Cosine).at(60) - 0.55).abs() < 1e-12);
        assert!((s(Decay::Cosine).at(110) - 0.1).abs() < 1e-12);
        assert!((s(Decay::Linear).at(60) - 0.55).abs() < 1e-12);
        assert!((s(Decay::Constant).at(100) - 1.0).abs() < 1e-12);
        assert!(
            (s(Decay::Linear).at(500) - 0.1).abs() < 1e-12,
            "past the end it stays at the floor"
        );
    }
}
