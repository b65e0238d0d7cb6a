//! Agent code in a container of its own (docs/security.md, "Agent code").
//!
//! On a cluster an agent pod has two containers: `agents` runs `moult agents`, which holds the
//! agent credential and talks to the coordinator, and `sandbox` runs `moult sandbox`, which holds
//! no credential and starts every agent program for it. The two share the pod's network (agent
//! code reaches the loopback server on 127.0.0.1) and a `/tmp` volume (the socket, episodes'
//! task and result files, the embedded Python package), but not their processes: agent code
//! cannot read the `agents` container's environment or memory through `/proc`.
//!
//! `moult agents` with `MOULT_AGENT_SANDBOX=<socket>` starts each program over one connection to
//! the sandbox's Unix socket: first one byte carrying three descriptors (`SCM_RIGHTS`), its ends
//! of three socket pairs, which become the program's stdin, stdout and stderr (its bytes go
//! straight between it and `moult agents`; nothing copies them), then one JSON line
//! `{"program", "args", "env"}`. The sandbox answers `{"pid": N}` (or `{"error": "..."}`) once
//! the program started and `{"exit": {"code": N}}` or `{"exit": {"signal": N}}` when it ended.
//! The program gets exactly `env`, runs in a process group of its own, and the whole group is
//! killed when the connection closes: the same lifetime a local child has (dropping it kills the
//! group).

use std::io::{ErrorKind, IoSlice, IoSliceMut};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use nix::sys::signal::{killpg, Signal};
use nix::sys::socket::{recvmsg, sendmsg, ControlMessage, ControlMessageOwned, MsgFlags};
use nix::unistd::Pid;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader, Interest};
use tokio::net::{UnixListener, UnixStream};
use tokio::process::{Child, Command};

use crate::{Guard, Jail};

/// The variable that gives every program the path of the binary that makes jails ([`crate::maker`];
/// `moult.sandbox.run` starts it).
pub const BIN_ENV: &str = "MOULT_BIN";

/// The longest first line of a connection.
const HELLO_BYTES: u64 = 1 << 20;
/// How long the sandbox waits for a connection's descriptors and first line.
const HELLO_TIME: Duration = Duration::from_secs(10);
/// How long `moult agents` waits for the sandbox to listen (its container may start later, or
/// be restarting).
const STARTUP: Duration = Duration::from_secs(60);

/// Unix socket paths hold at most 107 bytes. A longer one (a deep `/tmp`) is reached through a
/// descriptor of its folder, `/proc/self/fd/N/NAME`, which Linux resolves like the path itself;
/// the descriptor must stay open while the address is used.
fn addressable(socket: &Path) -> std::io::Result<(Option<std::fs::File>, PathBuf)> {
    use std::os::fd::AsRawFd;
    if socket.as_os_str().len() < 100 {
        return Ok((None, socket.to_path_buf()));
    }
    let no_file = || std::io::Error::other("the socket path names no file");
    let name = socket.file_name().ok_or_else(no_file)?;
    let folder = match socket.parent() {
        Some(p) if !p.as_os_str().is_empty() => std::fs::File::open(p)?,
        _ => std::fs::File::open(".")?,
    };
    let short = PathBuf::from(format!("/proc/self/fd/{}", folder.as_raw_fd())).join(name);
    Ok((Some(folder), short))
}

/// Connects to the sandbox, waiting up to [`STARTUP`] while its socket is missing or refuses.
async fn connect(socket: &Path) -> std::io::Result<UnixStream> {
    let deadline = Instant::now() + STARTUP;
    loop {
        let attempt = async {
            let (_folder, address) = addressable(socket)?;
            UnixStream::connect(address).await
        };
        match attempt.await {
            Err(e)
                if matches!(e.kind(), ErrorKind::NotFound | ErrorKind::ConnectionRefused)
                    && Instant::now() < deadline =>
            {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            other => return other,
        }
    }
}

/// What a connection asks for, after its descriptors.
#[derive(Debug, Serialize, Deserialize)]
struct Spawn {
    program: String,
    args: Vec<String>,
    env: Vec<(String, String)>,
    /// The jail to start the program in (docs/security.md#episodes).
    #[serde(default)]
    jail: Option<Jail>,
}

/// How a program ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Exit {
    Code(i32),
    Signal(i32),
}

