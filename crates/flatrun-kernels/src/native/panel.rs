//! Q4_K and Q6_K weights repacked into panels of 8 rows for the prefill GEMM, as ggml's
//! `repack.cpp` interleaves Q4_K rows at load, but done per L2-sized row group inside
//! each matrix multiplication (so streamed layers, used straight from their read buffer,
//! get it too): the group is walked by every tile of 4 tokens, and its repacking costs
//! about one of those walks.
//!
//! In a panel one 64-byte vector holds 8 bytes of packed nibbles from each of the 8 rows,
//! so a tile kernel multiplies all 8 rows by one token's 8 (broadcast) activation bytes at
//! once and every lane pair of its accumulator belongs to one row: no horizontal sums until
//! the end of each 64-value chunk (Q4_K) or block (Q6_K). The scales, mins and
//! super-block scales (and Q6_K's 6-bit values) are unpacked once here instead of once
//! per token tile.

use bytemuck::{Pod, Zeroable};
use flatrun_dequant::blocks::k_quants::scale_min_k4;
use flatrun_dequant::{BlockFormat, BlockQ4K, BlockQ6K};
use flatrun_format::GgmlType;

/// Rows per panel.
pub(crate) const PANEL_ROWS: usize = 8;

/// The unit of a panel buffer: one cache line. A panel block is a whole number of them.
#[repr(C, align(64))]
#[derive(Clone, Copy, Pod, Zeroable)]
pub(crate) struct Line(pub(crate) [u8; 64]);

/// One panel (8 rows × every block of a row) × 4 Q8_K token rows → `out[r·4 + t]`, in the
/// one-token order if asked; `false` (nothing written) for a call it cannot take.
pub(crate) type PanelTile =
    fn(&[Line], &[&[crate::native::quantize::BlockQ8K]], &mut [f32], bool) -> bool;

/// How one format is repacked and multiplied in panels.
#[derive(Clone, Copy)]
pub(crate) struct PanelFormat {
    /// Lines per panel block (8 rows × one super-block).
    pub(crate) lines_per_block: usize,
    /// Raw bytes of one row's block.
    pub(crate) block_bytes: usize,
    /// Repack whole panels of raw rows of `rb` bytes into lines.
    pub(crate) repack: fn(&[u8], usize, &mut Vec<Line>),
    pub(crate) tile: PanelTile,
    /// Whether `tile` keeps the one-token order (else such calls keep raw rows).
    pub(crate) one_token: bool,
}

/// The panel layout of `t` with the level's tiles, where both exist.
pub(crate) fn panel_format(
    t: GgmlType,
    q4k: Option<PanelTile>,
    q6k: Option<PanelTile>,
) -> Option<PanelFormat> {
    match t {
        GgmlType::Q4_K => q4k.map(|tile| PanelFormat {
            lines_per_block: std::mem::size_of::<Q4kPanelBlock>() / 64,
            block_bytes: BlockQ4K::BLOCK_BYTES,
            repack: repack_q4k,
            tile,
            one_token: true,
        }),
        GgmlType::Q6_K => q6k.map(|tile| PanelFormat {
            lines_per_block: std::mem::size_of::<Q6kPanelBlock>() / 64,
            block_bytes: BlockQ6K::BLOCK_BYTES,
            repack: repack_q6k,
            tile,
            one_token: false,
        }),
        _ => None,
    }
}

/// One Q4_K super-block (256 values) of 8 rows, laid out for [`PANEL_ROWS`]-row tiles.
#[repr(C, align(64))]
#[derive(Clone, Copy, Pod, Zeroable)]
pub(crate) struct Q4kPanelBlock {
    /// Vector `4c + g` (chunk c = 0..4 of 64 values, byte group g = 0..4): row r's packed
    /// bytes `32c + 8g .. 32c + 8g + 8` at bytes `8r ..`. Low nibbles are values
    /// `64c + 8g + j`, high nibbles values `64c + 32 + 8g + j`.
    pub(crate) qs: [[u8; 64]; 16],
    /// Vector `2c + h`: row r's scale of sub-block `2c + h` as i16 in lanes `4r .. 4r + 4`
    /// (the four i16 products `vpmaddubsw` makes of row r's 8 bytes).
    pub(crate) scales: [[i16; 32]; 8],
    /// Vector c: row r's mins of sub-blocks `2c`, `2c + 1` as i16 in lanes `2r`, `2r + 1`.
    pub(crate) mins: [[i16; 16]; 4],
    /// Row r's super-block scale of the scales, and of the mins.
    pub(crate) d: [f32; 8],
    pub(crate) dmin: [f32; 8],
}

const _: () = assert!(std::mem::size_of::<Q4kPanelBlock>() == 1728);

/// One Q6_K super-block of 8 rows.
#[repr(C, align(64))]
#[derive(Clone, Copy, Pod, Zeroable)]
pub(crate) struct Q6kPanelBlock {
    /// Vector v (0..32): row r's values `8v .. 8v + 8`, unsigned (0..64, the value + 32),
    /// at bytes `8r ..`.
    pub(crate) q: [[u8; 64]; 32],
    /// Vector g (0..16): row r's scale of values `16g .. 16g + 16` as i16 in lanes `4r .. 4r + 4`.
    pub(crate) scales: [[i16; 32]; 16],
    /// Vector p (0..8): row r's scales `2p`, `2p + 1` as i16 in lanes `2r`, `2r + 1` (for the
    /// offset of the unsigned values against the activations' 16-value sums).
    pub(crate) scale_pairs: [[i16; 16]; 8],
    /// Row r's super-block scale.
    pub(crate) d: [f32; 8],
    pad: [f32; 8],
}

