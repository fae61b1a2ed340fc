//! Q4_K, Q6_K and the 32-value formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL) repacked
//! into panels of 8 or 16 rows for the prefill GEMM, as ggml's
//! `repack.cpp` interleaves Q4_K rows at load, but done per L2-sized row group inside
//! each matrix multiplication (so streamed layers, used straight from their read buffer,
//! get it too): the group is walked by every tile of 4 tokens, and its repacking costs
//! about one of those walks.
//!
//! In a panel one 64-byte vector holds a few bytes of each of its rows: 8 bytes of each of
//! 8 rows (the 32-value formats), 4 packed bytes of each of 16 rows (Q4_K), or 4 signed
//! values of each of 16 rows (Q6_K, multiplied by activations offset by 128 so the byte
//! product stays unsigned × signed). A tile kernel multiplies all the rows by one token's
//! broadcast activation bytes at once and every lane (Q4_K, Q6_K) or lane pair of its
//! accumulator belongs to one row: no horizontal sums at all for the K-quants, or, for the
//! 32-value formats, whose float order keeps eight lanes of four values per output (ggml's
//! `vec_dot`), each row's lanes stay apart in two vector lanes per 8 values until the end.
//! The scales, mins and super-block scales (and the values of the 5-, 6- and 8-bit
//! formats, and IQ4_NL's codebook lookups) are unpacked once here instead of once per token
//! tile.

use bytemuck::{Pod, Zeroable};
use flatrun_dequant::blocks::k_quants::scale_min_k4;
use flatrun_dequant::iq_grids::KVALUES_IQ4NL;
use flatrun_dequant::{
    BlockFormat, BlockIq4Nl, BlockQ4_0, BlockQ4_1, BlockQ4K, BlockQ5_0, BlockQ5_1, BlockQ6K,
    BlockQ8_0,
};
use flatrun_format::GgmlType;

use crate::native::quantize::{BlockQ8, BlockQ8K};

/// Rows per panel of the 32-value formats.
pub(crate) const PANEL_ROWS: usize = 8;

/// Rows per Q4_K panel: one i32 lane per row ([`Q4kPanelBlock`]).
pub(crate) const Q4K_PANEL_ROWS: usize = 16;

/// Rows per Q6_K panel: one i32 lane per row ([`Q6kPanelBlock`]).
pub(crate) const Q6K_PANEL_ROWS: usize = 16;

/// The most rows a panel of any format holds.
pub(crate) const MAX_PANEL_ROWS: usize = Q4K_PANEL_ROWS;

/// The unit of a panel buffer: one cache line. A panel block is a whole number of them.
#[repr(C, align(64))]
#[derive(Clone, Copy, Pod, Zeroable)]
pub(crate) struct Line(pub(crate) [u8; 64]);

/// One panel (its rows × every block of a row) × `nt` token rows of activation blocks `A`
/// (4, or the format's [`PanelFormat::tokens`]) → `out[r·nt + t]`, in the one-token order
/// if asked; `false` (nothing written) for a call it cannot take.
pub(crate) type PanelTile<A> = fn(&[Line], &[&[A]], &mut [f32], bool) -> bool;

/// How one format is repacked and multiplied in panels.
pub(crate) struct PanelFormat<A> {
    /// Rows per panel.
    pub(crate) rows: usize,
    /// The widest token tile `tile` takes (4 or 8; every tile takes 4).
    pub(crate) tokens: usize,
    /// Lines per panel block (a panel's rows × one block).
    pub(crate) lines_per_block: usize,
    /// Raw bytes of one row's block.
    pub(crate) block_bytes: usize,
    /// Repack whole panels of raw rows of `rb` bytes into lines.
    pub(crate) repack: fn(&[u8], usize, &mut Vec<Line>),
    pub(crate) tile: PanelTile<A>,
    /// Whether `tile` keeps the one-token order (else such calls keep raw rows).
    pub(crate) one_token: bool,
    /// Whether `tile` takes its activations through [`offset_acts`] (the raw-row kernel
    /// still takes them as quantized).
    pub(crate) offset_acts: bool,
}

