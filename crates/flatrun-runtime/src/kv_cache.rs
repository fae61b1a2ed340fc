//! The key/value cache of one sequence: one [`LayerKvCache`] per layer,
//! f16 by default. Full-attention layers hold one slot per position up to
//! the context size; sliding-window layers hold a ring of `window +
//! max_batch` slots (Gemma 3's local layers need 512 positions, not 32k).

use crate::options::KvType;
use flatrun_kernels::ops::KvSlice;
use flatrun_model::arch::{LayerKv, MemoryKind};
use flatrun_model::{ModelConfig, ModelError};
use half::f16;

/// Zeroed bytes for a cache buffer, in their own anonymous mapping: the
/// kernel hands out zero pages on first write, so pages no position has
/// reached yet are never resident and a long context costs memory only as it
/// fills. (A heap allocation of the same size may be recycled memory that
/// `calloc` has to clear by hand, which makes every page resident up front.)
/// Falls back to the heap when the mapping cannot be made.
#[derive(Debug)]
enum ZeroedBytes {
    Mapped(memmap2::MmapMut),
    /// `u32` elements: 4-byte alignment, enough for f16 and f32.
    Heap(Vec<u32>),
}

impl ZeroedBytes {
    fn new(bytes: usize) -> ZeroedBytes {
        if bytes > 0
            && let Ok(map) = memmap2::MmapMut::map_anon(bytes)
        {
            return ZeroedBytes::Mapped(map);
        }
        ZeroedBytes::Heap(vec![0u32; bytes.div_ceil(4)])
    }
    fn as_bytes(&self) -> &[u8] {
        match self {
            ZeroedBytes::Mapped(map) => map,
            ZeroedBytes::Heap(v) => bytemuck::cast_slice(v),
        }
    }
    fn as_bytes_mut(&mut self) -> &mut [u8] {
        match self {
            ZeroedBytes::Mapped(map) => map,
            ZeroedBytes::Heap(v) => bytemuck::cast_slice_mut(v),
        }
    }
}

/// Slot storage in the chosen element type: `len` elements over zeroed
/// bytes (0 is zero in f16 and f32 alike). The bytes are page-aligned
/// (mapped) or 4-byte aligned (heap), so the casts below cannot fail.
#[derive(Debug)]
struct KvStore {
    kind: KvType,
    len: usize,
    bytes: ZeroedBytes,
}

impl KvStore {
    fn new(kind: KvType, len: usize) -> KvStore {
        let width = match kind {
            KvType::F16 => 2,
            KvType::F32 => 4,
        };
        KvStore {
            kind,
            len,
            bytes: ZeroedBytes::new(len * width),
        }
    }
    fn write_row(&mut self, slot: usize, dim: usize, row: &[f32]) {
        let range = slot * dim..(slot + 1) * dim;
        let len = self.len;
        let bytes = self.bytes.as_bytes_mut();
        match self.kind {
            KvType::F16 => {
                let buf: &mut [f16] = bytemuck::cast_slice_mut(&mut bytes[..len * 2]);
                for (dst, &src) in buf[range].iter_mut().zip(row) {
                    *dst = f16::from_f32(src);
                }
            }
            KvType::F32 => {
                let buf: &mut [f32] = bytemuck::cast_slice_mut(&mut bytes[..len * 4]);
                buf[range].copy_from_slice(row);
            }
        }
    }
    fn slice(&self, slots: usize, dim: usize) -> KvSlice<'_> {
        let bytes = self.bytes.as_bytes();
        match self.kind {
            KvType::F16 => KvSlice::F16(bytemuck::cast_slice(&bytes[..slots * dim * 2])),
            KvType::F32 => KvSlice::F32(bytemuck::cast_slice(&bytes[..slots * dim * 4])),
        }
    }
    fn bytes(&self) -> usize {
        match self.kind {
            KvType::F16 => self.len * 2,
            KvType::F32 => self.len * 4,
        }
    }
}

/// The cache of one layer of one sequence.
#[derive(Debug)]
pub struct LayerKvCache {
    layer: usize,
    kv_dim: usize,
    /// Number of slots.
    slots: usize,
    /// Sliding-window layers wrap around (`slot = pos % slots`).
    ring: bool,
    /// Largest position the sequence may reach (the context size).
    max_position: usize,
    keys: KvStore,
    values: KvStore,
    /// Absolute position held by each slot, `usize::MAX` when empty.
    slot_pos: Vec<usize>,
    /// Slots in use are `0..high_water` (the rest were never written).
    high_water: usize,
}

