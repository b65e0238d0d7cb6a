//! The `moult` command line.

use std::path::PathBuf;

use anyhow::{bail, Context};
use clap::{Parser, Subcommand};
use moult_runtime::engine::{http, EngineHandle, EngineOptions};
use moult_runtime::model::{parse_dtype, ModelConfig, Qwen3Model};
use tch::{Device, Kind};

#[derive(Debug, Parser)]
#[command(
    name = "moult",
    version,
    about = "Kubernetes-native agentic RL for LLMs"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Serve a model with the built-in engine behind vLLM's token-in/token-out API.
    Engine(EngineArgs),
    /// Serve the loopback server (OpenAI and Anthropic chat on exact tokens) against a running
    /// engine, so an agent can be tried by hand; `GET /s/{session}/trajectory` shows what a
    /// session recorded.
    Chat(ChatArgs),
}

#[derive(Debug, clap::Args)]
struct ChatArgs {
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
    /// Sessions kept at once; more get 429 until some are deleted.
    #[arg(long, default_value_t = 1024)]
    max_sessions: usize,
    /// Largest request body accepted (bytes).
    #[arg(long, default_value_t = moult_runtime::loopback::DEFAULT_MAX_BODY_BYTES)]
    max_body_bytes: usize,
    /// The name answered by /v1/models [default: the model folder's name].
    #[arg(long)]
    served_model_name: Option<String>,
}

#[derive(Debug, clap::Args)]
struct EngineArgs {
    /// A Hugging Face model folder: config.json and model.safetensors (or sharded with an index).
    #[arg(long)]
    model: PathBuf,
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Sequences decoded together in one step.
    #[arg(long, default_value_t = 32)]
    max_batch: usize,
    /// Longest prompt + output per request [default: the model's max_position_embeddings].
    #[arg(long)]
    max_model_len: Option<usize>,
    /// Prompt tokens processed per step; longer prompts are prefilled in chunks.
    #[arg(long, default_value_t = 2048)]
    max_prefill_tokens: usize,
    /// Requests accepted beyond the running batch before new ones get 429.
    #[arg(long, default_value_t = 4096)]
    max_waiting: usize,
    /// Weight dtype: auto (float32 on CPU, the checkpoint's dtype on CUDA), float32, bfloat16, float16.
    #[arg(long, default_value = "auto")]
    dtype: String,
    /// cpu, cuda or cuda:N [default: cuda if available, else cpu].
    #[arg(long)]
    device: Option<String>,
    /// Return the routed expert ids of MoE models (`routed_experts` in each response).
    #[arg(long)]
    enable_return_routed_experts: bool,
    /// libtorch intra-op threads [default: 1 for small models (hidden size < 512), else all cores].
    #[arg(long)]
    threads: Option<usize>,
    /// Keep weights packed for oneDNN matmuls on CPU (faster decoding, twice the weight
    /// memory): auto (all but small models), on, off.
    #[arg(long, default_value = "auto")]
    packed_weights: String,
    /// The name reported by /v1/models and in metrics labels [default: the model folder's name].
    #[arg(long)]
    served_model_name: Option<String>,
}

fn parse_device(text: Option<&str>) -> anyhow::Result<Device> {
    Ok(match text {
        None => Device::cuda_if_available(),
        Some("cpu") => Device::Cpu,
        Some("cuda") => Device::Cuda(0),
        Some(other) => match other.strip_prefix("cuda:").and_then(|n| n.parse().ok()) {
            Some(n) => Device::Cuda(n),
            None => bail!("--device must be cpu, cuda or cuda:N; got `{other}`"),
        },
    })
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! { _ = ctrl_c => {}, _ = term => {} }
    tracing::info!("shutting down: draining connections");
}

