//! Loopback-server benchmarks, printed as tables of ratios measured in one invocation (this
//! machine is noisy; compare within a run, never against a fixed number):
//!
//! 1. server work per turn (render the chat template, tokenize the new text, check the prefix,
//!    record the turn) at turn 2 vs turn 64 of a growing conversation, with Qwen3's real
//!    tokenizer and chat template;
//! 2. requests per second through the loopback server with a near-instant engine (a stub that
//!    answers one token at once), vs. that engine alone.
//!
//! `cargo bench -p moult-runtime --bench loopback` (after `source scripts/env.sh`; part 1 builds
//! Qwen3's tokenizer.json with transformers once). Documented in docs/benchmarks.md.

use std::path::{Path, PathBuf};

mod common;
use common::{hammer, root, run_python, stub_engine};
use std::sync::Arc;
use std::time::Instant;

use moult_runtime::chat::{ChatTemplate, Message, RenderOptions, Role, Tokenizer};
use moult_runtime::loopback::session::{Sampled, Session};
use moult_runtime::loopback::{self, ChatService, EngineClient, ServiceOptions};
use serde_json::{json, Value};

/// A folder with Qwen3's tokenizer.json (built by transformers from the fixtures) and its chat
/// template.
fn qwen3_dir() -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("bench-qwen3-tokenizer");
    if !dir.join("tokenizer.json").exists() {
        std::fs::create_dir_all(&dir).unwrap();
        let texts = dir.join("texts.json");
        std::fs::write(&texts, "[]").unwrap();
        run_python(&[
            root()
                .join("tests/python/encode_with_qwen3_tokenizer.py")
                .to_str()
                .unwrap(),
            dir.to_str().unwrap(),
            texts.to_str().unwrap(),
            dir.join("ids.json").to_str().unwrap(),
        ]);
    }
    dir
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// Server work of one turn as the service does it, minus the engine: render; then plan
/// (tokenize the new text, check the prefix), decode the sample, commit. The two durations, µs.
fn turn_work(
    session: &mut Session,
    template: &ChatTemplate,
    tokenizer: &Tokenizer,
    messages: Arc<Vec<Message>>,
    reply_ids: &[i64],
) -> (f64, f64) {
    let start = Instant::now();
    let json = Value::Array(messages.iter().map(Message::to_template).collect());
    let rendered = template
        .render(
            &json,
            &RenderOptions {
                add_generation_prompt: true,
                ..Default::default()
            },
        )
        .unwrap();
    let render = start.elapsed().as_secs_f64() * 1e6;
    let start = Instant::now();
    let plan = session
        .plan(&messages, rendered, |t, _| {
            tokenizer.encode(t).map(|ids| (ids, Vec::new()))
        })
        .unwrap();
    assert!(plan.continues.is_some() || messages.len() == 1);
    let sample = Sampled {
        token_ids: reply_ids.to_vec(),
        logprobs: vec![-0.5; reply_ids.len()],
        versions: vec![0; reply_ids.len()],
        routed_experts: None,
    };
    let text = tokenizer.decode(reply_ids, false).unwrap();
    session.commit(plan, messages, &[sample], vec![text]);
    (render, start.elapsed().as_secs_f64() * 1e6)
}

