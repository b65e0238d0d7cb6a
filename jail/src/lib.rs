//! How moult keeps the processes of untrusted code: a fresh jail for every agent episode
//! (docs/security.md, "Episodes"), agent programs with a cleared environment, in process groups
//! of their own or in an agent pod's sandbox container ([`program`], [`sandbox`]), and `moult`
//! as a container's first process ([`init`]).
//!
//! Agent code is untrusted: a program written by a model in training may loop, fork, fill the
//! disk, probe the network or leave a daemon behind. [`Jail::wrap`] turns a command line into one
//! that runs it in a jail of its own, made by [`maker`]: `moult-jail` (this crate's small binary,
//! built and installed beside `moult`), or `moult` itself where it is alone (an agent image gets
//! only `moult`). Either, started with `MOULT_JAIL` set ([`run_if_asked`]), creates new user,
//! mount, PID, network, IPC and UTS namespaces, and then
//!
//! - the whole filesystem is read-only, with a fresh, size-limited tmpfs over `/tmp` (and
//!   `$TMPDIR`, and `/dev/shm`): the episode's scratch, gone with the jail. What the command
//!   needs from under `/tmp` (its working directory, the files and folders its arguments and
//!   `PYTHONPATH` name, moult's Python package) is put back read-only, and the folders the
//!   caller names writable (the episode's task and result files);
//! - `/proc` is the jail's own: it shows only the jail's processes;
//! - the network is a loopback interface of its own: nothing is reachable but the ports the
//!   caller relays ([`Jail::ports`]), each forwarded to the same port on the caller's 127.0.0.1
//!   through a Unix socket;
//! - the command runs as the jail's process 2 under a reaper (process 1): when the command ends,
//!   process 1 exits and the kernel kills everything left in the jail, daemons included; killing
//!   the jail's outer process (the episode's timeout) does the same;
//! - the command and all it starts get the [`Limits`] as resource limits: CPU time, address
//!   space, processes, file size and open files. [`Limits::hit`] names the one that ended a
//!   program when its exit says so.
//!
//! What this needs of the kernel (unprivileged user namespaces, Linux 5.12 or newer) and of a
//! container is in docs/security.md; where it is missing the jail's process exits with status
//! [`SETUP_FAILED`] and says why on stderr.

pub mod init;
mod inside;
pub mod once;
pub mod program;
pub mod sandbox;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};
use tokio::io::copy_bidirectional;
use tokio::net::{TcpStream, UnixListener};
use tokio::task::JoinHandle;

pub use inside::run_if_asked;

/// The environment variable that carries a jail's plan to the `moult` that makes it.
pub const JAIL_ENV: &str = "MOULT_JAIL";

/// Names the binary that makes jails, overriding where [`maker`] looks.
pub const MAKER_ENV: &str = "MOULT_JAIL_BIN";

/// The binary that makes jails: [`MAKER_ENV`]'s, else `moult-jail` beside this process's own
/// binary (or beside cargo's `deps/` folder, for tests and benchmarks), else this binary, which
/// makes them as well but, linked to libtorch, takes ~0.4 s to start where `moult-jail` takes a
/// millisecond (docs/benchmarks.md, "Episodes").
pub fn maker() -> std::io::Result<PathBuf> {
    if let Some(named) = std::env::var_os(MAKER_ENV) {
        return Ok(named.into());
    }
    let exe = std::env::current_exe()?;
    let dir = exe.parent().unwrap_or(Path::new("/"));
    let cargo = dir.parent().filter(|_| dir.ends_with("deps"));
    let beside = [Some(dir), cargo].into_iter().flatten();
    let found = beside.map(|d| d.join("moult-jail")).find(|p| p.is_file());
    Ok(found.unwrap_or(exe))
}

/// What a jail says on stderr when the kernel killed one of its processes because all of them
/// together reached the memory limit (its memory cgroup, [`cgroups`]).
const OUT_OF_MEMORY: &str = "moult jail: out of memory";

/// The exit status of a jail that could not be made (its stderr says why).
pub const SETUP_FAILED: i32 = 125;

/// Resource limits of everything an episode's program starts (`agent.limits`, docs/agents.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Limits {
    /// CPU seconds of each process (`RLIMIT_CPU`; SIGXCPU, then SIGKILL a second later).
    pub cpu_seconds: u64,
    /// Address space of each process, in bytes (`RLIMIT_AS`; allocations past it fail).
    pub memory_bytes: u64,
    /// Processes and threads in the jail (`RLIMIT_NPROC` in the jail's user namespace).
    pub processes: u64,
    /// Largest file a process may write, in bytes (`RLIMIT_FSIZE`).
    pub file_size_bytes: u64,
    /// Size of each scratch tmpfs (`/tmp`, `/dev/shm`), in bytes.
    pub scratch_bytes: u64,
    /// Open files of each process (`RLIMIT_NOFILE`).
    pub open_files: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            cpu_seconds: 600,
            memory_bytes: 8 << 30,
            processes: 512,
            file_size_bytes: 1 << 30,
            scratch_bytes: 1 << 30,
            open_files: 4096,
        }
    }
}

