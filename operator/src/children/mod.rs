//! The objects one RLRun owns, computed from its spec alone (pure functions, no client; only
//! the disruption budgets also ask whether the run has succeeded).
//!
//! [`desired`] returns every child with its labels and owner reference; the controller
//! server-side-applies them and deletes the objects it owns that are no longer in the list. Names
//! are `<run>-<component>`; every child carries [`RUN_LABEL`] (the run's name) so orphans can be
//! found by label, and pods carry [`COMPONENT_LABEL`] too.

mod access;
mod disruption;
mod kueue;
mod network;
mod pods;
mod pool;
mod sandbox;
mod workloads;

pub use disruption::{PROTECTED_ROLES, UNHEALTHY_POD_EVICTION_POLICY};
pub use kueue::{
    queue_name, Placement, GROUP as KUEUE_GROUP, QUEUE_LABEL, VERSION as KUEUE_VERSION,
};
pub use network::{default_dns, egress_to, NetworkPolicies};
pub use pods::{quantity, DEFAULT_LIMITS, TMP_SIZE};
pub use pool::{
    pool_desired, pool_engine_selector, pool_secret_name, OnPool, PoolChildren,
    POOL_CREDENTIAL_ENV, POOL_CREDENTIAL_KEY,
};
pub use sandbox::{
    verifier, CORE_GROUP, EXTENSIONS_GROUP, POD_NAME_ENV, POD_UID_ENV, POOL_ENV, SANDBOX_PORT,
    VERIFIER_ENV, VERSION,
};
pub use workloads::{vllm_args, EngineRole};

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::{Deployment, StatefulSet};
use k8s_openapi::api::core::v1::{ConfigMap, Secret, Service, ServiceAccount};
use k8s_openapi::api::networking::v1::{NetworkPolicyEgressRule, NetworkPolicyPeer};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::{Resource, ResourceExt};
use serde::Serialize;

use crate::api::RLRun;

/// Label holding the owning run's name, on every child and every pod.
pub const RUN_LABEL: &str = "moult.dev/run";
/// Label holding the owning RLRun's UID, on every pod the operator makes. The NetworkPolicies'
/// peers require it besides the name labels, so a pod that copies a run's name labels is not a
/// peer unless it also knows the run's UID (what labels cannot stop: docs/security.md).
pub const RUN_UID_LABEL: &str = "moult.dev/run-uid";
/// Label holding the owning EnginePool's name, on every child of a pool and its engine pods (a
/// pool's children carry no [`RUN_LABEL`]: no run's listing or selector ever takes them).
pub const POOL_LABEL: &str = "moult.dev/pool";
/// Label holding the owning EnginePool's UID, on its engine pods (as [`RUN_UID_LABEL`] on a
/// run's).
pub const POOL_UID_LABEL: &str = "moult.dev/pool-uid";
/// Label holding the EnginePool's name on the coordinator and trainer pods of a run on it: the
/// pool's NetworkPolicy admits them to its engines.
pub const ON_POOL_LABEL: &str = "moult.dev/on-pool";
/// Label naming the role of a pod: engine, trainer, coordinator, agents.
pub const COMPONENT_LABEL: &str = "moult.dev/component";
/// Set on every child so that the operator watches only its own objects.
pub const MANAGED_BY_LABEL: &str = "app.kubernetes.io/managed-by";
pub const MANAGED_BY: &str = "moult-operator";
/// Pod-template annotation with a hash of the run config, so pods restart when it changes
/// (but not when only replica counts or `suspend` change).
pub const CONFIG_HASH_ANNOTATION: &str = "moult.dev/config-hash";
/// Annotation on every child with a hash of what the operator applied: a field dropped from the
/// desired object changes it, so the controller re-applies (and server-side apply removes the
/// field) even though the live object still has every desired field.
pub const APPLIED_HASH_ANNOTATION: &str = "moult.dev/applied-hash";
/// Key of the per-run token in its Secret.
pub const TOKEN_KEY: &str = "token";
/// Key of the agent credential (derived from the token, docs/security.md) in the same Secret.
pub const AGENT_TOKEN_KEY: &str = "agent-token";