impl<A> PanelFormat<A> {
    /// The activations `tile` reads: `offset` (`acts` through [`offset_acts`]) where the
    /// format asks for it, else `acts`.
    pub(crate) fn tile_acts<'a>(&self, acts: &'a [A], offset: &'a [A]) -> &'a [A] {
        if self.offset_acts { offset } else { acts }
    }
}

// By hand: a derive would ask `A: Copy`, and only function pointers are held.
impl<A> Clone for PanelFormat<A> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<A> Copy for PanelFormat<A> {}

/// The panel layout of K-quant `t` with the level's tiles, where both exist.
pub(crate) fn panel_format(
    t: GgmlType,
    q4k: Option<PanelTile<BlockQ8K>>,
    q6k: Option<PanelTile<BlockQ8K>>,
) -> Option<PanelFormat<BlockQ8K>> {
    match t {
        GgmlType::Q4_K => q4k.map(|tile| PanelFormat {
            rows: Q4K_PANEL_ROWS,
            tokens: 8,
            lines_per_block: std::mem::size_of::<Q4kPanelBlock>() / 64,
            block_bytes: BlockQ4K::BLOCK_BYTES,
            repack: repack_q4k,
            tile,
            one_token: true,
            offset_acts: false,
        }),
        GgmlType::Q6_K => q6k.map(|tile| PanelFormat {
            rows: Q6K_PANEL_ROWS,
            tokens: 8,
            lines_per_block: std::mem::size_of::<Q6kPanelBlock>() / 64,
            block_bytes: BlockQ6K::BLOCK_BYTES,
            repack: repack_q6k,
            tile,
            one_token: false,
            offset_acts: true,
        }),
        _ => None,
    }
}

/// One Q4_K super-block (256 values) of 16 rows, laid out for [`Q4K_PANEL_ROWS`]-row tiles:
/// 4 bytes of each row per vector, so each i32 lane of a `vpdpbusd` sum is one row's.
#[repr(C, align(64))]
#[derive(Clone, Copy, Pod, Zeroable)]
pub(crate) struct Q4kPanelBlock {
    /// Vector `8c + g` (chunk c = 0..4 of 64 values, byte group g = 0..8): row r's packed
    /// bytes `32c + 4g .. 32c + 4g + 4` at bytes `4r ..`. Low nibbles are values
    /// `64c + 4g + j`, high nibbles values `64c + 32 + 4g + j`.
    pub(crate) qs: [[u8; 64]; 32],
    /// Vector j: row r's scale of sub-block j as i16 in lane `2r`, 0 in lane `2r + 1`: one
    /// `vpdpwssd` multiplies each row's i32 lane (the `vpdpbusd` sum of 16 values of a
    /// sub-block, |sum| ≤ 16·15·128 < 2¹⁵, so its low i16 is itself and its high i16 meets
    /// the 0) by its scale.
    pub(crate) scales: [[i16; 32]; 8],
    /// Vector j: row r's min of sub-block j as i16 in lanes `2r` and `2r + 1` (against a
    /// token's two 16-value sums of that sub-block, one `vpmaddwd`).
    pub(crate) mins: [[i16; 32]; 8],
    /// Row r's super-block scale of the scales, and of the mins.
    pub(crate) d: [f32; 16],
    pub(crate) dmin: [f32; 16],
}

const _: () = assert!(std::mem::size_of::<Q4kPanelBlock>() == 3200);

/// One Q6_K super-block (256 values) of 16 rows, laid out for [`Q6K_PANEL_ROWS`]-row tiles
/// as [`Q4kPanelBlock`]: 4 values of each row per vector, so each i32 lane of a `vpdpbusd`
/// sum is one row's. The values are signed (−32..=31), against activations offset to
/// `a + 128` ([`offset_acts`]); the tile takes `128·Σq` off per 8 values, once for all of
/// a call's tokens.
#[repr(C, align(64))]
#[derive(Clone, Copy, Pod, Zeroable)]
pub(crate) struct Q6kPanelBlock {
    /// Vector v (0..64): row r's values `4v .. 4v + 4` as `i8` at bytes `4r ..`.
    pub(crate) q: [[u8; 64]; 64],
    /// Vector g (0..16): row r's scale of values `16g .. 16g + 16` as i16 at lane r
    /// (zero-extended to its i32 lane by the tile, for `vpdpwssd`: an 8-value sum
    /// |Σ a·q| ≤ 8·127·32 < 2¹⁵ fits the low i16 it multiplies).
    pub(crate) scales: [[i16; 16]; 16],
    /// Row r's super-block scale.
    pub(crate) d: [f32; 16],
}

