//! The cluster-test helper: connects to the test control plane that `scripts/test-cluster.sh up`
//! started (real etcd, kube-apiserver, controller-manager, scheduler, KWOK), gives each test a
//! namespace of its own and runs the real `moult-operator` binary against it.
//!
//! The tests that use it are `#[ignore]`d with a reason and named `cluster_*`;
//! `scripts/test.sh` starts the control plane and runs them with `--ignored`. Without a running
//! control plane they fail with that instruction: they never pass against a mock.

#![allow(dead_code)]

pub mod matrix;
pub mod netpol;
pub mod runs;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};

pub const ROOT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/..");

/// Where the control plane is.
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
        assert!(out.status.success(), "scripts/test-cluster.sh env failed: {}", String::from_utf8_lossy(&out.stderr));
        let env = String::from_utf8_lossy(&out.stdout);
        let value = |key: &str| {
            env.lines()
                .find_map(|l| l.strip_prefix(&format!("export {key}=")))
                .unwrap_or_else(|| panic!("no {key} in scripts/test-cluster.sh env"))
                .to_string()
        };
        let c = Cluster { kubeconfig: value("KUBECONFIG").into(), bin: value("MOULT_K8S_BIN").into() };
        let ready = c.kubectl(&["get", "--raw", "/readyz"]);
        assert!(
            ready.status.success(),
            "the test control plane is not running; start it with `bash scripts/test-cluster.sh up` ({})",
            String::from_utf8_lossy(&ready.stderr)
        );
        for (file, crd) in [("rlrun", "rlruns"), ("enginepool", "enginepools")] {
            let file = format!("{ROOT}/crds/{file}.yaml");
            let applied = c.kubectl(&["apply", "--server-side", "--force-conflicts", "-f", &file]);
            assert!(applied.status.success(), "applying the CRD: {}", String::from_utf8_lossy(&applied.stderr));
            let crd = format!("crd/{crd}.moult.dev");
            let est = c.kubectl(&["wait", "--for=condition=Established", &crd, "--timeout=30s"]);
            assert!(est.status.success(), "the CRD is not established: {}", String::from_utf8_lossy(&est.stderr));
        }
        c
    })
}

impl Cluster {
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

    pub async fn client(&self) -> Client {
        let kc = Kubeconfig::read_from(&self.kubeconfig).expect("the kubeconfig reads");
        let config = Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
            .await
            .expect("the kubeconfig is valid");
        Client::try_from(config).expect("a client")
    }
}

