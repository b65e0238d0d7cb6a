//! A per-sequence KV cache: for each layer, key and value buffers `[kv_heads, capacity, head_dim]`
//! that grow by doubling, so appending a token costs O(1) amortised and the attention at each
//! step reads only the filled prefix.

use tch::{Device, Kind, Tensor};

#[derive(Debug)]
struct LayerCache {
    k: Tensor,
    v: Tensor,
}

/// The cached keys and values of one sequence.
#[derive(Debug)]
pub struct KvCache {
    layers: Vec<LayerCache>,
    len: usize,
    capacity: usize,
    kv_heads: i64,
    head_dim: i64,
    kind: Kind,
    device: Device,
}

impl KvCache {
    /// An empty cache with room for `capacity` tokens before it first grows.
    pub fn new(
        num_layers: usize,
        kv_heads: usize,
        head_dim: usize,
        capacity: usize,
        kind: Kind,
        device: Device,
    ) -> Self {
        let capacity = capacity.max(1);
        let (kv_heads, head_dim) = (kv_heads as i64, head_dim as i64);
        let layers = (0..num_layers)
            .map(|_| LayerCache {
                k: Tensor::zeros([kv_heads, capacity as i64, head_dim], (kind, device)),
                v: Tensor::zeros([kv_heads, capacity as i64, head_dim], (kind, device)),
            })
            .collect();
        Self {
            layers,
            len: 0,
            capacity,
            kv_heads,
            head_dim,
            kind,
            device,
        }
    }

    /// Tokens cached (in every layer, once a forward step completes).
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes held by the buffers.
    pub fn bytes(&self) -> usize {
        2 * self.layers.len()
            * self.capacity
            * (self.kv_heads * self.head_dim) as usize
            * self.kind.elt_size_in_bytes()
    }

    /// Forgets every cached token (after a weight update the cache is recomputed).
    pub fn clear(&mut self) {
        self.len = 0;
    }

    fn grow_to(&mut self, needed: usize) {
        let mut capacity = self.capacity;
        while capacity < needed {
            capacity *= 2;
        }
        if capacity == self.capacity {
            return;
        }
        for layer in &mut self.layers {
            for buf in [&mut layer.k, &mut layer.v] {
                let bigger = Tensor::zeros(
                    [self.kv_heads, capacity as i64, self.head_dim],
                    (self.kind, self.device),
                );
                bigger
                    .narrow(1, 0, self.len as i64)
                    .copy_(&buf.narrow(1, 0, self.len as i64));
                *buf = bigger;
            }
        }
        self.capacity = capacity;
    }

    /// Writes `k, v: [kv_heads, n, head_dim]` for `layer` after the cached prefix and returns
    /// the whole keys and values `[kv_heads, len + n, head_dim]`. The cache's length advances
    /// once [`KvCache::advance`] is called after the last layer.
    pub(crate) fn append(&mut self, layer: usize, k: &Tensor, v: &Tensor) -> (Tensor, Tensor) {
        let n = k.size()[1] as usize;
        self.grow_to(self.len + n);
        let total = (self.len + n) as i64;
        let entry = &mut self.layers[layer];
        entry.k.narrow(1, self.len as i64, n as i64).copy_(k);
        entry.v.narrow(1, self.len as i64, n as i64).copy_(v);
        (entry.k.narrow(1, 0, total), entry.v.narrow(1, 0, total))
    }

    pub(crate) fn advance(&mut self, n: usize) {
        self.len += n;
    }
}