impl Limits {
    /// The limit a program's end points to, named as the manifest's field: `signal` is the signal
    /// that killed it, `stderr` the end of what it wrote. `None` when nothing points to a limit.
    pub fn hit(&self, signal: Option<i32>, stderr: &str) -> Option<String> {
        let (field, value) = self.hit_field(signal, stderr)?;
        Some(format!("agent.limits.{field} = {value}"))
    }

    /// [`Limits::hit`] as the limit's field name (`cpuSeconds`) and value (`600`).
    pub fn hit_field(&self, signal: Option<i32>, stderr: &str) -> Option<(&'static str, String)> {
        Some(match signal {
            Some(libc::SIGXCPU) => ("cpuSeconds", self.cpu_seconds.to_string()),
            Some(libc::SIGXFSZ) => ("fileSize", bytes(self.file_size_bytes)),
            _ if stderr.contains("MemoryError")
                || stderr.contains("Cannot allocate memory")
                || stderr.contains(OUT_OF_MEMORY) =>
            {
                ("memory", bytes(self.memory_bytes))
            }
            _ if stderr.contains("File too large") => ("fileSize", bytes(self.file_size_bytes)),
            _ if stderr.contains("No space left on device") => {
                ("scratch", bytes(self.scratch_bytes))
            }
            _ if stderr.contains("Resource temporarily unavailable") => {
                ("processes", self.processes.to_string())
            }
            _ => return None,
        })
    }
}

/// `n` bytes as the largest binary unit that divides it (`512Mi`, `1Gi`).
fn bytes(n: u64) -> String {
    let units = [(40, "Ti"), (30, "Gi"), (20, "Mi"), (10, "Ki")];
    match units
        .iter()
        .find(|(shift, _)| n != 0 && n % (1 << shift) == 0)
    {
        Some((shift, unit)) => format!("{}{unit}", n >> shift),
        None => n.to_string(),
    }
}

/// What a jail holds besides the command: its limits, the folders it may write, the extra ones
/// it may read from under `/tmp`, and the ports of the caller's 127.0.0.1 it may reach.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Jail {
    pub limits: Limits,
    /// Folders the program may write (bound at their own paths).
    #[serde(default)]
    pub writable: Vec<PathBuf>,
    /// Folders or files the program may read although they are under a scratch path.
    #[serde(default)]
    pub readable: Vec<PathBuf>,
    /// Ports of 127.0.0.1 the program may connect to (relayed to the caller's 127.0.0.1).
    #[serde(default)]
    pub ports: Vec<u16>,
}

/// The plan `moult` reads from [`JAIL_ENV`] to make a jail.
#[derive(Debug, Serialize, Deserialize)]
struct Plan {
    limits: Limits,
    writable: Vec<PathBuf>,
    readable: Vec<PathBuf>,
    scratch: Vec<PathBuf>,
    /// Each port, and the Unix socket of the caller's relay to it.
    relays: Vec<(u16, PathBuf)>,
    cwd: PathBuf,
    /// The jail's own cgroups, for a jail made by root (see [`cgroups`]).
    cgroups: Vec<PathBuf>,
    /// The program's own values of the variables this binary needs to start (its libraries'
    /// folder), which the jail's `moult` gets as this process has them.
    restore: Vec<(String, Option<String>)>,
}

/// What this binary needs of its environment to start (a build linked to libtorch).
const LOADER_VARS: [&str; 1] = ["LD_LIBRARY_PATH"];

/// A jailed command line, and what must live as long as the program: the relays of its ports
/// and their folder (stopped and removed when this is dropped).
#[derive(Debug)]
pub struct Wrapped {
    pub program: PathBuf,
    pub args: Vec<String>,
    pub env: Vec<(String, String)>,
    pub guard: Guard,
}

/// The relays of a jail's ports and their sockets' folder, stopped and removed on drop.
#[derive(Debug)]
pub struct Guard {
    dir: PathBuf,
    relays: Vec<JoinHandle<()>>,
    cgroups: Vec<PathBuf>,
}

