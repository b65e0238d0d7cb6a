//! One NetworkPolicy per component of a run (docs/security.md, "Network"): who may connect to
//! each component's pods, and where agent pods, which run untrusted code, may connect.
//!
//! Who talks to whom (docs/cluster.md): agents lease episodes and generate through the
//! coordinator (:8080); the trainer takes batches from the coordinator (:8080); the coordinator
//! routes to the engines (:8000) and tells them where the weights are, and asks the judge's
//! engines (:8000) with `spec.judge`; engines connect to the
//! trainer's weight-stream listener (:29600) with the TCP transport; with NCCL the
//! trainer calls the engines' weight-transfer routes (:8000) and NCCL connects both ways on ports
//! of its own; trainer ranks rendezvous on :29500 and run NCCL between them. The trainer and
//! the agents serve only `/health` and `/metrics` on :9090, admitted from anywhere (Prometheus,
//! wherever it runs); the coordinator's and the engines' `/metrics` share their API port, admitted
//! to the peers the operator is told scrape metrics ([`super::Config::metrics_from`]). Probes come from
//! the pod's node, which Kubernetes always admits. Only agent pods have egress rules: DNS and
//! the coordinator, and what `spec.agent.egress` opens.

use std::collections::BTreeMap;

use k8s_openapi::api::networking::v1::{
    IPBlock, NetworkPolicy, NetworkPolicyEgressRule, NetworkPolicyIngressRule, NetworkPolicyPeer,
    NetworkPolicyPort, NetworkPolicySpec,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use super::{Ctx, COORDINATOR_PORT, ENGINE_PORT, METRICS_PORT, RUN_UID_LABEL, WEIGHT_STREAM_PORT};
use crate::api::WeightTransport;

/// The run's policies, each selecting the pods of one component (the judge's with
/// `spec.judge`).
#[derive(Clone, Debug, Default)]
pub struct NetworkPolicies {
    /// The run's own engines' (none for a run on an EnginePool, whose policy is the pool's).
    pub engine: Option<NetworkPolicy>,
    pub trainer: NetworkPolicy,
    pub coordinator: NetworkPolicy,
    pub agents: NetworkPolicy,
    pub judge: Option<NetworkPolicy>,
    /// With a served distillation teacher: its engines, which the coordinator asks.
    pub teacher: Option<NetworkPolicy>,
}

/// The run's pods of `component`: its name labels and the run's UID.
pub(crate) fn pods(ctx: &Ctx, component: &str) -> NetworkPolicyPeer {
    let mut labels = ctx.selector(component);
    labels.insert(RUN_UID_LABEL.into(), ctx.owner.uid.clone());
    NetworkPolicyPeer {
        pod_selector: Some(LabelSelector {
            match_labels: Some(labels),
            ..LabelSelector::default()
        }),
        ..NetworkPolicyPeer::default()
    }
}

fn tcp(port: i32) -> NetworkPolicyPort {
    NetworkPolicyPort {
        port: Some(IntOrString::Int(port)),
        protocol: Some("TCP".into()),
        ..NetworkPolicyPort::default()
    }
}

/// Every TCP port (NCCL's connections, on ports of its own choosing).
fn every_tcp_port() -> NetworkPolicyPort {
    NetworkPolicyPort {
        protocol: Some("TCP".into()),
        ..NetworkPolicyPort::default()
    }
}

/// Ingress to `ports` from `from` (from anywhere when `None`).
fn ingress(
    from: Option<Vec<NetworkPolicyPeer>>,
    ports: Vec<NetworkPolicyPort>,
) -> NetworkPolicyIngressRule {
    NetworkPolicyIngressRule {
        from,
        ports: Some(ports),
    }
}

fn policy(
    ctx: &Ctx,
    component: &str,
    ingress: Vec<NetworkPolicyIngressRule>,
    egress: Option<Vec<NetworkPolicyEgressRule>>,
) -> NetworkPolicy {
    let mut types = vec!["Ingress".to_string()];
    if egress.is_some() {
        types.push("Egress".into());
    }
    NetworkPolicy {
        metadata: ctx.meta(component, None),
        spec: Some(NetworkPolicySpec {
            pod_selector: Some(LabelSelector {
                match_labels: Some(ctx.selector(component)),
                ..LabelSelector::default()
            }),
            policy_types: Some(types),
            ingress: Some(ingress),
            egress,
        }),
    }
}

pub(crate) fn network_policies(ctx: &Ctx) -> NetworkPolicies {
    let transport = ctx.run.spec.engines.transport();
    let scrapers = &ctx.config.metrics_from;
    let scraped = |port: i32| {
        (!scrapers.is_empty()).then(|| ingress(Some(scrapers.clone()), vec![tcp(port)]))
    };

    let mut engine = vec![ingress(
        Some(vec![pods(ctx, "coordinator")]),
        vec![tcp(ENGINE_PORT)],
    )];
    if transport == WeightTransport::Nccl {
        // The trainer calls the weight-transfer routes itself, and NCCL connects on its own ports.
        engine.push(ingress(
            Some(vec![pods(ctx, "trainer")]),
            vec![every_tcp_port()],
        ));
    }
    engine.extend(scraped(ENGINE_PORT));

    let mut trainer = vec![
        ingress(None, vec![tcp(METRICS_PORT)]),
        // Ranks rendezvous on MASTER_PORT and run NCCL between them.
        ingress(Some(vec![pods(ctx, "trainer")]), vec![every_tcp_port()]),
    ];
    let engine_pods = pods(ctx, "engine");
    match transport {
        // A run on an EnginePool uploads its adapter through its coordinator: no engine connects
        // to its trainer.
        _ if ctx.pool.is_some() => {}
        // Engines connect to the weight stream's listener.
        WeightTransport::Tcp => trainer.push(ingress(
            Some(vec![engine_pods]),
            vec![tcp(WEIGHT_STREAM_PORT)],
        )),
        // NCCL connects both ways on ports of its own.
        WeightTransport::Nccl => {
            trainer.push(ingress(Some(vec![engine_pods]), vec![every_tcp_port()]))
        }
        WeightTransport::Filesystem => {}
    }

    let mut coordinator = vec![ingress(
        Some(vec![pods(ctx, "agents"), pods(ctx, "trainer")]),
        vec![tcp(COORDINATOR_PORT)],
    )];
    coordinator.extend(scraped(COORDINATOR_PORT));

    let agents_ingress = vec![ingress(None, vec![tcp(METRICS_PORT)])];
    // The coordinator asks the judge's and a served teacher's engines; nobody else talks to
    // them.
    let asked_by_coordinator = |component: &str| {
        let mut rules = vec![ingress(
            Some(vec![pods(ctx, "coordinator")]),
            vec![tcp(ENGINE_PORT)],
        )];
        rules.extend(scraped(ENGINE_PORT));
        policy(ctx, component, rules, None)
    };
    let judge = ctx
        .run
        .spec
        .judge
        .as_ref()
        .map(|_| asked_by_coordinator("judge"));
    let teacher = super::pods::served_teacher(ctx).map(|_| asked_by_coordinator("teacher"));
    NetworkPolicies {
        judge,
        teacher,
        engine: ctx
            .pool
            .is_none()
            .then(|| policy(ctx, "engine", engine, None)),
        trainer: policy(ctx, "trainer", trainer, None),
        coordinator: policy(ctx, "coordinator", coordinator, None),
        agents: policy(ctx, "agents", agents_ingress, Some(agent_egress(ctx))),
    }
}

/// Where agent pods may connect: the cluster's DNS, the run's coordinator, and what
/// `spec.agent.egress` opens.
fn agent_egress(ctx: &Ctx) -> Vec<NetworkPolicyEgressRule> {
    let spec = ctx.run.spec.agent.egress.clone().unwrap_or_default();
    if spec.allow_all {
        return vec![NetworkPolicyEgressRule::default()];
    }
    let mut rules = vec![
        ctx.config.dns.clone(),
        NetworkPolicyEgressRule {
            to: Some(vec![pods(ctx, "coordinator")]),
            ports: Some(vec![tcp(COORDINATOR_PORT)]),
        },
    ];
    if ctx.run.spec.agent.sandbox.is_some() {
        // Their sandbox pods, and the API server, where they claim them.
        rules.push(NetworkPolicyEgressRule {
            to: Some(vec![pods(ctx, "sandbox")]),
            ports: Some(vec![tcp(super::sandbox::SANDBOX_PORT)]),
        });
        rules.extend(ctx.config.api_server.clone());
    }
    for target in &spec.to {
        let ports: Vec<NetworkPolicyPort> = target
            .ports
            .iter()
            .map(|p| NetworkPolicyPort {
                port: Some(IntOrString::Int(p.port)),
                end_port: p.end_port,
                protocol: Some(p.protocol.as_str().into()),
            })
            .collect();
        rules.push(NetworkPolicyEgressRule {
            to: Some(vec![NetworkPolicyPeer {
                ip_block: Some(IPBlock {
                    cidr: target.cidr.clone(),
                    except: (!target.except.is_empty()).then(|| target.except.clone()),
                }),
                ..NetworkPolicyPeer::default()
            }]),
            ports: (!ports.is_empty()).then_some(ports),
        });
    }
    rules
}

/// The cluster DNS most clusters run: pods labelled `k8s-app=kube-dns` in `kube-system`, port 53
/// over UDP and TCP (`moult-operator --agent-dns` for others).
pub fn default_dns() -> NetworkPolicyEgressRule {
    let labels = |k: &str, v: &str| LabelSelector {
        match_labels: Some(BTreeMap::from([(k.to_string(), v.to_string())])),
        ..LabelSelector::default()
    };
    NetworkPolicyEgressRule {
        to: Some(vec![NetworkPolicyPeer {
            namespace_selector: Some(labels("kubernetes.io/metadata.name", "kube-system")),
            pod_selector: Some(labels("k8s-app", "kube-dns")),
            ..NetworkPolicyPeer::default()
        }]),
        ports: Some(vec![
            NetworkPolicyPort {
                port: Some(IntOrString::Int(53)),
                protocol: Some("UDP".into()),
                ..NetworkPolicyPort::default()
            },
            tcp(53),
        ]),
    }
}

/// An egress rule to the addresses and ports of `slices` (the API server's, for agent pods that
/// claim sandbox pods); `None` when they hold no address.
pub fn egress_to(
    slices: &[k8s_openapi::api::discovery::v1::EndpointSlice],
) -> Option<NetworkPolicyEgressRule> {
    let addresses = slices
        .iter()
        .flat_map(|s| s.endpoints.iter().flatten().flat_map(|e| &e.addresses));
    let to: Vec<NetworkPolicyPeer> = addresses
        .map(|address| NetworkPolicyPeer {
            ip_block: Some(IPBlock {
                cidr: format!("{address}/{}", if address.contains(':') { 128 } else { 32 }),
                except: None,
            }),
            ..NetworkPolicyPeer::default()
        })
        .collect();
    let ports = slices
        .iter()
        .flat_map(|s| s.ports.iter().flatten().filter_map(|p| p.port));
    let ports: Vec<NetworkPolicyPort> = ports.map(tcp).collect();
    (!to.is_empty()).then_some(NetworkPolicyEgressRule {
        to: Some(to),
        ports: (!ports.is_empty()).then_some(ports),
    })
}
