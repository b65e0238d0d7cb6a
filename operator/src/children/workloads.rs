//! The run's workloads and their Services: engines (StatefulSet), trainer (StatefulSet with a
//! headless Service for rendezvous), coordinator (Deployment + Service) and the agent pool
//! (Deployment of the user's image with `moult` injected by an init container).

use k8s_openapi::api::apps::v1::{
    Deployment, DeploymentSpec, DeploymentStrategy, StatefulSet, StatefulSetSpec,
};
use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Container, ContainerPort, HTTPGetAction, PodSpec, Probe, ResourceRequirements, Service,
    ServicePort, ServiceSpec, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use super::pods::{
    claim, config_path, container, dataset, empty_dir, env, eval_dataset, field_env, judge_model,
    locked_down, model, moult_env, mount, resources, served_teacher, teacher, template, weights,
    Credential, CHECKPOINT_DIR, MOULT_BIN_SIZE, SHM_SIZE, TERMINATION_MESSAGE_POLICY, WEIGHTS_DIR,
};
use super::{
    name, Config, Ctx, COORDINATOR_PORT, ENGINE_PORT, METRICS_PORT, SANDBOX_ENV, SANDBOX_SOCKET,
    TRAINER_RENDEZVOUS_PORT, WEIGHT_STREAM_PORT,
};
use crate::api::{AgentForm, AgentSpec, EngineBackend, EnginesSpec, RLRunSpec, WeightTransport};

/// Where the init container puts the `moult` binary in agent pods.
pub(crate) const MOULT_BIN_DIR: &str = "/opt/moult/bin";

/// Where vLLM's engine pods keep what they write (all under the `/tmp` emptyDir, their `HOME`):
/// Hugging Face downloads, vLLM's own cache (torch.compile artifacts), Triton's kernels,
/// TorchInductor's cache (which otherwise asks the passwd file for a user name), numba's cache
/// (beside its sources otherwise), and the XDG folders the rest follow.
pub const VLLM_CACHES: [(&str, &str); 7] = [
    ("HF_HOME", "/tmp/hf"),
    ("XDG_CACHE_HOME", "/tmp/.cache"),
    ("XDG_CONFIG_HOME", "/tmp/.config"),
    ("VLLM_CACHE_ROOT", "/tmp/.cache/vllm"),
    ("TRITON_CACHE_DIR", "/tmp/.triton"),
    ("TORCHINDUCTOR_CACHE_DIR", "/tmp/torchinductor"),
    ("NUMBA_CACHE_DIR", "/tmp/numba"),
];

fn selector(ctx: &Ctx, component: &str) -> LabelSelector {
    LabelSelector {
        match_labels: Some(ctx.selector(component)),
        ..LabelSelector::default()
    }
}

fn service(ctx: &Ctx, component: &str, port: i32, headless: bool) -> Service {
    Service {
        metadata: ctx.meta(component, Some(component)),
        spec: Some(ServiceSpec {
            selector: Some(ctx.selector(component)),
            cluster_ip: headless.then(|| "None".to_string()),
            // Trainer ranks resolve each other before they are ready.
            publish_not_ready_addresses: headless.then_some(true),
            ports: Some(vec![ServicePort {
                name: Some("http".into()),
                port,
                target_port: Some(IntOrString::Int(port)),
                protocol: Some("TCP".into()),
                ..ServicePort::default()
            }]),
            ..ServiceSpec::default()
        }),
        ..Service::default()
    }
}

fn http_probe(path: &str, port: i32, period: i32) -> Probe {
    Probe {
        http_get: Some(HTTPGetAction {
            path: Some(path.into()),
            port: IntOrString::Int(port),
            ..Default::default()
        }),
        period_seconds: Some(period),
        ..Probe::default()
    }
}

fn port(name: &str, port: i32) -> ContainerPort {
    ContainerPort {
        name: Some(name.into()),
        container_port: port,
        protocol: Some("TCP".into()),
        ..Default::default()
    }
}

fn container_port(p: i32) -> Option<Vec<ContainerPort>> {
    Some(vec![port("http", p)])
}

/// Engines answer at `<run>-engine-<i>.<run>-engine` (the router finds them through this
/// headless Service's EndpointSlices).
pub(crate) fn engine_service(ctx: &Ctx) -> Service {
    service(ctx, "engine", ENGINE_PORT, true)
}

