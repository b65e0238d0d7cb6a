//! A run's status computed from its workloads and their pods (pure): phase, conditions, engine
//! replicas.
//!
//! A component is ready only when its controller has seen the current spec and every desired
//! pod is updated and ready — "Running" means the pods really are. A component that is not ready
//! and has a pod that will not become ready by waiting ([`causes`]: unschedulable, image pull,
//! crash loop, OOM kill) makes the run Degraded with that cause as the conditions' reason and,
//! per component, in their message. The operator owns `phase`,
//! `conditions`, `observedGeneration`, `engines` and `usage` ([`super::usage`]); the coordinator
//! owns the rest, and this module never touches it.

use k8s_openapi::api::apps::v1::{Deployment, StatefulSet};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::ResourceExt;

use super::causes::{self, Cause};
use super::kueue::Queued;
use crate::api::{EngineStatus, Phase, RLRun, RLRunStatus, RunPoolStatus};
use crate::children::{engine_selector, pool_engine_selector};

/// The run's workloads as last seen (None: does not exist yet), and its pods.
#[derive(Clone, Debug, Default)]
pub struct Workloads {
    pub engines: Option<StatefulSet>,
    pub trainer: Option<StatefulSet>,
    pub coordinator: Option<Deployment>,
    pub agents: Option<Deployment>,
    /// The engine pools the spec asks for besides the policy's (`judge` with `spec.judge`,
    /// `teacher` with a served teacher), by component label, each as last seen.
    pub scorers: Vec<(&'static str, Option<StatefulSet>)>,
    pub pods: Vec<Pod>,
    /// The run's Kueue Workload, for a run with a queue.
    pub queue: Option<Queued>,
    /// Why the controller of a component (by name: engines, trainer, ...) could not create a pod,
    /// as it last reported ([`causes::refused`]).
    pub refused: std::collections::BTreeMap<&'static str, String>,
}

/// One component as the status and the metrics report it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Component {
    /// engines, trainer, coordinator, agents, and judge or teacher when the run has them.
    pub name: &'static str,
    pub desired: i32,
    pub ready: i32,
    /// Pods that exist.
    pub pods: i32,
    /// Every desired pod updated and ready.
    pub settled: bool,
    /// Why it is not ready (None when settled, or only starting).
    pub cause: Option<Cause>,
}

/// The components of a run, in the order the status names them: the four every run has, then
/// the judge's and a served teacher's engines.
pub fn components(w: &Workloads) -> Vec<Component> {
    let component = |name, pod_label, r: Readiness| Component {
        name,
        desired: r.desired,
        ready: r.ready,
        pods: r.pods,
        settled: r.settled,
        // The pods' own cause, else why pods are missing (a ResourceQuota).
        cause: (!r.settled)
            .then(|| causes::first(&w.pods, pod_label))
            .flatten()
            .or_else(|| {
                let missing = !r.settled && r.pods < r.desired;
                w.refused
                    .get(name)
                    .filter(|_| missing)
                    .map(|m| causes::refused(m))
            }),
    };
    [
        component("engines", "engine", statefulset(w.engines.as_ref())),
        component("trainer", "trainer", statefulset(w.trainer.as_ref())),
        component(
            "coordinator",
            "coordinator",
            deployment(w.coordinator.as_ref()),
        ),
        component("agents", "agents", deployment(w.agents.as_ref())),
    ]
    .into_iter()
    .chain(
        w.scorers
            .iter()
            .map(|(name, s)| component(name, name, statefulset(s.as_ref()))),
    )
    .collect()
}

/// Desired and ready pods of one component.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Readiness {
    pub desired: i32,
    pub ready: i32,
    pub pods: i32,
    pub settled: bool,
}

pub(super) fn statefulset(s: Option<&StatefulSet>) -> Readiness {
    let Some(s) = s else {
        return Readiness {
            desired: 1,
            ready: 0,
            pods: 0,
            settled: false,
        };
    };
    let desired = s.spec.replicas.unwrap_or(1);
    let st = s.status.clone().unwrap_or_default();
    let seen = st.observed_generation.unwrap_or(0) >= s.metadata.generation.unwrap_or(0);
    let ready = st.ready_replicas.unwrap_or(0);
    let updated = st.updated_replicas.unwrap_or(0);
    let settled =
        seen && st.replicas == desired && ready == desired && (desired == 0 || updated == desired);
    Readiness {
        desired,
        ready,
        pods: st.replicas,
        settled,
    }
}

