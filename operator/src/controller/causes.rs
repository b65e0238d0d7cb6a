//! Why a component is not ready, read from its pods as the scheduler and the kubelet report them
//! (pure): a pod the scheduler cannot place, an image that cannot be pulled, a container that
//! cannot start, crash-loops or was killed for memory.
//!
//! Only pods that are not ready and not being deleted are read; for each component the first
//! such pod (by name) with a cause gives it. A crash's message is the container's termination
//! message: every container the operator makes has `terminationMessagePolicy:
//! FallbackToLogsOnError`, so it is the tail of its log when the process wrote no message file,
//! and moult prints its fatal error last (docs/operator.md, "Why is my run stuck").

use k8s_openapi::api::core::v1::{ContainerStatus, Pod};
use kube::ResourceExt;

use crate::children::COMPONENT_LABEL;

/// Longest message kept from a pod (the end of it: a log's last lines hold the error).
const MESSAGE_CHARS: usize = 600;

/// What keeps a pod from ready, as the condition reason says it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Reason {
    /// The scheduler cannot place the pod: a missing claim, too few GPUs, a taint, a selector.
    Unschedulable,
    /// ErrImagePull, ImagePullBackOff, InvalidImageName.
    ImagePullFailed,
    /// The kubelet cannot create or start the container (a missing Secret or ConfigMap key, a
    /// bad command).
    ContainerCannotStart,
    /// The container was killed for exceeding its memory limit.
    OOMKilled,
    /// The container exited with an error (and is restarted with back-off).
    CrashLoopBackOff,
    /// The namespace's ResourceQuota refused to let the pod be created.
    QuotaExceeded,
    /// The API server refused to create the pod for another reason (an admission policy).
    PodRefused,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Unschedulable => "Unschedulable",
            Reason::ImagePullFailed => "ImagePullFailed",
            Reason::ContainerCannotStart => "ContainerCannotStart",
            Reason::OOMKilled => "OOMKilled",
            Reason::CrashLoopBackOff => "CrashLoopBackOff",
            Reason::QuotaExceeded => "QuotaExceeded",
            Reason::PodRefused => "PodRefused",
        }
    }

    pub const ALL: [Reason; 7] = [
        Reason::Unschedulable,
        Reason::ImagePullFailed,
        Reason::ContainerCannotStart,
        Reason::OOMKilled,
        Reason::CrashLoopBackOff,
        Reason::QuotaExceeded,
        Reason::PodRefused,
    ];
}

/// Why one pod of a component is not ready.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Cause {
    pub reason: Reason,
    pub pod: String,
    /// One line: what the scheduler or the kubelet said, or the container's last words.
    pub message: String,
}

impl std::fmt::Display for Cause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}: pod {}: {}",
            self.reason.as_str(),
            self.pod,
            self.message
        )
    }
}

/// Why a workload's controller could not create a pod, from what it reported (a ReplicaSet's
/// `ReplicaFailure` condition, a StatefulSet's `FailedCreate` event): a ResourceQuota, or another
/// refusal of the API server.
pub fn refused(message: &str) -> Cause {
    let reason = match message.contains("exceeded quota") {
        true => Reason::QuotaExceeded,
        false => Reason::PodRefused,
    };
    // `... pods "r-engine-0" is forbidden: exceeded quota: ...`
    let pod = message
        .split("pods \"")
        .nth(1)
        .and_then(|rest| rest.split('"').next());
    Cause {
        reason,
        pod: pod.unwrap_or("(not created)").into(),
        message: one_line(message),
    }
}

/// The first cause among `pods` that have the component label `component`.
pub fn first(pods: &[Pod], component: &str) -> Option<Cause> {
    let mut mine: Vec<&Pod> = pods
        .iter()
        .filter(|p| p.labels().get(COMPONENT_LABEL).map(String::as_str) == Some(component))
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .collect();
    mine.sort_by_key(|p| p.name_any());
    mine.into_iter().find_map(of_pod)
}

