//! The checks a finished episode passes before its group may reach the trainer
//! (docs/security.md, "Bad data"). Episodes come from agent code and, on clusters, from agent
//! pods: untrusted input. One malformed episode the trainer cannot use (a token id outside the
//! vocabulary, fields of different lengths, a NaN) would otherwise stop the trainer, and since a
//! batch is served again until it is committed, stop it at every restart.

use std::path::Path;

use crate::agents::{Episode, EpisodeStatus};
use crate::engine::npy::decode_routed_experts;
use crate::loopback::Segment;

/// The largest logprob accepted for a sampled token: 0 up to float rounding.
const MAX_LOGPROB: f32 = 1e-3;

/// The largest reward magnitude accepted. The advantage estimators sum and square a group's
/// rewards, and a finite reward near `f64::MAX` makes them inf and the advantages NaN (found by
/// fuzzing, `runtime/tests/fuzz.rs`); no reward scale in use comes near this.
pub const MAX_REWARD: f64 = 1e12;

/// What an episode is checked against: the policy's, so that no episode can make the trainer's
/// forward fail (a trainer that fails on a batch fails on it again at every restart).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct EpisodeLimits {
    /// Token ids must be below this (the policy's `vocab_size`); unchecked when unknown.
    pub vocab_size: Option<usize>,
    /// A segment has at most this many tokens (the policy's `max_position_embeddings`);
    /// unchecked when unknown.
    pub max_positions: Option<usize>,
    /// Replayed routing names experts below this (the policy's `num_experts`); unchecked when
    /// unknown or the policy has none.
    pub experts: Option<usize>,
}

/// The policy's limits from `<model_dir>/config.json` (`vocab_size` and
/// `max_position_embeddings`, or under `text_config` for multimodal configs); unknown when there
/// is no readable config.
pub fn limits(model_dir: &Path) -> EpisodeLimits {
    let cfg: serde_json::Value = std::fs::read_to_string(model_dir.join("config.json"))
        .ok()
        .and_then(|text| serde_json::from_str(&text).ok())
        .unwrap_or_default();
    let read = |key: &str| {
        (cfg[key].as_u64())
            .or_else(|| cfg["text_config"][key].as_u64())
            .and_then(|n| usize::try_from(n).ok())
    };
    EpisodeLimits {
        vocab_size: read("vocab_size"),
        max_positions: read("max_position_embeddings"),
        experts: read("num_experts").or_else(|| read("num_local_experts")),
    }
}

/// Why an episode may not be trained on.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Invalid {
    #[error("reward {0} is not a finite number")]
    RewardNotFinite(f64),
    #[error(
        "reward {0} is larger in magnitude than {MAX_REWARD:e}: the advantages would overflow"
    )]
    RewardTooLarge(f64),
    #[error("segment {index}: {why}")]
    Segment { index: usize, why: BadSegment },
}

/// Why a segment of an episode may not be trained on.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum BadSegment {
    /// A served teacher's scores are filled in by the run, after this check; an episode that
    /// brings its own would choose its advantages.
    #[error("it carries teacher_logprobs: only the run's teacher scores tokens")]
    TeacherLogprobs,
    #[error("{len} tokens: the policy takes at most {max} positions")]
    TooLong { len: usize, max: usize },
    #[error("{field} has {n} entries for {len} token_ids")]
    Length {
        field: &'static str,
        n: usize,
        len: usize,
    },
    #[error("token id {token} at position {at} is outside the vocabulary (size {})",
        .vocab_size.map_or_else(|| "unknown".into(), |v| v.to_string()))]
    OutsideVocabulary {
        token: i64,
        at: usize,
        vocab_size: Option<usize>,
    },
    #[error("logprob {logprob} at position {at} is not a finite number")]
    LogprobNotFinite { logprob: f32, at: usize },
    #[error("sampled token at position {at} has logprob {logprob}: a log-probability is finite and at most 0")]
    SampledLogprob { logprob: f32, at: usize },
    #[error("sampled token at position {at} has no policy version")]
    NoVersion { at: usize },
    #[error(
        "sampled token at position {at} claims policy version {version}; the engines serve {now}"
    )]
    FutureVersion { at: usize, version: u64, now: u64 },
    #[error("loss_mask {mask} at position {at}: it is 0 or 1")]
    LossMask { mask: u8, at: usize },
    #[error("routed experts cover positions from {next} but a chunk starts at {start}")]
    RoutedGap { next: usize, start: usize },
    #[error("routed experts at {start}: {why}")]
    RoutedData { start: usize, why: String },
    /// At `.0`, expert `.1` of a policy of `.2` experts.
    #[error("routed experts at {0} name expert {1}; the policy has {2}")]
    RoutedExpert(usize, u16, usize),
    #[error("routed experts at {start} are [{}, {}] per token, earlier chunks {earlier:?}", .layout[0], .layout[1])]
    RoutedLayout {
        start: usize,
        layout: [usize; 2],
        earlier: Option<[usize; 2]>,
    },
    #[error("routed experts cover {covered} positions of a {len}-token segment")]
    RoutedCoverage { covered: usize, len: usize },
}