const _: () = assert!(std::mem::size_of::<Q6kPanelBlock>() == 4672);

/// `out` resized to `n` zeroed lines, seen as `n / lines_per_block` blocks of `B`.
/// The repacking writes every field a tile reads, so the buffer only grows (no clearing).
fn blocks_of<B: Pod>(out: &mut Vec<Line>, n_blocks: usize) -> &mut [B] {
    let n = n_blocks * (std::mem::size_of::<B>() / 64);
    if out.len() < n {
        out.resize(n, Line::zeroed());
    }
    bytemuck::cast_slice_mut(&mut out[..n])
}

/// Repack `rows` (whole Q4_K rows of `rb` bytes, a multiple of [`Q4K_PANEL_ROWS`] of them)
/// into `out`: panel p's blocks are blocks `p·nb .. (p + 1)·nb`, `nb` = blocks per row.
pub(crate) fn repack_q4k(rows: &[u8], rb: usize, out: &mut Vec<Line>) {
    let nb = rb / BlockQ4K::BLOCK_BYTES;
    let panels = rows.len() / rb / Q4K_PANEL_ROWS;
    let out: &mut [Q4kPanelBlock] = blocks_of(out, panels * nb);
    for p in 0..panels {
        for i in 0..nb {
            let dst = &mut out[p * nb + i];
            for r in 0..Q4K_PANEL_ROWS {
                let at = (p * Q4K_PANEL_ROWS + r) * rb + i * BlockQ4K::BLOCK_BYTES;
                let b = &rows[at..at + BlockQ4K::BLOCK_BYTES];
                let f16_at = |o: usize| half::f16::from_le_bytes([b[o], b[o + 1]]).to_f32();
                dst.d[r] = f16_at(BlockQ4K::D_OFFSET);
                dst.dmin[r] = f16_at(BlockQ4K::DMIN_OFFSET);
                let mut sc = [0u8; 12];
                sc.copy_from_slice(&b[BlockQ4K::SCALES_OFFSET..BlockQ4K::SCALES_OFFSET + 12]);
                for j in 0..8 {
                    let (s, m) = scale_min_k4(j, &sc);
                    dst.scales[j][2 * r..2 * r + 2].copy_from_slice(&[i16::from(s), 0]);
                    dst.mins[j][2 * r..2 * r + 2].fill(i16::from(m));
                }
                let qs = &b[BlockQ4K::QS_OFFSET..BlockQ4K::QS_OFFSET + 128];
                for (v, src) in qs.chunks_exact(4).enumerate() {
                    // Byte group v of the 128 packed bytes is (c, g) = (v / 8, v % 8).
                    dst.qs[v][4 * r..4 * r + 4].copy_from_slice(src);
                }
            }
        }
    }
}

