//! The engine thread's loop: admission, one packed forward per step, sampling, pause states and
//! weight swaps (the contract is in the parent module's documentation).

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::http::StatusCode;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use tch::{Device, Kind, Tensor};
use tokio::sync::{mpsc, oneshot};

use super::{Command, EngineOptions, EngineStatus, Event, Job, PauseMode};
use crate::engine::api::{FinishReason, PromptLogprobs, RankedLogprob, TokenLogprob, TopLogprob};
use crate::engine::metrics::EngineMetrics;
use crate::engine::npy::encode_routed_experts;
use crate::engine::sampling::sample;
use crate::engine::weights::StagedUpdate;
use crate::model::lora::LoraConfig;
use crate::model::{CausalLm, KvCache, LogitsFor, SeqInput};
use crate::serve::ApiError;

enum PauseState {
    Running,
    /// `wait`: finishing accepted requests; the senders are answered once none are left.
    Draining(Vec<oneshot::Sender<()>>),
    Paused(PauseMode),
}

struct Sequence {
    job: Job,
    /// Prompt followed by every sampled token.
    tokens: Vec<i64>,
    prompt_len: usize,
    rng: ChaCha8Rng,
    /// Routed expert ids, `layers * top_k` per position, for positions `0..routed_len`; the
    /// first capture of a position is kept (the version that produced it).
    routed: Vec<u16>,
    routed_len: usize,
    /// With `prompt_logprobs`: row `p` scores prompt token `p + 1`, for rows `0..scored.len()`
    /// (the first computation of a row is kept, as for routed experts).
    scored: Vec<ScoredRow>,
}

/// A prompt token's logprob under the raw distribution of the position before it.
struct ScoredRow {
    token: i64,
    logprob: f32,
    /// 1 + how many tokens are more likely.
    rank: u64,
    /// The most likely tokens, best first, as many as asked for.
    top: Vec<(i64, f32)>,
}

/// Float32 logits a step may hold for scoring prompt tokens (256 MiB): a scoring request's
/// prefill chunk is cut to the rows that fit.
const SCORE_LOGITS: usize = 1 << 26;

impl Sequence {
    fn output_len(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    /// The prompt rows still to score, if the request asked for prompt logprobs.
    fn scoring(&self) -> bool {
        self.job.params.prompt_logprobs.is_some() && self.scored.len() + 1 < self.prompt_len
    }

    /// The prompt rows a forward over `n` tokens from position `start` scores: those not scored
    /// yet (the last prompt row predicts the first output token and is not a prompt row's).
    fn rows_to_score(&self, start: usize, n: usize) -> std::ops::Range<usize> {
        if n == 0 || !self.scoring() {
            return 0..0;
        }
        self.scored.len().max(start)..(start + n).min(self.prompt_len - 1)
    }

    /// `prompt_logprobs` as vLLM reports them, once every prompt row is scored.
    fn prompt_logprobs(&self) -> Option<PromptLogprobs> {
        self.job.params.prompt_logprobs?;
        if self.scoring() {
            return None;
        }
        let rows = self.scored.iter().map(|row| {
            let mut entries: std::collections::BTreeMap<i64, RankedLogprob> = row
                .top
                .iter()
                .enumerate()
                .map(|(j, &(token, logprob))| {
                    let entry = RankedLogprob {
                        logprob,
                        rank: Some(j as u64 + 1),
                        decoded_token: None,
                    };
                    (token, entry)
                })
                .collect();
            entries.insert(
                row.token,
                RankedLogprob {
                    logprob: row.logprob,
                    rank: Some(row.rank),
                    decoded_token: None,
                },
            );
            Some(entries)
        });
        Some(std::iter::once(None).chain(rows).collect())
    }
}

pub(super) struct Engine {
    model: CausalLm,
    opts: EngineOptions,
    rx: mpsc::Receiver<Command>,
    status: Arc<EngineStatus>,
    metrics: EngineMetrics,
    waiting: VecDeque<Job>,
    /// Running sequences; `running[i]` owns slot `i` of `cache` (both stay compact the same way:
    /// removing `i` moves the last into `i`), so a step's batch is in slot order.
    running: Vec<Sequence>,
    cache: KvCache,
    pause: PauseState,
    version: u64,
    /// Slots of LoRA adapters unloaded while requests still ran with them: dropped once none
    /// does.
    unloading: Vec<usize>,
}

impl Engine {
    pub(super) fn new(
        model: CausalLm,
        opts: EngineOptions,
        rx: mpsc::Receiver<Command>,
        status: Arc<EngineStatus>,
        metrics: EngineMetrics,
    ) -> Self {
        // Positions per slot grow by doubling as sequences need them.
        let cache = model.new_cache(256.min(opts.max_model_len));
        Self {
            model,
            opts,
            rx,
            status,
            metrics,
            waiting: VecDeque::new(),
            running: Vec::new(),
            cache,
            pause: PauseState::Running,
            version: 0,
            unloading: Vec::new(),
        }
    }