fn deployment(d: Option<&Deployment>) -> Readiness {
    let Some(d) = d else {
        return Readiness {
            desired: 1,
            ready: 0,
            pods: 0,
            settled: false,
        };
    };
    let desired = d.spec.replicas.unwrap_or(1);
    let st = d.status.clone().unwrap_or_default();
    let seen = st.observed_generation.unwrap_or(0) >= d.metadata.generation.unwrap_or(0);
    let ready = st.ready_replicas.unwrap_or(0);
    let pods = st.replicas.unwrap_or(0);
    let settled =
        seen && pods == desired && ready == desired && st.updated_replicas.unwrap_or(0) == desired;
    Readiness {
        desired,
        ready,
        pods,
        settled,
    }
}

/// The reason of the conditions while a child's name is held by an object the run does not
/// control (docs/operator.md, "Why is my run stuck").
pub const OWNERSHIP_CONFLICT: &str = "OwnershipConflict";

/// Why the operator made no children for a run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// The spec cannot be turned into objects: the run has Failed until the spec changes.
    InvalidSpec(String),
    /// Objects the run does not control hold its children's names: nothing is applied or deleted
    /// until they are gone (or the run is renamed).
    OwnershipConflict(String),
    /// The run's EnginePool keeps it from ready (`reason`: `PoolNotFound`, `PoolModelMismatch`,
    /// ... of [`super::pool`]): nothing is applied or deleted until it may use the pool, except
    /// while the pool is being deleted (it still serves the run then).
    Pool {
        reason: &'static str,
        message: String,
    },
}

impl Refusal {
    pub fn conflicts(conflicts: &[super::apply::Conflict]) -> Refusal {
        let list: Vec<String> = conflicts.iter().map(ToString::to_string).collect();
        Refusal::OwnershipConflict(format!(
            "{}: the operator applies nothing of this run while they hold its children's names; delete or rename them, or rename the run",
            list.join("; ")
        ))
    }
}

