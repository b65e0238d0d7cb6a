//! From an RLRun manifest (the operator's own types, so a run reads the same locally and on a
//! cluster) to the settings of each part of a local run. Relative paths (model, dataset, the
//! agent's files) are taken from the manifest's folder. Every refusal names the field.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use moult_jail::{Jail, Limits};
use moult_operator::api::{
    AgentForm, AgentSpec, EngineBackend, Estimator, Isolation, RLRun, WeightTransport,
};
use moult_operator::validate::Manifest;
use serde_json::Value as Json;

pub mod dataset;
pub mod judge;

pub use judge::JudgeOptions;

use crate::agents::env::EnvLoopOptions;
use crate::agents::process::AgentCommand;
use crate::agents::{Agent, PoolOptions};
use crate::chat::{ChatSampling, SamplingOverride};
use crate::error::{Result, RunError};
use crate::rollout::eval::EvalOptions;
use crate::rollout::RolloutOptions;

/// Everything a local run needs, resolved from the manifest.
#[derive(Debug, Clone)]
pub struct RunConfig {
    pub run: RLRun,
    pub name: String,
    pub model_dir: PathBuf,
    pub tasks: Vec<Json>,
    /// The agent (`None` in a pod that runs no episodes).
    pub agent: Option<Agent>,
    pub concurrency: usize,
    pub episode_timeout: Duration,
    /// The jail of every episode's program (`agent.isolation`, `agent.limits`).
    pub jail: Option<Jail>,
    pub env_loop: EnvLoopOptions,
    pub rollout: RolloutOptions,
    pub partial_rollout: bool,
    pub estimator: Estimator,
    /// DAPO's overlong reward shaping (`spec.algorithm.overlong`).
    pub overlong: Option<Overlong>,
    /// The trainer's settings (only in builds that train).
    #[cfg(feature = "torch")]
    pub trainer: crate::trainer::train::TrainerOptions,
    /// Trainer ranks: `trainer.nodes × ranks_per_node`; `moult run` starts the ranks after the
    /// first as processes of this machine, a trainer pod its node's (docs/distributed.md).
    pub trainer_ranks: usize,
    /// Ranks per trainer node: one per GPU (`trainer.gpusPerNode`), one on CPU.
    pub ranks_per_node: usize,
    pub engines: usize,
    pub total_steps: u64,
    /// Steps between checkpoints; `None`: no checkpoints (the manifest has no `checkpoint`).
    pub checkpoint_every: Option<u64>,
    pub routing_replay: bool,
    /// The teacher of on-policy distillation (its model folder, where this process has it).
    pub teacher_dir: Option<PathBuf>,
    /// On-policy distillation with a served teacher (`algorithm.teacher.replicas`): its engines
    /// score each batch before the trainer gets it, and the trainer loads no teacher.
    pub served_teacher: Option<usize>,
    /// LLM-as-judge rewards (`spec.judge`).
    pub judge: Option<JudgeOptions>,
    /// Evaluation on held-out tasks (`spec.eval`), where this process runs it.
    pub eval: Option<EvalOptions>,
}

/// DAPO's soft overlong punishment (Yu et al. 2025; docs/algorithms.md), resolved from
/// `spec.algorithm.overlong`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Overlong {
    /// L_max: sampled tokens an episode may have.
    pub max_tokens: usize,
    /// B: the penalty grows over the last B tokens before L_max.
    pub buffer_tokens: usize,
    /// The largest penalty.
    pub factor: f64,
}

impl Overlong {
    /// The shaping `spec.algorithm.overlong` asks for, checked (`None` without one).
    fn of(spec: &moult_operator::api::RLRunSpec) -> Result<Option<Self>> {
        let Some(o) = &spec.algorithm.overlong else {
            return Ok(None);
        };
        let budget = episode_token_budget(spec);
        let max_tokens = o.max_tokens.map_or(budget, |m| m as usize);
        let buffer_tokens = o.buffer_tokens as usize;
        if buffer_tokens == 0 || buffer_tokens > max_tokens {
            let why = format!("{buffer_tokens} is not between 1 and maxTokens ({max_tokens}: the episode's token budget, rollout.maxTokens × rollout.maxTurns, unless overlong.maxTokens says otherwise)");
            return Err(RunError::field("spec.algorithm.overlong.bufferTokens", why));
        }
        if !(o.factor.is_finite() && o.factor >= 0.0) {
            let why = format!("{} is not a number of 0 or more", o.factor);
            return Err(RunError::field("spec.algorithm.overlong.factor", why));
        }
        Ok(Some(Self {
            max_tokens,
            buffer_tokens,
            factor: o.factor,
        }))
    }