/// Repack whole Q6_K rows (a multiple of [`Q6K_PANEL_ROWS`] of them) as [`repack_q4k`]
/// does Q4_K rows.
pub(crate) fn repack_q6k(rows: &[u8], rb: usize, out: &mut Vec<Line>) {
    let nb = rb / BlockQ6K::BLOCK_BYTES;
    let panels = rows.len() / rb / Q6K_PANEL_ROWS;
    let out: &mut [Q6kPanelBlock] = blocks_of(out, panels * nb);
    for p in 0..panels {
        for i in 0..nb {
            let dst = &mut out[p * nb + i];
            for r in 0..Q6K_PANEL_ROWS {
                let at = (p * Q6K_PANEL_ROWS + r) * rb + i * BlockQ6K::BLOCK_BYTES;
                let b = &rows[at..at + BlockQ6K::BLOCK_BYTES];
                let ql: &[u8; 128] = b[BlockQ6K::QL_OFFSET..][..128]
                    .try_into()
                    .unwrap_or(&[0; 128]);
                let qh: &[u8; 64] = b[BlockQ6K::QH_OFFSET..][..64]
                    .try_into()
                    .unwrap_or(&[0; 64]);
                // ggml's layout: per half n, values 128n + 32k + l (k = 0..4, l = 0..32) take
                // the low (k < 2) or high nibble of ql[64n + 32(k % 2) + l] and bits 2k.. of
                // qh[32n + l]; the stored 6 bits are the value + 32.
                let mut vals = [0u8; 256];
                for n in 0..2 {
                    for l in 0..32 {
                        let (lo, hi, h) = (ql[64 * n + l], ql[64 * n + 32 + l], qh[32 * n + l]);
                        let six = [
                            (lo & 0x0F) | ((h & 3) << 4),
                            (hi & 0x0F) | (((h >> 2) & 3) << 4),
                            (lo >> 4) | (((h >> 4) & 3) << 4),
                            (hi >> 4) | (((h >> 6) & 3) << 4),
                        ];
                        for (k, v) in six.into_iter().enumerate() {
                            vals[128 * n + 32 * k + l] = v.wrapping_sub(32);
                        }
                    }
                }
                for (v, src) in vals.chunks_exact(4).enumerate() {
                    dst.q[v][4 * r..4 * r + 4].copy_from_slice(src);
                }
                for g in 0..16 {
                    dst.scales[g][r] = i16::from(b[BlockQ6K::SCALES_OFFSET + g] as i8);
                }
                dst.d[r] =
                    half::f16::from_le_bytes([b[BlockQ6K::D_OFFSET], b[BlockQ6K::D_OFFSET + 1]])
                        .to_f32();
            }
        }
    }
}

/// One 32-value block of 8 rows of a legacy format, for the tiles against Q8 activations.
#[repr(C, align(64))]
#[derive(Clone, Copy, Pod, Zeroable)]
pub(crate) struct LegacyPanelBlock {
    /// Vector v (0..4): row r's values `8v .. 8v + 8` as bytes at `8r ..`: `i8`, or `u8`
    /// for the formats with a min (Q4_1, Q5_1).
    pub(crate) q: [[u8; 64]; 4],
    /// Row r's scale in lanes `2r` and `2r + 1`.
    pub(crate) d: [f32; 16],
    /// Row r's min (Q4_1, Q5_1; else 0).
    pub(crate) m: [f32; 8],
    pad: [f32; 8],
}

const _: () = assert!(std::mem::size_of::<LegacyPanelBlock>() == 384);

/// Whether the values of legacy format `t` are unsigned, with a min.
pub(crate) fn legacy_unsigned(t: GgmlType) -> bool {
    matches!(t, GgmlType::Q4_1 | GgmlType::Q5_1)
}

/// The panel layout of legacy format `t` with the level's tiles (`[signed, unsigned]`).
pub(crate) fn legacy_panel_format(
    t: GgmlType,
    tiles: Option<[PanelTile<BlockQ8>; 2]>,
) -> Option<PanelFormat<BlockQ8>> {
    let tiles = tiles?;
    let repack: fn(&[u8], usize, &mut Vec<Line>) = match t {
        GgmlType::Q4_0 => repack_legacy::<{ GgmlType::Q4_0 as u32 }>,
        GgmlType::Q4_1 => repack_legacy::<{ GgmlType::Q4_1 as u32 }>,
        GgmlType::Q5_0 => repack_legacy::<{ GgmlType::Q5_0 as u32 }>,
        GgmlType::Q5_1 => repack_legacy::<{ GgmlType::Q5_1 as u32 }>,
        GgmlType::Q8_0 => repack_legacy::<{ GgmlType::Q8_0 as u32 }>,
        GgmlType::IQ4_NL => repack_legacy::<{ GgmlType::IQ4_NL as u32 }>,
        _ => return None,
    };
    Some(PanelFormat {
        rows: PANEL_ROWS,
        tokens: 4,
        lines_per_block: std::mem::size_of::<LegacyPanelBlock>() / 64,
        block_bytes: t.type_size(),
        repack,
        tile: tiles[usize::from(legacy_unsigned(t))],
        one_token: true,
        offset_acts: !legacy_unsigned(t),
    })
}