/// Ports of the run's internal endpoints.
pub const ENGINE_PORT: i32 = 8000;
pub const COORDINATOR_PORT: i32 = 8080;
pub const TRAINER_RENDEZVOUS_PORT: i32 = 29500;
/// The trainer's listener for engines' weight streams (the TCP weight transport).
pub const WEIGHT_STREAM_PORT: i32 = 29600;
/// Health and Prometheus metrics of the roles that serve nothing else (trainer, agents).
pub const METRICS_PORT: i32 = 9090;
/// Where an agent pod's `moult sandbox` container listens for `moult agents`, on the `/tmp`
/// volume the two containers share (docs/security.md, "Agent code").
pub const SANDBOX_SOCKET: &str = "/tmp/moult-sandbox.sock";
/// The variable that points `moult agents` at that socket.
pub const SANDBOX_ENV: &str = "MOULT_AGENT_SANDBOX";

/// What the operator's flags decide for every run: images, the cluster's network facts its
/// NetworkPolicies need, and whether runs get disruption budgets.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    pub images: Images,
    /// Where agent pods may send DNS queries: [`default_dns`] (kube-system's kube-dns pods, port
    /// 53) unless the cluster's DNS is elsewhere.
    pub dns: NetworkPolicyEgressRule,
    /// Who may scrape `/metrics` on the coordinator's and the engines' API ports (Prometheus);
    /// nobody outside the run when empty. (The trainer's and agents' metrics ports admit anyone.)
    pub metrics_from: Vec<NetworkPolicyPeer>,
    /// Where agent pods of runs with `spec.agent.sandbox` reach the API server
    /// ([`crate::controller::api_server_egress`] unless the operator's flag says).
    pub api_server: Option<NetworkPolicyEgressRule>,
    /// A PodDisruptionBudget with `maxUnavailable: 0` for each run's trainer and coordinator
    /// (`--disruption-budgets`; docs/operator.md, "Disruption budgets").
    pub disruption_budgets: bool,
    /// The operator's own pods ([`operator_pods`] of its namespace), which an EnginePool's
    /// NetworkPolicy admits to its engines beside the pool's runs; none when `None`.
    pub operator: Option<NetworkPolicyPeer>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            images: Images::default(),
            dns: default_dns(),
            metrics_from: Vec::new(),
            api_server: None,
            disruption_budgets: false,
            operator: None,
        }
    }
}

/// The operator's pods as a NetworkPolicy peer: the pods labelled
/// `app.kubernetes.io/name: moult-operator` (the Helm chart's) in `namespace`.
pub fn operator_pods(namespace: &str) -> NetworkPolicyPeer {
    let labels = |k: &str, v: &str| k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector {
        match_labels: Some(BTreeMap::from([(k.to_string(), v.to_string())])),
        ..Default::default()
    };
    NetworkPolicyPeer {
        namespace_selector: Some(labels("kubernetes.io/metadata.name", namespace)),
        pod_selector: Some(labels("app.kubernetes.io/name", "moult-operator")),
        ..NetworkPolicyPeer::default()
    }
}

/// The images of a run's pods, when its spec names none.
#[derive(Clone, Debug, PartialEq)]
pub struct Images {
    /// vLLM engines when the spec names none.
    pub vllm: String,
    /// The moult runtime (trainer, coordinator, built-in engine, built-in environments).
    pub runtime: String,
    /// The small image whose only job is to copy the `moult` binary into agent pods.
    pub init: String,
}

impl Default for Images {
    fn default() -> Self {
        Images {
            vllm: "vllm/vllm-openai:v0.32.0".into(),
            runtime: format!("ghcr.io/moult-dev/moult:{}", env!("CARGO_PKG_VERSION")),
            init: format!("ghcr.io/moult-dev/moult-init:{}", env!("CARGO_PKG_VERSION")),
        }
    }
}

