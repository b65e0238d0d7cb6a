//! The `moult` subcommands, one module each: its arguments (`Args`) and what it does (`run`).
//! `main.rs` only parses and dispatches; what several subcommands share is here once: the
//! device flag, the stop signal, the default served model name, the log filter and the
//! local run config of `moult run` and `moult eval`.

pub mod agents;
pub mod chat;
pub mod coordinator;
pub mod engine;
pub mod engine_front;
pub mod eval;
pub mod export;
pub mod pool;
pub mod router;
pub mod run;
pub mod trainer;
pub mod trainer_rank;

use std::path::Path;
use std::time::Duration;

use anyhow::Context;
#[cfg(feature = "torch")]
use tch::Device;
use tokio_util::sync::CancellationToken;

/// What the log keeps: RUST_LOG, else `default` and up.
pub fn log_filter(default: &str) -> tracing_subscriber::EnvFilter {
    tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| default.into())
}

/// The device a `--device` flag names (cpu, cuda or cuda:N); without one, CUDA when `gpu` asks
/// for it (an engine, or a trainer whose manifest gives it GPUs) and one is here, else the CPU.
#[cfg(feature = "torch")]
pub fn device(flag: Option<&str>, gpu: bool) -> anyhow::Result<Device> {
    Ok(match flag {
        None if gpu => Device::cuda_if_available(),
        None | Some("cpu") => Device::Cpu,
        Some("cuda") => Device::Cuda(0),
        Some(other) => match other.strip_prefix("cuda:").and_then(|n| n.parse().ok()) {
            Some(n) => Device::Cuda(n),
            None => anyhow::bail!("--device must be cpu, cuda or cuda:N; got `{other}`"),
        },
    })
}

/// The local run config of the RLRun manifest at `path` (relative paths from its folder), and
/// the trainer's device (`--device`, by default CUDA when its trainer has GPUs).
#[cfg(feature = "torch")]
pub fn local_config(
    path: &Path,
    flag: Option<&str>,
) -> anyhow::Result<(moult_runtime::config::RunConfig, Device)> {
    use moult_runtime::config;
    let manifest: moult_operator::api::RLRun = config::read_manifest(path)?;
    let gpus = manifest.spec.trainer.gpus_per_node;
    let cfg = config::RunConfig::new(manifest, path.parent().unwrap_or(Path::new(".")))?;
    Ok((cfg, device(flag, gpus > 0)?))
}

/// The name a model folder is served under by default: the folder's name.
pub fn folder_name(dir: &Path) -> String {
    (dir.file_name()).map_or("model".into(), |n| n.to_string_lossy().into_owned())
}

/// A listener on `host:port` (port 0 picks a free one).
pub async fn bind(host: &str, port: u16) -> anyhow::Result<tokio::net::TcpListener> {
    let addr = format!("{host}:{port}");
    tokio::net::TcpListener::bind(&addr)
        .await
        .with_context(|| format!("binding {addr}"))
}

/// The process's stop (docs/operator.md, "Stopping, suspending, preempting"), watched from this
/// call on: cancelled at the first SIGTERM or Ctrl-C. The role then has `grace` to end on its
/// own (servers drain, agents return their episodes, a trainer checkpoints the last step it
/// trained); after that, or at a second signal, the process exits whatever it waits for.
pub fn stop_signal(grace: Option<Duration>) -> CancellationToken {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("a runtime with signals");
    let mut int = signal(SignalKind::interrupt()).expect("a runtime with signals");
    let stop = CancellationToken::new();
    let token = stop.clone();
    tokio::spawn(async move {
        tokio::select! { _ = term.recv() => {}, _ = int.recv() => {} }
        tracing::info!("stopping (SIGTERM or Ctrl-C)");
        token.cancel();
        let late = tokio::time::sleep(grace.unwrap_or(Duration::MAX));
        tokio::select! { _ = term.recv() => {}, _ = int.recv() => {}, () = late => {} }
        eprintln!("moult: still running {grace:?} after the stop, or stopped again: exiting now");
        std::process::exit(143);
    });
    stop
}

/// The stop of a role with `MOULT_STOP_SECONDS` of grace (the operator sets it a little under the
/// pod's `terminationGracePeriodSeconds`), else 20 s.
pub fn role_stop() -> anyhow::Result<CancellationToken> {
    let seconds = std::env::var("MOULT_STOP_SECONDS").map_or(Ok(20), |v| v.trim().parse());
    let seconds = seconds.context("MOULT_STOP_SECONDS must be a whole number of seconds")?;
    Ok(stop_signal(Some(Duration::from_secs(seconds))))
}

/// `moult` built without libtorch (`--no-default-features`: the agent pods' build) has the roles
/// that only move data; the others say so.
#[cfg(not(feature = "torch"))]
pub fn without_torch(command: &str) -> anyhow::Result<()> {
    anyhow::bail!(
        "`moult {command}` needs libtorch, and this moult was built without it (the agent-pod build, --no-default-features): use the runtime image's moult"
    )
}
