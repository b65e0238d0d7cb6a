//! vLLM engines for `moult run` (docs/vllm.md, "moult run with vLLM"): each one a `python -m
//! vllm.entrypoints.openai.api_server` process with the same flags the operator gives vLLM pods
//! ([`moult_operator::children::vllm_args`]), on a loopback port, in a process group of its own
//! (vLLM starts engine-core children) that is stopped as a whole when the run ends.
//!
//! Which Python has vLLM: `MOULT_VLLM_PYTHON`, else `python3` on the `PATH`.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use tch::Device;

use crate::config::RunConfig;
use crate::error::{Result, RunError};
use crate::records::console::Console;

/// How long vLLM may take to serve (it imports torch, loads the model, profiles memory).
const START_TIMEOUT: Duration = Duration::from_secs(600);

/// The Python that runs vLLM.
pub fn python() -> PathBuf {
    std::env::var_os("MOULT_VLLM_PYTHON")
        .filter(|p| !p.is_empty())
        .map_or_else(|| PathBuf::from("python3"), PathBuf::from)
}

/// A vLLM server this process started; dropping it stops the server and its children.
#[derive(Debug)]
pub struct VllmProcess {
    child: Child,
    pub url: String,
    log: PathBuf,
}

/// A free loopback port for [`VllmProcess::spawn`] (vLLM binds its own socket, so the port is
/// only likely to stay free).
pub fn free_port() -> Result<u16> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(RunError::start("finding a free port for vLLM"))
}

/// The last `n` lines of `path`.
fn tail(path: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

impl VllmProcess {
    /// Starts engine `index` of `cfg` and waits until it serves; its output goes to
    /// `<logs>/vllm-<index>.log`.
    pub async fn start(
        cfg: &RunConfig,
        index: usize,
        device: Device,
        logs: &Path,
        console: &Console,
    ) -> Result<Self> {
        let port = free_port()?;
        let model = cfg.model_dir.display().to_string();
        let mut args = moult_operator::children::vllm_args(
            &cfg.run.spec,
            &model,
            "127.0.0.1",
            port,
            &cfg.name,
            moult_operator::children::EngineRole::Policy,
        );
        // `vllm serve MODEL` takes the model as its first argument; the API server module (what
        // runs here: the console script of vLLM's CPU wheel does not start) wants `--model`.
        args.insert(0, "--model".into());
        std::fs::create_dir_all(logs).map_err(|e| RunError::file("creating", logs, e))?;
        let log = logs.join(format!("vllm-{index}.log"));
        console.phase(format!(
            "starting vLLM engine {index} (about a minute on a CPU; log: {})",
            log.display()
        ));
        let cpu_threads = (device == Device::Cpu).then_some(1);
        Self::spawn(&args, port, &log, cpu_threads).await
    }

    /// Starts `python -m vllm.entrypoints.openai.api_server ARGS` (which must listen on
    /// 127.0.0.1:`port`) with its output in `log`, and waits until it serves. `cpu_threads`: on a
    /// CPU, vLLM's OpenMP threads, unpinned (unless the environment sets them).
    pub async fn spawn(
        args: &[String],
        port: u16,
        log: &Path,
        cpu_threads: Option<usize>,
    ) -> Result<Self> {
        use std::os::unix::process::CommandExt;
        let out = std::fs::File::create(log).map_err(|e| RunError::file("creating", log, e))?;
        let err = out
            .try_clone()
            .map_err(|e| RunError::file("opening", log, e))?;
        let python = python();
        let mut command = Command::new(&python);
        command
            .args(["-m", "vllm.entrypoints.openai.api_server"])
            .args(args)
            // Serves /pause, /resume and /collective_rpc; and a LoRA run's adapters at run time.
            .env("VLLM_SERVER_DEV_MODE", "1")
            .env("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .process_group(0);
        if let Some(threads) = cpu_threads {
            // vLLM's CPU build binds spinning OpenMP threads to every core otherwise, starving
            // the trainer and the agents that share the machine.
            let threads = threads.to_string();
            for (name, value) in [
                ("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
                ("OMP_NUM_THREADS", threads.as_str()),
            ] {
                if std::env::var_os(name).is_none() {
                    command.env(name, value);
                }
            }
        }
        let child = command.spawn().map_err(|e| {
            RunError::Setup(format!(
                "spec.engines.backend vLLM: starting {}: {e} (set MOULT_VLLM_PYTHON to a Python with vLLM installed: docs/vllm.md)",
                python.display()
            ))
        })?;
        let mut vllm = VllmProcess {
            child,
            url: format!("http://127.0.0.1:{port}"),
            log: log.to_path_buf(),
        };
        vllm.wait_until_serving().await?;
        Ok(vllm)
    }

    async fn wait_until_serving(&mut self) -> Result<()> {
        let http = reqwest::Client::new();
        let started = Instant::now();
        loop {
            let health = http
                .get(format!("{}/health", self.url))
                .timeout(Duration::from_secs(5))
                .send()
                .await;
            if health.is_ok_and(|r| r.status().is_success()) {
                tracing::info!(url = %self.url, "vLLM serves after {:.0?}", started.elapsed());
                return Ok(());
            }
            let failed = match self.child.try_wait() {
                Ok(Some(status)) => format!("vLLM exited ({status}) before serving"),
                _ if started.elapsed() > START_TIMEOUT => {
                    format!("vLLM did not serve within {START_TIMEOUT:?}")
                }
                _ => {
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    continue;
                }
            };
            let (log, end) = (self.log.display(), tail(&self.log, 20));
            let why = format!("{failed}; the end of {log}:\n{end}");
            return Err(RunError::Setup(why));
        }
    }

    /// SIGKILL to the whole group, as an OOM kill or a lost node would end it.
    pub fn kill(&mut self) {
        self.signal(Signal::SIGKILL);
        let _ = self.child.wait();
    }

    /// Sends `signal` to the process group this child leads.
    fn signal(&self, signal: Signal) {
        let _ = killpg(Pid::from_raw(self.child.id() as i32), signal);
    }
}

impl Drop for VllmProcess {
    fn drop(&mut self) {
        // The API server and the engine-core processes it started: the whole group.
        self.signal(Signal::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(15);
        while Instant::now() < deadline {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        self.kill();
    }
}
