//! The trainer's side of the NCCL weight-sync data plane to vLLM engines (docs/engine.md), on
//! cudarc's bindings of libcuda and libnccl, both loaded at run time (feature `cuda`).
//!
//! [`NcclWeightSender::connect`] asks every engine its world size, mints the unique id, lays out
//! the ranks (the trainer is rank 0), and then enters `ncclCommInitRank` as rank 0 while
//! `POST /init_weight_transfer_engine` runs on every engine, followed by the one-element float32
//! all_reduce(SUM) that vLLM's communicator issues right after init (a peer that skipped it would
//! deadlock every rank). An update is [`NcclWeightSender::start_update`], one
//! [`NcclWeightSender::send_bucket`] per bucket (`POST /update_weights` on every engine while rank
//! 0 broadcasts the bucket's packed chunks, cut as [`BucketPlan`] says), then
//! [`NcclWeightSender::finish_update`]. [`NcclPublisher`], the NCCL weight transport, pauses and
//! resumes the engines around it.
//!
//! Nothing waits forever: the communicator is non-blocking, every wait polls it with a deadline,
//! and any failure (an engine refusing, a timeout, an NCCL error) aborts it (`ncclCommAbort`),
//! which also frees the engines' side of a collective in progress. After a failure the sender
//! refuses further work; connect a new one (vLLM accepts a new `init_weight_transfer_engine`).
//!
//! Tensors are anything implementing [`DeviceTensor`]: libtorch tensors on the sender's GPU
//! (what the trainer holds), or memory cudarc owns (the GPU tests).

// FFI is the point of this module: cudarc's safe `Comm` can neither initialise without blocking
// (a missing engine would hang `ncclCommInitRank` for ever) nor be aborted on our terms, and
// libtorch's tensors are read through their raw device pointers. Every unsafe block says why it
// holds.
#![allow(unsafe_code)]

use std::ffi::CStr;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use cudarc::nccl::{result as nccl, sys as nccl_sys};
use tch::Kind;

use super::nccl_control::{ControlTimeouts, EngineControl};
use super::nccl_handshake::{
    init_infos, BucketPlan, NcclSyncError, PackedWire, Result, Step, TensorMeta, UniqueId, DTYPES,
};
use super::stream::WeightStream;
use super::{Control, SyncError, SyncReport};
use crate::router::pool::EngineStatus;

/// Knobs of the NCCL data plane.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct NcclSenderConfig {
    /// The packed-broadcast parameters, sent to the engines at init.
    pub wire: PackedWire,
    /// The HTTP calls.
    pub timeouts: ControlTimeouts,
    /// The NCCL side: communicator init and warm-up together, and each bucket's broadcasts.
    /// `None` takes `timeouts.transfer`.
    pub nccl_timeout: Option<Duration>,
}

impl NcclSenderConfig {
    fn nccl_timeout(&self) -> Duration {
        self.nccl_timeout.unwrap_or(self.timeouts.transfer)
    }
}

/// Whether this machine can run the NCCL data plane: libcuda and libnccl load and a GPU exists;
/// the number of GPUs, or what is missing (GPU tests print it when they cannot run).
pub fn nccl_available() -> Result<usize> {
    let missing = |what: &str| Err(NcclSyncError::nccl(Step::COMM_INIT, what));
    // SAFETY: dlopen of the system's libcuda by its usual names; nothing is called yet.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return missing("libcuda could not be loaded (no NVIDIA driver)");
    }
    // SAFETY: as above, for libnccl.
    if !unsafe { nccl_sys::is_culib_present() } {
        return missing("libnccl could not be loaded (set LD_LIBRARY_PATH to its directory)");
    }
    let count = CudaContext::device_count();
    match count.map_err(|e| cuda_error(Step::COMM_INIT, "cuDeviceGetCount", e))? {
        count if count < 1 => missing("no CUDA device"),
        count => Ok(count as usize),
    }
}

/// Why a tensor cannot be broadcast.
#[derive(Debug, thiserror::Error)]
pub enum Unsendable {
    #[error("undefined tensor")]
    Undefined,
    #[error("on {0:?}, not a CUDA device")]
    NotCuda(tch::Device),
    #[error("not contiguous (send `.contiguous()`)")]
    NotContiguous,
    #[error("dtype {0:?} cannot be sent to vLLM")]
    Dtype(tch::Kind),
}

