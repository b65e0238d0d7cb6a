//! `moult coordinator`: the coordinator of a cluster run, in its pod.

use std::path::PathBuf;

use moult_runtime::cluster::coordinator::{self, CoordinatorOptions};

#[derive(Debug, clap::Args)]
pub struct Args {
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

pub async fn run(args: Args) -> anyhow::Result<()> {
    let stop = super::role_stop()?.cancelled_owned();
    let opts = CoordinatorOptions {
        config: args.config,
        host: args.host,
        port: args.port,
        seed: args.seed,
        poll: std::time::Duration::from_secs(20),
        lease_time: args.lease_time,
    };
    Ok(coordinator::run(opts, stop).await?)
}
