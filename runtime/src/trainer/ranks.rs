//! Rank 0 leads, the other ranks follow (docs/distributed.md). Only rank 0 talks to the rest of
//! the run (batches in, weights out, checkpoints); before each step, and before each gather of
//! the optimizer state for a checkpoint, it broadcasts a command, so every rank issues the same
//! collectives in the same order. A follower joins with [`follower`] (the setup comes from rank
//! 0), then [`Trainer::follow`]s until rank 0 says stop or is lost.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tch::{Device, Kind, Tensor};

use super::shard::{shard_file_name, ShardLayout};
use super::train::{Sample, Trainer, TrainerOptions};
use crate::dist::{Collectives, Error, ReduceOp, Result};
use crate::model::{CausalLm, ImageInput};
use crate::vision::ProcessedImage;

/// How long a follower waits for rank 0's next command: a run's rollouts between steps can take
/// long. A lost rank 0 closes its connections, which a follower sees at once.
const COMMAND_WAIT: Duration = Duration::from_secs(24 * 3600);

/// The folder of a checkpoint that holds its shard files.
pub const SHARDS: &str = "shards";

/// What every rank needs to build the same trainer, sent by rank 0 on joining.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Setup {
    /// The folder whose `config.json` and weights every rank loads (rank 0 then sends its own
    /// weights, so a checkpoint only rank 0 resumed from is everyone's).
    pub model_dir: PathBuf,
    /// The frozen reference of a KL penalty.
    pub reference_dir: Option<PathBuf>,
    /// The weights' dtype (`float32`, `bfloat16`, `float64`).
    pub dtype: String,
    pub options: TrainerOptions,
}

/// What rank 0 tells the followers to do next: the first byte of each command it broadcasts,
/// the rest its payload (a batch, a folder).
const STEP: u8 = 1;
const MOMENTS: u8 = 2;
const STOP: u8 = 3;
const WEIGHTS: u8 = 4;
const SAVE_SHARDS: u8 = 5;

/// Broadcasts bytes from rank 0 (`Some` there, `None` elsewhere); every rank returns them.
fn broadcast_bytes(group: &dyn Collectives, bytes: Option<&[u8]>) -> Result<Vec<u8>> {
    let len = Tensor::from_slice(&[bytes.map_or(0, |b| b.len() as i64)]);
    group.broadcast(&len, 0)?;
    let n = len.int64_value(&[0]);
    let buffer = match bytes {
        Some(b) => Tensor::from_slice(b),
        None => Tensor::zeros([n], (Kind::Uint8, Device::Cpu)),
    };
    if n > 0 {
        group.broadcast(&buffer, 0)?;
    }
    Ok(Vec::<u8>::try_from(&buffer).expect("a byte vector"))
}

/// A follower joins: rank 0's setup, then the trainer it describes, in sync with rank 0's.
pub fn follower(group: Box<dyn Collectives>, device: Device) -> crate::model::Result<Trainer> {
    let setup = broadcast_bytes(group.as_ref(), None)?;
    let setup: Setup = serde_json::from_slice(&setup).map_err(|e| {
        crate::model::Error::Input(format!("rank 0 sent a setup this rank cannot read: {e}"))
    })?;
    let kind = crate::model::parse_dtype(&setup.dtype).ok_or_else(|| {
        crate::model::Error::Input(format!("rank 0 sent an unknown dtype {}", setup.dtype))
    })?;
    let model = CausalLm::load(&setup.model_dir, kind, device)?;
    let reference = (setup.reference_dir.as_ref())
        .map(|d| CausalLm::load(d, kind, device))
        .transpose()?;
    joined(model, reference, setup.options, None, group)
}

