//! Operator benchmark on the test control plane: time from `apply` to every child created and
//! to phase Running for 1 and for 100 RLRuns applied at once, API writes per reconcile, and the
//! operator's memory with all of them. Prints a table.
//!
//!     bash scripts/test-cluster.sh up
//!     cargo build --release -p moult-operator --bin moult-operator --example cluster_bench
//!     target/release/examples/cluster_bench [100]
//!
//! Each count is measured twice: as plain runs, and as runs in a Kueue queue (a ClusterQueue with
//! quota for all of them), which adds a Workload per run and Kueue's admission to the loop (the
//! test control plane runs Kueue beside it).
//!
//! Runs are CPU-only (built-in engine, CPU trainer), one pod per component, and tolerate the GPU
//! taint, so that 100 of them (400 pods) fit on the six fake nodes; KWOK makes pods Running at once, so the times measure the
//! operator and the control plane, not image pulls.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use futures::future::join_all;
use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};
use moult_operator::api::{Phase, RLRun};

const CHILDREN_PER_RUN: usize = 16;

fn run_manifest(name: &str, queued: bool) -> serde_json::Value {
    let mut run = serde_json::json!({
        "apiVersion": "moult.dev/v1alpha1", "kind": "RLRun",
        "metadata": {"name": name},
        "spec": {
            "model": {"path": "/models/qwen3-tiny"},
            "agent": {"env": "math", "replicas": 1, "dataset": {"path": "/data/tasks.jsonl"}},
            "engines": {"replicas": 1, "backend": "Builtin", "gpusPerEngine": 0},
            "trainer": {"nodes": 1, "gpusPerNode": 0},
            // 400 pods need the GPU nodes too (CPU nodes hold 110 pods each).
            "scheduling": {"tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]},
            "totalSteps": 10
        }
    });
    if queued {
        run["spec"]["scheduling"]["queueName"] = "runs".into();
    }
    run
}

/// A ResourceFlavor, a ClusterQueue for namespace `ns` alone with quota for every run, and its
/// LocalQueue `runs`.
async fn queue(client: &Client, ns: &str) {
    let objects = [
        (
            "ResourceFlavor",
            serde_json::json!({"metadata": {"name": ns}}),
        ),
        (
            "ClusterQueue",
            serde_json::json!({"metadata": {"name": ns}, "spec": {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}},
            "resourceGroups": [{"coveredResources": ["cpu", "memory"], "flavors": [{"name": ns, "resources": [
                {"name": "cpu", "nominalQuota": 100000}, {"name": "memory", "nominalQuota": "100Ti"}]}]}]}}),
        ),
        (
            "LocalQueue",
            serde_json::json!({"metadata": {"name": "runs", "namespace": ns}, "spec": {"clusterQueue": ns}}),
        ),
    ];
    for (kind, mut object) in objects {
        object["apiVersion"] = "kueue.x-k8s.io/v1beta2".into();
        object["kind"] = kind.into();
        let gvk = kube::api::GroupVersionKind::gvk("kueue.x-k8s.io", "v1beta2", kind);
        let ar = kube::api::ApiResource::from_gvk_with_plural(
            &gvk,
            &format!("{}s", kind.to_lowercase()),
        );
        let api: Api<kube::api::DynamicObject> = match kind {
            "LocalQueue" => Api::namespaced_with(client.clone(), ns, &ar),
            _ => Api::all_with(client.clone(), &ar),
        };
        let object: kube::api::DynamicObject = serde_json::from_value(object).unwrap();
        api.create(&PostParams::default(), &object)
            .await
            .unwrap_or_else(|e| panic!("{kind}: {e} (is Kueue on the test control plane?)"));
    }
}

fn kubeconfig() -> (std::path::PathBuf, String) {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
    let out = Command::new("bash")
        .arg(format!("{root}/scripts/test-cluster.sh"))
        .arg("env")
        .output()
        .expect("bash");
    let env = String::from_utf8_lossy(&out.stdout).into_owned();
    let kc = env
        .lines()
        .find_map(|l| l.strip_prefix("export KUBECONFIG="))
        .expect("KUBECONFIG")
        .to_string();
    (kc.into(), root.to_string())
}

