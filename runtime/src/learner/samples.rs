//! From finished groups to the trainer's samples: rewards to advantages (the estimator), and
//! each episode's segments to [`Sample`]s carrying the exact tokens, loss mask, behaviour
//! logprobs and, with routing replay, the routed experts.

use std::collections::hash_map::{Entry, HashMap};
use std::sync::Arc;

use moult_operator::api::Estimator;
use tch::Tensor;

use crate::agents::Episode;
use crate::algorithms::advantages::{grpo, reinforce_pp, rloo};
use crate::config::Overlong;
use crate::error::{Result, RunError};
use crate::loopback::Segment;
use crate::model::{CausalLm, ImageInput, SeqInput};
use crate::rollout::validate::routed_experts;
use crate::rollout::{trained_segments, Group};
use crate::trainer::logprobs::token_logprobs;
use crate::trainer::step::scored;
use crate::trainer::train::Sample;
use crate::vision::{ImageProcessorConfig, ProcessedImage};

/// Summary statistics of a list of numbers: (mean, population std).
pub fn mean_std(xs: &[f64]) -> (f64, f64) {
    if xs.is_empty() {
        return (0.0, 0.0);
    }
    let n = xs.len() as f64;
    let mean = xs.iter().sum::<f64>() / n;
    let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n;
    (mean, var.sqrt())
}

/// Tokens the policy sampled in `episode` (over all its segments).
pub fn sampled_tokens(episode: &Episode) -> usize {
    episode.segments.iter().map(Segment::sampled_tokens).sum()
}

/// Each episode's advantage, per group, from the groups' rewards, shaped by `overlong` when
/// set; with the mean overlong penalty of the batch.
pub fn advantages(
    estimator: Estimator,
    overlong: Option<&Overlong>,
    batch: &[Group],
) -> Result<(Vec<Vec<f64>>, Option<f64>)> {
    let g = batch.first().map_or(0, |b| b.episodes.len());
    if batch.iter().any(|b| b.episodes.len() != g) {
        let why = "groups of unequal size in one batch";
        return Err(RunError::Batch(why.into()));
    }
    let episodes = batch.iter().flat_map(|b| &b.episodes);
    let penalties: Vec<f64> = (episodes.clone())
        .map(|e| overlong.map_or(0.0, |o| o.penalty(sampled_tokens(e))))
        .collect();
    let rewards: Vec<f64> = (episodes.zip(&penalties))
        .map(|(e, p)| e.reward + p)
        .collect();
    let r = Tensor::from_slice(&rewards).view([batch.len() as i64, g as i64]);
    let a = match estimator {
        Estimator::Grpo => grpo(&r, true, 1e-6),
        Estimator::DrGrpo => grpo(&r, false, 0.0),
        Estimator::Rloo => rloo(&r),
        Estimator::ReinforcePlusPlus => reinforce_pp(&r, 1e-6),
        // Per token, from the teacher ([`distill`]); the sequence advantage is unused.
        Estimator::OnPolicyDistillation => r.zeros_like(),
    };
    let flat: Vec<f64> = Vec::try_from(a.flatten(0, -1)).expect("advantages are doubles");
    let per_group = flat.chunks(g.max(1)).map(<[f64]>::to_vec).collect();
    Ok((per_group, overlong.map(|_| mean_std(&penalties).0)))
}

/// On-policy distillation: each sampled token's advantage is the teacher's logprob of it minus
/// the student's behaviour logprob, `A_t = log π_teacher(a_t) − log μ(a_t)`
/// ([`crate::algorithms::advantages::distillation`]), scored by `teacher` at `temperature`.
/// Returns the mean per-token reverse KL estimate `mean_t (log μ − log π_teacher)`.
pub fn distill(teacher: &CausalLm, samples: &mut [Sample], temperature: f64) -> Result<f64> {
    let mut scores = Vec::with_capacity(samples.len());
    for chunk in samples.chunks(16) {
        // The teacher routes its own experts: none of the policy's routing is replayed.
        let seqs = scored(chunk).into_iter();
        let seqs: Vec<SeqInput<'_>> = seqs.map(|s| SeqInput { replay: None, ..s }).collect();
        let teacher_lp = tch::no_grad(|| token_logprobs(teacher, &seqs, temperature))?;
        for (i, s) in chunk.iter().enumerate() {
            let row: Vec<f32> = Vec::try_from(teacher_lp.get(i as i64))?;
            scores.push(row[..s.tokens.len()].to_vec());
        }
    }
    teacher_advantages(samples, &scores)
}

