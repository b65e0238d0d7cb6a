//! `moult coordinator`: the hub of a cluster run. It serves, on one port, the engine API of the
//! router (agents generate through it, the trainer's weight updates fan out through it) and the
//! coordinator API of [`super::protocol`]; it runs the rollout pool (data cursor, admission,
//! staleness) over the agent pods ([`super::remote`]); and it reports to the RLRun's status.
//!
//! Steps: the batch of step N is formed from finished groups and kept until the trainer commits
//! N (a trainer that restarts asks again and gets the same groups), then its groups are dropped,
//! which frees their admission slots. A trainer that resumed from an older checkpoint says so in
//! its hello and the step count follows it.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::task::Poll;
use std::time::{Duration, Instant};

use axum::extract::{DefaultBodyLimit, Path as UrlPath, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Json;
use moult_operator::api::{Phase, RLRunStatus, RunPoolStatus};
use serde::Deserialize;
use serde_json::json;
use tokio::sync::{mpsc, watch};

use super::discovery::Owner;
use super::protocol::{
    Commit, CoordinatorStatus, Episode, Hello, HelloReply, Lease, Leases, Quarantined, Version,
};
use super::remote::RemoteAgents;
use crate::auth::{AgentGate, Limit};
use crate::config::{RunConfig, Sources};
use crate::engine::ApiError;
use crate::error::RunError;
use crate::records::metrics;
use crate::rollout::eval::{self, EvalResult};
use crate::rollout::{fill_batch, Group, RolloutPool, RolloutState};
use crate::router::{server, EnginePool, Router};
use crate::stages::judge::Judge;
use crate::stages::teacher::Teacher;
use crate::stages::{self, Stage, StepBatch};

/// How `moult coordinator` runs.
#[derive(Debug, Clone)]
pub struct CoordinatorOptions {
    pub config: PathBuf,
    pub host: String,
    pub port: u16,
    /// Fixes the task order.
    pub seed: u64,
    /// How long a lease or batch request waits for work before answering "none yet".
    pub poll: Duration,
    /// How long an episode's lease lasts unless its agent pod renews it.
    pub lease_time: Duration,
}

/// The trainer's side of the coordinator.
#[derive(Debug)]
struct Train {
    queue: mpsc::Receiver<Group>,
    /// Steps the trainer committed.
    committed: u64,
    /// The newest policy version number handed out.
    issued: u64,
    /// The groups of step `committed + 1` while they are gathered.
    pending: Vec<Group>,
    /// The batch of step `committed + 1` once gathered and through the stages, kept until it is
    /// committed; and whether the stages are at it now (its groups are out of `pending`).
    ready: Option<StepBatch>,
    scoring: bool,
    hellos: u64,
}

#[derive(Debug)]
struct Coordinator {
    cfg: RunConfig,
    pool: RolloutPool,
    agents: Arc<RemoteAgents>,
    router: Arc<Router>,
    /// What the agent pods may hold at once here, and what they were refused.
    gate: Arc<AgentGate>,
    train: tokio::sync::Mutex<Train>,
    /// What `GET /v1/status` shows (kept apart from `train`, which a batch request holds while
    /// it waits).
    status: Mutex<CoordinatorStatus>,
    reports: watch::Sender<RLRunStatus>,
    poll: Duration,
    /// The seed of the task order (the trainer checkpoints it with each step).
    seed: u64,
    started: Instant,
    /// The step whose evaluation (`spec.eval`) is running; the newest finished one is the
    /// status's.
    eval_running: Mutex<Option<u64>>,
    /// The batch stages that run here (a served teacher over its engines, the judge of
    /// `spec.judge` over its engines, ...).
    stages: Vec<Box<dyn Stage>>,
    /// Wakes batch requests that wait for an evaluation or the stages.
    wake: tokio::sync::Notify,
}

type Shared = State<Arc<Coordinator>>;

/// `batch` through the stages, then ready to go out. When a stage failed (a judge's or teacher's
/// engines are starting, or were replaced) the groups go back to be staged again after a pause.
async fn stage_batch(c: Arc<Coordinator>, mut batch: StepBatch) {
    let staged = stages::apply(&c.stages, &mut batch).await;
    if let Err(e) = &staged {
        tracing::warn!("{e}; scoring the batch again in {SCORING_RETRY:?}");
        tokio::time::sleep(SCORING_RETRY).await;
    }
    let mut t = c.train.lock().await;
    match staged {
        Ok(()) => t.ready = Some(batch),
        Err(_) => t.pending = batch.groups,
    }
    t.scoring = false;
    drop(t);
    c.wake.notify_waiters();
}

/// "Not yet" (204) to a batch request, once an evaluation or the stages are done or `poll` has
/// passed. Registered for the wake-up before `guard` (the training state's lock) goes, so a
/// notification sent under that lock is not missed.
async fn not_yet(c: &Coordinator, guard: tokio::sync::MutexGuard<'_, Train>) -> Response {
    let done = c.wake.notified();
    tokio::pin!(done);
    done.as_mut().enable();
    drop(guard);
    let _ = tokio::time::timeout(c.poll, done).await;
    StatusCode::NO_CONTENT.into_response()
}

/// The pause before a batch whose scoring failed (every judge request, or a segment the
/// teacher's engines could not score) is scored again.
const SCORING_RETRY: Duration = Duration::from_secs(5);

/// Four decimals: what `kubectl get rlr` prints (and all a status needs).
fn round4(x: f64) -> f64 {
    (x * 1e4).round() / 1e4
}

/// An error in the engine API's shape (the coordinator serves that API too).
fn error(status: StatusCode, message: impl std::fmt::Display) -> Response {
    ApiError::new(status, message.to_string()).into_response()
}

impl Coordinator {
    fn status(&self) -> CoordinatorStatus {
        CoordinatorStatus {
            rollout: self.pool.stats(),
            policy_version: self.pool.version(),
            data: self.pool.state(),
            agents: self.agents.stats(),
            agents_refused: [Limit::Requests, Limit::Generations, Limit::EpisodeBytes]
                .map(|l| self.gate.refused(l)),
            ..self.status.lock().expect("status lock").clone()
        }
    }

    /// The evaluation of the policy of `step` (served now), when one is due: ready (`None`: none
    /// is due), or pending (running; started here if it was not). The next step's batch waits
    /// for it.
    fn eval_gate(self: &Arc<Self>, step: u64) -> Poll<Option<EvalResult>> {
        let total = self.cfg.total_steps;
        let Some(opts) = self.cfg.eval.clone().filter(|e| e.due(step, total)) else {
            return Poll::Ready(None);
        };
        let mut running = self.eval_running.lock().expect("eval lock");
        let status = self.status.lock().expect("status lock");
        if let Some(done) = status.eval.as_ref().filter(|e| e.step == step) {
            return Poll::Ready(Some(done.clone()));
        }
        if *running != Some(step) {
            *running = Some(step);
            let c = self.clone();
            tokio::spawn(async move {
                let version = c.pool.version();
                eprintln!(
                    "moult coordinator: evaluating the policy of step {step} (version {version})"
                );
                let r = eval::evaluate(c.agents.as_ref(), &opts, (step, version), &|_, _| {}).await;
                c.evaluated(r);
            });
        }
        Poll::Pending
    }

    /// An evaluation finished: the status says so (and, after the last step, that the run
    /// succeeded); batch requests waiting for it go on.
    fn evaluated(&self, r: EvalResult) {
        eprintln!("{}", eval::line(&r));
        self.reports.send_modify(|report| {
            let m = report.metrics.get_or_insert_default();
            m.eval_step = Some(r.step);
            m.eval_reward = Some(round4(r.eval_reward_mean));
            m.eval_pass_at_k = Some(round4(r.eval_pass_at_k));
            let done = report.step >= Some(self.cfg.total_steps);
            report.phase = done.then_some(Phase::Succeeded);
        });
        // Under the lock `eval_gate` reads both with, so no evaluation starts twice.
        let mut running = self.eval_running.lock().expect("eval lock");
        self.status.lock().expect("status lock").eval = Some(r);
        *running = None;
        drop(running);
        self.wake.notify_waiters();
    }
}

/// The largest request bodies the coordinator reads, per route: an episode (a long multi-turn
/// trajectory with MoE routing data is tens of MiB), a generate request through the router (a long
/// context's token ids), and everything else (leases, versions, step records).
const EPISODE_BODY_LIMIT: usize = 256 << 20;
const ROUTER_BODY_LIMIT: usize = 32 << 20;
const CONTROL_BODY_LIMIT: usize = 1 << 20;

/// An episode to run, or "none yet" (204) after `poll`.
async fn lease(State(c): Shared) -> Result<Json<Lease>, StatusCode> {
    let lease = c.agents.lease(c.poll).await;
    lease.map(Json).ok_or(StatusCode::NO_CONTENT)
}

async fn episode(State(c): Shared, UrlPath(lease): UrlPath<String>, body: String) -> Response {
    let episode: Episode = match serde_json::from_str(&body) {
        Ok(e) => e,
        Err(e) => return error(StatusCode::BAD_REQUEST, format!("not an episode: {e}")),
    };
    Json(json!({"accepted": c.agents.complete(&lease, episode)})).into_response()
}

async fn renew(State(c): Shared, Json(l): Json<Leases>) -> Response {
    Json(json!({"unknown": c.agents.renew(&l.leases)})).into_response()
}

async fn hello(State(c): Shared, Json(hello): Json<Hello>) -> Response {
    let mut t = c.train.lock().await;
    t.hellos += 1;
    if t.hellos > 1 {
        tracing::warn!(
            step = hello.step,
            committed = t.committed,
            "the trainer restarted; it resumes from step {}",
            hello.step
        );
        c.status.lock().expect("status lock").trainer_restarts += 1;
        // A trainer that keeps stopping on one batch sets it aside when it gets it again.
        if let Some(ready) = t.ready.as_mut() {
            ready.restarts += 1;
        }
    }
    // A batch of a step the trainer trained but could not commit (it stopped) is spent.
    t.ready = t.ready.take().filter(|b| b.step > hello.step);
    t.committed = hello.step;
    c.status.lock().expect("status lock").step = hello.step;
    c.pool.learn_limits(hello.limits);
    // The first hello this coordinator hears, from a trainer that has been training: this
    // coordinator restarted, and the trainer knows where the data stood.
    if let (1, Some(rollout)) = (t.hellos, hello.rollout) {
        eprintln!(
            "moult coordinator: the trainer says the data stood at task {} of epoch {}: going on from there",
            rollout.cursor, rollout.epoch
        );
        c.pool.seek(rollout);
    }
    // Weights other than the engines' (a checkpoint, or the model after updates went out) are
    // published under a new version, so versions only increase.
    // A LoRA run on an EnginePool or vLLM publishes its adapter before it generates.
    let adapters = c.cfg.run.spec.versioned_adapters();
    let publish_as = (t.issued > 0 || hello.step > 0 || adapters).then(|| {
        t.issued += 1;
        t.issued
    });
    Json(HelloReply { publish_as }).into_response()
}

#[derive(Debug, Deserialize)]
struct BatchQuery {
    step: u64,
}

async fn batch(State(c): Shared, Query(q): Query<BatchQuery>) -> Response {
    let mut guard = c.train.lock().await;
    let t = &mut *guard;
    if t.hellos == 0 {
        // This coordinator (re)started after the trainer: it must hear the trainer's step and
        // data cursor first.
        let why =
            "this coordinator has not heard the trainer's hello: POST /v1/trainer/hello first";
        return error(StatusCode::CONFLICT, why);
    }
    let (step, committed) = (q.step, t.committed);
    if step != committed + 1 {
        let next = committed + 1;
        let message = format!(
            "step {step} is not next: {committed} steps are committed, ask for step {next}"
        );
        return error(StatusCode::CONFLICT, message);
    }
    if t.scoring {
        // The batch is with the stages (a judge, a teacher).
        return not_yet(&c, guard).await;
    }
    if let Some(ready) = t.ready.as_mut() {
        // The same batch until its step is committed (a trainer that resumed from an older
        // checkpoint trains it as the step it asks for).
        ready.step = q.step;
        return Json(&*ready).into_response();
    }
    // The policy the trainer would train on next is evaluated first, when due.
    let Poll::Ready(eval) = c.eval_gate(q.step - 1) else {
        return not_yet(&c, guard).await;
    };
    let filled = fill_batch(&c.pool, &mut t.queue, &c.cfg.rollout, &mut t.pending);
    match tokio::time::timeout(c.poll, filled).await {
        Err(_) => return StatusCode::NO_CONTENT.into_response(),
        Ok(None) => return error(StatusCode::SERVICE_UNAVAILABLE, "the rollout pool stopped"),
        Ok(Some(())) => {}
    }
    let groups = std::mem::take(&mut t.pending);
    let batch = StepBatch {
        eval,
        ..StepBatch::drawn(q.step, groups, &c.pool, c.seed)
    };
    if c.stages.is_empty() {
        return Json(t.ready.insert(batch)).into_response();
    }
    // The batch goes through the stages (once) before it goes out.
    t.scoring = true;
    // It cannot notify before `guard` is dropped: it hands the batch back under the lock.
    tokio::spawn(stage_batch(c.clone(), batch));
    not_yet(&c, guard).await
}

async fn version(State(c): Shared) -> Response {
    let mut t = c.train.lock().await;
    t.issued += 1;
    Json(Version { version: t.issued }).into_response()
}

/// The engines serve `v` now.
async fn published(State(c): Shared, Json(v): Json<Version>) -> Response {
    c.pool.set_version(v.version);
    c.reports
        .send_modify(|report| report.policy_version = Some(v.version));
    Json(json!({})).into_response()
}

async fn commit(State(c): Shared, Json(commit): Json<Commit>) -> Response {
    let mut t = c.train.lock().await;
    if commit.step <= t.committed {
        // A retried commit whose answer was lost.
        return Json(json!({"committed": t.committed})).into_response();
    }
    // A coordinator that started after the trainer (it restarted) takes the trainer's count.
    if commit.step != t.committed + 1 && t.hellos > 0 {
        let (step, committed) = (commit.step, t.committed);
        let message = format!("step {step} cannot be committed after step {committed}");
        return error(StatusCode::CONFLICT, message);
    }
    t.committed = commit.step;
    // Its groups are done with: their admission slots go back to generation.
    t.ready = None;
    drop(t);
    // The engines serve the step's version now; the report below carries it with the step.
    c.pool.set_version(commit.version);
    let r = &commit.record;
    {
        let mut s = c.status.lock().expect("status lock");
        s.step = commit.step;
        s.reward = Some(r.reward_mean);
        s.last_checkpoint = commit.checkpoint.clone().or(s.last_checkpoint.take());
    }
    // The new policy's evaluation starts now when due (the next batch waits for it).
    let eval_running = c.eval_gate(commit.step).is_pending();
    // A run on an EnginePool: its share of the pool's engines (docs/lora.md, "Fair share").
    let pool = c.cfg.run.spec.engines.pool_ref.as_ref();
    let share = if pool.is_some() {
        c.router.pool_share().await
    } else {
        None
    };
    c.reports.send_modify(|report| {
        report.step = Some(commit.step);
        report.policy_version = Some(commit.version);
        let m = report.metrics.get_or_insert_default();
        m.reward = Some(round4(r.reward_mean));
        m.response_length = Some(round4(r.response_tokens_mean));
        m.masked_fraction = Some(round4(r.masked_fraction));
        report.last_checkpoint = commit.checkpoint.clone().or(report.last_checkpoint.take());
        report.pool = pool.map(|p| RunPoolStatus {
            name: p.name.clone(),
            share: share.map(round4),
        });
        // After the last step the run has succeeded, once the final evaluation (when due) is
        // done.
        let done = commit.step >= c.cfg.total_steps && !eval_running;
        report.phase = done.then_some(Phase::Succeeded);
    });
    // The time left, from the mean step time so far (after the first step, which loads).
    let (done, total) = (commit.step, c.cfg.total_steps);
    let left = total.saturating_sub(done) as f64 / done as f64;
    let eta = (done > 1).then(|| c.started.elapsed().mul_f64(left));
    eprintln!("{}", metrics::progress_line(r, total, eta));
    Json(json!({"committed": commit.step})).into_response()
}

/// The trainer set the batch of a step aside: its groups are dropped (their slots go back to
/// generation), and the step's next batch request draws new ones.
async fn quarantine(State(c): Shared, Json(q): Json<Quarantined>) -> Response {
    let mut t = c.train.lock().await;
    if q.step == t.committed + 1 && t.ready.take().is_some() {
        c.pool.quarantined();
        tracing::warn!(
            step = q.step,
            "the trainer set the batch aside: {}",
            q.error
        );
    }
    Json(json!({})).into_response()
}

async fn status(State(c): Shared) -> Json<CoordinatorStatus> {
    Json(c.status())
}

async fn prometheus(State(c): Shared) -> String {
    let mut registry = prometheus_client::registry::Registry::default();
    server::register_metrics(&c.router, &mut registry);
    let s = c.status();
    let (a, r) = (&s.agents, &s.rollout);
    #[rustfmt::skip]
    let gauges = [
        ("moult_step", "Training steps committed", s.step),
        ("moult_policy_version", "Policy version the engines serve", s.policy_version),
        ("moult_episodes_waiting", "Episodes waiting for an agent pod", a.episodes_waiting as u64),
        ("moult_episodes_leased", "Episodes an agent pod is running", a.episodes_leased as u64),
        ("moult_leases_expired", "Episodes run again because their agent pod went silent", a.leases_expired),
        ("moult_groups_dropped_stale", "Groups dropped for staleness", r.dropped_stale),
        ("moult_groups_dropped_failed", "Groups dropped because an episode failed", r.dropped_failed),
        ("moult_groups_dropped_invalid", "Groups dropped because an episode was malformed", r.dropped_invalid),
        ("moult_groups_filtered", "Groups dynamic sampling dropped because every reward was equal", r.groups_filtered),
        ("moult_batches_quarantined", "Batches the trainer could not learn from, set aside", r.batches_quarantined),
        ("moult_trainer_restarts", "Times the trainer started again", s.trainer_restarts),
        ("moult_agent_requests_refused", "Agent requests refused: too many open", s.agents_refused[0]),
        ("moult_agent_generations_refused", "Agent generations refused: too many at once", s.agents_refused[1]),
        ("moult_agent_episodes_refused", "Agent episodes refused: too many bytes at once", s.agents_refused[2]),
    ];
    for (name, help, value) in gauges {
        super::gauge(&mut registry, name, help).set(value as f64);
    }
    crate::serve::metrics_text(&registry)
}

/// The judge of `spec.judge` as the coordinator asks it: a router of its own over the judge's
/// engines (`MOULT_JUDGE_ENGINES`: the judge Service, whose EndpointSlices it follows, or engine
/// URLs), served on this pod's loopback, with the judge's tokenizer and chat template; replies
/// are read with the policy's tokenizer (`MOULT_MODEL`).
async fn judge(
    cfg: &RunConfig,
    opts: &crate::config::JudgeOptions,
    client: Option<kube::Client>,
    ns: &str,
) -> Result<Judge, RunError> {
    let setup = |e: &dyn std::fmt::Display| RunError::Setup(format!("spec.judge: {e}"));
    let run = Owner::Run(cfg.name.clone());
    let (pool, _) = engine_pool("MOULT_JUDGE_ENGINES", client, ns, run)?;
    let router = crate::router::for_run(pool);
    let listener = super::bind("127.0.0.1:0", "spec.judge: binding 127.0.0.1".into()).await?;
    let url = format!("http://{}", listener.local_addr().map_err(|e| setup(&e))?);
    tokio::spawn(server::serve(listener, router, std::future::pending()));
    let policy = super::env_path("MOULT_MODEL").ok_or_else(|| {
        setup(&"MOULT_MODEL (the policy's model folder, whose tokenizer reads the replies) is not set")
    })?;
    let episodes = cfg.rollout.batch_size * cfg.rollout.group_size;
    Judge::connect(&url, opts, &policy, episodes)
}

/// The engines the environment variable `variable` names: a Service of `owner` (the run, or its
/// EnginePool), whose EndpointSlices the pool follows from now on (through the Kubernetes API),
/// or a comma-separated list of URLs. Returns the pool and what the variable said.
fn engine_pool(
    variable: &str,
    client: Option<kube::Client>,
    ns: &str,
    owner: Owner,
) -> Result<(Arc<EnginePool>, String), RunError> {
    let engines = super::env_var(variable)?;
    let pool = Arc::new(EnginePool::default());
    if engines.starts_with("http://") || engines.starts_with("https://") {
        for url in engines.split(',').map(str::trim).filter(|u| !u.is_empty()) {
            pool.add(url);
        }
    } else {
        let client = client.ok_or_else(|| {
            RunError::Setup(format!(
                "{variable} names the Service `{engines}`, whose EndpointSlices need the Kubernetes API (run in the pod, or set KUBECONFIG), or give engine URLs"
            ))
        })?;
        let (ns, service) = (ns.to_string(), engines.clone());
        let follow = super::discovery::follow(client, ns, owner, service, pool.clone());
        tokio::spawn(follow);
    }
    Ok((pool, engines))
}

/// Runs the coordinator until `shutdown` resolves.
pub async fn run(
    opts: CoordinatorOptions,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), RunError> {
    let (run, config_dir) = super::manifest(&opts.config)?;
    // Evaluation episodes queue for every agent pod's share at once.
    let agent_slots = run.spec.agent.replicas.max(1) as usize * run.spec.agent.concurrency as usize;
    let beside = Sources::beside_manifest(&run, &config_dir);
    let sources = Sources {
        tasks: super::mounted("MOULT_TASKS", beside.tasks),
        eval_tasks: super::mounted("MOULT_EVAL_TASKS", beside.eval_tasks),
        judge: super::mounted("MOULT_JUDGE_MODEL", beside.judge),
        dir: beside.dir,
        ..Sources::default()
    };
    let mut cfg = RunConfig::from_sources(run, &sources)?;
    if let Some(e) = &mut cfg.eval {
        e.concurrency = agent_slots;
    }
    // A Kubernetes client from the pod's service account (or `KUBECONFIG`), if there is one.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let client = kube::Client::try_default().await.inspect_err(|e| {
        tracing::info!("no Kubernetes API ({e}): the RLRun's status will not be written");
    });
    let client = client.ok();
    // The run's namespace: the manifest's, else the pod's (`POD_NAMESPACE`), else `default`.
    let ns = cfg.run.metadata.namespace.clone();
    let ns = ns
        .or_else(|| std::env::var("POD_NAMESPACE").ok())
        .unwrap_or_else(|| "default".into());

    // The router, over the engines of the Service (or a fixed list): the run's own, or its
    // EnginePool's. A LoRA run on a pool or vLLM routes nothing until its first adapter is up.
    let owner = match &cfg.run.spec.engines.pool_ref {
        Some(pool) => Owner::Pool(pool.name.clone()),
        None => Owner::Run(cfg.name.clone()),
    };
    let (pool, engines) = engine_pool("MOULT_ENGINES", client.clone(), &ns, owner)?;
    if cfg.run.spec.versioned_adapters() {
        pool.updated(&[], 1);
    }
    let router = crate::router::for_run(pool);
    let judge = match &cfg.judge {
        Some(opts) => Some(judge(&cfg, opts, client.clone(), &ns).await?),
        None => None,
    };

    // A served distillation teacher: its engines' Service (or URLs), health-checked.
    let teacher = match cfg.served_teacher {
        Some(_) => {
            let run = Owner::Run(cfg.name.clone());
            let (pool, _) = engine_pool("MOULT_TEACHER_ENGINES", client.clone(), &ns, run)?;
            tokio::spawn(pool.clone().check_health(Default::default()));
            Some(Teacher::new(pool))
        }
        None => None,
    };
    // The coordinator's stages: those that need the run's engines (the trainer dumps).
    let parts = stages::Parts {
        teacher,
        judge,
        ..stages::Parts::default()
    };
    let stages = stages::ordered(&cfg.run.spec, parts);

    // The rollout pool over the agent pods.
    let agents = Arc::new(RemoteAgents::new(opts.lease_time));
    let dataset = Arc::new(crate::config::ordered(&cfg.tasks, opts.seed));
    // The data from its start; a trainer that has been training says in its hello where it stood.
    let cursor = RolloutState::default();
    let (pool, queue) =
        RolloutPool::start(agents.clone(), dataset, cfg.rollout.clone(), cursor, 0)?;

    // A coordinator that restarted goes on from what the run's status says (versions only
    // increase); the trainer tells it its step.
    let previous = match &client {
        Some(client) => super::status::read(client.clone(), &ns, &cfg.name).await,
        None => RLRunStatus::default(),
    };
    let (issued, committed) = (previous.policy_version, previous.step);
    let (issued, committed) = (issued.unwrap_or(0), committed.unwrap_or(0));
    if issued > 0 {
        eprintln!(
            "moult coordinator: the run's status says step {committed}, version {issued}: going on from there"
        );
    }
    pool.set_version(issued);
    let (reports, report_rx) = watch::channel(previous);
    if let Some(client) = client {
        let name = cfg.name.clone();
        tokio::spawn(super::status::write_reports(client, ns, name, report_rx));
    }
    let total_steps = cfg.total_steps;
    let coordinator = Arc::new(Coordinator {
        pool: pool.clone(),
        agents,
        router: router.clone(),
        gate: AgentGate::new(cfg.run.spec.agent_limits()),
        train: tokio::sync::Mutex::new(Train {
            queue,
            committed,
            issued,
            pending: Vec::new(),
            ready: None,
            scoring: false,
            hellos: 0,
        }),
        status: Mutex::new(CoordinatorStatus {
            total_steps,
            step: committed,
            ..CoordinatorStatus::default()
        }),
        reports,
        poll: opts.poll,
        seed: opts.seed,
        started: Instant::now(),
        eval_running: Mutex::new(None),
        stages,
        wake: tokio::sync::Notify::new(),
        cfg,
    });
    let app = server::api_routes(router)
        .layer(DefaultBodyLimit::max(ROUTER_BODY_LIMIT))
        .merge(
            axum::Router::new()
                .route("/health", get(|| async { "ok" }))
                .route("/metrics", get(prometheus))
                .route("/v1/status", get(status))
                .route("/v1/agents/lease", post(lease))
                .route("/v1/agents/renew", post(renew))
                .route(
                    "/v1/agents/episodes/{lease}",
                    post(episode).layer(DefaultBodyLimit::max(EPISODE_BODY_LIMIT)),
                )
                .route("/v1/trainer/hello", post(hello))
                .route("/v1/trainer/batch", get(batch))
                .route("/v1/trainer/version", post(version))
                .route("/v1/trainer/published", post(published))
                .route("/v1/trainer/commit", post(commit))
                .route("/v1/trainer/quarantine", post(quarantine))
                .layer(DefaultBodyLimit::max(CONTROL_BODY_LIMIT))
                .with_state(coordinator.clone()),
        );
    let addr = format!("{}:{}", opts.host, opts.port);
    let listener = super::bind(&addr, format!("binding {addr}")).await?;
    // The address bound (a port of 0 picks one).
    let bound = listener
        .local_addr()
        .map_or(addr.clone(), |a| a.to_string());
    let (name, tasks) = (&coordinator.cfg.name, coordinator.cfg.tasks.len());
    eprintln!(
        "moult coordinator: {name} ({total_steps} steps, {tasks} tasks) on http://{bound}, engines from {engines}"
    );
    let app = crate::auth::protect_for_agents(app, coordinator.gate.clone());
    let served = crate::serve::serve(listener, app, shutdown).await;
    pool.stop();
    server::unload_adapters(&coordinator.router).await;
    served.map_err(RunError::start(format!("serving {addr}")))
}
