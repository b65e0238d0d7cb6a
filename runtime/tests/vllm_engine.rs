//! moult against a real vLLM (the pinned CPU build, scripts/setup-vllm.sh): the router and the
//! engine client read vLLM's own streams (string versions, `null` spans mid-stream, prefixed
//! request ids), tokens and logprobs through the router are vLLM's own, a weight update from a
//! folder, through the router, in the middle of a stream labels every token with the version
//! that produced it, two engines keep sessions and survive a SIGKILL, and the loopback server
//! records what vLLM sampled for the real openai and anthropic SDKs.
//!
//! Needs `MOULT_VLLM_PYTHON` (scripts/test.sh sets it). Each test starts its own vLLM server
//! (about a minute on two cores) and stops it, with its child processes, when it ends.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use moult_runtime::engine::client::{EngineClient, Generated};
use moult_runtime::local::vllm::{free_port, VllmProcess};
use moult_runtime::router::{HealthOptions, Router};
use serde_json::{json, Value};

fn vllm_python() -> PathBuf {
    assert!(
        std::env::var_os("MOULT_VLLM_PYTHON").is_some(),
        "MOULT_VLLM_PYTHON is not set: install the pinned vLLM with `bash scripts/setup-vllm.sh` \
         and set it to the python that prints (scripts/test.sh does both)"
    );
    moult_runtime::local::vllm::python()
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

/// A vLLM server (the pinned CPU build) on `model` with the flags the operator gives it (minus
/// NCCL, which needs a GPU), on one unpinned OpenMP thread; stopped with its children on drop.
struct Vllm;

impl Vllm {
    async fn start(model: &Path, name: &str) -> VllmProcess {
        Self::start_with(model, name, &[]).await
    }

    /// [`Vllm::start`] with `extra` flags after the operator's.
    async fn start_with(model: &Path, name: &str, extra: &[&str]) -> VllmProcess {
        let port = free_port().unwrap();
        let log = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("vllm-{name}.log"));
        let args: Vec<String> = [
            "--model",
            &model.display().to_string(),
            "--host",
            "127.0.0.1",
            "--port",
            &port.to_string(),
            "--enable-scale-out",
            "--logprobs-mode",
            "processed_logprobs",
            // CPU: float32 as the model was saved, a small KV cache (the default reserves most
            // of the machine's memory), no graph compilation (a minute of start-up).
            "--dtype",
            "float32",
            "--kv-cache-memory-bytes",
            "268435456",
            "--enforce-eager",
            "--max-model-len",
            "2048",
        ]
        .iter()
        .chain(extra)
        .map(|s| s.to_string())
        .collect();
        let started = Instant::now();
        let vllm = VllmProcess::spawn(&args, port, &log, Some(1))
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        println!(
            "vLLM serves {} after {:.0?}",
            model.display(),
            started.elapsed()
        );
        vllm
    }
}

/// moult's router in front of `engines`, with health probes patient enough for a busy CPU.
async fn router(engines: &[String]) -> (String, Arc<Router>) {
    let health = HealthOptions {
        interval: Duration::from_millis(500),
        timeout: Duration::from_secs(10),
        failures_to_down: 3,
    };
    common::start_router_with(engines, "consistent-hash", health, Duration::ZERO).await
}

/// `(token, logprob, version)` of a whole generation through `client`, and its finish reason.
async fn generate(
    client: &EngineClient,
    id: &str,
    prompt: &[i64],
    sampling: &Value,
) -> (Vec<(i64, f32, u64)>, String) {
    let mut stream = client
        .generate(id.to_string(), prompt, &[], sampling, Some(id))
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
    direct_with(url, prompt, sampling, None).await
}

