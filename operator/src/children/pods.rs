//! What every pod of a run shares: locked-down security contexts (non-root, no capabilities, no
//! privilege escalation, RuntimeDefault seccomp, a read-only root filesystem with size-limited
//! writable emptyDirs), the run config and token, GPU requests, and placement from
//! `spec.scheduling` (docs/security.md, "Pods").

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Capabilities, ConfigMapVolumeSource, Container, EmptyDirVolumeSource, EnvVar, EnvVarSource,
    ObjectFieldSelector, PersistentVolumeClaimVolumeSource, PodSecurityContext, PodSpec,
    PodTemplateSpec, ResourceRequirements, SeccompProfile, SecretKeySelector, SecurityContext,
    Toleration, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use super::access::CONFIG_FILE;
use super::{
    name, service_account_name, Ctx, AGENT_TOKEN_KEY, CONFIG_HASH_ANNOTATION, ON_POOL_LABEL,
    RUN_UID_LABEL, TOKEN_KEY,
};
use crate::api::{SchedulingSpec, WeightTransport};

/// Extended resource of NVIDIA's device plugin.
pub const GPU_RESOURCE: &str = "nvidia.com/gpu";
/// Unprivileged user every container runs as.
const RUN_AS: i64 = 1000;
pub const CONFIG_DIR: &str = "/etc/moult";
pub const MODEL_DIR: &str = "/models";
pub const DATA_DIR: &str = "/data";
/// Where `eval.dataset`'s claim is mounted when it is not `agent.dataset`'s.
pub const EVAL_DATA_DIR: &str = "/eval-data";
pub const CHECKPOINT_DIR: &str = "/checkpoints";
/// Where the Filesystem weight transport's volume is mounted (trainer and engines alike: the
/// trainer names folders by this path when it tells the engines to reload).
pub const WEIGHTS_DIR: &str = "/weights";
pub const TEACHER_DIR: &str = "/teacher";
/// Where `judge.claimName` is mounted (when it is not `model.claimName`).
pub const JUDGE_DIR: &str = "/judge";

/// Size limits of the writable emptyDirs (the kubelet evicts a pod that writes more). `/tmp` is
/// also `$HOME` and every cache (vLLM's torch.compile and Triton caches, Hugging Face downloads
/// when the model is not on a claim); a component's `resources.limits.ephemeral-storage`, when
/// set, replaces its default here.
pub const TMP_SIZE: [(&str, &str); 4] = [
    ("engine", "64Gi"),
    ("trainer", "16Gi"),
    ("coordinator", "1Gi"),
    ("agents", "8Gi"),
];
/// The CPU and memory limits of each container of a run, by container name, unless its
/// component's `resources.limits` sets them (docs/operator.md, "Resources"). Generous (limits
/// do not count for scheduling): they bound a runaway, so that no part of a run can take its
/// node's memory or CPU. A container's ephemeral-storage limit is its pod's `/tmp` size
/// ([`TMP_SIZE`]), 1Gi for the agents pod's `agent` and `install-moult` (agent code writes to
/// `/tmp` from `sandbox`) and for a vLLM pod's `engine-front`, which writes nothing.
pub const DEFAULT_LIMITS: [(&str, &str, &str); 7] = [
    ("engine", "16", "128Gi"),
    ("engine-front", "2", "1Gi"),
    ("trainer", "32", "256Gi"),
    ("coordinator", "4", "8Gi"),
    ("agent", "2", "4Gi"),
    ("sandbox", "4", "8Gi"),
    ("install-moult", "1", "256Mi"),
];

/// `c` with a CPU, memory and ephemeral-storage limit each: its own, else its
/// [`DEFAULT_LIMITS`] (raised to its request where that is larger: a limit is never below its
/// request).
fn bounded(c: &mut Container, tmp: &str) {
    let (cpu, memory) = (DEFAULT_LIMITS.iter())
        .find(|(name, ..)| *name == c.name)
        .map_or(("1", "1Gi"), |(_, cpu, memory)| (*cpu, *memory));
    let storage = match c.name.as_str() {
        "agent" | "install-moult" | "engine-front" => "1Gi",
        _ => tmp,
    };
    let r = c
        .resources
        .get_or_insert_with(ResourceRequirements::default);
    let requests = r.requests.get_or_insert_with(BTreeMap::new);
    let limits = r.limits.get_or_insert_with(BTreeMap::new);
    for (key, default) in [
        ("cpu", cpu),
        ("memory", memory),
        ("ephemeral-storage", storage),
    ] {
        let limit = match requests.get(key) {
            Some(request) if quantity(&request.0) > quantity(default) => request.0.clone(),
            _ => default.to_string(),
        };
        // A limit without a request would become the request too (the API server copies it),
        // and the pod would ask the scheduler for the whole default: an unset request is 0.
        if !limits.contains_key(key) {
            requests
                .entry(key.to_string())
                .or_insert(Quantity("0".into()));
        }
        limits.entry(key.to_string()).or_insert(Quantity(limit));
    }
}