/// Why a run's children cannot be built (the spec passed the schema but is unusable).
#[derive(Debug, Clone, PartialEq)]
pub struct InvalidSpec(pub String);

impl std::fmt::Display for InvalidSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Every object a run owns, typed.
#[derive(Clone, Debug, Default)]
pub struct Children {
    pub config: ConfigMap,
    pub token: Secret,
    pub service_account: ServiceAccount,
    pub role: Role,
    pub role_binding: RoleBinding,
    pub network_policies: NetworkPolicies,
    /// The run's own engines and their Service; none for a run on an EnginePool.
    pub engine_service: Option<Service>,
    pub engines: Option<StatefulSet>,
    pub trainer_service: Service,
    pub trainer: StatefulSet,
    pub coordinator_service: Service,
    pub coordinator: Deployment,
    pub agents: Deployment,
    /// With `spec.judge`: the judge's engines and their Service.
    pub judge_service: Option<Service>,
    pub judge: Option<StatefulSet>,
    /// With a served distillation teacher: its engines and their Service.
    pub teacher_service: Option<Service>,
    pub teacher: Option<StatefulSet>,
    /// With `spec.agent.sandbox`: the sandbox pods' template and warm pool, and the agent pods'
    /// own access (docs/security.md#sandbox-pods).
    pub sandbox: Option<SandboxChildren>,
    /// With a queue (`spec.scheduling.queueName`): the run's Kueue `Workload` (docs/operator.md,
    /// "Kueue").
    pub workload: Option<serde_json::Value>,
    /// With the operator's `--disruption-budgets`: the trainer's and the coordinator's
    /// PodDisruptionBudgets (none once the run has succeeded).
    pub disruption_budgets: Vec<PodDisruptionBudget>,
}

/// What `spec.agent.sandbox` adds to a run.
#[derive(Clone, Debug, Default)]
pub struct SandboxChildren {
    /// agent-sandbox's `SandboxTemplate` and `SandboxWarmPool` (not k8s-openapi types).
    pub template: serde_json::Value,
    pub warm_pool: serde_json::Value,
    pub account: ServiceAccount,
    pub role: Role,
    pub role_binding: RoleBinding,
}

/// One child in the form the controller applies: its kind and its JSON (with apiVersion/kind).
#[derive(Clone, Debug, PartialEq)]
pub struct Child {
    pub kind: ChildKind,
    pub name: String,
    pub object: serde_json::Value,
}

/// The kinds a run owns; the controller lists each by label to find orphans.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ChildKind {
    ConfigMap,
    Secret,
    ServiceAccount,
    Role,
    RoleBinding,
    NetworkPolicy,
    Service,
    /// With the operator's `--disruption-budgets` (before the workloads: their pods are
    /// protected from the start).
    PodDisruptionBudget,
    StatefulSet,
    Deployment,
    /// kubernetes-sigs/agent-sandbox's kinds, on clusters that have it.
    SandboxTemplate,
    SandboxWarmPool,
    /// Kueue's, on clusters that have it.
    Workload,
}

impl ChildKind {
    /// In the order they are applied: what pods need exists before the pods.
    pub const ALL: [ChildKind; 13] = [
        ChildKind::ConfigMap,
        ChildKind::Secret,
        ChildKind::ServiceAccount,
        ChildKind::Role,
        ChildKind::RoleBinding,
        ChildKind::NetworkPolicy,
        ChildKind::Service,
        ChildKind::PodDisruptionBudget,
        ChildKind::StatefulSet,
        ChildKind::Deployment,
        ChildKind::SandboxTemplate,
        ChildKind::SandboxWarmPool,
        ChildKind::Workload,
    ];

    /// Whether the kind is a custom resource of another project, which a cluster may not have.
    pub fn optional(self) -> bool {
        matches!(
            self,
            ChildKind::SandboxTemplate | ChildKind::SandboxWarmPool | ChildKind::Workload
        )
    }
}

