//! The RLRun controller: reconcile = compute the desired children → server-side apply what
//! differs → delete orphans by label → patch status when it changed → events on transitions.
//! Beside it, the EnginePool controller ([`pool`]), whose pools runs name in
//! `spec.engines.poolRef`: each watches the other's objects, so a run reacts to its pool and a
//! pool to the runs on it.
//!
//! RLRuns are watched through [`DeserializeGuard`], so one that does not parse is reported in
//! its status and events and skipped; it never stalls the watch. The operator watches every
//! namespace, or only those it is given (one controller per namespace, each with namespaced
//! watches, so that a Role in each namespace is all the RBAC it needs). Errors back off per object
//! exponentially. Children are watched too (by the managed-by label), so a child deleted or
//! edited by hand is restored; and so are the run's pods (by the same label, mapped to their
//! run by the run label), so that a pod the scheduler cannot place or a container that crashes
//! shows in the run's status within seconds ([`causes`]).

pub mod apply;
pub mod causes;
pub mod kueue;
pub mod leader;
pub mod metrics;
pub mod pool;
pub mod status;
pub mod usage;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::apps::v1::{Deployment, StatefulSet};
use k8s_openapi::api::core::v1::{
    ConfigMap, Event as CoreEvent, ObjectReference, Pod, Secret, Service, ServiceAccount,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ApiResource, DynamicObject, Patch, PatchParams};
use kube::core::error_boundary::{DeserializeGuard, InvalidObject};
use kube::runtime::controller::{Action, Config as ControllerConfig, Controller};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Client, Resource, ResourceExt};
use rand::RngCore;
use serde_json::json;

use self::apply::{Live, FIELD_MANAGER};
use self::metrics::{Metrics, ResultLabels};
use self::status::Refusal;
use self::status::Workloads;
use crate::api::{EnginePool, Phase, RLRun, RLRunStatus};
use crate::children::{self, ChildKind, MANAGED_BY, MANAGED_BY_LABEL, RUN_LABEL, TOKEN_KEY};
use crate::error::{Context as _, Error, Result};

/// Operator-wide settings.
#[derive(Clone, Debug)]
pub struct Settings {
    /// Watch these namespaces, or every namespace when empty.
    pub namespaces: Vec<String>,
    /// Images and network facts for every run's children.
    pub children: children::Config,
    /// Reconciles running at once (never two of one run).
    pub concurrency: u16,
    /// Periodic re-check of a healthy run.
    pub resync: Duration,
}

/// What every reconcile shares.
pub struct Ctx {
    pub client: Client,
    pub settings: Settings,
    pub metrics: Arc<Metrics>,
    recorder: Recorder,
    /// Consecutive failures per run or pool, for exponential backoff ([`Ctx::failed`]).
    failures: Mutex<HashMap<String, u32>>,
    /// The runs that exist (each controller's cache): per-run metrics of the others are dropped.
    runs: Vec<Store<DeserializeGuard<RLRun>>>,
    /// The runs' pods, per scope, from watch caches (kube-runtime reflectors): a reconcile reads
    /// them without asking the API server.
    pods: Vec<Store<Pod>>,
    /// `FailedCreate` events, per scope, from watch caches: why a StatefulSet lacks pods.
    refusals: Vec<Store<CoreEvent>>,
}

/// The API of `K` in namespace `ns`, or in all namespaces.
fn scoped<K>(client: &Client, ns: &Option<String>) -> Api<K>
where
    K: Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>,
{
    match ns {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    }
}

/// A watch cache of what `api` lists with `config` (a kube-runtime reflector), once complete
/// (a reconcile that saw no pods would count no usage and give a Kueue Workload's quota back).
async fn cache<K>(api: Api<K>, config: watcher::Config) -> Store<K>
where
    K: Resource<DynamicType = ()> + Clone + std::fmt::Debug + serde::de::DeserializeOwned,
    K: Send + Sync + 'static,
{
    let (store, writer) = kube::runtime::reflector::store::<K>();
    // Without managed fields, which are most of an object's size and never read here.
    let watch = watcher(api, config).modify(|o| o.managed_fields_mut().clear());
    let stream = kube::runtime::reflector(writer, watch);
    tokio::spawn(
        stream
            .default_backoff()
            .for_each(|_| futures::future::ready(())),
    );
    if store.wait_until_ready().await.is_err() {
        tracing::error!("a watch stopped before its first list");
    }
    store
}