/// The value of a Kubernetes quantity (`500m`, `4`, `16Gi`, `1e3`), to compare two; `None` when
/// it is not one (the CRD refuses those).
pub fn quantity(q: &str) -> Option<f64> {
    const SUFFIXES: [(&str, f64); 14] = [
        ("Ki", 1024.0),
        ("Mi", 1048576.0),
        ("Gi", 1073741824.0),
        ("Ti", 1099511627776.0),
        ("Pi", 1125899906842624.0),
        ("Ei", 1152921504606846976.0),
        ("n", 1e-9),
        ("u", 1e-6),
        ("m", 1e-3),
        ("k", 1e3),
        ("M", 1e6),
        ("G", 1e9),
        ("T", 1e12),
        ("P", 1e15),
    ];
    let q = q.trim();
    let (number, scale) = (SUFFIXES.iter())
        .find_map(|(suffix, scale)| Some((q.strip_suffix(suffix)?, *scale)))
        .unwrap_or((q, 1.0));
    // `E` is exa as a suffix, an exponent inside a number (`1e3`, `2E6`).
    let (number, scale) = match number.strip_suffix('E') {
        Some(n) if !n.is_empty() => (n, 1e18),
        _ => (number, scale),
    };
    number
        .parse::<f64>()
        .ok()
        .filter(|v| v.is_finite())
        .map(|v| v * scale)
}

/// `/dev/shm` of engines and trainer (memory-backed: it counts against the memory limit).
pub const SHM_SIZE: &str = "16Gi";
/// The agent pods' copy of the `moult` binary.
pub const MOULT_BIN_SIZE: &str = "512Mi";

/// Where the run config file is inside every pod.
pub fn config_path() -> String {
    format!("{CONFIG_DIR}/{CONFIG_FILE}")
}

/// A pod template for `component`: labels, config hash, service account, security context,
/// the config and token, placement. `gpu` pods get the GPU node selector and toleration.
pub(crate) fn template(ctx: &Ctx, component: &str, gpu: bool, spec: PodSpec) -> PodTemplateSpec {
    let mut labels = ctx.labels(Some(component));
    labels.insert(RUN_UID_LABEL.into(), ctx.owner.uid.clone());
    if let Some(pool) = ctx
        .pool
        .filter(|_| matches!(component, "coordinator" | "trainer"))
    {
        // The pool's NetworkPolicy admits the pods of its runs that talk to its engines.
        labels.insert(ON_POOL_LABEL.into(), pool.name.clone());
    }
    let owner = PodOwner {
        labels,
        config_hash: &ctx.config_hash,
        service_account: Some(service_account_name(&ctx.name)),
        config_map: Some(name(&ctx.name, "config")),
        scheduling: &ctx.run.spec.scheduling,
    };
    pod_template(owner, component, gpu, &tmp_size(ctx, component), spec)
}

/// What a pod template takes from the object that owns its pods (a run, an EnginePool).
pub(crate) struct PodOwner<'a> {
    /// The pods' labels.
    pub labels: BTreeMap<String, String>,
    /// Hash of the owner's spec without replica counts: pods restart when it changes.
    pub config_hash: &'a str,
    /// The pods' ServiceAccount; the namespace's default (its token never mounted) when `None`.
    pub service_account: Option<String>,
    /// The ConfigMap mounted as the `config` volume, if the pods have one.
    pub config_map: Option<String>,
    pub scheduling: &'a SchedulingSpec,
}

