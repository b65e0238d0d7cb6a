//! The engine's HTTP API (docs/engine.md): vLLM's token-in/token-out generate endpoint, pause and
//! resume, the weight-transfer control plane, health and metrics. Every error leaves in vLLM's
//! JSON error shape via [`ApiError`]; nothing a client sends can reach a panic.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Extension, Path, Query, State};
use axum::http::{header, StatusCode};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::{Json, Router};
use futures::Stream;
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::json;
use tokio::sync::{mpsc, Mutex};

use super::api::{
    AbortRequest, Choice, CollectiveRpc, ContentPart, FinishWeightUpdate, GenerateRequest,
    GenerateResponse, InitWeightTransfer, Logprobs, UpdateWeightVersion, UpdateWeights, Usage,
    WeightVersionSpan,
};
use super::client::{ADAPTER_BODY_LIMIT, GENERATE_BODY_LIMIT};
use super::core::{AdapterUse, EngineHandle, Event, ModelInfo, PauseMode};
use super::pool::{adapter_version, own, version_of, Tenant};
use super::weights::{connect, BucketLayout, StagedUpdate, WeightConnection};
use crate::model::{dtype_name, ImageInput};
use crate::serve::ApiError;

/// The weight-transfer session: the data-plane connection and the tensors received so far.
#[derive(Debug, Default)]
struct Transfer {
    stream: Option<WeightConnection>,
    updating: bool,
    staged: StagedUpdate,
}

struct AppState {
    engine: EngineHandle,
    transfer: Mutex<Transfer>,
    registry: prometheus_client::registry::Registry,
    next_id: AtomicU64,
}

/// The API router over a running engine.
pub fn router(engine: EngineHandle) -> Router {
    let registry = engine.metrics.registry(&engine.info.name);
    let state = Arc::new(AppState {
        engine,
        transfer: Mutex::default(),
        registry,
        next_id: AtomicU64::new(0),
    });
    Router::new()
        .route(
            "/inference/v1/generate",
            post(generate).layer(DefaultBodyLimit::max(GENERATE_BODY_LIMIT)),
        )
        .route("/inference/v1/abort_requests", post(abort_requests))
        .route("/pause", post(pause))
        .route("/resume", post(resume))
        .route("/is_paused", get(is_paused))
        .route("/get_world_size", get(get_world_size))
        .route(
            "/init_weight_transfer_engine",
            post(init_weight_transfer_engine),
        )
        .route("/start_weight_update", post(start_weight_update))
        .route("/update_weights", post(update_weights))
        .route("/finish_weight_update", post(finish_weight_update))
        .route("/collective_rpc", post(collective_rpc))
        .route("/update_weight_version", post(update_weight_version))
        .route("/weight_info", get(weight_info))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/v1/models", get(models))
        .route("/v1/load_lora_adapter", post(load_lora_adapter))
        .route("/v1/unload_lora_adapter", post(unload_lora_adapter))
        .route(
            "/v1/adapters/{name}",
            put(put_adapter).layer(DefaultBodyLimit::max(ADAPTER_BODY_LIMIT)),
        )
        .route("/v1/pool/share", get(pool_share))
        .fallback(|uri: axum::http::Uri| async move {
            ApiError::new(StatusCode::NOT_FOUND, format!("no route for {uri}"))
        })
        .with_state(state)
}

/// `GET /health`: 200 while the engine thread runs, 503 once it has stopped (so a liveness
/// probe restarts the pod, and routers stop sending to it).
async fn health(State(s): State<Arc<AppState>>) -> Response {
    if s.engine.alive() {
        StatusCode::OK.into_response()
    } else {
        ApiError::unavailable("the engine thread has stopped; see the engine's log").into_response()
    }
}

/// Serves the API on an already-bound listener until `shutdown` completes.
pub async fn serve(
    listener: tokio::net::TcpListener,
    engine: EngineHandle,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let routes =
        crate::auth::protect(router(engine)).layer(axum::middleware::from_fn(super::pool::gate));
    crate::serve::serve(listener, routes, shutdown).await
}

