//! `moult-operator`: the RLRun controller, with leader election, metrics and health endpoints.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use clap::Parser;
use k8s_openapi::api::networking::v1::{NetworkPolicyEgressRule, NetworkPolicyPeer};
use moult_operator::children::{self, Images};
use moult_operator::controller::{self, leader, metrics, Settings};

#[derive(Parser, Debug)]
#[command(
    name = "moult-operator",
    about = "Reconciles RLRuns into engines, trainer, coordinator and agents"
)]
struct Args {
    /// Watch only these namespaces (all namespaces when absent): repeat the flag or separate
    /// them with commas. The operator then needs RBAC in those namespaces alone.
    #[arg(
        long = "namespace",
        env = "MOULT_WATCH_NAMESPACE",
        value_delimiter = ','
    )]
    namespaces: Vec<String>,
    /// Reconciles at once (never two of the same run).
    #[arg(long, default_value_t = 8)]
    concurrency: u16,
    /// Re-check of every run even when nothing changed, as a Go duration.
    #[arg(long, default_value = "5m")]
    resync: kube::core::Duration,
    /// Address of /metrics, /healthz and /readyz.
    #[arg(long, default_value = "0.0.0.0:8080")]
    metrics_addr: SocketAddr,
    /// Elect a leader on a Lease so that only one replica writes.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    leader_election: bool,
    #[arg(long, default_value = "moult-operator")]
    lease_name: String,
    /// Namespace of the Lease (the pod's own namespace in the Helm chart).
    #[arg(long, env = "POD_NAMESPACE", default_value = "default")]
    lease_namespace: String,
    /// This replica's name in the Lease (the pod name in the Helm chart).
    #[arg(long, env = "POD_NAME")]
    identity: Option<String>,
    /// How long a leader that stopped renewing keeps the Lease.
    #[arg(long, default_value = "15s")]
    lease_duration: kube::core::Duration,
    /// How often the leader renews the Lease.
    #[arg(long, default_value = "5s")]
    lease_renew: kube::core::Duration,
    #[arg(long, env = "MOULT_VLLM_IMAGE", default_value_t = Images::default().vllm)]
    vllm_image: String,
    #[arg(long, env = "MOULT_RUNTIME_IMAGE", default_value_t = Images::default().runtime)]
    runtime_image: String,
    #[arg(long, env = "MOULT_INIT_IMAGE", default_value_t = Images::default().init)]
    init_image: String,
    /// Where agent pods may send DNS queries, as a NetworkPolicy egress rule in JSON (kube-system's
    /// `k8s-app: kube-dns` pods, port 53 UDP and TCP, when absent).
    #[arg(long, env = "MOULT_AGENT_DNS")]
    agent_dns: Option<String>,
    /// Who may scrape `/metrics` on the coordinator's and engines' API ports, as a JSON list of
    /// NetworkPolicy peers (`[{"namespaceSelector": ..., "podSelector": ...}]`); nobody outside
    /// the run when absent.
    #[arg(long, env = "MOULT_METRICS_FROM")]
    metrics_from: Option<String>,
    /// Where agent pods of runs with `spec.agent.sandbox` reach the Kubernetes API server (to
    /// claim sandbox pods), as a NetworkPolicy egress rule in JSON; when absent, the addresses
    /// and ports of the `default/kubernetes` Service's endpoints, read at start.
    #[arg(long, env = "MOULT_AGENT_API_SERVER")]
    agent_api_server: Option<String>,
    /// Give every run a PodDisruptionBudget with `maxUnavailable: 0` for its trainer and one for
    /// its coordinator, so that drains and autoscaler scale-downs do not evict them mid-run
    /// (docs/operator.md, "Disruption budgets"). `--disruption-budgets` alone means true.
    #[arg(
        long,
        env = "MOULT_DISRUPTION_BUDGETS",
        default_value_t = false,
        num_args = 0..=1,
        default_missing_value = "true",
        action = clap::ArgAction::Set
    )]
    disruption_budgets: bool,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,kube=warn".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let args = Args::parse();
    let _ = rustls::crypto::ring::default_provider().install_default();
    let client = kube::Client::try_default()
        .await
        .context("no Kubernetes configuration (KUBECONFIG or in-cluster)")?;
    let metrics = Arc::new(metrics::Metrics::default());
    let listener = metrics::bind(args.metrics_addr)
        .await
        .with_context(|| format!("binding {}", args.metrics_addr))?;
    tokio::spawn(metrics::serve(listener, metrics.clone()));
    let identity = args
        .identity
        .clone()
        .unwrap_or_else(|| format!("moult-operator-{}", std::process::id()));
    let dns: NetworkPolicyEgressRule = match &args.agent_dns {
        Some(json) => serde_json::from_str(json)
            .context("--agent-dns must be a NetworkPolicy egress rule in JSON")?,
        None => children::default_dns(),
    };
    let metrics_from: Vec<NetworkPolicyPeer> = match &args.metrics_from {
        Some(json) => serde_json::from_str(json)
            .context("--metrics-from must be a JSON list of NetworkPolicy peers")?,
        None => Vec::new(),
    };
    let api_server = match &args.agent_api_server {
        Some(json) => Some(
            serde_json::from_str(json)
                .context("--agent-api-server must be a NetworkPolicy egress rule in JSON")?,
        ),
        None => controller::api_server_egress(&client).await,
    };
    let settings = Settings {
        namespaces: args
            .namespaces
            .iter()
            .filter(|n| !n.is_empty())
            .cloned()
            .collect(),
        children: children::Config {
            images: Images {
                vllm: args.vllm_image.clone(),
                runtime: args.runtime_image.clone(),
                init: args.init_image.clone(),
            },
            dns,
            metrics_from,
            api_server,
            disruption_budgets: args.disruption_budgets,
            // The operator's pods, in the namespace of its Lease (its own, in the Helm chart).
            operator: Some(children::operator_pods(&args.lease_namespace)),
        },
        concurrency: args.concurrency,
        resync: positive(args.resync, "--resync")?,
    };
    if !args.leader_election {
        metrics.leader.set(1);
        controller::run(client, settings, metrics, &identity).await;
        return Ok(());
    }
    let timing = leader::Timing {
        duration: positive(args.lease_duration, "--lease-duration")?,
        renew: positive(args.lease_renew, "--lease-renew")?,
    };
    anyhow::ensure!(
        timing.renew < timing.duration,
        "--lease-renew must be shorter than --lease-duration"
    );
    let mut lock = leader::LeaseLock::new(
        client.clone(),
        &args.lease_namespace,
        &args.lease_name,
        &identity,
        timing,
    );
    tracing::info!(identity = %identity, lease = %format!("{}/{}", args.lease_namespace, args.lease_name), "waiting for the lease");
    lock.acquire().await;
    tracing::info!(identity = %identity, "became the leader");
    metrics.leader.set(1);
    tokio::select! {
        () = controller::run(client, settings, metrics.clone(), &identity) => {
            // Shut down by a signal: hand the lease over at once.
            if let Err(e) = lock.release().await {
                tracing::warn!(error = %e, "cannot release the lease");
            }
            Ok(())
        }
        () = lock.hold() => {
            metrics.leader.set(0);
            // Another replica may be the leader now: stop writing at once.
            anyhow::bail!("lost the lease {}/{}; exiting so that only the leader writes", args.lease_namespace, args.lease_name)
        }
    }
}

/// A flag's duration, refused when negative or zero.
fn positive(d: kube::core::Duration, flag: &str) -> anyhow::Result<Duration> {
    let std: Duration = d.into();
    anyhow::ensure!(
        !d.is_negative() && !std.is_zero(),
        "{flag} must be positive, not {d}"
    );
    Ok(std)
}
