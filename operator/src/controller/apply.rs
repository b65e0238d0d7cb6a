//! Bringing a run's children to their desired state: list what exists by label, server-side
//! apply only what differs, delete what is no longer desired.
//!
//! The operator touches only objects the run controls (an owner reference with `controller:
//! true` and the run's uid): a labelled object someone else controls is never deleted, and a
//! desired child whose name an object the run does not control already holds is a [`Conflict`].
//! Then nothing is applied or deleted and the run's status names the object (docs/operator.md,
//! "Why is my run stuck"): an RLRun never takes over a ServiceAccount, ConfigMap or Secret it
//! did not make. A desired child the label listing did not find is looked up by name before it
//! is applied (only then: a settled run costs no extra reads).
//!
//! "Differs" means some field we set is missing or has another value in the live object
//! ([`covers`]); fields that the API server defaults or other managers own do not count. Every
//! child also carries a hash of the applied object (`moult.dev/applied-hash`), so a field that
//! left the desired object makes it differ too. So a reconcile with nothing to change makes no
//! write at all, and a child edited or deleted by hand is restored on the next reconcile (the
//! watch on children triggers it).

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::{Deployment, StatefulSet};
use k8s_openapi::api::core::v1::{ConfigMap, Secret, Service, ServiceAccount};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, Preconditions,
};
use kube::core::GroupVersionKind;
use kube::{Client, Resource};
use serde_json::Value;

use crate::children::{self, Child, ChildKind, MANAGED_BY, MANAGED_BY_LABEL, RUN_LABEL};
use crate::error::{Context, Result};

/// The field manager of every write the operator makes.
pub const FIELD_MANAGER: &str = "moult-operator";

pub fn api_resource(kind: ChildKind) -> ApiResource {
    fn ar<K: Resource<DynamicType = ()>>() -> ApiResource {
        ApiResource::erase::<K>(&())
    }
    match kind {
        ChildKind::ConfigMap => ar::<ConfigMap>(),
        ChildKind::Secret => ar::<Secret>(),
        ChildKind::ServiceAccount => ar::<ServiceAccount>(),
        ChildKind::Role => ar::<Role>(),
        ChildKind::RoleBinding => ar::<RoleBinding>(),
        ChildKind::NetworkPolicy => ar::<NetworkPolicy>(),
        ChildKind::Service => ar::<Service>(),
        ChildKind::PodDisruptionBudget => ar::<PodDisruptionBudget>(),
        ChildKind::StatefulSet => ar::<StatefulSet>(),
        ChildKind::Deployment => ar::<Deployment>(),
        ChildKind::SandboxTemplate | ChildKind::SandboxWarmPool | ChildKind::Workload => {
            let (group, version) = match kind {
                ChildKind::Workload => (children::KUEUE_GROUP, children::KUEUE_VERSION),
                _ => (children::EXTENSIONS_GROUP, children::VERSION),
            };
            let kind = format!("{kind:?}");
            let plural = format!("{}s", kind.to_lowercase());
            ApiResource::from_gvk_with_plural(
                &GroupVersionKind::gvk(group, version, &kind),
                &plural,
            )
        }
    }
}

/// What a run with `spec.agent.sandbox` (or a queue) says where the cluster lacks agent-sandbox
/// (or Kueue).
pub fn missing_kind(kind: ChildKind) -> String {
    if kind == ChildKind::Workload {
        return format!("spec.scheduling.queueName (or the label {}) needs Kueue, and this cluster does not serve its Workload ({}/{}): install Kueue, or remove the queue to run without it (docs/operator.md#kueue)", children::QUEUE_LABEL, children::KUEUE_GROUP, children::KUEUE_VERSION);
    }
    format!("spec.agent.sandbox needs kubernetes-sigs/agent-sandbox with its extensions, and this cluster does not serve {kind:?} (extensions.agents.x-k8s.io/v1beta1): install agent-sandbox, or remove spec.agent.sandbox to run model-written code in jails of the agent pods (docs/security.md#sandbox-pods)")
}

