//! Attention over a packed batch: the trainer's path (each sequence over its own tokens) and the
//! engine's (new keys and values written into the slot cache, then one batched attention call for
//! every decoding sequence and one per prefilling sequence).
//!
//! A sliding-window layer's query at position `p` sees keys at `p - window + 1 ..= p`
//! (transformers' `kv_idx > q_idx - sliding_window`). Its keys stay in the cache like every
//! layer's; attention reads only the part any query of the step can see.

use tch::{Device, Kind, Tensor};

use super::{CausalLm, Layer};
use crate::model::kv_cache::KvCache;
use crate::model::lora::Rows;
use crate::model::rope::RopeAt;

impl CausalLm {
    fn qkv(
        &self,
        layer: &Layer,
        x: &Tensor,
        rope: &RopeAt,
        rows: &Rows,
    ) -> (Tensor, Tensor, Tensor) {
        let c = &self.cfg;
        let (heads, kv_heads) = (c.num_attention_heads as i64, c.num_key_value_heads as i64);
        let qkv = layer.qkv_proj.forward_rows(x, rows).view([
            x.size()[0],
            heads + 2 * kv_heads,
            c.head_dim as i64,
        ]);
        // Qwen3 and Gemma 3 normalise each head's queries and keys; the other families do not.
        let norm = |x: Tensor, w: &Option<Tensor>| match w {
            Some(w) => self.rms(&x, w),
            None => x,
        };
        let q = rope.apply(&norm(qkv.narrow(1, 0, heads), &layer.q_norm));
        let k = rope.apply(&norm(qkv.narrow(1, heads, kv_heads), &layer.k_norm));
        (q, k, qkv.narrow(1, heads + kv_heads, kv_heads))
    }

    /// Causal attention of `n` new queries `[heads, n, d]` over `past + n` keys
    /// `[kv_heads, past + n, d]`, within `window` positions if the layer slides.
    fn attend(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        n: i64,
        past: i64,
        window: Option<i64>,
    ) -> Tensor {
        // Keys before the first query's window are seen by no query.
        let start = window.map_or(0, |w| (past + 1 - w).max(0));
        let (k, v) = (
            k.narrow(1, start, past + n - start),
            v.narrow(1, start, past + n - start),
        );
        // New tokens see the prefix and, among themselves, only earlier ones; with a window, a
        // later query loses keys an earlier one still sees.
        let windowed = window.is_some_and(|w| n > 1 && past + n > w);
        let mask = ((past > 0 && n > 1) || windowed).then(|| {
            let rows = Tensor::arange(n, (Kind::Int64, self.device)).unsqueeze(1) + past;
            let cols =
                Tensor::arange_start(start, past + n, (Kind::Int64, self.device)).unsqueeze(0);
            let causal = cols.le_tensor(&rows);
            match window {
                Some(w) => causal.logical_and(&cols.gt_tensor(&(&rows - w))),
                None => causal,
            }
        });
        let is_causal = mask.is_none() && n > 1;
        let out = Tensor::scaled_dot_product_attention(
            &q.unsqueeze(0),
            &k.unsqueeze(0),
            &v.unsqueeze(0),
            mask,
            0.0,
            is_causal,
            self.cfg.attn_scale,
            true,
        );
        out.squeeze_dim(0).transpose(0, 1).reshape([n, -1])
    }

    /// The trainer's path: each sequence attends over its own tokens only.
    pub(super) fn attention_uncached(
        &self,
        layer: &Layer,
        x: &Tensor,
        rope: &RopeAt,
        spans: &[Span],
        rows: &Rows,
    ) -> Tensor {
        let (q, k, v) = self.qkv(layer, x, rope, rows);
        let outs: Vec<Tensor> = spans
            .iter()
            .map(|s| {
                let part = |t: &Tensor| t.narrow(0, s.offset, s.n).transpose(0, 1);
                self.attend(&part(&q), &part(&k), &part(&v), s.n, 0, layer.window)
            })
            .collect();
        layer.o_proj.forward_rows(&Tensor::cat(&outs, 0), rows)
    }

    /// The engine's path: write the new keys/values into the cache, then one batched attention
    /// for every decoding sequence, and one per prefilling sequence.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attention_cached(
        &self,
        l: usize,
        layer: &Layer,
        x: &Tensor,
        rope: &RopeAt,
        positions: &Tensor,
        cache: &mut KvCache,
        batch: &CachedBatch,
        spans: &[Span],
        rows: &Rows,
    ) -> Tensor {
        let c = &self.cfg;
        let (heads, kv_heads, d) = (
            c.num_attention_heads as i64,
            c.num_key_value_heads as i64,
            c.head_dim as i64,
        );
        let (q, k, v) = self.qkv(layer, x, rope, rows);
        cache.write(l, &batch.token_slots, positions, &k, &v);
        // Every used slot takes part in the decode attention (slots are compact). The query heads
        // sharing a KV head become that head's query rows, so grouped-query attention needs no
        // repeated keys.
        let used = cache.used() as i64;
        let decode_attention = |decode: &DecodeBatch, qs: &Tensor| {
            let qs = qs.view([used, kv_heads, heads / kv_heads, d]);
            let (ks, vs) = cache.prefix(l, used as usize, decode.max_len);
            let keys = match layer.window {
                Some(_) => decode
                    .window
                    .as_ref()
                    .expect("built for a model with a window"),
                None => &decode.full,
            };
            let seen = decode.max_len as i64 - keys.start;
            Tensor::scaled_dot_product_attention(
                &qs,
                &ks.narrow(2, keys.start, seen),
                &vs.narrow(2, keys.start, seen),
                keys.mask.as_ref(),
                0.0,
                false,
                self.cfg.attn_scale,
                false,
            )
            .view([used, heads * d])
        };
        if let Some(decode) = batch.decode.as_ref().filter(|d| d.identity) {
            // The steady state: every sequence decodes, packed in slot order.
            return layer
                .o_proj
                .forward_rows(&decode_attention(decode, &q), rows);
        }
        let mut out = Tensor::zeros([x.size()[0], heads * d], (x.kind(), self.device));
        if let Some(decode) = &batch.decode {
            // Rows of slots not decoding this step are computed and dropped.
            let qs = Tensor::zeros([used, heads, d], (x.kind(), self.device)).index_copy(
                0,
                &decode.slots,
                &q.index_select(0, &decode.rows),
            );
            let attended = decode_attention(decode, &qs).index_select(0, &decode.slots);
            let _ = out.index_copy_(0, &decode.rows, &attended);
        }
        for s in spans.iter().filter(|s| s.n > 1) {
            let slot = s.slot.expect("cached spans have slots");
            let (ks, vs) = cache.slot(l, slot, (s.past + s.n) as usize);
            let qs = q.narrow(0, s.offset, s.n).transpose(0, 1);
            out.narrow(0, s.offset, s.n).copy_(&self.attend(
                &qs,
                &ks,
                &vs,
                s.n,
                s.past,
                layer.window,
            ));
        }
        layer.o_proj.forward_rows(&out, rows)
    }
}

