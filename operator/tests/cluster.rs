//! The operator against a real control plane (etcd, kube-apiserver, controller-manager,
//! scheduler) with KWOK nodes: 4 fake 8-GPU nodes and 2 CPU nodes whose pods run.
//! Run with `bash scripts/test-cluster.sh up` then
//! `cargo test -p moult-operator --test cluster -- --ignored` (scripts/test.sh does both).

mod support;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use moult_operator::api::RLRun;
use support::{
    cluster, condition, helm, phase, small_run, wait_phase, wait_until, Namespace, Operator,
};

const T: Duration = Duration::from_secs(60);

fn running_pods(ns: &Namespace, selector: &str) -> usize {
    ns.kubectl(&[
        "get",
        "pods",
        "-l",
        selector,
        "--field-selector=status.phase=Running",
        "-o",
        "name",
    ])
    .lines()
    .count()
}

/// kind/name → resourceVersion of every child of `run` and of the run itself.
fn versions(ns: &Namespace, run: &str) -> BTreeMap<String, String> {
    let kinds = "configmaps,secrets,serviceaccounts,roles,rolebindings,networkpolicies,services,statefulsets,deployments";
    let out = ns.kubectl(&[
        "get",
        kinds,
        "-l",
        &format!("moult.dev/run={run}"),
        "-o",
        "jsonpath={range .items[*]}{.kind}/{.metadata.name}={.metadata.resourceVersion}{\"\\n\"}{end}",
    ]);
    let mut v: BTreeMap<String, String> = out
        .lines()
        .filter_map(|l| {
            l.split_once('=')
                .map(|(k, rv)| (k.to_string(), rv.to_string()))
        })
        .collect();
    v.insert(
        format!("RLRun/{run}"),
        ns.get(&format!("rlrun/{run}"), "{.metadata.resourceVersion}"),
    );
    v
}

