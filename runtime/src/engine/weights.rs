//! The TCP weight-transfer data plane, both ends (docs/engine.md).
//!
//! The trainer (rank 0) listens; each engine, told where by `POST /init_weight_transfer_engine`,
//! connects, and the two prove to each other that they hold the run token without sending it
//! (docs/engine.md): the engine sends `MOULTHI2`, its rank (u32 LE) and a random 32-byte nonce;
//! the trainer answers `MOULTTR2`, a nonce of its own and its proof (HMAC-SHA256 keyed by the
//! token of `trainer`, both nonces and the rank, [`crate::auth`]); the engine checks it and
//! answers its own proof (the same with `engine`), which the trainer checks. A peer without the
//! token learns nothing it could replay and is refused at either end. For every `POST /update_weights`
//! bucket the trainer sends `MOULTWT2`, the payload length as u64 LE, the tensors' raw bytes
//! concatenated in `names` order (the same packed stream the NCCL plane broadcasts), flushed in
//! chunks of `packed_buffer_size_bytes`, then the bucket's tag: HMAC-SHA256 of the bucket's number
//! on this connection (u64 LE), its header and its bytes, keyed by the MAC of the run token, both
//! nonces and the rank ([`DataKey`]). The engine checks the length against the `update_info` it
//! was given, so a desynchronised stream is detected rather than misread, and the tag before it
//! stages anything, so bytes changed, cut, replayed or reordered on the way fail the update.
//!
//! Updates are staged: buckets land in one byte buffer, and `finish_weight_update` copies them
//! into the model between two engine steps, so a step never sees half a version. Both ends reuse
//! their buffers across updates, so a steady stream of updates allocates nothing.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use hmac::{Hmac, Mac};
use sha2::Sha256;
use tch::{Device, Kind, Tensor};
use tokio::io::AsyncReadExt;

use super::api::UpdateInfo;
use crate::model::{dtype_name, parse_dtype};

pub const HELLO_MAGIC: &[u8; 8] = b"MOULTHI2";
/// The trainer's answer to a hello: this, its nonce and its proof.
pub const CHALLENGE_MAGIC: &[u8; 8] = b"MOULTTR2";
/// What each side's proof is the MAC of, besides the nonces and the rank.
const TRAINER_ROLE: &[u8] = b"moult weight stream trainer v2";
const ENGINE_ROLE: &[u8] = b"moult weight stream engine v2";
/// What the key of a connection's bucket tags is the MAC of, besides the nonces and the rank.
const DATA_ROLE: &[u8] = b"moult weight stream data v2";
const NONCE_BYTES: usize = 32;
const TAG_BYTES: usize = 32;

/// The key of one connection's bucket tags, and the number of the next bucket on it: both ends
/// derive the key from the handshake (so it is new for every connection and never sent), and
/// each bucket's tag covers its number, so no bucket can be replayed or moved.
#[derive(Debug, Clone)]
pub struct DataKey {
    key: [u8; 32],
    next: u64,
}

impl DataKey {
    fn new(token: &str, engine_nonce: &[u8], trainer_nonce: &[u8], rank: u32) -> Self {
        Self {
            key: proof(token, DATA_ROLE, engine_nonce, trainer_nonce, rank),
            next: 0,
        }
    }

    /// The MAC of the next bucket, fed its number so far (then its header and bytes).
    fn bucket(&mut self) -> Hmac<Sha256> {
        let mut mac = Hmac::<Sha256>::new_from_slice(&self.key).expect("a 32-byte key");
        mac.update(&self.next.to_le_bytes());
        self.next += 1;
        mac
    }
}

/// An engine's end of the weight stream: the connection and its [`DataKey`].
#[derive(Debug)]
pub struct WeightConnection {
    stream: tokio::net::TcpStream,
    key: DataKey,
}

/// One side's proof of the run token for one handshake: HMAC-SHA256 keyed by the token (empty
/// where there is none: a local run on loopback) of its role, both nonces and the rank.
fn proof(
    token: &str,
    role: &[u8],
    engine_nonce: &[u8],
    trainer_nonce: &[u8],
    rank: u32,
) -> [u8; 32] {
    moult_operator::credentials::mac(
        token,
        &[role, engine_nonce, trainer_nonce, &rank.to_le_bytes()],
    )
}

/// The run token of this process, or none (a local run).
fn run_token() -> String {
    crate::auth::token().unwrap_or_default().to_string()
}
pub const BUCKET_MAGIC: &[u8; 8] = b"MOULTWT2";

