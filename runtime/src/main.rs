//! The `moult` command line.

use std::path::PathBuf;

use anyhow::{bail, Context};
use clap::{Parser, Subcommand};
#[cfg(feature = "torch")]
use moult_runtime::engine::{http, EngineHandle, EngineOptions};
#[cfg(feature = "torch")]
use moult_runtime::model::{parse_dtype, CausalLm, ModelConfig};
#[cfg(feature = "torch")]
use tch::{Device, Kind};

#[derive(Debug, Parser)]
#[command(
    name = "moult",
    version,
    about = "Kubernetes-native agentic RL for LLMs"
)]
struct Cli {
    /// Log to the console too (INFO and up, or what RUST_LOG says): `moult run` otherwise shows
    /// its progress and warnings only, and logs to <out>/moult.log.
    #[arg(short, long, global = true)]
    verbose: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Serve a model with the built-in engine behind vLLM's token-in/token-out API.
    Engine(EngineArgs),
    /// Serve the loopback server (OpenAI and Anthropic chat on exact tokens) against a running
    /// engine, so an agent can be tried by hand; `GET /s/{session}/trajectory` shows what a
    /// session recorded.
    Chat(ChatArgs),
    /// Run episodes of an agent (ChatAgent or Env) against an engine with a loopback server, and
    /// write each episode (reward and exact token segments) as a JSON line; or, with --config and
    /// --coordinator, be an agent pod of a cluster run (lease episodes, run them, return them).
    Agents(AgentsArgs),
    /// Start agent programs for `moult agents` in a container that holds no credential (the
    /// sandbox container of a cluster run's agent pods; docs/security.md): `moult agents` with
    /// MOULT_AGENT_SANDBOX=SOCKET starts every agent program here instead of as its own child.
    Sandbox(SandboxArgs),
    /// The coordinator of a cluster run (in its pod): the router over the engines of the run's
    /// Service, the rollout pool over the agent pods, the trainer's batches and the RLRun status.
    Coordinator(CoordinatorArgs),
    /// The trainer of a cluster run (in its pod): batches from the coordinator, weights to the
    /// engines, checkpoints on MOULT_CHECKPOINTS; resumes from the newest checkpoint.
    Trainer(TrainerArgs),
    /// One rank of a trainer of several (started by `moult run` or `moult trainer` for the ranks
    /// after the first, with MOULT_TRAINER_RANK, MOULT_TRAINER_WORLD_SIZE and
    /// MOULT_TRAINER_MASTER set): joins rank 0, then trains as it commands (docs/distributed.md).
    #[command(hide = true)]
    TrainerRank(TrainerRankArgs),
    /// Serve the engine API in front of a pool of engines: session-affine routing, failover of
    /// requests from dead engines, control calls fanned out to every engine.
    Router(RouterArgs),
    /// Run RL from an RLRun manifest on this machine: built-in engines behind the router, the
    /// agent pool, the rollout pool, the trainer and weight sync, all local. Writes
    /// metrics.jsonl, reward.svg, summary.json and checkpoints to --out; resumes from the newest
    /// checkpoint there.
    Run(RunArgs),
    /// Evaluate a policy on an RLRun manifest's held-out tasks (spec.eval) as a run does during
    /// training, with engines and agents on this machine: a checkpoint (--checkpoint), or the
    /// manifest's model. Prints the result as JSON on stdout.
    Eval(EvalArgs),
    /// Write a checkpoint's policy as a model folder engines serve (`model.safetensors` with
    /// whole tensors, the config and tokenizer files): for a checkpoint that trainer ranks wrote
    /// in shards, or to take a policy out of a run's checkpoints.
    Export(ExportArgs),
}

#[derive(Debug, clap::Args)]
struct ExportArgs {
    /// A checkpoint folder (step-NNNNNN), or a run's checkpoints folder (its newest checkpoint).
    checkpoint: PathBuf,
    /// The model folder to write (it must not exist yet).
    out: PathBuf,
}

#[derive(Debug, clap::Args)]
struct EvalArgs {
    /// The RLRun manifest; its spec.eval says which tasks and how to sample.
    manifest: PathBuf,
    /// A checkpoint folder (step-NNNNNN), a run's checkpoints folder (its newest checkpoint), or
    /// any model folder [default: the manifest's model].
    #[arg(long)]
    checkpoint: Option<PathBuf>,
    /// Also write the result (JSON) to this file.
    #[arg(long)]
    out: Option<PathBuf>,
    /// cpu, cuda or cuda:N [default: cuda if the manifest's trainer has GPUs and one is here,
    /// else cpu].
    #[arg(long)]
    device: Option<String>,
    /// No status line (warnings still show).
    #[arg(long)]
    quiet: bool,
}

