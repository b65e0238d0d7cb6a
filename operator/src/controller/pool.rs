//! The EnginePool controller, and what a run's reconcile asks of its pool (docs/operator.md,
//! "Engine pools").
//!
//! A pool's reconcile = the runs naming it (listed fresh, so a run made a moment ago counts) →
//! its finalizer ([`POOL_FINALIZER`]) on while any run names it, off once none does → its
//! children applied like a run's ([`children::pool_desired`], server-side apply, orphans
//! deleted) → its status (ready engines, the runs with their shares, Ready; and Deleting while a
//! deleted pool waits for its runs). A deleted pool's children are left as they are until the
//! finalizer goes: they serve the runs still on it. A run's reconcile reads its pool through
//! [`find`]: the pool, its token (only from the Secret the pool controls) and its engines; what
//! keeps the run from its pool is a [`PoolIssue`], whose reason becomes the run's Ready reason.

use std::sync::Arc;

use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::{Pod, Secret};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ApiResource, DynamicObject, ListParams, Patch, PatchParams};
use kube::core::error_boundary::DeserializeGuard;
use kube::runtime::controller::Action;
use kube::{Resource, ResourceExt};
use serde_json::json;

use super::apply::{self, FIELD_MANAGER};
use super::status::{cond, stamp, statefulset};
use super::{causes, new_token, Ctx};
use crate::api::{EnginePool, EnginePoolStatus, PoolRun, RLRun};
use crate::children::{self, ChildKind, OnPool, POOL_LABEL, TOKEN_KEY};
use crate::error::{Context as _, Error, Result};

/// The finalizer a pool keeps while runs name it: deleting it then leaves it Terminating, its
/// engines serving those runs, until none does.
pub const POOL_FINALIZER: &str = "moult.dev/pool-in-use";

/// Reasons of a run's conditions when its pool keeps it from ready.
pub const POOL_NOT_FOUND: &str = "PoolNotFound";
pub const POOL_MODEL_MISMATCH: &str = "PoolModelMismatch";
pub const POOL_RANK_TOO_LARGE: &str = "PoolRankTooLarge";
pub const POOL_NOT_READY: &str = "PoolNotReady";
pub const POOL_DELETING: &str = "PoolDeleting";

/// Whether the cluster serves EnginePools (its CRD is installed: `helm upgrade` does not update
/// CRDs, so an operator upgraded in place may run without it).
pub async fn served(client: &kube::Client) -> bool {
    let version = format!("{}/v1alpha1", crate::api::GROUP);
    let resources = client.list_api_group_resources(&version).await;
    resources.is_ok_and(|list| list.resources.iter().any(|r| r.name == "enginepools"))
}

/// The kinds a pool owns (what its reconcile lists).
const POOL_KINDS: [ChildKind; 4] = [
    ChildKind::Secret,
    ChildKind::NetworkPolicy,
    ChildKind::Service,
    ChildKind::StatefulSet,
];

/// Why a run on a pool is not ready because of the pool: the reason of its conditions, and a
/// message that says what to do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolIssue {
    pub reason: &'static str,
    pub message: String,
}

/// What a run finds of its EnginePool.
#[derive(Clone, Debug, Default)]
pub struct Found {
    /// What the run takes from the pool, when it may use it: the run's children are made only
    /// then.
    pub on_pool: Option<OnPool>,
    /// What keeps the run from ready, if anything (a deleted pool still serves the run).
    pub issue: Option<PoolIssue>,
    /// The pool's engines, which the run's status reports as its own.
    pub engines: Option<StatefulSet>,
}

