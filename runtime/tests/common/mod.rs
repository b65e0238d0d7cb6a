//! Shared set-up of the libtorch tests: the tiny reference models, made once with transformers.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// The Python that has torch and transformers: `MOULT_PYTHON`, else the project's `.venv`.
pub fn python() -> PathBuf {
    if let Some(p) = std::env::var_os("MOULT_PYTHON") {
        return PathBuf::from(p);
    }
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../.venv/bin/python")
}

pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The output folder of `tests/python/<script> OUT_DIR`, made on first use and cached by the
/// content of the script and its `inputs` (several test binaries may race: the one that builds
/// writes into a private folder and renames it into place).
pub fn made_by(script: &str, inputs: &[&str]) -> PathBuf {
    made_by_with(script, inputs, &[])
}

/// [`made_by`] with `args` after `OUT_DIR` (they are part of the cache key).
fn made_by_with(script: &str, inputs: &[&str], args: &[&str]) -> PathBuf {
    let python_dir = repo_root().join("tests/python");
    let script = python_dir.join(script);
    let mut bytes = std::fs::read(&script).expect("read the model script");
    for input in inputs {
        bytes.extend(std::fs::read(python_dir.join(input)).expect("read a script input"));
    }
    for arg in args {
        bytes.extend(arg.as_bytes());
        bytes.push(0);
    }
    let digest = fnv(&bytes);
    let stem = script.file_stem().unwrap().to_string_lossy().into_owned();
    let base = Path::new(env!("CARGO_TARGET_TMPDIR")).to_path_buf();
    let dir = base.join(format!("{stem}-{digest:016x}"));
    if dir.join("done").exists() {
        return dir;
    }
    let staging = base.join(format!("{stem}-staging-{}", std::process::id()));
    let status = Command::new(python())
        .arg(&script)
        .arg(&staging)
        .args(args)
        .status()
        .unwrap_or_else(|e| {
            panic!(
                "cannot run {} ({e}); run `bash scripts/test.sh`, which sets up the virtualenv",
                python().display()
            )
        });
    assert!(status.success(), "{} failed", script.display());
    std::fs::write(staging.join("done"), b"").unwrap();
    if std::fs::rename(&staging, &dir).is_err() {
        // Another test binary won the race; its copy is identical.
        let _ = std::fs::remove_dir_all(&staging);
    }
    dir
}

/// The folder holding `qwen3-tiny/` and `qwen3-moe-tiny/`, made by
/// `tests/python/make_tiny_models.py`.
pub fn tiny_models() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| made_by("make_tiny_models.py", &[]))
}

/// LoRA adapters in PEFT's layout for the tiny models, with PEFT's logits
/// (`tests/python/make_lora_adapters.py`): `dense/` (on [`dense_model`]), `moe-2d/` (on
/// [`moe_model`]).
pub fn lora_adapters() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let tiny = tiny_models().to_string_lossy().into_owned();
        made_by_with("make_lora_adapters.py", &["make_tiny_models.py"], &[&tiny])
    })
}

/// [`chat_model`] with attention heads of 32 dimensions, which vLLM's CPU build serves.
pub fn chat_model_hd32() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        made_by_with(
            "make_chat_model.py",
            &["chat_scripts.json", "make_tiny_models.py"],
            &["--head-dim", "32"],
        )
    })
    .join("qwen3-tiny-chat")
}

/// `qwen3-tiny-chat`: a tiny Qwen3 that greedily says the assistant turns of
/// `tests/python/chat_scripts.json`, with the Qwen3 chat template and `expected.json`.
pub fn chat_model() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        made_by(
            "make_chat_model.py",
            &["chat_scripts.json", "make_tiny_models.py"],
        )
    })
    .join("qwen3-tiny-chat")
}

fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf29ce484222325u64, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x100000001b3)
    })
}

/// The tiny models of every family besides Qwen3 that `family_models()` holds.
pub const FAMILIES: [&str; 7] = [
    "llama-tiny",
    "llama-tiny-bias",
    "qwen2-tiny",
    "mistral-tiny",
    "mistral-tiny-window",
    "gemma3-tiny",
    "gemma3-tiny-linear",
];

/// Tiny random checkpoints of the families besides Qwen3 ([`FAMILIES`]:
/// `tests/python/make_family_models.py`), with transformers' reference logits.
pub fn family_models() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| made_by("make_family_models.py", &["make_tiny_models.py"]))
}

