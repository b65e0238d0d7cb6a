//! Agents that are programs: a `ChatAgent` process per episode, and external `Env`s speaking the
//! JSON-lines protocol. Python agents run through the small `moult` package, which is embedded in
//! this binary and written to a temporary folder on first use (so `moult agents` needs nothing
//! installed besides Python and the agent's own dependencies).
//!
//! Agent code is untrusted (docs/security.md): every child starts with a cleared environment
//! ([`agent_environment`]: no credential, only what programs need to run), in a process group of
//! its own, and the whole group is killed when its episode is dropped (timeout, pool shutdown) or
//! its process has answered, so nothing an agent started outlives it. Its stderr's tail is kept
//! for the failure reason. An external env process may serve many episodes: each `reset` starts
//! the next one; its answers are read a bounded line at a time.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex, OnceLock};

use futures::future::BoxFuture;
use serde_json::Value as Json;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};

use super::env::{Env, StepResult};
use super::AgentError;

const PACKAGE: [(&str, &str); 2] = [
    (
        "__init__.py",
        include_str!("../../python/moult/__init__.py"),
    ),
    ("runner.py", include_str!("../../python/moult/runner.py")),
];

/// The folder to put on `PYTHONPATH` for `import moult`.
pub fn python_package_dir() -> Result<&'static Path, AgentError> {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    if let Some(dir) = DIR.get() {
        return Ok(dir);
    }
    let digest = PACKAGE.iter().fold(0xcbf29ce484222325u64, |h, (_, text)| {
        text.bytes()
            .fold(h, |h, b| (h ^ b as u64).wrapping_mul(0x100000001b3))
    });
    let dir = std::env::temp_dir().join(format!("moult-python-{digest:016x}"));
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

/// Variables of moult's own environment that agent programs get (all others are withheld: the
/// run's credentials above all): what finding programs, libraries, locales and certificates
/// needs. Names listed in `MOULT_AGENT_PASS_ENV` (comma-separated) are passed too.
const PASSED_ENV: [&str; 22] = [
    "PATH",
    "HOME",
    "USER",
    "LOGNAME",
    "SHELL",
    "LANG",
    "LANGUAGE",
    "TZ",
    "TERM",
    "TMPDIR",
    "LD_LIBRARY_PATH",
    "VIRTUAL_ENV",
    "CONDA_PREFIX",
    "SSL_CERT_FILE",
    "SSL_CERT_DIR",
    "REQUESTS_CA_BUNDLE",
    "CURL_CA_BUNDLE",
    "HF_HOME",
    "HF_HUB_OFFLINE",
    "TRANSFORMERS_OFFLINE",
    "NO_PROXY",
    "no_proxy",
];
/// Prefixes of passed variables: locales, and Python's own settings.
const PASSED_PREFIXES: [&str; 2] = ["LC_", "PYTHON"];
/// The variable that names more variables to pass.
pub const PASS_ENV_VAR: &str = "MOULT_AGENT_PASS_ENV";

/// The environment an agent program starts with, from `vars` (this process's environment):
/// [`PASSED_ENV`], [`PASSED_PREFIXES`] and what [`PASS_ENV_VAR`] names, never a credential.
pub fn agent_environment(vars: impl Iterator<Item = (String, String)>) -> Vec<(String, String)> {
    let vars: Vec<(String, String)> = vars.collect();
    let extra: Vec<String> = vars
        .iter()
        .find(|(k, _)| k == PASS_ENV_VAR)
        .map(|(_, v)| {
            v.split(',')
                .map(|n| n.trim().to_string())
                .filter(|n| !n.is_empty())
                .collect()
        })
        .unwrap_or_default();
    vars.into_iter()
        .filter(|(k, _)| {
            !crate::auth::CREDENTIAL_ENVS.contains(&k.as_str())
                && (PASSED_ENV.contains(&k.as_str())
                    || PASSED_PREFIXES.iter().any(|p| k.starts_with(p))
                    || extra.contains(k))
        })
        .collect()
}