/// Parses a JSON body; errors name the field path (`sampling_params.max_token`).
fn parse<T: DeserializeOwned>(body: &Bytes) -> Result<T, ApiError> {
    match body.iter().find(|b| !b.is_ascii_whitespace()) {
        Some(b'{') => {}
        None => {
            return Err(ApiError::bad_request(
                "the request body is empty; send a JSON object",
            ))
        }
        Some(_) if serde_json::from_slice::<serde_json::Value>(body).is_err() => {
            return Err(ApiError::bad_request("malformed JSON body"))
        }
        Some(_) => {
            return Err(ApiError::bad_request(
                "the request body must be a JSON object",
            ))
        }
    }
    let de = &mut serde_json::Deserializer::from_slice(body);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        let message = if inner.is_syntax() || inner.is_eof() {
            format!("malformed JSON body: {inner}")
        } else if path == "." {
            format!("invalid request: {inner}")
        } else {
            format!("invalid field `{path}`: {inner}")
        };
        let err = ApiError::bad_request(message);
        if path == "." {
            err
        } else {
            err.with_param(&path)
        }
    })
}

async fn generate(
    State(state): State<Arc<AppState>>,
    tenant: Option<Extension<Tenant>>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let info = &state.engine.info;
    let req: GenerateRequest = parse(&body)?;
    let req = req.validate(info.vocab_size, info.max_model_len)?;
    let id = req
        .request_id
        .unwrap_or_else(|| format!("gen-{}", state.next_id.fetch_add(1, Ordering::Relaxed)));
    // A pool run generates with one of its own adapters, whose version its tokens carry.
    let tenant = match tenant {
        Some(Extension(t)) => Some((t.0.clone(), own(&t.0, req.model.as_deref(), "model")?)),
        None => None,
    };
    // A LoRA adapter by name, or the served model (its name, or none), as vLLM resolves it.
    let slot = match req.model.as_deref() {
        None => None,
        Some(name) if name == info.name => None,
        Some(name) => Some(state.engine.adapter(name).ok_or_else(|| {
            let msg = format!("The model `{name}` does not exist.");
            ApiError::new(StatusCode::NOT_FOUND, msg).with_param("model")
        })?),
    };
    let adapter = AdapterUse { slot, tenant };
    let (prompt, images) = images_of(info, req.prompt, req.content_parts).await?;
    if prompt.len() >= info.max_model_len {
        return Err(ApiError::bad_request(format!(
            "the prompt takes {} tokens with its images' placeholders, and the model's context is {}",
            prompt.len(),
            info.max_model_len
        ))
        .with_param("token_ids"));
    }
    let prompt_len = prompt.len();
    if req.routed_experts_prompt_start >= prompt_len {
        return Err(ApiError::bad_request(format!(
            "routed_experts_prompt_start must be in [0, {prompt_len}) (the prompt length, images' placeholders included), got {}",
            req.routed_experts_prompt_start
        ))
        .with_param("sampling_params.routed_experts_prompt_start"));
    }
    let mut rx = state.engine.generate_with_images(
        id.clone(),
        prompt,
        images,
        req.params,
        req.routed_experts_prompt_start,
        adapter,
    )?;
    // The first event says whether the engine accepted the request.
    let first = rx.recv().await.ok_or_else(engine_gone)?;
    if let Event::Rejected(err) = first {
        return Err(err);
    }
    if req.stream {
        Ok(Sse::new(stream_events(id, prompt_len, first, rx)).into_response())
    } else {
        collect(id, prompt_len, first, rx)
            .await
            .map(|r| Json(r).into_response())
    }
}