async fn engine(args: EngineArgs) -> anyhow::Result<()> {
    let device = parse_device(args.device.as_deref())?;
    let cfg = ModelConfig::from_dir(&args.model)?;
    let kind = match args.dtype.as_str() {
        "auto" if device == Device::Cpu => Kind::Float,
        "auto" => cfg
            .dtype
            .as_deref()
            .and_then(parse_dtype)
            .unwrap_or(Kind::BFloat16),
        other => parse_dtype(other).with_context(|| {
            format!("--dtype must be auto, float32, bfloat16 or float16; got `{other}`")
        })?,
    };
    if args.max_batch == 0 || args.max_prefill_tokens == 0 || args.threads == Some(0) {
        bail!("--max-batch, --max-prefill-tokens and --threads must be at least 1");
    }
    let name = args
        .served_model_name
        .clone()
        .unwrap_or_else(|| folder_name(&args.model));
    tracing::info!(model = %args.model.display(), ?kind, ?device, "loading");
    let started = std::time::Instant::now();
    let model = {
        let dir = args.model.clone();
        tokio::task::spawn_blocking(move || Qwen3Model::load(&dir, kind, device)).await??
    };
    tracing::info!(seconds = started.elapsed().as_secs_f32(), "model loaded");
    let opts = EngineOptions {
        max_batch: args.max_batch,
        max_model_len: args.max_model_len.unwrap_or(cfg.max_position_embeddings),
        max_prefill_tokens: args.max_prefill_tokens,
        max_waiting: args.max_waiting,
        return_routed_experts: args.enable_return_routed_experts,
        eos_token_ids: cfg.eos_token_ids.clone(),
        threads: args.threads,
        packed_weights: match args.packed_weights.as_str() {
            "auto" => None,
            "on" => Some(true),
            "off" => Some(false),
            other => bail!("--packed-weights must be auto, on or off; got `{other}`"),
        },
    };
    if args.enable_return_routed_experts && cfg.moe.is_none() {
        tracing::warn!(
            "--enable-return-routed-experts has no effect: the model is not a mixture of experts"
        );
    }
    let (handle, _thread) = EngineHandle::spawn(model, name, opts);
    let addr = format!("{}:{}", args.host, args.port);
    let listener = tokio::net::TcpListener::bind(&addr)
        .await
        .with_context(|| format!("binding {addr}"))?;
    println!(
        "moult engine listening on http://{}",
        listener.local_addr()?
    );
    http::serve(listener, handle, shutdown_signal()).await?;
    Ok(())
}

fn folder_name(dir: &std::path::Path) -> String {
    dir.file_name()
        .map_or("model".into(), |n| n.to_string_lossy().into_owned())
}

async fn chat(args: ChatArgs) -> anyhow::Result<()> {
    use moult_runtime::chat::{ChatTemplate, Tokenizer};
    use moult_runtime::loopback::{self, ChatService, EngineClient, ServiceOptions};
    if args.max_sessions == 0 {
        bail!("--max-sessions must be at least 1");
    }
    let tokenizer = Tokenizer::from_model_dir(&args.model)?;
    let template = ChatTemplate::from_model_dir(&args.model)?;
    let service = ChatService::new(
        EngineClient::new(&args.engine),
        tokenizer,
        template,
        ServiceOptions {
            max_sessions: args.max_sessions,
            model_name: args
                .served_model_name
                .clone()
                .unwrap_or_else(|| folder_name(&args.model)),
        },
    );
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", args.port))
        .await
        .with_context(|| format!("binding 127.0.0.1:{}", args.port))?;
    let addr = listener.local_addr()?;
    println!(
        "moult chat listening on http://{addr} (engine {})",
        args.engine
    );
    println!("  OpenAI:    base_url=http://{addr}/s/SESSION/v1");
    println!("  Anthropic: base_url=http://{addr}/s/SESSION");
    loopback::serve(
        listener,
        std::sync::Arc::new(service),
        args.max_body_bytes,
        shutdown_signal(),
    )
    .await?;
    Ok(())
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    match cli.command {
        Command::Engine(args) => runtime.block_on(engine(args)),
        Command::Chat(args) => runtime.block_on(chat(args)),
    }
}