/// Activation blocks whose values can be offset to unsigned bytes.
pub(crate) trait OffsetActs: Copy {
    /// The block with every value `a` (−128..=127) stored as the byte `a + 128` (its bit 7
    /// flipped), the rest as it is.
    fn offset(&self) -> Self;
}

impl OffsetActs for BlockQ8 {
    fn offset(&self) -> Self {
        BlockQ8 {
            qs: self.qs.map(|q| q ^ i8::MIN),
            ..*self
        }
    }
}

impl OffsetActs for BlockQ8K {
    fn offset(&self) -> Self {
        BlockQ8K {
            qs: self.qs.map(|q| q ^ i8::MIN),
            ..*self
        }
    }
}

/// `src` offset ([`OffsetActs::offset`]) into `out`: the unsigned operand of `vpdpbusd`
/// against signed weights, for the signed formats' panel tiles (`x86_panel.rs`).
pub(crate) fn offset_acts<A: OffsetActs>(src: &[A], out: &mut Vec<A>) {
    out.clear();
    out.extend(src.iter().map(OffsetActs::offset));
}

/// The scale and min (0 for the formats without one) of a legacy block.
fn legacy_scale_min<const T: u32>(b: &[u8]) -> (f32, f32) {
    let f16_at = |o: usize| half::f16::from_le_bytes([b[o], b[o + 1]]).to_f32();
    if T == GgmlType::Q4_1 as u32 || T == GgmlType::Q5_1 as u32 {
        (f16_at(0), f16_at(2))
    } else {
        (f16_at(0), 0.0)
    }
}

/// [`legacy_values`]' bytes with AVX2: the nibbles, fifth bits and codebook resolved as
/// the x86 row kernels do (`legacy_block` in `x86_legacy.rs`).
#[cfg(target_arch = "x86_64")]
mod fast {
    use std::arch::x86_64::*;

    use flatrun_dequant::iq_grids::KVALUES_IQ4NL;
    use flatrun_dequant::{BlockIq4Nl, BlockQ4_0, BlockQ4_1, BlockQ5_0, BlockQ5_1, BlockQ8_0};
    use flatrun_format::GgmlType;

    /// # Safety
    /// AVX2; `b` points at one whole block of format `T`.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn legacy_values<const T: u32>(b: *const u8) -> [u8; 32] {
        // SAFETY: every read lies inside the block (the caller's promise); the store is to
        // a local array of 32 bytes.
        unsafe {
            let nibbles = |p: *const u8| {
                let t = _mm_loadu_si128(p as *const __m128i);
                _mm256_and_si256(
                    _mm256_set_m128i(_mm_srli_epi16::<4>(t), t),
                    _mm256_set1_epi8(0x0F),
                )
            };
            // Bit j of the 32 bits at `p` as byte j: 0xFF where set.
            let bits = |p: *const u8| {
                let x = (p as *const i32).read_unaligned();
                let shuf = _mm256_set_epi64x(
                    0x0303030303030303,
                    0x0202020202020202,
                    0x0101010101010101,
                    0,
                );
                let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(x), shuf);
                let bit = _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe);
                _mm256_cmpeq_epi8(_mm256_or_si256(bytes, bit), _mm256_set1_epi64x(-1))
            };
            const Q4_0: u32 = GgmlType::Q4_0 as u32;
            const Q4_1: u32 = GgmlType::Q4_1 as u32;
            const Q5_0: u32 = GgmlType::Q5_0 as u32;
            const Q5_1: u32 = GgmlType::Q5_1 as u32;
            const Q8_0: u32 = GgmlType::Q8_0 as u32;
            let v = match T {
                Q4_0 => _mm256_sub_epi8(nibbles(b.add(BlockQ4_0::QS_OFFSET)), _mm256_set1_epi8(8)),
                Q4_1 => nibbles(b.add(BlockQ4_1::QS_OFFSET)),
                Q5_0 => {
                    // A missing fifth bit: value − 16, the high nibble 0xF0 in two's complement.
                    let hi = _mm256_andnot_si256(
                        bits(b.add(BlockQ5_0::QH_OFFSET)),
                        _mm256_set1_epi8(0xF0u8 as i8),
                    );
                    _mm256_or_si256(nibbles(b.add(BlockQ5_0::QS_OFFSET)), hi)
                }
                Q5_1 => {
                    let hi =
                        _mm256_and_si256(bits(b.add(BlockQ5_1::QH_OFFSET)), _mm256_set1_epi8(0x10));
                    _mm256_or_si256(nibbles(b.add(BlockQ5_1::QS_OFFSET)), hi)
                }
                Q8_0 => _mm256_loadu_si256(b.add(BlockQ8_0::QS_OFFSET) as *const __m256i),
                _ => {
                    let t = _mm_loadu_si128(KVALUES_IQ4NL.as_ptr() as *const __m128i);
                    _mm256_shuffle_epi8(
                        _mm256_set_m128i(t, t),
                        nibbles(b.add(BlockIq4Nl::QS_OFFSET)),
                    )
                }
            };
            let mut out = [0u8; 32];
            _mm256_storeu_si256(out.as_mut_ptr() as *mut __m256i, v);
            out
        }
    }
}