/// A request's images (`content_parts`), decoded and preprocessed off the async executor with the
/// model folder's `preprocessor_config.json`, then placed at the prompt's placeholders: one
/// token per image (vLLM's form, expanded here as vLLM expands it) or each image's whole run
/// (docs/vision.md). Returns the prompt with its placeholders expanded. Every refusal is a 400
/// naming `content_parts`.
async fn images_of(
    info: &ModelInfo,
    prompt: Vec<i64>,
    parts: Vec<ContentPart>,
) -> Result<(Vec<i64>, Vec<ImageInput>), ApiError> {
    let bad = |param: &str, message: String| ApiError::bad_request(message).with_param(param);
    let Some(vision) = &info.vision else {
        if parts.is_empty() {
            return Ok((prompt, Vec::new()));
        }
        return Err(bad(
            "content_parts",
            format!(
                "the model `{}` is text-only: it takes no images (vision-language models: docs/vision.md)",
                info.name
            ),
        ));
    };
    if parts.is_empty() && !prompt.contains(&vision.image_token_id) {
        return Ok((prompt, Vec::new()));
    }
    let processor = match (&vision.processor, parts.is_empty()) {
        (Some(p), _) => p.clone(),
        (None, true) => Default::default(),
        (None, false) => {
            return Err(bad(
                "content_parts",
                format!(
                    "the model `{}` has no preprocessor_config.json in its folder, so the engine cannot preprocess images (docs/vision.md)",
                    info.name
                ),
            ))
        }
    };
    let decoded = tokio::task::spawn_blocking(move || {
        parts
            .iter()
            .enumerate()
            .map(|(i, part)| {
                if part.kind != "image_url" {
                    return Err(bad(
                        &format!("content_parts[{i}].type"),
                        format!(
                            "content part type `{}` is not supported: the engine takes images (`image_url`); videos and audio are not supported (docs/vision.md)",
                            part.kind
                        ),
                    ));
                }
                let url_error = |e: crate::vision::VisionError| {
                    bad(&format!("content_parts[{i}].url"), format!("content_parts[{i}]: {e}"))
                };
                let image = crate::vision::parse_data_url(&part.url).map_err(url_error)?;
                crate::vision::preprocess_bytes(&image.bytes, &processor)
                    .map(std::sync::Arc::new)
                    .map_err(url_error)
            })
            .collect::<Result<Vec<_>, ApiError>>()
    })
    .await
    .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))??;
    let prompt = crate::model::expand_placeholders(
        prompt,
        vision.image_token_id,
        vision.merge_size,
        &decoded,
    );
    crate::model::place_images(&prompt, vision.image_token_id, vision.merge_size, decoded)
        .map(|images| (prompt, images))
        .map_err(|e| {
            let reason = match e {
                crate::model::Error::Input(reason) => reason,
                other => other.to_string(),
            };
            bad(
                "content_parts",
                format!("content_parts do not match token_ids: {reason}"),
            )
        })
}

fn engine_gone() -> ApiError {
    ApiError::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        "the engine dropped the request",
    )
}

async fn collect(
    id: String,
    prompt_len: usize,
    first: Event,
    mut rx: mpsc::UnboundedReceiver<Event>,
) -> Result<GenerateResponse, ApiError> {
    let mut choice = Choice::empty();
    let mut event = Some(first);
    loop {
        let next = match event.take() {
            Some(e) => Some(e),
            None => rx.recv().await,
        };
        match next.ok_or_else(engine_gone)? {
            Event::Token { logprob, version } => {
                choice.push_token(logprob, version);
            }
            Event::Finished {
                reason,
                routed_experts,
                prompt_logprobs,
            } => {
                choice.finish_reason = Some(reason.as_str().into());
                choice.routed_experts = routed_experts;
                let completion_tokens = choice.token_ids.len();
                return Ok(GenerateResponse {
                    request_id: id,
                    choices: vec![choice],
                    usage: Some(Usage::new(prompt_len, completion_tokens)),
                    prompt_logprobs,
                });
            }
            Event::Rejected(err) => return Err(err),
            Event::Failed(message) => {
                return Err(ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, message))
            }
        }
    }
}

