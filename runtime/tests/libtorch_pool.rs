//! Engine pools (docs/lora.md, "Engine pools"): a `moult engine` holding a pool's token serves
//! many runs' adapters, each run's credential opening only its own.
#![cfg(feature = "torch")]

mod common;

use std::io::{BufRead, BufReader};
use std::path::Path;

use moult_operator::credentials::pool_credential;
use moult_runtime::engine::api::GenerateResponse;
use moult_runtime::engine::sampling::SamplingParams;
use moult_runtime::model::lora::{self, LoraConfig};
use moult_runtime::model::CausalLm;
use serde_json::{json, Value};
use tch::{Device, Kind, Tensor};

const POOL_TOKEN: &str = "pool-secret";

/// A pool engine (`--pool-max-adapters 4 --max-lora-rank 8`) over `model`, its token
/// [`POOL_TOKEN`]; the child (killed on drop) and its URL.
struct PoolEngine(std::process::Child, String);

impl Drop for PoolEngine {
    fn drop(&mut self) {
        let _ = self.0.kill();
    }
}

fn spawn_pool_engine(model: &Path) -> PoolEngine {
    let args = [
        "engine",
        "--port",
        "0",
        "--threads",
        "1",
        "--max-batch",
        "2",
    ]
    .into_iter()
    .chain([
        "--pool-max-adapters",
        "4",
        "--max-lora-rank",
        "8",
        "--model",
    ])
    .map(std::ffi::OsStr::new)
    .chain([model.as_os_str()])
    .collect::<Vec<_>>();
    let env = [("MOULT_TOKEN", POOL_TOKEN)];
    let (child, url) = common::spawn_moult_with(&args, &env, "moult engine listening on");
    PoolEngine(child, url)
}

/// A random adapter (rank 4, every projection) of `model`, seeded: as uploaded, and the model
/// with it (the trainer's forward, the reference).
fn adapter(model: &Path, seed: i64) -> (Vec<u8>, CausalLm) {
    let config = LoraConfig {
        rank: 4,
        alpha: 8.0,
        rslora: false,
        dropout: 0.0,
        targets: lora::TARGETS.iter().map(|t| t.to_string()).collect(),
    };
    let mut with = CausalLm::load(model, Kind::Float, Device::Cpu).unwrap();
    with.attach_lora(&config, None, 0).unwrap();
    tch::manual_seed(seed);
    let weights: Vec<(String, Tensor)> = tch::no_grad(|| {
        (with.params().iter())
            .map(|(n, t)| (n.clone(), t.randn_like() * 0.3))
            .collect()
    });
    let bytes = lora::adapter_bytes(&config, &model.display().to_string(), &weights);
    let mut reference = CausalLm::load(model, Kind::Float, Device::Cpu).unwrap();
    reference
        .attach_lora(&config, Some(weights.into_iter().collect()), 0)
        .unwrap();
    (bytes, reference)
}

async fn call(
    method: reqwest::Method,
    url: String,
    credential: Option<&str>,
    body: Option<reqwest::Body>,
) -> (u16, String) {
    let mut req = reqwest::Client::new().request(method, url);
    if let Some(c) = credential {
        req = req.bearer_auth(c);
    }
    if let Some(b) = body {
        req = req.header("content-type", "application/json").body(b);
    }
    let r = req.send().await.unwrap();
    (r.status().as_u16(), r.text().await.unwrap())
}

fn generate_body(model: &str, seed: u64) -> reqwest::Body {
    json!({"token_ids": [1, 2, 3, 4, 5], "model": model,
        "sampling_params": {"max_tokens": 6, "temperature": 1.0, "seed": seed, "ignore_eos": true}})
    .to_string()
    .into()
}

