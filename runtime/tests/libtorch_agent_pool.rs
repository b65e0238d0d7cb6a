//! The agent pool with both agent forms written in Python (the embedded `moult` package), against
//! the built-in engine through the loopback server: ChatAgents with tool calls on the openai SDK,
//! a Python Env, a built-in Rust env, env processes reused across completed episodes only, and
//! agents that crash, fail and hang, which the pool reports while it keeps running, with no
//! engine request left behind.

mod common;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use common::{
    chat_model, dense_model, engine_options, metric, python, start_engine, start_loopback,
};
use moult_runtime::agents::env::EnvLoopOptions;
use moult_runtime::agents::process::{describe_python, AgentCommand};
use moult_runtime::agents::{Agent, AgentPool, Episode, EpisodeStatus, PoolOptions};
use moult_runtime::chat::ChatSampling;
use moult_runtime::loopback;
use serde_json::{json, Value};

/// A file under the repository root.
fn agent_file(path: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(path)
        .display()
        .to_string()
}

fn options(url: &str, timeout: Duration, scratch: &str) -> PoolOptions {
    PoolOptions {
        concurrency: 2,
        timeout,
        loopback_url: url.to_string(),
        env_loop: EnvLoopOptions {
            max_turns: 4,
            sampling: ChatSampling {
                max_tokens: Some(60),
                temperature: Some(0.0),
                ..ChatSampling::default()
            },
            system_prompt: Some("You are terse.".into()),
            ..EnvLoopOptions::default()
        },
        scratch_dir: std::env::temp_dir().join(format!("{scratch}-{}", std::process::id())),
        // The pool's own tests: jails are tested through `moult agents` (tests/libtorch_cli.rs).
        jail: None,
        sandboxes: None,
    }
}

async fn python_agent(file: &str) -> Agent {
    let py = python().display().to_string();
    let path = agent_file(file);
    let cmd = AgentCommand::python(&py, &path).unwrap();
    match describe_python(&py, &path, None).await.unwrap().as_str() {
        "chat" => Agent::Chat(cmd),
        "env" => Agent::ExternalEnv(cmd),
        other => panic!("unknown form {other}"),
    }
}

async fn run_all(pool: AgentPool, tasks: Vec<Value>) -> Vec<Episode> {
    let mut rx = Arc::new(pool).run(tasks);
    let mut out = Vec::new();
    while let Some(ep) = rx.recv().await {
        out.push(ep);
    }
    out.sort_by_key(|e| e.index);
    out
}

