//! The messages and plans of the NCCL weight-sync data plane to vLLM engines (docs/engine.md), pure
//! and tested without GPUs. The trainer is rank 0 of one NCCL communicator with every engine's
//! ranks; it mints the unique id and hands it to each engine in `init_info`.
//!
//! What this module owns, and the vLLM code it matches (read in vllm-project/vllm,
//! `vllm/distributed/weight_transfer/{nccl_common,nccl_engine,packed_tensor,base}.py` and
//! `vllm/entrypoints/serve/dev/rlhf/api_router.py`; see `docs/weight-sync.md`):
//! - [`UniqueId`]: the 128 raw bytes of `ncclGetUniqueId`, sent as `nccl_unique_id_b64`, standard
//!   (RFC 4648, padded, not URL-safe) base64, exactly as vLLM's `decode_nccl_unique_id` checks;
//! - [`NcclInitInfo`]: the `init_info` of `POST /init_weight_transfer_engine`, one per engine
//!   ([`init_infos`]): engine `i` gets `rank_offset = 1 + Σ world_size(j < i)` (vLLM ranks each of
//!   its workers `dp_rank * tp * pp + rank + rank_offset`, `GET /get_world_size` being tp·pp·dp),
//!   and `world_size` counts the trainer and every engine rank. vLLM takes exactly
//!   one rendezvous (the unique id *or* `master_address`/`master_port`), and the packed-broadcast
//!   wire parameters (`packed`, `packed_buffer_size_bytes`, `packed_num_buffers`) travel here,
//!   once, not per update;
//! - [`BucketPlan`]: one `POST /update_weights` bucket: its `update_info` (names, dtype_names,
//!   shapes only: vLLM builds its update dataclass with `**update_info` and refuses unknown keys)
//!   and the chunks of its packed broadcast. Tensors' raw bytes are concatenated in `names` order;
//!   whole tensors are packed until the running total *exceeds* `packed_buffer_size_bytes`, then
//!   that chunk is broadcast (vLLM's `pack_tensors` / `packed_nccl_broadcast_consumer`). The
//!   receiver sizes each `ncclBroadcast` from this rule, so the sender must cut identically;
//! - [`finish_body`]: `POST /finish_weight_update` takes `weight_version` as a string in vLLM.

use std::fmt;
use std::ops::Range;
use std::time::Duration;

use base64::Engine as _;
use serde::Serialize;
use tch::Kind;

use crate::engine::api::UpdateInfo;

/// `NCCL_UNIQUE_ID_BYTES` of `nccl.h`.
pub const NCCL_UNIQUE_ID_BYTES: usize = 128;

/// vLLM's `DEFAULT_PACKED_BUFFER_SIZE_BYTES` (1 GiB).
pub const VLLM_PACKED_BUFFER_BYTES: u64 = 1 << 30;

/// vLLM's `DEFAULT_PACKED_NUM_BUFFERS`: how many chunks the engine keeps in flight on rotating
/// streams. It changes no byte on the wire, only the engine's memory (`buffer × num_buffers`).
pub const VLLM_PACKED_NUM_BUFFERS: u32 = 2;

/// The step of the data plane an error happened in: an engine call, named by its request line
/// (which is also what is sent), or the trainer's NCCL work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Step(pub &'static str);

impl Step {
    pub const GET_WORLD_SIZE: Step = Step("GET /get_world_size");
    pub const INIT_TRANSFER: Step = Step("POST /init_weight_transfer_engine");
    pub const START_UPDATE: Step = Step("POST /start_weight_update");
    pub const UPDATE_WEIGHTS: Step = Step("POST /update_weights");
    pub const FINISH_UPDATE: Step = Step("POST /finish_weight_update");
    pub const COMM_INIT: Step = Step("ncclCommInitRank");
    pub const WARM_UP: Step = Step("the warm-up all_reduce");
    pub const BROADCAST: Step = Step("the packed broadcast");
}

impl fmt::Display for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.0)
    }
}