/// `qwen2.5-vl-tiny`: a tiny random Qwen2.5-VL (4 vision blocks, windowed and full; 2 text
/// layers) with the Qwen3 tokenizer, `preprocessor_config.json`, two PNGs and transformers'
/// reference logits with and without images (`tests/python/make_vl_model.py`).
pub fn vl_model() -> PathBuf {
    vl_models().join("qwen2.5-vl-tiny")
}

/// [`vl_model`]'s architecture with text heads of 32, which vLLM's CPU attention serves.
pub fn vl_model_hd32() -> PathBuf {
    vl_models().join("qwen2.5-vl-tiny-hd32")
}

fn vl_models() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        made_by(
            "make_vl_model.py",
            &["../fixtures/qwen2_vl_chat_template.jinja"],
        )
    })
    .clone()
}

pub fn dense_model() -> PathBuf {
    tiny_models().join("qwen3-tiny")
}

pub fn moe_model() -> PathBuf {
    tiny_models().join("qwen3-moe-tiny")
}

/// transformers' reference tensors for a model folder: (prompt ids, logits, experts) per prompt.
pub fn reference(model_dir: &Path) -> Vec<(Vec<i64>, tch::Tensor, Option<tch::Tensor>)> {
    let tensors: std::collections::HashMap<String, tch::Tensor> =
        tch::Tensor::read_safetensors(model_dir.join("reference.safetensors"))
            .unwrap()
            .into_iter()
            .collect();
    (0..)
        .map_while(|i| {
            let prompt = tensors.get(&format!("prompt_{i}"))?;
            Some((
                Vec::<i64>::try_from(prompt).unwrap(),
                tensors[&format!("logits_{i}")].shallow_clone(),
                tensors
                    .get(&format!("experts_{i}"))
                    .map(|t| t.shallow_clone()),
            ))
        })
        .collect()
}

/// Full (no cache) packed forward of several prompts at once, split back per prompt, with the
/// routed experts of a MoE model.
pub fn full_logits(
    model: &CausalLm,
    prompts: &[Vec<i64>],
) -> (Vec<tch::Tensor>, Option<tch::Tensor>) {
    full_logits_with(model, prompts, &[])
}

/// [`full_logits`], each prompt with the LoRA adapter `adapters` gives it
/// (`CausalLm::forward_adapters`; empty: the model's own).
pub fn full_logits_with(
    model: &CausalLm,
    prompts: &[Vec<i64>],
    adapters: &[Option<usize>],
) -> (Vec<tch::Tensor>, Option<tch::Tensor>) {
    let seqs: Vec<SeqInput> = prompts
        .iter()
        .map(|p| SeqInput {
            tokens: p,
            slot: None,
            replay: None,
            images: &[],
        })
        .collect();
    let out = tch::no_grad(|| model.forward_adapters(&seqs, adapters, None, LogitsFor::All));
    let out = out.unwrap();
    let lens: Vec<i64> = prompts.iter().map(|p| p.len() as i64).collect();
    (out.logits.split_with_sizes(&lens, 0), out.routed_experts)
}

use moult_runtime::engine::sampling::{processed_logprob, SamplingParams};
use moult_runtime::engine::{http, EngineHandle, EngineOptions};
use moult_runtime::model::{CausalLm, LogitsFor, SeqInput};

/// A running engine server on an ephemeral loopback port.
pub struct TestEngine {
    pub url: String,
    pub handle: EngineHandle,
}

pub fn engine_options() -> EngineOptions {
    EngineOptions {
        max_batch: 8,
        max_model_len: 512,
        max_prefill_tokens: 256,
        max_waiting: 64,
        return_routed_experts: true,
        eos_token_ids: vec![2002],
        threads: Some(1),
        // The packed path is the engine's on real models: test it (the trainer path is dense).
        packed_weights: Some(true),
        pool: None,
    }
}

/// Loads `model_dir` (f32, CPU) and serves it; the listener is bound before the URL is returned.
pub async fn start_engine(model_dir: &Path, opts: EngineOptions) -> TestEngine {
    let model = CausalLm::load(model_dir, tch::Kind::Float, tch::Device::Cpu).unwrap();
    let (handle, _thread) = EngineHandle::spawn(model, "tiny".into(), opts);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(http::serve(
        listener,
        handle.clone(),
        std::future::pending(),
    ));
    TestEngine { url, handle }
}

