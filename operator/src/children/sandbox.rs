//! Sandbox pods for model-written code, one per episode, from kubernetes-sigs/agent-sandbox
//! (`spec.agent.sandbox`, docs/security.md#sandbox-pods): the run's `SandboxTemplate` and
//! `SandboxWarmPool`, and what its agent pods need to claim them (a ServiceAccount of their own,
//! whose Role allows claims and nothing else).

use k8s_openapi::api::core::v1::{
    ConfigMapProjection, DownwardAPIProjection, DownwardAPIVolumeFile, ObjectFieldSelector,
};
use k8s_openapi::api::core::v1::{
    KeyToPath, PodSpec, ProjectedVolumeSource, ServiceAccount, ServiceAccountTokenProjection,
    Volume, VolumeProjection,
};
use k8s_openapi::api::rbac::v1::{PolicyRule, Role, RoleBinding};
use serde_json::{json, Value as Json};
use sha2::{Digest, Sha256};

use super::pods::{container, empty_dir, env, locked_down, mount, template, MOULT_BIN_SIZE};
use super::workloads::{install_moult, MOULT_BIN_DIR};
use super::{name, Ctx};
use crate::api::{AgentSandboxSpec, Isolation};

// What the operator and the runtime's sandbox pods (`sandbox-pods/`) agree on.
/// The port sandbox pods serve `moult.sandbox.run` calls on.
pub const SANDBOX_PORT: i32 = 7070;
/// agent-sandbox's API groups (`Sandbox`; the extensions) and their version.
pub const CORE_GROUP: &str = "agents.x-k8s.io";
pub const EXTENSIONS_GROUP: &str = "extensions.agents.x-k8s.io";
pub const VERSION: &str = "v1beta1";
const EXTENSIONS_API: &str = "extensions.agents.x-k8s.io/v1beta1";
/// The variables of an agent pod whose run has sandbox pods: the warm pool's (and template's)
/// name, and the pod's name and UID (the owner of its claims).
pub const POOL_ENV: &str = "MOULT_SANDBOX_POOL";
pub const POD_NAME_ENV: &str = "MOULT_POD_NAME";
pub const POD_UID_ENV: &str = "MOULT_POD_UID";
/// The variable that gives a sandbox pod the SHA-256 (hex) of the key its callers present.
pub const VERIFIER_ENV: &str = "MOULT_SANDBOX_VERIFIER";
/// Where a pod's ServiceAccount token is mounted (what Kubernetes clients read in a pod).
const TOKEN_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

/// What `spec.agent.sandbox` adds to the run whose token is `token`.
pub(crate) fn children(ctx: &Ctx, token: &str) -> Option<super::SandboxChildren> {
    let spec = ctx.run.spec.agent.sandbox.as_ref()?;
    let agent_credential = crate::credentials::agent_credential(token);
    let (account, role, role_binding) = agents_access(ctx);
    Some(super::SandboxChildren {
        template: sandbox_template(ctx, spec, &agent_credential),
        warm_pool: warm_pool(ctx, spec),
        account,
        role,
        role_binding,
    })
}

/// The name of the run's SandboxTemplate and SandboxWarmPool, and of its agents' ServiceAccount.
pub(crate) fn sandbox_name(ctx: &Ctx) -> String {
    name(&ctx.name, "sandbox")
}

pub(crate) fn agents_account(ctx: &Ctx) -> String {
    name(&ctx.name, "agents")
}

