//! A local kubelet for KWOK's fake nodes: runs the containers of one namespace's pods as processes
//! on this machine, so that cluster tests run the operator's real pod specs end to end.
//!
//! KWOK marks pods Running without running anything. [`Kubelet`] watches the namespace's pods and,
//! once a pod is scheduled (`spec.nodeName`), has an IP (`status.podIP`) and is not being deleted,
//! starts its containers. Init containers are skipped: their work (copying `moult` into agent
//! pods) is what [`KubeletOptions::binaries`] replaces. Pods are keyed by UID, so a StatefulSet pod
//! deleted and made again under the same name is a new pod, with fresh emptyDirs. How a pod spec
//! becomes processes:
//!
//! - **Program**: `command` + `args`, `command[0]` mapped through [`KubeletOptions::binaries`]
//!   (a container without `command` is not started: its image's entrypoint is unknown here). The
//!   working folder is the pod's, `<root>/pods/<pod>-<uid8>`; stdout and stderr are appended to
//!   `<root>/logs/<pod>-<container>.log`, each start marked by a line `=== start N ===`.
//! - **Environment**: this process's own (PATH, LD_LIBRARY_PATH, MOULT_PYTHON pass through), then
//!   `KUBECONFIG` (see *Identity*), then [`KubeletOptions::env`], then the container's `envFrom`
//!   and `env` in order: `value`, `secretKeyRef`, `configMapKeyRef`, and `fieldRef` for
//!   `metadata.{name,namespace,uid}`, `metadata.labels['k']`, `metadata.annotations['k']`,
//!   `status.{podIP,hostIP}`, `spec.{nodeName,serviceAccountName}`. `$(VAR)` is expanded as the
//!   kubelet does: in env values with the variables defined before, in command and args with all
//!   of the container's; `$$` is a literal `$`.
//! - **Volumes**: configMap and secret become a folder with a file per key (or per `items`),
//!   written at start; emptyDir a fresh folder per pod; persistentVolumeClaim the folder
//!   [`KubeletOptions::claims`] maps the claim to (a claim missing there is logged and the pod is
//!   not started); hostPath the path itself. Projected and downwardAPI volumes are not made. In
//!   the program, args and env values, a volumeMount's `mountPath` becomes the local folder
//!   (+ `subPath`) where it is a whole path prefix: it starts the string or follows a character
//!   that cannot be in a path (`=`, `:`, ...), and is followed by `/`, the end, or such a
//!   character. One pass, longest mountPath first: `/etc/moult/rlrun.yaml` becomes
//!   `<root>/pods/<pod>-<uid8>/volumes/config/rlrun.yaml`, and `HOME=/tmp` the pod's tmp emptyDir.
//! - **Network**: pod IPs are local addresses (`scripts/test-cluster.sh` routes KWOK's
//!   10.244.0.0/16 to loopback), but there is no kube-proxy and no DNS. `0.0.0.0` in args and env
//!   values becomes the pod's IP, so each process binds its own address and the EndpointSlices
//!   the API server keeps are real; `127.0.0.1` becomes the pod's own loopback address (`127.`
//!   and the last three parts of its IP), so containers of one pod meet there (a vLLM engine
//!   behind its front) and those of two pods do not. `http://<svc>:`, `http://<svc>.<ns>.svc:` and
//!   `http://<svc>.<ns>.svc.cluster.local:` (and `https://`) become `http://<ip>:`, the IP of a
//!   Running, non-terminating pod the Service selects (ClusterIPs route nowhere); pod DNS names
//!   `<hostname>.<subdomain>.<ns>.svc[.cluster.local]` (StatefulSet pods) become that pod's IP.
//!   A bare Service name outside a URL (`MOULT_ENGINES=run-engine`) is left alone. While a name a
//!   container refers to has no such pod, the pod waits (polling every 0.5 s) for up to 120 s,
//!   then starts with the name as it is (a real pod would crash-loop until it resolves).
//! - **Identity**: with [`KubeletOptions::kubeconfig`] (the admin's, for the server and CA), each
//!   pod gets `<pod dir>/kubeconfig` that authenticates as its ServiceAccount with a token bound
//!   to the pod (TokenRequest), as `KUBECONFIG`: a process that makes its client with kube's
//!   `Client::try_default()` acts with the pod's RBAC, as it would in-cluster. A pod with
//!   `automountServiceAccountToken: false` gives it only to the containers that mount a
//!   projected volume of its token.
//! - **Lifecycle**: each container is a process group of its own, and signals go to the group.
//!   restartPolicy Always: a process that exits is started again after a backoff (1 s, doubling
//!   to 8 s; back to 1 s after 10 s of running) while its pod lives. When the pod is deleted
//!   (`deletionTimestamp`, or gone from the watch) the group gets SIGTERM, then SIGKILL after the
//!   deletion's grace period (else `terminationGracePeriodSeconds`) capped at 15 s, and is never
//!   restarted. [`Kubelet::shutdown`] stops every pod so with 10 s; dropping the [`Kubelet`]
//!   SIGKILLs every group.
//!
//! KWOK removes a terminating pod at once, and its replacement (same StatefulSet name) often gets
//! the same IP, while the old processes are still in their grace period. A real StatefulSet makes
//! the new pod only once the old one is gone; here a pod whose name or IP is still held by another
//! pod's running processes waits for them to end, so it never finds its address in use.
//!
//! Process state (pids, restarts) is a small table behind a mutex: the watch task adds pods, one
//! task per pod runs its containers and records their processes, and the test reads it.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::Api;
use kube::runtime::watcher::{self, watcher, Event};
use kube::runtime::WatchStreamExt;
use kube::{Client, ResourceExt};
use tokio::sync::watch;
use tokio::task::JoinHandle;