impl Children {
    /// The children as applyable JSON, in [`ChildKind::ALL`] order.
    pub fn into_list(self) -> Vec<Child> {
        // The run's own engines (none on an EnginePool) in the places they always had: the API
        // server refuses the first bad object, and says so in the run's condition.
        let engine_policy =
            (self.network_policies.engine.as_ref()).map(|p| child(ChildKind::NetworkPolicy, p));
        let engine_service = (self.engine_service.as_ref()).map(|s| child(ChildKind::Service, s));
        let engines = (self.engines.as_ref()).map(|e| child(ChildKind::StatefulSet, e));
        let mut list: Vec<Child> = [
            Some(child(ChildKind::ConfigMap, &self.config)),
            Some(child(ChildKind::Secret, &self.token)),
            Some(child(ChildKind::ServiceAccount, &self.service_account)),
            Some(child(ChildKind::Role, &self.role)),
            Some(child(ChildKind::RoleBinding, &self.role_binding)),
            engine_policy,
            Some(child(
                ChildKind::NetworkPolicy,
                &self.network_policies.trainer,
            )),
            Some(child(
                ChildKind::NetworkPolicy,
                &self.network_policies.coordinator,
            )),
            Some(child(
                ChildKind::NetworkPolicy,
                &self.network_policies.agents,
            )),
            engine_service,
            Some(child(ChildKind::Service, &self.trainer_service)),
            Some(child(ChildKind::Service, &self.coordinator_service)),
            engines,
            Some(child(ChildKind::StatefulSet, &self.trainer)),
            Some(child(ChildKind::Deployment, &self.coordinator)),
            Some(child(ChildKind::Deployment, &self.agents)),
        ]
        .into_iter()
        .flatten()
        .collect();
        if let Some(policy) = &self.network_policies.judge {
            list.push(child(ChildKind::NetworkPolicy, policy));
        }
        if let Some(service) = &self.judge_service {
            list.push(child(ChildKind::Service, service));
        }
        if let Some(judge) = &self.judge {
            list.push(child(ChildKind::StatefulSet, judge));
        }
        if let Some(policy) = &self.network_policies.teacher {
            list.push(child(ChildKind::NetworkPolicy, policy));
        }
        if let Some(service) = &self.teacher_service {
            list.push(child(ChildKind::Service, service));
        }
        if let Some(teacher) = &self.teacher {
            list.push(child(ChildKind::StatefulSet, teacher));
        }
        if let Some(sandbox) = self.sandbox {
            list.push(child(ChildKind::ServiceAccount, &sandbox.account));
            list.push(child(ChildKind::Role, &sandbox.role));
            list.push(child(ChildKind::RoleBinding, &sandbox.role_binding));
            list.push(json_child(ChildKind::SandboxTemplate, sandbox.template));
            list.push(json_child(ChildKind::SandboxWarmPool, sandbox.warm_pool));
        }
        if let Some(workload) = self.workload {
            list.push(json_child(ChildKind::Workload, workload));
        }
        for budget in &self.disruption_budgets {
            list.push(child(ChildKind::PodDisruptionBudget, budget));
        }
        // In apply order: what pods need exists before the pods.
        list.sort_by_key(|c| c.kind);
        list
    }
}

/// `k` as an applyable child: its JSON with apiVersion and kind, and the hash of what is applied.
pub(crate) fn child<K: Resource<DynamicType = ()> + Serialize>(kind: ChildKind, k: &K) -> Child {
    let mut object = serde_json::to_value(k).expect("k8s-openapi objects serialize");
    object["apiVersion"] = K::api_version(&()).into();
    object["kind"] = K::kind(&()).into();
    json_child(kind, object)
}

/// `object` (with apiVersion and kind) as an applyable child, with the hash of what is applied.
fn json_child(kind: ChildKind, mut object: serde_json::Value) -> Child {
    let hash = format!(
        "{:016x}",
        fnv1a(&serde_json::to_vec(&object).expect("JSON serializes"))
    );
    let meta = object["metadata"]
        .as_object_mut()
        .expect("objects have metadata");
    let annotations = meta
        .entry("annotations")
        .or_insert_with(|| serde_json::json!({}));
    annotations[APPLIED_HASH_ANNOTATION] = hash.into();
    let name = object["metadata"]["name"].as_str().unwrap_or_default();
    Child {
        kind,
        name: name.to_string(),
        object,
    }
}