/// Where a tensor's bytes are, and what the engines are told of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    /// The dtype as vLLM names it (`getattr(torch, name)`): `bfloat16`, `float32`, ...
    pub dtype: &'static str,
    pub shape: Vec<i64>,
    /// The CUDA device the bytes are on.
    pub ordinal: Option<usize>,
    /// The address of the first byte, and how many there are.
    pub ptr: u64,
    pub len: usize,
}

/// A tensor in CUDA memory that can be broadcast.
///
/// # Safety
/// A [`Placement`] that [`DeviceTensor::placement`] returns must be true: `ptr` the address of
/// `len` bytes in the memory of CUDA device `ordinal` (in its primary context), holding the
/// tensor's elements row-major, valid for as long as the value lives. Writes to them may still
/// be in flight on any stream of that device: the sender synchronises the device before reading.
pub unsafe trait DeviceTensor: Send + 'static {
    /// Where the tensor is, or why it cannot be read as one contiguous block.
    fn placement(&self) -> Result<Placement, Unsendable>;
}

// SAFETY: undefined, non-contiguous and non-CUDA tensors are refused, so `data_ptr` is the first
// of `numel × element size` bytes in libtorch's allocation on that device (libtorch uses the
// primary context), kept alive by the tensor's reference count.
unsafe impl DeviceTensor for tch::Tensor {
    fn placement(&self) -> Result<Placement, Unsendable> {
        if !self.defined() {
            return Err(Unsendable::Undefined);
        }
        let tch::Device::Cuda(ordinal) = self.device() else {
            return Err(Unsendable::NotCuda(self.device()));
        };
        if !self.is_contiguous() {
            return Err(Unsendable::NotContiguous);
        }
        Ok(Placement {
            dtype: dtype_name(self.kind())?,
            shape: self.size(),
            ordinal: Some(ordinal),
            ptr: self.data_ptr() as u64,
            len: crate::trainer::bytes_of(self),
        })
    }
}

/// A libtorch dtype as vLLM names it.
pub fn dtype_name(kind: tch::Kind) -> Result<&'static str, Unsendable> {
    let known = DTYPES.iter().find(|(k, _)| *k == kind);
    known.map(|(_, name)| *name).ok_or(Unsendable::Dtype(kind))
}

fn cuda_error(step: Step, what: &str, e: cudarc::driver::DriverError) -> NcclSyncError {
    NcclSyncError::nccl(step, format!("{what}: {e}"))
}

/// The trainer's end of the NCCL data plane to a set of vLLM engines.
#[derive(Debug)]
pub struct NcclWeightSender {
    engines: Vec<EngineControl>,
    /// Ranks in the communicator: the trainer and every engine rank.
    world_size: u32,
    config: NcclSenderConfig,
    ordinal: usize,
    /// The GPU side, or why a failure aborted its communicator.
    device: Result<Device, String>,
}

impl NcclWeightSender {
    /// Sets up the communicator with every engine at `engine_urls`, the trainer being rank 0 on
    /// CUDA device `device_ordinal`.
    pub async fn connect(
        device_ordinal: usize,
        engine_urls: &[String],
        config: NcclSenderConfig,
    ) -> Result<Self> {
        config.wire.validate()?;
        nccl_available()?;
        let engines: Vec<EngineControl> = engine_urls
            .iter()
            .map(|url| EngineControl::new(url, config.timeouts))
            .collect();
        let sizes = futures::future::try_join_all(engines.iter().map(|e| e.world_size())).await?;
        // ncclGetUniqueId also opens rank 0's bootstrap listener, which the id points at.
        let (ctx, id) = tokio::task::spawn_blocking(move || open(device_ordinal))
            .await
            .map_err(|e| panicked(Step::COMM_INIT, e))??;
        let infos = init_infos(&id, &sizes, config.wire)?;
        let world_size = infos[0].world_size;
        tracing::info!(engines = ?engine_urls, ?sizes, world_size, "NCCL weight transfer: connecting");
        let init = move |deadline: &Deadline| Device::init(ctx, &id, world_size, deadline);
        let calls = engines.iter().zip(&infos).map(|(e, info)| e.init(info));
        let timeout = config.nccl_timeout();
        let device = collective(Step::COMM_INIT, timeout, &engines, init, calls).await?;
        Ok(Self {
            engines,
            world_size,
            config,
            ordinal: device_ordinal,
            device: Ok(device),
        })
    }

    /// Ranks in the communicator: the trainer and every engine rank.
    pub fn world_size(&self) -> u32 {
        self.world_size
    }

