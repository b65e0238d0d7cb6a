//! The rollout loop without a trainer (libtorch): the agent pool plays a built-in env through the
//! loopback server and the router on `moult engine` processes; the rollout pool streams groups;
//! after every batch new weights go out with partial rollout while the next groups generate; an
//! engine joins mid-run and another leaves. Every batch respects the staleness bound, and every
//! sampled token carries a version.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{chat_model, dense_model, spawn_engine, start_router};
use moult_runtime::agents::env::EnvLoopOptions;
use moult_runtime::agents::{Agent, AgentPool, PoolOptions};
use moult_runtime::chat::{ChatSampling, ChatTemplate, Tokenizer};
use moult_runtime::loopback::{ChatService, EngineClient, ServiceOptions};
use moult_runtime::model::CausalLm;
use moult_runtime::rollout::{next_batch, RolloutOptions, RolloutPool, RolloutState};
use moult_runtime::weight_sync::orchestrate::WeightSync;
use moult_runtime::weight_sync::stream::WeightStream;
use serde_json::json;
use tch::Tensor;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn libtorch_rollout_streams_fresh_groups_across_updates_and_scaling() {
    let dir = dense_model();
    let (a, a_url) = spawn_engine(&dir);
    let (b, b_url) = spawn_engine(&dir);
    let (router_url, router) = start_router(&[a_url.clone(), b_url], "consistent-hash").await;
    let pool = router.pool.clone();

    // The random model with the Qwen3 chat template: the env is played badly, but played.
    let service = Arc::new(ChatService::new(
        EngineClient::new(&router_url),
        Tokenizer::from_model_dir(&dir).unwrap(),
        ChatTemplate::from_model_dir(&chat_model()).unwrap(),
        ServiceOptions::pool(256, "tiny"),
    ));
    let agents = Arc::new(
        AgentPool::new(
            service,
            Agent::BuiltinEnv("repeat".into()),
            PoolOptions {
                concurrency: 16,
                timeout: Duration::from_secs(60),
                loopback_url: String::new(),
                env_loop: EnvLoopOptions {
                    max_turns: 2,
                    sampling: ChatSampling {
                        max_tokens: Some(24),
                        temperature: Some(1.0),
                        ..Default::default()
                    },
                    ..Default::default()
                },
                scratch_dir: std::env::temp_dir()
                    .join(format!("moult-rollout-{}", std::process::id())),
                jail: None,
                sandboxes: None,
            },
        )
        .unwrap(),
    );
    let dataset = Arc::new(
        (0..5)
            .map(|i| json!({"word": format!("w{i}"), "tries": 2}))
            .collect::<Vec<_>>(),
    );
    let opts = RolloutOptions {
        group_size: 4,
        batch_size: 2,
        max_staleness: 1,
        limits: Default::default(),
        dynamic_sampling: None,
    };
    let (rollout, mut queue) =
        RolloutPool::start(agents, dataset, opts.clone(), RolloutState::default(), 0).unwrap();

    let base = CausalLm::load(&dir, tch::Kind::Float, tch::Device::Cpu).unwrap();
    let mut sync = WeightSync::new(&router_url);
    sync.connect_tcp("127.0.0.1:0", "127.0.0.1").await.unwrap();
    let mut extra = None;
    let mut new_engine: Option<String> = None;
    for step in 1..=5u64 {
        let batch = tokio::time::timeout(
            Duration::from_secs(120),
            next_batch(&rollout, &mut queue, &opts),
        )
        .await
        .expect("a batch in time")
        .unwrap();
        let now = rollout.version();
        assert_eq!(batch.len(), opts.batch_size);
        for group in &batch {
            assert_eq!(group.episodes.len(), opts.group_size);
            let oldest = group.oldest_version.expect("sampled tokens carry versions");
            assert!(
                now - oldest <= opts.max_staleness,
                "step {step}: a token of version {oldest} at {now}"
            );
            for e in &group.episodes {
                for s in &e.segments {
                    for (m, v) in s.loss_mask.iter().zip(&s.versions) {
                        assert_eq!(
                            *m == 1,
                            v.is_some(),
                            "a version on exactly the sampled tokens"
                        );
                    }
                }
            }
        }
        drop(batch); // trained
                     // Scale: a third engine joins after step 2; the first leaves after step 4.
                     // The weight sync connects the data plane again by itself when the engine set changed.
        if step == 2 {
            let (c, c_url) = spawn_engine(&dir);
            pool.add(&c_url);
            // It serves the checkpoint, not version 1: no generation until an update reaches it.
            let mut waited = 0;
            while pool
                .all()
                .iter()
                .any(|e| e.url() == c_url && e.version().is_none())
            {
                tokio::time::sleep(Duration::from_millis(50)).await;
                waited += 1;
                assert!(
                    waited < 200,
                    "the health check did not read the new engine's version"
                );
            }
            assert!(pool.routable().iter().all(|e| e.url() != c_url));
            new_engine = Some(c_url);
            extra = Some(c);
        }
        if step == 4 {
            pool.remove(&a_url);
        }
        tch::manual_seed(step as i64);
        let weights: Vec<(String, Tensor)> = base
            .params()
            .iter()
            .map(|(n, t)| (n.clone(), t.detach() + Tensor::randn_like(t) * 0.05))
            .collect();
        let whole = WeightStream::whole(&weights);
        let report = sync.update_stream(whole, step, true).await.unwrap();
        assert!(report.paused >= report.transfer);
        rollout.set_version(step);
        if let Some(url) = &new_engine {
            assert!(
                pool.routable().iter().any(|e| e.url() == url),
                "updated, so routed to"
            );
        }
    }
    let stats = rollout.stats();
    assert!(stats.groups_done >= 10, "{stats:?}");
    assert_eq!(stats.dropped_failed, 0, "{stats:?}");
    for mut child in [Some(a), Some(b), extra].into_iter().flatten() {
        child.kill().unwrap();
        child.wait().unwrap();
    }
}
