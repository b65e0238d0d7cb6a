//! Cluster mode end to end, on the real test control plane: the real operator turns an RLRun into
//! pods, and the local kubelet ([`support::kubelet`]) runs each pod's containers as processes of
//! the real `moult` binary, exactly as the pod specs say (command, args, environment, mounts,
//! the pod's IP; the pod's ServiceAccount for the Kubernetes API). The run trains the main recipe
//! (examples/successor); the test checks that the RLRun's status shows step, version and reward
//! advancing, that a request without the run's token is refused, that a new engine from
//! `kubectl scale` joins and gets work, that a killed engine whose pod is deleted is replaced
//! without losing an episode, that a killed trainer resumes from its checkpoint with versions
//! still increasing, that a killed coordinator goes on from the run's status, that the episodes
//! of a killed agent process run again elsewhere, and that scaling down drains an engine without
//! losing an episode.

mod support;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use support::kubelet::{Kubelet, KubeletOptions};
use support::{cluster, repository, Namespace, Operator, ROOT};

const RUN: &str = "succ";
const TOKEN_HEADER: &str = "authorization";

fn recipe() -> PathBuf {
    Path::new(ROOT).join("examples/successor")
}

/// The successor recipe as a cluster run: paths in "the image" (this machine), two built-in
/// engines, checkpoints every 2 steps on a claim, evaluation on the held-out tasks every 2 steps,
/// dynamic sampling, and more steps than the test waits for.
fn run_yaml() -> String {
    let r = recipe();
    let r = r.display();
    format!(
        r#"apiVersion: moult.dev/v1alpha1
kind: RLRun
metadata:
  name: {RUN}
spec:
  model: {{path: {r}/model}}
  agent:
    form: Env
    image: local
    command: [python, {r}/env.py]
    concurrency: 64
    timeout: 1m
    dataset: {{path: {r}/tasks.jsonl}}
  engines: {{backend: Builtin, replicas: 2}}
  trainer: {{gpusPerNode: 0, dumpRollouts: true}}
  algorithm:
    estimator: GRPO
    groupSize: 8
    batchSize: 8
    maxStaleness: 1
    optimizer: {{learningRate: 1.0e-3, maxGradNorm: 1.0}}
    dynamicSampling: {{}}
  rollout: {{maxTokens: 4, temperature: 1.0, maxTurns: 3}}
  eval: {{dataset: {{path: {r}/eval.jsonl}}, intervalSteps: 2, samples: 2}}
  checkpoint: {{claimName: checkpoints, intervalSteps: 2}}
  totalSteps: 500
"#
    )
}

fn ensure_model() {
    let dir = recipe();
    let status = std::process::Command::new(
        std::env::var("MOULT_PYTHON").unwrap_or_else(|_| "python3".into()),
    )
    .arg(dir.join("make_model.py"))
    .arg(dir.join("model"))
    .status()
    .expect("run make_model.py");
    assert!(status.success(), "make_model.py failed");
}

/// The RLRun's status.
fn status(ns: &Namespace, run: &str) -> Value {
    let text = ns.kubectl(&["get", "rlrun", run, "-o", "json"]);
    let run: Value = serde_json::from_str(&text).expect("kubectl prints JSON");
    run["status"].clone()
}

fn step_of(s: &Value) -> u64 {
    s["step"].as_u64().unwrap_or(0)
}

