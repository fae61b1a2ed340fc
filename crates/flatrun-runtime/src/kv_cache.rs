//! The key/value cache of one sequence: one [`LayerKvCache`] per layer,
//! f16 by default, f32, or blocks of 32 values quantized to 8 or 4 bits
//! (`q8_0`/`q4_0`, llama.cpp's quantized cache types; keys and values each
//! have their own type). Full-attention layers hold one slot per position
//! up to the context size; sliding-window layers hold a ring of `window +
//! max_batch` slots (Gemma 3's local layers need 512 positions, not 32k).
//!
//! Where the bytes live ([`KvBacking`]): an anonymous mapping (the kernel
//! hands out zero pages on first write, so a long context costs memory only
//! as it fills), or a shared mapping of a file (streamed residency). A
//! file-backed layer is handed to the weight engine as [`LayerPages`], like
//! a streamed weight item: the engine's read-ahead thread starts reading the
//! next layer's bytes from the cache's file while this layer runs, and the
//! layer's pages leave the process right after it ran. Only the layers in
//! flight are mapped and the resident set stays flat as the context grows;
//! the page cache holds the rest and writes it back under memory pressure.

use crate::options::KvType;
use flatrun_format::GgmlType;
use flatrun_kernels::ops::{self, KvPager, KvPart, KvSlice};
use flatrun_model::arch::{KvRotation, LayerKv, LayerPlan, MemoryKind};
use flatrun_model::{ModelConfig, ModelError};
use half::f16;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

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
        /// Backed by the cache's file from this offset: pages may be
        /// dropped after use. `None`: anonymous memory.
        file_offset: Option<u64>,
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
            return Bytes::Mapped {
                map,
                file_offset: None,
            };
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
        // A touch of one row maps the whole page-cache folio around it, and
        // the kernel's read-around on a fault builds large folios (up to
        // 2 MiB): a pass over the keys would keep about a folio ahead of
        // it mapped, per thread and per store, past the rows it released.
        // Random access turns the read-around off, so the file's pages are
        // cached (and mapped) 4 KiB at a time; the weight engine reads each
        // layer's pages ahead itself. Nor may a huge page map them. Only
        // memory is at stake, so a kernel without the advice is no error.
        #[cfg(target_os = "linux")]
        {
            let _ = map.advise(memmap2::Advice::NoHugePage);
            let _ = map.advise(memmap2::Advice::Random);
        }
        Ok(Bytes::Mapped {
            map,
            file_offset: Some(offset),
        })
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
    /// Unmap every page of the store from the process (a file-backed store
    /// only: its data stays in the page cache and file).
    fn release_all(&self) {
        self.release_range(0..usize::MAX);
    }
    /// Unmap the pages covering bytes `range` (rounded out to whole pages)
    /// from the process; file-backed stores only.
    fn release_range(&self, range: std::ops::Range<usize>) {
        if let Bytes::Mapped {
            map,
            file_offset: Some(_),
        } = self
        {
            let page = crate::memory::page_size();
            let start = range.start / page * page;
            let end = range.end.min(map.len());
            if end > start {
                let len = end - start;
                // SAFETY: a shared file mapping: DONTNEED drops the page-table
                // entries only; written data stays in the page cache (written
                // back to the file) and the next access faults it back in.
                let _ = unsafe {
                    map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, start, len)
                };
            }
        }
    }
    /// Where the first `len` bytes are in the cache's file (file-backed
    /// stores).
    fn file_span(&self, len: usize) -> Option<(u64, u64)> {
        match self {
            Bytes::Mapped {
                map,
                file_offset: Some(at),
            } => Some((*at, len.min(map.len()) as u64)),
            _ => None,
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
    /// The `out.len() / dim` rows from `slot` on, as f32 (dequantized).
    fn read_rows(&self, slot: usize, dim: usize, out: &mut [f32]) -> Result<(), String> {
        let kind = self.kind;
        let n = out.len();
        let bytes = &self.bytes.as_bytes()[kind.bytes(slot * dim)..kind.bytes(slot * dim + n)];
        match kind {
            KvType::F16 => {
                let src: &[f16] = bytemuck::cast_slice(bytes);
                for (dst, &src) in out.iter_mut().zip(src) {
                    *dst = src.to_f32();
                }
            }
            KvType::F32 => out.copy_from_slice(bytemuck::cast_slice(bytes)),
            KvType::Q8_0 | KvType::Q4_0 => {
                let ty = Self::block_type(kind).unwrap_or(GgmlType::Q8_0);
                flatrun_dequant::dequantize(ty, bytes, out)
                    .map_err(|e| format!("dequantizing {kind} rows: {e}"))?;
            }
        }
        Ok(())
    }
    /// Writes the `rows.len() / dim` rows of `rows` from `slot` on.
    fn write_rows(&mut self, slot: usize, dim: usize, rows: &[f32]) -> Result<(), String> {
        for (i, row) in rows.chunks_exact(dim).enumerate() {
            self.write_row(slot + i, dim, row)?;
        }
        Ok(())
    }
    /// The bytes of the `n` rows from `slot` on.
    fn row_bytes(&self, slot: usize, n: usize, dim: usize) -> &[u8] {
        let kind = self.kind;
        &self.bytes.as_bytes()[kind.bytes(slot * dim)..kind.bytes((slot + n) * dim)]
    }
    /// Overwrites the rows from `slot` on with `bytes` (whole rows).
    fn put_row_bytes(&mut self, slot: usize, dim: usize, bytes: &[u8]) {
        let start = self.kind.bytes(slot * dim);
        self.bytes.as_bytes_mut()[start..start + bytes.len()].copy_from_slice(bytes);
    }
    /// Moves the `n` rows from `from` to `to` (the ranges may overlap).
    fn move_rows(&mut self, from: usize, to: usize, n: usize, dim: usize) {
        let kind = self.kind;
        let src = kind.bytes(from * dim)..kind.bytes((from + n) * dim);
        self.bytes
            .as_bytes_mut()
            .copy_within(src, kind.bytes(to * dim));
    }
}

/// Rows of keys a context shift re-rotates at once (its f32 buffer).
const SHIFT_ROWS: usize = 256;

/// Why a context shift cannot re-rotate a sequence's cache in place (the
/// caller then computes the kept tokens again).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ShiftRefusal {
    /// A hybrid model's recurrent state sums up every token: it cannot lose
    /// some of them.
    Recurrent,
    /// A sliding-window ring no longer holds a position the window needs
    /// once the positions move down (the kept prefix, overwritten long ago).
    RingLost { layer: usize },
    /// A position to keep is not in the cache any more.
    Missing { layer: usize, position: usize },
}

