//! The operator's fuzz target (docs/security.md, "Fuzzing"): the child builders on arbitrary
//! specs. Every kind of run (`support/runs.rs`) is mutated: names of up to 253 characters, odd
//! ones included, counts from the whole integer range, strings, lists and maps, optional parts
//! switched on and off. For each, the builders never panic, and either the spec is refused (by
//! the CRD's rules, `RLRun::validate`, or by the operator, naming the field) or every child:
//! has the run as controller owner; has a name and labels the API server takes (DNS-1123
//! lengths and characters; Services and workloads DNS-1035 labels short enough for their pods'
//! names and revision labels); and every container is locked down with size-limited writable
//! volumes; NetworkPolicies hold only valid IP blocks and ports.
//!
//! `cargo test -p moult-operator --test fuzz` runs briefly with a fixed seed. With
//! `MOULT_FUZZ_SECONDS=N` it runs for N seconds on fresh random seeds (`scripts/fuzz.sh`).
//! Either way it prints `target | executions | failures`, and each failure's shrunk input.

mod support;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Container, PodTemplateSpec, Toleration};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use moult_operator::api::{
    AgentEgressSpec, AgentForm, CheckpointSpec, EgressPort, EgressTarget, EngineBackend, Estimator,
    Protocol, RLRun, TeacherSpec, WeightTransferSpec, WeightTransport,
};
use moult_operator::children::{desired, Children, Config, InvalidSpec};
use proptest::prelude::*;
use proptest::test_runner::{Config as RunnerConfig, RngAlgorithm, TestError, TestRng, TestRunner};

/// Cases of the brief run (each builds a run and evaluates the CRD's rules on it).
const BRIEF_CASES: u32 = 96;

/// Cases whose spec was valid and built (the rest were refused): a run that only ever exercised
/// refusals would show here.
static BUILT: AtomicU64 = AtomicU64::new(0);

/// The message and place of the last panic (proptest reports only the message).
static LAST_PANIC: Mutex<Option<String>> = Mutex::new(None);

fn kinds() -> &'static Vec<(String, RLRun)> {
    static KINDS: OnceLock<Vec<(String, RLRun)>> = OnceLock::new();
    KINDS.get_or_init(support::runs::run_kinds)
}

/// One change to a run's spec or metadata.
#[derive(Debug, Clone)]
enum Mutation {
    Name(String),
    Uid(Option<String>),
    Counts {
        engines: i32,
        agents: i32,
        concurrency: u32,
        nodes: u32,
        gpus_per_node: u32,
        tp: u32,
        gpus_per_engine: Option<u32>,
    },
    Model(String, Option<String>, Option<u32>),
    Dataset(String, Option<String>),
    Agent {
        chat: bool,
        image: Option<String>,
        command: Vec<String>,
        env: Option<String>,
        read_only_root: bool,
    },
    Engines {
        builtin: bool,
        image: Option<String>,
        extra_args: Vec<String>,
        transport: Option<(u8, Option<String>)>,
        ephemeral_storage: Option<String>,
    },
    TrainerImage(Option<String>),
    Checkpoint(Option<(String, u32)>),
    Teacher(Option<(String, Option<String>, Option<i32>)>),
    Scheduling {
        queue: Option<String>,
        priority: Option<String>,
        node_selector: BTreeMap<String, String>,
        tolerations: Vec<(Option<String>, Option<String>, Option<String>)>,
    },
    Egress(Option<(bool, Vec<Target>)>),
    Flags {
        routing_replay: bool,
        suspend: bool,
    },
}

#[derive(Debug, Clone)]
struct Target {
    cidr: String,
    except: Vec<String>,
    ports: Vec<(i32, Option<i32>, u8)>,
}

/// Text: mostly what a user would write, sometimes anything (up to 253 characters, any
/// printable character, the odd control character).
fn text(sensible: &'static str) -> impl Strategy<Value = String> {
    prop_oneof![
        6 => sensible,
        1 => "[A-Za-z0-9._/ -]{0,253}",
        1 => "\\PC{0,253}",
        1 => ".{0,40}",
        1 => Just(String::new()),
    ]
}

fn name() -> impl Strategy<Value = String> {
    prop_oneof![
        5 => "[a-z]([-a-z0-9]{0,38}[a-z0-9])?",
        2 => "[a-z][-a-z0-9]{36,60}[a-z0-9]",
        1 => "[a-z][-a-z0-9.]{0,80}",
        1 => "[A-Za-z0-9._-]{1,253}",
        1 => "\\PC{1,253}",
        1 => Just("default".to_string()),
    ]
}

