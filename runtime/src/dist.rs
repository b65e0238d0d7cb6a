//! Collectives between the trainer's ranks (docs/distributed.md): one small interface
//! ([`Collectives`]: all-gather, reduce-scatter, all-reduce, broadcast) over tensors.
//!
//! The implementation is libtorch's own c10d, reached through a C++ shim
//! (`runtime/csrc/c10d_shim.cpp`): a `TCPStore` for the rendezvous (rank 0 listens, every rank
//! connects, as torchrun does), `ProcessGroupGloo` for CPU tensors and, for a rank on a GPU,
//! `ProcessGroupNCCL` for CUDA tensors. Each collective goes to the backend of its tensor's
//! device (rank 0's commands and batches stay on the CPU). One rank needs none of it ([`Solo`]).
//!
//! Contract: every rank calls the same collectives in the same order with tensors of the same
//! shapes. A collective that cannot complete (a rank died, the network broke) fails within the
//! group's timeout with an error naming this rank and, when the store can tell, the rank that was
//! lost; it never hangs.

use std::time::Duration;

use tch::{Device, Tensor};

/// What a failed rendezvous or collective says.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{0}")]
    Unavailable(String),
    #[error("trainer rank {rank} of {world}: {op} failed: {message}")]
    Collective {
        rank: usize,
        world: usize,
        op: &'static str,
        message: String,
    },
    #[error("invalid trainer rendezvous: {0}")]
    Config(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// How a reduction combines the ranks' values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    Sum,
    Max,
}

/// The collectives a sharded trainer needs. Tensors are contiguous and on the group's device.
pub trait Collectives: Send + Sync + std::fmt::Debug {
    fn rank(&self) -> usize;
    fn world(&self) -> usize;
    /// `out` (`[world · n]`) = every rank's `input` (`[n]`), in rank order.
    fn all_gather(&self, out: &Tensor, input: &Tensor) -> Result<()>;
    /// `out` (`[n]`) = this rank's chunk of the sum of every rank's `input` (`[world · n]`).
    fn reduce_scatter(&self, out: &Tensor, input: &Tensor) -> Result<()>;
    /// `tensor` = the reduction of every rank's `tensor`, in place.
    fn all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<()>;
    /// `tensor` = rank `root`'s `tensor`, in place.
    fn broadcast(&self, tensor: &Tensor, root: usize) -> Result<()>;
    /// The bound on one collective.
    fn timeout(&self) -> Duration;
    fn set_timeout(&self, timeout: Duration) -> Result<()>;
}

/// One rank alone: every collective is the identity.
#[derive(Debug, Clone, Copy, Default)]
pub struct Solo;

impl Collectives for Solo {
    fn rank(&self) -> usize {
        0
    }
    fn world(&self) -> usize {
        1
    }
    fn all_gather(&self, out: &Tensor, input: &Tensor) -> Result<()> {
        tch::no_grad(|| out.view(input.size().as_slice()).copy_(input));
        Ok(())
    }
    fn reduce_scatter(&self, out: &Tensor, input: &Tensor) -> Result<()> {
        self.all_gather(out, input)
    }
    fn all_reduce(&self, _: &Tensor, _: ReduceOp) -> Result<()> {
        Ok(())
    }
    fn broadcast(&self, _: &Tensor, _: usize) -> Result<()> {
        Ok(())
    }
    fn timeout(&self) -> Duration {
        Duration::MAX
    }
    fn set_timeout(&self, _: Duration) -> Result<()> {
        Ok(())
    }
}

/// Where and as whom a rank joins its group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rendezvous {
    /// Rank 0's address; rank 0 listens on `port` there.
    pub host: String,
    pub port: u16,
    pub rank: usize,
    pub world: usize,
    /// Bounds the rendezvous and every collective.
    pub timeout: Duration,
}

/// Environment variables of a trainer rank, set by `moult run` for the ranks it starts (trainer
/// pods get torchrun's `RANK`, `WORLD_SIZE`, `MASTER_ADDR` and `MASTER_PORT` from the operator
/// instead; docs/distributed.md).
pub const ENV_RANK: &str = "MOULT_TRAINER_RANK";
pub const ENV_WORLD: &str = "MOULT_TRAINER_WORLD_SIZE";
pub const ENV_MASTER: &str = "MOULT_TRAINER_MASTER";
pub const ENV_TIMEOUT: &str = "MOULT_TRAINER_TIMEOUT_SECONDS";