impl std::fmt::Display for ShiftRefusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ShiftRefusal::Recurrent => write!(f, "recurrent state"),
            ShiftRefusal::RingLost { layer } => {
                write!(
                    f,
                    "layer {layer}: the sliding-window ring lost a needed position"
                )
            }
            ShiftRefusal::Missing { layer, position } => {
                write!(f, "layer {layer}: position {position} is not cached")
            }
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
    /// The attention window of a sliding-window layer.
    window: Option<usize>,
    /// Largest position the sequence may reach (the context size).
    max_position: usize,
    keys: KvStore,
    values: KvStore,
    /// Absolute position held by each slot, `usize::MAX` when empty; at
    /// least `high_water` long. `None` while slot `j` holds position `j`
    /// for every `j < high_water` (a full-attention layer filled in order,
    /// the usual case): the table is then the cache's shared `identity`,
    /// and a long context costs no table per layer.
    slot_pos: Option<Vec<usize>>,
    /// `0, 1, 2, …` up to the cache's slots, shared by its layers.
    identity: Arc<[usize]>,
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
        match &mut self.slot_pos {
            // Slots hold their own positions: the first `pos` stay.
            None => self.high_water = self.high_water.min(pos),
            Some(table) => {
                for p in table.iter_mut() {
                    if *p != usize::MAX && *p >= pos {
                        *p = usize::MAX;
                    }
                }
            }
        }
    }

    /// The slot table as a vector of its own (from here on).
    fn own_table(&mut self) -> &mut Vec<usize> {
        let high_water = self.high_water;
        self.slot_pos
            .get_or_insert_with(|| (0..high_water).collect())
    }

    /// Record that `slot` holds `pos` (and that slots up to it are in
    /// use). A layer whose slots hold their own positions keeps sharing the
    /// identity table while writes go on in order; anything else (a ring
    /// that wrapped, a gap) gives it a table of its own, grown as slots are
    /// first written.
    fn set_slot(&mut self, slot: usize, pos: usize) {
        let in_order = slot == pos && slot <= self.high_water && slot < self.identity.len();
        if self.slot_pos.is_some() || !in_order {
            let table = self.own_table();
            if slot >= table.len() {
                table.resize(slot + 1, usize::MAX);
            }
            table[slot] = pos;
        }
        self.high_water = self.high_water.max(slot + 1);
    }

    /// The slot holding `pos`, if it still holds it.
    fn slot_of(&self, pos: usize) -> Option<usize> {
        let slot = if self.ring { pos % self.slots } else { pos };
        (slot < self.high_water && self.slot_positions()[slot] == pos).then_some(slot)
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
            self.set_slot(slot, pos);
        }
        true
    }

    /// The positions a shift of a `len`-token sequence keeps (old
    /// position, new position), those it re-rotates last; a ring keeps
    /// only what it can still hold.
    fn shift_moves(&self, keep: usize, dropped: usize, len: usize) -> Vec<(usize, usize)> {
        let new_len = len - dropped;
        let first = if self.ring {
            new_len.saturating_sub(self.slots)
        } else {
            0
        };
        (first..new_len)
            .map(|p| (if p < keep { p } else { p + dropped }, p))
            .collect()
    }

    /// Why this layer cannot be shifted in place, if it cannot: a position
    /// attention will need afterwards is not held.
    fn shift_refusal(&self, keep: usize, dropped: usize, len: usize) -> Option<ShiftRefusal> {
        let new_len = len - dropped;
        // What the next positions attend to: all of them, or the window.
        let needed = self.window.map_or(0, |w| new_len.saturating_sub(w));
        for (old, new) in self.shift_moves(keep, dropped, len) {
            if self.slot_of(old).is_none() && (new >= needed || !self.ring) {
                return Some(if self.ring {
                    ShiftRefusal::RingLost { layer: self.layer }
                } else {
                    ShiftRefusal::Missing {
                        layer: self.layer,
                        position: old,
                    }
                });
            }
        }
        None
    }

    /// Context shift of a sequence of `len` positions: positions
    /// `keep..keep + dropped` go, later ones move down by `dropped` (their
    /// slots too), each moved key row re-rotated by RoPE of −dropped; values
    /// only move. Quantized keys are dequantized, the Hadamard rotation
    /// undone, rotated, the Hadamard redone and quantized again. `buf` is
    /// scratch. Check [`Self::shift_refusal`] first.
    fn shift(
        &mut self,
        keep: usize,
        dropped: usize,
        len: usize,
        plan: &LayerPlan,
        buf: &mut Vec<f32>,
    ) -> Result<(), ModelError> {
        if self.slots == 0 || dropped == 0 {
            return Ok(());
        }
        let dim = self.kv_dim;
        let layer = self.layer;
        let kernel = move |what| ModelError::Kernel {
            layer,
            op: "kv cache shift",
            what,
        };
        let (n_kv_head, head_dim) = (plan.attn.n_kv_head, plan.attn.head_dim);
        let hadamard = self.rotation.keys;
        // k = H·rope(H·k, −dropped): H undoes itself, rope moves the angle.
        let rerotate = |rows: &mut [f32]| {
            if let Some(n) = hadamard {
                ops::hadamard(rows, n);
            }
            ops::rope_shift(rows, n_kv_head, head_dim, -(dropped as i64), &plan.rope);
            if let Some(n) = hadamard {
                ops::hadamard(rows, n);
            }
        };
        let new_len = len - dropped;
        if !self.ring {
            // slot == position: rows move down in place, a block at a time
            // (a row is read before any row lands on it).
            let from = keep + dropped;
            let moved = len - from;
            self.values.move_rows(from, keep, moved, dim);
            buf.resize(SHIFT_ROWS.min(moved.max(1)) * dim, 0.0);
            for start in (from..len).step_by(SHIFT_ROWS) {
                let rows = &mut buf[..SHIFT_ROWS.min(len - start) * dim];
                self.keys.read_rows(start, dim, rows).map_err(kernel)?;
                rerotate(rows);
                self.keys
                    .write_rows(start - dropped, dim, rows)
                    .map_err(kernel)?;
            }
            if let Some(table) = &mut self.slot_pos {
                for (slot, p) in table.iter_mut().enumerate().skip(keep) {
                    *p = if slot < new_len { slot } else { usize::MAX };
                }
            }
            self.high_water = self.high_water.min(new_len);
            return Ok(());
        }
        // A ring: slot = position % slots, so every kept row changes slot.
        // Gather them (moved keys as f32, the rest as bytes), then scatter.
        let moves: Vec<(usize, usize, usize)> = self
            .shift_moves(keep, dropped, len)
            .into_iter()
            .filter_map(|(old, new)| self.slot_of(old).map(|slot| (slot, old, new)))
            .collect();
        let moved = moves.iter().filter(|&&(_, old, new)| old != new).count();
        buf.resize(moved * dim, 0.0);
        let mut key_bytes = Vec::new();
        let mut value_bytes = Vec::with_capacity(self.values.kind.bytes(moves.len() * dim));
        let mut next = 0;
        for &(slot, old, new) in &moves {
            if old != new {
                let row = &mut buf[next * dim..(next + 1) * dim];
                self.keys.read_rows(slot, dim, row).map_err(kernel)?;
                next += 1;
            } else {
                key_bytes.extend_from_slice(self.keys.row_bytes(slot, 1, dim));
            }
            value_bytes.extend_from_slice(self.values.row_bytes(slot, 1, dim));
        }
        rerotate(&mut buf[..moved * dim]);
        self.own_table().fill(usize::MAX);
        let (key_row, value_row) = (self.keys.kind.bytes(dim), self.values.kind.bytes(dim));
        let (mut next, mut unmoved) = (0, 0);
        for (i, &(_, old, new)) in moves.iter().enumerate() {
            let slot = new % self.slots;
            if old != new {
                let row = &buf[next * dim..(next + 1) * dim];
                self.keys.write_row(slot, dim, row).map_err(kernel)?;
                next += 1;
            } else {
                let bytes = &key_bytes[unmoved * key_row..(unmoved + 1) * key_row];
                self.keys.put_row_bytes(slot, dim, bytes);
                unmoved += 1;
            }
            let bytes = &value_bytes[i * value_row..(i + 1) * value_row];
            self.values.put_row_bytes(slot, dim, bytes);
            self.set_slot(slot, new);
        }
        Ok(())
    }

    /// Whether the keys or the values live in the cache's file (each store
    /// falls back to anonymous memory when its mapping cannot be made).
    fn in_file(&self) -> bool {
        self.keys.bytes.file_span(0).is_some() || self.values.bytes.file_span(0).is_some()
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
            self.set_slot(slot, pos);
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
        let table = self.slot_pos.as_deref().unwrap_or(&self.identity);
        &table[..self.high_water.min(table.len())]
    }

    fn rotation(&self) -> KvRotation {
        self.rotation
    }

    fn pager(&self) -> Option<&dyn KvPager> {
        self.in_file().then_some(self)
    }
}

