//! The router in front of real `moult engine` processes (libtorch): an engine killed in the middle
//! of generation loses no request and no token (each token's logprob matches a reference forward),
//! sessions stick to their engine, engines join, leave, go down and come back, and control calls
//! reach every engine.

mod common;

use std::time::Duration;

use common::{
    dense_model, metric, reference_logprobs, spawn_engine, spawn_engine_on, start_router,
    Generation,
};
use futures::StreamExt;
use moult_runtime::engine::sampling::SamplingParams;
use moult_runtime::model::CausalLm;
use serde_json::{json, Value};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn libtorch_an_engine_killed_mid_generation_loses_no_token() {
    let model_dir = dense_model();
    let (mut a, a_url) = spawn_engine(&model_dir);
    let (mut b, b_url) = spawn_engine(&model_dir);
    // least-tokens spreads the requests over both engines.
    let (url, router) = start_router(&[a_url.clone(), b_url.clone()], "least-tokens").await;
    let client = reqwest::Client::new();
    const N: usize = 4;
    const MAX: usize = 300;
    let prompts: Vec<Vec<i64>> = (0..N)
        .map(|i| (0..10).map(|j| ((i * 37 + j * 11) % 2000) as i64).collect())
        .collect();
    let mut streams = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        let body = json!({"request_id": format!("r{i}"), "token_ids": p, "stream": true,
            "sampling_params": {"max_tokens": MAX, "temperature": 1.0, "ignore_eos": true, "seed": i}});
        let r = client
            .post(format!("{url}/inference/v1/generate"))
            .header("x-moult-session", format!("s{i}"))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        streams.push(r.bytes_stream());
    }
    // Both engines are busy with two requests each.
    let engines: Value = common::get_json(&format!("{url}/engines")).await;
    assert!(
        engines["engines"]
            .as_array()
            .unwrap()
            .iter()
            .all(|e| e["requests"] == 2),
        "{engines}"
    );

    let mut outs: Vec<Generation> = (0..N).map(|_| Generation::default()).collect();
    let mut buffers = vec![String::new(); N];
    let mut killed = false;
    let mut done = [false; N];
    while done.iter().any(|d| !d) {
        for i in 0..N {
            if done[i] {
                continue;
            }
            match tokio::time::timeout(Duration::from_secs(60), streams[i].next())
                .await
                .unwrap()
            {
                Some(chunk) => {
                    buffers[i].push_str(&String::from_utf8_lossy(&chunk.unwrap()));
                    while let Some(end) = buffers[i].find("\n\n") {
                        let event: String = buffers[i].drain(..end + 2).collect();
                        for line in event.lines() {
                            if let Some(data) = line.strip_prefix("data: ") {
                                outs[i].absorb(data);
                            }
                        }
                    }
                }
                None => done[i] = true,
            }
        }
        if !killed && outs.iter().all(|o| o.ids.len() >= 20) {
            a.kill().unwrap();
            a.wait().unwrap();
            killed = true;
        }
    }
    assert!(killed);
    assert!(
        router.failovers() >= 1,
        "no request was on the killed engine"
    );
    assert!(metric(&url, "moult_router_failovers_total", "").await >= 1.0);
    assert_eq!(metric(&url, "moult_router_engines_healthy", "").await, 1.0);
    let model = CausalLm::load(&model_dir, tch::Kind::Float, tch::Device::Cpu).unwrap();
    let params = SamplingParams {
        max_tokens: MAX,
        ignore_eos: true,
        ..SamplingParams::default()
    };
    for (i, out) in outs.iter().enumerate() {
        assert_eq!(out.finish, "length", "request {i}");
        assert_eq!(out.ids.len(), MAX, "request {i}: every token, once");
        assert_eq!(out.completion_tokens as usize, MAX);
        assert!(out.versions.iter().all(|&v| v == 0));
        // Each token's logprob is its probability under the model given everything before it:
        // what the engine that sampled it reported, whichever engine that was.
        let reference = reference_logprobs(&model, &prompts[i], &out.ids, &params, None);
        for (k, (got, want)) in out.logprobs.iter().zip(&reference).enumerate() {
            assert!(
                (got - want).abs() < 1e-4,
                "request {i} token {k}: {got} vs {want}"
            );
        }
    }
    // The dead engine is out of the pool's healthy set.
    let engines: Value = common::get_json(&format!("{url}/engines")).await;
    let dead = engines["engines"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["url"] == a_url.as_str())
        .unwrap();
    assert_eq!(dead["healthy"], false, "{engines}");
    b.kill().unwrap();
    b.wait().unwrap();
}

