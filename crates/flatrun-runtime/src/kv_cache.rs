//! The key/value cache of one sequence: one [`LayerKvCache`] per layer,
//! f16 by default, f32, or blocks of 32 values quantized to 8 or 4 bits
//! (`q8_0`/`q4_0`, llama.cpp's quantized cache types; keys and values each
//! have their own type). Full-attention layers hold one slot per position
//! up to the context size; sliding-window layers hold a ring of `window +
//! max_batch` slots (Gemma 3's local layers need 512 positions, not 32k).
//!
//! Where the bytes live ([`KvBacking`]): an anonymous mapping (the kernel
//! hands out zero pages on first write, so a long context costs memory only
//! as it fills), or a shared mapping of a file (streamed residency): the
//! executor releases a layer's pages right after the layer ran
//! ([`KvCache::release_layer`]) and asks for the next layer's ahead of use
//! ([`KvCache::prefetch_layer`]), so only the layers in flight are mapped
//! and the resident set stays flat as the context grows; the page cache
//! holds the rest and writes it back under memory pressure.

use crate::options::KvType;
use flatrun_format::GgmlType;
use flatrun_kernels::ops::KvSlice;
use flatrun_model::arch::{KvRotation, LayerKv, MemoryKind};
use flatrun_model::{ModelConfig, ModelError};
use half::f16;
use std::path::{Path, PathBuf};

/// Where a sequence's cache keeps its bytes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum KvBacking {
    /// Anonymous memory (resident residency).
    #[default]
    Anonymous,
    /// A shared mapping of a file created in the directory of `path` (a
    /// file named after `path`, removed as soon as it is open, so nothing
    /// is left behind), or an unnamed temporary file when `None`.
    File(Option<PathBuf>),
}

/// Bytes of one store, in their own mapping.
#[derive(Debug)]
enum Bytes {
    /// Anonymous or file-backed mapping (page-aligned).
    Mapped {
        map: memmap2::MmapMut,
        /// Backed by a file: pages may be dropped after use.
        file: bool,
    },
    /// `u32` elements: 4-byte alignment, enough for f16 and f32 (when a
    /// mapping cannot be made).
    Heap(Vec<u32>),
}

impl Bytes {
    fn anonymous(bytes: usize) -> Bytes {
        if bytes > 0
            && let Ok(map) = memmap2::MmapMut::map_anon(bytes)
        {
            return Bytes::Mapped { map, file: false };
        }
        Bytes::Heap(vec![0u32; bytes.div_ceil(4)])
    }
    /// `len` bytes of `file` from `offset` (page-aligned), zero until written.
    fn file(file: &std::fs::File, offset: u64, len: usize) -> std::io::Result<Bytes> {
        if len == 0 {
            return Ok(Bytes::Heap(Vec::new()));
        }
        // SAFETY: the file is private to this cache (created and unlinked by
        // `open_cache_file`), so no other process or mapping changes it
        // under us; every store maps its own disjoint, page-aligned range.
        let map = unsafe {
            memmap2::MmapOptions::new()
                .offset(offset)
                .len(len)
                .map_mut(file)?
        };
        Ok(Bytes::Mapped { map, file: true })
    }
    fn as_bytes(&self) -> &[u8] {
        match self {
            Bytes::Mapped { map, .. } => map,
            Bytes::Heap(v) => bytemuck::cast_slice(v),
        }
    }
    fn as_bytes_mut(&mut self) -> &mut [u8] {
        match self {
            Bytes::Mapped { map, .. } => map,
            Bytes::Heap(v) => bytemuck::cast_slice_mut(v),
        }
    }
    /// Unmap the pages of the first `len` bytes from the process (a
    /// file-backed store only: its data stays in the page cache and file).
    fn release(&self, len: usize) {
        if let Bytes::Mapped { map, file: true } = self {
            let len = len.min(map.len());
            if len > 0 {
                // SAFETY: a shared file mapping: DONTNEED drops the page-table
                // entries only; written data stays in the page cache (written
                // back to the file) and the next access faults it back in.
                let _ = unsafe {
                    map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, 0, len)
                };
            }
        }
    }
    /// Start reading the first `len` bytes in (file-backed stores).
    fn prefetch(&self, len: usize) {
        if let Bytes::Mapped { map, file: true } = self {
            let len = len.min(map.len());
            if len > 0 {
                let _ = map.advise_range(memmap2::Advice::WillNeed, 0, len);
            }
        }
    }
}