    pub(super) fn run(mut self) {
        // Small models (hidden size under 512) are dominated by per-operation overheads: one
        // intra-op thread and dense weights (oneDNN costs ~30 µs more per call). Larger ones
        // gain from both.
        let small = self.model.config().hidden_size < 512;
        let threads = self
            .opts
            .threads
            .unwrap_or_else(|| crate::model::compute_threads(self.model.config()));
        // Thread-local for OpenMP: this sets the engine thread's own pool.
        tch::set_num_threads(threads as i32);
        let packed = self.opts.packed_weights.unwrap_or(!small) && self.model.pack_for_inference();
        tracing::info!(threads, packed, "engine compute settings");
        loop {
            let idle = matches!(self.pause, PauseState::Paused(_))
                || (self.running.is_empty() && self.waiting.is_empty());
            if idle {
                match self.rx.blocking_recv() {
                    Some(cmd) => self.handle(cmd),
                    None => break,
                }
            }
            while let Ok(cmd) = self.rx.try_recv() {
                self.handle(cmd);
            }
            if matches!(self.pause, PauseState::Paused(_)) {
                self.publish();
                continue;
            }
            self.drop_cancelled();
            self.admit();
            if !self.running.is_empty() {
                if let Err(e) = self.step() {
                    tracing::error!(error = %e, "forward step failed; failing the running requests");
                    while !self.running.is_empty() {
                        let seq = self.remove(0);
                        let _ = seq.job.events.send(Event::Failed(e.to_string()));
                    }
                }
            }
            self.check_drained();
            if !self.unloading.is_empty() {
                self.drop_unused_adapters();
            }
            self.publish();
        }
        tracing::info!("engine thread exiting: every handle was dropped");
    }

    fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Generate(job) => self.accept(job),
            Command::Abort(ids, tenant) => {
                let ids: std::collections::HashSet<String> = ids.into_iter().collect();
                let ours = |job: &Job| match (&tenant, &job.adapter.tenant) {
                    (None, _) => true,
                    (Some(t), Some((run, _))) => run == t,
                    (Some(_), None) => false,
                };
                self.finish_where(FinishReason::Abort, |job| {
                    ids.contains(&job.id) && ours(job)
                });
            }
            Command::Pause(mode, done) => match mode {
                PauseMode::Keep => self.enter_pause(PauseMode::Keep, done),
                PauseMode::Abort => {
                    self.finish_where(FinishReason::Abort, |_| true);
                    self.enter_pause(PauseMode::Abort, done);
                }
                PauseMode::Wait => {
                    if self.running.is_empty() && self.waiting.is_empty() {
                        self.enter_pause(PauseMode::Wait, done);
                    } else if let PauseState::Draining(waiters) = &mut self.pause {
                        waiters.push(done);
                    } else {
                        self.pause = PauseState::Draining(vec![done]);
                        self.status.refusing.store(true, Ordering::Release);
                    }
                }
            },
            Command::Resume(done) => {
                self.status.refusing.store(false, Ordering::Release);
                self.status.paused.store(false, Ordering::Release);
                // A `wait` pause still draining is cancelled: its callers are released.
                if let PauseState::Draining(waiters) =
                    std::mem::replace(&mut self.pause, PauseState::Running)
                {
                    waiters.into_iter().for_each(|w| {
                        let _ = w.send(());
                    });
                }
                let _ = done.send(());
            }
            Command::ApplyWeights {
                update,
                version,
                done,
            } => {
                let result = self.apply_weights(&update, version);
                let _ = done.send((update, result));
            }
            Command::LoadAdapter {
                name,
                config,
                weights,
                done,
            } => {
                let _ = done.send(self.load_adapter(name, &config, weights));
            }
            Command::UnloadAdapter { name, done } => {
                let removed = self.status.adapters.lock().expect("adapters").remove(&name);
                let _ = done.send(match removed {
                    Some(slot) => {
                        self.unloading.push(slot);
                        self.drop_unused_adapters();
                        Ok(())
                    }
                    None => Err(ApiError::new(
                        StatusCode::NOT_FOUND,
                        format!("The lora adapter '{name}' cannot be found."),
                    )
                    .with_param("lora_name")),
                });
            }
        }
    }

    /// Serves an adapter as `name` in a slot no adapter (loaded or unloading) holds.
    fn load_adapter(
        &mut self,
        name: String,
        config: &LoraConfig,
        weights: BTreeMap<String, Tensor>,
    ) -> Result<(), ApiError> {
        let mut names = self.status.adapters.lock().expect("adapters");
        if names.contains_key(&name) {
            let msg = format!("The lora adapter '{name}' has already been loaded.");
            return Err(ApiError::bad_request(msg).with_param("lora_name"));
        }
        let taken =
            |slot: &usize| names.values().any(|s| s == slot) || self.unloading.contains(slot);
        let slot = (1..).find(|s| !taken(s)).expect("a free slot");
        self.model
            .load_adapter(slot, config, weights)
            .map_err(|e| ApiError::bad_request(e.to_string()).with_param("lora_path"))?;
        names.insert(name, slot);
        Ok(())
    }

    /// Counts `tokens` computed for `job`'s pool run, if it has one.
    fn charge(&self, job: &Job, tokens: u64) {
        if let Some((run, _)) = &job.adapter.tenant {
            self.status
                .fairness
                .lock()
                .expect("fairness")
                .charge(run, tokens);
        }
    }

    /// Drops the unloaded adapters no request runs with any more.
    fn drop_unused_adapters(&mut self) {
        let used = |slot: usize| {
            (self.running.iter().map(|s| &s.job))
                .chain(&self.waiting)
                .any(|j| j.adapter.slot == Some(slot))
        };
        let (drop, keep): (Vec<usize>, Vec<usize>) =
            self.unloading.iter().partition(|&&slot| !used(slot));
        for slot in drop {
            self.model.drop_adapter(slot);
        }
        self.unloading = keep;
    }

    fn enter_pause(&mut self, mode: PauseMode, done: oneshot::Sender<()>) {
        // The shared flags first: whoever is told "paused" must also read it.
        self.status
            .refusing
            .store(mode != PauseMode::Keep, Ordering::Release);
        self.status.paused.store(true, Ordering::Release);
        if let PauseState::Draining(waiters) =
            std::mem::replace(&mut self.pause, PauseState::Paused(mode))
        {
            waiters.into_iter().for_each(|w| {
                let _ = w.send(());
            });
        }
        let _ = done.send(());
    }

    fn check_drained(&mut self) {
        if matches!(self.pause, PauseState::Draining(_))
            && self.running.is_empty()
            && self.waiting.is_empty()
        {
            let (done, _) = oneshot::channel();
            self.enter_pause(PauseMode::Wait, done);
        }
    }

    fn accept(&mut self, job: Job) {
        let refuse = |job: Job, err: ApiError| {
            let _ = job.events.send(Event::Rejected(err));
        };
        match self.pause {
            PauseState::Paused(PauseMode::Wait | PauseMode::Abort) | PauseState::Draining(_) => {
                return refuse(
                    job,
                    ApiError::unavailable("the engine is paused; retry after it resumes"),
                );
            }
            _ => {}
        }
        if self
            .running
            .iter()
            .map(|s| &s.job.id)
            .chain(self.waiting.iter().map(|j| &j.id))
            .any(|id| *id == job.id)
        {
            let msg = format!("request_id `{}` is already in flight", job.id);
            return refuse(
                job,
                ApiError::new(StatusCode::CONFLICT, msg).with_param("request_id"),
            );
        }
        // Its adapter was unloaded between the request's check and here.
        if let Some(slot) = job.adapter.slot {
            let names = self.status.adapters.lock().expect("adapters");
            if !names.values().any(|&s| s == slot) {
                drop(names);
                let msg = "the request's LoRA adapter was unloaded".to_string();
                return refuse(
                    job,
                    ApiError::new(StatusCode::NOT_FOUND, msg).with_param("model"),
                );
            }
        }
        if self.waiting.len() >= self.opts.max_waiting {
            let msg = format!(
                "{} requests are already waiting; retry later",
                self.waiting.len()
            );
            return refuse(job, ApiError::new(StatusCode::TOO_MANY_REQUESTS, msg));
        }
        self.waiting.push_back(job);
    }

    /// Starts waiting requests while the batch has room: in order, or on a pool engine, the
    /// next request of the run with the least recent usage (docs/lora.md, "Engine pools").
    fn admit(&mut self) {
        while self.running.len() < self.opts.max_batch {
            let next = match self.opts.pool {
                None => Some(0).filter(|_| !self.waiting.is_empty()),
                Some(_) => {
                    let runs = self
                        .waiting
                        .iter()
                        .map(|j| j.adapter.tenant.as_ref().map(|t| &t.0));
                    self.status.fairness.lock().expect("fairness").next(runs)
                }
            };
            let Some(job) = next.and_then(|i| self.waiting.remove(i)) else {
                break;
            };
            if job.events.is_closed() {
                continue;
            }
            self.charge(&job, job.prompt.len() as u64);
            self.metrics.prompt_tokens.inc_by(job.prompt.len() as u64);
            let rng = match job.params.seed {
                Some(seed) => ChaCha8Rng::seed_from_u64(seed),
                None => ChaCha8Rng::from_entropy(),
            };
            let slot = self.cache.alloc();
            debug_assert_eq!(slot, self.running.len());
            self.running.push(Sequence {
                tokens: job.prompt.clone(),
                prompt_len: job.prompt.len(),
                rng,
                routed: Vec::new(),
                routed_len: 0,
                scored: Vec::new(),
                job,
            });
        }
    }

    /// Takes a sequence out of the batch and frees its cache slot; the last sequence and its
    /// slot both move into the gap.
    fn remove(&mut self, index: usize) -> Sequence {
        let seq = self.running.swap_remove(index);
        self.cache.free(index);
        debug_assert_eq!(self.cache.used(), self.running.len());
        seq
    }

    fn drop_cancelled(&mut self) {
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].job.events.is_closed() {
                tracing::debug!(request = %self.running[i].job.id, "dropped: the client went away");
                self.remove(i);
                // Counted as vLLM counts a disconnected client: an aborted request.
                self.metrics.finished(FinishReason::Abort);
            } else {
                i += 1;
            }
        }
        let before = self.waiting.len();
        self.waiting.retain(|j| !j.events.is_closed());
        for _ in self.waiting.len()..before {
            self.metrics.finished(FinishReason::Abort);
        }
    }

    /// Ends every running or waiting request that `matches`, with its partial output.
    fn finish_where(&mut self, reason: FinishReason, matches: impl Fn(&Job) -> bool) {
        let mut i = 0;
        while i < self.running.len() {
            if matches(&self.running[i].job) {
                let seq = self.remove(i);
                self.finish(seq, reason);
            } else {
                i += 1;
            }
        }
        let waiting = std::mem::take(&mut self.waiting);
        for job in waiting {
            if matches(&job) {
                self.metrics.finished(reason);
                let _ = job.events.send(Event::Finished {
                    reason,
                    routed_experts: None,
                    prompt_logprobs: None,
                });
            } else {
                self.waiting.push_back(job);
            }
        }
    }

    fn finish(&self, seq: Sequence, reason: FinishReason) {
        self.metrics.finished(reason);
        let routed_experts = self.routed_experts_of(&seq);
        let prompt_logprobs = seq.prompt_logprobs();
        let _ = seq.job.events.send(Event::Finished {
            reason,
            routed_experts,
            prompt_logprobs,
        });
    }

    fn routed_experts_of(&self, seq: &Sequence) -> Option<String> {
        let moe = self.model.config().moe.as_ref()?;
        if !self.opts.return_routed_experts {
            return None;
        }
        let layers = self.model.config().num_sparse_layers();
        let row = layers * moe.num_experts_per_tok;
        // vLLM's shape: every position that went through the model, i.e. all tokens but the last.
        let end = seq.routed_len.min(seq.tokens.len().saturating_sub(1));
        let start = seq.job.routed_experts_prompt_start.min(end);
        Some(encode_routed_experts(
            &seq.routed[start * row..end * row],
            end - start,
            layers,
            moe.num_experts_per_tok,
            moe.num_experts,
        ))
    }

    fn apply_weights(&mut self, update: &StagedUpdate, version: u64) -> Result<(), String> {
        // A version alone (`/update_weight_version` after a reload) changes no weight.
        if !update.is_empty() {
            update.apply(self.model.params())?;
            self.model.refresh_packed();
            // Recompute in-flight sequences under the new weights from their tokens.
            for slot in 0..self.running.len() {
                self.cache.clear(slot);
            }
        }
        self.version = version;
        self.status.weight_version.store(version, Ordering::Release);
        tracing::info!(version, tensors = update.len(), "weights updated");
        Ok(())
    }

    /// One packed forward over the running batch, then sampling for every sequence whose
    /// pending tokens were all consumed.
    fn step(&mut self) -> crate::model::Result<()> {
        let mut budget = self.opts.max_prefill_tokens;
        let vocab = self.model.config().vocab_size;
        let score_cap = (SCORE_LOGITS / vocab.max(1)).max(1);
        // Sequence i is in cache slot i.
        let starts: Vec<usize> = (0..self.running.len())
            .map(|slot| self.cache.len(slot))
            .collect();
        let plan: Vec<usize> = self
            .running
            .iter()
            .zip(&starts)
            .map(|(s, &start)| {
                let pending = s.tokens.len() - start;
                if pending <= 1 {
                    return pending;
                }
                let mut n = pending.min(budget);
                if s.scoring() {
                    n = n.min(score_cap);
                }
                budget -= n;
                n
            })
            .collect();
        let inputs: Vec<SeqInput> = self
            .running
            .iter()
            .zip(plan.iter().zip(&starts))
            .enumerate()
            .filter(|(_, (_, (&n, _)))| n > 0)
            .map(|(slot, (s, (&n, &start)))| SeqInput {
                tokens: &s.tokens[start..start + n],
                slot: Some(slot),
                replay: None,
                images: &s.job.images,
            })
            .collect();
        if inputs.is_empty() {
            return Ok(());
        }
        // Rows of the packed batch: each sequence's last (to sample from), then the prompt
        // rows of this chunk that requests asked to score, with the tokens they predict.
        let (mut rows, mut targets, mut top) = (Vec::new(), Vec::new(), 0usize);
        let mut offset = 0usize;
        for &n in plan.iter().filter(|&&n| n > 0) {
            rows.push((offset + n - 1) as i64);
            offset += n;
        }
        let sampled_rows = rows.len();
        let mut offset = 0usize;
        for (i, seq) in self.running.iter().enumerate() {
            let scored = seq.rows_to_score(starts[i], plan[i]);
            if !scored.is_empty() {
                top = top.max(seq.job.params.prompt_logprobs.unwrap_or(0));
            }
            for p in scored {
                rows.push((offset + p - starts[i]) as i64);
                targets.push(seq.tokens[p + 1]);
            }
            offset += plan[i];
        }
        let logits_for = if targets.is_empty() {
            LogitsFor::Last
        } else {
            LogitsFor::Rows(&rows)
        };
        // Each sequence's LoRA adapter (`None`: the served model itself).
        let adapters: Vec<Option<usize>> = (self.running.iter().zip(&plan))
            .filter(|(_, &n)| n > 0)
            .map(|(s, _)| s.job.adapter.slot)
            .collect();
        let out = tch::no_grad(|| {
            self.model
                .forward_adapters(&inputs, &adapters, Some(&mut self.cache), logits_for)
        })?;
        drop(inputs);
        let mut scores = if targets.is_empty() {
            Vec::new()
        } else {
            let scored = out
                .logits
                .narrow(0, sampled_rows as i64, targets.len() as i64);
            score_rows(&scored, &targets, top)?
        }
        .into_iter();
        let logits = out
            .logits
            .narrow(0, 0, sampled_rows as i64)
            .to_kind(Kind::Float)
            .to_device(Device::Cpu);
        let logits: Vec<f32> = Vec::try_from(logits.reshape([-1]))?;
        let routed: Option<Vec<i64>> = match (&out.routed_experts, self.opts.return_routed_experts)
        {
            (Some(r), true) => Some(Vec::try_from(r.to_device(Device::Cpu).reshape([-1]))?),
            _ => None,
        };
        let row_len = self.model.config().num_sparse_layers()
            * self
                .model
                .config()
                .moe
                .as_ref()
                .map_or(0, |m| m.num_experts_per_tok);

        let mut finished = Vec::new();
        let (mut row, mut packed_offset) = (0usize, 0usize);
        for (i, seq) in self.running.iter_mut().enumerate() {
            let n = plan[i];
            if n == 0 {
                continue;
            }
            if let Some(routed) = &routed {
                // Keep the first capture of each position.
                for pos in starts[i]..starts[i] + n {
                    if pos == seq.routed_len {
                        let at = (packed_offset + pos - starts[i]) * row_len;
                        seq.routed
                            .extend(routed[at..at + row_len].iter().map(|&e| e as u16));
                        seq.routed_len += 1;
                    }
                }
            }
            for _ in seq.rows_to_score(starts[i], n) {
                let mut scored = scores.next().expect("a score per scored row");
                scored
                    .top
                    .truncate(seq.job.params.prompt_logprobs.unwrap_or(0));
                seq.scored.push(scored);
            }
            packed_offset += n;
            let row_logits = &logits[row * vocab..(row + 1) * vocab];
            row += 1;
            if starts[i] + n < seq.tokens.len() {
                continue; // a prefill chunk: more prompt to go before sampling
            }
            let params = &seq.job.params;
            let masked;
            let row_logits = if seq.output_len() < params.min_tokens {
                let mut m = row_logits.to_vec();
                for &t in params.stop_token_ids.iter().chain(&self.opts.eos_token_ids) {
                    m[t as usize] = f32::NEG_INFINITY;
                }
                masked = m;
                &masked[..]
            } else {
                row_logits
            };
            let s = match sample(row_logits, params, &mut seq.rng) {
                Ok(s) => s,
                Err(e) => {
                    // No distribution to sample (NaN or +inf logits): the request fails rather
                    // than report a token with a NaN logprob.
                    tracing::error!(request = %seq.job.id, error = %e, "sampling failed");
                    finished.push((i, Err(e.to_string())));
                    continue;
                }
            };
            seq.tokens.push(s.token);
            self.metrics.generation_tokens.inc();
            if let Some((run, _)) = &seq.job.adapter.tenant {
                self.status
                    .fairness
                    .lock()
                    .expect("fairness")
                    .charge(run, 1);
            }
            let logprob = TokenLogprob {
                token_id: s.token,
                logprob: s.logprob,
                top_logprobs: s
                    .top
                    .into_iter()
                    .map(|(token_id, logprob)| TopLogprob { token_id, logprob })
                    .collect(),
            };
            // A pool run's token carries its adapter's version (docs/lora.md, "Engine pools").
            let version = seq
                .job
                .adapter
                .tenant
                .as_ref()
                .map_or(self.version, |t| t.1);
            let _ = seq.job.events.send(Event::Token { logprob, version });
            let out_len = seq.output_len();
            let stopped = out_len >= params.min_tokens
                && (params.stop_token_ids.contains(&s.token)
                    || (!params.ignore_eos && self.opts.eos_token_ids.contains(&s.token)));
            if stopped {
                finished.push((i, Ok(FinishReason::Stop)));
            } else if out_len >= params.max_tokens || seq.tokens.len() >= self.opts.max_model_len {
                finished.push((i, Ok(FinishReason::Length)));
            }
        }
        for (i, end) in finished.into_iter().rev() {
            let seq = self.remove(i);
            match end {
                Ok(reason) => self.finish(seq, reason),
                Err(message) => {
                    let _ = seq.job.events.send(Event::Failed(message));
                }
            }
        }
        Ok(())
    }

    fn publish(&self) {
        self.metrics.running.set(self.running.len() as i64);
        self.metrics.waiting.set(self.waiting.len() as i64);
        let used = self.cache.total_len();
        let budget = (self.opts.max_batch * self.opts.max_model_len).max(1);
        self.metrics.set_kv_usage(used as f64 / budget as f64);
    }
}

