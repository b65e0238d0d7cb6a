//! The server in a sandbox pod (`moult sandbox --serve`): runs `moult.sandbox.run` calls of the
//! one episode that claimed the pod (docs/security.md, "Sandbox pods").
//!
//! `POST /run` takes a [`RunRequest`] and answers a [`RunResult`]. The calls of an episode share
//! the pod's workspace, its working folder: a repository that one call edits is edited for the
//! next (a SWE task's). Each call runs in a jail of its own whose only writable folder is the
//! workspace, with the call's limits and timeout (or, where the run says `agent.isolation:
//! Process`, in a process group with the timeout alone); calls run one at a time. The server
//! holds no credential: it knows only the SHA-256 of the key that callers present
//! (`Authorization: Bearer`), so code in the pod that reads its environment learns nothing that
//! opens another sandbox.

use std::collections::BTreeMap;
use std::path::{Component, Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use base64::engine::general_purpose::STANDARD as BASE64;
use base64::Engine;
use serde::{Deserialize, Serialize};

use moult_operator::children::verifier;

use moult_jail::once;
use moult_jail::Limits;

pub use moult_operator::children::VERIFIER_ENV;

/// The largest request body: the files a call puts in the workspace travel in it.
pub const MAX_BODY_BYTES: usize = 64 << 20;

/// A server for `moult sandbox --serve ADDR`: its calls share `workspace` and run in jails
/// when `jailed` (this pod must be able to make them, or it says why); the key's hash is in
/// [`VERIFIER_ENV`].
pub async fn bind(
    addr: std::net::SocketAddr,
    workspace: PathBuf,
    jailed: bool,
) -> Result<(Arc<Server>, tokio::net::TcpListener), String> {
    let verifier =
        std::env::var(VERIFIER_ENV).map_err(|_| format!("--serve needs {VERIFIER_ENV}"))?;
    if jailed {
        moult_jail::Jail::default().probe(None).map_err(|why| format!("this sandbox pod cannot make jails: {why}; set spec.agent.isolation: Process to run its calls in process groups (docs/security.md#sandbox-pods)"))?;
    }
    // Beside the workspace, out of the calls' reach.
    let streams = workspace.with_file_name(".moult-sandbox-streams");
    let server = Arc::new(Server::new(&verifier, workspace, streams, jailed)?);
    let listener = tokio::net::TcpListener::bind(addr).await;
    Ok((
        server,
        listener.map_err(|e| format!("binding {addr}: {e}"))?,
    ))
}

/// One `moult.sandbox.run` call, as the SDK sends it (docs/agents.md).
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RunRequest {
    /// The program and its arguments.
    pub argv: Vec<String>,
    /// Files put in the workspace first: relative path -> base64 of the content.
    #[serde(default)]
    pub files: BTreeMap<String, String>,
    /// Base64 of the program's stdin.
    #[serde(default)]
    pub stdin: String,
    /// Seconds of wall clock.
    pub timeout: f64,
    pub limits: Limits,
    /// Variables for the program beyond PATH, HOME (the workspace) and the locale.
    #[serde(default)]
    pub env: Vec<(String, String)>,
    /// The most bytes of stdout and of stderr returned.
    pub max_output: usize,
    /// The most bytes of written files returned.
    pub max_files_bytes: usize,
}

/// What a call did (the fields of the SDK's `Result`).
#[derive(Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct RunResult {
    pub stdout: String,
    pub stderr: String,
    pub exit_code: Option<i32>,
    pub signal: Option<i32>,
    pub timed_out: bool,
    pub limit: Option<String>,
    /// Files of the workspace the call wrote or changed: relative path -> base64.
    pub files: BTreeMap<String, String>,
    pub truncated: bool,
}

/// Why a call was not run.
#[derive(Debug, thiserror::Error)]
enum CallError {
    #[error("{0}")]
    Invalid(String),
    #[error("the sandbox could not run the call: {0}")]
    Io(#[from] std::io::Error),
}

/// A sandbox pod's server.
#[derive(Debug)]
pub struct Server {
    /// The hex SHA-256 of the key callers present, as the operator writes it.
    verifier: String,
    workspace: PathBuf,
    /// Where each call's stdin, stdout and stderr are kept (outside the workspace).
    streams: PathBuf,
    jailed: bool,
    /// One call at a time: a call's changed files are those it changed.
    one: tokio::sync::Mutex<()>,
}

impl Server {
    /// A server whose calls run in `workspace` (made if missing; it becomes this process's
    /// working folder, which is a jail's), keeping streams in `streams`; `verifier` is the
    /// hex SHA-256 of the key callers present.
    pub fn new(
        verifier: &str,
        workspace: PathBuf,
        streams: PathBuf,
        jailed: bool,
    ) -> Result<Self, String> {
        if verifier.len() != 64 || !verifier.bytes().all(|b| b.is_ascii_hexdigit()) {
            let wanted = "must be the SHA-256 of the agents' key, 64 hex digits";
            return Err(format!("{VERIFIER_ENV} {wanted}"));
        }
        let verifier = verifier.to_ascii_lowercase();
        for dir in [&workspace, &streams] {
            std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        }
        std::env::set_current_dir(&workspace)
            .map_err(|e| format!("{}: {e}", workspace.display()))?;
        Ok(Self {
            verifier,
            workspace,
            streams,
            jailed,
            one: tokio::sync::Mutex::new(()),
        })
    }