    /// The penalty (≤ 0) added to the reward of an episode of `len` sampled tokens:
    /// 0 for `len ≤ L_max − B`, `factor · (L_max − B − len) / B` up to L_max, −factor beyond.
    pub fn penalty(&self, len: usize) -> f64 {
        let start = self.max_tokens.saturating_sub(self.buffer_tokens);
        if len <= start {
            0.0
        } else if len <= self.max_tokens {
            -self.factor * (len - start) as f64 / self.buffer_tokens.max(1) as f64
        } else {
            -self.factor
        }
    }
}

/// The token budget of an episode: `rollout.maxTokens` × `rollout.maxTurns` (the default of
/// `overlong.maxTokens` and of `loss.lengthNormalizer`).
pub fn episode_token_budget(spec: &moult_operator::api::RLRunSpec) -> usize {
    spec.rollout.max_tokens as usize * spec.rollout.max_turns as usize
}

/// The fields `spec` sets that only a cluster run acts on (pods, images, claims, scheduling),
/// each with what a local run does instead: `moult run` names them rather than ignore them
/// silently (docs/spec-fields.md has every field).
#[rustfmt::skip]
pub fn cluster_only_fields(spec: &moult_operator::api::RLRunSpec) -> Vec<&'static str> {
    let (a, e, t, s) = (&spec.agent, &spec.engines, &spec.trainer, &spec.scheduling);
    let algo = &spec.algorithm;
    [
        (spec.model.claim_name.is_some(), "model.claimName (the model is read from model.path here)"),
        (a.image.is_some(), "agent.image (agent programs run on this machine)"),
        (a.replicas != 1, "agent.replicas (one agent pool here)"),
        (a.resources.is_some(), "agent.resources"),
        (a.egress.is_some(), "agent.egress"),
        (a.runtime_class_name.is_some(), "agent.runtimeClassName (agent programs run on this machine)"),
        (a.sandbox.is_some(), "agent.sandbox (every moult.sandbox.run call gets a jail on this machine)"),
        (!a.read_only_root_filesystem, "agent.readOnlyRootFilesystem"),
        (a.dataset.claim_name.is_some(), "agent.dataset.claimName (tasks are read from agent.dataset.path here)"),
        (spec.eval.as_ref().is_some_and(|e| e.dataset.claim_name.is_some()), "eval.dataset.claimName (held-out tasks are read from eval.dataset.path here)"),
        (e.backend == EngineBackend::Builtin && !e.extra_args.is_empty(), "engines.extraArgs (moult engine's flags on a cluster; the built-in engines here take their defaults)"),
        (e.image.is_some(), "engines.image"),
        (e.gpus_per_engine.is_some(), "engines.gpusPerEngine"),
        (e.resources.is_some(), "engines.resources"),
        (e.weight_transfer.as_ref().is_some_and(|w| w.claim_name.is_some()), "engines.weightTransfer.claimName (the Filesystem transport writes under <out>/weights here)"),
        (t.image.is_some(), "trainer.image"),
        (t.resources.is_some(), "trainer.resources"),
        (t.termination_grace_period_seconds.is_some(), "trainer.terminationGracePeriodSeconds (Ctrl-C checkpoints the last step trained; a second exits at once)"),
        (spec.coordinator.resources.is_some(), "coordinator.resources"),
        (spec.coordinator.agent_limits.is_some(), "coordinator.agentLimits"),
        (algo.teacher.as_ref().is_some_and(|t| t.claim_name.is_some()), "algorithm.teacher.claimName (the teacher is read from algorithm.teacher.path here)"),
        (spec.judge.as_ref().is_some_and(|j| j.claim_name.is_some()), "judge.claimName (the judge is read from judge.path here)"),
        (spec.judge.as_ref().is_some_and(|j| j.replicas != 1), "judge.replicas (one judge engine here)"),
        (algo.teacher.as_ref().and_then(|t| t.replicas).is_some_and(|r| r != 1), "algorithm.teacher.replicas (one teacher engine here)"),
        (spec.checkpoint.is_some(), "checkpoint.claimName (checkpoints go to <out>/checkpoints here)"),
        (!s.node_selector.is_empty() || !s.tolerations.is_empty() || s.priority_class_name.is_some() || s.queue_name.is_some(), "scheduling"),
        (spec.suspend, "suspend"),
    ]
    .into_iter()
    .filter_map(|(set, field)| set.then_some(field))
    .collect()
}