#[derive(Debug, clap::Args)]
struct RunArgs {
    /// The RLRun manifest (the same YAML `kubectl apply` takes); relative paths in it are
    /// relative to its folder.
    manifest: PathBuf,
    /// Where metrics, the reward plot, the summary and checkpoints go [default: runs/<name>].
    #[arg(long)]
    out: Option<PathBuf>,
    /// Synchronous RL, for comparison: generation waits for training (staleness 0) and weight
    /// updates wait for running requests (no partial rollout).
    #[arg(long)]
    sync: bool,
    /// cpu, cuda or cuda:N [default: cuda if the manifest's trainer has GPUs and one is here,
    /// else cpu].
    #[arg(long)]
    device: Option<String>,
    /// Fixes the task order and libtorch's generator.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Train this many steps in all instead of the manifest's spec.totalSteps.
    #[arg(long)]
    steps: Option<u64>,
    /// Checkpoint every N steps instead of the manifest's spec.checkpoint.intervalSteps.
    #[arg(long)]
    checkpoint_every: Option<u64>,
    /// No progress line per step and no status line (warnings still show).
    #[arg(long)]
    quiet: bool,
    /// Write every trained batch (each episode's tokens, loss mask, logprobs, versions and
    /// reward) to <out>/rollouts/step-NNNNNN.json.
    #[arg(long)]
    dump_rollouts: bool,
    /// Train on the batches a run dumped (--dump-rollouts) in this folder, in order, instead of
    /// generating: no engines, no agents. Give it a new --out.
    #[arg(long, value_name = "DIR", conflicts_with = "dump_rollouts")]
    replay: Option<PathBuf>,
}

#[derive(Debug, clap::Args)]
struct CoordinatorArgs {
    /// The run config (the RLRun manifest the operator mounts).
    #[arg(long, env = "MOULT_CONFIG")]
    config: PathBuf,
    #[arg(long, default_value = "0.0.0.0")]
    host: String,
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Fixes the task order.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// How long an episode's lease lasts unless its agent pod renews it (agent pods renew every
    /// few seconds): a pod that dies loses its episodes to other pods after this long.
    #[arg(long, env = "MOULT_LEASE_TIME", default_value = "30s", value_parser = humantime::parse_duration)]
    lease_time: std::time::Duration,
}

#[derive(Debug, clap::Args)]
struct TrainerArgs {
    /// The run config (the RLRun manifest the operator mounts).
    #[arg(long, env = "MOULT_CONFIG")]
    config: PathBuf,
    /// Where /health and /metrics listen.
    #[arg(long, default_value = "0.0.0.0:9090")]
    metrics_addr: String,
    /// cpu, cuda or cuda:N [default: cuda if the run's trainer has GPUs and one is here, else cpu].
    #[arg(long)]
    device: Option<String>,
}

#[derive(Debug, clap::Args)]
struct TrainerRankArgs {
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: String,
}

#[derive(Debug, clap::Args)]
struct RouterArgs {
    /// An engine (built-in or vLLM); repeat for several. More can join through POST /engines.
    #[arg(long = "engine", required = true)]
    engines: Vec<String>,
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    #[arg(long, default_value_t = 8200)]
    port: u16,
    /// consistent-hash (session affinity with bounded load) or least-tokens.
    #[arg(long, default_value = "consistent-hash")]
    policy: String,
    /// How often each engine's /health is probed.
    #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
    health_interval: std::time::Duration,
    /// How long a request waits for a healthy engine when none is up (engines loading or
    /// restarting) before it fails with 503; 0s fails at once.
    #[arg(long, default_value = "0s", value_parser = humantime::parse_duration)]
    engine_patience: std::time::Duration,
}

