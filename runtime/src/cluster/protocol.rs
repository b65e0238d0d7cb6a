//! What the roles of a cluster run say to the coordinator (JSON over HTTP, with the run's token).
//!
//! | call | from | what |
//! | --- | --- | --- |
//! | `POST /v1/agents/lease` | agents | the next episode to run ([`Lease`]); 204 after a wait with none |
//! | `POST /v1/agents/renew` | agents | the leases ([`Leases`]) still running: they last another lease time; answers `{"unknown": [...]}` |
//! | `POST /v1/agents/episodes/{lease}` | agents | the finished [`Episode`]; `{"accepted": false}` for an expired lease |
//! | `POST /v1/trainer/hello` | trainer | ([`Hello`]) the step it resumed at; answers the version to publish its weights as |
//! | `GET /v1/trainer/batch?step=N` | trainer | the groups of step N ([`StepBatch`](crate::stages::StepBatch)); 204 while not ready; the same batch until N is committed; 409 if N is not next or no hello was heard yet (say hello again) |
//! | `POST /v1/trainer/version` | trainer | a new policy version number ([`Version`]) for the weights about to go out |
//! | `POST /v1/trainer/published` | trainer | ([`Version`]) the engines serve this version now |
//! | `POST /v1/trainer/commit` | trainer | ([`Commit`]) step N done: metrics, version, checkpoint |
//! | `POST /v1/trainer/quarantine` | trainer | ([`Quarantined`]) step N's batch was set aside: the next batch request draws another |
//! | `GET /v1/status` | anyone with the token | [`CoordinatorStatus`] |
//!
//! Policy versions are issued by the coordinator, one per publication, so they only increase even
//! when a restarted trainer publishes its checkpoint's weights again.

use moult_operator::api::CheckpointStatus;
use serde::{Deserialize, Serialize};
use serde_json::Value as Json;

pub use crate::agents::Episode;
use crate::chat::SamplingOverride;
use crate::records::metrics::StepRecord;
use crate::rollout::eval::EvalResult;
use crate::rollout::{EpisodeLimits, RolloutState, RolloutStats};

/// An episode for an agent pod to run.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Lease {
    /// The lease's id: 128 random bits in hex, so no other pod can guess it.
    pub lease: String,
    /// The episode's index in the run (names its session).
    pub index: usize,
    pub task: Json,
    /// Sampling that replaces the agent's own in every turn (an evaluation episode).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sampling: Option<SamplingOverride>,
}

/// The leases of the episodes an agent pod still runs.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Leases {
    pub leases: Vec<String>,
}

/// What the trainer says when it starts.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Hello {
    /// The step of the checkpoint it resumed from (0: none).
    pub step: u64,
    /// Where the data stood at its last batch (or checkpoint): a coordinator that restarted
    /// (and so lost its cursor) continues from there.
    pub rollout: Option<RolloutState>,
    /// The policy's vocabulary size and positions: the coordinator (which has no model folder)
    /// refuses episodes outside them from then on (docs/security.md, "Bad data").
    #[serde(flatten)]
    pub limits: EpisodeLimits,
}

/// The answer to [`Hello`].
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct HelloReply {
    /// Publish your weights as this version before training (`None`: the engines already serve
    /// them, a fresh run).
    pub publish_as: Option<u64>,
}

/// A policy version number.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct Version {
    pub version: u64,
}

/// Step N is trained and published.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Commit {
    pub step: u64,
    pub version: u64,
    pub record: StepRecord,
    /// The checkpoint written after the step, if one was due, and when.
    pub checkpoint: Option<CheckpointStatus>,
}

/// The trainer could not learn from the batch of `step` (docs/security.md, "Bad data").
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Quarantined {
    pub step: u64,
    pub error: String,
}

/// Counts of the queue of episodes for agent pods ([`super::remote`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoteStats {
    /// Episodes waiting for an agent, and leased to one.
    pub episodes_waiting: usize,
    pub episodes_leased: usize,
    /// Leases that expired (their agent went silent) and were run again.
    pub leases_expired: u64,
    /// Episodes returned, and answers to unknown (expired or repeated) leases ignored.
    pub episodes_returned: u64,
    pub episodes_ignored: u64,
}

/// `GET /v1/status`: where the run stands, as the coordinator sees it.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct CoordinatorStatus {
    pub step: u64,
    pub total_steps: u64,
    pub policy_version: u64,
    pub reward: Option<f64>,
    pub last_checkpoint: Option<CheckpointStatus>,
    /// The data cursor: the next task to draw, and the epoch.
    pub data: RolloutState,
    pub rollout: RolloutStats,
    /// The queue of episodes for agent pods.
    #[serde(flatten)]
    pub agents: RemoteStats,
    /// The newest evaluation on held-out tasks (`spec.eval`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eval: Option<EvalResult>,
    pub trainer_restarts: u64,
    /// Agent requests answered 429, by limit of `spec.coordinator.agentLimits`: requests open,
    /// generations, episode bytes.
    #[serde(default)]
    pub agents_refused: [u64; 3],
}
