//! `moult run`: RL from an RLRun manifest on this machine, with its progress on the console and
//! its full log in `<out>/moult.log`.

use std::path::PathBuf;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The RLRun manifest (the same YAML `kubectl apply` takes); relative paths in it are
    /// relative to its folder.
    manifest: PathBuf,
    /// Where metrics, the reward plot, the summary and checkpoints go [default: runs/<name>].
    #[arg(long)]
    out: Option<PathBuf>,
    /// Synchronous RL, for comparison: generation waits for training (staleness 0) and weight
    /// updates wait for running requests (no partial rollout).
    #[arg(long)]
    sync: bool,
    /// cpu, cuda or cuda:N [default: cuda if the manifest's trainer has GPUs and one is here,
    /// else cpu].
    #[arg(long)]
    device: Option<String>,
    /// Fixes the task order and libtorch's generator.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Train this many steps in all instead of the manifest's spec.totalSteps.
    #[arg(long)]
    steps: Option<u64>,
    /// Checkpoint every N steps instead of the manifest's spec.checkpoint.intervalSteps.
    #[arg(long)]
    checkpoint_every: Option<u64>,
    /// No progress line per step and no status line (warnings still show).
    #[arg(long)]
    quiet: bool,
    /// Write every trained batch (each episode's tokens, loss mask, logprobs, versions and
    /// reward) to <out>/rollouts/step-NNNNNN.json.
    #[arg(long)]
    dump_rollouts: bool,
    /// Train on the batches a run dumped (--dump-rollouts) in this folder, in order, instead of
    /// generating: no engines, no agents. Give it a new --out.
    #[arg(long, value_name = "DIR", conflicts_with = "dump_rollouts")]
    replay: Option<PathBuf>,
}

#[cfg(feature = "torch")]
pub async fn run(args: Args, verbose: bool) -> anyhow::Result<()> {
    // Ctrl-C stops at the next step (with a checkpoint of the last one); a second exits at once.
    let stop = super::stop_signal(None);
    use anyhow::{ensure, Context};
    use moult_runtime::local::{self, RunOptions};
    use moult_runtime::records::console::Console;
    use tch::Device;
    let (mut cfg, device) = super::local_config(&args.manifest, args.device.as_deref())?;
    if let Some(steps) = args.steps {
        ensure!(steps > 0, "--steps must be at least 1");
        cfg.total_steps = steps;
        cfg.trainer.schedule.total_steps = steps;
    }
    if let Some(every) = args.checkpoint_every {
        ensure!(every > 0, "--checkpoint-every must be at least 1");
        cfg.checkpoint_every = Some(every);
    }
    if args.sync {
        cfg = cfg.synchronous();
    }
    tch::manual_seed(args.seed as i64);
    let out = (args.out).unwrap_or_else(|| PathBuf::from("runs").join(&cfg.name));
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    let on = match device {
        Device::Cpu => "CPU".to_string(),
        other => format!("{other:?}"),
    };
    let mode = if args.sync {
        "synchronous"
    } else {
        "asynchronous"
    };
    let (name, steps, tasks, engines) = (&cfg.name, cfg.total_steps, cfg.tasks.len(), cfg.engines);
    let dir = out.display();
    eprintln!("moult run: {name} ({steps} steps, {tasks} tasks, {engines} engine(s), {on}, {mode} mode) -> {dir}");
    let log = out.join("moult.log");
    let console = Console::new(cfg.total_steps, !args.quiet);
    init_logging(&log, console.clone(), verbose)?;
    let summary = local::run(
        cfg,
        RunOptions {
            out: out.clone(),
            device,
            seed: args.seed,
            console: console.clone(),
            dump_rollouts: args.dump_rollouts,
            replay: args.replay,
        },
        stop,
    )
    .await;
    console.finish();
    let summary = summary.inspect_err(|_| {
        eprintln!("moult run: failed; the full log is {}", log.display());
    })?;
    let reward = |r: Option<f64>| r.map_or("-".into(), |r| format!("{r:.3}"));
    let s = &summary;
    let how = if s.interrupted { "stopped" } else { "finished" };
    let (name, step, total, version) = (&s.name, s.steps, s.total_steps, s.policy_version);
    let (seconds, from, to) = (s.seconds, reward(s.first_reward), reward(s.final_reward));
    eprintln!("moult run: {name} {how} at step {step}/{total} (version {version}) after {seconds:.0}s: reward {from} -> {to} (mean of the last 5 steps)");
    if let (Some(first), Some(last)) = (&summary.first_eval, &summary.last_eval) {
        eprintln!(
            "  eval (held-out tasks): reward {:.3} at step {} -> {:.3} at step {}, pass@{} {:.3} -> {:.3} ({}/eval.jsonl)",
            first.eval_reward_mean,
            first.step,
            last.eval_reward_mean,
            last.step,
            last.eval_k,
            first.eval_pass_at_k,
            last.eval_pass_at_k,
            out.display(),
        );
    }
    eprintln!(
        "  engines busy {:.0}% of the time (paused {:.1}s for weight sync), trainer busy {:.0}%",
        100.0 * summary.engine_busy_fraction,
        summary.engine_paused_seconds,
        100.0 * summary.trainer_busy_fraction,
    );
    eprintln!(
        "  metrics {0}/metrics.jsonl, plot {0}/reward.svg, summary {0}/summary.json, log {0}/moult.log{1}",
        out.display(),
        summary
            .last_checkpoint
            .as_ref()
            .map_or(String::new(), |c| format!(", checkpoint {}", c.display()))
    );
    Ok(())
}

/// `moult run`'s log: all of it to `file`; to the console (through the status line, by clones of
/// `console`) warnings only, unless `verbose` or RUST_LOG asks for more.
#[cfg(feature = "torch")]
fn init_logging(
    file: &std::path::Path,
    console: moult_runtime::records::console::Console,
    verbose: bool,
) -> anyhow::Result<()> {
    use anyhow::Context;
    use tracing_subscriber::{fmt, prelude::*};
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(file)
        .with_context(|| format!("opening the log {}", file.display()))?;
    // Not loud means no RUST_LOG: the console shows warnings only.
    let loud = verbose || std::env::var_os("RUST_LOG").is_some();
    let on_console = super::log_filter(if loud { "info" } else { "warn" });
    tracing_subscriber::registry()
        .with(
            fmt::layer()
                .with_writer(std::sync::Mutex::new(log))
                .with_ansi(false)
                .with_filter(super::log_filter("info")),
        )
        .with(
            fmt::layer()
                .with_writer(move || console.clone())
                .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
                .with_filter(on_console),
        )
        .init();
    Ok(())
}
