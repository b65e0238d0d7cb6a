//! `moult engine-front`: the run-token check in front of an engine that has none of its own (a
//! vLLM server on its pod's loopback; docs/security.md).

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The engine behind the front, e.g. http://127.0.0.1:8001.
    #[arg(long)]
    upstream: String,
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    #[arg(long, default_value_t = 8000)]
    port: u16,
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    let stop = super::role_stop()?.cancelled_owned();
    let routes = moult_runtime::engine::front::routes(&args.upstream)?;
    let listener = super::bind(&args.host, args.port).await?;
    let addr = listener.local_addr()?;
    println!("moult engine-front listening on http://{addr}");
    Ok(moult_runtime::serve::serve(listener, routes, stop).await?)
}
