//! A run's NetworkPolicies admit and refuse what docs/security.md ("Network") says, cell by cell,
//! for each weight transport, judged by a small evaluator of NetworkPolicy semantics
//! (`support/netpol.rs`, itself tested here on the rules it models). The cluster test
//! `cluster_network_policies_are_accepted_as_built_and_keep_to_the_matrix` checks the policies
//! the API server holds the same way.

mod support;

use k8s_openapi::api::networking::v1::NetworkPolicy;
use moult_operator::api::{
    AgentEgressSpec, EgressPort, EgressTarget, EngineBackend, Protocol, RLRun, WeightTransferSpec,
    WeightTransport,
};
use moult_operator::children::{desired, Children, Config};
use support::matrix::{self, mismatches, run_pod};
use support::netpol::{Endpoint, Labels, World};
use support::runs;

/// The cluster example with `transport` (vLLM over NCCL, built-in engines over TCP, vLLM over a
/// shared folder).
fn run_with(transport: WeightTransport) -> RLRun {
    let mut run = runs::cluster_example();
    match transport {
        WeightTransport::Nccl => {}
        WeightTransport::Tcp => {
            run.spec.engines.backend = EngineBackend::Builtin;
            run.spec.engines.tensor_parallel_size = 1;
            run.spec.engines.gpus_per_engine = Some(0);
        }
        WeightTransport::Filesystem => {
            run.spec.engines.weight_transfer = Some(WeightTransferSpec {
                transport,
                claim_name: Some("rl-weights".into()),
            })
        }
    }
    assert_eq!(run.spec.engines.transport(), transport);
    run
}

fn config() -> Config {
    Config {
        metrics_from: matrix::metrics_from(),
        ..Config::default()
    }
}

fn build(run: &RLRun, config: &Config) -> Children {
    desired(run, config, "token").expect("the run builds")
}

/// Another run in the same namespace, whose policies sit beside the run's.
fn other_run(run: &RLRun, config: &Config) -> Children {
    let mut other = run.clone();
    other.metadata.name = Some("other".into());
    other.metadata.uid = Some("6f1d7f59-0000-4000-8000-000000000002".into());
    build(&other, config)
}

fn policies(c: &Children) -> Vec<NetworkPolicy> {
    let p = &c.network_policies;
    let own = [p.trainer.clone(), p.coordinator.clone(), p.agents.clone()];
    p.engine.iter().cloned().chain(own).collect()
}