/// A pod template for `component` of `owner`, with a `/tmp` of `tmp`: every container
/// [`bounded`], locked down, placed by `owner.scheduling`; `gpu` pods get the GPU node selector
/// and toleration.
pub(crate) fn pod_template(
    owner: PodOwner,
    component: &str,
    gpu: bool,
    tmp: &str,
    mut spec: PodSpec,
) -> PodTemplateSpec {
    let init = spec.init_containers.iter_mut().flatten();
    for c in spec.containers.iter_mut().chain(init) {
        bounded(c, tmp);
    }
    let scheduling = owner.scheduling;
    let mut tolerations = scheduling.tolerations.clone();
    if gpu
        && !tolerations
            .iter()
            .any(|t| t.key.as_deref() == Some(GPU_RESOURCE))
    {
        // Managed GPU pools taint their nodes with the resource name.
        tolerations.push(Toleration {
            key: Some(GPU_RESOURCE.into()),
            operator: Some("Exists".into()),
            effect: Some("NoSchedule".into()),
            ..Toleration::default()
        });
    }
    let mut volumes = spec.volumes.unwrap_or_default();
    if let Some(config_map) = owner.config_map {
        volumes.push(Volume {
            name: "config".into(),
            config_map: Some(ConfigMapVolumeSource {
                name: config_map,
                ..Default::default()
            }),
            ..Volume::default()
        });
    }
    volumes.push(empty_dir("tmp", None, tmp));
    PodTemplateSpec {
        metadata: Some(ObjectMeta {
            labels: Some(owner.labels),
            annotations: Some(BTreeMap::from([(
                CONFIG_HASH_ANNOTATION.to_string(),
                owner.config_hash.to_string(),
            )])),
            ..ObjectMeta::default()
        }),
        spec: Some(PodSpec {
            service_account_name: owner.service_account,
            // Only the coordinator calls the API server (engine discovery, status); no other
            // pod, and above all no agent pod, holds an API credential.
            automount_service_account_token: Some(component == "coordinator"),
            security_context: Some(PodSecurityContext {
                run_as_non_root: Some(true),
                run_as_user: Some(RUN_AS),
                run_as_group: Some(RUN_AS),
                fs_group: Some(RUN_AS),
                seccomp_profile: Some(SeccompProfile {
                    type_: "RuntimeDefault".into(),
                    ..Default::default()
                }),
                ..PodSecurityContext::default()
            }),
            node_selector: (gpu && !scheduling.node_selector.is_empty())
                .then(|| scheduling.node_selector.clone()),
            tolerations: (!tolerations.is_empty()).then_some(tolerations),
            priority_class_name: scheduling.priority_class_name.clone(),
            volumes: Some(volumes),
            ..spec
        }),
    }
}

/// How every container's termination message is made: the tail of its log when it wrote no
/// message file, so that a crash's last words (moult prints its fatal error last) reach the
/// pod's status and from there the run's conditions (docs/operator.md, "Why is my run stuck").
pub const TERMINATION_MESSAGE_POLICY: &str = "FallbackToLogsOnError";

/// A container with the run's config, token and a writable `/tmp`, locked down with a read-only
/// root filesystem.
pub(crate) fn container(
    name: &str,
    image: &str,
    command: Vec<String>,
    args: Vec<String>,
) -> Container {
    Container {
        name: name.into(),
        image: Some(image.into()),
        command: (!command.is_empty()).then_some(command),
        args: (!args.is_empty()).then_some(args),
        security_context: Some(locked_down(true)),
        volume_mounts: Some(vec![
            mount("config", CONFIG_DIR, true),
            mount("tmp", "/tmp", false),
        ]),
        termination_message_policy: Some(TERMINATION_MESSAGE_POLICY.into()),
        ..Container::default()
    }
}

/// Which credential a pod holds (docs/security.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Credential {
    /// The run token (`MOULT_TOKEN`): coordinator, trainer, engines.
    Run,
    /// The agent credential alone (`MOULT_AGENT_TOKEN`): agent pods, which run untrusted code.
    Agent,
}

/// The environment every moult container gets: where the config is and its credential.
pub(crate) fn moult_env(ctx: &Ctx, credential: Credential) -> Vec<EnvVar> {
    let (variable, key) = match credential {
        Credential::Run => ("MOULT_TOKEN", TOKEN_KEY),
        Credential::Agent => ("MOULT_AGENT_TOKEN", AGENT_TOKEN_KEY),
    };
    vec![
        env("MOULT_CONFIG", &config_path()),
        env("HOME", "/tmp"),
        secret_env(variable, &name(&ctx.name, "token"), key),
    ]
}

/// The variable `variable` set from key `key` of the Secret `secret` (which must hold it).
pub(crate) fn secret_env(variable: &str, secret: &str, key: &str) -> EnvVar {
    EnvVar {
        name: variable.into(),
        value_from: Some(EnvVarSource {
            secret_key_ref: Some(SecretKeySelector {
                name: secret.into(),
                key: key.into(),
                optional: Some(false),
            }),
            ..EnvVarSource::default()
        }),
        ..EnvVar::default()
    }
}