/// The 32 values of one block of legacy format `T` (bytes `b`), with its scale and min:
/// ggml's dequantization before the scale (values `i8`, or `u8` with a min).
fn legacy_values<const T: u32>(b: &[u8]) -> ([u8; 32], f32, f32) {
    const Q4_0: u32 = GgmlType::Q4_0 as u32;
    const Q4_1: u32 = GgmlType::Q4_1 as u32;
    const Q5_0: u32 = GgmlType::Q5_0 as u32;
    const Q5_1: u32 = GgmlType::Q5_1 as u32;
    const Q8_0: u32 = GgmlType::Q8_0 as u32;
    const IQ4_NL: u32 = GgmlType::IQ4_NL as u32;
    let (d, m) = legacy_scale_min::<T>(b);
    let mut v = [0u8; 32];
    if T == Q8_0 {
        v.copy_from_slice(&b[BlockQ8_0::QS_OFFSET..BlockQ8_0::QS_OFFSET + 32]);
        return (v, d, m);
    }
    // Low nibbles are values 0..16, high nibbles 16..32.
    let qs_at = match T {
        Q4_0 => BlockQ4_0::QS_OFFSET,
        Q4_1 => BlockQ4_1::QS_OFFSET,
        Q5_0 => BlockQ5_0::QS_OFFSET,
        Q5_1 => BlockQ5_1::QS_OFFSET,
        _ => BlockIq4Nl::QS_OFFSET,
    };
    let qs = &b[qs_at..qs_at + 16];
    for j in 0..16 {
        v[j] = qs[j] & 0x0F;
        v[j + 16] = qs[j] >> 4;
    }
    match T {
        Q4_0 => v.iter_mut().for_each(|x| *x = x.wrapping_sub(8)),
        Q5_0 | Q5_1 => {
            // Bit j of `qh` is value j's fifth bit; Q5_0 then takes 16 off (as i8).
            let at = if T == Q5_0 {
                BlockQ5_0::QH_OFFSET
            } else {
                BlockQ5_1::QH_OFFSET
            };
            let h = u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
            for (j, x) in v.iter_mut().enumerate() {
                *x |= (((h >> j) & 1) as u8) << 4;
                if T == Q5_0 {
                    *x = x.wrapping_sub(16);
                }
            }
        }
        IQ4_NL => v
            .iter_mut()
            .for_each(|x| *x = KVALUES_IQ4NL[usize::from(*x)] as u8),
        _ => {}
    }
    (v, d, m)
}

