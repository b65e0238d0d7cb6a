//! The TCP weight stream's data, as an engine reads it after the handshake: a bucket's
//! `update_info` (from the control route) and the bytes that follow on the data plane, either a
//! bucket the trainer sends (tagged) or bytes injected on the path by whoever lacks the run token.

use std::collections::BTreeMap;
use std::time::Duration;

use moult_runtime::engine::api::UpdateInfo;
use moult_runtime::engine::weights::{
    connect, BucketLayout, StagedUpdate, TcpWeightSender, WeightConnection, WeightListener,
};
use tch::{Kind, Tensor};

/// The fuzzed model's weights: a matrix, a vector, a scalar.
fn params() -> Vec<(String, Vec<i64>)> {
    [("a", vec![2, 3]), ("b", vec![4]), ("c", vec![])]
        .into_iter()
        .map(|(n, s)| (n.to_string(), s))
        .collect()
}

/// Both ends of a weight stream after a real handshake on loopback.
fn plane() -> (WeightConnection, TcpWeightSender) {
    let listener = WeightListener::bind("127.0.0.1:0").expect("a loopback port");
    let addr = listener.local_addr().expect("bound").to_string();
    let accept = std::thread::spawn(move || listener.accept(1).expect("the engine connects"));
    let conn = crate::block_on(connect(&addr, 1)).expect("the handshake");
    (conn, accept.join().expect("the accepting thread"))
}

/// `update_info` JSON, a newline, a byte that says who sends, then bytes:
/// - even: the trainer's bucket whose tensors' bytes these are (when their length is the
///   layout's): it is staged whole and applies to the model's weights;
/// - odd: these bytes as they are, injected by a peer without the run token: refused, nothing
///   staged, whatever they hold.
pub fn stream(data: &[u8]) {
    let split = data.iter().position(|&b| b == b'\n').unwrap_or(data.len());
    let Ok(info) = serde_json::from_slice::<UpdateInfo>(&data[..split]) else {
        return;
    };
    let params = params();
    let Ok(layout) = BucketLayout::new(&info, &params) else {
        return;
    };
    let Some((&who, bytes)) = data.get(split + 1..).and_then(|rest| rest.split_first()) else {
        return;
    };
    let trainer = who % 2 == 0;
    if trainer && bytes.len() != layout.total_bytes() {
        return;
    }
    let (mut conn, mut sender) = plane();
    let bytes = bytes.to_vec();
    let tensors: Vec<(String, Tensor)> = if trainer {
        let mut offset = 0;
        (info.names.iter().zip(&info.shapes).zip(&info.dtype_names))
            .map(|((name, shape), dtype)| {
                let kind = moult_runtime::model::parse_dtype(dtype).expect("the layout took it");
                let len = shape.iter().product::<i64>() as usize * kind.elt_size_in_bytes();
                let t = Tensor::from_data_size(&bytes[offset..offset + len], shape, kind);
                offset += len;
                (name.clone(), t)
            })
            .collect()
    } else {
        Vec::new()
    };
    // Sent from a thread of its own (the trainer's end blocks), closed when done so that a
    // reader waiting for more sees the end.
    let send = std::thread::spawn(move || {
        let _ = if trainer {
            sender.send_bucket(&tensors, 7)
        } else {
            sender.send_raw(&bytes)
        };
    });
    let mut staged = StagedUpdate::default();
    let received =
        crate::block_on(staged.receive_within(&layout, &mut conn, Duration::from_millis(300)));
    drop(conn);
    send.join().expect("the sending thread");
    if !trainer {
        assert!(
            received.is_err(),
            "bytes without the run token's tag were staged"
        );
        assert!(
            staged.is_empty(),
            "a refused bucket staged {} tensors",
            staged.len()
        );
        return;
    }
    received.unwrap_or_else(|e| panic!("the trainer's own bucket was refused: {e}"));
    assert_eq!(staged.len(), info.names.len());
    let weights: BTreeMap<String, Tensor> = (params.iter())
        .map(|(n, s)| {
            (
                n.clone(),
                Tensor::zeros(s.as_slice(), (Kind::Float, tch::Device::Cpu)),
            )
        })
        .collect();
    staged.apply(&weights).expect("a staged bucket applies");
}
