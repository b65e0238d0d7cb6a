//! moult against a real vLLM (the pinned CPU build, scripts/setup-vllm.sh): the router and the
//! engine client read vLLM's own streams (string versions, `null` spans mid-stream, prefixed
//! request ids), tokens and logprobs through the router are vLLM's own, and a weight update from
//! a folder, through the router, in the middle of a stream labels every token with the version
//! that produced it.
//!
//! Needs `MOULT_VLLM_PYTHON` (scripts/test.sh sets it). Each test starts its own vLLM server
//! (about a minute on two cores) and stops it, with its child processes, when it ends.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use moult_runtime::engine::client::{EngineClient, Generated};
use moult_runtime::router::{policy, server, EnginePool, HealthOptions, Router};
use serde_json::{json, Value};

fn vllm_python() -> PathBuf {
    let python = std::env::var_os("MOULT_VLLM_PYTHON").unwrap_or_else(|| {
        panic!(
            "MOULT_VLLM_PYTHON is not set: install the pinned vLLM with `bash scripts/setup-vllm.sh` \
             and set it to the python that prints (scripts/test.sh does both)"
        )
    });
    PathBuf::from(python)
}

/// The tiny models both engines serve (made once by the vLLM virtualenv's transformers).
fn vllm_models() -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("vllm-models");
    std::fs::create_dir_all(&dir).unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/python/make_vllm_models.py");
    let status = Command::new(vllm_python())
        .arg(script)
        .arg(&dir)
        .stdout(Stdio::null())
        .status()
        .expect("the vLLM python runs");
    assert!(status.success(), "make_vllm_models.py failed");
    dir
}

/// A vLLM server process (and its engine-core children, in its own process group).
struct Vllm {
    child: Child,
    url: String,
    log: PathBuf,
}

impl Vllm {
    /// Starts vLLM on `model` with the flags the operator gives it (minus NCCL, which needs a
    /// GPU), and waits until it serves.
    async fn start(model: &Path, name: &str) -> Vllm {
        use std::os::unix::process::CommandExt;
        // vLLM binds its own socket; a port the OS just handed out is the best we can do.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let log = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("vllm-{name}.log"));
        let out = std::fs::File::create(&log).unwrap();
        let child = Command::new(vllm_python())
            .args(["-m", "vllm.entrypoints.openai.api_server", "--model"])
            .arg(model)
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .args(["--enable-scale-out", "--logprobs-mode", "processed_logprobs"])
            // CPU: float32 as the model was saved, a small KV cache (the default reserves most of
            // the machine's memory), no graph compilation (a minute of start-up).
            .args(["--dtype", "float32", "--kv-cache-memory-bytes", "268435456"])
            .args(["--enforce-eager", "--max-model-len", "2048"])
            .env("VLLM_SERVER_DEV_MODE", "1")
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .process_group(0)
            .spawn()
            .expect("vLLM starts");
        let mut vllm = Vllm {
            child,
            url: format!("http://127.0.0.1:{port}"),
            log,
        };
        let http = reqwest::Client::new();
        let started = Instant::now();
        loop {
            if let Ok(r) = http.get(format!("{}/health", vllm.url)).send().await {
                if r.status().is_success() {
                    break;
                }
            }
            if let Ok(Some(status)) = vllm.child.try_wait() {
                panic!("vLLM exited ({status}) before serving:\n{}", vllm.log_tail());
            }
            assert!(
                started.elapsed() < Duration::from_secs(600),
                "vLLM did not serve within 10 minutes:\n{}",
                vllm.log_tail()
            );
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        println!("vLLM serves {} after {:.0?}", model.display(), started.elapsed());
        vllm
    }

    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }
}

impl Drop for Vllm {
    fn drop(&mut self) {
        // The whole group: the API server and the engine-core processes it started.
        let group = format!("-{}", self.child.id());
        let _ = Command::new("kill").args(["-TERM", &group]).status();
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                break;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        let _ = Command::new("kill").args(["-KILL", &group]).status();
        let _ = self.child.wait();
    }
}

/// moult's router in front of `engines`, with health probes patient enough for a busy CPU.
async fn router(engines: &[String]) -> (String, Arc<Router>) {
    let pool = Arc::new(EnginePool::new(engines));
    tokio::spawn(pool.clone().check_health(HealthOptions {
        interval: Duration::from_millis(500),
        timeout: Duration::from_secs(10),
        failures_to_down: 3,
    }));
    let router = Arc::new(Router::new(pool, policy::by_name("consistent-hash").unwrap()));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(server::serve(
        listener,
        router.clone(),
        std::future::pending(),
    ));
    (url, router)
}