/// `dir`, checked to be a model folder (it has a `config.json`); a refusal names `field`.
fn model_folder(dir: &Path, field: &str) -> Result<PathBuf> {
    if !dir.join("config.json").is_file() {
        let why = format!("{} is not a model folder (no config.json)", dir.display());
        return Err(RunError::field(field, why));
    }
    Ok(dir.to_path_buf())
}

/// Reads and checks an RLRun (or EnginePool) manifest (YAML, one document of that kind; other
/// documents, such as PersistentVolumeClaims, are skipped).
pub fn read_manifest<K: Manifest>(path: &Path) -> Result<K> {
    let text = std::fs::read_to_string(path).map_err(|e| RunError::file("cannot read", path, e))?;
    let manifest = |reason: String| RunError::Manifest {
        path: path.to_path_buf(),
        reason,
    };
    let mut found = None;
    for doc in serde_yaml_ng::Deserializer::from_str(&text) {
        let value: serde_json::Value =
            serde::Deserialize::deserialize(doc).map_err(|e| manifest(format!("not YAML: {e}")))?;
        if value.get("kind").and_then(Json::as_str) != Some(K::KIND) {
            continue;
        }
        // As strict as `kubectl apply`: a misspelt field is refused, not silently dropped.
        let unknown = K::unknown(&value);
        if !unknown.is_empty() {
            return Err(manifest(unknown.join("; ")));
        }
        let object: K = serde_path_to_error::deserialize(value)
            .map_err(|e| manifest(format!("{}: {}", e.path(), e.inner())))?;
        found = Some(object);
    }
    let kind = K::KIND;
    let object = found.ok_or_else(|| manifest(format!("no document has `kind: {kind}`")))?;
    object.check().map_err(|e| manifest(e.join("; ")))?;
    Ok(object)
}

/// The jail of every episode's program: `agent.limits` over the defaults, `None` for
/// `agent.isolation: Process`.
fn jail(agent: &AgentSpec) -> Result<Option<Jail>> {
    let (set, mut l) = (agent.limits.clone().unwrap_or_default(), Limits::default());
    let sizes = [
        (set.memory, "memory", &mut l.memory_bytes),
        (set.file_size, "fileSize", &mut l.file_size_bytes),
        (set.scratch, "scratch", &mut l.scratch_bytes),
    ];
    for (q, field, to) in sizes.into_iter().filter_map(|(q, f, to)| Some((q?, f, to))) {
        let bytes = moult_operator::children::quantity(&q.0).filter(|b| *b >= 1.0);
        let why = "a size in bytes, as a quantity (512Mi, 2Gi)";
        *to =
            bytes.ok_or_else(|| RunError::field(format!("spec.agent.limits.{field}"), why))? as u64;
    }
    for (n, to) in [
        (set.cpu_seconds, &mut l.cpu_seconds),
        (set.processes, &mut l.processes),
        (set.open_files, &mut l.open_files),
    ] {
        *to = n.map_or(*to, u64::from);
    }
    let jail = Jail {
        limits: l,
        ..Jail::default()
    };
    Ok((agent.isolation == Isolation::Episode).then_some(jail))
}