    fn usable(&self) -> Result<()> {
        let broken = |why: &String| NcclSyncError::Broken(why.clone());
        self.device.as_ref().map(drop).map_err(broken)
    }

    /// `POST /start_weight_update` on every engine.
    pub async fn start_update(&mut self) -> Result<()> {
        self.usable()?;
        let calls = self.engines.iter().map(EngineControl::start_update);
        fan_out(&AtomicBool::new(false), calls).await
    }

    /// Sends one bucket: `POST /update_weights` with its `update_info` on every engine while rank
    /// 0 broadcasts its packed chunks. Returns once every engine has the bucket and the GPU is
    /// done reading the tensors.
    pub async fn send_bucket<T: DeviceTensor>(&mut self, tensors: Vec<(String, T)>) -> Result<()> {
        self.usable()?;
        // Checked before any engine hears of the bucket.
        let (plan, ptrs) = bucket_plan(&tensors, self.ordinal, self.config.wire)?;
        let info = plan.update_info();
        // Until this call returns, the device is with the broadcast task; if the caller drops
        // this future meanwhile, the task finishes (or aborts) on its own and the sender stays
        // unusable with this reason.
        let dropped = Err("a send_bucket call was dropped before it finished".into());
        let mut device = std::mem::replace(&mut self.device, dropped).expect("checked by usable()");
        // A failed collective leaves the communicator unusable: drop (abort) it there.
        let broadcast = move |deadline: &Deadline| {
            let sent = device.broadcast(&plan, &ptrs, deadline);
            drop(tensors); // alive until the GPU is done reading them
            sent.map(|()| device)
        };
        let calls = self.engines.iter().map(|e| e.update_weights(&info));
        let timeout = self.config.nccl_timeout();
        let (device, sent) =
            match collective(Step::BROADCAST, timeout, &self.engines, broadcast, calls).await {
                Ok(device) => (Ok(device), Ok(())),
                Err(e) => (Err(e.to_string()), Err(e)),
            };
        self.device = device;
        sent
    }

    /// `POST /finish_weight_update {weight_version}` on every engine.
    pub async fn finish_update(&mut self, weight_version: u64) -> Result<()> {
        self.usable()?;
        let calls = self.engines.iter().map(|e| e.finish_update(weight_version));
        fan_out(&AtomicBool::new(false), calls).await
    }
}

/// Runs `calls` concurrently; the first error raises `cancel` (so rank 0 stops waiting for a
/// collective that engine will never join) and is returned.
async fn fan_out<F>(cancel: &AtomicBool, calls: impl Iterator<Item = F>) -> Result<()>
where
    F: Future<Output = Result<()>>,
{
    futures::future::try_join_all(calls.map(|call| async {
        let result = call.await;
        if result.is_err() {
            cancel.store(true, Ordering::Release);
        }
        result
    }))
    .await
    .map(drop)
}

/// Rank 0's side of a collective (`gpu`, on a blocking thread, bounded by `timeout`) together
/// with the `engines`' HTTP `calls`, which return only once their side of it is done. The first
/// engine to fail raises the flag `gpu`'s waits poll, so rank 0 stops waiting for a peer that
/// will not join and aborts the communicator.
async fn collective<T: Send + 'static, F: Future<Output = Result<()>>>(
    step: Step,
    timeout: Duration,
    engines: &[EngineControl],
    gpu: impl FnOnce(&Deadline) -> Result<T> + Send + 'static,
    calls: impl Iterator<Item = F>,
) -> Result<T> {
    let urls: Vec<&str> = engines.iter().map(EngineControl::url).collect();
    let deadline = Deadline {
        at: Instant::now() + timeout,
        timeout,
        engines: urls.join(", "),
        cancel: Arc::default(),
    };
    let cancel = deadline.cancel.clone();
    let task = tokio::task::spawn_blocking(move || gpu(&deadline));
    let gpu = async { task.await.map_err(|e| panicked(step, e))? };
    let (out, ()) = tokio::try_join!(gpu, fan_out(&cancel, calls))?;
    Ok(out)
}

fn panicked(step: Step, e: tokio::task::JoinError) -> NcclSyncError {
    NcclSyncError::nccl(step, format!("the CUDA thread failed: {e}"))
}