/// Why `episode` may not be trained on, if it may not. Failed episodes are not checked (their
/// group is dropped anyway). `now` is the version the engines serve as far as the rollout knows:
/// a token may carry at most `now + 1` (engines resume on a new version a moment before the
/// rollout hears of it), so a made-up version from far ahead cannot dodge the staleness bound.
pub fn check(episode: &Episode, limits: &EpisodeLimits, now: u64) -> Result<(), Invalid> {
    if episode.status == EpisodeStatus::Failed {
        return Ok(());
    }
    if !episode.reward.is_finite() {
        return Err(Invalid::RewardNotFinite(episode.reward));
    }
    if episode.reward.abs() > MAX_REWARD {
        return Err(Invalid::RewardTooLarge(episode.reward));
    }
    for (index, segment) in episode.segments.iter().enumerate() {
        check_segment(segment, limits, now).map_err(|why| Invalid::Segment { index, why })?;
    }
    Ok(())
}

fn check_segment(s: &Segment, limits: &EpisodeLimits, now: u64) -> Result<(), BadSegment> {
    if s.teacher_logprobs.is_some() {
        return Err(BadSegment::TeacherLogprobs);
    }
    let len = s.token_ids.len();
    if let Some(max) = limits.max_positions.filter(|max| len > *max) {
        return Err(BadSegment::TooLong { len, max });
    }
    for (field, n) in [
        ("loss_mask", s.loss_mask.len()),
        ("logprobs", s.logprobs.len()),
        ("versions", s.versions.len()),
    ] {
        if n != len {
            return Err(BadSegment::Length { field, n, len });
        }
    }
    let newest = now.saturating_add(1);
    for (at, &token) in s.token_ids.iter().enumerate() {
        let vocab_size = limits.vocab_size;
        if !usize::try_from(token).is_ok_and(|t| vocab_size.is_none_or(|v| t < v)) {
            return Err(BadSegment::OutsideVocabulary {
                token,
                at,
                vocab_size,
            });
        }
        // Every logprob, not only the sampled ones: a batch crosses the network as JSON, which
        // has no NaN or inf (serde writes null), so one of them would make the batch unreadable
        // to the trainer at every retry (found by fuzzing: an inf logprob under mask 0 passed).
        let logprob = s.logprobs[at];
        if !logprob.is_finite() {
            return Err(BadSegment::LogprobNotFinite { logprob, at });
        }
        match s.loss_mask[at] {
            0 => {}
            1 => {
                if logprob > MAX_LOGPROB {
                    return Err(BadSegment::SampledLogprob { logprob, at });
                }
                match s.versions[at] {
                    None => return Err(BadSegment::NoVersion { at }),
                    Some(version) if version > newest => {
                        return Err(BadSegment::FutureVersion { at, version, now })
                    }
                    Some(_) => {}
                }
            }
            mask => return Err(BadSegment::LossMask { mask, at }),
        }
    }
    routed_experts(s, limits.experts).map(drop)
}

/// A `[rows, layers, top_k]` routing chunk, decoded: its shape and expert ids.
pub type RoutedChunk = ([usize; 3], Vec<u16>);

