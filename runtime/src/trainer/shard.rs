//! The state of a trainer of several ranks, sharded (docs/distributed.md).
//!
//! The trainable tensors are grouped in units. Each unit's tensors, flattened one after another
//! and padded to a multiple of the world size, are cut into one equal shard per rank; a rank's
//! state is its shard of every unit, one after another. Each step every rank reduce-scatters
//! the gradients of its part of the batch, so it holds the summed gradient of its shards only;
//! the global gradient norm is an all-reduce of the shards' squares; each rank runs AdamW on its
//! shards (its moments exist for them only).
//!
//! Two stages ([`Sharding`]). With `Optimizer` (ZeRO-2) there is one unit of every tensor and
//! every rank keeps the whole weights: the updated shards are all-gathered back into them after
//! each step. With `Full` (ZeRO-3) there is a unit per decoder layer (and one each for the
//! embedding, the final norm and an untied LM head), and a rank keeps only its shards of the
//! weights: a unit's whole tensors exist only between [`Shards::gather`] and
//! [`Shards::release`] (the forward and backward around them are `layered.rs`'s).
//!
//! A shard cuts tensors anywhere: its part of each tensor is a [`Piece`], and AdamW runs over
//! pieces as it runs over whole tensors on one rank, so a tensor no token reached on any rank
//! (an unrouted expert) is left alone exactly as one rank leaves it.

use std::cell::Cell;
use std::collections::HashMap;
use std::ops::Range;
use std::time::Instant;

use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};

use super::bytes_of;
use super::optim::{grads, AdamW};
use crate::dist::{Collectives, ReduceOp, Result};
use crate::model::NamedSlice;

/// What a trainer of several ranks shards: the manifest's own enum (`spec.trainer.sharding`;
/// docs/distributed.md), `Full` (ZeRO-3) unless set.
pub use moult_operator::api::TrainerSharding as Sharding;

/// How a checkpoint written shard by shard is laid out (`shards/layout.json`;
/// docs/distributed.md): enough to put the whole tensors back together without the model.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ShardLayout {
    /// The ranks that wrote it: `shards/rank-R-of-N.safetensors` for each.
    pub world: usize,
    /// Per unit: its tensors' shapes (the trainable tensors in order) and each rank's shard
    /// length.
    pub units: Vec<Unit>,
    /// Where each checkpoint-named weight lies in the trainable tensors.
    pub names: Vec<NamedSlice>,
    /// Whether the files hold AdamW moments (`m.U`, `v.U`; none before the first step).
    pub moments: bool,
}

/// A sharded checkpoint put back together: the weights by checkpoint name and the moments of
/// each trainable tensor (empty before the first step).
pub type Whole = (Vec<(String, Tensor)>, Vec<(Tensor, Tensor)>);

/// Why a sharded checkpoint's files cannot be put back together.
#[derive(Debug, thiserror::Error)]
pub enum UnshardError {
    #[error("`{key}` of {file} has shape {shape:?}, the layout says [{len}] for unit {unit}")]
    Shape {
        key: String,
        file: String,
        shape: Vec<i64>,
        len: i64,
        unit: usize,
    },
    #[error("{file} has no `{key}`")]
    Missing { file: String, key: String },
    #[error("`{name}` lies in tensor {tensor}, which no unit has")]
    NoUnit { name: String, tensor: usize },
}

impl ShardLayout {
    /// The file rank `rank` writes.
    pub fn file_name(&self, rank: usize) -> String {
        shard_file_name(rank, self.world)
    }

