//! An untrusted program as its caller holds it: started with a cleared environment
//! ([`environment`]), in a process group of its own or a jail, here or in the sandbox container
//! ([`Program`]), with the last bytes of its streams kept for the reason of its failure
//! ([`Tail`]).

use std::path::Path;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::sandbox::{Exit, ProcessGroup, Sandboxed};
use crate::Jail;

/// Variables of the caller's environment that untrusted programs get (all others are withheld:
/// credentials above all): what finding programs, libraries, locales and certificates needs.
/// Names listed in [`PASS_ENV_VAR`] (comma-separated) are passed too.
#[rustfmt::skip]
const PASSED_ENV: [&str; 22] = [
    // Programs, libraries and locales.
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TZ", "TERM", "TMPDIR",
    "LD_LIBRARY_PATH", "VIRTUAL_ENV", "CONDA_PREFIX",
    // Certificates, models and proxies.
    "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE",
    "HF_HOME", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "NO_PROXY", "no_proxy",
];
/// Prefixes of passed variables: locales, and Python's own settings.
const PASSED_PREFIXES: [&str; 2] = ["LC_", "PYTHON"];
/// The variable that names more variables to pass.
pub const PASS_ENV_VAR: &str = "MOULT_AGENT_PASS_ENV";

/// The environment an untrusted program starts with, from `vars` (the caller's environment):
/// [`PASSED_ENV`], [`PASSED_PREFIXES`] and what [`PASS_ENV_VAR`] names, never one of `withheld`.
pub fn environment(
    vars: impl Iterator<Item = (String, String)>,
    withheld: &[&str],
) -> Vec<(String, String)> {
    let vars: Vec<(String, String)> = vars.collect();
    let extra: Vec<&str> = (vars.iter().find(|(k, _)| k == PASS_ENV_VAR))
        .map(|(_, v)| v.split(',').map(str::trim).collect())
        .unwrap_or_default();
    let passed =
        |k: &str| PASSED_ENV.contains(&k) || PASSED_PREFIXES.iter().any(|p| k.starts_with(p));
    let passed = |k: &str| !withheld.contains(&k) && (passed(k) || extra.contains(&k));
    (vars.iter().filter(|(k, _)| passed(k)).cloned()).collect()
}

/// A program's stream, wherever it runs.
pub type Reader = Box<dyn tokio::io::AsyncRead + Send + Unpin>;
pub type Writer = Box<dyn tokio::io::AsyncWrite + Send + Unpin>;

/// An untrusted program in a process group of its own, killed whole when this is dropped: a
/// child of this process, or started in the sandbox (when there is a socket) with the same
/// streams and lifetime.
pub struct Program {
    running: Running,
    pub stdin: Option<Writer>,
    pub stdout: Option<Reader>,
    pub stderr: Option<Reader>,
}

enum Running {
    Local(ProcessGroup),
    /// Closing the control connection (dropping this) kills the group in the sandbox.
    Sandboxed(Sandboxed),
}

impl Program {
    /// Starts `program` with exactly `env`, its three streams piped, in the sandbox at `socket`
    /// if there is one, in `jail` if there is one.
    pub async fn start(
        socket: Option<&Path>,
        program: &str,
        args: &[String],
        env: Vec<(String, String)>,
        jail: Option<&Jail>,
    ) -> std::io::Result<Self> {
        if let Some(socket) = socket {
            let mut p = Sandboxed::spawn(socket, program, args, env, jail).await?;
            return Ok(Self {
                stdin: p.stdin.take().map(|s| Box::new(s) as Writer),
                stdout: p.stdout.take().map(|s| Box::new(s) as Reader),
                stderr: p.stderr.take().map(|s| Box::new(s) as Reader),
                running: Running::Sandboxed(p),
            });
        }
        let piped = [(); 3].map(|()| Stdio::piped());
        let mut p = ProcessGroup::spawn(program, args, env, piped, jail)?;
        Ok(Self {
            stdin: p.child.stdin.take().map(|s| Box::new(s) as Writer),
            stdout: p.child.stdout.take().map(|s| Box::new(s) as Reader),
            stderr: p.child.stderr.take().map(|s| Box::new(s) as Reader),
            running: Running::Local(p),
        })
    }