/// Polls the run's status until `check` holds, with the logs of every role on failure.
fn wait_status(
    (ns, run): (&Namespace, &str),
    kubelet: &Kubelet,
    timeout: Duration,
    what: &str,
    mut check: impl FnMut(&Value) -> bool,
) -> Value {
    let started = Instant::now();
    loop {
        let s = status(ns, run);
        if check(&s) {
            return s;
        }
        if started.elapsed() > timeout {
            panic!(
                "timed out after {timeout:?} waiting for {what}; status: {s}\n--- coordinator\n{}\n--- trainer\n{}\n--- agents\n{}\n--- engines\n{}",
                kubelet.logs_tail(&format!("{run}-coordinator"), 30),
                kubelet.logs_tail(&format!("{run}-trainer"), 30),
                kubelet.logs_tail(&format!("{run}-agents"), 20),
                kubelet.logs_tail(&format!("{run}-engine"), 20),
            );
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// The test kubelet for namespace `ns`, under `root`: pods run the real `moult` (agent pods the
/// moult their init container would copy in: the build without libtorch that scripts/test.sh
/// makes and names in MOULT_AGENT_BIN, else the full one) and `binaries`, with `claims` and
/// `env` (besides RUST_LOG); the recipes' files are "in the image" (the repository).
async fn start_kubelet(
    ns: &Namespace,
    root: &Path,
    claims: BTreeMap<String, PathBuf>,
    binaries: BTreeMap<String, PathBuf>,
    env: Vec<(String, String)>,
) -> Kubelet {
    let moult = PathBuf::from(env!("CARGO_BIN_EXE_moult"));
    let agent_moult = match std::env::var_os("MOULT_AGENT_BIN") {
        Some(bin) => {
            let bin = PathBuf::from(bin);
            assert!(
                bin.is_file(),
                "MOULT_AGENT_BIN {} is missing",
                bin.display()
            );
            println!("agent pods run {}", bin.display());
            bin
        }
        None => moult.clone(),
    };
    let mut all = BTreeMap::from([
        ("moult".to_string(), moult),
        ("/opt/moult/bin/moult".to_string(), agent_moult),
    ]);
    all.extend(binaries);
    let c = cluster();
    Kubelet::start(
        c.client().await,
        &ns.name,
        KubeletOptions {
            root: root.join("kubelet"),
            binaries: all,
            claims,
            env: [("RUST_LOG".to_string(), "info,kube=warn".to_string())]
                .into_iter()
                .chain(env)
                .collect(),
            kubeconfig: Some(c.kubeconfig.clone()),
            image: vec![repository()],
        },
    )
    .await
}

/// The IP of a pod; empty while the pod does not exist yet (a StatefulSet creates scaled-up
/// pods after `kubectl scale` returns) or has no IP.
fn pod_ip(ns: &Namespace, pod: &str) -> String {
    ns.kubectl(&[
        "get",
        "pod",
        pod,
        "--ignore-not-found",
        "-o",
        "jsonpath={.status.podIP}",
    ])
}

fn token(ns: &Namespace, run: &str) -> String {
    secret_key(ns, run, "token")
}

/// A key of the run's token Secret (`token`, `agent-token`).
fn secret_key(ns: &Namespace, run: &str, key: &str) -> String {
    let b64 = ns.kubectl(&[
        "get",
        "secret",
        &format!("{run}-token"),
        "-o",
        &format!("jsonpath={{.data.{key}}}"),
    ]);
    use base64::Engine as _;
    String::from_utf8(
        base64::engine::general_purpose::STANDARD
            .decode(b64.trim())
            .expect("base64"),
    )
    .expect("a UTF-8 token")
}

/// A GET of the coordinator's API, with the token.
async fn get_json(http: &reqwest::Client, url: &str, token: &str) -> Value {
    http.get(url)
        .header(TOKEN_HEADER, format!("Bearer {token}"))
        .send()
        .await
        .expect("the coordinator answers")
        .json()
        .await
        .expect("JSON")
}

/// The coordinator's `/v1/status`.
async fn coordinator_status(http: &reqwest::Client, base: &str, token: &str) -> Value {
    get_json(http, &format!("{base}/v1/status"), token).await
}

/// Successful generate requests an engine served (its own metrics).
async fn engine_requests(http: &reqwest::Client, url: &str) -> f64 {
    let Ok(r) = http.get(format!("{url}/metrics")).send().await else {
        return 0.0;
    };
    let text = r.text().await.unwrap_or_default();
    text.lines()
        .filter(|l| l.starts_with("vllm:request_success_total"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the test control plane: bash scripts/test-cluster.sh up"]
async fn cluster_run_trains_survives_restarts_and_scales() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    ensure_model();
    cluster();
    let ns = Namespace::new("cluster-run");
    let root = std::env::temp_dir().join(format!("moult-cluster-run-{}", ns.name));
    let _ = std::fs::remove_dir_all(&root);
    let checkpoints = ns.bound_claim("checkpoints", &root.join("claims/checkpoints"));
    let operator = Operator::start(&ns, "e2e");
    let kubelet = start_kubelet(
        &ns,
        &root,
        BTreeMap::from([("checkpoints".to_string(), checkpoints.clone())]),
        BTreeMap::new(),
        // Leases of a dead agent process expire after this (30 s by default).
        vec![("MOULT_LEASE_TIME".into(), "6s".into())],
    )
    .await;

    // Apply, then the first reward in the status.
    let applied = Instant::now();
    ns.apply(&run_yaml());
    let first = wait_status(
        (&ns, RUN),
        &kubelet,
        Duration::from_secs(300),
        "a first reward",
        |s| s["metrics"]["reward"].is_number(),
    );
    let to_first_reward = applied.elapsed();
    let s = wait_status(
        (&ns, RUN),
        &kubelet,
        Duration::from_secs(300),
        "3 steps",
        |s| step_of(s) >= 3,
    );
    assert!(s["policyVersion"].as_u64().unwrap() >= 3, "status: {s}");
    // The coordinator evaluated the base policy before step 1 and again every 2 steps, over the
    // agent pods, and the status says so (the Eval column).
    let s = wait_status(
        (&ns, RUN),
        &kubelet,
        Duration::from_secs(120),
        "an evaluation after step 2",
        |s| s["metrics"]["evalStep"].as_u64().is_some_and(|e| e >= 2),
    );
    let eval = s["metrics"]["evalReward"].as_f64().unwrap();
    assert!((0.0..=1.0).contains(&eval), "status: {s}");
    println!(
        "apply -> first reward in status: {:.1} s (step {}, reward {})",
        to_first_reward.as_secs_f64(),
        first["step"],
        first["metrics"]["reward"]
    );

    let http = reqwest::Client::new();
    let token = token(&ns, RUN);
    let coordinator = format!("http://{}:8080", pod_ip_of(&ns, "coordinator"));

    // The run's token guards internal endpoints (but not probes and metrics).
    for (url, method) in [
        (format!("{coordinator}/v1/status"), reqwest::Method::GET),
        (format!("{coordinator}/pause"), reqwest::Method::POST),
        (
            format!(
                "http://{}:8000/pause",
                pod_ip(&ns, &format!("{RUN}-engine-0"))
            ),
            reqwest::Method::POST,
        ),
    ] {
        let r = http.request(method.clone(), &url).send().await.unwrap();
        assert_eq!(r.status(), 401, "{method} {url} without the token");
        let r = http
            .request(method.clone(), &url)
            .header(TOKEN_HEADER, "Bearer not-the-token")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 401, "{method} {url} with a wrong token");
    }
    // The agent credential (what agent pods hold) opens leasing, returning and generating on
    // the coordinator, and nothing of the trainer's, the router's control or an engine's.
    let agent = secret_key(&ns, RUN, "agent-token");
    let engine_0 = format!("http://{}:8000", pod_ip(&ns, &format!("{RUN}-engine-0")));
    for (url, method) in [
        (format!("{coordinator}/engines"), reqwest::Method::POST),
        (format!("{coordinator}/engines"), reqwest::Method::GET),
        (format!("{coordinator}/pause"), reqwest::Method::POST),
        (
            format!("{coordinator}/update_weights"),
            reqwest::Method::POST,
        ),
        (
            format!("{coordinator}/init_weight_transfer_engine"),
            reqwest::Method::POST,
        ),
        (
            format!("{coordinator}/v1/trainer/commit"),
            reqwest::Method::POST,
        ),
        (
            format!("{coordinator}/v1/trainer/batch?step=1"),
            reqwest::Method::GET,
        ),
        (format!("{coordinator}/v1/status"), reqwest::Method::GET),
        (format!("{engine_0}/pause"), reqwest::Method::POST),
        (
            format!("{engine_0}/inference/v1/generate"),
            reqwest::Method::POST,
        ),
    ] {
        let r = http
            .request(method.clone(), &url)
            .header(TOKEN_HEADER, format!("Bearer {agent}"))
            .json(&serde_json::json!({}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 403, "{method} {url} with the agent credential");
    }
    let lease = http
        .post(format!("{coordinator}/v1/agents/renew"))
        .header(TOKEN_HEADER, format!("Bearer {agent}"))
        .json(&serde_json::json!({"leases": []}))
        .send()
        .await
        .unwrap();
    assert_eq!(lease.status(), 200, "agents may renew their leases");
    let health = http
        .get(format!("{coordinator}/health"))
        .send()
        .await
        .unwrap();
    assert_eq!(health.status(), 200, "probes need no token");
    // Every role's metrics, where the operator's probes and ports point.
    for (url, metric) in [
        (format!("{coordinator}/metrics"), "moult_step "),
        (
            format!("http://{}:9090/metrics", pod_ip_of(&ns, "trainer")),
            "moult_trainer_step ",
        ),
        (
            format!("http://{}:9090/metrics", pod_ip_of(&ns, "agents")),
            "moult_agents_episodes_total{status=\"completed\"} ",
        ),
        (
            format!(
                "http://{}:8000/metrics",
                pod_ip(&ns, &format!("{RUN}-engine-0"))
            ),
            "vllm:num_requests_running",
        ),
    ] {
        let text = http.get(&url).send().await.unwrap().text().await.unwrap();
        assert!(text.contains(metric), "{url} has no {metric}:\n{text}");
        let health = url.replace("/metrics", "/health");
        let r = http.get(&health).send().await.unwrap();
        assert_eq!(r.status(), 200, "{health}");
    }
    let st = coordinator_status(&http, &coordinator, &token).await;
    assert!(
        st["step"].as_u64().unwrap() >= 3,
        "coordinator status: {st}"
    );
    assert!(
        st["eval"]["eval_pass_at_k"].is_number(),
        "coordinator status: {st}"
    );
    // The trainer logged the evaluations beside metrics.jsonl on its volume: the base policy's
    // first, each with the held-out tasks × 2 samples.
    let evals = std::fs::read_to_string(checkpoints.join(RUN).join("eval.jsonl")).unwrap();
    let first_eval: Value = serde_json::from_str(evals.lines().next().unwrap()).unwrap();
    // And every trained batch (trainer.dumpRollouts), there too: the whole batch, no group
    // whose rewards are all equal (dynamic sampling).
    let dump = checkpoints.join(RUN).join("rollouts/step-000001.json");
    let dump: Value = serde_json::from_slice(&std::fs::read(&dump).unwrap()).unwrap();
    let groups = dump["groups"].as_array().unwrap();
    assert_eq!((dump["step"].as_u64(), groups.len()), (Some(1), 8));
    for g in groups {
        let rewards: Vec<f64> = g["episodes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["reward"].as_f64().unwrap())
            .collect();
        assert!(
            rewards.windows(2).any(|w| w[0] != w[1]),
            "an equal-reward group was trained: {rewards:?}"
        );
    }
    assert_eq!(
        (
            &first_eval["step"],
            &first_eval["eval_tasks"],
            &first_eval["eval_k"]
        ),
        (
            &serde_json::json!(0),
            &serde_json::json!(16),
            &serde_json::json!(2)
        ),
        "{evals}"
    );

    // Engine discovery admits only the run's own engines (docs/security.md, "Credentials"): a
    // bare pod with engine-0's labels copied (the Service selects it, so the run's own slice
    // lists it) and a rogue EndpointSlice with the Service's label, both at a listener of the
    // test's, get no request while the run goes on, so never see the token.
    let rogue = Rogue::start(&ns).await;
    let at = step_of(&status(&ns, RUN));
    wait_status(
        (&ns, RUN),
        &kubelet,
        Duration::from_secs(300),
        "2 steps with a rogue engine about",
        |s| step_of(s) >= at + 2,
    );
    let engines = router_engines(&http, &coordinator, &token).await;
    assert!(
        !engines.to_string().contains(&rogue.ip),
        "the router took the rogue engine {}: {engines}",
        rogue.ip
    );
    assert_eq!(rogue.finish(&ns), 0, "connections to the rogue engine");

    // kubectl scale: a third engine joins the router and gets work.
    ns.kubectl(&["scale", &format!("rlrun/{RUN}"), "--replicas=3"]);
    let third = format!("{RUN}-engine-2");
    let deadline = Instant::now() + Duration::from_secs(300);
    let third_url = loop {
        let ip = pod_ip(&ns, &third);
        if !ip.is_empty() {
            let url = format!("http://{ip}:8000");
            if engine_requests(&http, &url).await > 0.0 {
                break url;
            }
        }
        assert!(
            Instant::now() < deadline,
            "the third engine got no request; engines: {}\n{}",
            router_engines(&http, &coordinator, &token).await,
            kubelet.logs_tail(&format!("{RUN}-coordinator"), 30)
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    println!("scaled to 3: {third} ({third_url}) serves requests");

    // Kill an engine process and delete its pod: the StatefulSet makes a new pod, the kubelet
    // runs it, and no episode is lost (its requests fail over to the other engines).
    let before = coordinator_status(&http, &coordinator, &token).await;
    let victim = format!("{RUN}-engine-1");
    let old_uid = kubelet
        .processes()
        .into_iter()
        .find(|p| p.pod == victim)
        .expect("engine-1 runs")
        .uid;
    kubelet.kill(&victim);
    ns.kubectl(&["delete", "pod", &victim, "--wait=false"]);
    let step_at_kill = step_of(&status(&ns, RUN));
    wait_status(
        (&ns, RUN),
        &kubelet,
        Duration::from_secs(300),
        "3 steps after the engine kill",
        |s| step_of(s) >= step_at_kill + 3,
    );
    let deadline = Instant::now() + Duration::from_secs(120);
    while !kubelet
        .processes()
        .iter()
        .any(|p| p.pod == victim && p.running && p.uid != old_uid)
    {
        assert!(
            Instant::now() < deadline,
            "the replaced engine pod never ran"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let after = coordinator_status(&http, &coordinator, &token).await;
    assert_eq!(
        after["rollout"]["dropped_failed"], before["rollout"]["dropped_failed"],
        "an episode failed when the engine died: {after}"
    );
    println!(
        "engine killed at step {step_at_kill}: replaced, run at step {}, failed groups {}",
        after["step"], after["rollout"]["dropped_failed"]
    );

    // Kill the trainer: it restarts from its last checkpoint (every 2 steps), republishes under a
    // new version, and trains on; versions only increase.
    let s = status(&ns, RUN);
    let (step_at_kill, version_at_kill) = (step_of(&s), s["policyVersion"].as_u64().unwrap());
    kubelet.kill(&format!("{RUN}-trainer-0"));
    let s = wait_status(
        (&ns, RUN),
        &kubelet,
        Duration::from_secs(300),
        "the trainer to come back and pass its old step",
        |s| step_of(s) > step_at_kill,
    );
    assert!(
        s["policyVersion"].as_u64().unwrap() > version_at_kill,
        "versions went back after the trainer restart: {version_at_kill} -> {s}"
    );
    let st = coordinator_status(&http, &coordinator, &token).await;
    assert_eq!(st["trainer_restarts"], 1, "{st}");
    let trainer_log = std::fs::read_to_string(
        kubelet
            .log_path(&format!("{RUN}-trainer-0"))
            .expect("a trainer log"),
    )
    .unwrap();
    assert!(
        trainer_log.contains("resuming succ from"),
        "the trainer did not resume from a checkpoint:\n{trainer_log}"
    );
    assert!(
        checkpoints
            .join(RUN)
            .join("checkpoints/latest.json")
            .is_file(),
        "no checkpoint on the claim"
    );
    println!(
        "trainer killed at step {step_at_kill} (version {version_at_kill}): resumed, now step {} version {}",
        s["step"], s["policyVersion"]
    );

    // Kill the coordinator: it restarts (the pod's restart policy) and goes on from the run's
    // status; the trainer and the agents reconnect, and versions keep increasing.
    let s = status(&ns, RUN);
    let (step_at_kill, version_at_kill) = (step_of(&s), s["policyVersion"].as_u64().unwrap());
    let coordinator_pod = pod_name_of(&ns, "coordinator");
    let data_before = coordinator_status(&http, &coordinator, &token).await["data"].clone();
    kubelet.kill(&coordinator_pod);
    let s = wait_status(
        (&ns, RUN),
        &kubelet,
        Duration::from_secs(300),
        "3 steps after the coordinator restart",
        |s| step_of(s) >= step_at_kill + 3,
    );
    assert!(
        s["policyVersion"].as_u64().unwrap() > version_at_kill,
        "versions went back after the coordinator restart: {version_at_kill} -> {s}"
    );
    // The data cursor went on from where the trainer's last batch left it (at most 16 groups
    // behind the old coordinator's), not from the start: 3 steps later it is past where it was
    // (256 tasks: no epoch ends in this test).
    let data_after = coordinator_status(&http, &coordinator, &token).await["data"].clone();
    let position = |d: &Value| d["epoch"].as_u64().unwrap() * 256 + d["cursor"].as_u64().unwrap();
    assert!(
        position(&data_after) >= position(&data_before),
        "the data cursor started over: {data_before} -> {data_after}"
    );
    println!(
        "coordinator killed at step {step_at_kill} (version {version_at_kill}): restarted, now step {} version {}",
        s["step"], s["policyVersion"]
    );

    // Kill the agent pod's process: the leases of its running episodes are no longer renewed,
    // expire (after MOULT_LEASE_TIME, 6 s here) and go to the restarted process; the run goes on.
    let step_at_kill = step_of(&status(&ns, RUN));
    let agents_pod = pod_name_of(&ns, "agents");
    // Kill it while it holds leases (generation pauses while admission waits for the trainer).
    let deadline = Instant::now() + Duration::from_secs(120);
    let held = loop {
        let held = coordinator_status(&http, &coordinator, &token).await["episodes_leased"]
            .as_u64()
            .unwrap();
        if held > 0 {
            kubelet.kill(&agents_pod);
            break held;
        }
        assert!(Instant::now() < deadline, "no episode was ever leased");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let deadline = Instant::now() + Duration::from_secs(120);
    let st = loop {
        let st = coordinator_status(&http, &coordinator, &token).await;
        if st["leases_expired"].as_u64().unwrap() > 0 {
            break st;
        }
        assert!(
            Instant::now() < deadline,
            "{held} episodes were leased to the killed process, none expired: {st}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    wait_status(
        (&ns, RUN),
        &kubelet,
        Duration::from_secs(300),
        "3 steps after the agents restart",
        |s| step_of(s) >= step_at_kill + 3,
    );
    println!(
        "agents killed at step {step_at_kill} holding {held} leases: {} expired and ran again, run at step {}",
        st["leases_expired"], st["step"]
    );

    // Scale down: engine-2 drains (its pod gets SIGTERM, the router stops sending to it) and no
    // episode is lost.
    let before = coordinator_status(&http, &coordinator, &token).await;
    ns.kubectl(&["scale", &format!("rlrun/{RUN}"), "--replicas=2"]);
    let step_at_scale = step_of(&status(&ns, RUN));
    wait_status(
        (&ns, RUN),
        &kubelet,
        Duration::from_secs(300),
        "3 steps after scaling down",
        |s| step_of(s) >= step_at_scale + 3,
    );
    let engines = router_engines(&http, &coordinator, &token).await;
    assert_eq!(
        engines["engines"].as_array().map(Vec::len),
        Some(2),
        "the router still has the removed engine: {engines}"
    );
    let after = coordinator_status(&http, &coordinator, &token).await;
    assert_eq!(
        after["rollout"]["dropped_failed"], before["rollout"]["dropped_failed"],
        "an episode failed when scaling down: {after}"
    );
    let s = status(&ns, RUN);
    println!(
        "scaled down to 2 at step {step_at_scale}: now step {}, version {}, reward {}; kubectl get rlr:\n{}",
        s["step"],
        s["policyVersion"],
        s["metrics"]["reward"],
        ns.kubectl(&["get", "rlr", RUN])
    );

    ns.kubectl(&["delete", "rlrun", RUN, "--wait=false"]);
    kubelet.shutdown().await;
    drop(operator);
    // Kept when the test fails (the logs of every role are there), removed when it passes.
    let _ = std::fs::remove_dir_all(&root);
}

/// A field of the (first) pod of a component of run `RUN`.
fn pod_field(ns: &Namespace, component: &str, field: &str) -> String {
    pod_field_of(ns, RUN, component, field)
}

/// A field of the (first) pod of a component of `run`.
fn pod_field_of(ns: &Namespace, run: &str, component: &str, field: &str) -> String {
    ns.kubectl(&[
        "get",
        "pod",
        "-l",
        &format!("moult.dev/run={run},moult.dev/component={component}"),
        "-o",
        &format!("jsonpath={{.items[0].{field}}}"),
    ])
}

/// The IP of a component's pod.
fn pod_ip_of(ns: &Namespace, component: &str) -> String {
    pod_field(ns, component, "status.podIP")
}

/// The name of a component's pod.
fn pod_name_of(ns: &Namespace, component: &str) -> String {
    pod_field(ns, component, "metadata.name")
}

/// A pod that copies engine-0's labels (no container of it runs), a test listener at its IP on
/// the engine port, and an EndpointSlice with the engine Service's label listing it: what
/// engine discovery must never call.
struct Rogue {
    ip: String,
    connections: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Rogue {
    async fn start(ns: &Namespace) -> Rogue {
        use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
        let labels = ns.kubectl(&[
            "get",
            "pod",
            &format!("{RUN}-engine-0"),
            "-o",
            "jsonpath={.metadata.labels}",
        ]);
        let labels: Value = serde_json::from_str(&labels).expect("labels");
        let pod = serde_json::json!({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "copycat", "labels": labels},
            "spec": {"containers": [{"name": "rogue", "image": "rogue"}]},
        });
        ns.apply(&pod.to_string());
        let deadline = Instant::now() + Duration::from_secs(120);
        let ip = loop {
            let ip = pod_ip(ns, "copycat");
            if !ip.is_empty() {
                break ip;
            }
            assert!(Instant::now() < deadline, "the copycat pod got no IP");
            tokio::time::sleep(Duration::from_millis(500)).await;
        };
        let uid = ns.kubectl(&["get", "pod", "copycat", "-o", "jsonpath={.metadata.uid}"]);
        let listener = std::net::TcpListener::bind((ip.as_str(), 8000)).expect("rogue listener");
        listener.set_nonblocking(true).unwrap();
        let connections = std::sync::Arc::new(AtomicUsize::new(0));
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let (count, stopped) = (connections.clone(), stop.clone());
        std::thread::spawn(move || {
            while !stopped.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((conn, from)) => {
                        println!("the rogue engine was called from {from}");
                        count.fetch_add(1, Ordering::Relaxed);
                        drop(conn);
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(50)),
                }
            }
        });
        let slice = serde_json::json!({
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {
                "name": "rogue",
                "labels": {"kubernetes.io/service-name": format!("{RUN}-engine")},
            },
            "addressType": "IPv4",
            "endpoints": [{
                "addresses": [ip],
                "conditions": {"ready": true},
                "targetRef": {"kind": "Pod", "name": "copycat", "uid": uid.trim()},
            }],
            "ports": [{"name": "http", "port": 8000, "protocol": "TCP"}],
        });
        ns.apply(&slice.to_string());
        Rogue {
            ip,
            connections,
            stop,
        }
    }

    /// Removes the pod and the slice; the connections the listener took.
    fn finish(self, ns: &Namespace) -> usize {
        use std::sync::atomic::Ordering;
        ns.kubectl(&["delete", "endpointslice", "rogue", "--wait=false"]);
        ns.kubectl(&["delete", "pod", "copycat", "--grace-period=0", "--force"]);
        self.stop.store(true, Ordering::Relaxed);
        self.connections.load(Ordering::Relaxed)
    }
}

/// The router's engines (`GET /engines` on the coordinator).
async fn router_engines(http: &reqwest::Client, coordinator: &str, token: &str) -> Value {
    get_json(http, &format!("{coordinator}/engines"), token).await
}

/// The successor recipe with vLLM engine pods: the operator's unmodified vLLM container command
/// (`vllm serve MODEL ...`, the image's `vllm` mapped to the pinned CPU build in its virtualenv
/// through tests/python/vllm_serve.py) and the Filesystem weight transport, a shared folder
/// standing for the ReadWriteMany claim that the trainer and every engine mount.
fn vllm_run_yaml() -> String {
    let r = recipe();
    let r = r.display();
    format!(
        r#"apiVersion: moult.dev/v1alpha1
kind: RLRun
metadata:
  name: {VLLM_RUN}
spec:
  model: {{path: {r}/model-hd32}}
  agent:
    form: Env
    image: local
    command: [python, {r}/env.py]
    concurrency: 64
    timeout: 1m
    dataset: {{path: {r}/tasks.jsonl}}
  engines:
    backend: vLLM
    replicas: 1
    gpusPerEngine: 0
    weightTransfer: {{transport: Filesystem, claimName: weights}}
    extraArgs: ["--dtype", "float32", "--kv-cache-memory-bytes", "268435456", "--enforce-eager"]
  trainer: {{gpusPerNode: 0}}
  algorithm:
    estimator: GRPO
    groupSize: 8
    batchSize: 8
    maxStaleness: 1
    optimizer: {{learningRate: 1.0e-3, maxGradNorm: 1.0}}
  rollout: {{maxTokens: 4, temperature: 1.0, maxTurns: 3}}
  totalSteps: 500
"#
    )
}

const VLLM_RUN: &str = "succ-vllm";

/// Healthy engines behind the coordinator's router.
async fn healthy_engines(http: &reqwest::Client, coordinator: &str, token: &str) -> usize {
    let engines = router_engines(http, coordinator, token).await;
    engines["engines"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|e| e["healthy"].as_bool() == Some(true))
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the test control plane: bash scripts/test-cluster.sh up"]
async fn cluster_run_with_vllm_engine_pods_trains_replaces_and_scales() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let vllm_python = std::env::var_os("MOULT_VLLM_PYTHON").expect(
        "MOULT_VLLM_PYTHON is not set: install the pinned vLLM with `bash scripts/setup-vllm.sh` \
         (scripts/test.sh sets it)",
    );
    let dir = recipe();
    let made = std::process::Command::new(
        std::env::var("MOULT_PYTHON").unwrap_or_else(|_| "python3".into()),
    )
    .arg(dir.join("make_model.py"))
    .arg(dir.join("model-hd32"))
    .args(["--head-dim", "32"])
    .status()
    .expect("run make_model.py");
    assert!(made.success(), "make_model.py --head-dim 32 failed");
    cluster();
    let ns = Namespace::new("cluster-vllm");
    let root = std::env::temp_dir().join(format!("moult-cluster-run-{}", ns.name));
    let _ = std::fs::remove_dir_all(&root);
    let weights = ns.bound_claim("weights", &root.join("claims/weights"));
    // The image's `vllm` command: the pinned CPU build, the operator's arguments as they are.
    let vllm = root.join("bin/vllm");
    std::fs::create_dir_all(vllm.parent().unwrap()).unwrap();
    std::fs::write(
        &vllm,
        format!(
            "#!/bin/sh\nexec '{}' '{}' \"$@\"\n",
            PathBuf::from(&vllm_python).display(),
            Path::new(ROOT).join("tests/python/vllm_serve.py").display()
        ),
    )
    .unwrap();
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&vllm, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let operator = Operator::start(&ns, "e2e-vllm");
    let kubelet = start_kubelet(
        &ns,
        &root,
        BTreeMap::from([("weights".to_string(), weights.clone())]),
        BTreeMap::from([("vllm".to_string(), vllm)]),
        vec![
            // vLLM's CPU build: one unpinned OpenMP thread (docs/vllm.md).
            ("VLLM_CPU_OMP_THREADS_BIND".into(), "nobind".into()),
            ("OMP_NUM_THREADS".into(), "1".into()),
        ],
    )
    .await;

    ns.apply(&vllm_run_yaml());
    let s = wait_status(
        (&ns, VLLM_RUN),
        &kubelet,
        Duration::from_secs(600),
        "3 steps on vLLM",
        |s| step_of(s) >= 3,
    );
    println!(
        "vLLM run: step {}, version {}, reward {}",
        s["step"], s["policyVersion"], s["metrics"]["reward"]
    );
    // The trainer published through the shared folder: one version folder, the newest.
    let published: Vec<String> = std::fs::read_dir(weights.join(VLLM_RUN))
        .expect("the trainer writes under <claim>/<run>")
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with('v'))
        .collect();
    assert_eq!(published.len(), 1, "{published:?}");

    let http = reqwest::Client::new();
    let token = token(&ns, VLLM_RUN);
    let coordinator = format!(
        "http://{}:8080",
        pod_field_of(&ns, VLLM_RUN, "coordinator", "status.podIP")
    );
    engine_pod_answers_only_its_run(&http, &ns, &token).await;

    // A killed vLLM engine whose pod is deleted is replaced, and the run goes on.
    let victim = format!("{VLLM_RUN}-engine-0");
    let old_uid = kubelet
        .processes()
        .into_iter()
        .find(|p| p.pod == victim)
        .expect("engine-0 runs")
        .uid;
    kubelet.kill(&victim);
    ns.kubectl(&["delete", "pod", &victim, "--wait=false"]);
    let step_at_kill = step_of(&status(&ns, VLLM_RUN));
    wait_status(
        (&ns, VLLM_RUN),
        &kubelet,
        Duration::from_secs(600),
        "3 steps after the vLLM engine was killed",
        |s| step_of(s) >= step_at_kill + 3,
    );
    assert!(
        kubelet
            .processes()
            .iter()
            .any(|p| p.pod == victim && p.running && p.uid != old_uid),
        "the replaced engine pod does not run"
    );
    println!("vLLM engine killed at step {step_at_kill}: replaced, the run went on");

    // kubectl scale adds a vLLM engine: two healthy engines behind the router, and the run goes on.
    ns.kubectl(&["scale", &format!("rlrun/{VLLM_RUN}"), "--replicas=2"]);
    let deadline = Instant::now() + Duration::from_secs(600);
    while healthy_engines(&http, &coordinator, &token).await < 2 {
        assert!(
            Instant::now() < deadline,
            "the second vLLM engine never became healthy: {}\n{}",
            router_engines(&http, &coordinator, &token).await,
            kubelet.logs_tail(&format!("{VLLM_RUN}-engine-1"), 30)
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let step_at_scale = step_of(&status(&ns, VLLM_RUN));
    let s = wait_status(
        (&ns, VLLM_RUN),
        &kubelet,
        Duration::from_secs(600),
        "2 steps with two vLLM engines",
        |s| step_of(s) >= step_at_scale + 2,
    );
    println!(
        "scaled to 2 vLLM engines at step {step_at_scale}: now step {}, version {}",
        s["step"], s["policyVersion"]
    );

    ns.kubectl(&["delete", "rlrun", VLLM_RUN, "--wait=false"]);
    kubelet.shutdown().await;
    drop(operator);
    let _ = std::fs::remove_dir_all(&root);
}

/// A vLLM engine pod's port (what `kubectl port-forward` or any pod reaches) is its front's: 401
/// without the run token on every route but `/health` and `/metrics`, vLLM's answers with it;
/// vLLM's own port is on the pod's loopback, out of reach.
async fn engine_pod_answers_only_its_run(http: &reqwest::Client, ns: &Namespace, token: &str) {
    let ip = pod_field_of(ns, VLLM_RUN, "engine", "status.podIP");
    let engine = format!("http://{ip}:8000");
    let generate =
        json!({"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2, "ignore_eos": true}});
    for (method, path) in [
        ("POST", "/pause"),
        ("POST", "/collective_rpc"),
        ("POST", "/update_weights"),
        ("POST", "/inference/v1/generate"),
        ("GET", "/v1/models"),
        ("GET", "/is_paused"),
    ] {
        let method = reqwest::Method::from_bytes(method.as_bytes()).unwrap();
        let r = (http.request(method, format!("{engine}{path}")))
            .json(&generate)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 401, "{path} without the run token");
        let wrong = (http.get(format!("{engine}{path}")))
            .header(TOKEN_HEADER, "Bearer not-the-token")
            .send()
            .await
            .unwrap();
        assert_eq!(wrong.status(), 401, "{path} with another token");
    }
    for open in ["/health", "/metrics"] {
        let r = http.get(format!("{engine}{open}")).send().await.unwrap();
        assert_eq!(r.status(), 200, "{open} is open to probes and scrapes");
    }
    let bearer = format!("Bearer {token}");
    let models = get_json(http, &format!("{engine}/v1/models"), token).await;
    assert_eq!(models["data"][0]["id"], VLLM_RUN, "{models}");
    let paused = get_json(http, &format!("{engine}/is_paused"), token).await;
    assert!(paused["is_paused"].is_boolean(), "{paused}");
    let r = (http.post(format!("{engine}/inference/v1/generate")))
        .header(TOKEN_HEADER, &bearer)
        .json(&generate)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "generate with the run token");
    let answer: Value = r.json().await.unwrap();
    assert_eq!(
        answer["choices"][0]["token_ids"].as_array().unwrap().len(),
        2,
        "{answer}"
    );
    // vLLM itself is not on the pod's address.
    let direct = http.get(format!("http://{ip}:8001/v1/models")).send().await;
    assert!(
        direct.is_err(),
        "vLLM answers on the pod's address: {direct:?}"
    );
    println!("vLLM engine pod: 401 without the run token, vLLM's answers with it");
}

const JUDGE_RUN: &str = "judged";

/// The LLM-as-judge recipe (examples/judge) as a cluster run: the policy learns from the judge
/// alone; one built-in engine for the policy, one for the judge.
fn judge_run_yaml() -> String {
    let root = Path::new(ROOT).join("examples");
    let r = root.display();
    let judge = std::fs::read_to_string(root.join("judge/rlrun.yaml")).unwrap();
    let prompt = judge
        .lines()
        .find_map(|l| l.trim().strip_prefix("prompt: "))
        .expect("the recipe's judge prompt");
    format!(
        r#"apiVersion: moult.dev/v1alpha1
kind: RLRun
metadata:
  name: {JUDGE_RUN}
spec:
  model: {{path: {r}/successor/model}}
  agent:
    form: Env
    image: local
    command: [python, {r}/successor/env.py]
    concurrency: 64
    timeout: 1m
    dataset: {{path: {r}/judge/tasks.jsonl}}
  engines: {{backend: Builtin, replicas: 1}}
  trainer: {{gpusPerNode: 0}}
  algorithm:
    estimator: GRPO
    groupSize: 8
    batchSize: 8
    maxStaleness: 1
    optimizer: {{learningRate: 1.0e-3, maxGradNorm: 1.0}}
  judge:
    path: {r}/judge/judge-model
    prompt: {prompt}
    agentWeight: 0
    maxTokens: 4
  rollout: {{maxTokens: 4, temperature: 1.0, maxTurns: 1}}
  checkpoint: {{claimName: checkpoints, intervalSteps: 100}}
  totalSteps: 500
"#
    )
}

/// `spec.judge` on a cluster: the operator makes the judge's engines, the coordinator asks them
/// about every reply of a batch before it goes to the trainer, and the trainer's step records
/// hold the judge's scores; the run advances.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the test control plane: bash scripts/test-cluster.sh up"]
async fn cluster_run_with_a_judge_scores_every_batch_and_advances() {
    let run = RecipeRun::start(
        "cluster-judge",
        "examples/judge/make_judge.py",
        "examples/judge/judge-model",
        &judge_run_yaml(),
        JUDGE_RUN,
    )
    .await;
    assert_eq!(
        pod_field_of(&run.ns, JUDGE_RUN, "judge", "status.phase"),
        "Running",
        "the judge's engine pod"
    );
    // Every step's reward is the judge's score alone (agentWeight 0), and the record says what
    // the judge found: its mean score, and the env's own reward beside it.
    let records = run.records();
    for r in &records {
        let (reward, judge) = (
            r["reward_mean"].as_f64().unwrap(),
            r["judge_score_mean"].as_f64(),
        );
        assert_eq!(Some(reward), judge, "the reward is the judge's score: {r}");
        assert!(r["agent_reward_mean"].is_number(), "{r}");
        assert_eq!(r["judge_failed"], 0, "{r}");
    }
    println!(
        "judged run at step {}: judge score {} (agent reward {}) at the last step",
        step_of(&status(&run.ns, JUDGE_RUN)),
        records.last().unwrap()["judge_score_mean"],
        records.last().unwrap()["agent_reward_mean"]
    );
    run.finish().await;
}

const TEACHER_RUN: &str = "distilled";

/// The distillation recipe (examples/distill) as a cluster run with its teacher served: one
/// built-in engine for the policy, one for the teacher, which the trainer never loads.
fn served_teacher_run_yaml() -> String {
    let r = Path::new(ROOT).join("examples");
    let r = r.display();
    format!(
        r#"apiVersion: moult.dev/v1alpha1
kind: RLRun
metadata:
  name: {TEACHER_RUN}
spec:
  model: {{path: {r}/successor/model}}
  agent:
    form: Env
    image: local
    command: [python, {r}/successor/env.py]
    concurrency: 32
    timeout: 1m
    dataset: {{path: {r}/successor/tasks.jsonl}}
  engines: {{backend: Builtin, replicas: 1}}
  trainer: {{gpusPerNode: 0}}
  algorithm:
    estimator: OnPolicyDistillation
    teacher: {{path: {r}/distill/teacher, replicas: 1}}
    groupSize: 4
    batchSize: 8
    maxStaleness: 1
    optimizer: {{learningRate: 3.0e-4, maxGradNorm: 1.0}}
  rollout: {{maxTokens: 4, temperature: 1.0, maxTurns: 3}}
  checkpoint: {{claimName: checkpoints, intervalSteps: 100}}
  totalSteps: 500
"#
    )
}

/// A served distillation teacher on a cluster: the operator makes the teacher's engines, the
/// coordinator has them score every token of a batch before it goes to the trainer (which has
/// no teacher of its own), and each step record holds the reverse KL to the teacher.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the test control plane: bash scripts/test-cluster.sh up"]
async fn cluster_run_with_a_served_teacher_distills_and_advances() {
    let run = RecipeRun::start(
        "cluster-teacher",
        "examples/distill/make_teacher.py",
        "examples/distill/teacher",
        &served_teacher_run_yaml(),
        TEACHER_RUN,
    )
    .await;
    assert_eq!(
        pod_field_of(&run.ns, TEACHER_RUN, "teacher", "status.phase"),
        "Running",
        "the teacher's engine pod"
    );
    let trainer_env = run.ns.kubectl(&[
        "get",
        "pod",
        &format!("{TEACHER_RUN}-trainer-0"),
        "-o",
        "jsonpath={.spec.containers[0].env[*].name}",
    ]);
    assert!(!trainer_env.contains("MOULT_TEACHER"), "{trainer_env}");
    let records = run.records();
    for r in &records {
        let kl = r["teacher_kl"]
            .as_f64()
            .expect("teacher_kl in every record");
        assert!(kl.is_finite(), "{r}");
        assert!(r["teacher_seconds"].is_number(), "{r}");
    }
    println!(
        "distilled run at step {}: teacher_kl {} -> {}",
        step_of(&status(&run.ns, TEACHER_RUN)),
        records[0]["teacher_kl"],
        records.last().unwrap()["teacher_kl"]
    );
    run.finish().await;
}

const RANKS_RUN: &str = "ranked";

/// The successor recipe with two CPU trainer ranks, one pod each, and a checkpoint every 2 steps.
fn two_rank_run_yaml() -> String {
    run_yaml()
        .replace(&format!("name: {RUN}"), &format!("name: {RANKS_RUN}"))
        .replace(
            "trainer: {gpusPerNode: 0, dumpRollouts: true}",
            "trainer: {nodes: 2, gpusPerNode: 0}",
        )
}

/// Two trainer pods (`trainer.nodes: 2`, docs/distributed.md) rendezvous at pod 0 through the
/// headless Service, train every step together (each record says `trainer_world_size: 2`), and
/// when rank 1's process is killed the pair starts again from the newest checkpoint and the run
/// goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the test control plane: bash scripts/test-cluster.sh up"]
async fn cluster_run_with_two_trainer_ranks_trains_and_survives_a_killed_rank() {
    let run = RecipeRun::start(
        "cluster-ranks",
        "examples/successor/make_model.py",
        "examples/successor/model",
        &two_rank_run_yaml(),
        RANKS_RUN,
    )
    .await;
    for rank in 0..2 {
        assert_eq!(
            run.ns.kubectl(&[
                "get",
                "pod",
                &format!("{RANKS_RUN}-trainer-{rank}"),
                "-o",
                "jsonpath={.status.phase}",
            ]),
            "Running",
            "trainer pod {rank}"
        );
    }
    for r in &run.records() {
        assert_eq!(r["trainer_world_size"], 2, "{r}");
    }
    let before = step_of(&status(&run.ns, RANKS_RUN));
    run.kubelet.kill(&format!("{RANKS_RUN}-trainer-1"));
    wait_status(
        (&run.ns, RANKS_RUN),
        &run.kubelet,
        Duration::from_secs(300),
        "3 steps after rank 1 was killed",
        |s| step_of(s) >= before + 3,
    );
    let records = run.records();
    assert!(records.iter().all(|r| r["trainer_world_size"] == 2));
    println!(
        "two trainer ranks: step {before} when rank 1 was killed, step {} now",
        step_of(&status(&run.ns, RANKS_RUN))
    );
    run.finish().await;
}

/// A run on the test cluster with its operator and kubelet (a judge's, a served teacher's, two
/// trainer ranks'), after three committed steps.
struct RecipeRun {
    ns: Namespace,
    name: &'static str,
    root: PathBuf,
    checkpoints: PathBuf,
    kubelet: Kubelet,
    operator: Operator,
}

impl RecipeRun {
    /// Makes the recipe's policy and the model of `script OUT` (a scorer's, paths from the
    /// repository), applies `yaml` in namespace `ns` and waits for three steps.
    async fn start(
        ns: &str,
        script: &str,
        model: &str,
        yaml: &str,
        name: &'static str,
    ) -> RecipeRun {
        let _ = rustls::crypto::ring::default_provider().install_default();
        ensure_model();
        let made = std::process::Command::new(
            std::env::var("MOULT_PYTHON").unwrap_or_else(|_| "python3".into()),
        )
        .arg(Path::new(ROOT).join(script))
        .arg(Path::new(ROOT).join(model))
        .status()
        .unwrap_or_else(|e| panic!("run {script}: {e}"));
        assert!(made.success(), "{script} failed");
        cluster();
        let ns = Namespace::new(ns);
        let root = std::env::temp_dir().join(format!("moult-cluster-run-{}", ns.name));
        let _ = std::fs::remove_dir_all(&root);
        let checkpoints = ns.bound_claim("checkpoints", &root.join("claims/checkpoints"));
        let operator = Operator::start(&ns, name);
        let kubelet = start_kubelet(
            &ns,
            &root,
            BTreeMap::from([("checkpoints".to_string(), checkpoints.clone())]),
            BTreeMap::new(),
            Vec::new(),
        )
        .await;
        ns.apply(yaml);
        wait_status(
            (&ns, name),
            &kubelet,
            Duration::from_secs(300),
            "3 scored steps",
            |s| step_of(s) >= 3,
        );
        RecipeRun {
            ns,
            name,
            root,
            checkpoints,
            kubelet,
            operator,
        }
    }

    /// The step records the trainer wrote to the checkpoint claim (three at least).
    fn records(&self) -> Vec<Value> {
        let metrics =
            std::fs::read_to_string(self.checkpoints.join(self.name).join("metrics.jsonl"))
                .unwrap();
        let records: Vec<Value> = metrics
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert!(records.len() >= 3, "{metrics}");
        records
    }

    async fn finish(self) {
        self.ns
            .kubectl(&["delete", "rlrun", self.name, "--wait=false"]);
        self.kubelet.shutdown().await;
        drop(self.operator);
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

const CODE_RUN: &str = "code";

/// The code recipe (examples/code) as a cluster run whose model-written code runs in sandbox
/// pods of kubernetes-sigs/agent-sandbox (`spec.agent.sandbox`), whose controller runs beside
/// the test control plane: a small warm pool, eight episodes at once. Every fourth task names an
/// image of its own (its episodes get a pod made for them, not one of the pool).
fn sandboxed_run_yaml() -> String {
    let r = Path::new(ROOT).join("examples/code");
    // Not under /tmp, which the test kubelet maps to each pod's own.
    let tasks = Path::new(env!("CARGO_TARGET_TMPDIR")).join("sandboxed-tasks.jsonl");
    let text = std::fs::read_to_string(r.join("tasks.jsonl")).unwrap();
    let lines = text.lines().enumerate().map(|(i, line)| {
        let mut task: Value = serde_json::from_str(line).unwrap();
        if i % 4 == 0 {
            task["image"] = "python:3.13-slim".into();
        }
        format!("{task}\n")
    });
    std::fs::write(&tasks, lines.collect::<String>()).unwrap();
    let (r, tasks) = (r.display(), tasks.display());
    format!(
        r#"apiVersion: moult.dev/v1alpha1
kind: RLRun
metadata:
  name: {CODE_RUN}
spec:
  model: {{path: {r}/model}}
  agent:
    form: Env
    image: local
    command: [python, {r}/env.py]
    concurrency: 8
    timeout: 2m
    dataset: {{path: {tasks}}}
    sandbox: {{warmPool: 4}}
  engines: {{backend: Builtin, replicas: 1}}
  trainer: {{gpusPerNode: 0}}
  algorithm:
    estimator: GRPO
    groupSize: 8
    batchSize: 8
    maxStaleness: 1
    optimizer: {{learningRate: 1.0e-3, maxGradNorm: 1.0}}
  rollout: {{maxTokens: 6, temperature: 1.0, maxTurns: 1}}
  checkpoint: {{claimName: checkpoints, intervalSteps: 100}}
  totalSteps: 500
"#
    )
}

/// `spec.agent.sandbox` on a cluster with agent-sandbox: the operator makes the run's
/// SandboxTemplate and SandboxWarmPool; each episode's `moult.sandbox.run` claims a pod of the
/// pool, runs there (a `moult sandbox --serve` process of the test kubelet), and the claim is
/// deleted when the episode ends; the run trains on the rewards those pods' runs earn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the test control plane: bash scripts/test-cluster.sh up"]
async fn cluster_run_with_sandbox_pods_claims_one_per_episode_and_releases_it() {
    let run = RecipeRun::start(
        "cluster-sandbox",
        "examples/code/make_model.py",
        "examples/code/model",
        &sandboxed_run_yaml(),
        CODE_RUN,
    )
    .await;
    let uid = run
        .ns
        .kubectl(&["get", "rlrun", CODE_RUN, "-o", "jsonpath={.metadata.uid}"]);
    for kind in ["sandboxtemplate", "sandboxwarmpool"] {
        let owner = run.ns.kubectl(&[
            "get",
            kind,
            "code-sandbox",
            "-o",
            "jsonpath={.metadata.ownerReferences[0].uid}",
        ]);
        assert_eq!(owner, uid, "the run owns its {kind}");
    }
    // Three steps of 64 episodes each claimed a pod and gave it back: what is claimed now is
    // at most the episodes running.
    let log = run.kubelet.logs_tail("code-agents", 100_000);
    let claimed = log.matches("claimed SandboxClaim/").count();
    let released = log.matches("released SandboxClaim/").count();
    assert!(
        claimed >= 2 * 64,
        "{claimed} claims in the agents' log:\n{log}"
    );
    assert!(
        released + 8 >= claimed,
        "{claimed} claimed, {released} released:\n{log}"
    );
    let live = run.ns.kubectl(&[
        "get",
        "sandboxclaims,sandboxes",
        "-l",
        "moult.dev/agent-pod",
        "-o",
        "name",
    ]);
    assert!(live.lines().count() <= 8, "claims left: {live}");
    // Tasks with an image of their own got a Sandbox made for them, and gave it back too.
    let made = log.matches("claimed Sandbox/").count();
    let gone = log.matches("released Sandbox/").count();
    assert!(
        made >= 16 && gone + 8 >= made,
        "{made} sandboxes made, {gone} released"
    );
    // The rewards came from the sandbox pods' runs of the model's code.
    let records = run.records();
    let best = records
        .iter()
        .filter_map(|r| r["reward_mean"].as_f64())
        .fold(0.0, f64::max);
    assert!(best > 0.0, "no episode passed a test: {records:?}");
    // How long an episode waited for its pod, from the agents' log (docs/benchmarks.md).
    let waits = |kind: &str| {
        let mut ms: Vec<u64> = (log.lines())
            .filter(|l| l.contains(&format!("claimed {kind}/")))
            .filter_map(|l| l.rsplit(" in ").next()?.strip_suffix(" ms")?.parse().ok())
            .collect();
        ms.sort_unstable();
        (
            ms.get(ms.len() / 2).copied(),
            ms.get(ms.len() * 9 / 10).copied(),
        )
    };
    println!(
        "sandboxed run: {claimed} claims ({released} released), {made} sandboxes of a task's image ({gone} released), best step reward {best:.3}; claim wait median/p90 {:?} ms, task-image sandbox {:?} ms",
        waits("SandboxClaim"),
        waits("Sandbox")
    );
    run.finish().await;
}

const HOSTILE_RUN: &str = "hostile";

/// A run whose agent is hostile (tests/python/agents/hostile_env.py): every episode first looks
/// for what earlier ones left, then does one hostile thing, in turn over the tasks: a `setsid`
/// daemon, a fork bomb, a memory hog, an endless loop, a disk filler, writes to moult's package,
/// its own code and /tmp, connections to the run's ports and outside, reads of credentials.
fn hostile_run_yaml() -> String {
    let successor = recipe();
    let kinds = [
        "daemon", "forkbomb", "memory", "loop", "disk", "tamper", "probe", "secrets",
    ];
    let tasks = Path::new(env!("CARGO_TARGET_TMPDIR")).join("hostile-tasks.jsonl");
    let lines: String = (0..64)
        .map(|i| format!("{}\n", json!({"kind": kinds[i % kinds.len()]})))
        .collect();
    std::fs::write(&tasks, lines).unwrap();
    let env = Path::new(ROOT).join("tests/python/agents/hostile_env.py");
    let (successor, tasks, env) = (successor.display(), tasks.display(), env.display());
    format!(
        r#"apiVersion: moult.dev/v1alpha1
kind: RLRun
metadata:
  name: {HOSTILE_RUN}
spec:
  model: {{path: {successor}/model}}
  agent:
    form: Env
    image: local
    command: [python, {env}]
    concurrency: 8
    timeout: 1m
    isolation: Episode
    limits: {{cpuSeconds: 5, memory: 1Gi, processes: 64, fileSize: 16Mi, scratch: 32Mi}}
    dataset: {{path: {tasks}}}
  engines: {{backend: Builtin, replicas: 1}}
  trainer: {{gpusPerNode: 0}}
  algorithm:
    estimator: GRPO
    groupSize: 4
    batchSize: 4
    maxStaleness: 1
    optimizer: {{learningRate: 1.0e-3, maxGradNorm: 1.0}}
  rollout: {{maxTokens: 4, temperature: 1.0, maxTurns: 1}}
  checkpoint: {{claimName: checkpoints, intervalSteps: 100}}
  totalSteps: 500
"#
    )
}

/// Hostile agent code on the agent-pod path: each episode's program runs in a jail made in the
/// agent pod's `sandbox` container. Episodes that hit a limit fail and their groups are dropped;
/// the run goes on, and every episode that completed found nothing of the others and got nothing
/// out of its jail (reward 1 at every step); the daemons die with their episodes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the test control plane: bash scripts/test-cluster.sh up"]
async fn cluster_run_with_hostile_agent_code_contains_every_episode_and_goes_on() {
    let run = RecipeRun::start(
        "cluster-hostile",
        "examples/successor/make_model.py",
        "examples/successor/model",
        &hostile_run_yaml(),
        HOSTILE_RUN,
    )
    .await;
    // The episodes that hit a limit failed and said which; the run went on without them.
    let started = Instant::now();
    let log = loop {
        let log = run.kubelet.logs_tail("hostile-coordinator", 100_000);
        if log.contains("limits.cpuSeconds") || started.elapsed() > Duration::from_secs(180) {
            break log;
        }
        std::thread::sleep(Duration::from_secs(1));
    };
    assert!(
        log.contains("limits.cpuSeconds"),
        "no episode failed at its CPU limit:\n{log}"
    );
    let records = run.records();
    for r in &records {
        assert_eq!(
            r["reward_mean"], 1.0,
            "an episode saw another's traces or got out: {r}"
        );
    }
    // No daemon outlived its episode: at most the episodes running hold one.
    let daemons = std::process::Command::new("pgrep")
        .args(["-f", "hostile-daemon"])
        .output()
        .unwrap();
    let alive = String::from_utf8_lossy(&daemons.stdout).lines().count();
    assert!(alive <= 8, "{alive} daemons alive");
    println!(
        "hostile run: {} steps, every one at reward 1; {alive} daemons alive",
        records.len()
    );
    run.finish().await;
}

const SUSPEND_RUN: &str = "suspended";

/// The successor recipe with CPU requests (what `status.usage` counts), one engine, no evaluation,
/// and checkpoints only every 100 steps: the checkpoint a suspend resumes from is the one the
/// trainer writes when it stops.
fn suspend_run_yaml() -> String {
    small_run_yaml(SUSPEND_RUN)
}

/// The successor recipe as run `name` with CPU requests (what `status.usage` counts), one engine
/// (one GPU), no evaluation, and checkpoints only every 100 steps (so that the checkpoint a run
/// resumes from is the one its trainer writes when it stops).
fn small_run_yaml(name: &str) -> String {
    let mut yaml = run_yaml();
    for (from, to) in [
        (format!("name: {RUN}"), format!("name: {name}")),
        (
            "replicas: 2}".into(),
            "replicas: 1, resources: {requests: {cpu: 500m}}}".into(),
        ),
        (
            "dumpRollouts: true}".into(),
            "resources: {requests: {cpu: \"1\"}}}".into(),
        ),
        (
            "claimName: checkpoints, intervalSteps: 2".into(),
            "claimName: checkpoints, intervalSteps: 100".into(),
        ),
    ] {
        assert!(yaml.contains(&from), "{from} in the recipe's run");
        yaml = yaml.replace(&from, &to);
    }
    yaml.lines()
        .filter(|l| !l.starts_with("  eval:"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// `spec.suspend: true` stops every pod of a run that has trained some steps; the trainer
/// checkpoints the last step it trained as it stops, though no interval checkpoint is due; the
/// status says Suspended, and `status.usage` stays flat. `suspend: false` resumes the run at the
/// step after that one: every step in metrics.jsonl once, none lost, and usage grows again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the test control plane: bash scripts/test-cluster.sh up"]
async fn cluster_run_suspended_and_resumed_trains_every_step_once_and_counts_no_usage_meanwhile() {
    let run = RecipeRun::start(
        "cluster-suspend",
        "examples/successor/make_model.py",
        "examples/successor/model",
        &suspend_run_yaml(),
        SUSPEND_RUN,
    )
    .await;
    let (ns, kubelet) = (&run.ns, &run.kubelet);
    let cpu_seconds = |s: &Value, role: &str| {
        s["usage"]["roles"][role]["cpuSeconds"]
            .as_f64()
            .unwrap_or(0.0)
    };
    let s = wait_status(
        (ns, SUSPEND_RUN),
        kubelet,
        Duration::from_secs(150),
        "usage of the trainer",
        |s| cpu_seconds(s, "trainer") > 0.0,
    );
    assert_eq!(s["usage"]["roles"]["trainer"]["cpus"], 1.0, "{s}");
    assert_eq!(s["usage"]["roles"]["engines"]["cpus"], 0.5, "{s}");
    let wide = ns.kubectl(&["get", "rlrun", SUSPEND_RUN, "-o", "wide"]);
    assert!(wide.contains("GPU-HOURS"), "{wide}");
    println!("$ kubectl get rlrun {SUSPEND_RUN} -o wide\n{wide}");

    set_suspend(ns, SUSPEND_RUN, true);
    let suspended = wait_status(
        (ns, SUSPEND_RUN),
        kubelet,
        Duration::from_secs(120),
        "a suspended run",
        |s| s["phase"] == "Suspended" && s["usage"]["roles"]["trainer"]["cpus"] == 0.0,
    );
    let selector = format!("moult.dev/run={SUSPEND_RUN}");
    let deadline = Instant::now() + Duration::from_secs(60);
    while !ns
        .kubectl(&["get", "pods", "-l", &selector, "-o", "name"])
        .trim()
        .is_empty()
    {
        assert!(
            Instant::now() < deadline,
            "pods still there while suspended"
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    let conditions = suspended["conditions"].as_array().unwrap();
    let condition = conditions
        .iter()
        .find(|c| c["type"] == "Suspended")
        .unwrap();
    assert_eq!(condition["status"], "True", "{suspended}");
    assert!(condition["lastTransitionTime"].is_string(), "{suspended}");
    let trained = stop_checkpoint(&run.checkpoints, SUSPEND_RUN, kubelet);
    // Nothing runs: usage stays as it was, whatever the operator reconciles meanwhile.
    let before = status(ns, SUSPEND_RUN)["usage"]["roles"].clone();
    std::thread::sleep(Duration::from_secs(5));
    ns.kubectl(&[
        "annotate",
        "rlrun",
        SUSPEND_RUN,
        "--overwrite",
        "moult.dev/test=reconcile",
    ]);
    std::thread::sleep(Duration::from_secs(5));
    let after = status(ns, SUSPEND_RUN)["usage"]["roles"].clone();
    assert_eq!(before, after, "usage while suspended");
    for args in [
        vec!["get", "rlrun", SUSPEND_RUN, "-o", "wide"],
        vec![
            "get",
            "rlrun",
            SUSPEND_RUN,
            "-o",
            "jsonpath={.status.conditions[?(@.type==\"Suspended\")]}",
        ],
        vec![
            "get",
            "rlrun",
            SUSPEND_RUN,
            "-o",
            "jsonpath={.status.usage}",
        ],
    ] {
        println!("$ kubectl {}\n{}", args.join(" "), ns.kubectl(&args));
    }

    set_suspend(ns, SUSPEND_RUN, false);
    let resumed = wait_status(
        (ns, SUSPEND_RUN),
        kubelet,
        Duration::from_secs(300),
        "two steps after the resume",
        |s| {
            step_of(s) >= trained + 2
                && cpu_seconds(s, "trainer") > cpu_seconds(&suspended, "trainer")
        },
    );
    let steps: Vec<u64> = run
        .records()
        .iter()
        .map(|r| r["step"].as_u64().unwrap())
        .collect();
    assert_eq!(
        steps,
        (1..=steps.len() as u64).collect::<Vec<_>>(),
        "every step once, none lost"
    );
    println!(
        "suspended after step {trained}, resumed to step {}; trainer CPU-seconds {:.0} then {:.0}",
        step_of(&resumed),
        cpu_seconds(&suspended, "trainer"),
        cpu_seconds(&resumed, "trainer"),
    );
    run.finish().await;
}

/// Kueue's objects for namespace `ns`: a ClusterQueue for it alone whose one GPU fits one run
/// (its engine), CPU and memory aplenty, preempting lower priorities; GPUs on the flavor of the
/// GPU pool (its node label, a toleration of its taint), the rest on a flavor of any node; the
/// namespace's LocalQueue `runs`; and two PriorityClasses, `low` and `high`.
fn kueue_objects(ns: &str, low: &str, high: &str) -> String {
    format!(
        r#"apiVersion: kueue.x-k8s.io/v1beta2
kind: ResourceFlavor
metadata: {{name: {ns}-gpu}}
spec:
  nodeLabels: {{moult.dev/test-pool: gpu}}
  tolerations: [{{key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}}]
---
apiVersion: kueue.x-k8s.io/v1beta2
kind: ResourceFlavor
metadata: {{name: {ns}-any}}
---
apiVersion: kueue.x-k8s.io/v1beta2
kind: ClusterQueue
metadata: {{name: {ns}}}
spec:
  namespaceSelector: {{matchLabels: {{kubernetes.io/metadata.name: {ns}}}}}
  preemption: {{withinClusterQueue: LowerPriority}}
  resourceGroups:
  - coveredResources: [nvidia.com/gpu]
    flavors:
    - name: {ns}-gpu
      resources: [{{name: nvidia.com/gpu, nominalQuota: 1}}]
  - coveredResources: [cpu, memory]
    flavors:
    - name: {ns}-any
      resources: [{{name: cpu, nominalQuota: 64}}, {{name: memory, nominalQuota: 512Gi}}]
---
apiVersion: kueue.x-k8s.io/v1beta2
kind: LocalQueue
metadata: {{name: runs, namespace: {ns}}}
spec: {{clusterQueue: {ns}}}
---
apiVersion: scheduling.k8s.io/v1
kind: PriorityClass
metadata: {{name: {low}}}
value: 100
---
apiVersion: scheduling.k8s.io/v1
kind: PriorityClass
metadata: {{name: {high}}}
value: 1000
"#
    )
}

/// `kubectl patch` of `run`'s `spec.suspend`.
fn set_suspend(ns: &Namespace, run: &str, suspend: bool) {
    let patch = format!(r#"{{"spec":{{"suspend":{suspend}}}}}"#);
    ns.kubectl(&["patch", "rlrun", run, "--type=merge", "-p", &patch]);
}

/// The step of the checkpoint the stopped trainer of `run` wrote: the last step it trained (as
/// many as its records), waited for while the process may still be writing it (its pod can be
/// gone from the API server before its process ends).
fn stop_checkpoint(checkpoints: &Path, run: &str, kubelet: &Kubelet) -> u64 {
    let latest = checkpoints.join(run).join("checkpoints/latest.json");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let trained = records_of(checkpoints, run).len() as u64;
        let step = std::fs::read(&latest)
            .ok()
            .and_then(|b| serde_json::from_slice::<Value>(&b).ok());
        if step.as_ref().is_some_and(|l| l["step"] == trained) {
            return trained;
        }
        assert!(
            Instant::now() < deadline,
            "the trainer of {run} did not checkpoint the last step it trained ({trained}): latest.json {step:?}\n{}",
            kubelet.logs_tail(&format!("{run}-trainer"), 30)
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The step records the trainer of `run` wrote to the checkpoint claim.
fn records_of(checkpoints: &Path, run: &str) -> Vec<Value> {
    let metrics =
        std::fs::read_to_string(checkpoints.join(run).join("metrics.jsonl")).unwrap_or_default();
    metrics
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// The names of the pods of `run`.
fn pods_of(ns: &Namespace, run: &str) -> String {
    ns.kubectl(&[
        "get",
        "pods",
        "-l",
        &format!("moult.dev/run={run}"),
        "-o",
        "name",
    ])
    .trim()
    .to_string()
}

/// Runs in a Kueue queue (Kueue built from its Go module, its manager beside the test control
/// plane): the first, of low priority, is admitted and trains; a second of the same priority
/// waits as one unit, with no pod and Kueue's reason in its status; a run of high priority
/// preempts the first, whose trainer checkpoints the last step it trained as its pods stop and
/// whose status says Preempted; once the high one is gone, the first is admitted again and goes
/// on at the next step, every step in its metrics.jsonl once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the test control plane: bash scripts/test-cluster.sh up"]
async fn cluster_run_in_a_kueue_queue_waits_as_one_is_preempted_and_resumes_where_it_stopped() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    ensure_model();
    cluster();
    let ns = Namespace::new("cluster-kueue");
    let root = std::env::temp_dir().join(format!("moult-cluster-run-{}", ns.name));
    let _ = std::fs::remove_dir_all(&root);
    let checkpoints = ns.bound_claim("checkpoints", &root.join("claims/checkpoints"));
    let operator = Operator::start(&ns, "kueue");
    let claims = BTreeMap::from([("checkpoints".to_string(), checkpoints.clone())]);
    let kubelet = start_kubelet(&ns, &root, claims, BTreeMap::new(), Vec::new()).await;
    let (low, high) = (format!("{}-low", ns.name), format!("{}-high", ns.name));
    ns.apply(&kueue_objects(&ns.name, &low, &high));
    let queued = |name: &str, class: &str| {
        let scheduling =
            format!("\n  scheduling: {{queueName: runs, priorityClassName: {class}}}\n");
        small_run_yaml(name) + &scheduling
    };
    ns.apply(&queued("first", &low));
    wait_status(
        (&ns, "first"),
        &kubelet,
        Duration::from_secs(300),
        "3 steps of the first run",
        |s| step_of(s) >= 3,
    );

    // A second run waits for the first's GPU, as one: no pod of it at all.
    ns.apply(&queued("second", &low));
    let ready_reason = |s: &Value| {
        let ready = s["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|c| c["type"] == "Ready");
        ready.map(|c| {
            (
                c["reason"].as_str().unwrap_or_default().to_string(),
                c["message"].as_str().unwrap_or_default().to_string(),
            )
        })
    };
    let second = wait_status(
        (&ns, "second"),
        &kubelet,
        Duration::from_secs(60),
        "the second run queued",
        |s| {
            s["phase"] == "Queued"
                && ready_reason(s).is_some_and(|(_, m)| m.contains("insufficient"))
        },
    );
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(pods_of(&ns, "second"), "", "a queued run has no pod");
    println!(
        "$ kubectl get rlrun second -o wide\n{}",
        ns.kubectl(&["get", "rlrun", "second", "-o", "wide"])
    );
    println!("second: {:?}", ready_reason(&second));
    println!(
        "$ kubectl get workloads\n{}",
        ns.kubectl(&["get", "workloads"])
    );
    ns.kubectl(&["delete", "rlrun", "second", "--wait=false"]);

    // A run of high priority preempts the first: its pods stop, its trainer checkpoints.
    ns.apply(&queued("urgent", &high));
    let preempted = wait_status(
        (&ns, "first"),
        &kubelet,
        Duration::from_secs(120),
        "the first run preempted",
        |s| s["phase"] == "Preempted",
    );
    let (reason, message) = ready_reason(&preempted).unwrap();
    assert_eq!(reason, "Preempted", "{preempted}");
    assert!(message.contains("Kueue evicted"), "{message}");
    let deadline = Instant::now() + Duration::from_secs(90);
    while !pods_of(&ns, "first").is_empty() {
        assert!(
            Instant::now() < deadline,
            "the first run's pods still there: {}",
            pods_of(&ns, "first")
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    let trained = stop_checkpoint(&checkpoints, "first", &kubelet);
    wait_status(
        (&ns, "urgent"),
        &kubelet,
        Duration::from_secs(300),
        "a step of the urgent run",
        |s| step_of(s) >= 1,
    );
    for args in [vec!["get", "rlrun", "-o", "wide"], vec!["get", "workloads"]] {
        println!("$ kubectl {}\n{}", args.join(" "), ns.kubectl(&args));
    }

    // The urgent run gone, the first is admitted again and goes on at the next step.
    ns.kubectl(&["delete", "rlrun", "urgent", "--wait=false"]);
    let resumed = wait_status(
        (&ns, "first"),
        &kubelet,
        Duration::from_secs(300),
        "the first run resumed",
        |s| step_of(s) >= trained + 2,
    );
    assert_eq!(resumed["phase"], "Running", "{resumed}");
    let steps: Vec<u64> = records_of(&checkpoints, "first")
        .iter()
        .map(|r| r["step"].as_u64().unwrap())
        .collect();
    assert_eq!(
        steps,
        (1..=steps.len() as u64).collect::<Vec<_>>(),
        "every step once, none lost"
    );
    println!(
        "preempted after step {trained}; resumed to step {}",
        step_of(&resumed)
    );
    ns.kubectl(&["delete", "rlrun", "first", "--wait=false"]);
    kubelet.shutdown().await;
    drop(operator);
    for object in [
        format!("clusterqueue/{}", ns.name),
        format!("resourceflavor/{}-gpu", ns.name),
        format!("resourceflavor/{}-any", ns.name),
        format!("priorityclass/{low}"),
        format!("priorityclass/{high}"),
    ] {
        ns.kubectl(&["delete", &object, "--wait=false"]);
    }
    let _ = std::fs::remove_dir_all(&root);
}

/// The engine-pool recipe on the cluster (examples/successor/enginepool.yaml and its two runs,
/// docs/lora.md, "Engine pools"): one EnginePool of one built-in engine on the two-task base, and
/// two LoRA runs on it, one learning the successor task and one its reverse, 30 steps each.
fn pool_yaml() -> String {
    let r = recipe();
    let r = r.display();
    let run = |name: &str, tasks: &str| {
        format!(
            r#"---
apiVersion: moult.dev/v1alpha1
kind: RLRun
metadata:
  name: {name}
spec:
  model: {{path: {r}/model-pool, lora: {{rank: 8}}}}
  agent:
    form: Env
    image: local
    command: [python, {r}/env.py]
    concurrency: 64
    timeout: 1m
    dataset: {{path: {r}/{tasks}}}
  engines: {{poolRef: {{name: successor-pool}}}}
  trainer: {{gpusPerNode: 0}}
  algorithm:
    estimator: GRPO
    groupSize: 8
    batchSize: 8
    maxStaleness: 1
    optimizer: {{learningRate: 3.0e-3, maxGradNorm: 1.0}}
  rollout: {{maxTokens: 4, temperature: 1.0, maxTurns: 3}}
  checkpoint: {{claimName: checkpoints, intervalSteps: 100}}
  totalSteps: 30
"#
        )
    };
    format!(
        r#"apiVersion: moult.dev/v1alpha1
kind: EnginePool
metadata:
  name: successor-pool
spec:
  model: {{path: {r}/model-pool}}
  engines: {{backend: Builtin, replicas: 1}}
  maxAdapters: 8
  maxRank: 8
{}{}"#,
        run("pool-up", "tasks.jsonl"),
        run("pool-down", "tasks-down.jsonl")
    )
}

/// The pool's status.
fn pool_status(ns: &Namespace) -> Value {
    let text = ns.kubectl(&["get", "enginepool", "successor-pool", "-o", "json"]);
    serde_json::from_str(&text).expect("kubectl prints JSON")
}

/// The adapters the pool's engine serves, asked with the pool's token.
async fn pool_adapters(http: &reqwest::Client, ns: &Namespace) -> Vec<String> {
    let ip = pod_ip(ns, "successor-pool-engines-0");
    let token = ns.kubectl(&[
        "get",
        "secret",
        "successor-pool-pool",
        "-o",
        "jsonpath={.data.token}",
    ]);
    use base64::Engine as _;
    let token = base64::engine::general_purpose::STANDARD
        .decode(token.trim())
        .unwrap();
    let models = get_json(
        http,
        &format!("http://{ip}:8000/v1/models"),
        std::str::from_utf8(&token).unwrap(),
    )
    .await;
    (models["data"].as_array().into_iter().flatten())
        .filter(|m| m.get("parent").is_some())
        .map(|m| m["id"].as_str().unwrap().to_string())
        .collect()
}

/// Two LoRA runs on one EnginePool's built-in engine pod (docs/lora.md, "Engine pools"): both
/// learn their own task at once (rewards rising), each run's status shows its share of the pool
/// and the pool's status lists both; the engine holds each run's adapters (two versions at most);
/// deleting a run unloads its adapters; deleting the pool while a run still names it leaves it
/// Terminating, naming the run, which says PoolDeleting, until the run is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the test control plane: bash scripts/test-cluster.sh up"]
async fn cluster_two_runs_on_one_engine_pool_learn_their_tasks_and_share_it() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let dir = recipe();
    let made = std::process::Command::new(
        std::env::var("MOULT_PYTHON").unwrap_or_else(|_| "python3".into()),
    )
    .arg(dir.join("make_model.py"))
    .arg(dir.join("model-pool"))
    .arg("--both")
    .status()
    .expect("run make_model.py");
    assert!(made.success(), "make_model.py --both failed");
    cluster();
    let ns = Namespace::new("cluster-pool");
    let root = std::env::temp_dir().join(format!("moult-cluster-run-{}", ns.name));
    let _ = std::fs::remove_dir_all(&root);
    let checkpoints = ns.bound_claim("checkpoints", &root.join("claims/checkpoints"));
    let operator = Operator::start(&ns, "pool");
    let claims = BTreeMap::from([("checkpoints".to_string(), checkpoints.clone())]);
    let kubelet = start_kubelet(&ns, &root, claims, BTreeMap::new(), Vec::new()).await;
    ns.apply(&pool_yaml());
    for run in ["pool-up", "pool-down"] {
        wait_status(
            (&ns, run),
            &kubelet,
            Duration::from_secs(900),
            "30 steps",
            |s| step_of(s) >= 30 && s["pool"]["share"].is_number(),
        );
    }
    for run in ["pool-up", "pool-down"] {
        let rewards: Vec<f64> = (records_of(&checkpoints, run).iter())
            .map(|r| r["reward_mean"].as_f64().unwrap())
            .collect();
        let mean = |r: &[f64]| r.iter().sum::<f64>() / r.len() as f64;
        let (first, last) = (mean(&rewards[..3]), mean(&rewards[rewards.len() - 3..]));
        println!(
            "{run}: reward {first:.2} -> {last:.2} in {} steps",
            rewards.len()
        );
        assert!(
            first <= 0.4 && last >= first + 0.3,
            "{run} learns: {rewards:?}"
        );
        let s = status(&ns, run);
        let share = s["pool"]["share"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&share), "{run}'s share: {s}");
        assert_eq!(s["pool"]["name"], "successor-pool");
    }
    println!(
        "$ kubectl get enginepool\n{}",
        ns.kubectl(&["get", "enginepool", "-o", "wide"])
    );
    let runs: Vec<String> = (pool_status(&ns)["status"]["runs"]
        .as_array()
        .into_iter()
        .flatten())
    .map(|r| r["name"].as_str().unwrap().to_string())
    .collect();
    assert_eq!(runs, ["pool-down", "pool-up"]);
    // `kubectl get` prints every run on the pool in its Runs column.
    let table = ns.kubectl(&["get", "enginepool", "successor-pool"]);
    assert!(table.contains("pool-down,pool-up"), "{table}");
    let http = reqwest::Client::new();
    let adapters = pool_adapters(&http, &ns).await;
    for run in ["pool-up", "pool-down"] {
        let held = adapters
            .iter()
            .filter(|a| a.starts_with(&format!("{run}-v")))
            .count();
        assert!(
            (1..=2).contains(&held),
            "{run}'s adapters on the engine: {adapters:?}"
        );
    }

    // A deleted run's adapters go from the engine.
    ns.kubectl(&["delete", "rlrun", "pool-up", "--wait=false"]);
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let adapters = pool_adapters(&http, &ns).await;
        if !adapters.iter().any(|a| a.starts_with("pool-up-v")) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "pool-up's adapters stay: {adapters:?}"
        );
        std::thread::sleep(Duration::from_millis(500));
    }

    // A pool that a run still names is not deleted while it does.
    ns.kubectl(&["delete", "enginepool", "successor-pool", "--wait=false"]);
    std::thread::sleep(Duration::from_secs(5));
    let pool = pool_status(&ns);
    assert!(pool["metadata"]["deletionTimestamp"].is_string(), "{pool}");
    let deleting = (pool["status"]["conditions"]
        .as_array()
        .into_iter()
        .flatten())
    .find(|c| c["type"] == "Deleting")
    .unwrap_or_else(|| panic!("a Deleting condition: {pool}"));
    assert!(
        deleting["message"].as_str().unwrap().contains("pool-down"),
        "{deleting}"
    );
    wait_status(
        (&ns, "pool-down"),
        &kubelet,
        Duration::from_secs(60),
        "PoolDeleting",
        |s| {
            (s["conditions"].as_array().into_iter().flatten())
                .any(|c| c["type"] == "Ready" && c["reason"] == "PoolDeleting")
        },
    );
    ns.kubectl(&["delete", "rlrun", "pool-down", "--wait=false"]);
    let deadline = Instant::now() + Duration::from_secs(120);
    while !ns
        .kubectl(&["get", "enginepool", "--ignore-not-found", "-o", "name"])
        .trim()
        .is_empty()
    {
        assert!(
            Instant::now() < deadline,
            "the pool stays once no run names it"
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    kubelet.shutdown().await;
    drop(operator);
    let _ = std::fs::remove_dir_all(&root);
}
