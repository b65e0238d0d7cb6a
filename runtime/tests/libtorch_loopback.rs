//! The loopback server against the built-in engine with a tiny chat model, driven by the real
//! `openai` and `anthropic` Python SDKs (docs/loopback.md): token identity, observation tokens as
//! transformers renders them, segments sealing on compaction and Qwen3 think-stripping, retries
//! recorded once, protocol-shaped errors, and no engine request outliving its client.

mod common;

use std::path::Path;
use std::time::Duration;

use common::{chat_model, dense_model, engine_options, metric, start_engine, start_loopback};
use serde_json::{json, Value};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn libtorch_sdk_conversations_record_exact_segments() {
    let model = chat_model();
    let engine = start_engine(&model, engine_options()).await;
    common::sdk_conversations_record_exact_segments(&engine.url, &engine.url, &model).await;
}

async fn post_raw(url: &str, path: &str, body: Vec<u8>) -> (u16, Value) {
    let r = reqwest::Client::new()
        .post(format!("{url}{path}"))
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let text = r.text().await.unwrap();
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn libtorch_bad_requests_get_each_protocols_error_and_the_session_survives() {
    let model = chat_model();
    let engine = start_engine(&model, engine_options()).await;
    let (url, service) = start_loopback(&engine.url, &model, &model, 64 << 10).await;
    let openai = "/s/s1/v1/chat/completions";
    let anthropic = "/s/s1/v1/messages";
    let big = format!(
        r#"{{"model": "tiny", "max_tokens": 5, "messages": [{{"role": "user", "content": "{}"}}]}}"#,
        "x".repeat(100 << 10)
    );
    let mut bad_utf8 =
        br#"{"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": "a"#
            .to_vec();
    bad_utf8.extend([0xff, 0xfe]);
    bad_utf8.extend(br#""}]}"#);
    let cases: Vec<(&str, Vec<u8>, u16, &str)> = vec![
        (openai, b"{\"messages\": [".to_vec(), 400, "not valid JSON"),
        (openai, br#"{"messages": [{"role": "wizard", "content": "hi"}]}"#.to_vec(), 400, "messages[0].role"),
        (openai, br#"{"messages": [{"role": "user", "content": 5}]}"#.to_vec(), 400, "messages[0].content"),
        (openai, br#"{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}"#.to_vec(), 400, "image_url"),
        (openai, br#"{"messages": [{"role": "user", "content": "hi"}], "max_tokns": 3}"#.to_vec(), 400, "max_tokns"),
        (openai, big.clone().into_bytes(), 413, "larger than the limit"),
        (openai, bad_utf8.clone(), 400, "UTF-8"),
        (anthropic, b"[1, 2".to_vec(), 400, "not valid JSON"),
        (anthropic, b"[1, 2]".to_vec(), 400, "must be a JSON object"),
        (anthropic, br#"{"model": "tiny", "max_tokens": 5, "messages": [{"role": "system", "content": "hi"}]}"#.to_vec(), 400, "messages[0].role"),
        (anthropic, br#"{"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}"#.to_vec(), 400, "image"),
        (anthropic, br#"{"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": 7}]}"#.to_vec(), 400, "messages[0].content"),
        (anthropic, big.into_bytes(), 413, "larger than the limit"),
        (anthropic, bad_utf8, 400, "UTF-8"),
    ];
    for (path, body, status, needle) in cases {
        let (got, json) = post_raw(&url, path, body).await;
        assert_eq!(got, status, "{path}: {json}");
        let text = json.to_string();
        assert!(text.contains(needle), "{path}: `{needle}` not in {text}");
        if path == openai {
            assert!(json["error"]["message"].is_string(), "OpenAI shape: {json}");
            assert!(json["error"]["type"].is_string(), "OpenAI shape: {json}");
        } else {
            assert_eq!(json["type"], "error", "Anthropic shape: {json}");
            assert!(json["error"]["type"].is_string() && json["error"]["message"].is_string());
        }
    }
    // The session is untouched and still usable.
    let ok = json!({"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4, "temperature": 0});
    let (status, json) = post_raw(&url, openai, ok.to_string().into_bytes()).await;
    assert_eq!(status, 200, "{json}");
    assert_eq!(service.trajectory("s1").await.unwrap().0, 1);
}

/// The agent pool's sessions: registered by the pool, so a request under any other id (a
/// leftover agent process's, after its episode was taken) is a 404 and makes nothing; a session
/// takes at most `max_turns` turns and records at most `max_session_tokens`. Sessions made on first use (`moult chat`) expire when idle.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn libtorch_unknown_sessions_get_404_and_sessions_are_bounded() {
    use moult_runtime::loopback::ServiceOptions;
    let model = chat_model();
    let engine = start_engine(&model, engine_options()).await;
    let mut opts = ServiceOptions::pool(4, "tiny");
    opts.max_turns = 2;
    let (url, service) =
        common::start_loopback_with(&engine.url, &model, &model, 1 << 20, opts).await;
    let turn = json!({"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 2, "temperature": 0});
    let chat = |s: &str| format!("/s/{s}/v1/chat/completions");
    let (status, body) = post_raw(&url, &chat("made-up"), turn.to_string().into_bytes()).await;
    assert_eq!(status, 404, "{body}");
    assert!(body.to_string().contains("no session made-up"), "{body}");
    assert!(service.trajectory("made-up").await.is_none());

    service.open("ep1", None).unwrap();
    // Distinct turns (the same request again would be a retry, answered from the session).
    let nth = |i: usize| json!({"messages": [{"role": "user", "content": format!("Say hi {i}.")}], "max_tokens": 2, "temperature": 0});
    for i in 0..2 {
        let (status, body) = post_raw(&url, &chat("ep1"), nth(i).to_string().into_bytes()).await;
        assert_eq!(status, 200, "{body}");
    }
    let (status, body) = post_raw(&url, &chat("ep1"), nth(2).to_string().into_bytes()).await;
    assert_eq!(status, 429, "{body}");
    assert!(body.to_string().contains("its 2 turns"), "{body}");
    assert!(!service.take("ep1").await.unwrap().is_empty());
    // The episode is over: its agent's late requests make no session again.
    let (status, _) = post_raw(&url, &chat("ep1"), turn.to_string().into_bytes()).await;
    assert_eq!(status, 404);
    assert!(service.trajectory("ep1").await.is_none());

    // A session that has recorded its token allowance gets 429 on its next turn.
    let mut opts = ServiceOptions::pool(4, "tiny");
    opts.max_session_tokens = 8;
    let (url, service) =
        common::start_loopback_with(&engine.url, &model, &model, 1 << 20, opts).await;
    service.open("ep2", None).unwrap();
    let (status, body) = post_raw(&url, &chat("ep2"), nth(0).to_string().into_bytes()).await;
    assert_eq!(status, 200, "{body}");
    let (status, body) = post_raw(&url, &chat("ep2"), nth(1).to_string().into_bytes()).await;
    assert_eq!(status, 429, "{body}");
    assert!(
        body.to_string().contains("limit of 8 recorded tokens"),
        "{body}"
    );
    // An evaluation episode's session samples as its override says, whatever the agent asks:
    // one token at most here, though the request allows two.
    let sampling = moult_runtime::chat::SamplingOverride {
        temperature: Some(0.0),
        max_tokens: Some(1),
    };
    service.open("ep3", Some(sampling)).unwrap();
    let (status, body) = post_raw(&url, &chat("ep3"), nth(0).to_string().into_bytes()).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["usage"]["completion_tokens"], 1, "{body}");

    // Sessions made on first use: one unused for longer than `session_idle` goes when a new one
    // is made; one in use stays.
    let opts = ServiceOptions {
        max_sessions: 2,
        model_name: "tiny".into(),
        registered_sessions: false,
        session_idle: Some(Duration::from_secs(1)),
        max_turns: 8,
        max_session_tokens: 1 << 20,
    };
    let (url, service) =
        common::start_loopback_with(&engine.url, &model, &model, 1 << 20, opts).await;
    for s in ["old", "fresh"] {
        let (status, body) = post_raw(&url, &chat(s), turn.to_string().into_bytes()).await;
        assert_eq!(status, 200, "{body}");
        if s == "old" {
            tokio::time::sleep(Duration::from_millis(1500)).await;
        }
    }
    let (status, body) = post_raw(&url, &chat("new"), turn.to_string().into_bytes()).await;
    assert_eq!(status, 200, "{body}");
    assert!(
        service.trajectory("old").await.is_none(),
        "the idle session expired"
    );
    assert!(service.trajectory("fresh").await.is_some());
    assert!(service.trajectory("new").await.is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn libtorch_a_streaming_client_that_disconnects_aborts_its_engine_request() {
    // An engine with no EOS: the random tiny model would otherwise end some streams early
    // (its vocabulary is small), and the client must hang up mid-stream every time.
    let mut opts = engine_options();
    opts.max_model_len = 4096;
    opts.eos_token_ids.clear();
    let engine = start_engine(&dense_model(), opts).await;
    let (url, service) = start_loopback(&engine.url, &dense_model(), &chat_model(), 1 << 20).await;
    for (path, body) in [
        (
            "/s/gone/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "Tell a long story."}], "max_tokens": 4000, "stream": true}),
        ),
        (
            "/s/gone/v1/messages",
            json!({"model": "tiny", "messages": [{"role": "user", "content": "Tell a long story."}], "max_tokens": 4000, "stream": true}),
        ),
    ] {
        let aborted_before = metric(
            &engine.url,
            "vllm:request_success_total",
            "finished_reason=\"abort\"",
        )
        .await;
        let mut response = reqwest::Client::new()
            .post(format!("{url}{path}"))
            .json(&body)
            .send()
            .await
            .unwrap();
        // Read until the engine is surely generating, then hang up.
        let mut seen = 0;
        while seen < 20 {
            let chunk = response.chunk().await.unwrap().expect("the stream goes on");
            seen += String::from_utf8_lossy(&chunk).matches("data:").count();
        }
        drop(response);
        let mut waited = 0;
        while metric(&engine.url, "vllm:num_requests_running", "").await > 0.0 {
            tokio::time::sleep(Duration::from_millis(50)).await;
            waited += 1;
            assert!(waited < 1200, "the engine request outlived its client");
        }
        let aborted = metric(
            &engine.url,
            "vllm:request_success_total",
            "finished_reason=\"abort\"",
        )
        .await;
        assert_eq!(
            aborted,
            aborted_before + 1.0,
            "{path}: the request was not aborted"
        );
        assert_eq!(
            metric(
                &engine.url,
                "vllm:request_success_total",
                "finished_reason=\"length\""
            )
            .await,
            0.0
        );
    }
    // Nothing was recorded for the abandoned turns.
    assert_eq!(service.trajectory("gone").await.unwrap().0, 0);
}

/// The text and finish reason of each choice of an OpenAI SSE stream.
fn stream_choices(body: &str) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = Vec::new();
    for data in common::sse_data(body) {
        if data == "[DONE]" {
            continue;
        }
        let chunk: Value = serde_json::from_str(&data).unwrap();
        for c in chunk["choices"].as_array().unwrap() {
            let i = c["index"].as_u64().unwrap() as usize;
            if out.len() <= i {
                out.resize(i + 1, Default::default());
            }
            out[i].0 += c["delta"]["content"].as_str().unwrap_or("");
            if let Some(f) = c["finish_reason"].as_str() {
                out[i].1 = f.to_string();
            }
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn libtorch_n_samples_and_stop_strings() {
    let model = chat_model();
    let engine = start_engine(&model, engine_options()).await;
    let (url, service) = start_loopback(&engine.url, &model, &model, 1 << 20).await;
    let client = reqwest::Client::new();
    let hi = json!([{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi."}]);
    let said = "<think>\nA greeting is asked.\n</think>\n\nHi!";

    // n = 3: three candidates; the next turn continues the one the agent kept, the others seal.
    let scripts: Value = serde_json::from_str(
        &std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/python/chat_scripts.json"),
        )
        .unwrap(),
    )
    .unwrap();
    let tools = &scripts["tools"];
    let ask = json!({"role": "user", "content": "What is the weather in Paris?"});
    let r: Value = client
        .post(format!("{url}/s/n/v1/chat/completions"))
        .json(
            &json!({"messages": [ask], "tools": tools, "n": 3, "temperature": 0, "max_tokens": 80}),
        )
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let choices = r["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3, "{r}");
    assert!(
        choices.iter().all(|c| c["finish_reason"] == "tool_calls"),
        "{r}"
    );
    assert_eq!(service.trajectory("n").await.unwrap().1.len(), 3);
    let kept = &choices[1]["message"];
    let call_id = kept["tool_calls"][0]["id"].clone();
    let next =
        json!([ask, kept, {"role": "tool", "tool_call_id": call_id, "content": "sunny, 21 C"}]);
    let r: Value = common::post_json(
        &format!("{url}/s/n/v1/chat/completions"),
        &json!({"messages": next, "tools": tools, "temperature": 0, "max_tokens": 80}),
    )
    .await;
    assert_eq!(
        r["choices"][0]["message"]["content"], "It is sunny in Paris, 21 C.",
        "{r}"
    );
    let (turns, segments) = service.trajectory("n").await.unwrap();
    assert_eq!(turns, 2);
    let mut per_segment: Vec<usize> = segments.iter().map(|s| s.turns).collect();
    per_segment.sort();
    assert_eq!(per_segment, vec![1, 1, 2]);

    // n = 2 streamed: both choices interleave in one stream.
    let body = client
        .post(format!("{url}/s/n2/v1/chat/completions"))
        .json(&json!({"messages": hi, "n": 2, "temperature": 0, "max_tokens": 40, "stream": true}))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let streamed = stream_choices(&body);
    assert_eq!(
        streamed,
        vec![(said.to_string(), "stop".to_string()); 2],
        "{body}"
    );

    // A stop string ends the content before it, streamed or not.
    for stream in [false, true] {
        let req = json!({"messages": hi, "temperature": 0, "max_tokens": 40, "stop": ["greeting"], "stream": stream});
        let response = client
            .post(format!("{url}/s/stop-{stream}/v1/chat/completions"))
            .json(&req)
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let (content, finish) = if stream {
            stream_choices(&response).remove(0)
        } else {
            let r: Value = serde_json::from_str(&response).unwrap();
            (
                r["choices"][0]["message"]["content"]
                    .as_str()
                    .unwrap()
                    .to_string(),
                r["choices"][0]["finish_reason"]
                    .as_str()
                    .unwrap()
                    .to_string(),
            )
        };
        assert_eq!(
            (content.as_str(), finish.as_str()),
            ("<think>\nA ", "stop"),
            "{response}"
        );
    }
    // Anthropic names the stop sequence.
    let r: Value = client
        .post(format!("{url}/s/stop-a/v1/messages"))
        .json(&json!({"model": "tiny", "system": "You are terse.", "max_tokens": 40, "temperature": 0,
                      "stop_sequences": ["greeting"], "messages": [{"role": "user", "content": "Say hi."}]}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(r["stop_reason"], "stop_sequence", "{r}");
    assert_eq!(r["stop_sequence"], "greeting", "{r}");
    assert_eq!(r["content"][0]["text"], "<think>\nA ", "{r}");
}
