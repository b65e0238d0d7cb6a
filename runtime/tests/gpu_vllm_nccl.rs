//! The NCCL weight path to a real vLLM on one GPU (feature `cuda`): the publisher `moult trainer`
//! uses (rank 0 in this process, on the GPU) updates a vLLM engine started with the operator's
//! flags (`--weight-transfer-config {"backend":"nccl"}`) through the router, twice; after the
//! second update vLLM's own `/weight_checker` finds exactly the checksums of a vLLM that loaded
//! those weights from disk, the router knows the version, and a greedy generation equals that
//! vLLM's.
//!
//! It needs an NVIDIA GPU, libnccl (the `nvidia-nccl-cu12` wheel's `lib/` on `LD_LIBRARY_PATH`)
//! and vLLM 0.32.0's CUDA build (`MOULT_VLLM_PYTHON`), so it is `#[ignore]`d (reported as ignored,
//! never as passed). On a GPU machine, from the repository:
//!
//! ```text
//! bash scripts/gpu-check.sh
//! ```
//!
//! NCCL refuses two ranks of one communicator on one GPU within one host identity, so this
//! process sets its own `NCCL_HOSTID` after vLLM has started (docs/weight-sync.md).
#![cfg(feature = "cuda")]

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use moult_operator::api::WeightTransport;
use moult_runtime::local::vllm::{free_port, python, VllmProcess};
use moult_runtime::model::CausalLm;
use moult_runtime::weight_sync::publish::{PublishOptions, Publisher};
use moult_runtime::weight_sync::stream::WeightStream;
use serde_json::{json, Value};

fn models() -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("vllm-models");
    let status = std::process::Command::new(python())
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/python/make_vllm_models.py"))
        .arg(&dir)
        .status()
        .expect("MOULT_VLLM_PYTHON runs");
    assert!(status.success(), "make_vllm_models.py failed");
    dir
}

async fn vllm_on_gpu(model: &Path, name: &str, nccl: bool) -> VllmProcess {
    let port = free_port().unwrap();
    let mut args: Vec<String> = [
        "--model",
        &model.display().to_string(),
        "--host",
        "127.0.0.1",
        "--port",
        &port.to_string(),
        "--enable-scale-out",
        "--logprobs-mode",
        "processed_logprobs",
        "--dtype",
        "float32",
        "--gpu-memory-utilization",
        "0.2",
        "--enforce-eager",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    if nccl {
        args.extend([
            "--weight-transfer-config".into(),
            r#"{"backend":"nccl"}"#.into(),
        ]);
    }
    let log = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("gpu-vllm-{name}.log"));
    VllmProcess::spawn(&args, port, &log, None)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
}

async fn post(url: &str, body: Value) -> Value {
    let r = reqwest::Client::new()
        .post(url)
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = r.status();
    let text = r.text().await.unwrap();
    assert!(status.is_success(), "{url}: {status} {text}");
    serde_json::from_str(&text).unwrap_or(Value::Null)
}

async fn greedy(url: &str) -> Vec<i64> {
    let r = post(
        &format!("{url}/inference/v1/generate"),
        json!({"token_ids": [5, 17, 99, 300, 2001],
               "sampling_params": {"max_tokens": 16, "temperature": 0, "ignore_eos": true}}),
    )
    .await;
    serde_json::from_value(r["choices"][0]["token_ids"].clone()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a GPU, libnccl and vLLM's CUDA build: bash scripts/gpu-check.sh"]
async fn nccl_updates_reach_a_real_vllm_on_one_gpu() {
    assert!(
        std::env::var_os("MOULT_VLLM_PYTHON").is_some(),
        "MOULT_VLLM_PYTHON must name a python with vLLM 0.32.0's CUDA build"
    );
    let models = models();
    let (v1, v2) = (models.join("qwen3-tiny"), models.join("qwen3-tiny-v2"));

    // What a vLLM that loaded v2 from disk holds and says.
    let reference = vllm_on_gpu(&v2, "reference", false).await;
    let baseline = post(
        &format!("{}/weight_checker", reference.url),
        json!({"action": "checksum"}),
    )
    .await["checksums"]
        .clone();
    let expected_tokens = greedy(&reference.url).await;
    drop(reference);

    let engine = vllm_on_gpu(&v1, "engine", true).await;
    // vLLM has its host identity; this process (rank 0) takes another one.
    std::env::set_var("NCCL_HOSTID", "moult-gpu-check-trainer");
    let (router, _r) =
        common::start_router(std::slice::from_ref(&engine.url), "consistent-hash").await;
    let mut publisher = Publisher::connect(&PublishOptions {
        target: router.clone(),
        transport: WeightTransport::Nccl,
        device: tch::Device::Cuda(0),
        host: "127.0.0.1".into(),
        port: 0,
        folder: None,
        engine_kind: tch::Kind::Float,
        pool: None,
    })
    .await
    .unwrap();
    let weights = |dir: &Path| {
        let m = CausalLm::load(dir, tch::Kind::Float, tch::Device::Cuda(0)).unwrap();
        m.params()
            .iter()
            .map(|(n, t)| (n.clone(), t.detach().copy()))
            .collect::<Vec<_>>()
    };
    // Two updates, v1's weights again and then v2's: the second must replace every weight.
    for (version, dir) in [(1u64, &v1), (2, &v2)] {
        let report = publisher
            .update_stream(WeightStream::whole(&weights(dir)), version, true)
            .await
            .unwrap_or_else(|e| panic!("update {version}: {e}"));
        println!("update {version}: {report:?}");
    }
    let compared = post(
        &format!("{}/weight_checker", engine.url),
        json!({"action": "compare", "baseline": baseline}),
    )
    .await;
    assert_eq!(compared["match"], true, "{compared}");
    let info: Value = reqwest::get(format!("{router}/weight_info"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(
        info.to_string().contains('2'),
        "the router's version: {info}"
    );
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(greedy(&router).await, expected_tokens);
}
