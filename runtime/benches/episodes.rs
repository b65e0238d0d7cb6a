//! The cost of a fresh jail per episode (docs/security.md#episodes): how long an episode's
//! program takes to start, in a jail of its own (`agent.isolation: Episode`) and in a process
//! group only (`Process`), measured in one invocation as a ratio (this machine is noisy; compare
//! within a run, never against a fixed number). Two programs: `true` (the jail's own cost) and
//! the main recipe's Python Env (`examples/successor/env.py` under moult's runner, started and
//! reset to its first observation, as the agent pool starts every episode's env).
//!
//! `cargo bench -p moult-runtime --bench episodes` (after `source scripts/env.sh`; `MOULT_PYTHON`
//! names the Python, default `python3`). Documented in docs/benchmarks.md.

use std::time::{Duration, Instant};

use moult_jail::program::Program;
use moult_jail::Jail;
use moult_runtime::agents::env::Env;
use moult_runtime::agents::process::{AgentCommand, ExternalEnv};
use serde_json::json;

const STARTS: usize = 20;

/// The median of `STARTS` runs of `start`, after one to warm the caches.
async fn median<F: std::future::Future<Output = ()>>(mut start: impl FnMut() -> F) -> Duration {
    start().await;
    let mut times = Vec::new();
    for _ in 0..STARTS {
        let t = Instant::now();
        start().await;
        times.push(t.elapsed());
    }
    times.sort();
    times[STARTS / 2]
}

/// `true` to its end.
async fn run_true(jail: Option<&Jail>) {
    let path = std::env::var("PATH").unwrap_or_default();
    let env = vec![("PATH".to_string(), path)];
    let mut p = Program::start(None, "true", &[], env, jail).await.unwrap();
    assert!(p.wait().await.unwrap().success());
}

/// The successor env started and reset to its first observation.
async fn first_observation(cmd: &AgentCommand, jail: Option<&Jail>) {
    let mut env = ExternalEnv::spawn(cmd, jail.cloned()).await.unwrap();
    env.reset(&json!({"numbers": [3, 7, 1]})).await.unwrap();
}

fn main() {
    // The jails this benchmark makes start this binary.
    moult_jail::run_if_asked();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let python = std::env::var("MOULT_PYTHON").unwrap_or_else(|_| "python3".into());
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let env_py = root.join("examples/successor/env.py").display().to_string();
    let cmd = AgentCommand::python(&python, &env_py).unwrap();
    let jail = Jail::default();
    runtime.block_on(async {
        if let Err(why) = jail.probe(None) {
            eprintln!("episodes: no jail can be made here: {why}");
            std::process::exit(1);
        }
        println!("episode start-up, median of {STARTS} (ms)\n");
        println!("| program | process group | jail | jail / process group |");
        println!("| --- | ---: | ---: | ---: |");
        let t = median(|| run_true(None)).await;
        let j = median(|| run_true(Some(&jail))).await;
        row("`true`, started to ended", t, j);
        let t = median(|| first_observation(&cmd, None)).await;
        let j = median(|| first_observation(&cmd, Some(&jail))).await;
        row("successor env, started to its first observation", t, j);
    });
}

fn row(what: &str, process: Duration, jail: Duration) {
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let ratio = jail.as_secs_f64() / process.as_secs_f64();
    println!(
        "| {what} | {:.1} | {:.1} | {ratio:.2}x |",
        ms(process),
        ms(jail)
    );
}