#[derive(Debug, clap::Args)]
struct AgentsArgs {
    /// Agent pod of a cluster run: the run config (the RLRun manifest the operator mounts).
    #[arg(long, requires = "coordinator", conflicts_with_all = ["engine", "tasks", "agent", "agent_cmd"])]
    config: Option<PathBuf>,
    /// Agent pod of a cluster run: the coordinator's URL (leases, and generation via its router).
    #[arg(long, requires = "config")]
    coordinator: Option<String>,
    /// Agent pod of a cluster run: where /health and /metrics listen.
    #[arg(long, default_value = "0.0.0.0:9090", requires = "config")]
    metrics_addr: String,
    /// Agent pod of a cluster run: the agent's command (instead of the manifest's).
    #[arg(last = true, requires = "config")]
    command: Vec<String>,
    /// The engine (or router) to generate with.
    #[arg(long, required_unless_present = "config")]
    engine: Option<String>,
    /// The model's folder (tokenizer and chat template).
    #[arg(long, required_unless_present = "config")]
    model: Option<PathBuf>,
    /// The agent: a Python file (or module) exporting `AgentRunner` (a moult.ChatAgent or
    /// moult.Env), or `builtin:NAME` for a built-in env (builtin:repeat, builtin:math).
    #[arg(long, conflicts_with = "agent_cmd")]
    agent: Option<String>,
    /// Any program as the agent (split on whitespace); needs --form.
    #[arg(long, requires = "form")]
    agent_cmd: Option<String>,
    /// The form of --agent-cmd: chat (one process per episode, its own loop) or env (JSON lines).
    #[arg(long, value_parser = ["chat", "env"])]
    form: Option<String>,
    /// Tasks, one JSON value per line.
    #[arg(long, required_unless_present = "config")]
    tasks: Option<PathBuf>,
    /// Episodes written here, one JSON object per line [default: stdout].
    #[arg(long)]
    out: Option<PathBuf>,
    /// Episodes running at once.
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
    /// Wall-clock limit per episode (30s, 2m, ...).
    #[arg(long, default_value = "5m", value_parser = humantime::parse_duration)]
    timeout: std::time::Duration,
    /// Env form: model turns per episode.
    #[arg(long, default_value_t = 8)]
    max_turns: usize,
    /// Env form: tokens per model turn.
    #[arg(long, default_value_t = 256)]
    max_tokens: usize,
    /// Env form: sampling temperature.
    #[arg(long, default_value_t = 1.0)]
    temperature: f64,
    /// Env form: a system prompt before the first observation.
    #[arg(long)]
    system_prompt: Option<String>,
    /// The Python that runs Python agents.
    #[arg(long, default_value = "python3")]
    python: String,
    /// The loopback server's port on 127.0.0.1 (0 picks a free one).
    #[arg(long, default_value_t = 0)]
    port: u16,
}

#[derive(Debug, clap::Args)]
struct SandboxArgs {
    /// The Unix socket to listen on (in a folder shared with the `moult agents` container).
    #[arg(long)]
    socket: PathBuf,
}

#[derive(Debug, clap::Args)]
struct ChatArgs {
    /// The engine (or router) to generate with: the built-in engine or vLLM.
    #[arg(long)]
    engine: String,
    /// The model's folder: tokenizer.json and its chat template (chat_template.jinja or
    /// tokenizer_config.json).
    #[arg(long)]
    model: PathBuf,
    /// Port on 127.0.0.1 (the loopback server never listens on other interfaces); 0 picks one.
    #[arg(long, default_value_t = 8100)]
    port: u16,
    /// Sessions kept at once; more get 429 until some are deleted or expire.
    #[arg(long, default_value_t = 1024)]
    max_sessions: usize,
    /// A session unused this long is dropped when a new session needs room ("0s": never).
    #[arg(long, default_value = "1h", value_parser = humantime::parse_duration)]
    session_idle: std::time::Duration,
    /// Turns one session may take; more get 429.
    #[arg(long, default_value_t = moult_runtime::loopback::DEFAULT_MAX_TURNS)]
    max_turns: usize,
    /// Tokens one session may record over all its segments; a turn after that gets 429.
    #[arg(long, default_value_t = moult_runtime::loopback::DEFAULT_MAX_SESSION_TOKENS)]
    max_session_tokens: usize,
    /// Largest request body accepted (bytes).
    #[arg(long, default_value_t = moult_runtime::loopback::DEFAULT_MAX_BODY_BYTES)]
    max_body_bytes: usize,
    /// The name answered by /v1/models [default: the model folder's name].
    #[arg(long)]
    served_model_name: Option<String>,
}

#[derive(Debug, clap::Args)]
struct EngineArgs {
    /// A Hugging Face model folder: config.json and model.safetensors (or sharded with an index).
    #[arg(long)]
    model: PathBuf,
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Sequences decoded together in one step.
    #[arg(long, default_value_t = 32)]
    max_batch: usize,
    /// Longest prompt + output per request [default: the model's max_position_embeddings].
    #[arg(long)]
    max_model_len: Option<usize>,
    /// Prompt tokens processed per step; longer prompts are prefilled in chunks.
    #[arg(long, default_value_t = 2048)]
    max_prefill_tokens: usize,
    /// Requests accepted beyond the running batch before new ones get 429.
    #[arg(long, default_value_t = 4096)]
    max_waiting: usize,
    /// Weight dtype: auto (float32 on CPU, the checkpoint's dtype on CUDA), float32, bfloat16, float16.
    #[arg(long, default_value = "auto")]
    dtype: String,
    /// cpu, cuda or cuda:N [default: cuda if available, else cpu].
    #[arg(long)]
    device: Option<String>,
    /// Return the routed expert ids of MoE models (`routed_experts` in each response).
    #[arg(long)]
    enable_return_routed_experts: bool,
    /// libtorch intra-op threads [default: 1 for small models (hidden size < 512), else all cores].
    #[arg(long)]
    threads: Option<usize>,
    /// Keep weights packed for oneDNN matmuls on CPU (faster decoding, twice the weight
    /// memory): auto (all but small models), on, off.
    #[arg(long, default_value = "auto")]
    packed_weights: String,
    /// The name reported by /v1/models and in metrics labels [default: the model folder's name].
    #[arg(long)]
    served_model_name: Option<String>,
}

