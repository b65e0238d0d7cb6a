//! The inside of a jail: what `moult` does when it is started with [`JAIL_ENV`] (lib.rs says what
//! a jail is). It runs first thing in `main`, while the process has a single thread: creating a
//! user namespace and forking both need that.
//!
//! The process that makes the jail (its "keeper") stays outside the new PID namespace and relays
//! the jail's ports; its first child is the jail's process 1, which mounts the jail's `/proc`,
//! starts the program with its limits, reaps whatever is handed to it, and tells the keeper how
//! the program ended. Its exit ends the namespace: the kernel kills every process left in it.
#![allow(unsafe_code)]

use std::ffi::{CString, OsString};
use std::net::{Ipv4Addr, TcpListener};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::mount::{mount, MsFlags};
use nix::sched::{unshare, CloneFlags};
use nix::sys::resource::{setrlimit, Resource};
use nix::sys::signal::{raise, signal, SigHandler, Signal};
use nix::sys::wait::{waitpid, WaitStatus};
use nix::unistd::{fork, getgid, getuid, setsid, ForkResult, Pid};
use tokio::io::{copy_bidirectional, AsyncReadExt};

use super::{Limits, Plan, JAIL_ENV, OUT_OF_MEMORY, SETUP_FAILED};

const OPEN_TREE_CLONE: u32 = 1;
const AT_RECURSIVE: u32 = 0x8000;
const MOUNT_ATTR_RDONLY: u64 = 0x1;
const MOUNT_ATTR_NOSUID: u64 = 0x2;
const MOVE_MOUNT_F_EMPTY_PATH: u32 = 0x4;

/// `struct mount_attr` of mount_setattr(2).
#[repr(C)]
struct MountAttr {
    attr_set: u64,
    attr_clr: u64,
    propagation: u64,
    userns_fd: u64,
}

/// When this process was started to make a jail ([`JAIL_ENV`] is set): makes it, runs the
/// program its arguments name in it, and exits as the program did. When it was started by
/// `moult.sandbox.run` ([`crate::once`]): runs the program there and exits. Otherwise returns.
pub fn run_if_asked() {
    crate::once::run_if_asked();
    let Some(plan) = std::env::var_os(JAIL_ENV) else {
        return;
    };
    let fail = |why: String| -> ! {
        eprintln!("moult jail: {why}");
        std::process::exit(SETUP_FAILED)
    };
    let plan: Plan = serde_json::from_slice(plan.as_bytes())
        .unwrap_or_else(|e| fail(format!("{JAIL_ENV} holds no plan: {e}")));
    let argv: Vec<OsString> = std::env::args_os().skip(1).collect();
    if argv.is_empty() {
        fail("no program to run".into());
    }
    match make(&plan).and_then(|listeners| keep(&plan, listeners, &argv)) {
        Ok(never) => match never {},
        Err(why) => fail(why),
    }
}