/// The operator's part of the status. `refusal` is why the run's children were not made, if
/// they were not; `now` stamps conditions whose status changes.
pub fn compute(run: &RLRun, w: &Workloads, refusal: Option<&Refusal>, now: &Time) -> RLRunStatus {
    let old = run.status.clone().unwrap_or_default();
    let generation = run.metadata.generation;
    let name = run.name_any();
    let parts = components(w);
    let engines = &parts[0];
    let all_settled = parts.iter().all(|c| c.settled);
    let waiting: Vec<String> = parts
        .iter()
        .filter(|c| !c.settled)
        .map(|c| match &c.cause {
            Some(cause) => format!("{} {}/{} ready ({cause})", c.name, c.ready, c.desired),
            None => format!("{} {}/{} ready", c.name, c.ready, c.desired),
        })
        .collect();
    // The first component's cause names the conditions' reason.
    let stuck = parts
        .iter()
        .find_map(|c| c.cause.as_ref())
        .map(|c| c.reason.as_str());
    let was_running_here = matches!(old.phase, Some(Phase::Running | Phase::Degraded))
        && old.observed_generation == generation;

    let (phase, ready, progressing, degraded, suspended) =
        if let Some(Refusal::InvalidSpec(why)) = refusal {
            (
                Phase::Failed,
                cond("Ready", false, "InvalidSpec", why),
                cond("Progressing", false, "InvalidSpec", why),
                cond("Degraded", true, "InvalidSpec", why),
                cond("Suspended", run.spec.suspend, "InvalidSpec", why),
            )
        } else if let Some((reason, why)) = match refusal {
            Some(Refusal::OwnershipConflict(why)) => Some((OWNERSHIP_CONFLICT, why)),
            Some(Refusal::Pool { reason, message }) => Some((*reason, message)),
            _ => None,
        } {
            (
                if was_running_here {
                    Phase::Degraded
                } else {
                    Phase::Pending
                },
                cond("Ready", false, reason, why),
                cond("Progressing", false, reason, why),
                cond("Degraded", true, reason, why),
                cond("Suspended", run.spec.suspend, reason, why),
            )
        } else if old.phase == Some(Phase::Succeeded) {
            (
                Phase::Succeeded,
                cond(
                    "Ready",
                    false,
                    "Succeeded",
                    "the run reached its total steps",
                ),
                cond(
                    "Progressing",
                    false,
                    "Succeeded",
                    "the run reached its total steps",
                ),
                cond(
                    "Degraded",
                    false,
                    "Succeeded",
                    "the run reached its total steps",
                ),
                cond(
                    "Suspended",
                    run.spec.suspend,
                    "Succeeded",
                    "the run reached its total steps",
                ),
            )
        } else if run.spec.suspend {
            let msg = if all_settled {
                "every pod is stopped".to_string()
            } else {
                format!("stopping: {}", waiting.join(", "))
            };
            (
                Phase::Suspended,
                cond("Ready", false, "Suspended", "spec.suspend is set"),
                cond("Progressing", !all_settled, "Suspending", &msg),
                cond("Degraded", false, "Suspended", "spec.suspend is set"),
                cond("Suspended", true, "Suspended", &msg),
            )
        } else if let Some((phase, reason, msg)) = queued(w.queue.as_ref(), w) {
            (
                phase,
                cond("Ready", false, reason, &msg),
                cond("Progressing", false, reason, &msg),
                cond("Degraded", false, reason, &msg),
                cond("Suspended", true, reason, &msg),
            )
        } else if all_settled {
            let msg = format!(
                "{} engines, trainer, coordinator and agents are ready",
                engines.ready
            );
            (
                Phase::Running,
                cond("Ready", true, "AllComponentsReady", &msg),
                cond("Progressing", false, "AllComponentsReady", &msg),
                cond("Degraded", false, "AllComponentsReady", &msg),
                cond("Suspended", false, "Running", "spec.suspend is not set"),
            )
        } else if let Some(reason) = stuck {
            let msg = if was_running_here {
                format!("lost ready pods: {}", waiting.join(", "))
            } else {
                format!("waiting for {}", waiting.join(", "))
            };
            (
                if was_running_here {
                    Phase::Degraded
                } else {
                    Phase::Pending
                },
                cond("Ready", false, reason, &msg),
                cond("Progressing", false, reason, &msg),
                cond("Degraded", true, reason, &msg),
                cond("Suspended", false, "Running", "spec.suspend is not set"),
            )
        } else if was_running_here {
            let msg = format!("lost ready pods: {}", waiting.join(", "));
            (
                Phase::Degraded,
                cond("Ready", false, "ComponentsNotReady", &msg),
                cond("Progressing", true, "Recovering", &msg),
                cond("Degraded", true, "ComponentsNotReady", &msg),
                cond("Suspended", false, "Running", "spec.suspend is not set"),
            )
        } else {
            let msg = format!("waiting for {}", waiting.join(", "));
            (
                Phase::Pending,
                cond("Ready", false, "ComponentsNotReady", &msg),
                cond("Progressing", true, "RollingOut", &msg),
                cond("Degraded", false, "RollingOut", &msg),
                cond("Suspended", false, "Running", "spec.suspend is not set"),
            )
        };
    let conditions = [ready, progressing, degraded, suspended]
        .into_iter()
        .map(|c| stamp(c, &old.conditions, generation, now))
        .collect();
    let pool = run.spec.engines.pool_ref.as_ref();
    let desired_engines = match pool {
        // The pool's engines, which its own spec scales.
        Some(_) => engines.desired,
        None if run.spec.suspend => 0,
        None => run.spec.engines.replicas,
    };
    RLRunStatus {
        phase: Some(phase),
        conditions,
        observed_generation: generation,
        engines: Some(EngineStatus {
            replicas: engines.pods,
            ready_replicas: engines.ready,
            ready: format!("{}/{desired_engines}", engines.ready),
            selector: match pool {
                Some(p) => pool_engine_selector(&p.name),
                None => engine_selector(&name),
            },
        }),
        pool: pool.map(|p| RunPoolStatus {
            name: p.name.clone(),
            share: None,
        }),
        ..RLRunStatus::default()
    }
}

