//! `moult router`: the engine API in front of a pool of engines (session-affine routing,
//! failover, control calls fanned out).

use std::sync::Arc;

use anyhow::{bail, Context};
use moult_runtime::router::{policy, server, EnginePool, HealthOptions, Router};

#[derive(Debug, clap::Args)]
pub struct Args {
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

pub async fn run(args: Args) -> anyhow::Result<()> {
    let stop = super::role_stop()?.cancelled_owned();
    let name = &args.policy;
    let policy = policy::by_name(name).with_context(|| {
        format!("--policy must be consistent-hash or least-tokens; got `{name}`")
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
    let listener = super::bind(&args.host, args.port).await?;
    let (addr, engines) = (listener.local_addr()?, args.engines.len());
    println!("moult router listening on http://{addr} ({engines} engines)");
    Ok(server::serve(listener, router, stop).await?)
}
