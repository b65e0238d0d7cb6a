//! The worked examples of docs/extending.md, built and run: each Rust block of the page stands
//! verbatim in this file (a test compares them), the Python Env is written out and run through
//! the external-env protocol, and the lines the page says to edit next to must still exist.

mod common;

use std::path::{Path, PathBuf};

use futures::future::BoxFuture;
use moult_runtime::agents::env::Env;
use moult_runtime::agents::process::{AgentCommand, ExternalEnv};
use moult_runtime::error::RunError;
use moult_runtime::stages::{self, Stage, StepBatch};
use serde_json::json;
use tch::Tensor;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn read(path: &str) -> String {
    std::fs::read_to_string(repo().join(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// The code block after `<!-- checked: NAME -->` in docs/extending.md.
fn block(name: &str) -> String {
    let page = read("docs/extending.md");
    let marker = format!("<!-- checked: {name} -->");
    let after = &page[page.find(&marker).expect("the marker") + marker.len()..];
    let start = after.find("```").expect("a fence") + 3;
    let body = &after[start..];
    let body = &body[body.find('\n').expect("a fence line") + 1..];
    body[..body.find("```").expect("a closing fence")].to_string()
}

// --- The examples, as the page shows them. ---

/// A group-median baseline: `A_i = R_i − median_g(R)` over the `G` samples of each group, so
/// one outlier reward moves no other sample's advantage. `rewards`: `[groups, G]`.
pub fn median_baseline(rewards: &Tensor) -> Tensor {
    let (median, _) = rewards.median_dim(-1, true);
    rewards - median
}

/// REINFORCE with the IS correction and no clipping (the policy gradient itself):
/// `l_t = −coef_t · A_t · logp_t`.
pub fn reinforce(logp: &Tensor, advantages: &Tensor, coef: &Tensor) -> Tensor {
    -(advantages * logp) * coef.detach()
}

/// Clamps every episode's reward into `[low, high]` before advantages are computed, so that one
/// runaway reward cannot dominate its group.
#[derive(Debug)]
pub struct ClipRewards {
    pub low: f64,
    pub high: f64,
}

impl Stage for ClipRewards {
    fn phase(&self) -> &'static str {
        "clipping rewards"
    }

    fn apply<'a>(&'a self, batch: &'a mut StepBatch) -> BoxFuture<'a, Result<(), RunError>> {
        for episode in batch.groups.iter_mut().flat_map(|g| &mut g.episodes) {
            episode.reward = episode.reward.clamp(self.low, self.high);
        }
        Box::pin(async { Ok(()) })
    }
}

// --- The checks. ---

#[test]
fn every_rust_example_of_the_page_stands_verbatim_in_this_test() {
    let here = include_str!("libtorch_extending.rs");
    for name in ["estimator", "loss", "stage"] {
        let code = block(name);
        assert!(
            here.contains(&code),
            "docs/extending.md's `{name}` block differs from runtime/tests/libtorch_extending.rs:\n{code}"
        );
    }
}

#[test]
fn the_lines_the_page_says_to_edit_next_to_exist() {
    let samples = read("runtime/src/learner/samples.rs");
    assert!(samples.contains("Estimator::Rloo => rloo(&r),"));
    let step = read("runtime/src/trainer/step.rs");
    assert!(step.contains("match cfg.kind") && step.contains("LossKind::Cispo"));
    let stages = read("runtime/src/stages/mod.rs");
    assert!(
        stages.contains("pub fn ordered(")
            && stages.contains("let stages: [Option<Box<dyn Stage>>;")
    );
    let api = read("operator/src/api.rs");
    for item in [
        "pub enum Estimator",
        "pub enum LossKind",
        "pub struct Algorithm",
    ] {
        assert!(api.contains(item), "{item}");
    }
    let page = read("docs/extending.md");
    assert!(page.contains("cargo run -p moult-operator --bin crdgen -- crds/rlrun.yaml"));
}

#[test]
fn the_median_baseline_matches_a_plain_loop() {
    let rewards = [[1.0, 0.0, 0.0, 9.0], [0.5, 1.0, 0.25, 1.0]];
    let r = Tensor::from_slice(&rewards.concat()).view([2, 4]);
    let got: Vec<f64> = Vec::try_from(median_baseline(&r).flatten(0, -1)).unwrap();
    let mut want = Vec::new();
    for group in rewards {
        let mut sorted = group.to_vec();
        sorted.sort_by(f64::total_cmp);
        // torch's median of an even count is the lower of the two middle values.
        let median = sorted[(sorted.len() - 1) / 2];
        want.extend(group.iter().map(|x| x - median));
    }
    assert_eq!(got, want);
}

#[test]
fn the_reinforce_loss_matches_a_plain_loop_and_its_gradient_is_the_policy_gradient() {
    let logp = Tensor::from_slice(&[-0.5f32, -1.0, -2.0]).set_requires_grad(true);
    let adv = Tensor::from_slice(&[1.0f32, -2.0, 0.5]);
    let coef = Tensor::from_slice(&[1.0f32, 0.5, 0.0]);
    let loss = reinforce(&logp, &adv, &coef);
    let got: Vec<f32> = Vec::try_from(&loss).unwrap();
    assert_eq!(got, [0.5, -1.0, 0.0]);
    loss.sum(tch::Kind::Float).backward();
    let grad: Vec<f32> = Vec::try_from(logp.grad()).unwrap();
    assert_eq!(grad, [-1.0, 1.0, 0.0], "−coef · A");
}

#[tokio::test]
async fn the_clip_rewards_stage_clamps_every_reward_in_the_stage_list() {
    let episode = |reward: f64| {
        json!({"index": 0, "session": "s", "task": {}, "status": "completed", "reward": reward,
               "seconds": 1.0, "segments": []})
    };
    let mut batch: StepBatch = serde_json::from_value(json!({
        "step": 3,
        "groups": [{"task_index": 0, "epoch": 0, "task": {}, "episodes": [episode(-4.0), episode(0.5), episode(7.0)]}],
        "version": 2,
        "rollout": {"cursor": 1, "epoch": 0},
        "stats": {"groups_started": 1, "groups_done": 1, "dropped_stale": 0, "dropped_failed": 0},
    }))
    .expect("a batch");
    let list: Vec<Box<dyn Stage>> = vec![Box::new(ClipRewards {
        low: 0.0,
        high: 1.0,
    })];
    stages::apply(&list, &mut batch).await.unwrap();
    let rewards: Vec<f64> = batch.groups[0].episodes.iter().map(|e| e.reward).collect();
    assert_eq!(rewards, [0.0, 0.5, 1.0]);
}

#[tokio::test]
async fn the_count_env_runs_over_the_env_protocol() {
    let dir = std::env::temp_dir().join(format!("moult-extending-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("count_env.py");
    std::fs::write(&file, block("env")).unwrap();
    let python = common::python().to_string_lossy().into_owned();
    let cmd = AgentCommand::python(&python, &file.display().to_string()).unwrap();
    let mut env = ExternalEnv::spawn(&cmd, None).await.unwrap();
    let task = json!({"word": "moult"});
    let prompt = env.reset(&task).await.unwrap().text();
    assert!(prompt.contains("'moult'"), "{prompt}");
    let wrong = env.step("It has 4.").await.unwrap();
    assert_eq!((wrong.reward, wrong.terminated), (0.0, false), "{wrong:?}");
    let right = env.step("5").await.unwrap();
    assert_eq!((right.reward, right.terminated), (1.0, true), "{right:?}");
    env.reset(&task).await.unwrap();
    env.step("3").await.unwrap();
    let out_of_tries = env.step("6").await.unwrap();
    assert_eq!((out_of_tries.reward, out_of_tries.terminated), (0.0, true));
    std::fs::remove_dir_all(&dir).unwrap();
}
