//! The `EnginePool` custom resource (`moult.dev/v1alpha1`): one set of built-in engines on a
//! base model that many LoRA runs share (docs/operator.md, "Engine pools"). A run joins a pool
//! with `spec.engines.poolRef`; each run brings its own adapter, which the pool's engines hold
//! beside the others' (at most `maxAdapters` at once per engine), and each run reaches them with a
//! credential of its own derived from the pool's token (`credentials::pool_credential`).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{EnginesSpec, ModelSpec};

/// Built-in engines on one base model, shared by the LoRA runs that name the pool in
/// `spec.engines.poolRef`.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "moult.dev",
    version = "v1alpha1",
    kind = "EnginePool",
    plural = "enginepools",
    singular = "enginepool",
    shortname = "epool",
    category = "moult",
    namespaced,
    status = "EnginePoolStatus",
    derive = "PartialEq",
    doc = "Built-in inference engines on one base model, shared by many LoRA runs (each run brings its own adapter).",
    scale(
        spec_replicas_path = ".spec.engines.replicas",
        status_replicas_path = ".status.replicas",
        label_selector_path = ".status.selector"
    ),
    printcolumn(
        name = "Ready",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Ready\")].status"
    ),
    printcolumn(
        name = "Engines",
        type_ = "string",
        description = "ready/desired engine replicas",
        json_path = ".status.ready"
    ),
    printcolumn(
        name = "Runs",
        type_ = "string",
        description = "the runs on the pool",
        json_path = ".status.runNames"
    ),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp"),
    printcolumn(
        name = "Reason",
        type_ = "string",
        description = "why the pool is not ready",
        json_path = ".status.conditions[?(@.type==\"Ready\")].reason",
        priority = "1"
    ),
    printcolumn(
        name = "Message",
        type_ = "string",
        description = "the Ready condition's message",
        json_path = ".status.conditions[?(@.type==\"Ready\")].message",
        priority = "1"
    ),
    validation = Rule::new("size(self.metadata.name) <= 40").message(
        "EnginePool names are at most 40 characters: the names of its engines and their pods add suffixes"
    ),
    validation = Rule::new("self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')").message(
        "EnginePool names start with a lowercase letter and hold only lowercase letters, digits and '-' (no '.'): they name the pool's Service"
    ),
)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!has(self.model.lora)").message(
    "model.lora: an EnginePool serves the base model; each run brings its own adapter (docs/lora.md)"
))]
#[x_kube(validation = Rule::new("self.engines.backend == 'Builtin'").message(
    "engines.backend: an EnginePool runs moult's built-in engine, which holds many runs' adapters at once; vLLM pools are not supported yet: set engines.backend Builtin (docs/lora.md)"
))]
#[x_kube(validation = Rule::new("!has(self.engines.poolRef) && !has(self.engines.weightTransfer)").message(
    "engines.poolRef and engines.weightTransfer are a run's fields: an EnginePool's engines are its own, and each run sends its adapter to them (docs/lora.md)"
))]
pub struct EnginePoolSpec {
    /// The base model the engines serve (`lora` is each run's, not the pool's).
    pub model: ModelSpec,
    /// The engines: `replicas` (what `kubectl scale enginepool/NAME --replicas=N` changes),
    /// `backend` (Builtin only, for now), `image`, `gpusPerEngine`, `resources` and `extraArgs`
    /// (`moult engine`'s flags).
    pub engines: EnginesSpec,
    /// Adapters one engine holds at once: a run needs two while it switches versions, so half
    /// of this many runs share an engine at full speed.
    #[serde(default = "default_max_adapters")]
    #[schemars(range(min = 1, max = 64))]
    pub max_adapters: u32,
    /// The largest LoRA rank (`model.lora.rank`) a run on the pool may train: engines size
    /// their adapter slots by it.
    #[serde(default = "default_max_rank")]
    #[schemars(range(min = 1, max = 512))]
    pub max_rank: u32,
}

fn default_max_adapters() -> u32 {
    8
}

fn default_max_rank() -> u32 {
    64
}

/// Observed state, written by the operator.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema, Default)]
#[serde(rename_all = "camelCase")]
pub struct EnginePoolStatus {
    /// Engine pods that are ready (the scale subresource's replicas).
    #[serde(default)]
    pub replicas: i32,
    /// "ready/desired", as `kubectl get` prints it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready: Option<String>,
    /// Label selector of the engine pods (for HPAs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<String>,
    /// The runs whose `spec.engines.poolRef` names the pool, by name.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub runs: Vec<PoolRun>,
    /// The runs' names, comma-separated, as `kubectl get` prints them (a column shows one value
    /// of a list only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_names: Option<String>,
    /// Ready, and Deleting while the pool waits for the runs that still name it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// The `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}

/// A run on the pool.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PoolRun {
    pub name: String,
    /// The run's share of the pool's engine time, a fraction from 0 to 1, as the run's
    /// coordinator reports it (`status.pool.share` of the run); absent until it does.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0.0, max = 1.0))]
    pub share: Option<f64>,
}

/// `spec.engines.poolRef` of a run: the EnginePool, in the run's namespace, whose engines serve
/// the run.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, KubeSchema)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("self.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')").message(
    "engines.poolRef.name names an EnginePool: lowercase letters, digits and '-', starting with a letter"
))]
pub struct PoolRef {
    /// The EnginePool's name.
    #[schemars(length(min = 1, max = 40))]
    pub name: String,
}

/// A run's place on its pool (`status.pool`).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RunPoolStatus {
    /// The EnginePool (written by the operator; not required, so that the coordinator's write of
    /// `share` never waits for it).
    #[serde(default)]
    pub name: String,
    /// The run's share of the pool's engine time, a fraction from 0 to 1 (written by the run's
    /// coordinator).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0.0, max = 1.0))]
    pub share: Option<f64>,
}

#[cfg(all(test, feature = "validate"))]
mod tests;
