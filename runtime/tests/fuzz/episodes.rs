//! Episodes from agent code through the validator into training samples: a random episode,
//! well-formed or spoilt in any of the ways the validator knows (and a few at once), is either
//! refused, or becomes samples without an error or panic whose lengths agree (tokens, loss mask,
//! behaviour logprobs, the routing to replay) with finite logprobs and advantages.

use proptest::prelude::*;
use serde_json::json;

use crate::{drive, Budget, Row};
use moult_operator::api::Estimator;
use moult_runtime::agents::{Episode, EpisodeStatus};
use moult_runtime::config::Overlong;
use moult_runtime::engine::npy::encode_routed_experts;
use moult_runtime::learner::samples::{advantages, samples};
use moult_runtime::loopback::session::RoutedExperts;
use moult_runtime::loopback::Segment;
use moult_runtime::rollout::validate::{check, EpisodeLimits};
use moult_runtime::rollout::Group;

const VOCAB: i64 = 100;

/// A segment as the loopback server records it: rendered tokens (mask 0) and sampled ones
/// (mask 1, logprob ≤ 0, a version), routing in chunks that tile all positions but the last.
fn segment() -> impl Strategy<Value = Segment> {
    (
        prop::collection::vec((0..VOCAB, any::<bool>(), -20.0f32..=0.0, 0u64..6), 0..12),
        0usize..3,
        1usize..3,
        1usize..3,
    )
        .prop_map(|(tokens, chunks, layers, top_k)| {
            let n = tokens.len();
            let mut s = Segment {
                token_ids: tokens.iter().map(|t| t.0).collect(),
                loss_mask: tokens.iter().map(|t| u8::from(t.1)).collect(),
                logprobs: tokens.iter().map(|t| if t.1 { t.2 } else { 0.0 }).collect(),
                versions: tokens.iter().map(|t| t.1.then_some(t.3)).collect(),
                routed_experts: Vec::new(),
                images: Vec::new(),
                turns: 1,
                teacher_logprobs: None,
            };
            if chunks > 0 && n > 1 {
                // Positions 0..n-1 in `chunks` pieces (the last token was never fed).
                let rows = n - 1;
                let mut start = 0;
                for c in 0..chunks {
                    let len = if c + 1 == chunks {
                        rows - start
                    } else {
                        (rows - start) / 2
                    };
                    let ids = vec![1u16; len * layers * top_k];
                    s.routed_experts.push(RoutedExperts {
                        start,
                        data: encode_routed_experts(&ids, len, layers, top_k, 8),
                    });
                    start += len;
                }
            }
            s
        })
}

/// One way to spoil an episode, applied at an index chosen by the case.
#[derive(Debug, Clone)]
enum Spoil {
    Token(i64),
    PopMask,
    PushLogprob,
    PopVersion,
    Mask(u8),
    Logprob(f32),
    Version(Option<u64>),
    ChunkStart(usize),
    ChunkRows { rows: usize, layers: usize },
    ChunkData(String),
    ExtraChunk { rows: usize },
    Reward(f64),
    DropTokens,
}

fn spoil() -> impl Strategy<Value = Spoil> {
    prop_oneof![
        prop::sample::select(vec![-1i64, VOCAB, i64::MAX, i64::MIN]).prop_map(Spoil::Token),
        Just(Spoil::PopMask),
        Just(Spoil::PushLogprob),
        Just(Spoil::PopVersion),
        (2u8..=255).prop_map(Spoil::Mask),
        prop::sample::select(vec![
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            0.5,
            1e-3,
            f32::MAX
        ])
        .prop_map(Spoil::Logprob),
        prop::sample::select(vec![None, Some(7), Some(u64::MAX)]).prop_map(Spoil::Version),
        (0usize..14).prop_map(Spoil::ChunkStart),
        (0usize..4, 0usize..3).prop_map(|(rows, layers)| Spoil::ChunkRows { rows, layers }),
        prop::sample::select(vec![
            "not base64!".to_string(),
            String::new(),
            "k05VTVBZAQA=".to_string(),
        ])
        .prop_map(Spoil::ChunkData),
        (0usize..3).prop_map(|rows| Spoil::ExtraChunk { rows }),
        prop::sample::select(vec![
            f64::NAN,
            f64::INFINITY,
            f64::MAX,
            -f64::MAX,
            1e300,
            1e-300
        ])
        .prop_map(Spoil::Reward),
        Just(Spoil::DropTokens),
    ]
}

fn apply(e: &mut Episode, spoil: &Spoil, at: prop::sample::Index) {
    if let Spoil::Reward(r) = spoil {
        e.reward = *r;
        return;
    }
    if e.segments.is_empty() {
        return;
    }
    let k = at.index(e.segments.len());
    let s = &mut e.segments[k];
    let n = s.token_ids.len();
    let i = at.index(n.max(1));
    match spoil {
        Spoil::Token(t) => set(&mut s.token_ids, i, *t),
        Spoil::PopMask => drop(s.loss_mask.pop()),
        Spoil::PushLogprob => s.logprobs.push(-1.0),
        Spoil::PopVersion => drop(s.versions.pop()),
        Spoil::Mask(m) => set(&mut s.loss_mask, i, *m),
        Spoil::Logprob(l) => set(&mut s.logprobs, i, *l),
        Spoil::Version(v) => set(&mut s.versions, i, *v),
        Spoil::ChunkStart(start) => {
            if let Some(c) = s.routed_experts.first_mut() {
                c.start = *start;
            }
        }
        Spoil::ChunkRows { rows, layers } => {
            if let Some(c) = s.routed_experts.last_mut() {
                c.data = encode_routed_experts(&vec![0; rows * layers * 2], *rows, *layers, 2, 8);
            }
        }
        Spoil::ChunkData(d) => {
            if let Some(c) = s.routed_experts.last_mut() {
                c.data = d.clone();
            }
        }
        Spoil::ExtraChunk { rows } => {
            let start = s.routed_experts.len().min(n.saturating_sub(1));
            s.routed_experts.push(RoutedExperts {
                start,
                data: encode_routed_experts(&vec![0; rows * 2], *rows, 1, 2, 8),
            });
        }
        Spoil::DropTokens => {
            s.token_ids.truncate(i);
        }
        Spoil::Reward(_) => {}
    }
}

