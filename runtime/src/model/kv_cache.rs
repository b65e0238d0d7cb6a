//! The KV cache of a batch of sequences: per layer, one key and one value tensor
//! `[slots, kv_heads, capacity, head_dim]`, one slot per running sequence.
//!
//! Contract:
//! - Used slots are always `0..used()`, so one decoding step reads every sequence's keys as a
//!   single strided view, with no gather or padding copy: the batched attention of all decoding
//!   sequences is one call per layer.
//! - [`KvCache::free`] keeps slots compact by moving the last slot into the freed one; it
//!   returns that move so the owner can re-point the moved sequence.
//! - Capacity (positions) and slots grow by doubling, so appends are O(1) amortised.
//! - Lengths advance only when a forward step completes ([`KvCache::advance`]).

use tch::{Device, Kind, Tensor};

#[derive(Debug)]
struct LayerCache {
    k: Tensor,
    v: Tensor,
}

/// Cached keys and values for up to `slots` sequences.
#[derive(Debug)]
pub struct KvCache {
    layers: Vec<LayerCache>,
    lens: Vec<usize>,
    slot_capacity: usize,
    capacity: usize,
    kv_heads: i64,
    head_dim: i64,
    kind: Kind,
    device: Device,
}

impl KvCache {
    /// An empty cache; `capacity` positions per slot are reserved up front.
    pub fn new(
        num_layers: usize,
        kv_heads: usize,
        head_dim: usize,
        capacity: usize,
        kind: Kind,
        device: Device,
    ) -> Self {
        let mut cache = Self {
            layers: Vec::with_capacity(num_layers),
            lens: Vec::new(),
            slot_capacity: 1,
            capacity: capacity.max(1),
            kv_heads: kv_heads as i64,
            head_dim: head_dim as i64,
            kind,
            device,
        };
        for _ in 0..num_layers {
            let (k, v) = (cache.buffer(), cache.buffer());
            cache.layers.push(LayerCache { k, v });
        }
        cache
    }

    fn buffer(&self) -> Tensor {
        let shape = [
            self.slot_capacity as i64,
            self.kv_heads,
            self.capacity as i64,
            self.head_dim,
        ];
        Tensor::zeros(shape, (self.kind, self.device))
    }

    /// Slots in use (`0..used()`).
    pub fn used(&self) -> usize {
        self.lens.len()
    }

    /// Tokens cached in `slot`.
    pub fn len(&self, slot: usize) -> usize {
        self.lens[slot]
    }

    /// Tokens cached over all slots.
    pub fn total_len(&self) -> usize {
        self.lens.iter().sum()
    }

    /// Takes a new, empty slot (always `used()` before the call).
    pub fn alloc(&mut self) -> usize {
        if self.lens.len() == self.slot_capacity {
            self.resize(self.slot_capacity * 2, self.capacity);
        }
        self.lens.push(0);
        self.lens.len() - 1
    }

    /// Frees `slot`. If another slot had to move into it to keep slots compact, returns
    /// `Some(old_index)` of the moved slot (which is now `slot`).
    pub fn free(&mut self, slot: usize) -> Option<usize> {
        let last = self.lens.len() - 1;
        let moved = (slot != last).then(|| {
            let len = self.lens[last] as i64;
            for layer in &mut self.layers {
                for buf in [&mut layer.k, &mut layer.v] {
                    buf.get(slot as i64)
                        .narrow(1, 0, len)
                        .copy_(&buf.get(last as i64).narrow(1, 0, len));
                }
            }
            self.lens[slot] = self.lens[last];
            last
        });
        self.lens.pop();
        moved
    }

    /// Forgets the tokens of `slot` (after a weight update they are recomputed).
    pub fn clear(&mut self, slot: usize) {
        self.lens[slot] = 0;
    }

    /// Makes room for `positions` tokens in every slot.
    pub(crate) fn reserve(&mut self, positions: usize) {
        if positions > self.capacity {
            let mut capacity = self.capacity;
            while capacity < positions {
                capacity *= 2;
            }
            self.resize(self.slot_capacity, capacity);
        }
    }

    fn resize(&mut self, slot_capacity: usize, capacity: usize) {
        let (old_slots, old_capacity) = (self.slot_capacity as i64, self.capacity as i64);
        self.slot_capacity = slot_capacity;
        self.capacity = capacity;
        for i in 0..self.layers.len() {
            let (k, v) = (self.buffer(), self.buffer());
            k.narrow(0, 0, old_slots)
                .narrow(2, 0, old_capacity)
                .copy_(&self.layers[i].k);
            v.narrow(0, 0, old_slots)
                .narrow(2, 0, old_capacity)
                .copy_(&self.layers[i].v);
            self.layers[i] = LayerCache { k, v };
        }
    }

    /// Writes one layer's new keys and values `[tokens, kv_heads, head_dim]` at
    /// (`slots[t]`, `positions[t]`) for each token `t`, in one scatter.
    pub(crate) fn write(
        &mut self,
        layer: usize,
        slots: &Tensor,
        positions: &Tensor,
        k: &Tensor,
        v: &Tensor,
    ) {
        let entry = &mut self.layers[layer];
        let index = [Some(slots), None, Some(positions)];
        let _ = entry.k.index_put_(&index, k, false);
        let _ = entry.v.index_put_(&index, v, false);
    }

    /// Keys and values of slots `0..slots` up to position `len`: `[slots, kv_heads, len, head_dim]`
    /// views of the buffers.
    pub(crate) fn prefix(&self, layer: usize, slots: usize, len: usize) -> (Tensor, Tensor) {
        let entry = &self.layers[layer];
        let view = |t: &Tensor| t.narrow(0, 0, slots as i64).narrow(2, 0, len as i64);
        (view(&entry.k), view(&entry.v))
    }

    /// One slot's keys and values up to position `len`: `[kv_heads, len, head_dim]`.
    pub(crate) fn slot(&self, layer: usize, slot: usize, len: usize) -> (Tensor, Tensor) {
        let entry = &self.layers[layer];
        (
            entry.k.get(slot as i64).narrow(1, 0, len as i64),
            entry.v.get(slot as i64).narrow(1, 0, len as i64),
        )
    }

    pub(crate) fn advance(&mut self, slot: usize, n: usize) {
        self.lens[slot] += n;
    }
}