impl Drop for Guard {
    fn drop(&mut self) {
        self.relays.iter().for_each(JoinHandle::abort);
        let _ = std::fs::remove_dir_all(&self.dir);
        let mut cgroups = std::mem::take(&mut self.cgroups);
        if !cgroups.is_empty() {
            // Removable once the killed jail's last process is gone.
            std::thread::spawn(move || {
                for _ in 0..100 {
                    cgroups.retain(|c| std::fs::remove_dir(c).is_err() && c.exists());
                    if cgroups.is_empty() {
                        return;
                    }
                    std::thread::sleep(std::time::Duration::from_millis(50));
                }
            });
        }
    }
}

/// The cgroups a jail made by root gets of its own, named `name`, in each cgroup v1 controller
/// that is mounted and writable here: `pids` (`RLIMIT_NPROC` binds no process of root's, so a
/// root jail's processes are counted here instead) and `memory` (the memory of all the jail's
/// processes together, where `RLIMIT_AS` bounds each one's address space). None for other users,
/// or where there are none (docs/security.md#episodes says what that leaves).
fn cgroups(name: &str) -> Vec<PathBuf> {
    static PARENTS: std::sync::OnceLock<Vec<PathBuf>> = std::sync::OnceLock::new();
    let parents = PARENTS.get_or_init(cgroup_parents);
    parents.iter().map(|parent| parent.join(name)).collect()
}

/// This process's own cgroups that a jail's may be made in (see [`cgroups`]), found once per
/// process, when the empty cgroups of processes that ended before their guards could remove
/// them are swept too.
fn cgroup_parents() -> Vec<PathBuf> {
    if !nix::unistd::getuid().is_root() {
        return Vec::new();
    }
    let own = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    let mut parents = Vec::new();
    for controller in ["pids", "memory"] {
        let Some(own) = (own.lines()).find_map(|l| {
            l.split_once(&format!(":{controller}:"))
                .map(|(_, p)| p.to_string())
        }) else {
            continue;
        };
        let parent = Path::new("/sys/fs/cgroup")
            .join(controller)
            .join(own.trim_start_matches('/'));
        if nix::unistd::access(&parent, nix::unistd::AccessFlags::W_OK).is_err() {
            continue;
        }
        for entry in std::fs::read_dir(&parent).into_iter().flatten().flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let owner = name
                .strip_prefix("moult-jail-")
                .and_then(|n| n.split('-').next());
            if owner.is_some_and(|pid| !Path::new("/proc").join(pid).exists()) {
                let _ = std::fs::remove_dir(entry.path());
            }
        }
        parents.push(parent);
    }
    parents
}

/// The paths a jail covers with a fresh tmpfs: `/tmp`, and `$TMPDIR` when it is elsewhere.
fn scratch_paths() -> Vec<PathBuf> {
    let mut paths = vec![PathBuf::from("/tmp")];
    let tmp = std::env::temp_dir();
    if !tmp.starts_with("/tmp") && tmp.is_absolute() {
        paths.push(tmp);
    }
    paths
}

impl Jail {
    /// `program args` with `env`, jailed: a command line that starts the [`maker`] with the
    /// jail's plan, and the relays of [`Jail::ports`] (needs a Tokio runtime).
    pub fn wrap(
        &self,
        program: &str,
        args: &[String],
        env: Vec<(String, String)>,
    ) -> std::io::Result<Wrapped> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let exe = maker()?;
        let cwd = std::env::current_dir()?;
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("moult-jail-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let cgroups = cgroups(&format!("moult-jail-{}-{n}", std::process::id()));
        let mut guard = Guard {
            dir: dir.clone(),
            relays: Vec::new(),
            cgroups: cgroups.clone(),
        };
        let mut relays = Vec::new();
        for &port in &self.ports {
            let socket = dir.join(format!("{port}.sock"));
            let listener = UnixListener::bind(&socket)?;
            guard.relays.push(tokio::spawn(relay_out(listener, port)));
            relays.push((port, socket));
        }
        let scratch = scratch_paths();
        // The maker too: a program may start it (`moult.sandbox.run`, docs/agents.md).
        let named = [Path::new(program), &exe]
            .into_iter()
            .chain(args.iter().map(Path::new))
            .chain(
                env.iter()
                    .filter(|(k, _)| k == "PYTHONPATH")
                    .flat_map(|(_, v)| v.split(':').map(Path::new)),
            )
            .filter(|p| p.is_absolute() && p.exists())
            .map(Path::to_path_buf);
        // Each as named (a link to outside the scratch, such as a virtualenv's python, is kept
        // where it is named) and resolved (`runtime/../examples/env.py` is not inside `runtime/`).
        let mut readable: Vec<PathBuf> = (self.readable.iter().cloned())
            .chain([cwd.clone(), dir.clone()])
            .chain(named)
            .flat_map(|p| [std::fs::canonicalize(&p).ok(), Some(p)])
            .flatten()
            .filter(|p| scratch.iter().any(|s| p.starts_with(s)))
            .collect();
        // Outermost first, and nothing inside a folder already kept.
        readable.sort();
        readable.dedup_by(|inner, outer| inner.starts_with(&*outer));
        let mut env = env;
        let mut restore = Vec::new();
        for (var, ours) in LOADER_VARS.map(|v| (v, std::env::var(v))) {
            let theirs = env
                .iter()
                .position(|(k, _)| k == var)
                .map(|i| env.remove(i).1);
            if let Ok(ours) = ours {
                env.push((var.to_string(), ours));
                restore.push((var.to_string(), theirs));
            } else if let Some(theirs) = theirs {
                env.push((var.to_string(), theirs));
            }
        }
        let plan = Plan {
            restore,
            limits: self.limits,
            writable: self.writable.clone(),
            readable,
            scratch,
            relays,
            cwd,
            cgroups,
        };
        let plan = serde_json::to_string(&plan).map_err(std::io::Error::other)?;
        // The program's variables are the jail's `moult`'s, less the plan and what it restores.
        env.push((JAIL_ENV.to_string(), plan));
        Ok(Wrapped {
            program: exe,
            args: std::iter::once(program.to_string())
                .chain(args.iter().cloned())
                .collect(),
            env,
            guard,
        })
    }
}