/// Checks every tensor and plans the bucket; each tensor's address.
fn bucket_plan<T: DeviceTensor>(
    tensors: &[(String, T)],
    ordinal: usize,
    wire: PackedWire,
) -> Result<(BucketPlan, Vec<u64>)> {
    let (mut metas, mut ptrs) = (Vec::new(), Vec::new());
    for (name, t) in tensors {
        let bad = |message: String| NcclSyncError::Tensor {
            name: name.clone(),
            message,
        };
        let at = t.placement().map_err(|e| bad(e.to_string()))?;
        if at.ordinal != Some(ordinal) {
            return Err(bad(format!(
                "on CUDA device {:?}, but the sender broadcasts from device {ordinal}",
                at.ordinal
            )));
        }
        let meta = TensorMeta {
            name: name.clone(),
            dtype: at.dtype.to_string(),
            shape: at.shape,
        };
        let len = meta.byte_len()?;
        if len != at.len {
            return Err(bad(format!(
                "{} bytes, but {} of shape {:?} take {len}",
                at.len, meta.dtype, meta.shape
            )));
        }
        metas.push(meta);
        ptrs.push(at.ptr);
    }
    Ok((BucketPlan::new(metas, wire)?, ptrs))
}

/// Opens the device's primary context and mints the unique id.
fn open(ordinal: usize) -> Result<(Arc<CudaContext>, UniqueId)> {
    let opening = format!("opening CUDA device {ordinal}");
    let ctx = CudaContext::new(ordinal).map_err(|e| cuda_error(Step::COMM_INIT, &opening, e))?;
    let id = cudarc::nccl::Id::new()
        .map_err(|e| NcclSyncError::nccl(Step::COMM_INIT, format!("ncclGetUniqueId: {:?}", e.0)))?;
    Ok((ctx, UniqueId(id.internal().map(|c| c as u8))))
}

/// When a wait on the GPU gives up: at `at`, or once an engine failed its side of the
/// collective (`cancel`); and whom to name then.
struct Deadline {
    at: Instant,
    timeout: Duration,
    engines: String,
    cancel: Arc<AtomicBool>,
}

/// An NCCL communicator in non-blocking mode; dropping it aborts it.
#[derive(Debug)]
struct Comm {
    raw: nccl_sys::ncclComm_t,
}

// SAFETY: an NCCL communicator may be used from any thread as long as calls on it do not overlap;
// `Comm` is owned by one `Device`, which one blocking task at a time has by value.
unsafe impl Send for Comm {}

impl Drop for Comm {
    fn drop(&mut self) {
        // SAFETY: `raw` is a communicator NCCL created and nobody else frees; after this it is
        // never used again.
        if let Err(e) = unsafe { nccl::comm_abort(self.raw) } {
            tracing::warn!(error = ?e.0, "ncclCommAbort failed");
        }
    }
}

/// `NCCL_CONFIG_INITIALIZER` with `blocking = 0`: every field NCCL should choose is
/// `NCCL_CONFIG_UNDEF_INT`/`_PTR`. NCCL copies at most its own `sizeof(ncclConfig_t)` of it, so
/// a library older than these bindings (2.30) reads the fields it knows.
fn nonblocking_config() -> nccl_sys::ncclConfig_t {
    const UNDEF: i32 = i32::MIN;
    nccl_sys::ncclConfig_t {
        size: std::mem::size_of::<nccl_sys::ncclConfig_t>(),
        magic: 0xcafe_beef,
        version: 23000,
        blocking: 0,
        cgaClusterSize: UNDEF,
        minCTAs: UNDEF,
        maxCTAs: UNDEF,
        netName: std::ptr::null(),
        splitShare: UNDEF,
        trafficClass: UNDEF,
        commName: std::ptr::null(),
        collnetEnable: UNDEF,
        CTAPolicy: UNDEF,
        shrinkShare: UNDEF,
        nvlsCTAs: UNDEF,
        nChannelsPerNetPeer: UNDEF,
        nvlinkCentricSched: UNDEF,
        graphUsageMode: UNDEF,
        numRmaCtx: UNDEF,
        maxP2pPeers: UNDEF,
    }
}

impl Comm {
    /// `ncclCommInitRankConfig`, non-blocking: returns at once; [`Comm::ready`] says when done.
    fn start_init(id: &UniqueId, world_size: u32, rank: u32) -> Result<Self> {
        let mut config = nonblocking_config();
        let mut raw: nccl_sys::ncclComm_t = std::ptr::null_mut();
        let id = nccl_sys::ncclUniqueId {
            internal: id.0.map(|b| b as std::ffi::c_char),
        };
        // SAFETY: `raw` and `config` are valid for the call; NCCL copies the config and the id.
        let status = unsafe {
            nccl::comm_init_rank_config(&mut raw, world_size as i32, id, rank as i32, &mut config)
        };
        let comm = (!raw.is_null()).then_some(Self { raw });
        let failed = |message: String| NcclSyncError::nccl(Step::COMM_INIT, message);
        match status {
            Ok(_) => {
                comm.ok_or_else(|| failed("ncclCommInitRankConfig returned no communicator".into()))
            }
            Err(e) => Err(failed(describe(comm.as_ref(), e.0))),
        }
    }