/// SSE chunks: one per sampled token (`choices[0].token_ids` is the delta), a final chunk with
/// `finish_reason`, `routed_experts` and `usage`, then `[DONE]`. Dropping the stream (the client
/// went away) drops the receiver, which cancels the request in the engine.
fn stream_events(
    id: String,
    prompt_len: usize,
    first: Event,
    rx: mpsc::UnboundedReceiver<Event>,
) -> impl Stream<Item = Result<SseEvent, std::convert::Infallible>> {
    struct S {
        id: String,
        rx: mpsc::UnboundedReceiver<Event>,
        first: Option<Event>,
        produced: usize,
        prompt_len: usize,
        done: bool,
        /// The final chunk went out; `[DONE]` follows.
        terminate: bool,
    }
    let state = S {
        id,
        rx,
        first: Some(first),
        produced: 0,
        prompt_len,
        done: false,
        terminate: false,
    };
    futures::stream::unfold(state, |mut s| async move {
        if s.terminate {
            s.terminate = false;
            s.done = true;
            return Some((Ok(SseEvent::default().data("[DONE]")), s));
        }
        if s.done {
            return None;
        }
        let event = match s.first.take() {
            Some(e) => Some(e),
            None => s.rx.recv().await,
        };
        let chunk = |choice: Choice, usage: Option<Usage>| GenerateResponse {
            request_id: s.id.clone(),
            choices: vec![choice],
            usage,
            prompt_logprobs: None,
        };
        let data = match event {
            Some(Event::Token { logprob, version }) => {
                let index = s.produced;
                s.produced += 1;
                let choice = Choice {
                    index: 0,
                    token_ids: vec![logprob.token_id],
                    logprobs: Logprobs {
                        content: vec![logprob],
                    },
                    finish_reason: None,
                    routed_experts: None,
                    weight_versions: vec![WeightVersionSpan {
                        version,
                        start: index,
                        end: index + 1,
                    }],
                };
                serde_json::to_string(&chunk(choice, None)).expect("serializable")
            }
            Some(Event::Finished {
                reason,
                routed_experts,
                ..
            }) => {
                let choice = Choice {
                    index: 0,
                    token_ids: Vec::new(),
                    logprobs: Logprobs::default(),
                    finish_reason: Some(reason.as_str().into()),
                    routed_experts,
                    weight_versions: Vec::new(),
                };
                let usage = Usage::new(s.prompt_len, s.produced);
                s.terminate = true;
                serde_json::to_string(&chunk(choice, Some(usage))).expect("serializable")
            }
            Some(Event::Rejected(err)) => {
                s.done = true;
                json!({"error": {"message": err.message, "code": err.status.as_u16()}}).to_string()
            }
            Some(Event::Failed(message)) => {
                s.done = true;
                json!({"error": {"message": message, "code": 500}}).to_string()
            }
            None => {
                s.done = true;
                json!({"error": {"message": "the engine dropped the request", "code": 500}})
                    .to_string()
            }
        };
        Some((Ok(SseEvent::default().data(data)), s))
    })
}

async fn abort_requests(
    State(state): State<Arc<AppState>>,
    tenant: Option<Extension<Tenant>>,
    body: Bytes,
) -> Result<Json<serde_json::Value>, ApiError> {
    let req: AbortRequest = parse(&body)?;
    let tenant = tenant.map(|Extension(Tenant(run))| run);
    state.engine.abort(req.request_ids, tenant)?;
    Ok(Json(json!({})))
}

#[derive(Debug, Deserialize)]
struct PauseQuery {
    mode: Option<String>,
}

async fn pause(
    State(state): State<Arc<AppState>>,
    Query(q): Query<PauseQuery>,
) -> Result<Json<serde_json::Value>, ApiError> {
    // vLLM's default mode is `abort`.
    let text = q.mode.as_deref().unwrap_or("abort");
    let mode = PauseMode::parse(text).ok_or_else(|| {
        ApiError::bad_request(format!(
            "mode must be one of keep, wait, abort; got `{text}`"
        ))
        .with_param("mode")
    })?;
    state.engine.pause(mode).await?;
    Ok(Json(json!({"status": "paused", "mode": text})))
}

async fn resume(State(state): State<Arc<AppState>>) -> Result<Json<serde_json::Value>, ApiError> {
    state.engine.resume().await?;
    Ok(Json(json!({"status": "resumed"})))
}

