//! One publisher: how a trainer's new weights reach the engines after a step, whatever the
//! transport (docs/weight-sync.md, "Weight transports"). `moult run` and `moult trainer` both publish
//! through [`Publisher`]; each update is pause → transfer → version → resume, through the router
//! (locally) or the coordinator's router (on a cluster), which fans the control calls out to every
//! engine and learns the version, so engines that missed an update are not routed to.
//!
//! - [`WeightTransport::Tcp`]: moult's packed TCP stream to built-in engines ([`WeightSync`]).
//! - [`WeightTransport::Filesystem`]: safetensors in a shared folder, reloaded by the engines
//!   ([`FolderPublisher`]); vLLM (CPU or GPU) and the built-in engine.
//! - [`WeightTransport::Nccl`]: NCCL from the trainer's GPU to vLLM engines (cargo feature
//!   `cuda`; not yet run on a GPU from here, docs/vllm.md).
//! - A run on an EnginePool ([`PoolAdapter`]) uploads its adapter as a new name per version;
//!   the shared engines never pause (docs/lora.md, "Engine pools").

use std::path::{Path, PathBuf};
use std::time::Instant;

use moult_operator::api::{EngineBackend, EnginesSpec, RLRun, WeightTransport};
use tch::{Device, Kind};
use tokio_util::sync::CancellationToken;

use super::folder::FolderPublisher;
#[cfg(feature = "cuda")]
use super::nccl::NcclPublisher;
use super::orchestrate::WeightSync;
use super::stream::WeightStream;
use super::{Control, SyncError, SyncReport};
use crate::model::lora::{self, LoraConfig};
use crate::trainer::train::Trainer;

/// Where and how a trainer publishes.
#[derive(Debug, Clone)]
pub struct PublishOptions {
    /// The router or coordinator in front of the engines.
    pub target: String,
    pub transport: WeightTransport,
    /// The trainer's device (NCCL sends from its GPU).
    pub device: Device,
    /// TCP: the host the trainer listens on and tells engines to connect to.
    pub host: String,
    /// TCP: the port it listens on (0: any free one; on a cluster the one the trainer's
    /// NetworkPolicy admits engines to).
    pub port: u16,
    /// Filesystem: the folder new weights go to, by the path engines read it under.
    pub folder: Option<PathBuf>,
    /// The dtype engines hold weights in (what the Filesystem and NCCL transports send).
    pub engine_kind: Kind,
    /// A run on an EnginePool: its adapter's uploads, whatever the transport.
    pub pool: Option<PoolAdapter>,
}

/// A LoRA run's adapter on an EnginePool or vLLM engines, published for version `N` as
/// `<run>-v<N>` through the router, which loads it on every engine and then names it in the
/// run's requests (docs/lora.md).
#[derive(Debug, Clone)]
pub struct PoolAdapter {
    pub run: String,
    pub lora: LoraConfig,
    /// The base model, as the adapter's `base_model_name_or_path` names it.
    pub base: String,
    /// vLLM engines: the folder (every engine reads it under this path) each version is written
    /// to as a PEFT folder and loaded from; none: uploaded in the request (built-in engines).
    pub folder: Option<PathBuf>,
}

impl PoolAdapter {
    async fn upload(
        &self,
        to: &Control,
        mut weights: WeightStream,
        version: u64,
    ) -> Result<SyncReport, SyncError> {
        let (started, mut report, mut tensors) =
            (Instant::now(), SyncReport::default(), Vec::new());
        while let Some(bucket) = weights.next().await? {
            report.count(&bucket);
            tensors.extend(bucket);
        }
        let name = format!("{}-v{version}", self.run);
        let request = match &self.folder {
            None => {
                let bytes = lora::adapter_bytes(&self.lora, &self.base, &tensors);
                to.http
                    .put(format!("{}/v1/adapters/{name}", to.url()))
                    .body(bytes)
            }
            Some(root) => {
                let dir = root.join(&name);
                let written =
                    lora::write_adapter(&dir, &self.lora, Path::new(&self.base), &tensors);
                let what = "writing the adapter";
                written.map_err(|e| SyncError::Write {
                    what,
                    path: dir.clone(),
                    source: e.into(),
                })?;
                // vLLM may read a version again while it holds it: the oldest of five goes.
                if let Some(old) = version.checked_sub(4) {
                    let _ = std::fs::remove_dir_all(root.join(format!("{}-v{old}", self.run)));
                }
                let body = serde_json::json!({"lora_name": name, "lora_path": dir});
                to.http
                    .post(format!("{}/v1/load_lora_adapter", to.url()))
                    .json(&body)
            }
        };
        let answer = crate::auth::call::<serde_json::Value>(to.url(), request).await;
        answer.map_err(|e| SyncError::Call("load adapter", e))?;
        report.transfer = started.elapsed();
        Ok(report)
    }
}

