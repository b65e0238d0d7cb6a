//! The HTTP half of the NCCL weight-sync data plane: the weight-transfer endpoints of one engine
//! (docs/engine.md, vLLM's `vllm/entrypoints/serve/dev/rlhf/api_router.py`), called through the
//! engine API's [`Control`], each call bounded by a timeout and failing with an error that names
//! the engine and the step.
//!
//! Always compiled, so the exact requests the trainer sends are tested against a recording
//! engine without GPUs; the NCCL side (`nccl`, feature `cuda`) runs them concurrently with its
//! collectives.

use std::time::Duration;

use serde_json::{json, Value};

use super::nccl_handshake::{finish_body, NcclInitInfo, NcclSyncError, Result, Step};
use super::Control;
use crate::auth::CallError;
use crate::engine::api::UpdateInfo;

/// How long each kind of call may take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ControlTimeouts {
    /// `get_world_size`, `start_weight_update`, `finish_weight_update` (the last reloads layers).
    pub control: Duration,
    /// `init_weight_transfer_engine` and `update_weights`: they return only once the engine's
    /// side of the NCCL work is done (communicator up, or every tensor of the bucket landed).
    pub transfer: Duration,
}

impl Default for ControlTimeouts {
    fn default() -> Self {
        Self {
            control: Duration::from_secs(120),
            transfer: Duration::from_secs(600),
        }
    }
}

/// One engine's weight-transfer endpoints.
#[derive(Debug, Clone)]
pub struct EngineControl {
    control: Control,
    timeouts: ControlTimeouts,
}

impl EngineControl {
    pub fn new(base_url: &str, timeouts: ControlTimeouts) -> Self {
        Self {
            control: Control::new(base_url),
            timeouts,
        }
    }

    pub fn url(&self) -> &str {
        self.control.url()
    }