/// A run Kueue holds: Queued while its Workload waits for quota (with Kueue's message), Preempted
/// once evicted (with Kueue's reason and message) until Kueue admits it again.
fn queued<'a>(q: Option<&'a Queued>, w: &Workloads) -> Option<(Phase, &'a str, String)> {
    let q = q.filter(|q| !q.admitted)?;
    let pods = w.pods.len();
    let stopping = if pods > 0 {
        format!("; stopping {pods} pods")
    } else {
        String::new()
    };
    Some(match &q.evicted {
        Some(e) => {
            let msg = format!(
                "Kueue evicted the Workload {}: {}{stopping}",
                q.name, e.message
            );
            (Phase::Preempted, e.reason.as_str(), msg)
        }
        None => {
            let why = q
                .waiting
                .as_deref()
                .unwrap_or("Kueue has not looked at it yet");
            let msg = format!(
                "waiting for Kueue to admit the Workload {}: {why}{stopping}",
                q.name
            );
            (Phase::Queued, "Queued", msg)
        }
    })
}

/// True when `new` (the operator's fields) differs from what `old` holds: a status write is
/// needed.
pub fn changed(old: Option<&RLRunStatus>, new: &RLRunStatus) -> bool {
    let Some(old) = old else { return true };
    old.phase != new.phase
        || old.conditions != new.conditions
        || old.observed_generation != new.observed_generation
        || old.engines != new.engines
        || old.pool.as_ref().map(|p| &p.name) != new.pool.as_ref().map(|p| &p.name)
}

pub(super) struct Cond<'a> {
    type_: &'static str,
    status: bool,
    reason: &'a str,
    message: String,
}

pub(super) fn cond<'a>(
    type_: &'static str,
    status: bool,
    reason: &'a str,
    message: &str,
) -> Cond<'a> {
    Cond {
        type_,
        status,
        reason,
        message: message.to_string(),
    }
}