impl Rendezvous {
    /// The rendezvous of this process's environment; `None` for a trainer of one rank (no
    /// `MOULT_TRAINER_WORLD_SIZE`, or 1).
    pub fn from_env() -> Result<Option<Self>> {
        let var = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
        let bad = |name: &str, v: &str, want: &str| Error::Config(format!("{name}={v}: {want}"));
        let Some(w) = var(ENV_WORLD) else {
            return Ok(None);
        };
        let world: usize = w
            .parse()
            .map_err(|_| bad(ENV_WORLD, &w, "not a whole number"))?;
        if world <= 1 {
            return Ok(None);
        }
        let r = var(ENV_RANK).unwrap_or_default();
        let rank = r.parse().ok().filter(|r| *r < world);
        let rank = rank.ok_or_else(|| bad(ENV_RANK, &r, &format!("not a rank below {world}")))?;
        let master = var(ENV_MASTER).unwrap_or_default();
        let (host, port) = (master.rsplit_once(':'))
            .and_then(|(h, p)| Some((h.to_string(), p.parse::<u16>().ok()?)))
            .ok_or_else(|| bad(ENV_MASTER, &master, "expected host:port of rank 0"))?;
        let t = var(ENV_TIMEOUT).unwrap_or_else(|| "120".into());
        let timeout = t.parse::<f64>().ok().filter(|t| *t > 0.0);
        let timeout = timeout.ok_or_else(|| bad(ENV_TIMEOUT, &t, "expected positive seconds"))?;
        let timeout = Duration::from_secs_f64(timeout);
        Ok(Some(Self {
            host,
            port,
            rank,
            world,
            timeout,
        }))
    }

    /// Joins the group for a rank computing on `device`, waiting for every rank up to the
    /// timeout: on a GPU, CUDA tensors' collectives go through NCCL on that GPU, CPU tensors'
    /// through Gloo (on the CPU, Gloo alone).
    pub fn connect_on(&self, device: Device) -> Result<Box<dyn Collectives>> {
        let cuda = match device {
            Device::Cpu => None,
            Device::Cuda(i) => Some(i),
            other => {
                return Err(Error::Config(format!(
                    "trainer ranks run on the CPU or CUDA GPUs, not {other:?}"
                )))
            }
        };
        c10d::C10d::connect(self, cuda).map(|g| Box::new(g) as Box<dyn Collectives>)
    }

    /// [`Rendezvous::connect_on`], given up after the timeout (and a margin) even where the
    /// library would wait on: a rank 0 that died while this rank was joining it can leave the join
    /// waiting for a peer that is gone. The abandoned attempt's thread ends with the process.
    pub fn connect_bounded(&self, device: Device) -> Result<Box<dyn Collectives>> {
        let (tx, rx) = std::sync::mpsc::channel();
        let attempt = self.clone();
        std::thread::Builder::new()
            .name(format!("rank-{}-join", self.rank))
            .spawn(move || {
                let _ = tx.send(attempt.connect_on(device));
            })
            .map_err(|e| Error::Config(format!("starting the rendezvous thread: {e}")))?;
        rx.recv_timeout(self.timeout + Duration::from_secs(10))
            .unwrap_or_else(|_| Err(self.failed("no group at", "")))
    }

    /// This rank's rendezvous failed: `before` rank 0's address and the timeout, `after` them.
    fn failed(&self, before: &str, after: &str) -> Error {
        let (host, port, timeout) = (&self.host, self.port, self.timeout);
        Error::Collective {
            rank: self.rank,
            world: self.world,
            op: "rendezvous",
            message: format!("{before} {host}:{port} within {timeout:?}{after}"),
        }
    }
}

// FFI to the C++ shim over libtorch's c10d: the calls pass live tensors and an out-pointer for
// the error message, nothing else.
#[cfg(moult_gloo)]
#[allow(unsafe_code)]
mod c10d {
    use std::ffi::{c_char, c_int, c_void, CStr, CString};
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use tch::Tensor;

    use super::{Collectives, Error, ReduceOp, Rendezvous, Result};

    /// The shim's process group, a tensor (`at::Tensor*`), and where it puts an error message.
    type Group = *mut c_void;
    type At = *mut c_void;
    type Message = *mut *mut c_char;