impl Exit {
    pub fn success(self) -> bool {
        self == Exit::Code(0)
    }

    pub fn signal(self) -> Option<i32> {
        match self {
            Exit::Signal(s) => Some(s),
            Exit::Code(_) => None,
        }
    }

    pub fn code(self) -> Option<i32> {
        match self {
            Exit::Code(c) => Some(c),
            Exit::Signal(_) => None,
        }
    }

    pub fn of(status: std::process::ExitStatus) -> Self {
        use std::os::unix::process::ExitStatusExt;
        match (status.code(), status.signal()) {
            (Some(code), _) => Exit::Code(code),
            (None, Some(signal)) => Exit::Signal(signal),
            (None, None) => Exit::Code(-1),
        }
    }
}

impl std::fmt::Display for Exit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Exit::Code(code) => write!(f, "exited with status {code}"),
            Exit::Signal(signal) => write!(f, "was killed by signal {signal}"),
        }
    }
}

/// The sandbox's answers on the control connection.
#[derive(Debug, Serialize, Deserialize)]
#[serde(untagged)]
enum Answer {
    Started { pid: u32 },
    Failed { error: String },
    Ended { exit: Exit },
}

/// A connection's first line (or the control connection's next one).
async fn read_hello(conn: &mut BufReader<UnixStream>) -> std::io::Result<String> {
    let mut line = Vec::new();
    (&mut *conn)
        .take(HELLO_BYTES)
        .read_until(b'\n', &mut line)
        .await?;
    if !line.ends_with(b"\n") {
        let missing = "the connection's first line is missing or over 1 MiB";
        return Err(std::io::Error::other(missing));
    }
    String::from_utf8(line).map_err(|_| std::io::Error::other("the first line is not UTF-8"))
}

/// Sends a program's three stream descriptors, carried by one byte.
async fn send_streams(conn: &UnixStream, fds: [RawFd; 3]) -> std::io::Result<()> {
    let rights = [ControlMessage::ScmRights(&fds)];
    let byte = [IoSlice::new(b"S")];
    conn.async_io(Interest::WRITABLE, || {
        sendmsg::<()>(conn.as_raw_fd(), &byte, &rights, MsgFlags::empty(), None)
            .map_err(std::io::Error::from)
    })
    .await
    .map(drop)
}

/// Receives the three stream descriptors a connection starts with.
#[allow(unsafe_code)]
async fn receive_streams(conn: &UnixStream) -> std::io::Result<[OwnedFd; 3]> {
    let fds = conn
        .async_io(Interest::READABLE, || {
            let (mut byte, mut space) = ([0u8; 1], nix::cmsg_space!([RawFd; 3]));
            let mut iov = [IoSliceMut::new(&mut byte)];
            let flags = MsgFlags::MSG_CMSG_CLOEXEC;
            let msg = recvmsg::<()>(conn.as_raw_fd(), &mut iov, Some(&mut space), flags)?;
            let mut fds = Vec::new();
            for c in msg.cmsgs()? {
                if let ControlMessageOwned::ScmRights(received) = c {
                    fds.extend(received);
                }
            }
            Ok(fds)
        })
        .await?;
    // SAFETY: the kernel just made these descriptors for this process; nothing else owns them.
    let fds: Vec<OwnedFd> = (fds.into_iter())
        .map(|fd| unsafe { OwnedFd::from_raw_fd(fd) })
        .collect();
    let count = fds.len();
    fds.try_into()
        .map_err(|_| std::io::Error::other(format!("{count} stream descriptors came, not 3")))
}