/// A Condition that keeps its last transition time while its status stays the same.
pub(super) fn stamp(c: Cond, old: &[Condition], generation: Option<i64>, now: &Time) -> Condition {
    let status = if c.status { "True" } else { "False" }.to_string();
    let last_transition_time = old
        .iter()
        .find(|o| o.type_ == c.type_ && o.status == status)
        .map(|o| o.last_transition_time.clone())
        .unwrap_or_else(|| now.clone());
    Condition {
        type_: c.type_.into(),
        status,
        reason: c.reason.into(),
        message: c.message,
        observed_generation: generation,
        last_transition_time,
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::apps::v1::{DeploymentStatus, StatefulSetStatus};
    use k8s_openapi::jiff::Timestamp;

    use super::*;
    use crate::children::{desired, Config};

    fn run() -> RLRun {
        let mut r = crate::children::tests::example_run();
        r.metadata.generation = Some(3);
        r
    }

    /// The run's workloads as the API server would report them with `ready` pods each.
    fn workloads(r: &RLRun, ready: impl Fn(&str, i32) -> i32) -> Workloads {
        let c = desired(r, &Config::default(), "t").unwrap();
        let sts = |mut s: StatefulSet, n: &str| {
            let want = s.spec.replicas.unwrap();
            s.metadata.generation = Some(1);
            s.status = Some(StatefulSetStatus {
                observed_generation: Some(1),
                replicas: want,
                ready_replicas: Some(ready(n, want)),
                updated_replicas: Some(want),
                ..Default::default()
            });
            s
        };
        let dep = |mut d: Deployment, n: &str| {
            let want = d.spec.replicas.unwrap();
            d.metadata.generation = Some(1);
            d.status = Some(DeploymentStatus {
                observed_generation: Some(1),
                replicas: Some(want),
                ready_replicas: Some(ready(n, want)),
                updated_replicas: Some(want),
                ..Default::default()
            });
            d
        };
        Workloads {
            engines: Some(sts(c.engines.unwrap(), "engines")),
            trainer: Some(sts(c.trainer, "trainer")),
            coordinator: Some(dep(c.coordinator, "coordinator")),
            agents: Some(dep(c.agents, "agents")),
            scorers: c
                .judge
                .map(|j| ("judge", Some(sts(j, "judge"))))
                .into_iter()
                .collect(),
            pods: Vec::new(),
            queue: None,
            refused: Default::default(),
        }
    }

    #[test]
    fn pods_a_quota_refused_are_the_components_cause() {
        let r = run();
        let mut w = workloads(&r, |_, _| 0);
        if let Some(s) = w.engines.as_mut().and_then(|s| s.status.as_mut()) {
            s.replicas = 0;
        }
        let quota = "pods \"r-engine-0\" is forbidden: exceeded quota: gpus, requested: requests.nvidia.com/gpu=1";
        w.refused.insert("engines", quota.into());
        let engines = components(&w)
            .into_iter()
            .find(|c| c.name == "engines")
            .unwrap();
        assert_eq!(engines.cause.unwrap().reason, causes::Reason::QuotaExceeded);
        let s = compute(&r, &w, None, &now());
        assert_eq!(condition(&s, "Ready").reason, "QuotaExceeded");
    }

    /// A pod of `component` that the scheduler cannot place.
    fn unschedulable(name: &str, component: &str, message: &str) -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "labels": {"moult.dev/component": component}},
            "status": {"phase": "Pending", "conditions": [{
                "type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message
            }]},
        }))
        .unwrap()
    }

    fn now() -> Time {
        Time(Timestamp::from_second(1_800_000_000).unwrap())
    }

    fn condition<'a>(s: &'a RLRunStatus, t: &str) -> &'a Condition {
        s.conditions.iter().find(|c| c.type_ == t).unwrap()
    }

    #[test]
    fn running_only_when_every_pod_is_ready() {
        let r = run();
        let s = compute(
            &r,
            &workloads(&r, |n, want| if n == "engines" { want - 1 } else { want }),
            None,
            &now(),
        );
        assert_eq!(s.phase, Some(Phase::Pending));
        assert_eq!(condition(&s, "Ready").status, "False");
        assert!(
            condition(&s, "Ready").message.contains("engines 3/4 ready"),
            "{}",
            condition(&s, "Ready").message
        );
        assert_eq!(s.engines.as_ref().unwrap().ready, "3/4");
        let s = compute(&r, &workloads(&r, |_, want| want), None, &now());
        assert_eq!(s.phase, Some(Phase::Running));
        assert_eq!(condition(&s, "Ready").status, "True");
        assert_eq!(condition(&s, "Progressing").status, "False");
        assert_eq!(s.observed_generation, Some(3));
        assert_eq!(
            s.engines.unwrap().selector,
            "moult.dev/component=engine,moult.dev/run=gsm8k-grpo"
        );
    }

    #[test]
    fn missing_workloads_are_not_ready() {
        let r = run();
        let s = compute(&r, &Workloads::default(), None, &now());
        assert_eq!(s.phase, Some(Phase::Pending));
    }

    #[test]
    fn a_running_run_that_loses_pods_is_degraded_and_keeps_transition_times() {
        let mut r = run();
        let s = compute(&r, &workloads(&r, |_, want| want), None, &now());
        r.status = Some(s.clone());
        let later = Time(Timestamp::from_second(1_800_000_100).unwrap());
        let again = compute(&r, &workloads(&r, |_, want| want), None, &later);
        assert!(
            !changed(Some(&s), &again),
            "an unchanged run needs no status write"
        );
        let lost = compute(
            &r,
            &workloads(&r, |n, want| if n == "trainer" { 0 } else { want }),
            None,
            &later,
        );
        assert_eq!(lost.phase, Some(Phase::Degraded));
        assert_eq!(condition(&lost, "Degraded").status, "True");
        assert_eq!(condition(&lost, "Degraded").last_transition_time, later);
        assert_eq!(
            condition(&lost, "Suspended").last_transition_time,
            now(),
            "unchanged conditions keep their time"
        );
    }

    #[test]
    fn a_spec_change_rolls_out_as_pending_not_degraded() {
        let mut r = run();
        r.status = Some(compute(&r, &workloads(&r, |_, want| want), None, &now()));
        r.metadata.generation = Some(4);
        let s = compute(
            &r,
            &workloads(&r, |n, want| if n == "engines" { 1 } else { want }),
            None,
            &now(),
        );
        assert_eq!(s.phase, Some(Phase::Pending));
        assert_eq!(condition(&s, "Progressing").status, "True");
    }

    #[test]
    fn suspended_runs_report_suspended_and_zero_desired_engines() {
        let mut r = run();
        r.spec.suspend = true;
        let s = compute(&r, &workloads(&r, |_, want| want), None, &now());
        assert_eq!(s.phase, Some(Phase::Suspended));
        assert_eq!(condition(&s, "Suspended").status, "True");
        assert_eq!(condition(&s, "Ready").status, "False");
        assert_eq!(s.engines.unwrap().ready, "0/0");
    }

    #[test]
    fn a_run_kueue_holds_is_queued_with_kueues_reason_then_preempted_until_admitted() {
        let r = run();
        let mut w = workloads(&r, |_, _| 0);
        let waiting = "couldn't assign flavors to pod set engines: insufficient quota for nvidia.com/gpu in flavor gpu, 1 more needed";
        w.queue = Some(Queued {
            name: "r-kueue-1".into(),
            waiting: Some(waiting.into()),
            ..Queued::default()
        });
        let s = compute(&r, &w, None, &now());
        assert_eq!(s.phase, Some(Phase::Queued));
        let ready = condition(&s, "Ready");
        assert_eq!(ready.reason, "Queued");
        assert!(ready.message.contains(waiting), "{}", ready.message);
        assert_eq!(condition(&s, "Suspended").status, "True");
        let evicted = Condition {
            type_: "Evicted".into(),
            status: "True".into(),
            reason: "Preempted".into(),
            message:
                "Preempted to accommodate a workload due to prioritization in the ClusterQueue"
                    .into(),
            observed_generation: None,
            last_transition_time: now(),
        };
        w.queue = Some(Queued {
            name: "r-kueue-1".into(),
            reserved: true,
            evicted: Some(evicted),
            ..Queued::default()
        });
        let s = compute(&r, &w, None, &now());
        assert_eq!(s.phase, Some(Phase::Preempted));
        assert_eq!(condition(&s, "Ready").reason, "Preempted");
        assert!(condition(&s, "Ready").message.contains("prioritization"));
        // Admitted again: the run's own readiness says the rest.
        w.queue = Some(Queued {
            admitted: true,
            reserved: true,
            ..Queued::default()
        });
        let all_ready = workloads(&r, |_, want| want);
        let s = compute(
            &r,
            &Workloads {
                queue: w.queue.clone(),
                ..all_ready
            },
            None,
            &now(),
        );
        assert_eq!(s.phase, Some(Phase::Running));
    }

    #[test]
    fn an_invalid_spec_fails_with_the_reason() {
        let r = run();
        let s = compute(
            &r,
            &Workloads::default(),
            Some(&Refusal::InvalidSpec(
                "engines.image is not a valid image".into(),
            )),
            &now(),
        );
        assert_eq!(s.phase, Some(Phase::Failed));
        assert_eq!(condition(&s, "Degraded").reason, "InvalidSpec");
        assert!(condition(&s, "Ready").message.contains("engines.image"));
    }

    #[test]
    fn a_pod_that_cannot_run_names_its_cause_per_component_and_clears_when_fixed() {
        let mut r = run();
        let mut w = workloads(&r, |n, want| if n == "agents" { want } else { 0 });
        w.pods = vec![
            unschedulable(
                "gsm8k-grpo-engine-0",
                "engine",
                "0/6 nodes are available: persistentvolumeclaim \"models\" not found.",
            ),
            unschedulable(
                "gsm8k-grpo-trainer-0",
                "trainer",
                "0/6 nodes are available: 6 Insufficient nvidia.com/gpu.",
            ),
        ];
        let s = compute(&r, &w, None, &now());
        assert_eq!(s.phase, Some(Phase::Pending));
        for t in ["Ready", "Progressing", "Degraded"] {
            assert_eq!(condition(&s, t).reason, "Unschedulable", "{t}");
        }
        assert_eq!(condition(&s, "Degraded").status, "True");
        let msg = &condition(&s, "Ready").message;
        assert!(
            msg.contains("engines 0/4 ready (Unschedulable: pod gsm8k-grpo-engine-0: 0/6 nodes are available: persistentvolumeclaim \"models\" not found.)"),
            "{msg}"
        );
        assert!(msg.contains("Insufficient nvidia.com/gpu"), "{msg}");
        assert!(
            msg.ends_with("coordinator 0/1 ready"),
            "no cause, no parentheses: {msg}"
        );
        // Fixed: the pods run, the cause goes, and an unchanged run needs no write.
        r.status = Some(s);
        let s = compute(&r, &workloads(&r, |_, want| want), None, &now());
        assert_eq!(s.phase, Some(Phase::Running));
        assert_eq!(condition(&s, "Degraded").status, "False");
        r.status = Some(s.clone());
        let again = compute(&r, &workloads(&r, |_, want| want), None, &now());
        assert!(!changed(Some(&s), &again));
    }

    #[test]
    fn a_judge_that_cannot_start_keeps_the_run_from_running_and_says_why() {
        let mut r = run();
        r.spec.judge = Some(
            serde_json::from_value(serde_json::json!({
                "path": "Qwen3-32B", "claimName": "models", "prompt": "Is {response} right?"
            }))
            .unwrap(),
        );
        let mut w = workloads(&r, |n, want| if n == "judge" { 0 } else { want });
        assert_eq!(w.scorers.len(), 1);
        w.pods = vec![unschedulable(
            "gsm8k-grpo-judge-0",
            "judge",
            "0/6 nodes are available: 6 Insufficient nvidia.com/gpu.",
        )];
        let s = compute(&r, &w, None, &now());
        assert_eq!(s.phase, Some(Phase::Pending));
        assert_eq!(condition(&s, "Degraded").reason, "Unschedulable");
        let msg = &condition(&s, "Ready").message;
        assert!(
            msg.contains("judge 0/1 ready (Unschedulable: pod gsm8k-grpo-judge-0"),
            "{msg}"
        );
        // Not made yet counts as not ready too; ready, the run runs.
        w.scorers[0].1 = None;
        assert_eq!(compute(&r, &w, None, &now()).phase, Some(Phase::Pending));
        let s = compute(&r, &workloads(&r, |_, want| want), None, &now());
        assert_eq!(s.phase, Some(Phase::Running));
    }

    #[test]
    fn a_running_run_whose_pod_crash_loops_is_degraded_with_the_cause() {
        let mut r = run();
        r.status = Some(compute(&r, &workloads(&r, |_, want| want), None, &now()));
        let mut w = workloads(&r, |n, want| if n == "trainer" { 0 } else { want });
        w.pods = vec![serde_json::from_value(serde_json::json!({
            "metadata": {"name": "gsm8k-grpo-trainer-0", "labels": {"moult.dev/component": "trainer"}},
            "status": {"containerStatuses": [{
                "name": "trainer", "image": "x", "imageID": "", "ready": false, "restartCount": 2,
                "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                "lastState": {"terminated": {"exitCode": 1, "message": "Error: CUDA out of memory"}}
            }]},
        }))
        .unwrap()];
        let s = compute(&r, &w, None, &now());
        assert_eq!(s.phase, Some(Phase::Degraded));
        assert_eq!(condition(&s, "Degraded").reason, "CrashLoopBackOff");
        assert!(
            condition(&s, "Degraded")
                .message
                .contains("Error: CUDA out of memory"),
            "{}",
            condition(&s, "Degraded").message
        );
    }

    #[test]
    fn an_ownership_conflict_names_the_objects_and_is_pending_or_degraded_not_failed() {
        use crate::children::ChildKind;
        use crate::controller::apply::Conflict;
        let mut r = run();
        let refusal = Refusal::conflicts(&[
            Conflict {
                kind: ChildKind::ServiceAccount,
                name: "gsm8k-grpo-moult".into(),
                controller: None,
            },
            Conflict {
                kind: ChildKind::Secret,
                name: "gsm8k-grpo-token".into(),
                controller: Some("RLRun/other".into()),
            },
        ]);
        let s = compute(&r, &Workloads::default(), Some(&refusal), &now());
        assert_eq!(s.phase, Some(Phase::Pending));
        for t in ["Ready", "Progressing", "Degraded"] {
            assert_eq!(condition(&s, t).reason, OWNERSHIP_CONFLICT, "{t}");
        }
        assert_eq!(condition(&s, "Degraded").status, "True");
        let msg = &condition(&s, "Ready").message;
        assert!(
            msg.starts_with("ServiceAccount gsm8k-grpo-moult already exists, not controlled by this RLRun; Secret gsm8k-grpo-token already exists, controlled by RLRun/other:"),
            "{msg}"
        );
        // A run that was running at this generation is Degraded while it lasts.
        r.status = Some(compute(&r, &workloads(&r, |_, want| want), None, &now()));
        let s = compute(&r, &workloads(&r, |_, want| want), Some(&refusal), &now());
        assert_eq!(s.phase, Some(Phase::Degraded));
    }

    #[test]
    fn succeeded_is_final() {
        let mut r = run();
        r.status = Some(RLRunStatus {
            phase: Some(Phase::Succeeded),
            ..Default::default()
        });
        let s = compute(&r, &workloads(&r, |_, want| want), None, &now());
        assert_eq!(s.phase, Some(Phase::Succeeded));
    }
}