/// The security context of every container: non-root, no capabilities, no privilege
/// escalation, RuntimeDefault seccomp, and (unless the agent's spec says otherwise) a read-only
/// root filesystem.
pub(crate) fn locked_down(read_only_root: bool) -> SecurityContext {
    SecurityContext {
        allow_privilege_escalation: Some(false),
        read_only_root_filesystem: Some(read_only_root),
        run_as_non_root: Some(true),
        capabilities: Some(Capabilities {
            drop: Some(vec!["ALL".into()]),
            ..Capabilities::default()
        }),
        seccomp_profile: Some(SeccompProfile {
            type_: "RuntimeDefault".into(),
            ..Default::default()
        }),
        ..SecurityContext::default()
    }
}

/// The size limit of `component`'s `/tmp`: its `resources.limits.ephemeral-storage`, else
/// [`TMP_SIZE`].
fn tmp_size(ctx: &Ctx, component: &str) -> String {
    let spec = &ctx.run.spec;
    let resources = match component {
        "engine" => spec.engines.resources.as_ref(),
        "trainer" => spec.trainer.resources.as_ref(),
        "agents" => spec.agent.resources.as_ref(),
        "coordinator" => spec.coordinator.resources.as_ref(),
        _ => None,
    };
    tmp_size_of(resources, component)
}

/// The size limit of a `/tmp` of `component` whose resources are `resources`.
pub(crate) fn tmp_size_of(resources: Option<&ResourceRequirements>, component: &str) -> String {
    resources
        .and_then(|r| r.limits.as_ref())
        .and_then(|l| l.get("ephemeral-storage"))
        .map(|q| q.0.clone())
        .or_else(|| {
            TMP_SIZE
                .iter()
                .find(|(c, _)| *c == component)
                .map(|(_, size)| size.to_string())
        })
        .unwrap_or_else(|| "1Gi".into())
}

/// The user's resources with `gpus` GPUs added as a limit (extended resources are requested
/// through limits; the API server copies them to requests).
pub(crate) fn resources(
    user: Option<&ResourceRequirements>,
    gpus: u32,
) -> Option<ResourceRequirements> {
    let mut r = user.cloned().unwrap_or_default();
    if gpus > 0 {
        r.limits
            .get_or_insert_with(BTreeMap::new)
            .insert(GPU_RESOURCE.into(), Quantity(gpus.to_string()));
        if let Some(requests) = r.requests.as_mut() {
            requests.insert(GPU_RESOURCE.into(), Quantity(gpus.to_string()));
        }
    }
    (r != ResourceRequirements::default()).then_some(r)
}

pub(crate) fn env(name: &str, value: &str) -> EnvVar {
    EnvVar {
        name: name.into(),
        value: Some(value.into()),
        ..EnvVar::default()
    }
}

pub(crate) fn mount(name: &str, path: &str, read_only: bool) -> VolumeMount {
    VolumeMount {
        name: name.into(),
        mount_path: path.into(),
        read_only: read_only.then_some(true),
        ..VolumeMount::default()
    }
}

/// An emptyDir (in memory when `medium` is `Memory`) of at most `size`.
pub(crate) fn empty_dir(name: &str, medium: Option<&str>, size: &str) -> Volume {
    Volume {
        name: name.into(),
        empty_dir: Some(EmptyDirVolumeSource {
            medium: medium.map(Into::into),
            size_limit: Some(Quantity(size.into())),
            ..Default::default()
        }),
        ..Volume::default()
    }
}

pub(crate) fn claim(name: &str, claim_name: &str, read_only: bool) -> Volume {
    Volume {
        name: name.into(),
        persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
            claim_name: claim_name.into(),
            read_only: read_only.then_some(true),
        }),
        ..Volume::default()
    }
}

