//! What `moult run` shows on the terminal: one progress line per step, warnings, and a status line
//! under them that says what the run is waiting for (setting up, episodes, training, weight sync,
//! checkpoint) and for how long, so a slow step visibly lives. The full log goes to
//! `<out>/moult.log` (set up by the binary, docs/run.md "The console").
//!
//! On a terminal the status line is a spinner redrawn in place; elsewhere (a pipe, CI) nothing is
//! redrawn, and a phase that lasts long prints a "still ..." line every [`QUIET_NOTE_EVERY`].
//! Everything that writes to stderr while the spinner is drawn goes through [`Console::line`] or
//! a clone of the [`Console`] (a `Write`r), so lines never tear.

use std::borrow::Cow;
use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// Off a terminal, how often a phase that is still going says so.
pub const QUIET_NOTE_EVERY: Duration = Duration::from_secs(30);

/// The terminal of one run. Cheap to clone: clones share the status line.
#[derive(Clone, Debug)]
pub struct Console {
    bar: ProgressBar,
    /// Whether anything but warnings is shown at all (`--quiet` turns it off).
    show: bool,
    phase: Arc<Mutex<Phase>>,
}

#[derive(Debug)]
struct Phase {
    what: Cow<'static, str>,
    since: Instant,
    /// Off a terminal: how many "still ..." notes this phase printed.
    notes: u32,
}

impl Phase {
    fn new(what: Cow<'static, str>) -> Self {
        Phase {
            what,
            since: Instant::now(),
            notes: 0,
        }
    }
}

impl Console {
    /// A console for a run of `total` steps; `show: false` prints progress lines and the status
    /// line nowhere (warnings still go to stderr).
    pub fn new(total: u64, show: bool) -> Console {
        let target = if show {
            ProgressDrawTarget::stderr_with_hz(10)
        } else {
            ProgressDrawTarget::hidden()
        };
        let bar = ProgressBar::with_draw_target(Some(total), target);
        let style = ProgressStyle::with_template("{spinner} step {pos}/{len} · {msg}");
        bar.set_style(style.expect("the template is valid"));
        let phase = Arc::new(Mutex::new(Phase::new("setting up".into())));
        let console = Console { bar, show, phase };
        console.refresh();
        console
    }

    /// A console that shows nothing but warnings.
    pub fn hidden() -> Console {
        Console::new(0, false)
    }

    /// Whether the status line is drawn in place (stderr is a terminal).
    pub fn is_interactive(&self) -> bool {
        self.show && !self.bar.is_hidden()
    }

    /// The run is now doing `what` (e.g. "training"); the status line shows it with its age.
    pub fn phase(&self, what: impl Into<Cow<'static, str>>) {
        *self.phase.lock().expect("console lock") = Phase::new(what.into());
        self.refresh();
    }

    /// A new description of the current phase (e.g. a count that moved), keeping its age.
    pub fn detail(&self, what: impl Into<Cow<'static, str>>) {
        self.phase.lock().expect("console lock").what = what.into();
    }

    /// Steps done so far (the status line's position).
    pub fn set_step(&self, step: u64) {
        self.bar.set_position(step);
    }

    /// Redraws the status line (the age of the phase); off a terminal, prints a "still ..." note
    /// when the phase has lasted another [`QUIET_NOTE_EVERY`]. Called by [`Console::tick`].
    pub fn refresh(&self) {
        let mut p = self.phase.lock().expect("console lock");
        let (age, step) = (p.since.elapsed(), self.bar.position() + 1);
        let secs = age.as_secs_f64();
        if self.is_interactive() {
            self.bar.set_message(format!("{} ({secs:.0}s)", p.what));
            self.bar.tick();
        } else if self.show && age >= QUIET_NOTE_EVERY * (p.notes + 1) {
            p.notes += 1;
            eprintln!("moult run: step {step}: still {} ({secs:.0}s)", p.what);
        }
    }

    /// Keeps the status line alive until the returned task is aborted (or the console dropped).
    pub fn tick(&self) -> tokio::task::JoinHandle<()> {
        let console = self.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(200)).await;
                console.refresh();
            }
        })
    }

    /// A permanent line above the status line (a step's progress line, a note); nothing with
    /// `show: false`.
    pub fn line(&self, text: &str) {
        if self.show {
            self.write_stderr(format!("{text}\n").as_bytes());
        }
    }

    /// Writes to stderr with the status line lifted out of the way.
    fn write_stderr(&self, bytes: &[u8]) {
        // stderr is unbuffered: one `write_all` under its lock writes the whole text.
        let write = || {
            let _ = std::io::stderr().lock().write_all(bytes);
        };
        if self.is_interactive() {
            self.bar.suspend(write);
        } else {
            write();
        }
    }

    /// Takes the status line off the terminal (the final summary follows it).
    pub fn finish(&self) {
        self.bar.finish_and_clear();
    }
}

/// stderr for log lines while the console draws: a `tracing` layer writing through clones of
/// the console does not tear the status line.
impl Write for Console {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.write_stderr(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hidden_console_prints_no_progress_and_keeps_the_phase() {
        let console = Console::hidden();
        assert!(!console.is_interactive());
        console.phase("training");
        console.line("never shown");
        console.refresh();
        assert_eq!(console.phase.lock().unwrap().what, "training");
        assert_eq!(console.phase.lock().unwrap().notes, 0);
    }

    #[test]
    fn off_a_terminal_a_long_phase_notes_that_it_is_still_going() {
        // Tests run with stderr captured, never a terminal: the quiet notes apply.
        let console = Console::new(10, true);
        if console.is_interactive() {
            return; // run by hand on a terminal: the spinner draws instead
        }
        console.phase("training");
        console.refresh();
        assert_eq!(
            console.phase.lock().unwrap().notes,
            0,
            "too early for a note"
        );
        console.phase.lock().unwrap().since = Instant::now() - QUIET_NOTE_EVERY * 2;
        console.refresh();
        console.refresh();
        assert_eq!(
            console.phase.lock().unwrap().notes,
            2,
            "one note per period elapsed"
        );
    }
}