fn count_i32() -> impl Strategy<Value = i32> {
    prop_oneof![6 => 0i32..6, 1 => any::<i32>(), 1 => Just(i32::MAX), 1 => 1000i32..20000]
}

fn count_u32() -> impl Strategy<Value = u32> {
    prop_oneof![6 => 0u32..10, 1 => any::<u32>(), 1 => Just(u32::MAX), 1 => 10u32..5000]
}

fn cidr() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => (any::<[u8; 4]>(), 0u8..=32).prop_map(|(a, p)| {
            let ip = u32::from_be_bytes(a);
            let masked = if p == 0 { 0 } else { ip & (u32::MAX << (32 - p)) };
            format!("{}/{p}", std::net::Ipv4Addr::from(masked))
        }),
        1 => (any::<[u8; 4]>(), 0u8..40).prop_map(|(a, p)| format!("{}/{p}", std::net::Ipv4Addr::from(a))),
        1 => Just("::/0".to_string()),
        1 => "[0-9a-f:./]{0,40}",
    ]
}

fn target() -> impl Strategy<Value = Target> {
    (
        cidr(),
        prop::collection::vec(cidr(), 0..3),
        prop::collection::vec(
            (
                prop_oneof![1i32..65536, any::<i32>()],
                proptest::option::of(prop_oneof![1i32..65536, any::<i32>()]),
                0u8..3,
            ),
            0..3,
        ),
    )
        .prop_map(|(cidr, except, ports)| Target {
            cidr,
            except,
            ports,
        })
}