    extern "C" {
        fn moult_c10d_new(
            host: *const c_char,
            port: c_int,
            rank: c_int,
            world: c_int,
            timeout_ms: c_int,
            cuda_device: c_int,
            err: Message,
        ) -> Group;
        fn moult_c10d_drop(handle: Group);
        fn moult_c10d_free_message(err: *mut c_char);
        fn moult_c10d_all_gather(h: Group, out: At, input: At, err: Message) -> c_int;
        fn moult_c10d_reduce_scatter(h: Group, out: At, input: At, err: Message) -> c_int;
        fn moult_c10d_all_reduce(h: Group, t: At, op: c_int, err: Message) -> c_int;
        fn moult_c10d_broadcast(h: Group, t: At, root: c_int, err: Message) -> c_int;
        fn moult_c10d_set_timeout(h: Group, ms: i64, err: Message) -> c_int;
        fn moult_c10d_store_add(
            h: Group,
            key: *const c_char,
            delta: i64,
            out: *mut i64,
            err: Message,
        ) -> c_int;
    }

    /// How often each rank's heartbeat counter in the store goes up.
    const HEARTBEAT: Duration = Duration::from_millis(500);

    /// c10d process groups (Gloo; NCCL too on a GPU) and their TCP store, with this rank's heartbeat in the store
    /// (what names a lost rank when a collective fails).
    #[derive(Debug)]
    pub struct C10d {
        handle: Arc<Handle>,
        /// Collectives are serialised (every rank must issue them in one order).
        collective: Mutex<()>,
        rank: usize,
        world: usize,
        timeout: Mutex<Duration>,
        heartbeat: Option<std::thread::JoinHandle<()>>,
        stop: Arc<AtomicBool>,
    }

    #[derive(Debug)]
    struct Handle(Group);

    // SAFETY: c10d's process group is not tied to the thread that created it; collectives go
    // through `C10d::collective` one at a time, and the store (the heartbeat's only use from
    // another thread) has its own lock.
    unsafe impl Send for Handle {}
    unsafe impl Sync for Handle {}

    impl Drop for Handle {
        fn drop(&mut self) {
            // SAFETY: created by moult_c10d_new, dropped once, after the heartbeat thread ended.
            unsafe { moult_c10d_drop(self.0) }
        }
    }

    impl Drop for C10d {
        fn drop(&mut self) {
            self.stop.store(true, Ordering::Relaxed);
            if let Some(beat) = self.heartbeat.take() {
                let _ = beat.join();
            }
        }
    }

    /// Adds `delta` to rank `rank`'s heartbeat counter; returns it (`None`: the store did not
    /// answer, which is all its callers need to know).
    fn beat(handle: &Handle, rank: usize, delta: i64) -> Option<i64> {
        let key = CString::new(format!("moult/heartbeat/{rank}")).expect("no NUL");
        let (mut out, mut err) = (0i64, std::ptr::null_mut());
        // SAFETY: live handle, C string and out-pointers.
        let rc = unsafe { moult_c10d_store_add(handle.0, key.as_ptr(), delta, &mut out, &mut err) };
        if rc != 0 {
            take_message(err);
        }
        (rc == 0).then_some(out)
    }

    fn take_message(err: *mut c_char) -> String {
        if err.is_null() {
            return "unknown error".into();
        }
        // SAFETY: the shim returns strdup'ed, NUL-terminated messages.
        let text = unsafe { CStr::from_ptr(err) }
            .to_string_lossy()
            .into_owned();
        unsafe { moult_c10d_free_message(err) };
        text
    }

    impl C10d {
        /// Joins; `cuda` names the GPU whose tensors go through NCCL.
        pub fn connect(r: &Rendezvous, cuda: Option<usize>) -> Result<Self> {
            let host = CString::new(r.host.as_str())
                .map_err(|_| Error::Config(format!("host {:?} has a NUL byte", r.host)))?;
            let mut err = std::ptr::null_mut();
            // SAFETY: valid C string, out-pointer for the message.
            let handle = unsafe {
                moult_c10d_new(
                    host.as_ptr(),
                    r.port as c_int,
                    r.rank as c_int,
                    r.world as c_int,
                    r.timeout.as_millis().min(i32::MAX as u128) as c_int,
                    cuda.map_or(-1, |i| i as c_int),
                    &mut err,
                )
            };
            if handle.is_null() {
                return Err(r.failed("at", &format!(": {}", take_message(err))));
            }
            let handle = Arc::new(Handle(handle));
            let stop = Arc::new(AtomicBool::new(false));
            let heartbeat = {
                let (handle, stop, rank) = (handle.clone(), stop.clone(), r.rank);
                std::thread::Builder::new()
                    .name(format!("rank-{rank}-heartbeat"))
                    .spawn(move || {
                        while !stop.load(Ordering::Relaxed) {
                            // A store that is gone is rank 0 gone: the collectives say so.
                            let _ = beat(&handle, rank, 1);
                            std::thread::sleep(HEARTBEAT);
                        }
                    })
                    .map_err(|e| Error::Config(format!("starting the heartbeat thread: {e}")))?
            };
            Ok(Self {
                handle,
                collective: Mutex::new(()),
                rank: r.rank,
                world: r.world,
                timeout: Mutex::new(r.timeout),
                heartbeat: Some(heartbeat),
                stop,
            })
        }

