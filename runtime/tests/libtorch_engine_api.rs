//! The built-in engine's HTTP API on the tiny models (libtorch): forward consistency with the
//! trainer's path, routed experts, streaming, seeds, pause/abort/wait, weight transfer mid-
//! generation with version labels, bad input, cancellation and metrics.

mod common;

use std::time::Duration;

use futures::StreamExt;
use moult_runtime::engine::api::{GenerateResponse, WeightVersionSpan};
use moult_runtime::engine::npy::decode_routed_experts;
use moult_runtime::engine::sampling::SamplingParams;
use moult_runtime::engine::weights::{update_info, WeightListener};
use moult_runtime::model::{CausalLm, LogitsFor, SeqInput};
use serde_json::{json, Value};
use tch::{Device, Kind, Tensor};

fn client() -> reqwest::Client {
    reqwest::Client::new()
}

async fn post(url: &str, body: Value) -> (u16, Value) {
    let resp = client().post(url).json(&body).send().await.unwrap();
    let status = resp.status().as_u16();
    (status, resp.json().await.unwrap_or(Value::Null))
}

async fn generate(base: &str, body: Value) -> GenerateResponse {
    let (status, v) = post(&format!("{base}/inference/v1/generate"), body).await;
    assert_eq!(status, 200, "{v}");
    serde_json::from_value(v).unwrap()
}

fn params(temperature: f64, top_k: Option<usize>, top_p: f64) -> SamplingParams {
    SamplingParams {
        temperature,
        top_k,
        top_p,
        ..Default::default()
    }
}

fn prompt(seed: i64, len: usize) -> Vec<i64> {
    (0..len as i64)
        .map(|i| (seed * 131 + i * 37) % 2000)
        .collect()
}