/// The operator's objects only (its pods and children carry the managed-by label).
fn ours() -> watcher::Config {
    watcher::Config::default().labels(&format!("{MANAGED_BY_LABEL}={MANAGED_BY}"))
}

/// Runs the controller until shutdown (SIGTERM/SIGINT): one for every namespace, or one per
/// namespace of `settings.namespaces`.
pub async fn run(client: Client, settings: Settings, metrics: Arc<Metrics>, identity: &str) {
    let scopes: Vec<Option<String>> = if settings.namespaces.is_empty() {
        vec![None]
    } else {
        settings.namespaces.iter().cloned().map(Some).collect()
    };
    let controllers: Vec<(Controller<DeserializeGuard<RLRun>>, Option<String>)> = scopes
        .into_iter()
        .map(|ns| {
            let runs = match &ns {
                Some(ns) => Api::<DeserializeGuard<RLRun>>::namespaced(client.clone(), ns),
                None => Api::<DeserializeGuard<RLRun>>::all(client.clone()),
            };
            (Controller::new(runs, watcher::Config::default()), ns)
        })
        .collect();
    let reporter = Reporter {
        controller: FIELD_MANAGER.into(),
        instance: Some(identity.into()),
    };
    // The runs' pods and the FailedCreate events, each watched into a cache per scope.
    let (mut pods, mut refusals) = (Vec::new(), Vec::new());
    for (_, ns) in &controllers {
        pods.push(cache(scoped(&client, ns), ours()).await);
        let failed = watcher::Config::default().fields("reason=FailedCreate");
        refusals.push(cache(scoped(&client, ns), failed).await);
    }
    let ctx = Arc::new(Ctx {
        recorder: Recorder::new(client.clone(), reporter),
        client: client.clone(),
        metrics: metrics.clone(),
        failures: Mutex::new(HashMap::new()),
        settings: settings.clone(),
        runs: controllers.iter().map(|(c, _)| c.store()).collect(),
        pods,
        refusals,
    });
    metrics
        .ready
        .store(true, std::sync::atomic::Ordering::Relaxed);
    let queued = kueue::served(&client).await;
    if queued {
        tracing::info!("Kueue serves Workloads here: watching those of the runs");
    }
    let pooled = pool::served(&client).await;
    if !pooled {
        tracing::warn!("the EnginePool CRD is not installed (helm upgrade does not update CRDs: kubectl apply --server-side -f crds/enginepool.yaml): runs naming a pool wait with PoolNotFound");
    }
    let pools = controllers
        .iter()
        .filter(|_| pooled)
        .map(|(_, ns)| watch_pools(&client, ns.clone(), ctx.clone()))
        .collect::<Vec<_>>();
    let running = controllers
        .into_iter()
        .map(|(controller, ns)| watch(controller, &client, ns, ctx.clone(), queued, pooled));
    futures::future::join(
        futures::future::join_all(running),
        futures::future::join_all(pools),
    )
    .await;
}

/// The EnginePools of one namespace (or all): their children, their engine pods, and the runs
/// that name them (a run that comes or goes changes the pool's status and finalizer).
async fn watch_pools(client: &Client, owned: Option<String>, ctx: Arc<Ctx>) {
    let pools = match &owned {
        Some(ns) => Api::<DeserializeGuard<EnginePool>>::namespaced(client.clone(), ns),
        None => Api::<DeserializeGuard<EnginePool>>::all(client.clone()),
    };
    let runs = match &owned {
        Some(ns) => Api::<DeserializeGuard<RLRun>>::namespaced(client.clone(), ns),
        None => Api::<DeserializeGuard<RLRun>>::all(client.clone()),
    };
    let ours = ours();
    let concurrency = ctx.settings.concurrency;
    Controller::new(pools, watcher::Config::default())
        .watches(runs, watcher::Config::default(), |guard| {
            let run = guard.0.ok()?;
            let pool = run.spec.engines.pool_ref.as_ref()?.name.clone();
            let ns = run.namespace()?;
            Some(ObjectRef::<DeserializeGuard<EnginePool>>::new(&pool).within(&ns))
        })
        .watches(scoped::<Pod>(client, &owned), ours.clone(), |pod| {
            let pool = pod.labels().get(children::POOL_LABEL)?.clone();
            let ns = pod.namespace()?;
            Some(ObjectRef::<DeserializeGuard<EnginePool>>::new(&pool).within(&ns))
        })
        .owns(scoped::<StatefulSet>(client, &owned), ours.clone())
        .owns(scoped::<Service>(client, &owned), ours.clone())
        .owns(scoped::<Secret>(client, &owned), ours.clone())
        .owns(
            scoped::<k8s_openapi::api::networking::v1::NetworkPolicy>(client, &owned),
            ours,
        )
        .with_config(ControllerConfig::default().concurrency(concurrency))
        .shutdown_on_signal()
        .run(pool::reconcile, pool::error_policy, ctx)
        .for_each(|res| async move {
            if let Err(e) = res {
                tracing::debug!(error = %e, "reconcile of an EnginePool failed");
            }
        })
        .await;
}

