//! The TCP weight-transfer data plane, both ends (DESIGN §4.1).
//!
//! The trainer (rank 0) listens; each engine, told where by `POST /init_weight_transfer_engine`,
//! connects and announces its rank (`MOULTHI1`, u32 LE rank). For every `POST /update_weights`
//! bucket the trainer sends `MOULTWT1`, the payload length as u64 LE, then the tensors' raw bytes
//! concatenated in `names` order (the same packed stream the NCCL plane broadcasts), flushed in
//! chunks of at most `packed_buffer_size_bytes`. The engine checks the length against the
//! `update_info` it was given, so a desynchronised stream is detected rather than misread.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};

use tch::{Device, Kind, Tensor};
use tokio::io::AsyncReadExt;

use super::api::UpdateInfo;
use crate::model::{dtype_name, parse_dtype};

pub const HELLO_MAGIC: &[u8; 8] = b"MOULTHI1";
pub const BUCKET_MAGIC: &[u8; 8] = b"MOULTWT1";

/// vLLM's default `packed_buffer_size_bytes` for packed broadcasts (1 GiB is theirs; on CPU a
/// smaller chunk keeps memory flat without costing throughput).
pub const DEFAULT_PACKED_BUFFER_BYTES: usize = 64 << 20;

/// The `update_info` describing `tensors` in order.
pub fn update_info(tensors: &[(String, Tensor)]) -> UpdateInfo {
    UpdateInfo {
        names: tensors.iter().map(|(n, _)| n.clone()).collect(),
        dtype_names: tensors
            .iter()
            .map(|(_, t)| dtype_name(t.kind()).to_string())
            .collect(),
        shapes: tensors.iter().map(|(_, t)| t.size()).collect(),
        packed: Some(true),
    }
}

/// The trainer's end: accepted engine connections, ordered by rank.
#[derive(Debug)]
pub struct TcpWeightSender {
    conns: Vec<TcpStream>,
}

/// A bound listener waiting for engines (bind first, hand out the port, then accept).
#[derive(Debug)]
pub struct WeightListener {
    listener: TcpListener,
}

impl WeightListener {
    pub fn bind(addr: &str) -> std::io::Result<Self> {
        Ok(Self {
            listener: TcpListener::bind(addr)?,
        })
    }

    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// Waits for `engines` connections and orders them by announced rank.
    pub fn accept(self, engines: usize) -> std::io::Result<TcpWeightSender> {
        let mut ranked = Vec::with_capacity(engines);
        for _ in 0..engines {
            let (mut stream, _) = self.listener.accept()?;
            stream.set_nodelay(true)?;
            let mut hello = [0u8; 12];
            stream.read_exact(&mut hello)?;
            if &hello[..8] != HELLO_MAGIC {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    "peer is not a moult engine",
                ));
            }
            ranked.push((
                u32::from_le_bytes(hello[8..].try_into().expect("4 bytes")),
                stream,
            ));
        }
        ranked.sort_by_key(|(rank, _)| *rank);
        Ok(TcpWeightSender {
            conns: ranked.into_iter().map(|(_, s)| s).collect(),
        })
    }
}

/// The raw bytes of a tensor (contiguous, on the CPU).
fn tensor_bytes(t: &Tensor) -> Vec<u8> {
    let t = t.to_device(Device::Cpu).contiguous();
    let mut buf = vec![0u8; t.numel() * t.kind().elt_size_in_bytes()];
    t.copy_data_u8(&mut buf, t.numel());
    buf
}

impl TcpWeightSender {
    /// Sends one bucket to every engine; the engines must be reading it (`POST /update_weights`
    /// with [`update_info`] of the same tensors) concurrently.
    pub fn send_bucket(
        &mut self,
        tensors: &[(String, Tensor)],
        packed_buffer_bytes: usize,
    ) -> std::io::Result<()> {
        let total: usize = tensors
            .iter()
            .map(|(_, t)| t.numel() * t.kind().elt_size_in_bytes())
            .sum();
        let mut header = Vec::with_capacity(16);
        header.extend_from_slice(BUCKET_MAGIC);
        header.extend_from_slice(&(total as u64).to_le_bytes());
        self.broadcast(&header)?;
        let mut chunk = Vec::with_capacity(packed_buffer_bytes.min(total));
        for (_, t) in tensors {
            chunk.extend_from_slice(&tensor_bytes(t));
            if chunk.len() >= packed_buffer_bytes {
                self.broadcast(&chunk)?;
                chunk.clear();
            }
        }
        if !chunk.is_empty() {
            self.broadcast(&chunk)?;
        }
        Ok(())
    }

