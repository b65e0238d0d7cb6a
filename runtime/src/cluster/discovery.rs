//! Which engines the coordinator's router uses: those behind the engine Service, followed through
//! its EndpointSlices, so `kubectl scale rlrun/NAME --replicas=N` and replaced pods reach the
//! router without a restart.
//!
//! An endpoint that is ready joins the pool (it gets generation once it serves the current
//! weights, see [`crate::router::pool`]); one that is terminating or gone leaves it: no new
//! requests go there, and the requests it still runs finish there (its pod drains them before
//! it exits) or fail over to another engine. `MOULT_ENGINES` may instead be a comma-separated
//! list of URLs, for running the roles by hand without a cluster.

use std::collections::BTreeSet;
use std::sync::Arc;

use futures::TryStreamExt;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::runtime::{reflector, watcher, WatchStreamExt};
use kube::{Api, Client};

use crate::router::EnginePool;

/// The engine URLs a slice lists as ready (and not terminating).
pub fn ready_urls(slice: &EndpointSlice, default_port: u16) -> BTreeSet<String> {
    let port = slice
        .ports
        .iter()
        .flatten()
        .find(|p| p.name.as_deref() == Some("http"))
        .or_else(|| slice.ports.iter().flatten().next())
        .and_then(|p| p.port)
        .map_or(default_port, |p| p as u16);
    slice
        .endpoints
        .iter()
        .flatten()
        .filter(|e| {
            let c = e.conditions.as_ref();
            // Unset `ready` means ready (the API's convention).
            c.and_then(|c| c.ready).unwrap_or(true)
                && !c.and_then(|c| c.terminating).unwrap_or(false)
        })
        .flat_map(|e| e.addresses.iter())
        .map(|a| {
            if a.contains(':') {
                format!("http://[{a}]:{port}")
            } else {
                format!("http://{a}:{port}")
            }
        })
        .collect()
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

/// Follows the EndpointSlices of Service `service` in `namespace` into `pool`, forever
/// (reconnecting after API errors). The slices are kept in a reflector's store (which swaps in a
/// relisted set whole), and the pool follows the store after every event.
pub async fn follow(client: Client, namespace: String, service: String, pool: Arc<EnginePool>) {
    let api: Api<EndpointSlice> = Api::namespaced(client, &namespace);
    let config =
        watcher::Config::default().labels(&format!("kubernetes.io/service-name={service}"));
    let (slices, writer) = reflector::store();
    let mut events = std::pin::pin!(watcher::watcher(api, config).reflect(writer));
    loop {
        match events.try_next().await {
            Ok(Some(_)) => {
                let want = slices
                    .state()
                    .iter()
                    .flat_map(|s| ready_urls(s, 8000))
                    .collect();
                reconcile(&pool, &want);
            }
            Ok(None) => return,
            Err(e) => {
                tracing::warn!(%service, "watching the engines' EndpointSlices: {e}; retrying");
                tokio::time::sleep(std::time::Duration::from_secs(2)).await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::discovery::v1::{Endpoint, EndpointConditions, EndpointPort};

    fn endpoint(ip: &str, ready: Option<bool>, terminating: Option<bool>) -> Endpoint {
        Endpoint {
            addresses: vec![ip.into()],
            conditions: Some(EndpointConditions {
                ready,
                terminating,
                serving: None,
            }),
            ..Endpoint::default()
        }
    }

    #[test]
    fn ready_endpoints_join_and_terminating_ones_leave() {
        let slice = EndpointSlice {
            address_type: "IPv4".into(),
            endpoints: Some(vec![
                endpoint("10.0.0.1", Some(true), None),
                endpoint("10.0.0.2", None, None),
                endpoint("10.0.0.3", Some(false), None),
                endpoint("10.0.0.4", Some(true), Some(true)),
            ]),
            ports: Some(vec![EndpointPort {
                name: Some("http".into()),
                port: Some(8000),
                ..EndpointPort::default()
            }]),
            metadata: Default::default(),
        };
        let urls = ready_urls(&slice, 1);
        assert_eq!(
            urls.iter().map(String::as_str).collect::<Vec<_>>(),
            ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
        );
        let pool = EnginePool::new(&["http://10.0.0.4:8000".into()]);
        reconcile(&pool, &urls);
        let now: Vec<String> = pool.all().iter().map(|e| e.url().to_string()).collect();
        assert_eq!(now, ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]);
    }
}
