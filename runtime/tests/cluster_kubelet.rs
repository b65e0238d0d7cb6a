//! The local kubelet ([`support::kubelet`]) runs the pods the real operator makes for an RLRun:
//! every pod gets a process, started the way its spec says (args, env, volumes, addresses), with
//! the pod's identity, restarted when it dies and stopped when its pod is deleted. A stand-in for
//! `moult` records how it was started, so the test checks the translation, not the runtime.

mod support;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Pod, Secret};
use kube::api::{Api, DeleteParams};

use support::kubelet::{Kubelet, KubeletOptions, ProcessInfo};
use support::{cluster, eventually, repository, Namespace, Operator};

const RUN: &str = "kl";

/// A built-in engine pool of two, a CPU trainer with a checkpoint claim, an external env agent.
fn run_yaml() -> String {
    format!(
        r#"apiVersion: moult.dev/v1alpha1
kind: RLRun
metadata:
  name: {RUN}
spec:
  model: {{path: Qwen/Qwen3-0.6B}}
  agent:
    form: Env
    image: example.com/successor-env:test
    command: [python, env.py]
    dataset: {{path: tasks.jsonl}}
  engines: {{backend: Builtin, replicas: 2}}
  trainer: {{gpusPerNode: 0}}
  checkpoint: {{claimName: checkpoints}}
  totalSteps: 10
"#
    )
}

/// Stands in for `moult`: writes its args and some env vars to `report-<pid>.txt` in its working
/// folder (the pod's, which its containers share), notes SIGTERM there and takes a second to exit (as a server drains), and otherwise
/// idles (in a child, as real programs have some).
const STAND_IN: &str = r#"#!/usr/bin/env bash
{
  printf 'arg=%s\n' "$@"
  for v in MOULT_TOKEN MOULT_AGENT_TOKEN POD_IP MOULT_CONFIG MOULT_MODEL MOULT_CHECKPOINTS MOULT_COORDINATOR \
           MOULT_ENGINES MASTER_ADDR RANK HOME KUBECONFIG MOULT_AGENT_SANDBOX; do
    if [ -n "${!v+x}" ]; then printf 'env %s=%s\n' "$v" "${!v}"; fi
  done
} > report-$$.tmp && mv report-$$.tmp report-$$.txt
trap 'echo TERM >> report-$$.txt; sleep 1; exit 0' TERM
sleep 1000 &
wait
"#;

/// What the stand-in recorded.
#[derive(Debug)]
struct Report {
    args: Vec<String>,
    env: BTreeMap<String, String>,
    text: String,
}

impl Report {
    fn path(process: &ProcessInfo) -> PathBuf {
        process.dir.join(format!("report-{}.txt", process.pid))
    }

    fn read(process: &ProcessInfo) -> Option<Report> {
        let text = std::fs::read_to_string(Self::path(process)).ok()?;
        let args = text
            .lines()
            .filter_map(|l| l.strip_prefix("arg="))
            .map(String::from)
            .collect();
        let env = text
            .lines()
            .filter_map(|l| l.strip_prefix("env ")?.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Some(Report { args, env, text })
    }

    /// The argument after `flag`.
    fn flag(&self, flag: &str) -> Option<&str> {
        let i = self.args.iter().position(|a| a == flag)?;
        self.args.get(i + 1).map(String::as_str)
    }
}

/// The running process of the live pod whose name starts with `prefix`: of its main container,
/// not of an agent pod's `sandbox` ([`sandbox`]).
fn live(kubelet: &Kubelet, prefix: &str) -> Option<ProcessInfo> {
    running(kubelet, prefix, |c| c != "sandbox")
}

/// The running process of the `sandbox` container of the live pod whose name starts with `prefix`.
fn sandbox(kubelet: &Kubelet, prefix: &str) -> Option<ProcessInfo> {
    running(kubelet, prefix, |c| c == "sandbox")
}

fn running(
    kubelet: &Kubelet,
    prefix: &str,
    container: impl Fn(&str) -> bool,
) -> Option<ProcessInfo> {
    kubelet.processes().into_iter().find(|p| {
        p.pod.starts_with(prefix) && container(&p.container) && p.running && !p.terminating
    })
}

/// Processes of the group `pgid` that are not zombies (from /proc).
fn live_in_group(pgid: u32) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| {
            let pid: u32 = e.file_name().to_str()?.parse().ok()?;
            let stat = std::fs::read_to_string(e.path().join("stat")).ok()?;
            // pid (comm) state ppid pgrp ...: comm may hold spaces, so split after its ')'.
            let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
            (fields.first() != Some(&"Z") && fields.get(2)? == &pgid.to_string()).then_some(pid)
        })
        .collect()
}