fn operator(kubeconfig: &std::path::Path, ns: &str, log: &std::path::Path) -> Child {
    let bin = std::env::current_exe()
        .unwrap()
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .join("moult-operator");
    Command::new(&bin)
        .env("KUBECONFIG", kubeconfig)
        .args([
            "--namespace",
            ns,
            "--lease-namespace",
            ns,
            "--metrics-addr",
            "127.0.0.1:0",
            "--concurrency",
            "8",
        ])
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log).unwrap())
        .spawn()
        .unwrap_or_else(|e| {
            panic!(
                "{}: {e} (build it with --bin moult-operator)",
                bin.display()
            )
        })
}

fn metrics(log: &std::path::Path) -> String {
    use std::io::{Read, Write};
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let addr = text
        .split("addr=")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .expect("metrics address in the log");
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    write!(s, "GET /metrics HTTP/1.0\r\n\r\n").unwrap();
    let mut body = String::new();
    s.read_to_string(&mut body).unwrap();
    body
}

fn metric(body: &str, name: &str) -> f64 {
    body.lines()
        .filter(|l| l.starts_with(name))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

fn rss_mib(pid: u32) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let kb: f64 = status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0);
    kb / 1024.0
}

struct Row {
    runs: usize,
    queued: bool,
    children: Duration,
    running: Duration,
    writes: f64,
    reconciles: f64,
    idle_writes: f64,
    rss: f64,
}