/// The processed logprob of each `output` token under `model`, from one full forward over
/// prompt + output (the trainer's path), optionally replaying routing.
pub fn reference_logprobs(
    model: &CausalLm,
    prompt: &[i64],
    output: &[i64],
    params: &SamplingParams,
    replay: Option<&tch::Tensor>,
) -> Vec<f32> {
    let mut tokens = prompt.to_vec();
    tokens.extend_from_slice(&output[..output.len() - 1]);
    let seqs = [SeqInput {
        tokens: &tokens,
        slot: None,
        replay,
        images: &[],
    }];
    let logits = tch::no_grad(|| model.forward(&seqs, None, LogitsFor::All))
        .unwrap()
        .logits;
    output
        .iter()
        .enumerate()
        .map(|(i, &t)| {
            let row: Vec<f32> = Vec::try_from(
                logits
                    .get((prompt.len() - 1 + i) as i64)
                    .to_kind(tch::Kind::Float),
            )
            .unwrap();
            processed_logprob(&row, t, params)
        })
        .collect()
}

/// Parses an SSE body into its `data:` payloads.
pub fn sse_data(body: &str) -> Vec<String> {
    body.split("\n\n")
        .filter_map(|event| {
            event
                .lines()
                .find_map(|l| l.strip_prefix("data: "))
                .map(str::to_string)
        })
        .collect()
}

/// The `moult` binary of this build.
pub fn moult() -> Command {
    Command::new(env!("CARGO_BIN_EXE_moult"))
}

/// Starts `moult ARGS` and waits for its first line, `BANNER http://ADDR ...`; returns the child
/// and the URL. Its stdout stays open (a thread drains it) so later prints never hit a closed
/// pipe.
pub fn spawn_moult(args: &[&std::ffi::OsStr], banner: &str) -> (std::process::Child, String) {
    spawn_moult_with(args, &[], banner)
}

/// [`spawn_moult`] with the environment variables `env` set.
pub fn spawn_moult_with(
    args: &[&std::ffi::OsStr],
    env: &[(&str, &str)],
    banner: &str,
) -> (std::process::Child, String) {
    use std::io::{BufRead, BufReader};
    let mut child = moult()
        .args(args)
        .envs(env.iter().copied())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let line = lines.next().expect("a line").unwrap();
    std::thread::spawn(move || for _ in lines {});
    let url = line
        .strip_prefix(banner)
        .and_then(|rest| rest.trim_start().split(' ').next())
        .unwrap_or_else(|| panic!("expected `{banner} URL`, got: {line}"))
        .to_string();
    (child, url)
}

/// Starts `moult engine` (one thread) on `port` (0: any); the child and its URL.
pub fn spawn_engine_on(model: &Path, port: u16) -> (std::process::Child, String) {
    let port = port.to_string();
    let args: Vec<&std::ffi::OsStr> = vec![
        "engine".as_ref(),
        "--model".as_ref(),
        model.as_os_str(),
        "--port".as_ref(),
        port.as_ref(),
        "--threads".as_ref(),
        "1".as_ref(),
    ];
    spawn_moult(&args, "moult engine listening on")
}

pub fn spawn_engine(model: &Path) -> (std::process::Child, String) {
    spawn_engine_on(model, 0)
}

/// Serves a loopback server for `tokenizer_dir`'s tokenizer and `template_dir`'s chat template,
/// generating on the engine (or router) at `engine_url`; sessions are made on first use, as in
/// `moult chat`.
pub async fn start_loopback(
    engine_url: &str,
    tokenizer_dir: &Path,
    template_dir: &Path,
    max_body: usize,
) -> (String, std::sync::Arc<moult_runtime::loopback::ChatService>) {
    let opts = moult_runtime::loopback::ServiceOptions {
        registered_sessions: false,
        ..moult_runtime::loopback::ServiceOptions::pool(256, "tiny")
    };
    start_loopback_with(engine_url, tokenizer_dir, template_dir, max_body, opts).await
}

/// [`start_loopback`] with `opts`.
pub async fn start_loopback_with(
    engine_url: &str,
    tokenizer_dir: &Path,
    template_dir: &Path,
    max_body: usize,
    opts: moult_runtime::loopback::ServiceOptions,
) -> (String, std::sync::Arc<moult_runtime::loopback::ChatService>) {
    use moult_runtime::chat::{ChatTemplate, Tokenizer};
    use moult_runtime::loopback::{ChatService, EngineClient};
    let service = ChatService::new(
        EngineClient::new(engine_url),
        Tokenizer::from_model_dir(tokenizer_dir).unwrap(),
        ChatTemplate::from_model_dir(template_dir).unwrap(),
        opts,
    );
    serve_loopback(service, max_body).await
}