/// The engine pool: vLLM with the flags moult needs (docs/engine.md), or `moult engine`.
pub(crate) fn engines(ctx: &Ctx) -> StatefulSet {
    let (model_volume, model_path) = model(ctx);
    engine_pool(
        ctx,
        EnginePool {
            role: EngineRole::Policy,
            model: (model_volume, model_path),
            replicas: ctx.run.spec.engines.replicas,
        },
    )
}

/// The judge's Service (its EndpointSlices are how the coordinator finds the judge engines).
pub(crate) fn judge_service(ctx: &Ctx) -> Option<Service> {
    ctx.run.spec.judge.as_ref()?;
    Some(service(ctx, "judge", ENGINE_PORT, true))
}

/// The judge's engines (`spec.judge`): the engine pool's pods on the judge model, which never
/// take weight updates.
pub(crate) fn judge(ctx: &Ctx) -> Option<StatefulSet> {
    let replicas = ctx.run.spec.judge.as_ref()?.replicas;
    let model = judge_model(ctx, false)?;
    Some(engine_pool(
        ctx,
        EnginePool {
            role: EngineRole::Judge,
            model,
            replicas,
        },
    ))
}

/// The served teacher's Service (its EndpointSlices are how the coordinator finds them).
pub(crate) fn teacher_service(ctx: &Ctx) -> Option<Service> {
    served_teacher(ctx)?;
    Some(service(ctx, "teacher", ENGINE_PORT, true))
}

/// The served teacher's engines (`algorithm.teacher.replicas`): the engine pool's pods on the
/// teacher model, which never take weight updates.
pub(crate) fn teacher_engines(ctx: &Ctx) -> Option<StatefulSet> {
    let replicas = served_teacher(ctx)?;
    let model = teacher(ctx)?;
    Some(engine_pool(
        ctx,
        EnginePool {
            role: EngineRole::Teacher,
            model,
            replicas,
        },
    ))
}

/// What an engine pool serves, which decides its flags.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngineRole {
    /// The policy: weight updates from the trainer, routed experts with routing replay.
    Policy,
    /// The judge of `spec.judge`: a fixed model that answers questions.
    Judge,
    /// A served distillation teacher: a fixed model that scores whole segments, so its context
    /// is one token longer than the policy's (`model.maxModelLen + 1`).
    Teacher,
}

impl EngineRole {
    /// The component label and name suffix of its pods.
    pub fn component(self) -> &'static str {
        match self {
            EngineRole::Policy => "engine",
            EngineRole::Judge => "judge",
            EngineRole::Teacher => "teacher",
        }
    }
}

/// What sets an engine pool apart.
struct EnginePool {
    role: EngineRole,
    /// The model's volume and mount, and its path in the pod.
    model: (Option<(Volume, VolumeMount)>, String),
    replicas: i32,
}