/// The segment's routing chunks, decoded, once they are checked: they tile positions `0..`
/// contiguously, each a well-formed `[rows, layers, top_k]` array of one layout of ids below
/// `experts`, covering the segment or all of it but its last token. The trainer's routing replay
/// reads them from here too.
pub fn routed_experts(s: &Segment, experts: Option<usize>) -> Result<Vec<RoutedChunk>, BadSegment> {
    if s.routed_experts.is_empty() {
        return Ok(Vec::new());
    }
    let mut next = 0usize;
    let mut earlier: Option<[usize; 2]> = None;
    let mut chunks = Vec::with_capacity(s.routed_experts.len());
    for chunk in &s.routed_experts {
        let start = chunk.start;
        if start != next {
            return Err(BadSegment::RoutedGap { next, start });
        }
        let (shape, ids) = decode_routed_experts(&chunk.data)
            .map_err(|why| BadSegment::RoutedData { start, why })?;
        // Found by fuzzing: an id past the experts passed, and failed the trainer's forward.
        let outside = experts.and_then(|n| Some((*ids.iter().find(|&&e| e as usize >= n)?, n)));
        if let Some((expert, experts)) = outside {
            return Err(BadSegment::RoutedExpert(start, expert, experts));
        }
        let layout = [shape[1], shape[2]];
        if *earlier.get_or_insert(layout) != layout {
            return Err(BadSegment::RoutedLayout {
                start,
                layout,
                earlier,
            });
        }
        next = next.saturating_add(shape[0]);
        chunks.push((shape, ids));
    }
    let len = s.token_ids.len();
    // All but the last position needs at least one: the last row is a copy of the one before
    // (found by fuzzing: chunks of no rows on a 1-token segment panicked the trainer).
    if next != len && !(next > 0 && next.saturating_add(1) == len) {
        return Err(BadSegment::RoutedCoverage { covered: next, len });
    }
    Ok(chunks)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::npy::encode_routed_experts;
    use crate::loopback::session::RoutedExperts;

    fn segment() -> Segment {
        Segment {
            token_ids: vec![5, 6, 7, 8],
            loss_mask: vec![0, 0, 1, 1],
            logprobs: vec![0.0, 0.0, -0.5, -1.25],
            versions: vec![None, None, Some(3), Some(4)],
            routed_experts: Vec::new(),
            images: Vec::new(),
            turns: 1,
            teacher_logprobs: None,
        }
    }

    fn episode(segment: Segment) -> Episode {
        Episode {
            index: 0,
            session: "s".into(),
            task: serde_json::json!({}),
            status: EpisodeStatus::Completed,
            reason: None,
            reward: 1.0,
            info: Default::default(),
            seconds: 0.1,
            segments: vec![segment],
        }
    }

    const LIMITS: EpisodeLimits = EpisodeLimits {
        vocab_size: Some(100),
        max_positions: Some(64),
        experts: Some(8),
    };

    fn verdict(s: Segment) -> Result<(), String> {
        check(&episode(s), &LIMITS, 4).map_err(|e| e.to_string())
    }

    #[test]
    fn limits_are_read_from_the_models_config() {
        let dir = std::env::temp_dir().join(format!("moult-limits-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for (config, want) in [
            (
                r#"{"vocab_size": 100, "max_position_embeddings": 512}"#,
                (Some(100), Some(512)),
            ),
            (
                r#"{"text_config": {"vocab_size": 7, "max_position_embeddings": 9}}"#,
                (Some(7), Some(9)),
            ),
            ("not json", (None, None)),
        ] {
            std::fs::write(dir.join("config.json"), config).unwrap();
            let l = limits(&dir);
            assert_eq!((l.vocab_size, l.max_positions), want, "{config}");
        }
        for (config, experts) in [
            (r#"{"num_experts": 8}"#, Some(8)),
            (r#"{"num_local_experts": 4}"#, Some(4)),
            (r#"{"vocab_size": 100}"#, None),
        ] {
            std::fs::write(dir.join("config.json"), config).unwrap();
            assert_eq!(limits(&dir).experts, experts, "{config}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_well_formed_episode_passes() {
        assert_eq!(verdict(segment()), Ok(()));
        // One version ahead of the rollout: an engine that resumed on the new weights first.
        let mut s = segment();
        s.versions[3] = Some(5);
        assert_eq!(verdict(s), Ok(()));
        // Unknown vocabulary: any non-negative id.
        let mut s = segment();
        s.token_ids[0] = 1 << 40;
        assert_eq!(check(&episode(s), &EpisodeLimits::default(), 4), Ok(()));
    }

    #[test]
    fn each_kind_of_malformed_episode_is_refused_with_its_reason() {
        type Spoil = fn(&mut Episode);
        let cases: [(&str, Spoil); 14] = [
            // A forged segment longer than the policy's positions (it stopped the trainer at
            // every restart before this check).
            ("65 tokens: the policy takes at most 64 positions", |e| {
                let s = &mut e.segments[0];
                s.token_ids.resize(65, 5);
                s.loss_mask.resize(65, 0);
                s.logprobs.resize(65, 0.0);
                s.versions.resize(65, None);
            }),
            ("outside the vocabulary", |e| {
                e.segments[0].token_ids[1] = 100
            }),
            ("outside the vocabulary", |e| {
                e.segments[0].token_ids[1] = -1
            }),
            ("loss_mask has 3 entries", |e| {
                e.segments[0].loss_mask.pop();
            }),
            ("logprobs has 5 entries", |e| {
                e.segments[0].logprobs.push(0.0)
            }),
            ("versions has 3 entries", |e| {
                e.segments[0].versions.pop();
            }),
            ("it is 0 or 1", |e| e.segments[0].loss_mask[0] = 2),
            ("logprob NaN at position 2", |e| {
                e.segments[0].logprobs[2] = f32::NAN
            }),
            // Under mask 0 too.
            ("logprob inf at position 0", |e| {
                e.segments[0].logprobs[0] = f32::INFINITY
            }),
            ("has logprob 0.5", |e| e.segments[0].logprobs[2] = 0.5),
            ("no policy version", |e| e.segments[0].versions[2] = None),
            ("claims policy version 18446744073709551615", |e| {
                e.segments[0].versions[2] = Some(u64::MAX)
            }),
            ("reward NaN", |e| e.reward = f64::NAN),
            ("only the run's teacher scores tokens", |e| {
                e.segments[0].teacher_logprobs = Some(vec![0.0; 4])
            }),
        ];
        for (why, spoil) in cases {
            let mut e = episode(segment());
            spoil(&mut e);
            let err = check(&e, &LIMITS, 4).expect_err(why).to_string();
            assert!(err.contains(why), "{why}: {err}");
        }
        let mut e = episode(segment());
        e.reward = f64::INFINITY;
        assert!(check(&e, &LIMITS, 4).is_err());
        // Found by fuzzing: two rewards of -f64::MAX in a group made GRPO's advantages NaN.
        e.reward = -f64::MAX;
        assert!(check(&e, &LIMITS, 4)
            .unwrap_err()
            .to_string()
            .contains("the advantages would overflow"));
        e.reward = -MAX_REWARD;
        assert_eq!(check(&e, &LIMITS, 4), Ok(()));
        // A failed episode is not looked at: its group is dropped whatever it holds.
        e.status = EpisodeStatus::Failed;
        assert_eq!(check(&e, &LIMITS, 4), Ok(()));
    }

    #[test]
    fn routed_experts_must_tile_the_segment_in_one_layout() {
        let chunk = |start, rows, layers| RoutedExperts {
            start,
            data: encode_routed_experts(&vec![1; rows * layers * 2], rows, layers, 2, 8),
        };
        let with = |chunks: Vec<RoutedExperts>| {
            let mut s = segment();
            s.routed_experts = chunks;
            verdict(s)
        };
        // All positions but the last (never fed to the model), or all of them.
        assert_eq!(with(vec![chunk(0, 2, 3), chunk(2, 1, 3)]), Ok(()));
        assert_eq!(with(vec![chunk(0, 4, 3)]), Ok(()));
        assert!(with(vec![chunk(0, 2, 3), chunk(3, 1, 3)])
            .unwrap_err()
            .contains("a chunk starts at 3"));
        assert!(with(vec![chunk(0, 2, 3), chunk(2, 1, 2)])
            .unwrap_err()
            .contains("per token"));
        assert!(with(vec![chunk(0, 1, 3)])
            .unwrap_err()
            .contains("cover 1 positions of a 4-token segment"));
        // Found by fuzzing: a chunk of no rows on a 1-token segment.
        let mut s = segment();
        s.token_ids.truncate(1);
        s.loss_mask = vec![1];
        s.logprobs = vec![-0.5];
        s.versions = vec![Some(3)];
        s.routed_experts = vec![chunk(0, 0, 3)];
        assert!(verdict(s)
            .unwrap_err()
            .contains("cover 0 positions of a 1-token segment"));
        let garbage = RoutedExperts {
            start: 0,
            data: "not base64!".into(),
        };
        assert!(with(vec![garbage]).unwrap_err().contains("not base64"));
        // Found by fuzzing: an expert id past the policy's experts failed the forward.
        let mut ids = vec![1; 4 * 3 * 2];
        ids[7] = 8;
        let past = RoutedExperts {
            start: 0,
            data: encode_routed_experts(&ids, 4, 3, 2, 9),
        };
        let err = with(vec![past]).unwrap_err();
        assert!(err.contains("name expert 8; the policy has 8"), "{err}");
    }

    #[test]
    fn a_shape_that_overflows_is_refused_not_wrapped() {
        use base64::Engine as _;
        let header =
            "{'descr': '|u1', 'fortran_order': False, 'shape': (18446744073709551615, 2, 2), }";
        let mut bytes = b"\x93NUMPY\x01\x00".to_vec();
        bytes.extend_from_slice(&(header.len() as u16).to_le_bytes());
        bytes.extend_from_slice(header.as_bytes());
        let data = base64::engine::general_purpose::STANDARD.encode(&bytes);
        let mut s = segment();
        s.routed_experts = vec![RoutedExperts { start: 0, data }];
        assert!(verdict(s).unwrap_err().contains("too large"));
    }
}
