//! The `RLRun` custom resource (`moult.dev/v1alpha1`): the contract between the user, the
//! operator and the runtime.
//!
//! The schema served by the API server is derived from these types (`crdgen` writes it to
//! `crds/rlrun.yaml`). Rules that span fields are CEL rules (`x-kubernetes-validations`) placed
//! on the smallest object that holds every field they read, each with a message that names the
//! fields and what to change. Defaults live in the schema too, so `kubectl get -o yaml` shows
//! what the run will use. This module depends only on serde, schemars, k8s-openapi and kube's
//! derive: the runtime reads the same spec without a Kubernetes client.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{ResourceRequirements, Toleration};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::core::Duration;
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

mod engine_flags;
mod network;
mod pool;
mod rules;

pub use engine_flags::RESERVED_ENGINE_FLAGS;
pub use network::{AgentEgressSpec, EgressPort, EgressTarget, Protocol};
pub use pool::{EnginePool, EnginePoolSpec, EnginePoolStatus, PoolRef, PoolRun, RunPoolStatus};
use rules::{claim_rule, limits_rule, resources_rule, DNS_SUBDOMAIN, LABEL_KEY, LABEL_VALUE};

/// API group of every moult resource.
pub const GROUP: &str = "moult.dev";

/// One asynchronous RL run: a model trained by a trainer on trajectories that an agent pool
/// generates through a pool of inference engines.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "moult.dev",
    version = "v1alpha1",
    kind = "RLRun",
    plural = "rlruns",
    singular = "rlrun",
    shortname = "rlr",
    category = "moult",
    namespaced,
    status = "RLRunStatus",
    derive = "PartialEq",
    doc = "An asynchronous reinforcement-learning run of an LLM: engines, trainer, coordinator and agent pool.",
    scale(
        spec_replicas_path = ".spec.engines.replicas",
        status_replicas_path = ".status.engines.replicas",
        label_selector_path = ".status.engines.selector"
    ),
    printcolumn(name = "Phase", type_ = "string", json_path = ".status.phase"),
    printcolumn(
        name = "Engines",
        type_ = "string",
        description = "ready/desired engine replicas",
        json_path = ".status.engines.ready"
    ),
    printcolumn(name = "Version", type_ = "integer", json_path = ".status.policyVersion"),
    printcolumn(name = "Step", type_ = "integer", json_path = ".status.step"),
    printcolumn(name = "Reward", type_ = "number", json_path = ".status.metrics.reward"),
    printcolumn(name = "Eval", type_ = "number", json_path = ".status.metrics.evalReward"),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp"),
    printcolumn(
        name = "Reason",
        type_ = "string",
        description = "why the run is not ready (docs/operator.md, \"Why is my run stuck\")",
        json_path = ".status.conditions[?(@.type==\"Ready\")].reason",
        priority = "1"
    ),
    printcolumn(
        name = "GPU-Hours",
        type_ = "number",
        description = "GPU-hours the run's pods used while they ran",
        json_path = ".status.usage.gpuHours",
        priority = "1"
    ),
    printcolumn(
        name = "Message",
        type_ = "string",
        description = "the Ready condition's message: per component, what keeps it from ready",
        json_path = ".status.conditions[?(@.type==\"Ready\")].message",
        priority = "1"
    ),
    validation = Rule::new("size(self.metadata.name) <= 40").message(
        "RLRun names are at most 40 characters: the names of its engines, trainer and their pods add suffixes"
    ),
    validation = Rule::new("self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')").message(
        "RLRun names start with a lowercase letter and hold only lowercase letters, digits and '-' (no '.'): they name the run's Services"
    ),
)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!has(self.algorithm.teacher) || !has(self.algorithm.teacher.replicas) || !has(self.rollout) || !has(self.rollout.temperature) || self.rollout.temperature == 1.0").message(
    "algorithm.teacher.replicas: a served teacher scores at temperature 1 (engines' prompt logprobs ignore temperature), so rollout.temperature must be 1.0; or drop teacher.replicas to score in the trainer at any temperature"
))]
#[x_kube(validation = Rule::new("!has(self.judge) || self.algorithm.estimator != 'OnPolicyDistillation'").message(
    "algorithm.estimator OnPolicyDistillation takes its advantages from the teacher, not from rewards: remove judge or pick GRPO, RLOO or REINFORCE++"
))]
#[x_kube(validation = Rule::new("has(self.engines.poolRef) || self.engines.backend != 'vLLM' || (has(self.engines.weightTransfer) && self.engines.weightTransfer.transport != 'Nccl') || self.trainer.gpusPerNode > 0").message(
    "engines.weightTransfer.transport Nccl (vLLM's default) sends weights from the trainer's GPU: give trainer.gpusPerNode, or set engines.weightTransfer.transport Filesystem for a CPU trainer (docs/weight-sync.md)"
))]
#[x_kube(validation = Rule::new("!has(self.model.lora) || self.engines.backend == 'Builtin' || has(self.engines.poolRef) || (has(self.engines.weightTransfer) && self.engines.weightTransfer.transport == 'Filesystem')").message(
    "model.lora with vLLM engines: each adapter version reaches vLLM as a folder it loads: set engines.weightTransfer.transport Filesystem (with a claimName on a cluster), or use engines.backend Builtin (docs/lora.md)"
))]
#[x_kube(validation = Rule::new("!has(self.model.lora) || !has(self.trainer.computeDtype) || self.trainer.computeDtype != 'BFloat16'").message(
    "model.lora: the trainer computes LoRA runs in float32 (trainer.computeDtype BFloat16 gathers sharded full weights, which a LoRA run never shards; docs/lora.md)"
))]
#[x_kube(validation = Rule::new("!has(self.engines.poolRef) || has(self.model.lora)").message(
    "engines.poolRef: a run on an EnginePool trains a LoRA adapter of the pool's base model: set model.lora"
))]
pub struct RLRunSpec {
    /// The model to train (and to serve on the engines).
    pub model: ModelSpec,
    /// The agent pool that turns prompts into scored trajectories.
    pub agent: AgentSpec,
    /// The inference engines (vLLM, or moult's built-in engine).
    #[serde(default)]
    pub engines: EnginesSpec,
    /// The trainer ranks.
    #[serde(default)]
    pub trainer: TrainerSpec,
    /// The coordinator's pod.
    #[serde(default)]
    pub coordinator: CoordinatorSpec,
    /// Advantage estimator, loss, off-policy correction and optimizer.
    #[serde(default)]
    pub algorithm: AlgorithmSpec,
    /// An LLM judge that scores each episode's final reply with a prompt; its score replaces or
    /// joins the agent's own reward (`judge.weight`, `judge.agentWeight`). No judge when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub judge: Option<JudgeSpec>,
    /// Sampling settings of rollouts.
    #[serde(default)]
    pub rollout: RolloutSpec,
    /// Evaluation on held-out tasks during training (docs/run.md, "Evaluation"); none when
    /// absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval: Option<EvalSpec>,
    /// Rollout routing replay (R3) for mixture-of-experts models: the training forward uses the
    /// experts the engine routed each token to.
    #[serde(default)]
    pub routing_replay: bool,
    /// Where and how often the trainer checkpoints; no checkpoints when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint: Option<CheckpointSpec>,
    /// Where the pods may run.
    #[serde(default)]
    pub scheduling: SchedulingSpec,
    /// Scales every pod of the run to zero and keeps its state (for queueing systems such as
    /// Kueue); unset it to resume.
    #[serde(default)]
    pub suspend: bool,
    /// Training steps after which the run has succeeded.
    #[schemars(range(min = 1))]
    pub total_steps: u32,
}