/// The run's children that exist, by kind and name.
pub type Live = BTreeMap<(ChildKind, String), DynamicObject>;

/// The objects labelled as `run`'s children, split by who controls them.
#[derive(Debug, Default)]
pub struct Listed {
    /// Controlled by the run (its uid in a controller owner reference).
    pub owned: Live,
    /// Labelled as the run's but controlled by something else (or nothing): never touched.
    pub foreign: Live,
}

/// Whether `object` is controlled by the RLRun whose uid is `uid`.
pub fn controlled_by(object: &DynamicObject, uid: &str) -> bool {
    object
        .metadata
        .owner_references
        .iter()
        .flatten()
        .any(|o| o.controller == Some(true) && o.uid == uid)
}

/// A desired child whose kind and name an object the run does not control already holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Conflict {
    pub kind: ChildKind,
    pub name: String,
    /// What controls it (`Kind/name`), if anything.
    pub controller: Option<String>,
}

impl Conflict {
    fn of(kind: ChildKind, object: &DynamicObject) -> Conflict {
        let controller = object
            .metadata
            .owner_references
            .iter()
            .flatten()
            .find(|o| o.controller == Some(true))
            .map(|o| format!("{}/{}", o.kind, o.name));
        Conflict {
            kind,
            name: object.metadata.name.clone().unwrap_or_default(),
            controller,
        }
    }
}

impl std::fmt::Display for Conflict {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let by = match &self.controller {
            Some(c) => format!("controlled by {c}"),
            None => "not controlled by this RLRun".into(),
        };
        write!(f, "{:?} {} already exists, {by}", self.kind, self.name)
    }
}

/// Lists every child of `run` (by label) in `namespace`, split by whether the run whose uid is
/// `uid` controls it.
pub async fn list(client: &Client, namespace: &str, run: &str, uid: &str) -> Result<Listed> {
    list_labelled(client, namespace, (RUN_LABEL, run), uid, &ChildKind::ALL).await
}

/// Lists the objects of `kinds` in `namespace` labelled `label` (the owner's name label and its
/// name: a run's, an EnginePool's), split by whether the owner whose uid is `uid` controls them.
pub async fn list_labelled(
    client: &Client,
    namespace: &str,
    (label, run): (&str, &str),
    uid: &str,
    kinds: &[ChildKind],
) -> Result<Listed> {
    let lp =
        ListParams::default().labels(&format!("{label}={run},{MANAGED_BY_LABEL}={MANAGED_BY}"));
    let lists = kinds.iter().map(|&kind| {
        let api: Api<DynamicObject> =
            Api::namespaced_with(client.clone(), namespace, &api_resource(kind));
        let lp = &lp;
        async move {
            let items = match api.list(lp).await {
                Ok(list) => list.items,
                // A kind of another project that this cluster does not have: nothing to list.
                Err(kube::Error::Api(e)) if e.code == 404 && kind.optional() => Vec::new(),
                Err(e) => {
                    return Err(e).context(|| format!("listing the {kind:?}s of {namespace}/{run}"))
                }
            };
            Ok::<_, crate::error::Error>((kind, items))
        }
    });
    let mut listed = Listed::default();
    for (kind, items) in futures::future::try_join_all(lists).await? {
        for o in items {
            let key = (kind, o.metadata.name.clone().unwrap_or_default());
            if controlled_by(&o, uid) {
                listed.owned.insert(key, o);
            } else {
                listed.foreign.insert(key, o);
            }
        }
    }
    Ok(listed)
}

/// What one sync did.
#[derive(Debug, Default)]
pub struct Synced {
    /// The children after the sync (the API server's answer for those written).
    pub current: Live,
    pub applied: Vec<String>,
    pub deleted: Vec<String>,
    /// Desired children whose names objects the run does not control hold; when there are any,
    /// nothing was applied or deleted.
    pub conflicts: Vec<Conflict>,
    /// A child the API server refused as invalid (`Kind name: its message`): nothing more was
    /// applied, nothing deleted.
    pub refused: Option<String>,
}

