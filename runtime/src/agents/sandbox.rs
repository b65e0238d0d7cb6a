//! Agent code in a container of its own (docs/security.md, "Agent code").
//!
//! On a cluster an agent pod has two containers: `agents` runs `moult agents`, which holds the
//! agent credential and talks to the coordinator, and `sandbox` runs `moult sandbox`, which holds
//! no credential and starts every agent program for it. The two share the pod's network (agent
//! code reaches the loopback server on 127.0.0.1) and a `/tmp` volume (the socket, episodes'
//! task and result files, the embedded Python package), but not their processes: agent code
//! cannot read the `agents` container's environment or memory through `/proc`.
//!
//! `moult agents` with `MOULT_AGENT_SANDBOX=<socket>` starts programs through the sandbox's Unix
//! socket, four connections per program, each opened with one JSON line:
//! `{"attach": ID, "stream": "stdin"|"stdout"|"stderr"}` for the program's three streams (their
//! bytes are then copied as they are), and `{"spawn": ID, "program", "args", "env"}` for the
//! control connection, on which the sandbox answers `{"pid": N}` (or `{"error": "..."}`) once the
//! program started and `{"exit": {"code": N}}` or `{"exit": {"signal": N}}` when it ended. The
//! program gets exactly `env`, runs in a process group of its own, and the whole group is killed
//! when the control connection closes: the same lifetime a local child has (dropping it kills
//! the group).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};

use super::AgentError;

/// The environment variable that makes `moult agents` start agent programs in the sandbox
/// listening on this socket (the operator sets it in agent pods).
pub use moult_operator::children::SANDBOX_ENV;

/// The longest first line of a connection.
const HELLO_BYTES: u64 = 1 << 20;
/// How long a spawn waits for its three streams, and an attached stream for its spawn.
const PAIRING: Duration = Duration::from_secs(10);
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
    let name = socket.file_name().ok_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "the socket path names no file",
        )
    })?;
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
        let attempt = match addressable(socket) {
            Ok((_folder, address)) => UnixStream::connect(address).await,
            Err(e) => Err(e),
        };
        match attempt {
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused
                ) && Instant::now() < deadline =>
            {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            other => return other,
        }
    }
}

/// What the control connection asks for.
#[derive(Debug, Serialize, Deserialize)]
struct Spawn {
    spawn: String,
    program: String,
    args: Vec<String>,
    env: Vec<(String, String)>,
}