/// Everything `run` should own. `token` is the run's existing internal token (kept across
/// reconciles); a new one is generated by the caller when the Secret does not exist yet. A run
/// on an EnginePool (`spec.engines.poolRef`) needs [`desired_on_pool`].
pub fn desired(run: &RLRun, config: &Config, token: &str) -> Result<Children, InvalidSpec> {
    desired_with(run, config, token, None)
}

/// Everything a run on the EnginePool `pool` should own: [`desired`]'s children without engines
/// of its own, with the pool's address and the run's credential for it.
pub fn desired_on_pool(
    run: &RLRun,
    config: &Config,
    token: &str,
    pool: &OnPool,
) -> Result<Children, InvalidSpec> {
    desired_with(run, config, token, Some(pool))
}

fn desired_with(
    run: &RLRun,
    config: &Config,
    token: &str,
    pool: Option<&OnPool>,
) -> Result<Children, InvalidSpec> {
    let ctx = Ctx::new(run, config, pool)?;
    let config = access::config_map(&ctx)?;
    let mut children = Children {
        token: access::token_secret(&ctx, token),
        service_account: access::service_account(&ctx),
        role: access::role(&ctx),
        role_binding: access::role_binding(&ctx),
        network_policies: network::network_policies(&ctx),
        engine_service: pool.is_none().then(|| workloads::engine_service(&ctx)),
        engines: pool.is_none().then(|| workloads::engines(&ctx)),
        trainer_service: workloads::trainer_service(&ctx),
        trainer: workloads::trainer(&ctx),
        coordinator_service: workloads::coordinator_service(&ctx),
        coordinator: workloads::coordinator(&ctx),
        agents: workloads::agents(&ctx),
        judge_service: workloads::judge_service(&ctx),
        judge: workloads::judge(&ctx),
        teacher_service: workloads::teacher_service(&ctx),
        teacher: workloads::teacher_engines(&ctx),
        sandbox: sandbox::children(&ctx, token),
        config,
        workload: None,
        disruption_budgets: disruption::budgets(&ctx),
    };
    children.workload = kueue::workload(&ctx, &children);
    Ok(children)
}

/// The component labels of the engine pools `run` has besides the policy's: `judge` with
/// `spec.judge`, `teacher` with a served distillation teacher. Their readiness is part of the
/// run's status like every other component's.
pub fn scorer_components(run: &RLRun) -> Vec<&'static str> {
    let mut out = Vec::new();
    if run.spec.judge.is_some() {
        out.push("judge");
    }
    if pods::served_teacher_replicas(&run.spec).is_some() {
        out.push("teacher");
    }
    out
}

/// Names of a run's children.
pub fn name(run: &str, component: &str) -> String {
    format!("{run}-{component}")
}

/// The ServiceAccount (and Role, RoleBinding) of a run's pods. Never the run's bare name: an
/// RLRun named `default` must not collide with the namespace's `default` ServiceAccount.
pub fn service_account_name(run: &str) -> String {
    name(run, "moult")
}

/// The label selector of a run's engine pods (the scale subresource's selector).
pub fn engine_selector(run: &str) -> String {
    format!("{COMPONENT_LABEL}=engine,{RUN_LABEL}={run}")
}

/// What every builder needs: the run, its owner reference and operator settings.
pub(crate) struct Ctx<'a> {
    pub run: &'a RLRun,
    pub name: String,
    pub namespace: String,
    pub owner: OwnerReference,
    pub config: &'a Config,
    /// Hash of the spec without replica counts and `suspend`.
    pub config_hash: String,
    /// The EnginePool of a run with `spec.engines.poolRef`.
    pub pool: Option<&'a OnPool>,
}

