//! The engine's async-side handle, its requests and events. One dedicated thread (the loop in
//! `scheduler`) owns the model, the running batch and the KV cache; everything else talks to it
//! through [`EngineHandle`] over a bounded command queue.
//!
//! Contract:
//! - Continuous batching: each step runs one packed forward over every running sequence (a
//!   prefill chunk for new ones, one token for decoding ones); a request that arrives joins the
//!   next step; a request whose client went away (its event receiver dropped) or that is aborted
//!   leaves the batch before the next step and its cache is freed.
//! - Token identity: the ids sampled here are the output; nothing is ever re-tokenized.
//! - Versions: every sampled token is labelled with the weight version it was sampled under.
//!   A weight swap clears the caches of in-flight sequences, which are then recomputed under the
//!   new weights from their tokens (prompt + generated so far), so each token after the swap is
//!   sampled from exactly the new policy (as AReaL's interruptible generation does).
//! - Pause: `keep` freezes the batch (new requests queue); `wait` stops admitting new requests and
//!   pauses once in-flight ones finish; `abort` ends in-flight ones with their partial output.
//!   While paused by `wait`/`abort`, new requests are refused with a retryable 503.
//! - LoRA adapters (docs/lora.md): any number served beside the model, loaded and unloaded at
//!   run time by name; a request names its adapter and joins the same batches as every other
//!   (each adapter adds its output on its own rows of one forward). An adapter unloaded while
//!   requests run with it stays until they finish; new requests can no longer name it.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use axum::http::StatusCode;
use tch::{Device, Kind, Tensor};
use tokio::sync::{mpsc, oneshot};

use super::api::{FinishReason, TokenLogprob};
use super::metrics::EngineMetrics;
use super::pool::{Fairness, PoolLimits};
use super::sampling::SamplingParams;
use super::weights::StagedUpdate;
use crate::model::lora::LoraConfig;
use crate::model::{CausalLm, ImageInput};
use crate::serve::ApiError;

mod scheduler;

use scheduler::Engine;

/// Commands queued to the engine thread. Bounded: a burst larger than this is refused with a
/// 429 at the door rather than buffered without limit (each command is one request or call).
const COMMAND_QUEUE: usize = 1024;

/// Engine limits, from the command line.
#[derive(Debug, Clone)]
pub struct EngineOptions {
    /// Sequences decoded together (vLLM's `max_num_seqs`).
    pub max_batch: usize,
    /// Prompt plus output tokens per sequence.
    pub max_model_len: usize,
    /// Prompt tokens processed per step; longer prompts are prefilled in chunks.
    pub max_prefill_tokens: usize,
    /// Requests accepted but not yet running; more are refused with 429.
    pub max_waiting: usize,
    /// Return `routed_experts` for MoE models.
    pub return_routed_experts: bool,
    /// Ids that end generation unless `ignore_eos` (from config/generation_config).
    pub eos_token_ids: Vec<i64>,
    /// libtorch intra-op threads of the engine thread; `None`: one for small models (hidden size
    /// under 512), all cores otherwise.
    pub threads: Option<usize>,
    /// Keep oneDNN-packed weights for the matmuls (CPU); `None`: for all but small models.
    pub packed_weights: Option<bool>,
    /// An engine of an `EnginePool`: runs' credentials accepted, adapters limited, batch slots
    /// shared fairly (docs/lora.md, "Engine pools").
    pub pool: Option<PoolLimits>,
}

impl EngineOptions {
    /// The defaults for a model of `cfg` (those of `moult engine`'s flags): its whole context,
    /// 2048 prompt tokens a step, 4096 requests waiting, its EOS ids, no routed experts;
    /// `max_batch` sequences decoded together.
    pub fn for_model(cfg: &crate::model::ModelConfig, max_batch: usize) -> Self {
        Self {
            max_batch,
            max_model_len: cfg.max_position_embeddings,
            max_prefill_tokens: 2048,
            max_waiting: 4096,
            return_routed_experts: false,
            eos_token_ids: cfg.eos_token_ids.clone(),
            threads: None,
            packed_weights: None,
            pool: None,
        }
    }
}