/// Slot storage in the chosen element type: `len` elements over zeroed
/// bytes (0 is zero in every type). The bytes are page-aligned (mapped) or
/// 4-byte aligned (heap), so the casts below cannot fail.
#[derive(Debug)]
struct KvStore {
    kind: KvType,
    len: usize,
    bytes: Bytes,
}

impl KvStore {
    /// The ggml block type of a quantized store.
    fn block_type(kind: KvType) -> Option<GgmlType> {
        match kind {
            KvType::Q8_0 => Some(GgmlType::Q8_0),
            KvType::Q4_0 => Some(GgmlType::Q4_0),
            KvType::F16 | KvType::F32 => None,
        }
    }
    fn write_row(&mut self, slot: usize, dim: usize, row: &[f32]) -> Result<(), String> {
        let kind = self.kind;
        let total = kind.bytes(self.len);
        let bytes = &mut self.bytes.as_bytes_mut()[..total];
        match kind {
            KvType::F16 => {
                let buf: &mut [f16] = bytemuck::cast_slice_mut(bytes);
                for (dst, &src) in buf[slot * dim..(slot + 1) * dim].iter_mut().zip(row) {
                    *dst = f16::from_f32(src);
                }
            }
            KvType::F32 => {
                let buf: &mut [f32] = bytemuck::cast_slice_mut(bytes);
                buf[slot * dim..(slot + 1) * dim].copy_from_slice(&row[..dim]);
            }
            KvType::Q8_0 | KvType::Q4_0 => {
                let ty = Self::block_type(kind).unwrap_or(GgmlType::Q8_0);
                let dst = &mut bytes[kind.bytes(slot * dim)..kind.bytes((slot + 1) * dim)];
                flatrun_dequant::quantize(ty, &row[..dim], dst)
                    .map_err(|e| format!("quantizing a {kind} row: {e}"))?;
            }
        }
        Ok(())
    }
    fn slice(&self, slots: usize, dim: usize) -> KvSlice<'_> {
        let bytes = &self.bytes.as_bytes()[..self.kind.bytes(slots * dim)];
        match self.kind {
            KvType::F16 => KvSlice::F16(bytemuck::cast_slice(bytes)),
            KvType::F32 => KvSlice::F32(bytemuck::cast_slice(bytes)),
            KvType::Q8_0 => KvSlice::Q8_0(bytes),
            KvType::Q4_0 => KvSlice::Q4_0(bytes),
        }
    }
    fn bytes(&self) -> usize {
        self.kind.bytes(self.len)
    }
    /// Copies `src`'s row in `src_slot` (same type and width) into `slot`.
    fn copy_row(&mut self, slot: usize, src: &KvStore, src_slot: usize, dim: usize) {
        let kind = self.kind;
        let from =
            &src.bytes.as_bytes()[kind.bytes(src_slot * dim)..kind.bytes((src_slot + 1) * dim)];
        self.bytes.as_bytes_mut()[kind.bytes(slot * dim)..kind.bytes((slot + 1) * dim)]
            .copy_from_slice(from);
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
    /// The attention window of a sliding-window layer.
    window: Option<usize>,
    /// Largest position the sequence may reach (the context size).
    max_position: usize,
    keys: KvStore,
    values: KvStore,
    /// Absolute position held by each slot, `usize::MAX` when empty.
    slot_pos: Vec<usize>,
    /// Slots in use are `0..high_water` (the rest were never written).
    high_water: usize,
    /// The rotation quantized rows are stored under.
    rotation: KvRotation,
}

impl LayerKvCache {
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

    /// The slot holding `pos`, if it still holds it.
    fn slot_of(&self, pos: usize) -> Option<usize> {
        let slot = if self.ring { pos % self.slots } else { pos };
        (slot < self.high_water && self.slot_pos[slot] == pos).then_some(slot)
    }