impl PublishOptions {
    /// The weight path the manifest's `engines` ask for (a run on an EnginePool: its adapter's
    /// uploads), through `target`, for a model stored in `model_dtype`: TCP listens on `listen`
    /// (host, port), the Filesystem transport writes to `folder`.
    pub fn new(
        run: &RLRun,
        model_dtype: Option<&str>,
        target: String,
        device: Device,
        (host, port): (String, u16),
        folder: Option<PathBuf>,
    ) -> Result<Self, SyncError> {
        let (engines, model) = (&run.spec.engines, &run.spec.model);
        let lora = model
            .lora
            .as_ref()
            .filter(|_| run.spec.versioned_adapters());
        let on_vllm = engines.pool_ref.is_none() && engines.backend == EngineBackend::Vllm;
        Ok(Self {
            target,
            transport: engines.transport(),
            device,
            host,
            port,
            folder: folder.clone(),
            engine_kind: engine_kind(engines, model_dtype)?,
            pool: lora.map(|lora| PoolAdapter {
                run: run.metadata.name.clone().unwrap_or_default(),
                lora: lora.into(),
                base: model.path.clone(),
                folder: folder.filter(|_| on_vllm),
            }),
        })
    }
}

/// The weight path of a trainer.
#[derive(Debug)]
pub enum Publisher {
    Pool(Control, PoolAdapter),
    Tcp(WeightSync),
    Filesystem(FolderPublisher),
    #[cfg(feature = "cuda")]
    Nccl(Box<NcclPublisher>),
}

impl Publisher {
    /// The weight path `opts` asks for. Errors are [`SyncError::Manifest`] (naming the spec field)
    /// when the combination cannot work, [`SyncError::Setup`] when the engines could not be
    /// reached (worth trying again).
    pub async fn connect(opts: &PublishOptions) -> Result<Self, SyncError> {
        if let Some(pool) = &opts.pool {
            return Ok(Self::Pool(Control::new(&opts.target), pool.clone()));
        }
        match opts.transport {
            WeightTransport::Tcp => {
                let mut sync = WeightSync::new(&opts.target);
                sync.connect_tcp(&format!("{}:{}", opts.host, opts.port), &opts.host)
                    .await
                    .map_err(|e| SyncError::Setup(Box::new(e)))?;
                Ok(Self::Tcp(sync))
            }
            WeightTransport::Filesystem => {
                let folder = opts.folder.clone().ok_or_else(|| SyncError::Manifest(
                    "spec.engines.weightTransfer.claimName",
                    "the Filesystem transport needs a folder that the trainer and every engine share (MOULT_WEIGHTS_DIR, where the operator mounts the claim)".into(),
                ))?;
                let publisher = FolderPublisher::new(&opts.target, folder, opts.engine_kind);
                Ok(Self::Filesystem(publisher))
            }
            WeightTransport::Nccl => {
                #[cfg(feature = "cuda")]
                if let Device::Cuda(ordinal) = opts.device {
                    let publisher = NcclPublisher::new(&opts.target, ordinal, opts.engine_kind);
                    return Ok(Self::Nccl(Box::new(publisher)));
                }
                let why = if cfg!(feature = "cuda") {
                    format!("NCCL sends weights from a trainer on a GPU; this trainer runs on {:?} (give spec.trainer.gpusPerNode, or use transport Filesystem)", opts.device)
                } else {
                    "NCCL (vLLM's default) needs a moult built with `--features cuda` (the runtime image is) and a trainer on a GPU; on CPU use transport Filesystem (docs/vllm.md)".into()
                };
                let field = "spec.engines.weightTransfer.transport";
                Err(SyncError::Manifest(field, why))
            }
        }
    }

    /// Publishes `trainer`'s weights as `version`: the trainer gathers them bucket by bucket on
    /// a blocking thread (with sharded weights, one unit at a time, the other ranks gathering
    /// along) while this sends each as it comes (docs/weight-sync.md, "From a sharded
    /// trainer"). Returns the trainer, whether the gather succeeded (a failure means a rank was
    /// lost) and whether the update did.
    pub async fn publish_trainer(
        &mut self,
        trainer: Trainer,
        version: u64,
        partial_rollout: bool,
        stop: &CancellationToken,
    ) -> (
        Trainer,
        crate::dist::Result<()>,
        Result<SyncReport, SyncError>,
    ) {
        let (tx, stream) = WeightStream::channel();
        let gather = tokio::task::spawn_blocking(move || {
            // Every bucket is gathered even once the update stopped reading: the other ranks
            // take part in each gather.
            let gathered = trainer.weight_buckets(&mut |bucket| {
                tx.send(bucket);
            });
            if gathered.is_ok() {
                tx.done();
            }
            (trainer, gathered)
        });
        // A stop leaves the update where it is (the engines may be gone): the gather finishes,
        // its buckets unread, and the trainer comes back.
        let sent = tokio::select! {
            sent = self.update_stream(stream, version, partial_rollout) => sent,
            () = stop.cancelled() => Err(SyncError::Stopped),
        };
        match gather.await {
            Ok((trainer, gathered)) => (trainer, gathered, sent),
            // The gather thread panicked: the trainer is gone with it.
            Err(e) => std::panic::resume_unwind(e.into_panic()),
        }
    }

