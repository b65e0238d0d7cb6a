//! Routed experts on the wire as vLLM sends them: a `.npy` (format 1.0) array of shape
//! `(tokens - 1, layers, top_k)`, `uint8` when the model has at most 256 experts and `uint16`
//! (little-endian) otherwise, base64-encoded (standard alphabet, padded).

use base64::Engine as _;

/// Encodes expert ids `[rows][layers * top_k]` (flattened row-major) as base64 `.npy`.
pub fn encode_routed_experts(
    ids: &[u16],
    rows: usize,
    layers: usize,
    top_k: usize,
    num_experts: usize,
) -> String {
    debug_assert_eq!(ids.len(), rows * layers * top_k);
    let (descr, width) = if num_experts <= 256 {
        ("|u1", 1)
    } else {
        ("<u2", 2)
    };
    let dict = format!(
        "{{'descr': '{descr}', 'fortran_order': False, 'shape': ({rows}, {layers}, {top_k}), }}"
    );
    // magic(6) + version(2) + header length(2) + dict + padding + '\n', a multiple of 64.
    let unpadded = 10 + dict.len() + 1;
    let header_len = dict.len() + 1 + (64 - unpadded % 64) % 64;
    let mut out = Vec::with_capacity(10 + header_len + ids.len() * width);
    out.extend_from_slice(b"\x93NUMPY\x01\x00");
    out.extend_from_slice(&(header_len as u16).to_le_bytes());
    out.extend_from_slice(dict.as_bytes());
    out.resize(10 + header_len - 1, b' ');
    out.push(b'\n');
    for &id in ids {
        if width == 1 {
            out.push(id as u8);
        } else {
            out.extend_from_slice(&id.to_le_bytes());
        }
    }
    base64::engine::general_purpose::STANDARD.encode(out)
}

/// Decodes what [`encode_routed_experts`] writes: `(shape, ids)`. Used by clients and tests.
pub fn decode_routed_experts(b64: &str) -> Result<([usize; 3], Vec<u16>), String> {
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(b64)
        .map_err(|e| format!("not base64: {e}"))?;
    if bytes.len() < 10 || &bytes[..6] != b"\x93NUMPY" {
        return Err("not a .npy array".into());
    }
    let header_len = u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
    let header = std::str::from_utf8(bytes.get(10..10 + header_len).ok_or("truncated header")?)
        .map_err(|_| "header is not UTF-8")?;
    let width = if header.contains("'|u1'") {
        1
    } else if header.contains("'<u2'") {
        2
    } else {
        return Err(format!("unexpected dtype in {header}"));
    };
    let shape_text = header
        .split("'shape': (")
        .nth(1)
        .and_then(|s| s.split(')').next())
        .ok_or("no shape")?;
    let dims: Vec<usize> = shape_text
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| s.parse().map_err(|_| format!("bad shape {shape_text}")))
        .collect::<Result<_, _>>()?;
    let shape: [usize; 3] = dims
        .try_into()
        .map_err(|_| "shape is not 3-D".to_string())?;
    let data = &bytes[10 + header_len..];
    let ids: Vec<u16> = if width == 1 {
        data.iter().map(|&b| b as u16).collect()
    } else {
        data.chunks_exact(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]))
            .collect()
    };
    // A shape whose product overflows holds no real array: refuse it rather than wrap.
    let values = shape
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .ok_or_else(|| format!("shape {shape:?} is too large"))?;
    if ids.len() != values {
        return Err(format!("{} values for shape {shape:?}", ids.len()));
    }
    Ok((shape, ids))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_is_64_byte_aligned() {
        let ids: Vec<u16> = (0..2 * 3 * 2).map(|i| i as u16 * 7 % 128).collect();
        let b64 = encode_routed_experts(&ids, 2, 3, 2, 128);
        let raw = base64::engine::general_purpose::STANDARD
            .decode(&b64)
            .unwrap();
        let header_len = u16::from_le_bytes([raw[8], raw[9]]) as usize;
        assert_eq!((10 + header_len) % 64, 0);
        assert_eq!(raw[10 + header_len - 1], b'\n');
        assert_eq!(raw.len(), 10 + header_len + ids.len());
        assert_eq!(decode_routed_experts(&b64).unwrap(), ([2, 3, 2], ids));

        let wide: Vec<u16> = vec![300, 1, 511, 2];
        let b64 = encode_routed_experts(&wide, 1, 2, 2, 512);
        assert!(String::from_utf8_lossy(
            &base64::engine::general_purpose::STANDARD
                .decode(&b64)
                .unwrap()
        )
        .contains("'<u2'"));
        assert_eq!(decode_routed_experts(&b64).unwrap(), ([1, 2, 2], wide));
    }
}