/// What the HTTP layer needs to know about the loaded model, without touching the engine thread.
#[derive(Debug, Clone)]
pub struct ModelInfo {
    pub name: String,
    pub vocab_size: usize,
    pub max_model_len: usize,
    pub kind: Kind,
    pub device: Device,
    /// Every weight: (checkpoint name, shape).
    pub params: Vec<(String, Vec<i64>)>,
    /// Vision-language models: how the engine takes images (`content_parts`).
    pub vision: Option<VisionInfo>,
    pub num_experts: Option<usize>,
    pub sparse_layers: usize,
    pub top_k: usize,
    pub pool: Option<PoolLimits>,
}

/// What the HTTP layer needs to turn a request's images into the model's input.
#[derive(Debug, Clone)]
pub struct VisionInfo {
    /// The model folder's `preprocessor_config.json`; `None` when it has none (images are then
    /// refused, saying so).
    pub processor: Option<crate::vision::ImageProcessorConfig>,
    pub image_token_id: i64,
    pub merge_size: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PauseMode {
    Keep,
    Wait,
    Abort,
}

impl PauseMode {
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "keep" => Some(Self::Keep),
            "wait" => Some(Self::Wait),
            "abort" => Some(Self::Abort),
            _ => None,
        }
    }
}

/// What a request's receiver gets, in order: its tokens, then exactly one of `Finished`,
/// `Rejected` or `Failed`.
#[derive(Debug)]
pub enum Event {
    Token {
        logprob: TokenLogprob,
        version: u64,
    },
    Finished {
        reason: FinishReason,
        routed_experts: Option<String>,
        /// With `prompt_logprobs` asked for and the whole prompt scored.
        prompt_logprobs: Option<crate::engine::api::PromptLogprobs>,
    },
    /// Refused before it ran (paused engine, duplicate id, full queue).
    Rejected(ApiError),
    /// The forward failed; the request ends with an internal error.
    Failed(String),
}

/// The LoRA adapter a request runs with (`model` naming a loaded adapter; docs/lora.md).
#[derive(Debug, Clone, Default)]
pub struct AdapterUse {
    /// Its slot; `None` for the served model itself.
    pub slot: Option<usize>,
    /// The pool run the request runs for, and the version of its adapter, which its tokens
    /// carry (docs/lora.md, "Engine pools").
    pub tenant: Option<(Arc<str>, u64)>,
}

/// A request handed to the engine.
#[derive(Debug)]
pub struct Job {
    pub id: String,
    pub prompt: Vec<i64>,
    pub params: SamplingParams,
    pub routed_experts_prompt_start: usize,
    /// The prompt's images, placed at their placeholders (vision-language models): kept for the
    /// whole request, since every step's positions depend on them and a recompute (after a
    /// weight update) encodes them again.
    pub images: Vec<ImageInput>,
    /// The LoRA adapter the request runs with.
    pub adapter: AdapterUse,
    /// Unbounded, yet bounded in practice: a request produces at most `max_tokens + 1` events,
    /// and the engine thread must never block on a slow client.
    pub events: mpsc::UnboundedSender<Event>,
}

enum Command {
    Generate(Job),
    /// The requests to abort, and the pool run whose they must be (none: anyone's).
    Abort(Vec<String>, Option<Arc<str>>),
    Pause(PauseMode, oneshot::Sender<()>),
    Resume(oneshot::Sender<()>),
    /// Applies the update and hands the (emptied) buffer back for reuse.
    ApplyWeights {
        update: StagedUpdate,
        version: u64,
        done: oneshot::Sender<(StagedUpdate, Result<(), String>)>,
    },
    /// Serves a LoRA adapter under `name` from the next step on.
    LoadAdapter {
        name: String,
        config: LoraConfig,
        weights: BTreeMap<String, Tensor>,
        done: oneshot::Sender<Result<(), ApiError>>,
    },
    /// Stops serving the adapter `name`; its requests in flight finish with it first.
    UnloadAdapter {
        name: String,
        done: oneshot::Sender<Result<(), ApiError>>,
    },
}