mod spec;

use spec::{prepare, Launch, Problem};

/// Longest wait between SIGTERM and SIGKILL of a deleted pod (the default 30 s is too long for
/// tests).
const MAX_GRACE: Duration = Duration::from_secs(15);
const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);
/// How long a pod waits for the Services and pods it names before it starts anyway.
const RESOLVE_TIMEOUT: Duration = Duration::from_secs(120);
const POLL: Duration = Duration::from_millis(500);
const FIRST_BACKOFF: Duration = Duration::from_secs(1);
const MAX_BACKOFF: Duration = Duration::from_secs(8);
/// A process that ran this long was healthy: after its next exit it restarts after 1 s again.
const BACKOFF_RESET: Duration = Duration::from_secs(10);

/// What the local kubelet maps a pod's references to.
#[derive(Clone, Debug, Default)]
pub struct KubeletOptions {
    /// Scratch folder: `pods/<pod>-<uid8>` (working folders and volumes) and `logs/`.
    pub root: PathBuf,
    /// Container `command[0]` -> the local program to run instead (e.g. `moult` and
    /// `/opt/moult/bin/moult` -> `env!("CARGO_BIN_EXE_moult")`).
    pub binaries: BTreeMap<String, PathBuf>,
    /// PersistentVolumeClaim name -> the local folder that stands for it.
    pub claims: BTreeMap<String, PathBuf>,
    /// Set in every process, after this process's environment and before the container's.
    pub env: Vec<(String, String)>,
    /// The cluster admin's kubeconfig: when set, every pod acts as its ServiceAccount through a
    /// `KUBECONFIG` of its own (see the module doc).
    pub kubeconfig: Option<PathBuf>,
    /// Local folders that stand for files baked into the image (the repository's recipes and
    /// models): a path under one of them is never rewritten into a volume, even where a volume
    /// is mounted above it (a clone under `/tmp` stays visible though pods mount `/tmp`).
    pub image: Vec<PathBuf>,
}

/// One container of one pod, as [`Kubelet::processes`] reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProcessInfo {
    pub pod: String,
    pub uid: String,
    pub container: String,
    /// The latest process (its pid is also its process group).
    pub pid: u32,
    /// Starts after the first.
    pub restarts: u32,
    pub running: bool,
    /// The pod is being deleted (or the kubelet is shutting down): no more restarts.
    pub terminating: bool,
    /// The pod's working folder.
    pub dir: PathBuf,
}

/// Runs the pods of one namespace as local processes until shut down or dropped.
pub struct Kubelet {
    shared: Arc<Shared>,
    watcher: JoinHandle<()>,
}

