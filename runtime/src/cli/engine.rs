//! `moult engine`: serve a model folder with the built-in engine behind vLLM's
//! token-in/token-out API, until a shutdown signal or until the engine's compute thread stops.

use std::path::PathBuf;

#[derive(Debug, clap::Args)]
pub struct Args {
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
    /// Serve with a new LoRA adapter of this shape, which weight updates then write (a LoRA
    /// run's engines; docs/lora.md), as JSON: {"rank":8,"alpha":16,"targets":["q_proj",...]}.
    #[arg(long)]
    lora: Option<String>,
    /// Serve as an engine of an `EnginePool`, holding at most this many adapters (docs/lora.md).
    #[arg(long)]
    pool_max_adapters: Option<usize>,
    /// The largest adapter rank a pool engine takes.
    #[arg(long, default_value_t = 64)]
    max_lora_rank: i64,
}

#[cfg(feature = "torch")]
pub async fn run(args: Args) -> anyhow::Result<()> {
    let stop = super::role_stop()?.cancelled_owned();
    use anyhow::{bail, Context};
    use moult_runtime::engine::{http, pool::PoolLimits, EngineHandle, EngineOptions};
    use moult_runtime::model::{parse_dtype, CausalLm, ModelConfig};
    use tch::{Device, Kind};
    let device = super::device(args.device.as_deref(), true)?;
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
    let name = (args.served_model_name).unwrap_or_else(|| super::folder_name(&args.model));
    tracing::info!(model = %args.model.display(), ?kind, ?device, "loading");
    let started = std::time::Instant::now();
    let lora = (args.lora.as_deref().map(serde_json::from_str).transpose()).context("--lora")?;
    let load = move || CausalLm::load_lora(&args.model, lora.as_ref(), kind, device);
    let model = tokio::task::spawn_blocking(load).await??;
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
        pool: (args.pool_max_adapters).map(|max_adapters| PoolLimits {
            max_adapters,
            max_rank: args.max_lora_rank,
        }),
    };
    if args.enable_return_routed_experts && cfg.moe.is_none() {
        tracing::warn!(
            "--enable-return-routed-experts has no effect: the model is not a mixture of experts"
        );
    }
    let (handle, thread) = EngineHandle::spawn(model, name, opts);
    let listener = super::bind(&args.host, args.port).await?;
    let addr = listener.local_addr()?;
    println!("moult engine listening on http://{addr}");
    // The process ends with its engine thread: a server whose engine is gone would only answer
    // errors (docs/security.md).
    let died = tokio::task::spawn_blocking(move || thread.join());
    let shutdown = async move {
        tokio::select! {
            () = stop => {}
            _ = died => {}
        }
    };
    let engine = handle.clone();
    http::serve(listener, handle, shutdown).await?;
    if !engine.alive() {
        bail!("the engine's compute thread stopped (its error is above); exiting so that the engine is restarted");
    }
    Ok(())
}