/// Applies every desired child that the run's own children do not already cover and deletes every
/// child of the run's that is not desired, unless a desired child's name is held by an object the
/// run (uid `uid`) does not control: then it writes nothing and returns the conflicts. Children
/// are applied concurrently in waves: what pods need (config,
/// token, service account, role, network policy, services), then the RoleBinding (the API server
/// lets a binder without `bind` rights bind only a Role that exists and whose rules it holds),
/// then the workloads. A wave's applies all finish before the first error is returned: none is
/// cancelled half-way.
pub async fn sync(
    client: &Client,
    namespace: &str,
    uid: &str,
    desired: Vec<Child>,
    listed: Listed,
) -> Result<Synced> {
    let Listed {
        owned: mut live,
        foreign,
    } = listed;
    let mut out = Synced::default();
    // Desired children the listing did not find: does something else already hold the name?
    let unlisted = desired
        .iter()
        .filter(|c| !live.contains_key(&(c.kind, c.name.clone())))
        .map(|child| {
            let key = (child.kind, child.name.clone());
            let api: Api<DynamicObject> =
                Api::namespaced_with(client.clone(), namespace, &api_resource(child.kind));
            let held = foreign.get(&key).cloned();
            async move {
                let object = match held {
                    Some(o) => Some(o),
                    None => match api.get_opt(&key.1).await {
                        // Not served: applying it says so.
                        Err(kube::Error::Api(e)) if e.code == 404 && key.0.optional() => None,
                        found => found
                            .context(|| format!("looking for {:?} {namespace}/{}", key.0, key.1))?,
                    },
                };
                Ok::<_, crate::error::Error>(object.map(|o| (key.0, o)))
            }
        });
    for (kind, object) in futures::future::try_join_all(unlisted)
        .await?
        .into_iter()
        .flatten()
    {
        if !controlled_by(&object, uid) {
            out.conflicts.push(Conflict::of(kind, &object));
        }
    }
    if !out.conflicts.is_empty() {
        out.current = live;
        return Ok(out);
    }
    let mut waves: [Vec<Child>; 3] = [Vec::new(), Vec::new(), Vec::new()];
    for child in desired {
        let key = (child.kind, child.name.clone());
        if let Some(cur) = live.remove(&key) {
            // Listed items carry no apiVersion/kind; compare the rest.
            let mut want = child.object.clone();
            if let Some(o) = want.as_object_mut() {
                o.remove("apiVersion");
                o.remove("kind");
            }
            let cur_json = serde_json::to_value(&cur).expect("objects serialize");
            if covers(&cur_json, &want) {
                out.current.insert(key, cur);
                continue;
            }
        }
        let wave = match child.kind {
            ChildKind::RoleBinding => 1,
            ChildKind::StatefulSet | ChildKind::Deployment | ChildKind::SandboxWarmPool => 2,
            _ => 0,
        };
        waves[wave].push(child);
    }
    let pp = PatchParams::apply(FIELD_MANAGER).force();
    for wave in waves {
        let applies = wave.into_iter().map(|child| {
            let api: Api<DynamicObject> =
                Api::namespaced_with(client.clone(), namespace, &api_resource(child.kind));
            let pp = &pp;
            async move {
                let applied = api
                    .patch(&child.name, pp, &Patch::Apply(&child.object))
                    .await;
                (child.kind, child.name, applied)
            }
        });
        let mut first_error = None;
        for (kind, name, result) in futures::future::join_all(applies).await {
            match result {
                Ok(applied) => {
                    out.applied.push(format!("{kind:?}/{name}"));
                    out.current.insert((kind, name), applied);
                }
                // The API server's validation refused what the spec made: the spec's doing,
                // reported in the status (retrying cannot help).
                Err(kube::Error::Api(e)) if e.code == 422 || e.code == 400 => {
                    out.refused
                        .get_or_insert_with(|| format!("{kind:?} {name}: {}", e.message));
                }
                Err(kube::Error::Api(e)) if e.code == 404 && kind.optional() => {
                    out.refused.get_or_insert_with(|| missing_kind(kind));
                }
                Err(source) => {
                    first_error = first_error.or(Some(crate::error::Error::Kube {
                        context: format!("applying {kind:?} {namespace}/{name}"),
                        source,
                    }));
                }
            }
        }
        if let Some(e) = first_error {
            return Err(e);
        }
        if out.refused.is_some() {
            out.current.append(&mut live);
            return Ok(out);
        }
    }
    // Only what the run controls is left in `live`; the uid precondition makes sure the object
    // deleted is the one whose owner was checked, not one made since under the same name.
    let deletes = live.into_iter().map(|((kind, name), object)| {
        let api: Api<DynamicObject> =
            Api::namespaced_with(client.clone(), namespace, &api_resource(kind));
        let params = DeleteParams {
            preconditions: Some(Preconditions {
                uid: object.metadata.uid.clone(),
                resource_version: None,
            }),
            ..DeleteParams::background()
        };
        async move {
            match api.delete(&name, &params).await {
                Ok(_) => Ok(Some(format!("{kind:?}/{name}"))),
                // Gone, or another object by now (the precondition failed).
                Err(kube::Error::Api(e)) if e.code == 404 || e.code == 409 => Ok(None),
                Err(e) => {
                    Err(e).context(|| format!("deleting the orphan {kind:?} {namespace}/{name}"))
                }
            }
        }
    });
    out.deleted = futures::future::try_join_all(deletes)
        .await?
        .into_iter()
        .flatten()
        .collect();
    Ok(out)
}