async fn is_paused(State(state): State<Arc<AppState>>) -> Json<serde_json::Value> {
    Json(json!({"is_paused": state.engine.status.paused.load(Ordering::Acquire)}))
}

async fn get_world_size() -> Json<serde_json::Value> {
    // The built-in engine is one rank (no tensor parallelism).
    Json(json!({"world_size": 1}))
}

async fn init_weight_transfer_engine(
    State(state): State<Arc<AppState>>,
    body: Bytes,
) -> Result<Json<serde_json::Value>, ApiError> {
    let req: InitWeightTransfer = parse(&body)?;
    let info = req.init_info;
    if info.nccl_unique_id_b64.is_some() {
        return Err(ApiError::new(
            StatusCode::NOT_IMPLEMENTED,
            "the built-in engine takes weights over TCP only (init_info.master_address, master_port); the NCCL data plane is for vLLM engines on GPUs (docs/weight-sync.md)",
        )
        .with_param("init_info.nccl_unique_id_b64"));
    }
    let (Some(address), Some(port)) = (info.master_address, info.master_port) else {
        return Err(ApiError::bad_request(
            "init_info needs master_address and master_port (the trainer's TCP weight stream)",
        )
        .with_param("init_info"));
    };
    let addr = format!("{address}:{port}");
    let stream = tokio::time::timeout(
        std::time::Duration::from_secs(30),
        connect(&addr, info.rank_offset),
    )
    .await
    .map_err(|_| {
        ApiError::bad_request(format!(
            "timed out connecting to the weight stream at {addr}"
        ))
    })?
    .map_err(|e| {
        ApiError::bad_request(format!(
            "cannot connect to the weight stream at {addr}: {e}"
        ))
    })?;
    let mut transfer = state.transfer.lock().await;
    *transfer = Transfer {
        stream: Some(stream),
        ..Transfer::default()
    };
    Ok(Json(json!({})))
}

async fn start_weight_update(
    State(state): State<Arc<AppState>>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let mut transfer = state.transfer.lock().await;
    if transfer.stream.is_none() {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "call /init_weight_transfer_engine before /start_weight_update",
        ));
    }
    transfer.updating = true;
    transfer.staged.clear();
    Ok(Json(json!({})))
}

async fn update_weights(
    State(state): State<Arc<AppState>>,
    body: Bytes,
) -> Result<Json<serde_json::Value>, ApiError> {
    let req: UpdateWeights = parse(&body)?;
    let layout = BucketLayout::new(&req.update_info, &state.engine.info.params)
        .map_err(|m| ApiError::bad_request(m).with_param("update_info"))?;
    let mut transfer = state.transfer.lock().await;
    if !transfer.updating {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "call /start_weight_update before /update_weights",
        ));
    }
    let Transfer { stream, staged, .. } = &mut *transfer;
    let stream = stream.as_mut().expect("updating implies a connection");
    if let Err(message) = staged.receive(&layout, stream).await {
        // The stream position is unknown now: drop it; the trainer must re-init.
        *transfer = Transfer::default();
        return Err(ApiError::bad_request(message));
    }
    Ok(Json(json!({"received": layout.total_bytes()})))
}

async fn finish_weight_update(
    State(state): State<Arc<AppState>>,
    body: Bytes,
) -> Result<Json<serde_json::Value>, ApiError> {
    let req: FinishWeightUpdate = parse(&body)?;
    let staged = {
        let mut transfer = state.transfer.lock().await;
        if !transfer.updating {
            return Err(ApiError::new(
                StatusCode::CONFLICT,
                "call /start_weight_update before /finish_weight_update",
            ));
        }
        transfer.updating = false;
        std::mem::take(&mut transfer.staged)
    };
    let count = staged.len();
    let emptied = state
        .engine
        .apply_weights(staged, req.weight_version)
        .await?;
    // Keep the buffer for the next update unless a new one already started.
    let mut transfer = state.transfer.lock().await;
    if !transfer.updating {
        transfer.staged = emptied;
    }
    Ok(Json(
        json!({"weight_version": req.weight_version, "updated": count}),
    ))
}