/// An environment variable from a field of the pod (`status.podIP`, ...).
pub(crate) fn field_env(name: &str, field_path: &str) -> EnvVar {
    EnvVar {
        name: name.into(),
        value_from: Some(EnvVarSource {
            field_ref: Some(ObjectFieldSelector {
                field_path: field_path.into(),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..EnvVar::default()
    }
}

/// The dataset volume and mount (read-only), and the task file's path inside the pod.
pub(crate) fn dataset(ctx: &Ctx) -> (Option<(Volume, VolumeMount)>, String) {
    let d = &ctx.run.spec.agent.dataset;
    claimed(d.claim_name.as_deref(), &d.path, "data", DATA_DIR)
}

/// The held-out tasks of `spec.eval`: their volume and mount when they need one of their own
/// (a claim other than `agent.dataset`'s, which [`dataset`] mounts), and their path inside the
/// pod.
pub(crate) fn eval_dataset(ctx: &Ctx) -> Option<(Option<(Volume, VolumeMount)>, String)> {
    let d = &ctx.run.spec.eval.as_ref()?.dataset;
    let data = ctx.run.spec.agent.dataset.claim_name.as_deref();
    Some(claimed_or_shared(
        d.claim_name.as_deref(),
        &d.path,
        data.map(|c| (c, DATA_DIR)),
        ("eval-data", EVAL_DATA_DIR),
    ))
}

/// A file on claim `claim_name` in a pod that mounts `mounted` (a claim, and where): under that
/// mount when it is the same claim (no volume of its own), else on its own volume `(name, dir)`.
fn claimed_or_shared(
    claim_name: Option<&str>,
    path: &str,
    mounted: Option<(&str, &str)>,
    (volume, dir): (&str, &str),
) -> (Option<(Volume, VolumeMount)>, String) {
    match mounted {
        Some((claim, at)) if claim_name == Some(claim) => {
            (None, format!("{at}/{}", path.trim_start_matches('/')))
        }
        _ => claimed(claim_name, path, volume, dir),
    }
}

/// A file or folder `path` on claim `claim_name`: the claim's volume `volume` mounted read-only
/// at `dir`, and the path there; or `path` as it is, without a claim.
fn claimed(
    claim_name: Option<&str>,
    path: &str,
    volume: &str,
    dir: &str,
) -> (Option<(Volume, VolumeMount)>, String) {
    match claim_name {
        Some(c) => (
            Some((claim(volume, c, true), mount(volume, dir, true))),
            format!("{dir}/{}", path.trim_start_matches('/')),
        ),
        None => (None, path.to_string()),
    }
}

/// The teacher's volume and mount (on-policy distillation), and its path inside the pod.
pub(crate) fn teacher(ctx: &Ctx) -> Option<(Option<(Volume, VolumeMount)>, String)> {
    let t = ctx.run.spec.algorithm.teacher.as_ref()?;
    Some(claimed(
        t.claim_name.as_deref(),
        &t.path,
        "teacher",
        TEACHER_DIR,
    ))
}

/// The replicas of a served distillation teacher (`algorithm.teacher.replicas` with estimator
/// `OnPolicyDistillation`); `None`: no teacher, or the trainer loads it.
pub(crate) fn served_teacher(ctx: &Ctx) -> Option<i32> {
    served_teacher_replicas(&ctx.run.spec)
}

/// [`served_teacher`] of a spec.
pub(crate) fn served_teacher_replicas(spec: &crate::api::RLRunSpec) -> Option<i32> {
    let algo = &spec.algorithm;
    if algo.estimator != crate::api::Estimator::OnPolicyDistillation {
        return None;
    }
    algo.teacher.as_ref()?.replicas
}

/// The judge model's volume and mount, and its path inside the pod: at [`JUDGE_DIR`], or at
/// [`MODEL_DIR`] with no volume of its own in a pod that mounts the policy's model claim
/// (`with_model`) when the judge is on that claim.
pub(crate) fn judge_model(
    ctx: &Ctx,
    with_model: bool,
) -> Option<(Option<(Volume, VolumeMount)>, String)> {
    let j = ctx.run.spec.judge.as_ref()?;
    let model = ctx
        .run
        .spec
        .model
        .claim_name
        .as_deref()
        .filter(|_| with_model);
    Some(claimed_or_shared(
        j.claim_name.as_deref(),
        &j.path,
        model.map(|c| (c, MODEL_DIR)),
        ("judge", JUDGE_DIR),
    ))
}

/// The model volume and mount, and the model path inside the pod.
/// The Filesystem weight transport's ReadWriteMany claim, mounted at [`WEIGHTS_DIR`]: read-only
/// in engines, writable in the trainer.
pub(crate) fn weights(ctx: &Ctx, read_only: bool) -> Option<(Volume, VolumeMount)> {
    let w = ctx.run.spec.engines.weight_transfer.as_ref()?;
    if w.transport != WeightTransport::Filesystem {
        return None;
    }
    let c = w.claim_name.as_ref()?;
    Some((
        claim("weights", c, read_only),
        mount("weights", WEIGHTS_DIR, read_only),
    ))
}

pub(crate) fn model(ctx: &Ctx) -> (Option<(Volume, VolumeMount)>, String) {
    model_of(&ctx.run.spec.model)
}

/// [`model`] of a model spec (a run's, an EnginePool's).
pub(crate) fn model_of(m: &crate::api::ModelSpec) -> (Option<(Volume, VolumeMount)>, String) {
    claimed(m.claim_name.as_deref(), &m.path, "model", MODEL_DIR)
}