    /// `Ok(true)` once the last call finished, `Ok(false)` while it is in progress.
    fn ready(&self, step: Step) -> Result<bool> {
        let mut state = nccl_sys::ncclResult_t::ncclSuccess;
        // SAFETY: `raw` is live; `state` is valid for the write.
        let status = unsafe { nccl_sys::ncclCommGetAsyncError(self.raw, &mut state) };
        let failed = |r| NcclSyncError::nccl(step, describe(Some(self), r));
        if status != nccl_sys::ncclResult_t::ncclSuccess {
            return Err(failed(status));
        }
        match state {
            nccl_sys::ncclResult_t::ncclSuccess => Ok(true),
            nccl_sys::ncclResult_t::ncclInProgress => Ok(false),
            other => Err(failed(other)),
        }
    }

    /// Checks a call's immediate status (`ncclInProgress` is fine in non-blocking mode).
    fn enqueued(
        &self,
        step: Step,
        status: Result<nccl::NcclStatus, nccl::NcclError>,
    ) -> Result<()> {
        status
            .map(drop)
            .map_err(|e| NcclSyncError::nccl(step, describe(Some(self), e.0)))
    }
}

/// NCCL's name of `result`, and the communicator's last error message when there is one.
fn describe(comm: Option<&Comm>, result: nccl_sys::ncclResult_t) -> String {
    let mut message = format!("{result:?}");
    if let Some(comm) = comm {
        // SAFETY: NCCL returns a NUL-terminated string it owns (or null); it is copied at once.
        let last = unsafe { nccl_sys::ncclGetLastError(comm.raw) };
        if !last.is_null() {
            // SAFETY: non-null, NUL-terminated, alive until the next NCCL call on this thread.
            let text = unsafe { CStr::from_ptr(last) }.to_string_lossy();
            if !text.is_empty() {
                message.push_str(": ");
                message.push_str(&text);
            }
        }
    }
    message
}

/// The trainer's GPU side: communicator, packing buffer, stream and context. Fields drop in this
/// order: the abort first, so no collective still uses the buffer or the stream when they go.
#[derive(Debug)]
struct Device {
    comm: Comm,
    /// Grown to the largest multi-tensor chunk and reused across buckets.
    pack: Option<CudaSlice<u8>>,
    stream: Arc<CudaStream>,
    ctx: Arc<CudaContext>,
}

/// How often a wait looks at the GPU and the communicator.
const POLL: Duration = Duration::from_micros(200);

impl Device {
    /// Rank 0's communicator init and the warm-up all_reduce, on the calling (blocking) thread.
    fn init(
        ctx: Arc<CudaContext>,
        id: &UniqueId,
        world_size: u32,
        deadline: &Deadline,
    ) -> Result<Self> {
        ctx.bind_to_thread()
            .map_err(|e| cuda_error(Step::COMM_INIT, "binding the CUDA context", e))?;
        let stream = ctx
            .new_stream()
            .map_err(|e| cuda_error(Step::COMM_INIT, "creating a stream", e))?;
        let comm = Comm::start_init(id, world_size, 0)?;
        wait(&comm, Step::COMM_INIT, deadline, || Ok(true))?;
        let mut device = Self {
            ctx,
            stream,
            comm,
            pack: None,
        };
        device.warm_up(deadline)?;
        Ok(device)
    }

    /// One float32 element, all_reduce(SUM), as vLLM's `PyNcclCommunicator` does after init.
    fn warm_up(&mut self, deadline: &Deadline) -> Result<()> {
        let step = Step::WARM_UP;
        let mut one = self
            .stream
            .alloc_zeros::<f32>(1)
            .map_err(|e| cuda_error(step, "allocating", e))?;
        {
            let (ptr, _record) = one.device_ptr_mut(&self.stream);
            // SAFETY: `ptr` is one f32 on this device, alive until the stream is drained below
            // (`wait_stream` before `one` drops); the comm and stream are live.
            let status = unsafe {
                nccl::all_reduce(
                    ptr as *const _,
                    ptr as *mut _,
                    1,
                    nccl_sys::ncclDataType_t::ncclFloat32,
                    nccl_sys::ncclRedOp_t::ncclSum,
                    self.comm.raw,
                    self.stream.cu_stream() as _,
                )
            };
            self.comm.enqueued(step, status)?;
        }
        self.wait_stream(step, deadline)
    }