/// One controller: the runs of one namespace (or all), their children and their pods.
async fn watch(
    controller: Controller<DeserializeGuard<RLRun>>,
    client: &Client,
    owned: Option<String>,
    ctx: Arc<Ctx>,
    queued: bool,
    pooled: bool,
) {
    let ours = ours();
    let concurrency = ctx.settings.concurrency;
    // A pool that comes, goes or changes: the runs that name it look again.
    let controller = match pooled {
        true => {
            let runs = controller.store();
            let pools = match &owned {
                Some(ns) => Api::<DeserializeGuard<EnginePool>>::namespaced(client.clone(), ns),
                None => Api::<DeserializeGuard<EnginePool>>::all(client.clone()),
            };
            controller.watches(pools, watcher::Config::default(), move |pool| {
                let (name, ns) = (pool.name_any(), pool.namespace());
                let on = |guard: &DeserializeGuard<RLRun>| {
                    let run = guard.0.as_ref().ok()?;
                    let named = run.spec.engines.pool_ref.as_ref()?.name == name;
                    (named && run.namespace() == ns).then(|| ObjectRef::from_obj(guard))
                };
                runs.state()
                    .iter()
                    .filter_map(|g| on(g))
                    .collect::<Vec<_>>()
            })
        }
        false => controller,
    };
    // Kueue's Workloads of the runs, on a cluster that has Kueue.
    let controller = match queued {
        true => {
            let ar = kueue::api_resource("Workload");
            let api = match &owned {
                Some(ns) => Api::<DynamicObject>::namespaced_with(client.clone(), ns, &ar),
                None => Api::all_with(client.clone(), &ar),
            };
            controller.owns_with(api, ar, ours.clone())
        }
        false => controller,
    };
    controller
        // Pods belong to StatefulSets and ReplicaSets, not to the run: found by its label.
        .watches(scoped::<Pod>(client, &owned), ours.clone(), |pod| {
            let run = pod.labels().get(RUN_LABEL)?.clone();
            let ns = pod.namespace()?;
            Some(ObjectRef::<DeserializeGuard<RLRun>>::new(&run).within(&ns))
        })
        .owns(scoped::<StatefulSet>(client, &owned), ours.clone())
        .owns(scoped::<Deployment>(client, &owned), ours.clone())
        .owns(scoped::<Service>(client, &owned), ours.clone())
        .owns(scoped::<ConfigMap>(client, &owned), ours.clone())
        .owns(scoped::<Secret>(client, &owned), ours.clone())
        .owns(scoped::<ServiceAccount>(client, &owned), ours.clone())
        .owns(
            scoped::<k8s_openapi::api::rbac::v1::Role>(client, &owned),
            ours.clone(),
        )
        .owns(
            scoped::<k8s_openapi::api::rbac::v1::RoleBinding>(client, &owned),
            ours.clone(),
        )
        .owns(
            scoped::<k8s_openapi::api::policy::v1::PodDisruptionBudget>(client, &owned),
            ours.clone(),
        )
        .owns(
            scoped::<k8s_openapi::api::networking::v1::NetworkPolicy>(client, &owned),
            ours,
        )
        .with_config(ControllerConfig::default().concurrency(concurrency))
        .shutdown_on_signal()
        .run(reconcile, error_policy, ctx)
        .for_each(|res| async move {
            if let Err(e) = res {
                tracing::debug!(error = %e, "reconcile failed");
            }
        })
        .await;
}

fn key(meta: &kube::api::ObjectMeta) -> String {
    format!(
        "{}/{}",
        meta.namespace.as_deref().unwrap_or(""),
        meta.name.as_deref().unwrap_or("")
    )
}