    /// The whole tensors from every rank's file (`files[rank]`: its tensors by name).
    pub fn unshard(&self, files: Vec<Vec<(String, Tensor)>>) -> Result<Whole, UnshardError> {
        let files: Vec<HashMap<String, Tensor>> =
            files.into_iter().map(|f| f.into_iter().collect()).collect();
        // Unit `u`'s tensors `key` (`w`, `m` or `v`) flat: every rank's shard, in rank order.
        let flat = |key: &str, unit: usize| -> Result<Tensor, UnshardError> {
            let (key, len) = (format!("{key}.{unit}"), self.units[unit].shard_len);
            let parts = (files.iter().enumerate())
                .map(|(rank, f)| match f.get(&key) {
                    Some(t) if t.size() == [len] => Ok(t.shallow_clone()),
                    Some(t) => Err(UnshardError::Shape {
                        key: key.clone(),
                        file: self.file_name(rank),
                        shape: t.size(),
                        len,
                        unit,
                    }),
                    None => Err(UnshardError::Missing {
                        file: self.file_name(rank),
                        key: key.clone(),
                    }),
                })
                .collect::<Result<Vec<_>, _>>()?;
            Ok(Tensor::cat(&parts, 0))
        };
        let (mut tensors, mut moments) = (Vec::new(), Vec::new());
        for (u, unit) in self.units.iter().enumerate() {
            tensors.extend(split(&flat("w", u)?, &unit.shapes));
            if self.moments {
                moments.extend(split_moments(&flat("m", u)?, &flat("v", u)?, &unit.shapes));
            }
        }
        let weights = (self.names.iter())
            .map(|n| match tensors.get(n.tensor) {
                Some(t) => Ok(named(&t.reshape([-1]), 0, n)),
                None => Err(UnshardError::NoUnit {
                    name: n.name.clone(),
                    tensor: n.tensor,
                }),
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok((weights, moments))
    }
}

/// The weight `n` names, copied out of the flat `flat` where its tensor starts at `start`.
fn named(flat: &Tensor, start: i64, n: &NamedSlice) -> (String, Tensor) {
    let numel: i64 = n.shape.iter().product();
    let t = flat.narrow(0, start + n.offset, numel);
    (n.name.clone(), t.view(n.shape.as_slice()).copy())
}

/// The tensors of `shapes`, one after another from the start of `flat` (views of it).
fn split<'a>(flat: &'a Tensor, shapes: &'a [Vec<i64>]) -> impl Iterator<Item = Tensor> + 'a {
    shapes.iter().scan(0, move |at, shape| {
        let n: i64 = shape.iter().product();
        *at += n;
        Some(flat.narrow(0, *at - n, n).view(shape.as_slice()))
    })
}

/// [`split`] of first and second moments, copied.
fn split_moments(m: &Tensor, v: &Tensor, shapes: &[Vec<i64>]) -> Vec<(Tensor, Tensor)> {
    split(m, shapes)
        .zip(split(v, shapes))
        .map(|(m, v)| (m.copy(), v.copy()))
        .collect()
}

/// The file rank `rank` of `world` writes in a sharded checkpoint's `shards/`.
pub fn shard_file_name(rank: usize, world: usize) -> String {
    format!("rank-{rank:05}-of-{world:05}.safetensors")
}

/// This rank's part of one trainable tensor.
#[derive(Debug, Clone, Copy)]
struct Piece {
    /// Index into the trainable tensors.
    tensor: usize,
    /// Range within the flattened tensor.
    start: i64,
    len: i64,
    /// Offset within this rank's state.
    at: i64,
}

/// A group of trainable tensors gathered together; its shapes and shard length are also its
/// layout in a sharded checkpoint.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Unit {
    /// Each tensor's shape, and the length of each rank's shard of the unit.
    pub shapes: Vec<Vec<i64>>,
    pub shard_len: i64,
    #[serde(skip)]
    tensors: Range<usize>,
    /// Where each tensor starts in the unit's flat layout.
    #[serde(skip)]
    offsets: Vec<i64>,
    /// Where this rank's shard of the unit starts in its state.
    #[serde(skip)]
    at: i64,
}

#[derive(Debug)]
pub(super) struct Shards {
    units: Vec<Unit>,
    pieces: Vec<Piece>,
    /// Elements of this rank's state: its shard of every unit.
    state_len: i64,
    world: usize,
    /// Where the shards, gradients and gathers live: the model's device; and the dtype of the
    /// weights this rank keeps, of its gradient shard and of its moments.
    device: tch::Device,
    kind: Kind,
    /// `Full`: this rank's shards of the weights, the only copy between gathers.
    own: Option<Tensor>,
    /// `Full`: the dtype weights are gathered (and computed) in, when not the shards' own.
    compute: Option<Kind>,
    optimizer: AdamW,
    /// Seconds spent in collectives since [`Shards::take_seconds`], and of them in gathers of
    /// weights.
    seconds: Cell<f64>,
    gathering: Cell<f64>,
}

/// One step's summed gradient of this rank's shards, and which tensors got a gradient (on this
/// rank until [`Shards::finish_grad`], then on any).
pub(super) struct ShardGrad {
    grad: Tensor,
    reached: Vec<bool>,
}

impl Shards {
    /// The layout of `params` in `units` (ranges of their indices; `Optimizer` ignores them and
    /// keeps one unit of everything).
    pub(super) fn new(
        params: &[Tensor],
        units: Vec<Range<usize>>,
        sharding: Sharding,
        rank: usize,
        world: usize,
        optimizer: AdamW,
        compute: Option<Kind>,
    ) -> Self {
        assert!(
            params.iter().all(Tensor::is_contiguous),
            "trainable tensors own contiguous storage"
        );
        let units = match sharding {
            Sharding::Optimizer => std::iter::once(0..params.len()).collect(),
            Sharding::Full => units,
        };
        let (mut pieces, mut state_len, mut out, w) = (Vec::new(), 0, Vec::new(), world as i64);
        for tensors in units {
            let unit = &params[tensors.clone()];
            let total: i64 = unit.iter().map(|p| p.numel() as i64).sum();
            let shard_len = (total + w - 1) / w;
            let (lo, hi) = (rank as i64 * shard_len, (rank as i64 + 1) * shard_len);
            let (mut offsets, mut off) = (Vec::new(), 0);
            for (tensor, p) in tensors.clone().zip(unit) {
                let (a, b) = (off.max(lo), (off + p.numel() as i64).min(hi));
                if a < b {
                    pieces.push(Piece {
                        tensor,
                        start: a - off,
                        len: b - a,
                        at: state_len + a - lo,
                    });
                }
                offsets.push(off);
                off += p.numel() as i64;
            }
            out.push(Unit {
                shapes: unit.iter().map(Tensor::size).collect(),
                shard_len,
                tensors,
                offsets,
                at: state_len,
            });
            state_len += shard_len;
        }
        Self {
            units: out,
            pieces,
            state_len,
            world,
            device: params.first().map_or(tch::Device::Cpu, Tensor::device),
            kind: params.first().map_or(Kind::Float, Tensor::kind),
            own: None,
            compute,
            optimizer,
            seconds: Cell::new(0.0),
            gathering: Cell::new(0.0),
        }
    }

