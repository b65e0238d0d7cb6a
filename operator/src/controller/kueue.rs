//! The controller's side of Kueue (docs/operator.md, "Kueue"): what the run's Workload says
//! (admitted, waiting for quota, evicted), the placement of the flavors it was admitted on, and
//! the writes Kueue leaves to whoever owns a Workload: giving an evicted Workload's quota back
//! once the run's pods are gone, and finishing it when the run succeeded.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Toleration;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, PostParams};
use kube::Client;
use serde_json::{json, Value};

use crate::children::{Placement, KUEUE_GROUP, KUEUE_VERSION};
use crate::error::{Context, Result};

/// What Kueue says of a run's Workload.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Queued {
    pub name: String,
    /// Quota reserved, admission checks passed and not evicted: the run may have pods.
    pub admitted: bool,
    /// Holds quota (QuotaReserved True), admitted or being evicted.
    pub reserved: bool,
    /// Kueue evicted it (preempted, deactivated, ...): the condition says why and when.
    pub evicted: Option<Condition>,
    /// Why it waits: QuotaReserved's message while it is False.
    pub waiting: Option<String>,
    pub finished: bool,
    /// The flavors Kueue assigned, by pod set (the run's roles).
    pub flavors: BTreeMap<String, Vec<String>>,
}

fn condition<'a>(conditions: &'a [Condition], type_: &str) -> Option<&'a Condition> {
    conditions.iter().find(|c| c.type_ == type_)
}

fn is_true(conditions: &[Condition], type_: &str) -> bool {
    condition(conditions, type_).is_some_and(|c| c.status == "True")
}

/// What the Workload `w` says.
pub fn observe(w: &DynamicObject) -> Queued {
    let status = &w.data["status"];
    let conditions: Vec<Condition> =
        serde_json::from_value(status["conditions"].clone()).unwrap_or_default();
    let evicted = condition(&conditions, "Evicted").filter(|c| c.status == "True");
    let reserved = is_true(&conditions, "QuotaReserved");
    let waiting = condition(&conditions, "QuotaReserved").filter(|c| c.status == "False");
    let assignments = status["admission"]["podSetAssignments"].as_array();
    let flavors = assignments.into_iter().flatten().map(|a| {
        let names = a["flavors"].as_object().into_iter().flatten();
        let mut names: Vec<String> = names
            .filter_map(|(_, f)| f.as_str().map(String::from))
            .collect();
        names.sort();
        names.dedup();
        (a["name"].as_str().unwrap_or_default().to_string(), names)
    });
    Queued {
        name: w.metadata.name.clone().unwrap_or_default(),
        admitted: reserved && is_true(&conditions, "Admitted") && evicted.is_none(),
        reserved,
        evicted: evicted.cloned(),
        waiting: waiting.map(|c| c.message.clone()),
        finished: is_true(&conditions, "Finished"),
        flavors: flavors.collect(),
    }
}

/// Whether the cluster serves Kueue's Workloads: the controller then watches the runs' Workloads
/// (a Kueue installed later is watched once the operator restarts).
pub async fn served(client: &Client) -> bool {
    let version = format!("{KUEUE_GROUP}/{KUEUE_VERSION}");
    let resources = client.list_api_group_resources(&version).await;
    resources.is_ok_and(|list| list.resources.iter().any(|r| r.name == "workloads"))
}

pub fn api_resource(kind: &str) -> ApiResource {
    let gvk = GroupVersionKind::gvk(KUEUE_GROUP, KUEUE_VERSION, kind);
    ApiResource::from_gvk_with_plural(&gvk, &format!("{}s", kind.to_lowercase()))
}

/// Where the pods of each pod set go: the node labels and tolerations of its flavors
/// (cluster-scoped `ResourceFlavor`s).
pub async fn placement(client: &Client, q: &Queued) -> Result<BTreeMap<String, Placement>> {
    let api: Api<DynamicObject> = Api::all_with(client.clone(), &api_resource("ResourceFlavor"));
    let mut out = BTreeMap::new();
    for (role, flavors) in &q.flavors {
        let mut p = Placement::default();
        for flavor in flavors {
            let f = api
                .get(flavor)
                .await
                .context(|| format!("reading Kueue's ResourceFlavor {flavor}"))?;
            let labels: BTreeMap<String, String> =
                serde_json::from_value(f.data["spec"]["nodeLabels"].clone()).unwrap_or_default();
            let tolerations: Vec<Toleration> =
                serde_json::from_value(f.data["spec"]["tolerations"].clone()).unwrap_or_default();
            p.node_labels.extend(labels);
            for t in tolerations {
                if !p.tolerations.contains(&t) {
                    p.tolerations.push(t);
                }
            }
        }
        out.insert(role.clone(), p);
    }
    Ok(out)
}

/// The value of the PriorityClass `name`, which a Workload carries with its reference.
pub async fn priority(client: &Client, name: &str) -> Result<Option<i32>> {
    let api: Api<k8s_openapi::api::scheduling::v1::PriorityClass> = Api::all(client.clone());
    let class = api
        .get_opt(name)
        .await
        .context(|| format!("reading the PriorityClass {name}"))?;
    Ok(class.and_then(|c| c.value))
}

/// `workload` with the run's priority: the class and its value (Kueue reads both).
pub fn with_priority(workload: &mut Value, class: &str, value: i32) {
    let spec = &mut workload["spec"];
    spec["priorityClassRef"] =
        json!({"group": "scheduling.k8s.io", "kind": "PriorityClass", "name": class});
    spec["priority"] = value.into();
}