/// vLLM's weight update from a folder, step one: `reload_weights` loads every safetensors file of
/// `kwargs.weights_path` into the model (between two steps, like any update; the version is
/// unchanged until `/update_weight_version`).
async fn collective_rpc(
    State(state): State<Arc<AppState>>,
    body: Bytes,
) -> Result<Json<serde_json::Value>, ApiError> {
    let req: CollectiveRpc = parse(&body)?;
    if req.method != "reload_weights" {
        return Err(ApiError::bad_request(format!(
            "the built-in engine's collective_rpc has one method, reload_weights; got {:?}",
            req.method
        ))
        .with_param("method"));
    }
    let Some(dir) = req.kwargs.get("weights_path").and_then(|v| v.as_str()) else {
        return Err(ApiError::bad_request(
            "reload_weights needs kwargs.weights_path: a folder of safetensors",
        )
        .with_param("kwargs.weights_path"));
    };
    let dir = std::path::PathBuf::from(dir);
    let params = state.engine.info.params.clone();
    let staged = tokio::task::spawn_blocking(move || {
        let mut staged = StagedUpdate::default();
        staged.load_folder(&dir, &params).map(|()| staged)
    })
    .await
    .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?
    .map_err(|m| ApiError::bad_request(m).with_param("kwargs.weights_path"))?;
    let version = state.engine.status.weight_version.load(Ordering::Acquire);
    state.engine.apply_weights(staged, version).await?;
    Ok(Json(json!({"results": [null]})))
}

/// vLLM's weight update from a folder, step two: the version the loaded weights are.
async fn update_weight_version(
    State(state): State<Arc<AppState>>,
    body: Bytes,
) -> Result<Json<serde_json::Value>, ApiError> {
    let req: UpdateWeightVersion = parse(&body)?;
    state
        .engine
        .apply_weights(StagedUpdate::default(), req.new_version)
        .await?;
    Ok(Json(
        json!({"success": true, "new_version": req.new_version.to_string()}),
    ))
}

/// `GET /weight_info`: the weights and their version; for a pool run, the newest version of its
/// adapter this engine serves (0 for none), so that a router sends its requests only to engines
/// that hold its current adapter.
async fn weight_info(
    State(state): State<Arc<AppState>>,
    tenant: Option<Extension<Tenant>>,
) -> Json<serde_json::Value> {
    let info = &state.engine.info;
    let version = match tenant {
        Some(Extension(t)) => (state.engine.adapter_names().iter())
            .filter_map(|name| version_of(&t.0, name))
            .max()
            .unwrap_or(0),
        None => state.engine.status.weight_version.load(Ordering::Acquire),
    };
    let params: Vec<_> = info
        .params
        .iter()
        .map(|(name, shape)| json!({"name": name, "shape": shape}))
        .collect();
    Json(json!({
        "weight_version": version,
        "dtype": dtype_name(info.kind),
        "params": params,
    }))
}

async fn metrics(State(state): State<Arc<AppState>>) -> Result<Response, ApiError> {
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &state.registry)
        .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
    Ok((
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response())
}

/// `GET /v1/models`: the served model and its adapters (a pool run sees only its own).
async fn models(
    State(state): State<Arc<AppState>>,
    tenant: Option<Extension<Tenant>>,
) -> Json<serde_json::Value> {
    let info = &state.engine.info;
    let mut data =
        vec![json!({"id": info.name, "object": "model", "max_model_len": info.max_model_len})];
    let adapters = state
        .engine
        .status
        .adapters
        .lock()
        .expect("adapters")
        .clone();
    let seen = |name: &&String| {
        tenant
            .as_ref()
            .is_none_or(|t| version_of(&t.0 .0, name).is_some())
    };
    data.extend(adapters.keys().filter(seen).map(|name| {
        json!({"id": name, "object": "model", "parent": info.name, "max_model_len": info.max_model_len})
    }));
    Json(json!({"object": "list", "data": data}))
}

/// `POST /v1/load_lora_adapter`'s body, vLLM's (docs/lora.md).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct LoadLora {
    lora_name: String,
    lora_path: std::path::PathBuf,
    /// vLLM's; replacing an adapter in place is not done here (a new name per version is).
    #[serde(default)]
    load_inplace: bool,
}