/// Errors of the NCCL weight-sync data plane; each names the engine and the step.
#[derive(Debug, thiserror::Error)]
pub enum NcclSyncError {
    #[error("init_info.nccl_unique_id_b64: {0}")]
    UniqueId(String),
    /// Bad configuration or input (engine list, world sizes, buffer size, dtype).
    #[error("{0}")]
    Invalid(String),
    #[error("tensor `{name}`: {message}")]
    Tensor { name: String, message: String },
    /// The engine answered with an error, or could not be reached.
    #[error("engine {url}, {step}: {message}")]
    Engine {
        url: String,
        step: Step,
        message: String,
    },
    #[error("engine {url}, {step}: no answer within {timeout:?}")]
    EngineTimeout {
        url: String,
        step: Step,
        timeout: Duration,
    },
    /// NCCL or CUDA failed on the trainer's side.
    #[error("{step}: {message}")]
    Nccl { step: Step, message: String },
    /// A collective did not complete in time; the communicator was aborted.
    #[error("{step} did not complete within {timeout:?} (engines: {engines}); the communicator was aborted")]
    CommTimeout {
        step: Step,
        timeout: Duration,
        engines: String,
    },
    /// An earlier failure (or a cancelled call) aborted the communicator.
    #[error("the NCCL communicator was aborted earlier ({0}); connect a new sender")]
    Broken(String),
}

/// The NCCL data plane's results: an [`NcclSyncError`] unless said otherwise.
pub type Result<T, E = NcclSyncError> = std::result::Result<T, E>;

impl NcclSyncError {
    /// NCCL or CUDA failed at `step`.
    pub fn nccl(step: Step, message: impl Into<String>) -> Self {
        Self::Nccl {
            step,
            message: message.into(),
        }
    }
}

/// The 128 bytes of an `ncclUniqueId`.
#[derive(Clone, PartialEq, Eq)]
pub struct UniqueId(pub [u8; NCCL_UNIQUE_ID_BYTES]);

impl fmt::Debug for UniqueId {
    /// Redacted: anyone holding the id can join the communicator (vLLM hides it from `repr`).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("UniqueId(..)")
    }
}

impl Serialize for UniqueId {
    /// As `nccl_unique_id_b64`.
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_b64())
    }
}

impl UniqueId {
    /// Standard base64 with padding (Python's `base64.b64encode`).
    pub fn to_b64(&self) -> String {
        base64::engine::general_purpose::STANDARD.encode(self.0)
    }

    /// Decodes `nccl_unique_id_b64` as vLLM does (`b64decode(validate=True)`, 128 bytes).
    pub fn from_b64(b64: &str) -> Result<Self> {
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(b64)
            .map_err(|e| {
                NcclSyncError::UniqueId(format!(
                    "not valid standard base64 (URL-safe base64 is not accepted): {e}"
                ))
            })?;
        let len = bytes.len();
        let bytes: [u8; NCCL_UNIQUE_ID_BYTES] = bytes.try_into().map_err(|_| {
            NcclSyncError::UniqueId(format!(
                "must decode to {NCCL_UNIQUE_ID_BYTES} bytes, got {len}"
            ))
        })?;
        Ok(Self(bytes))
    }
}

/// The packed-broadcast parameters both sides must agree on (sent once, in `init_info`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PackedWire {
    /// A chunk is broadcast once its bytes exceed this.
    pub buffer_size_bytes: u64,
    /// Chunks the engine keeps in flight (its memory, not the byte stream).
    pub num_buffers: u32,
}

impl Default for PackedWire {
    fn default() -> Self {
        Self {
            buffer_size_bytes: VLLM_PACKED_BUFFER_BYTES,
            num_buffers: VLLM_PACKED_NUM_BUFFERS,
        }
    }
}

impl PackedWire {
    pub fn validate(&self) -> Result<()> {
        let sizes = [
            ("packed_buffer_size_bytes", self.buffer_size_bytes),
            ("packed_num_buffers", self.num_buffers.into()),
        ];
        match sizes.iter().find(|(_, size)| *size == 0) {
            Some((field, _)) => Err(NcclSyncError::Invalid(format!(
                "{field} must be at least 1"
            ))),
            None => Ok(()),
        }
    }
}

/// `init_info` of `POST /init_weight_transfer_engine` for one engine (vLLM's
/// `NCCLWeightTransferInitInfo` in its unique-id rendezvous mode). Its `Debug` hides the id.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct NcclInitInfo {
    pub nccl_unique_id_b64: UniqueId,
    pub rank_offset: u32,
    pub world_size: u32,
    pub packed: bool,
    pub packed_buffer_size_bytes: u64,
    pub packed_num_buffers: u32,
}