    /// Broadcasts a bucket's chunks from rank 0, in order, reading each tensor at `ptrs`.
    fn broadcast(&mut self, plan: &BucketPlan, ptrs: &[u64], deadline: &Deadline) -> Result<()> {
        let step = Step::BROADCAST;
        self.ctx
            .bind_to_thread()
            .map_err(|e| cuda_error(step, "binding the CUDA context", e))?;
        // The tensors' last writes may be on any of libtorch's streams.
        self.ctx
            .synchronize()
            .map_err(|e| cuda_error(step, "waiting for the tensors' pending writes", e))?;
        for chunk in &plan.chunks {
            let first = chunk.tensors.start;
            let source = if chunk.tensors.len() == 1 && !chunk.bytes.is_empty() {
                // One tensor: broadcast straight from its memory.
                ptrs[first]
            } else {
                // Several (or an empty chunk): pack them, in order, into the reusable buffer.
                // The copies queue behind the previous chunk's broadcast on the same stream.
                let pack = self.pack_buffer(chunk.bytes.len().max(1))?;
                for i in chunk.tensors.clone() {
                    let at = plan.offsets[i].start - chunk.bytes.start;
                    let len = plan.offsets[i].len();
                    if len == 0 {
                        continue;
                    }
                    // SAFETY: `pack + at .. + len` lies inside the pack buffer (the chunk's
                    // bytes, at most its size); the source is `len` readable bytes per the
                    // `DeviceTensor` contract (`bucket_plan` checked the length); both are on
                    // this context and stay alive until the stream is drained at the end.
                    unsafe {
                        cudarc::driver::result::memcpy_dtod_async(
                            pack + at as u64,
                            ptrs[i],
                            len,
                            self.stream.cu_stream(),
                        )
                    }
                    .map_err(|e| {
                        cuda_error(step, &format!("packing `{}`", plan.tensors[i].name), e)
                    })?;
                }
                pack
            };
            // SAFETY: `source` holds the chunk's `len` bytes on this device (a tensor per the
            // `DeviceTensor` contract, or the pack buffer) and outlives the stream drain below;
            // rank 0 only reads it; the comm and stream are live.
            let status = unsafe {
                nccl::broadcast(
                    source as *const _,
                    source as *mut _,
                    chunk.bytes.len(),
                    nccl_sys::ncclDataType_t::ncclUint8,
                    0,
                    self.comm.raw,
                    self.stream.cu_stream() as _,
                )
            };
            self.comm.enqueued(step, status)?;
            wait(&self.comm, step, deadline, || Ok(true))?;
        }
        self.wait_stream(step, deadline)
    }

    /// The packing buffer's address, grown to at least `bytes`.
    fn pack_buffer(&mut self, bytes: usize) -> Result<u64> {
        if self.pack.as_ref().is_none_or(|p| p.len() < bytes) {
            // Drop the old one first so both never sit in GPU memory together.
            self.pack = None;
            let what = "allocating the packing buffer";
            let pack = self.stream.alloc_zeros::<u8>(bytes);
            self.pack = Some(pack.map_err(|e| cuda_error(Step::BROADCAST, what, e))?);
        }
        let pack = self.pack.as_ref().expect("just set");
        let (ptr, _record) = pack.device_ptr(&self.stream);
        Ok(ptr)
    }

    /// Waits for everything queued on the stream.
    fn wait_stream(&self, step: Step, deadline: &Deadline) -> Result<()> {
        let event = self
            .stream
            .record_event(None)
            .map_err(|e| cuda_error(step, "recording an event", e))?;
        wait(&self.comm, step, deadline, || {
            event
                .try_is_complete()
                .map_err(|e| cuda_error(step, "waiting for the GPU", e))
        })
    }
}