#[cfg(feature = "torch")]
fn parse_device(text: Option<&str>) -> anyhow::Result<Device> {
    Ok(match text {
        None => Device::cuda_if_available(),
        Some("cpu") => Device::Cpu,
        Some("cuda") => Device::Cuda(0),
        Some(other) => match other.strip_prefix("cuda:").and_then(|n| n.parse().ok()) {
            Some(n) => Device::Cuda(n),
            None => bail!("--device must be cpu, cuda or cuda:N; got `{other}`"),
        },
    })
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! { _ = ctrl_c => {}, _ = term => {} }
    tracing::info!("shutting down: draining connections");
}

#[cfg(feature = "torch")]
async fn engine(args: EngineArgs) -> anyhow::Result<()> {
    let device = parse_device(args.device.as_deref())?;
    let cfg = ModelConfig::from_dir(&args.model)?;
    let kind = match args.dtype.as_str() {
        "auto" if device == Device::Cpu => Kind::Float,
        "auto" => cfg
            .dtype
            .as_deref()
            .and_then(parse_dtype)
            .unwrap_or(Kind::BFloat16),
        other => parse_dtype(other).with_context(|| {
            format!("--dtype must be auto, float32, bfloat16 or float16; got `{other}`")
        })?,
    };
    if args.max_batch == 0 || args.max_prefill_tokens == 0 || args.threads == Some(0) {
        bail!("--max-batch, --max-prefill-tokens and --threads must be at least 1");
    }
    let name = args
        .served_model_name
        .clone()
        .unwrap_or_else(|| folder_name(&args.model));
    tracing::info!(model = %args.model.display(), ?kind, ?device, "loading");
    let started = std::time::Instant::now();
    let model = {
        let dir = args.model.clone();
        tokio::task::spawn_blocking(move || CausalLm::load(&dir, kind, device)).await??
    };
    tracing::info!(seconds = started.elapsed().as_secs_f32(), "model loaded");
    let opts = EngineOptions {
        max_batch: args.max_batch,
        max_model_len: args.max_model_len.unwrap_or(cfg.max_position_embeddings),
        max_prefill_tokens: args.max_prefill_tokens,
        max_waiting: args.max_waiting,
        return_routed_experts: args.enable_return_routed_experts,
        eos_token_ids: cfg.eos_token_ids.clone(),
        threads: args.threads,
        packed_weights: match args.packed_weights.as_str() {
            "auto" => None,
            "on" => Some(true),
            "off" => Some(false),
            other => bail!("--packed-weights must be auto, on or off; got `{other}`"),
        },
    };
    if args.enable_return_routed_experts && cfg.moe.is_none() {
        tracing::warn!(
            "--enable-return-routed-experts has no effect: the model is not a mixture of experts"
        );
    }
    let (handle, thread) = EngineHandle::spawn(model, name, opts);
    let addr = format!("{}:{}", args.host, args.port);
    let listener = tokio::net::TcpListener::bind(&addr)
        .await
        .with_context(|| format!("binding {addr}"))?;
    println!(
        "moult engine listening on http://{}",
        listener.local_addr()?
    );
    // The process ends with its engine thread: a server whose engine is gone would only answer
    // errors (docs/security.md).
    let died = tokio::task::spawn_blocking(move || thread.join());
    let shutdown = async move {
        tokio::select! {
            () = shutdown_signal() => {}
            _ = died => {}
        }
    };
    let engine = handle.clone();
    http::serve(listener, handle, shutdown).await?;
    if !engine.alive() {
        bail!("the engine's compute thread stopped (its error is above); exiting so that the engine is restarted");
    }
    Ok(())
}

fn folder_name(dir: &std::path::Path) -> String {
    dir.file_name()
        .map_or("model".into(), |n| n.to_string_lossy().into_owned())
}