    /// Pushes the buckets of `weights` as `version` (pause `keep` with partial rollout, else
    /// `wait`) as they come (`WeightStream::whole` for weights already whole): each transport
    /// sends (or writes) a bucket while the next is gathered, and finishes the update only once
    /// the stream ended whole.
    pub async fn update_stream(
        &mut self,
        weights: WeightStream,
        version: u64,
        partial_rollout: bool,
    ) -> Result<SyncReport, SyncError> {
        match self {
            Self::Pool(control, pool) => pool.upload(control, weights, version).await,
            Self::Tcp(sync) => sync.update_stream(weights, version, partial_rollout).await,
            Self::Filesystem(folder) => folder.update(weights, version, partial_rollout).await,
            #[cfg(feature = "cuda")]
            Self::Nccl(p) => p.update(weights, version, partial_rollout).await,
        }
    }
}

/// The dtype weights are sent to the engines in: float32 for the built-in engine (it computes in
/// float32); for vLLM its `--dtype` among `extra_args`, else (`auto`) the checkpoint's own
/// (`model_dtype`), else float32. vLLM converts what it loads to its parameters' dtype, so this
/// decides the bytes moved per update, not what the engine computes with.
pub fn engine_kind(engines: &EnginesSpec, model_dtype: Option<&str>) -> Result<Kind, SyncError> {
    if engines.backend == EngineBackend::Builtin {
        return Ok(Kind::Float);
    }
    let extra_args = &engines.extra_args;
    let flag = extra_args
        .iter()
        .position(|a| a == "--dtype")
        .and_then(|i| extra_args.get(i + 1))
        .map(String::as_str)
        .or_else(|| extra_args.iter().find_map(|a| a.strip_prefix("--dtype=")));
    let name = match flag {
        Some("auto") | None => model_dtype.unwrap_or("float32"),
        Some(d) => d,
    };
    match name {
        "float32" | "float" => Ok(Kind::Float),
        "bfloat16" => Ok(Kind::BFloat16),
        "float16" | "half" => Ok(Kind::Half),
        other => Err(SyncError::Manifest(
            "spec.engines.extraArgs",
            format!("--dtype {other} is not one moult can send weights in (float32, bfloat16, float16, auto)"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(transport: WeightTransport) -> PublishOptions {
        PublishOptions {
            target: "http://127.0.0.1:1".into(),
            transport,
            device: Device::Cpu,
            host: "127.0.0.1".into(),
            port: 0,
            folder: None,
            engine_kind: Kind::Float,
            pool: None,
        }
    }

    #[tokio::test]
    async fn nccl_without_a_gpu_is_refused_naming_the_field() {
        let err = Publisher::connect(&opts(WeightTransport::Nccl))
            .await
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("spec.engines.weightTransfer.transport:"),
            "{err}"
        );
        // Without the feature the build is the reason; with it, the CPU trainer.
        let why = if cfg!(feature = "cuda") {
            "gpusPerNode"
        } else {
            "--features cuda"
        };
        assert!(err.contains(why), "{err}");
    }

    #[tokio::test]
    async fn the_filesystem_transport_needs_a_folder() {
        let err = Publisher::connect(&opts(WeightTransport::Filesystem))
            .await
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("spec.engines.weightTransfer.claimName:"),
            "{err}"
        );
    }

    #[test]
    fn engines_get_weights_in_their_own_dtype() {
        let spec = |backend, args: &[&str]| EnginesSpec {
            backend,
            extra_args: args.iter().map(|s| s.to_string()).collect(),
            ..EnginesSpec::default()
        };
        let vllm = |args: &[&str]| spec(EngineBackend::Vllm, args);
        assert_eq!(
            engine_kind(&spec(EngineBackend::Builtin, &[]), Some("bfloat16")).unwrap(),
            Kind::Float
        );
        assert_eq!(
            engine_kind(&vllm(&[]), Some("bfloat16")).unwrap(),
            Kind::BFloat16
        );
        assert_eq!(engine_kind(&vllm(&[]), None).unwrap(), Kind::Float);
        assert_eq!(
            engine_kind(&vllm(&["--dtype", "float32"]), Some("bfloat16")).unwrap(),
            Kind::Float
        );
        assert_eq!(
            engine_kind(&vllm(&["--dtype=half"]), None).unwrap(),
            Kind::Half
        );
        assert_eq!(
            engine_kind(&vllm(&["--dtype", "auto"]), Some("float16")).unwrap(),
            Kind::Half
        );
        let err = engine_kind(&vllm(&["--dtype", "fp8"]), None)
            .unwrap_err()
            .to_string();
        assert!(err.contains("spec.engines.extraArgs"), "{err}");
    }
}