    pub fn router(self: Arc<Self>) -> Router {
        Router::new()
            .route("/run", post(run))
            .route("/health", get(|| async { "ok" }))
            .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY_BYTES))
            .with_state(self)
    }

    fn authorized(&self, headers: &HeaderMap) -> bool {
        let key = headers.get("authorization").and_then(|v| v.to_str().ok());
        let key = key.and_then(|v| v.strip_prefix("Bearer "));
        key.is_some_and(|k| verifier(k) == self.verifier)
    }

    async fn call(&self, request: RunRequest) -> Result<RunResult, CallError> {
        let Some((program, args)) = request.argv.split_first() else {
            return Err(CallError::Invalid("argv is empty".into()));
        };
        if request.timeout.is_nan() || request.timeout <= 0.0 {
            return Err(CallError::Invalid("timeout must be above 0 seconds".into()));
        }
        let _one = self.one.lock().await;
        for (name, content) in &request.files {
            let path = inside(&self.workspace, name).ok_or_else(|| {
                CallError::Invalid(format!(
                    "files: {name:?} must be a relative path inside the sandbox's folder"
                ))
            })?;
            let bytes = BASE64
                .decode(content)
                .map_err(|e| CallError::Invalid(format!("files: {name:?} is not base64: {e}")))?;
            if let Some(parent) = path.parent() {
                std::fs::create_dir_all(parent)?;
            }
            std::fs::write(&path, bytes)?;
        }
        let stdin = BASE64
            .decode(&request.stdin)
            .map_err(|e| CallError::Invalid(format!("stdin is not base64: {e}")))?;
        let stdin_path = self.streams.join("stdin");
        std::fs::write(&stdin_path, stdin)?;
        let before = snapshot(&self.workspace);
        let home = self.workspace.display().to_string();
        let path = std::env::var("PATH").unwrap_or_else(|_| "/usr/bin:/bin".into());
        let mut env = vec![
            ("PATH".to_string(), path),
            ("HOME".into(), home),
            ("LANG".into(), "C.UTF-8".into()),
        ];
        env.retain(|(k, _)| !request.env.iter().any(|(given, _)| given == k));
        env.extend(request.env);
        let run = once::Request {
            env,
            limits: request.limits,
            dir: self.workspace.clone(),
            stdout: self.streams.join("stdout"),
            stderr: self.streams.join("stderr"),
            timeout: request.timeout,
        };
        let stdin = Stdio::from(std::fs::File::open(&stdin_path)?);
        let report = once::run(run, program, args, stdin, self.jailed).await?;
        let (stdout, cut_out) = read_text(&self.streams.join("stdout"), request.max_output)?;
        let (stderr, cut_err) = read_text(&self.streams.join("stderr"), request.max_output)?;
        let mut files = BTreeMap::new();
        let mut total = 0;
        for (name, stamp) in snapshot(&self.workspace) {
            if before.get(&name) == Some(&stamp) || total + stamp.0 > request.max_files_bytes {
                continue;
            }
            if let Ok(bytes) = std::fs::read(self.workspace.join(&name)) {
                total += bytes.len();
                files.insert(name, BASE64.encode(bytes));
            }
        }
        Ok(RunResult {
            stdout,
            stderr,
            exit_code: report.exit.and_then(|e| e.code()),
            signal: report.exit.and_then(|e| e.signal()),
            timed_out: report.timed_out,
            limit: report.limit,
            files,
            truncated: cut_out || cut_err,
        })
    }
}

async fn run(
    State(server): State<Arc<Server>>,
    headers: HeaderMap,
    body: bytes::Bytes,
) -> Response {
    if !server.authorized(&headers) {
        return (
            StatusCode::UNAUTHORIZED,
            "this sandbox answers its run's agents only",
        )
            .into_response();
    }
    let request: RunRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => {
            return (StatusCode::BAD_REQUEST, format!("not a run request: {e}")).into_response()
        }
    };
    match server.call(request).await {
        Ok(result) => Json(result).into_response(),
        Err(e @ CallError::Invalid(_)) => (StatusCode::BAD_REQUEST, e.to_string()).into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

/// `name` under `root`, if it is a relative path that stays there.
fn inside(root: &Path, name: &str) -> Option<PathBuf> {
    let path = Path::new(name);
    let plain = path.components().all(|c| matches!(c, Component::Normal(_)));
    (plain && !name.is_empty()).then(|| root.join(path))
}

/// Every regular file below `root`: relative path -> (size, modification time).
fn snapshot(root: &Path) -> BTreeMap<String, (usize, std::time::SystemTime)> {
    let mut seen = BTreeMap::new();
    let mut folders = vec![root.to_path_buf()];
    while let Some(folder) = folders.pop() {
        for entry in std::fs::read_dir(&folder).into_iter().flatten().flatten() {
            let Ok(meta) = entry.path().symlink_metadata() else {
                continue;
            };
            if meta.is_dir() {
                folders.push(entry.path());
            } else if meta.is_file() {
                let name = entry
                    .path()
                    .strip_prefix(root)
                    .map(|p| p.display().to_string());
                let modified = meta.modified().unwrap_or(std::time::UNIX_EPOCH);
                if let Ok(name) = name {
                    seen.insert(name, (meta.len() as usize, modified));
                }
            }
        }
    }
    seen
}

/// The first `limit` bytes of a file as text, and whether there were more.
fn read_text(path: &Path, limit: usize) -> std::io::Result<(String, bool)> {
    use std::io::Read;
    let mut data = Vec::new();
    std::fs::File::open(path)?
        .take(limit as u64 + 1)
        .read_to_end(&mut data)?;
    let cut = data.len() > limit;
    data.truncate(limit);
    Ok((String::from_utf8_lossy(&data).into_owned(), cut))
}