/// The agent the manifest names. A `command` whose program is Python and whose first argument is
/// a `.py` file (or `-m module`) runs through moult's runner (`AgentRunner`), any other command as
/// it is (speaking the Env JSON-lines protocol, or a ChatAgent program).
fn agent(run: &RLRun, dir: &Path) -> Result<Agent> {
    let spec = &run.spec.agent;
    if let Some(env) = &spec.env {
        if spec.command.is_empty() {
            return Agent::builtin(env).map_err(|e| RunError::field("spec.agent.env", e));
        }
    }
    let Some((program, args)) = spec.command.split_first() else {
        let why = "a local run needs the agent's command (or agent.env for a built-in environment)";
        return Err(RunError::field("spec.agent.command", why));
    };
    let is_python = Path::new(program)
        .file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| n.starts_with("python"));
    let cmd = match args {
        [file] if is_python && file.ends_with(".py") => {
            let path = dir.join(file);
            if !path.is_file() {
                let why = format!("{} does not exist", path.display());
                return Err(RunError::field("spec.agent.command", why));
            }
            AgentCommand::python(program, &path.to_string_lossy())
        }
        [flag, module] if is_python && flag == "-m" => AgentCommand::python(program, module),
        // Arguments naming files beside the manifest are made absolute (the command does not
        // run in the manifest's folder).
        _ => Ok(AgentCommand {
            program: program.clone(),
            args: args
                .iter()
                .map(|a| match dir.join(a) {
                    p if !Path::new(a).is_absolute() && p.exists() => p.display().to_string(),
                    _ => a.clone(),
                })
                .collect(),
            env: Vec::new(),
        }),
    }
    .map_err(|e| RunError::field("spec.agent.command", e))?;
    Ok(match spec.form {
        AgentForm::Env => Agent::ExternalEnv(cmd),
        AgentForm::ChatAgent => Agent::Chat(cmd),
    })
}

/// The judge of `spec.judge`, whose model folder is `model_dir` here (`None`: this process does
/// not judge): it exists, and every task has the fields its prompt reads.
fn judge(run: &RLRun, model_dir: Option<&Path>, tasks: &[Json]) -> Result<Option<JudgeOptions>> {
    let (Some(spec), Some(model_dir)) = (&run.spec.judge, model_dir) else {
        return Ok(None);
    };
    let model_dir = model_folder(model_dir, "spec.judge.path")?;
    for field in judge::task_fields(&spec.prompt) {
        if let Some(i) = tasks.iter().position(|t| t.get(&field).is_none()) {
            let task = i + 1;
            let why = format!("it reads {{task.{field}}}, but task {task} of spec.agent.dataset.path has no field `{field}`");
            return Err(RunError::field("spec.judge.prompt", why));
        }
    }
    Ok(Some(JudgeOptions {
        model_dir,
        prompt: spec.prompt.clone(),
        weight: spec.weight,
        agent_weight: spec.agent_weight,
        max_tokens: spec.max_tokens as usize,
    }))
}

/// The dataset in the run's fixed order (a seeded shuffle, so a resumed run's cursor means the
/// same task).
pub fn ordered(tasks: &[Json], seed: u64) -> Vec<Json> {
    use rand::seq::SliceRandom;
    use rand::SeedableRng;
    let mut tasks = tasks.to_vec();
    tasks.shuffle(&mut rand_chacha::ChaCha8Rng::seed_from_u64(seed));
    tasks
}

/// Tasks, one JSON value per line of `path` (blank lines skipped); errors name `field`, the
/// manifest field or command-line flag that gave the path.
pub fn read_jsonl(path: &Path, field: &str) -> Result<Vec<Json>> {
    let file = path.display();
    let text = std::fs::read_to_string(path)
        .map_err(|e| RunError::field(field, format!("cannot read {file}: {e}")))?;
    let lines = text.lines().enumerate();
    let lines = lines.filter(|(_, l)| !l.trim().is_empty());
    let values = lines.map(|(i, l)| {
        let why = |e| format!("{file}:{}: not a JSON value: {e}", i + 1);
        serde_json::from_str(l).map_err(|e| RunError::field(field, why(e)))
    });
    values.collect()
}

