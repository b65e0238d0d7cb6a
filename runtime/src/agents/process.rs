//! Agents that are programs: a `ChatAgent` process per episode, and external `Env`s speaking the
//! JSON-lines protocol. Python agents run through the small `moult` package, which is embedded in
//! this binary and written to a temporary folder on first use (so `moult agents` needs nothing
//! installed besides Python and the agent's own dependencies).
//!
//! Agent code is untrusted (docs/security.md): every child starts with a cleared environment
//! (no credential, only what programs need to run), as a [`moult_jail::program::Program`]: in a
//! jail of its own per episode (`agent.isolation: Episode`) or a process group (`Process`),
//! killed whole when its episode is dropped (timeout, pool shutdown) or its process has answered,
//! so nothing an agent started outlives it. Its stderr's tail is kept for the failure reason. An
//! external env process may serve many episodes when it is not jailed: each `reset` starts the
//! next one; its answers are read a bounded line at a time.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use futures::future::BoxFuture;
use serde_json::Value as Json;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};

use moult_jail::program::{self, Program, Reader, Tail, Writer};
use moult_jail::sandbox::Exit;
use moult_jail::Jail;

use super::env::{Env, Observation, StepResult};
use super::{AgentError, Result};
use moult_operator::children::SANDBOX_ENV;

const PACKAGE: [(&str, &str); 4] = [
    (
        "__init__.py",
        include_str!("../../python/moult/__init__.py"),
    ),
    ("runner.py", include_str!("../../python/moult/runner.py")),
    // The built-in `math` env (docs/agents.md), run as `python3 -m moult.runner run moult.math`.
    ("math.py", include_str!("../../python/moult/math.py")),
    ("sandbox.py", include_str!("../../python/moult/sandbox.py")),
];

/// The folder to put on `PYTHONPATH` for `import moult`.
pub fn python_package_dir() -> Result<&'static Path> {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    if let Some(dir) = DIR.get() {
        return Ok(dir);
    }
    use sha2::Digest as _;
    let digest = (PACKAGE.iter()).fold(sha2::Sha256::new(), |h, (_, text)| h.chain_update(text));
    let dir = std::env::temp_dir().join(format!("moult-python-{:x}", digest.finalize()));
    let package = dir.join("moult");
    std::fs::create_dir_all(&package)
        .map_err(|e| AgentError::Config(format!("cannot create {}: {e}", package.display())))?;
    for (name, text) in PACKAGE {
        let path = package.join(name);
        if std::fs::read_to_string(&path).ok().as_deref() != Some(text) {
            // Written whole, then renamed, so concurrent pools never import half a file.
            let staging = package.join(format!(".{name}.{}", std::process::id()));
            std::fs::write(&staging, text)
                .and_then(|()| std::fs::rename(&staging, &path))
                .map_err(|e| AgentError::Config(format!("cannot write {}: {e}", path.display())))?;
        }
    }
    Ok(DIR.get_or_init(|| dir))
}

/// Starts `cmd` with a cleared environment ([`program::environment`]: never a credential), its
/// own variables and `extra`, its three streams piped, in `jail` when there is one, in the agent
/// pod's sandbox container where `MOULT_AGENT_SANDBOX` names one.
async fn start(
    cmd: &AgentCommand,
    extra: Vec<(String, String)>,
    jail: Option<&Jail>,
) -> Result<Program> {
    let mut env = program::environment(std::env::vars(), &crate::auth::CREDENTIAL_ENVS);
    env.extend(cmd.env.iter().cloned().chain(extra));
    let started = Program::start(sandbox(), &cmd.program, &cmd.args, env, jail).await;
    started.map_err(|e| AgentError::Crashed(e.to_string()))
}

/// Runs `cmd` (started as [`start`] does) to its end with `input` on its stdin; whatever it
/// started dies with it. Its stdout's and stderr's tails are kept.
async fn run(
    cmd: &AgentCommand,
    extra: Vec<(String, String)>,
    input: String,
    jail: Option<&Jail>,
) -> Result<(Exit, Tail, Tail)> {
    let ran = start(cmd, extra, jail).await?.run(input).await;
    ran.map_err(|e| AgentError::Crashed(format!("waiting for the agent: {e}")))
}

/// The socket of the sandbox agent programs start in, when this process has one.
pub fn sandbox() -> Option<&'static Path> {
    static SOCKET: OnceLock<Option<PathBuf>> = OnceLock::new();
    let socket = || std::env::var_os(SANDBOX_ENV).filter(|s| !s.is_empty());
    SOCKET
        .get_or_init(|| socket().map(PathBuf::from))
        .as_deref()
}

/// How to start an agent program.
#[derive(Debug, Clone)]
pub struct AgentCommand {
    pub program: String,
    pub args: Vec<String>,
    pub env: Vec<(String, String)>,
}

