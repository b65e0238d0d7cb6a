//! `moult pool`: an EnginePool on this machine (docs/lora.md, "Two runs on one pool"): its
//! engines, until Ctrl-C. `moult run` of a run whose `spec.engines.poolRef.name` names the pool
//! generates on them and uploads its adapter to them.

use std::path::PathBuf;

use anyhow::Context;
use moult_operator::api::EnginePool;
use moult_runtime::engine::pool::{LocalPool, PoolLimits};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// An EnginePool manifest (YAML): its model folder (`spec.model.path`, beside the manifest),
    /// `spec.engines.replicas`, `spec.maxAdapters`, `spec.maxRank`.
    manifest: PathBuf,
    /// libtorch threads of each engine.
    #[arg(long, default_value_t = 1)]
    threads: usize,
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    let stop = super::stop_signal(None);
    let pool: EnginePool = moult_runtime::config::read_manifest(&args.manifest)?;
    let name = (pool.metadata.name.clone())
        .context("metadata.name: the pool's name, which runs' spec.engines.poolRef.name give")?;
    let dir = args.manifest.parent().unwrap_or(std::path::Path::new(""));
    let limits = PoolLimits::from(&pool.spec);
    let replicas = pool.spec.engines.replicas.max(1) as usize;
    let exe = std::env::current_exe()?;
    let model = dir.join(&pool.spec.model.path);
    let (mut engines, local) = LocalPool::start(&exe, &model, replicas, limits, args.threads)?;
    let file = local.write(&name)?;
    println!(
        "moult pool {name}: {replicas} engines at {}; runs whose spec.engines.poolRef.name is {name} generate there (Ctrl-C stops)",
        local.engines.join(", ")
    );
    stop.cancelled().await;
    let _ = std::fs::remove_file(file);
    for engine in &mut engines {
        let _ = engine.kill();
    }
    Ok(())
}
