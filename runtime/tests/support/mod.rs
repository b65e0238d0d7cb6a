//! The cluster-test helper of the runtime: connects to the test control plane that
//! `scripts/test-cluster.sh up` started (real etcd, kube-apiserver, controller-manager, scheduler,
//! KWOK), gives each test a namespace of its own, a bound PersistentVolumeClaim when it needs one,
//! and runs the real `moult-operator` binary against it. [`kubelet`] runs the pods the operator
//! makes as local processes.
//!
//! The tests that use it are `#[ignore]`d with a reason and named `cluster_*`; without a running
//! control plane they fail with the command that starts it: they never pass against a mock.

#![allow(dead_code)]

pub mod kubelet;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};

pub const ROOT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/..");

/// The repository's folder, as the paths built from [`ROOT`] start.
pub fn repository() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the runtime crate is inside the repository")
        .to_path_buf()
}

/// Where the control plane is: its kubeconfig and the folder holding `kubectl`.
pub struct Cluster {
    pub kubeconfig: PathBuf,
    pub bin: PathBuf,
}

/// The running test control plane, with the CRD applied (once per test binary).
pub fn cluster() -> &'static Cluster {
    static CLUSTER: OnceLock<Cluster> = OnceLock::new();
    CLUSTER.get_or_init(|| {
        let out = Command::new("bash")
            .arg(format!("{ROOT}/scripts/test-cluster.sh"))
            .arg("env")
            .output()
            .expect("bash runs");
        assert!(
            out.status.success(),
            "scripts/test-cluster.sh env failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let env = String::from_utf8_lossy(&out.stdout);
        let value = |key: &str| {
            env.lines()
                .find_map(|l| l.strip_prefix(&format!("export {key}=")))
                .unwrap_or_else(|| panic!("no {key} in scripts/test-cluster.sh env"))
                .to_string()
        };
        let c = Cluster {
            kubeconfig: value("KUBECONFIG").into(),
            bin: value("MOULT_K8S_BIN").into(),
        };
        let ready = c.kubectl(&["get", "--raw", "/readyz"]);
        assert!(
            ready.status.success(),
            "the test control plane is not running; start it with `bash scripts/test-cluster.sh up` ({})",
            String::from_utf8_lossy(&ready.stderr)
        );
        for (file, crd) in [("rlrun", "rlruns"), ("enginepool", "enginepools")] {
            let file = format!("{ROOT}/crds/{file}.yaml");
            let applied = c.kubectl(&["apply", "--server-side", "--force-conflicts", "-f", &file]);
            assert!(
                applied.status.success(),
                "applying the CRD: {}",
                String::from_utf8_lossy(&applied.stderr)
            );
            let crd = format!("crd/{crd}.moult.dev");
            let est = c.kubectl(&["wait", "--for=condition=Established", &crd, "--timeout=30s"]);
            assert!(
                est.status.success(),
                "the CRD is not established: {}",
                String::from_utf8_lossy(&est.stderr)
            );
        }
        c
    })
}

impl Cluster {
    /// A control-plane tool (`kubectl`) with this cluster's kubeconfig.
    pub fn command(&self, tool: &str) -> Command {
        let mut c = Command::new(self.bin.join(tool));
        c.env("KUBECONFIG", &self.kubeconfig);
        c
    }

    pub fn kubectl(&self, args: &[&str]) -> std::process::Output {
        self.command("kubectl")
            .args(args)
            .output()
            .expect("kubectl runs")
    }

    /// A client acting as the cluster admin.
    pub async fn client(&self) -> Client {
        // kube uses rustls; with more than one provider compiled in, one must be chosen.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let kc = Kubeconfig::read_from(&self.kubeconfig).expect("the kubeconfig reads");
        let config = Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
            .await
            .expect("the kubeconfig is valid");
        Client::try_from(config).expect("a client")
    }
}

/// A namespace of one test's own, deleted (with everything in it, and the PersistentVolumes
/// [`Namespace::bound_claim`] made for it) when dropped.
pub struct Namespace {
    pub name: String,
}

/// Label on the PersistentVolumes (cluster-scoped) made for a test namespace.
const TEST_NAMESPACE_LABEL: &str = "moult.dev/test-namespace";