/// Sets the condition `type_` of `w`'s status, keeping its transition time while its status
/// stays.
fn set(w: &mut DynamicObject, type_: &str, status: bool, reason: &str, message: &str, now: &Time) {
    let status = if status { "True" } else { "False" };
    let mut conditions: Vec<Condition> =
        serde_json::from_value(w.data["status"]["conditions"].clone()).unwrap_or_default();
    let old = conditions.iter().position(|c| c.type_ == type_);
    let since = old.map(|i| &conditions[i]).filter(|c| c.status == status);
    let new = Condition {
        type_: type_.into(),
        status: status.into(),
        reason: reason.into(),
        message: message.into(),
        observed_generation: w.metadata.generation,
        last_transition_time: since.map_or_else(|| now.clone(), |c| c.last_transition_time.clone()),
    };
    match old {
        Some(i) => conditions[i] = new,
        None => conditions.push(new),
    }
    w.data["status"]["conditions"] =
        serde_json::to_value(conditions).expect("conditions serialize");
}

/// Gives back the quota of `w`, evicted by `evicted`, once the run's pods are gone (what Kueue's
/// own job integrations do): no admission, QuotaReserved and Admitted False, and Requeued True
/// when Kueue is to admit it again by itself (a preemption, a node failure).
pub async fn release(
    client: &Client,
    mut w: DynamicObject,
    evicted: &Condition,
    now: &Time,
) -> Result<()> {
    let requeued = ["Preempted", "NodeFailures"].contains(&evicted.reason.as_str());
    let message = &evicted.message;
    if let Some(status) = w.data["status"].as_object_mut() {
        status.remove("admission");
    }
    set(&mut w, "QuotaReserved", false, "Pending", message, now);
    set(
        &mut w,
        "Admitted",
        false,
        "NoReservation",
        "The workload has no reservation",
        now,
    );
    set(&mut w, "Requeued", requeued, &evicted.reason, message, now);
    replace_status(client, &w).await
}

/// Marks `w` finished (the run succeeded): Kueue releases its quota.
pub async fn finish(client: &Client, mut w: DynamicObject, now: &Time) -> Result<()> {
    set(
        &mut w,
        "Finished",
        true,
        "Succeeded",
        "the RLRun reached its total steps",
        now,
    );
    replace_status(client, &w).await
}

/// Writes `w`'s status, refused when it changed since it was read (the next reconcile retries).
async fn replace_status(client: &Client, w: &DynamicObject) -> Result<()> {
    let ns = w.metadata.namespace.clone().unwrap_or_default();
    let api: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), &ns, &api_resource("Workload"));
    let name = w.metadata.name.clone().unwrap_or_default();
    api.replace_status(&name, &PostParams::default(), w)
        .await
        .context(|| format!("writing the status of Kueue's Workload {ns}/{name}"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn workload(status: Value) -> DynamicObject {
        serde_json::from_value(json!({
            "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "Workload",
            "metadata": {"name": "r-kueue-0", "namespace": "ns", "generation": 1},
            "spec": {}, "status": status,
        }))
        .unwrap()
    }

    fn cond(type_: &str, status: &str, reason: &str, message: &str) -> Value {
        json!({"type": type_, "status": status, "reason": reason, "message": message,
               "lastTransitionTime": "2026-12-06T10:00:00Z"})
    }

    #[test]
    fn a_workload_waits_is_admitted_on_flavors_and_is_evicted() {
        let waiting = observe(&workload(json!({"conditions": [cond(
            "QuotaReserved", "False", "Pending",
            "couldn't assign flavors to pod set engines: insufficient quota for nvidia.com/gpu",
        )]})));
        assert!(!waiting.admitted && !waiting.reserved);
        assert!(waiting.waiting.unwrap().contains("insufficient quota"));
        let admission = json!({"clusterQueue": "cq", "podSetAssignments": [
            {"name": "engines", "flavors": {"nvidia.com/gpu": "a100", "cpu": "default"}},
            {"name": "agents", "flavors": {"cpu": "default"}},
        ]});
        let admitted = observe(&workload(json!({"admission": admission, "conditions": [
            cond("QuotaReserved", "True", "QuotaReserved", ""),
            cond("Admitted", "True", "Admitted", ""),
        ]})));
        assert!(admitted.admitted);
        assert_eq!(admitted.flavors["engines"], ["a100", "default"]);
        let evicted = observe(&workload(json!({"admission": admission, "conditions": [
            cond("QuotaReserved", "True", "QuotaReserved", ""),
            cond("Admitted", "True", "Admitted", ""),
            cond("Evicted", "True", "Preempted", "Preempted to accommodate a workload (UID: x) due to prioritization in the ClusterQueue"),
        ]})));
        assert!(!evicted.admitted && evicted.reserved);
        assert_eq!(evicted.evicted.unwrap().reason, "Preempted");
    }

    #[test]
    fn releasing_clears_the_admission_and_requeues_a_preempted_workload() {
        let mut w = workload(json!({"admission": {"clusterQueue": "cq"}, "conditions": [
            cond("QuotaReserved", "True", "QuotaReserved", ""),
            cond("Admitted", "True", "Admitted", ""),
        ]}));
        let now = Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH);
        set(&mut w, "QuotaReserved", false, "Pending", "preempted", &now);
        set(&mut w, "Admitted", true, "Admitted", "", &now);
        let conditions: Vec<Condition> =
            serde_json::from_value(w.data["status"]["conditions"].clone()).unwrap();
        let reserved = condition(&conditions, "QuotaReserved").unwrap();
        assert_eq!(
            (reserved.status.as_str(), &reserved.last_transition_time),
            ("False", &now)
        );
        let admitted = condition(&conditions, "Admitted").unwrap();
        assert_ne!(
            admitted.last_transition_time, now,
            "a condition that stays keeps its time"
        );
    }
}
