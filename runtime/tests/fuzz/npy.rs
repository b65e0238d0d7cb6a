//! Routed experts as `.npy` in base64: arbitrary text never panics the decoder, and whatever the
//! encoder writes decodes to the same shape and ids.

use base64::Engine as _;
use proptest::prelude::*;

use crate::{drive, Budget, Row};
use moult_runtime::engine::npy::{decode_routed_experts, encode_routed_experts};

#[derive(Debug, Clone)]
enum Case {
    /// A valid array: it must round-trip.
    RoundTrip {
        rows: usize,
        layers: usize,
        top_k: usize,
        num_experts: usize,
        ids: Vec<u16>,
    },
    /// Bytes (possibly a mangled valid array) as base64: any answer but a panic.
    Bytes(Vec<u8>),
    /// Text that may not be base64 at all.
    Text(String),
}

fn round_trip() -> impl Strategy<Value = Case> {
    (
        0usize..6,
        0usize..5,
        0usize..4,
        prop_oneof![1usize..=256, 257usize..=65536],
    )
        .prop_flat_map(|(rows, layers, top_k, num_experts)| {
            let n = rows * layers * top_k;
            let ids = prop::collection::vec(0..=(num_experts - 1) as u16, n..=n);
            (Just((rows, layers, top_k, num_experts)), ids)
        })
        .prop_map(
            |((rows, layers, top_k, num_experts), ids)| Case::RoundTrip {
                rows,
                layers,
                top_k,
                num_experts,
                ids,
            },
        )
}

/// A valid array's bytes with a few edits, a header rewritten, or the tail cut off.
fn mangled() -> impl Strategy<Value = Case> {
    let header = prop_oneof![
        Just("{'descr': '|u1', 'fortran_order': False, 'shape': (2, 3, 2), }".to_string()),
        Just("{'descr': '<u2', 'fortran_order': False, 'shape': (18446744073709551615, 2, 2), }".to_string()),
        Just("{'descr': '|u1', 'shape': (, ), }".to_string()),
        Just("{'descr': '<u2', 'shape': (1,2,3,4), }".to_string()),
        "\\{'descr': '(\\|u1|<u2|<f4)', 'fortran_order': False, 'shape': \\(([0-9]{1,20}, ?){0,4}\\), \\}",
        ".{0,80}",
    ];
    (
        header,
        prop::collection::vec(any::<u8>(), 0..40),
        any::<u16>(),
        prop::option::of(any::<u16>()),
        prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..4),
    )
        .prop_map(|(header, data, pad, len_override, edits)| {
            let mut bytes = b"\x93NUMPY\x01\x00".to_vec();
            let len = len_override.unwrap_or((header.len() + (pad % 64) as usize) as u16);
            bytes.extend_from_slice(&len.to_le_bytes());
            bytes.extend_from_slice(header.as_bytes());
            bytes.extend(std::iter::repeat_n(b' ', (pad % 64) as usize));
            bytes.extend(data);
            for (at, b) in edits {
                let i = at.index(bytes.len());
                bytes[i] = b;
            }
            Case::Bytes(bytes)
        })
}

fn case() -> impl Strategy<Value = Case> {
    prop_oneof![
        3 => round_trip(),
        4 => mangled(),
        1 => prop::collection::vec(any::<u8>(), 0..64).prop_map(Case::Bytes),
        1 => ".{0,64}".prop_map(Case::Text),
    ]
}

fn check(case: Case) -> Result<(), TestCaseError> {
    match case {
        Case::RoundTrip {
            rows,
            layers,
            top_k,
            num_experts,
            ids,
        } => {
            let b64 = encode_routed_experts(&ids, rows, layers, top_k, num_experts);
            let back = decode_routed_experts(&b64);
            prop_assert_eq!(back, Ok(([rows, layers, top_k], ids)));
        }
        Case::Bytes(bytes) => {
            let b64 = base64::engine::general_purpose::STANDARD.encode(&bytes);
            if let Ok((shape, ids)) = decode_routed_experts(&b64) {
                prop_assert_eq!(shape.iter().product::<usize>(), ids.len());
            }
        }
        Case::Text(text) => {
            if let Ok((shape, ids)) = decode_routed_experts(&text) {
                prop_assert_eq!(shape.iter().product::<usize>(), ids.len());
            }
        }
    }
    Ok(())
}

pub fn target(budget: Budget) -> Row {
    drive("routed_experts_npy", budget, 5000, case(), check)
}