/// Writes `value` as one JSON line.
async fn send_line<T: Serialize>(
    conn: &mut (impl tokio::io::AsyncWrite + Unpin),
    value: &T,
) -> std::io::Result<()> {
    let mut line = serde_json::to_vec(value).expect("serializes");
    line.push(b'\n');
    conn.write_all(&line).await
}

/// A program started in the sandbox, from the agents' side: its streams, and the connection
/// whose closing (on drop) kills its process group.
#[derive(Debug)]
pub struct Sandboxed {
    control: BufReader<UnixStream>,
    pub stdin: Option<UnixStream>,
    pub stdout: Option<UnixStream>,
    pub stderr: Option<UnixStream>,
}

impl Sandboxed {
    /// Starts `program` with exactly `env` in the sandbox at `socket`, in `jail` if there is one.
    pub async fn spawn(
        socket: &Path,
        program: &str,
        args: &[String],
        env: Vec<(String, String)>,
        jail: Option<&Jail>,
    ) -> std::io::Result<Self> {
        let spawn = Spawn {
            program: program.to_string(),
            args: args.to_vec(),
            env,
            jail: jail.cloned(),
        };
        let connected = async {
            // Blocking sockets: the program's ends are its stdio as they are.
            let pairs = [(); 3].map(|()| std::os::unix::net::UnixStream::pair());
            let [a, b, c] = pairs;
            let pairs = [a?, b?, c?];
            let mut conn = connect(socket).await?;
            send_streams(
                &conn,
                pairs.each_ref().map(|(_, theirs)| theirs.as_raw_fd()),
            )
            .await?;
            send_line(&mut conn, &spawn).await?;
            let ours = pairs.map(|(ours, _)| {
                ours.set_nonblocking(true)?;
                UnixStream::from_std(ours)
            });
            let [a, b, c] = ours;
            Ok(([a?, b?, c?], conn))
        };
        let ([stdin, stdout, stderr], control) = connected.await.map_err(|e: std::io::Error| {
            std::io::Error::other(format!(
                "cannot reach the agent sandbox at {}: {e}",
                socket.display()
            ))
        })?;
        let mut control = BufReader::new(control);
        let answer = read_hello(&mut control)
            .await
            .map_err(|e| std::io::Error::other(format!("the agent sandbox did not answer: {e}")))?;
        match serde_json::from_str::<Answer>(&answer) {
            Ok(Answer::Started { .. }) => Ok(Self {
                control,
                stdin: Some(stdin),
                stdout: Some(stdout),
                stderr: Some(stderr),
            }),
            Ok(Answer::Failed { error }) => Err(std::io::Error::other(error)),
            _ => Err(std::io::Error::other(format!(
                "the agent sandbox answered {answer:?}"
            ))),
        }
    }

    /// Waits for the program to end.
    pub async fn wait(&mut self) -> std::io::Result<Exit> {
        let line = read_hello(&mut self.control).await.map_err(|e| {
            std::io::Error::other(format!("lost the agent sandbox while waiting: {e}"))
        })?;
        match serde_json::from_str::<Answer>(&line) {
            Ok(Answer::Ended { exit }) => Ok(exit),
            _ => Err(std::io::Error::other(format!(
                "the agent sandbox answered {line:?}"
            ))),
        }
    }
}

/// Serves the sandbox on `socket` until the process ends: starts the programs `moult agents`
/// asks for (see the module docs).
pub async fn serve(socket: &Path) -> std::io::Result<()> {
    let _ = std::fs::remove_file(socket);
    let (_folder, address) = addressable(socket)?;
    let listener = UnixListener::bind(address)?;
    loop {
        let (conn, _) = listener.accept().await?;
        tokio::spawn(run(conn));
    }
}