async fn reconcile(guard: Arc<DeserializeGuard<RLRun>>, ctx: Arc<Ctx>) -> Result<Action> {
    let started = std::time::Instant::now();
    let result = match &guard.0 {
        Ok(run) => reconcile_run(run, &ctx).await,
        Err(invalid) => report_malformed(invalid, &ctx).await,
    };
    ctx.metrics
        .reconcile_seconds
        .observe(started.elapsed().as_secs_f64());
    let label = if result.is_ok() { "ok" } else { "error" };
    ctx.metrics
        .reconciles
        .get_or_create(&ResultLabels {
            result: label.into(),
        })
        .inc();
    if result.is_ok() {
        ctx.succeeded(&key(guard.meta()));
    }
    result
}

/// Exponential backoff per run: 1 s, 2 s, 4 s, … up to 5 minutes.
fn error_policy(guard: Arc<DeserializeGuard<RLRun>>, error: &Error, ctx: Arc<Ctx>) -> Action {
    let k = key(guard.meta());
    let delay = ctx.failed(&k);
    tracing::warn!(run = %k, error = %error, retry_in = ?delay, "reconcile failed");
    Action::requeue(delay)
}

impl Ctx {
    /// Forgets the failures of the object with backoff key `key` (a run's or a pool's).
    fn succeeded(&self, key: &str) {
        self.failures.lock().expect("not poisoned").remove(key);
    }

    /// Counts one more failure of the object with backoff key `key`; how long to wait before
    /// retrying it.
    fn failed(&self, key: &str) -> Duration {
        let mut failures = self.failures.lock().expect("not poisoned");
        let n = failures.entry(key.to_string()).or_insert(0);
        *n = n.saturating_add(1);
        backoff(*n)
    }
}

/// Delay before retrying a run that failed `failures` times in a row: 1 s doubling to 5 min.
fn backoff(failures: u32) -> Duration {
    Duration::from_secs(1u64 << failures.saturating_sub(1).min(9)).min(Duration::from_secs(300))
}

async fn reconcile_run(run: &RLRun, ctx: &Ctx) -> Result<Action> {
    if run.meta().deletion_timestamp.is_some() {
        // Owner references make the garbage collector delete the children.
        return Ok(Action::await_change());
    }
    let ns = run.namespace().ok_or(Error::MissingMetadata("namespace"))?;
    let uid = run.uid().ok_or(Error::MissingMetadata("uid"))?;
    let name = run.name_any();
    let listed = apply::list(&ctx.client, &ns, &name, &uid).await?;
    let token =
        existing_token(&listed.owned, &children::name(&name, "token")).unwrap_or_else(new_token);
    let (desired, found) = desired_children(run, ctx, &token).await?;
    let pool_issue = found.as_ref().and_then(|f| f.issue.clone());
    let (current, refusal, queue) = match desired {
        Ok(None) => (listed.owned, None, None),
        Ok(Some(mut desired)) => {
            let queue = admit(ctx, run, &mut desired, &listed.owned).await?;
            let synced = apply::sync(&ctx.client, &ns, &uid, desired.into_list(), listed).await?;
            ctx.metrics.write("apply", synced.applied.len());
            ctx.metrics.write("delete", synced.deleted.len());
            if !synced.applied.is_empty() || !synced.deleted.is_empty() {
                tracing::info!(run = %format!("{ns}/{name}"), applied = ?synced.applied, deleted = ?synced.deleted, "synced children");
            }
            let refusal = if !synced.conflicts.is_empty() {
                tracing::warn!(run = %format!("{ns}/{name}"), conflicts = ?synced.conflicts, "children's names are taken: nothing applied");
                Some(Refusal::conflicts(&synced.conflicts))
            } else {
                synced.refused.map(|why| {
                    tracing::warn!(run = %format!("{ns}/{name}"), refused = %why, "the API server refused a child");
                    Refusal::InvalidSpec(format!(
                        "the API server refused an object made from the spec: {why}"
                    ))
                })
            };
            (synced.current, refusal, queue)
        }
        Err(why) => (listed.owned, Some(Refusal::InvalidSpec(why.0)), None),
    };
    // What keeps the run from its pool, unless the run's own children were refused.
    let refusal = refusal.or(pool_issue.map(|i| Refusal::Pool {
        reason: i.reason,
        message: i.message,
    }));
    let now = Time(Timestamp::now());
    let mut workloads = workloads(&current, run, pods(ctx, &ns, &name));
    if let Some(f) = found {
        // The pool's engines are the run's.
        workloads.engines = f.engines;
    }
    if let Some(q) = &queue {
        owe_kueue(ctx, run, q, &current, &workloads, &now).await?;
    }
    workloads.queue = queue;
    workloads.refused = refusals(ctx, &ns, &workloads);
    let mut new = status::compute(run, &workloads, refusal.as_ref(), &now);
    let used = run.status.as_ref().and_then(|s| s.usage.as_ref());
    new.usage = Some(usage::advance(used, &workloads.pods, &now));
    observe(ctx, run, &new, &workloads);
    let usage_due = usage::due(used, new.usage.as_ref().expect("just set"));
    if status::changed(run.status.as_ref(), &new) || usage_due {
        patch_status(run, &new, ctx).await?;
        announce(run, &new, ctx).await;
    }
    if let Some(Refusal::OwnershipConflict(_)) = refusal {
        // The objects in the way are not watched (they are not the run's): look again soon.
        return Ok(Action::requeue(CONFLICT_RECHECK));
    }
    // While pods run, their usage is brought up to date every minute.
    let mut roles = new.usage.iter().flat_map(|u| u.roles.values());
    match roles.any(|r| r.gpus > 0.0 || r.cpus > 0.0) {
        true => Ok(Action::requeue(ctx.settings.resync.min(usage::WRITE_EVERY))),
        false => Ok(Action::requeue(ctx.settings.resync)),
    }
}

