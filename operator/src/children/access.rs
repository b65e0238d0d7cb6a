//! The run's configuration and its access objects: the ConfigMap with the run config, the
//! Secret with the internal token (and, on an EnginePool, the run's credential for it), and the ServiceAccount and Role its pods use (limited to this
//! run). The NetworkPolicies are in `network.rs`.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{ConfigMap, Secret, ServiceAccount};
use k8s_openapi::api::rbac::v1::{PolicyRule, Role, RoleBinding, RoleRef, Subject};
use k8s_openapi::ByteString;

use super::{Ctx, InvalidSpec, AGENT_TOKEN_KEY, TOKEN_KEY};
use crate::api::GROUP;

/// File name of the run config inside the ConfigMap (mounted at `/etc/moult`).
pub const CONFIG_FILE: &str = "rlrun.yaml";

/// The run config: the RLRun manifest itself (name, namespace, spec), which is what
/// `moult run` reads locally too.
pub(crate) fn config_map(ctx: &Ctx) -> Result<ConfigMap, InvalidSpec> {
    let manifest = serde_json::json!({
        "apiVersion": format!("{GROUP}/v1alpha1"),
        "kind": "RLRun",
        "metadata": {"name": ctx.name, "namespace": ctx.namespace},
        "spec": ctx.run.spec,
    });
    let yaml = serde_yaml_ng::to_string(&manifest)
        .map_err(|e| InvalidSpec(format!("the spec cannot be written as YAML: {e}")))?;
    Ok(ConfigMap {
        metadata: ctx.meta("config", None),
        data: Some(BTreeMap::from([(CONFIG_FILE.to_string(), yaml)])),
        ..ConfigMap::default()
    })
}

/// The token every internal endpoint of the run requires, and the agent credential derived from
/// it (which opens only what agents need, docs/security.md).
pub(crate) fn token_secret(ctx: &Ctx, token: &str) -> Secret {
    let agent = crate::credentials::agent_credential(token);
    let mut data = BTreeMap::from([
        (TOKEN_KEY.to_string(), ByteString(token.as_bytes().to_vec())),
        (AGENT_TOKEN_KEY.to_string(), ByteString(agent.into_bytes())),
    ]);
    if let Some(pool) = ctx.pool {
        // The run's credential for its EnginePool's engines (never the pool token itself).
        data.insert(
            super::POOL_CREDENTIAL_KEY.to_string(),
            ByteString(pool.credential.clone().into_bytes()),
        );
    }
    Secret {
        metadata: ctx.meta("token", None),
        type_: Some("Opaque".into()),
        data: Some(data),
        ..Secret::default()
    }
}

pub(crate) fn service_account(ctx: &Ctx) -> ServiceAccount {
    account(ctx, "moult", true)
}

/// The ServiceAccount `<run>-<suffix>`; `automount`: whether pods mount its token by default.
pub(crate) fn account(ctx: &Ctx, suffix: &str, automount: bool) -> ServiceAccount {
    ServiceAccount {
        metadata: ctx.meta(suffix, None),
        automount_service_account_token: Some(automount),
        ..ServiceAccount::default()
    }
}

/// What the run's pods may do: read their own RLRun and write its status (the coordinator
/// reports step, version and metrics), and find the engine endpoints and check they are the run's
/// (or, on an EnginePool, read the pool and check they are its).
pub(crate) fn role(ctx: &Ctx) -> Role {
    let own = Some(vec![ctx.name.clone()]);
    Role {
        metadata: ctx.meta("moult", None),
        rules: Some(
            vec![
                PolicyRule {
                    api_groups: Some(vec![GROUP.into()]),
                    resources: Some(vec!["rlruns".into()]),
                    resource_names: own.clone(),
                    verbs: vec!["get".into(), "watch".into()],
                    ..PolicyRule::default()
                },
                PolicyRule {
                    api_groups: Some(vec![GROUP.into()]),
                    resources: Some(vec!["rlruns/status".into()]),
                    resource_names: own,
                    verbs: vec!["get".into(), "patch".into()],
                    ..PolicyRule::default()
                },
                // Engine discovery trusts a slice only if the run's engine Service controls it, and
                // an address only of a pod that the run's StatefulSet controls (docs/security.md).
                PolicyRule {
                    api_groups: Some(vec!["discovery.k8s.io".into()]),
                    resources: Some(vec!["endpointslices".into()]),
                    verbs: vec!["get".into(), "list".into(), "watch".into()],
                    ..PolicyRule::default()
                },
                PolicyRule {
                    api_groups: Some(vec![String::new()]),
                    resources: Some(vec!["pods".into()]),
                    verbs: vec!["get".into(), "list".into(), "watch".into()],
                    ..PolicyRule::default()
                },
                PolicyRule {
                    api_groups: Some(vec![String::new()]),
                    resources: Some(vec!["services".into()]),
                    verbs: vec!["get".into()],
                    ..PolicyRule::default()
                },
                PolicyRule {
                    api_groups: Some(vec!["apps".into()]),
                    resources: Some(vec!["statefulsets".into()]),
                    verbs: vec!["get".into()],
                    ..PolicyRule::default()
                },
            ]
            .into_iter()
            // A run on an EnginePool reads its pool: engine discovery checks that the engines are
            // the pool's (its UID), as it checks a run's own are the run's.
            .chain(ctx.pool.map(|pool| PolicyRule {
                api_groups: Some(vec![GROUP.into()]),
                resources: Some(vec!["enginepools".into()]),
                resource_names: Some(vec![pool.name.clone()]),
                verbs: vec!["get".into(), "watch".into()],
                ..PolicyRule::default()
            }))
            .collect(),
        ),
    }
}

pub(crate) fn role_binding(ctx: &Ctx) -> RoleBinding {
    binding(ctx, "moult")
}

/// Binds the Role `<run>-<suffix>` to the ServiceAccount of the same name.
pub(crate) fn binding(ctx: &Ctx, suffix: &str) -> RoleBinding {
    let name = super::name(&ctx.name, suffix);
    RoleBinding {
        metadata: ctx.meta(suffix, None),
        role_ref: RoleRef {
            api_group: Some("rbac.authorization.k8s.io".into()),
            kind: "Role".into(),
            name: name.clone(),
        },
        subjects: Some(vec![Subject {
            kind: "ServiceAccount".into(),
            name,
            namespace: Some(ctx.namespace.clone()),
            ..Subject::default()
        }]),
    }
}