/// Rank 0 of several: sends the setup every follower builds its trainer from, builds its own
/// (from `model`, which may hold a checkpoint's weights, and `resume`'s steps and moments), and
/// brings the followers to its weights and optimizer state.
pub fn leader(
    model: CausalLm,
    reference: Option<CausalLm>,
    setup: Setup,
    resume: Option<(u64, Vec<(Tensor, Tensor)>)>,
    group: Box<dyn Collectives>,
) -> crate::model::Result<Trainer> {
    let bytes = serde_json::to_vec(&setup).expect("the setup serialises");
    broadcast_bytes(group.as_ref(), Some(&bytes))?;
    joined(model, reference, setup.options, resume, group)
}

/// This rank's trainer, in sync with rank 0's weights and `resume` (given on rank 0).
fn joined(
    model: CausalLm,
    reference: Option<CausalLm>,
    options: TrainerOptions,
    resume: Option<(u64, Vec<(Tensor, Tensor)>)>,
    group: Box<dyn Collectives>,
) -> crate::model::Result<Trainer> {
    let mut trainer = Trainer::with_group(model, reference, options, group)
        .map_err(|e| crate::model::Error::Input(e.to_string()))?;
    trainer.sync_ranks(resume)?;
    Ok(trainer)
}

impl Trainer {
    fn leads(&self) -> bool {
        self.world_size() > 1 && self.group.rank() == 0
    }

    /// Rank 0: tells the followers what to do next.
    fn command(&self, command: u8, payload: &[u8]) -> Result<()> {
        if self.leads() {
            let bytes = [&[command], payload].concat();
            broadcast_bytes(self.group.as_ref(), Some(&bytes))?;
        }
        Ok(())
    }

    /// One optimizer step on `samples` (the whole batch; with several ranks, called on rank 0,
    /// which hands the batch to the others).
    pub fn step(&mut self, samples: &[Sample]) -> crate::model::Result<super::train::StepStats> {
        if self.leads() {
            self.command(STEP, &encode(samples))?;
        }
        self.step_on(samples)
    }

    /// The optimizer's moments, whole, in [`CausalLm::trainable`] order (for checkpoints); empty
    /// before the first step. With several ranks, called on rank 0.
    pub fn moments(&self) -> Result<Vec<(Tensor, Tensor)>> {
        self.command(MOMENTS, &[])?;
        let Some(shards) = &self.shards else {
            let clone = |(m, v): &(Tensor, Tensor)| (m.shallow_clone(), v.shallow_clone());
            return Ok(self.optimizer.moments().iter().map(clone).collect());
        };
        shards.gathered_moments(self.group.as_ref())
    }

    /// The weights to publish or save, by checkpoint name, detached from autograd. They may
    /// share storage with the model: use them before the next step. With sharded weights,
    /// gathered from every rank (called on rank 0).
    pub fn weights(&self) -> Result<Vec<(String, Tensor)>> {
        let mut all = Vec::new();
        self.weight_buckets(&mut |bucket| all.extend(bucket))?;
        all.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(all)
    }

    /// [`Trainer::weights`] in buckets, each handed to `emit` as soon as it exists: with sharded
    /// weights one unit (the embedding, a decoder layer, ...) at a time, so the whole model is
    /// never gathered in one place, and a publisher sends one bucket while the next is gathered
    /// (docs/weight-sync.md, "From a sharded trainer"). Every bucket is gathered even when
    /// `emit` no longer wants them: the other ranks take part in each gather.
    pub fn weight_buckets(&self, emit: &mut dyn FnMut(Vec<(String, Tensor)>)) -> Result<()> {
        match &self.shards {
            Some(shards) if shards.full() => {
                self.command(WEIGHTS, &[])?;
                shards.gather_units(&self.params, &self.names, self.group.as_ref(), emit)
            }
            _ => {
                let detached = |(n, t): (&String, &Tensor)| (n.clone(), t.detach());
                emit(self.model.params().iter().map(detached).collect());
                Ok(())
            }
        }
    }