impl Jail {
    /// Whether a jail can be made where programs start: here, or by the sandbox at `socket` (an
    /// agent pod's, [`sandbox`]). Tried with `true`, on a thread of its own (it blocks for the
    /// few milliseconds that takes); `Err` says why not.
    pub fn probe(&self, socket: Option<&Path>) -> Result<(), String> {
        let empty = Jail {
            ports: Vec::new(),
            writable: Vec::new(),
            ..self.clone()
        };
        let env = vec![("PATH".into(), std::env::var("PATH").unwrap_or_default())];
        let tried = std::thread::scope(|s| {
            s.spawn(|| -> std::io::Result<(sandbox::Exit, String)> {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()?;
                runtime.block_on(async {
                    let p = program::Program::start(socket, "true", &[], env, Some(&empty));
                    let mut p = p.await?;
                    let mut stderr = String::new();
                    if let Some(mut pipe) = p.stderr.take() {
                        tokio::io::AsyncReadExt::read_to_string(&mut pipe, &mut stderr).await?;
                    }
                    Ok((p.wait().await?, stderr))
                })
            })
            .join()
        });
        match tried {
            Ok(Ok((exit, _))) if exit.success() => Ok(()),
            Ok(Ok((_, stderr))) => Err(format!(
                "{}{}",
                stderr.trim().replace("moult jail: ", ""),
                hint().map(|h| format!("; {h}")).unwrap_or_default()
            )),
            Ok(Err(e)) => Err(format!("no jail can be made here ({e})")),
            Err(_) => Err("no jail can be made here (its probe panicked)".into()),
        }
    }
}

/// What on this machine most likely keeps a jail from being made, when something known does
/// (docs/security.md#episodes, "What it needs", says what to do about each).
fn hint() -> Option<&'static str> {
    let read = |path: &str| std::fs::read_to_string(path).map(|s| s.trim().to_string());
    let seccomp = read("/proc/self/status").ok().is_some_and(|s| {
        s.lines()
            .any(|l| l.split_whitespace().collect::<Vec<_>>() == ["Seccomp:", "2"])
    });
    if read("/proc/sys/user/max_user_namespaces").is_ok_and(|v| v == "0") {
        Some("user namespaces are turned off here (sysctl user.max_user_namespaces = 0)")
    } else if read("/proc/sys/kernel/unprivileged_userns_clone").is_ok_and(|v| v == "0") {
        Some("unprivileged user namespaces are turned off here (sysctl kernel.unprivileged_userns_clone = 0)")
    } else if read("/proc/sys/kernel/apparmor_restrict_unprivileged_userns").is_ok_and(|v| v == "1")
        && !nix::unistd::getuid().is_root()
    {
        Some("AppArmor keeps unprivileged user namespaces from mounting here (sysctl kernel.apparmor_restrict_unprivileged_userns = 1, Ubuntu 23.10 and later) unless a profile allows moult-jail")
    } else if seccomp {
        Some("this process runs under a seccomp filter, as a container's default profile is, which refuses new namespaces")
    } else {
        None
    }
}

/// Forwards each connection to a relay's Unix socket to `port` on this machine's 127.0.0.1.
async fn relay_out(listener: UnixListener, port: u16) {
    while let Ok((mut inner, _)) = listener.accept().await {
        tokio::spawn(async move {
            if let Ok(mut outer) = TcpStream::connect(("127.0.0.1", port)).await {
                let _ = copy_bidirectional(&mut inner, &mut outer).await;
            }
        });
    }
}