/// Why `pod` is not ready, if the scheduler or the kubelet said (None for a ready pod, or one
/// that is only starting).
pub fn of_pod(pod: &Pod) -> Option<Cause> {
    let status = pod.status.as_ref()?;
    let conditions = status.conditions.as_deref().unwrap_or_default();
    let condition = |t: &str| conditions.iter().find(|c| c.type_ == t);
    if condition("Ready").is_some_and(|c| c.status == "True") {
        return None;
    }
    let cause = |reason, message: String| Cause {
        reason,
        pod: pod.name_any(),
        message: one_line(&message),
    };
    if let Some(c) = condition("PodScheduled")
        .filter(|c| c.status == "False" && c.reason.as_deref() == Some("Unschedulable"))
    {
        return Some(cause(
            Reason::Unschedulable,
            c.message.clone().unwrap_or_default(),
        ));
    }
    let init = status
        .init_container_statuses
        .as_deref()
        .unwrap_or_default();
    let main = status.container_statuses.as_deref().unwrap_or_default();
    init.iter()
        .chain(main)
        .find_map(of_container)
        .map(|(reason, message)| cause(reason, message))
}

/// Why a container is not running, from its state and last state.
fn of_container(c: &ContainerStatus) -> Option<(Reason, String)> {
    let state = c.state.as_ref();
    let waiting = state.and_then(|s| s.waiting.as_ref());
    let waiting_reason = waiting.and_then(|w| w.reason.as_deref()).unwrap_or("");
    let waiting_message = || waiting.and_then(|w| w.message.clone()).unwrap_or_default();
    let name = &c.name;
    match waiting_reason {
        "ErrImagePull" | "ImagePullBackOff" | "InvalidImageName" | "ErrImageNeverPull" => {
            return Some((
                Reason::ImagePullFailed,
                format!("container {name}: {waiting_reason}: {}", waiting_message()),
            ));
        }
        "CreateContainerConfigError" | "CreateContainerError" | "RunContainerError" => {
            return Some((
                Reason::ContainerCannotStart,
                format!("container {name}: {waiting_reason}: {}", waiting_message()),
            ));
        }
        _ => {}
    }
    // The termination being reported: the current one, else the last before a restart.
    let terminated = state
        .and_then(|s| s.terminated.as_ref())
        .or_else(|| c.last_state.as_ref().and_then(|s| s.terminated.as_ref()))?;
    let crashing = waiting_reason == "CrashLoopBackOff"
        || (state.is_some_and(|s| s.terminated.is_some()) && terminated.exit_code != 0);
    // No restart count in the message: it would change the status (a write and an event) on
    // every restart; `kubectl get pods` shows it.
    if terminated.reason.as_deref() == Some("OOMKilled") && (crashing || !c.ready) {
        return Some((
            Reason::OOMKilled,
            format!(
                "container {name} was killed for exceeding its memory limit (exit code {}): raise its resources.limits.memory",
                terminated.exit_code
            ),
        ));
    }
    if !crashing {
        return None;
    }
    let said = terminated
        .message
        .as_deref()
        .map(str::trim)
        .filter(|m| !m.is_empty())
        .map_or_else(String::new, |m| format!(": {m}"));
    Some((
        Reason::CrashLoopBackOff,
        format!(
            "container {name} exited with code {}{said}",
            terminated.exit_code
        ),
    ))
}

