//! The `moult engine` binary as a user starts it (libtorch): it serves, and refuses bad
//! command lines and unsupported checkpoints with messages that name the problem.

mod common;

use std::process::Stdio;

use common::{moult, spawn_engine, spawn_moult};

#[tokio::test]
async fn libtorch_cli_engine_serves_generate() {
    let (mut child, url) = spawn_engine(&common::dense_model());
    let client = reqwest::Client::new();
    assert_eq!(
        client
            .get(format!("{url}/health"))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    let body = serde_json::json!({"token_ids": [2001, 273, 105], "sampling_params": {"max_tokens": 5, "seed": 1, "ignore_eos": true}});
    let v: serde_json::Value =
        common::post_json(&format!("{url}/inference/v1/generate"), &body).await;
    assert_eq!(
        v["choices"][0]["token_ids"].as_array().unwrap().len(),
        5,
        "{v}"
    );
    let models: serde_json::Value = common::get_json(&format!("{url}/v1/models")).await;
    assert_eq!(models["data"][0]["id"], "qwen3-tiny");
    child.kill().unwrap();
    child.wait().unwrap();
}

fn failing(args: &[&str]) -> String {
    let out = moult().args(args).output().unwrap();
    assert!(!out.status.success(), "{args:?} should fail");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn libtorch_cli_refuses_bad_arguments_and_unsupported_models() {
    let model = common::dense_model();
    let model = model.to_str().unwrap();
    let err = failing(&["engine", "--model", model, "--dtype", "int4"]);
    assert!(
        err.contains("--dtype must be auto, float32, bfloat16 or float16"),
        "{err}"
    );
    let err = failing(&["engine", "--model", model, "--device", "tpu"]);
    assert!(
        err.contains("--device must be cpu, cuda or cuda:N"),
        "{err}"
    );
    let err = failing(&["engine", "--model", model, "--max-batch", "0"]);
    assert!(err.contains("--max-batch"), "{err}");
    let err = failing(&["engine", "--model", "/nonexistent/model"]);
    assert!(err.contains("/nonexistent/model/config.json"), "{err}");

    // Checkpoints of what is not implemented are refused naming the field: Gemma 3's vision
    // tower (its 4B and larger checkpoints) and gpt-oss (attention sinks).
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("unsupported-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let base: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(common::dense_model().join("config.json")).unwrap(),
    )
    .unwrap();
    for (changes, named) in [
        (
            serde_json::json!({"architectures": ["Gemma3ForConditionalGeneration"],
                "vision_config": {"model_type": "siglip_vision_model"}}),
            "`vision_config`: Gemma3ForConditionalGeneration has a vision tower",
        ),
        (
            serde_json::json!({"architectures": ["GptOssForCausalLM"]}),
            "architecture `GptOssForCausalLM` is not supported",
        ),
    ] {
        let mut config = base.clone();
        for (key, value) in changes.as_object().unwrap() {
            config[key] = value.clone();
        }
        std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
        let err = failing(&["engine", "--model", dir.to_str().unwrap()]);
        assert!(err.contains(named), "{err}");
    }

    // `moult run` says it cannot publish to vLLM engines over NCCL (vLLM's default transport)
    // before it spends a minute starting them, naming the field to change.
    let recipe = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/successor");
    let text = std::fs::read_to_string(recipe.join("rlrun.yaml")).unwrap();
    assert!(text.contains("backend: Builtin") && text.contains("gpusPerNode: 0"));
    let manifest = recipe.join(format!(".vllm-{}.yaml", std::process::id()));
    // A GPU trainer: NCCL could work on a cluster, not from `moult run`.
    let vllm = text.replace("backend: Builtin", "backend: vLLM");
    std::fs::write(&manifest, vllm.replace("gpusPerNode: 0", "gpusPerNode: 1")).unwrap();
    let err = failing(&["run", manifest.to_str().unwrap()]);
    assert!(
        err.contains("spec.engines.weightTransfer.transport"),
        "{err}"
    );
    assert!(err.contains("transport: Filesystem"), "{err}");
    assert!(err.contains("docs/vllm.md"), "{err}");
    // A CPU trainer: NCCL cannot work anywhere, and the CRD's own rule says so (the API server
    // refuses the same manifest).
    std::fs::write(&manifest, vllm).unwrap();
    let err = failing(&["run", manifest.to_str().unwrap()]);
    std::fs::remove_file(&manifest).unwrap();
    assert!(
        err.contains("engines.weightTransfer.transport Nccl (vLLM's default) sends weights from the trainer's GPU"),
        "{err}"
    );
}

/// `moult chat` and `moult agents` against a `moult engine`, as the docs show them.
#[tokio::test]
async fn libtorch_cli_chat_and_agents_against_an_engine() {
    let model = common::chat_model();
    let (mut engine, engine_url) = spawn_engine(&model);

    let (mut chat, url) = spawn_moult(
        &[
            "chat".as_ref(),
            "--engine".as_ref(),
            engine_url.as_ref(),
            "--model".as_ref(),
            model.as_os_str(),
            "--port".as_ref(),
            "0".as_ref(),
        ],
        "moult chat listening on",
    );
    assert!(url.starts_with("http://127.0.0.1:"), "{url}");
    let models: serde_json::Value = common::get_json(&format!("{url}/s/a/v1/models")).await;
    assert_eq!(models["data"][0]["id"], "qwen3-tiny-chat");
    let body = serde_json::json!({"messages": [{"role": "user", "content": "Summary: Paris is sunny. Thank you!"}], "temperature": 0});
    let r: serde_json::Value =
        common::post_json(&format!("{url}/s/a/v1/chat/completions"), &body).await;
    assert_eq!(r["choices"][0]["message"]["content"], "You are welcome.");
    let t: serde_json::Value = common::get_json(&format!("{url}/s/a/trajectory")).await;
    let segment = &t["segments"][0];
    let sampled = segment["loss_mask"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| *m == 1)
        .count();
    assert_eq!(
        sampled,
        r["usage"]["completion_tokens"].as_u64().unwrap() as usize
    );
    assert_eq!(
        segment["versions"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|v| v.is_number())
            .count(),
        sampled
    );
    chat.kill().unwrap();
    chat.wait().unwrap();

    let dir = std::env::temp_dir().join(format!("moult-cli-agents-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let out = dir.join("episodes.jsonl");
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let status = moult()
        .args(["agents", "--engine", &engine_url, "--model"])
        .arg(&model)
        .arg("--agent")
        .arg(root.join("examples/agents/say_hi_env.py"))
        .arg("--tasks")
        .arg(root.join("examples/agents/say_hi_tasks.jsonl"))
        .args([
            "--system-prompt",
            "You are terse.",
            "--temperature",
            "0",
            "--python",
        ])
        .arg(common::python())
        .arg("--out")
        .arg(&out)
        .stderr(Stdio::null())
        .status()
        .unwrap();
    assert!(status.success());
    let text = std::fs::read_to_string(&out).unwrap();
    let episode: serde_json::Value = serde_json::from_str(text.lines().next().unwrap()).unwrap();
    assert_eq!(episode["status"], "completed", "{episode}");
    assert_eq!(episode["reward"], 2.0);
    assert_eq!(episode["segments"].as_array().unwrap().len(), 2);

    hostile_agent(&engine_url, &model, &dir, None, "process").await;
    hostile_agent(&engine_url, &model, &dir, None, "episode").await;
    // The same through a sandbox, as a cluster's agent pod runs agent code: in a second process
    // that holds no credential, started by `moult sandbox`.
    let socket = dir.join("sandbox.sock");
    let mut sandbox = moult()
        .args(["sandbox", "--socket"])
        .arg(&socket)
        .env_remove("MOULT_TOKEN")
        .env_remove("MOULT_AGENT_TOKEN")
        .env("MOULT_INIT", "1")
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    while !socket.exists() {
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    for isolation in ["process", "episode"] {
        hostile_agent(
            &engine_url,
            &model,
            &dir,
            Some((&socket, sandbox.id())),
            isolation,
        )
        .await;
    }
    // A sandbox that cannot make jails (as a container whose seccomp profile refuses new
    // namespaces): `moult agents` refuses at its start, with the sandbox's reason, rather than
    // failing every episode.
    let refusing = dir.join("refusing-maker");
    std::fs::write(
        &refusing,
        "#!/bin/sh\necho \"moult jail: cannot create the episode's namespaces (EPERM: Operation not permitted)\" >&2\nexit 125\n",
    )
    .unwrap();
    std::fs::set_permissions(
        &refusing,
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let refusing_socket = dir.join("refusing.sock");
    let mut refusing_sandbox = moult()
        .args(["sandbox", "--socket"])
        .arg(&refusing_socket)
        .env(moult_jail::MAKER_ENV, &refusing)
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    while !refusing_socket.exists() {
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    let refused = moult()
        .env("MOULT_AGENT_SANDBOX", &refusing_socket)
        .args(["agents", "--engine", &engine_url, "--model"])
        .arg(&model)
        // A command (a Python module would fail first, where its form is asked in a jail).
        .args(["--agent-cmd", "true", "--form", "env", "--tasks"])
        .arg(root.join("examples/agents/say_hi_tasks.jsonl"))
        .args(["--isolation", "episode"])
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success(), "{said}");
    assert!(
        said.contains("agent.isolation is `Episode`, but cannot create the episode's namespaces"),
        "{said}"
    );
    refusing_sandbox.kill().unwrap();
    refusing_sandbox.wait().unwrap();
    // SIGTERM goes on to the supervised sandbox, and both end.
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(sandbox.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    assert!(!sandbox.wait().unwrap().success());

    let bad = moult()
        .args(["agents", "--engine", &engine_url, "--model"])
        .arg(&model)
        .args(["--agent", "builtin:nope", "--tasks"])
        .arg(root.join("examples/agents/say_hi_tasks.jsonl"))
        .output()
        .unwrap();
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("available: repeat"));
    engine.kill().unwrap();
    engine.wait().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}

/// `moult router` in front of two `moult engine`s, as docs/router.md shows it.
#[tokio::test]
async fn libtorch_cli_router_routes_to_its_engines() {
    let model = common::dense_model();
    let (mut a, a_url) = spawn_engine(&model);
    let (mut b, b_url) = spawn_engine(&model);
    let (mut router, url) = spawn_moult(
        &[
            "router".as_ref(),
            "--engine".as_ref(),
            a_url.as_ref(),
            "--engine".as_ref(),
            b_url.as_ref(),
            "--port".as_ref(),
            "0".as_ref(),
        ],
        "moult router listening on",
    );
    let client = reqwest::Client::new();
    let body = serde_json::json!({"token_ids": [2001, 273, 105], "sampling_params": {"max_tokens": 4, "ignore_eos": true}});
    let v: serde_json::Value = client
        .post(format!("{url}/inference/v1/generate"))
        .header("x-moult-session", "s")
        .json(&body)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(
        v["choices"][0]["token_ids"].as_array().unwrap().len(),
        4,
        "{v}"
    );
    let engines: serde_json::Value = common::get_json(&format!("{url}/engines")).await;
    assert_eq!(engines["engines"].as_array().unwrap().len(), 2);
    let bad = moult()
        .args(["router", "--engine", "localhost:1", "--port", "0"])
        .output()
        .unwrap();
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("must be a URL"));
    for child in [&mut router, &mut a, &mut b] {
        child.kill().unwrap();
        child.wait().unwrap();
    }
}

/// Runs `tests/python/agents/hostile_agent.py` for one episode under `moult agents` (as a PID 1
/// would, `MOULT_INIT=1`), directly or through the sandbox `(socket, pid)`, in a jail of its
/// own or a process group (`isolation`), and checks what it found.
async fn hostile_agent(
    engine_url: &str,
    model: &std::path::Path,
    dir: &std::path::Path,
    sandbox: Option<(&std::path::Path, u32)>,
    isolation: &str,
) {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    // Agent code is untrusted: it gets no credential from moult's environment (not even one
    // MOULT_AGENT_PASS_ENV names), and the pool's variables and what the pass list names
    // only; what it starts dies with its episode; another session's URL is a 404; a task too
    // large for an environment variable reaches it through MOULT_TASK_FILE. `moult` runs as a
    // container's PID 1 would (MOULT_INIT=1): orphans of agent code are handed to it and reaped.
    let tasks = dir.join("big_task.jsonl");
    let padding = "x".repeat(200_000);
    std::fs::write(
        &tasks,
        format!("{}\n", serde_json::json!({ "padding": padding })),
    )
    .unwrap();
    let hostile_out = dir.join("hostile.jsonl");
    let mut agents = moult();
    if let Some((socket, _)) = sandbox {
        agents.env("MOULT_AGENT_SANDBOX", socket);
    }
    let mut supervisor = agents
        .args(["agents", "--engine", engine_url, "--model"])
        .arg(model)
        .arg("--agent")
        .arg(root.join("tests/python/agents/hostile_agent.py"))
        .arg("--tasks")
        .arg(&tasks)
        .arg("--python")
        .arg(common::python())
        .arg("--out")
        .arg(&hostile_out)
        .args(["--isolation", isolation])
        .env("MOULT_TOKEN", "run-secret")
        .env("MOULT_AGENT_TOKEN", "agent-secret")
        .env("MOULT_AGENT_PASS_ENV", "MOULT_TOKEN, PASSED_ON")
        .env("PASSED_ON", "yes")
        .env("WITHHELD", "no")
        .env("MOULT_INIT", "1")
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let supervisor_pid = supervisor.id();
    assert!(supervisor.wait().unwrap().success());
    let text = std::fs::read_to_string(&hostile_out).unwrap();
    let episode: serde_json::Value = serde_json::from_str(text.lines().next().unwrap()).unwrap();
    assert_eq!(episode["status"], "completed", "{episode}");
    let info = &episode["info"];
    let env: Vec<&str> = info["env"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    for name in [
        "MOULT_TOKEN",
        "MOULT_AGENT_TOKEN",
        "WITHHELD",
        "CARGO_MANIFEST_DIR",
    ] {
        assert!(!env.contains(&name), "{name} reached the agent: {env:?}");
    }
    for name in [
        "PATH",
        "PASSED_ON",
        "MOULT_SESSION_ID",
        "MOULT_TASK_FILE",
        "OPENAI_BASE_URL",
    ] {
        assert!(env.contains(&name), "{name} is missing: {env:?}");
    }
    let values = info["values"].as_array().unwrap();
    assert!(
        !values.iter().any(|v| {
            let v = v.as_str().unwrap();
            v.contains("run-secret") || v.contains("agent-secret")
        }),
        "a credential reached the agent"
    );
    assert_eq!(info["forged_status"], 404, "{info}");
    assert_eq!(info["task_in_env"], false);
    assert_eq!(info["task_len"], 200_000);
    // `moult.sandbox.run` from the agent: a jail of its own (nested in the episode's), made by the
    // `moult` that started the agent (MOULT_BIN), with no network and none of the agent's variables.
    assert_eq!(info["sandboxed"][0], true, "{info}");
    assert_eq!(info["sandboxed"][1], "unreachable None", "{info}");
    // Nothing the episode started is left on this machine, in either isolation.
    let session = format!("MOULT_SESSION_ID={}", episode["session"].as_str().unwrap());
    let of_the_episode = || {
        let pids = std::fs::read_dir("/proc").unwrap().flatten();
        pids.filter(|p| {
            std::fs::read(p.path().join("environ"))
                .is_ok_and(|e| e.split(|b| *b == 0).any(|v| v == session.as_bytes()))
        })
        .count()
    };
    for _ in 0..100 {
        if of_the_episode() == 0 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert_eq!(of_the_episode(), 0, "a process outlived its episode");
    if isolation == "episode" {
        // The agent is its jail's second process; the jail's first adopted and reaped the orphan.
        assert_eq!(info["parent_pid"], 1, "{info}");
        assert_eq!(info["escaped_parent"], 1, "{info}");
        assert_eq!(info["escaped_state"], "reaped", "{info}");
        return;
    }
    let leftover = info["leftover_pid"].as_u64().unwrap();
    let gone = || {
        std::fs::read_to_string(format!("/proc/{leftover}/stat")).map_or(true, |stat| {
            stat.rsplit(") ").next().unwrap_or("").starts_with('Z')
        })
    };
    // SIGKILL was sent when the episode ended; its delivery takes a moment.
    for _ in 0..100 {
        if gone() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert!(
        gone(),
        "the agent's leftover process {leftover} outlived its episode"
    );
    // Orphans go to the supervising moult of the process that started the agent (the sandbox's,
    // when there is one), which reaps them.
    let reaper = sandbox.map_or(supervisor_pid, |(_, pid)| pid);
    assert_eq!(info["escaped_parent"], reaper, "{info}");
    assert_eq!(info["escaped_state"], "reaped", "{info}");
    if let Some((_, sandbox_pid)) = sandbox {
        // The agent was started by the sandbox (the supervised `moult sandbox`), not by
        // `moult agents`.
        let parent = info["parent_pid"].as_u64().unwrap();
        let stat = std::fs::read_to_string(format!("/proc/{parent}/stat")).unwrap();
        let grandparent: u32 = stat
            .rsplit(") ")
            .next()
            .unwrap()
            .split(' ')
            .nth(1)
            .unwrap()
            .parse()
            .unwrap();
        assert_eq!(grandparent, sandbox_pid, "{stat}");
    }
}

/// `moult engine-front` (what a vLLM engine pod exposes, docs/security.md) in front of a server
/// that echoes what reached it: 401 without the run token on every route but `/health` and
/// `/metrics`; with it, requests pass unchanged but for the token, and streams pass as they come.
#[tokio::test]
async fn libtorch_cli_engine_front_lets_only_the_run_token_through() {
    use axum::body::{Body, Bytes};
    use axum::http::{HeaderMap, Method, Uri};
    use futures::StreamExt;
    use std::sync::{Arc, Mutex};

    // Without the run token the front would check nothing: it refuses to start.
    let out = (moult().args([
        "engine-front",
        "--upstream",
        "http://127.0.0.1:1",
        "--port",
        "0",
    ]))
    .env_remove("MOULT_TOKEN")
    .output()
    .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("MOULT_TOKEN is not set"), "{err}");

    // The upstream: `/stream` sends one chunk, then the rest once the test says so; every other
    // route echoes the request.
    let (release, released) = tokio::sync::oneshot::channel::<()>();
    let released = Arc::new(Mutex::new(Some(released)));
    let echo = move |method: Method, uri: Uri, headers: HeaderMap, body: Bytes| {
        let released = released.clone();
        async move {
            if uri.path() == "/stream" {
                let rest = released.lock().unwrap().take().unwrap();
                let first = futures::stream::once(async { Ok::<_, std::io::Error>("first;") });
                let last = futures::stream::once(async move {
                    let _ = rest.await;
                    Ok("last")
                });
                return Body::from_stream(first.chain(last));
            }
            let answer = serde_json::json!({
                "method": method.as_str(),
                "path": uri.path(),
                "query": uri.query(),
                "authorization": headers.get("authorization").map(|h| h.to_str().unwrap()),
                "custom": headers.get("x-moult-session").map(|h| h.to_str().unwrap()),
                "body": String::from_utf8_lossy(&body),
            });
            Body::from(answer.to_string())
        }
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let upstream = format!("http://{}", listener.local_addr().unwrap());
    let app = axum::Router::new().fallback(echo);
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });

    let start = |upstream: &str| {
        use std::io::{BufRead, BufReader};
        let mut child = (moult().args(["engine-front", "--upstream", upstream, "--port", "0"]))
            .env("MOULT_TOKEN", "s3cret")
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let line = lines.next().unwrap().unwrap();
        std::thread::spawn(move || for _ in lines {});
        let url = line.split(' ').nth(4).unwrap().to_string();
        assert!(url.starts_with("http://"), "{line}");
        (child, url)
    };
    let (mut front, url) = start(&upstream);
    let http = reqwest::Client::new();
    for (method, path) in [
        (Method::POST, "/pause"),
        (Method::POST, "/collective_rpc"),
        (Method::POST, "/update_weights"),
        (Method::POST, "/inference/v1/generate"),
        (Method::GET, "/v1/models"),
    ] {
        for authorization in [None, Some("Bearer s3cre"), Some("s3cret")] {
            let mut request = http.request(method.clone(), format!("{url}{path}"));
            if let Some(a) = authorization {
                request = request.header("authorization", a);
            }
            let r = request.body("{}").send().await.unwrap();
            assert_eq!(r.status(), 401, "{path} with {authorization:?}");
        }
    }
    for open in ["/health", "/metrics"] {
        let v: serde_json::Value = common::get_json(&format!("{url}{open}")).await;
        assert_eq!(v["path"], open);
    }
    let v: serde_json::Value = (http.post(format!("{url}/collective_rpc?timeout=5")))
        .header("authorization", "Bearer s3cret")
        .header("x-moult-session", "s1")
        .body(r#"{"method":"reload_weights"}"#)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v["method"], "POST");
    assert_eq!(v["path"], "/collective_rpc");
    assert_eq!(v["query"], "timeout=5");
    assert_eq!(v["body"], r#"{"method":"reload_weights"}"#);
    assert_eq!(v["custom"], "s1", "other headers pass");
    assert_eq!(
        v["authorization"],
        serde_json::Value::Null,
        "the token does not"
    );

    // A stream's first chunk arrives while the upstream still holds the rest.
    let r = (http.get(format!("{url}/stream")))
        .header("authorization", "Bearer s3cret")
        .send()
        .await
        .unwrap();
    let mut chunks = r.bytes_stream();
    let first = tokio::time::timeout(std::time::Duration::from_secs(60), chunks.next())
        .await
        .expect("the first chunk passes before the stream ends");
    assert_eq!(first.unwrap().unwrap(), "first;");
    release.send(()).unwrap();
    let mut rest = Vec::new();
    while let Some(chunk) = chunks.next().await {
        rest.extend_from_slice(&chunk.unwrap());
    }
    assert_eq!(rest, b"last");
    front.kill().unwrap();
    front.wait().unwrap();

    // An upstream that is down: 502, saying so.
    let (mut front, url) = start("http://127.0.0.1:1");
    let r = (http.get(format!("{url}/v1/models")))
        .header("authorization", "Bearer s3cret")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 502);
    let text = r.text().await.unwrap();
    assert!(
        text.contains("the engine behind this front did not answer"),
        "{text}"
    );
    front.kill().unwrap();
    front.wait().unwrap();
}
