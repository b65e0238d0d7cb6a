//! The optimizer state of a trainer of several ranks, sharded (ZeRO stage 2; docs/distributed.md).
//!
//! The trainable tensors, flattened one after another and padded to a multiple of the world
//! size, are cut into one equal shard per rank. Each step every rank reduce-scatters the
//! gradients of its part of the batch, so it holds the summed gradient of its shard only; the
//! global gradient norm is an all-reduce of the shards' squares; each rank runs AdamW on its
//! shard (its moments exist for that shard only) and the updated shards are all-gathered back
//! into every rank's weights. A shard cuts tensors anywhere: its part of each tensor is a
//! [`Piece`], and AdamW runs over pieces as it runs over whole tensors on one rank, so a tensor no
//! token reached on any rank (an unrouted expert) is left alone exactly as one rank leaves it.

use tch::{Kind, Tensor};

use super::optim::AdamW;
use crate::dist::{Collectives, ReduceOp, Result};

/// This rank's part of one trainable tensor.
#[derive(Debug, Clone, Copy)]
struct Piece {
    /// Index into the trainable tensors.
    tensor: usize,
    /// Range within the flattened tensor.
    start: i64,
    len: i64,
    /// Offset within this rank's shard.
    at: i64,
}

#[derive(Debug)]
pub(super) struct Shards {
    /// Elements of each trainable tensor, and where each starts in the flat layout.
    numels: Vec<i64>,
    offsets: Vec<i64>,
    shard_len: i64,
    pieces: Vec<Piece>,
    optimizer: AdamW,
}

/// One step's summed gradient of this rank's shard, and which tensors got a gradient on any rank.
pub(super) struct ShardGrad {
    grad: Tensor,
    reached: Vec<bool>,
}

impl Shards {
    pub(super) fn new(params: &[Tensor], rank: usize, world: usize, optimizer: AdamW) -> Self {
        let numels: Vec<i64> = params.iter().map(|p| p.numel() as i64).collect();
        for p in params {
            assert!(
                p.is_contiguous(),
                "trainable tensors own contiguous storage"
            );
        }
        let mut offsets = Vec::with_capacity(numels.len());
        let mut total = 0;
        for n in &numels {
            offsets.push(total);
            total += n;
        }
        let world = world as i64;
        let shard_len = (total + world - 1) / world;
        let (lo, hi) = (rank as i64 * shard_len, (rank as i64 + 1) * shard_len);
        let pieces = numels
            .iter()
            .zip(&offsets)
            .enumerate()
            .filter_map(|(tensor, (&n, &off))| {
                let (a, b) = (off.max(lo), (off + n).min(hi));
                (a < b).then_some(Piece {
                    tensor,
                    start: a - off,
                    len: b - a,
                    at: a - lo,
                })
            })
            .collect();
        Self {
            numels,
            offsets,
            shard_len,
            pieces,
            optimizer,
        }
    }

    fn world_len(&self, group: &dyn Collectives) -> i64 {
        self.shard_len * group.world() as i64
    }

    /// The flat layout of `parts` (one `[numel]` tensor per trainable tensor), padded.
    fn flat(&self, parts: Vec<Tensor>, group: &dyn Collectives) -> Tensor {
        let total: i64 = self.numels.iter().sum();
        let mut parts = parts;
        let pad = self.world_len(group) - total;
        if pad > 0 {
            parts.push(Tensor::zeros([pad], (parts[0].kind(), parts[0].device())));
        }
        Tensor::cat(&parts, 0)
    }

    /// Reduce-scatters the gradients every rank accumulated: this rank gets the sum of its shard.
    pub(super) fn reduce_grads(
        &self,
        params: &[Tensor],
        group: &dyn Collectives,
    ) -> Result<ShardGrad> {
        let local: Vec<bool> = params.iter().map(|p| p.grad().defined()).collect();
        let flat = tch::no_grad(|| {
            let parts = params
                .iter()
                .map(|p| {
                    let g = p.grad();
                    if g.defined() {
                        g.reshape([-1])
                    } else {
                        Tensor::zeros([p.numel() as i64], (p.kind(), p.device()))
                    }
                })
                .collect();
            self.flat(parts, group)
        });
        let grad = flat.new_zeros([self.shard_len], (flat.kind(), flat.device()));
        group.reduce_scatter(&grad, &flat)?;
        let flags = Tensor::from_slice(&local.iter().map(|&r| r as i32 as f32).collect::<Vec<_>>());
        group.all_reduce(&flags, ReduceOp::Max)?;
        let reached = Vec::<f32>::try_from(&flags)
            .expect("a float vector")
            .into_iter()
            .map(|f| f > 0.0)
            .collect();
        Ok(ShardGrad { grad, reached })
    }

    /// The global L2 norm of the gradient (before clipping).
    pub(super) fn grad_norm(&self, g: &ShardGrad, group: &dyn Collectives) -> Result<f64> {
        let squares = g
            .grad
            .to_kind(Kind::Double)
            .square()
            .sum(Kind::Double)
            .view([1]);
        group.all_reduce(&squares, ReduceOp::Sum)?;
        Ok(squares.double_value(&[0]).sqrt())
    }

