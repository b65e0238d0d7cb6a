//! Sandbox pods for episodes, from kubernetes-sigs/agent-sandbox (docs/security.md, "Sandbox
//! pods"): a `SandboxClaim` on the run's warm pool, or for a task that names its own image a
//! `Sandbox` made from the run's template with that image; deleted when the episode ends.

use std::net::IpAddr;
use std::time::{Duration, Instant};

use kube::api::{Api, DeleteParams, DynamicObject, PostParams};
use kube::core::{ApiResource, GroupVersionKind};
use moult_operator::children;
use serde_json::{json, Value as Json};

/// The group and version of `Sandbox`.
const CORE_GROUP: (&str, &str) = (children::CORE_GROUP, children::VERSION);
/// The group and version of `SandboxTemplate`, `SandboxClaim` and `SandboxWarmPool`.
const EXTENSIONS_GROUP: (&str, &str) = (children::EXTENSIONS_GROUP, children::VERSION);
/// The container of a sandbox pod that runs `moult sandbox --serve` (and whose image a task's
/// `image` replaces).
pub const CONTAINER: &str = "sandbox";
/// The label that ties claims and sandboxes to the agent pod that made them.
pub const AGENT_POD_LABEL: &str = "moult.dev/agent-pod";

/// The agent pod that makes claims: they name it as their owner, so that they go (and their
/// pods with them) when it goes, whatever becomes of its process.
#[derive(Debug, Clone)]
pub struct Owner {
    pub name: String,
    pub uid: String,
}

fn resource((group, version): (&str, &str), kind: &str, plural: &str) -> ApiResource {
    ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(group, version, kind), plural)
}

/// Why a sandbox pod could not be had.
#[derive(Debug, thiserror::Error)]
pub enum ClaimError {
    #[error("{0}: {1}")]
    Api(String, kube::Error),
    #[error("{0} was not ready within {1:?}: {2}")]
    NotReady(String, Duration, String),
    #[error("the run's SandboxTemplate {0} has no container named `sandbox`")]
    NoContainer(String),
}

/// Where the sandbox pods of a run's episodes come from.
#[derive(Clone)]
pub struct Claims {
    client: kube::Client,
    namespace: String,
    /// The run's SandboxWarmPool (and SandboxTemplate: they share the name).
    pool: String,
    /// This agent pod, the owner of every claim and sandbox it makes.
    owner: Owner,
    /// How long a pod may take to be ready.
    pub patience: Duration,
}

/// One episode's sandbox pod.
#[derive(Debug, Clone)]
pub struct Claimed {
    /// `SandboxClaim/NAME` or `Sandbox/NAME`.
    pub what: String,
    kind: &'static str,
    name: String,
    pub address: IpAddr,
}

impl std::fmt::Debug for Claims {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Claims({}/{})", self.namespace, self.pool)
    }
}

impl Claims {
    pub fn new(client: kube::Client, namespace: &str, pool: &str, owner: Owner) -> Self {
        Self {
            client,
            namespace: namespace.into(),
            pool: pool.into(),
            owner,
            patience: Duration::from_secs(300),
        }
    }

    fn api(&self, kind: &str) -> Api<DynamicObject> {
        let resource = match kind {
            "Sandbox" => resource(CORE_GROUP, "Sandbox", "sandboxes"),
            "SandboxClaim" => resource(EXTENSIONS_GROUP, "SandboxClaim", "sandboxclaims"),
            _ => resource(EXTENSIONS_GROUP, "SandboxTemplate", "sandboxtemplates"),
        };
        Api::namespaced_with(self.client.clone(), &self.namespace, &resource)
    }