async fn chat(args: ChatArgs) -> anyhow::Result<()> {
    if args.max_sessions == 0 {
        bail!("--max-sessions must be at least 1");
    }
    if args.max_turns == 0 {
        bail!("--max-turns must be at least 1");
    }
    if args.max_session_tokens == 0 {
        bail!("--max-session-tokens must be at least 1");
    }
    let service = chat_service(
        &args.engine,
        &args.model,
        moult_runtime::loopback::ServiceOptions {
            max_sessions: args.max_sessions,
            model_name: args
                .served_model_name
                .clone()
                .unwrap_or_else(|| folder_name(&args.model)),
            registered_sessions: false,
            session_idle: (!args.session_idle.is_zero()).then_some(args.session_idle),
            max_turns: args.max_turns,
            max_session_tokens: args.max_session_tokens,
        },
    )?;
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", args.port))
        .await
        .with_context(|| format!("binding 127.0.0.1:{}", args.port))?;
    let addr = listener.local_addr()?;
    println!(
        "moult chat listening on http://{addr} (engine {})",
        args.engine
    );
    println!("  OpenAI:    base_url=http://{addr}/s/SESSION/v1");
    println!("  Anthropic: base_url=http://{addr}/s/SESSION");
    moult_runtime::loopback::serve(
        listener,
        std::sync::Arc::new(service),
        args.max_body_bytes,
        shutdown_signal(),
    )
    .await?;
    Ok(())
}

fn chat_service(
    engine: &str,
    model: &std::path::Path,
    opts: moult_runtime::loopback::ServiceOptions,
) -> anyhow::Result<moult_runtime::loopback::ChatService> {
    moult_runtime::loopback::ChatService::from_model_dir(engine, model, opts)
        .map_err(anyhow::Error::msg)
}

async fn agents(args: AgentsArgs) -> anyhow::Result<()> {
    use moult_runtime::agents::env::EnvLoopOptions;
    if let (Some(config), Some(coordinator)) = (&args.config, &args.coordinator) {
        use moult_runtime::cluster::agents::{run, AgentsProcessOptions};
        return Ok(run(
            AgentsProcessOptions {
                config: config.clone(),
                coordinator: coordinator.clone(),
                command: args.command.clone(),
                metrics_addr: args.metrics_addr.clone(),
            },
            shutdown_signal(),
        )
        .await?);
    }
    let (Some(engine), Some(model), Some(tasks)) = (&args.engine, &args.model, &args.tasks) else {
        bail!("give --engine, --model and --tasks (or --config and --coordinator in an agent pod)");
    };
    use moult_runtime::agents::process::{describe_python, AgentCommand};
    use moult_runtime::agents::{Agent, AgentPool, EpisodeStatus, PoolOptions};
    use moult_runtime::chat::ChatSampling;
    use std::io::Write;
    use std::sync::Arc;

    let agent = match (&args.agent, &args.agent_cmd, args.form.as_deref()) {
        (Some(a), _, _) if a.starts_with("builtin:") => Agent::builtin(&a["builtin:".len()..])?,
        (Some(module), _, _) => {
            let cmd = AgentCommand::python(&args.python, module)?;
            match describe_python(&args.python, module).await?.as_str() {
                "chat" => Agent::Chat(cmd),
                "env" => Agent::ExternalEnv(cmd),
                other => bail!("{module}: AgentRunner has unknown form `{other}`"),
            }
        }
        (None, Some(line), Some("chat")) => Agent::Chat(AgentCommand::parse(line)?),
        (None, Some(line), Some("env")) => Agent::ExternalEnv(AgentCommand::parse(line)?),
        _ => bail!("give --agent PATH|builtin:NAME, or --agent-cmd CMD with --form chat|env"),
    };
    let tasks = moult_runtime::run::config::read_jsonl(tasks, "--tasks")?;
    let service = Arc::new(chat_service(
        engine,
        model,
        moult_runtime::loopback::ServiceOptions::pool(args.concurrency * 2, folder_name(model)),
    )?);
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", args.port))
        .await
        .with_context(|| format!("binding 127.0.0.1:{}", args.port))?;
    let loopback_url = format!("http://{}", listener.local_addr()?);
    tokio::spawn(moult_runtime::loopback::serve(
        listener,
        service.clone(),
        moult_runtime::loopback::DEFAULT_MAX_BODY_BYTES,
        std::future::pending(),
    ));
    let scratch_dir = std::env::temp_dir().join(format!("moult-agents-{}", std::process::id()));
    let pool = Arc::new(AgentPool::new(
        service,
        agent,
        PoolOptions {
            concurrency: args.concurrency,
            timeout: args.timeout,
            loopback_url: loopback_url.clone(),
            env_loop: EnvLoopOptions {
                max_turns: args.max_turns,
                sampling: ChatSampling {
                    max_tokens: Some(args.max_tokens),
                    temperature: Some(args.temperature),
                    ..ChatSampling::default()
                },
                system_prompt: args.system_prompt.clone(),
                ..EnvLoopOptions::default()
            },
            scratch_dir: scratch_dir.clone(),
        },
    )?);
    let total = tasks.len();
    eprintln!(
        "moult agents: {total} episodes, {} at once, loopback {loopback_url}",
        args.concurrency
    );
    let mut out: Box<dyn Write> = match &args.out {
        Some(path) => Box::new(std::io::BufWriter::new(
            std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?,
        )),
        None => Box::new(std::io::stdout()),
    };
    let mut episodes = pool.run(tasks);
    let (mut done, mut failed, mut reward) = (0usize, 0usize, 0.0);
    while let Some(ep) = episodes.recv().await {
        done += 1;
        reward += ep.reward;
        match ep.status {
            EpisodeStatus::Completed => eprintln!(
                "[{done}/{total}] episode {} reward {:.3} ({} segments, {:.1}s)",
                ep.index,
                ep.reward,
                ep.segments.len(),
                ep.seconds
            ),
            EpisodeStatus::Failed => {
                failed += 1;
                eprintln!(
                    "[{done}/{total}] episode {} FAILED: {}",
                    ep.index,
                    ep.reason.as_deref().unwrap_or("")
                );
            }
        }
        serde_json::to_writer(&mut out, &ep)?;
        out.write_all(b"\n")?;
        out.flush()?;
    }
    let _ = std::fs::remove_dir_all(&scratch_dir);
    eprintln!(
        "moult agents: {done} episodes, {failed} failed, mean reward {:.3}",
        if done > 0 { reward / done as f64 } else { 0.0 }
    );
    Ok(())
}