/// The run's children, and for a run on an EnginePool what it found of the pool: `None` while
/// the run may not use its pool (then nothing of the run is applied, [`pool::Found::issue`] says
/// why).
async fn desired_children(
    run: &RLRun,
    ctx: &Ctx,
    token: &str,
) -> Result<(
    Result<Option<children::Children>, children::InvalidSpec>,
    Option<pool::Found>,
)> {
    let config = &ctx.settings.children;
    let Some(r) = &run.spec.engines.pool_ref else {
        return Ok((children::desired(run, config, token).map(Some), None));
    };
    let found = pool::find(&ctx.client, run, &r.name).await?;
    let desired = match &found.on_pool {
        Some(on_pool) => children::desired_on_pool(run, config, token, on_pool).map(Some),
        None => Ok(None),
    };
    Ok((desired, Some(found)))
}

/// Kueue's say in the run's children (docs/operator.md, "Kueue"): the Workload carries the run's
/// priority; until Kueue admits it the run has no pods, and admitted, its pods go where the
/// flavors say. What Kueue says of the Workload (waiting, when it does not exist yet).
async fn admit(
    ctx: &Ctx,
    run: &RLRun,
    desired: &mut children::Children,
    live: &Live,
) -> Result<Option<kueue::Queued>> {
    let Some(name) = desired.workload_name() else {
        return Ok(None);
    };
    let class = run.spec.scheduling.priority_class_name.as_deref();
    if let (Some(w), Some(class)) = (desired.workload.as_mut(), class) {
        if let Some(value) = kueue::priority(&ctx.client, class).await? {
            kueue::with_priority(w, class, value);
        }
    }
    let queue = live
        .get(&(ChildKind::Workload, name.clone()))
        .map(kueue::observe);
    match queue.as_ref().filter(|q| q.admitted) {
        Some(q) => desired.place(&kueue::placement(&ctx.client, q).await?),
        None => desired.hold(),
    }
    Ok(Some(queue.unwrap_or(kueue::Queued {
        name,
        ..Default::default()
    })))
}

/// What Kueue leaves to the owner of a Workload: an evicted one's quota given back once the
/// run's pods are gone, and a finished run's Workload marked finished.
async fn owe_kueue(
    ctx: &Ctx,
    run: &RLRun,
    q: &kueue::Queued,
    current: &Live,
    w: &Workloads,
    now: &Time,
) -> Result<()> {
    let Some(live) = current.get(&(ChildKind::Workload, q.name.clone())) else {
        return Ok(());
    };
    let succeeded = run.status.as_ref().and_then(|s| s.phase) == Some(Phase::Succeeded);
    match &q.evicted {
        Some(evicted) if q.reserved && w.pods.is_empty() => {
            tracing::info!(run = %run.name_any(), reason = %evicted.reason, "the run's pods are gone: giving its Workload's quota back to Kueue");
            kueue::release(&ctx.client, live.clone(), evicted, now).await
        }
        _ if succeeded && !q.finished => kueue::finish(&ctx.client, live.clone(), now).await,
        _ => Ok(()),
    }
}