#[derive(Debug, Serialize, Deserialize)]
struct Attach {
    attach: String,
    stream: Stream,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
enum Stream {
    Stdin,
    Stdout,
    Stderr,
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

/// The socket of the sandbox agent programs start in, when this process has one.
pub fn socket() -> Option<&'static Path> {
    static SOCKET: std::sync::OnceLock<Option<PathBuf>> = std::sync::OnceLock::new();
    SOCKET
        .get_or_init(|| {
            std::env::var_os(SANDBOX_ENV)
                .filter(|s| !s.is_empty())
                .map(PathBuf::from)
        })
        .as_deref()
}

/// Why a connection's first line could not be read.
#[derive(Debug, thiserror::Error)]
enum HelloError {
    #[error(transparent)]
    Io(#[from] std::io::Error),
    #[error("the connection's first line is missing or over 1 MiB")]
    Missing,
    #[error("the first line is not UTF-8")]
    NotUtf8,
}

async fn read_hello(conn: &mut BufReader<UnixStream>) -> Result<String, HelloError> {
    let mut line = Vec::new();
    (&mut *conn)
        .take(HELLO_BYTES)
        .read_until(b'\n', &mut line)
        .await?;
    if !line.ends_with(b"\n") {
        return Err(HelloError::Missing);
    }
    String::from_utf8(line).map_err(|_| HelloError::NotUtf8)
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

/// A program started in the sandbox, from the agents' side: its streams, and the control
/// connection whose closing (on drop) kills its process group.
#[derive(Debug)]
pub struct Sandboxed {
    control: BufReader<UnixStream>,
    pub stdin: Option<UnixStream>,
    pub stdout: Option<UnixStream>,
    pub stderr: Option<UnixStream>,
    pub pid: u32,
}

impl Sandboxed {
    /// Starts `program` with exactly `env` in the sandbox at `socket`.
    pub async fn spawn(
        socket: &Path,
        program: &str,
        args: &[String],
        env: Vec<(String, String)>,
    ) -> Result<Self, AgentError> {
        let unreachable = |e: std::io::Error| {
            AgentError::Crashed(format!(
                "cannot reach the agent sandbox at {} ({SANDBOX_ENV}): {e}",
                socket.display()
            ))
        };
        let id = format!("{:032x}", rand::random::<u128>());
        let mut streams = Vec::with_capacity(3);
        for stream in [Stream::Stdin, Stream::Stdout, Stream::Stderr] {
            let mut conn = connect(socket).await.map_err(unreachable)?;
            send_line(
                &mut conn,
                &Attach {
                    attach: id.clone(),
                    stream,
                },
            )
            .await
            .map_err(unreachable)?;
            streams.push(conn);
        }
        let mut control = connect(socket).await.map_err(unreachable)?;
        send_line(
            &mut control,
            &Spawn {
                spawn: id,
                program: program.to_string(),
                args: args.to_vec(),
                env,
            },
        )
        .await
        .map_err(unreachable)?;
        let mut control = BufReader::new(control);
        let answer = read_hello(&mut control)
            .await
            .map_err(|e| AgentError::Crashed(format!("the agent sandbox did not answer: {e}")))?;
        let pid = match serde_json::from_str::<Answer>(&answer) {
            Ok(Answer::Started { pid }) => pid,
            Ok(Answer::Failed { error }) => return Err(AgentError::Crashed(error)),
            _ => {
                return Err(AgentError::Crashed(format!(
                    "the agent sandbox answered {answer:?}"
                )))
            }
        };
        let mut streams = streams.into_iter();
        Ok(Self {
            control,
            stdin: streams.next(),
            stdout: streams.next(),
            stderr: streams.next(),
            pid,
        })
    }

    /// Waits for the program to end.
    pub async fn wait(&mut self) -> Result<Exit, AgentError> {
        let line = read_hello(&mut self.control).await.map_err(|e| {
            AgentError::Crashed(format!("lost the agent sandbox while waiting: {e}"))
        })?;
        match serde_json::from_str::<Answer>(&line) {
            Ok(Answer::Ended { exit }) => Ok(exit),
            _ => Err(AgentError::Crashed(format!(
                "the agent sandbox answered {line:?}"
            ))),
        }
    }
}

/// Connections waiting for their partners, by program id.
#[derive(Default)]
struct Pending {
    streams: HashMap<(String, Stream), (UnixStream, Instant)>,
}

/// Serves the sandbox on `socket` until the process ends: starts the programs `moult agents`
/// asks for (see the module docs).
pub async fn serve(socket: &Path) -> std::io::Result<()> {
    let _ = std::fs::remove_file(socket);
    let (_folder, address) = addressable(socket)?;
    let listener = UnixListener::bind(address)?;
    let pending = Arc::new(Mutex::new(Pending::default()));
    let arrived = Arc::new(tokio::sync::Notify::new());
    loop {
        let (conn, _) = listener.accept().await?;
        let (pending, arrived) = (pending.clone(), arrived.clone());
        tokio::spawn(async move {
            let mut conn = BufReader::new(conn);
            let Ok(hello) = read_hello(&mut conn).await else {
                return;
            };
            if let Ok(attach) = serde_json::from_str::<Attach>(&hello) {
                let mut p = pending.lock().expect("pending lock");
                // Partners that never came are dropped with the next arrival.
                p.streams.retain(|_, (_, at)| at.elapsed() < PAIRING * 3);
                p.streams.insert(
                    (attach.attach, attach.stream),
                    (conn.into_inner(), Instant::now()),
                );
                drop(p);
                arrived.notify_waiters();
            } else if let Ok(spawn) = serde_json::from_str::<Spawn>(&hello) {
                run(spawn, conn.into_inner(), &pending, &arrived).await;
            }
        });
    }
}

/// Takes the three streams of program `id`, waiting up to [`PAIRING`] for them.
async fn streams_of(
    id: &str,
    pending: &Mutex<Pending>,
    arrived: &tokio::sync::Notify,
) -> Option<[UnixStream; 3]> {
    let deadline = tokio::time::Instant::now() + PAIRING;
    loop {
        let notified = arrived.notified();
        {
            let mut p = pending.lock().expect("pending lock");
            let all = [Stream::Stdin, Stream::Stdout, Stream::Stderr];
            if all
                .iter()
                .all(|s| p.streams.contains_key(&(id.to_string(), *s)))
            {
                let mut take = |s| p.streams.remove(&(id.to_string(), s)).map(|(c, _)| c);
                return Some([
                    take(Stream::Stdin)?,
                    take(Stream::Stdout)?,
                    take(Stream::Stderr)?,
                ]);
            }
        }
        if tokio::time::timeout_at(deadline, notified).await.is_err() {
            return None;
        }
    }
}

/// Runs one program for its control connection.
async fn run(
    spawn: Spawn,
    mut control: UnixStream,
    pending: &Mutex<Pending>,
    arrived: &tokio::sync::Notify,
) {
    let Some([stdin_conn, stdout_conn, stderr_conn]) =
        streams_of(&spawn.spawn, pending, arrived).await
    else {
        let error = "the program's streams did not arrive".to_string();
        let _ = send_line(&mut control, &Answer::Failed { error }).await;
        return;
    };
    let mut child = match tokio::process::Command::new(&spawn.program)
        .args(&spawn.args)
        .env_clear()
        .envs(spawn.env)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .kill_on_drop(true)
        .spawn()
    {
        Ok(child) => child,
        Err(e) => {
            let error = format!("cannot start `{}`: {e}", spawn.program);
            let _ = send_line(&mut control, &Answer::Failed { error }).await;
            return;
        }
    };
    let pid = child.id().unwrap_or_default();
    let group = i32::try_from(pid).ok().map(nix::unistd::Pid::from_raw);
    // The streams' bytes, copied as they come; each copy ends with its stream.
    let (mut from_agents, _) = stdin_conn.into_split();
    let mut child_stdin = child.stdin.take().expect("piped");
    tokio::spawn(async move {
        let _ = tokio::io::copy(&mut from_agents, &mut child_stdin).await;
    });
    for (mut out, conn) in [
        (
            Box::new(child.stdout.take().expect("piped"))
                as Box<dyn tokio::io::AsyncRead + Send + Unpin>,
            stdout_conn,
        ),
        (
            Box::new(child.stderr.take().expect("piped")) as _,
            stderr_conn,
        ),
    ] {
        tokio::spawn(async move {
            let (_, mut to_agents) = conn.into_split();
            let _ = tokio::io::copy(&mut out, &mut to_agents).await;
            let _ = to_agents.shutdown().await;
        });
    }
    let (control_read, mut control_write) = control.into_split();
    let mut closed = Box::pin(async move {
        // The agents' side sends nothing more: the read ends when it closes the connection.
        let mut control_read = control_read;
        let mut sink = [0u8; 64];
        while matches!(control_read.read(&mut sink).await, Ok(n) if n > 0) {}
    });
    let started = send_line(&mut control_write, &Answer::Started { pid }).await;
    if started.is_ok() {
        tokio::select! {
            status = child.wait() => {
                if let Ok(status) = status {
                    let _ = send_line(&mut control_write, &Answer::Ended { exit: Exit::of(status) }).await;
                }
                // What the program left running lives until the agents' side lets go.
                (&mut closed).await;
            }
            () = &mut closed => {}
        }
    }
    if let Some(group) = group {
        let _ = nix::sys::signal::killpg(group, nix::sys::signal::Signal::SIGKILL);
    }
    let _ = child.start_kill();
    let _ = child.wait().await;
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
        let err = Sandboxed::spawn(&socket, "/nonexistent/agent", &[], Vec::new())
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
            async move { Sandboxed::spawn(&socket, "/bin/echo", &["hi".into()], Vec::new()).await }
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