/// The coordinator (router, rollout pool, weight-sync orchestration; one pod).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = resources_rule("coordinator.resources"))]
#[x_kube(validation = limits_rule("coordinator.resources"))]
pub struct CoordinatorSpec {
    /// CPU, memory and ephemeral storage of the coordinator's container (limits default to 4
    /// CPUs, 8Gi and 1Gi; docs/operator.md, "Resources").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,
    /// What the agent pods together (they share one credential) may hold at once on the
    /// coordinator; beyond it they are answered 429 and retry (docs/security.md, "Holders and
    /// rates"). Each default scales with the agent sessions, `agent.replicas × agent.concurrency`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_limits: Option<AgentLimitsSpec>,
}

/// `coordinator.agentLimits`: each unset one takes its default.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AgentLimitsSpec {
    /// Requests open at once, each on a connection of its own [default: 8 × sessions + 64].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 1000000))]
    pub requests: Option<u32>,
    /// Generations at once (`/inference/v1/generate`) [default: 4 × sessions].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 1000000))]
    pub generations: Option<u32>,
    /// MiB of episode bodies being received at once [default: 2048]; at least 256, the most one
    /// episode may be.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[serde(rename = "episodeMiB")]
    #[schemars(range(min = 256, max = 1048576))]
    pub episode_mib: Option<u32>,
}

impl RLRunSpec {
    /// `coordinator.agentLimits` with the defaults filled in from the agent sessions
    /// (`agent.replicas × agent.concurrency`): requests, generations, episode bytes.
    pub fn agent_limits(&self) -> [u64; 3] {
        let sessions = self.agent.replicas.max(1) as u64 * u64::from(self.agent.concurrency);
        let limits = self.coordinator.agent_limits.unwrap_or_default();
        let or = |v: Option<u32>, default: u64| v.map_or(default, u64::from);
        [
            or(limits.requests, 8 * sessions + 64),
            or(limits.generations, 4 * sessions),
            or(limits.episode_mib, 2048) << 20,
        ]
    }

    /// Whether each policy version reaches the engines as a new LoRA adapter, `<run>-v<N>`,
    /// loaded beside the others (docs/lora.md): a LoRA run on an EnginePool or on vLLM engines.
    /// A LoRA run's own built-in engines are updated in place instead, as a full-weight run's.
    pub fn versioned_adapters(&self) -> bool {
        let e = &self.engines;
        self.model.lora.is_some() && (e.pool_ref.is_some() || e.backend == EngineBackend::Vllm)
    }

    /// vLLM's `--max-lora-rank` for a LoRA run's adapters: the smallest rank vLLM takes that
    /// holds the run's (vLLM takes 1, 8, 16, 32, 64, 128, 256, 320 and 512).
    pub fn vllm_lora_rank(&self) -> Option<u32> {
        let rank = self.model.lora.as_ref()?.rank;
        [1, 8, 16, 32, 64, 128, 256, 320, 512]
            .into_iter()
            .find(|&r| r >= rank)
    }
}

/// A Hugging Face checkpoint folder (`config.json`, tokenizer, safetensors).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = claim_rule("model.claimName"))]
pub struct ModelSpec {
    /// Path of the checkpoint folder inside the pods: under `/models` when `claimName` is set.
    #[schemars(length(min = 1, max = 4096))]
    pub path: String,
    /// PersistentVolumeClaim holding the checkpoint, mounted read-only at `/models`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub claim_name: Option<String>,
    /// Longest context (prompt + generation) the engines accept; the model's own when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 16777216))]
    pub max_model_len: Option<u32>,
    /// Train a LoRA adapter of the model instead of all its weights: the base stays frozen and
    /// shared, and only the adapter is trained, checkpointed (in PEFT's layout) and sent to the
    /// engines (docs/lora.md).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora: Option<LoraSpec>,
}

/// A LoRA adapter: `W x + (alpha / rank) · B A x` on each targeted projection (docs/lora.md).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!has(self.alpha) || self.alpha > 0.0").message(
    "model.lora.alpha must be positive"
))]
#[x_kube(validation = Rule::new("self.dropout >= 0.0 && self.dropout < 1.0").message(
    "model.lora.dropout is a probability below 1 (0 for none)"
))]
pub struct LoraSpec {
    /// The rank `r` of every adapted projection (vLLM serves ranks up to 512).
    #[schemars(range(min = 1, max = 512))]
    pub rank: u32,
    /// The adapter's output is scaled by `alpha / rank`; twice the rank when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub alpha: Option<f64>,
    /// Dropout on the adapter's input in the trainer's forward (PEFT's `lora_dropout`); 0 (the
    /// default) for none. Engines sample without it, so with dropout the trainer's logprobs
    /// differ from the engines' by its noise (docs/lora.md).
    #[serde(default)]
    pub dropout: f64,
    /// The projections adapted in every decoder layer, MoE experts' included; all seven when
    /// unset.
    #[serde(default = "LoraTarget::all")]
    #[schemars(length(min = 1, max = 7))]
    pub target_modules: Vec<LoraTarget>,
}

impl LoraSpec {
    /// `alpha`, or its default (twice the rank).
    pub fn alpha(&self) -> f64 {
        self.alpha.unwrap_or(2.0 * f64::from(self.rank))
    }

    /// The adapter's shape as the runtime's `model::lora::LoraConfig` reads it (the value of
    /// `moult engine --lora`): defaults filled in, modules by name.
    pub fn adapter(&self) -> serde_json::Value {
        let targets: Vec<String> = self.target_modules.iter().map(|t| t.name()).collect();
        serde_json::json!({
            "rank": self.rank,
            "alpha": self.alpha(),
            "dropout": self.dropout,
            "targets": targets,
        })
    }
}

/// A projection of a decoder layer a LoRA adapter may target (Hugging Face's module names).
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum LoraTarget {
    QProj,
    KProj,
    VProj,
    OProj,
    GateProj,
    UpProj,
    DownProj,
}

impl LoraTarget {
    pub fn all() -> Vec<Self> {
        use LoraTarget::*;
        vec![QProj, KProj, VProj, OProj, GateProj, UpProj, DownProj]
    }

    /// The module name (`q_proj`).
    pub fn name(self) -> String {
        serde_json::to_value(self)
            .ok()
            .and_then(|v| v.as_str().map(str::to_string))
            .unwrap_or_default()
    }
}

/// How an agent is written (docs/agents.md).
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema, Default)]
pub enum AgentForm {
    /// Gymnasium-shaped `reset`/`step`; the framework owns the LLM loop.
    #[default]
    Env,
    /// The user's own program owns the loop and talks to the loopback server through the OpenAI
    /// or Anthropic API.
    ChatAgent,
}