/// `POST /v1/load_lora_adapter`: reads the PEFT adapter folder `lora_path` (which the engine's
/// host must hold) and serves it as `lora_name`, as vLLM does with runtime LoRA updating.
async fn load_lora_adapter(
    State(state): State<Arc<AppState>>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let req: LoadLora = parse(&body)?;
    if req.load_inplace {
        let msg = "load_inplace is not supported: load each version under a new name";
        return Err(ApiError::bad_request(msg).with_param("load_inplace"));
    }
    if req.lora_name.is_empty() || req.lora_name == state.engine.info.name {
        let msg = "lora_name must be a new name, not empty and not the served model's";
        return Err(ApiError::bad_request(msg).with_param("lora_name"));
    }
    let (kind, device) = (state.engine.info.kind, state.engine.info.device);
    let path = req.lora_path.clone();
    let read = move || crate::model::lora::read_adapter(&path, kind, device);
    let (config, _, weights) = tokio::task::spawn_blocking(read)
        .await
        .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?
        .map_err(|e| ApiError::bad_request(e.to_string()).with_param("lora_path"))?;
    let name = req.lora_name;
    state
        .engine
        .load_adapter(name.clone(), config, weights)
        .await?;
    tracing::info!(adapter = %name, path = %req.lora_path.display(), "LoRA adapter loaded");
    Ok(format!("Success: LoRA adapter '{name}' added successfully.").into_response())
}

/// `PUT /v1/adapters/{name}`: serves the adapter in the body (one safetensors file, its PEFT
/// `adapter_config.json` in the metadata: [`crate::model::lora::adapter_bytes`]) as `name`. A
/// pool run may load only its own names (`<run>-v<N>`); loading its version `N` unloads its
/// versions before `N - 1` (requests still running with them finish first), so a run holds at
/// most two adapters while it switches (docs/lora.md, "Engine pools").
async fn put_adapter(
    State(state): State<Arc<AppState>>,
    tenant: Option<Extension<Tenant>>,
    Path(name): Path<String>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let engine = &state.engine;
    let run = tenant.map(|Extension(t)| t.0);
    if let Some(run) = &run {
        let version = own(run, Some(&name), "name")?;
        // An upload is activity: the run's adapters are not an idle run's.
        engine
            .status
            .fairness
            .lock()
            .expect("fairness")
            .charge(run, 0);
        for old in engine.adapter_names() {
            if version_of(run, &old).is_some_and(|v| v + 1 < version) {
                // Already gone when another upload of the run unloaded it first.
                let _ = engine.unload_adapter(old).await;
            }
        }
    }
    if name.is_empty() || name == engine.info.name {
        let msg = "the adapter needs a new name, not the served model's";
        return Err(ApiError::bad_request(msg).with_param("name"));
    }
    let (kind, device) = (engine.info.kind, engine.info.device);
    let what = std::path::PathBuf::from(format!("PUT /v1/adapters/{name}"));
    let read = move || crate::model::lora::adapter_from_bytes(&body, &what, kind, device);
    let (config, weights) = tokio::task::spawn_blocking(read)
        .await
        .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?
        .map_err(|e| ApiError::bad_request(e.to_string()))?;
    if let Some(limits) = engine.info.pool {
        if config.rank > limits.max_rank {
            let msg = format!(
                "the adapter's rank is {}; this pool serves ranks up to {} (its maxRank)",
                config.rank, limits.max_rank
            );
            return Err(ApiError::bad_request(msg));
        }
        if engine.adapter_names().len() >= limits.max_adapters {
            unload_idle_run(engine, run.as_deref()).await;
        }
        let loaded = engine.adapter_names().len();
        if loaded >= limits.max_adapters {
            let msg = format!("this pool engine already serves {loaded} adapters, its maxAdapters; retry once a run's old versions are unloaded");
            return Err(ApiError::new(StatusCode::TOO_MANY_REQUESTS, msg));
        }
    }
    engine.load_adapter(name.clone(), config, weights).await?;
    tracing::info!(adapter = %name, "LoRA adapter loaded");
    Ok(format!("Success: LoRA adapter '{name}' added successfully.").into_response())
}