    /// Whether the weights are sharded too (`Full`).
    pub(super) fn full(&self) -> bool {
        self.own.is_some()
    }

    pub(super) fn units(&self) -> usize {
        self.units.len()
    }

    /// The trainable tensors of unit `u`.
    pub(super) fn tensors(&self, u: usize) -> Range<usize> {
        self.units[u].tensors.clone()
    }

    /// The collectives' seconds since the last call, and of them the gathers' of weights.
    pub(super) fn take_seconds(&self) -> (f64, f64) {
        (self.seconds.take(), self.gathering.take())
    }

    /// Runs the collective `f`, counting its seconds.
    pub(super) fn timed<T>(&self, f: impl FnOnce() -> Result<T>) -> Result<T> {
        add_seconds(&self.seconds, f)
    }

    /// `Full`: keeps this rank's shards of `params` and frees the whole tensors (once, when the
    /// ranks agree on the weights).
    pub(super) fn shard_weights(&mut self, params: &[Tensor]) {
        let own = self.state_of(|_, p| piece_of(params, p));
        self.own = Some(own);
        for u in 0..self.units.len() {
            self.release(u, params);
        }
        give_back_freed_memory();
    }

    /// An empty gradient, to [`Shards::reduce_unit`] into.
    pub(super) fn new_grad(&self) -> ShardGrad {
        ShardGrad {
            grad: Tensor::zeros([self.state_len], (self.kind, self.device)),
            reached: vec![false; self.units.last().map_or(0, |u| u.tensors.end)],
        }
    }

