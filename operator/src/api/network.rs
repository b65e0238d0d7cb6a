//! Where a run's agent pods may connect (`spec.agent.egress`). Agent pods run untrusted code, so
//! by default they reach only the cluster's DNS and their run's coordinator; a run opens more
//! here, by IP block and port, or all at once (docs/security.md, "Network").

use kube::KubeSchema;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Destinations agent pods may reach besides DNS and the run's coordinator.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema, Default)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!self.allowAll || !has(self.to) || size(self.to) == 0").message(
    "agent.egress.allowAll already opens every destination: remove agent.egress.to, or unset allowAll to open only what agent.egress.to lists"
))]
pub struct AgentEgressSpec {
    /// Every destination: the internet, the cloud metadata service, the Kubernetes API server and
    /// every pod of the cluster. For agent code you trust that far (it fetches packages, calls
    /// outside APIs).
    #[serde(default)]
    pub allow_all: bool,
    /// IP blocks (and ports) agent pods may reach.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32))]
    pub to: Vec<EgressTarget>,
}

/// One IP block agent pods may reach.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("isCIDR(self.cidr) && cidr(self.cidr).masked() == cidr(self.cidr)").message(
    "agent.egress.to[].cidr must be an IP block in CIDR notation with no bits set past its prefix, such as 203.0.113.0/24, 0.0.0.0/0 or ::/0"
))]
#[x_kube(validation = Rule::new("!has(self.except) || !isCIDR(self.cidr) || self.except.all(e, isCIDR(e) && cidr(self.cidr).containsCIDR(e) && cidr(e).prefixLength() > cidr(self.cidr).prefixLength())").message(
    "agent.egress.to[].except must hold IP blocks strictly inside agent.egress.to[].cidr, such as 169.254.169.254/32 inside 0.0.0.0/0"
))]
pub struct EgressTarget {
    /// An IP block in CIDR notation: `0.0.0.0/0` (every IPv4 address), `203.0.113.0/24`.
    #[schemars(length(min = 1, max = 64))]
    pub cidr: String,
    /// Blocks inside `cidr` left out, such as `169.254.169.254/32` (the cloud metadata service).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16), inner(length(max = 64)))]
    pub except: Vec<String>,
    /// Ports agent pods may reach in the block; every port when empty.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16))]
    pub ports: Vec<EgressPort>,
}

/// A port, or a range of ports, agent pods may reach in an IP block.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!has(self.endPort) || self.endPort >= self.port").message(
    "agent.egress.to[].ports[].endPort must be at least its port"
))]
pub struct EgressPort {
    #[schemars(range(min = 1, max = 65535))]
    pub port: i32,
    /// The last port of a range that starts at `port`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 65535))]
    pub end_port: Option<i32>,
    #[serde(default)]
    pub protocol: Protocol,
}

/// A transport protocol, as NetworkPolicies name them.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema, Default)]
pub enum Protocol {
    #[default]
    #[serde(rename = "TCP")]
    Tcp,
    #[serde(rename = "UDP")]
    Udp,
    #[serde(rename = "SCTP")]
    Sctp,
}

impl Protocol {
    pub fn as_str(self) -> &'static str {
        match self {
            Protocol::Tcp => "TCP",
            Protocol::Udp => "UDP",
            Protocol::Sctp => "SCTP",
        }
    }
}