/// PersistentVolumes for the example's claims (there is no provisioner in the test cluster).
fn volumes_for_example(ns: &Namespace) {
    let mut yaml = String::new();
    for (claim, mode, size) in [
        ("models", "ReadOnlyMany", "100Gi"),
        ("datasets", "ReadOnlyMany", "10Gi"),
        ("checkpoints", "ReadWriteOnce", "500Gi"),
    ] {
        yaml += &format!(
            "---\napiVersion: v1\nkind: PersistentVolume\nmetadata: {{name: {ns}-{claim}}}\nspec:\n  capacity: {{storage: {size}}}\n  accessModes: [{mode}]\n  hostPath: {{path: /tmp/{ns}-{claim}}}\n  claimRef: {{namespace: {ns}, name: {claim}}}\n  persistentVolumeReclaimPolicy: Delete\n",
            ns = ns.name
        );
    }
    let out = ns.apply(&yaml);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
#[ignore = "cluster: needs the test control plane (bash scripts/test-cluster.sh up)"]
fn cluster_example_reaches_running_on_gpu_nodes_with_every_child_owned() {
    let ns = Namespace::new("example");
    let _op = Operator::start(&ns, "a");
    volumes_for_example(&ns);
    let started = Instant::now();
    ns.kubectl(&["apply", "-f", support::example_path().to_str().unwrap()]);
    wait_phase(&ns, "gsm8k-grpo", "Running");
    eprintln!(
        "example: Running {:.1}s after kubectl apply",
        started.elapsed().as_secs_f64()
    );

    let uid = ns.get("rlrun/gsm8k-grpo", "{.metadata.uid}");
    let children = versions(&ns, "gsm8k-grpo");
    let expected = [
        "ConfigMap/gsm8k-grpo-config",
        "Secret/gsm8k-grpo-token",
        "ServiceAccount/gsm8k-grpo-moult",
        "Role/gsm8k-grpo-moult",
        "RoleBinding/gsm8k-grpo-moult",
        "NetworkPolicy/gsm8k-grpo-engine",
        "NetworkPolicy/gsm8k-grpo-trainer",
        "NetworkPolicy/gsm8k-grpo-coordinator",
        "NetworkPolicy/gsm8k-grpo-agents",
        "Service/gsm8k-grpo-engine",
        "Service/gsm8k-grpo-trainer",
        "Service/gsm8k-grpo-coordinator",
        "StatefulSet/gsm8k-grpo-engine",
        "StatefulSet/gsm8k-grpo-trainer",
        "Deployment/gsm8k-grpo-coordinator",
        "Deployment/gsm8k-grpo-agents",
    ];
    for e in expected {
        assert!(children.contains_key(e), "{e} exists: {children:?}");
        let (kind, name) = e.split_once('/').unwrap();
        let owner = ns.get(
            &format!("{}/{name}", kind.to_lowercase()),
            "{.metadata.ownerReferences[0].uid}",
        );
        assert_eq!(owner, uid, "{e} is owned by the run");
    }
    // Engines and the trainer sit on the GPU nodes, each engine with its 2 GPUs.
    let placed = ns.kubectl(&[
        "get",
        "pods",
        "-l",
        "moult.dev/run=gsm8k-grpo",
        "-o",
        "jsonpath={range .items[*]}{.metadata.labels.moult\\.dev/component} {.spec.nodeName} {.status.phase}{\"\\n\"}{end}",
    ]);
    let mut per_component = BTreeMap::<String, usize>::new();
    for line in placed.lines() {
        let f: Vec<&str> = line.split(' ').collect();
        assert_eq!(f[2], "Running", "{line}");
        if f[0] == "engine" || f[0] == "trainer" {
            assert!(f[1].starts_with("gpu-"), "{line}: GPU pods go to GPU nodes");
        }
        *per_component.entry(f[0].to_string()).or_default() += 1;
    }
    assert_eq!(per_component.get("engine"), Some(&4));
    assert_eq!(per_component.get("trainer"), Some(&1));
    assert_eq!(per_component.get("agents"), Some(&4));
    assert_eq!(per_component.get("coordinator"), Some(&1));

    let status = |t: &str| {
        ns.get(
            "rlrun/gsm8k-grpo",
            &format!("{{.status.conditions[?(@.type==\"{t}\")].status}}"),
        )
    };
    assert_eq!(status("Ready"), "True");
    assert_eq!(status("Progressing"), "False");
    assert_eq!(status("Degraded"), "False");
    assert_eq!(status("Suspended"), "False");
    let events = ns.kubectl(&[
        "get",
        "events",
        "--field-selector",
        "involvedObject.kind=RLRun,involvedObject.name=gsm8k-grpo",
        "-o",
        "jsonpath={.items[*].reason}",
    ]);
    assert!(
        events.contains("Pending") && events.contains("Running"),
        "phase changes are events: {events}"
    );
    let table = ns.kubectl(&["get", "rlr"]);
    let header: Vec<&str> = table.lines().next().unwrap().split_whitespace().collect();
    assert_eq!(
        header,
        ["NAME", "PHASE", "ENGINES", "VERSION", "STEP", "REWARD", "EVAL", "AGE"]
    );
    let row: Vec<&str> = table.lines().nth(1).unwrap().split_whitespace().collect();
    assert_eq!(row[..3], ["gsm8k-grpo", "Running", "4/4"]);
}

#[test]
#[ignore = "cluster: needs the test control plane (bash scripts/test-cluster.sh up)"]
fn cluster_kubectl_scale_changes_engine_pods_and_an_hpa_can_target_the_run() {
    let ns = Namespace::new("scale");
    let _op = Operator::start(&ns, "a");
    assert!(ns.apply(&small_run("r", 2)).status.success());
    wait_phase(&ns, "r", "Running");
    let engines = "moult.dev/component=engine,moult.dev/run=r";
    assert_eq!(running_pods(&ns, engines), 2);
    ns.kubectl(&["scale", "rlrun/r", "--replicas=5"]);
    wait_until(T, "5 running engines", || running_pods(&ns, engines) == 5);
    wait_until(T, "status 5/5", || {
        ns.get("rlrun/r", "{.status.engines.ready}") == "5/5" && phase(&ns, "r") == "Running"
    });
    ns.kubectl(&["scale", "rlrun/r", "--replicas=1"]);
    wait_until(T, "1 engine", || {
        ns.kubectl(&["get", "pods", "-l", engines, "-o", "name"])
            .lines()
            .count()
            == 1
    });
    assert_eq!(ns.get("rlrun/r", "{.spec.engines.replicas}"), "1");
    // The scale subresource reports the selector an HPA needs.
    let scale = cluster().kubectl(&[
        "get",
        "--raw",
        &format!(
            "/apis/moult.dev/v1alpha1/namespaces/{}/rlruns/r/scale",
            ns.name
        ),
    ]);
    let scale: serde_json::Value = serde_json::from_slice(&scale.stdout).unwrap();
    assert_eq!(scale["status"]["selector"], engines);
    let hpa = r#"apiVersion: autoscaling/v2
kind: HorizontalPodAutoscaler
metadata: {name: engines}
spec:
  scaleTargetRef: {apiVersion: moult.dev/v1alpha1, kind: RLRun, name: r}
  minReplicas: 1
  maxReplicas: 6
  metrics:
  - type: Resource
    resource: {name: cpu, target: {type: Utilization, averageUtilization: 80}}
"#;
    let out = ns.apply(hpa);
    assert!(
        out.status.success(),
        "the HPA is accepted: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
#[ignore = "cluster: needs the test control plane (bash scripts/test-cluster.sh up)"]
fn cluster_invalid_manifests_are_rejected_with_their_messages() {
    let ns = Namespace::new("invalid");
    let base = small_run("bad", 1);
    let cases = support::invalid_cases(&base);
    assert!(cases.len() >= 20);
    for case in &cases {
        assert_ne!(
            case.yaml, base,
            "the case for {:?} changes the manifest",
            case.message
        );
        let out = ns.apply(&case.yaml);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "rejected: {}", case.message);
        // "spec.rollout: Invalid value: \"object\": rollout.temperature must be ..."
        assert!(
            stderr.contains(case.message) && stderr.contains(&format!("{}:", case.field)),
            "the API server names {:?} and says {:?}; it said: {stderr}",
            case.field,
            case.message
        );
    }
    assert!(
        ns.apply(&base).status.success(),
        "the base manifest itself is valid"
    );
}

/// A misspelt field: the API server refuses it under strict field validation (kubectl's default),
/// and `RLRun::unknown_fields`, which `moult run` and every pod read manifests with, names the
/// same path (with the field meant).
#[test]
#[ignore = "cluster: needs the test control plane (bash scripts/test-cluster.sh up)"]
fn cluster_unknown_fields_are_refused_by_the_api_server_as_moult_run_refuses_them() {
    let ns = Namespace::new("unknown");
    let base = small_run("typo", 1);
    for (from, to, path, hint) in [
        (
            "totalSteps: 10",
            "totalStep: 10",
            "spec.totalStep",
            "did you mean totalSteps?",
        ),
        (
            "engines: {replicas:",
            "engines: {replica:",
            "spec.engines.replica",
            "did you mean replicas?",
        ),
        (
            "totalSteps: 10",
            "totalSteps: 10\n  rollout: {maxToken: 4}",
            "spec.rollout.maxToken",
            "did you mean maxTokens?",
        ),
        (
            "Qwen3-0.6B}",
            "Qwen3-0.6B, adapter: {rank: 8}}",
            "spec.model.adapter",
            "spec.model has: claimName, lora, maxModelLen, path",
        ),
    ] {
        let yaml = base.replacen(from, to, 1);
        assert_ne!(yaml, base, "{from} is in the base manifest");
        let out = ns.apply(&yaml);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && stderr.contains(&format!("unknown field \"{path}\"")),
            "the API server refuses {path}: {stderr}"
        );
        let value: serde_json::Value = serde_yaml_ng::from_str(&yaml).unwrap();
        assert_eq!(
            RLRun::unknown_fields(&value),
            [format!("{path}: unknown field; {hint}")]
        );
    }
}

/// The API server applies the same defaults as `moult run`: `maxGradNorm` stays 1.0 when other
/// optimizer fields are set, and 0 (clipping off) is kept. (`null` could not be the switch:
/// `kubectl apply` drops null fields, and the API server then defaults them.)
#[test]
#[ignore = "cluster: needs the test control plane (bash scripts/test-cluster.sh up)"]
fn cluster_max_grad_norm_defaults_apart_from_its_siblings_and_zero_turns_it_off() {
    let ns = Namespace::new("gradnorm");
    for (name, optimizer, want) in [
        ("lr-only", "{learningRate: 1.0e-5}", Some(1.0)),
        ("clip-off", "{learningRate: 1.0e-5, maxGradNorm: 0}", None),
    ] {
        let yaml = small_run(name, 1).replace(
            "totalSteps: 10",
            &format!("totalSteps: 10\n  algorithm: {{optimizer: {optimizer}}}"),
        );
        let out = ns.apply(&yaml);
        assert!(
            out.status.success(),
            "{name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let stored: serde_json::Value =
            serde_json::from_str(&ns.get(&format!("rlrun/{name}"), "{}")).unwrap();
        let run: RLRun = serde_json::from_value(stored).unwrap();
        assert_eq!(run.spec.algorithm.optimizer.clip_norm(), want, "{name}");
    }
}

#[test]
#[ignore = "cluster: needs the test control plane (bash scripts/test-cluster.sh up)"]
fn cluster_children_deleted_or_edited_by_hand_are_restored_and_follow_the_spec() {
    let ns = Namespace::new("restore");
    let _op = Operator::start(&ns, "a");
    assert!(ns.apply(&small_run("r", 1)).status.success());
    wait_phase(&ns, "r", "Running");
    let cm_uid = ns.get("configmap/r-config", "{.metadata.uid}");
    ns.kubectl(&["delete", "configmap", "r-config"]);
    wait_until(T, "the ConfigMap to come back", || {
        let uid = ns.get("configmap/r-config", "{.metadata.uid}");
        !uid.is_empty() && uid != cm_uid
    });
    let svc_uid = ns.get("service/r-coordinator", "{.metadata.uid}");
    ns.kubectl(&["delete", "service", "r-coordinator"]);
    wait_until(T, "the Service to come back", || {
        let uid = ns.get("service/r-coordinator", "{.metadata.uid}");
        !uid.is_empty() && uid != svc_uid
    });
    let image = "{.spec.template.spec.containers[0].image}";
    let want = ns.get("statefulset/r-engine", image);
    ns.kubectl(&[
        "set",
        "image",
        "statefulset/r-engine",
        "engine=attacker/vllm:evil",
    ]);
    wait_until(T, "the engine image to be restored", || {
        ns.get("statefulset/r-engine", image) == want
    });
    // A field the spec no longer sets leaves the child too.
    let cpu = "{.spec.template.spec.containers[0].resources.requests.cpu}";
    ns.kubectl(&[
        "patch",
        "rlrun/r",
        "--type=merge",
        "-p",
        r#"{"spec":{"engines":{"resources":{"requests":{"cpu":"3"}}}}}"#,
    ]);
    wait_until(T, "the engine CPU request", || {
        ns.get("statefulset/r-engine", cpu) == "3"
    });
    ns.kubectl(&[
        "patch",
        "rlrun/r",
        "--type=merge",
        "-p",
        r#"{"spec":{"engines":{"resources":null}}}"#,
    ]);
    // Without the spec's request, the request is 0 again beside the default limit
    // (docs/operator.md, "Resources").
    wait_until(T, "the engine CPU request to go back to 0", || {
        ns.get("statefulset/r-engine", cpu) == "0"
    });
    ns.kubectl(&[
        "label",
        "networkpolicy/r-agents",
        "moult.dev/run-",
        "--overwrite",
    ]);
    // The policy lost the label the operator finds its children by: it is still the run's (its
    // owner reference says so), and the operator applies the label again.
    wait_until(T, "the NetworkPolicy label to be restored", || {
        ns.get(
            "networkpolicy/r-agents",
            "{.metadata.labels.moult\\.dev/run}",
        ) == "r"
    });
}

#[test]
#[ignore = "cluster: needs the test control plane (bash scripts/test-cluster.sh up)"]
fn cluster_restarts_make_no_duplicates_and_an_unchanged_reconcile_writes_nothing() {
    let ns = Namespace::new("idempotent");
    let mut first = Operator::start(&ns, "a");
    assert!(ns.apply(&small_run("r", 2)).status.success());
    // Kill the operator in the middle of its first reconcile (some children exist, not all).
    wait_until(T, "a first child", || {
        !ns.get("configmap/r-config", "{.metadata.name}").is_empty()
    });
    first.kill();
    let _second = Operator::start(&ns, "b");
    wait_phase(&ns, "r", "Running");
    let kinds = ns.kubectl(&[
        "get",
        "statefulsets,deployments,services,replicasets",
        "-l",
        "moult.dev/run=r",
        "-o",
        "name",
    ]);
    let count = |prefix: &str| kinds.lines().filter(|l| l.starts_with(prefix)).count();
    assert_eq!(count("statefulset.apps/"), 2, "{kinds}");
    assert_eq!(count("deployment.apps/"), 2, "{kinds}");
    assert_eq!(count("service/"), 3, "{kinds}");
    assert_eq!(
        count("replicaset.apps/"),
        2,
        "one ReplicaSet per Deployment: {kinds}"
    );
    assert_eq!(
        running_pods(&ns, "moult.dev/component=engine,moult.dev/run=r"),
        2
    );

    // Settle, then restart: the new operator reconciles everything and writes nothing.
    std::thread::sleep(Duration::from_secs(2));
    let before = versions(&ns, "r");
    drop(_second);
    let third = Operator::start(&ns, "c");
    wait_until(T, "the new operator's first reconciles", || {
        third.metric("moult_operator_reconciles_total", "result=\"ok\"") >= 1.0
    });
    std::thread::sleep(Duration::from_secs(2));
    let reconciles = third.metric("moult_operator_reconciles_total", "result=\"ok\"");
    let writes = third.metric("moult_operator_writes_total", "");
    eprintln!("idempotence: {reconciles} reconciles of an unchanged run, {writes} writes");
    assert_eq!(
        writes,
        0.0,
        "an unchanged run needs no writes; log:\n{}",
        third.log_text()
    );
    assert_eq!(versions(&ns, "r"), before, "no resourceVersion moved");
}

#[test]
#[ignore = "cluster: needs the test control plane (bash scripts/test-cluster.sh up)"]
fn cluster_suspend_stops_every_pod_and_resume_keeps_the_runs_state() {
    let ns = Namespace::new("suspend");
    let _op = Operator::start(&ns, "a");
    assert!(ns.apply(&small_run("r", 3)).status.success());
    wait_phase(&ns, "r", "Running");
    let token = ns.get("secret/r-token", "{.data.token}");
    ns.kubectl(&[
        "patch",
        "rlrun/r",
        "--type=merge",
        "-p",
        r#"{"spec":{"suspend":true}}"#,
    ]);
    wait_until(T, "no pods of the run", || {
        ns.kubectl(&["get", "pods", "-l", "moult.dev/run=r", "-o", "name"])
            .is_empty()
    });
    wait_phase(&ns, "r", "Suspended");
    assert_eq!(
        ns.get(
            "rlrun/r",
            "{.status.conditions[?(@.type==\"Suspended\")].status}"
        ),
        "True"
    );
    assert_eq!(
        ns.get("rlrun/r", "{.spec.engines.replicas}"),
        "3",
        "suspend keeps the desired replicas"
    );
    assert_eq!(ns.get("secret/r-token", "{.data.token}"), token);
    ns.kubectl(&[
        "patch",
        "rlrun/r",
        "--type=merge",
        "-p",
        r#"{"spec":{"suspend":false}}"#,
    ]);
    wait_phase(&ns, "r", "Running");
    assert_eq!(
        running_pods(&ns, "moult.dev/component=engine,moult.dev/run=r"),
        3
    );
    assert_eq!(
        ns.get("secret/r-token", "{.data.token}"),
        token,
        "the run keeps its token"
    );
}

/// Asks the API server to evict `pod` (what `kubectl drain` does); the refusal's message, or
/// `None` when the pod was evicted.
fn evict(ns: &Namespace, pod: &str) -> Option<String> {
    let body = serde_json::json!({
        "apiVersion": "policy/v1",
        "kind": "Eviction",
        "metadata": {"name": pod, "namespace": ns.name},
    });
    let path = std::env::temp_dir().join(format!("moult-eviction-{}-{pod}.json", ns.name));
    std::fs::write(&path, body.to_string()).unwrap();
    let out = ns.try_kubectl(&[
        "create",
        "--raw",
        &format!("/api/v1/namespaces/{}/pods/{pod}/eviction", ns.name),
        "-f",
        path.to_str().unwrap(),
    ]);
    let _ = std::fs::remove_file(&path);
    (!out.status.success()).then(|| String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
#[ignore = "cluster: needs the test control plane (bash scripts/test-cluster.sh up)"]
fn cluster_disruption_budgets_keep_drains_off_the_trainer_and_coordinator_and_go_with_the_flag() {
    let ns = Namespace::new("pdb");
    let mut op = Operator::start_with(&ns, "a", &["--disruption-budgets"]);
    assert!(ns.apply(&small_run("r", 1)).status.success());
    wait_phase(&ns, "r", "Running");
    let uid = ns.get("rlrun/r", "{.metadata.uid}");
    for role in ["trainer", "coordinator"] {
        let pdb = format!("pdb/r-{role}");
        assert_eq!(ns.get(&pdb, "{.metadata.ownerReferences[0].uid}"), uid);
        assert_eq!(
            ns.get(&pdb, "{.metadata.ownerReferences[0].controller}"),
            "true"
        );
        assert_eq!(ns.get(&pdb, "{.spec.maxUnavailable}"), "0");
        assert_eq!(
            ns.get(&pdb, "{.spec.unhealthyPodEvictionPolicy}"),
            "AlwaysAllow"
        );
        assert_eq!(
            ns.get(&pdb, "{.spec.selector.matchLabels}"),
            format!(r#"{{"moult.dev/component":"{role}","moult.dev/run":"r"}}"#)
        );
        // The disruption controller finds the role's one pod, healthy, and allows no eviction.
        wait_until(T, &format!("{pdb} to hold its pod"), || {
            ns.get(
                &pdb,
                "{.status.expectedPods}/{.status.currentHealthy}/{.status.disruptionsAllowed}",
            ) == "1/1/0"
        });
    }
    // A drain's eviction of the coordinator or a trainer rank is refused; of an agent pod, not.
    for role in ["coordinator", "trainer"] {
        let pod = ns.kubectl(&[
            "get",
            "pods",
            "-l",
            &format!("moult.dev/run=r,moult.dev/component={role}"),
            "-o",
            "jsonpath={.items[0].metadata.name}",
        ]);
        let refused = evict(&ns, &pod).unwrap_or_else(|| panic!("{pod} was evicted"));
        assert!(refused.contains("disruption budget"), "{refused}");
    }
    let agent = ns.kubectl(&[
        "get",
        "pods",
        "-l",
        "moult.dev/run=r,moult.dev/component=agents",
        "-o",
        "jsonpath={.items[0].metadata.name}",
    ]);
    assert_eq!(evict(&ns, &agent), None, "agent pods have no budget");
    // An operator started without the flag deletes the budgets (they are orphans now).
    op.terminate();
    let _op = Operator::start(&ns, "b");
    wait_until(T, "the budgets to be deleted", || {
        ns.kubectl(&["get", "pdb", "-l", "moult.dev/run=r", "-o", "name"])
            .trim()
            .is_empty()
    });
    assert_eq!(phase(&ns, "r"), "Running");
}

#[test]
#[ignore = "cluster: needs the test control plane (bash scripts/test-cluster.sh up)"]
fn cluster_deleting_the_run_garbage_collects_everything_it_owned() {
    let ns = Namespace::new("gc");
    let _op = Operator::start(&ns, "a");
    assert!(ns.apply(&small_run("r", 1)).status.success());
    wait_phase(&ns, "r", "Running");
    assert!(versions(&ns, "r").len() > 10);
    ns.kubectl(&["delete", "rlrun", "r", "--wait=true"]);
    wait_until(T, "every child to be collected", || {
        let left = ns.kubectl(&[
            "get",
            "configmaps,secrets,serviceaccounts,roles,rolebindings,networkpolicies,services,statefulsets,deployments,pods",
            "-l",
            "moult.dev/run=r",
            "-o",
            "name",
        ]);
        left.trim().is_empty()
    });
}

#[test]
#[ignore = "cluster: needs the test control plane (bash scripts/test-cluster.sh up)"]
fn cluster_only_the_leader_writes_and_a_follower_takes_over_when_it_dies() {
    let ns = Namespace::new("leader");
    let mut a = Operator::start(&ns, "a");
    wait_until(T, "a to lead", || {
        ns.get("lease/moult-operator", "{.spec.holderIdentity}") == "a"
    });
    let b = Operator::start(&ns, "b");
    assert!(ns.apply(&small_run("r", 2)).status.success());
    wait_phase(&ns, "r", "Running");
    assert!(a.metric("moult_operator_writes_total", "") > 0.0);
    assert_eq!(
        b.metric("moult_operator_writes_total", ""),
        0.0,
        "the follower writes nothing"
    );
    assert_eq!(
        b.metric("moult_operator_reconciles_total", ""),
        0.0,
        "the follower does not even reconcile"
    );
    assert_eq!(b.metric("moult_operator_leader", ""), 0.0);
    let killed = Instant::now();
    a.kill();
    wait_until(Duration::from_secs(30), "b to take the lease", || {
        ns.get("lease/moult-operator", "{.spec.holderIdentity}") == "b"
    });
    eprintln!(
        "leader election: b took over {:.1}s after a was killed",
        killed.elapsed().as_secs_f64()
    );
    ns.kubectl(&["scale", "rlrun/r", "--replicas=4"]);
    wait_until(T, "b to scale the engines", || {
        running_pods(&ns, "moult.dev/component=engine,moult.dev/run=r") == 4
    });
    assert!(b.metric("moult_operator_writes_total", "") > 0.0);
}

#[test]
#[ignore = "cluster: needs the test control plane (bash scripts/test-cluster.sh up)"]
fn cluster_helm_install_upgrade_and_uninstall_keep_the_crd_and_the_runs() {
    let ns = Namespace::new("helm");
    let chart = format!("{}/charts/moult-operator", support::ROOT);
    let n = ns.name.as_str();
    let crd_uid = || {
        cluster()
            .kubectl(&[
                "get",
                "crd",
                "rlruns.moult.dev",
                "-o",
                "jsonpath={.metadata.uid}",
            ])
            .stdout
    };
    let uid_before = crd_uid();
    let fake_image = [
        "--set",
        "image.repository=moult-operator",
        "--set",
        "image.tag=test",
    ];
    let mut install = vec![
        "install",
        "moult",
        chart.as_str(),
        "-n",
        n,
        "--wait",
        "--timeout",
        "90s",
    ];
    install.extend(fake_image);
    helm(&install);
    assert_eq!(
        ns.get("deployment/moult-moult-operator", "{.status.readyReplicas}"),
        "2"
    );

    // The chart's RBAC is enough: the operator, acting as the chart's ServiceAccount, runs a run.
    let sa = format!("system:serviceaccount:{n}:moult-moult-operator");
    let _op = Operator::start_as(&ns, "chart-sa", &support::kubeconfig_as(&sa, n));
    assert!(ns.apply(&small_run("kept", 1)).status.success());
    wait_phase(&ns, "kept", "Running");

    let mut upgrade = vec![
        "upgrade",
        "moult",
        chart.as_str(),
        "-n",
        n,
        "--wait",
        "--timeout",
        "90s",
        "--set",
        "replicas=3",
    ];
    upgrade.extend(fake_image);
    helm(&upgrade);
    assert_eq!(
        ns.get("deployment/moult-moult-operator", "{.spec.replicas}"),
        "3"
    );
    let args = ns.get(
        "deployment/moult-moult-operator",
        "{.spec.template.spec.containers[0].args}",
    );
    assert!(args.contains("--leader-election=true"), "{args}");
    assert_eq!(
        ns.get("rlrun/kept", "{.metadata.name}"),
        "kept",
        "the run survives the upgrade"
    );

    helm(&["uninstall", "moult", "-n", n, "--wait", "--timeout", "90s"]);
    wait_until(T, "the operator Deployment to go", || {
        ns.get("deployment/moult-moult-operator", "{.metadata.name}")
            .is_empty()
    });
    assert_eq!(
        crd_uid(),
        uid_before,
        "the CRD is the same object: never deleted"
    );
    assert_eq!(
        ns.get("rlrun/kept", "{.metadata.name}"),
        "kept",
        "the run survives the uninstall"
    );
    assert_eq!(phase(&ns, "kept"), "Running");
}

#[test]
#[ignore = "cluster: needs the test control plane (bash scripts/test-cluster.sh up)"]
fn cluster_a_run_the_operator_cannot_read_is_reported_and_does_not_stall_others() {
    // A CRD newer than the operator: the API server accepts an estimator the operator does not know.
    let ns = Namespace::new("malformed");
    let _op = Operator::start(&ns, "a");
    let path = "/spec/versions/0/schema/openAPIV3Schema/properties/spec/properties/algorithm/properties/estimator/enum/-";
    let patch = format!(r#"[{{"op":"add","path":"{path}","value":"FutureEstimator"}}]"#);
    let out = cluster().kubectl(&[
        "patch",
        "crd",
        "rlruns.moult.dev",
        "--type=json",
        "-p",
        &patch,
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let future = small_run("future", 1).replace(
        "totalSteps: 10",
        "totalSteps: 10\n  algorithm: {estimator: FutureEstimator}",
    );
    wait_until(T, "the API server to accept the new estimator", || {
        ns.apply(&future).status.success()
    });
    assert!(ns.apply(&small_run("today", 1)).status.success());
    wait_phase(&ns, "future", "Failed");
    // Put the CRD back as the operator generates it.
    let restore = cluster().kubectl(&[
        "apply",
        "--server-side",
        "--force-conflicts",
        "-f",
        &format!("{}/crds/rlrun.yaml", support::ROOT),
    ]);
    assert!(
        restore.status.success(),
        "{}",
        String::from_utf8_lossy(&restore.stderr)
    );
    let reason = ns.get(
        "rlrun/future",
        "{.status.conditions[?(@.type==\"Ready\")].reason}",
    );
    assert_eq!(reason, "MalformedSpec");
    let message = ns.get(
        "rlrun/future",
        "{.status.conditions[?(@.type==\"Ready\")].message}",
    );
    assert!(
        message.contains("FutureEstimator"),
        "the status says what is wrong: {message}"
    );
    wait_until(T, "a MalformedSpec event", || {
        ns.kubectl(&[
            "get",
            "events",
            "--field-selector",
            "involvedObject.name=future",
            "-o",
            "jsonpath={.items[*].reason}",
        ])
        .contains("MalformedSpec")
    });
    wait_phase(&ns, "today", "Running");
    assert!(
        ns.get("statefulset/future-engine", "{.metadata.name}")
            .is_empty(),
        "nothing is built for a run that cannot be read"
    );
}

#[test]
#[ignore = "cluster: needs the test control plane (bash scripts/test-cluster.sh up)"]
fn cluster_the_coordinators_status_fields_survive_reconciles_and_fill_the_columns() {
    let ns = Namespace::new("coordinator-status");
    let _op = Operator::start(&ns, "a");
    assert!(ns.apply(&small_run("r", 1)).status.success());
    wait_phase(&ns, "r", "Running");
    // What the coordinator reports, written with a field manager of its own.
    let report = r#"{"status":{"policyVersion":3,"step":5,"metrics":{"reward":0.75,"evalStep":5,"evalReward":0.5}}}"#;
    ns.kubectl(&[
        "patch",
        "rlrun/r",
        "--subresource=status",
        "--type=merge",
        "-p",
        report,
    ]);
    ns.kubectl(&["scale", "rlrun/r", "--replicas=2"]);
    wait_until(T, "status 2/2", || {
        ns.get("rlrun/r", "{.status.engines.ready}") == "2/2" && phase(&ns, "r") == "Running"
    });
    assert_eq!(ns.get("rlrun/r", "{.status.step}"), "5");
    assert_eq!(ns.get("rlrun/r", "{.status.policyVersion}"), "3");
    let row: Vec<String> = ns
        .kubectl(&["get", "rlr", "r", "--no-headers"])
        .split_whitespace()
        .map(String::from)
        .collect();
    assert_eq!(row[..7], ["r", "Running", "2/2", "3", "5", "0.75", "0.5"]);
}

/// The reasons of the run's events.
fn event_reasons(ns: &Namespace, run: &str) -> String {
    ns.kubectl(&[
        "get",
        "events",
        "--field-selector",
        &format!("involvedObject.kind=RLRun,involvedObject.name={run}"),
        "-o",
        "jsonpath={.items[*].reason}",
    ])
}

/// Restarts the operator (killing `op`) and asserts that the new one, reconciling the settled
/// run, writes nothing.
fn a_fresh_operator_writes_nothing(ns: &Namespace, op: &mut Operator, run: &str) {
    std::thread::sleep(Duration::from_secs(2));
    let before = versions(ns, run);
    op.kill();
    let fresh = Operator::start(ns, &format!("{}-again", op.identity));
    wait_until(T, "the new operator's first reconciles", || {
        fresh.metric("moult_operator_reconciles_total", "result=\"ok\"") >= 1.0
    });
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(
        fresh.metric("moult_operator_writes_total", ""),
        0.0,
        "a settled run needs no writes; log:\n{}",
        fresh.log_text()
    );
    assert_eq!(versions(ns, run), before, "no resourceVersion moved");
}

#[test]
#[ignore = "cluster: needs the test control plane (bash scripts/test-cluster.sh up)"]
fn cluster_a_run_whose_model_claim_is_missing_says_so_and_proceeds_once_it_exists() {
    let ns = Namespace::new("missing-claim");
    let mut op = Operator::start(&ns, "a");
    let run = small_run("r", 2).replace(
        "model: {path: Qwen/Qwen3-0.6B}",
        "model: {path: Qwen/Qwen3-0.6B, claimName: models}",
    );
    assert!(ns.apply(&run).status.success());
    let missing = "persistentvolumeclaim \"models\" not found";
    wait_until(T, "the status to name the missing claim", || {
        condition(&ns, "r", "Ready", "message").contains(missing)
    });
    assert_eq!(phase(&ns, "r"), "Pending");
    for t in ["Ready", "Progressing", "Degraded"] {
        assert_eq!(condition(&ns, "r", t, "reason"), "Unschedulable", "{t}");
    }
    assert_eq!(condition(&ns, "r", "Degraded", "status"), "True");
    wait_until(T, "an Unschedulable event", || {
        event_reasons(&ns, "r").contains("Unschedulable")
    });
    // `kubectl get rlr -o wide` shows why.
    let table = ns.kubectl(&["get", "rlr", "-o", "wide"]);
    let header: Vec<&str> = table.lines().next().unwrap().split_whitespace().collect();
    assert_eq!(header[8..], ["REASON", "GPU-HOURS", "MESSAGE"], "{table}");
    let row = table.lines().nth(1).unwrap();
    assert!(
        row.contains("Unschedulable") && row.contains(missing),
        "{table}"
    );
    // And so do the operator's metrics, for alerts.
    let blocked = |reason: &str| {
        op.metric(
            "moult_operator_run_blocked",
            &format!("component=\"engines\",reason=\"{reason}\""),
        )
    };
    assert_eq!(blocked("Unschedulable"), 1.0);
    assert_eq!(
        op.metric("moult_operator_run_phase", "phase=\"Pending\""),
        1.0
    );
    assert_eq!(
        op.metric("moult_operator_run_ready_pods", "component=\"engines\""),
        0.0
    );

    // The claim arrives (bound to a volume): the pods schedule and the cause clears.
    let volume = format!(
        "apiVersion: v1\nkind: PersistentVolume\nmetadata: {{name: {n}-models}}\nspec:\n  capacity: {{storage: 1Gi}}\n  accessModes: [ReadOnlyMany]\n  storageClassName: \"\"\n  hostPath: {{path: /tmp/{n}-models}}\n  claimRef: {{namespace: {n}, name: models}}\n  persistentVolumeReclaimPolicy: Delete\n---\napiVersion: v1\nkind: PersistentVolumeClaim\nmetadata: {{name: models}}\nspec:\n  accessModes: [ReadOnlyMany]\n  storageClassName: \"\"\n  volumeName: {n}-models\n  resources: {{requests: {{storage: 1Gi}}}}\n",
        n = ns.name
    );
    let out = ns.apply(&volume);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    wait_phase(&ns, "r", "Running");
    assert_eq!(condition(&ns, "r", "Degraded", "status"), "False");
    assert_eq!(condition(&ns, "r", "Ready", "reason"), "AllComponentsReady");
    wait_until(T, "the metrics to follow", || {
        blocked("Unschedulable") == 0.0
            && op.metric("moult_operator_run_phase", "phase=\"Running\"") == 1.0
    });
    a_fresh_operator_writes_nothing(&ns, &mut op, "r");
}

#[test]
#[ignore = "cluster: needs the test control plane (bash scripts/test-cluster.sh up)"]
fn cluster_a_run_asking_for_more_gpus_than_any_node_has_says_so() {
    let ns = Namespace::new("too-many-gpus");
    let _op = Operator::start(&ns, "a");
    // The test nodes have 8 GPUs each.
    let run = small_run("r", 1).replace("gpusPerNode: 8", "gpusPerNode: 16");
    assert!(ns.apply(&run).status.success());
    wait_until(T, "the status to say there are too few GPUs", || {
        condition(&ns, "r", "Ready", "message").contains("Insufficient nvidia.com/gpu")
    });
    let message = condition(&ns, "r", "Ready", "message");
    assert!(
        message.contains("trainer 0/1 ready (Unschedulable: pod r-trainer-0:"),
        "{message}"
    );
    assert_eq!(condition(&ns, "r", "Ready", "reason"), "Unschedulable");
    assert_ne!(phase(&ns, "r"), "Running");
}

/// What a kubelet reports for a pod whose only container `name` crash-loops after printing
/// `last_words`, or (`None`) runs and is ready again.
fn kubelet_report(pod: &str, container: &str, last_words: Option<&str>) -> String {
    let now = "2030-01-01T00:00:00Z";
    let (ready, state, last) = match last_words {
        Some(words) => (
            "False",
            serde_json::json!({"waiting": {"reason": "CrashLoopBackOff", "message": format!("back-off 40s restarting failed container={container} pod={pod}")}}),
            serde_json::json!({"terminated": {"exitCode": 1, "reason": "Error", "message": words, "startedAt": now, "finishedAt": now}}),
        ),
        None => (
            "True",
            serde_json::json!({"running": {"startedAt": now}}),
            serde_json::json!({}),
        ),
    };
    serde_json::json!({"status": {
        "phase": "Running",
        "conditions": [
            {"type": "PodScheduled", "status": "True", "lastTransitionTime": now},
            {"type": "Initialized", "status": "True", "lastTransitionTime": now},
            {"type": "ContainersReady", "status": ready, "lastTransitionTime": now},
            {"type": "Ready", "status": ready, "lastTransitionTime": now},
        ],
        "containerStatuses": [{
            "name": container, "image": "moult-runtime:test", "imageID": "",
            "ready": ready == "True", "restartCount": 3, "started": ready == "True",
            "state": state, "lastState": last,
        }],
    }})
    .to_string()
}

#[test]
#[ignore = "cluster: needs the test control plane (bash scripts/test-cluster.sh up)"]
fn cluster_a_container_that_exits_with_an_error_puts_its_error_in_the_condition() {
    let ns = Namespace::new("crash");
    let mut op = Operator::start(&ns, "a");
    assert!(ns.apply(&small_run("r", 1)).status.success());
    wait_phase(&ns, "r", "Running");
    // KWOK runs no containers: write what a kubelet would report, through the real API server
    // (the status subresource the kubelet writes), for a trainer that dies on a bad model path.
    let error =
        "Error: spec.model.path: /models/Qwen/Qwen3-0.6B is not a model folder (no config.json)";
    let patch = |words: Option<&str>| {
        ns.kubectl(&[
            "patch",
            "pod",
            "r-trainer-0",
            "--subresource=status",
            "--type=merge",
            "-p",
            &kubelet_report("r-trainer-0", "trainer", words),
        ]);
    };
    patch(Some(&format!("loading the manifest\n{error}\n")));
    wait_until(T, "the condition to carry the trainer's error", || {
        condition(&ns, "r", "Degraded", "message").contains(error)
    });
    assert_eq!(phase(&ns, "r"), "Degraded");
    assert_eq!(
        condition(&ns, "r", "Degraded", "reason"),
        "CrashLoopBackOff"
    );
    assert!(
        condition(&ns, "r", "Ready", "message").contains("trainer 0/1 ready (CrashLoopBackOff: pod r-trainer-0: container trainer exited with code 1:"),
        "{}",
        condition(&ns, "r", "Ready", "message")
    );
    wait_until(T, "a CrashLoopBackOff event", || {
        event_reasons(&ns, "r").contains("CrashLoopBackOff")
    });
    assert_eq!(
        op.metric(
            "moult_operator_run_blocked",
            "component=\"trainer\",reason=\"CrashLoopBackOff\""
        ),
        1.0
    );
    // Fixed: the container runs and is ready again; the condition clears.
    patch(None);
    wait_phase(&ns, "r", "Running");
    assert_eq!(condition(&ns, "r", "Degraded", "status"), "False");
    assert!(!condition(&ns, "r", "Ready", "message").contains(error));
    a_fresh_operator_writes_nothing(&ns, &mut op, "r");
}

/// A ResourceQuota that leaves no GPU for the run: the StatefulSets cannot create their pods,
/// and the run's status says so (QuotaExceeded, with the quota's words) instead of waiting
/// without a reason; raising the quota lets the pods come and the run reach Running.
#[test]
#[ignore = "cluster: needs the test control plane (bash scripts/test-cluster.sh up)"]
fn cluster_a_quota_that_refuses_the_pods_is_the_runs_reason() {
    let ns = Namespace::new("quota");
    let quota = |gpus: u32| {
        format!("apiVersion: v1\nkind: ResourceQuota\nmetadata: {{name: gpus}}\nspec: {{hard: {{requests.nvidia.com/gpu: \"{gpus}\"}}}}\n")
    };
    assert!(ns.apply(&quota(0)).status.success());
    let _op = Operator::start(&ns, "a");
    assert!(ns.apply(&small_run("r", 1)).status.success());
    wait_until(T, "the quota as the run's reason", || {
        condition(&ns, "r", "Ready", "reason") == "QuotaExceeded"
    });
    let message = condition(&ns, "r", "Ready", "message");
    assert!(message.contains("exceeded quota: gpus"), "{message}");
    assert_eq!(phase(&ns, "r"), "Pending");
    assert!(ns.apply(&quota(64)).status.success());
    wait_phase(&ns, "r", "Running");
}
