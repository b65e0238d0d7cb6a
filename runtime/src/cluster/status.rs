//! The coordinator's part of the RLRun's status (the operator owns phase, conditions and
//! engines): step, policy version, headline metrics and the last checkpoint, and the phase
//! `Succeeded` once the last step is committed, written by
//! server-side apply under the field manager `moult-coordinator`, with RBAC that allows only its
//! own RLRun's status. Writes happen off the training path: the newest report replaces one not yet
//! written, so a slow API server never holds up a step.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{Patch, PatchParams};
use kube::{Api, Client, Resource};
use moult_operator::api::{CheckpointStatus, RLRun, RunMetrics};
use serde_json::json;
use tokio::sync::watch;

/// The field manager of the coordinator's status writes.
pub const FIELD_MANAGER: &str = "moult-coordinator";

/// One report of where the run stands.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Report {
    pub step: u64,
    pub policy_version: u64,
    pub metrics: RunMetrics,
    /// Step and path of the newest checkpoint, and when the coordinator heard of it.
    pub checkpoint: Option<(u64, String, Time)>,
    /// The last step is committed: the run's phase becomes `Succeeded` (which the operator keeps).
    pub succeeded: bool,
}

/// The status patch of `report` (only the coordinator's fields).
pub fn patch_body(report: &Report) -> serde_json::Value {
    let mut status = json!({
        "policyVersion": report.policy_version,
        "step": report.step,
        "metrics": report.metrics,
    });
    if report.succeeded {
        status["phase"] = json!("Succeeded");
    }
    if let Some((step, path, time)) = &report.checkpoint {
        status["lastCheckpoint"] = serde_json::to_value(CheckpointStatus {
            step: *step,
            path: path.clone(),
            time: time.clone(),
        })
        .expect("a checkpoint status serializes");
    }
    json!({
        "apiVersion": RLRun::api_version(&()),
        "kind": RLRun::kind(&()),
        "status": status,
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
                step: s.step.unwrap_or(0),
                policy_version: s.policy_version.unwrap_or(0),
                metrics: s.metrics.unwrap_or_default(),
                checkpoint: s.last_checkpoint.map(|c| (c.step, c.path, c.time)),
                succeeded: false,
            }
        }
        Err(e) => {
            tracing::warn!(run = %name, "reading the RLRun's status: {e}");
            Report::default()
        }
    }
}

/// Writes the newest report to the RLRun `name` in `namespace` whenever one arrives.
pub async fn write_reports(
    client: Client,
    namespace: String,
    name: String,
    mut reports: watch::Receiver<Report>,
) {
    let api: Api<RLRun> = Api::namespaced(client, &namespace);
    let params = PatchParams::apply(FIELD_MANAGER).force();
    while reports.changed().await.is_ok() {
        let report = reports.borrow_and_update().clone();
        let body = patch_body(&report);
        let mut wait = std::time::Duration::from_millis(500);
        loop {
            match api.patch_status(&name, &params, &Patch::Apply(&body)).await {
                Ok(_) => break,
                Err(e) => {
                    tracing::warn!(run = %name, "writing the RLRun's status: {e}; retrying");
                    tokio::time::sleep(wait).await;
                    wait = (wait * 2).min(std::time::Duration::from_secs(10));
                    // A newer report supersedes this one.
                    if reports.has_changed().unwrap_or(false) {
                        break;
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
            checkpoint: None,
            succeeded: false,
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
            checkpoint: Some((9, "/checkpoints/r/step-000009".into(), time)),
            succeeded: true,
        });
        assert_eq!(done["status"]["phase"], "Succeeded");
        assert_eq!(done["status"]["lastCheckpoint"]["step"], 9);
        assert_eq!(
            done["status"]["lastCheckpoint"]["path"],
            "/checkpoints/r/step-000009"
        );
    }
}