/// `v[i] = x` where there is an entry `i` (earlier spoils may have shortened `v`).
fn set<T>(v: &mut [T], i: usize, x: T) {
    if let Some(slot) = v.get_mut(i) {
        *slot = x;
    }
}

#[derive(Debug, Clone)]
struct Case {
    episodes: Vec<(Vec<Segment>, f64, bool)>,
    spoils: Vec<(Spoil, prop::sample::Index, prop::sample::Index)>,
    vocab: Option<usize>,
    now: u64,
    estimator: u8,
    replay: bool,
}

fn case() -> impl Strategy<Value = Case> {
    (
        prop::collection::vec(
            (
                prop::collection::vec(segment(), 0..3),
                -5.0f64..5.0,
                prop::bool::weighted(0.1),
            ),
            2..5,
        ),
        prop::collection::vec(
            (
                spoil(),
                any::<prop::sample::Index>(),
                any::<prop::sample::Index>(),
            ),
            0..3,
        ),
        prop_oneof![3 => Just(Some(VOCAB as usize)), 1 => Just(None)],
        prop_oneof![4 => 4u64..8, 1 => Just(u64::MAX), 1 => Just(0u64)],
        0u8..5,
        any::<bool>(),
    )
        .prop_map(|(episodes, spoils, vocab, now, estimator, replay)| Case {
            episodes,
            spoils,
            vocab,
            now,
            estimator,
            replay,
        })
}

fn run(case: Case) -> Result<(), TestCaseError> {
    let mut episodes: Vec<Episode> = case
        .episodes
        .iter()
        .enumerate()
        .map(|(index, (segments, reward, failed))| Episode {
            index,
            session: format!("s{index}"),
            task: json!({}),
            status: if *failed {
                EpisodeStatus::Failed
            } else {
                EpisodeStatus::Completed
            },
            reason: None,
            reward: *reward,
            info: Default::default(),
            seconds: 0.1,
            segments: segments.clone(),
        })
        .collect();
    for (spoil, which, at) in &case.spoils {
        let e = which.index(episodes.len());
        apply(&mut episodes[e], spoil, *at);
    }
    let limits = EpisodeLimits {
        vocab_size: case.vocab,
        max_positions: None,
        experts: None,
    };
    // As the rollout does: a group with a failed or malformed episode never reaches the trainer.
    if episodes.iter().any(|e| e.status == EpisodeStatus::Failed)
        || episodes
            .iter()
            .any(|e| check(e, &limits, case.now).is_err())
    {
        return Ok(());
    }
    let group: Group = serde_json::from_value(json!({
        "task_index": 0, "epoch": 0, "task": {}, "episodes": episodes, "oldest_version": null
    }))
    .map_err(|e| TestCaseError::fail(format!("group: {e}")))?;
    let batch = vec![group];
    let estimator = match case.estimator {
        0 => Estimator::Grpo,
        1 => Estimator::Rloo,
        2 => Estimator::ReinforcePlusPlus,
        3 => Estimator::DrGrpo,
        _ => Estimator::OnPolicyDistillation,
    };
    // Overlong shaping with a budget some episodes exceed.
    let overlong = Overlong {
        max_tokens: 8,
        buffer_tokens: 4,
        factor: 1.0,
    };
    let (adv, _) = advantages(estimator, Some(&overlong), &batch)
        .map_err(|e| TestCaseError::fail(format!("advantages of a valid batch: {e}")))?;
    let out = samples(&batch, &adv, case.replay, None)
        .map_err(|e| TestCaseError::fail(format!("samples of a valid batch: {e}")))?;
    let expected: usize = batch[0]
        .episodes
        .iter()
        .flat_map(|e| &e.segments)
        .filter(|s| s.sampled_tokens() > 0)
        .count();
    prop_assert_eq!(out.len(), expected);
    for s in &out {
        let n = s.tokens.len();
        prop_assert_eq!(s.loss_mask.len(), n);
        prop_assert_eq!(s.behaviour_logprobs.len(), n);
        prop_assert!(s.loss_mask.contains(&1));
        prop_assert!(s
            .behaviour_logprobs
            .iter()
            .zip(&s.loss_mask)
            .all(|(l, m)| *m == 0 || (l.is_finite() && *l <= 1e-3)));
        prop_assert!(s.advantage.is_finite(), "advantage {}", s.advantage);
        if let Some(r) = &s.replay {
            prop_assert_eq!(r.size()[0], n as i64, "replay rows for {} tokens", n);
        }
    }
    Ok(())
}

pub fn target(budget: Budget) -> Row {
    drive("episodes_to_samples", budget, 2000, case(), run)
}