/// Engine pods of `engines.backend`, with `engines`' image, resources and flags.
fn engine_pool(ctx: &Ctx, pool: EnginePool) -> StatefulSet {
    let spec = &ctx.run.spec;
    let e = &spec.engines;
    let EnginePool {
        role,
        model: (model_volume, model_path),
        replicas,
    } = pool;
    let component = role.component();
    // The trainer sends weights to the policy's engines only (the weight transport's volume).
    let weight_updates = role == EngineRole::Policy;
    let (mut c, env_vars) = match e.backend {
        EngineBackend::Vllm => {
            // vLLM checks no credential: it listens on the pod's loopback, behind the front.
            let args = vllm_args(
                spec,
                &model_path,
                "127.0.0.1",
                VLLM_LOOPBACK_PORT,
                &ctx.name,
                role,
            );
            let image = e
                .image
                .clone()
                .unwrap_or_else(|| ctx.config.images.vllm.clone());
            // No credential: vLLM needs none, and it runs the model's own code.
            let mut env_vars = vec![
                // Dev mode serves /pause, /resume and the weight-transfer endpoints.
                env("VLLM_SERVER_DEV_MODE", "1"),
                // A LoRA run's adapters are loaded as the run goes (docs/lora.md).
                env("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True"),
                env("HOME", "/tmp"),
            ];
            // The root filesystem is read-only: every cache vLLM and the libraries under it
            // write goes to /tmp (HOME is /tmp too, for those that follow it).
            env_vars.extend(VLLM_CACHES.iter().map(|(k, v)| env(k, v)));
            let command = vec!["vllm".to_string(), "serve".to_string()];
            (container("engine", &image, command, args), env_vars)
        }
        EngineBackend::Builtin => {
            // A LoRA run's engines serve the base with the adapter weight updates write.
            let lora = spec.model.lora.as_ref().filter(|_| weight_updates);
            let flags = lora.map(|l| vec!["--lora".into(), l.adapter().to_string()]);
            let c = builtin_engine(e, ctx.config, model_path, flags.unwrap_or_default());
            (c, moult_env(ctx, Credential::Run))
        }
    };
    c.env = Some(env_vars);
    let front = (e.backend == EngineBackend::Vllm).then(|| engine_front(ctx));
    let volumes = [model_volume, weights(ctx, true).filter(|_| weight_updates)];
    let pod = engine_pod(e, c, front, volumes.into_iter().flatten());
    StatefulSet {
        metadata: ctx.meta(component, Some(component)),
        spec: StatefulSetSpec {
            replicas: Some(ctx.replicas(replicas)),
            service_name: Some(name(&ctx.name, component)),
            // Engines are independent: scale up and down all at once.
            pod_management_policy: Some("Parallel".into()),
            selector: selector(ctx, component),
            template: template(ctx, component, e.gpus() > 0, pod),
            ..StatefulSetSpec::default()
        },
        ..StatefulSet::default()
    }
}

/// `moult engine` on `model_path`, listening on the engine port, with `flags` and then
/// `engines.extraArgs`, in `engines.image` or the runtime image. Shared by a run's built-in
/// engines and an EnginePool's.
pub(crate) fn builtin_engine(
    e: &EnginesSpec,
    config: &Config,
    model_path: String,
    flags: Vec<String>,
) -> Container {
    let mut args = vec!["engine".to_string(), "--model".into(), model_path];
    args.extend(["--host".into(), "0.0.0.0".into()]);
    args.extend(["--port".into(), ENGINE_PORT.to_string()]);
    args.extend(flags);
    args.extend(e.extra_args.iter().cloned());
    let image = e.image.as_ref().unwrap_or(&config.images.runtime);
    container("engine", image, vec!["moult".into()], args)
}

/// An engine pod: the engine container `c` with `e`'s resources and GPUs, its probes,
/// `/dev/shm` and `volumes` mounted, and the token check in front of a vLLM engine (`front`,
/// which then holds the engine port). Shared by a run's engines and an EnginePool's.
pub(crate) fn engine_pod(
    e: &EnginesSpec,
    mut c: Container,
    front: Option<Container>,
    volumes: impl IntoIterator<Item = (Volume, VolumeMount)>,
) -> PodSpec {
    if front.is_none() {
        c.ports = container_port(ENGINE_PORT);
    }
    c.resources = resources(e.resources.as_ref(), e.gpus());
    c.readiness_probe = Some(http_probe("/health", ENGINE_PORT, 5));
    // Both servers answer /health only once the model is loaded (up to 30 minutes for a large
    // one), and 503 once their engine has died: restart it then.
    c.startup_probe = Some(Probe {
        failure_threshold: Some(180),
        ..http_probe("/health", ENGINE_PORT, 10)
    });
    c.liveness_probe = Some(Probe {
        failure_threshold: Some(3),
        ..http_probe("/health", ENGINE_PORT, 10)
    });
    let mut pod_volumes = vec![empty_dir("dshm", Some("Memory"), SHM_SIZE)];
    let mounts = c.volume_mounts.get_or_insert_with(Vec::new);
    // NCCL and vLLM's tensor-parallel workers share memory through /dev/shm.
    mounts.push(mount("dshm", "/dev/shm", false));
    for (v, m) in volumes {
        pod_volumes.push(v);
        mounts.push(m);
    }
    PodSpec {
        containers: std::iter::once(c).chain(front).collect(),
        volumes: Some(pod_volumes),
        ..PodSpec::default()
    }
}

/// Where a vLLM engine listens in its pod: on the loopback, reached only through its front.
pub const VLLM_LOOPBACK_PORT: u16 = 8001;