fn assert_close(ours: &[f32], reference: &[f32], tol: f32, what: &str) {
    assert_eq!(ours.len(), reference.len());
    for (i, (a, b)) in ours.iter().zip(reference).enumerate() {
        assert!(
            (a - b).abs() <= tol,
            "{what}: token {i}: engine {a} vs reference {b}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn libtorch_engine_logprobs_match_full_forward_under_concurrency() {
    let dir = common::dense_model();
    let engine = common::start_engine(&dir, common::engine_options()).await;
    let reference = CausalLm::load(&dir, Kind::Float, Device::Cpu).unwrap();
    let settings = [
        (0.8, Some(50), 0.9),
        (1.0, None, 1.0),
        (0.0, None, 1.0),
        (1.2, Some(5), 0.7),
    ];
    let futures = (0..8).map(|i| {
        let (t, k, p) = settings[i % settings.len()];
        let body = json!({
            "token_ids": prompt(i as i64, 3 + 7 * i),
            "sampling_params": {"max_tokens": 24, "temperature": t, "top_k": k.map_or(-1, |k| k as i64), "top_p": p, "seed": i, "ignore_eos": true},
        });
        let url = engine.url.clone();
        async move { (i, generate(&url, body).await) }
    });
    for (i, resp) in futures::future::join_all(futures).await {
        let (t, k, p) = settings[i % settings.len()];
        let choice = &resp.choices[0];
        assert_eq!(choice.token_ids.len(), 24);
        assert_eq!(choice.finish_reason.as_deref(), Some("length"));
        assert_eq!(
            choice.weight_versions,
            vec![WeightVersionSpan {
                version: 0,
                start: 0,
                end: 24
            }]
        );
        let engine_lp: Vec<f32> = choice.logprobs.content.iter().map(|c| c.logprob).collect();
        let ids: Vec<i64> = choice.logprobs.content.iter().map(|c| c.token_id).collect();
        assert_eq!(ids, choice.token_ids);
        let reference_lp = common::reference_logprobs(
            &reference,
            &prompt(i as i64, 3 + 7 * i),
            &choice.token_ids,
            &params(t, k, p),
            None,
        );
        assert_close(&engine_lp, &reference_lp, 1e-5, &format!("request {i}"));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn libtorch_moe_engine_routing_replays_to_the_same_logprobs() {
    let dir = common::moe_model();
    let engine = common::start_engine(&dir, common::engine_options()).await;
    let reference = CausalLm::load(&dir, Kind::Float, Device::Cpu).unwrap();
    let p = prompt(3, 11);
    let resp = generate(
        &engine.url,
        json!({"token_ids": p, "sampling_params": {"max_tokens": 20, "temperature": 1.0, "seed": 5, "ignore_eos": true}}),
    )
    .await;
    let choice = &resp.choices[0];
    let (shape, ids) =
        decode_routed_experts(choice.routed_experts.as_ref().expect("routed_experts")).unwrap();
    let total = p.len() + choice.token_ids.len();
    assert_eq!(
        shape,
        [total - 1, 2, 2],
        "(tokens - 1, sparse layers, top_k)"
    );
    let routing = Tensor::from_slice(&ids.iter().map(|&e| e as i64).collect::<Vec<_>>()).reshape([
        shape[0] as i64,
        2,
        2,
    ]);
    let engine_lp: Vec<f32> = choice.logprobs.content.iter().map(|c| c.logprob).collect();
    // numpy reads it as vLLM's clients do: uint8 (8 experts), the same shape and values.
    let npy = std::process::Command::new(common::python())
        .args(["-c", "import base64, io, sys, numpy; a = numpy.load(io.BytesIO(base64.b64decode(sys.argv[1]))); print(a.dtype, list(a.shape), a.reshape(-1).tolist())"])
        .arg(choice.routed_experts.as_ref().unwrap())
        .output()
        .unwrap();
    let printed = String::from_utf8(npy.stdout).unwrap();
    let expected: Vec<u16> = ids.clone();
    assert_eq!(
        printed.trim(),
        format!("uint8 {:?} {:?}", shape.to_vec(), expected),
        "{}",
        String::from_utf8_lossy(&npy.stderr)
    );
    let replayed = common::reference_logprobs(
        &reference,
        &p,
        &choice.token_ids,
        &params(1.0, None, 1.0),
        Some(&routing),
    );
    assert_close(&engine_lp, &replayed, 1e-5, "with routing replay");
    let free = common::reference_logprobs(
        &reference,
        &p,
        &choice.token_ids,
        &params(1.0, None, 1.0),
        None,
    );
    assert_close(
        &engine_lp,
        &free,
        1e-5,
        "without replay (same weights, same routing)",
    );

    // routed_experts_prompt_start trims the prompt rows, as vLLM does.
    let resp = generate(
        &engine.url,
        json!({"token_ids": p, "sampling_params": {"max_tokens": 5, "seed": 5, "ignore_eos": true, "routed_experts_prompt_start": 4}}),
    )
    .await;
    let (shape2, ids2) =
        decode_routed_experts(resp.choices[0].routed_experts.as_ref().unwrap()).unwrap();
    assert_eq!(shape2[0], p.len() + 5 - 1 - 4);
    assert_eq!(
        &ids2[..],
        &ids[4 * 4..(4 + shape2[0]) * 4],
        "same seed, same routing, offset by the prompt start"
    );
}

async fn stream_tokens(base: &str, body: Value) -> (Vec<i64>, Vec<f32>, Value) {
    let resp = client()
        .post(format!("{base}/inference/v1/generate"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert!(resp.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/event-stream"));
    let text = resp.text().await.unwrap();
    let data = common::sse_data(&text);
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    let mut tokens = Vec::new();
    let mut logprobs = Vec::new();
    let mut last = Value::Null;
    for d in &data[..data.len() - 1] {
        let v: Value = serde_json::from_str(d).unwrap();
        let c = &v["choices"][0];
        for (t, lp) in c["token_ids"]
            .as_array()
            .unwrap()
            .iter()
            .zip(c["logprobs"]["content"].as_array().unwrap())
        {
            tokens.push(t.as_i64().unwrap());
            logprobs.push(lp["logprob"].as_f64().unwrap() as f32);
        }
        last = v;
    }
    (tokens, logprobs, last)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn libtorch_streaming_matches_non_streaming_and_seeds_reproduce() {
    let engine = common::start_engine(&common::dense_model(), common::engine_options()).await;
    let body = |stream: bool, seed: u64| json!({"token_ids": prompt(9, 6), "stream": stream, "sampling_params": {"max_tokens": 16, "seed": seed, "ignore_eos": true, "logprobs": 2}});
    let once = generate(&engine.url, body(false, 77)).await;
    let twice = generate(&engine.url, body(false, 77)).await;
    assert_eq!(
        once.choices[0].token_ids, twice.choices[0].token_ids,
        "same seed, same tokens"
    );
    assert_eq!(once.choices[0].logprobs.content[0].top_logprobs.len(), 2);
    let other = generate(&engine.url, body(false, 78)).await;
    assert_ne!(
        once.choices[0].token_ids, other.choices[0].token_ids,
        "another seed, other tokens"
    );

    let (tokens, logprobs, last) = stream_tokens(&engine.url, body(true, 77)).await;
    assert_eq!(tokens, once.choices[0].token_ids);
    let expected: Vec<f32> = once.choices[0]
        .logprobs
        .content
        .iter()
        .map(|c| c.logprob)
        .collect();
    assert_close(&logprobs, &expected, 1e-6, "streamed logprobs");
    assert_eq!(last["choices"][0]["finish_reason"], "length");
    assert_eq!(last["usage"]["completion_tokens"], 16);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn libtorch_stop_tokens_and_eos_end_generation() {
    let engine = common::start_engine(&common::dense_model(), common::engine_options()).await;
    let free = generate(&engine.url, json!({"token_ids": prompt(1, 5), "sampling_params": {"max_tokens": 12, "seed": 3, "ignore_eos": true}})).await;
    let stop_at = free.choices[0].token_ids[4];
    let first = free.choices[0]
        .token_ids
        .iter()
        .position(|&t| t == stop_at)
        .unwrap();
    let stopped = generate(
        &engine.url,
        json!({"token_ids": prompt(1, 5), "sampling_params": {"max_tokens": 12, "seed": 3, "ignore_eos": true, "stop_token_ids": [stop_at]}}),
    )
    .await;
    let c = &stopped.choices[0];
    assert_eq!(c.finish_reason.as_deref(), Some("stop"));
    assert_eq!(
        c.token_ids,
        free.choices[0].token_ids[..=first],
        "the stop token is the last output token"
    );
}

/// Perturbed copies of every weight: the "trainer's" next version.
fn perturbed(model: &CausalLm, seed: i64) -> Vec<(String, Tensor)> {
    tch::manual_seed(seed);
    model
        .params()
        .iter()
        .map(|(name, t)| (name.clone(), t.detach() + Tensor::randn_like(t) * 0.08))
        .collect()
}

/// Pushes `tensors` as version `version` through the TCP data plane, the way a trainer does.
async fn push_weights(base: &str, tensors: Vec<(String, Tensor)>, version: u64, buckets: usize) {
    let listener = WeightListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let accept = std::thread::spawn(move || listener.accept(1).unwrap());
    let (s, v) = post(&format!("{base}/init_weight_transfer_engine"), json!({"init_info": {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2}})).await;
    assert_eq!(s, 200, "{v}");
    let mut sender = accept.join().unwrap();
    let (s, v) = post(&format!("{base}/start_weight_update"), json!({})).await;
    assert_eq!(s, 200, "{v}");
    let per = tensors.len().div_ceil(buckets);
    let chunks: Vec<Vec<(String, Tensor)>> = {
        let mut it = tensors.into_iter().peekable();
        let mut out = Vec::new();
        while it.peek().is_some() {
            out.push(it.by_ref().take(per).collect());
        }
        out
    };
    for bucket in chunks {
        let info = update_info(&bucket);
        let send = std::thread::spawn(move || {
            sender.send_bucket(&bucket, 4096).unwrap();
            sender
        });
        let (s, v) = post(
            &format!("{base}/update_weights"),
            json!({"update_info": info}),
        )
        .await;
        assert_eq!(s, 200, "{v}");
        sender = send.join().unwrap();
    }
    let (s, v) = post(
        &format!("{base}/finish_weight_update"),
        json!({"weight_version": version}),
    )
    .await;
    assert_eq!(s, 200, "{v}");
}

/// A streamed response: tokens, logprobs, (version, index) per token, finish reason, routed experts.
type Streamed = (
    Vec<i64>,
    Vec<f32>,
    Vec<(u64, usize)>,
    String,
    Option<String>,
);

/// Reads a streaming response chunk by chunk, reporting how many tokens arrived so far.
fn spawn_stream(
    base: &str,
    body: Value,
    progress: tokio::sync::watch::Sender<usize>,
) -> tokio::task::JoinHandle<Streamed> {
    let url = format!("{base}/inference/v1/generate");
    tokio::spawn(async move {
        let resp = client().post(url).json(&body).send().await.unwrap();
        let g = common::Generation::read(resp, |g| {
            let _ = progress.send(g.ids.len());
        })
        .await;
        let versions = g
            .versions
            .iter()
            .enumerate()
            .map(|(i, &v)| (v, i))
            .collect();
        (g.ids, g.logprobs, versions, g.finish, g.routed_experts)
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn libtorch_pause_keep_weight_update_resume_labels_every_token() {
    let dir = common::moe_model();
    let engine = common::start_engine(&dir, common::engine_options()).await;
    let old = CausalLm::load(&dir, Kind::Float, Device::Cpu).unwrap();
    let new = CausalLm::load(&dir, Kind::Float, Device::Cpu).unwrap();
    let update = perturbed(&old, 11);
    tch::no_grad(|| {
        for (name, t) in &update {
            new.params()[name].shallow_clone().copy_(t);
        }
    });
    let n = 4;
    let max_tokens = 60;
    let mut tasks = Vec::new();
    let mut watchers = Vec::new();
    for i in 0..n {
        let (tx, rx) = tokio::sync::watch::channel(0);
        let body = json!({"token_ids": prompt(i, 4 + i as usize), "stream": true, "sampling_params": {"max_tokens": max_tokens, "seed": i, "ignore_eos": true}});
        tasks.push(spawn_stream(&engine.url, body, tx));
        watchers.push(rx);
    }
    for w in &mut watchers {
        w.wait_for(|&k| k >= 3).await.unwrap();
    }
    let (s, _) = post(&format!("{}/pause?mode=keep", engine.url), json!({})).await;
    assert_eq!(s, 200);
    let paused: Value = common::get_json(&format!("{}/is_paused", engine.url)).await;
    assert_eq!(paused["is_paused"], true);
    // A request arriving while paused (keep) is queued, not refused.
    let (tx, _rx) = tokio::sync::watch::channel(0);
    let late = spawn_stream(
        &engine.url,
        json!({"token_ids": prompt(9, 5), "stream": true, "sampling_params": {"max_tokens": 10, "seed": 9, "ignore_eos": true}}),
        tx,
    );
    tokio::time::sleep(Duration::from_millis(200)).await;
    let frozen: Vec<usize> = watchers.iter().map(|w| *w.borrow()).collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        frozen,
        watchers.iter().map(|w| *w.borrow()).collect::<Vec<_>>(),
        "paused (keep) engines produce nothing"
    );

    push_weights(&engine.url, update, 1, 3).await;
    let info: Value = common::get_json(&format!("{}/weight_info", engine.url)).await;
    assert_eq!(info["weight_version"], 1);
    let (s, _) = post(&format!("{}/resume", engine.url), json!({})).await;
    assert_eq!(s, 200);

    let p = params(1.0, None, 1.0);
    let mut spanning = 0;
    for (i, task) in tasks.into_iter().enumerate() {
        let (tokens, lps, versions, finish, routed) = task.await.unwrap();
        assert_eq!(finish, "length");
        assert_eq!(
            tokens.len(),
            max_tokens as usize,
            "request {i}: nothing lost"
        );
        // Versions are monotone: a prefix under 0, the rest under 1.
        let switch = versions
            .iter()
            .position(|&(v, _)| v == 1)
            .unwrap_or(versions.len());
        assert!(
            versions[..switch].iter().all(|&(v, _)| v == 0)
                && versions[switch..].iter().all(|&(v, _)| v == 1)
        );
        assert!(
            switch >= 3,
            "request {i}: tokens before the pause carry version 0"
        );
        if switch < tokens.len() {
            spanning += 1;
        }
        let p_old = common::reference_logprobs(&old, &prompt(i as i64, 4 + i), &tokens, &p, None);
        let p_new = common::reference_logprobs(&new, &prompt(i as i64, 4 + i), &tokens, &p, None);
        assert_close(
            &lps[..switch],
            &p_old[..switch],
            1e-5,
            &format!("request {i}, version-0 tokens vs old weights"),
        );
        assert_close(
            &lps[switch..],
            &p_new[switch..],
            1e-5,
            &format!("request {i}, version-1 tokens vs new weights"),
        );
        // Routing replay with partial rollout: each position keeps the experts of the version
        // that first computed it (the old weights up to the last token fed before the update).
        let (shape, ids) =
            decode_routed_experts(routed.as_deref().expect("routed_experts")).unwrap();
        let p_len = 4 + i;
        let mut seq = prompt(i as i64, p_len);
        seq.extend_from_slice(&tokens[..tokens.len() - 1]);
        assert_eq!(shape[0], seq.len());
        let row = shape[1] * shape[2];
        let experts = |m: &CausalLm| -> Vec<Vec<i64>> {
            let input = [SeqInput {
                tokens: &seq,
                slot: None,
                replay: None,
                images: &[],
            }];
            let out = tch::no_grad(|| m.forward(&input, None, LogitsFor::Last)).unwrap();
            let t = out.routed_experts.unwrap();
            let flat = Vec::<i64>::try_from(t.flatten(0, -1)).unwrap();
            flat.chunks(shape[2])
                .map(|c| {
                    let mut c = c.to_vec();
                    c.sort();
                    c
                })
                .collect()
        };
        let (e_old, e_new) = (experts(&old), experts(&new));
        let boundary = p_len + switch - 1;
        let mut differ = 0;
        for pos in 0..seq.len() {
            for l in 0..shape[1] {
                let at = pos * row + l * shape[2];
                let mut got: Vec<i64> = ids[at..at + shape[2]]
                    .iter()
                    .map(|&e| i64::from(e))
                    .collect();
                got.sort();
                let want = if pos < boundary {
                    &e_old[pos * shape[1] + l]
                } else {
                    &e_new[pos * shape[1] + l]
                };
                assert_eq!(&got, want, "request {i} position {pos} layer {l}");
                differ += usize::from(e_old[pos * shape[1] + l] != e_new[pos * shape[1] + l]);
            }
        }
        assert!(
            differ > 0,
            "request {i}: the update changed some routing, so the check means something"
        );
        let moved = lps[switch..]
            .iter()
            .zip(&p_old[switch..])
            .filter(|(a, b)| (*a - *b).abs() > 1e-3)
            .count();
        assert!(
            moved > 0,
            "request {i}: the new weights really changed the distribution"
        );
    }
    assert!(spanning == n as usize, "every request spans the update");
    let (tokens, _, versions, _, _) = late.await.unwrap();
    assert_eq!(tokens.len(), 10);
    assert!(
        versions.iter().all(|&(v, _)| v == 1),
        "queued while paused, sampled only under version 1"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn libtorch_pause_abort_returns_partial_results_and_refuses_until_resume() {
    let engine = common::start_engine(&common::dense_model(), common::engine_options()).await;
    let mut tasks = Vec::new();
    let mut watchers = Vec::new();
    for i in 0..3 {
        let (tx, rx) = tokio::sync::watch::channel(0);
        tasks.push(spawn_stream(&engine.url, json!({"token_ids": prompt(i, 5), "stream": true, "sampling_params": {"max_tokens": 400, "ignore_eos": true}}), tx));
        watchers.push(rx);
    }
    for w in &mut watchers {
        w.wait_for(|&k| k >= 2).await.unwrap();
    }
    let (s, _) = post(&format!("{}/pause?mode=abort", engine.url), json!({})).await;
    assert_eq!(s, 200);
    for task in tasks {
        let (tokens, _, _, finish, _) = task.await.unwrap();
        assert_eq!(finish, "abort");
        assert!(
            tokens.len() >= 2 && tokens.len() < 400,
            "partial output returned"
        );
    }
    let resp = client()
        .post(format!("{}/inference/v1/generate", engine.url))
        .json(&json!({"token_ids": [1, 2]}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 503);
    assert!(resp.headers().contains_key("retry-after"));
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["error"]["code"], 503);
    post(&format!("{}/resume", engine.url), json!({})).await;
    let ok = generate(
        &engine.url,
        json!({"token_ids": [1, 2], "sampling_params": {"max_tokens": 3, "ignore_eos": true}}),
    )
    .await;
    assert_eq!(ok.choices[0].token_ids.len(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn libtorch_pause_wait_drains_in_flight_requests_first() {
    let engine = common::start_engine(&common::dense_model(), common::engine_options()).await;
    let (tx, mut rx) = tokio::sync::watch::channel(0);
    let task = spawn_stream(
        &engine.url,
        json!({"token_ids": prompt(2, 5), "stream": true, "sampling_params": {"max_tokens": 40, "ignore_eos": true}}),
        tx,
    );
    rx.wait_for(|&k| k >= 1).await.unwrap();
    let url = engine.url.clone();
    let pause =
        tokio::spawn(async move { post(&format!("{url}/pause?mode=wait"), json!({})).await });
    tokio::time::sleep(Duration::from_millis(50)).await;
    let refused = client()
        .post(format!("{}/inference/v1/generate", engine.url))
        .json(&json!({"token_ids": [1]}))
        .send()
        .await
        .unwrap();
    assert_eq!(
        refused.status(),
        503,
        "new requests are refused while draining"
    );
    let (tokens, _, _, finish, _) = task.await.unwrap();
    assert_eq!(
        (tokens.len(), finish.as_str()),
        (40, "length"),
        "the in-flight request finished whole"
    );
    assert_eq!(pause.await.unwrap().0, 200);
    let paused: Value = common::get_json(&format!("{}/is_paused", engine.url)).await;
    assert_eq!(paused["is_paused"], true);
    post(&format!("{}/resume", engine.url), json!({})).await;
    generate(
        &engine.url,
        json!({"token_ids": [1], "sampling_params": {"max_tokens": 2}}),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn libtorch_abort_requests_ends_one_request_with_its_partial_output() {
    let engine = common::start_engine(&common::dense_model(), common::engine_options()).await;
    let (tx, mut rx) = tokio::sync::watch::channel(0);
    let victim = spawn_stream(
        &engine.url,
        json!({"request_id": "victim", "token_ids": prompt(4, 5), "stream": true, "sampling_params": {"max_tokens": 400, "ignore_eos": true}}),
        tx,
    );
    let url = engine.url.clone();
    let bystander = tokio::spawn(async move {
        generate(&url, json!({"token_ids": prompt(5, 5), "sampling_params": {"max_tokens": 30, "ignore_eos": true}})).await
    });
    rx.wait_for(|&k| k >= 2).await.unwrap();
    // A second request with an id already in flight is refused.
    let (s, v) = post(
        &format!("{}/inference/v1/generate", engine.url),
        json!({"request_id": "victim", "token_ids": [1]}),
    )
    .await;
    assert_eq!(s, 409, "{v}");
    let (s, _) = post(
        &format!("{}/inference/v1/abort_requests", engine.url),
        json!({"request_ids": ["victim"]}),
    )
    .await;
    assert_eq!(s, 200);
    let (tokens, _, _, finish, _) = victim.await.unwrap();
    assert_eq!(finish, "abort");
    assert!(tokens.len() < 400);
    assert_eq!(bystander.await.unwrap().choices[0].token_ids.len(), 30);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn libtorch_client_disconnect_frees_the_slot() {
    let engine = common::start_engine(&common::dense_model(), common::engine_options()).await;
    for stream in [true, false] {
        let resp = client()
            .post(format!("{}/inference/v1/generate", engine.url))
            .timeout(Duration::from_millis(300))
            .json(&json!({"token_ids": prompt(6, 5), "stream": stream, "sampling_params": {"max_tokens": 500, "ignore_eos": true}}))
            .send()
            .await;
        if let Ok(resp) = resp {
            let mut s = resp.bytes_stream();
            let _ = s.next().await;
            drop(s);
        }
        tokio::time::sleep(Duration::from_millis(400)).await;
        let mut running = 1.0;
        for _ in 0..50 {
            running = common::metric(&engine.url, "vllm:num_requests_running", "").await;
            if running == 0.0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert_eq!(
            running, 0.0,
            "stream={stream}: the abandoned request still runs"
        );
    }
    let generated = common::metric(&engine.url, "vllm:generation_tokens_total", "").await;
    assert!(
        generated > 0.0 && generated < 1000.0,
        "abandoned requests stopped early ({generated} tokens)"
    );
    for name in [
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prompt_tokens_total",
    ] {
        common::metric(&engine.url, name, "").await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn libtorch_bad_input_gets_4xx_naming_the_field_while_others_complete() {
    let engine = common::start_engine(&common::dense_model(), common::engine_options()).await;
    let url = engine.url.clone();
    let healthy = tokio::spawn(async move {
        generate(&url, json!({"token_ids": prompt(7, 8), "sampling_params": {"max_tokens": 64, "ignore_eos": true}})).await
    });
    let gen = format!("{}/inference/v1/generate", engine.url);
    let cases: Vec<(&str, &str, &str)> = vec![
        ("{\"token_ids\": [1, 2", "malformed JSON", ""),
        ("[1, 2, 3]", "must be a JSON object", ""),
        (
            r#"{"token_ids": [1, 99999]}"#,
            "token_ids[1] = 99999",
            "token_ids",
        ),
        (r#"{"token_ids": [-1]}"#, "token_ids[0] = -1", "token_ids"),
        (
            r#"{"token_ids": [1], "sampling_params": {"max_tokens": 600}}"#,
            "maximum context length is 512",
            "sampling_params.max_tokens",
        ),
        (
            r#"{"token_ids": [1], "sampling_params": {"temperature": -0.5}}"#,
            "temperature",
            "sampling_params.temperature",
        ),
        (
            r#"{"token_ids": [1], "sampling_params": {"max_token": 5}}"#,
            "unknown field `max_token`",
            "sampling_params",
        ),
        (
            r#"{"token_ids": [1], "sampling_params": {"top_p": 1.5}}"#,
            "top_p",
            "sampling_params.top_p",
        ),
        (
            r#"{"token_ids": [1], "sampling_params": {"seed": -4}}"#,
            "sampling_params.seed",
            "sampling_params.seed",
        ),
        (r#"{"token_ids": "hello"}"#, "token_ids", "token_ids"),
    ];
    for (body, needle, param) in cases {
        let resp = client()
            .post(&gen)
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .unwrap();
        let status = resp.status().as_u16();
        let v: Value = resp.json().await.unwrap();
        assert_eq!(status, 400, "{body}: {v}");
        let message = v["error"]["message"].as_str().unwrap();
        assert!(message.contains(needle), "{body}: {message}");
        assert_eq!(v["error"]["code"], 400);
        assert_eq!(v["error"]["type"], "BadRequestError");
        if !param.is_empty() {
            assert!(
                v["error"]["param"]
                    .as_str()
                    .unwrap_or("")
                    .starts_with(param),
                "{body}: {v}"
            );
        }
    }
    let (s, v) = post(&format!("{}/pause?mode=sideways", engine.url), json!({})).await;
    assert_eq!(s, 400, "{v}");
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("keep, wait, abort"));
    let (s, v) = post(
        &format!("{}/update_weights", engine.url),
        json!({"update_info": {"names": ["nope"], "dtype_names": ["float32"], "shapes": [[1]]}}),
    )
    .await;
    assert_eq!(s, 400);
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("`nope` is not a weight"),
        "{v}"
    );
    let (s, _) = post(
        &format!("{}/finish_weight_update", engine.url),
        json!({"weight_version": 3}),
    )
    .await;
    assert_eq!(s, 409, "finish without start");
    let (s, v) = post(
        &format!("{}/init_weight_transfer_engine", engine.url),
        json!({"init_info": {"nccl_unique_id_b64": "AAAA", "rank_offset": 1, "world_size": 2}}),
    )
    .await;
    assert_eq!(s, 501, "{v}");
    let resp = client()
        .get(format!("{}/no/such/route", engine.url))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 404);

    let done = healthy.await.unwrap();
    assert_eq!(
        done.choices[0].token_ids.len(),
        64,
        "the healthy request was not disturbed"
    );
    assert_eq!(
        client()
            .get(format!("{}/health", engine.url))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn libtorch_end_of_sequence_stops_unless_ignored_or_before_min_tokens() {
    let dir = common::dense_model();
    let probe = common::start_engine(&dir, common::engine_options()).await;
    let greedy = |extra: Value| {
        let mut params = json!({"max_tokens": 5, "temperature": 0.0});
        params
            .as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        json!({"token_ids": prompt(8, 6), "sampling_params": params})
    };
    let first = generate(&probe.url, greedy(json!({"ignore_eos": true})))
        .await
        .choices[0]
        .token_ids[0];
    // An engine whose end-of-sequence id is exactly the token greedy decoding picks first.
    let opts = moult_runtime::engine::EngineOptions {
        eos_token_ids: vec![first],
        ..common::engine_options()
    };
    let engine = common::start_engine(&dir, opts).await;
    let stopped = generate(&engine.url, greedy(json!({}))).await;
    assert_eq!(stopped.choices[0].token_ids, vec![first]);
    assert_eq!(stopped.choices[0].finish_reason.as_deref(), Some("stop"));
    let ignored = generate(&engine.url, greedy(json!({"ignore_eos": true}))).await;
    assert_eq!(
        (
            ignored.choices[0].token_ids.len(),
            ignored.choices[0].finish_reason.as_deref()
        ),
        (5, Some("length"))
    );
    let held = generate(&engine.url, greedy(json!({"min_tokens": 2}))).await;
    let c = &held.choices[0];
    assert_ne!(
        c.token_ids[0], first,
        "end-of-sequence is masked before min_tokens"
    );
    assert!(c.token_ids.len() >= 2);
}

/// A model whose logits are NaN (NaN weights, pushed here as an update) has no distribution to
/// sample: the request fails with the reason and reports no token, with top-k or without, and the
/// engine serves again once its weights are good. (Found by fuzzing the sampler: with top-k such
/// a row panicked the engine thread, without it every logprob was NaN.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn libtorch_nan_logits_fail_the_request_and_the_engine_goes_on() {
    let dir = common::dense_model();
    let engine = common::start_engine(&dir, common::engine_options()).await;
    let model = CausalLm::load(&dir, Kind::Float, Device::Cpu).unwrap();
    let good: Vec<(String, Tensor)> = model
        .params()
        .iter()
        .map(|(n, t)| (n.clone(), t.detach().copy()))
        .collect();
    let nan: Vec<(String, Tensor)> = good
        .iter()
        .map(|(n, t)| {
            let t = if n == "model.norm.weight" {
                t.full_like(f64::NAN)
            } else {
                t.shallow_clone()
            };
            (n.clone(), t)
        })
        .collect();
    assert!(nan.iter().any(|(n, _)| n == "model.norm.weight"));
    push_weights(&engine.url, nan, 1, 1).await;
    for top_k in [-1, 5] {
        let (status, v) = post(
            &format!("{}/inference/v1/generate", engine.url),
            json!({"token_ids": prompt(3, 6), "sampling_params": {"max_tokens": 4, "top_k": top_k}}),
        )
        .await;
        assert_eq!(status, 500, "top_k {top_k}: {v}");
        let message = v["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains("not finite"), "top_k {top_k}: {v}");
    }
    push_weights(&engine.url, good, 2, 1).await;
    let ok = generate(
        &engine.url,
        json!({"token_ids": prompt(3, 6), "sampling_params": {"max_tokens": 4, "ignore_eos": true}}),
    )
    .await;
    assert_eq!(ok.choices[0].token_ids.len(), 4);
    assert!(ok.choices[0]
        .logprobs
        .content
        .iter()
        .all(|t| t.logprob.is_finite()));
}

/// `prompt_logprobs` (what a served distillation teacher answers): every prompt token's logprob
/// under the raw distribution equals the trainer's full forward at temperature 1, whatever the
/// sampling temperature, across prefill chunks and beside requests that decode; ranks and the
/// top tokens are the reference's; streaming requests and the router refuse them by name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn libtorch_prompt_logprobs_are_the_full_forwards_across_prefill_chunks() {
    use moult_runtime::trainer::logprobs::token_logprobs;
    let dir = common::dense_model();
    let mut opts = common::engine_options();
    // Prompts longer than a chunk are scored over several steps.
    opts.max_prefill_tokens = 16;
    let engine = common::start_engine(&dir, opts).await;
    let reference = CausalLm::load(&dir, Kind::Float, Device::Cpu).unwrap();
    let cases = [
        (1usize, 0i64, 0.7),
        (5, 0, 1.0),
        (40, 3, 0.0),
        (100, 0, 1.3),
    ];
    let scoring = cases.iter().enumerate().map(|(i, &(len, top, t))| {
        let body = json!({
            "token_ids": prompt(i as i64 + 10, len),
            "sampling_params": {"max_tokens": 1, "temperature": t, "prompt_logprobs": top},
        });
        let url = engine.url.clone();
        async move { generate(&url, body).await }
    });
    // A decoding request beside them gets no prompt logprobs.
    let decoding = generate(
        &engine.url,
        json!({"token_ids": prompt(3, 20), "sampling_params": {"max_tokens": 12, "ignore_eos": true}}),
    );
    let (scored, decoded) = tokio::join!(futures::future::join_all(scoring), decoding);
    assert_eq!(decoded.prompt_logprobs, None);
    assert_eq!(decoded.choices[0].token_ids.len(), 12);
    for (i, resp) in scored.iter().enumerate() {
        let (len, top, _) = cases[i];
        let tokens = prompt(i as i64 + 10, len);
        let rows = resp
            .prompt_logprobs
            .as_ref()
            .expect("prompt_logprobs asked for");
        assert_eq!(rows.len(), len, "case {i}: one entry per prompt token");
        assert!(rows[0].is_none(), "nothing predicts the first token");
        let want = tch::no_grad(|| {
            token_logprobs(
                &reference,
                &[SeqInput {
                    slot: None,
                    tokens: &tokens,
                    replay: None,
                    images: &[],
                }],
                1.0,
            )
        })
        .unwrap();
        let want: Vec<f32> = Vec::try_from(want.get(0)).unwrap();
        let all = tch::no_grad(|| {
            reference.forward(
                &[SeqInput {
                    tokens: &tokens,
                    slot: None,
                    replay: None,
                    images: &[],
                }],
                None,
                LogitsFor::All,
            )
        })
        .unwrap()
        .logits
        .log_softmax(-1, Kind::Float);
        for p in 1..len {
            let entries = rows[p].as_ref().unwrap();
            // The prompt token and the top tokens, the prompt token once if it is among them.
            let n = entries.len() as i64;
            assert!(n == top.max(1) || n == top + 1, "case {i}: {n} entries");
            let own = &entries[&tokens[p]];
            assert!(
                (own.logprob - want[p]).abs() <= 1e-5,
                "case {i} position {p}: engine {} vs trainer {}",
                own.logprob,
                want[p]
            );
            let row = all.get(p as i64 - 1);
            let greater = i64::try_from(row.gt(f64::from(want[p])).sum(Kind::Int64)).unwrap();
            assert_eq!(own.rank, Some(greater as u64 + 1), "case {i} position {p}");
            if top > 0 {
                let (values, ids) = row.topk(top, -1, true, true);
                let ids: Vec<i64> = Vec::try_from(ids).unwrap();
                let values: Vec<f32> = Vec::try_from(values).unwrap();
                for (j, (id, v)) in ids.iter().zip(&values).enumerate() {
                    let entry = &entries[id];
                    assert!((entry.logprob - v).abs() <= 1e-5);
                    if *id != tokens[p] {
                        assert_eq!(entry.rank, Some(j as u64 + 1));
                    }
                }
            }
        }
    }
    let url = format!("{}/inference/v1/generate", engine.url);
    for (body, what) in [
        (
            json!({"token_ids": [1, 2, 3], "stream": true, "sampling_params": {"prompt_logprobs": 0}}),
            "stream: false",
        ),
        (
            json!({"token_ids": [1, 2, 3], "sampling_params": {"prompt_logprobs": 21}}),
            "between 0 and 20",
        ),
    ] {
        let (status, v) = post(&url, body).await;
        assert_eq!(status, 400, "{v}");
        assert_eq!(
            v["error"]["param"], "sampling_params.prompt_logprobs",
            "{v}"
        );
        assert!(
            v["error"]["message"].as_str().unwrap().contains(what),
            "{v}"
        );
    }
    let (router, _r) =
        common::start_router(std::slice::from_ref(&engine.url), "consistent-hash").await;
    let (status, v) = post(
        &format!("{router}/inference/v1/generate"),
        json!({"token_ids": [1, 2, 3], "sampling_params": {"prompt_logprobs": 0}}),
    )
    .await;
    assert_eq!(status, 400, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("not routed"),
        "{v}"
    );
}

/// `POST {url}{path}` with `body`: the status and the body as text.
async fn post_text(url: &str, path: &str, body: Value) -> (u16, String) {
    let resp = client()
        .post(format!("{url}{path}"))
        .json(&body)
        .send()
        .await
        .unwrap();
    (resp.status().as_u16(), resp.text().await.unwrap())
}

/// The engine's logprobs of `resp`'s tokens against `reference`'s (the trainer's forward, at
/// temperature 1) after `prompt`, within 1e-4.
fn check_against(resp: &GenerateResponse, reference: &CausalLm, prompt: &[i64], what: &str) {
    let lp: Vec<f32> = (resp.choices[0].logprobs.content.iter())
        .map(|c| c.logprob)
        .collect();
    let want = common::reference_logprobs(
        reference,
        prompt,
        &resp.choices[0].token_ids,
        &params(1.0, None, 1.0),
        None,
    );
    assert_close(&lp, &want, 1e-4, what);
}

/// LoRA adapters loaded at run time, vLLM's way (docs/lora.md): `/v1/load_lora_adapter` of a
/// PEFT folder (one PEFT made, one moult wrote), requests naming them in `model` mixed in the
/// same batches with requests for the model itself, each token's logprob the one the trainer's
/// forward with that adapter gives; `/v1/models` lists them; unknown names, duplicates and bad
/// folders are refused naming the field; an unloaded adapter is no longer served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn libtorch_engine_serves_lora_adapters_loaded_at_run_time_in_shared_batches() {
    use moult_runtime::model::lora::{self, LoraConfig};
    let dir = common::dense_model();
    let engine = common::start_engine(&dir, common::engine_options()).await;
    let peft = common::lora_adapters().join("dense");
    // An adapter moult writes, with a trained-looking B, on other projections and rank.
    let mine = std::env::temp_dir().join(format!("moult-engine-lora-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&mine);
    std::fs::create_dir_all(&mine).unwrap();
    let config = LoraConfig {
        rank: 8,
        alpha: 8.0,
        rslora: false,
        dropout: 0.0,
        targets: vec!["k_proj".into(), "gate_proj".into(), "down_proj".into()],
    };
    let mut model = CausalLm::load(&dir, Kind::Float, Device::Cpu).unwrap();
    model.attach_lora(&config, None, 4).unwrap();
    tch::manual_seed(4);
    let weights: Vec<(String, Tensor)> = tch::no_grad(|| {
        (model.params().iter())
            .map(|(n, t)| (n.clone(), t.randn_like() * 0.2))
            .collect()
    });
    lora::write_adapter(&mine, &config, &dir, &weights).unwrap();
    for (name, path) in [("peft", &peft), ("mine", &mine)] {
        let body = json!({"lora_name": name, "lora_path": path});
        let (status, text) = post_text(&engine.url, "/v1/load_lora_adapter", body).await;
        assert_eq!(status, 200, "{text}");
        assert_eq!(
            text,
            format!("Success: LoRA adapter '{name}' added successfully.")
        );
    }
    let body = json!({"lora_name": "peft", "lora_path": peft});
    let (status, text) = post_text(&engine.url, "/v1/load_lora_adapter", body).await;
    assert_eq!(status, 400, "{text}");
    assert!(
        text.contains("has already been loaded") && text.contains("lora_name"),
        "{text}"
    );
    let body = json!({"lora_name": "x", "lora_path": "/nonexistent"});
    let (status, text) = post_text(&engine.url, "/v1/load_lora_adapter", body).await;
    assert_eq!(status, 400, "{text}");
    assert!(text.contains("lora_path"), "{text}");
    let models: Value = client()
        .get(format!("{}/v1/models", engine.url))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let ids: Vec<&str> = (models["data"].as_array().unwrap().iter())
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["tiny", "mine", "peft"]);
    assert_eq!(models["data"][1]["parent"], "tiny");

    let references = [
        (
            None,
            CausalLm::load(&dir, Kind::Float, Device::Cpu).unwrap(),
        ),
        (
            Some("peft"),
            CausalLm::load(&peft, Kind::Float, Device::Cpu).unwrap(),
        ),
        (
            Some("mine"),
            CausalLm::load(&mine, Kind::Float, Device::Cpu).unwrap(),
        ),
        (
            Some("tiny"),
            CausalLm::load(&dir, Kind::Float, Device::Cpu).unwrap(),
        ),
    ];
    let futures = (0..8).map(|i| {
        let model = references[i % references.len()].0;
        let body = json!({
            "token_ids": prompt(i as i64, 4 + 5 * i),
            "model": model,
            "sampling_params": {"max_tokens": 16, "temperature": 1.0, "seed": i, "ignore_eos": true},
        });
        let url = engine.url.clone();
        async move { (i, generate(&url, body).await) }
    });
    for (i, resp) in futures::future::join_all(futures).await {
        let (name, reference) = &references[i % references.len()];
        let choice = &resp.choices[0];
        let engine_lp: Vec<f32> = choice.logprobs.content.iter().map(|c| c.logprob).collect();
        let reference_lp = common::reference_logprobs(
            reference,
            &prompt(i as i64, 4 + 5 * i),
            &choice.token_ids,
            &params(1.0, None, 1.0),
            None,
        );
        assert_close(
            &engine_lp,
            &reference_lp,
            1e-4,
            &format!("request {i} on {name:?}"),
        );
        if name.is_some_and(|n| n != "tiny") {
            // The adapter is what computed them: the base gives other logprobs.
            let base = common::reference_logprobs(
                &references[0].1,
                &prompt(i as i64, 4 + 5 * i),
                &choice.token_ids,
                &params(1.0, None, 1.0),
                None,
            );
            let moved = (engine_lp.iter().zip(&base)).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(
                moved > 1e-3,
                "request {i}: the adapter changes the logprobs ({moved})"
            );
        }
    }
    // Unloaded while a request runs with it: the request finishes with it, then it is gone.
    let (status, _) = post(&format!("{}/pause?mode=keep", engine.url), json!({})).await;
    assert_eq!(status, 200);
    let body = json!({"token_ids": prompt(5, 7), "model": "mine",
        "sampling_params": {"max_tokens": 12, "temperature": 1.0, "seed": 5, "ignore_eos": true}});
    let url = engine.url.clone();
    let held = tokio::spawn(async move { generate(&url, body).await });
    // The request reaches the paused engine and waits there.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (status, text) = post_text(
        &engine.url,
        "/v1/unload_lora_adapter",
        json!({"lora_name": "mine"}),
    )
    .await;
    assert_eq!(status, 200, "{text}");
    let (status, _) = post(&format!("{}/resume", engine.url), json!({})).await;
    assert_eq!(status, 200);
    let resp = held.await.unwrap();
    let what = "finished after its adapter was unloaded";
    check_against(&resp, &references[2].1, &prompt(5, 7), what);
    let body = json!({"token_ids": [1, 2, 3], "model": "mine"});
    assert_eq!(
        post(&format!("{}/inference/v1/generate", engine.url), body)
            .await
            .0,
        404
    );
    let body = json!({"token_ids": [1, 2, 3], "model": "nope"});
    let (status, v) = post(&format!("{}/inference/v1/generate", engine.url), body).await;
    assert_eq!(status, 404, "{v}");
    assert!(
        v.to_string().contains("The model `nope` does not exist."),
        "{v}"
    );
    let (status, text) = post_text(
        &engine.url,
        "/v1/unload_lora_adapter",
        json!({"lora_name": "peft"}),
    )
    .await;
    assert_eq!(
        (status, text.as_str()),
        (200, "Success: LoRA adapter 'peft' removed successfully.")
    );
    let body = json!({"token_ids": [1, 2, 3], "model": "peft"});
    let (status, _) = post(&format!("{}/inference/v1/generate", engine.url), body).await;
    assert_eq!(status, 404);
    let (status, text) = post_text(
        &engine.url,
        "/v1/unload_lora_adapter",
        json!({"lora_name": "peft"}),
    )
    .await;
    assert_eq!(status, 404, "{text}");
    assert!(text.contains("cannot be found"), "{text}");
    // Loaded again under the same name: a free slot, served as before.
    let body = json!({"lora_name": "peft", "lora_path": peft});
    assert_eq!(
        post_text(&engine.url, "/v1/load_lora_adapter", body)
            .await
            .0,
        200
    );
    let body = json!({"token_ids": prompt(3, 9), "model": "peft",
        "sampling_params": {"max_tokens": 6, "temperature": 1.0, "seed": 3}});
    let resp = generate(&engine.url, body).await;
    check_against(&resp, &references[1].1, &prompt(3, 9), "reloaded");
    let _ = std::fs::remove_dir_all(&mine);
}
