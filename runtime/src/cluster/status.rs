//! The coordinator's part of the RLRun's status (the operator owns phase, conditions and
//! engines): step, policy version, headline metrics and the last checkpoint, and the phase
//! `Succeeded` once the last step is committed, written by
//! server-side apply under the field manager `moult-coordinator`, with RBAC that allows only its
//! own RLRun's status. Writes happen off the training path: the newest report replaces one not yet
//! written, so a slow API server never holds up a step.

use kube::api::{Patch, PatchParams};
use kube::{Api, Client, Resource};
use moult_operator::api::{CheckpointStatus, Phase, RLRun, RunMetrics};
use serde::Serialize;
use serde_json::json;
use tokio::sync::watch;

/// The field manager of the coordinator's status writes.
pub const FIELD_MANAGER: &str = "moult-coordinator";

/// One report of where the run stands: the coordinator's fields of the RLRun's status.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Report {
    /// `Succeeded` once the last step is committed (which the operator keeps).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub phase: Option<Phase>,
    pub policy_version: u64,
    pub step: u64,
    pub metrics: RunMetrics,
    /// The newest checkpoint, and when the coordinator heard of it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_checkpoint: Option<CheckpointStatus>,
}

/// The status patch of `report`.
pub fn patch_body(report: &Report) -> serde_json::Value {
    json!({
        "apiVersion": RLRun::api_version(&()),
        "kind": RLRun::kind(&()),
        "status": report,
    })
}

/// The coordinator's part of the RLRun's status as it stands (a coordinator that restarted goes
/// on from it); empty if there is none or it cannot be read.
pub async fn read(client: Client, namespace: &str, name: &str) -> Report {
    let api: Api<RLRun> = Api::namespaced(client, namespace);
    match api.get_status(name).await {
        Ok(run) => {
            let s = run.status.unwrap_or_default();
            Report {
                phase: None,
                policy_version: s.policy_version.unwrap_or(0),
                step: s.step.unwrap_or(0),
                metrics: s.metrics.unwrap_or_default(),
                last_checkpoint: s.last_checkpoint,
            }
        }
        Err(e) => {
            tracing::warn!(run = %name, "reading the RLRun's status: {e}");
            Report::default()
        }
    }
}

/// Writes the newest report to the RLRun `name` in `namespace` whenever one arrives; a write
/// that fails is retried until it succeeds or a newer report supersedes it.
pub async fn write_reports(
    client: Client,
    namespace: String,
    name: String,
    mut reports: watch::Receiver<Report>,
) {
    let api: Api<RLRun> = Api::namespaced(client, &namespace);
    let params = PatchParams::apply(FIELD_MANAGER).force();
    let what = format!("writing the status of RLRun {name}");
    while reports.changed().await.is_ok() {
        let body = patch_body(&reports.borrow_and_update());
        let patch = Patch::Apply(&body);
        let write = super::retry(&what, || api.patch_status(&name, &params, &patch));
        tokio::select! {
            _ = write => {}
            _ = reports.changed() => reports.mark_changed(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    #[test]
    fn the_patch_holds_only_the_coordinators_fields() {
        let body = patch_body(&Report {
            step: 3,
            policy_version: 4,
            metrics: RunMetrics {
                reward: Some(0.5),
                response_length: Some(12.0),
                masked_fraction: None,
                ..RunMetrics::default()
            },
            last_checkpoint: None,
            phase: None,
        });
        assert_eq!(body["kind"], "RLRun");
        let status = body["status"].as_object().unwrap();
        let keys: Vec<&str> = status.keys().map(String::as_str).collect();
        assert_eq!(keys, ["policyVersion", "step", "metrics"]);
        assert_eq!(status["metrics"]["reward"], 0.5);
        assert!(status["metrics"].get("maskedFraction").is_none());
        // After the last step: the phase too, and the checkpoint.
        let time = Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH);
        let done = patch_body(&Report {
            step: 9,
            policy_version: 9,
            metrics: RunMetrics::default(),
            last_checkpoint: Some(CheckpointStatus {
                step: 9,
                path: "/checkpoints/r/step-000009".into(),
                time,
            }),
            phase: Some(Phase::Succeeded),
        });
        assert_eq!(done["status"]["phase"], "Succeeded");
        assert_eq!(done["status"]["lastCheckpoint"]["step"], 9);
        assert_eq!(
            done["status"]["lastCheckpoint"]["path"],
            "/checkpoints/r/step-000009"
        );
    }
}
