//! The weight stream and its bucket layouts. Any bytes a peer without the run token sends in the
//! handshake (as an engine's hello and proof, or as a trainer's challenge) are refused, never a
//! panic; any bytes injected after the handshake (a bucket without its tag, spoilt, cut short,
//! or noise) are refused and stage nothing;
//! any `update_info` is refused with its entry named or laid out in bytes that add up; NCCL
//! bucket plans never overflow and their chunks tile the bucket; and tensors of any shape and
//! dtype sent over the TCP plane, at any flush size, land bit for bit.

use std::collections::BTreeMap;
use std::io::Write;
use std::time::Duration;

use proptest::prelude::*;
use tch::{Device, Kind, Tensor};

use crate::{drive, Budget, Row};
use moult_runtime::engine::api::UpdateInfo;
use moult_runtime::engine::weights::{
    connect, update_info, BucketLayout, StagedUpdate, WeightListener, BUCKET_MAGIC,
    CHALLENGE_MAGIC, HELLO_MAGIC,
};
use moult_runtime::weight_sync::nccl_handshake::{BucketPlan, PackedWire, TensorMeta};

const SHORT: Duration = Duration::from_millis(500);

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// The model of these cases: names and shapes (a scalar and an empty tensor among them).
fn params() -> Vec<(String, Vec<i64>)> {
    vec![
        ("a.weight".into(), vec![3, 2]),
        ("b.scalar".into(), vec![]),
        ("c.empty".into(), vec![0, 4]),
        ("d.norm".into(), vec![5]),
        ("e.experts".into(), vec![2, 1, 3]),
    ]
}

fn kind(i: u8) -> Kind {
    [Kind::Float, Kind::BFloat16, Kind::Half][i as usize % 3]
}

#[derive(Debug, Clone)]
enum Case {
    /// An arbitrary `update_info` against the model.
    Layout(UpdateInfo),
    /// NCCL bucket plans of arbitrary metadata and buffer sizes.
    Plan(Vec<TensorMeta>, u64),
    /// A trainer that sends these bytes as one bucket for a layout of these tensors, then hangs up.
    Bucket(Vec<(usize, u8)>, Vec<u8>),
    /// A would-be engine whose hello (and proof) is these bytes.
    Hello(Vec<u8>),
    /// A would-be trainer whose challenge (nonce and proof) is these bytes.
    Challenge(Vec<u8>),
    /// Tensors (index into the model, dtype, seed) sent at this flush size.
    RoundTrip(Vec<(usize, u8)>, usize),
}

fn names() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => (0..5usize).prop_map(|i| params()[i].0.clone()),
        1 => "[a-z.]{0,10}",
    ]
}

fn shape() -> impl Strategy<Value = Vec<i64>> {
    prop_oneof![
        4 => (0..5usize).prop_map(|i| params()[i].1.clone()),
        1 => prop::collection::vec(
            prop_oneof![-2i64..6, Just(i64::MAX), Just(i64::MIN), Just(1 << 40)],
            0..4
        ),
    ]
}

fn dtype() -> impl Strategy<Value = String> {
    prop::sample::select(vec![
        "float32",
        "bfloat16",
        "float16",
        "torch.float32",
        "half",
        "int8",
        "float64",
        "bool",
        "float8_e4m3fn",
        "",
        "FLOAT32",
    ])
    .prop_map(str::to_string)
}

fn layout() -> impl Strategy<Value = Case> {
    (
        prop::collection::vec(names(), 0..6),
        prop::collection::vec(dtype(), 0..6),
        prop::collection::vec(shape(), 0..6),
        any::<bool>(),
    )
        .prop_map(|(mut names, mut dtype_names, mut shapes, same_len)| {
            if same_len {
                let n = names.len().min(dtype_names.len()).min(shapes.len());
                names.truncate(n);
                dtype_names.truncate(n);
                shapes.truncate(n);
            }
            Case::Layout(UpdateInfo {
                names,
                dtype_names,
                shapes,
                packed: None,
            })
        })
}

fn plan() -> impl Strategy<Value = Case> {
    let meta = (names(), dtype(), shape()).prop_map(|(name, dtype, shape)| TensorMeta {
        name,
        dtype,
        shape,
    });
    (
        prop::collection::vec(meta, 0..8),
        prop_oneof![0u64..64, Just(u64::MAX), Just(1 << 30)],
    )
        .prop_map(|(m, b)| Case::Plan(m, b))
}

