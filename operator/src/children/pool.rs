//! An EnginePool's objects, computed from its spec alone (pure functions, no client), and what a
//! run on a pool gets from it (docs/operator.md, "Engine pools").
//!
//! A pool owns the Secret `<pool>-pool` (its token), its engines (the StatefulSet and headless
//! Service `<pool>-engines`, built like a run's: [`super::workloads::engine_pod`]) and the
//! NetworkPolicy `<pool>-engines`, which admits only the coordinator and trainer pods of runs on
//! the pool (labelled [`ON_POOL_LABEL`]), the operator's pods and its metrics scrapers. Every child carries
//! [`POOL_LABEL`], never [`super::RUN_LABEL`]; the `-engines` suffix is no run component's, so a
//! pool's children never take a run's names. A run on the pool holds a credential of its own
//! derived from the pool token (`credentials::pool_credential`), which the engines check.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::{StatefulSet, StatefulSetSpec};
use k8s_openapi::api::core::v1::{EnvVar, Secret, Service, ServicePort, ServiceSpec};
use k8s_openapi::api::networking::v1::{
    NetworkPolicy, NetworkPolicyIngressRule, NetworkPolicyPeer, NetworkPolicyPort,
    NetworkPolicySpec,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta, OwnerReference};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use k8s_openapi::ByteString;
use kube::{Resource, ResourceExt};

use super::pods::{env, model_of, pod_template, secret_env, tmp_size_of, PodOwner};
use super::workloads::{builtin_engine, engine_pod};
use super::{
    child, fnv1a, name, Child, ChildKind, Config, InvalidSpec, COMPONENT_LABEL, ENGINE_PORT,
    MANAGED_BY, MANAGED_BY_LABEL, ON_POOL_LABEL, POOL_LABEL, POOL_UID_LABEL, TOKEN_KEY,
};
use crate::api::{EngineBackend, EnginePool, SchedulingSpec};

/// Key of a run's pool credential in the run's own Secret (`<run>-token`).
pub const POOL_CREDENTIAL_KEY: &str = "pool-credential";
/// The variable holding a run's credential for its pool's engines, in its coordinator and trainer
/// (they find the engines as a run finds its own, by the pool's labels).
pub const POOL_CREDENTIAL_ENV: &str = "MOULT_POOL_CREDENTIAL";

/// What a run on an EnginePool takes from it.
#[derive(Clone, Debug, PartialEq)]
pub struct OnPool {
    /// The pool's name (in the run's namespace).
    pub name: String,
    /// The run's credential, `credentials::pool_credential(pool token, run)`.
    pub credential: String,
}

impl OnPool {
    /// What the run `run` takes from `pool`, whose token is `pool_token`.
    pub fn new(pool: &EnginePool, pool_token: &str, run: &str) -> OnPool {
        OnPool {
            name: pool.name_any(),
            credential: crate::credentials::pool_credential(pool_token, run),
        }
    }
}

/// The Secret holding a pool's token.
pub fn pool_secret_name(pool: &str) -> String {
    name(pool, "pool")
}

/// The component suffix of a pool's engines (their StatefulSet, Service and NetworkPolicy).
const ENGINES: &str = "engines";
/// The component label of a pool's engine pods, as of a run's.
const COMPONENT: &str = "engine";

/// The label selector of a pool's engine pods (the scale subresource's selector).
pub fn pool_engine_selector(pool: &str) -> String {
    format!("{COMPONENT_LABEL}={COMPONENT},{POOL_LABEL}={pool}")
}

/// Every object a pool owns.
#[derive(Clone, Debug)]
pub struct PoolChildren {
    pub token: Secret,
    pub network_policy: NetworkPolicy,
    pub service: Service,
    pub engines: StatefulSet,
}

impl PoolChildren {
    /// The children as applyable JSON, in [`ChildKind::ALL`] order.
    pub fn into_list(self) -> Vec<Child> {
        vec![
            child(ChildKind::Secret, &self.token),
            child(ChildKind::NetworkPolicy, &self.network_policy),
            child(ChildKind::Service, &self.service),
            child(ChildKind::StatefulSet, &self.engines),
        ]
    }
}