/// One `init_info` per engine, in order, `engine_world_sizes[i]` being engine `i`'s
/// `GET /get_world_size`: the trainer is rank 0, and each engine's ranks follow the earlier
/// engines'.
pub fn init_infos(
    id: &UniqueId,
    engine_world_sizes: &[u32],
    wire: PackedWire,
) -> Result<Vec<NcclInitInfo>> {
    if engine_world_sizes.is_empty() {
        let why = "the NCCL weight transfer needs at least one engine";
        return Err(NcclSyncError::Invalid(why.into()));
    }
    let mut rank_offsets = Vec::with_capacity(engine_world_sizes.len());
    let mut next: u32 = 1;
    for (i, &size) in engine_world_sizes.iter().enumerate() {
        if size == 0 {
            let why = format!("engine {i} reports world_size 0; it must be at least 1");
            return Err(NcclSyncError::Invalid(why));
        }
        rank_offsets.push(next);
        next = next
            .checked_add(size)
            .filter(|&n| n <= i32::MAX as u32)
            .ok_or_else(|| {
                NcclSyncError::Invalid(format!(
                    "the engines' world sizes {engine_world_sizes:?} add up to more ranks than NCCL takes (i32)"
                ))
            })?;
    }
    let info = |rank_offset| NcclInitInfo {
        nccl_unique_id_b64: id.clone(),
        rank_offset,
        world_size: next,
        packed: true,
        packed_buffer_size_bytes: wire.buffer_size_bytes,
        packed_num_buffers: wire.num_buffers,
    };
    Ok(rank_offsets.into_iter().map(info).collect())
}

/// The dtypes a checkpoint holds, as vLLM names them (`getattr(torch, name)`).
pub const DTYPES: [(Kind, &str); 12] = [
    (Kind::Float, "float32"),
    (Kind::BFloat16, "bfloat16"),
    (Kind::Half, "float16"),
    (Kind::Double, "float64"),
    (Kind::Int64, "int64"),
    (Kind::Int, "int32"),
    (Kind::Int16, "int16"),
    (Kind::Int8, "int8"),
    (Kind::Uint8, "uint8"),
    (Kind::Bool, "bool"),
    (Kind::Float8e4m3fn, "float8_e4m3fn"),
    (Kind::Float8e5m2, "float8_e5m2"),
];

/// One tensor of a bucket as the engine is told about it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorMeta {
    pub name: String,
    pub dtype: String,
    pub shape: Vec<i64>,
}

impl TensorMeta {
    /// Its raw bytes: elements × dtype size.
    pub fn byte_len(&self) -> Result<usize> {
        let bad = |message: String| NcclSyncError::Tensor {
            name: self.name.clone(),
            message,
        };
        let size = DTYPES
            .iter()
            .find(|(_, name)| *name == self.dtype)
            .map(|(kind, _)| kind.elt_size_in_bytes())
            .ok_or_else(|| {
                let names: Vec<&str> = DTYPES.iter().map(|(_, name)| *name).collect();
                bad(format!(
                    "dtype `{}` is not one of {}",
                    self.dtype,
                    names.join(", ")
                ))
            })?;
        let overflows = || bad(format!("shape {:?} overflows", self.shape));
        let elements = self.shape.iter().try_fold(1usize, |n, &d| {
            let d = usize::try_from(d)
                .map_err(|_| bad(format!("shape {:?} has a negative dimension", self.shape)))?;
            n.checked_mul(d).ok_or_else(overflows)
        })?;
        elements.checked_mul(size).ok_or_else(overflows)
    }
}

/// One `ncclBroadcast` of a packed bucket: tensors `tensors` (indices into the bucket), whose
/// bytes are `bytes` of the bucket's concatenated stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chunk {
    pub tensors: Range<usize>,
    pub bytes: Range<usize>,
}