/// What run `run` may take from `pool` (`None`: it does not exist), whose token is `token` (read
/// from the Secret the pool controls; `None` before the pool's first reconcile).
pub fn judge(
    run: &RLRun,
    pool_name: &str,
    pool: Option<&EnginePool>,
    token: Option<&str>,
) -> (Option<OnPool>, Option<PoolIssue>) {
    let issue = |reason, message: String| Some(PoolIssue { reason, message });
    let Some(pool) = pool else {
        let ns = run.namespace().unwrap_or_default();
        return (None, issue(POOL_NOT_FOUND, format!(
            "spec.engines.poolRef: the EnginePool {pool_name} does not exist in namespace {ns}: create it, or name another (kubectl get enginepools)"
        )));
    };
    let (mine, theirs) = (&run.spec.model, &pool.spec.model);
    if (&mine.path, &mine.claim_name) != (&theirs.path, &theirs.claim_name) {
        let show = |m: &crate::api::ModelSpec| match &m.claim_name {
            Some(c) => format!("{} on claim {c}", m.path),
            None => m.path.clone(),
        };
        return (None, issue(POOL_MODEL_MISMATCH, format!(
            "spec.model.path: the run's model ({}) is not the base model of the EnginePool {pool_name} ({}): a run on a pool trains an adapter of the pool's model",
            show(mine), show(theirs)
        )));
    }
    let rank = mine.lora.as_ref().map_or(0, |l| l.rank);
    if rank > pool.spec.max_rank {
        return (None, issue(POOL_RANK_TOO_LARGE, format!(
            "spec.model.lora.rank {rank} is above the EnginePool {pool_name}'s maxRank {}: lower the rank, or raise the pool's spec.maxRank",
            pool.spec.max_rank
        )));
    }
    let on_pool = token.map(|t| OnPool::new(pool, t, &run.name_any()));
    if pool.meta().deletion_timestamp.is_some() {
        return (on_pool, issue(POOL_DELETING, format!(
            "the EnginePool {pool_name} is being deleted: it stays, and serves this run, until no run names it; name another pool in spec.engines.poolRef, or delete the run"
        )));
    }
    match on_pool {
        Some(on_pool) => (Some(on_pool), None),
        None => (None, issue(POOL_NOT_READY, format!(
            "the EnginePool {pool_name} has no token yet (Secret {}): the operator makes it when it reconciles the pool",
            children::pool_secret_name(pool_name)
        ))),
    }
}

/// Reads run `run`'s pool `pool_name` (in the run's namespace): the pool, its token and its
/// engines, each only from an object the pool controls.
pub async fn find(client: &kube::Client, run: &RLRun, pool_name: &str) -> Result<Found> {
    let ns = run.namespace().ok_or(Error::MissingMetadata("namespace"))?;
    let pools: Api<EnginePool> = Api::namespaced(client.clone(), &ns);
    let pool = (pools.get_opt(pool_name).await)
        .context(|| format!("reading the EnginePool {ns}/{pool_name}"))?;
    let uid = pool.as_ref().and_then(|p| p.uid());
    let controlled = |meta: &kube::api::ObjectMeta| {
        let owners = meta.owner_references.iter().flatten();
        uid.is_some()
            && owners
                .into_iter()
                .any(|o| o.controller == Some(true) && Some(&o.uid) == uid.as_ref())
    };
    let (mut token, mut engines) = (None, None);
    if pool.is_some() {
        let secrets: Api<Secret> = Api::namespaced(client.clone(), &ns);
        let secret_name = children::pool_secret_name(pool_name);
        let secret = (secrets.get_opt(&secret_name).await)
            .context(|| format!("reading the Secret {ns}/{secret_name}"))?;
        token = secret
            .filter(|s| controlled(&s.metadata))
            .and_then(|s| s.data?.remove(TOKEN_KEY))
            .and_then(|t| String::from_utf8(t.0).ok())
            .filter(|t| !t.is_empty());
        let sets: Api<StatefulSet> = Api::namespaced(client.clone(), &ns);
        let engines_name = children::name(pool_name, "engines");
        engines = (sets.get_opt(&engines_name).await)
            .context(|| format!("reading the StatefulSet {ns}/{engines_name}"))?
            .filter(|s| controlled(&s.metadata));
    }
    let (on_pool, issue) = judge(run, pool_name, pool.as_ref(), token.as_deref());
    Ok(Found {
        on_pool,
        issue,
        engines,
    })
}

/// The runs in `runs` (RLRuns as the API server lists them; one that does not parse counts by
/// its fields) whose `spec.engines.poolRef` names `pool`, by name, with the share their
/// coordinators report.
pub fn runs_on(pool: &str, runs: &[DynamicObject]) -> Vec<PoolRun> {
    let mut on: Vec<PoolRun> = runs
        .iter()
        .filter(|r| r.data["spec"]["engines"]["poolRef"]["name"].as_str() == Some(pool))
        .map(|r| PoolRun {
            name: r.name_any(),
            share: r.data["status"]["pool"]["share"].as_f64(),
        })
        .collect();
    on.sort_by(|a, b| a.name.cmp(&b.name));
    on
}