async fn coordinator(args: CoordinatorArgs) -> anyhow::Result<()> {
    use moult_runtime::cluster::coordinator::{run, CoordinatorOptions};
    run(
        CoordinatorOptions {
            config: args.config,
            host: args.host,
            port: args.port,
            seed: args.seed,
            poll: std::time::Duration::from_secs(20),
            lease_time: args.lease_time,
        },
        shutdown_signal(),
    )
    .await?;
    Ok(())
}

#[cfg(feature = "torch")]
async fn trainer(args: TrainerArgs) -> anyhow::Result<()> {
    use moult_runtime::cluster::trainer::{run, TrainerProcessOptions};
    let device = match args.device.as_deref() {
        Some(d) => parse_device(Some(d))?,
        None => {
            let gpus = moult_runtime::run::config::read_manifest(&args.config)?
                .spec
                .trainer
                .gpus_per_node;
            if gpus > 0 {
                Device::cuda_if_available()
            } else {
                Device::Cpu
            }
        }
    };
    run(
        TrainerProcessOptions {
            config: args.config,
            metrics_addr: args.metrics_addr,
            device,
        },
        shutdown_signal(),
    )
    .await?;
    Ok(())
}

/// A trainer rank after the first: joins, follows rank 0, exits when it says stop (or fails
/// when it is lost).
#[cfg(feature = "torch")]
fn trainer_rank(args: TrainerRankArgs) -> anyhow::Result<()> {
    use moult_runtime::dist::Rendezvous;
    use moult_runtime::trainer::ranks;
    // Started by a rank 0 on this machine: go when it goes.
    let _ = nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL);
    let device = parse_device(Some(&args.device))?;
    let rendezvous = Rendezvous::from_env()?
        .context("MOULT_TRAINER_WORLD_SIZE must be above 1 for a trainer rank")?;
    let group = moult_runtime::cluster::trainer::join(&rendezvous, device)?;
    let rank = group.rank();
    let mut trainer = ranks::follower(group, device)
        .with_context(|| format!("trainer rank {rank}: joining rank 0"))?;
    trainer
        .follow()
        .with_context(|| format!("trainer rank {rank}"))?;
    Ok(())
}

async fn router(args: RouterArgs) -> anyhow::Result<()> {
    use moult_runtime::router::{policy, server, EnginePool, HealthOptions, Router};
    use std::sync::Arc;
    let policy = policy::by_name(&args.policy).with_context(|| {
        format!(
            "--policy must be consistent-hash or least-tokens; got `{}`",
            args.policy
        )
    })?;
    for url in &args.engines {
        if !(url.starts_with("http://") || url.starts_with("https://")) {
            bail!("--engine must be a URL starting with http:// or https://; got `{url}`");
        }
    }
    let pool = Arc::new(EnginePool::new(&args.engines));
    tokio::spawn(pool.clone().check_health(HealthOptions {
        interval: args.health_interval,
        ..HealthOptions::default()
    }));
    let router = Arc::new(Router::new(pool, policy).with_engine_patience(args.engine_patience));
    let addr = format!("{}:{}", args.host, args.port);
    let listener = tokio::net::TcpListener::bind(&addr)
        .await
        .with_context(|| format!("binding {addr}"))?;
    println!(
        "moult router listening on http://{} ({} engines)",
        listener.local_addr()?,
        args.engines.len()
    );
    server::serve(listener, router, shutdown_signal()).await?;
    Ok(())
}

