//! The serving side of a local run, every role as tasks of this process on loopback ports: the
//! built-in engines (or vLLM processes, [`super::vllm`]), the router in front of them, the loopback server the agents talk to, and the
//! agent pool; with `spec.judge`, one more engine on the judge model with a chat service of its
//! own (the judge's tokenizer and template). The same HTTP APIs as on a cluster, so a local run
//! exercises the real paths.

use std::path::Path;
use std::sync::Arc;

use tch::{Device, Kind};
use tokio::net::TcpListener;
use tokio::sync::watch;

use super::vllm::VllmProcess;
use crate::agents::AgentPool;
use crate::config::RunConfig;
use crate::engine::pool::LocalPool;
use crate::engine::{http, EngineHandle, EngineOptions};
use crate::error::RunError;
use crate::model::{lora::LoraConfig, CausalLm, ModelConfig};
use crate::records::console::Console;
use crate::router::{server, EnginePool};
use crate::stages::judge::Judge;
use crate::stages::teacher::Teacher;
use crate::weight_sync::publish::PublishOptions;
use moult_operator::api::EngineBackend;

/// The running serving side; dropping it stops every server (and the vLLM processes).
#[derive(Debug)]
pub struct Stack {
    /// The router's base URL: generation and weight updates go through it.
    pub router_url: String,
    router: Arc<crate::router::Router>,
    pub agents: Arc<AgentPool>,
    /// The judge of LLM-as-judge rewards, when the run has one.
    pub judge: Option<Judge>,
    /// A served distillation teacher (`algorithm.teacher.replicas`): one built-in engine.
    pub teacher: Option<Teacher>,
    /// vLLM engines this run started (`engines.backend: vLLM`), held until the stack drops.
    _vllm: Vec<VllmProcess>,
    stop: watch::Sender<bool>,
}

impl Drop for Stack {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
    }
}

/// The engines of the EnginePool `name` running on this machine (`moult pool`), which this run
/// then reaches with its pool credential (docs/lora.md, "Two runs on one pool").
fn pool_engines(name: &str, cfg: &RunConfig) -> Result<Vec<String>, RunError> {
    let Some(pool) = LocalPool::find(name) else {
        let why = format!("no EnginePool `{name}` runs on this machine: start it with `moult pool MANIFEST` (docs/lora.md)");
        return Err(RunError::field("spec.engines.poolRef.name", why));
    };
    if std::fs::canonicalize(&cfg.model_dir).ok().as_ref() != Some(&pool.model) {
        let why = format!(
            "the pool `{name}` serves {}; a run on it trains an adapter of that model",
            pool.model.display()
        );
        return Err(RunError::field("spec.model.path", why));
    }
    let credential = moult_operator::credentials::pool_credential(&pool.token, &cfg.name);
    let _ = crate::auth::POOL_CREDENTIAL.set(Some(credential));
    Ok(pool.engines)
}

async fn bind() -> Result<(TcpListener, String), RunError> {
    let start = RunError::start("binding 127.0.0.1");
    let listener = TcpListener::bind(("127.0.0.1", 0)).await.map_err(&start)?;
    let url = format!("http://{}", listener.local_addr().map_err(&start)?);
    Ok((listener, url))
}

async fn stopped(mut rx: watch::Receiver<bool>) {
    let _ = rx.wait_for(|s| *s).await;
}

/// Starts one built-in engine on `model_dir`.
async fn engine(
    (model_dir, lora): (&Path, Option<&LoraConfig>),
    device: Device,
    opts: EngineOptions,
    stop: watch::Receiver<bool>,
) -> Result<String, RunError> {
    let (dir, lora) = (model_dir.to_path_buf(), lora.cloned());
    let load = move || CausalLm::load_lora(&dir, lora.as_ref(), Kind::Float, device);
    let model = tokio::task::spawn_blocking(load).await??;
    let name = model_dir
        .file_name()
        .map_or("model".into(), |n| n.to_string_lossy().into_owned());
    let (handle, _thread) = EngineHandle::spawn(model, name, opts);
    let (listener, url) = bind().await?;
    tokio::spawn(http::serve(listener, handle, stopped(stop)));
    Ok(url)
}

/// Starts a built-in engine on a model that never takes weight updates (the judge's, a served
/// teacher's): outside the router, with the model's whole context, `batch` requests at once.
async fn fixed_engine(
    model_dir: &Path,
    batch: usize,
    device: Device,
    stop: watch::Receiver<bool>,
) -> Result<String, RunError> {
    let opts = EngineOptions::for_model(&ModelConfig::from_dir(model_dir)?, batch.clamp(1, 256));
    engine((model_dir, None), device, opts, stop).await
}