    /// A ready sandbox pod of the run's template: claimed from its warm pool, or, with `image`,
    /// made anew with that image.
    pub async fn claim(&self, image: Option<&str>) -> Result<Claimed, ClaimError> {
        let metadata = json!({
            "generateName": format!("{}-", self.pool),
            "labels": {AGENT_POD_LABEL: self.owner.name},
            "ownerReferences": [{
                "apiVersion": "v1", "kind": "Pod", "name": self.owner.name, "uid": self.owner.uid,
            }],
        });
        let (kind, spec) = match image {
            None => ("SandboxClaim", json!({"warmPoolRef": {"name": self.pool}})),
            Some(image) => ("Sandbox", self.template_with(image).await?),
        };
        let (group, version) = if kind == "Sandbox" {
            CORE_GROUP
        } else {
            EXTENSIONS_GROUP
        };
        let object: DynamicObject = serde_json::from_value(json!({
            "apiVersion": format!("{group}/{version}"),
            "kind": kind,
            "metadata": metadata,
            "spec": spec,
        }))
        .expect("a sandbox object is well formed");
        let api = self.api(kind);
        let made = (api.create(&PostParams::default(), &object).await)
            .map_err(|e| ClaimError::Api(format!("creating a {kind} of {}", self.pool), e))?;
        let name = made.metadata.name.unwrap_or_default();
        let mut claimed = Claimed {
            what: format!("{kind}/{name}"),
            kind,
            name,
            address: IpAddr::from([0, 0, 0, 0]),
        };
        match self.ready(&claimed).await {
            Ok(address) => {
                claimed.address = address;
                Ok(claimed)
            }
            Err(e) => {
                self.release(&claimed).await;
                Err(e)
            }
        }
    }

    /// The run's template's pod template, with `image` in its `sandbox` container.
    async fn template_with(&self, image: &str) -> Result<Json, ClaimError> {
        let template = self.api("SandboxTemplate").get(&self.pool).await;
        let template = template
            .map_err(|e| ClaimError::Api(format!("reading SandboxTemplate {}", self.pool), e))?;
        let mut pod = template.data["spec"]["podTemplate"].clone();
        let containers = pod["spec"]["containers"].as_array_mut();
        let sandbox = containers
            .into_iter()
            .flatten()
            .find(|c| c["name"] == CONTAINER)
            .ok_or_else(|| ClaimError::NoContainer(self.pool.clone()))?;
        sandbox["image"] = image.into();
        Ok(json!({"podTemplate": pod}))
    }

    /// Waits until the claimed pod is ready and has an address.
    async fn ready(&self, claimed: &Claimed) -> Result<IpAddr, ClaimError> {
        let deadline = Instant::now() + self.patience;
        let api = self.api(claimed.kind);
        let mut last = "no status yet".to_string();
        while Instant::now() < deadline {
            let object = (api.get(&claimed.name).await)
                .map_err(|e| ClaimError::Api(format!("reading {}", claimed.what), e))?;
            let status = &object.data["status"];
            // A claim reports its sandbox's addresses under `sandbox`, a sandbox its own.
            let ips = status["sandbox"]["podIPs"]
                .as_array()
                .or(status["podIPs"].as_array());
            let ip = ips.and_then(|ips| ips.first()?.as_str()?.parse::<IpAddr>().ok());
            let conditions = status["conditions"].as_array().into_iter().flatten();
            let ready = conditions
                .clone()
                .any(|c| c["type"] == "Ready" && c["status"] == "True");
            if let (true, Some(ip)) = (ready, ip) {
                return Ok(ip);
            }
            if let Some(c) = conditions.clone().find(|c| c["type"] == "Ready") {
                last = format!(
                    "{}: {}",
                    c["reason"].as_str().unwrap_or(""),
                    c["message"].as_str().unwrap_or("")
                );
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        Err(ClaimError::NotReady(
            claimed.what.clone(),
            self.patience,
            last,
        ))
    }

    /// Deletes what an earlier process of this pod claimed (a restarted container's episodes
    /// are gone).
    pub async fn sweep(&self) -> Result<(), ClaimError> {
        let selector = format!("{AGENT_POD_LABEL}={}", self.owner.name);
        let list = kube::api::ListParams::default().labels(&selector);
        for kind in ["SandboxClaim", "Sandbox"] {
            (self
                .api(kind)
                .delete_collection(&DeleteParams::background(), &list)
                .await)
                .map_err(|e| ClaimError::Api(format!("deleting this pod's {kind}s"), e))?;
        }
        Ok(())
    }

    /// Deletes the claim or sandbox, and so its pod. Failures are logged: the run goes on.
    pub async fn release(&self, claimed: &Claimed) {
        let deleted = self
            .api(claimed.kind)
            .delete(&claimed.name, &DeleteParams::background())
            .await;
        if let Err(e) = deleted {
            tracing::warn!("releasing {}: {e}", claimed.what);
        }
    }
}