/// `text` on one line (runs of whitespace become one space), its end kept when too long.
fn one_line(text: &str) -> String {
    let line = text.split_whitespace().collect::<Vec<_>>().join(" ");
    let n = line.chars().count();
    if n <= MESSAGE_CHARS {
        return line;
    }
    let tail: String = line.chars().skip(n - MESSAGE_CHARS).collect();
    format!("…{tail}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(name: &str, component: &str, status: serde_json::Value) -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "labels": {(COMPONENT_LABEL): component}},
            "status": status,
        }))
        .unwrap()
    }

    #[test]
    fn a_pod_the_quota_refused_is_its_components_cause() {
        let quota = "create Pod r-engine-0 in StatefulSet r-engine failed error: pods \"r-engine-0\" is forbidden: exceeded quota: gpus, requested: requests.nvidia.com/gpu=1, used: requests.nvidia.com/gpu=8, limited: requests.nvidia.com/gpu=8";
        let cause = refused(quota);
        assert_eq!(
            (cause.reason, cause.pod.as_str()),
            (Reason::QuotaExceeded, "r-engine-0")
        );
        assert!(cause
            .message
            .ends_with("limited: requests.nvidia.com/gpu=8"));
        assert_eq!(
            refused("admission webhook denied the request").reason,
            Reason::PodRefused
        );
    }

    #[test]
    fn an_unschedulable_pod_gives_the_schedulers_message() {
        let p = pod(
            "r-engine-0",
            "engine",
            serde_json::json!({"phase": "Pending", "conditions": [{
                "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                "message": "0/6 nodes are available: persistentvolumeclaim \"models\" not found."
            }]}),
        );
        let c = first(&[p], "engine").unwrap();
        assert_eq!(c.reason, Reason::Unschedulable);
        assert_eq!(c.pod, "r-engine-0");
        assert!(c
            .message
            .contains("persistentvolumeclaim \"models\" not found"));
        assert!(first(&[], "engine").is_none());
    }

    #[test]
    fn image_pull_failures_and_config_errors_name_the_container() {
        let waiting = |reason: &str| {
            pod(
                "r-agents-x",
                "agents",
                serde_json::json!({"containerStatuses": [{
                    "name": "agent", "image": "x", "imageID": "", "ready": false, "restartCount": 0,
                    "state": {"waiting": {"reason": reason, "message": "rpc error: not found"}}
                }]}),
            )
        };
        let c = of_pod(&waiting("ImagePullBackOff")).unwrap();
        assert_eq!(c.reason, Reason::ImagePullFailed);
        assert_eq!(
            c.message,
            "container agent: ImagePullBackOff: rpc error: not found"
        );
        let c = of_pod(&waiting("CreateContainerConfigError")).unwrap();
        assert_eq!(c.reason, Reason::ContainerCannotStart);
        assert!(of_pod(&waiting("ContainerCreating")).is_none());
    }

    #[test]
    fn a_crash_loop_carries_the_containers_last_words_and_an_oom_kill_says_so() {
        let crashed = |reason: &str, code: i32, message: &str| {
            pod(
                "r-trainer-0",
                "trainer",
                serde_json::json!({"containerStatuses": [{
                    "name": "trainer", "image": "x", "imageID": "", "ready": false, "restartCount": 4,
                    "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s"}},
                    "lastState": {"terminated": {"exitCode": code, "reason": reason, "message": message}}
                }]}),
            )
        };
        let c = of_pod(&crashed(
            "Error",
            1,
            "loading\nError: spec.model.path: /models/x is not a model folder\n",
        ))
        .unwrap();
        assert_eq!(c.reason, Reason::CrashLoopBackOff);
        assert_eq!(
            c.message,
            "container trainer exited with code 1: loading Error: spec.model.path: /models/x is not a model folder"
        );
        let c = of_pod(&crashed("OOMKilled", 137, "")).unwrap();
        assert_eq!(c.reason, Reason::OOMKilled);
        assert!(c.message.contains("memory limit"), "{}", c.message);
    }

    #[test]
    fn ready_and_deleted_pods_give_no_cause_and_long_messages_keep_their_end() {
        let ready = pod(
            "r-engine-0",
            "engine",
            serde_json::json!({"conditions": [{"type": "Ready", "status": "True"}]}),
        );
        assert!(of_pod(&ready).is_none());
        let mut gone = pod(
            "r-engine-1",
            "engine",
            serde_json::json!({"conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "x"}]}),
        );
        gone.metadata.deletion_timestamp =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                k8s_openapi::jiff::Timestamp::from_second(1_800_000_000).unwrap(),
            ));
        assert!(first(&[gone], "engine").is_none());
        let long = format!("{} the error", "x ".repeat(2000));
        let short = one_line(&long);
        assert!(short.ends_with("the error") && short.chars().count() <= MESSAGE_CHARS + 1);
    }
}
