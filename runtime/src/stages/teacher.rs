//! A served teacher for on-policy distillation (`algorithm.teacher.replicas`): engines of its
//! own, the built-in engine or vLLM, score every token of a batch before the trainer learns from
//! it, so the teacher need not fit beside the trainer (docs/run.md, "On-policy distillation").
//!
//! Each trained segment goes to one teacher engine as a non-streaming generate request with
//! `prompt_logprobs: 0`: the answer holds the teacher's logprob of every token given the ones
//! before ([`crate::engine::client::EngineClient::prompt_logprobs`]). Prompt logprobs are of the
//! raw distribution (temperature 1) in vLLM, so a served teacher needs `rollout.temperature: 1`
//! (checked with the manifest). Segments go to the engine with the fewest tokens outstanding; an
//! engine that cannot be reached is marked down and the segment tried on another.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use futures::{StreamExt, TryStreamExt};

use super::{Stage, StepBatch};
use crate::engine::client::EngineError;
use crate::error::{Result, RunError};
use crate::rollout::trained_segments;
use crate::router::{Engine, EnginePool};

/// Tries per segment before the batch's scoring fails.
const ATTEMPTS: usize = 4;
/// Segments scored at once over all teacher engines.
const IN_FLIGHT: usize = 64;
/// How long a segment waits for a teacher engine to be up (they may still be loading).
const ENGINE_PATIENCE: Duration = Duration::from_secs(60);

/// What scoring a batch took, for the step's metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TeacherStats {
    /// Tokens scored (every token of every trained segment).
    pub tokens: usize,
    /// Wall time of scoring the batch.
    pub seconds: f64,
}

/// The teacher's engines.
#[derive(Debug, Clone)]
pub struct Teacher {
    pool: Arc<EnginePool>,
}

impl Teacher {
    /// A teacher over `pool`, whose health the caller keeps checked (the router's checker).
    pub fn new(pool: Arc<EnginePool>) -> Self {
        Self { pool }
    }

    /// One segment's scores from the least loaded teacher engine, trying others when one fails.
    async fn score(&self, id: &str, tokens: &[i64]) -> Result<Vec<f32>> {
        let mut last = String::new();
        for attempt in 0..ATTEMPTS {
            let engine = self.engine().await?;
            let _load = engine.track(tokens.len() as u64);
            match engine.client.prompt_logprobs(id, tokens).await {
                Ok(scores) => return Ok(scores),
                Err(EngineError::Refused { status, message }) if (400..500).contains(&status) => {
                    // The same answer from any engine: the segment does not fit the teacher.
                    let (url, len) = (engine.url(), tokens.len());
                    return Err(RunError::Setup(format!(
                        "the teacher engine {url} refused a {len}-token segment ({status}): {message} (a served teacher's context must hold the student's longest segment plus one token: docs/run.md, \"On-policy distillation\")"
                    )));
                }
                Err(e) => {
                    if matches!(e, EngineError::Unreachable { .. }) {
                        engine.mark_down();
                    }
                    tracing::debug!(attempt, error = %e, "teacher: scoring failed; trying again");
                    last = e.to_string();
                }
            }
        }
        Err(RunError::Setup(format!(
            "the teacher could not score a segment in {ATTEMPTS} tries: {last}"
        )))
    }

    /// The routable engine with the fewest tokens outstanding, waiting for one to come up.
    async fn engine(&self) -> Result<Arc<Engine>> {
        let since = Instant::now();
        loop {
            if let Some(e) = self.pool.routable().into_iter().min_by_key(|e| e.tokens()) {
                return Ok(e);
            }
            if since.elapsed() >= ENGINE_PATIENCE {
                return Err(RunError::Setup(format!(
                    "no teacher engine is up after {ENGINE_PATIENCE:?} ({} known)",
                    self.pool.all().len()
                )));
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
}

impl Stage for Teacher {
    fn phase(&self) -> &'static str {
        "the teacher scores the batch"
    }

    /// Scores every segment with sampled tokens of the batch (the step makes request ids
    /// unique): each gets `teacher_logprobs`. On failure no segment is changed.
    fn apply<'a>(&'a self, batch: &'a mut StepBatch) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            let started = Instant::now();
            let asks: Vec<_> = trained_segments(&batch.groups)
                .map(|(g, e, s, seg)| {
                    let id = format!("teacher-{}-{g}-{e}-{s}", batch.step);
                    ((g, e, s), id, seg.token_ids.clone())
                })
                .collect();
            let tokens = asks.iter().map(|(_, _, t)| t.len()).sum();
            let scores = futures::stream::iter(asks).map(|(at, id, tokens)| async move {
                self.score(&id, &tokens).await.map(|s| (at, s))
            });
            let scored: Vec<_> = scores.buffer_unordered(IN_FLIGHT).try_collect().await?;
            for ((g, e, s), logprobs) in scored {
                batch.groups[g].episodes[e].segments[s].teacher_logprobs = Some(logprobs);
            }
            batch.taught = Some(TeacherStats {
                tokens,
                seconds: started.elapsed().as_secs_f64(),
            });
            Ok(())
        })
    }
}