/// How often a run whose children's names are taken looks again (a few reads each time).
const CONFLICT_RECHECK: Duration = Duration::from_secs(10);

/// The run's pods (where the causes of a component that is not ready are read).
fn pods(ctx: &Ctx, ns: &str, run: &str) -> Vec<Pod> {
    let all = ctx.pods.iter().flat_map(|store| store.state());
    let ours = |p: &Pod| {
        p.namespace().as_deref() == Some(ns) && p.labels().get(RUN_LABEL).is_some_and(|r| r == run)
    };
    all.filter(|p| ours(p)).map(|p| (*p).clone()).collect()
}

/// The run's gauges from its new status, and none for runs that are gone.
fn observe(ctx: &Ctx, rl_run: &RLRun, new: &RLRunStatus, workloads: &Workloads) {
    let (ns, run) = (&rl_run.namespace().unwrap_or_default(), &rl_run.name_any());
    let run_labels = rl_run.metadata.labels.clone().unwrap_or_default();
    let existing: Vec<String> = ctx
        .runs
        .iter()
        .flat_map(|store| store.state())
        .map(|r| key(r.meta()))
        .collect();
    ctx.metrics.retain_runs(&existing);
    ctx.metrics.label_run(ns, run, &run_labels);
    ctx.metrics.observe_run(
        ns,
        run,
        new.phase,
        &status::components(workloads),
        new.usage.as_ref(),
    );
}

/// The token in the Secret `secret` among `live` (a run's `<run>-token`, a pool's `<pool>-pool`).
fn existing_token(live: &Live, secret: &str) -> Option<String> {
    let secret = live.get(&(ChildKind::Secret, secret.to_string()))?;
    let encoded = secret.data.get("data")?.get(TOKEN_KEY)?.as_str()?;
    use base64::Engine as _;
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(encoded)
        .ok()?;
    String::from_utf8(bytes).ok().filter(|t| !t.is_empty())
}

/// 32 random bytes, hex-encoded.
fn new_token() -> String {
    let mut bytes = [0u8; 32];
    rand::thread_rng().fill_bytes(&mut bytes);
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn workloads(current: &Live, rl_run: &RLRun, pods: Vec<Pod>) -> Workloads {
    let run = &rl_run.name_any();
    fn typed<K: serde::de::DeserializeOwned>(
        current: &Live,
        kind: ChildKind,
        name: String,
    ) -> Option<K> {
        let o = current.get(&(kind, name))?;
        serde_json::to_value(o)
            .ok()
            .and_then(|v| serde_json::from_value(v).ok())
    }
    Workloads {
        engines: typed(
            current,
            ChildKind::StatefulSet,
            children::name(run, "engine"),
        ),
        trainer: typed(
            current,
            ChildKind::StatefulSet,
            children::name(run, "trainer"),
        ),
        coordinator: typed(
            current,
            ChildKind::Deployment,
            children::name(run, "coordinator"),
        ),
        agents: typed(
            current,
            ChildKind::Deployment,
            children::name(run, "agents"),
        ),
        scorers: children::scorer_components(rl_run)
            .into_iter()
            .map(|c| {
                let s = typed(current, ChildKind::StatefulSet, children::name(run, c));
                (c, s)
            })
            .collect(),
        pods,
        queue: None,
        refused: BTreeMap::new(),
    }
}

/// How old a FailedCreate event may be to say why a StatefulSet lacks pods.
const REFUSAL_FRESH: i64 = 300;

/// Why the run's workloads could not create pods (a ResourceQuota, an admission policy), for the
/// components with fewer pods than they want: a Deployment's `ReplicaFailure` condition, a
/// StatefulSet's newest `FailedCreate` event of the last minutes (from the events cache).
fn refusals(ctx: &Ctx, ns: &str, w: &Workloads) -> BTreeMap<&'static str, String> {
    let mut out = BTreeMap::new();
    for (name, d) in [("coordinator", &w.coordinator), ("agents", &w.agents)] {
        let conditions = d
            .iter()
            .flat_map(|d| d.status.iter().flat_map(|s| s.conditions.iter().flatten()));
        let mut failures = conditions.filter(|c| {
            c.type_.as_deref() == Some("ReplicaFailure") && c.status.as_deref() == Some("True")
        });
        if let Some(message) = failures.next().and_then(|c| c.message.clone()) {
            out.insert(name, message);
        }
    }
    let now = Timestamp::now();
    let events: Vec<_> = ctx
        .refusals
        .iter()
        .flat_map(|store| store.state())
        .collect();
    let scorers = w.scorers.iter().map(|(name, s)| (*name, s));
    for (name, s) in [("engines", &w.engines), ("trainer", &w.trainer)]
        .into_iter()
        .chain(scorers)
    {
        let Some(s) = s.as_ref().filter(|s| {
            s.status.as_ref().map_or(0, |st| st.replicas) < s.spec.replicas.unwrap_or(1)
        }) else {
            continue;
        };
        let about = |e: &CoreEvent| {
            let o = &e.involved_object;
            o.kind.as_deref() == Some("StatefulSet")
                && o.namespace.as_deref() == Some(ns)
                && o.name == s.metadata.name
        };
        let fresh = events.iter().filter(|e| about(e));
        let fresh = fresh.filter_map(|e| Some((e.last_timestamp.as_ref()?.0, e.message.as_ref()?)));
        let fresh = fresh.filter(|(at, _)| now.duration_since(*at).as_secs() < REFUSAL_FRESH);
        if let Some((_, message)) = fresh.max_by_key(|(at, _)| *at) {
            out.insert(name, message.clone());
        }
    }
    out
}

