//! The learner: the training side of a run, one for `moult run` and for `moult trainer` (the
//! cluster's trainer pod). It loads the policy (from the newest checkpoint, or the model folder)
//! and, called by the one step loop ([`steps::run_steps`]), for each batch: advantages → the exact
//! token segments as samples ([`samples`]) → (distillation: the teacher's scores) → one optimizer
//! step → the weights to the engines under the step's version ([`Publisher`], whatever the
//! transport) → the step's metrics record → a checkpoint when one is due ([`checkpoint`]).

pub mod checkpoint;
mod followers;
pub mod samples;
pub(crate) mod steps;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use tch::{Device, Kind};
use tokio_util::sync::CancellationToken;

use crate::config::RunConfig;
use crate::dist::Rendezvous;
use crate::error::{Result, RunError};
use crate::model::CausalLm;
use crate::records::console::Console;
use crate::records::metrics::{MetricsLog, StepRecord};
use crate::rollout::eval::EvalResult;
use crate::rollout::{staleness_histogram, Group};
use crate::router::Activity;
use crate::stages::StepBatch;
use crate::trainer::ranks::{self, Setup};
use crate::trainer::train::Trainer;
use crate::weight_sync::publish::{PublishOptions, Publisher};
use checkpoint::CheckpointMeta;
pub(crate) use followers::Followers;

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Result<T> {
    Ok(tokio::task::spawn_blocking(f).await?)
}

/// The training side of a run.
pub(crate) struct Learner {
    cfg: RunConfig,
    /// `None` only while it computes on a blocking thread.
    trainer: Option<Trainer>,
    /// The other trainer ranks, when this process is rank 0 of several.
    _followers: Option<Followers>,
    teacher: Option<CausalLm>,
    publisher: Option<Publisher>,
    log: Option<MetricsLog>,
    /// The run's output folder, once [`Learner::log_to`] named it.
    out: Option<PathBuf>,
    ckpt_root: Option<PathBuf>,
    resume: Option<(PathBuf, CheckpointMeta)>,
    console: Console,
    step: u64,
    started: Instant,
    /// How many times a failed publish is tried (with a pause between tries).
    pub publish_tries: usize,
    /// No engines to publish to (a replay of dumped batches): publishing does nothing.
    pub offline: bool,
    /// Where the engines' activity is read (the router or coordinator weights go through), and
    /// the last reading: each step's busy fractions cover the time since.
    activity: Option<ActivityReader>,
    /// The newest evaluation not yet in a step record: the next record carries it.
    pending_eval: Option<EvalResult>,
    /// The run's stop (SIGTERM, Ctrl-C): the step under way is finished without publishing, and
    /// the last step trained is checkpointed ([`Learner::checkpoint_on_stop`]).
    pub stop: CancellationToken,
    /// The version the engines last got from this learner (the checkpoint's, at first).
    pub version: u64,
    /// What a checkpoint of the last step trained says, and whether one is written.
    last: Option<(CheckpointMeta, bool)>,
}

/// Reads how busy the engines have been from the router's `GET /engines`.
struct ActivityReader {
    http: reqwest::Client,
    url: String,
    last: (Instant, Activity),
}

/// How long a step waits for the router's activity reading.
const ACTIVITY_TIMEOUT: Duration = Duration::from_secs(5);

impl ActivityReader {
    async fn read(http: &reqwest::Client, url: &str) -> Option<Activity> {
        #[derive(serde::Deserialize)]
        struct Engines {
            activity: Activity,
        }
        let response = http.get(url).timeout(ACTIVITY_TIMEOUT).send().await.ok()?;
        Some(response.json::<Engines>().await.ok()?.activity)
    }

    /// Busy fraction of the engines and their paused seconds since the last reading, and the
    /// window's length; `None` when the router did not answer (the window then goes on).
    async fn since_last(&mut self) -> Option<(f64, f64, f64)> {
        let now = Self::read(&self.http, &self.url).await?;
        let (at, last) = std::mem::replace(&mut self.last, (Instant::now(), now));
        let window = at.elapsed().as_secs_f64().max(1e-9);
        let busy = (now.busy_seconds - last.busy_seconds).max(0.0);
        let fraction = (busy / (window * now.engines.max(1) as f64)).clamp(0.0, 1.0);
        let paused = (now.paused_seconds - last.paused_seconds).clamp(0.0, window);
        Some((fraction, paused, window))
    }
}

