//! What the benchmarks share: a near-instant stub engine and a load generator.
#![allow(dead_code)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::response::sse::{Event, Sse};
use axum::routing::post;
use axum::Router;
use serde_json::{json, Value};

/// A stub engine: every generate request gets one token and its finish at once.
pub async fn stub_engine() -> String {
    async fn generate(
    ) -> Sse<futures::stream::Iter<std::vec::IntoIter<Result<Event, std::convert::Infallible>>>>
    {
        let token = json!({"request_id": "x", "choices": [{"index": 0, "token_ids": [9707],
            "logprobs": {"content": [{"token_id": 9707, "logprob": -0.1}]}, "finish_reason": null,
            "routed_experts": null, "weight_versions": [{"version": 0, "start": 0, "end": 1}]}]});
        let end = json!({"request_id": "x", "choices": [{"index": 0, "token_ids": [],
            "logprobs": {"content": []}, "finish_reason": "length", "routed_experts": null,
            "weight_versions": []}], "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}});
        Sse::new(futures::stream::iter(vec![
            Ok(Event::default().data(token.to_string())),
            Ok(Event::default().data(end.to_string())),
            Ok(Event::default().data("[DONE]")),
        ]))
    }
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let app = Router::new()
        .route("/health", axum::routing::get(|| async { "ok" }))
        .route("/inference/v1/generate", post(generate));
    tokio::spawn(async move { axum::serve(listener, app).await });
    url
}

/// Sends every `(path, body)` to `url` from `concurrency` clients; the elapsed time and each
/// request's latency in µs.
pub async fn hammer(
    url: String,
    bodies: Vec<(String, Value)>,
    concurrency: usize,
) -> (Duration, Vec<f64>) {
    let client = reqwest::Client::new();
    let bodies = Arc::new(bodies);
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let start = Instant::now();
    let workers: Vec<_> = (0..concurrency)
        .map(|_| {
            let (client, url, bodies, next) =
                (client.clone(), url.clone(), bodies.clone(), next.clone());
            tokio::spawn(async move {
                let mut latencies = Vec::new();
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let Some((path, body)) = bodies.get(i) else {
                        break;
                    };
                    let sent = Instant::now();
                    let r = client
                        .post(format!("{url}{path}"))
                        .json(body)
                        .send()
                        .await
                        .unwrap();
                    assert!(r.status().is_success(), "{path}: {}", r.status());
                    r.bytes().await.unwrap();
                    latencies.push(sent.elapsed().as_secs_f64() * 1e6);
                }
                latencies
            })
        })
        .collect();
    let mut latencies = Vec::new();
    for w in workers {
        latencies.extend(w.await.unwrap());
    }
    (start.elapsed(), latencies)
}

/// The `p`-quantile (0..=1) of `values`.
pub fn quantile(values: &[f64], p: f64) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[((v.len() - 1) as f64 * p).round() as usize]
}