    /// `GET /get_world_size` → `{"world_size": n}` (tp · pp · dp in vLLM).
    pub async fn world_size(&self) -> Result<u32> {
        let step = Step::GET_WORLD_SIZE;
        let body = self.call(step, None).await?;
        body.get("world_size")
            .and_then(Value::as_u64)
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| self.error(step, format!("expected {{\"world_size\": n}}, got {body}")))
    }

    /// `POST /init_weight_transfer_engine {init_info}`; returns once the engine's ranks joined
    /// the communicator and ran the warm-up all_reduce, so it must run concurrently with rank 0's
    /// own init.
    pub async fn init(&self, init_info: &NcclInitInfo) -> Result<()> {
        let body = json!({ "init_info": init_info });
        self.call(Step::INIT_TRANSFER, Some(body)).await.map(drop)
    }

    pub async fn start_update(&self) -> Result<()> {
        self.call(Step::START_UPDATE, Some(json!({})))
            .await
            .map(drop)
    }

    /// `POST /update_weights {update_info}`; returns once the bucket's broadcasts landed, so it
    /// must run concurrently with rank 0's broadcasts.
    pub async fn update_weights(&self, update_info: &UpdateInfo) -> Result<()> {
        let body = json!({ "update_info": update_info });
        self.call(Step::UPDATE_WEIGHTS, Some(body)).await.map(drop)
    }

    pub async fn finish_update(&self, weight_version: u64) -> Result<()> {
        let body = finish_body(weight_version);
        self.call(Step::FINISH_UPDATE, Some(body)).await.map(drop)
    }

    fn error(&self, step: Step, message: String) -> NcclSyncError {
        NcclSyncError::Engine {
            url: self.url().into(),
            step,
            message,
        }
    }

    /// The request `step` names, with `body`, bounded by the timeout of its kind; a refusal
    /// carries the engine's own message (vLLM answers `{"error": ...}` or FastAPI's
    /// `{"detail": ...}`).
    async fn call(&self, step: Step, body: Option<Value>) -> Result<Value> {
        let (method, path) = (step.0.split_once(' ')).expect("an engine call's request line");
        let method = reqwest::Method::from_bytes(method.as_bytes()).expect("GET or POST");
        let timeout = match step {
            Step::INIT_TRANSFER | Step::UPDATE_WEIGHTS => self.timeouts.transfer,
            _ => self.timeouts.control,
        };
        let request = self.control.request(method, path, body.as_ref());
        let message = match tokio::time::timeout(timeout, request).await {
            Ok(Ok(answer)) => return Ok(answer),
            Err(_) => {
                let url = self.url().into();
                return Err(NcclSyncError::EngineTimeout { url, step, timeout });
            }
            Ok(Err(CallError::Send { source, .. })) => format!("cannot reach the engine: {source}"),
            Ok(Err(CallError::Answer { source, .. })) => format!("unreadable answer: {source}"),
            Ok(Err(CallError::Status {
                status, body: text, ..
            })) => {
                let body = serde_json::from_str(&text).unwrap_or(Value::String(text));
                let message = ["error", "detail", "message"]
                    .iter()
                    .find_map(|k| body.get(k))
                    .map(|m| {
                        // OpenAI's shape: `{"error": {"message": ...}}`.
                        let m = m.get("message").unwrap_or(m);
                        m.as_str().map_or_else(|| m.to_string(), str::to_string)
                    })
                    .unwrap_or_else(|| body.to_string());
                format!("HTTP {}: {message}", status.as_u16())
            }
        };
        Err(self.error(step, message))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use axum::extract::State;
    use axum::http::{StatusCode, Uri};
    use axum::routing::{get, post};
    use axum::{Json, Router};

    use super::*;
    use crate::weight_sync::nccl_handshake::{
        init_infos, BucketPlan, PackedWire, TensorMeta, UniqueId,
    };

    type Log = Arc<Mutex<Vec<(String, serde_json::Value)>>>;

    /// A stand-in for vLLM's routes that records each request and answers as vLLM does; an
    /// `update_info` with keys other than names/dtype_names/shapes is refused like vLLM's
    /// `update_info_cls(**update_info)`.
    async fn engine(world_size: u32) -> (String, Log) {
        async fn record(
            State(log): State<Log>,
            uri: Uri,
            body: Option<Json<serde_json::Value>>,
        ) -> (StatusCode, Json<serde_json::Value>) {
            let body = body.map(|Json(b)| b).unwrap_or_default();
            log.lock()
                .unwrap()
                .push((uri.path().to_string(), body.clone()));
            if let Some(info) = body.get("update_info").and_then(|i| i.as_object()) {
                if let Some(k) = info
                    .keys()
                    .find(|k| !["names", "dtype_names", "shapes"].contains(&k.as_str()))
                {
                    return (
                        StatusCode::BAD_REQUEST,
                        Json(serde_json::json!({"error": format!(
                            "Invalid update_info for NCCLWeightTransferEngine: unexpected keyword argument '{k}'"
                        )})),
                    );
                }
            }
            (StatusCode::OK, Json(serde_json::json!({"message": "ok"})))
        }
        let log: Log = Arc::default();
        let app = Router::new()
            .route(
                "/get_world_size",
                get(move || async move { Json(serde_json::json!({ "world_size": world_size })) }),
            )
            .route("/init_weight_transfer_engine", post(record))
            .route("/start_weight_update", post(record))
            .route("/update_weights", post(record))
            .route("/finish_weight_update", post(record))
            .with_state(log.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await });
        (url, log)
    }

    /// The whole control sequence of one engine, as vLLM receives it.
    #[tokio::test]
    async fn control_calls_send_what_vllm_parses() {
        let (url, log) = engine(2).await;
        let control = EngineControl::new(&url, ControlTimeouts::default());
        assert!(!control.url().ends_with('/'));
        assert_eq!(control.world_size().await.unwrap(), 2);

        let id = UniqueId([7; 128]);
        let info = &init_infos(&id, &[1, 2], PackedWire::default()).unwrap()[1];
        control.init(info).await.unwrap();
        control.start_update().await.unwrap();
        let plan = BucketPlan::new(
            vec![TensorMeta {
                name: "lm_head.weight".into(),
                dtype: "bfloat16".into(),
                shape: vec![4, 2],
            }],
            PackedWire::default(),
        )
        .unwrap();
        control.update_weights(&plan.update_info()).await.unwrap();
        control.finish_update(3).await.unwrap();

        let log = log.lock().unwrap().clone();
        let paths: Vec<&str> = log.iter().map(|(p, _)| p.as_str()).collect();
        assert_eq!(
            paths,
            [
                "/init_weight_transfer_engine",
                "/start_weight_update",
                "/update_weights",
                "/finish_weight_update"
            ]
        );
        assert_eq!(
            log[0].1,
            serde_json::json!({"init_info": {
                "nccl_unique_id_b64": id.to_b64(),
                "rank_offset": 2,
                "world_size": 4,
                "packed": true,
                "packed_buffer_size_bytes": 1u64 << 30,
                "packed_num_buffers": 2,
            }})
        );
        assert_eq!(
            log[2].1,
            serde_json::json!({"update_info": {
                "names": ["lm_head.weight"],
                "dtype_names": ["bfloat16"],
                "shapes": [[4, 2]],
            }})
        );
        assert_eq!(log[3].1, serde_json::json!({"weight_version": "3"}));
    }

    #[tokio::test]
    async fn refusals_name_the_engine_step_and_message() {
        let (url, _) = engine(1).await;
        let control = EngineControl::new(&url, ControlTimeouts::default());
        let bad = UpdateInfo {
            names: vec!["w".into()],
            dtype_names: vec!["float32".into()],
            shapes: vec![vec![1]],
            packed: Some(true),
        };
        let err = control.update_weights(&bad).await.unwrap_err().to_string();
        assert!(
            err.starts_with(&format!(
                "engine {}, POST /update_weights: HTTP 400: Invalid update_info",
                control.url()
            )),
            "{err}"
        );
        assert!(err.contains("'packed'"), "{err}");
    }

    #[tokio::test]
    async fn a_silent_engine_times_out_and_a_missing_one_is_unreachable() {
        // Accepts connections and never answers.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((s, _)) = listener.accept().await {
                held.push(s);
            }
        });
        let timeouts = ControlTimeouts {
            control: Duration::from_millis(200),
            transfer: Duration::from_millis(200),
        };
        let control = EngineControl::new(&url, timeouts);
        let err = control.start_update().await.unwrap_err();
        assert!(
            matches!(
                err,
                NcclSyncError::EngineTimeout {
                    step: Step::START_UPDATE,
                    ..
                }
            ),
            "{err}"
        );
        assert!(err.to_string().contains(&url), "{err}");

        // A port nobody listens on (bound, then closed by dropping).
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", closed.local_addr().unwrap());
        drop(closed);
        let control = EngineControl::new(&url, timeouts);
        let err = control.world_size().await.unwrap_err().to_string();
        assert!(
            err.contains("GET /get_world_size: cannot reach the engine"),
            "{err}"
        );
    }
}