/// A child in a process group of its own (its pid is the group's id): dropping it kills the
/// whole group, whatever the child started, even once the child itself has exited.
#[derive(Debug)]
struct Group {
    child: Child,
    /// Kept from the start: `Child::id` forgets the pid once the child has been waited for.
    pgid: Option<nix::unistd::Pid>,
}

impl Group {
    fn spawn(mut c: Command, program: &str) -> Result<Self, AgentError> {
        let child = c
            .process_group(0)
            .spawn()
            .map_err(|e| AgentError::Crashed(format!("cannot start `{program}`: {e}")))?;
        let pgid = child
            .id()
            .and_then(|p| i32::try_from(p).ok())
            .map(nix::unistd::Pid::from_raw);
        Ok(Self { child, pgid })
    }
}

impl Drop for Group {
    fn drop(&mut self) {
        if let Some(pgid) = self.pgid {
            // ESRCH (the group is gone already) is the common case, not an error.
            let _ = nix::sys::signal::killpg(pgid, nix::sys::signal::Signal::SIGKILL);
        }
        let _ = self.child.start_kill();
    }
}

/// How to start an agent program.
#[derive(Debug, Clone)]
pub struct AgentCommand {
    pub program: String,
    pub args: Vec<String>,
    pub env: Vec<(String, String)>,
}

