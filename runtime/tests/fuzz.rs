//! The runtime's fuzz targets (docs/security.md, "Fuzzing"): property tests over the parsers and
//! bookkeeping that untrusted input reaches, each asserting an invariant rather than only "does
//! not panic". Stable Rust has no libFuzzer, so each target is a proptest strategy (seeded with the
//! shapes the unit tests use) and a property.
//!
//! `cargo test -p moult-runtime --test fuzz` runs every target briefly with fixed seeds (what CI
//! does). With `MOULT_FUZZ_SECONDS=N` each target instead runs for N seconds on fresh random seeds
//! (`scripts/fuzz.sh`). Either way the binary prints `target | executions | failures` and, for
//! each failure, the shrunk input and why. Names given as arguments select targets by substring.
//!
//! The binary has its own `main` (no libtest harness) so that it can set the run token before any
//! thread starts: the auth target checks the real middleware, which reads `MOULT_TOKEN` once.

mod fuzz {
    pub mod auth;
    pub mod chat;
    pub mod episodes;
    pub mod generate;
    pub mod npy;
    pub mod sampling;
    pub mod sse;
    pub mod streaming;
    pub mod weights;
}

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use proptest::strategy::Strategy;
use proptest::test_runner::{Config, RngAlgorithm, TestCaseResult, TestError, TestRng, TestRunner};

/// The run token of this process (the auth target derives the agent credential from it).
pub const RUN_TOKEN: &str = "fuzz-run-token";

/// How long, or how many cases, each target runs.
#[derive(Debug, Clone, Copy)]
pub enum Budget {
    /// `cases` cases from a fixed seed (reproducible: what `cargo test` runs).
    Brief { scale: u32 },
    /// Fresh random seeds until the time is up.
    Timed(Duration),
}

/// One target's row of the table.
#[derive(Debug)]
pub struct Row {
    pub target: &'static str,
    pub executions: u64,
    pub failures: Vec<String>,
}

/// The message and place of the last panic in a case (proptest reports only the message).
static LAST_PANIC: Mutex<Option<String>> = Mutex::new(None);

/// Clears [`IN_CASE`] when a case ends, by returning or by panicking.
struct InCase;

impl Drop for InCase {
    fn drop(&mut self) {
        IN_CASE.set(false);
    }
}

thread_local! {
    /// Whether this thread runs a case: its panics are failures that proptest reports; any
    /// other panic is printed as usual.
    static IN_CASE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `property` on values of `strategy` within `budget`; `cases` is the brief run's count (at
/// scale 1). A failing input is shrunk and reported; a timed run then goes on with a new seed.
pub fn drive<S: Strategy>(
    target: &'static str,
    budget: Budget,
    cases: u32,
    strategy: S,
    property: impl Fn(S::Value) -> TestCaseResult,
) -> Row {
    let executions = AtomicU64::new(0);
    let counted = |v: S::Value| {
        executions.fetch_add(1, Ordering::Relaxed);
        *LAST_PANIC.lock().unwrap() = None;
        IN_CASE.set(true);
        let _reset = InCase;
        property(v)
    };
    let config = |cases| Config {
        cases,
        failure_persistence: None,
        max_shrink_iters: 2048,
        max_global_rejects: u32::MAX,
        ..Config::default()
    };
    let mut failures = Vec::new();
    let mut record = |failure: Option<String>| {
        let Some(mut text) = failure else {
            return;
        };
        // Errors of libtorch carry a whole backtrace: the head says what failed.
        if text.len() > 4000 {
            let mut cut = 4000;
            while !text.is_char_boundary(cut) {
                cut -= 1;
            }
            text.truncate(cut);
            text.push_str(" [...]");
        }
        failures.push(text);
    };
    let describe = |result: Result<(), TestError<S::Value>>| {
        result.err().map(|e| {
            let place = LAST_PANIC.lock().unwrap().take().unwrap_or_default();
            format!("{e}\n    last panic: {place}")
        })
    };
    match budget {
        Budget::Brief { scale } => {
            let mut runner = TestRunner::new_with_rng(
                config(cases.saturating_mul(scale)),
                TestRng::deterministic_rng(RngAlgorithm::ChaCha),
            );
            record(describe(runner.run(&strategy, counted)));
        }
        Budget::Timed(time) => {
            let deadline = Instant::now() + time;
            while Instant::now() < deadline {
                // A fresh random seed per round; rounds are short so the deadline is kept.
                let mut runner = TestRunner::new(config(cases.max(16)));
                // A panic outside a case (a strategy's) ends the round, not the whole run.
                let round = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    runner.run(&strategy, counted)
                }));
                record(match round {
                    Ok(result) => describe(result),
                    Err(_) => Some("a strategy panicked (printed above)".into()),
                });
            }
        }
    }
    Row {
        target,
        executions: executions.into_inner(),
        failures,
    }
}