impl LayerKvCache {
    fn new(
        layer: usize,
        kv_dim: usize,
        slots: usize,
        ring: bool,
        ctx: usize,
        kind: KvType,
    ) -> Self {
        LayerKvCache {
            layer,
            kv_dim,
            slots,
            ring,
            max_position: ctx,
            keys: KvStore::new(kind, slots * kv_dim),
            values: KvStore::new(kind, slots * kv_dim),
            slot_pos: vec![usize::MAX; slots],
            high_water: 0,
        }
    }

    /// Bytes held by this layer's keys and values.
    pub fn bytes(&self) -> usize {
        self.keys.bytes() + self.values.bytes()
    }

    /// Slots of this layer.
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// Forget every position at or after `pos`.
    fn truncate(&mut self, pos: usize) {
        for p in self.slot_pos.iter_mut() {
            if *p != usize::MAX && *p >= pos {
                *p = usize::MAX;
            }
        }
    }
}

impl LayerKv for LayerKvCache {
    fn write(&mut self, positions: &[usize], k: &[f32], v: &[f32]) -> Result<(), ModelError> {
        for (i, &pos) in positions.iter().enumerate() {
            if pos >= self.max_position || (!self.ring && pos >= self.slots) {
                return Err(ModelError::KvFull {
                    layer: self.layer,
                    capacity: self.max_position.min(if self.ring {
                        usize::MAX
                    } else {
                        self.slots
                    }),
                    position: pos,
                });
            }
            let slot = if self.ring { pos % self.slots } else { pos };
            let row = i * self.kv_dim..(i + 1) * self.kv_dim;
            self.keys.write_row(slot, self.kv_dim, &k[row.clone()]);
            self.values.write_row(slot, self.kv_dim, &v[row]);
            self.slot_pos[slot] = pos;
            self.high_water = self.high_water.max(slot + 1);
        }
        Ok(())
    }

    fn keys(&self) -> KvSlice<'_> {
        self.keys.slice(self.high_water, self.kv_dim)
    }

    fn values(&self) -> KvSlice<'_> {
        self.values.slice(self.high_water, self.kv_dim)
    }

    fn slot_positions(&self) -> &[usize] {
        &self.slot_pos[..self.high_water]
    }
}

/// The cache of one sequence, all layers.
#[derive(Debug)]
pub struct KvCache {
    layers: Vec<LayerKvCache>,
    capacity: usize,
}

impl KvCache {
    /// A cache for `ctx` positions; windowed layers get `window + max_batch`
    /// ring slots when that is smaller.
    pub fn new(cfg: &ModelConfig, ctx: usize, max_batch: usize, kind: KvType) -> KvCache {
        let layers = (0..cfg.n_layer)
            .map(|il| match cfg.window(il) {
                // Recurrent (delta-net) layers of a hybrid stack keep no KV.
                _ if cfg.arch.layer_memory(cfg, il) == MemoryKind::Recurrent => {
                    LayerKvCache::new(il, cfg.kv_dim(), 0, false, ctx, kind)
                }
                Some(w) if w + max_batch < ctx => {
                    LayerKvCache::new(il, cfg.kv_dim(), w + max_batch, true, ctx, kind)
                }
                _ => LayerKvCache::new(il, cfg.kv_dim(), ctx, false, ctx, kind),
            })
            .collect();
        KvCache {
            layers,
            capacity: ctx,
        }
    }

    /// Positions this cache can hold.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Bytes of every layer's keys and values.
    pub fn bytes(&self) -> usize {
        self.layers.iter().map(|l| l.bytes()).sum()
    }

    /// The cache of layer `il`.
    pub fn layer_mut(&mut self, il: usize) -> Option<&mut LayerKvCache> {
        self.layers.get_mut(il)
    }

    /// Forget every position at or after `pos` (rewinding a sequence).
    pub fn truncate(&mut self, pos: usize) {
        for l in &mut self.layers {
            l.truncate(pos);
        }
    }
}