const _: () = assert!(std::mem::size_of::<Q6kPanelBlock>() == 3392);

/// `out` resized to `n` zeroed lines, seen as `n / lines_per_block` blocks of `B`.
fn blocks_of<B: Pod>(out: &mut Vec<Line>, n_blocks: usize) -> &mut [B] {
    let per = std::mem::size_of::<B>() / 64;
    out.clear();
    out.resize(n_blocks * per, Line::zeroed());
    bytemuck::cast_slice_mut(&mut out[..])
}

/// Repack `rows` (whole Q4_K rows of `rb` bytes, a multiple of [`PANEL_ROWS`] of them) into
/// `out`: panel p's blocks are blocks `p·nb .. (p + 1)·nb`, `nb` = blocks per row.
pub(crate) fn repack_q4k(rows: &[u8], rb: usize, out: &mut Vec<Line>) {
    let nb = rb / BlockQ4K::BLOCK_BYTES;
    let panels = rows.len() / rb / PANEL_ROWS;
    let out: &mut [Q4kPanelBlock] = blocks_of(out, panels * nb);
    for p in 0..panels {
        for i in 0..nb {
            let dst = &mut out[p * nb + i];
            for r in 0..PANEL_ROWS {
                let at = (p * PANEL_ROWS + r) * rb + i * BlockQ4K::BLOCK_BYTES;
                let b = &rows[at..at + BlockQ4K::BLOCK_BYTES];
                let f16_at = |o: usize| half::f16::from_le_bytes([b[o], b[o + 1]]).to_f32();
                dst.d[r] = f16_at(BlockQ4K::D_OFFSET);
                dst.dmin[r] = f16_at(BlockQ4K::DMIN_OFFSET);
                let mut sc = [0u8; 12];
                sc.copy_from_slice(&b[BlockQ4K::SCALES_OFFSET..BlockQ4K::SCALES_OFFSET + 12]);
                for j in 0..8 {
                    let (s, m) = scale_min_k4(j, &sc);
                    dst.scales[j][4 * r..4 * r + 4].fill(i16::from(s));
                    dst.mins[j / 2][2 * r + j % 2] = i16::from(m);
                }
                let qs = &b[BlockQ4K::QS_OFFSET..BlockQ4K::QS_OFFSET + 128];
                for (v, src) in qs.chunks_exact(8).enumerate() {
                    // Byte group v of the 128 packed bytes is (c, g) = (v / 4, v % 4).
                    dst.qs[v][8 * r..8 * r + 8].copy_from_slice(src);
                }
            }
        }
    }
}

/// Repack whole Q6_K rows as [`repack_q4k`] does Q4_K rows.
pub(crate) fn repack_q6k(rows: &[u8], rb: usize, out: &mut Vec<Line>) {
    let nb = rb / BlockQ6K::BLOCK_BYTES;
    let panels = rows.len() / rb / PANEL_ROWS;
    let out: &mut [Q6kPanelBlock] = blocks_of(out, panels * nb);
    for p in 0..panels {
        for i in 0..nb {
            let dst = &mut out[p * nb + i];
            for r in 0..PANEL_ROWS {
                let at = (p * PANEL_ROWS + r) * rb + i * BlockQ6K::BLOCK_BYTES;
                let b = &rows[at..at + BlockQ6K::BLOCK_BYTES];
                let ql: &[u8; 128] = b[BlockQ6K::QL_OFFSET..][..128]
                    .try_into()
                    .unwrap_or(&[0; 128]);
                let qh: &[u8; 64] = b[BlockQ6K::QH_OFFSET..][..64]
                    .try_into()
                    .unwrap_or(&[0; 64]);
                // ggml's layout: per half n, values 128n + 32k + l (k = 0..4, l = 0..32) take
                // the low (k < 2) or high nibble of ql[64n + 32(k % 2) + l] and bits 2k.. of qh[32n + l].
                let mut vals = [0u8; 256];
                for n in 0..2 {
                    for l in 0..32 {
                        let (lo, hi, h) = (ql[64 * n + l], ql[64 * n + 32 + l], qh[32 * n + l]);
                        vals[128 * n + l] = (lo & 0x0F) | ((h & 3) << 4);
                        vals[128 * n + 32 + l] = (hi & 0x0F) | (((h >> 2) & 3) << 4);
                        vals[128 * n + 64 + l] = (lo >> 4) | (((h >> 4) & 3) << 4);
                        vals[128 * n + 96 + l] = (hi >> 4) | (((h >> 6) & 3) << 4);
                    }
                }
                for (v, src) in vals.chunks_exact(8).enumerate() {
                    dst.q[v][8 * r..8 * r + 8].copy_from_slice(src);
                }
                for g in 0..16 {
                    let s = i16::from(b[BlockQ6K::SCALES_OFFSET + g] as i8);
                    dst.scales[g][4 * r..4 * r + 4].fill(s);
                    dst.scale_pairs[g / 2][2 * r + g % 2] = s;
                }
                dst.d[r] =
                    half::f16::from_le_bytes([b[BlockQ6K::D_OFFSET], b[BlockQ6K::D_OFFSET + 1]])
                        .to_f32();
            }
        }
    }
}
