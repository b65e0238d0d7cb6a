//! What a run's pods used (pure): `status.usage`, GPU- and CPU-seconds per role (docs/operator.md,
//! "What a run costs").
//!
//! At each reconcile the totals advance by what ran since the last observation (the GPUs and CPUs
//! of the pods running then, times the seconds since), and what runs now is noted for the next.
//! A reconcile follows every pod change (the controller watches the run's pods), so what runs
//! between two observations is what ran at the first of them. A pod counts from the moment it is
//! `Running` until it is gone or ended, terminating included; a pod that waits (Pending, pulling
//! its image) or a suspended run counts nothing.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::ResourceExt;

use crate::api::Usage;
use crate::children::COMPONENT_LABEL;

/// The roles usage is counted for (pods' component labels; the engines' pods say `engine`).
pub const ROLES: [&str; 6] = [
    "engines",
    "trainer",
    "coordinator",
    "agents",
    "judge",
    "teacher",
];

/// How old the written totals may grow while the same pods run before they are written again.
pub const WRITE_EVERY: std::time::Duration = std::time::Duration::from_secs(60);

/// The usage at `now`: `old`'s totals advanced to `now` by what ran at its observation, and the
/// GPUs and CPUs of the `pods` running now.
pub fn advance(old: Option<&Usage>, pods: &[Pod], now: &Time) -> Usage {
    let mut roles = old.map(|u| u.roles.clone()).unwrap_or_default();
    if let Some(old) = old {
        let seconds = now
            .0
            .duration_since(old.observed_at.0)
            .as_secs_f64()
            .max(0.0);
        for role in roles.values_mut() {
            role.gpu_seconds += role.gpus * seconds;
            role.cpu_seconds += role.cpus * seconds;
        }
    }
    for role in roles.values_mut() {
        (role.gpus, role.cpus) = (0.0, 0.0);
    }
    for pod in pods.iter().filter(|p| running(p)) {
        let Some(role) = pod.labels().get(COMPONENT_LABEL) else {
            continue;
        };
        let role = if role == "engine" { "engines" } else { role };
        let (gpus, cpus) = requested(pod);
        let role = roles.entry(role.into()).or_default();
        role.gpus += gpus;
        role.cpus += cpus;
    }
    let gpu_seconds: f64 = roles.values().map(|r| r.gpu_seconds).sum();
    Usage {
        gpu_hours: (gpu_seconds / 3600.0 * 1000.0).round() / 1000.0,
        roles,
        observed_at: now.clone(),
    }
}

/// True when `new` is worth a status write: what runs changed, or `old` is [`WRITE_EVERY`] old
/// while something runs.
pub fn due(old: Option<&Usage>, new: &Usage) -> bool {
    let Some(old) = old else { return true };
    let rates = |u: &Usage| -> BTreeMap<String, (f64, f64)> {
        let running = u.roles.iter().filter(|(_, r)| r.gpus > 0.0 || r.cpus > 0.0);
        running
            .map(|(k, r)| (k.clone(), (r.gpus, r.cpus)))
            .collect()
    };
    let age = new.observed_at.0.duration_since(old.observed_at.0);
    let stale = age.as_secs_f64() >= WRITE_EVERY.as_secs_f64() && !rates(new).is_empty();
    rates(old) != rates(new) || stale
}

fn running(pod: &Pod) -> bool {
    pod.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
}

/// The GPUs (limits of any `*/gpu` resource) and CPUs (requests, else limits) of `pod`'s
/// containers.
fn requested(pod: &Pod) -> (f64, f64) {
    let containers = pod.spec.iter().flat_map(|s| &s.containers);
    let mut total = (0.0, 0.0);
    for r in containers.filter_map(|c| c.resources.as_ref()) {
        let (requests, limits) = (r.requests.as_ref(), r.limits.as_ref());
        let gpus = limits.iter().flat_map(|l| l.iter());
        total.0 += gpus
            .filter(|(k, _)| k.ends_with("/gpu"))
            .map(|(_, q)| amount(q))
            .sum::<f64>();
        let cpu = requests
            .and_then(|r| r.get("cpu"))
            .or(limits.and_then(|l| l.get("cpu")));
        total.1 += cpu.map_or(0.0, amount);
    }
    total
}

/// A CPU or GPU quantity as a number: `2`, `0.5`, `500m`.
fn amount(q: &Quantity) -> f64 {
    let s = q.0.trim();
    match s.strip_suffix('m') {
        Some(milli) => milli.parse::<f64>().map_or(0.0, |m| m / 1000.0),
        None => s.parse().unwrap_or(0.0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::jiff::{SignedDuration, Timestamp};

    fn pod(role: &str, phase: &str, cpu: &str, gpus: Option<&str>) -> Pod {
        let mut limits = serde_json::json!({"cpu": "8"});
        if let Some(g) = gpus {
            limits["nvidia.com/gpu"] = g.into();
        }
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": format!("{role}-0"), "labels": {COMPONENT_LABEL: role}},
            "spec": {"containers": [
                {"name": "main", "resources": {"requests": {"cpu": cpu}, "limits": limits}},
                {"name": "side"},
            ]},
            "status": {"phase": phase},
        }))
        .unwrap()
    }

    fn at(seconds: i64) -> Time {
        Time(Timestamp::UNIX_EPOCH + SignedDuration::from_secs(seconds))
    }

    #[test]
    fn usage_counts_what_ran_and_nothing_while_pods_wait_or_are_gone() {
        let trainer = pod("trainer", "Running", "4", Some("2"));
        let engine = pod("engine", "Running", "500m", Some("1"));
        let waiting = pod("engine", "Pending", "500m", Some("1"));
        let first = advance(
            None,
            &[trainer.clone(), engine.clone(), waiting.clone()],
            &at(0),
        );
        assert_eq!(first.gpu_hours, 0.0);
        assert_eq!(first.roles["trainer"].gpus, 2.0);
        assert_eq!(
            first.roles["engines"].gpus, 1.0,
            "a pending pod counts nothing"
        );
        assert_eq!(first.roles["engines"].cpus, 0.5);
        // An hour later the trainer is gone (suspended): the hour counts, then nothing.
        let second = advance(Some(&first), &[engine], &at(3600));
        assert_eq!(second.roles["trainer"].gpu_seconds, 7200.0);
        assert_eq!(second.roles["trainer"].cpu_seconds, 4.0 * 3600.0);
        assert_eq!(second.roles["engines"].gpu_seconds, 3600.0);
        assert_eq!(second.gpu_hours, 3.0);
        assert!(due(Some(&first), &second), "what runs changed");
        let third = advance(Some(&second), &[], &at(7200));
        assert_eq!(
            third.roles["trainer"].gpu_seconds, 7200.0,
            "flat while gone"
        );
        assert_eq!(third.roles["engines"].gpu_seconds, 7200.0);
        let fourth = advance(Some(&third), &[], &at(90_000));
        assert_eq!(fourth.roles, third.roles, "a suspended run uses nothing");
        assert!(
            !due(Some(&third), &fourth),
            "nothing runs: nothing to write"
        );
    }

    #[test]
    fn usage_is_written_when_what_runs_changes_or_a_minute_passed() {
        let pods = [pod("agents", "Running", "1", None)];
        let first = advance(None, &pods, &at(0));
        assert!(due(None, &first));
        assert!(!due(Some(&first), &advance(Some(&first), &pods, &at(59))));
        assert!(due(Some(&first), &advance(Some(&first), &pods, &at(60))));
        assert_eq!(
            advance(Some(&first), &pods, &at(60)).roles["agents"].cpu_seconds,
            60.0
        );
    }
}