/// Attention's passes over a file-backed layer drop the rows they went past.
impl KvPager for LayerKvCache {
    fn passed(&self, part: KvPart, slots: std::ops::Range<usize>) {
        let store = match part {
            KvPart::Keys => &self.keys,
            KvPart::Values => &self.values,
        };
        let bytes = |slot: usize| store.kind.bytes(slot * self.kv_dim);
        store
            .bytes
            .release_range(bytes(slots.start)..bytes(slots.end));
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

/// One layer of a file-backed cache as the weight engine handles it: where
/// its written keys and values are in the cache's file (read ahead from the
/// descriptor, as a streamed weight item is) and the same bytes as mapped
/// (dropped from the process once the layer ran).
pub struct LayerPages<'a> {
    file: &'a Arc<File>,
    /// The keys' and the values' stores (both in `file`) and their written
    /// lengths.
    stores: [(&'a Bytes, usize); 2],
}

impl LayerPages<'_> {
    /// Bytes of keys and values written so far.
    pub fn bytes(&self) -> u64 {
        self.stores.iter().map(|&(_, len)| len as u64).sum()
    }

    /// A request to read these bytes ahead that owns what it needs (the
    /// file stays open while it waits in a queue).
    pub fn ahead(&self) -> PagesAhead {
        let span = |(store, len): (&Bytes, usize)| store.file_span(len).unwrap_or((0, 0));
        PagesAhead {
            file: self.file.clone(),
            spans: self.stores.map(span),
        }
    }

    /// Unmap the pages from the process. They stay in the page cache (and
    /// are written back to the file), and fault back in on the next touch.
    pub fn release(self) {
        // The whole mapping, not just the rows written when this was taken:
        // the rows the layer wrote since, and pages mapped around the last
        // ones, go too.
        for (store, _) in self.stores {
            store.release_all();
        }
    }
}

/// Bytes of a file-backed layer to bring into the page cache ahead of use.
#[derive(Debug)]
pub struct PagesAhead {
    file: Arc<File>,
    spans: [(u64, u64); 2],
}

impl PagesAhead {
    /// Ask the system to start reading the bytes in; returns at once.
    pub fn start(&self) {
        for &(offset, len) in &self.spans {
            if len > 0 {
                crate::memory::will_need(&self.file, offset, len);
            }
        }
    }

    /// Bytes asked for.
    pub fn bytes(&self) -> u64 {
        self.spans.iter().map(|&(_, len)| len).sum()
    }
}

/// The cache of one sequence, all layers.
#[derive(Debug)]
pub struct KvCache {
    layers: Vec<LayerKvCache>,
    capacity: usize,
    /// The file a file-backed cache maps (kept open for reading ahead).
    file: Option<Arc<File>>,
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
        let identity: Arc<[usize]> =
            (0..shape.iter().map(|&(n, _)| n).max().unwrap_or(0)).collect();
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
                slot_pos: None,
                identity: identity.clone(),
                high_water: 0,
                rotation,
            })
            .collect();
        KvCache {
            layers,
            capacity: ctx,
            file: file.map(Arc::new),
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

    /// Context shift of a sequence of `len` positions (see
    /// [`LayerKvCache`]'s): every layer, or none when one cannot (then
    /// nothing changed and the refusal says why). `plans` are the layers'
    /// RoPE settings.
    pub fn shift(
        &mut self,
        keep: usize,
        dropped: usize,
        len: usize,
        plans: &[LayerPlan],
    ) -> Result<Option<ShiftRefusal>, ModelError> {
        debug_assert!(keep + dropped <= len && len <= self.capacity);
        if let Some(refusal) = self
            .layers
            .iter()
            .filter(|l| l.slots > 0)
            .find_map(|l| l.shift_refusal(keep, dropped, len))
        {
            return Ok(Some(refusal));
        }
        let mut buf = Vec::new();
        for (layer, plan) in self.layers.iter_mut().zip(plans) {
            layer.shift(keep, dropped, len, plan, &mut buf)?;
        }
        Ok(None)
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

    /// Layer `il`'s written bytes, when the cache lives in a file: what the
    /// weight engine reads ahead and releases. `None` for anonymous memory
    /// (and layers without a cache).
    pub fn layer_pages(&self, il: usize) -> Option<LayerPages<'_>> {
        let l = self.layers.get(il).filter(|l| l.in_file())?;
        let file = self.file.as_ref()?;
        let (k, v) = l.used_bytes();
        Some(LayerPages {
            file,
            stores: [(&l.keys.bytes, k), (&l.values.bytes, v)],
        })
    }

    /// Whether the cache lives in a file mapping.
    pub fn is_file_backed(&self) -> bool {
        self.layers.iter().any(LayerKvCache::in_file)
    }
}

#[cfg(test)]
mod shift_tests {
    use super::*;
    use flatrun_kernels::ops::{AttnConfig, RopeConfig, RopeLayout, RopeScaling};