/// The finalizers `current` should become (`None`: as they are): [`POOL_FINALIZER`] while
/// runs are on the pool (`in_use`), none of ours once none is. A pool being deleted takes no new
/// finalizer (the API server refuses one).
pub fn finalizers(current: &[String], in_use: bool, deleting: bool) -> Option<Vec<String>> {
    let has = current.iter().any(|f| f == POOL_FINALIZER);
    match (has, in_use) {
        (false, true) if !deleting => {
            let mut more = current.to_vec();
            more.push(POOL_FINALIZER.into());
            Some(more)
        }
        (true, false) => Some(
            current
                .iter()
                .filter(|f| *f != POOL_FINALIZER)
                .cloned()
                .collect(),
        ),
        _ => None,
    }
}

/// The pool's status from its engines (as last seen) and their pods, the runs on it, and why its
/// children were not made (`refusal`), if they were not. `now` stamps conditions that change.
pub fn pool_status(
    pool: &EnginePool,
    engines: Option<&StatefulSet>,
    pods: &[Pod],
    runs: Vec<PoolRun>,
    refusal: Option<&str>,
    now: &Time,
) -> EnginePoolStatus {
    let old = pool.status.clone().unwrap_or_default();
    let generation = pool.metadata.generation;
    let name = pool.name_any();
    let r = statefulset(engines);
    let desired = pool.spec.engines.replicas;
    let waiting = format!("engines {}/{desired} ready", r.ready);
    let ready = if let Some(why) = refusal {
        cond("Ready", false, "InvalidSpec", why)
    } else if desired == 0 {
        cond(
            "Ready",
            false,
            "ScaledToZero",
            "spec.engines.replicas is 0: no engine serves the pool's runs",
        )
    } else if r.settled {
        let msg = format!("{} engines are ready", r.ready);
        cond("Ready", true, "EnginesReady", &msg)
    } else if let Some(cause) = causes::first(pods, "engine") {
        let msg = format!("waiting for {waiting} ({cause})");
        cond("Ready", false, cause.reason.as_str(), &msg)
    } else {
        let msg = format!("waiting for {waiting}");
        cond("Ready", false, "EnginesNotReady", &msg)
    };
    let mut conditions = vec![ready];
    let names: Vec<&str> = runs.iter().map(|r| r.name.as_str()).collect();
    let run_names = (!names.is_empty()).then(|| names.join(","));
    if pool.meta().deletion_timestamp.is_some() {
        conditions.push(if names.is_empty() {
            cond("Deleting", true, "NoRuns", "no run names the pool: it is being deleted")
        } else {
            let msg = format!(
                "the pool is deleted once no run names it; runs on it: {} (delete them, or name another pool in their spec.engines.poolRef)",
                names.join(", ")
            );
            cond("Deleting", true, "RunsOnPool", &msg)
        });
    }
    EnginePoolStatus {
        replicas: r.ready,
        ready: Some(format!("{}/{desired}", r.ready)),
        selector: Some(children::pool_engine_selector(&name)),
        runs,
        run_names,
        conditions: conditions
            .into_iter()
            .map(|c| stamp(c, &old.conditions, generation, now))
            .collect(),
        observed_generation: generation,
    }
}

/// Every RLRun of namespace `ns`, as the API server lists them (fresh: the pool's finalizer
/// depends on it).
async fn list_runs(client: &kube::Client, ns: &str) -> Result<Vec<DynamicObject>> {
    let ar = ApiResource::erase::<RLRun>(&());
    let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), ns, &ar);
    let list = (api.list(&ListParams::default()).await)
        .context(|| format!("listing the RLRuns of {ns}"))?;
    Ok(list.items)
}

pub(super) async fn reconcile(
    guard: Arc<DeserializeGuard<EnginePool>>,
    ctx: Arc<Ctx>,
) -> Result<Action> {
    let result = match &guard.0 {
        Ok(pool) => reconcile_pool(pool, &ctx).await,
        Err(invalid) => {
            let meta = &invalid.metadata;
            tracing::warn!(pool = ?meta.name, namespace = ?meta.namespace, error = %invalid.error, "skipping an EnginePool that does not parse");
            Ok(Action::await_change())
        }
    };
    if result.is_ok() {
        ctx.succeeded(&key(guard.meta()));
    }
    result
}

/// The backoff key of a pool (apart from a run of the same name).
fn key(meta: &kube::api::ObjectMeta) -> String {
    format!("EnginePool {}", super::key(meta))
}

