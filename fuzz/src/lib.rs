//! moult's coverage-guided fuzz targets (docs/security.md, "Fuzzing"). Each target takes the raw
//! bytes an attacker controls (an episode a compromised agent pod posts, an image in a chat
//! message, a request body, a manifest, a task file, a weight stream, a sandbox's answers), runs
//! them through the same code a run does, and asserts an invariant: a panic, an abort or a
//! broken invariant is a finding.
//!
//! - `scripts/fuzz.sh SECONDS [TARGET...]` runs each target under libFuzzer (`cargo fuzz`,
//!   nightly Rust) from its seed corpus in `fuzz/corpus/<target>/`, and prints the table of
//!   docs/security.md.
//! - `cargo test -p moult-fuzz` replays every corpus file through its target on stable Rust
//!   (what CI runs), so a fixed finding stays fixed once its input is in the corpus.

use std::path::{Path, PathBuf};
use std::process::Command;

mod data;
pub mod episode;
mod requests;
mod sandbox;
mod spec;
mod vision;
mod weights;

/// A target: its name (its corpus folder) and its function.
pub type Target = (&'static str, fn(&[u8]));

/// Every target, in the order of docs/security.md's table.
pub const TARGETS: [Target; 15] = [
    ("episode_forward", episode::forward),
    ("episode_json", episode::json),
    ("image_preprocess", vision::preprocess),
    ("image_data_url", vision::data_url),
    ("chat_template", requests::chat_template),
    ("tool_calls", requests::tool_calls),
    ("openai_request", requests::openai),
    ("anthropic_request", requests::anthropic),
    ("generate_request", requests::generate),
    ("sse_stream", requests::sse),
    ("routed_experts_npy", data::routed_experts),
    ("tasks_dataset", data::tasks),
    ("rlrun_manifest", spec::manifest),
    ("weight_stream", weights::stream),
    ("sandbox_answers", sandbox::client),
];

/// The target called `name`.
pub fn target(name: &str) -> Option<fn(&[u8])> {
    TARGETS.iter().find(|(n, _)| *n == name).map(|(_, f)| *f)
}

/// The repository's root (the fixtures and the tiny-model script live there).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The folder `tests/python/<script>` writes, made once per content of the script (the Python
/// of the project's virtualenv: `MOULT_PYTHON`, else `.venv/bin/python`) and kept in the
/// system's temporary folder.
fn made_by(script: &str) -> PathBuf {
    let script = repo_root().join("tests/python").join(script);
    let bytes = std::fs::read(&script).expect("read the model script");
    let digest = bytes.iter().fold(0xcbf29ce484222325u64, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x100000001b3)
    });
    let dir = std::env::temp_dir().join(format!("moult-fuzz-models-{digest:016x}"));
    if dir.join("done").exists() {
        return dir;
    }
    let python = std::env::var_os("MOULT_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join(".venv/bin/python"));
    let staging = dir.with_extension(format!("staging-{}", std::process::id()));
    let status = Command::new(&python)
        .arg(&script)
        .arg(&staging)
        .stdout(std::process::Stdio::null())
        .status()
        .unwrap_or_else(|e| {
            panic!(
                "cannot run {} ({e}): source scripts/env.sh",
                python.display()
            )
        });
    assert!(status.success(), "{} failed", script.display());
    std::fs::write(staging.join("done"), b"").expect("mark the models made");
    if std::fs::rename(&staging, &dir).is_err() {
        let _ = std::fs::remove_dir_all(&staging);
    }
    dir
}

/// A fixture of `tests/fixtures/`.
fn fixture(name: &str) -> String {
    let path = repo_root().join("tests/fixtures").join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// `data` as text, when it is UTF-8.
fn text(data: &[u8]) -> Option<&str> {
    std::str::from_utf8(data).ok()
}

/// Runs `f`, which catches some panics itself (`catch_unwind` around a dependency that panics on
/// bad input), with a silent panic hook: libFuzzer's hook would abort on the caught panic before
/// `f` could turn it into an error. A panic that `f` does not catch still fails the target: it
/// unwinds into libFuzzer's driver, which aborts.
fn panics_caught_inside<T>(f: impl FnOnce() -> T) -> T {
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    std::panic::set_hook(hook);
    out.unwrap_or_else(|panic| std::panic::resume_unwind(panic))
}

/// One current-thread runtime per thread, for the targets that drive async code.
fn block_on<F: std::future::Future>(f: F) -> F::Output {
    thread_local! {
        static RT: tokio::runtime::Runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a tokio runtime");
    }
    RT.with(|rt| rt.block_on(f))
}