/// The sender's default flush size (vLLM's packed broadcasts default to 1 GiB on GPUs; on a CPU
/// socket a smaller chunk keeps memory flat at the same throughput).
pub const DEFAULT_PACKED_BUFFER_BYTES: usize = 64 << 20;

/// Largest temporary tensor when copying staged bytes into the model: big weights (embeddings)
/// are copied in row blocks of about this size, so the temporaries are reused by the allocator.
const APPLY_CHUNK_BYTES: usize = 16 << 20;

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

/// How long the trainer waits for every engine to connect.
pub const ACCEPT_TIMEOUT: Duration = Duration::from_secs(120);
/// How long a connected peer has for each message of the handshake (its hello, its proof).
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long either end waits without progress (a write that takes no bytes, a read that gets
/// none) before the update fails: a silent or stuck peer cannot stall weight sync.
pub const STALL_TIMEOUT: Duration = Duration::from_secs(60);

/// A bound listener waiting for engines (bind first, hand out the port, then accept).
#[derive(Debug)]
pub struct WeightListener {
    listener: TcpListener,
    /// [`ACCEPT_TIMEOUT`], [`HANDSHAKE_TIMEOUT`], [`STALL_TIMEOUT`] (shorter in tests).
    pub accept_timeout: Duration,
    pub handshake_timeout: Duration,
    pub stall_timeout: Duration,
    /// The token engines must prove they hold (this process's run token).
    pub token: String,
}

impl WeightListener {
    pub fn bind(addr: &str) -> std::io::Result<Self> {
        Ok(Self {
            listener: TcpListener::bind(addr)?,
            accept_timeout: ACCEPT_TIMEOUT,
            handshake_timeout: HANDSHAKE_TIMEOUT,
            stall_timeout: STALL_TIMEOUT,
            token: run_token(),
        })
    }

    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// Waits (at most [`ACCEPT_TIMEOUT`]) for `engines` connections and orders them by announced
    /// rank. A peer that connects and says nothing for [`HANDSHAKE_TIMEOUT`] fails the accept.
    pub fn accept(self, engines: usize) -> std::io::Result<TcpWeightSender> {
        let deadline = Instant::now() + self.accept_timeout;
        self.listener.set_nonblocking(true)?;
        let mut ranked = Vec::with_capacity(engines);
        while ranked.len() < engines {
            let mut stream = match self.listener.accept() {
                Ok((stream, _)) => stream,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        return Err(std::io::Error::new(
                            std::io::ErrorKind::TimedOut,
                            format!(
                                "{} of {engines} engines connected to the weight stream within {:?}",
                                ranked.len(),
                                self.accept_timeout
                            ),
                        ));
                    }
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                }
                Err(e) => return Err(e),
            };
            stream.set_nonblocking(false)?;
            stream.set_nodelay(true)?;
            stream.set_read_timeout(Some(self.handshake_timeout))?;
            let timeout = self.handshake_timeout;
            let silent = move |e: std::io::Error| {
                match e.kind() {
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
                    std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        format!("a peer of the weight stream did not finish its handshake within {timeout:?}"),
                    )
                }
                _ => e,
            }
            };
            let mut hello = [0u8; 12 + NONCE_BYTES];
            stream.read_exact(&mut hello).map_err(silent)?;
            if &hello[..8] != HELLO_MAGIC {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    "a peer of the weight stream is not a moult engine of this version (no MOULTHI2 hello)",
                ));
            }
            let rank = u32::from_le_bytes(hello[8..12].try_into().expect("4 bytes"));
            let engine_nonce = &hello[12..];
            let trainer_nonce: [u8; NONCE_BYTES] = rand::random();
            let mut challenge = Vec::with_capacity(8 + 2 * NONCE_BYTES);
            challenge.extend_from_slice(CHALLENGE_MAGIC);
            challenge.extend_from_slice(&trainer_nonce);
            challenge.extend_from_slice(&proof(
                &self.token,
                TRAINER_ROLE,
                engine_nonce,
                &trainer_nonce,
                rank,
            ));
            stream.set_write_timeout(Some(self.handshake_timeout))?;
            stream.write_all(&challenge)?;
            let mut given = [0u8; 32];
            stream.read_exact(&mut given).map_err(silent)?;
            let expected = proof(&self.token, ENGINE_ROLE, engine_nonce, &trainer_nonce, rank);
            if !crate::auth::same_secret(&given, &expected) {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::PermissionDenied,
                    "a peer of the weight stream did not prove the run's token",
                ));
            }
            stream.set_read_timeout(None)?;
            // A write that moves no bytes for this long (an engine that stopped reading) fails.
            stream.set_write_timeout(Some(self.stall_timeout))?;
            let key = DataKey::new(&self.token, engine_nonce, &trainer_nonce, rank);
            ranked.push((rank, stream, key));
        }
        ranked.sort_by_key(|(rank, ..)| *rank);
        Ok(TcpWeightSender {
            conns: ranked.into_iter().map(|(_, s, k)| (s, k)).collect(),
            chunk: Vec::new(),
        })
    }
}

