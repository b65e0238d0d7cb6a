//! `moult eval`: evaluate a policy on an RLRun manifest's held-out tasks (spec.eval) as a run
//! does during training; the result goes to stdout as JSON.

use std::path::PathBuf;

#[derive(Debug, clap::Args)]
pub struct Args {
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

#[cfg(feature = "torch")]
pub async fn run(args: Args) -> anyhow::Result<()> {
    use anyhow::Context;
    use moult_runtime::local::{self, RunOptions};
    use moult_runtime::records::console::Console;
    let (cfg, device) = super::local_config(&args.manifest, args.device.as_deref())?;
    let console = Console::new(0, !args.quiet);
    let scratch = std::env::temp_dir().join(format!("moult-eval-{}", std::process::id()));
    let result = local::evaluate_checkpoint(
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