/// The agent pool.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("self.form != 'ChatAgent' || (has(self.image) && size(self.command) > 0)").message(
    "agent.form ChatAgent runs your program: set agent.image and agent.command"
))]
#[x_kube(validation = Rule::new("self.form != 'Env' || has(self.env) || has(self.image)").message(
    "agent.form Env needs agent.env (a built-in environment) or agent.image (an external one)"
))]
#[x_kube(validation = resources_rule("agent.resources"))]
#[x_kube(validation = limits_rule("agent.resources"))]
#[x_kube(validation = Rule::new("!has(self.timeout) || self.timeout.matches('^([0-9]+([.][0-9]+)?(ns|us|µs|ms|s|m|h))+$')").message(
    "agent.timeout must be a duration such as 90s, 10m or 1h30m"
))]
pub struct AgentSpec {
    #[serde(default)]
    pub form: AgentForm,
    /// Image of the agent pods. The `moult` binary is copied into it by an init container, so
    /// any image works. Optional for built-in environments.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 1024))]
    pub image: Option<String>,
    /// The agent program (ChatAgent) or external environment server (Env), run in `image`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 256), inner(length(max = 8192)))]
    pub command: Vec<String>,
    /// A built-in environment by name (Env form).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub env: Option<String>,
    /// Agent-pool pods.
    #[serde(default = "one")]
    #[schemars(range(min = 0, max = 10000))]
    pub replicas: i32,
    /// Concurrent sessions per agent-pool pod.
    #[serde(default = "default_concurrency")]
    #[schemars(range(min = 1, max = 4096))]
    pub concurrency: u32,
    /// Longest an episode may take before it is abandoned, as a Go duration ("10m", "90s").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout: Option<Duration>,
    /// The prompts or tasks.
    pub dataset: DatasetSpec,
    /// CPU and memory of the agent code in each agent-pool pod: its `sandbox` container, where
    /// agent programs run (the `agent` container beside it, `moult agents`, requests 250m CPU
    /// and 512Mi of memory of its own).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,
    /// Where agent pods may connect besides the cluster's DNS and the run's coordinator (nowhere
    /// else when absent: agent code is untrusted, docs/security.md).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress: Option<AgentEgressSpec>,
    /// The image is mounted read-only in the `sandbox` container, where agent code runs (`/tmp`
    /// and `$HOME` are writable either way). Set false for agent code that writes into its image, such as a coding agent that
    /// edits a repository baked into it.
    #[serde(default = "yes")]
    pub read_only_root_filesystem: bool,
    /// How agent programs are kept apart: `Episode` (the default) starts every episode's program
    /// in a jail of its own, `Process` only in a process group of its own, the weaker guarantee
    /// (docs/security.md#episodes).
    #[serde(default)]
    pub isolation: Isolation,
    /// Limits of every episode's jail (`isolation: Episode`); docs/agents.md#limits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limits: Option<EpisodeLimits>,
    /// RuntimeClass of the agent pods: a sandboxed runtime such as gVisor (`runsc`) or Kata
    /// Containers that the cluster's admin installed (docs/security.md#in-a-pod).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub runtime_class_name: Option<String>,
    /// Run the code a model writes (`moult.sandbox.run` calls) in a pod of its own per episode,
    /// from kubernetes-sigs/agent-sandbox, which the cluster's admin installed
    /// (docs/security.md#sandbox-pods). Without it, each call gets a jail in the agent pod.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sandbox: Option<AgentSandboxSpec>,
}

/// Sandbox pods for model-written code, one per episode (docs/security.md#sandbox-pods).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AgentSandboxSpec {
    /// Image of the sandbox pods, such as a task's repository and its tools (default: the
    /// agent's image). A task with an `image` field gets a pod of that image instead, made for
    /// its episode rather than taken from the warm pool. `moult` is copied in, so any image works.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 1024))]
    pub image: Option<String>,
    /// Sandbox pods kept started and waiting for an episode (default: as many as the run's
    /// episodes at once, agent replicas times concurrency).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 10000))]
    pub warm_pool: Option<i32>,
    /// CPU and memory of each sandbox pod.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,
}

/// How agent programs are kept apart (docs/security.md#episodes).
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum Isolation {
    /// A fresh jail per episode: its own processes, scratch, network and limits.
    #[default]
    Episode,
    /// A process group per episode, in the agent's container (or this machine) as it is.
    Process,
}

/// The limits of an episode's jail; each one that ends an episode is named in its failure.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("(!has(self.memory) || isQuantity(string(self.memory))) && (!has(self.fileSize) || isQuantity(string(self.fileSize))) && (!has(self.scratch) || isQuantity(string(self.scratch)))").message(Message::Message("spec.agent.limits: memory, fileSize and scratch are sizes in bytes, as quantities (512Mi, 2Gi)".into())))]
pub struct EpisodeLimits {
    /// CPU seconds of each process (default 600).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub cpu_seconds: Option<u32>,
    /// Address space of each process (default 8Gi).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<Quantity>,
    /// Processes and threads in the jail (default 512).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub processes: Option<u32>,
    /// Largest file a process may write (default 1Gi).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub file_size: Option<Quantity>,
    /// Size of the jail's scratch `/tmp` (default 1Gi).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scratch: Option<Quantity>,
    /// Open files of each process (default 4096).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 16))]
    pub open_files: Option<u32>,
}

/// Tasks: JSON lines, or Parquet files as Hugging Face datasets store them (docs/run.md,
/// "Datasets").
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = claim_rule("agent.dataset.claimName (or eval.dataset.claimName)"))]
pub struct DatasetSpec {
    /// Path of the file inside the pods (under `/data` when `claimName` is set): a file, a
    /// folder (every `.jsonl` and `.parquet` file in it, in name order), or files matched by
    /// one `*` in the file name (`data/train-*.parquet`).
    #[schemars(length(min = 1, max = 4096))]
    pub path: String,
    /// PersistentVolumeClaim holding the file, mounted read-only at `/data`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub claim_name: Option<String>,
    /// The files' format; from each file's extension when absent (`.parquet`: Parquet, any
    /// other: JSON lines).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub format: Option<DatasetFormat>,
    /// The task fields the agent receives, each from a column (or a JSON line's field): `{question:
    /// problem, answer: solution}`; every column under its own name when empty.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(extend("maxProperties" = 64))]
    pub columns: BTreeMap<String, String>,
}

/// How a dataset file is stored.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum DatasetFormat {
    /// One JSON value (a task) per line.
    Jsonl,
    /// Apache Parquet (what Hugging Face datasets store): one task per row.
    Parquet,
}

/// Which server the engine pods run.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema, Default)]
pub enum EngineBackend {
    /// The unmodified `vllm/vllm-openai` image.
    #[default]
    #[serde(rename = "vLLM")]
    Vllm,
    /// moult's built-in engine (`moult engine`), for small models and CPU clusters.
    Builtin,
}