/// [`distill`] with the scores a served teacher gave each segment of `batch` beforehand
/// ([`crate::stages::teacher`]); `samples` are [`samples`] of the same batch.
pub fn distill_served(batch: &[Group], samples: &mut [Sample]) -> Result<f64> {
    let mut segments = trained_segments(batch);
    let scores = (samples.iter())
        .map(|s| {
            let (_, _, _, seg) = segments.next().ok_or_else(|| {
                RunError::Batch("distillation: more samples than trained segments".into())
            })?;
            let scores = seg.teacher_logprobs.as_deref().ok_or_else(|| {
                RunError::Batch(
                    "distillation: a segment came without the served teacher's scores (a replayed dump must come from a run with algorithm.teacher.replicas too)".into(),
                )
            })?;
            if scores.len() != s.tokens.len() {
                let (scored, len) = (scores.len(), s.tokens.len());
                return Err(RunError::Batch(format!(
                    "distillation: the teacher scored {scored} tokens of a {len}-token segment"
                )));
            }
            Ok(scores)
        })
        .collect::<Result<Vec<_>, _>>()?;
    teacher_advantages(samples, &scores)
}

/// Sets each sample's per-token advantages from the teacher's logprob of each of its tokens;
/// returns the mean per-token reverse KL estimate over the samples.
fn teacher_advantages(samples: &mut [Sample], teacher: &[impl AsRef<[f32]>]) -> Result<f64> {
    let (mut sum, mut count) = (0.0, 0);
    for (s, teacher) in samples.iter_mut().zip(teacher) {
        let mask = Tensor::from_slice(&s.loss_mask).to_kind(tch::Kind::Float);
        let teacher = Tensor::from_slice(teacher.as_ref());
        let behaviour = Tensor::from_slice(&s.behaviour_logprobs);
        let adv = crate::algorithms::advantages::distillation(&teacher, &behaviour, &mask);
        let adv: Vec<f32> = Vec::try_from(adv)?;
        for (a, _) in adv.iter().zip(&s.loss_mask).filter(|(_, &m)| m == 1) {
            sum -= f64::from(*a);
        }
        count += s.sampled();
        s.token_advantages = Some(adv);
    }
    Ok(sum / count.max(1) as f64)
}

/// The routing to replay for `segment`, `[tokens, sparse_layers, top_k]`: the engine's chunks
/// tile positions `0..tokens-1` (the last token was never fed to the model; its row repeats the
/// one before, and no loss reads it).
pub fn replay_tensor(segment: &Segment) -> Result<Option<Tensor>> {
    let chunks = routed_experts(segment, None).map_err(|e| RunError::Batch(e.to_string()))?;
    if chunks.is_empty() {
        return Ok(None);
    }
    let rows: Vec<Tensor> = (chunks.into_iter())
        .map(|(shape, ids)| {
            let ids: Vec<i64> = ids.into_iter().map(i64::from).collect();
            Tensor::from_slice(&ids).view(shape.map(|d| d as i64))
        })
        .collect();
    let t = Tensor::cat(&rows, 0);
    // Checked: the chunks cover the segment, or all of it but its last token, whose row is then
    // a copy of the one before.
    let covered = t.size()[0];
    if covered < segment.token_ids.len() as i64 {
        let last = t.get(covered - 1).unsqueeze(0);
        return Ok(Some(Tensor::cat(&[t, last], 0)));
    }
    Ok(Some(t))
}

/// A segment's images, preprocessed as the engine preprocessed them (`images`: the model's image
/// settings; a segment with images for a model without them is an error). `seen` holds the
/// batch's images preprocessed so far, by SHA-256: a group's episodes share their task's images.
fn segment_images(
    seg: &Segment,
    images: Option<&ImageProcessorConfig>,
    seen: &mut HashMap<String, Arc<ProcessedImage>>,
) -> Result<Vec<ImageInput>> {
    if seg.images.is_empty() {
        return Ok(Vec::new());
    }
    let config = images.ok_or_else(|| {
        RunError::Batch(
            "a segment has images, but the policy is not a vision-language model (docs/vision.md)"
                .into(),
        )
    })?;
    (seg.images.iter())
        .map(|i| {
            let image = match seen.entry(i.image.sha256.clone()) {
                Entry::Occupied(seen) => seen.get().clone(),
                Entry::Vacant(new) => {
                    let processed = (i.image.bytes())
                        .and_then(|b| crate::vision::preprocess_bytes(&b, config))
                        .map_err(|e| {
                            RunError::Batch(format!("a segment's image {}: {e}", i.image.sha256))
                        })?;
                    new.insert(Arc::new(processed)).clone()
                }
            };
            Ok(ImageInput {
                offset: i.offset,
                image,
            })
        })
        .collect()
}

