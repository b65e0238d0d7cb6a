//! How the trainer process gets its weights to the engines: pause them (through the
//! coordinator's router, which fans control calls out to every engine), transfer, resume.
//!
//! - Built-in engines: the TCP weight stream from the trainer's `POD_IP`, driven through the
//!   router ([`WeightSync`]).
//! - vLLM engines (`engines.backend: Vllm`, cargo feature `cuda`, a trainer on a GPU): the NCCL
//!   data plane of [`crate::weight_sync::nccl`], rank 0 in this process and the engines' ranks
//!   after it, talking to each engine the coordinator lists (`GET /engines`), connected again
//!   whenever that list changes or an update failed. Not yet run on a GPU from here (see
//!   docs/cluster.md).

use moult_operator::api::EngineBackend;
use tch::{Device, Tensor};

use crate::run::RunError;
use crate::weight_sync::orchestrate::WeightSync;

/// The weight path of a trainer process.
#[derive(Debug)]
pub(crate) enum Publisher {
    Tcp(WeightSync),
    #[cfg(feature = "cuda")]
    Nccl(Box<nccl::NcclPublisher>),
}

impl Publisher {
    /// The weight path for `backend`'s engines behind `coordinator`.
    pub async fn connect(
        coordinator: &str,
        backend: EngineBackend,
        device: Device,
        pod_ip: &str,
    ) -> Result<Self, RunError> {
        match backend {
            EngineBackend::Builtin => {
                let mut sync = WeightSync::new(coordinator);
                let mut wait = std::time::Duration::from_millis(500);
                while let Err(e) = sync.connect_tcp(&format!("{pod_ip}:0"), pod_ip).await {
                    tracing::warn!("connecting the weight stream: {e}; retrying in {wait:?}");
                    tokio::time::sleep(wait).await;
                    wait = (wait * 2).min(std::time::Duration::from_secs(10));
                }
                Ok(Self::Tcp(sync))
            }
            #[cfg(feature = "cuda")]
            EngineBackend::Vllm => match device {
                Device::Cuda(ordinal) => Ok(Self::Nccl(Box::new(nccl::NcclPublisher::new(
                    coordinator,
                    ordinal,
                )))),
                other => Err(RunError::Manifest(format!(
                    "spec.engines.backend: vLLM engines take weights over NCCL from a trainer on a GPU; this trainer runs on {other:?} (give spec.trainer.gpusPerNode)"
                ))),
            },
            #[cfg(not(feature = "cuda"))]
            EngineBackend::Vllm => {
                let _ = device;
                Err(RunError::Manifest(
                    "spec.engines.backend: vLLM engines take weights over NCCL, which this moult was built without: build it with `--features cuda` (the runtime image does)".into(),
                ))
            }
        }
    }

    /// Pushes `weights` as `version` (pause `keep` with partial rollout, else `wait`; the engines
    /// are resumed whatever happens).
    pub async fn update(
        &mut self,
        weights: &[(String, Tensor)],
        version: u64,
        partial_rollout: bool,
    ) -> Result<(), String> {
        match self {
            Self::Tcp(sync) => sync
                .update(weights, version, partial_rollout)
                .await
                .map(drop)
                .map_err(|e| e.to_string()),
            #[cfg(feature = "cuda")]
            Self::Nccl(p) => p.update(weights, version, partial_rollout).await,
        }
    }
}

#[cfg(feature = "cuda")]
mod nccl {
    use tch::Tensor;

    use crate::weight_sync::nccl::{NcclSenderConfig, NcclWeightSender};
    use crate::weight_sync::orchestrate::buckets;

    /// Bytes per `update_weights` call.
    const BUCKET_BYTES: usize = 256 << 20;

    /// The NCCL weight path to the engines the coordinator lists.
    #[derive(Debug)]
    pub(crate) struct NcclPublisher {
        http: reqwest::Client,
        coordinator: String,
        ordinal: usize,
        sender: Option<NcclWeightSender>,
        urls: Vec<String>,
    }

    impl NcclPublisher {
        pub fn new(coordinator: &str, ordinal: usize) -> Self {
            Self {
                http: crate::auth::client(),
                coordinator: coordinator.trim_end_matches('/').to_string(),
                ordinal,
                sender: None,
                urls: Vec::new(),
            }
        }

        async fn call(&self, path: &str) -> Result<serde_json::Value, String> {
            let url = format!("{}{path}", self.coordinator);
            let request = if path.starts_with("/engines") {
                self.http.get(&url)
            } else {
                self.http.post(&url)
            };
            let r = request.send().await.map_err(|e| format!("{url}: {e}"))?;
            let status = r.status();
            let text = r.text().await.unwrap_or_default();
            if !status.is_success() {
                return Err(format!("{url}: {status} {text}"));
            }
            Ok(serde_json::from_str(&text).unwrap_or(serde_json::Value::Null))
        }

        /// The engines up behind the coordinator's router.
        async fn engines(&self) -> Result<Vec<String>, String> {
            let list = self.call("/engines").await?;
            let mut urls: Vec<String> = list["engines"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|e| e["healthy"].as_bool() == Some(true))
                .filter_map(|e| e["url"].as_str().map(String::from))
                .collect();
            urls.sort();
            if urls.is_empty() {
                return Err("no engine is up behind the coordinator".into());
            }
            Ok(urls)
        }

        pub async fn update(
            &mut self,
            weights: &[(String, Tensor)],
            version: u64,
            partial_rollout: bool,
        ) -> Result<(), String> {
            let urls = self.engines().await?;
            if self.sender.is_none() || urls != self.urls {
                self.sender = None;
                let sender =
                    NcclWeightSender::connect(self.ordinal, &urls, NcclSenderConfig::default())
                        .await
                        .map_err(|e| e.to_string())?;
                self.sender = Some(sender);
                self.urls = urls;
            }
            let mode = if partial_rollout { "keep" } else { "wait" };
            self.call(&format!("/pause?mode={mode}")).await?;
            let sender = self.sender.as_mut().expect("connected above");
            let sent = sender
                .update(buckets(weights, BUCKET_BYTES), version)
                .await
                .map_err(|e| e.to_string());
            if sent.is_err() {
                // A failed sender refuses further work: connect again next time.
                self.sender = None;
            }
            let resumed = self.call("/resume").await;
            sent?;
            resumed.map(drop)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn vllm_engines_without_nccl_on_a_gpu_are_refused_naming_the_field() {
        let err = Publisher::connect("http://127.0.0.1:1", EngineBackend::Vllm, Device::Cpu, "")
            .await
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("spec.engines.backend:"), "{err}");
        // Without the feature the build is the reason; with it, the CPU trainer.
        let why = if cfg!(feature = "cuda") {
            "gpusPerNode"
        } else {
            "--features cuda"
        };
        assert!(err.contains(why), "{err}");
    }
}