/// Server-side applies the operator's status fields (the coordinator's stay untouched).
async fn patch_status(run: &RLRun, status: &RLRunStatus, ctx: &Ctx) -> Result<()> {
    let api: Api<RLRun> = Api::namespaced(ctx.client.clone(), &run.namespace().unwrap_or_default());
    let body = json!({
        "apiVersion": RLRun::api_version(&()),
        "kind": RLRun::kind(&()),
        "status": status,
    });
    api.patch_status(
        &run.name_any(),
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(&body),
    )
    .await
    .context(|| format!("patching the status of {}", run.name_any()))?;
    ctx.metrics.write("status", 1);
    Ok(())
}

/// Events: when the phase changes (Warning for Degraded and Failed), and a Warning when the
/// cause that keeps the run from ready changes (reason: the cause, note: the message).
async fn announce(run: &RLRun, new: &RLRunStatus, ctx: &Ctx) {
    let old = run.status.as_ref();
    if let Some((reason, message)) = cause(new).filter(|c| old.and_then(cause) != Some(*c)) {
        let event = Event {
            type_: EventType::Warning,
            reason: reason.into(),
            note: Some(note(message)),
            action: "Reconcile".into(),
            secondary: None,
        };
        if let Err(e) = ctx.recorder.publish(&event, &run.object_ref(&())).await {
            tracing::warn!(error = %e, "cannot publish an event");
        }
    }
    let Some(phase) = new.phase.filter(|p| Some(*p) != old.and_then(|s| s.phase)) else {
        return;
    };
    let message = new
        .conditions
        .iter()
        .find(|c| c.type_ == "Ready")
        .map(|c| c.message.clone());
    let type_ = if matches!(phase, Phase::Degraded | Phase::Failed) {
        EventType::Warning
    } else {
        EventType::Normal
    };
    let event = Event {
        type_,
        reason: format!("{phase:?}"),
        note: message.as_deref().map(note),
        action: "Reconcile".into(),
        secondary: None,
    };
    if let Err(e) = ctx.recorder.publish(&event, &run.object_ref(&())).await {
        tracing::warn!(error = %e, "cannot publish an event");
    }
}

/// An event's note: at most 1 kB (the API server refuses longer ones), cut at a character.
fn note(message: &str) -> String {
    const MAX: usize = 1000;
    if message.len() <= MAX {
        return message.to_string();
    }
    let mut end = MAX - "…".len();
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &message[..end])
}

/// The cause in a status (a Degraded condition whose reason is one of [`causes::Reason`], or an
/// ownership conflict), as reason and message.
fn cause(status: &RLRunStatus) -> Option<(&str, &str)> {
    status
        .conditions
        .iter()
        .find(|c| c.type_ == "Degraded" && c.status == "True")
        .filter(|c| {
            c.reason == status::OWNERSHIP_CONFLICT
                || c.reason.starts_with("Pool")
                || causes::Reason::ALL.iter().any(|r| r.as_str() == c.reason)
        })
        .map(|c| (c.reason.as_str(), c.message.as_str()))
}