fn mutation() -> impl Strategy<Value = Mutation> {
    let opt = |s: &'static str| proptest::option::of(text(s));
    prop_oneof![
        3 => name().prop_map(Mutation::Name),
        // The API server's UIDs are UUIDs (pods carry the run's as a label value).
        1 => proptest::option::of("[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
            .prop_map(Mutation::Uid),
        2 => (count_i32(), count_i32(), count_u32(), count_u32(), count_u32(), count_u32(), proptest::option::of(count_u32()))
            .prop_map(|(engines, agents, concurrency, nodes, gpus_per_node, tp, gpus_per_engine)| Mutation::Counts {
                engines, agents, concurrency, nodes, gpus_per_node, tp, gpus_per_engine,
            }),
        1 => (text("[A-Za-z0-9/._-]{1,60}"), opt("[a-z][a-z0-9-]{0,20}"), proptest::option::of(count_u32()))
            .prop_map(|(p, c, l)| Mutation::Model(p, c, l)),
        1 => (text("[A-Za-z0-9/._-]{1,60}"), opt("[a-z][a-z0-9.-]{0,20}"))
            .prop_map(|(p, c)| Mutation::Dataset(p, c)),
        2 => (any::<bool>(), opt("[a-z0-9./:-]{1,60}"), prop::collection::vec(text("[a-z.=-]{1,12}"), 0..4),
              opt("[a-z_]{1,12}"), any::<bool>())
            .prop_map(|(chat, image, command, env, read_only_root)| Mutation::Agent { chat, image, command, env, read_only_root }),
        2 => (any::<bool>(), opt("[a-z0-9./:-]{1,60}"),
              prop::collection::vec(text("--[a-z_-]{1,20}(=[a-z0-9]{0,5})?|-[a-z]{1,3}|[a-z0-9]{1,8}"), 0..5),
              proptest::option::of((0u8..4, opt("[a-z][a-z0-9-]{0,20}"))),
              opt("[0-9]{1,3}(Gi|Mi|G|k)?"))
            .prop_map(|(builtin, image, extra_args, transport, ephemeral_storage)| Mutation::Engines {
                builtin, image, extra_args, transport, ephemeral_storage,
            }),
        1 => opt("[a-z0-9./:-]{1,60}").prop_map(Mutation::TrainerImage),
        1 => proptest::option::of((text("[a-z][a-z0-9-]{0,20}"), count_u32())).prop_map(Mutation::Checkpoint),
        1 => proptest::option::of((text("[A-Za-z0-9/._-]{1,40}"), opt("[a-z][a-z0-9-]{0,20}"), proptest::option::of(1..4i32))).prop_map(Mutation::Teacher),
        2 => (opt("[a-z][a-z0-9-]{0,30}"), opt("[a-z][a-z0-9.-]{0,30}"),
              prop::collection::btree_map(text("[a-z0-9./-]{1,40}"), text("[A-Za-z0-9._-]{0,20}"), 0..4),
              prop::collection::vec((opt("[a-z0-9./-]{1,40}"), opt("Exists|Equal|Lt"), opt("NoSchedule|NoExecute|Sometimes")), 0..3))
            .prop_map(|(queue, priority, node_selector, tolerations)| Mutation::Scheduling { queue, priority, node_selector, tolerations }),
        2 => proptest::option::of((any::<bool>(), prop::collection::vec(target(), 0..3))).prop_map(Mutation::Egress),
        1 => (any::<bool>(), any::<bool>()).prop_map(|(routing_replay, suspend)| Mutation::Flags { routing_replay, suspend }),
    ]
}

fn apply(run: &mut RLRun, m: Mutation) {
    let s = &mut run.spec;
    match m {
        Mutation::Name(n) => run.metadata.name = Some(n),
        Mutation::Uid(u) => run.metadata.uid = u,
        Mutation::Counts {
            engines,
            agents,
            concurrency,
            nodes,
            gpus_per_node,
            tp,
            gpus_per_engine,
        } => {
            s.engines.replicas = engines;
            s.agent.replicas = agents;
            s.agent.concurrency = concurrency;
            s.trainer.nodes = nodes;
            s.trainer.gpus_per_node = gpus_per_node;
            s.engines.tensor_parallel_size = tp;
            s.engines.gpus_per_engine = gpus_per_engine;
        }
        Mutation::Model(path, claim, len) => {
            s.model.path = path;
            s.model.claim_name = claim;
            s.model.max_model_len = len;
        }
        Mutation::Dataset(path, claim) => {
            s.agent.dataset.path = path;
            s.agent.dataset.claim_name = claim;
        }
        Mutation::Agent {
            chat,
            image,
            command,
            env,
            read_only_root,
        } => {
            s.agent.form = if chat {
                AgentForm::ChatAgent
            } else {
                AgentForm::Env
            };
            s.agent.image = image;
            s.agent.command = command;
            s.agent.env = env;
            s.agent.read_only_root_filesystem = read_only_root;
        }
        Mutation::Engines {
            builtin,
            image,
            extra_args,
            transport,
            ephemeral_storage,
        } => {
            s.engines.backend = if builtin {
                EngineBackend::Builtin
            } else {
                EngineBackend::Vllm
            };
            s.engines.image = image;
            s.engines.extra_args = extra_args;
            s.engines.weight_transfer = transport.and_then(|(t, claim_name)| {
                let transport = match t {
                    0 => WeightTransport::Nccl,
                    1 => WeightTransport::Tcp,
                    2 => WeightTransport::Filesystem,
                    _ => return None,
                };
                Some(WeightTransferSpec {
                    transport,
                    claim_name,
                })
            });
            if let Some(q) = ephemeral_storage {
                s.engines
                    .resources
                    .get_or_insert_with(Default::default)
                    .limits
                    .get_or_insert_with(Default::default)
                    .insert("ephemeral-storage".into(), Quantity(q));
            }
        }
        Mutation::TrainerImage(image) => s.trainer.image = image,
        Mutation::Checkpoint(c) => {
            s.checkpoint = c.map(|(claim_name, interval_steps)| CheckpointSpec {
                claim_name,
                interval_steps,
            })
        }
        Mutation::Teacher(t) => {
            s.algorithm.estimator = if t.is_some() {
                Estimator::OnPolicyDistillation
            } else {
                Estimator::Grpo
            };
            s.algorithm.teacher = t.map(|(path, claim_name, replicas)| TeacherSpec {
                path,
                claim_name,
                replicas,
            });
        }
        Mutation::Scheduling {
            queue,
            priority,
            node_selector,
            tolerations,
        } => {
            let sc = &mut s.scheduling;
            sc.queue_name = queue;
            sc.priority_class_name = priority;
            sc.node_selector = node_selector;
            sc.tolerations = tolerations
                .into_iter()
                .map(|(key, operator, effect)| Toleration {
                    key,
                    operator,
                    effect,
                    ..Toleration::default()
                })
                .collect();
        }
        Mutation::Egress(e) => {
            s.agent.egress = e.map(|(allow_all, to)| AgentEgressSpec {
                allow_all,
                to: to
                    .into_iter()
                    .map(|t| EgressTarget {
                        cidr: t.cidr,
                        except: t.except,
                        ports: t
                            .ports
                            .into_iter()
                            .map(|(port, end_port, p)| EgressPort {
                                port,
                                end_port,
                                protocol: [Protocol::Tcp, Protocol::Udp, Protocol::Sctp]
                                    [usize::from(p) % 3],
                            })
                            .collect(),
                    })
                    .collect(),
            })
        }
        Mutation::Flags {
            routing_replay,
            suspend,
        } => {
            s.routing_replay = routing_replay;
            s.suspend = suspend;
        }
    }
}

fn case() -> impl Strategy<Value = (usize, Vec<Mutation>)> {
    (0..kinds().len(), prop::collection::vec(mutation(), 0..6))
}

fn is_dns_label(s: &str, max: usize) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= max
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
}