/// A bucket: a well-formed stream for the layout with a few bytes changed, cut short, or
/// arbitrary bytes.
fn bucket() -> impl Strategy<Value = Case> {
    (
        prop::collection::vec((0..5usize, any::<u8>()), 1..4),
        prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..3),
        prop_oneof![Just(None), any::<prop::sample::Index>().prop_map(Some)],
        any::<bool>(),
        prop::collection::vec(any::<u8>(), 0..40),
    )
        .prop_map(|(tensors, edits, cut, random, noise)| {
            let total = total_bytes(&tensors);
            let mut bytes = if random {
                noise
            } else {
                let mut b = BUCKET_MAGIC.to_vec();
                b.extend_from_slice(&(total as u64).to_le_bytes());
                b.extend((0..total).map(|i| (i * 7) as u8));
                b
            };
            for (at, v) in edits {
                if !bytes.is_empty() {
                    let i = at.index(bytes.len());
                    bytes[i] = v;
                }
            }
            if let Some(cut) = cut {
                bytes.truncate(cut.index(bytes.len() + 1));
            }
            Case::Bucket(tensors, bytes)
        })
}

/// Handshake bytes: the right magic, a rank and a nonce, then a made-up proof, with a few bytes
/// changed or cut short; or noise.
fn handshake(magic: &'static [u8; 8], len: usize) -> impl Strategy<Value = Vec<u8>> {
    (
        prop::collection::vec(any::<u8>(), len..=len),
        prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..3),
        prop_oneof![Just(None), any::<prop::sample::Index>().prop_map(Some)],
        prop::option::of(prop::collection::vec(any::<u8>(), 0..80)),
    )
        .prop_map(move |(body, edits, cut, noise)| {
            let mut b = noise.unwrap_or_else(|| {
                let mut b = magic.to_vec();
                b.extend(body);
                b
            });
            for (at, v) in edits {
                if !b.is_empty() {
                    let i = at.index(b.len());
                    b[i] = v;
                }
            }
            if let Some(cut) = cut {
                b.truncate(cut.index(b.len() + 1));
            }
            b
        })
}

fn hello() -> impl Strategy<Value = Case> {
    // Rank, nonce, then the engine's proof.
    handshake(HELLO_MAGIC, 4 + 32 + 32).prop_map(Case::Hello)
}

fn challenge() -> impl Strategy<Value = Case> {
    // Nonce and the trainer's proof.
    handshake(CHALLENGE_MAGIC, 32 + 32).prop_map(Case::Challenge)
}

fn round_trip() -> impl Strategy<Value = Case> {
    (
        prop::collection::vec((0..5usize, any::<u8>()), 1..6),
        prop_oneof![1usize..64, Just(1usize), Just(1 << 20)],
    )
        .prop_map(|(t, flush)| Case::RoundTrip(t, flush))
}

fn case() -> impl Strategy<Value = Case> {
    prop_oneof![
        3 => layout(),
        3 => plan(),
        2 => bucket(),
        1 => hello(),
        1 => challenge(),
        2 => round_trip(),
    ]
}

fn layout_of(tensors: &[(usize, u8)]) -> UpdateInfo {
    let p = params();
    UpdateInfo {
        names: tensors.iter().map(|(i, _)| p[*i].0.clone()).collect(),
        dtype_names: tensors
            .iter()
            .map(|(_, k)| moult_runtime::model::dtype_name(kind(*k)).to_string())
            .collect(),
        shapes: tensors.iter().map(|(i, _)| p[*i].1.clone()).collect(),
        packed: None,
    }
}

fn total_bytes(tensors: &[(usize, u8)]) -> usize {
    let p = params();
    tensors
        .iter()
        .map(|(i, k)| p[*i].1.iter().product::<i64>() as usize * kind(*k).elt_size_in_bytes())
        .sum()
}