/// The run-token check in front of a vLLM engine (`moult engine-front`, docs/security.md): what
/// the pod exposes on the engine port. Probes reach vLLM's `/health` through it.
fn engine_front(ctx: &Ctx) -> Container {
    let args = vec![
        "engine-front".to_string(),
        "--upstream".into(),
        format!("http://127.0.0.1:{VLLM_LOOPBACK_PORT}"),
        "--host".into(),
        "0.0.0.0".into(),
        "--port".into(),
        ENGINE_PORT.to_string(),
    ];
    let image = &ctx.config.images.runtime;
    let mut c = container("engine-front", image, vec!["moult".into()], args);
    c.env = Some(moult_env(ctx, Credential::Run));
    c.ports = container_port(ENGINE_PORT);
    c
}

/// The command-line arguments of a vLLM engine (after `vllm serve`) on `model_path`, listening
/// on `host:port`: every flag the RL API needs (docs/vllm.md), then `engines.extraArgs`. `moult
/// run` starts its vLLM processes with the same arguments. Only the policy's engines (`role`)
/// get a weight-transfer engine and routed experts.
pub fn vllm_args(
    spec: &RLRunSpec,
    model_path: &str,
    host: &str,
    port: u16,
    served_name: &str,
    role: EngineRole,
) -> Vec<String> {
    let e = &spec.engines;
    let mut args = vec![
        model_path.to_string(),
        "--host".into(),
        host.into(),
        "--port".into(),
        port.to_string(),
        "--served-model-name".into(),
        served_name.into(),
        "--tensor-parallel-size".into(),
        e.tensor_parallel_size.to_string(),
        // Behaviour logprobs must be those of the distribution sampled from.
        "--logprobs-mode".into(),
        "processed_logprobs".into(),
        // The token-in/token-out generate endpoint answers 403 without it.
        "--enable-scale-out".into(),
    ];
    if role == EngineRole::Policy && e.transport() == WeightTransport::Nccl {
        // The weight-transfer routes need a transfer engine: NCCL from the trainer. (The
        // Filesystem transport reloads through `/collective_rpc` and needs none.)
        args.extend([
            "--weight-transfer-config".into(),
            r#"{"backend":"nccl"}"#.into(),
        ]);
    }
    if let Some(len) = spec.model.max_model_len {
        // A teacher scores a whole segment as a prompt, with one token to generate after it.
        let len = len + u32::from(role == EngineRole::Teacher);
        args.extend(["--max-model-len".into(), len.to_string()]);
    }
    if spec.routing_replay && role == EngineRole::Policy {
        args.push("--enable-return-routed-experts".into());
    }
    if let (Some(rank), EngineRole::Policy) = (spec.vllm_lora_rank(), role) {
        // A LoRA run loads each version as a new adapter at run time (with
        // VLLM_ALLOW_RUNTIME_LORA_UPDATING) and holds two while it switches (docs/lora.md).
        args.extend(
            ["--enable-lora", "--max-loras", "2", "--max-cpu-loras", "4"].map(String::from),
        );
        args.extend(["--max-lora-rank".into(), rank.to_string()]);
    }
    args.extend(e.extra_args.iter().cloned());
    args
}

pub(crate) fn trainer_service(ctx: &Ctx) -> Service {
    service(ctx, "trainer", TRAINER_RENDEZVOUS_PORT, true)
}