fn is_dns_subdomain(s: &str) -> bool {
    s.len() <= 253 && s.split('.').all(|l| is_dns_label(l, 63))
}

fn is_label_value(v: &str) -> bool {
    let b = v.as_bytes();
    b.is_empty()
        || (b.len() <= 63
            && b.iter()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
            && b[0].is_ascii_alphanumeric()
            && b[b.len() - 1].is_ascii_alphanumeric())
}

fn is_label_key(k: &str) -> bool {
    let (prefix, name) = match k.rsplit_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, k),
    };
    prefix.is_none_or(is_dns_subdomain) && !name.is_empty() && is_label_value(name)
}

fn is_quantity(q: &str) -> bool {
    // Kubernetes' own pattern of a quantity.
    let digits = q.trim_start_matches(['+', '-']);
    let number_end = digits
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(digits.len());
    number_end > 0
        && digits[number_end..]
            .chars()
            .all(|c| "eEinumkKMGTP+-0123456789".contains(c))
}

fn labels_ok(labels: Option<&BTreeMap<String, String>>, what: &str) -> Result<(), String> {
    for (k, v) in labels.into_iter().flatten() {
        if !is_label_key(k) || !is_label_value(v) {
            return Err(format!("{what}: label {k:?}={v:?} is not valid"));
        }
    }
    Ok(())
}

fn container_ok(c: &Container, agent_code_writable: bool) -> Result<(), String> {
    let sc = c
        .security_context
        .as_ref()
        .ok_or(format!("{}: no security context", c.name))?;
    let drop = sc.capabilities.as_ref().and_then(|c| c.drop.clone());
    let locked = sc.allow_privilege_escalation == Some(false)
        && sc.run_as_non_root == Some(true)
        && sc.privileged.is_none()
        && drop == Some(vec!["ALL".to_string()])
        && sc.capabilities.as_ref().is_some_and(|c| c.add.is_none())
        && sc.seccomp_profile.as_ref().map(|s| s.type_.as_str()) == Some("RuntimeDefault")
        && sc.read_only_root_filesystem == Some(!agent_code_writable);
    if !locked {
        return Err(format!("{}: not locked down: {sc:?}", c.name));
    }
    for v in c.env.iter().flatten() {
        if v.name.is_empty()
            || !v
                .name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'))
        {
            return Err(format!("{}: env name {:?}", c.name, v.name));
        }
    }
    Ok(())
}

fn template_ok(t: &PodTemplateSpec, what: &str, agent_code_writable: bool) -> Result<(), String> {
    labels_ok(t.metadata.as_ref().and_then(|m| m.labels.as_ref()), what)?;
    let p = t.spec.as_ref().ok_or(format!("{what}: no pod spec"))?;
    if p.security_context.as_ref().and_then(|s| s.run_as_non_root) != Some(true) {
        return Err(format!("{what}: the pod may run as root"));
    }
    if let Some(sa) = &p.service_account_name {
        if !is_dns_subdomain(sa) {
            return Err(format!("{what}: service account {sa:?}"));
        }
    }
    for v in p.volumes.iter().flatten() {
        if !is_dns_label(&v.name, 63) {
            return Err(format!("{what}: volume name {:?}", v.name));
        }
        if let Some(e) = &v.empty_dir {
            match &e.size_limit {
                Some(q) if is_quantity(&q.0) => {}
                other => return Err(format!("{what}: emptyDir {} limit {other:?}", v.name)),
            }
        }
        if let Some(c) = &v.persistent_volume_claim {
            if !is_dns_subdomain(&c.claim_name) {
                return Err(format!("{what}: claim {:?}", c.claim_name));
            }
        }
    }
    for c in p.init_containers.iter().flatten().chain(&p.containers) {
        // Agent code runs in the agent pod's sandbox container, which holds no credential.
        let agent_code = what == "agents" && c.name == "sandbox";
        container_ok(c, agent_code && agent_code_writable).map_err(|e| format!("{what}: {e}"))?;
        if agent_code && c.env.iter().flatten().any(|v| v.value_from.is_some()) {
            return Err(format!("{what}: the sandbox reads a secret or field"));
        }
        for m in c.volume_mounts.iter().flatten() {
            if !p.volumes.iter().flatten().any(|v| v.name == m.name) {
                return Err(format!("{what}: mount of no volume {}", m.name));
            }
        }
    }
    Ok(())
}

