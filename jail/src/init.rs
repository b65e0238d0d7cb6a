//! `moult` as the first process of a container (docs/security.md, "Agent pods").
//!
//! In a container whose command is `moult`, `moult` is PID 1, and every process whose parent
//! dies is handed to it: agent code that double-forks or a tool that leaves children behind
//! would pile up as zombies, since nothing would wait for them, until the pod runs out of
//! process ids. So when it is PID 1 (or when `MOULT_INIT=1` asks for it elsewhere, which makes
//! it a child subreaper), `moult` does what tini does: it starts itself again with the same
//! arguments, forwards the signals it gets to that process, waits for every process handed to
//! it, and exits with its child's status. `MOULT_INIT=0` turns this off.

use std::process::Command;

use anyhow::Context;
use nix::sys::signal::{kill, Signal};
use nix::sys::wait::{waitpid, WaitStatus};
use nix::unistd::Pid;

/// The environment variable that asks for (`1`) or refuses (`0`) the supervising first process.
pub const INIT_ENV: &str = "MOULT_INIT";

/// The signals passed on to the supervised process (what a container runtime or a user sends).
const FORWARDED: [i32; 6] = [
    signal_hook::consts::SIGTERM,
    signal_hook::consts::SIGINT,
    signal_hook::consts::SIGHUP,
    signal_hook::consts::SIGQUIT,
    signal_hook::consts::SIGUSR1,
    signal_hook::consts::SIGUSR2,
];

/// Whether this process should supervise: PID 1 unless `MOULT_INIT=0`, or `MOULT_INIT=1`.
fn wanted() -> bool {
    match std::env::var(INIT_ENV).as_deref() {
        Ok("1") => true,
        Ok("0") => false,
        _ => std::process::id() == 1,
    }
}

/// Runs `moult` with this process's arguments under a supervisor when this process is a
/// container's PID 1 (see the module docs), returning the supervised process's exit code; `None`
/// when this process should do its work itself.
pub fn supervise_if_first() -> anyhow::Result<Option<i32>> {
    if !wanted() {
        return Ok(None);
    }
    if std::process::id() != 1 {
        // Orphans of the supervised process come to us rather than to the real PID 1.
        nix::sys::prctl::set_child_subreaper(true)
            .context("cannot become a child subreaper (MOULT_INIT=1)")?;
    }
    let exe = std::env::current_exe().context("cannot find the moult executable to supervise")?;
    // Handlers first, so that no signal sent between the start and the forwarding is lost.
    let mut signals = signal_hook::iterator::Signals::new(FORWARDED)
        .context("cannot install the signal handlers of the supervising moult")?;
    let child = Command::new(exe)
        .args(std::env::args_os().skip(1))
        .env(INIT_ENV, "0")
        .spawn()
        .context("cannot start the supervised moult")?;
    let child = Pid::from_raw(i32::try_from(child.id()).expect("process ids fit in i32"));
    std::thread::spawn(move || {
        for number in signals.forever() {
            if let Ok(signal) = Signal::try_from(number) {
                let _ = kill(child, signal);
            }
        }
    });
    loop {
        // Every child, the supervised one and whatever was handed to us.
        match waitpid(None::<Pid>, None) {
            Ok(WaitStatus::Exited(pid, code)) if pid == child => return Ok(Some(code)),
            Ok(WaitStatus::Signaled(pid, signal, _)) if pid == child => {
                return Ok(Some(128 + signal as i32))
            }
            Ok(_) | Err(nix::errno::Errno::EINTR) => {}
            Err(e) => return Err(e).context("waiting for the supervised moult"),
        }
    }
}