/// The trainer ranks: rank from the pod index, world size, and rank 0's stable address.
pub(crate) fn trainer(ctx: &Ctx) -> StatefulSet {
    let spec = &ctx.run.spec;
    let t = &spec.trainer;
    let image = t
        .image
        .clone()
        .unwrap_or_else(|| ctx.config.images.runtime.clone());
    let mut c = container(
        "trainer",
        &image,
        vec!["moult".into()],
        vec![
            "trainer".into(),
            "--config".into(),
            config_path(),
            "--metrics-addr".into(),
            format!("0.0.0.0:{METRICS_PORT}"),
        ],
    );
    let trainer_svc = name(&ctx.name, "trainer");
    let (model_volume, model_path) = model(ctx);
    let mut env_vars = vec![
        field_env("RANK", "metadata.labels['apps.kubernetes.io/pod-index']"),
        // Engines connect to this address for the weight stream.
        field_env("POD_IP", "status.podIP"),
        env("MOULT_MODEL", &model_path),
        env("WORLD_SIZE", &t.nodes.to_string()),
        env("GPUS_PER_NODE", &t.gpus_per_node.to_string()),
        env(
            "MASTER_ADDR",
            &format!("{trainer_svc}-0.{trainer_svc}.{}.svc", ctx.namespace),
        ),
        env("MASTER_PORT", &TRAINER_RENDEZVOUS_PORT.to_string()),
        env(
            "MOULT_COORDINATOR",
            &format!(
                "http://{}:{COORDINATOR_PORT}",
                name(&ctx.name, "coordinator")
            ),
        ),
    ];
    if spec.checkpoint.is_some() {
        env_vars.push(env("MOULT_CHECKPOINTS", CHECKPOINT_DIR));
    }
    let weights = weights(ctx, false);
    if weights.is_some() {
        // The Filesystem transport: new weights go here, where every engine reads them.
        env_vars.push(env("MOULT_WEIGHTS_DIR", WEIGHTS_DIR));
    }
    // On-policy distillation with the teacher in the trainer (a served one has engines).
    let teacher = teacher(ctx).filter(|_| served_teacher(ctx).is_none());
    if let Some((_, path)) = &teacher {
        // On-policy distillation: the trainer scores samples with the teacher.
        env_vars.push(env("MOULT_TEACHER", path));
    }
    // A stopped trainer checkpoints its last step within its grace, and exits a little before
    // it ends rather than be killed (docs/operator.md, "Stopping, suspending, preempting").
    let grace = t.grace_seconds();
    env_vars.push(env("MOULT_STOP_SECONDS", &(grace - 5).to_string()));
    if ctx.pool.is_some() {
        // The trainer sends the adapter to the pool's engines, as the run.
        env_vars.push(super::pool::credential_env(&name(&ctx.name, "token")));
    }
    env_vars.extend(moult_env(ctx, Credential::Run));
    c.env = Some(env_vars);
    c.ports = Some(vec![
        port("rendezvous", TRAINER_RENDEZVOUS_PORT),
        port("weights", WEIGHT_STREAM_PORT),
        port("metrics", METRICS_PORT),
    ]);
    c.liveness_probe = Some(http_probe("/health", METRICS_PORT, 10));
    c.resources = resources(t.resources.as_ref(), t.gpus_per_node);
    let mut volumes = vec![empty_dir("dshm", Some("Memory"), SHM_SIZE)];
    let mounts = c.volume_mounts.get_or_insert_with(Vec::new);
    mounts.push(mount("dshm", "/dev/shm", false));
    if let Some((v, m)) = model_volume {
        volumes.push(v);
        mounts.push(m);
    }
    if let Some(ck) = &spec.checkpoint {
        volumes.push(claim("checkpoints", &ck.claim_name, false));
        mounts.push(mount("checkpoints", CHECKPOINT_DIR, false));
    }
    if let Some((Some((v, m)), _)) = teacher {
        volumes.push(v);
        mounts.push(m);
    }
    if let Some((v, m)) = weights {
        volumes.push(v);
        mounts.push(m);
    }
    let pod = PodSpec {
        containers: vec![c],
        volumes: Some(volumes),
        subdomain: Some(trainer_svc.clone()),
        termination_grace_period_seconds: Some(grace.into()),
        ..PodSpec::default()
    };
    StatefulSet {
        metadata: ctx.meta("trainer", Some("trainer")),
        spec: StatefulSetSpec {
            replicas: Some(ctx.replicas(t.nodes as i32)),
            service_name: Some(trainer_svc),
            // Ranks rendezvous with each other: start them together.
            pod_management_policy: Some("Parallel".into()),
            selector: selector(ctx, "trainer"),
            template: template(ctx, "trainer", t.gpus_per_node > 0, pod),
            ..StatefulSetSpec::default()
        },
        ..StatefulSet::default()
    }
}

pub(crate) fn coordinator_service(ctx: &Ctx) -> Service {
    service(ctx, "coordinator", COORDINATOR_PORT, false)
}