/// The trainer's end: accepted engine connections, ordered by rank.
#[derive(Debug)]
pub struct TcpWeightSender {
    conns: Vec<(TcpStream, DataKey)>,
    /// The packing buffer, reused across buckets.
    chunk: Vec<u8>,
}

impl TcpWeightSender {
    /// Sends one bucket to every engine; the engines must be reading it (`POST /update_weights`
    /// with [`update_info`] of the same tensors) concurrently.
    pub fn send_bucket(
        &mut self,
        tensors: &[(String, Tensor)],
        packed_buffer_bytes: usize,
    ) -> std::io::Result<()> {
        let packed_buffer_bytes = packed_buffer_bytes.max(1);
        let total: usize = tensors
            .iter()
            .map(|(_, t)| t.numel() * t.kind().elt_size_in_bytes())
            .sum();
        let mut header = Vec::with_capacity(16);
        header.extend_from_slice(BUCKET_MAGIC);
        header.extend_from_slice(&(total as u64).to_le_bytes());
        let mut macs: Vec<_> = self.conns.iter_mut().map(|(_, k)| k.bucket()).collect();
        broadcast(&mut self.conns, &mut macs, &header)?;
        let mut chunk = std::mem::take(&mut self.chunk);
        chunk.clear();
        for (_, t) in tensors {
            let t = t.to_device(Device::Cpu).contiguous();
            let rows = if t.dim() == 0 { 1 } else { t.size()[0] };
            let row_numel = if rows == 0 {
                0
            } else {
                t.numel() / rows as usize
            };
            let row_bytes = row_numel * t.kind().elt_size_in_bytes();
            let flat = if t.dim() == 0 { t.reshape([1]) } else { t };
            let mut r = 0;
            while r < rows {
                // As many whole rows as fit before the flush size (at least one).
                let space = packed_buffer_bytes.saturating_sub(chunk.len());
                let n = ((space / row_bytes.max(1)) as i64).clamp(1, rows - r);
                let start = chunk.len();
                chunk.resize(start + n as usize * row_bytes, 0);
                flat.narrow(0, r, n)
                    .copy_data_u8(&mut chunk[start..], n as usize * row_numel);
                r += n;
                if chunk.len() >= packed_buffer_bytes {
                    broadcast(&mut self.conns, &mut macs, &chunk)?;
                    chunk.clear();
                }
            }
        }
        if !chunk.is_empty() {
            broadcast(&mut self.conns, &mut macs, &chunk)?;
        }
        self.chunk = chunk;
        for ((conn, _), mac) in self.conns.iter_mut().zip(macs) {
            conn.write_all(&mac.finalize().into_bytes())?;
        }
        Ok(())
    }

    /// Writes `bytes` to every engine as they are: no header, no tag. What a peer on the path
    /// that does not hold the run token could inject (the fuzz target of the weight stream).
    pub fn send_raw(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        for (conn, _) in &mut self.conns {
            conn.write_all(bytes)?;
        }
        Ok(())
    }
}

/// Sends `bytes` to every engine, each connection's tag taking them in.
fn broadcast(
    conns: &mut [(TcpStream, DataKey)],
    macs: &mut [Hmac<Sha256>],
    bytes: &[u8],
) -> std::io::Result<()> {
    for ((conn, _), mac) in conns.iter_mut().zip(macs) {
        mac.update(bytes);
        conn.write_all(bytes)?;
    }
    Ok(())
}

/// The engine's end: connects to the trainer, announces its rank, and checks the trainer's proof
/// of the run token before proving its own (each message within [`HANDSHAKE_TIMEOUT`]).
pub async fn connect(addr: &str, rank: u32) -> std::io::Result<WeightConnection> {
    connect_with(addr, rank, &run_token()).await
}