impl AgentCommand {
    /// This command with `vars` added to its environment.
    pub fn with_env(&self, vars: Vec<(String, String)>) -> Self {
        let env = [self.env.clone(), vars].concat();
        Self {
            env,
            ..self.clone()
        }
    }

    /// `python -m moult.runner run PATH` for a Python module exporting `AgentRunner`.
    pub fn python(python: &str, module: &str) -> Result<Self> {
        let package = python_package_dir()?;
        let mut path = package.display().to_string();
        if let Some(existing) = std::env::var_os("PYTHONPATH") {
            path = format!("{path}:{}", existing.to_string_lossy());
        }
        Ok(Self {
            program: python.to_string(),
            args: ["-m", "moult.runner", "run", module]
                .map(String::from)
                .to_vec(),
            env: vec![("PYTHONPATH".into(), path)],
        })
    }

    /// A shell-free command line split on whitespace.
    pub fn parse(line: &str) -> Result<Self> {
        let mut parts = line.split_whitespace().map(str::to_string);
        let program = (parts.next())
            .ok_or_else(|| AgentError::Config("the agent command is empty".into()))?;
        Ok(Self {
            program,
            args: parts.collect(),
            env: Vec::new(),
        })
    }
}

/// Asks a Python agent module which form it is (`chat` or `env`), in `jail` if there is one.
pub async fn describe_python(python: &str, module: &str, jail: Option<&Jail>) -> Result<String> {
    let mut cmd = AgentCommand::python(python, module)?;
    cmd.args[2] = "describe".into();
    let (exit, stdout, stderr) = run(&cmd, Vec::new(), String::new(), jail)
        .await
        .map_err(|e| AgentError::Config(format!("cannot run `{python}`: {e}")))?;
    // The streams end with the program; their last bytes may still be on their way.
    let (out, err) = (stdout.finished().await, stderr.finished().await);
    if !exit.success() {
        let why = format!("the agent module {module} failed to load ({exit}): {err}");
        return Err(AgentError::Config(why));
    }
    Ok(out)
}

/// The largest task also given in `MOULT_TASK` (larger ones only in `MOULT_TASK_FILE`).
const TASK_ENV_BYTES: usize = 64 << 10;

/// Removes a folder when dropped (the episode's task and result files, however it ends).
struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Why a program's end failed its episode: how it ended, the limit of `jail` that its signal or
/// its last words (`why`, the end of its stderr) point to, and those words.
fn ended(what: &str, how: &str, signal: Option<i32>, jail: Option<&Jail>, why: &str) -> String {
    match jail.and_then(|j| j.limits.hit(signal, why)) {
        Some(limit) => format!("the {what} {how} at the limit {limit}: {why}"),
        None => format!("the {what} {how}: {why}"),
    }
}

/// The longest line an env process may answer with (an observation, as JSON).
const ENV_LINE_BYTES: usize = 16 << 20;

/// Runs one ChatAgent episode, in `jail` if there is one: the program gets the loopback base
/// URLs, the session id and the task in its environment (and the task on stdin), and writes
/// `{"reward", "info"}` to `MOULT_RESULT_FILE`, in the folder `dir` made for the episode; its
/// reward and info.
pub async fn run_chat_agent(
    cmd: &AgentCommand,
    mut env: Vec<(String, String)>,
    task: &Json,
    dir: &Path,
    jail: Option<&Jail>,
) -> Result<(f64, serde_json::Map<String, Json>)> {
    let (result_file, task_file) = (dir.join("result.json"), dir.join("task.json"));
    let task_text = task.to_string();
    // The task goes in a file (an environment variable's size is limited by the kernel), and in
    // `MOULT_TASK` too when it is small.
    let file = task_file.display();
    std::fs::create_dir_all(dir)
        .and_then(|()| std::fs::write(&task_file, &task_text))
        .map_err(|e| AgentError::Crashed(format!("cannot write the task to {file}: {e}")))?;
    let _dir = RemoveOnDrop(dir.to_path_buf());
    env.push(("MOULT_TASK_FILE".into(), task_file.display().to_string()));
    let result_path = result_file.display().to_string();
    env.push(("MOULT_RESULT_FILE".into(), result_path));
    if task_text.len() <= TASK_ENV_BYTES {
        env.push(("MOULT_TASK".into(), task_text.clone()));
    }
    let (exit, stdout, stderr) = run(cmd, env, format!("{task_text}\n"), jail).await?;
    let result = std::fs::read_to_string(result_file);
    if !exit.success() {
        let mut why = stderr.finished().await;
        if why.is_empty() {
            why = stdout.finished().await;
        }
        let why = ended("agent", &exit.to_string(), exit.signal(), jail, &why);
        return Err(AgentError::Crashed(why));
    }
    let unwritten = "the agent exited without writing its result to MOULT_RESULT_FILE";
    let text = result.map_err(|_| AgentError::Crashed(unwritten.into()))?;
    let v: Json = serde_json::from_str(&text)
        .map_err(|e| AgentError::Crashed(format!("the agent's result is not JSON: {e}")))?;
    let no_reward = || format!("the agent's result has no numeric `reward`: {text}");
    let reward = (v["reward"].as_f64()).ok_or_else(|| AgentError::Crashed(no_reward()))?;
    Ok((reward, v["info"].as_object().cloned().unwrap_or_default()))
}

