//! The coordinator's part of the RLRun's status (the operator owns phase, conditions and
//! engines): step, policy version, headline metrics and the last checkpoint, and the phase
//! `Succeeded` once the last step is committed, written by
//! server-side apply under the field manager `moult-coordinator`, with RBAC that allows only its
//! own RLRun's status. Writes happen off the training path: the newest report replaces one not yet
//! written, so a slow API server never holds up a step.
//!
//! A report is the operator's own [`RLRunStatus`] holding only the coordinator's fields (the rest
//! unset, so not claimed): `Succeeded` as `phase` once the last step is committed (which the
//! operator keeps), and the newest checkpoint with the time the trainer wrote it.

use kube::api::{Patch, PatchParams};
use kube::{Api, Client, Resource};
use moult_operator::api::{RLRun, RLRunStatus};
use serde_json::json;
use tokio::sync::watch;

/// The field manager of the coordinator's status writes.
pub const FIELD_MANAGER: &str = "moult-coordinator";

/// The status patch of `report`.
pub fn patch_body(report: &RLRunStatus) -> serde_json::Value {
    json!({
        "apiVersion": RLRun::api_version(&()),
        "kind": RLRun::kind(&()),
        "status": report,
    })
}

/// The coordinator's part of the RLRun's status as it stands (a coordinator that restarted goes
/// on from it), each of its fields set (zero, empty) where there is none or it cannot be read.
pub async fn read(client: Client, namespace: &str, name: &str) -> RLRunStatus {
    let api: Api<RLRun> = Api::namespaced(client, namespace);
    let s = match api.get_status(name).await {
        Ok(run) => run.status.unwrap_or_default(),
        Err(e) => {
            tracing::warn!(run = %name, "reading the RLRun's status: {e}");
            RLRunStatus::default()
        }
    };
    RLRunStatus {
        policy_version: Some(s.policy_version.unwrap_or(0)),
        step: Some(s.step.unwrap_or(0)),
        metrics: Some(s.metrics.unwrap_or_default()),
        last_checkpoint: s.last_checkpoint,
        ..RLRunStatus::default()
    }
}

/// Writes the newest report to the RLRun `name` in `namespace` whenever one arrives; a write
/// that fails is retried until it succeeds or a newer report supersedes it.
pub async fn write_reports(
    client: Client,
    namespace: String,
    name: String,
    mut reports: watch::Receiver<RLRunStatus>,
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
    use moult_operator::api::{CheckpointStatus, Phase, RunMetrics};

    #[test]
    fn the_patch_holds_only_the_coordinators_fields() {
        let body = patch_body(&RLRunStatus {
            step: Some(3),
            policy_version: Some(4),
            metrics: Some(RunMetrics {
                reward: Some(0.5),
                response_length: Some(12.0),
                masked_fraction: None,
                ..RunMetrics::default()
            }),
            ..RLRunStatus::default()
        });
        assert_eq!(body["kind"], "RLRun");
        let status = body["status"].as_object().unwrap();
        let keys: Vec<&str> = status.keys().map(String::as_str).collect();
        assert_eq!(keys, ["policyVersion", "step", "metrics"]);
        assert_eq!(status["metrics"]["reward"], 0.5);
        assert!(status["metrics"].get("maskedFraction").is_none());
        // After the last step: the phase too, and the checkpoint.
        let time = Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH);
        let done = patch_body(&RLRunStatus {
            step: Some(9),
            policy_version: Some(9),
            metrics: Some(RunMetrics::default()),
            last_checkpoint: Some(CheckpointStatus {
                step: 9,
                path: "/checkpoints/r/step-000009".into(),
                time,
            }),
            phase: Some(Phase::Succeeded),
            ..RLRunStatus::default()
        });
        assert_eq!(done["status"]["phase"], "Succeeded");
        assert_eq!(done["status"]["lastCheckpoint"]["step"], 9);
        assert_eq!(
            done["status"]["lastCheckpoint"]["path"],
            "/checkpoints/r/step-000009"
        );
    }
}
