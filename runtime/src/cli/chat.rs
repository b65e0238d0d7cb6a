//! `moult chat`: the loopback server (OpenAI and Anthropic chat on exact tokens) against a
//! running engine, on 127.0.0.1, so that an agent can be tried by hand.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::ensure;
use moult_runtime::loopback::{self, ChatService, ServiceOptions};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The engine (or router) to generate with: the built-in engine or vLLM.
    #[arg(long)]
    engine: String,
    /// The model's folder: tokenizer.json and its chat template (chat_template.jinja or
    /// tokenizer_config.json).
    #[arg(long)]
    model: PathBuf,
    /// Port on 127.0.0.1 (the loopback server never listens on other interfaces); 0 picks one.
    #[arg(long, default_value_t = 8100)]
    port: u16,
    /// Sessions kept at once; more get 429 until some are deleted or expire.
    #[arg(long, default_value_t = 1024)]
    max_sessions: usize,
    /// A session unused this long is dropped when a new session needs room ("0s": never).
    #[arg(long, default_value = "1h", value_parser = humantime::parse_duration)]
    session_idle: std::time::Duration,
    /// Turns one session may take; more get 429.
    #[arg(long, default_value_t = loopback::DEFAULT_MAX_TURNS)]
    max_turns: usize,
    /// Tokens one session may record over all its segments; a turn after that gets 429.
    #[arg(long, default_value_t = loopback::DEFAULT_MAX_SESSION_TOKENS)]
    max_session_tokens: usize,
    /// Largest request body accepted (bytes).
    #[arg(long, default_value_t = loopback::DEFAULT_MAX_BODY_BYTES)]
    max_body_bytes: usize,
    /// The name answered by /v1/models [default: the model folder's name].
    #[arg(long)]
    served_model_name: Option<String>,
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    let stop = super::role_stop()?.cancelled_owned();
    for (flag, value) in [
        ("--max-sessions", args.max_sessions),
        ("--max-turns", args.max_turns),
        ("--max-session-tokens", args.max_session_tokens),
    ] {
        ensure!(value > 0, "{flag} must be at least 1");
    }
    let service = ChatService::from_model_dir(
        &args.engine,
        &args.model,
        ServiceOptions {
            max_sessions: args.max_sessions,
            model_name: (args.served_model_name).unwrap_or_else(|| super::folder_name(&args.model)),
            registered_sessions: false,
            session_idle: (!args.session_idle.is_zero()).then_some(args.session_idle),
            max_turns: args.max_turns,
            max_session_tokens: args.max_session_tokens,
        },
    )
    .map_err(anyhow::Error::msg)?;
    let listener = super::bind("127.0.0.1", args.port).await?;
    let (addr, engine) = (listener.local_addr()?, &args.engine);
    println!("moult chat listening on http://{addr} (engine {engine})");
    println!("  OpenAI:    base_url=http://{addr}/s/SESSION/v1");
    println!("  Anthropic: base_url=http://{addr}/s/SESSION");
    let app = loopback::router(Arc::new(service), args.max_body_bytes);
    Ok(moult_runtime::serve::serve(listener, app, stop).await?)
}