/// The hex SHA-256 of the agent credential: sandbox pods check callers against it and so hold
/// no credential themselves.
pub fn verifier(agent_credential: &str) -> String {
    Sha256::digest(agent_credential.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The run's SandboxTemplate: pods that run `moult sandbox --serve` in the sandbox image (the
/// init container copies `moult` in, as into agent pods), reachable from the run's agent pods
/// alone and reaching nothing.
pub(crate) fn sandbox_template(ctx: &Ctx, s: &AgentSandboxSpec, agent_credential: &str) -> Json {
    let a = &ctx.run.spec.agent;
    let image = (s.image.clone().or_else(|| a.image.clone()))
        .unwrap_or_else(|| ctx.config.images.runtime.clone());
    let moult = format!("{MOULT_BIN_DIR}/moult");
    let isolation = match a.isolation {
        Isolation::Episode => "episode",
        Isolation::Process => "process",
    };
    let serve = format!("0.0.0.0:{SANDBOX_PORT}");
    let args = [
        "sandbox",
        "--serve",
        &serve,
        "--workspace",
        "/tmp/workspace",
    ];
    let args = (args.iter().map(|s| s.to_string()))
        .chain(["--isolation".into(), isolation.into()])
        .collect();
    let mut c = container("sandbox", &image, vec![moult.clone()], args);
    c.security_context = Some(locked_down(a.read_only_root_filesystem));
    c.env = Some(vec![
        env("HOME", "/tmp"),
        env(VERIFIER_ENV, &verifier(agent_credential)),
    ]);
    c.resources = s.resources.clone();
    c.volume_mounts = Some(vec![
        mount("tmp", "/tmp", false),
        mount("moult-bin", MOULT_BIN_DIR, true),
    ]);
    let pod = PodSpec {
        init_containers: Some(vec![install_moult(ctx, &moult)]),
        containers: vec![c],
        volumes: Some(vec![empty_dir("moult-bin", None, MOULT_BIN_SIZE)]),
        runtime_class_name: a.runtime_class_name.clone(),
        ..PodSpec::default()
    };
    let pod = template(ctx, "sandbox", false, pod);
    json!({
        "apiVersion": EXTENSIONS_API,
        "kind": "SandboxTemplate",
        "metadata": ctx.meta("sandbox", None),
        "spec": {
            "podTemplate": {
                "metadata": {
                    "labels": pod.metadata.as_ref().and_then(|m| m.labels.clone()),
                    "annotations": pod.metadata.as_ref().and_then(|m| m.annotations.clone()),
                },
                "spec": pod.spec,
            },
            "networkPolicyManagement": "Managed",
            "networkPolicy": {
                "ingress": [{
                    "from": [super::network::pods(ctx, "agents")],
                    "ports": [{"port": SANDBOX_PORT, "protocol": "TCP"}],
                }],
                // No egress at all: model-written code reaches nothing.
                "egress": [],
            },
        },
    })
}

/// The run's SandboxWarmPool: `spec.agent.sandbox.warmPool` pods (default: one per episode the
/// run runs at once), none while suspended.
pub(crate) fn warm_pool(ctx: &Ctx, s: &AgentSandboxSpec) -> Json {
    let a = &ctx.run.spec.agent;
    let wanted = s
        .warm_pool
        .unwrap_or(a.replicas.saturating_mul(a.concurrency as i32));
    json!({
        "apiVersion": EXTENSIONS_API,
        "kind": "SandboxWarmPool",
        "metadata": ctx.meta("sandbox", None),
        "spec": {
            "replicas": ctx.replicas(wanted),
            "sandboxTemplateRef": {"name": sandbox_name(ctx)},
        },
    })
}

/// The agent pods' own ServiceAccount, Role and RoleBinding: claims of the run's warm pool and
/// sandboxes of its template, nothing else of the API.
pub(crate) fn agents_access(ctx: &Ctx) -> (ServiceAccount, Role, RoleBinding) {
    let rule = |group: &str, resources: &[&str], verbs: &[&str]| PolicyRule {
        api_groups: Some(vec![group.into()]),
        resources: Some(resources.iter().map(|r| r.to_string()).collect()),
        verbs: verbs.iter().map(|v| v.to_string()).collect(),
        ..PolicyRule::default()
    };
    let claims = ["create", "get", "list", "delete", "deletecollection"];
    let mut template = rule(EXTENSIONS_GROUP, &["sandboxtemplates"], &["get"]);
    template.resource_names = Some(vec![sandbox_name(ctx)]);
    let role = Role {
        metadata: ctx.meta("agents", None),
        rules: Some(vec![
            rule(EXTENSIONS_GROUP, &["sandboxclaims"], &claims),
            rule(CORE_GROUP, &["sandboxes"], &claims),
            template,
        ]),
    };
    let binding = super::access::binding(ctx, "agents");
    let account = super::access::account(ctx, "agents", false);
    (account, role, binding)
}

/// Gives an agent pod's `agent` container (its first; never its `sandbox` container, where agent
/// code runs) the credential of the agents' ServiceAccount and the variables of its claims.
pub(crate) fn claim_from(ctx: &Ctx, pod: &mut PodSpec) {
    pod.service_account_name = Some(agents_account(ctx));
    pod.automount_service_account_token = Some(false);
    let field = |path: &str| DownwardAPIVolumeFile {
        path: path.rsplit('.').next().unwrap_or(path).into(),
        field_ref: Some(ObjectFieldSelector {
            field_path: path.into(),
            ..ObjectFieldSelector::default()
        }),
        ..DownwardAPIVolumeFile::default()
    };
    let token = Volume {
        name: "api-credential".into(),
        projected: Some(ProjectedVolumeSource {
            sources: Some(vec![
                VolumeProjection {
                    service_account_token: Some(ServiceAccountTokenProjection {
                        path: "token".into(),
                        expiration_seconds: Some(3600),
                        ..ServiceAccountTokenProjection::default()
                    }),
                    ..VolumeProjection::default()
                },
                VolumeProjection {
                    config_map: Some(ConfigMapProjection {
                        name: "kube-root-ca.crt".into(),
                        items: Some(vec![KeyToPath {
                            key: "ca.crt".into(),
                            path: "ca.crt".into(),
                            ..KeyToPath::default()
                        }]),
                        ..ConfigMapProjection::default()
                    }),
                    ..VolumeProjection::default()
                },
                VolumeProjection {
                    downward_api: Some(DownwardAPIProjection {
                        items: Some(vec![field("metadata.namespace")]),
                    }),
                    ..VolumeProjection::default()
                },
            ]),
            ..ProjectedVolumeSource::default()
        }),
        ..Volume::default()
    };
    pod.volumes.get_or_insert_with(Vec::new).push(token);
    let agent = &mut pod.containers[0];
    (agent.volume_mounts.get_or_insert_with(Vec::new)).push(mount(
        "api-credential",
        TOKEN_DIR,
        true,
    ));
    (agent.env.get_or_insert_with(Vec::new)).extend([
        env(POOL_ENV, &sandbox_name(ctx)),
        super::pods::field_env(POD_NAME_ENV, "metadata.name"),
        super::pods::field_env(POD_UID_ENV, "metadata.uid"),
    ]);
}