    /// Scales the shard's gradient (clipping to a global norm).
    pub(super) fn scale(&self, g: &mut ShardGrad, factor: f64) {
        let _ = tch::no_grad(|| g.grad.g_mul_scalar_(factor));
    }

    /// AdamW on this rank's shard, then every rank's updated shard into every rank's weights;
    /// returns the seconds the all-gather took.
    pub(super) fn step(
        &mut self,
        params: &[Tensor],
        g: &ShardGrad,
        lr: f64,
        group: &dyn Collectives,
    ) -> Result<f64> {
        let views: Vec<Tensor> = self.pieces.iter().map(|p| piece_of(params, p)).collect();
        let grads: Vec<Option<Tensor>> = self
            .pieces
            .iter()
            .map(|p| g.reached[p.tensor].then(|| g.grad.narrow(0, p.at, p.len)))
            .collect();
        self.optimizer.step_with(&views, &grads, lr);
        let started = std::time::Instant::now();
        self.all_gather_weights(params, group)?;
        Ok(started.elapsed().as_secs_f64())
    }

    /// Bytes of optimizer state this rank holds (its shard's moments).
    pub(super) fn state_bytes(&self) -> usize {
        self.optimizer.state_bytes()
    }

    /// Every rank's shard of the weights into every rank's full weights.
    pub(super) fn all_gather_weights(
        &self,
        params: &[Tensor],
        group: &dyn Collectives,
    ) -> Result<()> {
        let shard = self.shard_of(|_, p| piece_of(params, p), params[0].kind());
        let full = shard.new_zeros([self.world_len(group)], (shard.kind(), shard.device()));
        group.all_gather(&full, &shard)?;
        tch::no_grad(|| {
            for (i, p) in params.iter().enumerate() {
                p.detach()
                    .view([-1])
                    .copy_(&full.narrow(0, self.offsets[i], self.numels[i]));
            }
        });
        Ok(())
    }

    /// This rank's shard built from each piece's tensor, padded.
    fn shard_of(&self, piece: impl Fn(usize, &Piece) -> Tensor, kind: Kind) -> Tensor {
        let shard = Tensor::zeros([self.shard_len], (kind, tch::Device::Cpu));
        tch::no_grad(|| {
            for (i, p) in self.pieces.iter().enumerate() {
                shard.narrow(0, p.at, p.len).copy_(&piece(i, p));
            }
        });
        shard
    }

    /// The AdamW moments of every tensor, whole (gathered from every rank), in trainable order;
    /// empty before the first step.
    pub(super) fn gathered_moments(
        &self,
        params: &[Tensor],
        group: &dyn Collectives,
    ) -> Result<Vec<(Tensor, Tensor)>> {
        let state = self.optimizer.moments();
        // Every rank must take part, stepped or not; a rank without state contributes zeros.
        let stepped = Tensor::from_slice(&[(!state.is_empty()) as i32 as f32]);
        group.all_reduce(&stepped, ReduceOp::Max)?;
        if stepped.double_value(&[0]) == 0.0 {
            return Ok(Vec::new());
        }
        let kind = params[0].kind();
        let mut whole = Vec::with_capacity(2);
        for which in 0..2 {
            // Piece i's moments are state[i] (AdamW runs over the pieces in order).
            let shard = self.shard_of(
                |i, p| match state.get(i) {
                    Some((m, v)) => [m, v][which].shallow_clone(),
                    None => Tensor::zeros([p.len], (kind, tch::Device::Cpu)),
                },
                kind,
            );
            let full = shard.new_zeros([self.world_len(group)], (kind, shard.device()));
            group.all_gather(&full, &shard)?;
            whole.push(full);
        }
        Ok(params
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let part = |full: &Tensor| {
                    full.narrow(0, self.offsets[i], self.numels[i])
                        .view(p.size().as_slice())
                        .copy()
                };
                (part(&whole[0]), part(&whole[1]))
            })
            .collect())
    }

    /// Continues from whole moments (a checkpoint's, of any number of ranks).
    pub(super) fn restore(&mut self, steps: i64, moments: &[(Tensor, Tensor)]) {
        let pieces = if moments.is_empty() {
            Vec::new()
        } else {
            self.pieces
                .iter()
                .map(|p| {
                    let cut = |t: &Tensor| t.reshape([-1]).narrow(0, p.start, p.len).copy();
                    let (m, v) = &moments[p.tensor];
                    (cut(m), cut(v))
                })
                .collect()
        };
        self.optimizer.restore(steps, pieces);
    }
}

/// The slice of `params` a piece updates (a view: writes reach the weights).
fn piece_of(params: &[Tensor], p: &Piece) -> Tensor {
    params[p.tensor]
        .detach()
        .view([-1])
        .narrow(0, p.start, p.len)
}