/// A program in a process group of its own (its pid is the group's id): dropping it kills the whole group, whatever the program started, even once the program
/// itself has exited. Both sides start programs this way: `moult agents` without a sandbox, and
/// the sandbox.
#[derive(Debug)]
pub struct ProcessGroup {
    pub child: Child,
    /// Kept from the start: `Child::id` forgets the pid once the child has been waited for.
    group: Option<Pid>,
    /// The relays of the program's jail, when it has one.
    _jail: Option<Guard>,
}

impl ProcessGroup {
    /// Starts `program` with exactly `env` (and [`BIN_ENV`]) and `stdio` as its stdin, stdout
    /// and stderr, in `jail` if there is one.
    pub fn spawn(
        program: &str,
        args: &[String],
        mut env: Vec<(String, String)>,
        [stdin, stdout, stderr]: [Stdio; 3],
        jail: Option<&Jail>,
    ) -> std::io::Result<Self> {
        let cannot = |e: std::io::Error| {
            std::io::Error::new(e.kind(), format!("cannot start `{program}`: {e}"))
        };
        // Where `moult.sandbox.run` finds the binary that makes its jails.
        env.retain(|(k, _)| k != BIN_ENV);
        let exe = crate::maker().map_err(cannot)?;
        env.push((BIN_ENV.into(), exe.to_string_lossy().into_owned()));
        let wrapped = jail.map(|j| j.wrap(program, args, env.clone())).transpose();
        let wrapped = wrapped.map_err(cannot)?;
        let (exe, args, env) = match &wrapped {
            Some(w) => (w.program.as_os_str(), &w.args[..], &w.env),
            None => (program.as_ref(), args, &env),
        };
        let child = Command::new(exe)
            .args(args)
            .env_clear()
            .envs(env.iter().cloned())
            .stdin(stdin)
            .stdout(stdout)
            .stderr(stderr)
            .process_group(0)
            .kill_on_drop(true)
            .spawn()
            .map_err(cannot)?;
        let group = child.id().and_then(|p| i32::try_from(p).ok());
        Ok(Self {
            child,
            group: group.map(Pid::from_raw),
            _jail: wrapped.map(|w| w.guard),
        })
    }

    fn kill(&mut self) {
        if let Some(group) = self.group {
            // ESRCH (the group is gone already) is the common case, not an error.
            let _ = killpg(group, Signal::SIGKILL);
        }
        let _ = self.child.start_kill();
    }
}

