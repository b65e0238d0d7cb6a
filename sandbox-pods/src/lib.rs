//! Model-written code in a pod of its own per episode (docs/security.md, "Sandbox pods"), for
//! runs with `spec.agent.sandbox` on a cluster with kubernetes-sigs/agent-sandbox installed.
//!
//! The operator makes the run a `SandboxTemplate` (pods that run `moult sandbox --serve`, in
//! the task's image) and a `SandboxWarmPool` of them. In each agent pod, `moult agents` runs a
//! [`proxy::Proxy`] on the pod's 127.0.0.1: an episode's `moult.sandbox.run` calls go there, the
//! first one claims a pod of the warm pool for the episode ([`claims::Claims`]), every call is
//! sent on to that pod's [`server::Server`], and the pod is released when the episode ends.
//!
//! - [`server`]: the sandbox pod's side;
//! - [`claims`]: `SandboxClaim`s and `Sandbox`es through the Kubernetes API;
//! - [`proxy`]: the agent pod's side.

pub mod claims;
pub mod proxy;
pub mod server;

use std::sync::Arc;

use tokio::net::TcpListener;

pub use proxy::{Lease, Proxy};

/// The port sandbox pods serve on.
pub const PORT: u16 = 7070;

/// The variables that tell `moult agents` the run has sandbox pods: the warm pool's (and
/// template's) name, and this pod's name and UID (the owner of its claims).
pub const POOL_ENV: &str = "MOULT_SANDBOX_POOL";
pub const POD_NAME_ENV: &str = "MOULT_POD_NAME";
pub const POD_UID_ENV: &str = "MOULT_POD_UID";

/// The proxy of an agent pod whose run has sandbox pods ([`POOL_ENV`] is set), and the listener
/// on 127.0.0.1 where the caller serves its [`Proxy::router`]; `key` is the agents'
/// credential, which sandbox pods check. `None` when the run has none. Claims left by an
/// earlier process of this pod are deleted first.
pub async fn from_env(key: &str) -> Result<Option<(Arc<Proxy>, TcpListener)>, String> {
    let Ok(pool) = std::env::var(POOL_ENV) else {
        return Ok(None);
    };
    let listener = TcpListener::bind("127.0.0.1:0").await;
    let listener = listener.map_err(|e| format!("binding 127.0.0.1 for sandbox pods: {e}"))?;
    let url = format!(
        "http://{}",
        listener.local_addr().map_err(|e| e.to_string())?
    );
    let var = |name: &str| {
        std::env::var(name)
            .map_err(|_| format!("{POOL_ENV} is set but {name} is not (the operator sets both)"))
    };
    let owner = claims::Owner {
        name: var(POD_NAME_ENV)?,
        uid: var(POD_UID_ENV)?,
    };
    let client = kube::Client::try_default().await.map_err(|e| {
        format!("sandbox pods (spec.agent.sandbox) need the agent pod's Kubernetes credential: {e}")
    })?;
    let namespace = client.default_namespace().to_string();
    let claims = claims::Claims::new(client, &namespace, &pool, owner);
    claims.sweep().await.map_err(|e| e.to_string())?;
    Ok(Some((Proxy::new(claims, key.into(), PORT, url), listener)))
}