/// State shared with the HTTP layer for cheap reads.
#[derive(Debug, Default)]
pub struct EngineStatus {
    pub paused: AtomicBool,
    /// Set while paused or draining by `wait`/`abort`: new requests are refused.
    pub refusing: AtomicBool,
    pub weight_version: AtomicU64,
    /// The LoRA adapters served, by name: their slots (docs/lora.md).
    pub adapters: std::sync::Mutex<BTreeMap<String, usize>>,
    /// A pool engine's use by each run (docs/lora.md, "Engine pools").
    pub fairness: std::sync::Mutex<Fairness>,
}

/// The async side's handle on the engine thread.
#[derive(Debug, Clone)]
pub struct EngineHandle {
    tx: mpsc::Sender<Command>,
    pub status: Arc<EngineStatus>,
    pub info: Arc<ModelInfo>,
    pub(crate) metrics: EngineMetrics,
}

fn closed() -> ApiError {
    ApiError::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        "the engine thread has stopped",
    )
}

impl EngineHandle {
    /// Starts the engine thread on `model`.
    pub fn spawn(
        model: CausalLm,
        name: String,
        opts: EngineOptions,
    ) -> (Self, std::thread::JoinHandle<()>) {
        let cfg = model.config();
        let max_model_len = opts.max_model_len.min(cfg.max_position_embeddings);
        let info = ModelInfo {
            name,
            vocab_size: cfg.vocab_size,
            max_model_len,
            kind: model.kind(),
            device: model.device(),
            params: model
                .params()
                .iter()
                .map(|(n, t)| (n.clone(), t.size()))
                .collect(),
            vision: cfg.vl.as_ref().map(|vl| VisionInfo {
                processor: model.image_processor().cloned(),
                image_token_id: vl.image_token_id,
                merge_size: vl.vision.spatial_merge_size,
            }),
            num_experts: cfg.moe.as_ref().map(|m| m.num_experts),
            sparse_layers: cfg.num_sparse_layers(),
            top_k: cfg.moe.as_ref().map_or(0, |m| m.num_experts_per_tok),
            pool: opts.pool,
        };
        let (tx, rx) = mpsc::channel(COMMAND_QUEUE);
        let status = Arc::new(EngineStatus::default());
        let metrics = EngineMetrics::default();
        let handle = Self {
            tx,
            status: status.clone(),
            info: Arc::new(info),
            metrics: metrics.clone(),
        };
        let opts = EngineOptions {
            max_model_len,
            ..opts
        };
        let engine = Engine::new(model, opts, rx, status, metrics);
        let thread = std::thread::Builder::new()
            .name("moult-engine".into())
            .spawn(move || engine.run())
            .expect("spawn the engine thread");
        (handle, thread)
    }

    /// A handle whose engine thread has ended (its command queue closed, as a panic leaves it),
    /// for tests of the HTTP layer.
    #[cfg(test)]
    pub(crate) fn stopped(info: ModelInfo) -> Self {
        let (tx, _rx) = mpsc::channel(1);
        Self {
            tx,
            status: Arc::default(),
            info: Arc::new(info),
            metrics: EngineMetrics::default(),
        }
    }

    /// Whether the engine thread still runs (a panic in it, such as libtorch running out of
    /// memory, ends it and drops its command queue).
    pub fn alive(&self) -> bool {
        !self.tx.is_closed()
    }

