//! LLM-as-judge rewards (docs/algorithms.md): a judge model, served by a built-in engine of its own behind
//! its own [`ChatService`] (its own tokenizer and chat template), reads a prompt made from the
//! task and the episode's final reply and answers with a score.
//!
//! Contract: every episode of a batch is judged concurrently, and its reward becomes
//! `agentWeight · (its own reward) + weight · (judge score)`. The final reply is the last run of
//! sampled tokens (loss mask 1) of the episode's last segment, decoded with the policy's
//! tokenizer, special tokens skipped. The score is the first number of the judge's answer,
//! clamped to [0, 1], or yes/no (1/0), whichever comes first; an answer with neither scores 0 and
//! is counted (`judge_unparsed`), a request that failed scores 0 and is counted (`judge_failed`).
//! A batch in which every request failed is left unchanged and is an error: `moult run` stops
//! (the judge is broken, and training on all-zero scores would only hide it); a cluster's
//! coordinator asks again after a pause (the judge's engines may be starting or replaced).

use std::sync::LazyLock;

use futures::future::BoxFuture;
use regex::Regex;

use super::{Stage, StepBatch};
use crate::chat::{ChatRequest, ChatSampling, Message, Role, Tokenizer};
use crate::config::judge::{fill_prompt, JudgeOptions};
use crate::error::{Result, RunError};
use crate::loopback::session::Segment;
use crate::loopback::ChatService;

/// A judge ready to score: its chat service and the policy's tokenizer (to read replies).
#[derive(Debug)]
pub struct Judge {
    service: ChatService,
    policy_tokenizer: Tokenizer,
    opts: JudgeOptions,
}

/// What judging a batch found, for the step's metrics (a coordinator sends it with the batch).
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct JudgeStats {
    /// Mean of the agents' own rewards (before the judge's score was mixed in).
    pub agent_reward_mean: f64,
    pub judge_score_mean: f64,
    /// Answers with no number and no yes/no.
    pub unparsed: usize,
    /// Requests that failed (scored 0).
    pub failed: usize,
    /// Wall time of judging the batch.
    pub seconds: f64,
}

/// The judge's score in its answer: the first number (clamped to [0, 1]) or the first word
/// yes/no (1/0), whichever comes first; `None` when there is neither. Text up to a closing
/// `</think>` is the judge's reasoning and not read.
pub fn parse_score(answer: &str) -> Option<f64> {
    // A number (`3`, `0.75`, `.5`) or a word; the first number, or word that is yes or no, counts.
    static TOKEN: LazyLock<Regex> = LazyLock::new(|| {
        Regex::new(r"[0-9]+(\.[0-9]+)?|\.[0-9]+|[A-Za-z]+").expect("the pattern is valid")
    });
    let answer = answer.rsplit_once("</think>").map_or(answer, |(_, a)| a);
    let mut tokens = TOKEN.find_iter(answer);
    tokens.find_map(|m| match m.as_str().to_ascii_lowercase().as_str() {
        "yes" => Some(1.0),
        "no" => Some(0.0),
        word if word.starts_with(|c: char| c.is_ascii_alphabetic()) => None,
        number => {
            let value: f64 = number.parse().ok()?;
            let negative = answer[..m.start()].ends_with('-');
            Some(if negative { -value } else { value }.clamp(0.0, 1.0))
        }
    })
}

/// The token ids of the episode's final reply: the last run of sampled tokens (loss mask 1) of
/// its last segment; empty when it sampled nothing.
pub fn final_reply_ids(segments: &[Segment]) -> &[i64] {
    let Some(last) = segments.last() else {
        return &[];
    };
    let mask = &last.loss_mask;
    // No sampled token: `end` 0, an empty reply.
    let end = mask.iter().rposition(|&m| m == 1).map_or(0, |i| i + 1);
    let start = mask[..end].iter().rposition(|&m| m != 1);
    &last.token_ids[start.map_or(0, |i| i + 1)..end]
}

/// One episode's verdict.
#[derive(Clone, Copy, PartialEq)]
enum Verdict {
    Score(f64),
    Unparsed,
    Failed,
}

impl Judge {
    /// A judge asking the engines behind `engine_url` (which serve `opts.model_dir`), with the
    /// judge's tokenizer and chat template, about replies read with the tokenizer of the
    /// policy in `policy_dir`; room for the `episodes` of a step at once.
    pub fn connect(
        engine_url: &str,
        opts: &JudgeOptions,
        policy_dir: &std::path::Path,
        episodes: usize,
    ) -> Result<Self> {
        // One session per reply of a step, each taken as soon as it is answered.
        let sessions = crate::loopback::ServiceOptions::pool(episodes.max(1), "judge");
        let service = ChatService::from_model_dir(engine_url, &opts.model_dir, sessions)
            .map_err(|e| RunError::Setup(format!("spec.judge: {e}")))?;
        Ok(Self {
            service,
            policy_tokenizer: Tokenizer::from_model_dir(policy_dir)
                .map_err(|e| RunError::Setup(e.to_string()))?,
            opts: opts.clone(),
        })
    }