/// The local run config of the RLRun manifest at `path` (relative paths from its folder), and
/// the device `--device` names: by default CUDA when the manifest's trainer has GPUs and one is
/// here, else the CPU.
#[cfg(feature = "torch")]
fn local_config(
    path: &std::path::Path,
    device: Option<&str>,
) -> anyhow::Result<(moult_runtime::run::config::RunConfig, Device)> {
    use moult_runtime::run::config;
    let manifest = config::read_manifest(path)?;
    let dir = path
        .parent()
        .map_or_else(|| PathBuf::from("."), PathBuf::from);
    let gpus = manifest.spec.trainer.gpus_per_node > 0;
    let cfg = config::RunConfig::new(manifest, &dir)?;
    let device = match device {
        Some(d) => parse_device(Some(d))?,
        None if gpus => Device::cuda_if_available(),
        None => Device::Cpu,
    };
    Ok((cfg, device))
}

#[cfg(feature = "torch")]
async fn run(args: RunArgs, verbose: bool) -> anyhow::Result<()> {
    use moult_runtime::run::{self, console::Console, RunOptions};
    let (mut cfg, device) = local_config(&args.manifest, args.device.as_deref())?;
    if let Some(steps) = args.steps {
        if steps == 0 {
            bail!("--steps must be at least 1");
        }
        cfg.total_steps = steps;
        cfg.trainer.schedule.total_steps = steps;
    }
    if let Some(every) = args.checkpoint_every {
        if every == 0 {
            bail!("--checkpoint-every must be at least 1");
        }
        cfg.checkpoint_every = Some(every);
    }
    if args.sync {
        cfg = cfg.synchronous();
    }
    tch::manual_seed(args.seed as i64);
    let out = args.out.unwrap_or_else(|| run::default_out(&cfg.name));
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    eprintln!(
        "moult run: {} ({} steps, {} tasks, {} engine(s), {}, {} mode) -> {}",
        cfg.name,
        cfg.total_steps,
        cfg.tasks.len(),
        cfg.engines,
        match device {
            Device::Cpu => "CPU".to_string(),
            other => format!("{other:?}"),
        },
        if args.sync {
            "synchronous"
        } else {
            "asynchronous"
        },
        out.display()
    );
    let log = out.join("moult.log");
    let console = Console::new(cfg.total_steps, !args.quiet);
    init_run_logging(&log, &console, verbose)?;
    let summary = run::run(
        cfg,
        RunOptions {
            out: out.clone(),
            device,
            seed: args.seed,
            console: console.clone(),
            dump_rollouts: args.dump_rollouts,
            replay: args.replay.clone(),
        },
        shutdown_signal(),
    )
    .await;
    console.finish();
    let summary = summary.inspect_err(|_| {
        eprintln!("moult run: failed; the full log is {}", log.display());
    })?;
    let reward = |r: Option<f64>| r.map_or("-".into(), |r| format!("{r:.3}"));
    eprintln!(
        "moult run: {} {} at step {}/{} (version {}) after {:.0}s: reward {} -> {} (mean of the last 5 steps)",
        summary.name,
        if summary.interrupted { "stopped" } else { "finished" },
        summary.steps,
        summary.total_steps,
        summary.policy_version,
        summary.seconds,
        reward(summary.first_reward),
        reward(summary.final_reward),
    );
    if let (Some(first), Some(last)) = (&summary.first_eval, &summary.last_eval) {
        eprintln!(
            "  eval (held-out tasks): reward {:.3} at step {} -> {:.3} at step {}, pass@{} {:.3} -> {:.3} ({}/eval.jsonl)",
            first.eval_reward_mean,
            first.step,
            last.eval_reward_mean,
            last.step,
            last.eval_k,
            first.eval_pass_at_k,
            last.eval_pass_at_k,
            out.display(),
        );
    }
    eprintln!(
        "  engines busy {:.0}% of the time (paused {:.1}s for weight sync), trainer busy {:.0}%",
        100.0 * summary.engine_busy_fraction,
        summary.engine_paused_seconds,
        100.0 * summary.trainer_busy_fraction,
    );
    eprintln!(
        "  metrics {0}/metrics.jsonl, plot {0}/reward.svg, summary {0}/summary.json, log {0}/moult.log{1}",
        out.display(),
        summary
            .last_checkpoint
            .as_ref()
            .map_or(String::new(), |c| format!(", checkpoint {}", c.display()))
    );
    Ok(())
}

#[cfg(feature = "torch")]
async fn eval(args: EvalArgs) -> anyhow::Result<()> {
    use moult_runtime::run::{self, console::Console, RunOptions};
    let (cfg, device) = local_config(&args.manifest, args.device.as_deref())?;
    let console = Console::new(0, !args.quiet);
    let scratch = std::env::temp_dir().join(format!("moult-eval-{}", std::process::id()));
    let result = run::evaluate_checkpoint(
        cfg,
        &RunOptions {
            out: scratch.clone(),
            device,
            seed: 0,
            console: console.clone(),
            dump_rollouts: false,
            replay: None,
        },
        args.checkpoint.as_deref(),
    )
    .await;
    console.finish();
    let _ = std::fs::remove_dir_all(&scratch);
    let result = result?;
    eprintln!("{}", moult_runtime::rollout::eval::line(&result));
    let json = serde_json::to_string_pretty(&result)?;
    if let Some(path) = &args.out {
        std::fs::write(path, format!("{json}\n"))
            .with_context(|| format!("writing {}", path.display()))?;
    }
    println!("{json}");
    Ok(())
}

