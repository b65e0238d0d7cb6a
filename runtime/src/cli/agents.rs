//! `moult agents`: run episodes of an agent against an engine through a loopback server of its
//! own and write each episode as a JSON line; or, with `--config` and `--coordinator`, be an
//! agent pod of a cluster run.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{bail, Context};
use moult_runtime::agents::env::EnvLoopOptions;
use moult_runtime::agents::process::{describe_python, AgentCommand};
use moult_runtime::agents::{Agent, AgentPool, EpisodeStatus, PoolOptions};
use moult_runtime::chat::ChatSampling;
use moult_runtime::cluster::agents::AgentsProcessOptions;

#[derive(Debug, clap::Args)]
pub struct Args {
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
    /// `episode`: every episode's program in a jail of its own; `process`: in a process group
    /// only, the weaker guarantee (docs/security.md#episodes).
    #[arg(long, default_value = "episode", value_parser = ["episode", "process"])]
    isolation: String,
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    let stop = super::role_stop()?.cancelled_owned();
    if let (Some(config), Some(coordinator)) = (args.config, args.coordinator) {
        let opts = AgentsProcessOptions {
            config,
            coordinator,
            command: args.command,
            metrics_addr: args.metrics_addr,
        };
        return Ok(moult_runtime::cluster::agents::run(opts, stop).await?);
    }
    let (Some(engine), Some(model), Some(tasks)) = (&args.engine, &args.model, &args.tasks) else {
        bail!("give --engine, --model and --tasks (or --config and --coordinator in an agent pod)");
    };
    let jail = (args.isolation == "episode").then(moult_jail::Jail::default);
    let agent = match (&args.agent, &args.agent_cmd, args.form.as_deref()) {
        (Some(a), _, _) if a.starts_with("builtin:") => Agent::builtin(&a["builtin:".len()..])?,
        (Some(module), _, _) => {
            let cmd = AgentCommand::python(&args.python, module)?;
            match describe_python(&args.python, module, jail.as_ref())
                .await?
                .as_str()
            {
                "chat" => Agent::Chat(cmd),
                "env" => Agent::ExternalEnv(cmd),
                other => bail!("{module}: AgentRunner has unknown form `{other}`"),
            }
        }
        (None, Some(line), Some("chat")) => Agent::Chat(AgentCommand::parse(line)?),
        (None, Some(line), Some("env")) => Agent::ExternalEnv(AgentCommand::parse(line)?),
        _ => bail!("give --agent PATH|builtin:NAME, or --agent-cmd CMD with --form chat|env"),
    };
    let tasks = moult_runtime::config::read_jsonl(tasks, "--tasks")?;
    let listener = super::bind("127.0.0.1", args.port).await?;
    let scratch_dir = std::env::temp_dir().join(format!("moult-agents-{}", std::process::id()));
    let pool = AgentPool::serve(
        engine,
        (model, super::folder_name(model)),
        agent,
        PoolOptions {
            concurrency: args.concurrency,
            timeout: args.timeout,
            env_loop: EnvLoopOptions {
                max_turns: args.max_turns,
                sampling: ChatSampling {
                    max_tokens: Some(args.max_tokens),
                    temperature: Some(args.temperature),
                    ..ChatSampling::default()
                },
                system_prompt: args.system_prompt,
                ..EnvLoopOptions::default()
            },
            scratch_dir: scratch_dir.clone(),
            jail,
            ..PoolOptions::default()
        },
        listener,
        std::future::pending(),
    )?;
    let total = tasks.len();
    let (at_once, loopback) = (args.concurrency, pool.loopback_url());
    eprintln!("moult agents: {total} episodes, {at_once} at once, loopback {loopback}");
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
                let reason = ep.reason.as_deref().unwrap_or("");
                eprintln!("[{done}/{total}] episode {} FAILED: {reason}", ep.index);
            }
        }
        writeln!(out, "{}", serde_json::to_string(&ep)?)?;
        out.flush()?;
    }
    let _ = std::fs::remove_dir_all(&scratch_dir);
    eprintln!(
        "moult agents: {done} episodes, {failed} failed, mean reward {:.3}",
        if done > 0 { reward / done as f64 } else { 0.0 }
    );
    Ok(())
}