impl Learner {
    /// The policy of a run whose checkpoints live under `ckpt_root`: from the newest one there,
    /// or the model folder; the teacher of distillation too. With several trainer ranks, this
    /// process is rank 0, and the others join at `rendezvous` (trainer pods) or, without one,
    /// are started as processes of this machine.
    pub async fn load(
        cfg: RunConfig,
        ckpt_root: Option<PathBuf>,
        device: Device,
        console: Console,
        rendezvous: Option<Rendezvous>,
    ) -> Result<Self> {
        let resume = ckpt_root.as_deref().map(checkpoint::latest).transpose()?;
        let resume = resume.flatten();
        let (trainer, followers) = load_trainer(&cfg, resume.as_ref(), device, rendezvous).await?;
        let teacher = load_teacher(&cfg, &trainer, device).await?;
        let meta = resume.as_ref().map(|(_, m)| *m);
        Ok(Self {
            step: resume.as_ref().map_or(0, |(_, m)| m.step),
            cfg,
            trainer: Some(trainer),
            _followers: followers,
            teacher,
            publisher: None,
            log: None,
            out: None,
            ckpt_root,
            resume,
            console,
            started: Instant::now(),
            publish_tries: 1,
            offline: false,
            activity: None,
            pending_eval: None,
            stop: CancellationToken::new(),
            version: meta.map_or(0, |m| m.policy_version),
            last: meta.map(|m| (m, true)),
        })
    }

    /// The checkpoint this learner resumed from.
    pub fn resumed(&self) -> Option<&(PathBuf, CheckpointMeta)> {
        self.resume.as_ref()
    }

    /// What a process resuming from a checkpoint says ("resuming NAME from DIR (step S, ...)").
    pub fn resume_note(&self) -> Option<String> {
        let (dir, meta) = self.resume.as_ref()?;
        let (name, dir) = (&self.cfg.name, dir.display());
        Some(format!(
            "resuming {name} from {dir} (step {}, version {})",
            meta.step, meta.policy_version
        ))
    }

    /// Steps trained so far (the checkpoint's, when resumed).
    pub fn step(&self) -> u64 {
        self.step
    }

    /// Opens the weight path to the engines.
    pub async fn connect(&mut self, opts: &PublishOptions) -> Result<()> {
        self.publisher = Some(Publisher::connect(opts).await?);
        let http = crate::auth::client();
        let url = format!("{}/engines", opts.target.trim_end_matches('/'));
        let first = ActivityReader::read(&http, &url).await.unwrap_or_default();
        self.activity = Some(ActivityReader {
            http,
            url,
            last: (Instant::now(), first),
        });
        Ok(())
    }

    /// Writes every step record to `<out>/metrics.jsonl` from now on, and batches set aside to
    /// `<out>/quarantine/`.
    pub fn log_to(&mut self, out: &Path) -> Result<()> {
        std::fs::create_dir_all(out).map_err(|e| RunError::file("creating", out, e))?;
        self.out = Some(out.to_path_buf());
        self.log = Some(MetricsLog::open(out, self.step)?);
        Ok(())
    }

    pub fn records(&self) -> &[StepRecord] {
        self.log.as_ref().map_or(&[], |l| l.records())
    }

    /// The evaluations logged so far (this process's, and a resumed run's earlier ones).
    pub fn evals(&self) -> &[EvalResult] {
        self.log.as_ref().map_or(&[], |l| l.evals())
    }

    /// Logs an evaluation (`eval.jsonl`, TensorBoard at its step); the next step record carries
    /// its numbers. An evaluation of a step already logged (a batch handed out again after a
    /// restart) is skipped.
    pub fn record_eval(&mut self, eval: EvalResult) -> Result<()> {
        if self.evals().iter().any(|e| e.step == eval.step) {
            return Ok(());
        }
        self.console.line(&crate::rollout::eval::line(&eval));
        if let Some(log) = &mut self.log {
            log.push_eval(eval.clone())?;
        }
        self.pending_eval = Some(eval);
        Ok(())
    }