    /// Reduce-scatters unit `u`'s gradients (`None` where this rank's tokens did not reach a
    /// tensor) and adds this rank's shard of the sum into `acc`.
    pub(super) fn reduce_unit(
        &self,
        u: usize,
        grads: &[Option<Tensor>],
        acc: &mut ShardGrad,
        group: &dyn Collectives,
    ) -> Result<()> {
        let unit = &self.units[u];
        let (kind, shard_len, at) = (self.kind, unit.shard_len, unit.at);
        // The unit's flat layout, padded.
        let mut parts: Vec<Tensor> = (grads.iter().zip(&unit.shapes).enumerate())
            .map(|(i, (g, shape))| match g {
                Some(g) => {
                    acc.reached[unit.tensors.start + i] = true;
                    g.detach().to_kind(kind).reshape([-1])
                }
                None => Tensor::zeros([shape.iter().product::<i64>()], (kind, self.device)),
            })
            .collect();
        let pad =
            shard_len * self.world as i64 - parts.iter().map(Tensor::numel).sum::<usize>() as i64;
        parts.push(Tensor::zeros([pad], (kind, self.device)));
        let flat = tch::no_grad(|| Tensor::cat(&parts, 0));
        let part = Tensor::zeros([shard_len], (kind, self.device));
        self.timed(|| group.reduce_scatter(&part, &flat))?;
        tch::no_grad(|| {
            let _ = acc.grad.narrow(0, at, shard_len).g_add_(&part);
        });
        Ok(())
    }

    /// `Optimizer`: reduce-scatters the gradients every rank accumulated in `params` (then
    /// [`Shards::finish_grad`]).
    pub(super) fn reduce_grads(
        &self,
        params: &[Tensor],
        group: &dyn Collectives,
    ) -> Result<ShardGrad> {
        let mut acc = self.new_grad();
        for u in 0..self.units.len() {
            let unit = &params[self.units[u].tensors.clone()];
            self.reduce_unit(u, &grads(unit), &mut acc, group)?;
        }
        Ok(acc)
    }

    /// Makes `reached` say whether any rank's tokens reached each tensor.
    pub(super) fn finish_grad(&self, g: &mut ShardGrad, group: &dyn Collectives) -> Result<()> {
        let flags: Vec<f32> = g.reached.iter().map(|&r| f32::from(u8::from(r))).collect();
        let flags = Tensor::from_slice(&flags);
        self.timed(|| group.all_reduce(&flags, ReduceOp::Max))?;
        let flags = Vec::<f32>::try_from(&flags).expect("a float vector");
        g.reached = flags.into_iter().map(|f| f > 0.0).collect();
        Ok(())
    }

    /// Scales the gradient so its global L2 norm is at most `max_norm`; returns the norm before
    /// clipping (as [`super::optim::clip_grad_norm`] on one rank).
    pub(super) fn clip(
        &self,
        g: &mut ShardGrad,
        max_norm: f64,
        group: &dyn Collectives,
    ) -> Result<f64> {
        // In float64, a few million elements at a time: the whole shard in float64 would take
        // twice its memory, twice over.
        const CHUNK: i64 = 1 << 22;
        let sum: f64 = (g.grad.split(CHUNK, 0).iter())
            .map(|chunk| {
                chunk
                    .to_kind(Kind::Double)
                    .square()
                    .sum(Kind::Double)
                    .double_value(&[])
            })
            .sum();
        let squares = Tensor::from_slice(&[sum]);
        self.timed(|| group.all_reduce(&squares, ReduceOp::Sum))?;
        let norm = squares.double_value(&[0]).sqrt();
        if norm > max_norm && norm > 0.0 {
            let _ = tch::no_grad(|| g.grad.g_mul_scalar_(max_norm / norm));
        }
        Ok(norm)
    }

    /// AdamW on this rank's shards; with `Optimizer`, then every rank's updated shard into
    /// every rank's weights.
    pub(super) fn step(
        &mut self,
        params: &[Tensor],
        g: &ShardGrad,
        lr: f64,
        group: &dyn Collectives,
    ) -> Result<()> {
        let views: Vec<Tensor> = (self.pieces.iter())
            .map(|p| match &self.own {
                Some(own) => own.narrow(0, p.at, p.len),
                None => piece_of(params, p),
            })
            .collect();
        let grads: Vec<Option<Tensor>> = (self.pieces.iter())
            .map(|p| g.reached[p.tensor].then(|| g.grad.narrow(0, p.at, p.len)))
            .collect();
        self.optimizer.step_with(&views, &grads, lr);
        if !self.full() {
            let _ = self.gather(0, params, group)?;
        }
        Ok(())
    }

