//! Episodes as a compromised agent pod posts them (JSON), through the validator a run applies,
//! into the trainer's samples and the policy's forward and loss.

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

use moult_operator::api::LossKind;
use moult_runtime::agents::{Episode, EpisodeStatus};
use moult_runtime::algorithms::losses::Aggregation;
use moult_runtime::learner::samples::samples;
use moult_runtime::model::CausalLm;
use moult_runtime::rollout::validate::{check, limits, EpisodeLimits};
use moult_runtime::rollout::Group;
use moult_runtime::trainer::step::{policy_loss, LossConfig};

/// Inputs that went through the forward and the loss, and validated episodes that went through
/// the JSON round trip: the replay test checks that the seeds reach that far, so a seed corpus
/// gone stale (an input the current types no longer read) fails CI instead of fuzzing nothing
/// but the parser.
pub static FORWARDS: AtomicUsize = AtomicUsize::new(0);
pub static ROUND_TRIPS: AtomicUsize = AtomicUsize::new(0);

/// The policy version the engines serve, as far as the fuzzed rollout knows.
const NOW: u64 = 3;

/// The policy's positions in the fuzzed run: small, so that inputs of libFuzzer's usual sizes
/// reach the limit (the forged 600-token episode of a 512-position model, in miniature).
const POSITIONS: u64 = 40;

struct Policy {
    model: CausalLm,
    limits: EpisodeLimits,
}

/// The tiny Qwen3-MoE (routing replay reaches the forward) with [`POSITIONS`] positions.
fn policy_dir() -> PathBuf {
    let source = crate::made_by("make_tiny_models.py").join("qwen3-moe-tiny");
    let dir = source.with_file_name(format!("qwen3-moe-tiny-{POSITIONS}"));
    if dir.join("config.json").exists() {
        return dir;
    }
    let staging = dir.with_extension(format!("staging-{}", std::process::id()));
    std::fs::create_dir_all(&staging).expect("make the policy's folder");
    for entry in std::fs::read_dir(&source).expect("the tiny models") {
        let path = entry.expect("a file of the tiny model").path();
        let name = path.file_name().expect("a file name").to_owned();
        if name == "reference.safetensors" {
            continue;
        }
        std::fs::copy(&path, staging.join(&name)).expect("copy the tiny model");
    }
    let config = staging.join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&config).expect("its config")).expect("JSON");
    cfg["max_position_embeddings"] = POSITIONS.into();
    std::fs::write(&config, cfg.to_string()).expect("write its config");
    if std::fs::rename(&staging, &dir).is_err() {
        let _ = std::fs::remove_dir_all(&staging);
    }
    dir
}

thread_local! {
    static POLICY: Policy = {
        let dir = policy_dir();
        let model = CausalLm::load(&dir, tch::Kind::Float, tch::Device::Cpu)
            .expect("the tiny policy loads");
        Policy { model, limits: limits(&dir) }
    };
}

/// An episode the validator accepts never makes the trainer's samples, forward or loss fail:
/// a batch the trainer fails on would be quarantined, its group's work lost.
pub fn forward(data: &[u8]) {
    let Ok(episode) = serde_json::from_slice::<Episode>(data) else {
        return;
    };
    POLICY.with(|policy| {
        assert_eq!(policy.limits.max_positions, Some(POSITIONS as usize));
        // A failed episode's group is dropped before any batch; nothing of it is trained.
        if episode.status == EpisodeStatus::Failed || check(&episode, &policy.limits, NOW).is_err()
        {
            return;
        }
        let group: Group = serde_json::from_value(serde_json::json!({
            "task_index": 0, "epoch": 0, "task": null, "episodes": [episode], "oldest_version": 1,
        }))
        .expect("a group");
        let batch = samples(std::slice::from_ref(&group), &[vec![1.0]], true, None)
            .unwrap_or_else(|e| panic!("a validated episode's samples failed: {e}"));
        if batch.is_empty() {
            return;
        }
        let cfg = LossConfig {
            kind: LossKind::PpoClip,
            eps_low: 0.2,
            eps_high: 0.28,
            aggregation: Aggregation::TokenMean,
            correction: None,
            temperature: 1.0,
        };
        let (loss, metrics) = policy_loss(&policy.model, &batch, &cfg, None)
            .unwrap_or_else(|e| panic!("a validated episode failed the forward: {e}"));
        let loss = loss.double_value(&[]);
        assert!(loss.is_finite(), "loss {loss} ({metrics:?})");
        FORWARDS.fetch_add(1, Ordering::Relaxed);
    })
}

/// A validated episode crosses the network (agent pod → coordinator → trainer pod) as JSON and
/// comes back the same and still valid: JSON has no NaN or infinity, and a batch the trainer
/// cannot read would be served to it again at every restart.
pub fn json(data: &[u8]) {
    let Ok(episode) = serde_json::from_slice::<Episode>(data) else {
        return;
    };
    let limits = EpisodeLimits {
        vocab_size: Some(2003),
        max_positions: Some(64),
        experts: Some(8),
    };
    if check(&episode, &limits, NOW).is_err() {
        return;
    }
    let sent = serde_json::to_vec(&episode).expect("an episode serializes");
    let received: Episode = serde_json::from_slice(&sent)
        .unwrap_or_else(|e| panic!("a validated episode does not read back: {e}"));
    assert_eq!(check(&received, &limits, NOW), Ok(()));
    assert_eq!(
        serde_json::to_vec(&received).expect("serializes"),
        sent,
        "a validated episode changed on its way"
    );
    ROUND_TRIPS.fetch_add(1, Ordering::Relaxed);
}