async fn connect_with(addr: &str, rank: u32, token: &str) -> std::io::Result<WeightConnection> {
    use tokio::io::AsyncWriteExt;
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    stream.set_nodelay(true)?;
    let engine_nonce: [u8; NONCE_BYTES] = rand::random();
    let mut hello = Vec::with_capacity(12 + NONCE_BYTES);
    hello.extend_from_slice(HELLO_MAGIC);
    hello.extend_from_slice(&rank.to_le_bytes());
    hello.extend_from_slice(&engine_nonce);
    stream.write_all(&hello).await?;
    let mut challenge = [0u8; 8 + NONCE_BYTES + 32];
    read_within(&mut stream, &mut challenge, HANDSHAKE_TIMEOUT).await?;
    let (magic, rest) = challenge.split_at(8);
    let (trainer_nonce, given) = rest.split_at(NONCE_BYTES);
    let expected = proof(token, TRAINER_ROLE, &engine_nonce, trainer_nonce, rank);
    if magic != CHALLENGE_MAGIC || !crate::auth::same_secret(given, &expected) {
        return Err(std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            "the weight stream's trainer did not prove the run's token",
        ));
    }
    let mine = proof(token, ENGINE_ROLE, &engine_nonce, trainer_nonce, rank);
    stream.write_all(&mine).await?;
    let key = DataKey::new(token, &engine_nonce, trainer_nonce, rank);
    Ok(WeightConnection { stream, key })
}

/// Fills `buf` from `stream`, failing when a read gets no bytes for `stall` or the stream ends.
async fn read_within(
    stream: &mut tokio::net::TcpStream,
    buf: &mut [u8],
    stall: Duration,
) -> std::io::Result<()> {
    let mut filled = 0;
    while filled < buf.len() {
        let n = tokio::time::timeout(stall, stream.read(&mut buf[filled..]))
            .await
            .map_err(|_| {
                std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!(
                        "the trainer sent nothing for {stall:?} ({filled} of {} bytes read)",
                        buf.len()
                    ),
                )
            })??;
        if n == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                format!(
                    "the weight stream ended after {filled} of {} bytes",
                    buf.len()
                ),
            ));
        }
        filled += n;
    }
    Ok(())
}

/// One staged weight: where its bytes lie in [`StagedUpdate`].
#[derive(Debug, Clone)]
struct Entry {
    name: String,
    shape: Vec<i64>,
    kind: Kind,
    offset: usize,
}

/// A bucket's tensors, checked against the model: (name, shape, dtype) in stream order.
#[derive(Debug)]
pub struct BucketLayout {
    entries: Vec<(String, Vec<i64>, Kind)>,
    total_bytes: usize,
}

fn byte_len(shape: &[i64], kind: Kind) -> usize {
    shape.iter().product::<i64>() as usize * kind.elt_size_in_bytes()
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
                return Err(format!(
                    "update_info.shapes: `{name}` has shape {expected:?} in this model, got {shape:?}"
                ));
            }
            let kind = parse_dtype(dtype).ok_or_else(|| {
                format!("update_info.dtype_names: `{dtype}` for `{name}` is not one of float32, bfloat16, float16")
            })?;
            total_bytes += byte_len(shape, kind);
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
}

/// Buckets received since `start_weight_update`, not yet applied.
#[derive(Debug, Default)]
pub struct StagedUpdate {
    bytes: Vec<u8>,
    entries: Vec<Entry>,
}

impl StagedUpdate {
    /// Empties the update, keeping the buffer for the next one.
    pub fn clear(&mut self) {
        self.bytes.clear();
        self.entries.clear();
    }

