//! Partial rollout through the router (libtorch): weight updates pushed again and again to two
//! `moult engine` processes while they generate, over the TCP stream and through a folder
//! (the Filesystem transport). No request is lost, every token carries the
//! version that produced it, and its logprob is the one a forward with that version's weights
//! gives (so the label is not just a number: the weights really were those).

mod common;

use std::time::Duration;

use common::{dense_model, reference_logprobs, spawn_engine, start_router, Generation};
use moult_operator::api::WeightTransport;
use moult_runtime::engine::sampling::SamplingParams;
use moult_runtime::model::CausalLm;
use moult_runtime::weight_sync::publish::{PublishOptions, Publisher};
use moult_runtime::weight_sync::stream::WeightStream;
use serde_json::{json, Value};
use tch::Tensor;
use tokio::sync::watch;

fn spawn_stream(
    url: String,
    body: Value,
    session: String,
    progress: watch::Sender<usize>,
) -> tokio::task::JoinHandle<Generation> {
    tokio::spawn(async move {
        let r = reqwest::Client::new()
            .post(format!("{url}/inference/v1/generate"))
            .header("x-moult-session", session)
            .json(&body)
            .send()
            .await
            .unwrap();
        Generation::read(r, |g| {
            let _ = progress.send(g.ids.len());
        })
        .await
    })
}

/// Version `v`'s weights: the checkpoint plus noise seeded by `v`.
fn version(base: &CausalLm, v: i64) -> Vec<(String, Tensor)> {
    tch::manual_seed(v);
    base.params()
        .iter()
        .map(|(name, t)| (name.clone(), t.detach() + Tensor::randn_like(t) * 0.08))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn libtorch_repeated_weight_updates_under_load_label_every_token() {
    updates_under_load(WeightTransport::Tcp).await;
}

/// The same through the Filesystem transport: safetensors in a folder, reloaded by each engine
/// between pause and resume.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn libtorch_filesystem_weight_updates_under_load_label_every_token() {
    updates_under_load(WeightTransport::Filesystem).await;
}

async fn updates_under_load(transport: WeightTransport) {
    let dir = dense_model();
    let (mut a, a_url) = spawn_engine(&dir);
    let (mut b, b_url) = spawn_engine(&dir);
    let (url, _router) = start_router(&[a_url, b_url], "least-tokens").await;

    let base = CausalLm::load(&dir, tch::Kind::Float, tch::Device::Cpu).unwrap();
    const UPDATES: i64 = 3;
    let weights: Vec<Vec<(String, Tensor)>> = (1..=UPDATES).map(|v| version(&base, v)).collect();

    const N: usize = 4;
    const MAX: usize = 1200;
    let prompts: Vec<Vec<i64>> = (0..N)
        .map(|i| (0..6).map(|j| ((i * 91 + j * 7) % 2000) as i64).collect())
        .collect();
    let mut tasks = Vec::new();
    let mut progress = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        let (tx, rx) = watch::channel(0);
        let body = json!({"token_ids": p, "stream": true,
            "sampling_params": {"max_tokens": MAX, "ignore_eos": true, "seed": i}});
        tasks.push(spawn_stream(url.clone(), body, format!("s{i}"), tx));
        progress.push(rx);
    }

    let folder = std::env::temp_dir().join(format!("moult-fs-sync-{}", std::process::id()));
    let mut sync = Publisher::connect(&PublishOptions {
        target: url.clone(),
        transport,
        device: tch::Device::Cpu,
        host: "127.0.0.1".into(),
        port: 0,
        folder: Some(folder.clone()),
        engine_kind: tch::Kind::Float,
        pool: None,
    })
    .await
    .unwrap();
    if let Publisher::Tcp(tcp) = &mut sync {
        tcp.bucket_bytes = 64 << 10; // several buckets per update
    }
    let mut reports = Vec::new();
    for (k, w) in weights.iter().enumerate() {
        // Wait until every request has made progress under the current version.
        let target = 20 * (k + 1);
        for p in &mut progress {
            tokio::time::timeout(Duration::from_secs(60), p.wait_for(|&n| n >= target))
                .await
                .unwrap()
                .unwrap();
        }
        let update = sync.update_stream(WeightStream::whole(w), k as u64 + 1, true);
        reports.push(update.await.unwrap());
    }
    let buckets = if transport == WeightTransport::Tcp {
        2
    } else {
        1
    };
    assert!(reports.iter().all(|r| r.buckets >= buckets && r.bytes > 0));
    if transport == WeightTransport::Filesystem {
        // One folder left: the newest version's.
        let left: Vec<_> = std::fs::read_dir(&folder).unwrap().collect();
        assert_eq!(left.len(), 1);
        assert!(folder
            .join(format!("v{UPDATES}/model.safetensors"))
            .is_file());
        std::fs::remove_dir_all(&folder).unwrap();
    }

    let params = SamplingParams {
        max_tokens: MAX,
        ignore_eos: true,
        ..SamplingParams::default()
    };
    let models: Vec<CausalLm> = std::iter::once(base)
        .chain(weights.iter().map(|w| {
            let m = CausalLm::load(&dir, tch::Kind::Float, tch::Device::Cpu).unwrap();
            tch::no_grad(|| {
                for (name, t) in w {
                    m.params()[name].shallow_clone().copy_(t);
                }
            });
            m
        }))
        .collect();
    for (i, task) in tasks.into_iter().enumerate() {
        let Generation {
            ids,
            logprobs: lps,
            versions,
            finish,
            ..
        } = task.await.unwrap();
        assert_eq!(finish, "length", "request {i}");
        assert_eq!(ids.len(), MAX, "request {i}: nothing lost");
        assert!(
            versions.windows(2).all(|w| w[0] <= w[1]),
            "request {i}: versions never go back"
        );
        assert_eq!(versions[0], 0);
        assert_eq!(
            *versions.last().unwrap(),
            UPDATES as u64,
            "request {i} saw every update"
        );
        for (v, model) in models.iter().enumerate() {
            let reference = reference_logprobs(model, &prompts[i], &ids, &params, None);
            for (k, (&got, &want)) in lps.iter().zip(&reference).enumerate() {
                if versions[k] as usize == v {
                    assert!(
                        (got - want).abs() < 1e-4,
                        "request {i} token {k} (version {v}): {got} vs {want}"
                    );
                }
            }
        }
    }
    for child in [&mut a, &mut b] {
        child.kill().unwrap();
        child.wait().unwrap();
    }
}