struct Shared {
    client: Client,
    namespace: String,
    opts: KubeletOptions,
    started: Instant,
    pods: Mutex<Vec<PodSlot>>,
}

/// A pod the kubelet has taken on, in the order they came.
struct PodSlot {
    name: String,
    uid: String,
    ip: String,
    dir: PathBuf,
    main_container: String,
    /// Its grace period when it disappears from the watch without a deletion seen.
    grace: Duration,
    /// `Some(grace)` once the pod is to stop.
    stop: watch::Sender<Option<Duration>>,
    task: Option<JoinHandle<()>>,
    processes: Vec<ProcessInfo>,
}

impl Kubelet {
    /// Starts watching `namespace`'s pods; pods that already exist are started too.
    pub async fn start(client: Client, namespace: &str, opts: KubeletOptions) -> Kubelet {
        for folder in ["logs", "pods"] {
            let path = opts.root.join(folder);
            std::fs::create_dir_all(&path)
                .unwrap_or_else(|e| panic!("kubelet: cannot make {}: {e}", path.display()));
        }
        let shared = Arc::new(Shared {
            client,
            namespace: namespace.to_string(),
            opts,
            started: Instant::now(),
            pods: Mutex::new(Vec::new()),
        });
        let watcher = tokio::spawn(watch_pods(shared.clone()));
        Kubelet { shared, watcher }
    }

    /// SIGKILLs the running processes of the live pod `pod`, which restart as with restartPolicy
    /// Always. Panics when the pod has none.
    pub fn kill(&self, pod: &str) {
        let pids: Vec<u32> = self
            .shared
            .pods()
            .iter()
            .filter(|s| s.name == pod && s.stop.borrow().is_none())
            .flat_map(|s| s.processes.iter().filter(|p| p.running).map(|p| p.pid))
            .collect();
        assert!(
            !pids.is_empty(),
            "kubelet: pod {pod} has no running process to kill"
        );
        for pid in pids {
            signal_group(pid, "KILL");
        }
    }

    /// Every container process the kubelet has started, those of deleted pods included.
    pub fn processes(&self) -> Vec<ProcessInfo> {
        self.shared
            .pods()
            .iter()
            .flat_map(|s| {
                let terminating = s.stop.borrow().is_some();
                s.processes.iter().map(move |p| ProcessInfo {
                    terminating,
                    ..p.clone()
                })
            })
            .collect()
    }

    /// The log of the main (first) container of the latest pod named `pod`, once it exists.
    pub fn log_path(&self, pod: &str) -> Option<PathBuf> {
        let pods = self.shared.pods();
        let slot = pods.iter().rev().find(|s| s.name == pod)?;
        let path = self.shared.log_path(&slot.name, &slot.main_container);
        path.exists().then_some(path)
    }

    /// The last `lines` lines of every container log of the pods whose names start with
    /// `pod_prefix`, and the kubelet's own notes about them: for assertion messages.
    pub fn logs_tail(&self, pod_prefix: &str, lines: usize) -> String {
        let logs = self.shared.opts.root.join("logs");
        let mut files: Vec<PathBuf> = std::fs::read_dir(&logs)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path())
            .filter(|p| {
                p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with(pod_prefix))
            })
            .collect();
        files.sort();
        let mut out = String::new();
        let mut tail = |title: &str, text: &str| {
            let all: Vec<&str> = text.lines().collect();
            out.push_str(&format!("--- {title}\n"));
            for line in &all[all.len().saturating_sub(lines)..] {
                out.push_str(line);
                out.push('\n');
            }
        };
        for f in &files {
            tail(
                &f.display().to_string(),
                &std::fs::read_to_string(f).unwrap_or_default(),
            );
        }
        let notes = std::fs::read_to_string(self.shared.opts.root.join("kubelet.log"));
        let notes: Vec<&str> = notes
            .as_deref()
            .unwrap_or("")
            .lines()
            .filter(|l| l.contains(pod_prefix))
            .collect();
        tail("kubelet notes", &notes.join("\n"));
        out
    }

    /// Stops every pod as if deleted with a 10 s grace period (SIGTERM, then SIGKILL) and waits
    /// for their processes to end.
    pub async fn shutdown(self) {
        self.watcher.abort();
        let tasks: Vec<JoinHandle<()>> = self
            .shared
            .pods()
            .iter_mut()
            .filter_map(|s| {
                s.stop.send_replace(Some(SHUTDOWN_GRACE));
                s.task.take()
            })
            .collect();
        for task in tasks {
            let _ = task.await;
        }
    }
}

