//! Trainer ranks as processes of this machine (docs/distributed.md): `moult run` starts the ranks
//! after the first, and a trainer pod on a node with several GPUs starts that node's others, as
//! torchrun does.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use tch::Device;

use crate::dist::{self, Rendezvous};
use crate::error::{Result, RunError};

/// Trainer ranks as processes of this machine (`moult trainer-rank`), as torchrun starts a node's
/// ranks: the ranks after the first for `moult run`, a trainer pod's ranks after its first on a
/// node with several GPUs. They follow rank 0 and end when it stops them, when this process
/// drops them, or when it dies.
pub(crate) struct Followers {
    children: Vec<std::process::Child>,
}

impl Followers {
    /// `moult run`: starts ranks 1..world on this machine; returns them and rank 0's rendezvous
    /// (it listens on a free port). On a GPU, rank r computes on the r-th GPU from rank 0's.
    pub(super) fn start_all(world: usize, device: Device) -> Result<(Self, Rendezvous)> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(RunError::start("finding a port for the trainer ranks"))?
            .port();
        let rendezvous = Rendezvous {
            host: "127.0.0.1".into(),
            port,
            rank: 0,
            world,
            timeout: Duration::from_secs(120),
        };
        let followers = Self::start(&rendezvous, 1..world, device)?;
        Ok((followers, rendezvous))
    }

    /// Starts `ranks` of `at`'s group on this machine, the i-th of them (counting from `at`'s
    /// own rank, this process) on the i-th GPU from `device`'s, or on the CPU.
    pub(crate) fn start(
        at: &Rendezvous,
        ranks: std::ops::Range<usize>,
        device: Device,
    ) -> Result<Self> {
        let exe = std::env::var_os("MOULT_BIN")
            .map(PathBuf::from)
            .map_or_else(std::env::current_exe, Ok)
            .map_err(RunError::start("finding the moult binary"))?;
        let device_of = |rank: usize| -> Result<String> {
            match device {
                Device::Cpu => Ok("cpu".to_string()),
                Device::Cuda(first) => {
                    let gpu = first + rank - at.rank;
                    let count = tch::Cuda::device_count().max(0) as usize;
                    if gpu >= count {
                        let why = format!("trainer rank {rank} computes on GPU {gpu}, and this machine has {count} (one rank per GPU; docs/distributed.md)");
                        return Err(RunError::field("spec.trainer.gpusPerNode", why));
                    }
                    Ok(format!("cuda:{gpu}"))
                }
                other => Err(RunError::Setup(format!(
                    "trainer ranks run on the CPU or CUDA GPUs, not {other:?}"
                ))),
            }
        };
        let mut followers = Self { children: vec![] };
        for rank in ranks {
            let device = device_of(rank)?;
            let child = std::process::Command::new(&exe)
                .args(["trainer-rank", "--device", &device])
                .env(dist::ENV_RANK, rank.to_string())
                .env(dist::ENV_WORLD, at.world.to_string())
                .env(dist::ENV_MASTER, format!("{}:{}", at.host, at.port))
                .env(dist::ENV_TIMEOUT, at.timeout.as_secs().to_string())
                .stdin(std::process::Stdio::null())
                .stdout(std::process::Stdio::null())
                .spawn()
                .map_err(RunError::start(format!(
                    "starting trainer rank {rank} ({} trainer-rank)",
                    exe.display()
                )))?;
            followers.children.push(child);
        }
        Ok(followers)
    }
}

impl Drop for Followers {
    fn drop(&mut self) {
        // Told to stop (the learner's drop), they exit on their own; give them a moment.
        let deadline = Instant::now() + Duration::from_secs(5);
        for child in &mut self.children {
            while Instant::now() < deadline && matches!(child.try_wait(), Ok(None)) {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