async fn success_count(engine: &str) -> f64 {
    metric(engine, "vllm:request_success_total", "").await
}

async fn engines_status(url: &str) -> Vec<(String, bool)> {
    let v: Value = common::get_json(&format!("{url}/engines")).await;
    v["engines"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            (
                e["url"].as_str().unwrap().to_string(),
                e["healthy"].as_bool().unwrap(),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn libtorch_sessions_stick_engines_come_and_go_and_control_calls_fan_out() {
    let model_dir = dense_model();
    let (mut a, a_url) = spawn_engine(&model_dir);
    let (mut b, b_url) = spawn_engine(&model_dir);
    let (url, _router) = start_router(&[a_url.clone(), b_url.clone()], "consistent-hash").await;
    let client = reqwest::Client::new();
    let generate = |session: &str| {
        let client = client.clone();
        let url = url.clone();
        let session = session.to_string();
        async move {
            let body = json!({"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2}});
            let r = client
                .post(format!("{url}/inference/v1/generate"))
                .header("x-moult-session", session)
                .json(&body)
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
            r.json::<Value>().await.unwrap()
        }
    };
    // Every turn of a session lands on the same engine.
    for _ in 0..6 {
        generate("episode-7").await;
    }
    let (na, nb) = (success_count(&a_url).await, success_count(&b_url).await);
    assert!(
        (na, nb) == (6.0, 0.0) || (na, nb) == (0.0, 6.0),
        "{na} {nb}"
    );

    // Control calls reach every engine.
    let r = client
        .post(format!("{url}/pause?mode=keep"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    for e in [&a_url, &b_url] {
        let v: Value = reqwest::get(format!("{e}/is_paused"))
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(v["is_paused"], true);
    }
    let v: Value = common::get_json(&format!("{url}/is_paused")).await;
    assert_eq!(v["is_paused"], true);
    client.post(format!("{url}/resume")).send().await.unwrap();
    let v: Value = common::get_json(&format!("{url}/get_world_size")).await;
    assert_eq!(v["world_size"], 2);

    // An engine that dies is taken out; requests go to the other; it comes back on restart.
    let port: u16 = b_url.rsplit(':').next().unwrap().parse().unwrap();
    b.kill().unwrap();
    b.wait().unwrap();
    let mut waited = 0;
    while engines_status(&url).await.contains(&(b_url.clone(), true)) {
        tokio::time::sleep(Duration::from_millis(100)).await;
        waited += 1;
        assert!(waited < 300, "the dead engine stayed in");
    }
    for i in 0..4 {
        generate(&format!("s{i}")).await;
    }
    let (mut b2, b2_url) = spawn_engine_on(&model_dir, port);
    assert_eq!(b2_url, b_url);
    let mut waited = 0;
    while !engines_status(&url).await.contains(&(b_url.clone(), true)) {
        tokio::time::sleep(Duration::from_millis(100)).await;
        waited += 1;
        assert!(waited < 300, "the restarted engine did not come back");
    }

    // Engines join and leave through /engines.
    let (mut c, c_url) = spawn_engine(&model_dir);
    let r = client
        .post(format!("{url}/engines"))
        .json(&json!({"url": c_url}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(engines_status(&url).await.len(), 3);
    for i in 0..30 {
        generate(&format!("spread{i}")).await;
    }
    assert!(
        success_count(&c_url).await > 0.0,
        "the new engine got no work"
    );
    let r = client
        .delete(format!("{url}/engines"))
        .json(&json!({"url": a_url}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let before = success_count(&a_url).await;
    for i in 0..10 {
        generate(&format!("after{i}")).await;
    }
    assert_eq!(
        success_count(&a_url).await,
        before,
        "a removed engine got work"
    );
    let r = client
        .post(format!("{url}/engines"))
        .json(&json!({"url": "localhost:1"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    for child in [&mut a, &mut b2, &mut c] {
        child.kill().unwrap();
        child.wait().unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn libtorch_requests_wait_for_an_engine_when_none_is_up() {
    let generate = |url: String| async move {
        let body = json!({"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2}});
        reqwest::Client::new()
            .post(format!("{url}/inference/v1/generate"))
            .header("x-moult-session", "early")
            .json(&body)
            .send()
            .await
            .unwrap()
    };
    // Without patience, no engine means 503 at once (a control call's too).
    let (impatient, _r) = start_router(&[], "consistent-hash").await;
    let r = generate(impatient.clone()).await;
    assert_eq!(r.status(), 503);
    assert!(r.text().await.unwrap().contains("no healthy engine"));
    let r = reqwest::get(format!("{impatient}/get_world_size"))
        .await
        .unwrap();
    assert_eq!(r.status(), 503);

    // With patience, a request sent before any engine is up waits for the first to join.
    let (url, _router) = common::start_router_with(
        &[],
        "consistent-hash",
        common::quick_health(),
        Duration::from_secs(300),
    )
    .await;
    let waiting = tokio::spawn(generate(url.clone()));
    // A weight sync's control call waits the same way.
    let world = format!("{url}/get_world_size");
    let control = tokio::spawn(async move { reqwest::get(world).await.unwrap() });
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(!waiting.is_finished(), "the request did not wait");
    assert!(!control.is_finished(), "the control call did not wait");
    let (mut a, a_url) = spawn_engine(&dense_model());
    let r = reqwest::Client::new()
        .post(format!("{url}/engines"))
        .json(&json!({"url": a_url}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let r = tokio::time::timeout(Duration::from_secs(120), waiting)
        .await
        .expect("the waiting request went on once the engine was up")
        .unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(
        v["choices"][0]["token_ids"].as_array().unwrap().len(),
        2,
        "{v}"
    );
    assert_eq!(success_count(&a_url).await, 1.0);
    let r = tokio::time::timeout(Duration::from_secs(120), control)
        .await
        .unwrap()
        .unwrap();
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["world_size"], 1, "{v}");
    a.kill().unwrap();
    a.wait().unwrap();
}

/// Two clients give their requests the same id: the engine knows each by a random id of the
/// router's own (no clash), and an abort reaches only the request its caller started (the same
/// session); one naming the id under no session or another session aborts nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn libtorch_an_abort_reaches_only_the_callers_own_request() {
    let (mut a, a_url) = spawn_engine(&dense_model());
    let (url, _router) = start_router(std::slice::from_ref(&a_url), "least-tokens").await;
    let client = reqwest::Client::new();
    let generate = |session: &'static str| {
        let body = json!({"request_id": "same", "token_ids": [1, 2, 3],
            "sampling_params": {"max_tokens": 300, "ignore_eos": true}});
        let request = (client.post(format!("{url}/inference/v1/generate")))
            .header("x-moult-session", session)
            .json(&body);
        tokio::spawn(async move { request.send().await.unwrap().json::<Value>().await.unwrap() })
    };
    // The engine is paused (`keep`) while the aborts arrive, so neither request can finish
    // first however fast this machine generates: both wait in the engine's queue.
    let control = |path: &'static str| {
        let request = client.post(format!("{url}{path}"));
        async move { assert_eq!(request.send().await.unwrap().status(), 200, "{path}") }
    };
    control("/pause?mode=keep").await;
    let (mine, theirs) = (generate("mine"), generate("theirs"));
    for _ in 0..600 {
        if metric(&a_url, "vllm:num_requests_waiting", "").await == 2.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(metric(&a_url, "vllm:num_requests_waiting", "").await, 2.0);
    let abort = |session: Option<&'static str>| {
        let mut request = (client.post(format!("{url}/inference/v1/abort_requests")))
            .json(&json!({"request_ids": ["same"]}));
        if let Some(session) = session {
            request = request.header("x-moult-session", session);
        }
        async move { assert_eq!(request.send().await.unwrap().status(), 200) }
    };
    abort(None).await;
    abort(Some("someone")).await;
    abort(Some("mine")).await;
    control("/resume").await;
    let mine = tokio::time::timeout(Duration::from_secs(120), mine)
        .await
        .unwrap()
        .unwrap();
    let theirs = tokio::time::timeout(Duration::from_secs(120), theirs)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(mine["request_id"], "same", "answers carry the client's id");
    assert_eq!(mine["choices"][0]["finish_reason"], "abort", "{mine}");
    assert_eq!(theirs["choices"][0]["finish_reason"], "length", "{theirs}");
    assert_eq!(
        theirs["choices"][0]["token_ids"].as_array().unwrap().len(),
        300
    );
    a.kill().unwrap();
    a.wait().unwrap();
}
