//! `moult trainer`: the trainer of a cluster run, in its pod; resumes from the newest checkpoint.

use std::path::PathBuf;

#[derive(Debug, clap::Args)]
pub struct Args {
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

#[cfg(feature = "torch")]
pub async fn run(args: Args) -> anyhow::Result<()> {
    let stop = super::role_stop()?;
    use moult_runtime::cluster::trainer::{self, TrainerProcessOptions};
    use moult_runtime::config::read_manifest;
    let gpus = read_manifest::<moult_operator::api::RLRun>(&args.config)?
        .spec
        .trainer
        .gpus_per_node;
    let opts = TrainerProcessOptions {
        device: super::device(args.device.as_deref(), gpus > 0)?,
        config: args.config,
        metrics_addr: args.metrics_addr,
    };
    Ok(trainer::run(opts, stop).await?)
}