fn assert_config_file(path: &str, what: &str) {
    let text = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{what}: the config {path} is not a local file: {e}"));
    let yaml: serde_yaml_ng::Value = serde_yaml_ng::from_str(&text).expect("the config is YAML");
    assert_eq!(yaml["kind"].as_str(), Some("RLRun"), "{what}: {path}");
    assert_eq!(
        yaml["metadata"]["name"].as_str(),
        Some(RUN),
        "{what}: {path}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the test control plane: bash scripts/test-cluster.sh up"]
async fn cluster_kubelet_runs_the_operators_pod_specs() {
    let began = Instant::now();
    let ns = Namespace::new("cluster_kubelet");
    let client = cluster().client().await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns.name);
    let root = Path::new(env!("CARGO_TARGET_TMPDIR")).join(&ns.name);
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(&root).unwrap();
    let checkpoints = ns.bound_claim("checkpoints", &root.join("claims/checkpoints"));
    let stand_in = root.join("stand-in-moult");
    std::fs::write(&stand_in, STAND_IN).unwrap();
    std::process::Command::new("chmod")
        .arg("755")
        .arg(&stand_in)
        .status()
        .unwrap();

    let operator = Operator::start(&ns, "kubelet-test");
    ns.apply(&run_yaml());
    let binaries = ["moult", "/opt/moult/bin/moult"].map(|c| (c.to_string(), stand_in.clone()));
    let kubelet = Kubelet::start(
        client.clone(),
        &ns.name,
        KubeletOptions {
            root: root.join("kubelet"),
            binaries: binaries.into(),
            claims: [("checkpoints".to_string(), checkpoints.clone())].into(),
            env: Vec::new(),
            kubeconfig: Some(cluster().kubeconfig.clone()),
            image: vec![repository()],
        },
    )
    .await;

    // Every pod of the run gets a process, which reports how it was started.
    let prefixes = [
        "engine-0",
        "engine-1",
        "trainer-0",
        "coordinator-",
        "agents-",
    ]
    .map(|p| format!("{RUN}-{p}"));
    let started = Instant::now();
    eventually(
        Duration::from_secs(120),
        "a process in every pod of the run",
        || {
            prefixes
                .iter()
                .all(|p| live(&kubelet, p).is_some_and(|info| Report::path(&info).exists()))
        },
    )
    .await;
    println!(
        "every pod of the run has a process {:.1?} after the RLRun",
        started.elapsed()
    );
    let mut reports: BTreeMap<String, (ProcessInfo, Report, String)> = BTreeMap::new();
    for prefix in &prefixes {
        let info = live(&kubelet, prefix).unwrap();
        let report = Report::read(&info).unwrap();
        let pod = pods.get(&info.pod).await.unwrap();
        let ip = pod.status.and_then(|s| s.pod_ip).expect("a pod IP");
        println!(
            "{:<24} {ip:<12} pid {:<7} {:?}",
            info.pod, info.pid, report.args
        );
        reports.insert(prefix.trim_end_matches('-').to_string(), (info, report, ip));
    }
    let get = |k: &str| &reports[&format!("{RUN}-{k}")];
    let context = || kubelet.logs_tail(RUN, 20);

    let secret = Api::<Secret>::namespaced(client.clone(), &ns.name)
        .get(&format!("{RUN}-token"))
        .await
        .unwrap();
    let data = secret.data.unwrap();
    let key = |k: &str| String::from_utf8(data[k].0.clone()).unwrap();
    let (token, agent_token) = (key("token"), key("agent-token"));
    for (pod, (info, report, _)) in &reports {
        // Agent pods run untrusted code: they hold the agent credential alone and no API
        // credential; only the coordinator talks to the API server.
        let agents = pod.ends_with("-agents");
        let credentials = (
            report.env.get("MOULT_TOKEN"),
            report.env.get("MOULT_AGENT_TOKEN"),
        );
        if agents {
            assert_eq!(credentials, (None, Some(&agent_token)), "{pod}");
        } else {
            assert_eq!(credentials, (Some(&token), None), "{pod}");
        }
        assert_eq!(
            report.env.contains_key("KUBECONFIG"),
            pod.ends_with("-coordinator"),
            "{pod}: KUBECONFIG"
        );
        let config = report.env.get("MOULT_CONFIG").expect("MOULT_CONFIG");
        assert_config_file(config, pod);
        if let Some(flag) = report.flag("--config") {
            assert_config_file(flag, pod);
        }
        // HOME=/tmp is the pod's own tmp emptyDir.
        assert_eq!(
            report.env.get("HOME").map(PathBuf::from),
            Some(info.dir.join("volumes/tmp"))
        );
    }
    for engine in ["engine-0", "engine-1"] {
        let (_, report, ip) = get(engine);
        assert_eq!(
            report.flag("--host"),
            Some(ip.as_str()),
            "{engine}: {:?}\n{}",
            report.args,
            context()
        );
    }
    let (_, coordinator, coordinator_ip) = get("coordinator");
    let coordinator_url = format!("http://{coordinator_ip}:8080");
    let (_, agents, _) = get("agents");
    assert_eq!(
        agents.flag("--coordinator"),
        Some(coordinator_url.as_str()),
        "{:?}",
        agents.args
    );
    let bare = format!("{RUN}-engine");
    assert_eq!(
        coordinator.env.get("MOULT_ENGINES"),
        Some(&bare),
        "a bare Service name is left alone"
    );
    let (trainer, trainer_report, trainer_ip) = get("trainer-0");
    let trainer_env = |k: &str| trainer_report.env.get(k).map(String::as_str);
    let claim = trainer_env("MOULT_CHECKPOINTS").map(Path::new);
    assert_eq!(
        claim,
        Some(checkpoints.as_path()),
        "the checkpoint claim's local folder"
    );
    assert_eq!(trainer_env("POD_IP"), Some(trainer_ip.as_str()));
    assert_eq!(
        trainer_env("MASTER_ADDR"),
        Some(trainer_ip.as_str()),
        "trainer-0's pod DNS name"
    );
    assert_eq!(
        trainer_env("MOULT_COORDINATOR"),
        Some(coordinator_url.as_str())
    );
    for report in [trainer_report, agents] {
        assert_eq!(
            report.env.get("MOULT_MODEL").map(String::as_str),
            Some("Qwen/Qwen3-0.6B")
        );
    }
    assert_eq!(
        trainer_env("RANK"),
        Some("0"),
        "RANK from the pod-index label"
    );

    // Agent code runs in the agent pod's second container, which holds no credential and no
    // config, and listens where the agent container is told to find it (their shared /tmp).
    let agents_pod = format!("{RUN}-agents-");
    eventually(Duration::from_secs(30), "the agent pod's sandbox", || {
        sandbox(&kubelet, &agents_pod).is_some_and(|info| Report::path(&info).exists())
    })
    .await;
    let sandboxed = Report::read(&sandbox(&kubelet, &agents_pod).unwrap()).unwrap();
    let tmp = reports[&format!("{RUN}-agents")].0.dir.join("volumes/tmp");
    let socket = tmp.join("moult-sandbox.sock").display().to_string();
    assert_eq!(sandboxed.args, ["sandbox", "--socket", socket.as_str()]);
    assert_eq!(
        sandboxed.env.keys().collect::<Vec<_>>(),
        ["HOME"],
        "{}",
        sandboxed.text
    );
    assert_eq!(sandboxed.env["HOME"], tmp.display().to_string());
    assert_eq!(agents.env.get("MOULT_AGENT_SANDBOX"), Some(&socket));

    // Each pod acts as the run's ServiceAccount, with the run's Role.
    let kubeconfig = coordinator
        .env
        .get("KUBECONFIG")
        .expect("a KUBECONFIG of the pod's own");
    let can_i = |args: &[&str]| {
        let out = cluster()
            .command("kubectl")
            .env("KUBECONFIG", kubeconfig)
            .args(["auth", "can-i"])
            .args(args)
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    };
    assert_eq!(
        can_i(&[
            "patch",
            &format!("rlruns.moult.dev/{RUN}"),
            "--subresource=status"
        ]),
        "yes"
    );
    assert_eq!(can_i(&["list", "endpointslices.discovery.k8s.io"]), "yes");
    assert_eq!(can_i(&["get", "secrets"]), "no");

    // A killed container is started again, like restartPolicy Always.
    let trainer_pod = format!("{RUN}-trainer-0");
    kubelet.kill(&trainer_pod);
    eventually(Duration::from_secs(20), "the trainer's restart", || {
        live(&kubelet, &trainer_pod).is_some_and(|p| p.restarts == 1 && p.pid != trainer.pid)
    })
    .await;
    let log = std::fs::read_to_string(kubelet.log_path(&trainer_pod).unwrap()).unwrap();
    assert!(log.contains("=== start 2 ==="), "{log}");
    assert!(log.contains("signal: 9"), "{log}");

    // A deleted pod's process gets SIGTERM; the StatefulSet's replacement (a new pod, same name)
    // gets a process of its own.
    let engine_pod = format!("{RUN}-engine-1");
    let (old, _, _) = get("engine-1");
    let deleted = Instant::now();
    pods.delete(&engine_pod, &DeleteParams::default())
        .await
        .unwrap();
    let (mut recreated, mut overlap) = (None, false);
    eventually(
        Duration::from_secs(60),
        "engine-1's replacement process",
        || {
            let all = kubelet.processes();
            let new = all
                .iter()
                .find(|p| p.pod == engine_pod && p.uid != old.uid && p.running);
            if new.is_some() {
                recreated.get_or_insert(deleted.elapsed());
                overlap |= all.iter().any(|p| p.uid == old.uid && p.running);
            }
            new.is_some_and(|p| Report::path(p).exists())
        },
    )
    .await;
    assert!(
        !overlap,
        "the replacement ran beside the old engine-1\n{}",
        context()
    );
    let old_report = Report::read(old).unwrap();
    assert!(
        old_report.text.ends_with("TERM\n"),
        "SIGTERM, not SIGKILL: {}",
        old_report.text
    );
    let new = live(&kubelet, &engine_pod).unwrap();
    let new_ip = pods
        .get(&engine_pod)
        .await
        .unwrap()
        .status
        .unwrap()
        .pod_ip
        .unwrap();
    let new_report = Report::read(&new).unwrap();
    assert_eq!(new_report.flag("--host"), Some(new_ip.as_str()));
    assert_ne!(new.dir, old.dir, "a new pod has folders of its own");
    println!(
        "engine-1 deleted: replacement process up {:.1?} later (pod {} -> {}, IP {} -> {new_ip})",
        recreated.unwrap(),
        &old.uid[..8],
        &new.uid[..8],
        get("engine-1").2,
    );

    // Shutting down leaves no process behind, children of the programs included.
    let all = kubelet.processes();
    kubelet.shutdown().await;
    eventually(
        Duration::from_secs(5),
        "every process group to be gone",
        || all.iter().all(|p| live_in_group(p.pid).is_empty()),
    )
    .await;
    drop(operator);
    drop(ns);
    let _ = std::fs::remove_dir_all(&root);
    println!(
        "{} processes run and stopped in {:.1?}",
        all.len(),
        began.elapsed()
    );
}
