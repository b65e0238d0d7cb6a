//! The `moult` subcommands, one module each: its arguments (`Args`) and what it does (`run`).
//! `main.rs` only parses and dispatches; what several subcommands share is here once: the
//! device flag, the shutdown signal, the default served model name, the log filter and the
//! local run config of `moult run` and `moult eval`.

pub mod agents;
pub mod chat;
pub mod coordinator;
pub mod engine;
pub mod engine_front;
pub mod eval;
pub mod export;
pub mod router;
pub mod run;
pub mod trainer;
pub mod trainer_rank;

use std::path::Path;

use anyhow::Context;
#[cfg(feature = "torch")]
use tch::Device;

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
    let manifest = config::read_manifest(path)?;
    let gpus = manifest.spec.trainer.gpus_per_node;
    let cfg = config::RunConfig::new(manifest, path.parent().unwrap_or(Path::new(".")))?;
    Ok((cfg, device(flag, gpus > 0)?))
}

/// The name a model folder is served under by default: the folder's name.
pub fn folder_name(dir: &Path) -> String {
    dir.file_name()
        .map_or("model".into(), |n| n.to_string_lossy().into_owned())
}

/// A listener on `host:port` (port 0 picks a free one).
pub async fn bind(host: &str, port: u16) -> anyhow::Result<tokio::net::TcpListener> {
    let addr = format!("{host}:{port}");
    tokio::net::TcpListener::bind(&addr)
        .await
        .with_context(|| format!("binding {addr}"))
}

/// Ctrl-C or SIGTERM: the servers drain their connections and return.
pub async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let term = async {
        match signal(SignalKind::terminate()) {
            Ok(mut s) => _ = s.recv().await,
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! { _ = tokio::signal::ctrl_c() => {}, () = term => {} }
    tracing::info!("shutting down: draining connections");
}

/// `moult` built without libtorch (`--no-default-features`: the agent pods' build) has the roles
/// that only move data; the others say so.
#[cfg(not(feature = "torch"))]
pub fn without_torch(command: &str) -> anyhow::Result<()> {
    anyhow::bail!(
        "`moult {command}` needs libtorch, and this moult was built without it (the agent-pod build, --no-default-features): use the runtime image's moult"
    )
}