/// The engine pool.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!has(self.gpusPerEngine) || self.gpusPerEngine % self.tensorParallelSize == 0").message(
    "engines.gpusPerEngine must be a multiple of engines.tensorParallelSize"
))]
#[x_kube(validation = Rule::new("self.backend != 'Builtin' || self.tensorParallelSize == 1").message(
    "the built-in engine has no tensor parallelism: engines.tensorParallelSize must be 1 with backend Builtin"
))]
#[x_kube(validation = Rule::new("!has(self.weightTransfer) || self.weightTransfer.transport != 'Nccl' || self.backend == 'vLLM'").message(
    "engines.weightTransfer.transport Nccl is for vLLM engines: the built-in engine takes weights over Tcp or Filesystem"
))]
#[x_kube(validation = Rule::new("!has(self.weightTransfer) || self.weightTransfer.transport != 'Tcp' || self.backend == 'Builtin'").message(
    "engines.weightTransfer.transport Tcp is the built-in engine's weight stream: vLLM engines take weights over Nccl or Filesystem"
))]
#[x_kube(validation = Rule::new(engine_flags::reserved_flags_rule()).message(
    Message::Expression(engine_flags::reserved_flags_message())
))]
#[x_kube(validation = resources_rule("engines.resources"))]
#[x_kube(validation = limits_rule("engines.resources"))]
#[x_kube(validation = Rule::new("!has(self.poolRef) || (self.replicas == 1 && !has(self.weightTransfer))").message(
    "engines.poolRef: a run on an EnginePool has no engines of its own: leave engines.replicas unset (scale the pool: kubectl scale enginepool/NAME) and remove engines.weightTransfer (the adapter goes to the pool's engines; docs/lora.md)"
))]
#[x_kube(validation = Rule::new(engine_flags::ENGINE_DTYPE_RULE).message(
    "engines.extraArgs --dtype must be auto, float32, bfloat16 or float16 (or float, half): moult sends weights to vLLM in that dtype (docs/vllm.md)"
))]
pub struct EnginesSpec {
    /// Engine replicas (what `kubectl scale rlrun/NAME --replicas=N` and HPAs change).
    #[serde(default = "one")]
    #[schemars(range(min = 0, max = 1024))]
    pub replicas: i32,
    #[serde(default)]
    pub backend: EngineBackend,
    /// Engine image; `vllm/vllm-openai` at the supported version for vLLM, the moult runtime
    /// image for the built-in engine, when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 1024))]
    pub image: Option<String>,
    /// GPUs one model copy is split across (vLLM `--tensor-parallel-size`), all in one pod.
    #[serde(default = "one_u32")]
    #[schemars(range(min = 1, max = 16))]
    pub tensor_parallel_size: u32,
    /// GPUs requested by each engine pod; `tensorParallelSize` when absent, 0 for CPU engines.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(max = 16))]
    pub gpus_per_engine: Option<u32>,
    /// Extra command-line flags passed to the engine as they are. Flags moult sets itself are
    /// refused (see `RESERVED_ENGINE_FLAGS` and docs/vllm.md).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 128), inner(length(max = 2048)))]
    pub extra_args: Vec<String>,
    /// CPU and memory of each engine pod (GPUs come from `gpusPerEngine`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,
    /// How new weights reach the engines after each step: NCCL for vLLM and the TCP stream for
    /// the built-in engine when absent (docs/weight-sync.md, "Weight transports").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight_transfer: Option<WeightTransferSpec>,
    /// Serve the run from the built-in engines of this EnginePool (in the run's namespace)
    /// instead of engines of its own: a LoRA run (`model.lora`) on the pool's base model
    /// (docs/operator.md, "Engine pools"). `replicas` and `weightTransfer` are then not set;
    /// `backend`, `image`, `tensorParallelSize`, `gpusPerEngine`, `extraArgs` and `resources`
    /// shape only the run's judge and served-teacher engines.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool_ref: Option<PoolRef>,
}

/// How the trainer's weights travel to the engines.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum WeightTransport {
    /// NCCL broadcast from the trainer's GPU to vLLM engines' GPUs (vLLM's weight-transfer
    /// engine).
    Nccl,
    /// moult's packed TCP stream from the trainer to built-in engines.
    Tcp,
    /// The trainer writes safetensors to a folder every engine reads (a ReadWriteMany volume on a
    /// cluster, a directory locally); engines reload from it. Works with vLLM (CPU or GPU) and
    /// the built-in engine.
    Filesystem,
}

/// The weight path of a run.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = claim_rule("engines.weightTransfer.claimName"))]
#[x_kube(validation = Rule::new("self.transport == 'Filesystem' || !has(self.claimName)").message(
    "engines.weightTransfer.claimName is the folder of the Filesystem transport: remove it or set transport Filesystem"
))]
pub struct WeightTransferSpec {
    pub transport: WeightTransport,
    /// Filesystem transport on a cluster: a ReadWriteMany PersistentVolumeClaim mounted at
    /// `/weights` in the trainer (read-write) and every engine (read-only). `moult run` uses a
    /// folder under its `--out` instead.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub claim_name: Option<String>,
}

impl Default for EnginesSpec {
    fn default() -> Self {
        EnginesSpec {
            replicas: 1,
            backend: EngineBackend::default(),
            image: None,
            tensor_parallel_size: 1,
            gpus_per_engine: None,
            extra_args: Vec::new(),
            resources: None,
            weight_transfer: None,
            pool_ref: None,
        }
    }
}

impl EnginesSpec {
    /// GPUs each engine pod requests.
    pub fn gpus(&self) -> u32 {
        self.gpus_per_engine.unwrap_or(self.tensor_parallel_size)
    }

    /// The weight transport the run uses: the spec's, or the backend's own (NCCL for vLLM, the
    /// TCP stream for the built-in engine, which an EnginePool's engines are).
    pub fn transport(&self) -> WeightTransport {
        match (&self.weight_transfer, self.backend) {
            (Some(w), _) => w.transport,
            (None, _) if self.pool_ref.is_some() => WeightTransport::Tcp,
            (None, EngineBackend::Vllm) => WeightTransport::Nccl,
            (None, EngineBackend::Builtin) => WeightTransport::Tcp,
        }
    }
}