async fn bench(client: &Client, kc: &std::path::Path, runs: usize, queued: bool) -> Row {
    let ns = format!(
        "bench-{runs}{}-{}",
        if queued { "-kueue" } else { "" },
        std::process::id()
    );
    let nss: Api<Namespace> = Api::all(client.clone());
    nss.create(
        &PostParams::default(),
        &serde_json::from_value(serde_json::json!({"metadata": {"name": ns}})).unwrap(),
    )
    .await
    .unwrap();
    // Pods need the default ServiceAccount.
    let sas: Api<k8s_openapi::api::core::v1::ServiceAccount> = Api::namespaced(client.clone(), &ns);
    while sas.get_opt("default").await.unwrap().is_none() {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    if queued {
        queue(client, &ns).await;
    }
    let log = std::env::temp_dir().join(format!("{ns}.log"));
    let mut op = operator(kc, &ns, &log);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let api: Api<RLRun> = Api::namespaced(client.clone(), &ns);
    let started = Instant::now();
    join_all((0..runs).map(|i| {
        let api = api.clone();
        async move {
            let name = format!("run-{i}");
            api.patch(
                &name,
                &PatchParams::apply("bench"),
                &Patch::Apply(run_manifest(&name, queued)),
            )
            .await
            .unwrap();
        }
    }))
    .await;
    let mut kinds = vec![
        "configmaps",
        "secrets",
        "serviceaccounts",
        "roles",
        "rolebindings",
        "networkpolicies",
        "services",
        "statefulsets",
        "deployments",
    ];
    if queued {
        kinds.push("workloads");
    }
    let mut children_at = None;
    let running_at;
    loop {
        if children_at.is_none() {
            let mut n = 0;
            for k in &kinds {
                let ar = match *k {
                    "configmaps" => {
                        kube::api::ApiResource::erase::<k8s_openapi::api::core::v1::ConfigMap>(&())
                    }
                    "secrets" => {
                        kube::api::ApiResource::erase::<k8s_openapi::api::core::v1::Secret>(&())
                    }
                    "serviceaccounts" => kube::api::ApiResource::erase::<
                        k8s_openapi::api::core::v1::ServiceAccount,
                    >(&()),
                    "roles" => {
                        kube::api::ApiResource::erase::<k8s_openapi::api::rbac::v1::Role>(&())
                    }
                    "rolebindings" => {
                        kube::api::ApiResource::erase::<k8s_openapi::api::rbac::v1::RoleBinding>(&())
                    }
                    "networkpolicies" => kube::api::ApiResource::erase::<
                        k8s_openapi::api::networking::v1::NetworkPolicy,
                    >(&()),
                    "services" => {
                        kube::api::ApiResource::erase::<k8s_openapi::api::core::v1::Service>(&())
                    }
                    "statefulsets" => {
                        kube::api::ApiResource::erase::<k8s_openapi::api::apps::v1::StatefulSet>(&())
                    }
                    "deployments" => {
                        kube::api::ApiResource::erase::<k8s_openapi::api::apps::v1::Deployment>(&())
                    }
                    _ => kube::api::ApiResource::from_gvk_with_plural(
                        &kube::api::GroupVersionKind::gvk("kueue.x-k8s.io", "v1beta2", "Workload"),
                        "workloads",
                    ),
                };
                let dynamic: Api<kube::api::DynamicObject> =
                    Api::namespaced_with(client.clone(), &ns, &ar);
                n += dynamic
                    .list(
                        &ListParams::default()
                            .labels("app.kubernetes.io/managed-by=moult-operator"),
                    )
                    .await
                    .unwrap()
                    .items
                    .len();
            }
            if n == runs * (CHILDREN_PER_RUN + usize::from(queued)) {
                children_at = Some(started.elapsed());
            }
        }
        let list = api.list(&ListParams::default()).await.unwrap();
        if children_at.is_some()
            && list
                .items
                .iter()
                .filter(|r| r.status.as_ref().and_then(|s| s.phase) == Some(Phase::Running))
                .count()
                == runs
        {
            running_at = started.elapsed();
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(300),
            "runs did not reach Running in 5 minutes"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Let the last status writes land, then count.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let body = metrics(&log);
    let writes = metric(&body, "moult_operator_writes_total");
    let reconciles = metric(&body, "moult_operator_reconciles_total");
    let rss = rss_mib(op.id());
    // A restarted operator reconciles every run once more: those reconciles should write nothing.
    let _ = op.kill();
    let _ = op.wait();
    let log2 = std::env::temp_dir().join(format!("{ns}-restart.log"));
    let mut op2 = operator(kc, &ns, &log2);
    let t = Instant::now();
    let idle_writes = loop {
        tokio::time::sleep(Duration::from_millis(500)).await;
        if std::fs::read_to_string(&log2)
            .unwrap_or_default()
            .contains("addr=")
        {
            let body = metrics(&log2);
            if metric(&body, "moult_operator_reconciles_total") >= runs as f64
                || t.elapsed() > Duration::from_secs(120)
            {
                break metric(&body, "moult_operator_writes_total");
            }
        }
    };
    let _ = op2.kill();
    let _ = op2.wait();
    let _ = nss.delete(&ns, &DeleteParams::default()).await;
    if queued {
        for (kind, plural) in [
            ("ClusterQueue", "clusterqueues"),
            ("ResourceFlavor", "resourceflavors"),
        ] {
            let gvk = kube::api::GroupVersionKind::gvk("kueue.x-k8s.io", "v1beta2", kind);
            let ar = kube::api::ApiResource::from_gvk_with_plural(&gvk, plural);
            let api: Api<kube::api::DynamicObject> = Api::all_with(client.clone(), &ar);
            let _ = api.delete(&ns, &DeleteParams::default()).await;
        }
    }
    Row {
        runs,
        queued,
        children: children_at.unwrap(),
        running: running_at,
        writes,
        reconciles,
        idle_writes,
        rss,
    }
}

#[tokio::main]
async fn main() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let max: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(100);
    let (kc, _) = kubeconfig();
    let config = Config::from_custom_kubeconfig(
        Kubeconfig::read_from(&kc).unwrap(),
        &KubeConfigOptions::default(),
    )
    .await
    .unwrap();
    let client = Client::try_from(config).unwrap();
    let mut rows = Vec::new();
    for runs in [1, max] {
        for queued in [false, true] {
            rows.push(bench(&client, &kc, runs, queued).await);
        }
    }
    println!("| RLRuns applied at once | Kueue | all children created | all Running | API writes (per run) | reconciles | writes after restart | operator RSS |");
    println!("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |");
    for r in rows {
        println!(
            "| {} | {} | {:.2} s | {:.2} s | {} ({:.1}) | {} | {} | {:.0} MiB |",
            r.runs,
            if r.queued { "yes" } else { "no" },
            r.children.as_secs_f64(),
            r.running.as_secs_f64(),
            r.writes,
            r.writes / r.runs as f64,
            r.reconciles,
            r.idle_writes,
            r.rss
        );
    }
}
