//! `moult sandbox`: start agent programs for `moult agents` in a container that holds no
//! credential (`--socket`), or run an episode's model-written code in a sandbox pod of its own
//! (`--serve`, docs/security.md#sandbox-pods). `moult`'s main dispatches here.

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Context;
use tokio::net::TcpListener;

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

/// Runs `moult sandbox`; `serve` serves a router on a listener until the process ends (moult's
/// HTTP server, with its timeouts).
pub async fn run<F>(
    args: Args,
    serve: impl FnOnce(TcpListener, axum::Router) -> F,
) -> anyhow::Result<()>
where
    F: std::future::Future<Output = std::io::Result<()>>,
{
    let Some(addr) = args.serve else {
        let socket = args.socket.expect("clap requires --socket without --serve");
        eprintln!("moult sandbox listening on {}", socket.display());
        return (moult_jail::sandbox::serve(&socket).await)
            .with_context(|| format!("serving the agent sandbox on {}", socket.display()));
    };
    let jailed = args.isolation == "episode";
    let bound = crate::server::bind(addr, args.workspace, jailed).await;
    let (server, listener) = bound.map_err(anyhow::Error::msg)?;
    eprintln!("moult sandbox serving on {addr}");
    serve(listener, server.router()).await?;
    Ok(())
}