/// Where a process finds the files a manifest names.
#[derive(Debug, Clone, Default)]
pub struct Sources {
    /// Relative paths of the agent's command are taken from here.
    pub dir: PathBuf,
    /// The model folder, if this process needs it (checked to be one).
    pub model_dir: Option<PathBuf>,
    /// The task file, if this process draws tasks (read and checked).
    pub tasks: Option<PathBuf>,
    /// The held-out tasks of `spec.eval`, if this process evaluates (read and checked).
    pub eval_tasks: Option<PathBuf>,
    /// Whether this process runs episodes (the agent's command is checked).
    pub agent: bool,
    /// The teacher of on-policy distillation, if this process scores with it (checked to be a
    /// model folder); `None`: the run's teacher is not this process's business.
    pub teacher: Option<PathBuf>,
    /// The judge's model folder, if this process judges (checked, with the tasks' fields its
    /// prompt reads).
    pub judge: Option<PathBuf>,
}

impl Sources {
    /// Everything beside the manifest in `dir`: a local run.
    pub fn beside_manifest(run: &RLRun, dir: &Path) -> Self {
        let spec = &run.spec;
        Self {
            dir: dir.to_path_buf(),
            model_dir: Some(dir.join(&spec.model.path)),
            tasks: Some(dir.join(&spec.agent.dataset.path)),
            eval_tasks: spec.eval.as_ref().map(|e| dir.join(&e.dataset.path)),
            agent: true,
            teacher: spec.algorithm.teacher.as_ref().map(|t| dir.join(&t.path)),
            judge: spec.judge.as_ref().map(|j| dir.join(&j.path)),
        }
    }
}

/// The trainer's settings from the manifest: loss, IS correction, schedule, optimizer.
#[cfg(feature = "torch")]
fn trainer_options(run: &RLRun, total_steps: u64) -> crate::trainer::train::TrainerOptions {
    use crate::algorithms::{correction::Correction, losses::Aggregation};
    use crate::trainer::{optim::LrSchedule, step::LossConfig, train::TrainerOptions};
    use moult_operator::api::Aggregation as SpecAggregation;
    let spec = &run.spec;
    let algo = &spec.algorithm;
    let opt = &algo.optimizer;
    let correction = algo.is_correction.as_ref().map(|c| Correction {
        level: c.level,
        mode: c.mode,
        low: c.low.unwrap_or(0.0),
        high: c.high,
    });
    TrainerOptions {
        loss: LossConfig {
            kind: algo.loss.kind,
            eps_low: algo.loss.eps_low,
            eps_high: algo.loss.eps_high,
            aggregation: match algo.loss.aggregation {
                SpecAggregation::TokenMean => Aggregation::TokenMean,
                SpecAggregation::SeqMean => Aggregation::SeqMean,
                SpecAggregation::SeqMeanTokenSumNorm => Aggregation::SeqMeanTokenSumNorm {
                    normalizer: algo
                        .loss
                        .length_normalizer
                        .map_or_else(|| episode_token_budget(spec), |n| n as usize)
                        .max(1),
                },
            },
            correction,
            temperature: spec.rollout.temperature,
        },
        schedule: LrSchedule {
            peak: opt.learning_rate,
            warmup_steps: u64::from(opt.warmup_steps),
            total_steps,
            decay: opt.decay,
            min_ratio: opt.min_learning_rate_ratio,
        },
        weight_decay: opt.weight_decay,
        max_grad_norm: opt.clip_norm(),
        micro_batch_tokens: spec.trainer.micro_batch_tokens.unwrap_or(8192) as usize,
        kl_coef: algo.loss.kl_coef,
        sharding: spec.trainer.sharding.unwrap_or_default(),
        bf16_compute: spec.trainer.compute_dtype
            == Some(moult_operator::api::TrainerDtype::BFloat16),
        freeze_vision: spec.trainer.freeze_vision_tower,
        lora: spec.model.lora.as_ref().map(Into::into),
    }
}

impl RunConfig {
    /// The settings of a local run of `run`, whose manifest is in `dir`.
    pub fn new(run: RLRun, dir: &Path) -> Result<Self> {
        let engines = &run.spec.engines;
        if engines.replicas < 1 {
            // A cluster run may be scaled to zero engines; a local one would wait forever.
            let why = "a local run needs at least 1 engine";
            return Err(RunError::field("spec.engines.replicas", why));
        }
        if engines.backend == EngineBackend::Vllm
            && engines.transport() != WeightTransport::Filesystem
        {
            // Found out now rather than after a minute of starting vLLM.
            let why = "moult run publishes to vLLM engines through the Filesystem transport (set weightTransfer: {transport: Filesystem}); NCCL from moult run is not built yet (docs/vllm.md)";
            return Err(RunError::field(
                "spec.engines.weightTransfer.transport",
                why,
            ));
        }
        let sources = Sources::beside_manifest(&run, dir);
        Self::from_sources(run, &sources)
    }