fn expected_think() -> Vec<Vec<i64>> {
    let all: Value =
        serde_json::from_str(&std::fs::read_to_string(chat_model().join("expected.json")).unwrap())
            .unwrap();
    all["think"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| serde_json::from_value(s["token_ids"].clone()).unwrap())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn libtorch_both_agent_forms_run_in_the_pool() {
    let model = chat_model();
    let engine = start_engine(&model, engine_options()).await;
    let (url, service) = start_loopback(
        &engine.url,
        &model,
        &model,
        loopback::DEFAULT_MAX_BODY_BYTES,
    )
    .await;

    // ChatAgents: the user's own programs on the openai and anthropic SDKs, with tool calls,
    // one process per episode (the examples of examples/agents/).
    for example in ["openai_weather.py", "anthropic_weather.py"] {
        let agent = python_agent(&format!("examples/agents/{example}")).await;
        assert!(matches!(agent, Agent::Chat(_)));
        let pool = AgentPool::new(
            service.clone(),
            agent,
            options(&url, Duration::from_secs(120), "chat"),
        )
        .unwrap();
        let task = json!({"question": "What is the weather in Paris?"});
        let episodes = run_all(pool, vec![task.clone(), task]).await;
        for ep in &episodes {
            assert_eq!(
                ep.status,
                EpisodeStatus::Completed,
                "{example}: {:?}",
                ep.reason
            );
            assert_eq!(ep.reward, 1.0, "{example}");
            assert_eq!(
                ep.info["answer"], "It is sunny in Paris, 21 C.",
                "{example}"
            );
            // The tool round trip extends the segment: one segment, two sampled turns.
            assert_eq!(ep.segments.len(), 1, "{example}");
            assert_eq!(ep.segments[0].turns, 2, "{example}");
        }
    }

    // Env in Python (JSON lines): the framework owns the loop; Qwen3 drops the first reply's
    // <think> block from history, so the episode has two segments, exactly as transformers renders.
    let agent = python_agent("examples/agents/say_hi_env.py").await;
    assert!(matches!(agent, Agent::ExternalEnv(_)));
    let pool = AgentPool::new(
        service.clone(),
        agent,
        options(&url, Duration::from_secs(120), "env"),
    )
    .unwrap();
    let episodes = run_all(pool, vec![json!({"prompt": "Say hi."})]).await;
    let ep = &episodes[0];
    assert_eq!(ep.status, EpisodeStatus::Completed, "{:?}", ep.reason);
    assert_eq!(ep.reward, 2.0);
    assert_eq!(ep.info["turn"], 2);
    let got: Vec<Vec<i64>> = ep.segments.iter().map(|s| s.token_ids.clone()).collect();
    assert_eq!(got, expected_think());

    // A built-in Rust env.
    let pool = AgentPool::new(
        service.clone(),
        Agent::BuiltinEnv("repeat".into()),
        options(&url, Duration::from_secs(120), "builtin"),
    )
    .unwrap();
    let episodes = run_all(pool, vec![json!({"word": "Hi", "tries": 2})]).await;
    assert_eq!(
        episodes[0].status,
        EpisodeStatus::Completed,
        "{:?}",
        episodes[0].reason
    );
    assert!(!episodes[0].segments.is_empty());
    let err = AgentPool::new(
        service,
        Agent::BuiltinEnv("nope".into()),
        options(&url, Duration::from_secs(1), "x"),
    )
    .unwrap_err();
    assert!(err.to_string().contains("available: repeat"), "{err}");
}

/// Whether a process is gone (or a zombie left to be reaped).
fn dead(pid: u64) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).map_or(true, |stat| {
        stat.rsplit(") ").next().unwrap_or("").starts_with('Z')
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn libtorch_env_processes_are_reused_after_completed_episodes_only() {
    let model = chat_model();
    let engine = start_engine(&model, engine_options()).await;
    let (url, service) = start_loopback(
        &engine.url,
        &model,
        &model,
        loopback::DEFAULT_MAX_BODY_BYTES,
    )
    .await;
    let agent = python_agent("tests/python/agents/pid_env.py").await;
    let mut opts = options(&url, Duration::from_secs(120), "reuse");
    // One at a time: the episodes run in task order, each after the previous one finished.
    opts.concurrency = 1;
    let pool = AgentPool::new(service, agent, opts).unwrap();
    let modes = ["ok", "ok", "ok", "fail", "ok", "exit", "ok", "ok"];
    let episodes = run_all(pool, modes.map(|m| json!({"mode": m})).to_vec()).await;
    let pids: Vec<Option<u64>> = episodes
        .iter()
        .map(|e| e.info.get("pid").and_then(Value::as_u64))
        .collect();
    let status: Vec<_> = episodes.iter().map(|e| (e.status, &e.reason)).collect();
    for (i, ep) in episodes.iter().enumerate() {
        let want = if i == 3 {
            EpisodeStatus::Failed
        } else {
            EpisodeStatus::Completed
        };
        assert_eq!(ep.status, want, "episode {i}: {status:?}");
    }
    let pid = |i: usize| pids[i].unwrap_or_else(|| panic!("episode {i} has no pid: {pids:?}"));
    // Completed episodes hand their process to the next one ...
    assert_eq!((pid(1), pid(2)), (pid(0), pid(0)), "{pids:?}");
    // ... which raised (episode 3): that process is killed and the next episode gets a new one.
    assert_ne!(pid(4), pid(0), "{pids:?}");
    assert_eq!(pid(5), pid(4), "{pids:?}");
    // A process that exited after its episode (5) is replaced when its next reset finds it gone.
    assert_ne!(pid(6), pid(5), "{pids:?}");
    assert_eq!(pid(7), pid(6), "{pids:?}");
    assert!(
        episodes[3]
            .reason
            .as_deref()
            .unwrap_or("")
            .contains("the env gave up"),
        "{status:?}"
    );
    let mut waited = 0;
    while !dead(pid(0)) {
        tokio::time::sleep(Duration::from_millis(50)).await;
        waited += 1;
        assert!(
            waited < 100,
            "the failed episode's env process {} still runs",
            pid(0)
        );
    }
}

async fn running(engine_url: &str) -> f64 {
    metric(engine_url, "vllm:num_requests_running", "").await
        + metric(engine_url, "vllm:num_requests_waiting", "").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn libtorch_crashed_failed_and_hung_agents_fail_alone() {
    // The random model rarely says EOS, so the misbehaving agents' streams are still running
    // when they crash or hang.
    let mut opts = engine_options();
    opts.max_model_len = 4096;
    let engine = start_engine(&dense_model(), opts).await;
    let (url, service) = start_loopback(
        &engine.url,
        &dense_model(),
        &chat_model(),
        loopback::DEFAULT_MAX_BODY_BYTES,
    )
    .await;
    let agent = python_agent("tests/python/agents/misbehaving_agent.py").await;
    let pool = AgentPool::new(
        service.clone(),
        agent,
        options(&url, Duration::from_secs(8), "bad"),
    )
    .unwrap();
    let tasks = ["crash", "hang", "fail", "ok", "ok"]
        .map(|m| json!({"mode": m}))
        .to_vec();
    let episodes = run_all(pool, tasks).await;
    let reasons: Vec<_> = episodes
        .iter()
        .map(|e| (e.status, e.reason.clone().unwrap_or_default()))
        .collect();
    assert_eq!(episodes[0].status, EpisodeStatus::Failed);
    assert!(reasons[0].1.contains("signal"), "{reasons:?}");
    assert_eq!(episodes[1].status, EpisodeStatus::Failed);
    assert!(reasons[1].1.contains("timed out after 8s"), "{reasons:?}");
    assert_eq!(episodes[2].status, EpisodeStatus::Failed);
    assert!(reasons[2].1.contains("the agent gave up"), "{reasons:?}");
    for ep in &episodes[3..] {
        assert_eq!(ep.status, EpisodeStatus::Completed, "{reasons:?}");
        assert_eq!(ep.reward, 1.0);
        assert_eq!(ep.segments.len(), 1);
    }
    // The crashed agent's unfinished turn recorded nothing. The engine runs ahead of the agent's
    // reads, so the random model may have said EOS before the kill landed: a turn that finished
    // is recorded, and then its last sampled token is an EOS. (The hung one's stream may have
    // finished into its socket buffers before the timeout: a failed episode reports it anyway.)
    let eos = [2000, 2002];
    for seg in &episodes[0].segments {
        let last = *seg.token_ids.last().unwrap();
        assert!(
            eos.contains(&last) && seg.loss_mask.last() == Some(&1),
            "the crashed agent's unfinished turn was recorded ({} tokens, last {last})",
            seg.token_ids.len()
        );
    }
    assert!(episodes[2].segments.is_empty());
    // No engine request outlives its agent.
    let mut waited = 0;
    while running(&engine.url).await > 0.0 {
        tokio::time::sleep(Duration::from_millis(50)).await;
        waited += 1;
        assert!(waited < 1200, "engine requests leaked");
    }
}