/// The coordinator: router, rollout pool and weight-sync orchestration (one replica).
pub(crate) fn coordinator(ctx: &Ctx) -> Deployment {
    let mut c = container(
        "coordinator",
        &ctx.config.images.runtime,
        vec!["moult".into()],
        vec![
            "coordinator".into(),
            "--config".into(),
            config_path(),
            "--host".into(),
            "0.0.0.0".into(),
            "--port".into(),
            COORDINATOR_PORT.to_string(),
        ],
    );
    c.resources = ctx.run.spec.coordinator.resources.clone();
    let (data_volume, tasks_path) = dataset(ctx);
    // The engines' Service: the coordinator follows its EndpointSlices (the pool's, on a pool).
    let engines = match ctx.pool {
        Some(pool) => name(&pool.name, "engines"),
        None => name(&ctx.name, "engine"),
    };
    let mut env_vars = vec![
        env("MOULT_ENGINES", &engines),
        // The coordinator draws the tasks (it owns the data cursor).
        env("MOULT_TASKS", &tasks_path),
    ];
    // It runs the evaluations too (spec.eval), over the held-out tasks.
    let eval = eval_dataset(ctx);
    if let Some((_, path)) = &eval {
        env_vars.push(env("MOULT_EVAL_TASKS", path));
    }
    // With a judge it scores each batch: it asks the judge engines (their Service's
    // EndpointSlices), with the judge's tokenizer and chat template, about replies it reads with
    // the policy's tokenizer.
    let mut judge_volumes = Vec::new();
    if let Some((judge_volume, judge_path)) = judge_model(ctx, true) {
        let (model_volume, model_path) = model(ctx);
        env_vars.extend([
            env("MOULT_JUDGE_ENGINES", &name(&ctx.name, "judge")),
            env("MOULT_JUDGE_MODEL", &judge_path),
            env("MOULT_MODEL", &model_path),
        ]);
        judge_volumes.extend([model_volume, judge_volume].into_iter().flatten());
    }
    // With a served teacher it has each batch scored by the teacher's engines (their Service's
    // EndpointSlices) before the trainer gets it.
    if served_teacher(ctx).is_some() {
        env_vars.push(env("MOULT_TEACHER_ENGINES", &name(&ctx.name, "teacher")));
    }
    if ctx.pool.is_some() {
        // It routes the run's generations to the pool's engines, as the run.
        env_vars.push(super::pool::credential_env(&name(&ctx.name, "token")));
    }
    env_vars.extend(moult_env(ctx, Credential::Run));
    c.env = Some(env_vars);
    c.ports = container_port(COORDINATOR_PORT);
    c.readiness_probe = Some(http_probe("/health", COORDINATOR_PORT, 5));
    let mut volumes = Vec::new();
    for (v, m) in [data_volume, eval.and_then(|(volume, _)| volume)]
        .into_iter()
        .flatten()
        .chain(judge_volumes)
    {
        volumes.push(v);
        c.volume_mounts.get_or_insert_with(Vec::new).push(m);
    }
    let pod = PodSpec {
        containers: vec![c],
        volumes: Some(volumes),
        ..PodSpec::default()
    };
    Deployment {
        metadata: ctx.meta("coordinator", Some("coordinator")),
        spec: DeploymentSpec {
            replicas: Some(ctx.replicas(1)),
            selector: selector(ctx, "coordinator"),
            // Never two coordinators of one run at once.
            strategy: Some(DeploymentStrategy {
                type_: Some("Recreate".into()),
                ..Default::default()
            }),
            template: template(ctx, "coordinator", false, pod),
            ..DeploymentSpec::default()
        },
        ..Deployment::default()
    }
}

/// The agent pool: the user's image (or the runtime's for built-in environments), with the
/// `moult` binary copied in by an init container so that any image works.
/// The agent pod's second container: `moult sandbox`, in the agent's image, starts every agent
/// program for `moult agents` (docs/security.md, "Agent code"). It holds no credential and
/// mounts neither the config nor the model, only the `/tmp` it shares with the agent container
/// (the socket, episodes' files) and `moult` itself; the spec's resources are the agent code's.
fn sandbox(image: &str, moult: &str, a: &AgentSpec) -> Container {
    let args = vec!["sandbox".into(), "--socket".into(), SANDBOX_SOCKET.into()];
    let mut c = container("sandbox", image, vec![moult.to_string()], args);
    // Agent code may need to write into its own image (spec.agent.readOnlyRootFilesystem).
    c.security_context = Some(locked_down(a.read_only_root_filesystem));
    c.env = Some(vec![env("HOME", "/tmp")]);
    c.resources = a.resources.clone();
    c.volume_mounts = Some(vec![
        mount("tmp", "/tmp", false),
        mount("moult-bin", MOULT_BIN_DIR, true),
    ]);
    c
}

