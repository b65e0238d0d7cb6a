//! Bringing a run's children to their desired state: list what exists by label, server-side
//! apply only what differs, delete what is no longer desired.
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
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, ListParams, Patch, PatchParams};
use kube::{Client, Resource};
use serde_json::Value;

use crate::children::{Child, ChildKind, MANAGED_BY, MANAGED_BY_LABEL, RUN_LABEL};
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
        ChildKind::StatefulSet => ar::<StatefulSet>(),
        ChildKind::Deployment => ar::<Deployment>(),
    }
}

/// The run's children that exist, by kind and name.
pub type Live = BTreeMap<(ChildKind, String), DynamicObject>;

/// Lists every child of `run` (by label) in `namespace`.
pub async fn list(client: &Client, namespace: &str, run: &str) -> Result<Live> {
    let lp = ListParams::default().labels(&format!(
        "{RUN_LABEL}={run},{MANAGED_BY_LABEL}={MANAGED_BY}"
    ));
    let lists = ChildKind::ALL.map(|kind| {
        let api: Api<DynamicObject> =
            Api::namespaced_with(client.clone(), namespace, &api_resource(kind));
        let lp = &lp;
        async move {
            let items = api
                .list(lp)
                .await
                .context(|| format!("listing the {kind:?}s of {namespace}/{run}"))?;
            Ok::<_, crate::error::Error>((kind, items))
        }
    });
    let mut live = Live::new();
    for (kind, items) in futures::future::try_join_all(lists).await? {
        for o in items {
            live.insert((kind, o.metadata.name.clone().unwrap_or_default()), o);
        }
    }
    Ok(live)
}

/// What one sync did.
#[derive(Debug, Default)]
pub struct Synced {
    /// The children after the sync (the API server's answer for those written).
    pub current: Live,
    pub applied: Vec<String>,
    pub deleted: Vec<String>,
}

/// Applies every desired child that `live` does not already cover and deletes every live child
/// that is not desired. Children are applied concurrently in waves: what pods need (config,
/// token, service account, role, network policy, services), then the RoleBinding (the API server
/// lets a binder without `bind` rights bind only a Role that exists and whose rules it holds),
/// then the workloads. A wave's applies all finish before the first error is returned: none is
/// cancelled half-way.
pub async fn sync(
    client: &Client,
    namespace: &str,
    desired: Vec<Child>,
    mut live: Live,
) -> Result<Synced> {
    let mut out = Synced::default();
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
            ChildKind::StatefulSet | ChildKind::Deployment => 2,
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
                    .await
                    .context(|| format!("applying {:?} {namespace}/{}", child.kind, child.name))?;
                Ok::<_, crate::error::Error>((child.kind, child.name, applied))
            }
        });
        let mut first_error = None;
        for result in futures::future::join_all(applies).await {
            match result {
                Ok((kind, name, applied)) => {
                    out.applied.push(format!("{kind:?}/{name}"));
                    out.current.insert((kind, name), applied);
                }
                Err(e) => first_error = first_error.or(Some(e)),
            }
        }
        if let Some(e) = first_error {
            return Err(e);
        }
    }
    let deletes = live.into_keys().map(|(kind, name)| {
        let api: Api<DynamicObject> =
            Api::namespaced_with(client.clone(), namespace, &api_resource(kind));
        async move {
            match api.delete(&name, &DeleteParams::background()).await {
                Ok(_) => Ok(Some(format!("{kind:?}/{name}"))),
                Err(kube::Error::Api(e)) if e.code == 404 => Ok(None),
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