/// Polls until the communicator has no call in progress and `done()` holds. Fails on an NCCL
/// error, once an engine failed its side, or at the deadline; the caller then drops the
/// communicator, aborting it.
fn wait(
    comm: &Comm,
    step: Step,
    deadline: &Deadline,
    mut done: impl FnMut() -> Result<bool>,
) -> Result<()> {
    loop {
        if comm.ready(step)? && done()? {
            return Ok(());
        }
        if deadline.cancel.load(Ordering::Acquire) {
            let why = format!("an engine failed during {step}");
            return Err(NcclSyncError::Broken(why));
        }
        if Instant::now() >= deadline.at {
            let (timeout, engines) = (deadline.timeout, deadline.engines.clone());
            return Err(NcclSyncError::CommTimeout {
                step,
                timeout,
                engines,
            });
        }
        std::thread::sleep(POLL);
    }
}

/// Bytes per `update_weights` call of [`NcclPublisher`].
const BUCKET_BYTES: usize = 256 << 20;

/// The NCCL weight transport: updates from the trainer's GPU to the engines the coordinator (or
/// router) lists.
#[derive(Debug)]
pub struct NcclPublisher {
    control: Control,
    ordinal: usize,
    kind: Kind,
    /// The engines the sender is connected to, and the sender.
    sender: Option<(Vec<String>, NcclWeightSender)>,
}

impl NcclPublisher {
    pub fn new(target: &str, ordinal: usize, kind: Kind) -> Self {
        Self {
            control: Control::new(target),
            ordinal,
            kind,
            sender: None,
        }
    }

    /// The engines up behind the router.
    async fn engines(&self) -> Result<Vec<String>, SyncError> {
        let mut listed = self.control.get("engines").await?;
        let engines: Vec<EngineStatus> =
            serde_json::from_value(listed["engines"].take()).unwrap_or_default();
        let mut urls: Vec<String> = engines
            .into_iter()
            .filter(|e| e.healthy)
            .map(|e| e.url)
            .collect();
        urls.sort();
        if urls.is_empty() {
            return Err(SyncError::NoEngines);
        }
        Ok(urls)
    }

    /// Connects (again when the engines changed), then pause, send, set the version, resume.
    /// After a failed send the engines stay paused: resuming them would serve half-loaded
    /// weights.
    pub async fn update(
        &mut self,
        mut weights: WeightStream,
        version: u64,
        partial_rollout: bool,
    ) -> Result<SyncReport, SyncError> {
        let urls = self.engines().await?;
        if self.sender.as_ref().is_none_or(|(to, _)| *to != urls) {
            self.sender = None;
            let new = NcclWeightSender::connect(self.ordinal, &urls, NcclSenderConfig::default())
                .await
                .map_err(SyncError::at("connect"))?;
            self.sender = Some((urls, new));
        }
        let Self {
            control,
            kind,
            sender,
            ..
        } = self;
        let send = async {
            let (_, connected) = sender.as_mut().expect("connected above");
            let sent = send_stream(connected, *kind, &mut weights, version).await;
            if sent.is_err() {
                // A failed sender refuses further work: connect again next time.
                *sender = None;
            }
            sent.map_err(|e| SyncError::Held(Box::new(e)))
        };
        control.paused_update(version, partial_rollout, send).await
    }
}

/// Start, each bucket as it comes in the engines' dtype, finish (only once the stream ended
/// whole); what was sent.
async fn send_stream(
    sender: &mut NcclWeightSender,
    kind: Kind,
    weights: &mut WeightStream,
    version: u64,
) -> Result<SyncReport, SyncError> {
    sender.start_update().await?;
    let mut sent = SyncReport::default();
    while let Some(pieces) = weights.next_split(BUCKET_BYTES).await? {
        for bucket in pieces {
            // vLLM copies what it receives into its parameters.
            let converted: Vec<_> = bucket
                .into_iter()
                .map(|(n, t)| (n, t.to_kind(kind).contiguous()))
                .collect();
            sent.count(&converted);
            sender.send_bucket(converted).await?;
        }
    }
    sender.finish_update(version).await?;
    Ok(sent)
}

#[cfg(test)]
mod tests {
    //! What runs without a GPU: input checks and the refusal to start without CUDA. The
    //! exchange itself is tested in `tests/gpu_nccl_weight_sync.rs`.

    use super::*;

    // SAFETY: test double; `bucket_plan` reads only the placement, never the bytes at `ptr`.
    unsafe impl DeviceTensor for Placement {
        fn placement(&self) -> Result<Placement, Unsendable> {
            Ok(self.clone())
        }
    }

    /// A tensor that only describes itself (never read: the checks fail or stop before CUDA).
    fn described(shape: Vec<i64>, ordinal: Option<usize>, len: usize) -> Placement {
        Placement {
            dtype: "bfloat16",
            shape,
            ordinal,
            ptr: 0,
            len,
        }
    }