/// The repository root.
pub fn root() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Runs Python (the project's interpreter) with `args`; its stdout.
pub fn run_python(args: &[&str]) -> String {
    let python = std::env::var_os("MOULT_PYTHON")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| root().join(".venv/bin/python"));
    let out = std::process::Command::new(python)
        .args(args)
        .output()
        .expect("run python (source scripts/env.sh first)");
    assert!(
        out.status.success(),
        "{args:?} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// The tiny random Qwen3 of the tests, made once under cargo's target directory.
pub fn tiny_model() -> std::path::PathBuf {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("bench-models");
    let tiny = dir.join("qwen3-tiny");
    if !tiny.join("model.safetensors").exists() {
        let script = root().join("tests/python/make_tiny_models.py");
        run_python(&[script.to_str().unwrap(), dir.to_str().unwrap()]);
    }
    tiny
}

/// A random model of Qwen3-0.6B's width with `layers` layers, made once.
pub fn qwen3_width_model(layers: usize) -> std::path::PathBuf {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("bench-models")
        .join(format!("qwen3-0.6b-width-{layers}-layers"));
    if !dir.join("model.safetensors").exists() {
        let fixture = root().join("tests/fixtures/qwen3_0.6b_config.json");
        let mut config: Value =
            serde_json::from_str(&std::fs::read_to_string(fixture).unwrap()).unwrap();
        config["num_hidden_layers"] = json!(layers);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.with_extension("config.json");
        std::fs::write(&path, config.to_string()).unwrap();
        let script = root().join("tests/python/make_random_model.py");
        run_python(&[
            script.to_str().unwrap(),
            path.to_str().unwrap(),
            dir.to_str().unwrap(),
        ]);
    }
    dir
}

/// Starts a built-in engine in this process on an ephemeral port; its URL.
pub async fn start_engine(model: &std::path::Path, threads: usize) -> String {
    start_engine_lora(model, threads, None).await
}

/// [`start_engine`] serving a new LoRA adapter of shape `lora` (a LoRA run's engine).
pub async fn start_engine_lora(
    model: &std::path::Path,
    threads: usize,
    lora: Option<moult_runtime::model::lora::LoraConfig>,
) -> String {
    use moult_runtime::engine::{http, EngineHandle, EngineOptions};
    let cfg = moult_runtime::model::ModelConfig::from_dir(model).unwrap();
    let m = moult_runtime::model::CausalLm::load_lora(
        model,
        lora.as_ref(),
        tch::Kind::Float,
        tch::Device::Cpu,
    )
    .unwrap();
    let opts = EngineOptions {
        max_batch: 64,
        max_model_len: 2048,
        max_prefill_tokens: 2048,
        max_waiting: 4096,
        return_routed_experts: false,
        eos_token_ids: cfg.eos_token_ids.clone(),
        threads: Some(threads),
        packed_weights: None,
        pool: None,
    };
    let (handle, _thread) = EngineHandle::spawn(m, "bench".into(), opts);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(http::serve(listener, handle, std::future::pending()));
    url
}

/// The main recipe (examples/successor): its base model made (if not current) and its manifest
/// with absolute paths (model, env.py, and `tasks` or the recipe's own task file), so that it
/// runs from anywhere, without its evaluation (`spec.eval`: benchmarks time training; the eval
/// bench adds one of its own). Returns the recipe folder and the manifest text.
pub fn successor_manifest(tasks: Option<&std::path::Path>) -> (std::path::PathBuf, String) {
    let recipe = root().join("examples/successor");
    let model = recipe.join("model");
    run_python(&[
        recipe.join("make_model.py").to_str().unwrap(),
        model.to_str().unwrap(),
    ]);
    let tasks = tasks.map_or_else(|| recipe.join("tasks.jsonl"), std::path::Path::to_path_buf);
    let manifest = std::fs::read_to_string(recipe.join("rlrun.yaml"))
        .unwrap()
        .replace("path: model", &format!("path: {}", model.display()))
        .replace("path: tasks.jsonl", &format!("path: {}", tasks.display()))
        .replace(
            "command: [\"python\", \"env.py\"]",
            &format!(
                "command: [\"python\", \"{}\"]",
                recipe.join("env.py").display()
            ),
        );
    // The `eval:` block: from its line to the next field at its indentation.
    let mut in_eval = false;
    let manifest: String = manifest
        .lines()
        .filter(|l| {
            if l.starts_with("  ") && !l.starts_with("   ") {
                in_eval = l.starts_with("  eval:");
            }
            !in_eval
        })
        .map(|l| format!("{l}\n"))
        .collect();
    (recipe, manifest)
}

/// The records of a `metrics.jsonl` (none if it does not exist yet).
pub fn metrics_records(path: &std::path::Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).expect("metrics lines are JSON"))
        .collect()
}

/// A run's outcome as a benchmark sees it.
pub struct Outcome {
    /// From start to the last step's record.
    pub seconds: f64,
    /// From start to the first step's record (start-up, first batch, first step).
    pub first_step: f64,
    pub steps: Vec<serde_json::Value>,
}

