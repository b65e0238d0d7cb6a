//! Kueue (docs/operator.md, "Kueue"): a run that names a queue is one Kueue `Workload`
//! (`kueue.x-k8s.io/v1beta2`), with a pod set per role: its pods wait for quota as one unit.
//!
//! The Workload holds what Kueue admits by: each pod set's count and a template with the pods'
//! resources, node selector, tolerations, affinity, runtime and priority classes (not their
//! images or arguments, which change without changing what the run needs). Kueue does not let an
//! admitted Workload's pod sets change, so the Workload's name carries a hash of them: a change
//! (`kubectl scale` of the engines, new resources) makes a new Workload, which waits for quota
//! again, and the old one is deleted as an orphan. Until the Workload is admitted, and once it is
//! evicted, the run has no pods ([`Children::hold`]); admitted, each pod set's pods get the node
//! labels and tolerations of the flavors Kueue assigned ([`Children::place`]).

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Container, PodSpec, PodTemplateSpec, Toleration};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde_json::{json, Value};

use super::{fnv1a, Children, Ctx};
use crate::api::RLRun;

pub const GROUP: &str = "kueue.x-k8s.io";
pub const VERSION: &str = "v1beta2";
/// Kueue's label naming the LocalQueue of a job.
pub const QUEUE_LABEL: &str = "kueue.x-k8s.io/queue-name";

/// The LocalQueue `run` waits in: `spec.scheduling.queueName`, else the run's
/// `kueue.x-k8s.io/queue-name` label (Kueue's convention for the objects it admits).
pub fn queue_name(run: &RLRun) -> Option<String> {
    let label = run
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(QUEUE_LABEL));
    run.spec
        .scheduling
        .queue_name
        .clone()
        .or_else(|| label.cloned())
}

/// Where Kueue placed a pod set: the node labels and tolerations of its assigned flavors.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Placement {
    pub node_labels: BTreeMap<String, String>,
    pub tolerations: Vec<Toleration>,
}

/// The run's Workload, when the run names a queue: the pod sets of `c`'s workloads (before
/// [`Children::hold`] or [`Children::place`]), at the counts the spec asks for.
pub(crate) fn workload(ctx: &Ctx, c: &Children) -> Option<Value> {
    let queue = queue_name(ctx.run)?;
    let spec = &ctx.run.spec;
    let teacher = super::pods::served_teacher_replicas(spec);
    let engine_pools = [
        // A run on an EnginePool has no engines of its own to queue.
        ("engines", Some(spec.engines.replicas), c.engines.as_ref()),
        ("trainer", Some(spec.trainer.nodes as i32), Some(&c.trainer)),
        (
            "judge",
            spec.judge.as_ref().map(|j| j.replicas),
            c.judge.as_ref(),
        ),
        ("teacher", teacher, c.teacher.as_ref()),
    ];
    let engine_pools = engine_pools
        .into_iter()
        .filter_map(|(role, count, s)| Some((role, count?, &s?.spec.template)));
    let deployments = [
        ("coordinator", 1, &c.coordinator),
        ("agents", spec.agent.replicas, &c.agents),
    ];
    let deployments = deployments
        .into_iter()
        .map(|(role, count, d)| (role, count, &d.spec.template));
    let pod_sets: Vec<Value> = engine_pools
        .chain(deployments)
        .map(|(role, count, template)| {
            json!({"name": role, "count": count, "template": admission_template(template)})
        })
        .collect();
    let spec = json!({"queueName": queue, "podSets": pod_sets});
    let hash = fnv1a(&serde_json::to_vec(&spec).expect("JSON serializes")) as u32;
    let mut meta = ctx.meta(&format!("kueue-{hash:08x}"), None);
    meta.annotations = None;
    Some(json!({
        "apiVersion": format!("{GROUP}/{VERSION}"),
        "kind": "Workload",
        "metadata": meta,
        "spec": {
            "queueName": spec["queueName"],
            "podSets": spec["podSets"],
            // A suspended run gives its quota back (Kueue evicts an inactive Workload).
            "active": !ctx.run.spec.suspend,
        },
    }))
}

/// The parts of a pod template Kueue admits by.
fn admission_template(t: &PodTemplateSpec) -> PodTemplateSpec {
    let spec = t.spec.clone().unwrap_or_default();
    let bare = |cs: Vec<Container>| -> Vec<Container> {
        let bare = cs.into_iter().map(|c| Container {
            name: c.name,
            resources: c.resources,
            ..Container::default()
        });
        bare.collect()
    };
    PodTemplateSpec {
        metadata: Some(ObjectMeta {
            labels: t.metadata.as_ref().and_then(|m| m.labels.clone()),
            ..ObjectMeta::default()
        }),
        spec: Some(PodSpec {
            containers: bare(spec.containers),
            init_containers: spec.init_containers.map(bare),
            node_selector: spec.node_selector,
            tolerations: spec.tolerations,
            affinity: spec.affinity,
            runtime_class_name: spec.runtime_class_name,
            priority_class_name: spec.priority_class_name,
            ..PodSpec::default()
        }),
    }
}

impl Children {
    /// The name of the run's Workload, when it has one.
    pub fn workload_name(&self) -> Option<String> {
        let w = self.workload.as_ref()?;
        w["metadata"]["name"].as_str().map(String::from)
    }

    /// No pod of the run: its Workload waits for quota, or was evicted.
    pub fn hold(&mut self) {
        let statefulsets = [self.engines.as_mut(), Some(&mut self.trainer)];
        let scorers = [self.judge.as_mut(), self.teacher.as_mut()];
        for s in statefulsets.into_iter().chain(scorers).flatten() {
            s.spec.replicas = Some(0);
        }
        for d in [&mut self.coordinator, &mut self.agents] {
            d.spec.replicas = Some(0);
        }
        if let Some(sandbox) = &mut self.sandbox {
            sandbox.warm_pool["spec"]["replicas"] = 0.into();
        }
    }

    /// Each pod set's pods on the nodes of its admitted flavors (`placement` by role).
    pub fn place(&mut self, placement: &BTreeMap<String, Placement>) {
        let mut templates: Vec<(&str, &mut PodTemplateSpec)> = Vec::new();
        let statefulsets = [
            ("engines", self.engines.as_mut()),
            ("trainer", Some(&mut self.trainer)),
        ];
        let scorers = [
            ("judge", self.judge.as_mut()),
            ("teacher", self.teacher.as_mut()),
        ];
        for (role, s) in statefulsets.into_iter().chain(scorers) {
            templates.extend(s.map(|s| (role, &mut s.spec.template)));
        }
        for (role, d) in [
            ("coordinator", &mut self.coordinator),
            ("agents", &mut self.agents),
        ] {
            templates.push((role, &mut d.spec.template));
        }
        for (role, template) in templates {
            let (Some(p), Some(spec)) = (placement.get(role), template.spec.as_mut()) else {
                continue;
            };
            let selector = spec.node_selector.get_or_insert_with(BTreeMap::new);
            selector.extend(p.node_labels.clone());
            let tolerations = spec.tolerations.get_or_insert_with(Vec::new);
            tolerations.extend(
                p.tolerations
                    .iter()
                    .filter(|t| !tolerations.contains(t))
                    .cloned()
                    .collect::<Vec<_>>(),
            );
        }
    }
}