/// Where one sequence sits in the packed batch.
#[derive(Debug)]
pub(super) struct Span {
    pub(super) offset: i64,
    pub(super) n: i64,
    pub(super) past: i64,
    pub(super) slot: Option<usize>,
}

/// Index tensors of a cached forward, built once and shared by every layer.
pub(super) struct CachedBatch {
    /// Cache slot of every packed token.
    token_slots: Tensor,
    decode: Option<DecodeBatch>,
}

/// The sequences decoding one token this step.
struct DecodeBatch {
    /// Their packed rows and cache slots.
    rows: Tensor,
    slots: Tensor,
    /// Every sequence of the step decodes and row `i` is slot `i`: no gather or scatter needed.
    identity: bool,
    /// Positions cached: the longest used slot after this step's writes.
    max_len: usize,
    /// The keys full-attention layers read, and those sliding-window layers read.
    full: DecodeKeys,
    window: Option<DecodeKeys>,
}

/// The cached positions `start..max_len` a decode step's attention reads.
struct DecodeKeys {
    start: i64,
    /// `[used, 1, 1, max_len - start]` additive mask: 0 where a slot's query sees a key, -inf
    /// past the slot's end or before its window; `None` when every query sees every key read.
    mask: Option<Tensor>,
}

impl DecodeKeys {
    /// What slots of lengths `lens` (this step's token included) see, within `window`.
    fn new(lens: &[i64], max_len: i64, window: Option<i64>, kind: Kind, device: Device) -> Self {
        let min_len = *lens.iter().min().expect("at least one slot");
        let start = window.map_or(0, |w| (min_len - w).max(0));
        let all_seen = lens
            .iter()
            .all(|&len| len == max_len && window.is_none_or(|w| len - w <= start));
        let mask = (!all_seen).then(|| {
            let lens_t = Tensor::from_slice(lens)
                .to_device(device)
                .view([-1, 1, 1, 1]);
            let cols =
                Tensor::arange_start(start, max_len, (Kind::Int64, device)).view([1, 1, 1, -1]);
            let mut valid = cols.lt_tensor(&lens_t);
            if let Some(w) = window {
                valid = valid.logical_and(&cols.ge_tensor(&(&lens_t - w)));
            }
            Tensor::zeros(valid.size(), (kind, device))
                .masked_fill(&valid.logical_not(), f64::NEG_INFINITY)
        });
        Self { start, mask }
    }
}

impl CachedBatch {
    /// `window`: the model's sliding window, if any layer slides.
    pub(super) fn new(
        cache: &KvCache,
        spans: &[Span],
        token_slots: Vec<i64>,
        window: Option<i64>,
        kind: Kind,
        device: Device,
    ) -> Self {
        let decoding: Vec<&Span> = spans.iter().filter(|s| s.n == 1).collect();
        let decode = (!decoding.is_empty()).then(|| {
            // Lengths after this step's writes; a slot with nothing cached still gets one
            // (ignored) key so its dropped row stays finite.
            let mut lens: Vec<i64> = (0..cache.used()).map(|s| cache.len(s) as i64).collect();
            for s in spans {
                lens[s.slot.expect("cached spans have slots")] = s.past + s.n;
            }
            let lens: Vec<i64> = lens.into_iter().map(|l| l.max(1)).collect();
            let max_len = *lens.iter().max().expect("at least one slot");
            let full = DecodeKeys::new(&lens, max_len, None, kind, device);
            let window = window.map(|w| DecodeKeys::new(&lens, max_len, Some(w), kind, device));
            let rows: Vec<i64> = decoding.iter().map(|s| s.offset).collect();
            let slots: Vec<i64> = decoding
                .iter()
                .map(|s| s.slot.expect("cached") as i64)
                .collect();
            let identity = decoding.len() == spans.len()
                && spans.len() == cache.used()
                && slots
                    .iter()
                    .zip(&rows)
                    .enumerate()
                    .all(|(i, (&s, &r))| s == i as i64 && r == i as i64);
            DecodeBatch {
                rows: Tensor::from_slice(&rows).to_device(device),
                slots: Tensor::from_slice(&slots).to_device(device),
                identity,
                max_len: max_len as usize,
                full,
                window,
            }
        });
        Self {
            token_slots: Tensor::from_slice(&token_slots).to_device(device),
            decode,
        }
    }
}