    /// Asks the judge about one reply (one user message, greedy, `maxTokens`).
    async fn verdict(&self, session: String, prompt: String) -> Verdict {
        let request = ChatRequest {
            messages: vec![Message::text(Role::User, prompt)],
            sampling: ChatSampling {
                max_tokens: Some(self.opts.max_tokens),
                temperature: Some(0.0),
                ..ChatSampling::default()
            },
            n: 1,
            ..ChatRequest::default()
        };
        let answer = match self.service.open(&session, None) {
            Ok(()) => self.service.turn(&session, "call_", request, None).await,
            Err(e) => Err(e),
        };
        // The judge's own trajectory is not trained on: drop the session either way.
        let _ = self.service.take(&session).await;
        let text = match answer {
            Ok(answer) => answer.choices[0].content.clone().unwrap_or_default(),
            Err(e) => {
                tracing::warn!(session, error = %e, "judge: the request failed; scored 0");
                return Verdict::Failed;
            }
        };
        let Some(score) = parse_score(&text) else {
            tracing::debug!(session, answer = text, "judge: no score in the answer");
            return Verdict::Unparsed;
        };
        Verdict::Score(score)
    }
}

impl Stage for Judge {
    fn phase(&self) -> &'static str {
        "judging the batch"
    }

    /// Judges every episode of the batch concurrently and replaces each reward with
    /// `agentWeight · reward + weight · score`. The step makes the judge's session ids unique.
    fn apply<'a>(&'a self, batch: &'a mut StepBatch) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            let (started, step) = (std::time::Instant::now(), batch.step);
            let mut asks = Vec::new();
            for (g, group) in batch.groups.iter().enumerate() {
                for (e, episode) in group.episodes.iter().enumerate() {
                    let ids = final_reply_ids(&episode.segments);
                    let reply = (self.policy_tokenizer.decode(ids, true))
                        .map_err(|e| RunError::Setup(format!("judge: decoding a reply: {e}")))?;
                    let prompt = fill_prompt(&self.opts.prompt, &group.task, &reply)
                        .map_err(|e| RunError::field("spec.judge.prompt", e))?;
                    asks.push(self.verdict(format!("judge-{step}-{g}-{e}"), prompt));
                }
            }
            let verdicts = futures::future::join_all(asks).await;
            let n = verdicts.len();
            let count = |v: Verdict| verdicts.iter().filter(|&&w| w == v).count();
            let mut stats = JudgeStats {
                unparsed: count(Verdict::Unparsed),
                failed: count(Verdict::Failed),
                ..JudgeStats::default()
            };
            if n > 0 && stats.failed == n {
                // The batch is left as it was: it may be judged again (a judge that is starting).
                return Err(RunError::Setup(format!(
                    "judge: all {n} requests of step {step} failed (see the warnings above)"
                )));
            }
            let episodes = batch.groups.iter_mut().flat_map(|g| g.episodes.iter_mut());
            for (episode, verdict) in episodes.zip(verdicts) {
                let score = match verdict {
                    Verdict::Score(s) => s,
                    Verdict::Unparsed | Verdict::Failed => 0.0,
                };
                stats.agent_reward_mean += episode.reward;
                stats.judge_score_mean += score;
                episode.reward = self.opts.agent_weight * episode.reward + self.opts.weight * score;
            }
            stats.agent_reward_mean /= n.max(1) as f64;
            stats.judge_score_mean /= n.max(1) as f64;
            stats.seconds = started.elapsed().as_secs_f64();
            batch.judged = Some(stats);
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scores_are_the_first_number_clamped_or_yes_no() {
        let cases: &[(&str, Option<f64>)] = &[
            ("yes", Some(1.0)),
            ("No.", Some(0.0)),
            ("YES, it is", Some(1.0)),
            ("0.75", Some(0.75)),
            ("Score: .5", Some(0.5)),
            ("7 out of 10, yes", Some(1.0)),
            ("-2", Some(0.0)),
            ("no, 1", Some(0.0)),
            ("1 - no", Some(1.0)),
            ("<think>maybe 0.2 or no</think> yes", Some(1.0)),
            // Words that merely contain yes/no do not count.
            ("I know nothing; yesterday", None),
            ("", None),
            ("maybe", None),
        ];
        for (answer, want) in cases {
            assert_eq!(parse_score(answer), *want, "{answer:?}");
        }
    }

    fn segment(ids: &[i64], mask: &[u8]) -> Segment {
        Segment {
            token_ids: ids.to_vec(),
            loss_mask: mask.to_vec(),
            ..Segment::default()
        }
    }

    #[test]
    fn the_final_reply_is_the_last_sampled_run_of_the_last_segment() {
        let first = segment(&[1, 2, 3], &[0, 1, 1]);
        let last = segment(&[10, 11, 12, 13, 14, 15, 16], &[0, 1, 1, 0, 1, 1, 0]);
        assert_eq!(final_reply_ids(&[first.clone(), last]), [14, 15]);
        assert_eq!(final_reply_ids(&[segment(&[5, 6], &[1, 1])]), [5, 6]);
        assert!(final_reply_ids(&[first, segment(&[7], &[0])]).is_empty());
        assert!(final_reply_ids(&[]).is_empty());
    }
}
