//! Which engines the coordinator's router uses: those behind the engine Service, followed through
//! its EndpointSlices, so `kubectl scale rlrun/NAME --replicas=N` and replaced pods reach the
//! router without a restart.
//!
//! An endpoint that is ready joins the pool (it gets generation once it serves the current
//! weights, see [`crate::router::pool`]); one that is terminating or gone leaves it: no new
//! requests go there, and the requests it still runs finish there (its pod drains them before
//! it exits) or fail over to another engine. `MOULT_ENGINES` may instead be a comma-separated
//! list of URLs, for running the roles by hand without a cluster.
//!
//! Only the run's own objects count (docs/security.md, "Engine discovery"): a slice counts only
//! if the engine Service controls it, and an endpoint only at the IP of a pod that the engines'
//! StatefulSet controls, both controlled by the RLRun itself (checked by UID). A slice that copies
//! the Service's label, or a pod that copies the engines' labels, never gets a request, and so
//! never sees the run's token.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use futures::TryStreamExt;
use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::{Pod, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::runtime::{reflector, watcher, WatchStreamExt};
use kube::{Api, Client};
use moult_operator::api::{self, RLRun};
use moult_operator::children::{POOL_LABEL, RUN_LABEL};

use crate::router::EnginePool;

/// The UIDs of the run's own engine Service and engine StatefulSet.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Owners {
    pub service: String,
    pub workload: String,
}

/// The UID of the object's controller (its owner reference marked `controller`).
pub fn controller(meta: &ObjectMeta) -> Option<&str> {
    let mut owners = meta.owner_references.iter().flatten();
    owners
        .find(|o| o.controller == Some(true))
        .map(|o| o.uid.as_str())
}

/// The engine URLs that the run's own slices list as ready (and not terminating), at the IPs of
/// the run's own pods.
pub fn ready_urls<'a>(
    slices: impl IntoIterator<Item = &'a EndpointSlice>,
    pods: impl IntoIterator<Item = &'a Pod>,
    owners: &Owners,
    default_port: u16,
) -> BTreeSet<String> {
    let pods: BTreeMap<&str, &Pod> = (pods.into_iter())
        .filter(|p| controller(&p.metadata) == Some(owners.workload.as_str()))
        .filter_map(|p| Some((p.metadata.uid.as_deref()?, p)))
        .collect();
    let ips = |p: &Pod| -> BTreeSet<String> {
        let status = p.status.iter();
        let ips = status.flat_map(|s| s.pod_ips.iter().flatten().map(|ip| ip.ip.clone()));
        ips.chain(p.status.as_ref().and_then(|s| s.pod_ip.clone()))
            .collect()
    };
    let mut urls = BTreeSet::new();
    for slice in slices {
        if controller(&slice.metadata) != Some(owners.service.as_str()) {
            continue;
        }
        let mut ports = slice.ports.iter().flatten();
        let port = (ports.clone().find(|p| p.name.as_deref() == Some("http")))
            .or_else(|| ports.next())
            .and_then(|p| p.port)
            .map_or(default_port, |p| p as u16);
        for e in slice.endpoints.iter().flatten() {
            let c = e.conditions.as_ref();
            // Unset `ready` means ready (the API's convention).
            let ready = c.and_then(|c| c.ready).unwrap_or(true);
            if !ready || c.and_then(|c| c.terminating).unwrap_or(false) {
                continue;
            }
            let target = (e.target_ref.as_ref()).filter(|t| t.kind.as_deref() == Some("Pod"));
            let Some(pod) = target.and_then(|t| pods.get(t.uid.as_deref()?)) else {
                continue;
            };
            let ips = ips(pod);
            let addrs = e.addresses.iter().filter(|a| ips.contains(*a));
            let addrs = addrs.filter_map(|a| a.parse::<IpAddr>().ok());
            // An IPv6 address's socket address is written in brackets.
            urls.extend(addrs.map(|ip| format!("http://{}", SocketAddr::new(ip, port))));
        }
    }
    urls
}

/// Makes the pool's membership `want`: adds the new, removes the gone.
pub fn reconcile(pool: &EnginePool, want: &BTreeSet<String>) {
    for e in pool.all() {
        if !want.contains(e.url()) {
            pool.remove(e.url());
        }
    }
    for url in want {
        pool.add(url);
    }
}

/// Why the run's own engine objects could not be told.
#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    #[error("reading the run's objects: {0}")]
    Api(#[from] kube::Error),
    #[error("the {kind} {name} is not the {owner}'s own (another controller owns it)")]
    NotOwned {
        kind: &'static str,
        name: String,
        owner: Owner,
    },
}