    fn send(&self, cmd: Command) -> Result<(), ApiError> {
        self.tx.try_send(cmd).map_err(|e| match e {
            mpsc::error::TrySendError::Full(_) => ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "the engine's command queue is full; retry later",
            ),
            mpsc::error::TrySendError::Closed(_) => closed(),
        })
    }

    /// Queues a generation; its events arrive on the returned receiver. Dropping the receiver
    /// cancels the request.
    pub fn generate(
        &self,
        id: String,
        prompt: Vec<i64>,
        params: SamplingParams,
        routed_experts_prompt_start: usize,
    ) -> Result<mpsc::UnboundedReceiver<Event>, ApiError> {
        self.generate_with_images(
            id,
            prompt,
            Vec::new(),
            params,
            routed_experts_prompt_start,
            AdapterUse::default(),
        )
    }

    /// [`EngineHandle::generate`] of a prompt with images, placed at their placeholders
    /// ([`CausalLm::place_images`]).
    pub fn generate_with_images(
        &self,
        id: String,
        prompt: Vec<i64>,
        images: Vec<ImageInput>,
        params: SamplingParams,
        routed_experts_prompt_start: usize,
        adapter: AdapterUse,
    ) -> Result<mpsc::UnboundedReceiver<Event>, ApiError> {
        if self.status.refusing.load(Ordering::Acquire) {
            return Err(ApiError::unavailable(
                "the engine is paused; retry after it resumes",
            ));
        }
        let (events, rx) = mpsc::unbounded_channel();
        self.send(Command::Generate(Job {
            id,
            prompt,
            params,
            routed_experts_prompt_start,
            images,
            adapter,
            events,
        }))?;
        Ok(rx)
    }

    /// The names of the LoRA adapters served.
    pub fn adapter_names(&self) -> Vec<String> {
        let adapters = self.status.adapters.lock().expect("adapters");
        adapters.keys().cloned().collect()
    }

    /// The slot of the LoRA adapter served as `name`, if one is.
    pub fn adapter(&self, name: &str) -> Option<usize> {
        self.status
            .adapters
            .lock()
            .expect("adapters")
            .get(name)
            .copied()
    }

    /// Serves the adapter `weights` (PEFT names) of shape `config` as `name` (docs/lora.md):
    /// requests naming it in `model` run with it, in the same batches as every other.
    pub async fn load_adapter(
        &self,
        name: String,
        config: LoraConfig,
        weights: BTreeMap<String, Tensor>,
    ) -> Result<(), ApiError> {
        let (done, wait) = oneshot::channel();
        self.send(Command::LoadAdapter {
            name,
            config,
            weights,
            done,
        })?;
        wait.await.map_err(|_| closed())?
    }

    /// Stops serving the adapter `name` to new requests; those in flight finish with it.
    pub async fn unload_adapter(&self, name: String) -> Result<(), ApiError> {
        let (done, wait) = oneshot::channel();
        self.send(Command::UnloadAdapter { name, done })?;
        wait.await.map_err(|_| closed())?
    }

    /// Aborts the requests `request_ids`; with `tenant`, only those of that pool run (a run on
    /// an EnginePool stops its own requests, never another's).
    pub fn abort(
        &self,
        request_ids: Vec<String>,
        tenant: Option<Arc<str>>,
    ) -> Result<(), ApiError> {
        self.send(Command::Abort(request_ids, tenant))
    }

    /// Pauses; returns once the pause took effect (for `wait`, once in-flight requests finished).
    pub async fn pause(&self, mode: PauseMode) -> Result<(), ApiError> {
        if mode != PauseMode::Keep {
            self.status.refusing.store(true, Ordering::Release);
        }
        let (done, wait) = oneshot::channel();
        self.send(Command::Pause(mode, done))?;
        wait.await.map_err(|_| closed())
    }

    pub async fn resume(&self) -> Result<(), ApiError> {
        let (done, wait) = oneshot::channel();
        self.send(Command::Resume(done))?;
        wait.await.map_err(|_| closed())
    }

    /// Copies a staged update into the model between two steps and sets the weight version.
    /// Returns the update's buffer, emptied, for the next one.
    pub async fn apply_weights(
        &self,
        update: StagedUpdate,
        version: u64,
    ) -> Result<StagedUpdate, ApiError> {
        let (done, wait) = oneshot::channel();
        self.send(Command::ApplyWeights {
            update,
            version,
            done,
        })?;
        let (mut update, result) = wait.await.map_err(|_| closed())?;
        update.clear();
        result.map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e))?;
        Ok(update)
    }
}
