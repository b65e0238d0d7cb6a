//! The network matrix of docs/security.md ("Network"): which source may connect to which
//! component's port, as a table, checked against a run's NetworkPolicies with the evaluator of
//! [`super::netpol`]. The table is read from the document itself, so the two cannot drift apart.

use k8s_openapi::api::networking::v1::{NetworkPolicy, NetworkPolicyPeer};
use moult_operator::api::WeightTransport;
use moult_operator::children::Children;

use super::netpol::{Endpoint, Labels, World};

/// Where the table starts in docs/security.md.
const MARKER: &str = "<!-- network matrix";

/// The table: destination headers, and per source its cells.
pub struct Matrix {
    pub destinations: Vec<String>,
    pub rows: Vec<(String, Vec<String>)>,
}

/// The matrix as docs/security.md writes it.
pub fn documented() -> Matrix {
    let path = format!("{}/../docs/security.md", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).expect("docs/security.md");
    let start = text
        .find(MARKER)
        .expect("the network matrix marker in docs/security.md");
    let cells = |line: &str| -> Vec<String> {
        line.trim()
            .trim_matches('|')
            .split('|')
            .map(|c| c.trim().trim_matches('`').to_string())
            .collect()
    };
    let mut lines = text[start..]
        .lines()
        .skip_while(|l| !l.starts_with('|'))
        .take_while(|l| l.starts_with('|'));
    let header = cells(lines.next().expect("a header row"));
    lines.next(); // | --- |
    let rows = lines
        .map(|l| {
            let mut c = cells(l);
            let source = c.remove(0);
            (source, c)
        })
        .collect();
    Matrix {
        destinations: header[1..].to_vec(),
        rows,
    }
}

/// What a cell says for a run using `transport`: admitted, refused, or not a question (`—`).
fn expected(cell: &str, transport: WeightTransport) -> Option<bool> {
    match cell {
        "yes" => Some(true),
        "no" => Some(false),
        "—" => None,
        list => {
            let names: Vec<&str> = list.split(',').map(str::trim).collect();
            for n in &names {
                assert!(
                    ["Nccl", "Tcp", "Filesystem"].contains(n),
                    "a matrix cell is yes, no, — or weight transports: {list:?}"
                );
            }
            Some(names.contains(&format!("{transport:?}").as_str()))
        }
    }
}

/// The labels of a component's pods, from its pod template.
fn pod_labels(children: &Children, component: &str) -> Labels {
    let template = match component {
        "engine" => &children.engines.as_ref().unwrap().spec.template,
        "trainer" => &children.trainer.spec.template,
        "coordinator" => &children.coordinator.spec.template,
        "agents" => &children.agents.spec.template,
        other => panic!("no component {other}"),
    };
    template
        .metadata
        .as_ref()
        .and_then(|m| m.labels.clone())
        .expect("pod templates are labelled")
}

pub const NAMESPACE: &str = super::runs::NAMESPACE;

/// The Prometheus of the checks: the pod `--metrics-from` names.
pub fn prometheus() -> Endpoint {
    Endpoint::pod(
        "prometheus",
        "10.244.7.1",
        "monitoring",
        Labels::from([("app.kubernetes.io/name".into(), "prometheus".into())]),
    )
}

/// The `--metrics-from` the documented matrix assumes: Prometheus's pods in `monitoring`.
pub fn metrics_from() -> Vec<NetworkPolicyPeer> {
    vec![serde_json::from_value(serde_json::json!({
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
    }))
    .unwrap()]
}

/// The run's pods: `<component>-0` and `<component>-1`.
pub fn run_pod(children: &Children, component: &str, index: u8) -> Endpoint {
    let n = ["engine", "trainer", "coordinator", "agents"]
        .iter()
        .position(|c| *c == component)
        .unwrap();
    Endpoint::pod(
        &format!("{component}-{index}"),
        &format!("10.244.{}.{}", n + 1, index + 1),
        NAMESPACE,
        pod_labels(children, component),
    )
}