/// Whose engines a coordinator follows: its run's own, or its EnginePool's (a run on a pool,
/// docs/lora.md), whose engine pods carry [`RUN_LABEL`] or [`POOL_LABEL`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Owner {
    Run(String),
    Pool(String),
}

impl std::fmt::Display for Owner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Run(run) => write!(f, "RLRun {run}"),
            Self::Pool(pool) => write!(f, "EnginePool {pool}"),
        }
    }
}

/// The engine Service and StatefulSet, both named `service`: each must be controlled by `owner`.
async fn owners(
    client: &Client,
    ns: &str,
    owner: &Owner,
    service: &str,
) -> Result<Owners, DiscoveryError> {
    let uid = |meta: &ObjectMeta| meta.uid.clone().unwrap_or_default();
    let owner_meta = match owner {
        Owner::Run(run) => {
            let api = Api::<RLRun>::namespaced(client.clone(), ns);
            api.get(run).await?.metadata
        }
        Owner::Pool(pool) => {
            let api = Api::<api::EnginePool>::namespaced(client.clone(), ns);
            api.get(pool).await?.metadata
        }
    };
    let svc: Service = Api::namespaced(client.clone(), ns).get(service).await?;
    let sts: StatefulSet = Api::namespaced(client.clone(), ns).get(service).await?;
    let owner_uid = uid(&owner_meta);
    for (kind, meta) in [("Service", &svc.metadata), ("StatefulSet", &sts.metadata)] {
        if controller(meta) != Some(owner_uid.as_str()) {
            let (name, owner) = (service.to_string(), owner.clone());
            return Err(DiscoveryError::NotOwned { kind, name, owner });
        }
    }
    Ok(Owners {
        service: uid(&svc.metadata),
        workload: uid(&sts.metadata),
    })
}