    const HEAD_DIM: usize = 64;
    const N_KV_HEAD: usize = 2;
    const DIM: usize = HEAD_DIM * N_KV_HEAD;

    fn plan(layout: RopeLayout, n_rot: usize, window: Option<usize>) -> LayerPlan {
        LayerPlan {
            index: 0,
            rope: RopeConfig {
                layout,
                n_rot,
                theta_base: 10000.0,
                scaling: RopeScaling::None,
                freq_factors: None,
            },
            attn: AttnConfig {
                n_head: N_KV_HEAD,
                n_kv_head: N_KV_HEAD,
                head_dim: HEAD_DIM,
                scale: 1.0,
                window,
                softcap: None,
            },
            q_scale: None,
            qk_halves_to_pairs: false,
        }
    }

    fn layer(kind: KvType, slots: usize, ring: bool, window: Option<usize>) -> LayerKvCache {
        let store = |kind: KvType| KvStore {
            kind,
            len: slots * DIM,
            bytes: Bytes::anonymous(kind.bytes(slots * DIM)),
        };
        LayerKvCache {
            layer: 0,
            kv_dim: DIM,
            slots,
            ring,
            window,
            max_position: 4096,
            keys: store(kind),
            values: store(kind),
            slot_pos: None,
            identity: (0..slots).collect(),
            high_water: 0,
            rotation: KvRotation::for_cache(HEAD_DIM, kind.is_block(), kind.is_block()),
        }
    }