/// Everything `pool` should own. `token` is the pool's existing token (kept across reconciles);
/// the caller makes a new one when the Secret does not exist yet.
pub fn pool_desired(
    pool: &EnginePool,
    config: &Config,
    token: &str,
) -> Result<PoolChildren, InvalidSpec> {
    let ctx = PoolCtx::new(pool, config)?;
    Ok(PoolChildren {
        token: token_secret(&ctx, token),
        network_policy: network_policy(&ctx),
        service: service(&ctx),
        engines: engines(&ctx),
    })
}

/// What every pool builder needs.
struct PoolCtx<'a> {
    pool: &'a EnginePool,
    name: String,
    namespace: String,
    owner: OwnerReference,
    config: &'a Config,
    /// Hash of the spec without the replica count.
    config_hash: String,
}

impl<'a> PoolCtx<'a> {
    fn new(pool: &'a EnginePool, config: &'a Config) -> Result<Self, InvalidSpec> {
        let owner = pool
            .controller_owner_ref(&())
            .ok_or_else(|| InvalidSpec("the EnginePool has no uid yet".into()))?;
        let namespace = pool
            .namespace()
            .ok_or_else(|| InvalidSpec("the EnginePool has no namespace".into()))?;
        if pool.spec.engines.backend != EngineBackend::Builtin {
            // The CRD refuses it; an EnginePool stored under an older schema may still say so.
            return Err(InvalidSpec(
                "spec.engines.backend: an EnginePool runs moult's built-in engine only: set engines.backend Builtin (docs/lora.md)".into(),
            ));
        }
        let mut scaled = pool.spec.clone();
        scaled.engines.replicas = 0;
        let hash = fnv1a(&serde_json::to_vec(&scaled).expect("the spec serializes"));
        Ok(PoolCtx {
            pool,
            name: pool.name_any(),
            namespace,
            owner,
            config,
            config_hash: format!("{hash:016x}"),
        })
    }

