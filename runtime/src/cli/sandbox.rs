//! `moult sandbox`: start agent programs for `moult agents` in a container that holds no
//! credential (`--socket`), or run an episode's model-written code in a sandbox pod of its own
//! (`--serve`, docs/security.md#sandbox-pods).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context};
use moult_sandbox_pods::server::{Server, VERIFIER_ENV};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The Unix socket to listen on (in a folder shared with the `moult agents` container).
    #[arg(long, conflicts_with = "serve", required_unless_present = "serve")]
    socket: Option<PathBuf>,
    /// Serve `moult.sandbox.run` calls over HTTP here (a sandbox pod); callers present the key
    /// whose SHA-256 is in MOULT_SANDBOX_VERIFIER.
    #[arg(long)]
    serve: Option<SocketAddr>,
    /// With --serve: the folder the calls of the pod's episode share.
    #[arg(long, default_value = "/tmp/workspace")]
    workspace: PathBuf,
    /// With --serve: `episode` runs each call in a jail of its own, `process` in a process group.
    #[arg(long, default_value = "episode", value_parser = ["episode", "process"])]
    isolation: String,
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    let Some(addr) = args.serve else {
        let socket = args.socket.expect("clap requires --socket without --serve");
        eprintln!("moult sandbox listening on {}", socket.display());
        return (moult_jail::sandbox::serve(&socket).await)
            .with_context(|| format!("serving the agent sandbox on {}", socket.display()));
    };
    let verifier =
        std::env::var(VERIFIER_ENV).with_context(|| format!("--serve needs {VERIFIER_ENV}"))?;
    let jailed = args.isolation == "episode";
    // Beside the workspace, out of the calls' reach.
    let streams = args.workspace.with_file_name(".moult-sandbox-streams");
    let server = Server::new(&verifier, args.workspace, streams, jailed);
    let server = Arc::new(server.map_err(anyhow::Error::msg)?);
    if jailed {
        if let Err(why) = moult_jail::Jail::default().probe(None) {
            bail!("this sandbox pod cannot make jails: {why}; set spec.agent.isolation: Process to run its calls in process groups (docs/security.md#sandbox-pods)");
        }
    }
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding {addr}"))?;
    eprintln!("moult sandbox serving on {addr}");
    moult_runtime::serve::serve(listener, server.router(), std::future::pending()).await?;
    Ok(())
}