    /// The unrotated key of token `t` (its value is the same row).
    fn raw(t: usize) -> Vec<f32> {
        (0..DIM)
            .map(|i| (((i * 31 + t * 97) % 201) as f32 / 100.0) - 1.0)
            .collect()
    }

    /// The row the decoder writes for token `t` at `pos`: rope, then H.
    fn key(t: usize, pos: usize, plan: &LayerPlan, rot: KvRotation) -> Vec<f32> {
        let mut k = raw(t);
        ops::rope(&mut k, N_KV_HEAD, HEAD_DIM, &[pos], &plan.rope);
        if let Some(n) = rot.keys {
            ops::hadamard(&mut k, n);
        }
        k
    }

    fn value(t: usize, rot: KvRotation) -> Vec<f32> {
        let mut v = raw(t + 1000);
        if let Some(n) = rot.values {
            ops::hadamard(&mut v, n);
        }
        v
    }

    /// The f32 row of `store` in `slot`.
    fn row(store: &KvStore, slot: usize) -> Vec<f32> {
        let mut out = vec![0.0; DIM];
        store.read_rows(slot, DIM, &mut out).unwrap();
        out
    }

    fn max_diff(a: &[f32], b: &[f32]) -> f32 {
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f32::max)
    }

    /// Writes `len` tokens, shifts, and checks every kept position holds
    /// the key written directly at its new position (within `tol`) and its
    /// value unchanged.
    fn check(kind: KvType, layout: RopeLayout, n_rot: usize, ring: Option<usize>, tol: f32) {
        let (len, keep, dropped) = (300, 5, 120);
        let window = ring.map(|_| 128);
        let slots = ring.unwrap_or(512);
        let plan = plan(layout, n_rot, window);
        let mut l = layer(kind, slots, ring.is_some(), window);
        let rot = l.rotation;
        for pos in 0..len {
            l.write(&[pos], &key(pos, pos, &plan, rot), &value(pos, rot))
                .unwrap();
        }
        assert_eq!(l.shift_refusal(keep, dropped, len), None);
        let mut buf = Vec::new();
        l.shift(keep, dropped, len, &plan, &mut buf).unwrap();
        let new_len = len - dropped;
        let first = if ring.is_some() {
            new_len - window.unwrap()
        } else {
            0
        };
        let mut worst = 0f32;
        for new in first..new_len {
            let t = if new < keep { new } else { new + dropped };
            let slot = l.slot_of(new).unwrap_or_else(|| panic!("{new} not held"));
            let want = key(t, new, &plan, rot);
            // Quantized rows are compared with what quantizing the direct
            // row gives: the shift adds one requantization's error.
            let mut direct = layer(kind, 1, false, None);
            direct.write(&[0], &want, &want).unwrap();
            worst = worst.max(max_diff(&row(&l.keys, slot), &row(&direct.keys, 0)));
            let mut v = layer(kind, 1, false, None);
            v.write(&[0], &value(t, rot), &value(t, rot)).unwrap();
            assert_eq!(row(&l.values, slot), row(&v.values, 0), "value of {new}");
        }
        assert!(
            worst <= tol,
            "{kind} {layout:?} n_rot {n_rot} ring {ring:?}: keys off by {worst}"
        );
        // Nothing past the new end, and later writes go on from there.
        assert!(l.slot_of(new_len).is_none());
        if ring.is_none() {
            assert_eq!(l.slot_positions().len(), new_len);
        }
        assert!(
            l.slot_positions()
                .iter()
                .all(|&p| p == usize::MAX || p < new_len)
        );
    }