    /// Bytes this rank keeps between steps: its shards' moments and, with `Full`, its shards of
    /// the weights (else the whole weights are the model's).
    pub(super) fn state_bytes(&self) -> usize {
        self.optimizer.state_bytes() + self.own.as_ref().map_or(0, bytes_of)
    }

    /// Every rank's shard of unit `u`'s weights into every rank's tensors of it: with `Full`,
    /// `params` of the unit hold the whole weights until [`Shards::release`]. Returns the
    /// unit's flat layout.
    pub(super) fn gather(
        &self,
        u: usize,
        params: &[Tensor],
        group: &dyn Collectives,
    ) -> Result<Tensor> {
        let unit = &self.units[u];
        let (at, len, compute) = (unit.at, unit.shard_len, self.compute.unwrap_or(self.kind));
        let shard = match &self.own {
            Some(own) => own.narrow(0, at, len).to_kind(compute),
            None => self.state_of(|_, p| piece_of(params, p)).narrow(0, at, len),
        };
        let full = add_seconds(&self.gathering, || self.all_gather(u, &shard, group))?;
        tch::no_grad(|| {
            for (t, whole) in unit.tensors.clone().zip(split(&full, &unit.shapes)) {
                let mut p = params[t].shallow_clone();
                if self.own.is_some() {
                    p.set_data(&whole);
                } else {
                    p.detach().copy_(&whole);
                }
            }
        });
        Ok(full)
    }

    /// Every rank's `shard` of unit `u`, one after another (a collective).
    fn all_gather(&self, u: usize, shard: &Tensor, group: &dyn Collectives) -> Result<Tensor> {
        let len = self.units[u].shard_len * self.world as i64;
        let full = shard.new_zeros([len], (shard.kind(), shard.device()));
        self.timed(|| group.all_gather(&full, shard))?;
        Ok(full)
    }

    /// `Full`: frees unit `u`'s whole tensors (their shards stay).
    pub(super) fn release(&self, u: usize, params: &[Tensor]) {
        for t in self.units[u].tensors.clone() {
            let mut p = params[t].shallow_clone();
            p.set_data(&Tensor::empty([0], (p.kind(), p.device())));
        }
    }

    /// AdamW's first and second moments laid out as this rank's state (zeros before a step).
    fn moment_states(&self) -> [Tensor; 2] {
        let state = self.optimizer.moments();
        // Piece i's moments are state[i] (AdamW runs over the pieces in order).
        [0, 1].map(|which| {
            self.state_of(|i, p| match state.get(i) {
                Some((m, v)) => [m, v][which].shallow_clone(),
                None => Tensor::zeros([p.len], (self.kind, self.device)),
            })
        })
    }

    /// `Full`: this rank's shard of each unit, flat, for its file of a sharded checkpoint:
    /// weights (`w.U`) and, after a step, moments (`m.U`, `v.U`).
    pub(super) fn shard_tensors(&self) -> Vec<(String, Tensor)> {
        let own = self.own.as_ref().expect("sharded weights");
        let moments = (!self.optimizer.moments().is_empty()).then(|| self.moment_states());
        let mut out = Vec::new();
        for (u, unit) in self.units.iter().enumerate() {
            let part = |t: &Tensor| {
                t.narrow(0, unit.at, unit.shard_len)
                    .to_device(tch::Device::Cpu)
            };
            out.push((format!("w.{u}"), part(own)));
            for (key, t) in ["m", "v"].iter().zip(moments.iter().flatten()) {
                out.push((format!("{key}.{u}"), part(t)));
            }
        }
        out
    }

    /// The layout of a checkpoint these shards write.
    pub(super) fn layout(&self, names: &[NamedSlice]) -> ShardLayout {
        ShardLayout {
            world: self.world,
            units: self.units.clone(),
            names: names.to_vec(),
            moments: !self.optimizer.moments().is_empty(),
        }
    }