/// Follows the EndpointSlices of the run's Service `service` in `namespace` into `pool`, forever
/// (reconnecting after API errors), trusting only the run's own slices and pods. The slices and
/// the run's pods are kept in reflectors' stores (which swap in a relisted set whole), and the
/// pool follows them after every event.
pub async fn follow(
    client: Client,
    namespace: String,
    owner: Owner,
    service: String,
    pool: Arc<EnginePool>,
) {
    let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), &namespace);
    let pods: Api<Pod> = Api::namespaced(client.clone(), &namespace);
    let by = |label: String| watcher::Config::default().labels(&label);
    let (slice_store, slice_writer) = reflector::store();
    let (pod_store, pod_writer) = reflector::store();
    let slice_events =
        watcher::watcher(slices, by(format!("kubernetes.io/service-name={service}")));
    let pod_label = match &owner {
        Owner::Run(run) => format!("{RUN_LABEL}={run}"),
        Owner::Pool(pool) => format!("{POOL_LABEL}={pool}"),
    };
    let pod_events = watcher::watcher(pods, by(pod_label));
    let mut events = std::pin::pin!(futures::stream::select(
        slice_events.reflect(slice_writer).map_ok(|_| ()),
        pod_events.reflect(pod_writer).map_ok(|_| ()),
    ));
    let mut known: Option<Owners> = None;
    loop {
        match events.try_next().await {
            Ok(Some(())) => {
                // The Service or StatefulSet may be new (deleted and made again): look them up
                // until found, and again when none of the slices is theirs.
                let slices = slice_store.state();
                let theirs = |o: &Owners| {
                    slices
                        .iter()
                        .any(|s| controller(&s.metadata) == Some(&o.service))
                };
                if !known.as_ref().is_some_and(theirs) {
                    match owners(&client, &namespace, &owner, &service).await {
                        Ok(o) => known = Some(o),
                        Err(e) => tracing::warn!(%service, "engine discovery: {e}"),
                    }
                }
                let Some(o) = &known else { continue };
                let pods = pod_store.state();
                let (slices, pods) = (slices.iter().map(|s| &**s), pods.iter().map(|p| &**p));
                let want = ready_urls(slices, pods, o, 8000);
                reconcile(&pool, &want);
            }
            Ok(None) => return,
            Err(e) => {
                tracing::warn!(%service, "watching the engines' EndpointSlices and pods: {e}; retrying");
                tokio::time::sleep(std::time::Duration::from_secs(2)).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{ObjectReference, PodIP, PodStatus};
    use k8s_openapi::api::discovery::v1::{Endpoint, EndpointConditions, EndpointPort};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;

    fn owned_by(uid: &str, controller: bool) -> ObjectMeta {
        ObjectMeta {
            uid: Some(format!("{uid}-self")),
            owner_references: Some(vec![OwnerReference {
                uid: uid.into(),
                controller: Some(controller),
                ..OwnerReference::default()
            }]),
            ..ObjectMeta::default()
        }
    }

    fn endpoint(ip: &str, pod: &str, ready: Option<bool>, terminating: Option<bool>) -> Endpoint {
        Endpoint {
            addresses: vec![ip.into()],
            conditions: Some(EndpointConditions {
                ready,
                terminating,
                serving: None,
            }),
            target_ref: Some(ObjectReference {
                kind: Some("Pod".into()),
                uid: Some(pod.into()),
                ..ObjectReference::default()
            }),
            ..Endpoint::default()
        }
    }

    fn slice(controller: &str, endpoints: Vec<Endpoint>) -> EndpointSlice {
        EndpointSlice {
            address_type: "IPv4".into(),
            endpoints: Some(endpoints),
            ports: Some(vec![EndpointPort {
                name: Some("http".into()),
                port: Some(8000),
                ..EndpointPort::default()
            }]),
            metadata: owned_by(controller, true),
        }
    }

    /// A pod with UID `uid` at `ip`, controlled by `controller`.
    fn pod(uid: &str, ip: &str, controller: &str) -> Pod {
        let mut metadata = owned_by(controller, true);
        metadata.uid = Some(uid.into());
        Pod {
            metadata,
            status: Some(PodStatus {
                pod_ip: Some(ip.into()),
                pod_ips: Some(vec![PodIP { ip: ip.into() }]),
                ..PodStatus::default()
            }),
            ..Pod::default()
        }
    }

    fn owners() -> Owners {
        Owners {
            service: "svc".into(),
            workload: "sts".into(),
        }
    }

    #[test]
    fn ready_endpoints_join_and_terminating_ones_leave() {
        let slice = slice(
            "svc",
            vec![
                endpoint("10.0.0.1", "p1", Some(true), None),
                endpoint("10.0.0.2", "p2", None, None),
                endpoint("10.0.0.3", "p3", Some(false), None),
                endpoint("10.0.0.4", "p4", Some(true), Some(true)),
            ],
        );
        let pods: Vec<Pod> = (1..=4)
            .map(|i| pod(&format!("p{i}"), &format!("10.0.0.{i}"), "sts"))
            .collect();
        let urls = ready_urls([&slice], &pods, &owners(), 1);
        assert_eq!(
            urls.iter().map(String::as_str).collect::<Vec<_>>(),
            ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
        );
        let pool = EnginePool::new(&["http://10.0.0.4:8000".into()]);
        reconcile(&pool, &urls);
        let now: Vec<String> = pool.all().iter().map(|e| e.url().to_string()).collect();
        assert_eq!(now, ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]);
    }

    #[test]
    fn only_the_runs_own_slices_and_pods_count() {
        let pods = [
            pod("p1", "10.0.0.1", "sts"),
            // Copied labels, its own controller (or none).
            pod("rogue", "10.0.0.9", "someone-else"),
            Pod {
                metadata: ObjectMeta {
                    uid: Some("bare".into()),
                    ..ObjectMeta::default()
                },
                ..pod("bare", "10.0.0.8", "sts")
            },
        ];
        let slices = [
            slice(
                "svc",
                vec![
                    endpoint("10.0.0.1", "p1", None, None),
                    // The run's slice naming a pod that is not the run's.
                    endpoint("10.0.0.9", "rogue", None, None),
                    endpoint("10.0.0.8", "bare", None, None),
                    // The run's pod, at an address that is not the pod's.
                    endpoint("10.0.0.7", "p1", None, None),
                ],
            ),
            // A slice with the Service's label that the Service does not control.
            slice("forged", vec![endpoint("10.0.0.1", "p1", None, None)]),
            EndpointSlice {
                metadata: owned_by("svc", false),
                ..slice("svc", vec![endpoint("10.0.0.9", "rogue", None, None)])
            },
        ];
        let mut no_target = endpoint("10.0.0.1", "p1", None, None);
        no_target.target_ref = None;
        let urls = ready_urls(&slices, &pods, &owners(), 1);
        assert_eq!(
            urls.into_iter().collect::<Vec<_>>(),
            ["http://10.0.0.1:8000"]
        );
        let untargeted = slice("svc", vec![no_target]);
        assert!(ready_urls([&untargeted], &pods, &owners(), 1).is_empty());
        // A forged slice alone gives nothing, even naming the run's own pod.
        assert!(ready_urls([&slices[1]], &pods, &owners(), 1).is_empty());
    }
}
