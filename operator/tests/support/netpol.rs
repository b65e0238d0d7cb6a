//! A small evaluator of Kubernetes NetworkPolicy semantics (networking.k8s.io/v1, as the API
//! reference states them), to check what a run's policies admit without a network plugin:
//!
//! - A pod is isolated for ingress (egress) when a policy of its namespace selects it
//!   (`podSelector`) and has `Ingress` (`Egress`) among its `policyTypes`; `policyTypes` left out
//!   means `Ingress`, plus `Egress` when the policy has egress rules. A pod no policy isolates
//!   accepts (sends) everything.
//! - An isolated pod admits a connection when any rule of any policy selecting it admits it (the
//!   policies are OR-ed). A rule admits a peer that any of its `from` (`to`) peers matches (every
//!   peer when the list is empty or absent) on a port that any of its `ports` matches (every port
//!   when absent): the protocol (TCP when unset), and the port, or `port` to `endPort`, or every
//!   port of the protocol when `port` is unset. Named ports are not modelled (none are used).
//! - A peer with `podSelector` alone matches pods of the policy's namespace; with
//!   `namespaceSelector` alone, every pod of the namespaces it selects; with both, the pods it
//!   selects in those namespaces; `ipBlock` matches addresses in `cidr` and not in `except` (here
//!   pods' addresses too: the API leaves that to the plugin, and most match them).
//! - A connection needs both the source's egress and the destination's ingress.
//! - Traffic from a pod's own node (kubelet probes) is always admitted.

use std::collections::BTreeMap;
use std::net::IpAddr;

use k8s_openapi::api::networking::v1::{NetworkPolicy, NetworkPolicyPeer, NetworkPolicyPort};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

pub type Labels = BTreeMap<String, String>;

/// A pod: its namespace (name and labels) and its own labels.
#[derive(Clone, Debug)]
pub struct Pod {
    pub namespace: String,
    pub namespace_labels: Labels,
    pub labels: Labels,
}

/// One end of a connection.
#[derive(Clone, Debug)]
pub struct Endpoint {
    pub name: String,
    pub ip: IpAddr,
    /// None outside the cluster's pods.
    pub pod: Option<Pod>,
    /// A node (the kubelet, probing a pod on it).
    pub node: bool,
}

impl Endpoint {
    pub fn pod(name: &str, ip: &str, namespace: &str, labels: Labels) -> Endpoint {
        Endpoint {
            name: name.into(),
            ip: ip.parse().expect("an IP address"),
            pod: Some(Pod {
                namespace: namespace.into(),
                namespace_labels: Labels::from([(
                    "kubernetes.io/metadata.name".to_string(),
                    namespace.to_string(),
                )]),
                labels,
            }),
            node: false,
        }
    }

    pub fn outside(name: &str, ip: &str) -> Endpoint {
        Endpoint {
            name: name.into(),
            ip: ip.parse().expect("an IP address"),
            pod: None,
            node: false,
        }
    }

    pub fn node(name: &str, ip: &str) -> Endpoint {
        Endpoint {
            node: true,
            ..Endpoint::outside(name, ip)
        }
    }
}

/// The policies of a cluster.
#[derive(Clone, Debug, Default)]
pub struct World {
    pub policies: Vec<NetworkPolicy>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Direction {
    Ingress,
    Egress,
}

impl World {
    pub fn new(policies: impl IntoIterator<Item = NetworkPolicy>) -> World {
        World {
            policies: policies.into_iter().collect(),
        }
    }

    /// Whether `src` may open a connection to `dst` on `port` over `protocol`.
    pub fn admits(&self, src: &Endpoint, dst: &Endpoint, port: u16, protocol: &str) -> bool {
        self.allows(Direction::Egress, src, dst, port, protocol)
            && (src.node || self.allows(Direction::Ingress, dst, src, port, protocol))
    }