    fn broadcast(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        for conn in &mut self.conns {
            conn.write_all(bytes)?;
        }
        Ok(())
    }
}

/// The engine's end: connects to the trainer and announces its rank.
pub async fn connect(addr: &str, rank: u32) -> std::io::Result<tokio::net::TcpStream> {
    use tokio::io::AsyncWriteExt;
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    stream.set_nodelay(true)?;
    let mut hello = Vec::with_capacity(12);
    hello.extend_from_slice(HELLO_MAGIC);
    hello.extend_from_slice(&rank.to_le_bytes());
    stream.write_all(&hello).await?;
    Ok(stream)
}

/// A bucket's tensors, checked against the model: (name, shape, dtype) in stream order.
#[derive(Debug)]
pub struct BucketLayout {
    entries: Vec<(String, Vec<i64>, Kind)>,
    total_bytes: usize,
}

impl BucketLayout {
    /// Checks `info` against the model's weights; errors name the offending entry.
    pub fn new(info: &UpdateInfo, params: &[(String, Vec<i64>)]) -> Result<Self, String> {
        let n = info.names.len();
        if info.dtype_names.len() != n || info.shapes.len() != n {
            return Err(format!(
                "update_info has {n} names, {} dtype_names and {} shapes; they must match",
                info.dtype_names.len(),
                info.shapes.len()
            ));
        }
        let mut entries = Vec::with_capacity(n);
        let mut total_bytes = 0;
        for ((name, dtype), shape) in info.names.iter().zip(&info.dtype_names).zip(&info.shapes) {
            let Some((_, expected)) = params.iter().find(|(p, _)| p == name) else {
                return Err(format!(
                    "update_info.names: `{name}` is not a weight of this model"
                ));
            };
            if shape != expected {
                return Err(format!("update_info.shapes: `{name}` has shape {expected:?} in this model, got {shape:?}"));
            }
            let kind = parse_dtype(dtype).ok_or_else(|| {
                format!("update_info.dtype_names: `{dtype}` for `{name}` is not one of float32, bfloat16, float16")
            })?;
            total_bytes += shape.iter().product::<i64>() as usize * kind.elt_size_in_bytes();
            entries.push((name.clone(), shape.clone(), kind));
        }
        Ok(Self {
            entries,
            total_bytes,
        })
    }

    pub fn total_bytes(&self) -> usize {
        self.total_bytes
    }

    /// Reads this bucket from the stream: header, then the payload.
    pub async fn read(&self, stream: &mut tokio::net::TcpStream) -> Result<Vec<u8>, String> {
        let mut header = [0u8; 16];
        stream
            .read_exact(&mut header)
            .await
            .map_err(|e| format!("reading the bucket header: {e}"))?;
        if &header[..8] != BUCKET_MAGIC {
            return Err("the weight stream is out of sync (bad bucket magic)".into());
        }
        let len = u64::from_le_bytes(header[8..].try_into().expect("8 bytes")) as usize;
        if len != self.total_bytes {
            return Err(format!(
                "the trainer sent {len} bytes but update_info describes {} bytes",
                self.total_bytes
            ));
        }
        let mut payload = vec![0u8; len];
        stream
            .read_exact(&mut payload)
            .await
            .map_err(|e| format!("reading {len} weight bytes: {e}"))?;
        Ok(payload)
    }

    /// Cuts a payload into tensors (CPU; the engine moves them to its device when applying).
    pub fn tensors(&self, payload: &[u8]) -> Result<Vec<(String, Tensor)>, tch::TchError> {
        let mut offset = 0;
        self.entries
            .iter()
            .map(|(name, shape, kind)| {
                let len = shape.iter().product::<i64>() as usize * kind.elt_size_in_bytes();
                let t = Tensor::f_from_data_size(&payload[offset..offset + len], shape, *kind)?;
                offset += len;
                Ok((name.clone(), t))
            })
            .collect()
    }
}
