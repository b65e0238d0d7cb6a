//! One command in a fresh jail of its own, for `moult.sandbox.run` in the Python SDK
//! (docs/agents.md, "Running model-written code"): code a model wrote, run by an Env or a
//! ChatAgent, for example as a tool.
//!
//! The SDK starts `moult PROGRAM ARGS...` with [`ONCE_ENV`] holding a [`Request`], and `moult`,
//! first thing in `main` ([`crate::run_if_asked`]), runs the program in a jail whose only
//! writable folder is the request's `dir` (its working directory), with no network at all and the
//! request's limits, its stdin this process's, its stdout and stderr into the files the request
//! names, for at most `timeout` seconds. Then it prints one JSON line, a [`Report`], and exits 0;
//! where it could not run the program, it exits [`SETUP_FAILED`] and says why on stderr. Whatever
//! the program started dies with it, as in an episode's jail.

use std::io::{Read, Seek, SeekFrom};
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::sandbox::{Exit, ProcessGroup};
use crate::{Jail, Limits, SETUP_FAILED};

/// The environment variable that carries a [`Request`] to `moult`.
pub const ONCE_ENV: &str = "MOULT_SANDBOX_RUN";

/// The end of the program's stderr that [`Limits::hit_field`] reads.
const STDERR_TAIL: u64 = 4096;

/// What to run the program with (its arguments are `moult`'s).
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Request {
    /// The program's environment, exactly.
    pub env: Vec<(String, String)>,
    pub limits: Limits,
    /// The folder the program may write.
    pub dir: PathBuf,
    pub stdout: PathBuf,
    pub stderr: PathBuf,
    /// Seconds of wall clock before the jail is killed.
    pub timeout: f64,
}

/// How the program ended: `exit` is `None` when it ran out of time.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Report {
    pub exit: Option<Exit>,
    pub timed_out: bool,
    /// The limit that ended it (`limits.cpuSeconds = 10`), as [`Limits::hit_field`] reads it.
    pub limit: Option<String>,
}

/// When this process was started by `moult.sandbox.run` ([`ONCE_ENV`] is set): runs the program
/// and exits. Otherwise returns.
pub(crate) fn run_if_asked() {
    let Some(request) = std::env::var_os(ONCE_ENV) else {
        return;
    };
    let fail = |why: String| -> ! {
        eprintln!("moult sandbox run: {why}");
        std::process::exit(SETUP_FAILED)
    };
    let request: Request = serde_json::from_str(&request.to_string_lossy())
        .unwrap_or_else(|e| fail(format!("{ONCE_ENV} holds no request: {e}")));
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let Some((program, args)) = argv.split_first() else {
        fail("no program to run".into())
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build();
    let runtime = runtime.unwrap_or_else(|e| fail(format!("cannot start: {e}")));
    match runtime.block_on(run(request, program, args, Stdio::inherit(), true)) {
        Ok(report) => {
            println!(
                "{}",
                serde_json::to_string(&report).expect("a report serialises")
            );
            std::process::exit(0)
        }
        Err(e) => fail(e.to_string()),
    }
}

/// Runs `program` as `request` says, in a jail of its own when `jailed` (else in a process group
/// of its own, whose limits are the caller's: the timeout alone is applied), and reports how it
/// ended. Its working folder is this process's.
pub async fn run(
    request: Request,
    program: &str,
    args: &[String],
    stdin: Stdio,
    jailed: bool,
) -> std::io::Result<Report> {
    let jail = Jail {
        limits: request.limits,
        writable: vec![request.dir.clone()],
        ..Jail::default()
    };
    let stdout = std::fs::File::create(&request.stdout)?;
    let mut stderr = (std::fs::OpenOptions::new().read(true).write(true))
        .create(true)
        .truncate(true)
        .open(&request.stderr)?;
    let stdio = [stdin, stdout.into(), stderr.try_clone()?.into()];
    let jail = jailed.then_some(&jail);
    let mut group = ProcessGroup::spawn(program, args, request.env, stdio, jail)?;
    let timeout = Duration::try_from_secs_f64(request.timeout).unwrap_or(Duration::ZERO);
    let exit = match tokio::time::timeout(timeout, group.child.wait()).await {
        Ok(status) => Some(Exit::of(status?)),
        Err(_) => None,
    };
    // The jail and all it holds, whether or not the program has ended.
    drop(group);
    let mut tail = Vec::new();
    let len = stderr.seek(SeekFrom::End(0))?;
    stderr.seek(SeekFrom::Start(len.saturating_sub(STDERR_TAIL)))?;
    stderr.read_to_end(&mut tail)?;
    let tail = String::from_utf8_lossy(&tail);
    let limit = exit.and_then(|e| request.limits.hit_field(e.signal(), &tail));
    Ok(Report {
        exit,
        timed_out: exit.is_none(),
        limit: limit.map(|(field, value)| format!("limits.{field} = {value}")),
    })
}
