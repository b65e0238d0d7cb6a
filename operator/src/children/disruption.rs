//! Disruption budgets (docs/operator.md, "Disruption budgets"): with the operator's
//! `--disruption-budgets`, a `policy/v1` PodDisruptionBudget for each role whose pods a voluntary
//! disruption (a `kubectl drain`, a cluster autoscaler's scale-down) must not evict mid-run: the
//! trainer and the coordinator.
//!
//! Each budget selects its role's pods by the workload's own selector and allows no eviction
//! (`maxUnavailable: 0`). No other number makes sense for these roles: the coordinator is one pod,
//! so a budget that allowed one eviction would protect nothing, and the trainer ranks are one
//! process group, which loses every rank when it loses one. Pods that are not ready may always be
//! evicted (`unhealthyPodEvictionPolicy: AlwaysAllow`): a crash-looping or unready pod does no
//! work worth protecting, and with the default (`IfHealthyBudget`) it would block a drain for as
//! long as it stays broken. A suspended run (or one Kueue holds) has no pods, so its budgets hold
//! nothing; a run that has succeeded has none, so that its idle pods do not block drains.

use k8s_openapi::api::policy::v1::{PodDisruptionBudget, PodDisruptionBudgetSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use super::Ctx;
use crate::api::Phase;

/// The roles that get a budget (component labels; the budget is named `<run>-<role>`).
pub const PROTECTED_ROLES: [&str; 2] = ["trainer", "coordinator"];

/// What a budget lets evictions do to pods that are running but not ready.
pub const UNHEALTHY_POD_EVICTION_POLICY: &str = "AlwaysAllow";

/// The run's budgets: one per protected role when the operator's config asks for them and the
/// run has not succeeded; none otherwise.
pub(crate) fn budgets(ctx: &Ctx) -> Vec<PodDisruptionBudget> {
    let succeeded = ctx.run.status.as_ref().and_then(|s| s.phase) == Some(Phase::Succeeded);
    if !ctx.config.disruption_budgets || succeeded {
        return Vec::new();
    }
    PROTECTED_ROLES
        .iter()
        .map(|role| PodDisruptionBudget {
            metadata: ctx.meta(role, Some(role)),
            spec: Some(PodDisruptionBudgetSpec {
                max_unavailable: Some(IntOrString::Int(0)),
                selector: Some(LabelSelector {
                    match_labels: Some(ctx.selector(role)),
                    ..LabelSelector::default()
                }),
                unhealthy_pod_eviction_policy: Some(UNHEALTHY_POD_EVICTION_POLICY.into()),
                ..PodDisruptionBudgetSpec::default()
            }),
            ..PodDisruptionBudget::default()
        })
        .collect()
}