        /// Which ranks stopped: those whose heartbeat did not move over a few beats, or rank 0
        /// when the store it holds cannot be reached.
        fn lost_ranks(&self) -> String {
            let read = || -> Option<Vec<i64>> {
                (0..self.world).map(|r| beat(&self.handle, r, 0)).collect()
            };
            let Some(before) = read() else {
                return "rank 0 was lost (the rendezvous store it holds does not answer)".into();
            };
            std::thread::sleep(HEARTBEAT * 4);
            let Some(after) = read() else {
                return "rank 0 was lost (the rendezvous store it holds does not answer)".into();
            };
            let lost: Vec<String> = (0..self.world)
                .filter(|&r| r != self.rank && before[r] == after[r])
                .map(|r| r.to_string())
                .collect();
            match lost.len() {
                0 => "every rank's heartbeat still moves (a network error, or a rank stuck in a collective)".into(),
                1 => format!("rank {} was lost (its heartbeat stopped)", lost[0]),
                _ => format!("ranks {} were lost (their heartbeats stopped)", lost.join(", ")),
            }
        }

        fn call(&self, op: &'static str, f: impl FnOnce(Group, Message) -> c_int) -> Result<()> {
            let guard = self.collective.lock().unwrap_or_else(|e| e.into_inner());
            let mut err = std::ptr::null_mut();
            if f(self.handle.0, &mut err) == 0 {
                return Ok(());
            }
            drop(guard);
            let message = take_message(err);
            Err(Error::Collective {
                rank: self.rank,
                world: self.world,
                op,
                message: format!("{}; {message}", self.lost_ranks()),
            })
        }
    }

    fn ptr(t: &Tensor) -> At {
        t.as_ptr() as At
    }

    impl Collectives for C10d {
        fn rank(&self) -> usize {
            self.rank
        }
        fn world(&self) -> usize {
            self.world
        }
        fn all_gather(&self, out: &Tensor, input: &Tensor) -> Result<()> {
            // SAFETY: live tensors for the call's duration.
            self.call("all-gather", |h, e| unsafe {
                moult_c10d_all_gather(h, ptr(out), ptr(input), e)
            })
        }
        fn reduce_scatter(&self, out: &Tensor, input: &Tensor) -> Result<()> {
            // SAFETY: as above.
            self.call("reduce-scatter", |h, e| unsafe {
                moult_c10d_reduce_scatter(h, ptr(out), ptr(input), e)
            })
        }
        fn all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<()> {
            let op = match op {
                ReduceOp::Sum => 0,
                ReduceOp::Max => 1,
            };
            // SAFETY: as above.
            self.call("all-reduce", |h, e| unsafe {
                moult_c10d_all_reduce(h, ptr(tensor), op, e)
            })
        }
        fn broadcast(&self, tensor: &Tensor, root: usize) -> Result<()> {
            // SAFETY: as above.
            self.call("broadcast", |h, e| unsafe {
                moult_c10d_broadcast(h, ptr(tensor), root as c_int, e)
            })
        }
        fn timeout(&self) -> Duration {
            *self.timeout.lock().unwrap_or_else(|e| e.into_inner())
        }
        fn set_timeout(&self, timeout: Duration) -> Result<()> {
            let ms = timeout.as_millis().min(i64::MAX as u128) as i64;
            // SAFETY: as above.
            self.call("set-timeout", |h, e| unsafe {
                moult_c10d_set_timeout(h, ms, e)
            })?;
            *self.timeout.lock().unwrap_or_else(|e| e.into_inner()) = timeout;
            Ok(())
        }
    }
}

#[cfg(not(moult_gloo))]
mod c10d {
    use super::{Error, Rendezvous, Result};

    /// Built without Gloo's headers: no multi-rank trainer.
    #[derive(Debug)]
    pub enum C10d {}

    impl C10d {
        pub fn connect(r: &Rendezvous, _cuda: Option<usize>) -> Result<super::Solo> {
            Err(Error::Unavailable(format!(
                "a trainer of {} ranks needs the Gloo collectives, and this moult was built without Gloo's headers (apt-get install libgloo-dev, then rebuild; docs/distributed.md)",
                r.world
            )))
        }
    }
}