fn per_turn_overhead() {
    let dir = qwen3_dir();
    let tokenizer = Tokenizer::from_model_dir(&dir).unwrap();
    let template = ChatTemplate::from_model_dir(&dir).unwrap();
    let user = "Here is the next observation of the environment: the door is locked, the key is under the mat, and a note on the wall says the password is the name of the first city you visited. What do you do?";
    let reply = "I lift the mat, take the key and unlock the door. Then I read the note again and type the password.";
    let mut reply_ids = tokenizer.encode(reply).unwrap();
    reply_ids.extend(tokenizer.encode("<|im_end|>").unwrap());
    const TURNS: usize = 64;
    const REPEATS: usize = 15;
    let mut renders = vec![Vec::new(); TURNS + 1];
    let mut accounting = vec![Vec::new(); TURNS + 1];
    let mut context = vec![0; TURNS + 1];
    for _ in 0..REPEATS {
        let mut session = Session::default();
        let mut messages = vec![Message::text(Role::User, user)];
        for turn in 1..=TURNS {
            let shared = Arc::new(messages.clone());
            let (r, a) = turn_work(&mut session, &template, &tokenizer, shared, &reply_ids);
            renders[turn].push(r);
            accounting[turn].push(a);
            context[turn] = session.segments()[0].token_ids.len();
            messages.push(Message::text(Role::Assistant, reply));
            messages.push(Message::text(Role::User, user));
        }
    }
    println!("## Server work per turn of a growing conversation (median of {REPEATS} runs)\n");
    println!("Accounting = tokenize the new text + prefix check + record the turn; render = the chat template over the whole conversation.\n");
    println!("| turn | context tokens | accounting µs | vs turn 2 | render µs | vs turn 2 |");
    println!("| --- | --- | --- | --- | --- | --- |");
    let (a2, r2) = (median(accounting[2].clone()), median(renders[2].clone()));
    for turn in [2, 4, 8, 16, 32, 64] {
        let (a, r) = (
            median(accounting[turn].clone()),
            median(renders[turn].clone()),
        );
        println!(
            "| {turn} | {} | {a:.0} | {:.2}x | {r:.0} | {:.2}x |",
            context[turn],
            a / a2,
            r / r2
        );
    }
    // For scale: tokenizing the whole conversation each turn, as a retokenizing server would.
    let mut messages = vec![Message::text(Role::User, user)];
    for _ in 1..TURNS {
        messages.push(Message::text(Role::Assistant, reply));
        messages.push(Message::text(Role::User, user));
    }
    let json = Value::Array(messages.iter().map(Message::to_template).collect());
    let full = template
        .render(
            &json,
            &RenderOptions {
                add_generation_prompt: true,
                ..Default::default()
            },
        )
        .unwrap();
    let full_tokenize = median(
        (0..REPEATS)
            .map(|_| {
                let start = Instant::now();
                tokenizer.encode(&full).unwrap();
                start.elapsed().as_secs_f64() * 1e6
            })
            .collect(),
    );
    println!(
        "\nFor scale: tokenizing the whole turn-64 conversation, as a retokenizing server would each turn, takes {full_tokenize:.0} µs.\n"
    );
}

async fn requests_per_second() {
    let dir = qwen3_dir();
    let engine = stub_engine().await;
    const REQUESTS: usize = 3000;
    let service = Arc::new(ChatService::new(
        EngineClient::new(&engine),
        Tokenizer::from_model_dir(&dir).unwrap(),
        ChatTemplate::from_model_dir(&dir).unwrap(),
        ServiceOptions {
            registered_sessions: false,
            ..ServiceOptions::pool(REQUESTS + 1, "bench")
        },
    ));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let lb = format!("http://{}", listener.local_addr().unwrap());
    let app = loopback::router(service, loopback::DEFAULT_MAX_BODY_BYTES);
    tokio::spawn(moult_runtime::serve::serve(
        listener,
        app,
        std::future::pending(),
    ));
    let prompt = Tokenizer::from_model_dir(&dir)
        .unwrap()
        .encode(
            "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
        )
        .unwrap();
    println!("## Requests per second, near-instant engine (one token per request), 8 clients\n");
    println!("| path | requests | seconds | requests/s | vs engine alone |");
    println!("| --- | --- | --- | --- | --- |");
    let direct: Vec<(String, Value)> = (0..REQUESTS)
        .map(|i| {
            let body = json!({"request_id": format!("r{i}"), "token_ids": prompt, "sampling_params": {"max_tokens": 1}, "stream": true});
            ("/inference/v1/generate".to_string(), body)
        })
        .collect();
    let chat: Vec<(String, Value)> = (0..REQUESTS)
        .map(|i| {
            let body = json!({"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 1});
            (format!("/s/b{i}/v1/chat/completions"), body)
        })
        .collect();
    // Warm both paths (connections, allocator) before measuring.
    hammer(engine.clone(), direct[..200].to_vec(), 8).await;
    let d = hammer(engine.clone(), direct, 8).await.0.as_secs_f64();
    let c = hammer(lb.clone(), chat, 8).await.0.as_secs_f64();
    let (rd, rc) = (REQUESTS as f64 / d, REQUESTS as f64 / c);
    println!("| engine alone (generate, streamed) | {REQUESTS} | {d:.2} | {rd:.0} | 1.00x |");
    println!(
        "| loopback → engine (chat completions) | {REQUESTS} | {c:.2} | {rc:.0} | {:.2}x |",
        rc / rd
    );
    println!();
}

fn main() {
    println!(
        "cores: {}\n",
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    per_turn_overhead();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(requests_per_second());
}