fn check_layout(info: &UpdateInfo) -> Result<(), TestCaseError> {
    let p = params();
    match BucketLayout::new(info, &p) {
        Err(e) => prop_assert!(e.starts_with("update_info"), "{e}"),
        Ok(layout) => {
            let mut total = 0usize;
            for ((name, dtype), shape) in info.names.iter().zip(&info.dtype_names).zip(&info.shapes)
            {
                let expected = p.iter().find(|(n, _)| n == name).map(|(_, s)| s);
                prop_assert_eq!(Some(shape), expected);
                let k = moult_runtime::model::parse_dtype(dtype);
                prop_assert!(k.is_some());
                total += shape.iter().product::<i64>() as usize * k.unwrap().elt_size_in_bytes();
            }
            prop_assert_eq!(layout.total_bytes(), total);
        }
    }
    Ok(())
}

fn check_plan(metas: Vec<TensorMeta>, buffer: u64) -> Result<(), TestCaseError> {
    let wire = PackedWire {
        buffer_size_bytes: buffer,
        num_buffers: 2,
    };
    let Ok(plan) = BucketPlan::new(metas.clone(), wire) else {
        return Ok(());
    };
    prop_assert!(buffer > 0 && !metas.is_empty());
    // Offsets: contiguous from 0, each the tensor's byte length, never overlapping.
    let mut at = 0usize;
    for (m, r) in metas.iter().zip(&plan.offsets) {
        prop_assert_eq!(r.start, at);
        prop_assert_eq!(r.len(), m.byte_len().unwrap());
        at = r.end;
    }
    prop_assert_eq!(plan.total_bytes(), at);
    // Chunks: tile the tensors and bytes in order; each is flushed only once it exceeds the
    // buffer, and would not have without its last tensor.
    let (mut t, mut b) = (0usize, 0usize);
    for (i, c) in plan.chunks.iter().enumerate() {
        prop_assert_eq!(c.tensors.start, t);
        prop_assert_eq!(c.bytes.start, b);
        prop_assert!(c.tensors.end > c.tensors.start);
        prop_assert_eq!(c.bytes.start, plan.offsets[c.tensors.start].start);
        prop_assert_eq!(c.bytes.end, plan.offsets[c.tensors.end - 1].end);
        let limit = usize::try_from(buffer).unwrap_or(usize::MAX);
        if i + 1 < plan.chunks.len() {
            prop_assert!(c.bytes.len() > limit);
        }
        let without_last = plan.offsets[c.tensors.end - 1].start - c.bytes.start;
        prop_assert!(without_last <= limit);
        t = c.tensors.end;
        b = c.bytes.end;
    }
    prop_assert_eq!((t, b), (metas.len(), at));
    let info = plan.update_info();
    prop_assert_eq!(info.names.len(), metas.len());
    prop_assert_eq!(
        &info.shapes,
        &metas.iter().map(|m| m.shape.clone()).collect::<Vec<_>>()
    );
    Ok(())
}

fn check_bucket(tensors: Vec<(usize, u8)>, bytes: Vec<u8>) -> Result<(), TestCaseError> {
    let layout = BucketLayout::new(&layout_of(&tensors), &params()).unwrap();
    let listener = WeightListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let rt = runtime();
    let (result, staged) = rt.block_on(async {
        let accept = std::thread::spawn(move || listener.accept(1));
        let mut conn = connect(&addr, 1).await.unwrap();
        let mut sender = accept.join().unwrap().unwrap();
        // Injected after a real handshake, without the connection's key; then the peer hangs up,
        // so the receiver sees the end rather than waiting out its timeout.
        let writer = std::thread::spawn(move || {
            let _ = sender.send_raw(&bytes);
        });
        let mut staged = StagedUpdate::default();
        let r = staged.receive_within(&layout, &mut conn, SHORT).await;
        drop(conn);
        writer.join().unwrap();
        (r, staged)
    });
    prop_assert!(
        result.is_err(),
        "bytes without the stream's tag were staged"
    );
    prop_assert!(
        staged.is_empty(),
        "a refused bucket staged {} tensors",
        staged.len()
    );
    Ok(())
}