    /// Whether the policies isolating `pod` in `direction` let `peer` through (`port` is always
    /// the destination's).
    fn allows(
        &self,
        direction: Direction,
        pod: &Endpoint,
        peer: &Endpoint,
        port: u16,
        protocol: &str,
    ) -> bool {
        let Some(p) = &pod.pod else {
            return true;
        };
        let isolating: Vec<&NetworkPolicy> = self
            .policies
            .iter()
            .filter(|np| np.metadata.namespace.as_deref() == Some(p.namespace.as_str()))
            .filter(|np| {
                let spec = np.spec.as_ref().expect("a policy has a spec");
                let selects = spec
                    .pod_selector
                    .as_ref()
                    .is_none_or(|s| selector_matches(s, &p.labels));
                selects && types(np).contains(&direction)
            })
            .collect();
        if isolating.is_empty() {
            return true;
        }
        isolating.iter().any(|np| {
            let spec = np.spec.as_ref().unwrap();
            let ns = np.metadata.namespace.as_deref().unwrap();
            match direction {
                Direction::Ingress => spec.ingress.iter().flatten().any(|r| {
                    peers_match(r.from.as_deref(), ns, peer)
                        && ports_match(r.ports.as_deref(), port, protocol)
                }),
                Direction::Egress => spec.egress.iter().flatten().any(|r| {
                    peers_match(r.to.as_deref(), ns, peer)
                        && ports_match(r.ports.as_deref(), port, protocol)
                }),
            }
        })
    }
}

/// A policy's types, defaulted as the API says.
fn types(np: &NetworkPolicy) -> Vec<Direction> {
    let spec = np.spec.as_ref().unwrap();
    match &spec.policy_types {
        Some(t) => t
            .iter()
            .map(|t| match t.as_str() {
                "Ingress" => Direction::Ingress,
                "Egress" => Direction::Egress,
                other => panic!("unknown policy type {other}"),
            })
            .collect(),
        None => {
            let mut t = vec![Direction::Ingress];
            if spec.egress.as_ref().is_some_and(|e| !e.is_empty()) {
                t.push(Direction::Egress);
            }
            t
        }
    }
}

fn peers_match(peers: Option<&[NetworkPolicyPeer]>, policy_ns: &str, e: &Endpoint) -> bool {
    match peers {
        None | Some([]) => true,
        Some(peers) => peers.iter().any(|p| peer_matches(p, policy_ns, e)),
    }
}

fn peer_matches(peer: &NetworkPolicyPeer, policy_ns: &str, e: &Endpoint) -> bool {
    if let Some(block) = &peer.ip_block {
        assert!(
            peer.pod_selector.is_none() && peer.namespace_selector.is_none(),
            "ipBlock stands alone in a peer"
        );
        return in_cidr(&block.cidr, e.ip)
            && !block.except.iter().flatten().any(|x| in_cidr(x, e.ip));
    }
    assert!(
        peer.pod_selector.is_some() || peer.namespace_selector.is_some(),
        "a peer names pods, namespaces or an IP block"
    );
    let Some(pod) = &e.pod else {
        return false;
    };
    let namespace = match &peer.namespace_selector {
        Some(s) => selector_matches(s, &pod.namespace_labels),
        None => pod.namespace == policy_ns,
    };
    namespace
        && peer
            .pod_selector
            .as_ref()
            .is_none_or(|s| selector_matches(s, &pod.labels))
}

fn ports_match(ports: Option<&[NetworkPolicyPort]>, port: u16, protocol: &str) -> bool {
    match ports {
        None | Some([]) => true,
        Some(ports) => ports.iter().any(|p| {
            let proto = p.protocol.as_deref().unwrap_or("TCP");
            let number = match &p.port {
                None => return proto == protocol,
                Some(IntOrString::Int(n)) => *n,
                Some(IntOrString::String(name)) => panic!("named port {name} is not modelled"),
            };
            let end = p.end_port.unwrap_or(number);
            proto == protocol && (number..=end).contains(&i32::from(port))
        }),
    }
}

/// matchLabels and matchExpressions (In, NotIn, Exists, DoesNotExist), ANDed; `{}` selects all.
pub fn selector_matches(s: &LabelSelector, labels: &Labels) -> bool {
    let exact = s
        .match_labels
        .iter()
        .flatten()
        .all(|(k, v)| labels.get(k) == Some(v));
    let expressions = s.match_expressions.iter().flatten().all(|e| {
        let value = labels.get(&e.key);
        let values = e.values.as_deref().unwrap_or_default();
        match e.operator.as_str() {
            "In" => value.is_some_and(|v| values.contains(v)),
            "NotIn" => value.is_none_or(|v| !values.contains(v)),
            "Exists" => value.is_some(),
            "DoesNotExist" => value.is_none(),
            other => panic!("unknown selector operator {other}"),
        }
    });
    exact && expressions
}

/// Whether `ip` is in the block `cidr` ("10.0.0.0/8", "::/0").
pub fn in_cidr(cidr: &str, ip: IpAddr) -> bool {
    let (net, bits) = cidr.split_once('/').expect("a CIDR has a prefix length");
    let bits: u32 = bits.parse().expect("a prefix length");
    match (net.parse::<IpAddr>().expect("a CIDR's address"), ip) {
        (IpAddr::V4(n), IpAddr::V4(a)) => {
            let mask = if bits == 0 {
                0
            } else {
                u32::MAX << (32 - bits)
            };
            u32::from(n) & mask == u32::from(a) & mask
        }
        (IpAddr::V6(n), IpAddr::V6(a)) => {
            let mask = if bits == 0 {
                0
            } else {
                u128::MAX << (128 - bits)
            };
            u128::from(n) & mask == u128::from(a) & mask
        }
        _ => false,
    }
}