    fn labels(&self, component: Option<&str>) -> BTreeMap<String, String> {
        let mut l = BTreeMap::from([
            (POOL_LABEL.to_string(), self.name.clone()),
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

    /// The labels that select the pool's engine pods.
    fn selector(&self) -> BTreeMap<String, String> {
        BTreeMap::from([
            (POOL_LABEL.to_string(), self.name.clone()),
            (COMPONENT_LABEL.to_string(), COMPONENT.to_string()),
        ])
    }

    fn meta(&self, suffix: &str, component: Option<&str>) -> ObjectMeta {
        ObjectMeta {
            name: Some(name(&self.name, suffix)),
            namespace: Some(self.namespace.clone()),
            labels: Some(self.labels(component)),
            owner_references: Some(vec![self.owner.clone()]),
            ..ObjectMeta::default()
        }
    }
}

/// The pool token, from which every run's credential is derived; only the engines hold it.
fn token_secret(ctx: &PoolCtx, token: &str) -> Secret {
    Secret {
        metadata: ctx.meta("pool", None),
        type_: Some("Opaque".into()),
        data: Some(BTreeMap::from([(
            TOKEN_KEY.to_string(),
            ByteString(token.as_bytes().to_vec()),
        )])),
        ..Secret::default()
    }
}

/// The engines' headless Service: its name resolves to every ready engine, and its
/// EndpointSlices list them.
fn service(ctx: &PoolCtx) -> Service {
    Service {
        metadata: ctx.meta(ENGINES, Some(COMPONENT)),
        spec: Some(ServiceSpec {
            selector: Some(ctx.selector()),
            cluster_ip: Some("None".into()),
            ports: Some(vec![ServicePort {
                name: Some("http".into()),
                port: ENGINE_PORT,
                target_port: Some(IntOrString::Int(ENGINE_PORT)),
                protocol: Some("TCP".into()),
                ..ServicePort::default()
            }]),
            ..ServiceSpec::default()
        }),
        ..Service::default()
    }
}

/// `moult engine` on the base model, holding up to `maxAdapters` adapters of rank up to
/// `maxRank` at once, checking each run's credential against the pool token (`MOULT_TOKEN`).
fn engines(ctx: &PoolCtx) -> StatefulSet {
    let spec = &ctx.pool.spec;
    let e = &spec.engines;
    let (model_volume, model_path) = model_of(&spec.model);
    let mut flags = vec!["--served-model-name".into(), ctx.name.clone()];
    if let Some(len) = spec.model.max_model_len {
        flags.extend(["--max-model-len".into(), len.to_string()]);
    }
    flags.extend(["--pool-max-adapters".into(), spec.max_adapters.to_string()]);
    flags.extend(["--max-lora-rank".into(), spec.max_rank.to_string()]);
    let mut c = builtin_engine(e, ctx.config, model_path, flags);
    // No run config: the engine reads only its flags and the pool token.
    c.volume_mounts
        .get_or_insert_with(Vec::new)
        .retain(|m| m.name != "config");
    c.env = Some(vec![
        env("HOME", "/tmp"),
        secret_env("MOULT_TOKEN", &pool_secret_name(&ctx.name), TOKEN_KEY),
    ]);
    let pod = engine_pod(e, c, None, model_volume);
    let mut labels = ctx.labels(Some(COMPONENT));
    labels.insert(POOL_UID_LABEL.into(), ctx.owner.uid.clone());
    let owner = PodOwner {
        labels,
        config_hash: &ctx.config_hash,
        // The engines call no API: the namespace's default account, its token not mounted.
        service_account: None,
        config_map: None,
        scheduling: &NO_SCHEDULING,
    };
    let tmp = tmp_size_of(e.resources.as_ref(), COMPONENT);
    StatefulSet {
        metadata: ctx.meta(ENGINES, Some(COMPONENT)),
        spec: StatefulSetSpec {
            replicas: Some(e.replicas),
            service_name: Some(name(&ctx.name, ENGINES)),
            // Engines are independent: scale up and down all at once.
            pod_management_policy: Some("Parallel".into()),
            selector: LabelSelector {
                match_labels: Some(ctx.selector()),
                ..LabelSelector::default()
            },
            template: pod_template(owner, COMPONENT, e.gpus() > 0, &tmp, pod),
            ..StatefulSetSpec::default()
        },
        ..StatefulSet::default()
    }
}

/// A pool has no placement of its own yet: its GPU engines get the GPU toleration only.
static NO_SCHEDULING: std::sync::LazyLock<SchedulingSpec> =
    std::sync::LazyLock::new(SchedulingSpec::default);

/// Only the coordinator and trainer pods of runs on the pool (which hold credentials for it) and
/// the operator's own pods ([`Config::operator`]) reach the engines, and the operator's metrics
/// scrapers their `/metrics`.
fn network_policy(ctx: &PoolCtx) -> NetworkPolicy {
    let port = || {
        Some(vec![NetworkPolicyPort {
            port: Some(IntOrString::Int(ENGINE_PORT)),
            protocol: Some("TCP".into()),
            ..NetworkPolicyPort::default()
        }])
    };
    let runs = NetworkPolicyPeer {
        pod_selector: Some(LabelSelector {
            match_labels: Some(BTreeMap::from([(
                ON_POOL_LABEL.to_string(),
                ctx.name.clone(),
            )])),
            ..LabelSelector::default()
        }),
        ..NetworkPolicyPeer::default()
    };
    // The operator itself, where it was told where it runs.
    let from = std::iter::once(runs).chain(ctx.config.operator.clone());
    let mut ingress = vec![NetworkPolicyIngressRule {
        from: Some(from.collect()),
        ports: port(),
    }];
    if !ctx.config.metrics_from.is_empty() {
        ingress.push(NetworkPolicyIngressRule {
            from: Some(ctx.config.metrics_from.clone()),
            ports: port(),
        });
    }
    NetworkPolicy {
        metadata: ctx.meta(ENGINES, None),
        spec: Some(NetworkPolicySpec {
            pod_selector: Some(LabelSelector {
                match_labels: Some(ctx.selector()),
                ..LabelSelector::default()
            }),
            policy_types: Some(vec!["Ingress".into()]),
            ingress: Some(ingress),
            egress: None,
        }),
    }
}

/// The variable of a run's coordinator and trainer on a pool: the run's credential from the run's
/// Secret (`secret`, key [`POOL_CREDENTIAL_KEY`]).
pub(crate) fn credential_env(secret: &str) -> EnvVar {
    secret_env(POOL_CREDENTIAL_ENV, secret, POOL_CREDENTIAL_KEY)
}

#[cfg(test)]
mod tests;