/// Cuts a bucket of tensors of `byte_lens` into broadcasts as vLLM's packed consumer does: whole
/// tensors accumulate until the total exceeds `buffer_size_bytes` (strictly), that chunk is
/// flushed, and whatever remains at the end is the last chunk. A tensor larger than the buffer
/// is never split.
pub fn plan_chunks(byte_lens: &[usize], buffer_size_bytes: u64) -> Vec<Chunk> {
    let limit = usize::try_from(buffer_size_bytes).unwrap_or(usize::MAX);
    let mut chunks = Vec::new();
    let (mut first, mut start, mut end) = (0, 0, 0);
    for (i, &len) in byte_lens.iter().enumerate() {
        end += len;
        if end - start > limit {
            chunks.push(Chunk {
                tensors: first..i + 1,
                bytes: start..end,
            });
            first = i + 1;
            start = end;
        }
    }
    if first < byte_lens.len() {
        chunks.push(Chunk {
            tensors: first..byte_lens.len(),
            bytes: start..end,
        });
    }
    chunks
}

/// One `POST /update_weights` bucket: what the engine is told and how the bytes are cut.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BucketPlan {
    pub tensors: Vec<TensorMeta>,
    /// Each tensor's byte range in the bucket's concatenated stream.
    pub offsets: Vec<Range<usize>>,
    pub chunks: Vec<Chunk>,
}

impl BucketPlan {
    pub fn new(tensors: Vec<TensorMeta>, wire: PackedWire) -> Result<Self> {
        wire.validate()?;
        if tensors.is_empty() {
            let why = "an update_weights bucket needs at least one tensor";
            return Err(NcclSyncError::Invalid(why.into()));
        }
        let lens = tensors
            .iter()
            .map(TensorMeta::byte_len)
            .collect::<Result<Vec<_>, _>>()?;
        let mut offsets = Vec::with_capacity(lens.len());
        let mut at: usize = 0;
        for (t, &len) in tensors.iter().zip(&lens) {
            // Each tensor's length fits, their sum may not (found by fuzzing: it overflowed).
            let end = at.checked_add(len).ok_or_else(|| NcclSyncError::Tensor {
                name: t.name.clone(),
                message: format!(
                    "the bucket's tensors up to this one exceed {} bytes",
                    usize::MAX
                ),
            })?;
            offsets.push(at..end);
            at = end;
        }
        Ok(Self {
            chunks: plan_chunks(&lens, wire.buffer_size_bytes),
            tensors,
            offsets,
        })
    }

    pub fn total_bytes(&self) -> usize {
        self.offsets.last().map_or(0, |r| r.end)
    }

    /// `update_info` of `POST /update_weights`: names, dtype_names and shapes, nothing else.
    pub fn update_info(&self) -> UpdateInfo {
        UpdateInfo {
            names: self.tensors.iter().map(|t| t.name.clone()).collect(),
            dtype_names: self.tensors.iter().map(|t| t.dtype.clone()).collect(),
            shapes: self.tensors.iter().map(|t| t.shape.clone()).collect(),
            packed: None,
        }
    }
}