impl Namespace {
    pub fn new(test: &str) -> Namespace {
        let suffix = std::process::id() % 100_000;
        let name = format!("t-{}-{suffix}", test.replace('_', "-"))
            .chars()
            .take(63)
            .collect::<String>();
        let out = cluster().kubectl(&["create", "namespace", &name]);
        assert!(
            out.status.success(),
            "creating namespace {name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        // Pods need the namespace's default ServiceAccount, which the controller-manager makes.
        wait_until(
            Duration::from_secs(30),
            &format!("serviceaccount default in {name}"),
            || {
                cluster()
                    .kubectl(&["get", "serviceaccount", "default", "-n", &name])
                    .status
                    .success()
            },
        );
        Namespace { name }
    }

    /// kubectl in this namespace; panics with stderr when it fails.
    pub fn kubectl(&self, args: &[&str]) -> String {
        let mut all = vec!["-n", self.name.as_str()];
        all.extend_from_slice(args);
        let out = cluster().kubectl(&all);
        assert!(
            out.status.success(),
            "kubectl {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// `kubectl apply` of YAML text; panics with stderr when it fails.
    pub fn apply(&self, yaml: &str) {
        use std::io::Write;
        let mut child = cluster()
            .command("kubectl")
            .args(["-n", &self.name, "apply", "-f", "-"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("kubectl runs");
        let mut stdin = child.stdin.take().expect("a stdin");
        stdin.write_all(yaml.as_bytes()).expect("kubectl reads");
        drop(stdin);
        let out = child.wait_with_output().expect("kubectl ends");
        assert!(
            out.status.success(),
            "kubectl apply failed: {}\n{yaml}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// A PersistentVolumeClaim `claim` bound to a hostPath PersistentVolume on the local folder
    /// `dir` (made here), once the PV controller has bound them: a pod using the claim schedules
    /// only then. Returns `dir`, for [`kubelet::KubeletOptions::claims`].
    pub fn bound_claim(&self, claim: &str, dir: &Path) -> PathBuf {
        std::fs::create_dir_all(dir).expect("the claim's folder");
        let pv = format!("{}-{claim}", self.name);
        let ns = &self.name;
        let dir = dir.display();
        // claimRef and volumeName pre-bind the pair; storageClassName "" keeps any default
        // StorageClass (and its provisioner) out of it.
        self.apply(&format!(
            r#"apiVersion: v1
kind: PersistentVolume
metadata:
  name: {pv}
  labels: {{{TEST_NAMESPACE_LABEL}: {ns}}}
spec:
  storageClassName: ""
  capacity: {{storage: 1Gi}}
  accessModes: [ReadWriteOnce]
  persistentVolumeReclaimPolicy: Retain
  hostPath: {{path: "{dir}", type: DirectoryOrCreate}}
  claimRef: {{namespace: {ns}, name: {claim}}}
---
apiVersion: v1
kind: PersistentVolumeClaim
metadata:
  name: {claim}
spec:
  storageClassName: ""
  volumeName: {pv}
  accessModes: [ReadWriteOnce]
  resources: {{requests: {{storage: 1Gi}}}}
"#
        ));
        wait_until(
            Duration::from_secs(60),
            &format!("PVC {claim} Bound"),
            || self.kubectl(&["get", "pvc", claim, "-o", "jsonpath={.status.phase}"]) == "Bound",
        );
        PathBuf::from(dir.to_string())
    }
}

impl Drop for Namespace {
    fn drop(&mut self) {
        let _ = cluster().kubectl(&["delete", "namespace", &self.name, "--wait=false"]);
        let selector = format!("{TEST_NAMESPACE_LABEL}={}", self.name);
        let _ = cluster().kubectl(&["delete", "pv", "-l", &selector, "--wait=false"]);
    }
}

/// Polls `check` every 200 ms until it holds; panics naming `what` after `timeout`.
pub fn wait_until(timeout: Duration, what: &str, mut check: impl FnMut() -> bool) {
    let start = Instant::now();
    while !check() {
        assert!(
            start.elapsed() < timeout,
            "timed out after {timeout:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// [`wait_until`] for async tests: the same polling, without blocking the executor.
pub async fn eventually(timeout: Duration, what: &str, mut check: impl FnMut() -> bool) {
    let start = Instant::now();
    while !check() {
        assert!(
            start.elapsed() < timeout,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A `moult-operator` process watching one namespace, killed when dropped.
pub struct Operator {
    pub child: Child,
    pub log: PathBuf,
}

impl Operator {
    /// Starts the operator for `ns` (lease in `ns`, 6 s lease renewed every second, as in the
    /// operator's own cluster tests). The binary is not this crate's: `scripts/test.sh` builds
    /// it next to `moult`.
    pub fn start(ns: &Namespace, identity: &str) -> Operator {
        let bin = Path::new(env!("CARGO_BIN_EXE_moult"))
            .parent()
            .expect("the moult binary is in a folder")
            .join("moult-operator");
        assert!(
            bin.exists(),
            "{} is missing: build it first: cargo build -p moult-operator",
            bin.display()
        );
        let log = std::env::temp_dir().join(format!("moult-operator-{}-{identity}.log", ns.name));
        let file = std::fs::File::create(&log).expect("the log file");
        let child = Command::new(&bin)
            .env("KUBECONFIG", &cluster().kubeconfig)
            .env("RUST_LOG", "info,kube=warn")
            .args(["--namespace", &ns.name, "--lease-namespace", &ns.name])
            .args(["--identity", identity, "--metrics-addr", "127.0.0.1:0"])
            .args(["--lease-duration", "6s", "--lease-renew", "1s"])
            .args([
                "--runtime-image",
                "moult-runtime:test",
                "--init-image",
                "moult-init:test",
            ])
            .stdout(Stdio::null())
            .stderr(file)
            .spawn()
            .expect("the operator binary starts");
        Operator { child, log }
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Operator {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