type Target = (&'static str, fn(Budget) -> Row);

const TARGETS: [Target; 10] = [
    ("generate_request", fuzz::generate::target),
    ("sampling", fuzz::sampling::target),
    ("routed_experts_npy", fuzz::npy::target),
    ("chat_segments", fuzz::chat::target),
    ("stream_stops_and_tools", fuzz::streaming::target),
    ("incremental_detok", fuzz::streaming::detok_target),
    ("sse_chunks", fuzz::sse::target),
    ("episodes_to_samples", fuzz::episodes::target),
    ("weight_stream", fuzz::weights::target),
    ("auth_paths", fuzz::auth::target),
];

fn main() {
    // Before any thread exists: the middleware and the weight stream read it once.
    std::env::set_var(moult_runtime::auth::TOKEN_ENV, RUN_TOKEN);
    std::env::remove_var(moult_runtime::auth::AGENT_TOKEN_ENV);
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if IN_CASE.get() {
            *LAST_PANIC.lock().unwrap() = Some(info.to_string());
        } else {
            default_hook(info);
        }
    }));
    let budget = match std::env::var("MOULT_FUZZ_SECONDS") {
        Ok(s) => Budget::Timed(Duration::from_secs_f64(
            s.trim()
                .parse()
                .expect("MOULT_FUZZ_SECONDS is a number of seconds"),
        )),
        Err(_) => Budget::Brief {
            scale: std::env::var("MOULT_FUZZ_SCALE")
                .ok()
                .and_then(|s| s.parse().ok())
                .unwrap_or(1),
        },
    };
    let filters: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let started = Instant::now();
    let mut rows = Vec::new();
    for (name, target) in TARGETS {
        if !filters.is_empty() && !filters.iter().any(|f| name.contains(f.as_str())) {
            continue;
        }
        let t = Instant::now();
        let row = target(budget);
        println!(
            "fuzz {name}: {} executions, {} failures, {:.1}s",
            row.executions,
            row.failures.len(),
            t.elapsed().as_secs_f64()
        );
        rows.push(row);
    }
    let _ = std::panic::take_hook();
    println!(
        "\n{:<24} | {:>10} | {:>8}",
        "target", "executions", "failures"
    );
    println!("{:-<24}-|-{:->10}-|-{:->8}", "", "", "");
    for r in &rows {
        println!(
            "{:<24} | {:>10} | {:>8}",
            r.target,
            r.executions,
            r.failures.len()
        );
    }
    let failed: Vec<&Row> = rows.iter().filter(|r| !r.failures.is_empty()).collect();
    for r in &failed {
        for f in &r.failures {
            println!("\nFAILED {}: {f}", r.target);
        }
    }
    println!(
        "\ntest result: {}. {} passed; {} failed; 0 ignored; 0 measured; {} filtered out; finished in {:.2}s",
        if failed.is_empty() { "ok" } else { "FAILED" },
        rows.len() - failed.len(),
        failed.len(),
        TARGETS.len() - rows.len(),
        started.elapsed().as_secs_f64()
    );
    if !failed.is_empty() {
        std::process::exit(1);
    }
}