impl AgentCommand {
    /// `python -m moult.runner run PATH` for a Python module exporting `AgentRunner`.
    pub fn python(python: &str, module: &str) -> Result<Self, AgentError> {
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
    pub fn parse(line: &str) -> Result<Self, AgentError> {
        let mut parts = line.split_whitespace().map(str::to_string);
        let program = parts
            .next()
            .ok_or_else(|| AgentError::Config("the agent command is empty".into()))?;
        Ok(Self {
            program,
            args: parts.collect(),
            env: Vec::new(),
        })
    }

    fn command(&self) -> Command {
        let mut c = Command::new(&self.program);
        c.args(&self.args)
            .env_clear()
            .envs(agent_environment(std::env::vars()))
            .envs(self.env.iter().cloned())
            .kill_on_drop(true);
        c
    }
}

/// Asks a Python agent module which form it is (`chat` or `env`).
pub async fn describe_python(python: &str, module: &str) -> Result<String, AgentError> {
    let mut cmd = AgentCommand::python(python, module)?;
    cmd.args[2] = "describe".into();
    let out = cmd
        .command()
        .output()
        .await
        .map_err(|e| AgentError::Config(format!("cannot run `{python}`: {e}")))?;
    if !out.status.success() {
        return Err(AgentError::Config(format!(
            "the agent module {module} failed to load: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// The largest task also given in `MOULT_TASK` (larger ones only in `MOULT_TASK_FILE`).
const TASK_ENV_BYTES: usize = 64 << 10;

/// Removes a file when dropped (the episode's task file, however the episode ends).
struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// The longest line an env process may answer with (an observation, as JSON).
const ENV_LINE_BYTES: usize = 16 << 20;

/// The last bytes a child wrote to a pipe (bounded: a chatty agent costs no more than this).
const TAIL_BYTES: usize = 4096;

fn keep_tail(pipe: impl tokio::io::AsyncRead + Unpin + Send + 'static) -> Arc<Mutex<Vec<u8>>> {
    let tail = Arc::new(Mutex::new(Vec::new()));
    let sink = tail.clone();
    tokio::spawn(async move {
        let mut pipe = pipe;
        let mut buf = [0u8; 4096];
        while let Ok(n) = pipe.read(&mut buf).await {
            if n == 0 {
                break;
            }
            let mut t = sink.lock().expect("tail lock");
            t.extend_from_slice(&buf[..n]);
            if t.len() > TAIL_BYTES {
                let cut = t.len() - TAIL_BYTES;
                t.drain(..cut);
            }
        }
    });
    tail
}

fn tail_text(tail: &Mutex<Vec<u8>>) -> String {
    String::from_utf8_lossy(&tail.lock().expect("tail lock"))
        .trim()
        .to_string()
}

/// What a ChatAgent process reported.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatOutcome {
    pub reward: f64,
    pub info: serde_json::Map<String, Json>,
}

/// Runs one ChatAgent episode: the program gets the loopback base URLs, the session id and the
/// task in its environment (and the task on stdin), and writes `{"reward", "info"}` to
/// `MOULT_RESULT_FILE`.
pub async fn run_chat_agent(
    cmd: &AgentCommand,
    env: &[(String, String)],
    task: &Json,
    result_file: &Path,
) -> Result<ChatOutcome, AgentError> {
    let _ = std::fs::remove_file(result_file);
    let task_text = task.to_string();
    // The task goes in a file (an environment variable's size is limited by the kernel), and in
    // `MOULT_TASK` too when it is small.
    let task_file = result_file.with_extension("task.json");
    std::fs::write(&task_file, &task_text).map_err(|e| {
        AgentError::Crashed(format!(
            "cannot write the task to {}: {e}",
            task_file.display()
        ))
    })?;
    let _task_file = RemoveOnDrop(task_file.clone());
    let mut c = cmd.command();
    c.envs(env.iter().cloned())
        .env("MOULT_TASK_FILE", &task_file)
        .env("MOULT_RESULT_FILE", result_file)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if task_text.len() <= TASK_ENV_BYTES {
        c.env("MOULT_TASK", &task_text);
    }
    let mut group = Group::spawn(c, &cmd.program)?;
    let child = &mut group.child;
    if let Some(mut stdin) = child.stdin.take() {
        // The agent may not read its stdin: written aside (a task larger than the pipe's buffer
        // would block here otherwise), and a closed pipe is not an error.
        let line = format!("{task_text}\n");
        tokio::spawn(async move {
            let _ = stdin.write_all(line.as_bytes()).await;
        });
    }
    let stdout = keep_tail(child.stdout.take().expect("piped"));
    let stderr = keep_tail(child.stderr.take().expect("piped"));
    let status = child
        .wait()
        .await
        .map_err(|e| AgentError::Crashed(format!("waiting for the agent: {e}")))?;
    // Whatever the agent left running goes with it.
    drop(group);
    let result = std::fs::read_to_string(result_file);
    let _ = std::fs::remove_file(result_file);
    if !status.success() {
        let mut why = tail_text(&stderr);
        if why.is_empty() {
            why = tail_text(&stdout);
        }
        return Err(AgentError::Crashed(format!("the agent {status}: {why}")));
    }
    let text = result.map_err(|_| {
        AgentError::Crashed(
            "the agent exited without writing its result to MOULT_RESULT_FILE".into(),
        )
    })?;
    let v: Json = serde_json::from_str(&text)
        .map_err(|e| AgentError::Crashed(format!("the agent's result is not JSON: {e}")))?;
    let reward = v.get("reward").and_then(Json::as_f64).ok_or_else(|| {
        AgentError::Crashed(format!(
            "the agent's result has no numeric `reward`: {text}"
        ))
    })?;
    let info = v
        .get("info")
        .and_then(Json::as_object)
        .cloned()
        .unwrap_or_default();
    Ok(ChatOutcome { reward, info })
}

/// An environment in another process, over JSON lines on its stdin/stdout. It serves episodes
/// one after another: each `reset` starts a new one.
#[derive(Debug)]
pub struct ExternalEnv {
    cmd: AgentCommand,
    /// Held for its drop: the process group dies with the env.
    _child: Group,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    stderr: Arc<Mutex<Vec<u8>>>,
    /// Episodes started in this process.
    episodes: usize,
}

impl ExternalEnv {
    pub fn spawn(cmd: &AgentCommand) -> Result<Self, AgentError> {
        let mut c = cmd.command();
        c.stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut group = Group::spawn(c, &cmd.program)?;
        let child = &mut group.child;
        let stdin = child.stdin.take().expect("piped");
        let stdout = BufReader::new(child.stdout.take().expect("piped"));
        let stderr = keep_tail(child.stderr.take().expect("piped"));
        Ok(Self {
            cmd: cmd.clone(),
            _child: group,
            stdin,
            stdout,
            stderr,
            episodes: 0,
        })
    }

    async fn call(&mut self, request: Json) -> Result<Json, AgentError> {
        let gone = |this: &Self, what: &str| {
            AgentError::Crashed(format!(
                "the env process {what}: {}",
                tail_text(&this.stderr)
            ))
        };
        let line = format!("{request}\n");
        if self.stdin.write_all(line.as_bytes()).await.is_err() {
            return Err(gone(self, "closed its input"));
        }
        let _ = self.stdin.flush().await;
        let mut answer = Vec::new();
        match (&mut self.stdout)
            .take(ENV_LINE_BYTES as u64 + 1)
            .read_until(b'\n', &mut answer)
            .await
        {
            Ok(0) | Err(_) => return Err(gone(self, "exited")),
            Ok(_) if answer.len() > ENV_LINE_BYTES => {
                return Err(AgentError::Env(format!(
                    "the env answered with a line over {} MiB",
                    ENV_LINE_BYTES >> 20
                )))
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
            return Err(AgentError::Env(
                err.as_str().map_or_else(|| err.to_string(), str::to_string),
            ));
        }
        Ok(v)
    }
}

impl Env for ExternalEnv {
    fn reset<'a>(&'a mut self, task: &'a Json) -> BoxFuture<'a, Result<String, AgentError>> {
        Box::pin(async move {
            let request = serde_json::json!({"method": "reset", "task": task});
            // A failure's reason quotes this episode's stderr, not an earlier one's.
            self.stderr.lock().expect("tail lock").clear();
            let v = match self.call(request.clone()).await {
                // A program written to serve one episode may have exited after it: start afresh.
                Err(AgentError::Crashed(_)) if self.episodes > 0 => {
                    *self = Self::spawn(&self.cmd)?;
                    self.call(request).await?
                }
                answer => answer?,
            };
            self.episodes += 1;
            v.get("observation")
                .and_then(Json::as_str)
                .map(str::to_string)
                .ok_or_else(|| {
                    AgentError::Env(format!("reset answered without an observation: {v}"))
                })
        })
    }

    fn step<'a>(&'a mut self, action: &'a str) -> BoxFuture<'a, Result<StepResult, AgentError>> {
        Box::pin(async move {
            let v = self
                .call(serde_json::json!({"method": "step", "action": action}))
                .await?;
            serde_json::from_value(v.clone())
                .map_err(|e| AgentError::Env(format!("step answered {v}: {e}")))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn agents_get_a_cleared_environment_without_credentials() {
        let vars = [
            ("PATH", "/usr/bin"),
            ("LC_ALL", "C.UTF-8"),
            ("PYTHONPATH", "/x"),
            ("MOULT_TOKEN", "run-secret"),
            ("MOULT_AGENT_TOKEN", "agent-secret"),
            ("KUBECONFIG", "/k"),
            ("AWS_SECRET_ACCESS_KEY", "s"),
            ("SERPAPI_KEY", "k"),
            // Naming a credential does not pass it.
            (PASS_ENV_VAR, "SERPAPI_KEY, MOULT_TOKEN,,MOULT_AGENT_TOKEN"),
        ]
        .map(|(k, v)| (k.to_string(), v.to_string()));
        let env = agent_environment(vars.into_iter());
        let names: Vec<&str> = env.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(names, ["PATH", "LC_ALL", "PYTHONPATH", "SERPAPI_KEY"]);
        assert!(agent_environment(std::iter::empty()).is_empty());
    }
}