/// Serves `service` as a loopback server on a free port.
pub async fn serve_loopback(
    service: moult_runtime::loopback::ChatService,
    max_body: usize,
) -> (String, std::sync::Arc<moult_runtime::loopback::ChatService>) {
    let service = std::sync::Arc::new(service);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let app = moult_runtime::loopback::router(service.clone(), max_body);
    tokio::spawn(moult_runtime::serve::serve(
        listener,
        app,
        std::future::pending(),
    ));
    (url, service)
}

/// Health probes every 200 ms (the tests' routers notice an engine's coming and going quickly).
pub fn quick_health() -> moult_runtime::router::HealthOptions {
    moult_runtime::router::HealthOptions {
        interval: std::time::Duration::from_millis(200),
        timeout: std::time::Duration::from_millis(500),
        failures_to_down: 2,
    }
}

/// Serves a router over `engines` with `policy`, probing health every 200 ms.
pub async fn start_router(
    engines: &[String],
    policy: &str,
) -> (String, std::sync::Arc<moult_runtime::router::Router>) {
    start_router_with(engines, policy, quick_health(), std::time::Duration::ZERO).await
}

/// Serves a router over `engines` with `policy`, probing health as `health` says; requests
/// wait up to `engine_patience` for a healthy engine.
pub async fn start_router_with(
    engines: &[String],
    policy: &str,
    health: moult_runtime::router::HealthOptions,
    engine_patience: std::time::Duration,
) -> (String, std::sync::Arc<moult_runtime::router::Router>) {
    use moult_runtime::router::{policy, server, EnginePool, Router};
    let pool = std::sync::Arc::new(EnginePool::new(engines));
    tokio::spawn(pool.clone().check_health(health));
    let router = std::sync::Arc::new(
        Router::new(pool, policy::by_name(policy).unwrap()).with_engine_patience(engine_patience),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(server::serve(
        listener,
        router.clone(),
        std::future::pending(),
    ));
    (url, router)
}

/// The sum of a Prometheus metric's samples at `base/metrics` whose line contains `label`
/// (`""` for all), 0 when absent.
pub async fn metric(base: &str, name: &str, label: &str) -> f64 {
    let text = reqwest::get(format!("{base}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .filter(|l| l.starts_with(name) && l.contains(label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .fold(0.0, |a, b| a + b)
}

/// A streamed engine-API generation as it arrives.
#[derive(Debug, Default, Clone)]
pub struct Generation {
    pub ids: Vec<i64>,
    pub logprobs: Vec<f32>,
    /// The version of each token.
    pub versions: Vec<u64>,
    pub finish: String,
    pub routed_experts: Option<String>,
    pub completion_tokens: u64,
}

impl Generation {
    /// Takes one SSE `data:` payload.
    pub fn absorb(&mut self, data: &str) {
        if data == "[DONE]" {
            return;
        }
        let v: serde_json::Value = serde_json::from_str(data).unwrap();
        assert!(v.get("error").is_none(), "{v}");
        let c = &v["choices"][0];
        let spans = c["weight_versions"].as_array().unwrap();
        for lp in c["logprobs"]["content"].as_array().unwrap() {
            let index = self.ids.len();
            self.ids.push(lp["token_id"].as_i64().unwrap());
            self.logprobs.push(lp["logprob"].as_f64().unwrap() as f32);
            let span = spans
                .iter()
                .find(|s| {
                    s["start"].as_u64().unwrap() as usize <= index
                        && index < s["end"].as_u64().unwrap() as usize
                })
                .unwrap_or_else(|| panic!("token {index} has no version span: {v}"));
            self.versions.push(span["version"].as_u64().unwrap());
        }
        if let Some(f) = c["finish_reason"].as_str() {
            self.finish = f.to_string();
            self.routed_experts = c["routed_experts"].as_str().map(str::to_string);
            self.completion_tokens = v["usage"]["completion_tokens"].as_u64().unwrap_or(0);
        }
    }

    /// Reads a streaming response to its end, calling `progress` after each event.
    pub async fn read(response: reqwest::Response, mut progress: impl FnMut(&Generation)) -> Self {
        use futures::StreamExt;
        assert_eq!(response.status(), 200);
        let mut stream = response.bytes_stream();
        let mut buf = String::new();
        let mut out = Self::default();
        while let Some(chunk) = stream.next().await {
            buf.push_str(&String::from_utf8_lossy(&chunk.unwrap()));
            while let Some(end) = buf.find("\n\n") {
                let event: String = buf.drain(..end + 2).collect();
                if let Some(data) = event.lines().find_map(|l| l.strip_prefix("data: ")) {
                    out.absorb(data);
                    progress(&out);
                }
            }
        }
        out
    }
}

/// POSTs `body` as JSON and returns the JSON answer (any status).
pub async fn post_json(url: &str, body: &serde_json::Value) -> serde_json::Value {
    reqwest::Client::new()
        .post(url)
        .json(body)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// GETs `url` and returns the JSON answer.
pub async fn get_json(url: &str) -> serde_json::Value {
    reqwest::get(url).await.unwrap().json().await.unwrap()
}

pub fn expected_segments(model: &Path, name: &str) -> Vec<(Vec<i64>, Vec<u8>)> {
    let text = std::fs::read_to_string(model.join("expected.json")).unwrap();
    let all: serde_json::Value = serde_json::from_str(&text).unwrap();
    all[name]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            (
                serde_json::from_value(s["token_ids"].clone()).unwrap(),
                serde_json::from_value(s["loss_mask"].clone()).unwrap(),
            )
        })
        .collect()
}

/// Each run of sampled tokens must be exactly what the engine samples (greedy) after the tokens
/// before it, with the same behaviour logprobs and a policy version.
pub async fn assert_token_identity(engine_url: &str, segment: &moult_runtime::loopback::Segment) {
    let mut i = 0;
    while i < segment.token_ids.len() {
        if segment.loss_mask[i] == 0 {
            i += 1;
            continue;
        }
        let end = (i..segment.token_ids.len())
            .find(|&j| segment.loss_mask[j] == 0)
            .unwrap_or(segment.token_ids.len());
        let body = serde_json::json!({
            "token_ids": &segment.token_ids[..i],
            "sampling_params": {"temperature": 0.0, "max_tokens": end - i, "logprobs": 0},
        });
        let r: serde_json::Value =
            post_json(&format!("{engine_url}/inference/v1/generate"), &body).await;
        let ids: Vec<i64> = serde_json::from_value(r["choices"][0]["token_ids"].clone()).unwrap();
        assert_eq!(ids, segment.token_ids[i..end], "sampled ids at {i}..{end}");
        for (k, lp) in r["choices"][0]["logprobs"]["content"]
            .as_array()
            .unwrap()
            .iter()
            .enumerate()
        {
            let want = lp["logprob"].as_f64().unwrap() as f32;
            let got = segment.logprobs[i + k];
            assert!(
                (want - got).abs() < 1e-4,
                "logprob at {}: {got} vs {want}",
                i + k
            );
            assert_eq!(segment.versions[i + k], Some(0));
        }
        assert!(segment.versions[..i]
            .iter()
            .zip(&segment.loss_mask[..i])
            .all(|(v, &m)| (m == 0) == v.is_none()));
        i = end;
    }
}

/// The real `openai` and `anthropic` SDKs (tests/python/loopback_sdk_client.py) drive the scripted
/// conversations through a loopback server on `generate_url` (an engine or a router), with the
/// chat `model`'s tokenizer and template: every session's segments are what transformers renders
/// and tokenizes (`expected.json`), and every sampled run is exactly what the engine at
/// `engine_url` samples greedily after it, with its logprobs and version 0.
pub async fn sdk_conversations_record_exact_segments(
    generate_url: &str,
    engine_url: &str,
    model: &Path,
) {
    let (url, service) = start_loopback(generate_url, model, model, 1 << 20).await;
    let script = repo_root().join("tests/python/loopback_sdk_client.py");
    let output = tokio::task::spawn_blocking(move || {
        std::process::Command::new(python())
            .arg(script)
            .arg(&url)
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    assert!(
        output.status.success(),
        "the SDK client failed:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let weather: Vec<_> = expected_segments(model, "weather")
        .into_iter()
        .chain(expected_segments(model, "compacted"))
        .collect();
    let think = expected_segments(model, "think");
    for proto in ["openai", "anthropic"] {
        for mode in ["plain", "stream"] {
            for (name, expected, turns) in [("weather", &weather, 3), ("think", &think, 2)] {
                let session = format!("{proto}-{mode}-{name}");
                let (recorded_turns, segments) = service.trajectory(&session).await.unwrap();
                // `think` retried its first request: answered from cache, recorded once.
                assert_eq!(recorded_turns, turns, "{session}: turns");
                let got: Vec<_> = segments
                    .iter()
                    .map(|s| (s.token_ids.clone(), s.loss_mask.clone()))
                    .collect();
                // Rendered by transformers' apply_chat_template and tokenized by transformers:
                // weather is one segment until the agent compacts; think seals when the Qwen3
                // template drops the earlier <think> block.
                assert_eq!(&got, expected, "{session}: segments");
                for segment in &segments {
                    assert_token_identity(engine_url, segment).await;
                }
            }
        }
    }
}