    /// Copies what attention at position `len` needs of `src`'s first `len`
    /// positions (all of them, or a sliding window's last `window`) into
    /// this empty layer; false when `src` no longer holds one of them (a
    /// ring that moved past it) or the shapes differ.
    fn copy_prefix_from(&mut self, src: &LayerKvCache, len: usize) -> bool {
        if self.kv_dim != src.kv_dim
            || self.keys.kind != src.keys.kind
            || self.values.kind != src.values.kind
        {
            return false;
        }
        let mut first = self.window.map_or(0, |w| len.saturating_sub(w));
        if self.ring {
            first = first.max(len.saturating_sub(self.slots));
        }
        for pos in first..len {
            let Some(from) = src.slot_of(pos) else {
                return false;
            };
            let slot = if self.ring { pos % self.slots } else { pos };
            if slot >= self.slots {
                return false;
            }
            self.keys.copy_row(slot, &src.keys, from, self.kv_dim);
            self.values.copy_row(slot, &src.values, from, self.kv_dim);
            self.slot_pos[slot] = pos;
            self.high_water = self.high_water.max(slot + 1);
        }
        true
    }

    /// Bytes of the written slots of keys and values.
    fn used_bytes(&self) -> (usize, usize) {
        let n = self.high_water * self.kv_dim;
        (self.keys.kind.bytes(n), self.values.kind.bytes(n))
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
            let layer = self.layer;
            let kernel = move |what| ModelError::Kernel {
                layer,
                op: "kv cache write",
                what,
            };
            self.keys
                .write_row(slot, self.kv_dim, &k[row.clone()])
                .map_err(kernel)?;
            self.values
                .write_row(slot, self.kv_dim, &v[row])
                .map_err(kernel)?;
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

    fn rotation(&self) -> KvRotation {
        self.rotation
    }
}

/// The shape of a cache: per layer, its slots and whether they form a ring.
fn layer_slots(cfg: &ModelConfig, ctx: usize, max_batch: usize) -> Vec<(usize, bool)> {
    (0..cfg.n_layer)
        .map(|il| match cfg.window(il) {
            // Recurrent (delta-net) layers of a hybrid stack keep no KV.
            _ if cfg.arch.layer_memory(cfg, il) == MemoryKind::Recurrent => (0, false),
            Some(w) if w + max_batch < ctx => (w + max_batch, true),
            _ => (ctx, false),
        })
        .collect()
}

/// A fresh file for a streamed cache: in the directory of `path` (named
/// after it) or the system's temporary directory, unlinked right away so
/// that it disappears with the last mapping.
fn open_cache_file(path: Option<&Path>) -> std::io::Result<std::fs::File> {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let name = format!("{}.{}.{n}", "flatrun-kv", std::process::id());
    let target = match path {
        Some(p) if p.is_dir() => p.join(name),
        Some(p) => {
            let mut s = p.as_os_str().to_owned();
            s.push(format!(".{}.{n}", std::process::id()));
            PathBuf::from(s)
        }
        None => std::env::temp_dir().join(name),
    };
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(&target)?;
    let _ = std::fs::remove_file(&target);
    Ok(file)
}

/// The cache of one sequence, all layers.
#[derive(Debug)]
pub struct KvCache {
    layers: Vec<LayerKvCache>,
    capacity: usize,
}

/// Element types of keys and values, and the storage of a new cache.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KvLayout {
    pub keys: KvType,
    pub values: KvType,
    pub backing: KvBacking,
}

impl KvLayout {
    /// f16 or f32 keys and values in anonymous memory.
    pub fn plain(kind: KvType) -> KvLayout {
        KvLayout {
            keys: kind,
            values: kind,
            backing: KvBacking::Anonymous,
        }
    }
}

impl KvCache {
    /// A cache for `ctx` positions; windowed layers get `window + max_batch`
    /// ring slots when that is smaller. A file-backed cache whose file
    /// cannot be made falls back to anonymous memory.
    pub fn new(cfg: &ModelConfig, ctx: usize, max_batch: usize, kind: KvType) -> KvCache {
        Self::with_layout(cfg, ctx, max_batch, &KvLayout::plain(kind))
    }