/// The invariants of the children of a valid run.
fn children_ok(run: &RLRun, c: Children) -> Result<(), String> {
    let uid = run.metadata.uid.clone().unwrap_or_default();
    let name = run.metadata.name.clone().unwrap_or_default();
    let writable = !run.spec.agent.read_only_root_filesystem;
    for (what, t) in [
        ("engine", &c.engines.as_ref().unwrap().spec.template),
        ("trainer", &c.trainer.spec.template),
        ("coordinator", &c.coordinator.spec.template),
        ("agents", &c.agents.spec.template),
    ] {
        template_ok(t, what, writable)?;
    }
    for np in [
        c.network_policies.engine.as_ref().unwrap(),
        &c.network_policies.trainer,
        &c.network_policies.coordinator,
        &c.network_policies.agents,
    ] {
        let spec = np.spec.as_ref().unwrap();
        let rules = spec
            .ingress
            .iter()
            .flatten()
            .map(|r| (r.from.clone(), r.ports.clone()))
            .chain(
                spec.egress
                    .iter()
                    .flatten()
                    .map(|r| (r.to.clone(), r.ports.clone())),
            );
        for (peers, ports) in rules {
            for p in peers.iter().flatten() {
                if let Some(b) = &p.ip_block {
                    let parsed = |s: &str| {
                        s.split_once('/').is_some_and(|(ip, bits)| {
                            ip.parse::<std::net::IpAddr>().is_ok() && bits.parse::<u8>().is_ok()
                        })
                    };
                    if !parsed(&b.cidr) || !b.except.iter().flatten().all(|e| parsed(e)) {
                        return Err(format!("a NetworkPolicy ipBlock {b:?}"));
                    }
                }
            }
            for p in ports.iter().flatten() {
                use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
                if let Some(IntOrString::Int(n)) = p.port {
                    if !(1..=65535).contains(&n) || p.end_port.is_some_and(|e| e < n || e > 65535) {
                        return Err(format!("a NetworkPolicy port {p:?}"));
                    }
                }
            }
        }
    }
    for child in c.into_list() {
        let kind = child.object["kind"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let meta = &child.object["metadata"];
        let owners = meta["ownerReferences"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        let controller = owners.iter().any(|o| {
            o["kind"] == "RLRun"
                && o["uid"] == uid.as_str()
                && o["name"] == name.as_str()
                && o["controller"] == true
        });
        if !controller {
            return Err(format!(
                "{kind} {}: not controlled by the run: {owners:?}",
                child.name
            ));
        }
        let name_ok = match kind.as_str() {
            // Services are DNS-1035 labels; a StatefulSet's pods are `<name>-<i>` and its revision
            // label `<name>-<10 characters>` must stay within 63.
            "Service" => {
                is_dns_label(&child.name, 63) && child.name.as_bytes()[0].is_ascii_lowercase()
            }
            "StatefulSet" => is_dns_label(&child.name, 52),
            "Deployment" => is_dns_label(&child.name, 63),
            _ => is_dns_subdomain(&child.name),
        };
        if !name_ok {
            return Err(format!("{kind} name {:?} is not valid", child.name));
        }
        let labels: Option<BTreeMap<String, String>> =
            serde_json::from_value(meta["labels"].clone()).ok();
        labels_ok(labels.as_ref(), &format!("{kind} {}", child.name))?;
    }
    Ok(())
}

/// The property: builders never panic; a valid spec gives valid children; a refusal names what.
fn property((kind, mutations): (usize, Vec<Mutation>)) -> Result<(), TestCaseError> {
    let mut run = kinds()[kind].1.clone();
    for m in mutations {
        apply(&mut run, m);
    }
    let config = Config {
        metrics_from: support::matrix::metrics_from(),
        ..Config::default()
    };
    let built = desired(&run, &config, "token");
    let verdict = run.validate();
    match (verdict, built) {
        (Ok(()), Ok(children)) if run.metadata.uid.is_some() => {
            BUILT.fetch_add(1, Ordering::Relaxed);
            children_ok(&run, children).map_err(TestCaseError::fail)?;
        }
        (Ok(()), Err(InvalidSpec(why))) => {
            prop_assert!(
                why.starts_with("spec.") || run.metadata.uid.is_none(),
                "a refusal of a valid spec names no field: {why}"
            );
        }
        (Err(errors), _) => {
            prop_assert!(!errors.is_empty());
            for e in errors {
                prop_assert!(!e.trim().is_empty(), "an empty validation message");
            }
        }
        _ => {}
    }
    Ok(())
}

/// A target's row of the table.
struct Row {
    target: &'static str,
    executions: u64,
    failures: Vec<String>,
}

fn run_target(target: &'static str, seconds: Option<f64>) -> Row {
    let executions = AtomicU64::new(0);
    let counted = |v| {
        executions.fetch_add(1, Ordering::Relaxed);
        *LAST_PANIC.lock().unwrap() = None;
        property(v)
    };
    let config = |cases| RunnerConfig {
        cases,
        failure_persistence: None,
        max_shrink_iters: 1024,
        ..RunnerConfig::default()
    };
    let mut failures = Vec::new();
    let mut record = |result: Result<(), TestError<(usize, Vec<Mutation>)>>| {
        if let Err(e) = result {
            let place = LAST_PANIC.lock().unwrap().take().unwrap_or_default();
            failures.push(format!("{e}\n    last panic: {place}"));
        }
    };
    match seconds {
        None => {
            let mut runner = TestRunner::new_with_rng(
                config(BRIEF_CASES),
                TestRng::deterministic_rng(RngAlgorithm::ChaCha),
            );
            record(runner.run(&case(), counted));
        }
        Some(s) => {
            let deadline = Instant::now() + Duration::from_secs_f64(s);
            while Instant::now() < deadline {
                let mut runner = TestRunner::new(config(32));
                record(runner.run(&case(), counted));
            }
        }
    }
    Row {
        target,
        executions: executions.into_inner(),
        failures,
    }
}

fn main() {
    std::panic::set_hook(Box::new(|info| {
        *LAST_PANIC.lock().unwrap() = Some(info.to_string());
    }));
    let seconds = std::env::var("MOULT_FUZZ_SECONDS").ok().map(|s| {
        s.trim()
            .parse::<f64>()
            .expect("MOULT_FUZZ_SECONDS is a number of seconds")
    });
    let filters: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let target = "operator_children";
    let started = Instant::now();
    let rows: Vec<Row> =
        if filters.is_empty() || filters.iter().any(|f| target.contains(f.as_str())) {
            vec![run_target(target, seconds)]
        } else {
            Vec::new()
        };
    let _ = std::panic::take_hook();
    for r in &rows {
        println!(
            "fuzz {}: {} executions, {} of them valid specs built, {:.1}s",
            r.target,
            r.executions,
            BUILT.load(Ordering::Relaxed),
            started.elapsed().as_secs_f64()
        );
    }
    println!(
        "\n{:<24} | {:>10} | {:>8}",
        "target", "executions", "failures"
    );
    println!("{:-<24}-|-{:->10}-|-{:->8}", "", "", "");
    for r in &rows {
        println!(
            "{:<24} | {:>10} | {:>8}",
            r.target,
            r.executions,
            r.failures.len()
        );
    }
    let failed = rows.iter().filter(|r| !r.failures.is_empty()).count();
    for r in &rows {
        for f in &r.failures {
            println!("\nFAILED {}: {f}", r.target);
        }
    }
    println!(
        "\ntest result: {}. {} passed; {failed} failed; 0 ignored; 0 measured; {} filtered out; finished in {:.2}s",
        if failed == 0 { "ok" } else { "FAILED" },
        rows.len() - failed,
        1 - rows.len(),
        started.elapsed().as_secs_f64()
    );
    if failed > 0 {
        std::process::exit(1);
    }
}