    /// Sharded weights: every rank writes its shards of the weights and moments into
    /// `dir/shards/` with no gather (docs/distributed.md, "Checkpoints"). Called on rank 0;
    /// returns once every rank's file is written and synced (or an error if any rank could not
    /// write its own), with the layout that puts them back together.
    pub fn save_shards(&self, dir: &Path) -> crate::model::Result<ShardLayout> {
        self.command(SAVE_SHARDS, dir.to_string_lossy().as_bytes())?;
        self.write_shard(dir)?;
        Ok(self.shards().layout(&self.names))
    }

    /// This rank's file of a sharded checkpoint in `dir`, written and synced; then whether every
    /// rank wrote its own: this rank's error, or the news that another failed.
    fn write_shard(&self, dir: &Path) -> crate::model::Result<()> {
        let shards = dir.join(SHARDS);
        let file = shards.join(shard_file_name(self.group.rank(), self.world_size()));
        let mine = std::fs::create_dir_all(&shards)
            .and_then(|()| {
                let tensors = self.shards().shard_tensors();
                Tensor::write_safetensors(&tensors, &file).map_err(std::io::Error::other)
            })
            .and_then(|()| std::fs::File::open(&file)?.sync_all())
            .map_err(|e| crate::model::Error::Input(format!("writing {}: {e}", file.display())));
        let failed = Tensor::from_slice(&[f32::from(u8::from(mine.is_err()))]);
        self.group.all_reduce(&failed, ReduceOp::Max)?;
        if mine.is_ok() && failed.double_value(&[0]) > 0.0 {
            let why =
                "another trainer rank could not write its checkpoint shard (its log says why)";
            return Err(crate::model::Error::Input(why.into()));
        }
        mine
    }

    /// Rank 0, at the end of a run: the followers return from [`Trainer::follow`].
    pub fn stop_followers(&self) -> Result<()> {
        self.command(STOP, &[])
    }

    /// A follower: does what rank 0 commands until it says stop; returns the steps taken.
    pub fn follow(&mut self) -> crate::model::Result<u64> {
        let group_timeout = self.group.timeout();
        loop {
            self.group.set_timeout(COMMAND_WAIT)?;
            let bytes = broadcast_bytes(self.group.as_ref(), None)?;
            self.group.set_timeout(group_timeout)?;
            let (&command, payload) = bytes.split_first().unwrap_or((&0, &[]));
            match command {
                STEP => {
                    let samples = decode(payload).map_err(|e| {
                        Error::Config(format!("rank 0 sent a batch this rank cannot read: {e}"))
                    })?;
                    self.step_on(&samples)?;
                }
                MOMENTS => _ = self.moments()?,
                STOP => return Ok(self.steps()),
                WEIGHTS => self.weight_buckets(&mut drop)?,
                SAVE_SHARDS => {
                    let dir = PathBuf::from(String::from_utf8_lossy(payload).into_owned());
                    if let Err(e) = self.write_shard(&dir) {
                        // Rank 0 says so too, and tries again or carries on without this
                        // checkpoint; this rank goes on with it.
                        tracing::warn!("a checkpoint shard was not written: {e}");
                    }
                }
                other => Err(Error::Config(format!(
                    "rank 0 sent an unknown command {other}"
                )))?,
            }
        }
    }

    /// Every rank takes rank 0's weights, and the steps and whole optimizer moments rank 0
    /// resumes from (`resume`, given on rank 0), once, on joining; each keeps its shard.
    fn sync_ranks(&mut self, resume: Option<(u64, Vec<(Tensor, Tensor)>)>) -> Result<()> {
        let group = self.group.as_ref();
        tch::no_grad(|| (self.params.iter()).try_for_each(|p| group.broadcast(&p.detach(), 0)))?;
        let (steps, moments) = resume.unwrap_or((0, Vec::new()));
        let head = Tensor::from_slice(&[steps as i64, !moments.is_empty() as i64]);
        group.broadcast(&head, 0)?;
        let (steps, has_moments) = (head.int64_value(&[0]) as u64, head.int64_value(&[1]) == 1);
        let mut all = Vec::new();
        for (i, p) in self.params.iter().enumerate().filter(|_| has_moments) {
            let (m, v) = match moments.get(i) {
                Some((m, v)) => (m.shallow_clone(), v.shallow_clone()),
                None => (p.zeros_like(), p.zeros_like()),
            };
            group.broadcast(&m, 0)?;
            group.broadcast(&v, 0)?;
            all.push((m, v));
        }
        self.restore(steps, all)
            .map_err(|e| Error::Config(e.to_string()))?;
        self.shard_weights();
        Ok(())
    }
}