impl Stack {
    /// Ends the serving side in order: engines abort what they still run (so nothing waits on
    /// a stream that will never finish), a run on an EnginePool unloads its adapters from the
    /// pool's engines, then every server stops.
    pub async fn shutdown(self) {
        let _ = crate::auth::client()
            .post(format!("{}/pause?mode=abort", self.router_url))
            .timeout(std::time::Duration::from_secs(5))
            .send()
            .await;
        server::unload_adapters(&self.router).await;
    }

    /// How the trainer publishes to these engines: through the router, over the run's
    /// transport; the Filesystem transport writes under `<out>/weights`.
    pub fn publish_options(
        &self,
        cfg: &RunConfig,
        out: &Path,
        device: Device,
    ) -> Result<PublishOptions, RunError> {
        Ok(PublishOptions::new(
            &cfg.run,
            ModelConfig::from_dir(&cfg.model_dir)?.dtype.as_deref(),
            self.router_url.clone(),
            device,
            ("127.0.0.1".into(), 0),
            Some(out.join("weights")),
        )?)
    }

    pub async fn start(
        cfg: &RunConfig,
        device: Device,
        scratch: &Path,
        console: &Console,
    ) -> Result<Self, RunError> {
        let (stop, stop_rx) = watch::channel(false);
        let model_cfg = ModelConfig::from_dir(&cfg.model_dir)?;
        let opts = EngineOptions {
            max_model_len: (cfg.run.spec.model.max_model_len)
                .map_or(model_cfg.max_position_embeddings, |n| n as usize),
            return_routed_experts: cfg.routing_replay && model_cfg.moe.is_some(),
            // Every running episode's turn fits in one decoding batch.
            ..EngineOptions::for_model(&model_cfg, cfg.concurrency.clamp(1, 256))
        };
        // The policy's engines serve a LoRA run's adapter (docs/lora.md).
        let policy = (cfg.model_dir.as_path(), cfg.trainer.lora.as_ref());
        // A run on an EnginePool has no engines of its own.
        let (mut urls, own) = match &cfg.run.spec.engines.pool_ref {
            Some(pool) => (pool_engines(&pool.name, cfg)?, 0),
            None => (Vec::new(), cfg.engines),
        };
        let mut vllm = Vec::new();
        for index in 0..own {
            match cfg.run.spec.engines.backend {
                EngineBackend::Builtin => {
                    urls.push(engine(policy, device, opts.clone(), stop_rx.clone()).await?);
                }
                EngineBackend::Vllm => {
                    let logs = scratch.parent().unwrap_or(scratch);
                    let process = VllmProcess::start(cfg, index, device, logs, console).await?;
                    urls.push(process.url.clone());
                    vllm.push(process);
                }
            }
        }
        let pool = Arc::new(EnginePool::new(&urls));
        let router = crate::router::for_run(pool);
        let (listener, router_url) = bind().await?;
        let serve = server::serve(listener, router.clone(), stopped(stop_rx.clone()));
        tokio::spawn(serve);

        // The judge and a served teacher take a step's episodes all at once.
        let episodes = cfg.rollout.batch_size * cfg.rollout.group_size;
        let judge = match &cfg.judge {
            Some(opts) => {
                // Its own engine, and a chat service with its tokenizer and template.
                let url = fixed_engine(&opts.model_dir, episodes, device, stop_rx.clone()).await?;
                Some(Judge::connect(&url, opts, &cfg.model_dir, episodes)?)
            }
            None => None,
        };
        let teacher = match (&cfg.teacher_dir, cfg.served_teacher) {
            (Some(dir), Some(_)) => {
                let url = fixed_engine(dir, episodes, device, stop_rx.clone()).await?;
                Some(Teacher::new(Arc::new(EnginePool::new(&[url]))))
            }
            _ => None,
        };
        let (agent, opts) = cfg.agent_pool(cfg.concurrency, scratch.to_path_buf())?;
        let model = (cfg.model_dir.as_path(), cfg.name.clone());
        let (listener, _) = bind().await?;
        let shutdown = stopped(stop_rx.clone());
        let agents = AgentPool::serve(&router_url, model, agent, opts, listener, shutdown)?;
        Ok(Self {
            router_url,
            router,
            agents,
            judge,
            teacher,
            _vllm: vllm,
            stop,
        })
    }
}