    /// The agent and the settings of a pool running `concurrency` of its episodes at once, with
    /// their scratch files in `scratch_dir` (the loopback address is the pool's to set).
    pub fn agent_pool(
        &self,
        concurrency: usize,
        scratch_dir: PathBuf,
    ) -> Result<(Agent, PoolOptions)> {
        let agent = (self.agent.clone())
            .ok_or_else(|| RunError::Setup("the run config has no agent".into()))?;
        let opts = PoolOptions {
            concurrency,
            timeout: self.episode_timeout,
            env_loop: self.env_loop.clone(),
            scratch_dir,
            jail: self.jail.clone(),
            ..PoolOptions::default()
        };
        Ok((agent, opts))
    }

    /// The settings of `run` for a process that has the files `sources` names (a pod of a cluster
    /// run has only its role's: the model, or the tasks). What it lacks is left empty.
    pub fn from_sources(run: RLRun, sources: &Sources) -> Result<Self> {
        let spec = &run.spec;
        let dir = sources.dir.as_path();
        let name = run.metadata.name.clone().unwrap_or_else(|| "run".into());
        let model_dir = match &sources.model_dir {
            Some(dir) => model_folder(dir, "spec.model.path")?,
            None => PathBuf::from(&spec.model.path),
        };
        let tasks = match &sources.tasks {
            Some(path) => dataset::read(&spec.agent.dataset, path, "spec.agent.dataset")?,
            None => Vec::new(),
        };
        let eval = match (&spec.eval, &sources.eval_tasks) {
            (Some(e), Some(path)) => {
                let mut tasks = dataset::read(&e.dataset, path, "spec.eval.dataset")?;
                if let Some(max) = e.max_tasks {
                    tasks.truncate(max as usize);
                }
                Some(EvalOptions {
                    tasks: Arc::new(tasks),
                    interval: u64::from(e.interval_steps.max(1)),
                    samples: e.samples.max(1) as usize,
                    sampling: SamplingOverride {
                        temperature: Some(e.temperature.unwrap_or(spec.rollout.temperature)),
                        max_tokens: Some(e.max_tokens.unwrap_or(spec.rollout.max_tokens) as usize),
                    },
                    pass_reward: e.pass_reward,
                    // Locally one agent pool runs everything; a coordinator widens this to
                    // every agent pod's share.
                    concurrency: spec.agent.concurrency.max(1) as usize,
                })
            }
            _ => None,
        };
        let judge = judge(&run, sources.judge.as_deref(), &tasks)?;
        // What the spec alone decides (rollout.temperature > 0, the flags of engines.extraArgs,
        // ...) was checked by `read_manifest` through `RLRun::validate`: the CRD's own rules, so
        // the API server refuses the same manifests (docs/operator.md, "One validation").
        let algo = &spec.algorithm;
        let total_steps = u64::from(spec.total_steps);
        // Episodes are checked against the policy's limits where this process has the model.
        let limits = crate::rollout::validate::limits(&model_dir);
        Ok(Self {
            name,
            model_dir,
            tasks,
            agent: sources.agent.then(|| agent(&run, dir)).transpose()?,
            concurrency: spec.agent.concurrency.max(1) as usize,
            episode_timeout: (spec.agent.timeout).map_or(Duration::from_secs(600), Duration::from),
            jail: jail(&spec.agent)?,
            env_loop: EnvLoopOptions {
                max_turns: spec.rollout.max_turns as usize,
                sampling: ChatSampling {
                    max_tokens: Some(spec.rollout.max_tokens as usize),
                    temperature: Some(spec.rollout.temperature),
                    top_p: Some(spec.rollout.top_p),
                    ..ChatSampling::default()
                },
                ..EnvLoopOptions::default()
            },
            rollout: RolloutOptions {
                group_size: algo.group_size as usize,
                batch_size: algo.batch_size as usize,
                max_staleness: u64::from(algo.max_staleness),
                limits,
                dynamic_sampling: algo.dynamic_sampling.as_ref().map(|d| {
                    (d.max_groups_per_step).map_or(4 * algo.batch_size as usize, |m| m as usize)
                }),
            },
            partial_rollout: algo.partial_rollout,
            estimator: algo.estimator,
            overlong: Overlong::of(spec)?,
            #[cfg(feature = "torch")]
            trainer: trainer_options(&run, total_steps),
            trainer_ranks: (spec.trainer.nodes.max(1) * spec.trainer.gpus_per_node.max(1)) as usize,
            ranks_per_node: spec.trainer.gpus_per_node.max(1) as usize,
            engines: spec.engines.replicas as usize,
            total_steps,
            checkpoint_every: spec
                .checkpoint
                .as_ref()
                .map(|c| u64::from(c.interval_steps.max(1))),
            routing_replay: spec.routing_replay,
            teacher_dir: match (&sources.teacher, algo.estimator) {
                (Some(dir), Estimator::OnPolicyDistillation) => {
                    Some(model_folder(dir, "spec.algorithm.teacher.path")?)
                }
                _ => None,
            },
            served_teacher: match (&algo.teacher, algo.estimator) {
                (Some(t), Estimator::OnPolicyDistillation) => t.replicas.map(|r| r as usize),
                _ => None,
            },
            judge,
            eval,
            run,
        })
    }