/// `(token, logprob, version)` of a whole generation through `client`, and its finish reason.
async fn generate(
    client: &EngineClient,
    id: &str,
    prompt: &[i64],
    sampling: &Value,
) -> (Vec<(i64, f32, u64)>, String) {
    let mut stream = client
        .generate(id.to_string(), prompt, sampling, Some(id))
        .await
        .expect("the generation starts");
    let mut tokens = Vec::new();
    while let Some(event) = stream.next().await {
        match event.expect("the generation streams") {
            Generated::Token {
                id,
                logprob,
                version,
                ..
            } => tokens.push((id, logprob, version)),
            Generated::Finished { reason, .. } => return (tokens, reason),
        }
    }
    panic!("the stream ended without finishing");
}

/// vLLM's own non-streaming answer, straight from the engine.
async fn direct(url: &str, prompt: &[i64], sampling: &Value) -> Value {
    let r = reqwest::Client::new()
        .post(format!("{url}/inference/v1/generate"))
        .json(&json!({"token_ids": prompt, "sampling_params": sampling}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    r.json().await.unwrap()
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_through_the_router_gives_vllms_own_tokens_logprobs_and_versions() {
    let models = vllm_models();
    let vllm = Vllm::start(&models.join("qwen3-tiny"), "router").await;
    let (url, _router) = router(std::slice::from_ref(&vllm.url)).await;
    let client = EngineClient::new(&url);
    let prompt = [5, 17, 99, 300, 2001];
    let sampling = json!({"max_tokens": 24, "temperature": 1.0, "top_p": 0.9, "top_k": 50,
        "logprobs": 0, "seed": 42, "ignore_eos": true});

    // Streamed through the router (vLLM sends versions only with its last chunk) against vLLM's
    // own non-streaming answer with the same seed.
    let (routed, reason) = generate(&client, "a", &prompt, &sampling).await;
    assert_eq!(reason, "length");
    let own = direct(&vllm.url, &prompt, &sampling).await;
    let choice = &own["choices"][0];
    let expected: Vec<(i64, f32)> = choice["logprobs"]["content"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            (
                c["token_id"].as_i64().unwrap(),
                c["logprob"].as_f64().unwrap() as f32,
            )
        })
        .collect();
    assert_eq!(expected.len(), 24);
    let got: Vec<(i64, f32)> = routed.iter().map(|&(t, l, _)| (t, l)).collect();
    assert_eq!(got.len(), 24);
    for (i, ((t, l), (et, el))) in got.iter().zip(&expected).enumerate() {
        assert_eq!(t, et, "token {i}");
        assert!((l - el).abs() < 1e-4, "logprob {i}: {l} vs {el}");
    }
    assert!(
        routed.iter().all(|&(_, _, v)| v == 0),
        "vLLM's \"default\" weights are version 0"
    );
    assert_eq!(choice["weight_versions"][0]["version"], "default");

    // The router reads vLLM's string versions from /weight_info.
    let info: Value = reqwest::get(format!("{url}/weight_info"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(info.to_string().contains("default"), "{info}");

    // A version set through the router (vLLM's update from a folder: reload, then the version)
    // labels the next generation, read back through the router.
    post(&format!("{url}/pause?mode=keep"), json!({})).await;
    post(
        &format!("{url}/collective_rpc"),
        json!({"method": "reload_weights",
               "kwargs": {"weights_path": models.join("qwen3-tiny-v2")}}),
    )
    .await;
    post(
        &format!("{url}/update_weight_version"),
        json!({"new_version": "1"}),
    )
    .await;
    post(&format!("{url}/resume"), json!({})).await;
    let (after, _) = generate(&client, "b", &prompt, &sampling).await;
    assert_eq!(after.len(), 24);
    assert!(after.iter().all(|&(_, _, v)| v == 1), "{after:?}");
    let changed: Vec<i64> = after.iter().map(|&(t, _, _)| t).collect();
    let before: Vec<i64> = routed.iter().map(|&(t, _, _)| t).collect();
    assert_ne!(changed, before, "other weights, other tokens");
}