/// The trainer: `nodes` pods of `gpusPerNode` GPUs, one rank per GPU (one per pod on CPU).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = resources_rule("trainer.resources"))]
#[x_kube(validation = limits_rule("trainer.resources"))]
#[x_kube(validation = Rule::new("!has(self.computeDtype) || self.computeDtype != 'BFloat16' || ((self.nodes >= 2 || (has(self.gpusPerNode) && self.gpusPerNode >= 2)) && (!has(self.sharding) || self.sharding == 'Full'))").message(
    "trainer.computeDtype BFloat16 keeps float32 master weights in the shards of sharded weights: it needs two ranks or more (trainer.nodes × gpusPerNode) with sharding Full (docs/distributed.md)"
))]
pub struct TrainerSpec {
    /// Trainer nodes, one pod each, of `gpusPerNode` ranks (one on CPU); all `nodes ×
    /// gpusPerNode` ranks train as one (docs/distributed.md). `moult run` starts them all as
    /// processes of its machine.
    #[serde(default = "one_u32")]
    #[schemars(range(min = 1, max = 1024))]
    pub nodes: u32,
    /// GPUs per trainer pod, one rank each; 0 trains on CPU.
    #[serde(default = "default_gpus_per_node")]
    #[schemars(range(max = 16))]
    pub gpus_per_node: u32,
    /// Trainer image (the moult runtime with libtorch and CUDA) when not the operator's default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 1024))]
    pub image: Option<String>,
    /// CPU and memory of each trainer pod (GPUs come from `gpusPerNode`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,
    /// Write every trained batch (each episode's tokens, loss mask, logprobs, versions, reward)
    /// to `rollouts/step-NNNNNN.json` beside the run's metrics (`moult run --dump-rollouts`;
    /// docs/run.md, "Rollout dumps and replay"). On a cluster that is the checkpoint claim,
    /// which it needs.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub dump_rollouts: bool,
    /// What several ranks shard: `Full` (the default: weights, gradients and optimizer state,
    /// ZeRO-3) or `Optimizer` (gradients and optimizer state, ZeRO-2: every rank keeps the
    /// whole weights, and skips the gathers and recompute). Ignored with one rank.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sharding: Option<TrainerSharding>,
    /// A vision-language policy's vision tower (`visual.*`, its merger included) is not trained:
    /// only the language model learns (docs/vision.md). Refused for a text-only policy.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub freeze_vision_tower: bool,
    /// Tokens (sampled or not) per forward and backward on each rank (8192 when unset); the
    /// gradients of a batch accumulate over its micro-batches. Bounds activation memory
    /// whatever the batch size (docs/distributed.md, "Memory planning").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 1048576))]
    pub micro_batch_tokens: Option<u32>,
    /// The dtype the trainer computes in: `Float32` (the default) or `BFloat16`, which gathers
    /// the weights as bfloat16 and keeps float32 shards, gradient reduction and optimizer state
    /// (several ranks with `sharding: Full` only; docs/distributed.md).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compute_dtype: Option<TrainerDtype>,
    /// Seconds a trainer pod has, from SIGTERM (a suspend, a preemption, a node drain), to
    /// finish or abandon its step and checkpoint the last step it trained before it is killed
    /// (120 when unset; docs/operator.md, "Stopping, suspending, preempting").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 10, max = 86400))]
    pub termination_grace_period_seconds: Option<u32>,
}

impl TrainerSpec {
    /// The trainer pods' `terminationGracePeriodSeconds`.
    pub fn grace_seconds(&self) -> u32 {
        self.termination_grace_period_seconds.unwrap_or(120)
    }
}

/// A trainer's compute dtype.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum TrainerDtype {
    Float32,
    BFloat16,
}

/// What the ranks of a trainer shard (docs/distributed.md).
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum TrainerSharding {
    /// Weights, gradients and optimizer state (ZeRO-3): each decoder layer's weights are
    /// gathered just before it runs, and the layer is recomputed for the backward.
    #[default]
    Full,
    /// Gradients and optimizer state (ZeRO-2): every rank keeps the whole weights.
    Optimizer,
}

impl Default for TrainerSpec {
    fn default() -> Self {
        TrainerSpec {
            nodes: 1,
            gpus_per_node: default_gpus_per_node(),
            image: None,
            resources: None,
            dump_rollouts: false,
            sharding: None,
            micro_batch_tokens: None,
            compute_dtype: None,
            termination_grace_period_seconds: None,
            freeze_vision_tower: false,
        }
    }
}

/// Advantage estimators (docs/algorithms.md).
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema, Default)]
pub enum Estimator {
    /// Group-normalised advantages.
    #[default]
    #[serde(rename = "GRPO")]
    Grpo,
    /// Leave-one-out baseline.
    #[serde(rename = "RLOO")]
    Rloo,
    /// Batch-normalised REINFORCE++.
    #[serde(rename = "REINFORCE++")]
    ReinforcePlusPlus,
    /// Advantage = teacher logprob − student logprob per token.
    OnPolicyDistillation,
    /// Dr. GRPO (Liu et al. 2025): GRPO's group-centred reward without the division by the
    /// group's standard deviation; pair it with `loss.aggregation: SeqMeanTokenSumNorm`.
    #[serde(rename = "DrGRPO")]
    DrGrpo,
}

/// Policy losses (docs/algorithms.md).
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema, Default)]
pub enum LossKind {
    /// PPO clip with asymmetric ε.
    #[default]
    #[serde(rename = "PPOClip")]
    PpoClip,
    /// Sequence-level geometric ratio.
    #[serde(rename = "GSPO")]
    Gspo,
    /// Clipped IS-weight policy optimisation.
    #[serde(rename = "CISPO")]
    Cispo,
}

/// How per-token losses are averaged.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema, Default)]
pub enum Aggregation {
    /// Every sampled token weighs the same (DAPO).
    #[default]
    TokenMean,
    /// Every sequence weighs the same: the mean of each one's token mean (GRPO's original).
    SeqMean,
    /// Dr. GRPO's constant normalisation: the sum of every sequence's token losses divided by
    /// the number of sequences times a constant (`loss.lengthNormalizer`), so that neither
    /// long nor short answers are favoured.
    SeqMeanTokenSumNorm,
}

/// The policy loss.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct LossSpec {
    #[serde(default)]
    pub kind: LossKind,
    /// Lower clip range ε_low (ratio ≥ 1 − ε_low).
    #[serde(default = "default_eps_low")]
    #[schemars(range(min = 0.0, max = 1.0))]
    pub eps_low: f64,
    /// Upper clip range ε_high (ratio ≤ 1 + ε_high).
    #[serde(default = "default_eps_high")]
    #[schemars(range(min = 0.0, max = 10.0))]
    pub eps_high: f64,
    #[serde(default)]
    pub aggregation: Aggregation,
    /// The constant of `SeqMeanTokenSumNorm`, in tokens; the rollout's token budget
    /// (`rollout.maxTokens` × `rollout.maxTurns`) when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 16777216))]
    pub length_normalizer: Option<u32>,
    /// Weight of a KL penalty to the initial policy (the k3 estimator per sampled token,
    /// aggregated like the loss); 0 for none.
    #[serde(default)]
    #[schemars(range(min = 0.0, max = 100.0))]
    pub kl_coef: f64,
}

impl Default for LossSpec {
    fn default() -> Self {
        LossSpec {
            kind: LossKind::default(),
            eps_low: default_eps_low(),
            eps_high: default_eps_high(),
            aggregation: Aggregation::default(),
            length_normalizer: None,
            kl_coef: 0.0,
        }
    }
}

/// What the importance-sampling gate compares with its thresholds.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum IsLevel {
    /// u = ρ_t per token.
    Token,
    /// u = Π ρ_t over the sequence.
    Seq,
    /// u = exp(mean log ρ_t) over the sequence.
    Geo,
}

/// What the gate does with tokens outside the thresholds.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum IsMode {
    /// coef_t = ρ_t if low ≤ u ≤ high, else 0.
    Mask,
    /// coef = clamp(u, low, high).
    Clip,
    /// coef = min(u, high).
    Trunc,
}