/// Makes the namespaces, the mounts and the loopback interface, and listens on the relayed ports.
fn make(plan: &Plan) -> Result<Vec<(TcpListener, PathBuf)>, String> {
    let (uid, gid) = (getuid(), getgid());
    for cgroup in &plan.cgroups {
        // Before the namespaces: this process, and so everything the jail will hold, joins it.
        // Memory and swap together where swap is accounted (memsw), so swap cannot stretch it.
        let limits = match cgroup.starts_with("/sys/fs/cgroup/memory") {
            true => vec![
                ("memory.limit_in_bytes", plan.limits.memory_bytes),
                ("memory.memsw.limit_in_bytes", plan.limits.memory_bytes),
            ],
            false => vec![("pids.max", plan.limits.processes + 2)],
        };
        let cannot = |e| format!("cannot make the jail's cgroup {}: {e}", cgroup.display());
        std::fs::create_dir_all(cgroup).map_err(cannot)?;
        for (file, max) in limits {
            let path = cgroup.join(file);
            if path.exists() {
                std::fs::write(path, max.to_string()).map_err(cannot)?;
            }
        }
        let pid = std::process::id().to_string();
        std::fs::write(cgroup.join("cgroup.procs"), pid).map_err(cannot)?;
    }
    let new = CloneFlags::CLONE_NEWUSER
        | CloneFlags::CLONE_NEWNS
        | CloneFlags::CLONE_NEWPID
        | CloneFlags::CLONE_NEWNET
        | CloneFlags::CLONE_NEWIPC
        | CloneFlags::CLONE_NEWUTS;
    unshare(new).map_err(|e| {
        format!("cannot create the episode's namespaces ({e}): this needs unprivileged user namespaces (docs/security.md#episodes)")
    })?;
    write("/proc/self/setgroups", "deny")?;
    write("/proc/self/uid_map", &format!("{uid} {uid} 1"))?;
    write("/proc/self/gid_map", &format!("{gid} {gid} 1"))?;
    let private = MsFlags::MS_REC | MsFlags::MS_PRIVATE;
    mount(None::<&str>, "/", None::<&str>, private, None::<&str>)
        .map_err(|e| format!("cannot make the jail's mounts private: {e}"))?;
    // What stays visible under the scratch is cloned before the scratch covers it.
    let mut kept = Vec::new();
    let marked =
        (plan.readable.iter().map(|p| (p, false))).chain(plan.writable.iter().map(|p| (p, true)));
    for (path, writable) in marked {
        let tree = open_tree(path)?;
        if !writable {
            read_only(tree.as_raw_fd(), "", libc::AT_EMPTY_PATH as u32)?;
        }
        kept.push((path, path.is_dir(), tree));
    }
    kept.sort_by(|a, b| a.0.cmp(b.0));
    read_only(libc::AT_FDCWD, "/", 0)?;
    let size = format!("size={},mode=1777", plan.limits.scratch_bytes);
    let shm = Some(Path::new("/dev/shm")).filter(|p| p.is_dir());
    for path in plan.scratch.iter().map(PathBuf::as_path).chain(shm) {
        let flags = MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
        mount(
            Some("tmpfs"),
            path,
            Some("tmpfs"),
            flags,
            Some(size.as_str()),
        )
        .map_err(|e| format!("cannot mount the scratch tmpfs on {}: {e}", path.display()))?;
    }
    for (path, dir, tree) in kept {
        place(path, dir, &tree)?;
    }
    loopback_up()?;
    (plan.relays.iter())
        .map(|(port, socket)| {
            let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, *port))
                .map_err(|e| format!("cannot listen on the jail's 127.0.0.1:{port}: {e}"))?;
            Ok((listener, socket.clone()))
        })
        .collect()
}

/// The keeper: starts the jail's process 1, relays the ports until it ends, and ends the same way
/// as the program did.
fn keep(
    plan: &Plan,
    listeners: Vec<(TcpListener, PathBuf)>,
    argv: &[OsString],
) -> Result<std::convert::Infallible, String> {
    let (report_read, report_write) =
        nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(|e| format!("pipe: {e}"))?;
    // SAFETY: this process has one thread (the module docs); the child only mounts, forks and
    // execs, and exits.
    let first = match unsafe { fork() }.map_err(|e| format!("cannot fork: {e}"))? {
        ForkResult::Child => {
            drop((report_read, listeners));
            first_process(plan, argv, report_write)
        }
        ForkResult::Parent { child } => child,
    };
    drop(report_write);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()
        .map_err(|e| format!("cannot start the relays: {e}"))?;
    let report = runtime.block_on(async {
        for (listener, socket) in listeners {
            listener.set_nonblocking(true).ok();
            if let Ok(listener) = tokio::net::TcpListener::from_std(listener) {
                tokio::spawn(relay_in(listener, socket));
            }
        }
        let mut report = Vec::new();
        if let Ok(mut pipe) = tokio::net::unix::pipe::Receiver::from_owned_fd(report_read) {
            let _ = pipe.read_to_end(&mut report).await;
        }
        report
    });
    drop(runtime);
    let status = waitpid(first, None);
    let memory = plan
        .cgroups
        .iter()
        .find(|c| c.starts_with("/sys/fs/cgroup/memory"));
    let control = memory.and_then(|c| std::fs::read_to_string(c.join("memory.oom_control")).ok());
    let killed = control
        .as_deref()
        .and_then(|c| c.lines().find_map(|l| l.strip_prefix("oom_kill ")));
    if killed.is_some_and(|n| n.trim() != "0") {
        eprintln!("{OUT_OF_MEMORY}: the jail's processes together reached its memory limit");
    }
    match (report.as_slice(), status) {
        ([b'c', code @ ..], _) => std::process::exit(number(code)),
        ([b's', signal @ ..], _) => die_by(number(signal)),
        (_, Ok(WaitStatus::Exited(_, code))) => std::process::exit(code),
        (_, Ok(WaitStatus::Signaled(_, signal, _))) => die_by(signal as i32),
        (_, other) => Err(format!("lost the jail's first process: {other:?}")),
    }
}

fn number(text: &[u8]) -> i32 {
    std::str::from_utf8(text)
        .ok()
        .and_then(|t| t.parse().ok())
        .unwrap_or(SETUP_FAILED)
}