impl Drop for Kubelet {
    fn drop(&mut self) {
        self.watcher.abort();
        for slot in self.shared.pods().iter_mut() {
            slot.stop.send_replace(Some(Duration::ZERO));
            if let Some(task) = slot.task.take() {
                task.abort();
            }
            for p in slot.processes.iter().filter(|p| p.running) {
                signal_group(p.pid, "KILL");
            }
        }
    }
}

impl Shared {
    fn pods(&self) -> MutexGuard<'_, Vec<PodSlot>> {
        self.pods.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn log_path(&self, pod: &str, container: &str) -> PathBuf {
        self.opts
            .root
            .join("logs")
            .join(format!("{pod}-{container}.log"))
    }

    /// A line in `<root>/kubelet.log` (and on stderr) about what the kubelet did or waits for.
    fn note(&self, message: &str) {
        let line = format!("[{:7.1}s] {message}", self.started.elapsed().as_secs_f64());
        eprintln!("kubelet: {line}");
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.opts.root.join("kubelet.log"))
        {
            let _ = writeln!(f, "{line}");
        }
    }

    /// A pod from the watch: started when it is ready to run, stopped when it is being deleted.
    fn observe(self: &Arc<Self>, pod: Pod) {
        let Some(uid) = pod.metadata.uid.clone() else {
            return;
        };
        if pod.metadata.deletion_timestamp.is_some() {
            return self.stop(&uid, Some(grace_period(&pod)));
        }
        let scheduled = pod.spec.as_ref().is_some_and(|s| s.node_name.is_some());
        let ip = pod.status.as_ref().and_then(|s| s.pod_ip.clone());
        let (true, Some(ip)) = (scheduled, ip) else {
            return;
        };
        let mut pods = self.pods();
        if pods.iter().any(|s| s.uid == uid) {
            return;
        }
        let name = pod.name_any();
        let dir = self
            .opts
            .root
            .join("pods")
            .join(format!("{name}-{}", short(&uid)));
        let main_container = pod
            .spec
            .as_ref()
            .and_then(|s| s.containers.first())
            .map(|c| c.name.clone())
            .unwrap_or_default();
        let grace = grace_period(&pod);
        let (stop, stopped) = watch::channel(None);
        self.note(&format!("pod {name} ({}) at {ip}: scheduled", short(&uid)));
        let task = tokio::spawn(run_pod(self.clone(), pod, ip.clone(), dir.clone(), stopped));
        pods.push(PodSlot {
            name,
            uid,
            ip,
            dir,
            main_container,
            grace,
            stop,
            task: Some(task),
            processes: Vec::new(),
        });
    }

    /// Tells a pod to stop (once), with its own grace period when `grace` is None.
    fn stop(&self, uid: &str, grace: Option<Duration>) {
        if let Some(slot) = self.pods().iter().find(|s| s.uid == uid) {
            if slot.stop.borrow().is_none() {
                let grace = grace.unwrap_or(slot.grace);
                self.note(&format!(
                    "pod {} ({}): stopping, grace {grace:?}",
                    slot.name,
                    short(uid)
                ));
                slot.stop.send_replace(Some(grace));
            }
        }
    }

    /// Another pod whose processes still run under the name or IP of pod `uid`.
    fn predecessor(&self, uid: &str, name: &str, ip: &str) -> Option<String> {
        self.pods()
            .iter()
            .filter(|s| s.uid != uid && (s.name == name || s.ip == ip))
            .find(|s| s.processes.iter().any(|p| p.running))
            .map(|s| format!("pod {} ({}) at {}", s.name, short(&s.uid), s.ip))
    }

    /// Updates (adding it on first use) the row of one container of the pod `uid`.
    fn update(&self, uid: &str, container: &str, change: impl FnOnce(&mut ProcessInfo)) {
        let mut pods = self.pods();
        let Some(slot) = pods.iter_mut().find(|s| s.uid == uid) else {
            return;
        };
        let row = match slot.processes.iter().position(|p| p.container == container) {
            Some(i) => i,
            None => {
                slot.processes.push(ProcessInfo {
                    pod: slot.name.clone(),
                    uid: uid.to_string(),
                    container: container.to_string(),
                    pid: 0,
                    restarts: 0,
                    running: false,
                    terminating: false,
                    dir: slot.dir.clone(),
                });
                slot.processes.len() - 1
            }
        };
        change(&mut slot.processes[row]);
    }
}