/// `moult` built without libtorch (`--no-default-features`: the agent pods' build) has the roles
/// that only move data; the others say so.
#[cfg(not(feature = "torch"))]
fn without_torch(command: &str) -> anyhow::Result<()> {
    bail!(
        "`moult {command}` needs libtorch, and this moult was built without it (the agent-pod build, --no-default-features): use the runtime image's moult"
    )
}

/// What the log keeps: RUST_LOG, else INFO and up.
fn log_filter() -> tracing_subscriber::EnvFilter {
    tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into())
}

/// `moult run`'s log: all of it to `file`; to the console (through the status line) warnings
/// only, unless `verbose` or RUST_LOG asks for more.
#[cfg(feature = "torch")]
fn init_run_logging(
    file: &std::path::Path,
    console: &moult_runtime::run::console::Console,
    verbose: bool,
) -> anyhow::Result<()> {
    use tracing_subscriber::{fmt, prelude::*, EnvFilter};
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(file)
        .with_context(|| format!("opening the log {}", file.display()))?;
    let loud = verbose || std::env::var_os("RUST_LOG").is_some();
    let on_console = if loud {
        log_filter()
    } else {
        EnvFilter::new("warn")
    };
    tracing_subscriber::registry()
        .with(
            fmt::layer()
                .with_writer(std::sync::Mutex::new(log))
                .with_ansi(false)
                .with_filter(log_filter()),
        )
        .with(
            fmt::layer()
                .with_writer(console.writer())
                .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
                .with_filter(on_console),
        )
        .init();
    Ok(())
}

fn main() -> anyhow::Result<()> {
    // As a container's PID 1, supervise a second `moult` and reap what is orphaned.
    if let Some(code) = moult_runtime::init::supervise_if_first()? {
        std::process::exit(code);
    }
    let cli = Cli::parse();
    // `moult run` sets up its log once it knows its output folder.
    if !matches!(cli.command, Command::Run(_)) {
        // `moult eval` is a command a person runs and reads, not a server: warnings only, unless
        // RUST_LOG asks for more.
        let filter = match cli.command {
            Command::Eval(_) => tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "warn".into()),
            _ => log_filter(),
        };
        tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .init();
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    match cli.command {
        #[cfg(feature = "torch")]
        Command::Engine(args) => runtime.block_on(engine(args)),
        #[cfg(not(feature = "torch"))]
        Command::Engine(_) => without_torch("engine"),
        Command::Chat(args) => runtime.block_on(chat(args)),
        Command::Agents(args) => runtime.block_on(agents(args)),
        Command::Sandbox(args) => runtime.block_on(async move {
            eprintln!("moult sandbox listening on {}", args.socket.display());
            moult_runtime::agents::sandbox::serve(&args.socket)
                .await
                .with_context(|| format!("serving the agent sandbox on {}", args.socket.display()))
        }),
        Command::Router(args) => runtime.block_on(router(args)),
        Command::Coordinator(args) => runtime.block_on(coordinator(args)),
        #[cfg(feature = "torch")]
        Command::Trainer(args) => runtime.block_on(trainer(args)),
        #[cfg(not(feature = "torch"))]
        Command::Trainer(_) => without_torch("trainer"),
        #[cfg(feature = "torch")]
        Command::TrainerRank(args) => trainer_rank(args),
        #[cfg(not(feature = "torch"))]
        Command::TrainerRank(_) => without_torch("trainer-rank"),
        #[cfg(feature = "torch")]
        Command::Run(args) => runtime.block_on(run(args, cli.verbose)),
        #[cfg(not(feature = "torch"))]
        Command::Run(_) => without_torch("run"),
        #[cfg(feature = "torch")]
        Command::Eval(args) => runtime.block_on(eval(args)),
        #[cfg(not(feature = "torch"))]
        Command::Eval(_) => without_torch("eval"),
        #[cfg(feature = "torch")]
        Command::Export(args) => {
            let from = moult_runtime::run::checkpoint::export(&args.checkpoint, &args.out)?;
            eprintln!(
                "moult export: {} -> {} (serve it with `moult engine --model {}`)",
                from.display(),
                args.out.display(),
                args.out.display()
            );
            Ok(())
        }
        #[cfg(not(feature = "torch"))]
        Command::Export(_) => without_torch("export"),
    }
}