/// The body of `POST /finish_weight_update`. vLLM declares `weight_version: str | None`
/// (pydantic refuses a JSON number there), so the version travels as a decimal string.
pub fn finish_body(weight_version: u64) -> serde_json::Value {
    serde_json::json!({ "weight_version": weight_version.to_string() })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id() -> UniqueId {
        let mut bytes = [0u8; NCCL_UNIQUE_ID_BYTES];
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = (i * 37 + 250) as u8;
        }
        UniqueId(bytes)
    }

    #[test]
    fn unique_id_is_standard_padded_base64_of_128_bytes() {
        let id = id();
        let b64 = id.to_b64();
        // 128 bytes → 172 characters with one `=` of padding, as Python's b64encode writes it.
        assert_eq!(b64.len(), 172);
        assert!(b64.ends_with('=') && !b64.ends_with("=="));
        assert_eq!(UniqueId::from_b64(&b64).unwrap(), id);
        // Bytes ≥ 0xf8 encode to `+`/`/` in standard base64; URL-safe `-`/`_` are refused.
        assert!(b64.contains('+') || b64.contains('/'), "{b64}");
        let url_safe = b64.replace('+', "-").replace('/', "_");
        let err = UniqueId::from_b64(&url_safe).unwrap_err().to_string();
        assert!(err.contains("URL-safe base64 is not accepted"), "{err}");
        // vLLM's own fixture: 128 zero bytes.
        let zeros = "A".repeat(171) + "=";
        assert_eq!(UniqueId::from_b64(&zeros).unwrap().0, [0; 128]);
    }

    #[test]
    fn unique_id_of_the_wrong_length_or_alphabet_is_refused() {
        let short = base64::engine::general_purpose::STANDARD.encode([0u8; 64]);
        let err = UniqueId::from_b64(&short).unwrap_err().to_string();
        assert!(err.contains("must decode to 128 bytes, got 64"), "{err}");
        let long = base64::engine::general_purpose::STANDARD.encode([0u8; 129]);
        assert!(UniqueId::from_b64(&long).is_err());
        assert!(UniqueId::from_b64("!!!!").is_err());
        let unpadded = id().to_b64().trim_end_matches('=').to_string();
        assert!(UniqueId::from_b64(&unpadded).is_err());
        assert!(format!("{:?}", id()) == "UniqueId(..)");
    }

    #[test]
    fn rank_offsets_follow_earlier_engines_world_sizes() {
        // A tp=2 engine, a tp=1 engine, a tp=4 (or tp·dp) engine.
        let infos = init_infos(&id(), &[2, 1, 4], PackedWire::default()).unwrap();
        assert!(infos.iter().all(|i| i.world_size == 8));
        assert_eq!(
            infos.iter().map(|i| i.rank_offset).collect::<Vec<_>>(),
            [1, 3, 4]
        );
        let single = &init_infos(&id(), &[1], PackedWire::default()).unwrap()[0];
        assert_eq!((single.rank_offset, single.world_size), (1, 2));
    }

    #[test]
    fn bad_layouts_are_refused_with_the_engine() {
        let layout = |sizes: &[u32]| init_infos(&id(), sizes, PackedWire::default());
        assert!(layout(&[]).is_err());
        let err = layout(&[1, 0]).unwrap_err().to_string();
        assert!(err.contains("engine 1 reports world_size 0"), "{err}");
        assert!(layout(&[u32::MAX]).is_err());
        assert!(layout(&[i32::MAX as u32 - 1]).is_ok());
        assert!(layout(&[i32::MAX as u32]).is_err());
    }

    #[test]
    fn init_info_json_is_vllms_unique_id_mode() {
        let wire = PackedWire {
            buffer_size_bytes: 1 << 20,
            num_buffers: 2,
        };
        let infos = init_infos(&id(), &[2, 1], wire).unwrap();
        let json: Vec<serde_json::Value> = infos
            .iter()
            .map(|i| serde_json::to_value(i).unwrap())
            .collect();
        assert_eq!(
            json[1],
            serde_json::json!({
                "nccl_unique_id_b64": id().to_b64(),
                "rank_offset": 3,
                "world_size": 4,
                "packed": true,
                "packed_buffer_size_bytes": 1048576,
                "packed_num_buffers": 2,
            })
        );
        assert_eq!(json[0]["rank_offset"], 1);
        // Exactly one rendezvous: vLLM refuses the unique id together with master_address/port.
        assert!(json[0].get("master_address").is_none() && json[0].get("master_port").is_none());
        assert!(!format!("{:?}", infos[0]).contains(&id().to_b64()));
    }

    #[test]
    fn chunks_flush_after_the_tensor_that_exceeds_the_buffer() {
        // Buffer 10: [4, 4] = 8 ≤ 10 continues; + 4 = 12 > 10 flushes; [6] stays; + 5 = 11 flushes.
        assert_eq!(
            plan_chunks(&[4, 4, 4, 6, 5, 3], 10),
            vec![
                Chunk {
                    tensors: 0..3,
                    bytes: 0..12
                },
                Chunk {
                    tensors: 3..5,
                    bytes: 12..23
                },
                Chunk {
                    tensors: 5..6,
                    bytes: 23..26
                },
            ]
        );
        // Exactly the buffer size does not flush (vLLM compares with `>`).
        assert_eq!(
            plan_chunks(&[5, 5, 1], 10),
            vec![Chunk {
                tensors: 0..3,
                bytes: 0..11
            }]
        );
        // A tensor larger than the buffer is one chunk of its own, never split.
        assert_eq!(
            plan_chunks(&[100, 1], 10),
            vec![
                Chunk {
                    tensors: 0..1,
                    bytes: 0..100
                },
                Chunk {
                    tensors: 1..2,
                    bytes: 100..101
                },
            ]
        );
        assert_eq!(plan_chunks(&[], 10), vec![]);
    }

    /// A straightforward transcription of vLLM's consumer loop (iterate, append, break on `>`,
    /// flush the rest) as the reference for many random buckets.
    #[test]
    fn chunks_match_a_reference_of_vllms_consumer() {
        fn reference(sizes: &[usize], buffer: usize) -> Vec<Vec<usize>> {
            let mut it = sizes.iter().enumerate();
            let mut out = Vec::new();
            loop {
                let mut current = Vec::new();
                let mut total = 0;
                let mut exhausted = true;
                for (i, &s) in it.by_ref() {
                    current.push(i);
                    total += s;
                    if total > buffer {
                        exhausted = false;
                        break;
                    }
                }
                if !current.is_empty() {
                    out.push(current);
                }
                if exhausted {
                    return out;
                }
            }
        }
        let mut seed = 0x9e3779b97f4a7c15u64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for _ in 0..500 {
            let n = (next() % 12) as usize;
            let sizes: Vec<usize> = (0..n).map(|_| (next() % 40) as usize).collect();
            let buffer = (next() % 50 + 1) as usize;
            let got: Vec<Vec<usize>> = plan_chunks(&sizes, buffer as u64)
                .into_iter()
                .map(|c| c.tensors.collect())
                .collect();
            assert_eq!(got, reference(&sizes, buffer), "{sizes:?} / {buffer}");
        }
    }

    #[test]
    fn bucket_plan_offsets_update_info_and_byte_lengths() {
        let metas = vec![
            TensorMeta {
                name: "model.embed_tokens.weight".into(),
                dtype: "bfloat16".into(),
                shape: vec![16, 8],
            },
            TensorMeta {
                name: "model.norm.weight".into(),
                dtype: "float32".into(),
                shape: vec![8],
            },
            TensorMeta {
                name: "scalar".into(),
                dtype: "float32".into(),
                shape: vec![],
            },
        ];
        let wire = PackedWire {
            buffer_size_bytes: 100,
            num_buffers: 2,
        };
        let plan = BucketPlan::new(metas, wire).unwrap();
        assert_eq!(plan.offsets, vec![0..256, 256..288, 288..292]);
        assert_eq!(plan.total_bytes(), 292);
        assert_eq!(plan.chunks.len(), 2);
        assert_eq!(
            plan.chunks
                .iter()
                .map(|c| c.bytes.len())
                .collect::<Vec<_>>(),
            [256, 36]
        );
        let json = serde_json::to_value(plan.update_info()).unwrap();
        assert_eq!(
            json,
            serde_json::json!({
                "names": ["model.embed_tokens.weight", "model.norm.weight", "scalar"],
                "dtype_names": ["bfloat16", "float32", "float32"],
                "shapes": [[16, 8], [8], []],
            })
        );
    }

    #[test]
    fn bad_buckets_name_the_tensor() {
        let wire = PackedWire::default();
        let meta = |dtype: &str, shape: Vec<i64>| TensorMeta {
            name: "w".into(),
            dtype: dtype.into(),
            shape,
        };
        let err = BucketPlan::new(vec![meta("complex64", vec![2])], wire)
            .unwrap_err()
            .to_string();
        assert!(err.contains("tensor `w`: dtype `complex64`"), "{err}");
        let err = BucketPlan::new(vec![meta("float32", vec![2, -1])], wire)
            .unwrap_err()
            .to_string();
        assert!(err.contains("negative dimension"), "{err}");
        assert!(BucketPlan::new(vec![], wire).is_err());
        // Found by fuzzing: tensors whose byte lengths each fit but whose sum does not.
        let err = BucketPlan::new(
            vec![meta("int8", vec![5]), meta("bfloat16", vec![i64::MAX])],
            wire,
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("tensor `w`: the bucket's tensors"), "{err}");
        let zero = PackedWire {
            buffer_size_bytes: 0,
            num_buffers: 2,
        };
        assert!(BucketPlan::new(vec![meta("float32", vec![1])], zero).is_err());
    }

    #[test]
    fn finish_sends_the_version_as_a_string() {
        assert_eq!(finish_body(7), serde_json::json!({ "weight_version": "7" }));
    }

    #[test]
    fn steps_read_as_endpoints() {
        let err = NcclSyncError::Engine {
            url: "http://e0:8000".into(),
            step: Step::UPDATE_WEIGHTS,
            message: "boom".into(),
        };
        assert_eq!(
            err.to_string(),
            "engine http://e0:8000, POST /update_weights: boom"
        );
    }
}