/// The sources the rows name.
pub fn source(name: &str, ours: &Children, other_run: &Children) -> Endpoint {
    let notebook = Labels::from([("app".into(), "notebook".into())]);
    match name {
        "engine" | "trainer" | "coordinator" | "agents" => run_pod(ours, name, 0),
        "metrics scrapers (--metrics-from)" => prometheus(),
        "another pod of the namespace" => {
            Endpoint::pod("notebook", "10.244.8.1", NAMESPACE, notebook)
        }
        "another run's coordinator" => Endpoint::pod(
            "other-coordinator",
            "10.244.8.2",
            NAMESPACE,
            pod_labels(other_run, "coordinator"),
        ),
        "a pod of the namespace with a coordinator's copied labels" => {
            let mut labels = pod_labels(ours, "coordinator");
            labels.remove(moult_operator::children::RUN_UID_LABEL);
            Endpoint::pod("copycat", "10.244.8.4", NAMESPACE, labels)
        }
        "a pod of another namespace" => Endpoint::pod("team-b", "10.244.8.3", "team-b", notebook),
        "outside the cluster" => Endpoint::outside("internet", "203.0.113.7"),
        "the pod's node (probes)" => Endpoint::node("node", "192.0.2.1"),
        other => panic!("the matrix names an unknown source {other:?}"),
    }
}

/// The connections a destination header stands for: endpoint, port, protocol.
pub fn destinations(header: &str, ours: &Children) -> Vec<(Endpoint, u16, &'static str)> {
    let other_ports = |c: &str| {
        vec![
            (run_pod(ours, c, 1), 29500, "TCP"),
            (run_pod(ours, c, 1), 40000, "TCP"),
        ]
    };
    match header {
        "engine :8000" => vec![(run_pod(ours, "engine", 1), 8000, "TCP")],
        "engine, other ports" => other_ports("engine"),
        "trainer :9090" => vec![(run_pod(ours, "trainer", 1), 9090, "TCP")],
        "trainer :29600" => vec![(run_pod(ours, "trainer", 1), 29600, "TCP")],
        "trainer, other ports" => other_ports("trainer"),
        "coordinator :8080" => vec![(run_pod(ours, "coordinator", 1), 8080, "TCP")],
        "agents :9090" => vec![(run_pod(ours, "agents", 1), 9090, "TCP")],
        "cluster DNS :53" => {
            let dns = Endpoint::pod(
                "kube-dns",
                "10.244.9.1",
                "kube-system",
                Labels::from([("k8s-app".into(), "kube-dns".into())]),
            );
            vec![(dns.clone(), 53, "UDP"), (dns, 53, "TCP")]
        }
        "outside the cluster" => vec![
            (Endpoint::outside("the internet", "203.0.113.7"), 443, "TCP"),
            (Endpoint::outside("a DNS resolver", "8.8.8.8"), 53, "UDP"),
            (
                Endpoint::outside("cloud metadata", "169.254.169.254"),
                80,
                "TCP",
            ),
            (
                Endpoint::outside("the API server", "192.0.2.10"),
                6443,
                "TCP",
            ),
        ],
        other => panic!("the matrix names an unknown destination {other:?}"),
    }
}

/// Every cell of the documented matrix that `policies` (the run's, with `other_run`'s beside them
/// in the namespace) get wrong for a run using `transport`, as sentences.
pub fn mismatches(
    transport: WeightTransport,
    policies: Vec<NetworkPolicy>,
    ours: &Children,
    other_run: &Children,
) -> Vec<String> {
    let m = documented();
    let world = World::new(policies);
    let mut wrong = Vec::new();
    for (row, cells) in &m.rows {
        assert_eq!(cells.len(), m.destinations.len(), "row {row:?}");
        let src = source(row, ours, other_run);
        for (header, cell) in m.destinations.iter().zip(cells) {
            let Some(want) = expected(cell, transport) else {
                continue;
            };
            for (dst, port, protocol) in destinations(header, ours) {
                let got = world.admits(&src, &dst, port, protocol);
                if got != want {
                    wrong.push(format!(
                        "{transport:?}: {row} → {header} ({} {port}/{protocol}): the matrix says {cell}, the policies {}",
                        dst.name,
                        if got { "admit it" } else { "refuse it" }
                    ));
                }
            }
        }
    }
    wrong
}
