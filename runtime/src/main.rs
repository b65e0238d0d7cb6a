//! The `moult` command line: the parser, the logging every subcommand shares, and the dispatch
//! to `cli::<subcommand>`, where each subcommand's arguments and logic live.

mod cli;

use clap::{Parser, Subcommand};

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
    Engine(cli::engine::Args),
    /// Check the run token in front of an engine that checks none itself (vLLM in an engine pod
    /// listens on the pod's loopback, and this on the pod's address; docs/security.md).
    EngineFront(cli::engine_front::Args),
    /// Serve the loopback server (OpenAI and Anthropic chat on exact tokens) against a running
    /// engine, so an agent can be tried by hand; `GET /s/{session}/trajectory` shows what a
    /// session recorded.
    Chat(cli::chat::Args),
    /// Run episodes of an agent (ChatAgent or Env) against an engine with a loopback server, and
    /// write each episode (reward and exact token segments) as a JSON line; or, with --config and
    /// --coordinator, be an agent pod of a cluster run (lease episodes, run them, return them).
    Agents(cli::agents::Args),
    /// Start agent programs for `moult agents` in a container that holds no credential (the
    /// sandbox container of a cluster run's agent pods; docs/security.md): `moult agents` with
    /// MOULT_AGENT_SANDBOX=SOCKET starts every agent program here instead of as its own child.
    Sandbox(moult_sandbox_pods::cli::Args),
    /// The coordinator of a cluster run (in its pod): the router over the engines of the run's
    /// Service, the rollout pool over the agent pods, the trainer's batches and the RLRun status.
    Coordinator(cli::coordinator::Args),
    /// The trainer of a cluster run (in its pod): batches from the coordinator, weights to the
    /// engines, checkpoints on MOULT_CHECKPOINTS; resumes from the newest checkpoint.
    Trainer(cli::trainer::Args),
    /// One rank of a trainer of several (started by `moult run` or `moult trainer` for the ranks
    /// after the first, with MOULT_TRAINER_RANK, MOULT_TRAINER_WORLD_SIZE and
    /// MOULT_TRAINER_MASTER set): joins rank 0, then trains as it commands (docs/distributed.md).
    #[command(hide = true)]
    TrainerRank(cli::trainer_rank::Args),
    /// Serve the engine API in front of a pool of engines: session-affine routing, failover of
    /// requests from dead engines, control calls fanned out to every engine.
    Router(cli::router::Args),
    /// Run RL from an RLRun manifest on this machine: built-in engines behind the router, the
    /// agent pool, the rollout pool, the trainer and weight sync, all local. Writes
    /// metrics.jsonl, reward.svg, summary.json and checkpoints to --out; resumes from the newest
    /// checkpoint there.
    Run(cli::run::Args),
    /// Evaluate a policy on an RLRun manifest's held-out tasks (spec.eval) as a run does during
    /// training, with engines and agents on this machine: a checkpoint (--checkpoint), or the
    /// manifest's model. Prints the result as JSON on stdout.
    Eval(cli::eval::Args),
    /// Serve an EnginePool manifest's engines on this machine, for `moult run`s whose
    /// `spec.engines.poolRef` names it (LoRA runs sharing one base model; docs/lora.md).
    Pool(cli::pool::Args),
    /// Write a checkpoint's policy as a model folder engines serve (`model.safetensors` with
    /// whole tensors, the config and tokenizer files): for a checkpoint that trainer ranks wrote
    /// in shards, to take a policy out of a run's checkpoints, or to merge a LoRA run's adapter
    /// into its base model.
    Export(cli::export::Args),
}

fn main() -> anyhow::Result<()> {
    // Started to make an episode's jail, make it and run the agent program in it.
    moult_jail::run_if_asked();
    // As a container's PID 1, supervise a second `moult` and reap what is orphaned.
    if let Some(code) = moult_jail::init::supervise_if_first()? {
        std::process::exit(code);
    }
    let cli = Cli::parse();
    // `moult run` sets up its log once it knows its output folder.
    if !matches!(cli.command, Command::Run(_)) {
        // `moult eval` is a command a person runs and reads, not a server: warnings only, unless
        // RUST_LOG asks for more.
        let default = match cli.command {
            Command::Eval(_) => "warn",
            _ => "info",
        };
        tracing_subscriber::fmt()
            .with_env_filter(cli::log_filter(default))
            .with_writer(std::io::stderr)
            .init();
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    match cli.command {
        Command::Chat(args) => runtime.block_on(cli::chat::run(args)),
        Command::Agents(args) => runtime.block_on(cli::agents::run(args)),
        Command::Sandbox(args) => runtime.block_on(moult_sandbox_pods::cli::run(args, |l, app| {
            moult_runtime::serve::serve(l, app, std::future::pending())
        })),
        Command::Router(args) => runtime.block_on(cli::router::run(args)),
        Command::EngineFront(args) => runtime.block_on(cli::engine_front::run(args)),
        Command::Coordinator(args) => runtime.block_on(cli::coordinator::run(args)),
        Command::Pool(args) => runtime.block_on(cli::pool::run(args)),
        #[cfg(feature = "torch")]
        Command::Engine(args) => runtime.block_on(cli::engine::run(args)),
        #[cfg(feature = "torch")]
        Command::Trainer(args) => runtime.block_on(cli::trainer::run(args)),
        #[cfg(feature = "torch")]
        Command::TrainerRank(args) => cli::trainer_rank::run(args),
        #[cfg(feature = "torch")]
        Command::Run(args) => runtime.block_on(cli::run::run(args, cli.verbose)),
        #[cfg(feature = "torch")]
        Command::Eval(args) => runtime.block_on(cli::eval::run(args)),
        #[cfg(feature = "torch")]
        Command::Export(args) => cli::export::run(args),
        #[cfg(not(feature = "torch"))]
        Command::Engine(_) => cli::without_torch("engine"),
        #[cfg(not(feature = "torch"))]
        Command::Trainer(_) => cli::without_torch("trainer"),
        #[cfg(not(feature = "torch"))]
        Command::TrainerRank(_) => cli::without_torch("trainer-rank"),
        #[cfg(not(feature = "torch"))]
        Command::Run(_) => cli::without_torch("run"),
        #[cfg(not(feature = "torch"))]
        Command::Eval(_) => cli::without_torch("eval"),
        #[cfg(not(feature = "torch"))]
        Command::Export(_) => cli::without_torch("export"),
    }
}