/// Waits until `metrics_path` holds `steps` records, noting when the first arrived; panics if
/// one of `children` exits meanwhile.
pub fn follow(
    metrics_path: &std::path::Path,
    steps: u64,
    started: Instant,
    children: &mut [std::process::Child],
) -> Outcome {
    let mut first_step = None;
    loop {
        let records = metrics_records(metrics_path);
        if first_step.is_none() && !records.is_empty() {
            first_step = Some(started.elapsed().as_secs_f64());
        }
        if records.len() as u64 >= steps {
            return Outcome {
                seconds: started.elapsed().as_secs_f64(),
                first_step: first_step.unwrap_or_default(),
                steps: records,
            };
        }
        for c in children.iter_mut() {
            if let Some(status) = c.try_wait().unwrap() {
                panic!("a cluster role exited early: {status}");
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Which CPUs each role's process may run on (`taskset -c` lists such as `0` or `0,1`).
#[derive(Debug, Clone, Copy)]
pub struct Pinning {
    pub engine: &'static str,
    pub trainer: &'static str,
    /// The coordinator and the agents (with the env processes they start).
    pub rest: &'static str,
}

/// `moult` pinned to `cpus`, or free to run anywhere.
fn moult_on(cpus: Option<&str>) -> std::process::Command {
    let moult = env!("CARGO_BIN_EXE_moult");
    match cpus {
        Some(cpus) => {
            let mut c = std::process::Command::new("taskset");
            c.args(["-c", cpus, moult]);
            c
        }
        None => std::process::Command::new(moult),
    }
}

/// The cluster roles of `manifest` as separate processes (`moult engine`, `moult coordinator`,
/// `moult trainer`, `moult agents`) talking HTTP and the TCP weight stream with the run's
/// token, as they do in the operator's pods, with the recipe's model and `tasks`; runs until
/// `steps` steps are recorded. Logs go to `dir`.
pub fn run_roles(
    manifest: &std::path::Path,
    model: &std::path::Path,
    tasks: &std::path::Path,
    dir: &std::path::Path,
    steps: u64,
    pinning: Option<Pinning>,
) -> Outcome {
    use std::process::Stdio;
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir).unwrap();
    let (engine, coordinator) = (free_port(), free_port());
    let engine_url = format!("http://127.0.0.1:{engine}");
    let coordinator_url = format!("http://127.0.0.1:{coordinator}");
    let log = |name: &str| Stdio::from(std::fs::File::create(dir.join(name)).unwrap());
    let token = [("MOULT_TOKEN", "bench-token")];
    let cpus = |f: fn(&Pinning) -> &'static str| pinning.as_ref().map(f);
    let started = Instant::now();
    let mut children = vec![
        moult_on(cpus(|p| p.engine))
            .args(["engine", "--model"])
            .arg(model)
            .args(["--port", &engine.to_string()])
            .envs(token)
            .stdout(Stdio::null())
            .stderr(log("engine.log"))
            .spawn()
            .unwrap(),
        moult_on(cpus(|p| p.rest))
            .arg("coordinator")
            .arg("--config")
            .arg(manifest)
            .args(["--host", "127.0.0.1", "--port", &coordinator.to_string()])
            .envs(token)
            .env("MOULT_ENGINES", &engine_url)
            .env("MOULT_TASKS", tasks)
            .stderr(log("coordinator.log"))
            .spawn()
            .unwrap(),
        moult_on(cpus(|p| p.trainer))
            .arg("trainer")
            .arg("--config")
            .arg(manifest)
            .args(["--metrics-addr", &format!("127.0.0.1:{}", free_port())])
            .envs(token)
            .env("MOULT_MODEL", model)
            .env("MOULT_COORDINATOR", &coordinator_url)
            .env("POD_IP", "127.0.0.1")
            .env("MOULT_CHECKPOINTS", dir.join("checkpoints"))
            .stderr(log("trainer.log"))
            .spawn()
            .unwrap(),
        moult_on(cpus(|p| p.rest))
            .arg("agents")
            .arg("--config")
            .arg(manifest)
            .args(["--coordinator", &coordinator_url])
            .args(["--metrics-addr", &format!("127.0.0.1:{}", free_port())])
            .envs(token)
            .env("MOULT_MODEL", model)
            .stderr(log("agents.log"))
            .spawn()
            .unwrap(),
    ];
    let metrics_path = dir.join("checkpoints/successor/metrics.jsonl");
    let outcome = follow(&metrics_path, steps, started, &mut children);
    for c in &mut children {
        let _ = c.kill();
        let _ = c.wait();
    }
    outcome
}