impl<'a> Ctx<'a> {
    fn new(
        run: &'a RLRun,
        config: &'a Config,
        pool: Option<&'a OnPool>,
    ) -> Result<Self, InvalidSpec> {
        let owner = run
            .controller_owner_ref(&())
            .ok_or_else(|| InvalidSpec("the RLRun has no uid yet".into()))?;
        let namespace = run
            .namespace()
            .ok_or_else(|| InvalidSpec("the RLRun has no namespace".into()))?;
        if run.spec.trainer.dump_rollouts && run.spec.checkpoint.is_none() {
            return Err(InvalidSpec(
                "spec.trainer.dumpRollouts: the trainer writes the dumps beside its checkpoints, on spec.checkpoint.claimName: set spec.checkpoint".into(),
            ));
        }
        if let Some(w) = &run.spec.engines.weight_transfer {
            if w.transport == crate::api::WeightTransport::Filesystem && w.claim_name.is_none() {
                // The schema cannot ask for it: `moult run` uses the same spec with a local folder.
                return Err(InvalidSpec(
                    "spec.engines.weightTransfer.claimName: the Filesystem transport on a cluster needs a ReadWriteMany PersistentVolumeClaim that the trainer and every engine mount (docs/weight-sync.md, \"Weight transports\")".into(),
                ));
            }
        }
        match (&run.spec.engines.pool_ref, pool) {
            (Some(r), None) => {
                return Err(InvalidSpec(format!(
                    "spec.engines.poolRef: the EnginePool {} is not known here",
                    r.name
                )))
            }
            (None, Some(p)) => {
                return Err(InvalidSpec(format!(
                    "the run names no EnginePool, yet was given {}",
                    p.name
                )))
            }
            _ => {}
        }
        let mut scaled = run.spec.clone();
        scaled.engines.replicas = 0;
        scaled.agent.replicas = 0;
        scaled.suspend = false;
        let config_hash = fnv1a(&serde_json::to_vec(&scaled).expect("the spec serializes"));
        Ok(Ctx {
            run,
            name: run.name_any(),
            namespace,
            owner,
            config,
            config_hash: format!("{config_hash:016x}"),
            pool,
        })
    }

    /// Labels of every child; `component` adds the component label.
    pub fn labels(&self, component: Option<&str>) -> BTreeMap<String, String> {
        let mut l = BTreeMap::from([
            (RUN_LABEL.to_string(), self.name.clone()),
            (MANAGED_BY_LABEL.to_string(), MANAGED_BY.to_string()),
            ("app.kubernetes.io/name".to_string(), "moult".to_string()),
            ("app.kubernetes.io/instance".to_string(), self.name.clone()),
        ]);
        if let Some(c) = component {
            l.insert(COMPONENT_LABEL.to_string(), c.to_string());
            l.insert("app.kubernetes.io/component".to_string(), c.to_string());
        }
        l
    }

    /// Labels that select one component's pods (a subset of [`Ctx::labels`], immutable once set).
    pub fn selector(&self, component: &str) -> BTreeMap<String, String> {
        BTreeMap::from([
            (RUN_LABEL.to_string(), self.name.clone()),
            (COMPONENT_LABEL.to_string(), component.to_string()),
        ])
    }

    /// Metadata of a child named `<run>-<suffix>`.
    pub fn meta(&self, suffix: &str, component: Option<&str>) -> ObjectMeta {
        ObjectMeta {
            name: Some(name(&self.name, suffix)),
            namespace: Some(self.namespace.clone()),
            labels: Some(self.labels(component)),
            owner_references: Some(vec![self.owner.clone()]),
            ..ObjectMeta::default()
        }
    }

    /// Replicas of a scalable component: zero while suspended.
    pub fn replicas(&self, wanted: i32) -> i32 {
        if self.run.spec.suspend {
            0
        } else {
            wanted
        }
    }
}

/// 64-bit FNV-1a: a stable hash (std's hashers are not stable across releases).
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}

#[cfg(test)]
pub(crate) mod tests;