/// Ends this process by `signal`, as the program ended (no core file).
fn die_by(signal_number: i32) -> ! {
    let _ = setrlimit(Resource::RLIMIT_CORE, 0, 0);
    if let Ok(s) = Signal::try_from(signal_number) {
        // SAFETY: restoring the default action installs no handler.
        let _ = unsafe { signal(s, SigHandler::SigDfl) };
        let _ = raise(s);
    }
    std::process::exit(128 + signal_number)
}

/// The jail's process 1: its own `/proc`, the program with its limits, and the reaping of every
/// process handed to it until the program ends.
fn first_process(plan: &Plan, argv: &[OsString], report: OwnedFd) -> ! {
    let fail = |why: String| -> ! {
        eprintln!("moult jail: {why}");
        std::process::exit(SETUP_FAILED)
    };
    // The keeper is killed when its episode is abandoned: so is everything in the jail.
    let _ = nix::sys::prctl::set_pdeathsig(Signal::SIGKILL);
    let flags = MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
    if let Err(e) = mount(Some("proc"), "/proc", Some("proc"), flags, None::<&str>) {
        fail(format!("cannot mount the jail's own /proc ({e}): in a container this needs a fully visible /proc (docs/security.md#episodes)"));
    }
    let limits = plan.limits;
    let mut command = std::process::Command::new(&argv[0]);
    command
        .args(&argv[1..])
        .env_remove(JAIL_ENV)
        .current_dir(&plan.cwd);
    for (var, value) in &plan.restore {
        match value {
            Some(value) => command.env(var, value),
            None => command.env_remove(var),
        };
    }
    // SAFETY: setsid and setrlimit are system calls, safe between fork and exec.
    unsafe {
        command.pre_exec(move || {
            setsid()?;
            apply(&limits)?;
            Ok(())
        });
    }
    let program = match command.spawn() {
        Ok(child) => Pid::from_raw(child.id() as i32),
        Err(e) => {
            eprintln!(
                "moult jail: cannot start `{}`: {e}",
                argv[0].to_string_lossy()
            );
            std::process::exit(127)
        }
    };
    let mut report = std::fs::File::from(report);
    loop {
        let line = match waitpid(None::<Pid>, None) {
            Ok(WaitStatus::Exited(pid, code)) if pid == program => format!("c{code}"),
            Ok(WaitStatus::Signaled(pid, s, _)) if pid == program => format!("s{}", s as i32),
            Ok(_) | Err(Errno::EINTR) => continue,
            Err(e) => format!("c{}", 128 + e as i32),
        };
        let _ = std::io::Write::write_all(&mut report, line.as_bytes());
        std::process::exit(0)
    }
}

/// Sets the limits of the program (inherited by all it starts).
fn apply(limits: &Limits) -> nix::Result<()> {
    let cpu = limits.cpu_seconds;
    setrlimit(Resource::RLIMIT_CPU, cpu, cpu.saturating_add(1))?;
    setrlimit(
        Resource::RLIMIT_AS,
        limits.memory_bytes,
        limits.memory_bytes,
    )?;
    setrlimit(Resource::RLIMIT_NPROC, limits.processes, limits.processes)?;
    setrlimit(
        Resource::RLIMIT_FSIZE,
        limits.file_size_bytes,
        limits.file_size_bytes,
    )?;
    setrlimit(
        Resource::RLIMIT_NOFILE,
        limits.open_files,
        limits.open_files,
    )?;
    setrlimit(Resource::RLIMIT_CORE, 0, 0)
}

/// Forwards each connection to the jail's 127.0.0.1:PORT to the caller's relay socket.
async fn relay_in(listener: tokio::net::TcpListener, socket: PathBuf) {
    while let Ok((mut inner, _)) = listener.accept().await {
        let socket = socket.clone();
        tokio::spawn(async move {
            if let Ok(mut outer) = tokio::net::UnixStream::connect(&socket).await {
                let _ = copy_bidirectional(&mut inner, &mut outer).await;
            }
        });
    }
}

fn write(path: &str, text: &str) -> Result<(), String> {
    std::fs::write(path, text).map_err(|e| format!("cannot write {path}: {e}"))
}

fn c_path(path: &Path) -> Result<CString, String> {
    CString::new(path.as_os_str().as_bytes()).map_err(|_| format!("{} holds a NUL", path.display()))
}