/// The batch as trainer samples: every segment with sampled tokens, with its episode's
/// advantage and, for a vision-language policy (`images`: its image settings), its images.
pub fn samples(
    batch: &[Group],
    advantages: &[Vec<f64>],
    routing_replay: bool,
    images: Option<&ImageProcessorConfig>,
) -> Result<Vec<Sample>> {
    let mut seen = HashMap::new();
    trained_segments(batch)
        .map(|(g, e, _, seg)| {
            Ok(Sample {
                images: segment_images(seg, images, &mut seen)?,
                tokens: seg.token_ids.clone(),
                loss_mask: seg.loss_mask.clone(),
                behaviour_logprobs: seg.logprobs.clone(),
                advantage: advantages[g][e],
                token_advantages: None,
                replay: routing_replay
                    .then(|| replay_tensor(seg))
                    .transpose()?
                    .flatten(),
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::npy::encode_routed_experts;
    use crate::loopback::session::RoutedExperts;

    fn chunk(start: usize, rows: usize, first_id: u16) -> RoutedExperts {
        let ids: Vec<u16> = (0..rows as u16 * 2).map(|i| first_id + i).collect();
        RoutedExperts {
            start,
            data: encode_routed_experts(&ids, rows, 1, 2, 64),
        }
    }

    fn segment(len: usize, chunks: Vec<RoutedExperts>) -> Segment {
        Segment {
            token_ids: vec![1; len],
            loss_mask: vec![0; len],
            logprobs: vec![0.0; len],
            versions: vec![None; len],
            routed_experts: chunks,
            images: Vec::new(),
            turns: 1,
            teacher_logprobs: None,
        }
    }

    #[test]
    fn replay_tiles_the_engine_chunks_and_pads_the_last_token() {
        // Two turns: positions 0..4 from the first request, 4..6 from the second; 7 tokens.
        let seg = segment(7, vec![chunk(0, 4, 0), chunk(4, 2, 8)]);
        let t = replay_tensor(&seg).unwrap().unwrap();
        assert_eq!(t.size(), vec![7, 1, 2]);
        let ids: Vec<i64> = Vec::try_from(t.flatten(0, -1)).unwrap();
        assert_eq!(ids, vec![0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 10, 11]);
        assert!(replay_tensor(&segment(7, vec![])).unwrap().is_none());
        // A gap or a short cover is an error, never a silently misaligned replay.
        assert!(replay_tensor(&segment(7, vec![chunk(0, 4, 0), chunk(5, 1, 8)])).is_err());
        assert!(replay_tensor(&segment(9, vec![chunk(0, 4, 0)])).is_err());
        // Found by fuzzing: no rows for a 1-token segment panicked (`get(-1)` of nothing).
        assert!(replay_tensor(&segment(1, vec![chunk(0, 0, 0)])).is_err());
    }

    #[test]
    fn mean_std_is_the_population_one() {
        assert_eq!(mean_std(&[]), (0.0, 0.0));
        let (m, s) = mean_std(&[1.0, 3.0]);
        assert_eq!((m, s), (2.0, 1.0));
    }

    /// A group of episodes with these rewards and sampled lengths.
    fn group(episodes: &[(f64, usize)]) -> Group {
        let episodes: Vec<Episode> = episodes
            .iter()
            .map(|&(reward, sampled)| {
                let mut seg = segment(sampled + 3, Vec::new());
                seg.loss_mask[3..].fill(1);
                Episode {
                    index: 0,
                    session: "s".into(),
                    task: serde_json::json!({}),
                    status: crate::agents::EpisodeStatus::Completed,
                    reason: None,
                    reward,
                    info: Default::default(),
                    seconds: 0.1,
                    segments: vec![seg],
                }
            })
            .collect();
        serde_json::from_value(serde_json::json!({
            "task_index": 0, "epoch": 0, "task": {}, "episodes": episodes, "oldest_version": null
        }))
        .unwrap()
    }

    #[test]
    fn overlong_penalties_shape_the_rewards_and_dr_grpo_only_centres_them() {
        let batch = [
            group(&[(1.0, 10), (0.0, 90)]),
            group(&[(1.0, 100), (1.0, 200)]),
        ];
        assert_eq!(sampled_tokens(&batch[0].episodes[1]), 90);
        let o = Overlong {
            max_tokens: 100,
            buffer_tokens: 20,
            factor: 1.0,
        };
        // Shaped rewards: 1, −0.5 | 0, 0.
        let (a, penalty) = advantages(Estimator::DrGrpo, Some(&o), &batch).unwrap();
        assert_eq!(a, vec![vec![0.75, -0.75], vec![0.0, 0.0]]);
        assert_eq!(penalty, Some(-2.5 / 4.0));
        let (a, penalty) = advantages(Estimator::DrGrpo, None, &batch).unwrap();
        assert_eq!(a, vec![vec![0.5, -0.5], vec![0.0, 0.0]]);
        assert_eq!(penalty, None);
        // GRPO divides by the group's std (0.5 here).
        let (a, _) = advantages(Estimator::Grpo, None, &batch).unwrap();
        assert!(
            (a[0][0] - 1.0).abs() < 1e-5 && (a[0][1] + 1.0).abs() < 1e-5,
            "{a:?}"
        );
    }
}