/// Unloads the adapters of the run (other than `uploader`) idle longest, if it has been idle
/// long enough ([`super::pool::IDLE_SECS`]): room on a pool engine from a run that stopped
/// without unloading its adapters.
async fn unload_idle_run(engine: &EngineHandle, uploader: Option<&str>) {
    let names = engine.adapter_names();
    let run_of = |n: &str| adapter_version(n).map(|(run, _)| run.to_string());
    let runs: Vec<String> = names.iter().filter_map(|n| run_of(n)).collect();
    let others = (runs.iter().map(String::as_str)).filter(|r| Some(*r) != uploader);
    let idle = engine
        .status
        .fairness
        .lock()
        .expect("fairness")
        .idlest(others)
        .map(str::to_string);
    let Some(idle) = idle else {
        return;
    };
    for name in names.iter().filter(|n| run_of(n).as_ref() == Some(&idle)) {
        let _ = engine.unload_adapter(name.clone()).await;
    }
}

/// `GET /v1/pool/share`: each run's tokens on this engine and its share of the recent ones (a
/// pool run sees only its own).
async fn pool_share(
    State(state): State<Arc<AppState>>,
    tenant: Option<Extension<Tenant>>,
) -> Json<serde_json::Value> {
    let fairness = state.engine.status.fairness.lock().expect("fairness");
    let runs = fairness.shares(tenant.as_ref().map(|t| &*t.0 .0));
    Json(json!({ "runs": runs }))
}

/// `POST /v1/unload_lora_adapter`'s body.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct UnloadLora {
    lora_name: String,
}

/// `POST /v1/unload_lora_adapter`: new requests can no longer name it; those in flight finish
/// with it.
async fn unload_lora_adapter(
    State(state): State<Arc<AppState>>,
    tenant: Option<Extension<Tenant>>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let UnloadLora { lora_name } = parse(&body)?;
    if let Some(Extension(t)) = &tenant {
        own(&t.0, Some(&lora_name), "lora_name")?;
    }
    state.engine.unload_adapter(lora_name.clone()).await?;
    tracing::info!(adapter = %lora_name, "LoRA adapter unloaded");
    Ok(format!("Success: LoRA adapter '{lora_name}' removed successfully.").into_response())
}

#[cfg(test)]
mod tests {
    use axum::body::Body;
    use axum::http::Request;
    use tower::ServiceExt;

    use super::*;
    use crate::engine::core::ModelInfo;

    /// An engine whose compute thread has died answers 503 on `/health` (so its liveness probe
    /// restarts it and routers stop sending to it), and refuses work rather than queueing it.
    #[tokio::test]
    async fn a_dead_engine_thread_fails_health_and_refuses_work() {
        let engine = EngineHandle::stopped(ModelInfo {
            vision: None,
            name: "tiny".into(),
            vocab_size: 16,
            max_model_len: 32,
            kind: tch::Kind::Float,
            device: tch::Device::Cpu,
            params: Vec::new(),
            num_experts: None,
            sparse_layers: 0,
            top_k: 0,
            pool: None,
        });
        assert!(!engine.alive());
        let app = router(engine);
        let call = |method: &str, path: &str, body: &str| {
            Request::builder()
                .method(method)
                .uri(path)
                .header("content-type", "application/json")
                .body(Body::from(body.to_string()))
                .unwrap()
        };
        let health = app
            .clone()
            .oneshot(call("GET", "/health", ""))
            .await
            .unwrap();
        assert_eq!(health.status(), StatusCode::SERVICE_UNAVAILABLE);
        let generate = app
            .oneshot(call(
                "POST",
                "/inference/v1/generate",
                r#"{"request_id": "a", "token_ids": [1, 2], "sampling_params": {"max_tokens": 2}}"#,
            ))
            .await
            .unwrap();
        assert!(generate.status().is_server_error(), "{}", generate.status());
    }
}