/// The init container that copies `moult` (to `moult`, on the `moult-bin` volume) into a pod of
/// any image: agent pods and sandbox pods.
pub(crate) fn install_moult(ctx: &Ctx, moult: &str) -> Container {
    Container {
        name: "install-moult".into(),
        image: Some(ctx.config.images.init.clone()),
        command: Some(vec!["cp".into(), "/moult".into(), moult.into()]),
        security_context: Some(locked_down(true)),
        volume_mounts: Some(vec![mount("moult-bin", MOULT_BIN_DIR, false)]),
        termination_message_policy: Some(TERMINATION_MESSAGE_POLICY.into()),
        ..Container::default()
    }
}

pub(crate) fn agents(ctx: &Ctx) -> Deployment {
    let spec = &ctx.run.spec;
    let a = &spec.agent;
    let moult = format!("{MOULT_BIN_DIR}/moult");
    let mut args = vec![
        "agents".to_string(),
        "--config".into(),
        config_path(),
        "--metrics-addr".into(),
        format!("0.0.0.0:{METRICS_PORT}"),
        "--coordinator".into(),
        format!(
            "http://{}:{COORDINATOR_PORT}",
            name(&ctx.name, "coordinator")
        ),
    ];
    if !a.command.is_empty() {
        args.push("--".into());
        args.extend(a.command.iter().cloned());
    }
    let image = a
        .image
        .clone()
        .unwrap_or_else(|| ctx.config.images.runtime.clone());
    let mut c = container("agent", &image, vec![moult.clone()], args);
    let (model_volume, model_path) = model(ctx);
    let mut env_vars = vec![
        env("MOULT_CONCURRENCY", &a.concurrency.to_string()),
        // The tokenizer and chat template of the loopback server.
        env("MOULT_MODEL", &model_path),
        // Agent code runs in the sandbox container below, never beside the agent credential.
        env(SANDBOX_ENV, SANDBOX_SOCKET),
    ];
    if let AgentForm::Env = a.form {
        if let Some(name) = &a.env {
            env_vars.push(env("MOULT_ENV", name));
        }
    }
    env_vars.extend(moult_env(ctx, Credential::Agent));
    c.env = Some(env_vars);
    c.ports = Some(vec![port("metrics", METRICS_PORT)]);
    c.liveness_probe = Some(http_probe("/health", METRICS_PORT, 10));
    // The loopback server and the episode loop; the agent code's share is the sandbox's.
    c.resources = Some(ResourceRequirements {
        requests: Some(BTreeMap::from([
            ("cpu".to_string(), Quantity("250m".into())),
            ("memory".to_string(), Quantity("512Mi".into())),
        ])),
        ..ResourceRequirements::default()
    });
    let mounts = c.volume_mounts.get_or_insert_with(Vec::new);
    mounts.push(mount("moult-bin", MOULT_BIN_DIR, true));
    let mut volumes = vec![empty_dir("moult-bin", None, MOULT_BIN_SIZE)];
    if let Some((v, m)) = model_volume {
        // The chat template and tokenizer come from the model folder.
        volumes.push(v);
        mounts.push(m);
    }
    let mut pod = PodSpec {
        init_containers: Some(vec![install_moult(ctx, &moult)]),
        volumes: Some(volumes),
        runtime_class_name: a.runtime_class_name.clone(),
        ..PodSpec::default()
    };
    pod.containers = vec![c, sandbox(&image, &moult, a)];
    let mut template = template(ctx, "agents", false, pod);
    if let (Some(_), Some(pod)) = (&a.sandbox, template.spec.as_mut()) {
        super::sandbox::claim_from(ctx, pod);
    }
    Deployment {
        metadata: ctx.meta("agents", Some("agents")),
        spec: DeploymentSpec {
            replicas: Some(ctx.replicas(a.replicas)),
            selector: selector(ctx, "agents"),
            template,
            ..DeploymentSpec::default()
        },
        ..Deployment::default()
    }
}
