//! `moult sandbox`: start agent programs for `moult agents` in a container that holds no
//! credential (docs/security.md).

use std::path::PathBuf;

use anyhow::Context;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The Unix socket to listen on (in a folder shared with the `moult agents` container).
    #[arg(long)]
    socket: PathBuf,
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    eprintln!("moult sandbox listening on {}", args.socket.display());
    moult_jail::sandbox::serve(&args.socket)
        .await
        .with_context(|| format!("serving the agent sandbox on {}", args.socket.display()))
}
