//! GPU tests of the NCCL weight-sync data plane (feature `cuda`): the trainer's
//! `NcclWeightSender` against stand-in engines that speak vLLM's weight-transfer routes and do
//! their side of the NCCL work the way vLLM's `NCCLWeightTransferEngine` does (join with the
//! unique id, warm-up all_reduce, then per `update_weights` one `ncclBroadcast` per packed chunk,
//! cut from `update_info` alone), written on cudarc's safe API independently of the sender.
//!
//! They need NVIDIA GPUs with libcuda and libnccl, so they are `#[ignore]`d (reported as ignored,
//! never as passed) and run with:
//!
//! ```text
//! cargo test -p moult-runtime --features cuda --test gpu_nccl_weight_sync -- --ignored --nocapture
//! ```
//!
//! Run that way on a machine that lacks what a test needs, the test fails with the reason: it
//! never passes without having exchanged bytes. NCCL refuses two ranks of one communicator on
//! the same GPU within one host identity ("Duplicate GPU detected"), and the stand-in engines run
//! in this process, so the exchange test needs two GPUs; the failure tests need one.
#![cfg(feature = "cuda")]
// The tensors sent here live in memory cudarc owns, and `DeviceTensor` is an unsafe trait.
#![allow(unsafe_code)]

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::{Json, Router};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr};
use cudarc::nccl::{Comm, Id, ReduceOp};
use moult_runtime::engine::api::UpdateInfo;
use moult_runtime::weight_sync::nccl::{
    nccl_available, DeviceTensor, NcclSenderConfig, NcclWeightSender, Placement, Unsendable,
};
use moult_runtime::weight_sync::nccl_control::ControlTimeouts;
use moult_runtime::weight_sync::nccl_handshake::{
    BucketPlan, NcclSyncError, PackedWire, Step, TensorMeta, UniqueId,
};
use tokio::sync::{mpsc, oneshot};

/// GPUs present, or the test fails with what is missing.
fn gpus(needed: usize) -> usize {
    let count = nccl_available().unwrap_or_else(|reason| {
        panic!("GPU test cannot run here: {reason}");
    });
    assert!(
        count >= needed,
        "GPU test needs {needed} CUDA devices (NCCL refuses two ranks of one communicator on one GPU), found {count}"
    );
    count
}

/// A tensor's bytes in memory cudarc owns: what the sender broadcasts here, without libtorch.
struct DeviceBytes {
    /// At least `placement.len` bytes (cudarc cannot allocate zero).
    bytes: CudaSlice<u8>,
    placement: Placement,
}

impl DeviceBytes {
    /// Copies `host` (the tensor's raw bytes, row-major) to `stream`'s device.
    fn from_host(
        stream: &Arc<CudaStream>,
        host: &[u8],
        dtype: &'static str,
        shape: Vec<i64>,
    ) -> Self {
        // cudarc cannot allocate zero bytes; an empty tensor keeps one unused byte.
        let src = if host.is_empty() { &[0u8][..] } else { host };
        let bytes = stream.clone_htod(src).unwrap();
        let placement = Placement {
            dtype,
            shape,
            ordinal: Some(stream.context().ordinal()),
            ptr: bytes.device_ptr(stream).0,
            len: host.len(),
        };
        Self { bytes, placement }
    }

    /// The bytes, copied back to the host.
    fn to_host(&self) -> Vec<u8> {
        let mut out = self.bytes.stream().clone_dtoh(&self.bytes).unwrap();
        out.truncate(self.placement.len);
        out
    }
}

// SAFETY: `bytes` is a live cudarc allocation of at least `len` bytes on its stream's device,
// owned by the value; cudarc allocates in the device's primary context.
unsafe impl DeviceTensor for DeviceBytes {
    fn placement(&self) -> Result<Placement, Unsendable> {
        Ok(self.placement.clone())
    }
}

/// What a stand-in engine recorded.
#[derive(Default)]
struct Seen {
    init_info: Option<serde_json::Value>,
    calls: Vec<String>,
    /// (name, raw bytes) of every tensor received, in order.
    received: Vec<(String, Vec<u8>)>,
    finished: Vec<serde_json::Value>,
}

/// A bucket's tensors as received: (name, raw bytes), in order.
type Received = Result<Vec<(String, Vec<u8>)>, String>;

/// Work for the engine's NCCL thread (cudarc's `Comm` stays on the thread that made it).
enum Work {
    Receive(UpdateInfo, oneshot::Sender<Received>),
}