/// An environment in another process, over JSON lines on its stdin/stdout. It serves episodes
/// one after another: each `reset` starts a new one.
pub struct ExternalEnv {
    cmd: AgentCommand,
    jail: Option<Jail>,
    /// Held for its drop: the process group dies with the env.
    child: Program,
    stdin: Writer,
    stdout: BufReader<Reader>,
    stderr: Tail,
    /// Episodes started in this process.
    episodes: usize,
}

impl std::fmt::Debug for ExternalEnv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExternalEnv")
            .field("cmd", &self.cmd)
            .field("episodes", &self.episodes)
            .finish_non_exhaustive()
    }
}

impl ExternalEnv {
    /// Starts `cmd`, in `jail` if there is one (then the process serves one episode).
    pub async fn spawn(cmd: &AgentCommand, jail: Option<Jail>) -> Result<Self> {
        let mut group = start(cmd, Vec::new(), jail.as_ref()).await?;
        let stdin = group.stdin.take().expect("piped");
        let stdout = BufReader::new(group.stdout.take().expect("piped"));
        let stderr = Tail::keep(group.stderr.take());
        Ok(Self {
            cmd: cmd.clone(),
            jail,
            child: group,
            stdin,
            stdout,
            stderr,
            episodes: 0,
        })
    }

    /// Why the process stopped answering: how it ended (waited for a moment), with the limit
    /// that ended it.
    async fn gone(&mut self, what: &str) -> AgentError {
        let exit = tokio::time::timeout(std::time::Duration::from_secs(1), self.child.wait());
        let signal = exit.await.ok().and_then(Result::ok).and_then(Exit::signal);
        let why = self.stderr.text();
        AgentError::Crashed(ended("env process", what, signal, self.jail.as_ref(), &why))
    }

    async fn call(&mut self, request: Json) -> Result<Json> {
        let line = format!("{request}\n");
        if self.stdin.write_all(line.as_bytes()).await.is_err() {
            return Err(self.gone("closed its input").await);
        }
        let _ = self.stdin.flush().await;
        let mut answer = Vec::new();
        match (&mut self.stdout)
            .take(ENV_LINE_BYTES as u64 + 1)
            .read_until(b'\n', &mut answer)
            .await
        {
            Ok(0) | Err(_) => return Err(self.gone("exited").await),
            Ok(_) if answer.len() > ENV_LINE_BYTES => {
                let mib = ENV_LINE_BYTES >> 20;
                let message = format!("the env answered with a line over {mib} MiB");
                return Err(AgentError::Env(message));
            }
            Ok(_) => {}
        }
        let answer = String::from_utf8_lossy(&answer);
        let v: Json = serde_json::from_str(&answer).map_err(|e| {
            AgentError::Env(format!(
                "the env answered with invalid JSON ({e}): {answer:?}"
            ))
        })?;
        if let Some(err) = v.get("error") {
            let message = err.as_str().map_or_else(|| err.to_string(), str::to_string);
            return Err(AgentError::Env(message));
        }
        Ok(v)
    }
}

impl Env for ExternalEnv {
    fn reset<'a>(&'a mut self, task: &'a Json) -> BoxFuture<'a, Result<Observation>> {
        Box::pin(async move {
            let request = serde_json::json!({"method": "reset", "task": task});
            // A failure's reason quotes this episode's stderr, not an earlier one's.
            self.stderr.clear();
            let v = match self.call(request.clone()).await {
                // A program written to serve one episode may have exited after it: start afresh.
                Err(AgentError::Crashed(_)) if self.episodes > 0 => {
                    *self = Self::spawn(&self.cmd, self.jail.clone()).await?;
                    self.call(request).await?
                }
                answer => answer?,
            };
            self.episodes += 1;
            let observation = v.get("observation").cloned().ok_or_else(|| {
                AgentError::Env(format!("reset answered without an observation: {v}"))
            })?;
            serde_json::from_value(observation).map_err(|e| {
                AgentError::Env(format!(
                    "reset answered an observation that is neither text nor a list of text and image parts: {e}"
                ))
            })
        })
    }

    fn step<'a>(&'a mut self, action: &'a str) -> BoxFuture<'a, Result<StepResult>> {
        Box::pin(async move {
            let step = serde_json::json!({"method": "step", "action": action});
            let v = self.call(step).await?;
            serde_json::from_value(v.clone())
                .map_err(|e| AgentError::Env(format!("step answered {v}: {e}")))
        })
    }
}