impl Drop for ProcessGroup {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Runs one program for its connection.
async fn run(conn: UnixStream) {
    let hello = async {
        let streams = receive_streams(&conn).await?;
        let mut conn = BufReader::new(conn);
        let spawn = serde_json::from_str::<Spawn>(&read_hello(&mut conn).await?)
            .map_err(std::io::Error::other)?;
        Ok::<_, std::io::Error>((streams, spawn, conn.into_inner()))
    };
    let Ok(Ok((streams, spawn, mut control))) = tokio::time::timeout(HELLO_TIME, hello).await
    else {
        return;
    };
    let streams = streams.map(Stdio::from);
    let jail = spawn.jail.as_ref();
    let mut p = match ProcessGroup::spawn(&spawn.program, &spawn.args, spawn.env, streams, jail) {
        Ok(p) => p,
        Err(e) => {
            let error = e.to_string();
            let _ = send_line(&mut control, &Answer::Failed { error }).await;
            return;
        }
    };
    let (mut control_read, mut control_write) = control.into_split();
    let mut closed = Box::pin(async move {
        // The agents' side sends nothing more: the read ends when it closes the connection.
        let mut sink = [0u8; 64];
        while matches!(control_read.read(&mut sink).await, Ok(n) if n > 0) {}
    });
    let pid = p.child.id().unwrap_or_default();
    if send_line(&mut control_write, &Answer::Started { pid })
        .await
        .is_ok()
    {
        tokio::select! {
            status = p.child.wait() => {
                if let Ok(status) = status {
                    let _ = send_line(&mut control_write, &Answer::Ended { exit: Exit::of(status) }).await;
                }
                // What the program left running lives until the agents' side lets go.
                (&mut closed).await;
            }
            () = &mut closed => {}
        }
    }
    p.kill();
    let _ = p.child.wait().await;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Everything a program wrote to one of its streams.
    async fn read_all(stream: Option<UnixStream>) -> String {
        let mut text = String::new();
        stream
            .expect("the stream is there")
            .read_to_string(&mut text)
            .await
            .unwrap();
        text
    }

    fn serving(socket: &Path) -> tokio::task::JoinHandle<std::io::Result<()>> {
        let socket = socket.to_path_buf();
        tokio::spawn(async move { serve(&socket).await })
    }

    /// A program in the sandbox: its streams carry its bytes both ways, it gets exactly the
    /// environment it is given, and what it leaves running dies when the control connection
    /// closes.
    #[tokio::test]
    async fn programs_run_in_the_sandbox_with_their_streams_and_die_with_their_connection() {
        let dir = std::env::temp_dir().join(format!("moult-sandbox-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let socket = dir.join("sandbox.sock");
        let server = serving(&socket);
        while !socket.exists() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let leftover = dir.join("leftover.pid");
        let script = format!(
            "read line; echo \"got $line and ${{ONLY:-none}} ${{HOME:-nohome}}\"; echo oops >&2; sleep 600 >/dev/null 2>&1 & echo $! > {}; exit 3",
            leftover.display()
        );
        let mut p = Sandboxed::spawn(
            &socket,
            "/bin/sh",
            &["-c".into(), script],
            vec![("ONLY".into(), "this".into())],
            None,
        )
        .await
        .unwrap();
        let mut stdin = p.stdin.take().unwrap();
        stdin.write_all(b"hello\n").await.unwrap();
        drop(stdin);
        assert_eq!(
            read_all(p.stdout.take()).await,
            "got hello and this nohome\n"
        );
        assert_eq!(read_all(p.stderr.take()).await, "oops\n");
        assert_eq!(p.wait().await.unwrap(), Exit::Code(3));
        let pid: i32 = std::fs::read_to_string(&leftover)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        let alive = || {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .is_ok_and(|s| !s.rsplit(") ").next().unwrap_or("").starts_with('Z'))
        };
        assert!(alive(), "the leftover lives while the connection is open");
        drop(p);
        for _ in 0..100 {
            if !alive() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(!alive(), "the leftover died with its connection");

        // A program that cannot start is an error naming it.
        let err = Sandboxed::spawn(&socket, "/nonexistent/agent", &[], Vec::new(), None)
            .await
            .unwrap_err();
        assert!(
            err.to_string()
                .contains("cannot start `/nonexistent/agent`"),
            "{err}"
        );
        server.abort();
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A socket path longer than a Unix address holds (a pod's `/tmp` deep in a kubelet's
    /// folders) still serves, and a client that comes before the server waits for it.
    #[tokio::test]
    async fn a_long_socket_path_serves_and_clients_wait_for_the_server() {
        let dir = std::env::temp_dir()
            .join(format!("moult-sandbox-long-{}", std::process::id()))
            .join("a-folder-name-long-enough-that-the-whole-path".repeat(2))
            .join("is-over-the-107-bytes-of-sun-path");
        std::fs::create_dir_all(&dir).unwrap();
        let socket = dir.join("moult-sandbox.sock");
        assert!(socket.as_os_str().len() > 108, "{}", socket.display());
        let client = tokio::spawn({
            let socket = socket.clone();
            async move { Sandboxed::spawn(&socket, "/bin/echo", &["hi".into()], Vec::new(), None).await }
        });
        tokio::time::sleep(Duration::from_millis(500)).await;
        let server = serving(&socket);
        let mut p = client.await.unwrap().unwrap();
        assert_eq!(read_all(p.stdout.take()).await, "hi\n");
        assert_eq!(p.wait().await.unwrap(), Exit::Code(0));
        server.abort();
        let _ = std::fs::remove_dir_all(dir.parent().unwrap().parent().unwrap());
    }
}