/// How the stand-in behaves on init.
#[derive(Clone, Copy, PartialEq)]
enum Mode {
    /// Joins and receives like vLLM.
    Real { device: usize },
    /// Answers init with an HTTP 500 at once (a vLLM that cannot set up the transfer).
    RefuseInit,
    /// Accepts init and never joins the communicator.
    NeverJoin,
}

struct Engine {
    mode: Mode,
    seen: Mutex<Seen>,
    work: Mutex<Option<mpsc::Sender<Work>>>,
}

type Shared = Arc<Engine>;

async fn serve(mode: Mode) -> (String, Shared) {
    let engine = Arc::new(Engine {
        mode,
        seen: Mutex::default(),
        work: Mutex::default(),
    });
    let app = Router::new()
        .route(
            "/get_world_size",
            get(|| async { Json(serde_json::json!({"world_size": 1})) }),
        )
        .route("/init_weight_transfer_engine", post(init))
        .route("/start_weight_update", post(start))
        .route("/update_weights", post(update))
        .route("/finish_weight_update", post(finish))
        .with_state(engine.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    (url, engine)
}

type Answer = (StatusCode, Json<serde_json::Value>);

fn ok() -> Answer {
    (StatusCode::OK, Json(serde_json::json!({"message": "ok"})))
}

fn fail(message: String) -> Answer {
    (
        StatusCode::INTERNAL_SERVER_ERROR,
        Json(serde_json::json!({ "error": message })),
    )
}

async fn init(State(engine): State<Shared>, Json(body): Json<serde_json::Value>) -> Answer {
    let info = body["init_info"].clone();
    {
        let mut seen = engine.seen.lock().unwrap();
        seen.calls.push("init".into());
        seen.init_info = Some(info.clone());
    }
    let device = match engine.mode {
        Mode::RefuseInit => return fail("weight transfer backend is not nccl".into()),
        Mode::NeverJoin => {
            tokio::time::sleep(Duration::from_secs(3600)).await;
            return ok();
        }
        Mode::Real { device } => device,
    };
    let id = match UniqueId::from_b64(info["nccl_unique_id_b64"].as_str().unwrap_or_default()) {
        Ok(id) => id,
        Err(e) => return fail(e.to_string()),
    };
    let rank = info["rank_offset"].as_u64().unwrap() as usize;
    let world = info["world_size"].as_u64().unwrap() as usize;
    let buffer = info["packed_buffer_size_bytes"].as_u64().unwrap();
    let (work_tx, work_rx) = mpsc::channel(1);
    let (ready_tx, ready_rx) = oneshot::channel();
    std::thread::spawn(move || engine_rank(device, id, rank, world, buffer, ready_tx, work_rx));
    match ready_rx.await {
        Ok(Ok(())) => {
            *engine.work.lock().unwrap() = Some(work_tx);
            ok()
        }
        Ok(Err(e)) => fail(e),
        Err(_) => fail("the engine's NCCL thread died".into()),
    }
}

/// The engine's rank: join, warm up, then receive buckets as vLLM's packed consumer does.
fn engine_rank(
    device: usize,
    id: UniqueId,
    rank: usize,
    world: usize,
    buffer: u64,
    ready: oneshot::Sender<Result<(), String>>,
    mut work: mpsc::Receiver<Work>,
) {
    let setup = || -> Result<(Arc<CudaStream>, Comm), String> {
        let ctx = CudaContext::new(device).map_err(|e| e.to_string())?;
        let stream = ctx.new_stream().map_err(|e| e.to_string())?;
        let id = Id::uninit(id.0.map(|b| b as std::ffi::c_char));
        let comm = Comm::from_rank(stream.clone(), rank, world, id)
            .map_err(|e| format!("ncclCommInitRank: {:?}", e.0))?;
        // vLLM's PyNcclCommunicator: one zero float32, all_reduce(SUM), synchronise.
        let mut one = stream.alloc_zeros::<f32>(1).map_err(|e| e.to_string())?;
        comm.all_reduce_in_place(&mut one, &ReduceOp::Sum)
            .map_err(|e| format!("warm-up all_reduce: {:?}", e.0))?;
        stream.synchronize().map_err(|e| e.to_string())?;
        Ok((stream, comm))
    };
    let (stream, comm) = match setup() {
        Ok(s) => {
            let _ = ready.send(Ok(()));
            s
        }
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    while let Some(Work::Receive(info, reply)) = work.blocking_recv() {
        let receive = || -> Received {
            let metas = info
                .names
                .iter()
                .zip(&info.dtype_names)
                .zip(&info.shapes)
                .map(|((name, dtype), shape)| TensorMeta {
                    name: name.clone(),
                    dtype: dtype.clone(),
                    shape: shape.clone(),
                })
                .collect();
            let wire = PackedWire {
                buffer_size_bytes: buffer,
                num_buffers: 2,
            };
            let plan = BucketPlan::new(metas, wire).map_err(|e| e.to_string())?;
            let mut out = Vec::new();
            for chunk in &plan.chunks {
                // torch.empty(n, uint8) on the device, broadcast from rank 0.
                let mut buf = stream
                    .alloc_zeros::<u8>(chunk.bytes.len().max(1))
                    .map_err(|e| e.to_string())?;
                let mut view = buf.slice_mut(0..chunk.bytes.len());
                comm.broadcast_in_place(&mut view, 0)
                    .map_err(|e| format!("broadcast: {:?}", e.0))?;
                let host = stream.clone_dtoh(&buf).map_err(|e| e.to_string())?;
                for i in chunk.tensors.clone() {
                    let r = plan.offsets[i].clone();
                    let at = r.start - chunk.bytes.start;
                    out.push((
                        plan.tensors[i].name.clone(),
                        host[at..at + r.len()].to_vec(),
                    ));
                }
            }
            Ok(out)
        };
        let _ = reply.send(receive());
    }
}

async fn start(State(engine): State<Shared>) -> Answer {
    engine.seen.lock().unwrap().calls.push("start".into());
    ok()
}

async fn update(State(engine): State<Shared>, Json(body): Json<serde_json::Value>) -> Answer {
    engine.seen.lock().unwrap().calls.push("update".into());
    let Some(info) = body["update_info"].as_object() else {
        return fail("missing update_info".into());
    };
    // vLLM builds its dataclass with **update_info: any other key is refused.
    if let Some(k) = info
        .keys()
        .find(|k| !["names", "dtype_names", "shapes"].contains(&k.as_str()))
    {
        return fail(format!("unexpected keyword argument '{k}'"));
    }
    let info: UpdateInfo = match serde_json::from_value(body["update_info"].clone()) {
        Ok(i) => i,
        Err(e) => return fail(e.to_string()),
    };
    let Some(work) = engine.work.lock().unwrap().clone() else {
        return fail("not initialised".into());
    };
    let (tx, rx) = oneshot::channel();
    if work.send(Work::Receive(info, tx)).await.is_err() {
        return fail("the engine's NCCL thread died".into());
    }
    match rx.await {
        Ok(Ok(tensors)) => {
            engine.seen.lock().unwrap().received.extend(tensors);
            ok()
        }
        Ok(Err(e)) => fail(e),
        Err(_) => fail("the engine's NCCL thread died".into()),
    }
}

async fn finish(State(engine): State<Shared>, Json(body): Json<serde_json::Value>) -> Answer {
    let mut seen = engine.seen.lock().unwrap();
    seen.calls.push("finish".into());
    seen.finished.push(body);
    ok()
}

/// Deterministic bytes of a tensor.
fn pattern(len: usize, salt: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(salt))
        .collect()
}

/// Trainer on GPU 0, one single-rank engine on each further GPU (two at most: ranks 1 and 2):
/// init, then two updates of two buckets whose chunks are a packed group, an oversized tensor
/// alone and a packed tail with an empty tensor; every engine receives exactly the bytes sent,
/// in order, and sees vLLM's call sequence.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "needs 2 NVIDIA GPUs with libcuda and libnccl: cargo test -p moult-runtime --features cuda --test gpu_nccl_weight_sync -- --ignored"]
async fn gpu_engines_receive_every_byte_of_packed_buckets() {
    let count = gpus(2);
    let mut engines = Vec::new();
    let mut urls = Vec::new();
    for device in 1..count.min(3) {
        let (url, engine) = serve(Mode::Real { device }).await;
        urls.push(url);
        engines.push(engine);
    }
    let config = NcclSenderConfig {
        wire: PackedWire {
            // Small, so one bucket makes several chunks of each kind.
            buffer_size_bytes: 1000,
            num_buffers: 2,
        },
        timeouts: ControlTimeouts {
            control: Duration::from_secs(60),
            transfer: Duration::from_secs(120),
        },
        nccl_timeout: None,
    };
    let mut sender = NcclWeightSender::connect(0, &urls, config).await.unwrap();
    assert_eq!(sender.world_size() as usize, 1 + engines.len());
    for (i, engine) in engines.iter().enumerate() {
        let info = engine.seen.lock().unwrap().init_info.clone().unwrap();
        assert_eq!(info["rank_offset"], 1 + i);
        assert_eq!(info["world_size"], 1 + engines.len());
        assert_eq!(info["packed"], true);
        assert_eq!(info["packed_buffer_size_bytes"], 1000);
        assert!(info.get("master_address").is_none());
    }

    let ctx = CudaContext::new(0).unwrap();
    let stream = ctx.default_stream();
    // (name, dtype, shape): 400 + 400 + 400 B pack into one chunk (1200 > 1000); 4000 B alone;
    // 2 B, 8 B and an empty tensor close the bucket as a last packed chunk.
    let specs: Vec<(&str, &'static str, Vec<i64>)> = vec![
        (
            "model.layers.0.self_attn.q_proj.weight",
            "float32",
            vec![10, 10],
        ),
        (
            "model.layers.0.self_attn.k_proj.weight",
            "bfloat16",
            vec![10, 20],
        ),
        ("model.layers.0.mlp.up_proj.weight", "float16", vec![20, 10]),
        ("model.embed_tokens.weight", "float32", vec![50, 20]),
        ("model.norm.weight", "bfloat16", vec![1]),
        ("lm_head.bias", "float64", vec![1]),
        ("empty", "float32", vec![0, 4]),
    ];
    for version in 1..=2u64 {
        let mut expected = Vec::new();
        let mut buckets = Vec::new();
        for bucket_specs in [&specs[..4], &specs[4..]] {
            let mut bucket = Vec::new();
            for (i, (name, dtype, shape)) in bucket_specs.iter().enumerate() {
                let meta = TensorMeta {
                    name: name.to_string(),
                    dtype: dtype.to_string(),
                    shape: shape.clone(),
                };
                let bytes = pattern(meta.byte_len().unwrap(), version as u8 * 16 + i as u8);
                let tensor = DeviceBytes::from_host(&stream, &bytes, dtype, shape.clone());
                assert_eq!(tensor.to_host(), bytes);
                expected.push((name.to_string(), bytes));
                bucket.push((name.to_string(), tensor));
            }
            buckets.push(bucket);
        }
        // One whole update: start, every bucket in order, finish with the version.
        sender.start_update().await.unwrap();
        for bucket in buckets {
            sender.send_bucket(bucket).await.unwrap();
        }
        sender.finish_update(version).await.unwrap();
        for engine in &engines {
            let mut seen = engine.seen.lock().unwrap();
            assert_eq!(seen.received, expected, "version {version}");
            seen.received.clear();
            assert_eq!(
                seen.finished.last().unwrap(),
                &serde_json::json!({"weight_version": version.to_string()})
            );
        }
    }
    let calls = engines[0].seen.lock().unwrap().calls.clone();
    assert_eq!(
        calls,
        ["init", "start", "update", "update", "finish", "start", "update", "update", "finish"]
    );
}

/// An engine that refuses init fails `connect` at once, naming it; rank 0's pending
/// communicator init is aborted rather than left waiting for ranks that will never come.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an NVIDIA GPU with libcuda and libnccl: cargo test -p moult-runtime --features cuda --test gpu_nccl_weight_sync -- --ignored"]
async fn gpu_an_engine_refusing_init_fails_connect_promptly() {
    gpus(1);
    let (url, _) = serve(Mode::RefuseInit).await;
    let started = Instant::now();
    let err = NcclWeightSender::connect(0, std::slice::from_ref(&url), NcclSenderConfig::default())
        .await
        .unwrap_err();
    assert!(
        matches!(&err, NcclSyncError::Engine { url: u, step: Step::INIT_TRANSFER, .. } if *u == url),
        "{err}"
    );
    assert!(
        err.to_string()
            .contains("weight transfer backend is not nccl"),
        "{err}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "{:?}",
        started.elapsed()
    );
}

/// An engine that accepts init but never joins: `connect` gives up at the NCCL deadline with a
/// timeout naming the engines, instead of hanging in `ncclCommInitRank`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs an NVIDIA GPU with libcuda and libnccl: cargo test -p moult-runtime --features cuda --test gpu_nccl_weight_sync -- --ignored"]
async fn gpu_an_engine_that_never_joins_times_out() {
    gpus(1);
    let (url, _) = serve(Mode::NeverJoin).await;
    let config = NcclSenderConfig {
        nccl_timeout: Some(Duration::from_secs(3)),
        ..NcclSenderConfig::default()
    };
    let started = Instant::now();
    let err = NcclWeightSender::connect(0, std::slice::from_ref(&url), config)
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            NcclSyncError::CommTimeout {
                step: Step::COMM_INIT,
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains(&url), "{err}");
    let took = started.elapsed();
    assert!(
        took >= Duration::from_secs(3) && took < Duration::from_secs(30),
        "{took:?}"
    );
}