/// A batch on the wire from rank 0 to the others: protobuf, declared with prost's derive.
#[derive(Clone, PartialEq, prost::Message)]
struct WireBatch {
    #[prost(message, repeated, tag = "1")]
    samples: Vec<WireSample>,
}

/// A [`Sample`] on the wire.
#[derive(Clone, PartialEq, prost::Message)]
struct WireSample {
    #[prost(int64, repeated, tag = "1")]
    tokens: Vec<i64>,
    #[prost(bytes = "vec", tag = "2")]
    loss_mask: Vec<u8>,
    #[prost(float, repeated, tag = "3")]
    behaviour_logprobs: Vec<f32>,
    #[prost(double, tag = "4")]
    advantage: f64,
    #[prost(message, optional, tag = "5")]
    token_advantages: Option<Floats>,
    /// The routing replay's shape (empty without one) and its expert ids.
    #[prost(int64, repeated, tag = "6")]
    replay_size: Vec<i64>,
    #[prost(int64, repeated, tag = "7")]
    replay: Vec<i64>,
    #[prost(message, repeated, tag = "8")]
    images: Vec<WireImage>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct Floats {
    #[prost(float, repeated, tag = "1")]
    values: Vec<f32>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct WireImage {
    #[prost(uint64, tag = "1")]
    offset: u64,
    #[prost(uint32, repeated, tag = "2")]
    grid_thw: Vec<u32>,
    #[prost(uint64, tag = "3")]
    patch_dim: u64,
    #[prost(float, repeated, tag = "4")]
    pixel_values: Vec<f32>,
}

/// A batch as bytes.
fn encode(samples: &[Sample]) -> Vec<u8> {
    let samples = samples.iter().map(|s| WireSample {
        tokens: s.tokens.clone(),
        loss_mask: s.loss_mask.clone(),
        behaviour_logprobs: s.behaviour_logprobs.clone(),
        advantage: s.advantage,
        token_advantages: s.token_advantages.clone().map(|values| Floats { values }),
        replay_size: s.replay.as_ref().map_or_else(Vec::new, Tensor::size),
        replay: (s.replay.as_ref()).map_or_else(Vec::new, |r| {
            Vec::try_from(&r.reshape([-1])).expect("int64 routing")
        }),
        images: (s.images.iter())
            .map(|i| WireImage {
                offset: i.offset as u64,
                grid_thw: i.image.grid_thw.to_vec(),
                patch_dim: i.image.patch_dim as u64,
                pixel_values: i.image.pixel_values.clone(),
            })
            .collect(),
    });
    prost::Message::encode_to_vec(&WireBatch {
        samples: samples.collect(),
    })
}

/// Why a batch from rank 0 cannot be read.
#[derive(Debug, thiserror::Error)]
enum BatchError {
    #[error(transparent)]
    Decode(#[from] prost::DecodeError),
    #[error("a sample's tokens, loss mask, logprobs and advantages differ in length")]
    Lengths,
    #[error("a routing replay of shape {0:?} has {1} expert ids")]
    Replay(Vec<i64>, usize),
    #[error("an image's grid is not 3 numbers, or its offset lies past its sample")]
    Image,
}

/// The inverse of [`encode`].
fn decode(bytes: &[u8]) -> Result<Vec<Sample>, BatchError> {
    let batch: WireBatch = prost::Message::decode(bytes)?;
    let sample = |s: WireSample| {
        let n = s.tokens.len();
        let advantages = s.token_advantages.as_ref().map_or(n, |a| a.values.len());
        if [s.loss_mask.len(), s.behaviour_logprobs.len(), advantages] != [n; 3] {
            return Err(BatchError::Lengths);
        }
        let numel =
            (s.replay_size.iter()).try_fold(1usize, |a, &d| a.checked_mul(d.try_into().ok()?));
        let replay = match (s.replay_size.is_empty(), numel) {
            (true, _) => None,
            (false, Some(numel)) if numel == s.replay.len() => {
                Some(Tensor::from_slice(&s.replay).view(s.replay_size.as_slice()))
            }
            _ => return Err(BatchError::Replay(s.replay_size, s.replay.len())),
        };
        let images = (s.images.into_iter())
            .map(|i| {
                let grid_thw = <[u32; 3]>::try_from(i.grid_thw).map_err(|_| BatchError::Image)?;
                if i.offset as usize > n {
                    return Err(BatchError::Image);
                }
                let (pixel_values, patch_dim) = (i.pixel_values, i.patch_dim as usize);
                Ok(ImageInput {
                    offset: i.offset as usize,
                    image: std::sync::Arc::new(ProcessedImage {
                        pixel_values,
                        grid_thw,
                        patch_dim,
                    }),
                })
            })
            .collect::<Result<_, _>>()?;
        Ok(Sample {
            tokens: s.tokens,
            loss_mask: s.loss_mask,
            behaviour_logprobs: s.behaviour_logprobs,
            advantage: s.advantage,
            token_advantages: s.token_advantages.map(|a| a.values),
            replay,
            images,
        })
    };
    batch.samples.into_iter().map(sample).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_cross_ranks_unchanged() {
        let samples = vec![
            Sample {
                tokens: vec![1, 2, 3],
                loss_mask: vec![0, 1, 1],
                behaviour_logprobs: vec![0.0, -1.5, -0.25],
                advantage: 0.75,
                token_advantages: Some(vec![0.0, 1.0, -2.0]),
                replay: Some(Tensor::from_slice(&[0i64, 1, 2, 3, 4, 5]).view([3, 1, 2])),
                images: vec![ImageInput {
                    offset: 1,
                    image: std::sync::Arc::new(ProcessedImage {
                        pixel_values: vec![0.5, -1.25, 3.0, 0.0],
                        grid_thw: [1, 2, 2],
                        patch_dim: 1,
                    }),
                }],
            },
            Sample {
                tokens: vec![9],
                loss_mask: vec![1],
                behaviour_logprobs: vec![-3.0],
                advantage: -1.0,
                token_advantages: None,
                replay: None,
                images: Vec::new(),
            },
        ];
        let bytes = encode(&samples);
        let back = decode(&bytes).unwrap();
        assert_eq!(back.len(), 2);
        for (a, b) in samples.iter().zip(&back) {
            assert_eq!(
                (
                    &a.tokens,
                    &a.loss_mask,
                    &a.behaviour_logprobs,
                    a.advantage,
                    &a.token_advantages
                ),
                (
                    &b.tokens,
                    &b.loss_mask,
                    &b.behaviour_logprobs,
                    b.advantage,
                    &b.token_advantages
                )
            );
            assert_eq!(a.images.len(), b.images.len());
            for (x, y) in a.images.iter().zip(&b.images) {
                assert_eq!((x.offset, &*x.image), (y.offset, &*y.image));
            }
            assert_eq!(a.replay.is_some(), b.replay.is_some());
            if let (Some(x), Some(y)) = (&a.replay, &b.replay) {
                assert!(x.equal(y));
            }
        }
        assert!(decode(&bytes[..bytes.len() - 1]).is_err());
        assert!(decode(&[bytes.as_slice(), &[0]].concat()).is_err());
    }
}