/// Whether `live` already holds every field of `desired` with the same value. Objects may have
/// more fields; lists must have the same length and cover element by element.
pub fn covers(live: &Value, desired: &Value) -> bool {
    match (live, desired) {
        (Value::Object(l), Value::Object(d)) => d.iter().all(|(k, dv)| match l.get(k) {
            Some(lv) => covers(lv, dv),
            None => dv.is_null() || dv.as_object().is_some_and(|o| o.is_empty()),
        }),
        (Value::Array(l), Value::Array(d)) => {
            l.len() == d.len() && l.iter().zip(d).all(|(lv, dv)| covers(lv, dv))
        }
        (l, d) => l == d,
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::covers;

    #[test]
    fn defaults_added_by_the_server_do_not_count_as_changes() {
        let desired = json!({"spec": {"replicas": 2, "template": {"spec": {"containers": [{"name": "a", "image": "x"}]}}}});
        let live = json!({"spec": {"replicas": 2, "revisionHistoryLimit": 10,
            "template": {"spec": {"containers": [{"name": "a", "image": "x", "imagePullPolicy": "IfNotPresent"}], "dnsPolicy": "ClusterFirst"}}}});
        assert!(covers(&live, &desired));
    }

    #[test]
    fn changed_missing_and_extra_list_items_count() {
        let desired = json!({"spec": {"replicas": 2, "args": ["a", "b"], "labels": {"k": "v"}}});
        assert!(!covers(
            &json!({"spec": {"replicas": 3, "args": ["a", "b"], "labels": {"k": "v"}}}),
            &desired
        ));
        assert!(!covers(
            &json!({"spec": {"replicas": 2, "args": ["a"], "labels": {"k": "v"}}}),
            &desired
        ));
        assert!(!covers(
            &json!({"spec": {"replicas": 2, "args": ["a", "b", "c"], "labels": {"k": "v"}}}),
            &desired
        ));
        assert!(!covers(
            &json!({"spec": {"replicas": 2, "args": ["a", "b"], "labels": {}}}),
            &desired
        ));
        assert!(!covers(
            &json!({"spec": {"replicas": 2, "args": ["a", "b"]}}),
            &desired
        ));
    }

    #[test]
    fn empty_objects_are_covered_by_absence() {
        assert!(covers(
            &json!({"volume": {"name": "tmp"}}),
            &json!({"volume": {"name": "tmp", "emptyDir": {}}})
        ));
    }
}