/// A peer that sends `bytes` as an engine's side of the handshake, then hangs up, is refused.
fn check_hello(bytes: Vec<u8>) -> Result<(), TestCaseError> {
    let mut listener = WeightListener::bind("127.0.0.1:0").unwrap();
    listener.accept_timeout = Duration::from_secs(5);
    listener.handshake_timeout = SHORT;
    let addr = listener.local_addr().unwrap();
    let writer = std::thread::spawn(move || {
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        let _ = s.write_all(&bytes);
        let _ = s.shutdown(std::net::Shutdown::Write);
        // Read the challenge, as an engine would, until the trainer hangs up.
        let _ = std::io::copy(&mut s, &mut std::io::sink());
    });
    // Dropped before the join: the trainer hangs up, so the peer's read ends.
    let refused = listener.accept(1).is_err();
    writer.join().unwrap();
    prop_assert!(refused, "a peer without the token was accepted");
    Ok(())
}

/// A trainer that answers an engine's hello with `bytes`, then hangs up, is refused.
fn check_challenge(bytes: Vec<u8>) -> Result<(), TestCaseError> {
    let rt = runtime();
    let result = rt.block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let trainer = tokio::spawn(async move {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let (mut s, _) = listener.accept().await.unwrap();
            let mut hello = [0u8; 8 + 4 + 32];
            let _ = s.read_exact(&mut hello).await;
            let _ = s.write_all(&bytes).await;
            let _ = s.shutdown().await;
        });
        let r = connect(&addr, 1).await;
        trainer.await.unwrap();
        r
    });
    prop_assert!(result.is_err(), "a trainer without the token was trusted");
    Ok(())
}

fn check_round_trip(tensors: Vec<(usize, u8)>, flush: usize) -> Result<(), TestCaseError> {
    let p = params();
    let sent: Vec<(String, Tensor)> = tensors
        .iter()
        .enumerate()
        .map(|(j, (i, k))| {
            let (name, shape) = &p[*i];
            let n: i64 = shape.iter().product();
            let values: Vec<f32> = (0..n)
                .map(|v| (v as f32 + 1.0) * (j as f32 + 0.5))
                .collect();
            let t = Tensor::from_slice(&values)
                .reshape(shape.as_slice())
                .to_kind(kind(*k));
            (name.clone(), t)
        })
        .collect();
    let layout = BucketLayout::new(&update_info(&sent), &p)
        .map_err(|e| TestCaseError::fail(format!("layout of the sender's own tensors: {e}")))?;
    let listener = WeightListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let rt = runtime();
    let params: BTreeMap<String, Tensor> = p
        .iter()
        .map(|(n, s)| {
            (
                n.clone(),
                Tensor::zeros(s.as_slice(), (Kind::Float, Device::Cpu)),
            )
        })
        .collect();
    let staged = rt.block_on(async {
        let accept = std::thread::spawn(move || listener.accept(1));
        let mut stream = connect(&addr, 1).await.unwrap();
        let mut sender = accept.join().unwrap().unwrap();
        let to_send: Vec<(String, Tensor)> = sent
            .iter()
            .map(|(n, t)| (n.clone(), t.shallow_clone()))
            .collect();
        let send = std::thread::spawn(move || sender.send_bucket(&to_send, flush));
        let mut staged = StagedUpdate::default();
        let r = staged.receive_within(&layout, &mut stream, SHORT).await;
        send.join().unwrap().unwrap();
        r.map(|()| staged)
    });
    let staged = staged.map_err(TestCaseError::fail)?;
    staged.apply(&params).map_err(TestCaseError::fail)?;
    // The last tensor sent under each name is what the model holds.
    let mut last: BTreeMap<&str, &Tensor> = BTreeMap::new();
    for (n, t) in &sent {
        last.insert(n, t);
    }
    for (n, t) in last {
        prop_assert!(params[n].equal(&t.to_kind(Kind::Float)), "{n} differs");
    }
    Ok(())
}

fn check(case: Case) -> Result<(), TestCaseError> {
    match case {
        Case::Layout(info) => check_layout(&info),
        Case::Plan(metas, buffer) => check_plan(metas, buffer),
        Case::Bucket(t, bytes) => check_bucket(t, bytes),
        Case::Hello(bytes) => check_hello(bytes),
        Case::Challenge(bytes) => check_challenge(bytes),
        Case::RoundTrip(t, flush) => check_round_trip(t, flush),
    }
}

pub fn target(budget: Budget) -> Row {
    drive("weight_stream", budget, 1500, case(), check)
}