/// A detached copy of the mounts at `path` (open_tree(2) with OPEN_TREE_CLONE).
fn open_tree(path: &Path) -> Result<OwnedFd, String> {
    let c = c_path(path)?;
    let flags = OPEN_TREE_CLONE | AT_RECURSIVE | libc::O_CLOEXEC as u32;
    // SAFETY: a valid C string, and the kernel's new descriptor is owned here alone.
    let fd = unsafe { libc::syscall(libc::SYS_open_tree, libc::AT_FDCWD, c.as_ptr(), flags) };
    if fd < 0 {
        let e = std::io::Error::last_os_error();
        return Err(format!("cannot keep {} in the jail: {e}", path.display()));
    }
    // SAFETY: see above.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// Makes the mounts at `path` (relative to `dir`) and below read-only and setuid-free.
fn read_only(dir: RawFd, path: &str, flags: u32) -> Result<(), String> {
    let c = CString::new(path).expect("no NUL");
    let attr = MountAttr {
        attr_set: MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID,
        attr_clr: 0,
        propagation: 0,
        userns_fd: 0,
    };
    let size = std::mem::size_of::<MountAttr>();
    let flags = flags | AT_RECURSIVE;
    // SAFETY: valid pointers for the call's duration.
    let r = unsafe { libc::syscall(libc::SYS_mount_setattr, dir, c.as_ptr(), flags, &attr, size) };
    if r < 0 {
        let e = std::io::Error::last_os_error();
        return Err(format!("cannot make the jail's filesystem read-only (mount_setattr: {e}; Linux 5.12 or newer, docs/security.md#episodes)"));
    }
    Ok(())
}

/// Attaches the detached `tree` at `path`, which is made in the scratch if it is not there.
fn place(path: &Path, dir: bool, tree: &OwnedFd) -> Result<(), String> {
    let made = if dir {
        std::fs::create_dir_all(path)
    } else {
        let parent = path.parent().unwrap_or(Path::new("/"));
        std::fs::create_dir_all(parent).and_then(|()| {
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .map(drop)
        })
    };
    made.map_err(|e| format!("cannot make {} in the jail: {e}", path.display()))?;
    let c = c_path(path)?;
    let empty = CString::default();
    // SAFETY: valid descriptors and C strings for the call's duration.
    let r = unsafe {
        libc::syscall(
            libc::SYS_move_mount,
            tree.as_raw_fd(),
            empty.as_ptr(),
            libc::AT_FDCWD,
            c.as_ptr(),
            MOVE_MOUNT_F_EMPTY_PATH,
        )
    };
    if r < 0 {
        let e = std::io::Error::last_os_error();
        return Err(format!(
            "cannot put {} back in the jail: {e}",
            path.display()
        ));
    }
    Ok(())
}

/// Brings the jail's loopback interface up (a new network namespace starts with it down).
fn loopback_up() -> Result<(), String> {
    let fail = |what| {
        format!(
            "cannot bring up the jail's loopback interface ({what}: {})",
            std::io::Error::last_os_error()
        )
    };
    // SAFETY: a socket only for the interface ioctls, owned here alone.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(fail("socket"));
    }
    // SAFETY: see above.
    let socket = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: an all-zero ifreq is valid; the ioctls read and write only it.
    unsafe {
        let mut request: libc::ifreq = std::mem::zeroed();
        request.ifr_name[0] = b'l' as libc::c_char;
        request.ifr_name[1] = b'o' as libc::c_char;
        if libc::ioctl(socket.as_raw_fd(), libc::SIOCGIFFLAGS, &mut request) < 0 {
            return Err(fail("SIOCGIFFLAGS"));
        }
        request.ifr_ifru.ifru_flags |= libc::IFF_UP as libc::c_short;
        if libc::ioctl(socket.as_raw_fd(), libc::SIOCSIFFLAGS, &request) < 0 {
            return Err(fail("SIOCSIFFLAGS"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn limits_name_the_field_that_ended_a_program() {
        let limits = super::Limits::default();
        assert_eq!(
            limits.hit(Some(libc::SIGXCPU), ""),
            Some("agent.limits.cpuSeconds = 600".into())
        );
        assert_eq!(
            limits.hit(None, "  MemoryError"),
            Some("agent.limits.memory = 8Gi".into())
        );
        assert_eq!(
            limits.hit(Some(libc::SIGXFSZ), ""),
            Some("agent.limits.fileSize = 1Gi".into())
        );
        assert_eq!(
            limits.hit(None, "OSError: [Errno 28] No space left on device"),
            Some("agent.limits.scratch = 1Gi".into())
        );
        assert_eq!(limits.hit(Some(libc::SIGKILL), "Traceback"), None);
    }
}