/// The watch task: feeds every pod event to [`Shared::observe`] / [`Shared::stop`].
async fn watch_pods(shared: Arc<Shared>) {
    let api: Api<Pod> = Api::namespaced(shared.client.clone(), &shared.namespace);
    let mut events = watcher(api, watcher::Config::default())
        .default_backoff()
        .boxed();
    // UIDs of a re-list in progress: pods missing from it were deleted while the watch was down.
    let mut listed: Option<BTreeSet<String>> = None;
    while let Some(event) = events.next().await {
        match event {
            Ok(Event::Init) => listed = Some(BTreeSet::new()),
            Ok(Event::InitApply(pod)) => {
                if let (Some(l), Some(uid)) = (listed.as_mut(), pod.metadata.uid.clone()) {
                    l.insert(uid);
                }
                shared.observe(pod);
            }
            Ok(Event::InitDone) => {
                let Some(listed) = listed.take() else {
                    continue;
                };
                let gone: Vec<String> = shared
                    .pods()
                    .iter()
                    .filter(|s| !listed.contains(&s.uid))
                    .map(|s| s.uid.clone())
                    .collect();
                for uid in gone {
                    shared.stop(&uid, None);
                }
            }
            Ok(Event::Apply(pod)) => shared.observe(pod),
            Ok(Event::Delete(pod)) => {
                if let Some(uid) = &pod.metadata.uid {
                    shared.stop(uid, Some(grace_period(&pod)));
                }
            }
            Err(e) => shared.note(&format!("watching pods: {e}")),
        }
    }
}

/// The deletion's grace period, else the pod's, capped at [`MAX_GRACE`].
fn grace_period(pod: &Pod) -> Duration {
    let seconds = pod
        .metadata
        .deletion_grace_period_seconds
        .or_else(|| pod.spec.as_ref()?.termination_grace_period_seconds)
        .unwrap_or(30);
    Duration::from_secs(seconds.max(0) as u64).min(MAX_GRACE)
}

fn short(uid: &str) -> &str {
    &uid[..uid.len().min(8)]
}

/// One pod: resolves its spec (waiting for what it needs), then runs its containers until it
/// is told to stop.
async fn run_pod(
    shared: Arc<Shared>,
    pod: Pod,
    ip: String,
    dir: PathBuf,
    mut stop: watch::Receiver<Option<Duration>>,
) {
    let name = pod.name_any();
    let uid = pod.metadata.uid.clone().unwrap_or_default();
    let began = Instant::now();
    let mut reported = String::new();
    let launches = loop {
        let waiting = match shared.predecessor(&uid, &name, &ip) {
            Some(other) => format!("{other} to stop"),
            None => match prepare(&shared, &pod, &ip, &dir).await {
                Ok((launches, pending)) if pending.is_empty() => break launches,
                Ok((launches, pending)) if began.elapsed() > RESOLVE_TIMEOUT => {
                    let names = Vec::from_iter(pending).join(", ");
                    shared.note(&format!("pod {name}: starting with {names} unresolved"));
                    break launches;
                }
                Ok((_, pending)) => {
                    let names = Vec::from_iter(pending).join(", ");
                    format!("a running pod behind {names}")
                }
                Err(Problem::Wait(why)) => why,
                Err(Problem::Fatal(why)) => {
                    return shared.note(&format!("pod {name}: not started: {why}"));
                }
            },
        };
        if waiting != reported {
            shared.note(&format!("pod {name}: waiting for {waiting}"));
            reported = waiting;
        }
        tokio::select! {
            _ = tokio::time::sleep(POLL) => {}
            _ = stopped(&mut stop) => return,
        }
    };
    let containers = launches
        .into_iter()
        .map(|l| run_container(&shared, &uid, l, stop.clone()));
    futures::future::join_all(containers).await;
}