/// Exponential backoff per pool, as per run.
pub(super) fn error_policy(
    guard: Arc<DeserializeGuard<EnginePool>>,
    error: &Error,
    ctx: Arc<Ctx>,
) -> Action {
    let k = key(guard.meta());
    let delay = ctx.failed(&k);
    tracing::warn!(pool = %k, error = %error, retry_in = ?delay, "reconcile failed");
    Action::requeue(delay)
}

async fn reconcile_pool(pool: &EnginePool, ctx: &Ctx) -> Result<Action> {
    let ns = pool
        .namespace()
        .ok_or(Error::MissingMetadata("namespace"))?;
    let uid = pool.uid().ok_or(Error::MissingMetadata("uid"))?;
    let name = pool.name_any();
    let runs = runs_on(&name, &list_runs(&ctx.client, &ns).await?);
    let deleting = pool.meta().deletion_timestamp.is_some();
    let api: Api<EnginePool> = Api::namespaced(ctx.client.clone(), &ns);
    if let Some(list) = finalizers(pool.finalizers(), !runs.is_empty(), deleting) {
        // The resource version makes it a compare-and-swap: a run listed above still counts.
        let patch = json!({"metadata": {
            "finalizers": list,
            "resourceVersion": pool.resource_version(),
        }});
        (api.patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await)
            .context(|| format!("setting the finalizers of the EnginePool {ns}/{name}"))?;
        ctx.metrics.write("finalizer", 1);
        if deleting && runs.is_empty() {
            tracing::info!(pool = %format!("{ns}/{name}"), "no run names the EnginePool: it goes");
            return Ok(Action::await_change());
        }
    }
    if deleting && runs.is_empty() {
        return Ok(Action::await_change());
    }
    let listed =
        apply::list_labelled(&ctx.client, &ns, (POOL_LABEL, &name), &uid, &POOL_KINDS).await?;
    let (current, refusal) = if deleting {
        // Left as they are: they serve the runs still on the pool.
        (listed.owned, None)
    } else {
        let secret = children::pool_secret_name(&name);
        let token = super::existing_token(&listed.owned, &secret).unwrap_or_else(new_token);
        match children::pool_desired(pool, &ctx.settings.children, &token) {
            Ok(desired) => {
                let synced =
                    apply::sync(&ctx.client, &ns, &uid, desired.into_list(), listed).await?;
                ctx.metrics.write("apply", synced.applied.len());
                ctx.metrics.write("delete", synced.deleted.len());
                if !synced.applied.is_empty() || !synced.deleted.is_empty() {
                    tracing::info!(pool = %format!("{ns}/{name}"), applied = ?synced.applied, deleted = ?synced.deleted, "synced the EnginePool's children");
                }
                let refusal = if synced.conflicts.is_empty() {
                    synced.refused.map(|why| {
                        format!("the API server refused an object made from the spec: {why}")
                    })
                } else {
                    let list: Vec<String> =
                        synced.conflicts.iter().map(ToString::to_string).collect();
                    Some(format!(
                        "{}: the operator applies nothing of this pool while they hold its children's names",
                        list.join("; ")
                    ))
                };
                (synced.current, refusal)
            }
            Err(why) => (listed.owned, Some(why.0)),
        }
    };
    let engines: Option<StatefulSet> = current
        .get(&(ChildKind::StatefulSet, children::name(&name, "engines")))
        .and_then(|o| serde_json::from_value(serde_json::to_value(o).ok()?).ok());
    let pods: Vec<Pod> = (ctx.pods.iter().flat_map(|store| store.state()))
        .filter(|p| {
            p.namespace().as_deref() == Some(ns.as_str())
                && p.labels().get(POOL_LABEL) == Some(&name)
        })
        .map(|p| (*p).clone())
        .collect();
    let now = Time(Timestamp::now());
    let new = pool_status(
        pool,
        engines.as_ref(),
        &pods,
        runs,
        refusal.as_deref(),
        &now,
    );
    if pool.status.as_ref() != Some(&new) {
        let body = json!({
            "apiVersion": EnginePool::api_version(&()),
            "kind": EnginePool::kind(&()),
            "status": new,
        });
        (api.patch_status(
            &name,
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(&body),
        )
        .await)
            .context(|| format!("patching the status of the EnginePool {ns}/{name}"))?;
        ctx.metrics.write("status", 1);
    }
    Ok(Action::requeue(ctx.settings.resync))
}

#[cfg(test)]
mod tests;