#[test]
fn the_policies_admit_and_refuse_what_the_documented_matrix_says_for_every_transport() {
    let m = matrix::documented();
    assert_eq!(m.destinations.len(), 9, "{:?}", m.destinations);
    assert_eq!(m.rows.len(), 11);
    let config = config();
    let mut wrong = Vec::new();
    for transport in [
        WeightTransport::Nccl,
        WeightTransport::Tcp,
        WeightTransport::Filesystem,
    ] {
        let run = run_with(transport);
        let ours = build(&run, &config);
        let other = other_run(&run, &config);
        let all = policies(&ours)
            .into_iter()
            .chain(policies(&other))
            .collect();
        wrong.extend(mismatches(transport, all, &ours, &other));
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[test]
fn without_metrics_from_nothing_outside_the_run_reaches_the_coordinator_or_the_engines() {
    let run = run_with(WeightTransport::Nccl);
    let ours = build(&run, &Config::default());
    let world = World::new(policies(&ours));
    let prometheus = matrix::prometheus();
    for (component, port, admitted) in [
        ("engine", 8000, false),
        ("coordinator", 8080, false),
        ("trainer", 9090, true),
        ("agents", 9090, true),
    ] {
        let dst = run_pod(&ours, component, 0);
        assert_eq!(
            world.admits(&prometheus, &dst, port, "TCP"),
            admitted,
            "{component}:{port}"
        );
    }
}

fn egress(spec: AgentEgressSpec) -> World {
    let mut run = run_with(WeightTransport::Nccl);
    run.spec.agent.egress = Some(spec);
    World::new(policies(&build(&run, &config())))
}

#[test]
fn agent_egress_opens_what_it_lists_and_allow_all_opens_everything() {
    let run = run_with(WeightTransport::Nccl);
    let ours = build(&run, &config());
    let agent = run_pod(&ours, "agents", 0);
    let internet = Endpoint::outside("the internet", "203.0.113.7");
    let metadata = Endpoint::outside("cloud metadata", "169.254.169.254");
    let api_server = Endpoint::outside("the API server", "10.0.0.1");
    let engine = run_pod(&ours, "engine", 0);
    let coordinator = run_pod(&ours, "coordinator", 0);

    let https = egress(runs::https_egress());
    assert!(https.admits(&agent, &internet, 443, "TCP"));
    assert!(
        !https.admits(&agent, &internet, 80, "TCP"),
        "only the port listed"
    );
    assert!(!https.admits(&agent, &metadata, 443, "TCP"), "except");
    assert!(!https.admits(&agent, &api_server, 443, "TCP"), "except");
    assert!(
        !https.admits(&agent, &engine, 8000, "TCP"),
        "pods are in 10/8"
    );
    assert!(https.admits(&agent, &coordinator, 8080, "TCP"));

    let ports = egress(AgentEgressSpec {
        allow_all: false,
        to: vec![EgressTarget {
            cidr: "203.0.113.0/24".into(),
            except: Vec::new(),
            ports: vec![EgressPort {
                port: 8000,
                end_port: Some(8100),
                protocol: Protocol::Udp,
            }],
        }],
    });
    assert!(ports.admits(&agent, &internet, 8050, "UDP"));
    assert!(!ports.admits(&agent, &internet, 8050, "TCP"));
    assert!(!ports.admits(&agent, &internet, 8101, "UDP"));

    let open = egress(AgentEgressSpec {
        allow_all: true,
        to: Vec::new(),
    });
    for (dst, port) in [(&internet, 80), (&metadata, 80), (&api_server, 443)] {
        assert!(open.admits(&agent, dst, port, "TCP"), "{}", dst.name);
    }
    // Even then the engines admit only the coordinator and the trainer.
    assert!(!open.admits(&agent, &engine, 8000, "TCP"));
}

#[test]
fn each_component_is_isolated_by_its_own_policy_and_no_other() {
    let run = run_with(WeightTransport::Nccl);
    let ours = build(&run, &config());
    for (component, policy) in [
        ("engine", ours.network_policies.engine.as_ref().unwrap()),
        ("trainer", &ours.network_policies.trainer),
        ("coordinator", &ours.network_policies.coordinator),
        ("agents", &ours.network_policies.agents),
    ] {
        assert_eq!(
            policy.metadata.name.as_deref(),
            Some(format!("gsm8k-grpo-{component}").as_str())
        );
        for other in ["engine", "trainer", "coordinator", "agents"] {
            let pod = run_pod(&ours, other, 0);
            let labels = &pod.pod.as_ref().unwrap().labels;
            let selector = policy.spec.as_ref().unwrap().pod_selector.as_ref().unwrap();
            assert_eq!(
                support::netpol::selector_matches(selector, labels),
                component == other,
                "{component}'s policy and {other}'s pods"
            );
        }
    }
}

/// The evaluator models the rules the checks rest on; each is shown to hold here.
mod evaluator {
    use super::*;

    fn policy(json: serde_json::Value) -> NetworkPolicy {
        serde_json::from_value(json).unwrap()
    }

    fn labels(pairs: &[(&str, &str)]) -> Labels {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn db() -> Endpoint {
        Endpoint::pod("db", "10.1.0.1", "a", labels(&[("app", "db")]))
    }
    fn web() -> Endpoint {
        Endpoint::pod("web", "10.1.0.2", "a", labels(&[("app", "web")]))
    }
    fn web_in_b() -> Endpoint {
        Endpoint::pod("web-b", "10.2.0.2", "b", labels(&[("app", "web")]))
    }

    #[test]
    fn a_pod_no_policy_selects_is_open_and_a_selected_one_admits_only_its_rules() {
        let db_only_from_web = policy(serde_json::json!({
            "metadata": {"name": "db", "namespace": "a"},
            "spec": {"podSelector": {"matchLabels": {"app": "db"}},
                     "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "web"}}}],
                                  "ports": [{"port": 5432}]}]}
        }));
        let w = World::new([db_only_from_web]);
        assert!(
            w.admits(&db(), &web(), 80, "TCP"),
            "web is selected by nothing"
        );
        assert!(w.admits(&web(), &db(), 5432, "TCP"));
        assert!(!w.admits(&web(), &db(), 5433, "TCP"), "another port");
        assert!(!w.admits(&web(), &db(), 5432, "UDP"), "TCP when unset");
        assert!(
            !w.admits(&web_in_b(), &db(), 5432, "TCP"),
            "podSelector alone is the policy's namespace"
        );
        assert!(w.admits(&Endpoint::node("node", "192.0.2.1"), &db(), 1, "TCP"));
        assert!(World::default().admits(&web(), &db(), 1, "SCTP"));
    }

    #[test]
    fn policies_are_or_ed_and_an_empty_rule_list_admits_nothing() {
        let deny = policy(serde_json::json!({
            "metadata": {"name": "deny", "namespace": "a"},
            "spec": {"podSelector": {}, "policyTypes": ["Ingress"]}
        }));
        let w = World::new([deny.clone()]);
        assert!(!w.admits(&web(), &db(), 5432, "TCP"));
        let from_b = policy(serde_json::json!({
            "metadata": {"name": "b", "namespace": "a"},
            "spec": {"podSelector": {"matchLabels": {"app": "db"}},
                     "ingress": [{"from": [{"namespaceSelector": {"matchExpressions": [
                         {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["b"]}]}}]}]}
        }));
        let w = World::new([deny, from_b]);
        assert!(
            w.admits(&web_in_b(), &db(), 5432, "TCP"),
            "namespaceSelector alone"
        );
        assert!(!w.admits(&web(), &db(), 5432, "TCP"));
        assert!(
            !w.admits(&db(), &web(), 80, "TCP"),
            "deny still holds for web"
        );
    }

    #[test]
    fn both_selectors_in_one_peer_are_and_ed_and_ip_blocks_leave_out_their_exceptions() {
        let p = policy(serde_json::json!({
            "metadata": {"name": "p", "namespace": "a"},
            "spec": {"podSelector": {"matchLabels": {"app": "db"}},
                     "ingress": [{"from": [
                         {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "b"}},
                          "podSelector": {"matchLabels": {"app": "batch"}}},
                         {"ipBlock": {"cidr": "203.0.113.0/24", "except": ["203.0.113.128/25"]}}]}]}
        }));
        let w = World::new([p]);
        assert!(
            !w.admits(&web_in_b(), &db(), 1, "TCP"),
            "namespace yes, pod no"
        );
        let batch = Endpoint::pod("batch", "10.2.0.3", "b", labels(&[("app", "batch")]));
        assert!(w.admits(&batch, &db(), 1, "TCP"));
        assert!(w.admits(&Endpoint::outside("x", "203.0.113.7"), &db(), 1, "TCP"));
        assert!(!w.admits(&Endpoint::outside("y", "203.0.113.200"), &db(), 1, "TCP"));
        assert!(!w.admits(&Endpoint::outside("z", "198.51.100.1"), &db(), 1, "TCP"));
    }

    #[test]
    fn policy_types_default_to_ingress_plus_egress_with_egress_rules_and_ports_take_ranges() {
        let egress = serde_json::json!([{"ports": [{"port": 8000, "endPort": 8010, "protocol": "UDP"},
                                                  {"protocol": "TCP"}]}]);
        // policyTypes left out: Ingress always, Egress as there are egress rules.
        let p = policy(serde_json::json!({
            "metadata": {"name": "p", "namespace": "a"},
            "spec": {"podSelector": {"matchLabels": {"app": "web"}}, "egress": egress}
        }));
        let w = World::new([p]);
        assert!(w.admits(&web(), &db(), 8005, "UDP"));
        assert!(!w.admits(&web(), &db(), 8011, "UDP"));
        assert!(w.admits(&web(), &db(), 1, "TCP"), "every TCP port");
        assert!(!w.admits(&web(), &db(), 1, "SCTP"));
        assert!(
            !w.admits(&db(), &web(), 1, "TCP"),
            "isolated for ingress too"
        );
        // An Egress-only policy leaves ingress open; an Ingress-only one ignores egress rules.
        let egress_only = policy(serde_json::json!({
            "metadata": {"name": "q", "namespace": "a"},
            "spec": {"podSelector": {"matchLabels": {"app": "web"}}, "policyTypes": ["Egress"],
                     "egress": egress}
        }));
        let w = World::new([egress_only]);
        assert!(w.admits(&db(), &web(), 1, "SCTP"));
        assert!(!w.admits(&web(), &db(), 1, "SCTP"));
        let ingress_only = policy(serde_json::json!({
            "metadata": {"name": "r", "namespace": "a"},
            "spec": {"podSelector": {"matchLabels": {"app": "web"}}, "policyTypes": ["Ingress"],
                     "egress": [{"ports": [{"port": 1}]}]}
        }));
        assert!(World::new([ingress_only]).admits(&web(), &db(), 2, "TCP"));
    }
}