    /// [`KvCache::new`] with separate key and value types and a backing.
    pub fn with_layout(
        cfg: &ModelConfig,
        ctx: usize,
        max_batch: usize,
        layout: &KvLayout,
    ) -> KvCache {
        let kv_dim = cfg.kv_dim();
        let shape = layer_slots(cfg, ctx, max_batch);
        let page = crate::memory::page_size();
        let rotation = KvRotation::for_cache(
            cfg.head_dim,
            layout.keys.is_block(),
            layout.values.is_block(),
        );
        let sizes: Vec<(usize, usize)> = shape
            .iter()
            .map(|&(slots, _)| {
                (
                    layout.keys.bytes(slots * kv_dim),
                    layout.values.bytes(slots * kv_dim),
                )
            })
            .collect();
        let file = match &layout.backing {
            KvBacking::Anonymous => None,
            KvBacking::File(path) => open_cache_file(path.as_deref()).ok().and_then(|f| {
                let total: usize = sizes
                    .iter()
                    .map(|(k, v)| k.next_multiple_of(page) + v.next_multiple_of(page))
                    .sum();
                f.set_len(total as u64).ok().map(|_| f)
            }),
        };
        let mut offset = 0u64;
        let mut store = |kind: KvType, len: usize, bytes: usize| {
            let data = match &file {
                Some(f) => {
                    let b =
                        Bytes::file(f, offset, bytes).unwrap_or_else(|_| Bytes::anonymous(bytes));
                    offset += bytes.next_multiple_of(page) as u64;
                    b
                }
                None => Bytes::anonymous(bytes),
            };
            KvStore {
                kind,
                len,
                bytes: data,
            }
        };
        let layers = shape
            .iter()
            .zip(&sizes)
            .enumerate()
            .map(|(il, (&(slots, ring), &(kb, vb)))| LayerKvCache {
                layer: il,
                kv_dim,
                slots,
                ring,
                window: cfg.window(il),
                max_position: ctx,
                keys: store(layout.keys, slots * kv_dim, kb),
                values: store(layout.values, slots * kv_dim, vb),
                slot_pos: vec![usize::MAX; slots],
                high_water: 0,
                rotation,
            })
            .collect();
        KvCache {
            layers,
            capacity: ctx,
        }
    }

    /// Bytes a cache of this shape holds at `ctx` positions, per layer,
    /// without making one.
    pub fn planned_layer_bytes(
        cfg: &ModelConfig,
        ctx: usize,
        max_batch: usize,
        keys: KvType,
        values: KvType,
    ) -> Vec<u64> {
        let kv_dim = cfg.kv_dim();
        layer_slots(cfg, ctx, max_batch)
            .iter()
            .map(|&(slots, _)| (keys.bytes(slots * kv_dim) + values.bytes(slots * kv_dim)) as u64)
            .collect()
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

    /// Forget every position at or after `pos` (rewinding a sequence):
    /// constant work per slot, whatever the element type or backing.
    pub fn truncate(&mut self, pos: usize) {
        for l in &mut self.layers {
            l.truncate(pos);
        }
    }

    /// Bytes of the slots written so far (what the cache really occupies:
    /// the rest of its mapping was never touched).
    pub fn used_bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| {
                let (k, v) = l.used_bytes();
                k + v
            })
            .sum()
    }

    /// Fills this empty cache with what `src` holds of positions `0..len`
    /// (a shared prompt prefix), layer by layer: afterwards the cache
    /// continues at position `len` exactly as `src` would. False (the cache
    /// is then unusable) when `src` does not hold them all any more (a
    /// sliding-window ring that moved on) or the caches differ in shape.
    pub fn copy_prefix_from(&mut self, src: &KvCache, len: usize) -> bool {
        len <= self.capacity
            && self.layers.len() == src.layers.len()
            && self
                .layers
                .iter_mut()
                .zip(&src.layers)
                .all(|(dst, src)| dst.copy_prefix_from(src, len))
    }

    /// A file-backed cache: unmap layer `il`'s pages (they stay in the page
    /// cache and the file). Nothing for anonymous memory.
    pub fn release_layer(&self, il: usize) {
        if let Some(l) = self.layers.get(il) {
            let (k, v) = l.used_bytes();
            l.keys.bytes.release(k);
            l.values.bytes.release(v);
        }
    }

    /// A file-backed cache: start reading layer `il`'s written pages in.
    pub fn prefetch_layer(&self, il: usize) {
        if let Some(l) = self.layers.get(il) {
            let (k, v) = l.used_bytes();
            l.keys.bytes.prefetch(k);
            l.values.bytes.prefetch(v);
        }
    }

    /// Whether the cache lives in a file mapping.
    pub fn is_file_backed(&self) -> bool {
        self.layers.iter().any(|l| {
            matches!(l.keys.bytes, Bytes::Mapped { file: true, .. })
                || matches!(l.values.bytes, Bytes::Mapped { file: true, .. })
        })
    }
}