/// An RLRun that does not parse: say why in its status and events, once; never retry it until
/// it changes.
async fn report_malformed(invalid: &InvalidObject, ctx: &Ctx) -> Result<Action> {
    let meta = &invalid.metadata;
    let (Some(ns), Some(name)) = (meta.namespace.clone(), meta.name.clone()) else {
        return Ok(Action::await_change());
    };
    tracing::warn!(run = %format!("{ns}/{name}"), error = %invalid.error, "skipping an RLRun that does not parse");
    let ar = ApiResource::erase::<RLRun>(&());
    let api: Api<DynamicObject> = Api::namespaced_with(ctx.client.clone(), &ns, &ar);
    let message = format!("the RLRun cannot be read: {}", invalid.error);
    let current = api
        .get_status(&name)
        .await
        .context(|| format!("reading {ns}/{name}"))?;
    let status = current.data.get("status");
    let already = status.and_then(|s| s.get("phase")).and_then(|p| p.as_str()) == Some("Failed")
        && status
            .and_then(|s| s.get("conditions"))
            .and_then(|c| c.as_array())
            .is_some_and(|c| {
                c.iter()
                    .any(|c| c.get("message").and_then(|m| m.as_str()) == Some(message.as_str()))
            });
    if already {
        return Ok(Action::await_change());
    }
    let now = Time(Timestamp::now());
    let body = json!({
        "apiVersion": ar.api_version, "kind": ar.kind,
        "status": {
            "phase": "Failed",
            "observedGeneration": meta.generation,
            "conditions": [
                {"type": "Ready", "status": "False", "reason": "MalformedSpec", "message": message,
                 "lastTransitionTime": now, "observedGeneration": meta.generation},
                {"type": "Degraded", "status": "True", "reason": "MalformedSpec", "message": message,
                 "lastTransitionTime": now, "observedGeneration": meta.generation},
            ],
        },
    });
    api.patch_status(
        &name,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(&body),
    )
    .await
    .context(|| format!("reporting {ns}/{name} as malformed"))?;
    ctx.metrics.write("status", 1);
    let reference = ObjectReference {
        api_version: Some(ar.api_version.clone()),
        kind: Some(ar.kind.clone()),
        name: Some(name),
        namespace: Some(ns),
        uid: meta.uid.clone(),
        resource_version: meta.resource_version.clone(),
        ..ObjectReference::default()
    };
    let event = Event {
        type_: EventType::Warning,
        reason: "MalformedSpec".into(),
        note: Some(note(&message)),
        action: "Reconcile".into(),
        secondary: None,
    };
    if let Err(e) = ctx.recorder.publish(&event, &reference).await {
        tracing::warn!(error = %e, "cannot publish an event");
    }
    Ok(Action::await_change())
}

/// The API server's addresses and ports, from the `default/kubernetes` Service's EndpointSlices:
/// NetworkPolicies see a connection's destination after the Service's address is translated.
/// `None` (logged) when they cannot be read.
pub async fn api_server_egress(
    client: &kube::Client,
) -> Option<k8s_openapi::api::networking::v1::NetworkPolicyEgressRule> {
    use k8s_openapi::api::discovery::v1::EndpointSlice;
    let api: kube::Api<EndpointSlice> = kube::Api::namespaced(client.clone(), "default");
    let lp = kube::api::ListParams::default().labels("kubernetes.io/service-name=kubernetes");
    match api.list(&lp).await {
        Ok(list) => children::egress_to(&list.items),
        Err(e) => {
            tracing::warn!("the API server's endpoints could not be read ({e}): agent pods of runs with spec.agent.sandbox may not reach it where NetworkPolicies are enforced; set --agent-api-server");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::backoff;

    #[test]
    fn event_notes_fit_the_api_servers_kilobyte() {
        assert_eq!(super::note("short"), "short");
        let long = "é".repeat(2000);
        let n = super::note(&long);
        assert!(n.len() <= 1000 && n.ends_with('…'), "{}", n.len());
    }

    #[test]
    fn backoff_doubles_from_one_second_to_five_minutes() {
        let delays: Vec<u64> = (1..=11).map(|n| backoff(n).as_secs()).collect();
        assert_eq!(delays, [1, 2, 4, 8, 16, 32, 64, 128, 256, 300, 300]);
        assert_eq!(backoff(u32::MAX), Duration::from_secs(300));
    }
}