    #[test]
    fn shifted_keys_equal_keys_written_at_the_new_positions() {
        for layout in [RopeLayout::Normal, RopeLayout::Neox] {
            for n_rot in [HEAD_DIM, HEAD_DIM / 2] {
                check(KvType::F32, layout, n_rot, None, 1e-4);
                check(KvType::F16, layout, n_rot, None, 2e-3);
                check(KvType::Q8_0, layout, n_rot, None, 5e-2);
                check(KvType::Q4_0, layout, n_rot, None, 0.5);
            }
        }
    }

    #[test]
    fn a_ring_moves_its_rows_to_their_new_slots() {
        for kind in [KvType::F32, KvType::Q8_0] {
            let tol = if kind == KvType::F32 { 1e-4 } else { 5e-2 };
            check(kind, RopeLayout::Neox, HEAD_DIM, Some(192), tol);
        }
    }

    #[test]
    fn two_shifts_equal_one_by_their_sum() {
        for kind in [KvType::F32, KvType::F16] {
            let plan = plan(RopeLayout::Neox, HEAD_DIM, None);
            let fill = || {
                let mut l = layer(kind, 512, false, None);
                for pos in 0..300 {
                    let rot = l.rotation;
                    l.write(&[pos], &key(pos, pos, &plan, rot), &value(pos, rot))
                        .unwrap();
                }
                l
            };
            let (mut twice, mut once, mut buf) = (fill(), fill(), Vec::new());
            twice.shift(6, 40, 300, &plan, &mut buf).unwrap();
            twice.shift(6, 70, 260, &plan, &mut buf).unwrap();
            once.shift(6, 110, 300, &plan, &mut buf).unwrap();
            assert_eq!(twice.slot_positions(), once.slot_positions());
            let mut worst = 0f32;
            for slot in 0..190 {
                worst = worst.max(max_diff(&row(&twice.keys, slot), &row(&once.keys, slot)));
                assert_eq!(row(&twice.values, slot), row(&once.values, slot));
            }
            eprintln!("{kind}: twice vs once {worst:e}");
            assert!(worst < 2e-3, "{kind}: {worst}");
        }
    }

    #[test]
    fn a_ring_that_lost_the_kept_prefix_refuses() {
        let mut l = layer(KvType::F16, 192, true, Some(128));
        for pos in 0..300 {
            l.write(&[pos], &raw(pos), &raw(pos)).unwrap();
        }
        // After dropping 200 the window reaches back to the kept prefix,
        // overwritten long ago.
        assert_eq!(
            l.shift_refusal(5, 200, 300),
            Some(ShiftRefusal::RingLost { layer: 0 })
        );
        assert_eq!(l.shift_refusal(5, 100, 300), None);
    }
}