/// Off-policy importance-sampling correction (Molt's level × mode scheme, docs/algorithms.md).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("self.level == 'Token' || self.mode == 'Mask'").message(
    "isCorrection.level Seq and Geo are sequence-level gates: they need isCorrection.mode Mask"
))]
#[x_kube(validation = Rule::new("self.mode == 'Trunc' || has(self.low)").message(
    "isCorrection.mode Mask and Clip need both isCorrection.low and isCorrection.high"
))]
#[x_kube(validation = Rule::new("self.mode != 'Trunc' || !has(self.low)").message(
    "isCorrection.mode Trunc uses only isCorrection.high: remove isCorrection.low"
))]
#[x_kube(validation = Rule::new("!has(self.low) || self.low < self.high").message(
    "isCorrection.low must be smaller than isCorrection.high"
))]
#[x_kube(validation = Rule::new("self.high > 0.0").message(
    "isCorrection.high must be greater than 0"
))]
pub struct IsCorrectionSpec {
    pub level: IsLevel,
    pub mode: IsMode,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0.0))]
    pub low: Option<f64>,
    #[schemars(range(min = 0.0))]
    pub high: f64,
}

/// The optimizer (AdamW).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct OptimizerSpec {
    #[serde(default = "default_lr")]
    #[schemars(range(min = 0.0, max = 1.0))]
    pub learning_rate: f64,
    #[serde(default)]
    #[schemars(range(min = 0.0, max = 1.0))]
    pub weight_decay: f64,
    /// Gradients are clipped to this global norm, 1.0 unless set; 0 turns clipping off.
    #[serde(default = "default_max_grad_norm")]
    #[schemars(range(min = 0.0))]
    pub max_grad_norm: f64,
    /// Steps of linear learning-rate warm-up.
    #[serde(default)]
    #[schemars(range(max = 10000000))]
    pub warmup_steps: u32,
    /// How the learning rate falls after the warm-up: `Constant` unless set.
    #[serde(default)]
    pub decay: LrDecay,
    /// Where `Linear` and `Cosine` decay end at `totalSteps`, as a fraction of `learningRate`
    /// (0 unless set).
    #[serde(default)]
    #[schemars(range(min = 0.0, max = 1.0))]
    pub min_learning_rate_ratio: f64,
}

/// How the learning rate falls after the warm-up (`algorithm.optimizer.decay`).
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum LrDecay {
    /// Stays at `learningRate`.
    #[default]
    Constant,
    /// Falls in a straight line to `minLearningRateRatio` × `learningRate` at `totalSteps`.
    Linear,
    /// Falls along a half cosine to `minLearningRateRatio` × `learningRate` at `totalSteps`.
    Cosine,
}

impl OptimizerSpec {
    /// The norm gradients are clipped to; none when `maxGradNorm` is 0.
    pub fn clip_norm(&self) -> Option<f64> {
        (self.max_grad_norm > 0.0).then_some(self.max_grad_norm)
    }
}

impl Default for OptimizerSpec {
    fn default() -> Self {
        OptimizerSpec {
            learning_rate: default_lr(),
            weight_decay: 0.0,
            max_grad_norm: default_max_grad_norm(),
            warmup_steps: 0,
            decay: LrDecay::Constant,
            min_learning_rate_ratio: 0.0,
        }
    }
}

/// The RL algorithm.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!(self.estimator in ['GRPO', 'DrGRPO', 'RLOO']) || self.groupSize >= 2").message(
    "GRPO, DrGRPO and RLOO compare samples of one prompt: algorithm.groupSize must be at least 2"
))]
#[x_kube(validation = Rule::new("!has(self.dynamicSampling) || self.groupSize >= 2").message(
    "algorithm.dynamicSampling drops groups whose rewards are all equal: algorithm.groupSize must be at least 2"
))]
#[x_kube(validation = Rule::new("self.estimator != 'OnPolicyDistillation' || has(self.teacher)").message(
    "algorithm.estimator OnPolicyDistillation learns from a teacher: set algorithm.teacher.path"
))]
pub struct AlgorithmSpec {
    #[serde(default)]
    pub estimator: Estimator,
    /// Samples per prompt.
    #[serde(default = "default_group_size")]
    #[schemars(range(min = 1, max = 1024))]
    pub group_size: u32,
    /// Prompts (groups) per training step.
    #[serde(default = "default_batch_size")]
    #[schemars(range(min = 1, max = 65536))]
    pub batch_size: u32,
    /// Policy versions a trajectory's oldest token may lag behind the trainer; 0 is on-policy.
    #[serde(default = "one_u32")]
    #[schemars(range(max = 64))]
    pub max_staleness: u32,
    /// Keep unfinished generations across weight updates (pause `keep`) instead of aborting them.
    #[serde(default = "yes")]
    pub partial_rollout: bool,
    #[serde(default)]
    pub loss: LossSpec,
    /// Off-policy correction; none when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub is_correction: Option<IsCorrectionSpec>,
    #[serde(default)]
    pub optimizer: OptimizerSpec,
    /// The teacher of on-policy distillation (estimator OnPolicyDistillation): it scores every
    /// token the student sampled, and the advantage is its logprob minus the student's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub teacher: Option<TeacherSpec>,
    /// DAPO's overlong reward shaping: a penalty added to the reward of episodes that sample
    /// more tokens than `maxTokens − bufferTokens`; none when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub overlong: Option<OverlongSpec>,
    /// DAPO's dynamic sampling: groups whose rewards are all equal (they carry no learning
    /// signal under a group baseline) are dropped and more are generated until the batch is
    /// full; off when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dynamic_sampling: Option<DynamicSamplingSpec>,
}

/// Dynamic sampling's bound on extra generation.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DynamicSamplingSpec {
    /// Finished groups a step may look at before it stops dropping equal-reward groups and
    /// takes them as they come (so a run whose tasks are all solved, or all failed, never
    /// stalls); 4 × `batchSize` when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 1048576))]
    pub max_groups_per_step: Option<u32>,
}

/// DAPO's soft overlong punishment (Yu et al. 2025): for an episode of L sampled tokens, with
/// L_max = `maxTokens` and buffer B = `bufferTokens`, the reward gains 0 when L ≤ L_max − B,
/// `factor · (L_max − B − L) / B` (from 0 down to −factor) when L_max − B < L ≤ L_max, and
/// −factor beyond.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!has(self.maxTokens) || self.bufferTokens <= self.maxTokens").message(
    "algorithm.overlong.bufferTokens must be at most algorithm.overlong.maxTokens"
))]
pub struct OverlongSpec {
    /// Where the penalty starts, in tokens before the maximum.
    #[schemars(range(min = 1, max = 16777216))]
    pub buffer_tokens: u32,
    /// L_max; the rollout's token budget (`rollout.maxTokens` × `rollout.maxTurns`) when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 16777216))]
    pub max_tokens: Option<u32>,
    /// The largest penalty.
    #[serde(default = "one_f64")]
    #[schemars(range(min = 0.0, max = 1000.0))]
    pub factor: f64,
}