/// A namespace of one test's own, deleted (with everything in it) when dropped.
pub struct Namespace {
    pub name: String,
}

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
        let out = self.try_kubectl(args);
        assert!(
            out.status.success(),
            "kubectl {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    pub fn try_kubectl(&self, args: &[&str]) -> std::process::Output {
        let mut all = vec!["-n", self.name.as_str()];
        all.extend_from_slice(args);
        cluster().kubectl(&all)
    }

    /// `kubectl apply` of YAML text.
    pub fn apply(&self, yaml: &str) -> std::process::Output {
        use std::io::Write;
        let mut child = cluster()
            .command("kubectl")
            .args(["-n", &self.name, "apply", "-f", "-"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("kubectl runs");
        child
            .stdin
            .take()
            .unwrap()
            .write_all(yaml.as_bytes())
            .unwrap();
        child.wait_with_output().unwrap()
    }

    /// A jsonpath of one object.
    pub fn get(&self, object: &str, jsonpath: &str) -> String {
        let out = self.try_kubectl(&["get", object, "-o", &format!("jsonpath={jsonpath}")]);
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

impl Drop for Namespace {
    fn drop(&mut self) {
        let _ = cluster().kubectl(&["delete", "namespace", &self.name, "--wait=false"]);
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

/// A `moult-operator` process watching one namespace, killed when dropped.
pub struct Operator {
    pub child: Child,
    pub log: PathBuf,
    pub identity: String,
}

impl Operator {
    /// Starts the operator for `ns` with short lease timings (6 s lease renewed every second, so
    /// a loaded 2-core machine does not make a leader miss its renewals), lease in `ns`.
    pub fn start(ns: &Namespace, identity: &str) -> Operator {
        Operator::start_as(ns, identity, &cluster().kubeconfig)
    }

    /// The same with another kubeconfig (another identity).
    pub fn start_as(ns: &Namespace, identity: &str, kubeconfig: &Path) -> Operator {
        Operator::launch(identity, kubeconfig, &ns.name, &ns.name, &[])
    }

    /// The operator for `ns` with more flags.
    pub fn start_with(ns: &Namespace, identity: &str, flags: &[&str]) -> Operator {
        Operator::launch(identity, &cluster().kubeconfig, &ns.name, &ns.name, flags)
    }

    /// An operator acting with `kubeconfig`, watching `watch` (comma-separated namespaces), its
    /// Lease in `lease_ns`, with `flags` added.
    pub fn launch(
        identity: &str,
        kubeconfig: &Path,
        watch: &str,
        lease_ns: &str,
        flags: &[&str],
    ) -> Operator {
        let log = std::env::temp_dir().join(format!(
            "moult-operator-{}-{identity}.log",
            watch.replace(',', "+")
        ));
        let file = std::fs::File::create(&log).expect("the log file");
        let child = Command::new(env!("CARGO_BIN_EXE_moult-operator"))
            .env("KUBECONFIG", kubeconfig)
            .env("RUST_LOG", "info,kube=warn")
            .args([
                "--namespace",
                watch,
                "--lease-namespace",
                lease_ns,
                "--identity",
                identity,
            ])
            .args([
                "--metrics-addr",
                "127.0.0.1:0",
                "--lease-duration",
                "6s",
                "--lease-renew",
                "1s",
            ])
            .args([
                "--runtime-image",
                "moult-runtime:test",
                "--init-image",
                "moult-init:test",
            ])
            .args(flags)
            .stdout(Stdio::null())
            .stderr(file)
            .spawn()
            .expect("the operator binary starts");
        Operator {
            child,
            log,
            identity: identity.into(),
        }
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The address of its /metrics (from its log).
    pub fn metrics_addr(&self) -> String {
        let mut addr = String::new();
        wait_until(
            Duration::from_secs(30),
            "the operator's metrics address",
            || {
                let text = self.log_text();
                match text.split("addr=").nth(1) {
                    Some(rest) => {
                        addr = rest.split_whitespace().next().unwrap_or("").to_string();
                        true
                    }
                    None => false,
                }
            },
        );
        addr
    }

    /// One metric's value, summed over its labels, from /metrics (0 when absent).
    pub fn metric(&self, name: &str, labels: &str) -> f64 {
        let body = http_get(&self.metrics_addr(), "/metrics");
        body.lines()
            .filter(|l| l.starts_with(name) && l.contains(labels))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM (graceful: the lease is released).
    pub fn terminate(&mut self) {
        let _ = Command::new("kill")
            .arg("-TERM")
            .arg(self.child.id().to_string())
            .status();
        let _ = self.child.wait();
    }
}

impl Drop for Operator {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A kubeconfig that acts as `user` (impersonation by the admin), written next to the real one.
pub fn kubeconfig_as(user: &str, tag: &str) -> PathBuf {
    let text = std::fs::read_to_string(&cluster().kubeconfig).expect("the kubeconfig");
    let line = text
        .lines()
        .find(|l| l.trim_start().starts_with("client-key:"))
        .expect("a client key");
    let indent = &line[..line.len() - line.trim_start().len()];
    let text = text.replace(line, &format!("{line}\n{indent}as: {user}"));
    let path = std::env::temp_dir().join(format!("moult-kubeconfig-{tag}"));
    std::fs::write(&path, text).unwrap();
    path
}

/// A plain HTTP/1.0 GET on loopback.
pub fn http_get(addr: &str, path: &str) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).expect("metrics endpoint reachable");
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").unwrap();
    let mut body = String::new();
    s.read_to_string(&mut body).unwrap();
    body
}

pub fn example_path() -> PathBuf {
    Path::new(ROOT).join("examples/cluster/gsm8k-grpo.yaml")
}

/// The RLRun document of the cluster example (the file also holds the claims it needs).
pub fn example_run_yaml() -> String {
    let text = std::fs::read_to_string(example_path()).unwrap();
    text.split("\n---\n")
        .find(|d| d.contains("kind: RLRun"))
        .expect("the example has an RLRun")
        .to_string()
}

/// A small RLRun without volumes: `engines` vLLM engines with 2 GPUs each, one 8-GPU trainer.
pub fn small_run(name: &str, engines: i32) -> String {
    format!(
        r#"apiVersion: moult.dev/v1alpha1
kind: RLRun
metadata:
  name: {name}
spec:
  model: {{path: Qwen/Qwen3-0.6B}}
  agent:
    env: math
    replicas: 1
    dataset: {{path: /data/tasks.jsonl}}
  engines: {{replicas: {engines}, tensorParallelSize: 2}}
  trainer: {{nodes: 1, gpusPerNode: 8}}
  totalSteps: 10
"#
    )
}

/// Where a rule lives: a CEL rule, or the OpenAPI schema (ranges, enums). `RLRun::validate`
/// checks both, as the runtime does before it runs anything.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rule {
    Cel,
    Schema,
}

/// One manifest the API server and the runtime must both refuse.
pub struct Invalid {
    pub yaml: String,
    /// The field path both name ("spec.rollout"); empty for a rule on the whole object.
    pub field: &'static str,
    /// What the API server says, and the runtime too.
    pub message: &'static str,
    pub rule: Rule,
}

/// Invalid variants of `base` (a [`small_run`]) and what the API server must say.
pub fn invalid_cases(base: &str) -> Vec<Invalid> {
    let spec = |extra: &str| base.replace("totalSteps: 10", &format!("totalSteps: 10\n  {extra}"));
    let engines = |extra: &str| {
        base.replace(
            "tensorParallelSize: 2}",
            &format!("tensorParallelSize: 2, {extra}}}"),
        )
    };
    let agent =
        |extra: &str| base.replace("    env: math\n", &format!("    env: math\n    {extra}\n"));
    let case = |yaml: String, field, message, rule| Invalid {
        yaml,
        field,
        message,
        rule,
    };
    use Rule::{Cel, Schema};
    vec![
        case(engines("gpusPerEngine: 3"), "spec.engines", "engines.gpusPerEngine must be a multiple of engines.tensorParallelSize", Cel),
        case(engines("backend: Builtin"), "spec.engines", "engines.tensorParallelSize must be 1 with backend Builtin", Cel),
        case(engines(r#"extraArgs: ["--port", "9999"]"#), "spec.engines", "engines.extraArgs cannot set a flag moult sets itself", Cel),
        case(engines(r#"extraArgs: ["--served-model-name=other"]"#), "spec.engines", "engines.extraArgs cannot set a flag moult sets itself", Cel),
        case(engines(r#"extraArgs: ["--tensor_parallel_size", "4"]"#), "spec.engines", "engines.extraArgs cannot set a flag moult sets itself", Cel),
        case(engines(r#"extraArgs: ["--dtype", "int8"]"#), "spec.engines", "engines.extraArgs --dtype must be auto, float32, bfloat16 or float16", Cel),
        case(spec("algorithm: {isCorrection: {level: Geo, mode: Clip, low: 0.5, high: 2}}"), "spec.algorithm.isCorrection", "isCorrection.level Seq and Geo are sequence-level gates: they need isCorrection.mode Mask", Cel),
        case(spec("algorithm: {isCorrection: {level: Token, mode: Mask, low: 5, high: 0.5}}"), "spec.algorithm.isCorrection", "isCorrection.low must be smaller than isCorrection.high", Cel),
        case(spec("algorithm: {isCorrection: {level: Token, mode: Mask, high: 5}}"), "spec.algorithm.isCorrection", "isCorrection.mode Mask and Clip need both isCorrection.low and isCorrection.high", Cel),
        case(spec("algorithm: {isCorrection: {level: Token, mode: Trunc, low: 0.1, high: 2}}"), "spec.algorithm.isCorrection", "isCorrection.mode Trunc uses only isCorrection.high: remove isCorrection.low", Cel),
        case(spec("algorithm: {isCorrection: {level: Token, mode: Trunc, high: 0}}"), "spec.algorithm.isCorrection", "isCorrection.high must be greater than 0", Cel),
        case(spec("algorithm: {estimator: GRPO, groupSize: 1}"), "spec.algorithm", "GRPO and RLOO compare samples of one prompt: algorithm.groupSize must be at least 2", Cel),
        case(spec("rollout: {topP: 1.5}"), "spec.rollout", "rollout.topP must be greater than 0 and at most 1", Cel),
        case(spec("rollout: {temperature: 0}"), "spec.rollout", "rollout.temperature must be greater than 0", Cel),
        case(base.replace("gpusPerNode: 8", "gpusPerNode: 0"), "spec", "engines.weightTransfer.transport Nccl (vLLM's default) sends weights from the trainer's GPU", Cel),
        case(base.replace("    env: math\n", "    form: ChatAgent\n"), "spec.agent", "agent.form ChatAgent runs your program: set agent.image and agent.command", Cel),
        case(base.replace("    env: math\n", "    env: math\n    timeout: ten minutes\n"), "spec.agent", "agent.timeout must be a duration such as 90s, 10m or 1h30m", Cel),
        case(base.replace("    env: math\n", ""), "spec.agent", "agent.form Env needs agent.env (a built-in environment) or agent.image (an external one)", Cel),
        case(base.replace("name: bad", "name: this-name-is-far-too-long-for-an-rlrun-object"), "", "RLRun names are at most 40 characters", Cel),
        case(base.replace("totalSteps: 10", "totalSteps: 0"), "spec.totalSteps", "spec.totalSteps: Invalid value: 0: spec.totalSteps in body should be greater than or equal to 1", Schema),
        case(base.replace("replicas: 1, tensor", "replicas: -1, tensor"), "spec.engines.replicas", "spec.engines.replicas in body should be greater than or equal to 0", Schema),
        case(spec("rollout: {temperature: 11}"), "spec.rollout.temperature", "spec.rollout.temperature in body should be less than or equal to 10", Schema),
        // argparse takes any unique prefix of a flag, and vLLM's parser reads `_` as `-`.
        case(engines(r#"extraArgs: ["--served-model", "other"]"#), "spec.engines", "engines.extraArgs cannot set a flag moult sets itself: --served-model-name", Cel),
        case(engines(r#"extraArgs: ["--tensor_parallel=4"]"#), "spec.engines", "engines.extraArgs cannot set a flag moult sets itself: --tensor-parallel-size", Cel),
        case(engines(r#"extraArgs: ["-t", "4"]"#), "spec.engines", "engines.extraArgs cannot set a flag moult sets itself: -tp", Cel),
        case(agent("egress: {to: [{cidr: 10.0.0.1/8}]}"), "spec.agent.egress.to[0]", "agent.egress.to[].cidr must be an IP block in CIDR notation", Cel),
        case(agent("egress: {to: [{cidr: 10.0.0.0/8, except: [192.168.0.0/16]}]}"), "spec.agent.egress.to[0]", "agent.egress.to[].except must hold IP blocks strictly inside agent.egress.to[].cidr", Cel),
        case(agent("egress: {to: [{cidr: 0.0.0.0/0, ports: [{port: 443, endPort: 80}]}]}"), "spec.agent.egress.to[0].ports[0]", "agent.egress.to[].ports[].endPort must be at least its port", Cel),
        case(agent("egress: {allowAll: true, to: [{cidr: 0.0.0.0/0}]}"), "spec.agent.egress", "agent.egress.allowAll already opens every destination", Cel),
        case(base.replace("model: {path: Qwen/Qwen3-0.6B}", "model: {path: Qwen/Qwen3-0.6B, claimName: My_Models}"), "spec.model", "model.claimName must name a PersistentVolumeClaim", Cel),
        case(spec("scheduling: {tolerations: [{operator: Exists}]}"), "spec.scheduling", "scheduling.tolerations must each name a taint key", Cel),
        case(spec("scheduling: {tolerations: [{key: node-role.kubernetes.io/control-plane, operator: Exists}]}"), "spec.scheduling", "scheduling.tolerations must each name a taint key, and none of node-role.kubernetes.io/", Cel),
        case(engines("resources: {limits: {cpu: lots}}"), "spec.engines", "engines.resources limits and requests must be quantities", Cel),
        case(agent("resources: {requests: {memory: 1.5 GB}}"), "spec.agent", "agent.resources limits and requests must be quantities", Cel),
        case(engines("resources: {requests: {memory: 4Gi}, limits: {memory: 2Gi}}"), "spec.engines", "engines.resources: a limit is below its request", Cel),
        case(agent("resources: {requests: {cpu: 1500m}, limits: {cpu: 1}}"), "spec.agent", "agent.resources: a limit is below its request", Cel),
        case(spec("coordinator: {resources: {requests: {cpu: 2}, limits: {cpu: 500m}}}"), "spec.coordinator", "coordinator.resources: a limit is below its request", Cel),
        case(spec("scheduling: {priorityClassName: system-node-critical}"), "spec.scheduling", "scheduling.priorityClassName must name a PriorityClass", Cel),
        case(spec("scheduling: {queueName: team a}"), "spec.scheduling", "scheduling.queueName names a Kueue LocalQueue", Cel),
        case(spec("scheduling: {nodeSelector: {'gpu type': a100}}"), "spec.scheduling", "scheduling.nodeSelector must map label keys", Cel),
        case(base.replace("name: bad", "name: 9lives"), "", "RLRun names start with a lowercase letter", Cel),
        case(base.replace("model: {path: Qwen/Qwen3-0.6B}", &format!("model: {{path: {}}}", "q".repeat(4097))), "spec.model.path", "spec.model.path: Too long: may not be more than 4096 bytes", Schema),
        case(base.replace("replicas: 1, tensor", "replicas: 1025, tensor"), "spec.engines.replicas", "spec.engines.replicas in body should be less than or equal to 1024", Schema),
        case(spec("rollout: {maxTurns: 1025}"), "spec.rollout.maxTurns", "spec.rollout.maxTurns in body should be less than or equal to 1024", Schema),
        case(spec("algorithm: {batchSize: 100000}"), "spec.algorithm.batchSize", "spec.algorithm.batchSize in body should be less than or equal to 65536", Schema),
        case(agent(&format!("command: [{}]", vec!["x"; 257].join(", "))), "spec.agent.command", "spec.agent.command: Too many: 257: must have at most 256 items", Schema),
        case(spec(&format!("scheduling: {{nodeSelector: {{{}}}}}", (0..33).map(|i| format!("k{i}: v")).collect::<Vec<_>>().join(", "))), "spec.scheduling.nodeSelector", "spec.scheduling.nodeSelector: Too many: 33: must have at most 32 items", Schema),
        // A string of an embedded Kubernetes type, bounded by the CRD's default (lib.rs).
        case(spec(&format!("scheduling: {{tolerations: [{{key: {}, operator: Exists}}]}}", "k".repeat(1025))), "spec.scheduling.tolerations[0].key", "spec.scheduling.tolerations[0].key: Too long: may not be more than 1024 bytes", Schema),
        case(
            spec("algorithm: {estimator: PPO}"),
            "spec.algorithm.estimator",
            "spec.algorithm.estimator: Unsupported value: \"PPO\": supported values: \"GRPO\", \"RLOO\", \"REINFORCE++\", \"OnPolicyDistillation\"",
            Schema,
        ),
    ]
}

/// The run's `status.phase`.
pub fn phase(ns: &Namespace, run: &str) -> String {
    ns.get(&format!("rlrun/{run}"), "{.status.phase}")
}

/// Waits (at most a minute) until the run's phase is `want`.
pub fn wait_phase(ns: &Namespace, run: &str, want: &str) {
    wait_until(
        Duration::from_secs(60),
        &format!("rlrun/{run} phase {want}"),
        || phase(ns, run) == want,
    );
}

/// A field (`reason`, `message`, `status`) of one of the run's conditions.
pub fn condition(ns: &Namespace, run: &str, type_: &str, field: &str) -> String {
    ns.get(
        &format!("rlrun/{run}"),
        &format!("{{.status.conditions[?(@.type==\"{type_}\")].{field}}}"),
    )
}

/// `helm ARGS` against the test cluster; its stdout (panics naming the args if it fails).
pub fn helm(args: &[&str]) -> String {
    let out = cluster()
        .command("helm")
        .args(args)
        .output()
        .expect("helm runs");
    assert!(
        out.status.success(),
        "helm {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}