    /// Synchronous RL for comparison (`--sync`): generation waits for training (staleness 0)
    /// and weight updates wait for running requests instead of keeping them.
    pub fn synchronous(mut self) -> Self {
        self.rollout.max_staleness = 0;
        self.partial_rollout = false;
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `manifest` written to a file of its own and read as `moult run` and every pod read it.
    fn read(name: &str, spec: &str) -> Result<RLRun> {
        let path =
            std::env::temp_dir().join(format!("moult-config-{name}-{}.yaml", std::process::id()));
        std::fs::write(
            &path,
            format!(
                "apiVersion: moult.dev/v1alpha1
kind: RLRun
metadata: {{name: r}}
spec:
  model: {{path: model}}
  agent: {{env: repeat, dataset: {{path: tasks.jsonl}}}}
{spec}"
            ),
        )
        .unwrap();
        let run = read_manifest(&path);
        let _ = std::fs::remove_file(&path);
        run
    }

    /// The refusals the API server makes (operator/tests/support's table), made here too with
    /// the same field and message: one set of rules, the CRD's.
    #[test]
    fn a_manifest_the_api_server_refuses_is_refused_with_the_same_field() {
        assert!(read("ok", "  totalSteps: 1\n").is_ok());
        for (name, spec, field, message) in [
            (
                "temperature",
                "  rollout: {temperature: 0}\n  totalSteps: 1\n",
                "spec.rollout",
                "rollout.temperature must be greater than 0",
            ),
            (
                "port",
                "  engines: {extraArgs: [\"--port\", \"9999\"]}\n  totalSteps: 1\n",
                "spec.engines",
                "engines.extraArgs cannot set a flag moult sets itself",
            ),
            (
                "overlong",
                "  algorithm: {overlong: {bufferTokens: 64, maxTokens: 32}}\n  totalSteps: 1\n",
                "spec.algorithm.overlong",
                "algorithm.overlong.bufferTokens must be at most algorithm.overlong.maxTokens",
            ),
            (
                "steps",
                "  totalSteps: 0\n",
                "spec.totalSteps",
                "spec.totalSteps in body should be greater than or equal to 1",
            ),
            // Strict field validation: `kubectl apply` refuses a misspelt field, and so does this.
            (
                "typo",
                "  rollout: {maxToken: 4}\n  totalSteps: 1\n",
                "spec.rollout.maxToken",
                "unknown field; did you mean maxTokens?",
            ),
        ] {
            let Err(e @ RunError::Manifest { .. }) = read(name, spec) else {
                panic!("{name}: refused as a manifest error");
            };
            let e = e.to_string();
            assert!(
                e.contains(&format!("{field}: ")) && e.contains(message),
                "{name}: {e}"
            );
        }
    }

    /// DAPO's formula, by hand: L_max 100, buffer 20, factor 0.5.
    #[test]
    fn the_overlong_penalty_is_zero_then_linear_over_the_buffer_then_the_whole_factor() {
        let o = Overlong {
            max_tokens: 100,
            buffer_tokens: 20,
            factor: 0.5,
        };
        for (len, want) in [
            (0, 0.0),
            (80, 0.0),
            (81, -0.5 / 20.0),
            (90, -0.25),
            (100, -0.5),
            (101, -0.5),
            (10_000, -0.5),
        ] {
            assert!(
                (o.penalty(len) - want).abs() < 1e-12,
                "{len}: {}",
                o.penalty(len)
            );
        }
    }

    #[cfg(feature = "torch")]
    #[test]
    fn the_trainer_spec_sets_sharding_and_micro_batches() {
        use crate::trainer::train::Sharding;
        let default = trainer_options(&read("default", "  totalSteps: 1\n").unwrap(), 1);
        assert_eq!(
            (default.sharding, default.micro_batch_tokens),
            (Sharding::Full, 8192)
        );
        let run = read(
            "trainer",
            "  trainer: {nodes: 2, sharding: Optimizer, microBatchTokens: 512}\n  totalSteps: 1\n",
        )
        .unwrap();
        let set = trainer_options(&run, 1);
        assert_eq!(
            (set.sharding, set.micro_batch_tokens),
            (Sharding::Optimizer, 512)
        );
        // The learning-rate schedule: constant unless a decay is set.
        assert_eq!(set.schedule.at(1), set.schedule.at(1_000));
        let run = read(
            "decay",
            "  algorithm: {optimizer: {learningRate: 1.0e-5, decay: Cosine, minLearningRateRatio: 0.1}}\n  totalSteps: 10\n",
        )
        .unwrap();
        let schedule = trainer_options(&run, 10).schedule;
        assert!(
            (schedule.at(10) - 1e-6).abs() < 1e-15,
            "{}",
            schedule.at(10)
        );
        assert!(
            (schedule.at(5) - 5.5e-6).abs() < 1e-15,
            "{}",
            schedule.at(5)
        );
        // The CRD's rule, as the API server applies it: bfloat16 needs master shards.
        let bf16 = |trainer: &str| {
            let run = read("bf16", &format!("  trainer: {trainer}\n  totalSteps: 1\n"))?;
            Ok::<_, RunError>(trainer_options(&run, 1).bf16_compute)
        };
        assert!(bf16("{nodes: 2, gpusPerNode: 1, computeDtype: BFloat16}").unwrap());
        // One node of several GPUs is several ranks.
        assert!(bf16("{gpusPerNode: 4, computeDtype: BFloat16}").unwrap());
        assert!(!bf16("{nodes: 2, computeDtype: Float32}").unwrap());
        for refused in [
            "{gpusPerNode: 1, computeDtype: BFloat16}",
            "{nodes: 2, sharding: Optimizer, computeDtype: BFloat16}",
        ] {
            let e = bf16(refused).unwrap_err().to_string();
            assert!(
                e.contains("trainer.computeDtype BFloat16"),
                "{refused}: {e}"
            );
        }
        let zero = read(
            "zero",
            "  trainer: {microBatchTokens: 0}\n  totalSteps: 1\n",
        )
        .unwrap_err()
        .to_string();
        assert!(zero.contains("spec.trainer.microBatchTokens"), "{zero}");
    }

    #[test]
    fn a_local_run_names_the_cluster_only_fields_a_manifest_sets() {
        let run = read("local", "  totalSteps: 1\n").unwrap();
        assert!(cluster_only_fields(&run.spec).is_empty());
        let run = read(
            "cluster",
            "  trainer: {nodes: 2, image: t}\n  scheduling: {queueName: q}\n  totalSteps: 1\n",
        )
        .unwrap();
        // trainer.nodes: ranks as processes of this machine.
        assert_eq!(
            cluster_only_fields(&run.spec),
            ["trainer.image", "scheduling"]
        );
    }
}