/// A teacher model for on-policy distillation: a Hugging Face folder with the student's
/// tokenizer.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = claim_rule("algorithm.teacher.claimName"))]
pub struct TeacherSpec {
    /// Path of the checkpoint folder inside the pods: under `/teacher` when `claimName` is set.
    #[schemars(length(min = 1, max = 4096))]
    pub path: String,
    /// PersistentVolumeClaim holding the checkpoint, mounted read-only at `/teacher`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub claim_name: Option<String>,
    /// Serve the teacher from engines of its own instead of loading it in the trainer: on a
    /// cluster the `<run>-teacher` StatefulSet of this many replicas (`engines.backend`, with
    /// `engines`' image and resources), locally one built-in engine. They score every token of a
    /// batch (prompt logprobs, at temperature 1: `rollout.temperature` must be 1) before the
    /// trainer learns from it, so the teacher need not fit beside the trainer. Unset: the trainer
    /// loads the teacher.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 64))]
    pub replicas: Option<i32>,
}

/// LLM-as-judge rewards: a judge model (served by engines of its own: on a cluster the
/// `<run>-judge` StatefulSet, of `engines.backend` with `engines`' image and resources) reads a
/// prompt made from the task and the agent's final reply and answers with a score. Each
/// episode's reward is `agentWeight` × (the agent's own reward) + `weight` × (the judge's score).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = claim_rule("judge.claimName"))]
#[x_kube(validation = Rule::new("self.prompt.contains('{response}')").message(
    "judge.prompt must contain {response}: the judge has to see the agent's reply"
))]
#[x_kube(validation = Rule::new("self.weight > 0.0 || self.agentWeight > 0.0").message(
    "judge.weight and judge.agentWeight are both 0: every reward would be 0; raise one of them"
))]
pub struct JudgeSpec {
    /// Path of the judge's checkpoint folder (a Hugging Face folder with its own tokenizer and
    /// chat template) inside the pods: under `/judge` when `claimName` is set (under `/models`
    /// when it is `model.claimName`).
    #[schemars(length(min = 1, max = 4096))]
    pub path: String,
    /// PersistentVolumeClaim holding the judge's checkpoint, mounted read-only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub claim_name: Option<String>,
    /// Judge engines on a cluster (the coordinator spreads a step's questions over them).
    #[serde(default = "one")]
    #[schemars(range(min = 1, max = 64))]
    pub replicas: i32,
    /// What the judge is asked, as one user message. Placeholders: `{response}` (the agent's
    /// final reply text, required), `{task}` (the task as JSON) and `{task.FIELD}` (a top-level
    /// field of the task: a string as it is, anything else as JSON). The judge answers with a
    /// number (the first one in its reply, clamped to [0, 1]) or with yes/no (1/0); any other
    /// answer scores 0.
    #[schemars(length(min = 1, max = 65536))]
    pub prompt: String,
    /// Weight of the judge's score in the reward.
    #[serde(default = "default_weight")]
    #[schemars(range(min = 0.0, max = 1000.0))]
    pub weight: f64,
    /// Weight of the agent's own reward (the environment's or the agent program's); 0 trains on
    /// the judge alone (the agent's reward is still reported in the metrics).
    #[serde(default = "default_weight")]
    #[schemars(range(min = 0.0, max = 1000.0))]
    pub agent_weight: f64,
    /// Tokens the judge may generate for its answer.
    #[serde(default = "default_judge_max_tokens")]
    #[schemars(range(min = 1, max = 4096))]
    pub max_tokens: u32,
}

impl Default for AlgorithmSpec {
    fn default() -> Self {
        AlgorithmSpec {
            estimator: Estimator::default(),
            group_size: default_group_size(),
            batch_size: default_batch_size(),
            max_staleness: 1,
            partial_rollout: true,
            loss: LossSpec::default(),
            is_correction: None,
            optimizer: OptimizerSpec::default(),
            teacher: None,
            overlong: None,
            dynamic_sampling: None,
        }
    }
}

/// Sampling of rollouts.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("self.topP > 0.0 && self.topP <= 1.0").message(
    "rollout.topP must be greater than 0 and at most 1"
))]
#[x_kube(validation = Rule::new("self.temperature > 0.0").message(
    "rollout.temperature must be greater than 0: training samples from the policy (1.0 is usual)"
))]
pub struct RolloutSpec {
    /// Tokens generated per turn at most.
    #[serde(default = "default_max_tokens")]
    #[schemars(range(min = 1, max = 16777216))]
    pub max_tokens: u32,
    #[serde(default = "default_temperature")]
    #[schemars(range(min = 0.0, max = 10.0))]
    pub temperature: f64,
    #[serde(default = "default_top_p")]
    pub top_p: f64,
    /// Model turns per episode at most (an agent pod's loopback server allows 1024 per session).
    #[serde(default = "one_u32")]
    #[schemars(range(min = 1, max = 1024))]
    pub max_turns: u32,
}

impl Default for RolloutSpec {
    fn default() -> Self {
        RolloutSpec {
            max_tokens: default_max_tokens(),
            temperature: default_temperature(),
            top_p: default_top_p(),
            max_turns: 1,
        }
    }
}

/// Evaluation during training: every `intervalSteps` steps (and before the first, and after the
/// last) each held-out task runs `samples` times through the run's agents and engines with the
/// policy of that step, and is never trained on. An episode passes when its reward is at least
/// `passReward`; a task passes (pass@k, k = `samples`) when any of its episodes does.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!has(self.temperature) || self.temperature >= 0.0").message(
    "eval.temperature must be 0 (greedy) or more"
))]
pub struct EvalSpec {
    /// The held-out tasks, in the form of `agent.dataset`.
    pub dataset: DatasetSpec,
    /// Training steps between evaluations.
    #[serde(default = "default_eval_interval")]
    #[schemars(range(min = 1, max = 1000000))]
    pub interval_steps: u32,
    /// Episodes per task: the k of pass@k.
    #[serde(default = "one_u32")]
    #[schemars(range(min = 1, max = 1024))]
    pub samples: u32,
    /// Sampling temperature of evaluation episodes (0 is greedy); `rollout.temperature` when
    /// absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0.0, max = 10.0))]
    pub temperature: Option<f64>,
    /// Tokens generated per turn at most; `rollout.maxTokens` when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 16777216))]
    pub max_tokens: Option<u32>,
    /// The reward at which an episode counts as passed.
    #[serde(default = "one_f64")]
    #[schemars(range(min = -1000000.0, max = 1000000.0))]
    pub pass_reward: f64,
    /// Evaluate on the first this many tasks of the file only; all when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 10000000))]
    pub max_tasks: Option<u32>,
}

/// Checkpoints of model, optimizer, data cursor and policy version.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = claim_rule("checkpoint.claimName"))]
pub struct CheckpointSpec {
    /// PersistentVolumeClaim the trainer writes checkpoints to, mounted at `/checkpoints`.
    #[schemars(length(min = 1, max = 253))]
    pub claim_name: String,
    /// Training steps between checkpoints.
    #[serde(default = "default_checkpoint_interval")]
    #[schemars(range(min = 1, max = 1000000))]
    pub interval_steps: u32,
}