    #[test]
    fn bucket_plans_check_device_and_length_naming_the_tensor() {
        let wire = PackedWire {
            buffer_size_bytes: 10,
            num_buffers: 2,
        };
        let ok = vec![
            ("a".to_string(), described(vec![2, 2], Some(1), 8)),
            ("b".to_string(), described(vec![3], Some(1), 6)),
        ];
        let (plan, _) = bucket_plan(&ok, 1, wire).unwrap();
        assert_eq!(plan.total_bytes(), 14);
        assert_eq!(plan.chunks.len(), 1);
        assert_eq!(plan.update_info().dtype_names, ["bfloat16", "bfloat16"]);

        let cases = [
            (described(vec![2], Some(0), 4), "on CUDA device Some(0)"),
            (described(vec![2], None, 4), "on CUDA device None"),
            (
                described(vec![2], Some(1), 5),
                "5 bytes, but bfloat16 of shape [2] take 4",
            ),
        ];
        for (tensor, needle) in cases {
            let err = bucket_plan(&[("w.weight".to_string(), tensor)], 1, wire)
                .unwrap_err()
                .to_string();
            assert!(err.starts_with("tensor `w.weight`: "), "{err}");
            assert!(err.contains(needle), "{err}");
        }
    }

    #[test]
    fn libtorch_tensors_off_the_gpu_are_refused_with_their_dtype_named() {
        let cpu = tch::Tensor::zeros([4, 2], (tch::Kind::BFloat16, tch::Device::Cpu));
        assert_eq!(dtype_name(cpu.kind()).unwrap(), "bfloat16");
        let err = bucket_plan(
            &[("lm_head.weight".to_string(), cpu)],
            0,
            PackedWire::default(),
        )
        .unwrap_err()
        .to_string();
        assert_eq!(err, "tensor `lm_head.weight`: on Cpu, not a CUDA device");
        let kinds = [
            (tch::Kind::Float, "float32"),
            (tch::Kind::Half, "float16"),
            (tch::Kind::Int64, "int64"),
        ];
        for (kind, name) in kinds {
            assert_eq!(dtype_name(kind).unwrap(), name);
        }
        assert!(dtype_name(tch::Kind::ComplexFloat).is_err());
    }

    /// An engine failing its HTTP call raises the cancel flag the NCCL wait polls, so rank 0 stops
    /// waiting for a collective that engine will not join; all succeeding leaves it down.
    #[tokio::test]
    async fn an_engine_failing_cancels_the_collective_wait() {
        let refused = || NcclSyncError::Engine {
            url: "http://e1".into(),
            step: Step::UPDATE_WEIGHTS,
            message: "HTTP 400".into(),
        };
        let cancel = AtomicBool::new(false);
        let calls = vec![
            Box::pin(std::future::pending::<Result<()>>())
                as std::pin::Pin<Box<dyn Future<Output = _> + Send>>,
            Box::pin(async move { Err(refused()) }),
        ];
        // The other engine never answers: the error must not wait for it.
        let err = tokio::time::timeout(Duration::from_secs(5), fan_out(&cancel, calls.into_iter()))
            .await
            .expect("fan_out returns at the first error")
            .unwrap_err();
        assert!(err
            .to_string()
            .starts_with("engine http://e1, POST /update_weights"));
        assert!(cancel.load(Ordering::Acquire));

        let cancel = AtomicBool::new(false);
        fan_out(&cancel, (0..3).map(|_| async { Ok(()) }))
            .await
            .unwrap();
        assert!(!cancel.load(Ordering::Acquire));
    }

    /// Without CUDA, `connect` says what is missing instead of panicking in cudarc's loader; with
    /// it, an engine nobody serves fails at its first call, naming it.
    #[tokio::test]
    async fn connect_fails_with_the_reason_without_cuda_or_engine() {
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", closed.local_addr().unwrap());
        drop(closed);
        let err = NcclWeightSender::connect(0, std::slice::from_ref(&url), Default::default())
            .await
            .unwrap_err();
        match nccl_available() {
            Err(reason) => {
                assert!(
                    matches!(&err, NcclSyncError::Nccl { step: Step::COMM_INIT, .. } if err.to_string() == reason.to_string()),
                    "{err}"
                );
            }
            Ok(_) => {
                assert!(
                    matches!(&err, NcclSyncError::Engine { url: u, step: Step::GET_WORLD_SIZE, .. } if *u == url),
                    "{err}"
                );
            }
        }
    }
}
