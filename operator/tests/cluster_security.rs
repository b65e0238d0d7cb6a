//! The operator's hardening on a real control plane (docs/security.md): the NetworkPolicies the
//! API server holds are the ones built and keep to the documented matrix; a run never touches an
//! object it does not control (the namespace's `default` ServiceAccount above all); the chart's
//! namespaced install grants Roles in the watched namespaces alone. Run with `bash
//! scripts/test-cluster.sh up` then `cargo test -p moult-operator --test cluster_security --
//! --ignored` (scripts/test.sh does both).

mod support;

use std::time::Duration;

use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::api::Api;
use moult_operator::api::{RLRun, WeightTransport};
use moult_operator::children::{desired, Config, Images};
use support::{
    cluster, condition, helm, matrix, phase, small_run, wait_phase, wait_until, Namespace, Operator,
};

const T: Duration = Duration::from_secs(60);

/// What the test operator's flags make (support::Operator).
fn test_config(metrics_from: bool) -> Config {
    Config {
        images: Images {
            runtime: "moult-runtime:test".into(),
            init: "moult-init:test".into(),
            ..Images::default()
        },
        metrics_from: if metrics_from {
            matrix::metrics_from()
        } else {
            Vec::new()
        },
        ..Config::default()
    }
}

#[test]
#[ignore = "cluster: needs the test control plane (bash scripts/test-cluster.sh up)"]
fn cluster_network_policies_are_accepted_as_built_and_keep_to_the_matrix() {
    let ns = Namespace::new("netpol");
    let from = serde_json::to_string(&matrix::metrics_from()).unwrap();
    let _op = Operator::start_with(&ns, "a", &["--metrics-from", &from]);
    assert!(ns.apply(&small_run("r", 1)).status.success());
    wait_phase(&ns, "r", "Running");
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (run, live) = rt.block_on(async {
        let client = cluster().client().await;
        let run = Api::<RLRun>::namespaced(client.clone(), &ns.name)
            .get("r")
            .await
            .unwrap();
        let api = Api::<NetworkPolicy>::namespaced(client, &ns.name);
        let mut live = Vec::new();
        for component in ["engine", "trainer", "coordinator", "agents"] {
            live.push(api.get(&format!("r-{component}")).await.unwrap());
        }
        (run, live)
    });
    assert_eq!(run.spec.engines.transport(), WeightTransport::Nccl);
    let built = desired(&run, &test_config(true), "t").unwrap();
    let p = &built.network_policies;
    for (live, built) in live.iter().zip([
        p.engine.as_ref().unwrap(),
        &p.trainer,
        &p.coordinator,
        &p.agents,
    ]) {
        let name = live.metadata.name.clone().unwrap();
        assert_eq!(
            serde_json::to_value(&live.spec).unwrap(),
            serde_json::to_value(&built.spec).unwrap(),
            "{name}: the API server holds what the builder made"
        );
        assert_eq!(
            live.metadata.owner_references.as_ref().unwrap()[0].uid,
            run.metadata.uid.clone().unwrap(),
            "{name}"
        );
    }
    // The matrix's world has its own namespace: move the run there, and the live policies too.
    let mut moved = run.clone();
    moved.metadata.namespace = Some(matrix::NAMESPACE.into());
    let ours = desired(&moved, &test_config(true), "t").unwrap();
    let mut other = moved.clone();
    other.metadata.name = Some("other".into());
    let other = desired(&other, &test_config(true), "t").unwrap();
    let mut policies: Vec<NetworkPolicy> = live
        .into_iter()
        .map(|mut np| {
            np.metadata.namespace = Some(matrix::NAMESPACE.into());
            np
        })
        .collect();
    let o = &other.network_policies;
    policies.extend([
        o.engine.clone().unwrap(),
        o.trainer.clone(),
        o.coordinator.clone(),
        o.agents.clone(),
    ]);
    let wrong = matrix::mismatches(WeightTransport::Nccl, policies, &ours, &other);
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// uid, resourceVersion, labels and owner references of the `default` ServiceAccount.
fn default_account(ns: &Namespace) -> String {
    ns.get(
        "serviceaccount/default",
        "{.metadata.uid} {.metadata.resourceVersion} {.metadata.labels} {.metadata.ownerReferences}",
    )
}

#[test]
#[ignore = "cluster: needs the test control plane (bash scripts/test-cluster.sh up)"]
fn cluster_an_rlrun_named_default_leaves_the_default_service_account_alone() {
    let ns = Namespace::new("default-run");
    let _op = Operator::start(&ns, "a");
    let before = default_account(&ns);
    assert!(before.split(' ').next().is_some_and(|uid| !uid.is_empty()));
    assert!(ns.apply(&small_run("default", 1)).status.success());
    wait_phase(&ns, "default", "Running");
    assert_eq!(
        default_account(&ns),
        before,
        "untouched while the run lives"
    );
    let uid = ns.get("rlrun/default", "{.metadata.uid}");
    assert_eq!(
        ns.get(
            "serviceaccount/default-moult",
            "{.metadata.ownerReferences[0].uid}"
        ),
        uid,
        "the run's own ServiceAccount"
    );
    let accounts = ns.kubectl(&[
        "get",
        "pods",
        "-l",
        "moult.dev/run=default",
        "-o",
        "jsonpath={.items[*].spec.serviceAccountName}",
    ]);
    assert!(
        !accounts.is_empty() && accounts.split(' ').all(|a| a == "default-moult"),
        "{accounts}"
    );
    ns.kubectl(&["delete", "rlrun", "default", "--wait=true"]);
    wait_until(T, "the run's children to be collected", || {
        ns.kubectl(&[
            "get",
            "serviceaccounts,configmaps,statefulsets",
            "-l",
            "moult.dev/run=default",
            "-o",
            "name",
        ])
        .trim()
        .is_empty()
    });
    assert_eq!(
        default_account(&ns),
        before,
        "the default ServiceAccount survives the run's deletion, unchanged"
    );
}

#[test]
#[ignore = "cluster: needs the test control plane (bash scripts/test-cluster.sh up)"]
fn cluster_objects_the_run_does_not_control_are_reported_and_left_as_they_are() {
    let ns = Namespace::new("conflict");
    let _op = Operator::start(&ns, "a");
    let theirs = r#"apiVersion: v1
kind: ConfigMap
metadata: {name: r-config}
data: {owner: someone else}
---
apiVersion: v1
kind: Secret
metadata: {name: r-token}
stringData: {token: not the run's}
---
apiVersion: v1
kind: ConfigMap
metadata:
  name: r-lookalike
  labels: {moult.dev/run: r, app.kubernetes.io/managed-by: moult-operator}
data: {owner: someone else}
"#;
    let out = ns.apply(theirs);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let version = |o: &str| ns.get(o, "{.metadata.resourceVersion} {.metadata.ownerReferences}");
    // The objects the run does not control, as the API server holds them.
    let versions = || -> Vec<String> {
        [
            "configmap/r-config",
            "secret/r-token",
            "configmap/r-lookalike",
        ]
        .iter()
        .map(|o| version(o))
        .collect()
    };
    let before = versions();

    assert!(ns.apply(&small_run("r", 1)).status.success());
    wait_until(T, "the status to name the objects in the way", || {
        condition(&ns, "r", "Ready", "reason") == "OwnershipConflict"
    });
    let message = condition(&ns, "r", "Ready", "message");
    for want in [
        "ConfigMap r-config already exists, not controlled by this RLRun",
        "Secret r-token already exists, not controlled by this RLRun",
    ] {
        assert!(message.contains(want), "{want:?} in {message:?}");
    }
    assert_eq!(phase(&ns, "r"), "Pending");
    assert_eq!(condition(&ns, "r", "Degraded", "status"), "True");
    wait_until(T, "an OwnershipConflict event", || {
        ns.kubectl(&[
            "get",
            "events",
            "--field-selector",
            "involvedObject.name=r",
            "-o",
            "jsonpath={.items[*].reason}",
        ])
        .contains("OwnershipConflict")
    });
    assert!(
        ns.kubectl(&[
            "get",
            "statefulsets,deployments,serviceaccounts",
            "-l",
            "moult.dev/run=r",
            "-o",
            "name"
        ])
        .trim()
        .is_empty(),
        "nothing of the run is made while its names are taken"
    );
    assert_eq!(versions(), before, "nothing was written to them");
    assert_eq!(
        ns.get("secret/r-token", "{.data.token}"),
        "bm90IHRoZSBydW4ncw==",
        "not the run's token"
    );

    // Out of the way: the run proceeds; a labelled object it does not control is no orphan of
    // its, and stays.
    ns.kubectl(&["delete", "configmap/r-config", "secret/r-token"]);
    wait_phase(&ns, "r", "Running");
    let uid = ns.get("rlrun/r", "{.metadata.uid}");
    assert_eq!(
        ns.get("configmap/r-config", "{.metadata.ownerReferences[0].uid}"),
        uid
    );
    assert_eq!(version("configmap/r-lookalike"), before[2]);
}

#[test]
#[ignore = "cluster: needs the test control plane (bash scripts/test-cluster.sh up)"]
fn cluster_a_child_the_api_server_refuses_fails_the_run_with_its_message_until_the_spec_is_fixed() {
    let ns = Namespace::new("refused");
    let _op = Operator::start(&ns, "a");
    // A toleration's effect: the CRD holds Kubernetes' own schema of a toleration, which takes
    // any string; a pod template does not. (The stand-in for whatever the CRD does not check.)
    let bad = small_run("r", 1).replace(
        "totalSteps: 10",
        "totalSteps: 10\n  scheduling: {tolerations: [{key: team, operator: Exists, effect: Sometimes}]}",
    );
    assert!(ns.apply(&bad).status.success());
    wait_phase(&ns, "r", "Failed");
    assert_eq!(condition(&ns, "r", "Ready", "reason"), "InvalidSpec");
    let message = condition(&ns, "r", "Ready", "message");
    assert!(
        message.starts_with(
            "the API server refused an object made from the spec: StatefulSet r-engine:"
        ) && message.contains("Sometimes"),
        "{message}"
    );
    assert!(ns.apply(&small_run("r", 1)).status.success());
    wait_phase(&ns, "r", "Running");
}

#[test]
#[ignore = "cluster: needs the test control plane (bash scripts/test-cluster.sh up)"]
fn cluster_helm_namespaced_install_grants_roles_in_the_watched_namespaces_only() {
    let release = Namespace::new("helm-release");
    let watched = Namespace::new("helm-watched");
    let second = Namespace::new("helm-second");
    let other = Namespace::new("helm-other");
    let chart = format!("{}/charts/moult-operator", support::ROOT);
    let r = release.name.as_str();
    helm(&[
        "install",
        "moult",
        &chart,
        "-n",
        r,
        "--wait",
        "--timeout",
        "90s",
        "--set",
        "image.repository=moult-operator",
        "--set",
        "image.tag=test",
        "--set",
        "replicas=1",
        "--set",
        &format!("watchNamespaces={{{},{}}}", watched.name, second.name),
    ]);
    let fullname = "moult-moult-operator";
    for kind in ["role", "rolebinding"] {
        assert_eq!(
            watched.get(&format!("{kind}/{fullname}"), "{.metadata.name}"),
            fullname,
            "a {kind} in the watched namespace"
        );
        assert!(other
            .get(&format!("{kind}/{fullname}"), "{.metadata.name}")
            .is_empty());
    }
    let cluster_role = cluster().kubectl(&["get", "clusterrole", &format!("{fullname}-{r}")]);
    assert!(!cluster_role.status.success(), "no ClusterRole");
    let args = release.get(
        &format!("deployment/{fullname}"),
        "{.spec.template.spec.containers[0].args}",
    );
    assert!(
        args.contains(&format!("--namespace={},{}", watched.name, second.name)),
        "{args}"
    );

    let sa = format!("system:serviceaccount:{r}:{fullname}");
    let can = |args: &[&str]| {
        let mut all = vec!["auth", "can-i", "--as", sa.as_str()];
        all.extend_from_slice(args);
        String::from_utf8_lossy(&cluster().kubectl(&all).stdout)
            .trim()
            .to_string()
    };
    assert_eq!(
        can(&["list", "rlruns.moult.dev", "-n", &watched.name]),
        "yes"
    );
    assert_eq!(
        can(&["create", "statefulsets.apps", "-n", &watched.name]),
        "yes"
    );
    assert_eq!(can(&["list", "rlruns.moult.dev", "-n", &other.name]), "no");
    assert_eq!(can(&["list", "secrets", "-n", &other.name]), "no");
    assert_eq!(can(&["list", "rlruns.moult.dev", "--all-namespaces"]), "no");

    // The operator, acting as the chart's ServiceAccount and watching the two namespaces (one
    // controller each), runs a run in each; a run elsewhere is none of its business.
    let kubeconfig = support::kubeconfig_as(&sa, r);
    let both = format!("{},{}", watched.name, second.name);
    let _op = Operator::launch("chart-sa", &kubeconfig, &both, r, &[]);
    assert!(watched.apply(&small_run("here", 1)).status.success());
    assert!(second.apply(&small_run("also", 1)).status.success());
    assert!(other.apply(&small_run("there", 1)).status.success());
    wait_phase(&watched, "here", "Running");
    wait_phase(&second, "also", "Running");
    assert!(
        phase(&other, "there").is_empty(),
        "the other namespace is not watched"
    );
    helm(&["uninstall", "moult", "-n", r, "--wait", "--timeout", "90s"]);
    assert!(watched
        .get(&format!("role/{fullname}"), "{.metadata.name}")
        .is_empty());
}
