//! Model-written code in a pod of its own per episode (docs/security.md, "Sandbox pods"), for
//! runs with `spec.agent.sandbox` on a cluster with kubernetes-sigs/agent-sandbox installed.
//!
//! The operator makes the run a `SandboxTemplate` (pods that run `moult sandbox --serve`, in
//! the task's image) and a `SandboxWarmPool` of them. In each agent pod, `moult agents` runs a
//! [`proxy::Proxy`] on the pod's 127.0.0.1: an episode's `moult.sandbox.run` calls go there, the
//! first one claims a pod of the warm pool for the episode ([`claims::Claims`]), every call is
//! sent on to that pod's [`server::Server`], and the pod is released when the episode ends.
//!
//! - [`cli`]: `moult sandbox`, an agent pod's sandbox container (`--socket`) or a sandbox pod
//!   (`--serve`);
//! - [`server`]: the sandbox pod's side;
//! - [`claims`]: `SandboxClaim`s and `Sandbox`es through the Kubernetes API;
//! - [`proxy`]: the agent pod's side.

pub mod claims;
pub mod cli;
pub mod proxy;
pub mod server;

use std::sync::Arc;

use tokio::net::TcpListener;

pub use proxy::{Lease, Proxy};

use moult_operator::children::{POD_NAME_ENV, POD_UID_ENV, POOL_ENV};

/// The port sandbox pods serve on (the operator's template says so).
pub const PORT: u16 = moult_operator::children::SANDBOX_PORT as u16;

/// A lease of an episode of `task` on `proxy`'s sandbox pods, if there is a proxy, and the
/// variables of the episode's program (none without).
pub fn lease(
    proxy: Option<&Arc<Proxy>>,
    task: &serde_json::Value,
) -> (Option<Lease>, Vec<(String, String)>) {
    let lease = proxy.map(|proxy| proxy.lease(task));
    let vars = lease.as_ref().map(Lease::env).unwrap_or_default();
    (lease, vars)
}

/// The proxy of an agent pod whose run has sandbox pods ([`POOL_ENV`] is set), on 127.0.0.1,
/// where `serve` serves its router; `key` is the agents' credential, which sandbox pods check;
/// `jail`, where episodes' programs start, may then reach the proxy. `None` when the run has
/// none. Claims left by an earlier process of this pod are deleted first.
pub async fn from_env(
    key: Option<&str>,
    serve: impl FnOnce(TcpListener, axum::Router),
    jail: Option<&mut moult_jail::Jail>,
) -> Result<Option<Arc<Proxy>>, String> {
    let Ok(pool) = std::env::var(POOL_ENV) else {
        return Ok(None);
    };
    let proxy = proxy_of(&pool, key, jail).await;
    let (proxy, listener) = proxy.map_err(|e| format!("spec.agent.sandbox: {e}"))?;
    serve(listener, proxy.clone().router());
    Ok(Some(proxy))
}

/// [`from_env`]'s proxy for the warm pool `pool`, and its listener.
async fn proxy_of(
    pool: &str,
    key: Option<&str>,
    jail: Option<&mut moult_jail::Jail>,
) -> Result<(Arc<Proxy>, TcpListener), String> {
    let var = |name: &str| {
        std::env::var(name)
            .map_err(|_| format!("{POOL_ENV} is set but {name} is not (the operator sets both)"))
    };
    let owner = claims::Owner {
        name: var(POD_NAME_ENV)?,
        uid: var(POD_UID_ENV)?,
    };
    let key = key.ok_or("sandbox pods need the agent credential (MOULT_AGENT_TOKEN)")?;
    let client = kube::Client::try_default()
        .await
        .map_err(|e| format!("sandbox pods need the agent pod's Kubernetes credential: {e}"))?;
    let namespace = client.default_namespace().to_string();
    let claims = claims::Claims::new(client, &namespace, pool, owner);
    claims.sweep().await.map_err(|e| e.to_string())?;
    let listener = TcpListener::bind("127.0.0.1:0").await;
    let listener = listener.map_err(|e| format!("binding 127.0.0.1 for sandbox pods: {e}"))?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    jail.into_iter().for_each(|j| j.ports.push(addr.port()));
    let url = format!("http://{addr}");
    Ok((Proxy::new(claims, key.into(), PORT, url), listener))
}