/// Placement of the run's pods.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema, Default)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new(format!("!has(self.nodeSelector) || self.nodeSelector.all(k, k.matches('{LABEL_KEY}') && size(k.split('/')[size(k.split('/')) - 1]) <= 63 && self.nodeSelector[k].matches('{LABEL_VALUE}') && size(self.nodeSelector[k]) <= 63)")).message(
    "scheduling.nodeSelector must map label keys (an optional DNS prefix and '/', then at most 63 letters, digits, '-', '_' or '.') to label values (at most 63 of them)"
))]
#[x_kube(validation = Rule::new("!has(self.tolerations) || self.tolerations.all(t, has(t.key) && t.key != '' && !t.key.startsWith('node-role.kubernetes.io/'))").message(
    "scheduling.tolerations must each name a taint key, and none of node-role.kubernetes.io/ (control-plane nodes): a run may not tolerate every taint or run on the cluster's control plane"
))]
#[x_kube(validation = Rule::new(format!("!has(self.priorityClassName) || (self.priorityClassName.matches('{DNS_SUBDOMAIN}') && !self.priorityClassName.startsWith('system-'))")).message(
    "scheduling.priorityClassName must name a PriorityClass (lowercase letters, digits, '-' and '.') other than the system- ones, which are for the cluster's own components"
))]
#[x_kube(validation = Rule::new(format!("!has(self.queueName) || (size(self.queueName) <= 63 && self.queueName.matches('{LABEL_VALUE}'))")).message(
    "scheduling.queueName names a Kueue LocalQueue: at most 63 letters, digits, '-', '_' or '.', starting and ending with a letter or digit"
))]
pub struct SchedulingSpec {
    /// Node labels every GPU pod (engines, trainer) requires.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(extend("maxProperties" = 32))]
    pub node_selector: BTreeMap<String, String>,
    /// Tolerations of every pod of the run (each of a named taint; not of the control plane's).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32))]
    pub tolerations: Vec<Toleration>,
    /// PriorityClass of every pod of the run (not a `system-` one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub priority_class_name: Option<String>,
    /// Kueue LocalQueue the run waits in, as one Kueue Workload with a pod set per role: nothing
    /// starts until Kueue admits it (docs/operator.md, "Kueue"). The RLRun's
    /// `kueue.x-k8s.io/queue-name` label does the same.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 63))]
    pub queue_name: Option<String>,
}

/// Lifecycle phase of a run.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum Phase {
    /// Children created, not every pod ready yet.
    Pending,
    /// Every component has its pods ready.
    Running,
    /// Was running; some component lost ready pods.
    Degraded,
    /// `spec.suspend` is set: everything scaled to zero, state kept.
    Suspended,
    /// Waiting for Kueue to admit the run's Workload: no pod started (docs/operator.md, "Kueue").
    Queued,
    /// Kueue evicted the run's Workload (a preemption, ...): its pods stopped, the trainer
    /// checkpointed, and it waits to be admitted again.
    Preempted,
    /// Reached `totalSteps` (reported by the coordinator).
    Succeeded,
    /// The run cannot proceed (reported by the coordinator), or its spec cannot be turned into
    /// objects (see the conditions).
    Failed,
}

/// Observed state; the operator owns phase, conditions, engines and usage, the coordinator owns
/// policy version, step, metrics and checkpoint.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema, Default)]
#[serde(rename_all = "camelCase")]
pub struct RLRunStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<Phase>,
    /// Ready, Progressing, Degraded and Suspended.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// The `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engines: Option<EngineStatus>,
    /// Version of the weights the engines serve.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy_version: Option<u64>,
    /// Training steps done.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metrics: Option<RunMetrics>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_checkpoint: Option<CheckpointStatus>,
    /// What the run's pods used while they ran (docs/operator.md, "What a run costs").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
    /// The EnginePool of a run with `spec.engines.poolRef`: its name (the operator's) and the
    /// run's share of its engine time (the coordinator's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool: Option<RunPoolStatus>,
}

/// What a run's pods used: GPU- and CPU-seconds of the pods that ran, not of those asked for,
/// brought up to date at each reconcile (every pod change, and every minute while pods run).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Usage {
    /// GPU-hours of every role, as `kubectl get rlrun -o wide` prints them.
    pub gpu_hours: f64,
    /// By role: engines, trainer, coordinator, agents, and judge or teacher engines.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub roles: BTreeMap<String, RoleUsage>,
    /// When the totals were brought up to date.
    pub observed_at: Time,
}

/// One role's usage.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema, Default)]
#[serde(rename_all = "camelCase")]
pub struct RoleUsage {
    /// GPUs × seconds its pods ran (their `nvidia.com/gpu` or other `*/gpu` limits).
    pub gpu_seconds: f64,
    /// CPUs × seconds its pods ran (their CPU requests, else limits).
    pub cpu_seconds: f64,
    /// GPUs of its pods running at `observedAt`.
    pub gpus: f64,
    /// CPUs of its pods running at `observedAt`.
    pub cpus: f64,
}

/// Engine pods as the scale subresource reports them.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema, Default)]
#[serde(rename_all = "camelCase")]
pub struct EngineStatus {
    /// Engine pods that exist.
    pub replicas: i32,
    /// Engine pods that are ready.
    pub ready_replicas: i32,
    /// "ready/desired", as `kubectl get` prints it.
    pub ready: String,
    /// Label selector of the engine pods (for HPAs).
    pub selector: String,
}

/// Latest training metrics.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema, Default)]
#[serde(rename_all = "camelCase")]
pub struct RunMetrics {
    /// Mean reward of the latest step's trajectories.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reward: Option<f64>,
    /// Mean generated tokens per trajectory in the latest step.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub response_length: Option<f64>,
    /// Fraction of tokens the IS correction masked in the latest step.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub masked_fraction: Option<f64>,
    /// The newest evaluation on held-out tasks (`spec.eval`): the step whose policy it
    /// measured, its mean reward and pass@k.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval_step: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval_reward: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval_pass_at_k: Option<f64>,
}

/// The newest complete checkpoint.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CheckpointStatus {
    pub step: u64,
    pub path: String,
    pub time: Time,
}

fn one() -> i32 {
    1
}
fn one_u32() -> u32 {
    1
}
fn one_f64() -> f64 {
    1.0
}
fn yes() -> bool {
    true
}
fn default_concurrency() -> u32 {
    8
}
fn default_gpus_per_node() -> u32 {
    8
}
fn default_eps_low() -> f64 {
    0.2
}
fn default_eps_high() -> f64 {
    0.28
}

fn default_max_grad_norm() -> f64 {
    1.0
}

fn default_lr() -> f64 {
    1e-6
}
fn default_group_size() -> u32 {
    8
}
fn default_batch_size() -> u32 {
    32
}
fn default_max_tokens() -> u32 {
    4096
}
fn default_temperature() -> f64 {
    1.0
}
fn default_top_p() -> f64 {
    1.0
}
fn default_checkpoint_interval() -> u32 {
    50
}
fn default_weight() -> f64 {
    1.0
}
fn default_eval_interval() -> u32 {
    10
}
fn default_judge_max_tokens() -> u32 {
    8
}

#[cfg(all(test, feature = "validate"))]
mod tests;
