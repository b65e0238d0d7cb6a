//! The operator's Prometheus metrics and its `/metrics`, `/healthz` and `/readyz` endpoints.
//!
//! Besides the reconciler's own (reconciles, writes, durations, leadership), each run has gauges
//! of its phase, its components' ready and desired pods, and what blocks a component (docs/
//! operator.md, "Metrics"): enough to alert on a run that is stuck. A run's series go when the
//! run is gone (at the next reconcile of any run).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use axum::Router;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use super::causes::Reason;
use super::status::Component;
use crate::api::{Phase, Usage};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WriteLabels {
    /// apply, delete or status.
    pub verb: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabels {
    /// ok or error.
    pub result: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PhaseLabels {
    pub namespace: String,
    pub run: String,
    pub phase: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ComponentLabels {
    pub namespace: String,
    pub run: String,
    /// engines, trainer, coordinator or agents.
    pub component: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RoleLabels {
    pub namespace: String,
    pub run: String,
    /// engines, trainer, coordinator, agents, judge or teacher.
    pub role: String,
}

/// A series' labels, as names and values.
type LabelSet = Vec<(String, String)>;

/// A gauge of seconds.
type Seconds = Gauge<f64, std::sync::atomic::AtomicU64>;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BlockedLabels {
    pub namespace: String,
    pub run: String,
    pub component: String,
    /// A cause of docs/operator.md, "Why is my run stuck" (Unschedulable, CrashLoopBackOff, ...).
    pub reason: String,
}

const PHASES: [Phase; 8] = [
    Phase::Pending,
    Phase::Running,
    Phase::Degraded,
    Phase::Suspended,
    Phase::Queued,
    Phase::Preempted,
    Phase::Succeeded,
    Phase::Failed,
];

/// Every metric the operator exports.
pub struct Metrics {
    pub registry: Registry,
    pub reconciles: Family<ResultLabels, Counter>,
    /// API writes (applies, deletes, status patches) the reconciler made.
    pub writes: Family<WriteLabels, Counter>,
    pub reconcile_seconds: Histogram,
    /// 1 while this replica holds the lease (or runs without leader election).
    pub leader: Gauge,
    /// 1 for a run's current phase, 0 for the others.
    pub run_phase: Family<PhaseLabels, Gauge>,
    pub ready_pods: Family<ComponentLabels, Gauge>,
    pub desired_pods: Family<ComponentLabels, Gauge>,
    /// 1 for the cause that keeps a component from ready, 0 for the other causes.
    pub blocked: Family<BlockedLabels, Gauge>,
    /// A run's `status.usage`, per role.
    pub gpu_seconds: Family<RoleLabels, Seconds>,
    pub cpu_seconds: Family<RoleLabels, Seconds>,
    /// Runs (namespace, name) with series, and the components each has series for (engines,
    /// trainer, judge, teacher, ...), to drop those of deleted runs and removed components.
    runs: Mutex<HashMap<(String, String), BTreeSet<&'static str>>>,
    /// Set once the controller runs; `/readyz` answers 200 from then on.
    pub ready: AtomicBool,
    /// 1 per run, with the run's labels as `label_<key>` (as kube-state-metrics gives objects'
    /// labels), so that usage sums by team: `... * on(namespace, run) group_left(label_team)
    /// moult_operator_run_labels`.
    pub run_labels: Family<LabelSet, Gauge>,
    /// Each run's label series, to drop when its labels change or it goes.
    labelled: Mutex<HashMap<(String, String), LabelSet>>,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("moult_operator");
        let reconciles = Family::<ResultLabels, Counter>::default();
        let writes = Family::<WriteLabels, Counter>::default();
        let reconcile_seconds = Histogram::new(exponential_buckets(0.001, 2.0, 16));
        let leader = Gauge::default();
        let run_phase = Family::<PhaseLabels, Gauge>::default();
        let ready_pods = Family::<ComponentLabels, Gauge>::default();
        let desired_pods = Family::<ComponentLabels, Gauge>::default();
        let blocked = Family::<BlockedLabels, Gauge>::default();
        let gpu_seconds = Family::<RoleLabels, Seconds>::default();
        let cpu_seconds = Family::<RoleLabels, Seconds>::default();
        let run_labels = Family::<LabelSet, Gauge>::default();
        registry.register(
            "run_labels",
            "1 for each RLRun, with its labels as label_<key>",
            run_labels.clone(),
        );
        registry.register(
            "run_gpu_seconds",
            "GPUs × seconds the pods of each role of each RLRun ran (status.usage)",
            gpu_seconds.clone(),
        );
        registry.register(
            "run_cpu_seconds",
            "CPUs (requested) × seconds the pods of each role of each RLRun ran (status.usage)",
            cpu_seconds.clone(),
        );
        registry.register(
            "run_phase",
            "1 for the phase each RLRun is in, 0 for the others",
            run_phase.clone(),
        );
        registry.register(
            "run_ready_pods",
            "Ready pods of each component of each RLRun",
            ready_pods.clone(),
        );
        registry.register(
            "run_desired_pods",
            "Desired pods of each component of each RLRun",
            desired_pods.clone(),
        );
        registry.register(
            "run_blocked",
            "1 when a component of an RLRun is kept from ready by this reason (Unschedulable, ImagePullFailed, ContainerCannotStart, OOMKilled, CrashLoopBackOff)",
            blocked.clone(),
        );
        registry.register("reconciles", "Reconciles by result", reconciles.clone());
        registry.register(
            "writes",
            "API writes made by reconciles, by verb",
            writes.clone(),
        );
        registry.register(
            "reconcile_duration_seconds",
            "Time one reconcile takes",
            reconcile_seconds.clone(),
        );
        registry.register(
            "leader",
            "1 while this replica is the leader",
            leader.clone(),
        );
        Metrics {
            registry,
            reconciles,
            writes,
            reconcile_seconds,
            leader,
            run_phase,
            ready_pods,
            desired_pods,
            blocked,
            gpu_seconds,
            cpu_seconds,
            runs: Mutex::new(HashMap::new()),
            ready: AtomicBool::new(false),
            run_labels,
            labelled: Mutex::new(HashMap::new()),
        }
    }
}

impl Metrics {
    pub fn write(&self, verb: &str, n: usize) {
        self.writes
            .get_or_create(&WriteLabels { verb: verb.into() })
            .inc_by(n as u64);
    }

    /// Sets the gauges of one run from its phase, components and usage.
    pub fn observe_run(
        &self,
        namespace: &str,
        run: &str,
        phase: Option<Phase>,
        components: &[Component],
        usage: Option<&Usage>,
    ) {
        for (role, used) in usage.iter().flat_map(|u| &u.roles) {
            let labels = RoleLabels {
                namespace: namespace.into(),
                run: run.into(),
                role: role.clone(),
            };
            self.gpu_seconds
                .get_or_create(&labels)
                .set(used.gpu_seconds);
            self.cpu_seconds
                .get_or_create(&labels)
                .set(used.cpu_seconds);
        }
        let now: BTreeSet<&'static str> = components.iter().map(|c| c.name).collect();
        let before = self
            .runs
            .lock()
            .expect("not poisoned")
            .insert((namespace.into(), run.into()), now.clone());
        for gone in before.unwrap_or_default().difference(&now) {
            self.remove_component(namespace, run, gone);
        }
        for p in PHASES {
            self.run_phase
                .get_or_create(&PhaseLabels {
                    namespace: namespace.into(),
                    run: run.into(),
                    phase: format!("{p:?}"),
                })
                .set(i64::from(phase == Some(p)));
        }
        for c in components {
            let labels = ComponentLabels {
                namespace: namespace.into(),
                run: run.into(),
                component: c.name.into(),
            };
            self.ready_pods
                .get_or_create(&labels)
                .set(i64::from(c.ready));
            self.desired_pods
                .get_or_create(&labels)
                .set(i64::from(c.desired));
            for reason in Reason::ALL {
                self.blocked
                    .get_or_create(&BlockedLabels {
                        namespace: namespace.into(),
                        run: run.into(),
                        component: c.name.into(),
                        reason: reason.as_str().into(),
                    })
                    .set(i64::from(
                        c.cause.as_ref().is_some_and(|cause| cause.reason == reason),
                    ));
            }
        }
    }

    /// The run's labels series: `labels` as `label_<key>` (other characters than letters and
    /// digits made `_`).
    pub fn label_run(&self, namespace: &str, run: &str, labels: &BTreeMap<String, String>) {
        let series =
            [("namespace", namespace), ("run", run)].map(|(k, v)| (k.to_string(), v.to_string()));
        let labels = labels.iter().map(|(k, v)| {
            let key: String = k
                .chars()
                .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
                .collect();
            (format!("label_{key}"), v.clone())
        });
        let series: LabelSet = series.into_iter().chain(labels).collect();
        let key = (namespace.to_string(), run.to_string());
        let old = self
            .labelled
            .lock()
            .expect("not poisoned")
            .insert(key, series.clone());
        if let Some(old) = old.filter(|old| *old != series) {
            self.run_labels.remove(&old);
        }
        self.run_labels.get_or_create(&series).set(1);
    }

    /// Drops the series of runs not among `existing` ("namespace/name" keys), of every
    /// component they had.
    pub fn retain_runs(&self, existing: &[String]) {
        self.labelled
            .lock()
            .expect("not poisoned")
            .retain(|(namespace, run), series| {
                let keep = existing.contains(&format!("{namespace}/{run}"));
                if !keep {
                    self.run_labels.remove(series);
                }
                keep
            });
        let mut runs = self.runs.lock().expect("not poisoned");
        runs.retain(|(namespace, run), components| {
            if existing.contains(&format!("{namespace}/{run}")) {
                return true;
            }
            for p in PHASES {
                self.run_phase.remove(&PhaseLabels {
                    namespace: namespace.clone(),
                    run: run.clone(),
                    phase: format!("{p:?}"),
                });
            }
            for component in components.iter() {
                self.remove_component(namespace, run, component);
            }
            for role in super::usage::ROLES {
                let labels = RoleLabels {
                    namespace: namespace.clone(),
                    run: run.clone(),
                    role: role.into(),
                };
                self.gpu_seconds.remove(&labels);
                self.cpu_seconds.remove(&labels);
            }
            false
        });
    }

    fn remove_component(&self, namespace: &str, run: &str, component: &str) {
        let labels = ComponentLabels {
            namespace: namespace.into(),
            run: run.into(),
            component: component.into(),
        };
        self.ready_pods.remove(&labels);
        self.desired_pods.remove(&labels);
        for reason in Reason::ALL {
            self.blocked.remove(&BlockedLabels {
                namespace: namespace.into(),
                run: run.into(),
                component: component.into(),
                reason: reason.as_str().into(),
            });
        }
    }

    pub fn encode(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)
            .expect("writing to a String cannot fail");
        out
    }
}

/// Serves the endpoints on `listener` until the process ends.
pub async fn serve(
    listener: tokio::net::TcpListener,
    metrics: Arc<Metrics>,
) -> std::io::Result<()> {
    let app = Router::new()
        .route(
            "/metrics",
            get(|State(m): State<Arc<Metrics>>| async move { m.encode() }),
        )
        .route("/healthz", get(|| async { "ok" }))
        .route(
            "/readyz",
            get(|State(m): State<Arc<Metrics>>| async move {
                if m.ready.load(Ordering::Relaxed) {
                    (StatusCode::OK, "ok")
                } else {
                    (StatusCode::SERVICE_UNAVAILABLE, "waiting for the lease")
                }
            }),
        )
        .with_state(metrics);
    axum::serve(listener, app).await
}

/// Binds the metrics address (port 0 picks a free one; the bound address is logged).
pub async fn bind(addr: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    tracing::info!(addr = %listener.local_addr()?, "serving /metrics, /healthz and /readyz");
    Ok(listener)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::controller::causes::Cause;

    fn component(name: &'static str, ready: i32, cause: Option<Reason>) -> Component {
        Component {
            name,
            desired: 2,
            ready,
            pods: 2,
            settled: ready == 2,
            cause: cause.map(|reason| Cause {
                reason,
                pod: format!("r-{name}-0"),
                message: "m".into(),
            }),
        }
    }

    #[test]
    fn a_runs_phase_readiness_and_cause_are_gauges_that_go_with_the_run() {
        let m = Metrics::default();
        m.observe_run(
            "ns",
            "r",
            Some(Phase::Pending),
            &[
                component("engines", 0, Some(Reason::Unschedulable)),
                component("trainer", 2, None),
                component("judge", 0, Some(Reason::ImagePullFailed)),
                component("teacher", 2, None),
            ],
            None,
        );
        let text = m.encode();
        for line in [
            "moult_operator_run_phase{namespace=\"ns\",run=\"r\",phase=\"Pending\"} 1",
            "moult_operator_run_phase{namespace=\"ns\",run=\"r\",phase=\"Running\"} 0",
            "moult_operator_run_ready_pods{namespace=\"ns\",run=\"r\",component=\"engines\"} 0",
            "moult_operator_run_desired_pods{namespace=\"ns\",run=\"r\",component=\"engines\"} 2",
            "moult_operator_run_blocked{namespace=\"ns\",run=\"r\",component=\"engines\",reason=\"Unschedulable\"} 1",
            "moult_operator_run_blocked{namespace=\"ns\",run=\"r\",component=\"trainer\",reason=\"Unschedulable\"} 0",
        ] {
            assert!(text.contains(line), "{line} in:\n{text}");
        }
        assert!(
            text.contains("component=\"judge\",reason=\"ImagePullFailed\"} 1"),
            "{text}"
        );
        // A component the spec no longer has (the judge removed) takes its series with it.
        m.observe_run(
            "ns",
            "r",
            Some(Phase::Running),
            &[component("trainer", 2, None), component("teacher", 2, None)],
            Some(&crate::api::Usage {
                gpu_hours: 1.0,
                roles: [(
                    "trainer".to_string(),
                    crate::api::RoleUsage {
                        gpu_seconds: 3600.0,
                        cpu_seconds: 7200.0,
                        gpus: 1.0,
                        cpus: 2.0,
                    },
                )]
                .into(),
                observed_at: k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                    k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
                ),
            }),
        );
        let text = m.encode();
        for line in [
            "moult_operator_run_gpu_seconds{namespace=\"ns\",run=\"r\",role=\"trainer\"} 3600.0",
            "moult_operator_run_cpu_seconds{namespace=\"ns\",run=\"r\",role=\"trainer\"} 7200.0",
        ] {
            assert!(text.contains(line), "{line} in:\n{text}");
        }
        assert!(
            !m.encode().contains("component=\"judge\""),
            "{}",
            m.encode()
        );
        assert!(
            !m.encode().contains("component=\"engines\""),
            "{}",
            m.encode()
        );
        let team = [
            ("team".to_string(), "rl".to_string()),
            ("app.kubernetes.io/part-of".to_string(), "x".to_string()),
        ];
        m.label_run("ns", "r", &team.into());
        let text = m.encode();
        let line = "moult_operator_run_labels{namespace=\"ns\",run=\"r\",label_app_kubernetes_io_part_of=\"x\",label_team=\"rl\"} 1";
        assert!(text.contains(line), "{line} in:\n{text}");
        m.label_run(
            "ns",
            "r",
            &[("team".to_string(), "infra".to_string())].into(),
        );
        assert!(
            !m.encode().contains("label_team=\"rl\""),
            "a changed label takes its old series away"
        );
        m.retain_runs(&["ns/r".into()]);
        assert!(m.encode().contains("run=\"r\""));
        m.retain_runs(&[]);
        assert!(!m.encode().contains("run=\"r\""), "{}", m.encode());
    }
}