/// Runs one container until its pod stops, restarting it whenever it exits.
async fn run_container(
    shared: &Shared,
    uid: &str,
    launch: Launch,
    mut stop: watch::Receiver<Option<Duration>>,
) {
    let name = launch.container.as_str();
    let mut backoff = FIRST_BACKOFF;
    for start in 1u32.. {
        if stop.borrow().is_some() {
            return;
        }
        let began = Instant::now();
        match spawn(&launch, start, uid) {
            Err(e) => {
                append(
                    &launch.log,
                    &format!("=== could not start {:?}: {e} ===", launch.program),
                );
                shared.update(uid, name, |p| p.restarts = start - 1);
            }
            Ok(mut child) => {
                let pid = child.id().unwrap_or(0);
                let pod = launch.dir.file_name().unwrap_or_default().to_string_lossy();
                shared.note(&format!("pod {pod}: {name} start {start}, pid {pid}"));
                shared.update(uid, name, |p| {
                    p.pid = pid;
                    p.restarts = start - 1;
                    p.running = true;
                });
                let grace = tokio::select! {
                    status = child.wait() => {
                        let status = status.map_or_else(|e| e.to_string(), |s| s.to_string());
                        append(&launch.log, &format!("=== exited: {status} ==="));
                        None
                    }
                    grace = stopped(&mut stop) => Some(grace),
                };
                match grace {
                    Some(grace) => terminate(&mut child, pid, grace).await,
                    // What the leader left behind in its group goes with it, as in a container.
                    None => signal_group(pid, "KILL"),
                }
                shared.update(uid, name, |p| p.running = false);
                if grace.is_some() {
                    return append(&launch.log, "=== stopped ===");
                }
            }
        }
        if began.elapsed() >= BACKOFF_RESET {
            backoff = FIRST_BACKOFF;
        }
        tokio::select! {
            _ = tokio::time::sleep(backoff) => {}
            _ = stopped(&mut stop) => return,
        }
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

fn spawn(launch: &Launch, start: u32, uid: &str) -> std::io::Result<tokio::process::Child> {
    let mut log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&launch.log)?;
    writeln!(log, "=== start {start} === (pod uid {})", short(uid))?;
    tokio::process::Command::new(&launch.program)
        .args(&launch.args)
        .envs(launch.env.iter().map(|(k, v)| (k, v)))
        .current_dir(&launch.dir)
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        // A group of its own: signals reach what the program starts too.
        .process_group(0)
        .kill_on_drop(true)
        .spawn()
}

/// SIGTERM, up to `grace` for the leader to exit, then SIGKILL to whatever is left.
async fn terminate(child: &mut tokio::process::Child, pid: u32, grace: Duration) {
    signal_group(pid, "TERM");
    if tokio::time::timeout(grace, child.wait()).await.is_err() {
        signal_group(pid, "KILL");
        let _ = child.wait().await;
    }
    signal_group(pid, "KILL");
}

/// Resolves when the pod is told to stop, with its grace period.
async fn stopped(stop: &mut watch::Receiver<Option<Duration>>) -> Duration {
    match stop.wait_for(Option::is_some).await {
        Ok(grace) => grace.unwrap_or_default(),
        // The kubelet is gone.
        Err(_) => Duration::ZERO,
    }
}

/// `kill -<signal> -- -<pgid>`, quietly (the group may be gone).
fn signal_group(pgid: u32, signal: &str) {
    // 0 and 1 would signal the test's own group or every process.
    if pgid <= 1 {
        return;
    }
    let _ = std::process::Command::new("kill")
        .arg(format!("-{signal}"))
        .arg("--")
        .arg(format!("-{pgid}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
}

fn append(path: &Path, line: &str) {
    if let Ok(mut f) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
    {
        let _ = writeln!(f, "{line}");
    }
}
