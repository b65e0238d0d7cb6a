//! `moult export`: write a checkpoint's policy as a model folder engines serve.

use std::path::PathBuf;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// A checkpoint folder (step-NNNNNN), or a run's checkpoints folder (its newest checkpoint).
    checkpoint: PathBuf,
    /// The model folder to write (it must not exist yet).
    out: PathBuf,
}

#[cfg(feature = "torch")]
pub fn run(args: Args) -> anyhow::Result<()> {
    let from = moult_runtime::learner::checkpoint::export(&args.checkpoint, &args.out)?;
    let (from, out) = (from.display(), args.out.display());
    eprintln!("moult export: {from} -> {out} (serve it with `moult engine --model {out}`)");
    Ok(())
}