/// Each row's logprob of its target token under the raw distribution (temperature 1, as vLLM's
/// prompt logprobs), its rank, and the `top` most likely tokens.
fn score_rows(logits: &tch::Tensor, targets: &[i64], top: usize) -> tch::Result<Vec<ScoredRow>> {
    let logprobs = logits.to_kind(Kind::Float).log_softmax(-1, Kind::Float);
    let target = tch::Tensor::from_slice(targets)
        .to_device(logprobs.device())
        .unsqueeze(1);
    let chosen = logprobs.gather(1, &target, false);
    let ranks = logprobs
        .gt_tensor(&chosen)
        .sum_dim_intlist(1, false, Kind::Int64)
        + 1;
    let chosen: Vec<f32> = Vec::try_from(chosen.squeeze_dim(1).to_device(Device::Cpu))?;
    let ranks: Vec<i64> = Vec::try_from(ranks.to_device(Device::Cpu))?;
    let (top_values, top_ids): (Vec<f32>, Vec<i64>) = if top > 0 {
        let (values, ids) = logprobs.topk(top as i64, -1, true, true);
        (
            Vec::try_from(values.to_device(Device::Cpu).reshape([-1]))?,
            Vec::try_from(ids.to_device(Device::Cpu).reshape([-1]))?,
        )
    } else {
        (Vec::new(), Vec::new())
    };
    Ok((0..targets.len())
        .map(|r| ScoredRow {
            token: targets[r],
            logprob: chosen[r],
            rank: ranks[r] as u64,
            top: (r * top..(r + 1) * top)
                .map(|j| (top_ids[j], top_values[j]))
                .collect(),
        })
        .collect())
}