/// A run's credential opens generation with its own adapters, loading its own, and nothing else;
/// its tokens carry its adapter's version and are that adapter's; old versions go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn libtorch_a_pool_run_uses_only_its_own_adapters() {
    use reqwest::Method;
    let model = common::dense_model();
    let engine = spawn_pool_engine(&model);
    let url = |path: &str| format!("{}{path}", engine.1);
    let (a, b) = (
        pool_credential(POOL_TOKEN, "run-a"),
        pool_credential(POOL_TOKEN, "run-b"),
    );
    let (a1, ref_a1) = adapter(&model, 1);
    let (b1, _) = adapter(&model, 2);
    let put = |name: &str, cred: &str, bytes: &Vec<u8>| {
        let (url, cred, body) = (
            url(&format!("/v1/adapters/{name}")),
            cred.to_string(),
            bytes.clone(),
        );
        async move { call(Method::PUT, url, Some(&cred), Some(body.into())).await }
    };
    let (status, text) = put("run-a-v1", &a, &a1).await;
    assert_eq!(status, 200, "{text}");
    // Another run's name, with A's credential: refused, naming whose names A may use.
    let (status, text) = put("run-b-v1", &a, &b1).await;
    assert_eq!(status, 403, "{text}");
    assert!(
        text.contains("run `run-a` may use only its own adapters"),
        "{text}"
    );
    let (status, text) = put("run-b-v1", &b, &b1).await;
    assert_eq!(status, 200, "{text}");

    // A cannot generate with B's adapter, nor with the bare base model.
    for model in ["run-b-v1", "qwen3-tiny"] {
        let (status, text) = call(
            Method::POST,
            url("/inference/v1/generate"),
            Some(&a),
            Some(generate_body(model, 1)),
        )
        .await;
        assert_eq!(status, 403, "{model}: {text}");
    }
    // A's generation: its adapter's tokens, labelled with its version.
    let (status, text) = call(
        Method::POST,
        url("/inference/v1/generate"),
        Some(&a),
        Some(generate_body("run-a-v1", 3)),
    )
    .await;
    assert_eq!(status, 200, "{text}");
    let resp: GenerateResponse = serde_json::from_str(&text).unwrap();
    let choice = &resp.choices[0];
    assert_eq!(choice.weight_versions.len(), 1);
    assert_eq!(choice.weight_versions[0].version, 1);
    let engine_lp: Vec<f32> = choice.logprobs.content.iter().map(|c| c.logprob).collect();
    let params = SamplingParams {
        temperature: 1.0,
        ..Default::default()
    };
    let reference =
        common::reference_logprobs(&ref_a1, &[1, 2, 3, 4, 5], &choice.token_ids, &params, None);
    let most = (engine_lp.iter().zip(&reference)).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    assert!(most < 1e-4, "A's tokens are A's adapter's: {most}");

    // Control routes and the path-based load are the pool's alone.
    for (method, path) in [
        (Method::POST, "/pause"),
        (Method::POST, "/v1/load_lora_adapter"),
        (Method::POST, "/update_weight_version"),
        (Method::GET, "/is_paused"),
    ] {
        let (status, text) = call(method, url(path), Some(&a), None).await;
        assert_eq!(status, 403, "{path}: {text}");
    }
    let (status, _) = call(
        Method::POST,
        url("/v1/unload_lora_adapter"),
        Some(&a),
        Some(json!({"lora_name": "run-b-v1"}).to_string().into()),
    )
    .await;
    assert_eq!(status, 403, "A cannot unload B's adapter");
    // A forged credential (another run's name on A's MAC) is no credential.
    let forged = a.replacen("run-a", "run-b", 1);
    let (status, _) = call(Method::GET, url("/v1/models"), Some(&forged), None).await;
    assert_eq!(status, 401);

    // A sees only its own adapters, and its newest version.
    let models = |cred: String| async move {
        let (_, text) = call(Method::GET, url("/v1/models"), Some(&cred), None).await;
        let v: Value = serde_json::from_str(&text).unwrap();
        (v["data"].as_array().unwrap().iter())
            .map(|m| m["id"].as_str().unwrap().to_string())
            .collect::<Vec<_>>()
    };
    assert_eq!(models(a.clone()).await, ["qwen3-tiny", "run-a-v1"]);
    // Versions 2 and 3: version 1 goes once 3 is in (a run holds two while it switches).
    for v in [2, 3] {
        let (status, text) = put(&format!("run-a-v{v}"), &a, &a1).await;
        assert_eq!(status, 200, "{text}");
    }
    assert_eq!(
        models(a.clone()).await,
        ["qwen3-tiny", "run-a-v2", "run-a-v3"]
    );
    assert_eq!(
        models(POOL_TOKEN.to_string()).await,
        ["qwen3-tiny", "run-a-v2", "run-a-v3", "run-b-v1"]
    );
    let (_, text) = call(Method::GET, url("/weight_info"), Some(&a), None).await;
    let info: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(info["weight_version"], 3);
    // A rank above the pool's maxRank is refused, naming it.
    let big = {
        let config = LoraConfig {
            rank: 16,
            alpha: 16.0,
            rslora: false,
            dropout: 0.0,
            targets: vec!["q_proj".into()],
        };
        let mut m = CausalLm::load(&model, Kind::Float, Device::Cpu).unwrap();
        m.attach_lora(&config, None, 0).unwrap();
        let weights: Vec<(String, Tensor)> = m
            .params()
            .iter()
            .map(|(n, t)| (n.clone(), t.shallow_clone()))
            .collect();
        lora::adapter_bytes(&config, "tiny", &weights)
    };
    let (status, text) = put("run-a-v4", &a, &big).await;
    assert_eq!(status, 400, "{text}");
    assert!(text.contains("maxRank"), "{text}");

    // Each run's share: A sees its own; the pool sees both.
    let (_, text) = call(Method::GET, url("/v1/pool/share"), Some(&a), None).await;
    let share: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(share["runs"].as_object().unwrap().len(), 1, "{share}");
    assert!(
        share["runs"]["run-a"]["tokens"].as_u64().unwrap() >= 11,
        "{share}"
    );

    // An abort with A's credential stops A's requests, never B's, even named by id: both wait
    // in a paused engine, A aborts both ids, and only A's ends aborted.
    let pool = Some(POOL_TOKEN);
    let (status, text) = call(Method::POST, url("/pause?mode=keep"), pool, None).await;
    assert_eq!(status, 200, "{text}");
    let start = |id: &str, model: &str, cred: &str| {
        let body = json!({"request_id": id, "token_ids": [1, 2, 3], "model": model,
            "sampling_params": {"max_tokens": 3, "temperature": 1.0, "ignore_eos": true}});
        let (url, cred) = (url("/inference/v1/generate"), cred.to_string());
        tokio::spawn(async move {
            let (status, text) = call(
                Method::POST,
                url,
                Some(&cred),
                Some(body.to_string().into()),
            )
            .await;
            assert_eq!(status, 200, "{text}");
            let resp: GenerateResponse = serde_json::from_str(&text).unwrap();
            resp.choices[0].finish_reason.clone().unwrap()
        })
    };
    let (on_a, on_b) = (
        start("a-req", "run-a-v3", &a),
        start("b-req", "run-b-v1", &b),
    );
    // Until both wait (the engine's gauge).
    for _ in 0..200 {
        let (_, text) = call(Method::GET, url("/metrics"), pool, None).await;
        if text.lines().any(|l| l == "vllm:num_requests_waiting 2") {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let ids = json!({"request_ids": ["a-req", "b-req"]}).to_string();
    let (status, text) = call(
        Method::POST,
        url("/inference/v1/abort_requests"),
        Some(&a),
        Some(ids.into()),
    )
    .await;
    assert_eq!(status, 200, "{text}");
    let (status, text) = call(Method::POST, url("/resume"), pool, None).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(on_a.await.unwrap(), "abort", "A's own request is aborted");
    assert_eq!(on_b.await.unwrap(), "length", "B's request runs to its end");
}

/// `moult pool`, stopped as Ctrl-C stops it (it stops its engines) when dropped.
struct MoultPool(std::process::Child);

impl Drop for MoultPool {
    fn drop(&mut self) {
        let pid = self.0.id().to_string();
        let _ = std::process::Command::new("kill")
            .args(["-INT", &pid])
            .status();
        let _ = self.0.wait();
    }
}

/// The recipe's engine pool (examples/successor/enginepool.yaml) with its two runs at once, each
/// `moult run` a process of its own (docs/lora.md, "Two runs on one pool"): one learns the
/// successor task and the other its reverse, on one engine, each with its adapter, and both
/// rewards rise; the engine computed tokens for both.
#[test]
fn libtorch_two_runs_on_one_pool_learn_two_tasks() {
    let dir = common::repo_root().join("examples/successor");
    let status = std::process::Command::new(common::python())
        .arg(dir.join("make_model.py"))
        .arg(dir.join("model-pool"))
        .arg("--both")
        .status()
        .unwrap();
    assert!(status.success(), "make_model.py --both failed");
    let mut pool = MoultPool(
        common::moult()
            .arg("pool")
            .arg(dir.join("enginepool.yaml"))
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let banner = BufReader::new(pool.0.stdout.take().unwrap()).lines().next();
    let banner = banner.expect("a line").unwrap();
    assert!(
        banner.starts_with("moult pool successor-pool: 1 engines at "),
        "{banner}"
    );
    let out = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("pool-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let runs: Vec<_> = ["up", "down"]
        .iter()
        .map(|task| {
            let child = common::moult()
                .arg("run")
                .arg(dir.join(format!("rlrun-pool-{task}.yaml")))
                .arg("--out")
                .arg(out.join(task))
                .args(["--steps", "40", "--seed", "1", "--quiet"])
                .spawn()
                .unwrap();
            (task, child)
        })
        .collect();
    for (task, mut child) in runs {
        assert!(
            child.wait().unwrap().success(),
            "moult run of the {task} task failed"
        );
    }
    let pool_file =
        std::fs::read_to_string(std::env::temp_dir().join("moult-pools/successor-pool.json"))
            .unwrap();
    let pool_file: Value = serde_json::from_str(&pool_file).unwrap();
    let (engine, token) = (
        pool_file["engines"][0].as_str().unwrap(),
        pool_file["token"].as_str().unwrap(),
    );
    let share: Value = tokio::runtime::Runtime::new().unwrap().block_on(async {
        let (status, text) = call(
            reqwest::Method::GET,
            format!("{engine}/v1/pool/share"),
            Some(token),
            None,
        )
        .await;
        assert_eq!(status, 200, "{text}");
        serde_json::from_str(&text).unwrap()
    });
    drop(pool);
    for (task, run) in [("up", "successor-up"), ("down", "successor-down")] {
        let rewards: Vec<f64> = std::fs::read_to_string(out.join(task).join("metrics.jsonl"))
            .unwrap()
            .lines()
            .map(|l| {
                serde_json::from_str::<Value>(l).unwrap()["reward_mean"]
                    .as_f64()
                    .unwrap()
            })
            .collect();
        assert_eq!(rewards.len(), 40);
        let mean = |r: &[f64]| r.iter().sum::<f64>() / r.len() as f64;
        let (first, last) = (mean(&rewards[..3]), mean(&rewards[37..]));
        println!("{task}: reward {first:.2} -> {last:.2}");
        assert!(first <= 0.4, "{task}: the base is at chance: {first}");
        assert!(
            last >= first + 0.4,
            "{task}: the reward did not rise: {rewards:?}"
        );
        let tokens = share["runs"][run]["tokens"].as_u64().unwrap_or(0);
        assert!(
            tokens > 10_000,
            "{run} generated on the pool's engine: {share}"
        );
    }
    let _ = std::fs::remove_dir_all(&out);
}