/// Repack whole rows of legacy format `T` as [`repack_q4k`] does Q4_K rows.
fn repack_legacy<const T: u32>(rows: &[u8], rb: usize, out: &mut Vec<Line>) {
    let ts = match T {
        x if x == GgmlType::Q4_0 as u32 => BlockQ4_0::BLOCK_BYTES,
        x if x == GgmlType::Q4_1 as u32 => BlockQ4_1::BLOCK_BYTES,
        x if x == GgmlType::Q5_0 as u32 => BlockQ5_0::BLOCK_BYTES,
        x if x == GgmlType::Q5_1 as u32 => BlockQ5_1::BLOCK_BYTES,
        x if x == GgmlType::Q8_0 as u32 => BlockQ8_0::BLOCK_BYTES,
        _ => BlockIq4Nl::BLOCK_BYTES,
    };
    let nb = rb / ts;
    let panels = rows.len() / rb / PANEL_ROWS;
    let out: &mut [LegacyPanelBlock] = blocks_of(out, panels * nb);
    #[cfg(target_arch = "x86_64")]
    let avx2 = std::arch::is_x86_feature_detected!("avx2");
    for p in 0..panels {
        for i in 0..nb {
            let dst = &mut out[p * nb + i];
            for r in 0..PANEL_ROWS {
                let at = (p * PANEL_ROWS + r) * rb + i * ts;
                let blk = &rows[at..at + ts];
                #[cfg(target_arch = "x86_64")]
                let (v, d, m) = if avx2 {
                    // SAFETY: AVX2 was detected above, and `blk` is one whole block.
                    let v = unsafe { fast::legacy_values::<T>(blk.as_ptr()) };
                    let (d, m) = legacy_scale_min::<T>(blk);
                    (v, d, m)
                } else {
                    legacy_values::<T>(blk)
                };
                #[cfg(not(target_arch = "x86_64"))]
                let (v, d, m) = legacy_values::<T>(blk);
                for (k, src) in v.chunks_exact(8).enumerate() {
                    dst.q[k][8 * r..8 * r + 8].copy_from_slice(src);
                }
                dst.d[2 * r] = d;
                dst.d[2 * r + 1] = d;
                dst.m[r] = m;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::SimdLevel;
    use crate::native::dispatch::Dispatch;

    /// On a level with panel tiles, each tile takes a well-formed call of whole panels: the
    /// GEMM tests (`tests/gemm_tiles.rs`) hold the panels' bits to the row kernels', which
    /// says nothing if every call fell back to the rows.
    #[test]
    fn panel_tiles_take_whole_panels() {
        if !crate::supported_levels().contains(&SimdLevel::Avx512Vnni) {
            return;
        }
        let d = Dispatch::for_level(SimdLevel::Avx512Vnni);
        let acts = [BlockQ8K::default(); 2];
        let tokens: [&[BlockQ8K]; 8] = [&acts; 8];
        let mut out = [f32::NAN; 8 * MAX_PANEL_ROWS];
        for t in [GgmlType::Q4_K, GgmlType::Q6_K] {
            let f = panel_format(t, d.q4k_panel, d.q6k_panel).expect("a K-quant panel format");
            let raw = vec![0u8; f.rows * 2 * f.block_bytes];
            let mut lines = Vec::new();
            (f.repack)(&raw, 2 * f.block_bytes, &mut lines);
            for nt in [4, f.tokens] {
                out.fill(f32::NAN);
                assert!(
                    (f.tile)(&lines, &tokens[..nt], &mut out, false),
                    "{t:?} × {nt}"
                );
                assert!(out[..nt * f.rows].iter().all(|&x| x == 0.0));
                // Too few outputs for the panel's rows: refused, not written past.
                let short = &mut out[..nt * f.rows - 1];
                assert!(!(f.tile)(&lines, &tokens[..nt], short, false));
            }
            // A tile of tokens the format has no kernel for.
            assert!(!(f.tile)(&lines, &tokens[..5], &mut out, false));
        }
        let q8 = [crate::native::quantize::BlockQ8::default(); 2];
        let q8_tokens: [&[crate::native::quantize::BlockQ8]; 4] = [&q8; 4];
        let f = legacy_panel_format(GgmlType::Q4_0, d.q8_panel).expect("a Q4_0 panel format");
        let raw = vec![0u8; f.rows * 2 * f.block_bytes];
        let mut lines = Vec::new();
        (f.repack)(&raw, 2 * f.block_bytes, &mut lines);
        assert!((f.tile)(&lines, &q8_tokens, &mut out, true));
    }
}