/// [`direct`] naming the served `model` (a LoRA adapter's name serves the adapter).
async fn direct_with(url: &str, prompt: &[i64], sampling: &Value, model: Option<&str>) -> Value {
    let r = reqwest::Client::new()
        .post(format!("{url}/inference/v1/generate"))
        .json(&json!({"token_ids": prompt, "sampling_params": sampling, "model": model}))
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
    // A client that asks for no logprobs (vLLM then sends none) still gets every token, through
    // the router's non-streaming answer, with the logprobs the router asked vLLM for.
    let mut plain = sampling.clone();
    plain.as_object_mut().unwrap().remove("logprobs");
    let answer = post(
        &format!("{url}/inference/v1/generate"),
        json!({"token_ids": prompt, "sampling_params": plain}),
    )
    .await;
    let tokens: Vec<i64> = answer["choices"][0]["token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_i64().unwrap())
        .collect();
    assert_eq!(
        tokens,
        expected.iter().map(|&(t, _)| t).collect::<Vec<_>>(),
        "{answer}"
    );
    assert_eq!(
        answer["choices"][0]["logprobs"]["content"]
            .as_array()
            .unwrap()
            .len(),
        24
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

/// vLLM's samples of a few prompts: `(prompt + output, prompt length, behaviour logprobs,
/// routed experts)`.
async fn vllm_samples(url: &str, temperature: f64) -> Vec<(Vec<i64>, usize, Vec<f32>, Value)> {
    vllm_samples_of(url, temperature, None).await
}

/// [`vllm_samples`] of the served `model` (a LoRA adapter's name).
async fn vllm_samples_of(
    url: &str,
    temperature: f64,
    model: Option<&str>,
) -> Vec<(Vec<i64>, usize, Vec<f32>, Value)> {
    let mut out = Vec::new();
    for i in 0..4i64 {
        let prompt: Vec<i64> = (0..(5 + 3 * i)).map(|j| (i * 97 + j * 13) % 2000).collect();
        let sampling = json!({"max_tokens": 16 + 4 * i, "temperature": temperature,
            "logprobs": 0, "seed": i, "ignore_eos": true});
        let v = direct_with(url, &prompt, &sampling, model).await;
        let c = &v["choices"][0];
        let ids: Vec<i64> = serde_json::from_value(c["token_ids"].clone()).unwrap();
        let lps: Vec<f32> = c["logprobs"]["content"]
            .as_array()
            .unwrap()
            .iter()
            .map(|l| l["logprob"].as_f64().unwrap() as f32)
            .collect();
        assert_eq!(ids.len(), lps.len());
        let mut tokens = prompt.clone();
        tokens.extend(&ids);
        out.push((tokens, prompt.len(), lps, c["routed_experts"].clone()));
    }
    out
}

/// moult's trainer's logprob of every token of each sequence at temperature `t`.
fn trainer_logprobs(model_dir: &Path, seqs: &[&[i64]], t: f64) -> Vec<Vec<f32>> {
    use moult_runtime::model::CausalLm;
    use moult_runtime::model::SeqInput;
    use moult_runtime::trainer::logprobs::token_logprobs;
    let model = CausalLm::load(model_dir, tch::Kind::Float, tch::Device::Cpu).unwrap();
    let scored: Vec<SeqInput> = seqs
        .iter()
        .map(|tokens| SeqInput {
            slot: None,
            tokens,
            replay: None,
            images: &[],
        })
        .collect();
    let logp = tch::no_grad(|| token_logprobs(&model, &scored, t).unwrap());
    (0..seqs.len())
        .map(|i| Vec::try_from(logp.get(i as i64)).unwrap())
        .collect()
}

/// The largest |moult's trainer logprob − vLLM's behaviour logprob| over every sampled token.
fn largest_gap(model_dir: &Path, samples: &[(Vec<i64>, usize, Vec<f32>, Value)], t: f64) -> f32 {
    let seqs: Vec<&[i64]> = samples.iter().map(|(tokens, ..)| &tokens[..]).collect();
    let rows = trainer_logprobs(model_dir, &seqs, t);
    let mut gap = 0f32;
    for ((_, p_len, lps, _), row) in samples.iter().zip(&rows) {
        for (k, want) in lps.iter().enumerate() {
            gap = gap.max((row[p_len + k] - want).abs());
        }
    }
    gap
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_sampled_tokens_recompute_to_vllms_logprobs_in_moults_trainer() {
    let models = vllm_models();
    let temperature = 0.8;
    for (name, moe) in [("qwen3-tiny", false), ("qwen3-moe-tiny", true)] {
        let dir = models.join(name);
        let vllm = Vllm::start(&dir, name).await;
        let samples = vllm_samples(&vllm.url, temperature).await;
        // What a served distillation teacher answers: vLLM's prompt logprobs of whole
        // sequences, through the client moult's teacher uses.
        let client = moult_runtime::engine::client::EngineClient::new(&vllm.url);
        let mut scores = Vec::new();
        for (i, (tokens, ..)) in samples.iter().enumerate() {
            scores.push(
                client
                    .prompt_logprobs(&format!("score-{i}"), tokens)
                    .await
                    .unwrap(),
            );
        }
        drop(vllm);
        if moe {
            // vLLM's CPU build cannot return routed experts (docs/vllm.md): the trainer routes
            // on its own, which agrees with vLLM on these random weights.
            assert!(samples.iter().all(|s| s.3.is_null()));
        }
        let gap = largest_gap(&dir, &samples, temperature);
        println!("{name}: largest |moult − vLLM| logprob gap {gap:.2e}");
        assert!(
            gap < 1e-4,
            "{name}: moult's trainer and vLLM disagree by {gap}"
        );
        // Prompt logprobs are of the raw distribution: the trainer's at temperature 1.
        let seqs: Vec<&[i64]> = samples.iter().map(|(tokens, ..)| &tokens[..]).collect();
        let rows = trainer_logprobs(&dir, &seqs, 1.0);
        let mut gap = 0f32;
        for (score, row) in scores.iter().zip(&rows) {
            // Rows are padded to the longest sequence.
            for p in 1..score.len() {
                gap = gap.max((score[p] - row[p]).abs());
            }
        }
        println!("{name}: largest |moult − vLLM| prompt logprob gap {gap:.2e}");
        assert!(
            gap < 1e-4,
            "{name}: vLLM's prompt logprobs and moult's trainer disagree by {gap}"
        );
    }
}

/// vLLM's CPU build serves a LoRA adapter as moult writes it (PEFT's layout, a checkpoint's
/// `step-N/`; docs/lora.md): the tokens it samples with the adapter recompute in moult's
/// trainer, with the same adapter, to vLLM's logprobs; without naming the adapter vLLM serves
/// the base, which the adapter moves far from.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_serves_a_lora_adapter_moult_wrote_with_moults_logprobs() {
    use moult_runtime::model::lora::{self, LoraConfig, TARGETS};
    use moult_runtime::model::CausalLm;
    let dir = vllm_models().join("qwen3-tiny");
    let adapter = Path::new(env!("CARGO_TARGET_TMPDIR")).join("vllm-lora-adapter");
    let _ = std::fs::remove_dir_all(&adapter);
    std::fs::create_dir_all(&adapter).unwrap();
    let config = LoraConfig {
        rank: 8,
        alpha: 16.0,
        rslora: false,
        dropout: 0.0,
        targets: TARGETS.map(String::from).into(),
    };
    let mut model = CausalLm::load(&dir, tch::Kind::Float, tch::Device::Cpu).unwrap();
    model.attach_lora(&config, None, 1).unwrap();
    // A trained adapter's B is not zero.
    tch::manual_seed(3);
    let weights: Vec<(String, tch::Tensor)> = tch::no_grad(|| {
        (model.params().iter())
            .map(|(n, t)| (n.clone(), t.randn_like() * 0.2 / 8f64.sqrt()))
            .collect()
    });
    lora::write_adapter(&adapter, &config, &dir, &weights).unwrap();
    let module = format!("moult-lora={}", adapter.display());
    let flags = [
        "--enable-lora",
        "--max-loras",
        "1",
        "--max-lora-rank",
        "8",
        "--lora-modules",
        &module,
    ];
    let vllm = Vllm::start_with(&dir, "lora", &flags).await;
    let temperature = 0.8;
    let with = vllm_samples_of(&vllm.url, temperature, Some("moult-lora")).await;
    let base = vllm_samples(&vllm.url, temperature).await;
    drop(vllm);
    let gap = largest_gap(&adapter, &with, temperature);
    println!("LoRA adapter: largest |moult − vLLM| logprob gap {gap:.2e}");
    assert!(
        gap < 1e-4,
        "moult and vLLM disagree with the adapter by {gap}"
    );
    let gap = largest_gap(&dir, &base, temperature);
    assert!(
        gap < 1e-4,
        "vLLM serves the base without the adapter's name: {gap}"
    );
    let moved = largest_gap(&dir, &with, temperature);
    assert!(moved > 1e-2, "the adapter moves the logprobs ({moved})");
}

/// The other families moult implements (docs/models.md) served by vLLM: the tokens it samples
/// recompute in moult's trainer to vLLM's own logprobs, and its prompt logprobs (a served
/// teacher's scores) to the trainer's at temperature 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_llama_qwen2_mistral_and_gemma3_logprobs_are_moults() {
    let models = vllm_models();
    let temperature = 0.8;
    for name in [
        "llama-tiny",
        "qwen2-tiny",
        "mistral-tiny",
        "mistral-tiny-window",
        "gemma3-tiny",
    ] {
        let dir = models.join(name);
        let vllm = Vllm::start(&dir, name).await;
        let samples = vllm_samples(&vllm.url, temperature).await;
        let client = moult_runtime::engine::client::EngineClient::new(&vllm.url);
        let (tokens, ..) = &samples[3];
        let scores = client.prompt_logprobs("score", tokens).await.unwrap();
        drop(vllm);
        let gap = largest_gap(&dir, &samples, temperature);
        let row = &trainer_logprobs(&dir, &[&tokens[..]], 1.0)[0];
        let prompt_gap = (1..scores.len())
            .map(|p| (scores[p] - row[p]).abs())
            .fold(0f32, f32::max);
        println!("{name}: largest |moult − vLLM| logprob gap {gap:.2e}, prompt logprobs {prompt_gap:.2e}");
        assert!(
            gap < 1e-4,
            "{name}: moult's trainer and vLLM disagree by {gap}"
        );
        assert!(
            prompt_gap < 1e-4,
            "{name}: prompt logprobs disagree by {prompt_gap}"
        );
    }
}

/// Tokens an engine generated so far (its own counter).
async fn generation_tokens(url: &str) -> f64 {
    common::metric(url, "vllm:generation_tokens_total", "").await
}

/// One weight update from a folder through the router: pause (keep), reload, version, resume.
async fn update_from_folder(router: &str, folder: &Path, version: u64) {
    post(&format!("{router}/pause?mode=keep"), json!({})).await;
    post(
        &format!("{router}/collective_rpc"),
        json!({"method": "reload_weights", "kwargs": {"weights_path": folder}}),
    )
    .await;
    post(
        &format!("{router}/update_weight_version"),
        json!({"new_version": version.to_string()}),
    )
    .await;
    post(&format!("{router}/resume"), json!({})).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_partial_rollout_across_three_folder_updates_labels_every_token_with_its_weights() {
    let models = vllm_models();
    let vllm = Vllm::start(&models.join("qwen3-tiny"), "partial").await;
    partial_rollout_across_folder_updates(&vllm.url, &models).await;
}

/// The same endpoints on the built-in engine: the same partial rollout, the same checks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn builtin_engine_partial_rollout_across_three_folder_updates_labels_every_token() {
    let models = vllm_models();
    let (mut child, url) = common::spawn_engine_on(&models.join("qwen3-tiny"), 0);
    partial_rollout_across_folder_updates(&url, &models).await;
    let _ = child.kill();
    let _ = child.wait();
}

/// A long greedy generation through the router, with three updates from folders while it runs:
/// each token carries the version of the weights that produced it.
async fn partial_rollout_across_folder_updates(engine: &str, models: &Path) {
    // Version k is served from folders[k]: two different sets of weights, alternating.
    let (a, b) = (models.join("qwen3-tiny"), models.join("qwen3-tiny-v2"));
    let folders = [&a, &b, &a, &b];
    let (url, _router) = router(&[engine.to_string()]).await;
    let prompt = vec![5, 17, 99, 300, 2001];
    let greedy =
        |n: usize| json!({"max_tokens": n, "temperature": 0, "ignore_eos": true, "logprobs": 0});
    const TOTAL: usize = 1800;

    let before = generation_tokens(engine).await;
    let stream = {
        let (client, prompt) = (EngineClient::new(&url), prompt.clone());
        tokio::spawn(async move { generate(&client, "long", &prompt, &greedy(TOTAL)).await })
    };
    // An update after every 300 tokens or so, while the request runs.
    for (version, folder) in folders.iter().enumerate().skip(1) {
        let deadline = Instant::now() + Duration::from_secs(300);
        while generation_tokens(engine).await < before + 300.0 * version as f64 {
            assert!(Instant::now() < deadline, "vLLM stopped generating");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        update_from_folder(&url, folder, version as u64).await;
    }
    let (tokens, reason) = stream.await.unwrap();
    assert_eq!((tokens.len(), reason.as_str()), (TOTAL, "length"));

    // The versions run 0, 1, 2, 3 in contiguous spans.
    let mut spans: Vec<(u64, usize, usize)> = Vec::new();
    for (i, &(_, _, v)) in tokens.iter().enumerate() {
        match spans.last_mut() {
            Some((last, _, end)) if *last == v => *end = i + 1,
            _ => spans.push((v, i, i + 1)),
        }
    }
    let versions: Vec<u64> = spans.iter().map(|s| s.0).collect();
    assert_eq!(versions, [0, 1, 2, 3], "{spans:?}");

    // Each span is exactly what its version's weights generate from everything before it: a
    // fresh greedy generation under those weights, with the same logprobs. (vLLM's pause in
    // `keep` mode drops the frozen requests' caches, so they resume on a prefix recomputed under
    // the new weights: docs/vllm.md.)
    for (version, start, end) in spans {
        update_from_folder(&url, folders[version as usize], 100 + version).await;
        let mut context = prompt.clone();
        context.extend(tokens[..start].iter().map(|t| t.0));
        let fresh = direct(engine, &context, &greedy(end - start)).await;
        let want = fresh["choices"][0]["logprobs"]["content"]
            .as_array()
            .unwrap();
        assert_eq!(want.len(), end - start);
        for (k, (got, want)) in tokens[start..end].iter().zip(want).enumerate() {
            assert_eq!(
                got.0,
                want["token_id"].as_i64().unwrap(),
                "version {version} token {k}"
            );
            let lp = want["logprob"].as_f64().unwrap() as f32;
            assert!(
                (got.1 - lp).abs() < 1e-4,
                "version {version} token {k}: {} vs {lp}",
                got.1
            );
        }
    }
}

/// Which engine served a request: the one whose generation counter moved.
async fn served_by(engines: &[&VllmProcess], before: &[f64]) -> usize {
    let mut moved = Vec::new();
    for (i, e) in engines.iter().enumerate() {
        if generation_tokens(&e.url).await > before[i] {
            moved.push(i);
        }
    }
    assert_eq!(moved.len(), 1, "exactly one engine served the request");
    moved[0]
}

/// The router in front of two vLLM engines: a session's requests stick to one engine, and when
/// one engine is SIGKILLed in the middle of generations every request still returns its full
/// length, continued on the other, each token's logprob that of a reference forward of its
/// prefix (moult's trainer on the same weights).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_vllm_engines_behind_the_router_keep_sessions_and_survive_a_sigkill() {
    let models = vllm_models();
    let dir = models.join("qwen3-tiny");
    let (a, b) = tokio::join!(Vllm::start(&dir, "pair-a"), Vllm::start(&dir, "pair-b"));
    let mut engines = [a, b];
    let urls: Vec<String> = engines.iter().map(|e| e.url.clone()).collect();
    let (url, _router) = router(&urls).await;
    let client = EngineClient::new(&url);
    let prompt = |s: i64| -> Vec<i64> { (0..6).map(|j| (s * 131 + j * 17) % 2000).collect() };

    // Stickiness: two requests of each session land on the same engine, and the sessions spread.
    let short = json!({"max_tokens": 4, "temperature": 1.0, "logprobs": 0, "ignore_eos": true});
    let mut homes = Vec::new();
    for session in 0..8 {
        let mut served = Vec::new();
        for turn in 0..2 {
            let refs: Vec<&VllmProcess> = engines.iter().collect();
            let mut before = Vec::new();
            for e in &refs {
                before.push(generation_tokens(&e.url).await);
            }
            let id = format!("s{session}");
            let (tokens, _) = generate(&client, &id, &prompt(session * 2 + turn), &short).await;
            assert_eq!(tokens.len(), 4);
            served.push(served_by(&refs, &before).await);
        }
        assert_eq!(served[0], served[1], "session {session} moved");
        homes.push(served[0]);
    }
    assert!(homes.contains(&0) && homes.contains(&1), "{homes:?}");

    // Failover: eight long generations, one engine killed while they run.
    const LEN: usize = 256;
    let long = json!({"max_tokens": LEN, "temperature": 1.0, "logprobs": 0, "ignore_eos": true});
    let mut runs = Vec::new();
    for session in 0..8i64 {
        let (client, p, sampling) = (EngineClient::new(&url), prompt(100 + session), long.clone());
        runs.push(tokio::spawn(async move {
            let (tokens, reason) =
                generate(&client, &format!("long{session}"), &p, &sampling).await;
            (p, tokens, reason)
        }));
    }
    let counts = || async {
        let mut c = Vec::new();
        for e in &urls {
            c.push(generation_tokens(e).await);
        }
        c
    };
    let before = counts().await;
    let deadline = Instant::now() + Duration::from_secs(300);
    // The engine with more of the work dies once the generations are well under way.
    let victim = loop {
        let now = counts().await;
        let moved: Vec<f64> = now.iter().zip(&before).map(|(n, b)| n - b).collect();
        if moved[0] + moved[1] >= 400.0 {
            break usize::from(moved[1] > moved[0]);
        }
        assert!(Instant::now() < deadline, "the engines did not generate");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    engines[victim].kill();
    let mut samples = Vec::new();
    for run in runs {
        let (p, tokens, reason) = run.await.unwrap();
        assert_eq!((tokens.len(), reason.as_str()), (LEN, "length"));
        let mut all = p.clone();
        all.extend(tokens.iter().map(|t| t.0));
        let lps: Vec<f32> = tokens.iter().map(|t| t.1).collect();
        samples.push((all, p.len(), lps, Value::Null));
    }
    let gap = largest_gap(&dir, &samples, 1.0);
    println!("after the SIGKILL: largest |logprob − reference| {gap:.2e}");
    assert!(
        gap < 1e-4,
        "a continued request's logprobs are off by {gap}"
    );
}

/// The loopback server with the real `openai` and `anthropic` SDKs, generating through the router
/// on vLLM: every recorded segment is token-identical to what vLLM samples, with vLLM's logprobs
/// (the same scripted conversations and checks as on the built-in engine).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sdk_conversations_through_the_router_on_vllm_record_vllms_tokens() {
    let model = common::chat_model_hd32();
    let vllm = Vllm::start(&model, "sdk").await;
    let (url, _router) = router(std::slice::from_ref(&vllm.url)).await;
    common::sdk_conversations_record_exact_segments(&url, &vllm.url, &model).await;
}

/// Images to vLLM (docs/vision.md): the pinned vLLM (CPU build) serving a tiny Qwen2.5-VL takes
/// a prompt with two images in the form moult's loopback server sends it (one `<|image_pad|>`
/// per image, the images as `content_parts` data URLs), expands the placeholders exactly as
/// moult does, and generates what moult's built-in engine generates, with the same logprobs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_takes_images_as_moult_sends_them_and_matches_moults_engine() {
    use base64::Engine as _;
    const IMAGE_PAD: i64 = 151655;
    let dir = common::vl_model_hd32();
    let images = common::vl_model().join("images");
    // The two-image prompt of the parity test, as transformers' processor expanded it.
    let reference: std::collections::HashMap<String, tch::Tensor> =
        tch::Tensor::read_safetensors(common::vl_model().join("reference.safetensors"))
            .unwrap()
            .into_iter()
            .collect();
    let len = reference["prompt_len_2"].int64_value(&[0]) as usize;
    let expanded: Vec<i64> = Vec::try_from(&reference["prompt_2"]).unwrap()[..len].to_vec();
    let mut collapsed = expanded.clone();
    collapsed.dedup_by(|a, b| *a == IMAGE_PAD && *b == IMAGE_PAD);
    let url = |name: &str| {
        let bytes = std::fs::read(images.join(name)).unwrap();
        format!(
            "data:image/png;base64,{}",
            base64::engine::general_purpose::STANDARD.encode(bytes)
        )
    };
    let body = json!({"token_ids": collapsed,
        "content_parts": [{"type": "image_url", "url": url("a.png")},
                          {"type": "image_url", "url": url("b.png")}],
        "sampling_params": {"temperature": 0.0, "max_tokens": 8, "logprobs": 0, "ignore_eos": true}});
    let generated = |v: &Value| -> (Vec<i64>, Vec<f64>) {
        let choice = &v["choices"][0];
        let ids = choice["token_ids"]
            .as_array()
            .unwrap_or_else(|| panic!("no tokens in {v}"))
            .iter()
            .map(|t| t.as_i64().unwrap())
            .collect();
        let lps = choice["logprobs"]["content"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["logprob"].as_f64().unwrap())
            .collect();
        (ids, lps)
    };

    let vllm = Vllm::start(&dir, "qwen2.5-vl").await;
    let mut asked = body.clone();
    asked["return_token_ids"] = json!(true);
    let theirs = common::post_json(&format!("{}/inference/v1/generate", vllm.url), &asked).await;
    drop(vllm);
    let (mut engine, engine_url) = common::spawn_engine(&dir);
    let ours = common::post_json(&format!("{engine_url}/inference/v1/generate"), &body).await;
    engine.kill().unwrap();
    engine.wait().unwrap();

    // vLLM expanded each placeholder to the image's tokens, as the processor (and moult) do.
    let prompt: Vec<i64> = theirs["prompt_token_ids"]
        .as_array()
        .unwrap_or_else(|| panic!("vLLM returned no prompt ids: {theirs}"))
        .iter()
        .map(|t| t.as_i64().unwrap())
        .collect();
    assert_eq!(prompt, expanded);
    assert_eq!(
        ours["usage"]["prompt_tokens"].as_u64(),
        Some(expanded.len() as u64)
    );
    let ((their_ids, their_lps), (our_ids, our_lps)) = (generated(&theirs), generated(&ours));
    assert_eq!(their_ids, our_ids, "greedy tokens");
    let gap = their_lps
        .iter()
        .zip(&our_lps)
        .map(|(a, b)| (a - b).abs())
        .fold(0f64, f64::max);
    println!(
        "qwen2.5-vl: {} prompt tokens ({} sent), vLLM and moult's engine agree on {} greedy tokens, logprob gap {gap:.2e}",
        expanded.len(),
        collapsed.len(),
        our_ids.len()
    );
    assert!(gap < 1e-4, "vLLM and moult disagree by {gap}");
}