    /// Tensors staged so far.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Stages every tensor of the `*.safetensors` files in `dir` (a weight update from a folder,
    /// vLLM's `reload_weights`). Each tensor must be a weight of this model (`params`) with its
    /// shape, in float32, bfloat16 or float16; errors name the file and tensor.
    pub fn load_folder(
        &mut self,
        dir: &std::path::Path,
        params: &[(String, Vec<i64>)],
    ) -> Result<(), String> {
        use safetensors::{Dtype, SafeTensors};
        let mut files: Vec<_> = std::fs::read_dir(dir)
            .map_err(|e| format!("reading {}: {e}", dir.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect();
        files.sort();
        if files.is_empty() {
            return Err(format!("{} holds no .safetensors file", dir.display()));
        }
        let shapes: BTreeMap<&str, &Vec<i64>> =
            params.iter().map(|(n, s)| (n.as_str(), s)).collect();
        self.clear();
        for file in &files {
            let bytes =
                std::fs::read(file).map_err(|e| format!("reading {}: {e}", file.display()))?;
            let st = SafeTensors::deserialize(&bytes)
                .map_err(|e| format!("{}: not a safetensors file: {e}", file.display()))?;
            for (name, view) in st.tensors() {
                let Some(expected) = shapes.get(name.as_str()) else {
                    return Err(format!(
                        "{}: `{name}` is not a weight of this model",
                        file.display()
                    ));
                };
                let shape: Vec<i64> = view.shape().iter().map(|&d| d as i64).collect();
                if &&shape != expected {
                    return Err(format!(
                        "{}: `{name}` has shape {expected:?} in this model, got {shape:?}",
                        file.display()
                    ));
                }
                let kind = match view.dtype() {
                    Dtype::F32 => Kind::Float,
                    Dtype::BF16 => Kind::BFloat16,
                    Dtype::F16 => Kind::Half,
                    other => {
                        return Err(format!(
                        "{}: `{name}` is {other:?}; weights must be float32, bfloat16 or float16",
                        file.display()
                    ))
                    }
                };
                let offset = self.bytes.len();
                self.bytes.extend_from_slice(view.data());
                self.entries.push(Entry {
                    name,
                    shape,
                    kind,
                    offset,
                });
            }
        }
        Ok(())
    }

    /// Reads one bucket from the stream (header, payload, tag) and stages it once its tag holds;
    /// fails when the trainer sends nothing for [`STALL_TIMEOUT`].
    pub async fn receive(
        &mut self,
        layout: &BucketLayout,
        conn: &mut WeightConnection,
    ) -> Result<(), String> {
        self.receive_within(layout, conn, STALL_TIMEOUT).await
    }

    /// [`Self::receive`] with another stall timeout (tests).
    pub async fn receive_within(
        &mut self,
        layout: &BucketLayout,
        conn: &mut WeightConnection,
        stall: Duration,
    ) -> Result<(), String> {
        let WeightConnection { stream, key } = conn;
        let mut header = [0u8; 16];
        read_within(stream, &mut header, stall)
            .await
            .map_err(|e| format!("reading the bucket header: {e}"))?;
        if &header[..8] != BUCKET_MAGIC {
            return Err("the weight stream is out of sync (bad bucket magic)".into());
        }
        let len = u64::from_le_bytes(header[8..].try_into().expect("8 bytes")) as usize;
        if len != layout.total_bytes {
            return Err(format!(
                "the trainer sent {len} bytes but update_info describes {} bytes",
                layout.total_bytes
            ));
        }
        let start = self.bytes.len();
        self.bytes.resize(start + len + TAG_BYTES, 0);
        if let Err(e) = read_within(stream, &mut self.bytes[start..], stall).await {
            self.bytes.truncate(start);
            return Err(format!("reading {len} weight bytes and their tag: {e}"));
        }
        let bucket = key.next;
        let mut mac = key.bucket();
        mac.update(&header);
        mac.update(&self.bytes[start..start + len]);
        let tag_holds = mac.verify_slice(&self.bytes[start + len..]).is_ok();
        self.bytes.truncate(start + len);
        if !tag_holds {
            self.bytes.truncate(start);
            return Err(format!(
                "bucket {bucket} of the weight stream failed its HMAC: its bytes were changed on the way, or its sender does not hold the run token (docs/security.md)"
            ));
        }
        let mut offset = start;
        for (name, shape, kind) in &layout.entries {
            self.entries.push(Entry {
                name: name.clone(),
                shape: shape.clone(),
                kind: *kind,
                offset,
            });
            offset += byte_len(shape, *kind);
        }
        Ok(())
    }

    /// Copies every staged tensor into the model's weight of the same name (converting dtype and
    /// device), in row blocks of at most [`APPLY_CHUNK_BYTES`].
    pub fn apply(&self, params: &BTreeMap<String, Tensor>) -> Result<(), String> {
        self.apply_in_blocks(params, APPLY_CHUNK_BYTES)
    }

    fn apply_in_blocks(
        &self,
        params: &BTreeMap<String, Tensor>,
        block_bytes: usize,
    ) -> Result<(), String> {
        tch::no_grad(|| {
            for e in &self.entries {
                let param = params
                    .get(&e.name)
                    .ok_or_else(|| format!("unknown weight `{}`", e.name))?;
                let (rows, row_shape) = match e.shape.split_first() {
                    Some((&rows, rest)) => (rows, rest.to_vec()),
                    None => (1, Vec::new()),
                };
                let row_bytes = byte_len(&row_shape, e.kind);
                let block = ((block_bytes / row_bytes.max(1)) as i64).max(1);
                let flat = if e.shape.is_empty() {
                    param.reshape([1])
                } else {
                    param.shallow_clone()
                };
                let mut r = 0;
                while r < rows {
                    let n = block.min(rows - r);
                    let start = e.offset + r as usize * row_bytes;
                    let shape: Vec<i64> = std::iter::once(n)
                        .chain(row_shape.iter().copied())
                        .collect();
                    let src = Tensor::f_from_data_size(
                        &self.bytes[start..start + n as usize * row_bytes],
                        &shape,
                        e.kind,
                    )
                    .map_err(|err| format!("weight `{}`: {err}", e.name))?;
                    flat.narrow(0, r, n)
                        .f_copy_(&src)
                        .map_err(|err| format!("weight `{}`: {err}", e.name))?;
                    r += n;
                }
            }
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One engine (rank 1) connected to a trainer's listener on loopback.
    async fn plane() -> (WeightConnection, TcpWeightSender) {
        let listener = WeightListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let accept = std::thread::spawn(move || listener.accept(1).unwrap());
        let stream = connect(&addr, 1).await.unwrap();
        (stream, accept.join().unwrap())
    }

    /// Trainer → engine over loopback: bf16 and f32 tensors of several ranks, a flush size that
    /// splits rows across chunks, and copy blocks smaller than a tensor, land exactly.
    #[tokio::test]
    async fn libtorch_round_trip_through_the_tcp_plane() {
        tch::manual_seed(0);
        let params: BTreeMap<String, Tensor> = [
            (
                "a.weight",
                Tensor::zeros([7, 5], (Kind::Float, Device::Cpu)),
            ),
            (
                "b.experts",
                Tensor::zeros([3, 4, 2], (Kind::Float, Device::Cpu)),
            ),
            ("c.norm", Tensor::zeros([9], (Kind::BFloat16, Device::Cpu))),
        ]
        .into_iter()
        .map(|(n, t)| (n.to_string(), t))
        .collect();
        let sent = vec![
            (
                "a.weight".to_string(),
                Tensor::randn([7, 5], (Kind::Float, Device::Cpu)),
            ),
            (
                "b.experts".to_string(),
                Tensor::randn([3, 4, 2], (Kind::BFloat16, Device::Cpu)),
            ),
            (
                "c.norm".to_string(),
                Tensor::randn([9], (Kind::Float, Device::Cpu)),
            ),
        ];
        let shapes: Vec<(String, Vec<i64>)> =
            params.iter().map(|(n, t)| (n.clone(), t.size())).collect();
        let layout = BucketLayout::new(&update_info(&sent), &shapes).unwrap();
        assert_eq!(layout.total_bytes(), 7 * 5 * 4 + 3 * 4 * 2 * 2 + 9 * 4);

        let (mut stream, mut sender) = plane().await;
        let to_send: Vec<(String, Tensor)> = sent
            .iter()
            .map(|(n, t)| (n.clone(), t.shallow_clone()))
            .collect();
        let send = std::thread::spawn(move || sender.send_bucket(&to_send, 24).unwrap());
        let mut staged = StagedUpdate::default();
        staged.receive(&layout, &mut stream).await.unwrap();
        send.join().unwrap();
        assert_eq!(staged.len(), 3);
        staged.apply_in_blocks(&params, 16).unwrap();
        for (name, t) in &sent {
            let got = &params[name];
            assert_eq!(
                got.kind(),
                if name == "c.norm" {
                    Kind::BFloat16
                } else {
                    Kind::Float
                }
            );
            assert!(
                got.to_kind(Kind::Float).allclose(
                    &t.to_kind(got.kind()).to_kind(Kind::Float),
                    0.0,
                    0.0,
                    false
                ),
                "{name}"
            );
        }

        // A length that disagrees with update_info is caught, not misread.
        let wrong = BucketLayout::new(&update_info(&sent[..1]), &shapes).unwrap();
        let (mut stream, mut sender) = plane().await;
        let all: Vec<(String, Tensor)> = sent
            .iter()
            .map(|(n, t)| (n.clone(), t.shallow_clone()))
            .collect();
        std::thread::spawn(move || sender.send_bucket(&all, 1 << 20))
            .join()
            .unwrap()
            .unwrap();
        let err = StagedUpdate::default()
            .receive(&wrong, &mut stream)
            .await
            .unwrap_err();
        assert!(err.contains("update_info describes"), "{err}");
    }

    /// Each end proves the run token to the other: an engine with another token is refused by
    /// the trainer, and an engine refuses a trainer with another token before proving anything.
    #[tokio::test]
    async fn both_ends_of_the_weight_stream_prove_the_run_token() {
        let (engine, trainer) = ("engine-token", "trainer-token");
        for (engine_token, trainer_token, refused_by) in [
            (engine, engine, None),
            (engine, trainer, Some("trainer")),
            ("", trainer, Some("trainer")),
            (trainer, "", Some("trainer")),
        ] {
            let mut listener = WeightListener::bind("127.0.0.1:0").unwrap();
            listener.token = trainer_token.to_string();
            listener.handshake_timeout = Duration::from_secs(5);
            let addr = listener.local_addr().unwrap().to_string();
            let accept = std::thread::spawn(move || listener.accept(1));
            let engine_side = connect_with(&addr, 3, engine_token).await;
            // The engine checks the trainer first: with different tokens it refuses and closes,
            // so the trainer sees the stream end where the engine's proof would be.
            let trainer_side = accept.join().unwrap();
            match refused_by {
                None => {
                    engine_side.unwrap();
                    trainer_side.unwrap();
                }
                Some(_) => {
                    let err = engine_side.unwrap_err();
                    assert_eq!(err.kind(), std::io::ErrorKind::PermissionDenied, "{err}");
                    assert!(err.to_string().contains("trainer did not prove"), "{err}");
                    assert!(trainer_side.is_err());
                }
            }
        }

        // An engine that answers a proof made with another token is refused by the trainer.
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut listener = WeightListener::bind("127.0.0.1:0").unwrap();
        listener.token = trainer.to_string();
        let addr = listener.local_addr().unwrap().to_string();
        let accept = std::thread::spawn(move || listener.accept(1));
        let mut forger = tokio::net::TcpStream::connect(&addr).await.unwrap();
        let nonce = [7u8; NONCE_BYTES];
        let mut hello = HELLO_MAGIC.to_vec();
        hello.extend_from_slice(&0u32.to_le_bytes());
        hello.extend_from_slice(&nonce);
        forger.write_all(&hello).await.unwrap();
        let mut challenge = [0u8; 8 + NONCE_BYTES + 32];
        forger.read_exact(&mut challenge).await.unwrap();
        let forged = proof(
            engine,
            ENGINE_ROLE,
            &nonce,
            &challenge[8..8 + NONCE_BYTES],
            0,
        );
        forger.write_all(&forged).await.unwrap();
        let err = accept.join().unwrap().unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::PermissionDenied, "{err}");
        assert!(
            err.to_string().contains("did not prove the run's token"),
            "{err}"
        );
    }

    /// A peer that connects and says nothing, or a trainer that stops mid-bucket, fails the
    /// transfer within its timeout; the next connection works.
    #[tokio::test]
    async fn a_silent_peer_fails_the_transfer_within_its_timeout() {
        use tokio::io::AsyncWriteExt;
        let mut listener = WeightListener::bind("127.0.0.1:0").unwrap();
        listener.handshake_timeout = Duration::from_millis(200);
        let addr = listener.local_addr().unwrap().to_string();
        let accept = std::thread::spawn(move || listener.accept(1));
        let _silent = tokio::net::TcpStream::connect(&addr).await.unwrap();
        let err = accept.join().unwrap().unwrap_err();
        assert!(
            err.to_string()
                .contains("did not finish its handshake within"),
            "{err}"
        );

        // A peer that proves nothing (it sends a hello, then says nothing) fails it the same way.
        let mut listener = WeightListener::bind("127.0.0.1:0").unwrap();
        listener.handshake_timeout = Duration::from_millis(200);
        let addr = listener.local_addr().unwrap().to_string();
        let accept = std::thread::spawn(move || listener.accept(1));
        let mut mute = tokio::net::TcpStream::connect(&addr).await.unwrap();
        let mut hello = HELLO_MAGIC.to_vec();
        hello.extend_from_slice(&[0u8; 4 + NONCE_BYTES]);
        mute.write_all(&hello).await.unwrap();
        let err = accept.join().unwrap().unwrap_err();
        assert!(
            err.to_string()
                .contains("did not finish its handshake within"),
            "{err}"
        );

        // Nobody connects at all.
        let mut listener = WeightListener::bind("127.0.0.1:0").unwrap();
        listener.accept_timeout = Duration::from_millis(200);
        let err = listener.accept(2).unwrap_err();
        assert!(
            err.to_string().contains("0 of 2 engines connected"),
            "{err}"
        );

        // The trainer sends a header and stalls: the engine's read fails, and the next update
        // on a fresh stream goes through.
        let sent = vec![(
            "w".to_string(),
            Tensor::randn([4, 4], (Kind::Float, Device::Cpu)),
        )];
        let shapes = vec![("w".to_string(), vec![4, 4])];
        let layout = BucketLayout::new(&update_info(&sent), &shapes).unwrap();
        let (mut stream, mut sender) = plane().await;
        let mut header = BUCKET_MAGIC.to_vec();
        header.extend_from_slice(&(layout.total_bytes() as u64).to_le_bytes());
        header.extend_from_slice(&[0u8; 10]);
        sender.conns[0].0.write_all(&header).unwrap();
        let started = Instant::now();
        let mut staged = StagedUpdate::default();
        let err = staged
            .receive_within(&layout, &mut stream, Duration::from_millis(300))
            .await
            .unwrap_err();
        assert!(err.contains("sent nothing for"), "{err}");
        assert!(started.elapsed() < Duration::from_secs(10));
        assert_eq!(staged.len(), 0, "nothing half-staged");

        let (mut stream, mut sender) = plane().await;
        let to_send: Vec<(String, Tensor)> = sent
            .iter()
            .map(|(n, t)| (n.clone(), t.shallow_clone()))
            .collect();
        let send = std::thread::spawn(move || sender.send_bucket(&to_send, 1 << 20).unwrap());
        staged.receive(&layout, &mut stream).await.unwrap();
        send.join().unwrap();
        assert_eq!(staged.len(), 1);
        let _ = stream.stream.shutdown().await;
    }

    /// A bucket whose bytes changed on the way, one sent twice, and one tagged with a key made
    /// from another token all fail their HMAC and stage nothing; an untouched one is staged.
    #[tokio::test]
    async fn a_bucket_whose_tag_fails_stages_nothing() {
        use std::io::Read as _;
        let sent = vec![(
            "w".to_string(),
            Tensor::randn([8, 8], (Kind::Float, Device::Cpu)),
        )];
        let shapes = vec![("w".to_string(), vec![8, 8])];
        let layout = BucketLayout::new(&update_info(&sent), &shapes).unwrap();
        // What the trainer sends for one bucket, captured from a real sender over a socket pair.
        let bucket_bytes = |sender: &mut TcpWeightSender| {
            let (a, mut b) = {
                let l = TcpListener::bind("127.0.0.1:0").unwrap();
                let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
                (a, l.accept().unwrap().0)
            };
            let real = std::mem::replace(&mut sender.conns[0].0, a);
            let to_send = vec![("w".to_string(), sent[0].1.shallow_clone())];
            sender.send_bucket(&to_send, 100).unwrap();
            drop(std::mem::replace(&mut sender.conns[0].0, real));
            let mut bytes = Vec::new();
            b.read_to_end(&mut bytes).unwrap();
            bytes
        };
        let stall = Duration::from_secs(5);
        let (mut conn, mut sender) = plane().await;
        let first = bucket_bytes(&mut sender);
        assert_eq!(first.len(), 16 + 8 * 8 * 4 + TAG_BYTES);
        for spoil in [20, first.len() - 1] {
            let mut spoilt = first.clone();
            spoilt[spoil] ^= 1;
            let (mut conn, mut sender) = plane().await;
            sender.conns[0].0.write_all(&spoilt).unwrap();
            let mut staged = StagedUpdate::default();
            let err = staged
                .receive_within(&layout, &mut conn, stall)
                .await
                .unwrap_err();
            assert!(
                err.contains("bucket 0 of the weight stream failed its HMAC"),
                "{err}"
            );
            assert!(
                staged.is_empty() && staged.bytes.is_empty(),
                "nothing staged"
            );
        }
        // The untouched bucket is staged; the same bytes again (a replay) are not.
        let mut staged = StagedUpdate::default();
        sender.conns[0].0.write_all(&first).unwrap();
        staged
            .receive_within(&layout, &mut conn, stall)
            .await
            .unwrap();
        sender.conns[0].0.write_all(&first).unwrap();
        let err = staged
            .receive_within(&layout, &mut conn, stall)
            .await
            .unwrap_err();
        assert!(
            err.contains("bucket 1 of the weight stream failed its HMAC"),
            "{err}"
        );
        assert_eq!(staged.len(), 1, "the replayed bucket added nothing");

        // A sender whose key comes from another token (it saw the handshake, not the token).
        let (mut conn, mut sender) = plane().await;
        sender.conns[0].1.key = proof("another token", DATA_ROLE, &[0; 32], &[0; 32], 1);
        let forged = bucket_bytes(&mut sender);
        sender.conns[0].0.write_all(&forged).unwrap();
        let err = StagedUpdate::default()
            .receive_within(&layout, &mut conn, stall)
            .await
            .unwrap_err();
        assert!(err.contains("failed its HMAC"), "{err}");
    }
}