    /// `Full`: the weights by checkpoint name, whole, gathered unit by unit (a collective);
    /// `emit` gets each unit's weights as soon as they are gathered, so only one unit is whole
    /// at a time here.
    pub(super) fn gather_units(
        &self,
        params: &[Tensor],
        names: &[NamedSlice],
        group: &dyn Collectives,
        emit: &mut dyn FnMut(Vec<(String, Tensor)>),
    ) -> Result<()> {
        for u in 0..self.units.len() {
            let full = self.gather(u, params, group)?;
            self.release(u, params);
            let unit = &self.units[u];
            let start = |n: &NamedSlice| unit.offsets[n.tensor - unit.tensors.start];
            let unit_names = names.iter().filter(|n| unit.tensors.contains(&n.tensor));
            emit(unit_names.map(|n| named(&full, start(n), n)).collect());
        }
        Ok(())
    }

    /// This rank's state built from each piece's tensor, padded.
    fn state_of(&self, piece: impl Fn(usize, &Piece) -> Tensor) -> Tensor {
        let state = Tensor::zeros([self.state_len], (self.kind, self.device));
        tch::no_grad(|| {
            for (i, p) in self.pieces.iter().enumerate() {
                state.narrow(0, p.at, p.len).copy_(&piece(i, p));
            }
        });
        state
    }

    /// The AdamW moments of every tensor, whole (gathered from every rank), in trainable order;
    /// empty before the first step.
    pub(super) fn gathered_moments(
        &self,
        group: &dyn Collectives,
    ) -> Result<Vec<(Tensor, Tensor)>> {
        let state = self.optimizer.moments();
        // Every rank must take part, stepped or not; a rank without state contributes zeros.
        let stepped = Tensor::from_slice(&[(!state.is_empty()) as i32 as f32]);
        self.timed(|| group.all_reduce(&stepped, ReduceOp::Max))?;
        if stepped.double_value(&[0]) == 0.0 {
            return Ok(Vec::new());
        }
        let [m, v] = self.moment_states();
        let mut out = Vec::new();
        for (u, unit) in self.units.iter().enumerate() {
            let gather =
                |s: &Tensor| self.all_gather(u, &s.narrow(0, unit.at, unit.shard_len), group);
            out.extend(split_moments(&gather(&m)?, &gather(&v)?, &unit.shapes));
        }
        Ok(out)
    }

    /// Continues from whole moments (a checkpoint's, of any number of ranks).
    pub(super) fn restore(&mut self, steps: i64, moments: &[(Tensor, Tensor)]) {
        let pieces = (self.pieces.iter().filter(|_| !moments.is_empty()))
            .map(|p| {
                let cut = |t: &Tensor| t.reshape([-1]).narrow(0, p.start, p.len).copy();
                let (m, v) = &moments[p.tensor];
                (cut(m), cut(v))
            })
            .collect();
        self.optimizer.restore(steps, pieces);
    }
}

/// Runs `f`, adding the seconds it took to `total`.
fn add_seconds<T>(total: &Cell<f64>, f: impl FnOnce() -> T) -> T {
    let started = Instant::now();
    let out = f();
    total.set(total.get() + started.elapsed().as_secs_f64());
    out
}

/// The slice of `params` a piece updates (a view: writes reach the weights).
fn piece_of(params: &[Tensor], p: &Piece) -> Tensor {
    params[p.tensor]
        .detach()
        .view([-1])
        .narrow(0, p.start, p.len)
}

/// Returns the heap's free pages to the system. The whole weights every rank loaded are freed
/// when it keeps its shards, but most of their tensors are below glibc's mmap threshold, so
/// without this their pages would stay resident (and counted) as free heap.
fn give_back_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[allow(unsafe_code)]
    {
        extern "C" {
            fn malloc_trim(pad: usize) -> std::os::raw::c_int;
        }
        // SAFETY: glibc's malloc_trim takes no pointers and is safe to call at any time from any
        // thread; it only releases memory the allocator holds free.
        unsafe {
            malloc_trim(0);
        }
    }
}