    /// Runs `f` with the trainer on a compute thread; the trainer comes back either way.
    async fn on_trainer<T: Send + 'static>(
        &mut self,
        f: impl FnOnce(&mut Trainer) -> T + Send + 'static,
    ) -> Result<T> {
        let mut trainer = self.trainer.take().expect("the trainer is here");
        let (trainer, out) = blocking(move || {
            let out = f(&mut trainer);
            (trainer, out)
        })
        .await?;
        self.trainer = Some(trainer);
        Ok(out)
    }

    fn trainer(&self) -> &Trainer {
        (self.trainer.as_ref()).expect("the trainer is back from its compute thread")
    }

    /// Publishes the current weights as `version` (pause `keep` with `partial` rollout), trying
    /// [`publish_tries`](Self::publish_tries) times; returns the seconds it took, or `None` when
    /// the run stopped before the engines had them.
    pub async fn publish(&mut self, version: u64, partial: bool) -> Result<Option<f64>> {
        if self.offline {
            return Ok(Some(0.0));
        }
        let started = Instant::now();
        let mut tries = 0;
        loop {
            let publisher = (self.publisher.as_mut())
                .ok_or_else(|| RunError::Setup("the weight path is not connected".into()))?;
            let trainer = self.trainer.take().expect("the trainer is here");
            let (trainer, gathered, sent) = publisher
                .publish_trainer(trainer, version, partial, &self.stop)
                .await;
            self.trainer = Some(trainer);
            // A lost rank ends the run (the trainer cannot go on); a failed send is tried again.
            gathered.map_err(crate::model::Error::from)?;
            match sent {
                Ok(_) => {
                    self.version = version;
                    return Ok(Some(started.elapsed().as_secs_f64()));
                }
                Err(_) if self.stop.is_cancelled() => return Ok(None),
                Err(e) if tries + 1 < self.publish_tries => {
                    tries += 1;
                    tracing::warn!(version, tries, "publishing the weights: {e}; trying again");
                    tokio::select! {
                        () = tokio::time::sleep(Duration::from_secs(2)) => {}
                        () = self.stop.cancelled() => return Ok(None),
                    }
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Sets `batch` aside: written with `error` to `<out>/quarantine/step-<N>-<ms>.json` (with an
    /// output folder), to be looked at later (docs/security.md, "Bad data").
    pub fn quarantine(&self, batch: &StepBatch, error: &RunError) -> Result<()> {
        tracing::warn!(
            step = batch.step,
            "{error}: the batch is set aside, the step drawn again"
        );
        let Some(dir) = self.out.as_ref().map(|o| o.join("quarantine")) else {
            return Ok(());
        };
        std::fs::create_dir_all(&dir).map_err(|e| RunError::file("creating", &dir, e))?;
        let ms = chrono::Utc::now().timestamp_millis();
        let body = serde_json::json!({"error": error.to_string(), "batch": batch});
        let text = serde_json::to_vec(&body).expect("a batch serialises");
        let path = dir.join(format!("step-{}-{ms}.json", batch.step));
        crate::records::files::write_atomic(&path, &text)
    }

    /// Advantages, the exact token segments as samples, the teacher's scores (distillation) and
    /// one optimizer step on `groups`; the trainer and teacher move to a compute thread and back.
    pub async fn learn(&mut self, groups: &[Group]) -> Result<Learned> {
        self.console.phase("training");
        let (cfg, computing) = (&self.cfg, Instant::now());
        let (advantages, overlong_penalty_mean) =
            samples::advantages(cfg.estimator, cfg.overlong.as_ref(), groups)?;
        let images = self.trainer().model().image_processor().cloned();
        let mut train_samples =
            samples::samples(groups, &advantages, cfg.routing_replay, images.as_ref())?;
        let teacher_kl = match self.teacher.take() {
            Some(t) => {
                let temperature = cfg.trainer.loss.temperature;
                let (t, scored, kl) = blocking(move || {
                    let kl = samples::distill(&t, &mut train_samples, temperature);
                    (t, train_samples, kl)
                })
                .await?;
                (self.teacher, train_samples) = (Some(t), scored);
                Some(kl?)
            }
            // A served teacher's scores came with the batch.
            None if cfg.served_teacher.is_some() => {
                Some(samples::distill_served(groups, &mut train_samples)?)
            }
            None => None,
        };
        let started = Instant::now();
        let stats = self.on_trainer(move |t| t.step(&train_samples)).await??;
        Ok(Learned {
            advantages,
            stats,
            teacher_kl,
            overlong_penalty_mean,
            train_seconds: started.elapsed().as_secs_f64(),
            compute_seconds: computing.elapsed().as_secs_f64(),
        })
    }

    /// The record of step `self.step + 1`, which `learned` trained and `sync` seconds published
    /// as `version`; written to `metrics.jsonl` (and TensorBoard), with the newest evaluation.
    pub async fn record(
        &mut self,
        batch: &StepBatch,
        learned: Learned,
        version: u64,
        sync: f64,
        started: Instant,
    ) -> Result<StepRecord> {
        self.step += 1;
        // The engines' activity over the step; the trainer's busy time over the same window.
        let window = || (0.0, 0.0, started.elapsed().as_secs_f64());
        let (engine_busy_fraction, engine_paused_seconds, window) = match &mut self.activity {
            Some(reader) => reader.since_last().await.unwrap_or_else(|| {
                tracing::warn!("the router did not say how busy the engines were");
                window()
            }),
            None => window(),
        };
        let staleness = staleness_histogram(&batch.groups, batch.version);
        let stale_tokens: usize = staleness.values().sum();
        let rewards: Vec<f64> = (batch.groups.iter())
            .flat_map(|g| g.episodes.iter().map(|e| e.reward))
            .collect();
        let (reward_mean, reward_std) = samples::mean_std(&rewards);
        let (advantage_mean, advantage_std) = samples::mean_std(&learned.advantages.concat());
        let (stats, rollout, step_seconds) = (&learned.stats, batch.stats, started.elapsed());
        let (judged, taught) = (batch.judged, batch.taught);
        let eval = self.pending_eval.take();
        let record = StepRecord {
            step: self.step,
            policy_version: version,
            reward_mean,
            reward_std,
            episodes: rewards.len(),
            advantage_mean,
            advantage_std,
            loss: finite_or_zero(stats.loss),
            mean_abs_log_rho: stats.mean_abs_log_rho,
            masked_fraction: stats.masked_fraction,
            entropy: stats.entropy,
            kl: stats.kl,
            teacher_kl: learned.teacher_kl,
            overlong_penalty_mean: learned.overlong_penalty_mean,
            agent_reward_mean: judged.map(|j| j.agent_reward_mean),
            judge_score_mean: judged.map(|j| j.judge_score_mean),
            judge_unparsed: judged.map(|j| j.unparsed),
            judge_failed: judged.map(|j| j.failed),
            judge_seconds: judged.map(|j| j.seconds),
            teacher_seconds: taught.map(|t| t.seconds),
            trainer_world_size: self.trainer().world_size(),
            grad_norm: finite_or_zero(stats.grad_norm),
            update_skipped: stats.skipped,
            learning_rate: stats.learning_rate,
            staleness_mean: (staleness.iter())
                .map(|(k, n)| *k as f64 * *n as f64)
                .sum::<f64>()
                / stale_tokens.max(1) as f64,
            staleness,
            sequences: stats.sequences,
            sampled_tokens: stats.sampled_tokens,
            response_tokens_mean: stats.sampled_tokens as f64 / rewards.len().max(1) as f64,
            tokens_per_second: stats.sampled_tokens as f64 / step_seconds.as_secs_f64().max(1e-9),
            step_seconds: step_seconds.as_secs_f64(),
            train_seconds: learned.train_seconds,
            sync_seconds: sync,
            dropped_stale: rollout.dropped_stale,
            dropped_failed: rollout.dropped_failed,
            dropped_invalid: rollout.dropped_invalid,
            groups_filtered: rollout.groups_filtered,
            batches_quarantined: rollout.batches_quarantined,
            elapsed_seconds: self.started.elapsed().as_secs_f64(),
            engine_busy_fraction,
            trainer_busy_fraction: (learned.compute_seconds / window.max(1e-9)).clamp(0.0, 1.0),
            engine_paused_seconds,
            eval_step: eval.as_ref().map(|e| e.step),
            eval_reward_mean: eval.as_ref().map(|e| e.eval_reward_mean),
            eval_pass_at_k: eval.as_ref().map(|e| e.eval_pass_at_k),
        };
        if let Some(log) = &mut self.log {
            log.push(record.clone())?;
        }
        Ok(record)
    }

    /// A checkpoint of the step just recorded, when one is due (every `checkpoint.intervalSteps`,
    /// after the last step, and when the run is stopping) and the run keeps checkpoints.
    pub async fn checkpoint_if_due(
        &mut self,
        batch: &StepBatch,
        version: u64,
    ) -> Result<Option<PathBuf>> {
        let step = self.step;
        let meta = CheckpointMeta {
            step,
            policy_version: version,
            rollout: batch.rollout,
            seed: batch.seed,
        };
        self.last = Some((meta, false));
        let due = (self.cfg.checkpoint_every)
            .is_some_and(|every| step % every == 0 || step == self.cfg.total_steps);
        match due || self.stop.is_cancelled() {
            true => self.checkpoint_on_stop().await,
            false => Ok(None),
        }
    }

    /// A checkpoint of the last step trained, unless it has one (or the run keeps none): a run
    /// that stops resumes at the step after it, not at the last interval checkpoint.
    pub async fn checkpoint_on_stop(&mut self) -> Result<Option<PathBuf>> {
        let keeps = self.cfg.checkpoint_every.and(self.ckpt_root.clone());
        let (Some(root), Some((meta, false))) = (keeps, self.last) else {
            return Ok(None);
        };
        self.console.phase("saving a checkpoint");
        let model_dir = self.cfg.model_dir.clone();
        let saved = self.on_trainer(move |t| checkpoint::save(&root, &model_dir, t, &meta));
        let dir = saved.await??;
        self.last = Some((meta, true));
        Ok(Some(dir))
    }
}

impl Drop for Learner {
    fn drop(&mut self) {
        // Rank 0 of several: the other ranks stop (local ones' processes end as the followers
        // drop; trainer pods exit and their StatefulSet starts them again, to wait for rank 0).
        if let Some(Err(e)) = self.trainer.as_ref().map(Trainer::stop_followers) {
            tracing::warn!("stopping the other trainer ranks: {e}");
        }
    }
}

/// The trainer: from the checkpoint's weights and moments (`resume`), or the model folder. With
/// several ranks (`trainer.nodes`), this process is rank 0: the others join at `rendezvous`, or,
/// without one, are started as processes of this machine (docs/distributed.md).
async fn load_trainer(
    cfg: &RunConfig,
    resume: Option<&(PathBuf, CheckpointMeta)>,
    device: Device,
    rendezvous: Option<Rendezvous>,
) -> Result<(Trainer, Option<Followers>)> {
    // A KL penalty is to the initial policy: the model folder's weights, frozen.
    let reference_dir = (cfg.trainer.kl_coef > 0.0).then(|| cfg.model_dir.clone());
    let (reference, model_dir) = (reference_dir.clone(), cfg.model_dir.clone());
    let resume = resume.map(|(d, meta)| (d.clone(), meta.step));
    let (model, moments, reference) = blocking(move || -> Result<_> {
        let load = |dir: &Path| CausalLm::load(dir, Kind::Float, device);
        let (model, moments) = match resume {
            Some((dir, step)) => checkpoint::load_policy(&dir, Kind::Float, device)
                .map(|(model, moments)| (model, Some((step, moments))))?,
            None => (load(&model_dir)?, None),
        };
        Ok((model, moments, reference.as_deref().map(load).transpose()?))
    })
    .await??;
    if cfg.trainer_ranks > 1 {
        let (followers, rendezvous) = match rendezvous {
            Some(r) => (None, r),
            None => Followers::start_all(cfg.trainer_ranks, device).map(|(f, r)| (Some(f), r))?,
        };
        let setup = Setup {
            model_dir: cfg.model_dir.clone(),
            reference_dir,
            dtype: "float32".into(),
            options: cfg.trainer.clone(),
        };
        let trainer = blocking(move || -> Result<Trainer> {
            let group = rendezvous
                .connect_on(device)
                .map_err(|e| RunError::Setup(e.to_string()))?;
            Ok(ranks::leader(model, reference, setup, moments, group)?)
        })
        .await??;
        return Ok((trainer, followers));
    }
    let mut trainer = Trainer::new(model, reference, cfg.trainer.clone())
        .map_err(|e| RunError::Setup(e.to_string()))?;
    if let Some((step, moments)) = moments {
        trainer
            .restore(step, moments)
            .map_err(|e| RunError::Checkpoint(e.to_string()))?;
    }
    Ok((trainer, None))
}

/// The teacher of on-policy distillation, if the run has one; it must share the student's
/// vocabulary.
async fn load_teacher(
    cfg: &RunConfig,
    student: &Trainer,
    device: Device,
) -> Result<Option<CausalLm>> {
    // A served teacher's engines score the batches before they get here.
    let (Some(dir), None) = (cfg.teacher_dir.clone(), cfg.served_teacher) else {
        return Ok(None);
    };
    let student_vocab = student.model().config().vocab_size;
    let teacher = blocking(move || CausalLm::load(&dir, Kind::Float, device)).await??;
    let teacher_vocab = teacher.config().vocab_size;
    if teacher_vocab != student_vocab {
        let why = format!("the teacher's vocabulary ({teacher_vocab}) is not the student's ({student_vocab}): they must share a tokenizer");
        return Err(RunError::field("spec.algorithm.teacher.path", why));
    }
    Ok(Some(teacher))
}

/// What one optimizer step on a batch produced.
pub(crate) struct Learned {
    advantages: Vec<Vec<f64>>,
    stats: crate::trainer::train::StepStats,
    teacher_kl: Option<f64>,
    overlong_penalty_mean: Option<f64>,
    train_seconds: f64,
    /// Everything the step computed: advantages, samples, the teacher, the optimizer step.
    compute_seconds: f64,
}

/// `x`, or 0 when it is NaN or infinite (a record holds JSON numbers only: a step whose update
/// was skipped records 0).
fn finite_or_zero(x: f64) -> f64 {
    Some(x).filter(|x| x.is_finite()).unwrap_or(0.0)
}