    /// Waits for the program (not what it started) to end.
    pub async fn wait(&mut self) -> std::io::Result<Exit> {
        match &mut self.running {
            Running::Local(p) => p.child.wait().await.map(Exit::of),
            Running::Sandboxed(p) => p.wait().await,
        }
    }
}

impl Program {
    /// Runs the program to its end with `input` on its stdin, keeping the tails of its stdout
    /// and stderr; whatever it started dies with it.
    pub async fn run(mut self, input: String) -> std::io::Result<(Exit, Tail, Tail)> {
        if let Some(mut stdin) = self.stdin.take() {
            // The program may not read its stdin: written aside (an input larger than the
            // pipe's buffer would block here otherwise), and a closed pipe is not an error.
            tokio::spawn(async move { stdin.write_all(input.as_bytes()).await });
        }
        let (stdout, stderr) = (
            Tail::keep(self.stdout.take()),
            Tail::keep(self.stderr.take()),
        );
        Ok((self.wait().await?, stdout, stderr))
    }
}

/// The last bytes a program wrote to one of its streams (bounded: a chatty program costs no
/// more than this).
const TAIL_BYTES: usize = 4096;

/// How long the rest of a stream may take to arrive once its program has ended.
const TAIL_GRACE: Duration = Duration::from_secs(1);

/// The last [`TAIL_BYTES`] a program wrote to one of its streams, read as they come.
#[derive(Debug)]
pub struct Tail {
    bytes: Arc<Mutex<Vec<u8>>>,
    reader: tokio::task::JoinHandle<()>,
}

impl Tail {
    /// Reads `pipe` to its end, keeping its tail.
    pub fn keep(pipe: Option<Reader>) -> Self {
        let bytes = Arc::new(Mutex::new(Vec::new()));
        let sink = bytes.clone();
        let reader = tokio::spawn(async move {
            let Some(mut pipe) = pipe else { return };
            let mut buf = [0u8; 4096];
            while let Ok(n @ 1..) = pipe.read(&mut buf).await {
                let mut t = sink.lock().expect("tail lock");
                t.extend_from_slice(&buf[..n]);
                let cut = t.len().saturating_sub(TAIL_BYTES);
                t.drain(..cut);
            }
        });
        Self { bytes, reader }
    }

    /// What has arrived so far.
    pub fn text(&self) -> String {
        let bytes = self.bytes.lock().expect("tail lock");
        String::from_utf8_lossy(&bytes).trim().to_string()
    }

    /// Forgets what has arrived so far.
    pub fn clear(&self) {
        self.bytes.lock().expect("tail lock").clear();
    }

    /// Everything, once the stream has ended (or [`TAIL_GRACE`] after the call).
    pub async fn finished(mut self) -> String {
        let _ = tokio::time::timeout(TAIL_GRACE, &mut self.reader).await;
        self.text()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn programs_get_a_cleared_environment_without_credentials() {
        let vars = [
            ("PATH", "/usr/bin"),
            ("LC_ALL", "C.UTF-8"),
            ("PYTHONPATH", "/x"),
            ("MOULT_TOKEN", "run-secret"),
            ("MOULT_AGENT_TOKEN", "agent-secret"),
            ("KUBECONFIG", "/k"),
            ("AWS_SECRET_ACCESS_KEY", "s"),
            ("SERPAPI_KEY", "k"),
            // Naming a withheld variable does not pass it.
            (PASS_ENV_VAR, "SERPAPI_KEY, MOULT_TOKEN,,MOULT_AGENT_TOKEN"),
        ]
        .map(|(k, v)| (k.to_string(), v.to_string()));
        let withheld = ["MOULT_TOKEN", "MOULT_AGENT_TOKEN"];
        let env = environment(vars.into_iter(), &withheld);
        let names: Vec<&str> = env.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(names, ["PATH", "LC_ALL", "PYTHONPATH", "SERPAPI_KEY"]);
        assert!(environment(std::iter::empty(), &withheld).is_empty());
    }
}
