//! The non-linear "IQ" formats: weights are picked from fixed codebooks
//! (grids of 4 or 8 values, or the 16-value IQ4 table) instead of a uniform
//! integer range. The tables live in [`crate::iq_grids`].
//!
//! In every grid, entry `i` packs 4 (u32) or 8 (u64) byte-sized values, value
//! `j` being byte `j` (little-endian). Signs come as 7-bit indices into
//! [`KSIGNS_IQ2XS`], whose eighth bit keeps an even number of minus signs.

use bytemuck::{Pod, Zeroable};
use half::f16;

use super::{QK_K, ScaleList, block_format, byte_offsets, f16_to_f32};
use crate::iq_grids::{
    IQ1S_GRID, IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID, IQ3S_GRID, IQ3XXS_GRID, KMASK_IQ2XS,
    KSIGNS_IQ2XS, KVALUES_IQ4NL,
};

/// The shift of IQ1_S/IQ1_M grid values (ggml's `IQ1S_DELTA`).
pub const IQ1S_DELTA: f32 = 0.125;

/// Value `j` (0..8) of a u64 grid entry, unsigned.
#[inline(always)]
fn grid8(entry: u64, j: usize) -> f32 {
    ((entry >> (8 * j)) & 0xFF) as u8 as f32
}

/// Value `j` (0..4) of a u32 grid entry, unsigned.
#[inline(always)]
fn grid4(entry: u32, j: usize) -> f32 {
    ((entry >> (8 * j)) & 0xFF) as u8 as f32
}

/// +1 or −1 for position `j` of a sign byte.
#[inline(always)]
fn sign(signs: u8, j: usize) -> f32 {
    if signs & KMASK_IQ2XS[j] != 0 {
        -1.0
    } else {
        1.0
    }
}

/// IQ2_XXS — 2.0625 bits per weight: groups of 8 from a 256-entry grid,
/// 7-bit sign patterns, a 4-bit scale per 32 weights.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Pod, Zeroable)]
pub struct BlockIq2Xxs {
    /// Super-block scale.
    pub d: f16,
    /// Per 32 weights, two u32: four 8-bit grid indices, then four 7-bit
    /// sign indices and a 4-bit scale in the top bits.
    pub qs: [u16; QK_K / 8],
}
block_format!(
    BlockIq2Xxs,
    IQ2_XXS,
    elems = 256,
    bytes = 66,
    partner = super::BlockQ8K
);

impl BlockIq2Xxs {
    fn decode(&self, out: &mut [f32; QK_K]) {
        let d = f16_to_f32(self.d);
        for ib32 in 0..QK_K / 32 {
            let q = &self.qs[4 * ib32..4 * ib32 + 4];
            let grid_idx = (q[0] as u32 | (q[1] as u32) << 16).to_le_bytes();
            let aux1 = q[2] as u32 | (q[3] as u32) << 16;
            let db = d * (0.5 + (aux1 >> 28) as f32) * 0.25;
            for l in 0..4 {
                let grid = IQ2XXS_GRID[grid_idx[l] as usize];
                let signs = KSIGNS_IQ2XS[((aux1 >> (7 * l)) & 127) as usize];
                let y = &mut out[32 * ib32 + 8 * l..32 * ib32 + 8 * l + 8];
                for (j, o) in y.iter_mut().enumerate() {
                    *o = db * grid8(grid, j) * sign(signs, j);
                }
            }
        }
    }
    fn scale_values(&self) -> ScaleList {
        ScaleList::of(&[f16_to_f32(self.d)])
    }
}

/// IQ2_XS — 2.3125 bits per weight: groups of 8 from a 512-entry grid,
/// 9-bit index + 7-bit signs per u16, a 4-bit scale per 16 weights.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Pod, Zeroable)]
pub struct BlockIq2Xs {
    /// Super-block scale.
    pub d: f16,
    /// Grid index (low 9 bits) and sign index (high 7 bits) per 8 weights.
    pub qs: [u16; QK_K / 8],
    /// Two 4-bit scales per 32 weights.
    pub scales: [u8; QK_K / 32],
}
block_format!(
    BlockIq2Xs,
    IQ2_XS,
    elems = 256,
    bytes = 74,
    partner = super::BlockQ8K
);

impl BlockIq2Xs {
    fn decode(&self, out: &mut [f32; QK_K]) {
        let d = f16_to_f32(self.d);
        for ib32 in 0..QK_K / 32 {
            let sc = self.scales[ib32];
            let db = [
                d * (0.5 + (sc & 0x0F) as f32) * 0.25,
                d * (0.5 + (sc >> 4) as f32) * 0.25,
            ];
            for l in 0..4 {
                let q = self.qs[4 * ib32 + l];
                let grid = IQ2XS_GRID[(q & 511) as usize];
                let signs = KSIGNS_IQ2XS[(q >> 9) as usize];
                let y = &mut out[32 * ib32 + 8 * l..32 * ib32 + 8 * l + 8];
                for (j, o) in y.iter_mut().enumerate() {
                    *o = db[l / 2] * grid8(grid, j) * sign(signs, j);
                }
            }
        }
    }
    fn scale_values(&self) -> ScaleList {
        ScaleList::of(&[f16_to_f32(self.d)])
    }
}

/// IQ2_S — 2.5625 bits per weight: groups of 8 from a 1024-entry grid
/// (8 low index bits in `qs`, 2 high in `qh`), explicit sign bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Pod, Zeroable)]
pub struct BlockIq2S {
    /// Super-block scale.
    pub d: f16,
    /// 32 low grid-index bytes, then 32 sign bytes.
    pub qs: [u8; QK_K / 4],
    /// High index bits: two per group of 8.
    pub qh: [u8; QK_K / 32],
    /// Two 4-bit scales per 32 weights.
    pub scales: [u8; QK_K / 32],
}
block_format!(
    BlockIq2S,
    IQ2_S,
    elems = 256,
    bytes = 82,
    partner = super::BlockQ8K
);

impl BlockIq2S {
    fn decode(&self, out: &mut [f32; QK_K]) {
        let d = f16_to_f32(self.d);
        let (idx_lo, sign_bytes) = self.qs.split_at(QK_K / 8);
        for ib32 in 0..QK_K / 32 {
            let sc = self.scales[ib32];
            let db = [
                d * (0.5 + (sc & 0x0F) as f32) * 0.25,
                d * (0.5 + (sc >> 4) as f32) * 0.25,
            ];
            for l in 0..4 {
                let hi = ((self.qh[ib32] as u32) << (8 - 2 * l)) & 0x300;
                let grid = IQ2S_GRID[(idx_lo[4 * ib32 + l] as u32 | hi) as usize];
                let signs = sign_bytes[4 * ib32 + l];
                let y = &mut out[32 * ib32 + 8 * l..32 * ib32 + 8 * l + 8];
                for (j, o) in y.iter_mut().enumerate() {
                    *o = db[l / 2] * grid8(grid, j) * sign(signs, j);
                }
            }
        }
    }
    fn scale_values(&self) -> ScaleList {
        ScaleList::of(&[f16_to_f32(self.d)])
    }
}

/// IQ3_XXS — 3.0625 bits per weight: groups of 4 from a 256-entry grid,
/// 7-bit sign patterns per 8 weights, a 4-bit scale per 32.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Pod, Zeroable)]
pub struct BlockIq3Xxs {
    /// Super-block scale.
    pub d: f16,
    /// 64 grid indices, then per 32 weights a u32 of four 7-bit sign indices
    /// and a 4-bit scale.
    pub qs: [u8; 3 * QK_K / 8],
}
block_format!(
    BlockIq3Xxs,
    IQ3_XXS,
    elems = 256,
    bytes = 98,
    partner = super::BlockQ8K
);

impl BlockIq3Xxs {
    fn decode(&self, out: &mut [f32; QK_K]) {
        let d = f16_to_f32(self.d);
        let (idx, scales_and_signs) = self.qs.split_at(QK_K / 4);
        for ib32 in 0..QK_K / 32 {
            let s = &scales_and_signs[4 * ib32..4 * ib32 + 4];
            let aux = u32::from_le_bytes([s[0], s[1], s[2], s[3]]);
            let db = d * (0.5 + (aux >> 28) as f32) * 0.5;
            let q = &idx[8 * ib32..8 * ib32 + 8];
            for l in 0..4 {
                let signs = KSIGNS_IQ2XS[((aux >> (7 * l)) & 127) as usize];
                let grid1 = IQ3XXS_GRID[q[2 * l] as usize];
                let grid2 = IQ3XXS_GRID[q[2 * l + 1] as usize];
                let y = &mut out[32 * ib32 + 8 * l..32 * ib32 + 8 * l + 8];
                for j in 0..4 {
                    y[j] = db * grid4(grid1, j) * sign(signs, j);
                    y[j + 4] = db * grid4(grid2, j) * sign(signs, j + 4);
                }
            }
        }
    }
    fn scale_values(&self) -> ScaleList {
        ScaleList::of(&[f16_to_f32(self.d)])
    }
}

/// IQ3_S — 3.4375 bits per weight: groups of 4 from a 512-entry grid (8 low
/// index bits in `qs`, the ninth in `qh`), explicit signs, 4-bit odd scales.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Pod, Zeroable)]
pub struct BlockIq3S {
    /// Super-block scale.
    pub d: f16,
    /// Low 8 bits of the grid indices.
    pub qs: [u8; QK_K / 4],
    /// Ninth index bits, one byte per 32 weights.
    pub qh: [u8; QK_K / 32],
    /// Sign bits, one per weight.
    pub signs: [u8; QK_K / 8],
    /// Two 4-bit scales per 64 weights (`1 + 2*s`).
    pub scales: [u8; QK_K / 64],
}
block_format!(
    BlockIq3S,
    IQ3_S,
    elems = 256,
    bytes = 110,
    partner = super::BlockQ8K
);

impl BlockIq3S {
    fn decode(&self, out: &mut [f32; QK_K]) {
        let d = f16_to_f32(self.d);
        for ib32 in 0..QK_K / 32 {
            let sc = self.scales[ib32 / 2];
            let nibble = if ib32 % 2 == 0 { sc & 0x0F } else { sc >> 4 };
            let db = d * (1 + 2 * nibble as i32) as f32;
            let qs = &self.qs[8 * ib32..8 * ib32 + 8];
            let qh = self.qh[ib32] as u32;
            let signs = &self.signs[4 * ib32..4 * ib32 + 4];
            for l in 0..4 {
                let grid1 = IQ3S_GRID[(qs[2 * l] as u32 | ((qh << (8 - 2 * l)) & 256)) as usize];
                let grid2 =
                    IQ3S_GRID[(qs[2 * l + 1] as u32 | ((qh << (7 - 2 * l)) & 256)) as usize];
                let y = &mut out[32 * ib32 + 8 * l..32 * ib32 + 8 * l + 8];
                for j in 0..4 {
                    y[j] = db * grid4(grid1, j) * sign(signs[l], j);
                    y[j + 4] = db * grid4(grid2, j) * sign(signs[l], j + 4);
                }
            }
        }
    }
    fn scale_values(&self) -> ScaleList {
        ScaleList::of(&[f16_to_f32(self.d)])
    }
}

/// Value `j` of an IQ1 grid entry (signed: −1, 0, 1).
#[inline(always)]
fn grid1(entry: u64, j: usize) -> f32 {
    ((entry >> (8 * j)) & 0xFF) as u8 as i8 as f32
}

/// IQ1_S — 1.5625 bits per weight: groups of 8 from a 2048-entry grid of
/// {−1, 0, 1}, shifted by ±[`IQ1S_DELTA`], a 3-bit scale per 32 weights.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Pod, Zeroable)]
pub struct BlockIq1S {
    /// Super-block scale.
    pub d: f16,
    /// Low 8 bits of the grid indices.
    pub qs: [u8; QK_K / 8],
    /// Per 32 weights: four 3-bit high index parts, a 3-bit scale (bits
    /// 12..15) and the sign of the shift (bit 15).
    pub qh: [u16; QK_K / 32],
}
block_format!(
    BlockIq1S,
    IQ1_S,
    elems = 256,
    bytes = 50,
    partner = super::BlockQ8K
);

impl BlockIq1S {
    fn decode(&self, out: &mut [f32; QK_K]) {
        let d = f16_to_f32(self.d);
        for ib in 0..QK_K / 32 {
            let qh = self.qh[ib] as u32;
            let dl = d * (2 * ((qh >> 12) & 7) + 1) as f32;
            let delta = if qh & 0x8000 != 0 {
                -IQ1S_DELTA
            } else {
                IQ1S_DELTA
            };
            for l in 0..4 {
                let idx = self.qs[4 * ib + l] as u32 | (((qh >> (3 * l)) & 7) << 8);
                let grid = IQ1S_GRID[idx as usize];
                let y = &mut out[32 * ib + 8 * l..32 * ib + 8 * l + 8];
                for (j, o) in y.iter_mut().enumerate() {
                    *o = dl * (grid1(grid, j) + delta);
                }
            }
        }
    }
    fn scale_values(&self) -> ScaleList {
        ScaleList::of(&[f16_to_f32(self.d)])
    }
}

/// IQ1_M — 1.75 bits per weight: as IQ1_S with a shift sign per 8 weights
/// and 3-bit scales per 16; the f16 super-block scale is spread over the top
/// nibbles of the four scale words.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Pod, Zeroable)]
pub struct BlockIq1M {
    /// Low 8 bits of the grid indices.
    pub qs: [u8; QK_K / 8],
    /// Per 8 weights a nibble: 3 high index bits and the shift sign (bit 3).
    pub qh: [u8; QK_K / 16],
    /// Four little-endian u16: 3-bit sub-block scales, and the f16 scale in
    /// their top nibbles.
    pub scales: [u8; QK_K / 32],
}
block_format!(
    BlockIq1M,
    IQ1_M,
    elems = 256,
    bytes = 56,
    partner = super::BlockQ8K
);

impl BlockIq1M {
    /// The four scale words.
    fn scale_words(&self) -> [u16; 4] {
        let s = &self.scales;
        [
            u16::from_le_bytes([s[0], s[1]]),
            u16::from_le_bytes([s[2], s[3]]),
            u16::from_le_bytes([s[4], s[5]]),
            u16::from_le_bytes([s[6], s[7]]),
        ]
    }

    /// The super-block scale, gathered from the top nibbles.
    pub fn super_scale(&self) -> f32 {
        let sc = self.scale_words();
        let bits =
            (sc[0] >> 12) | ((sc[1] >> 8) & 0x00F0) | ((sc[2] >> 4) & 0x0F00) | (sc[3] & 0xF000);
        f16::from_bits(bits).to_f32()
    }

    fn decode(&self, out: &mut [f32; QK_K]) {
        let sc = self.scale_words();
        let d = self.super_scale();
        for ib in 0..QK_K / 32 {
            let word = sc[ib / 2] as u32;
            let shift = 6 * (ib % 2) as u32;
            let dl1 = d * (2 * ((word >> shift) & 7) + 1) as f32;
            let dl2 = d * (2 * ((word >> (shift + 3)) & 7) + 1) as f32;
            let qs = &self.qs[4 * ib..4 * ib + 4];
            let qh = [self.qh[2 * ib] as u32, self.qh[2 * ib + 1] as u32];
            let idx = [
                qs[0] as u32 | ((qh[0] << 8) & 0x700),
                qs[1] as u32 | ((qh[0] << 4) & 0x700),
                qs[2] as u32 | ((qh[1] << 8) & 0x700),
                qs[3] as u32 | ((qh[1] << 4) & 0x700),
            ];
            let delta = [
                if qh[0] & 0x08 != 0 {
                    -IQ1S_DELTA
                } else {
                    IQ1S_DELTA
                },
                if qh[0] & 0x80 != 0 {
                    -IQ1S_DELTA
                } else {
                    IQ1S_DELTA
                },
                if qh[1] & 0x08 != 0 {
                    -IQ1S_DELTA
                } else {
                    IQ1S_DELTA
                },
                if qh[1] & 0x80 != 0 {
                    -IQ1S_DELTA
                } else {
                    IQ1S_DELTA
                },
            ];
            for l in 0..4 {
                let dl = if l < 2 { dl1 } else { dl2 };
                let grid = IQ1S_GRID[idx[l] as usize];
                let y = &mut out[32 * ib + 8 * l..32 * ib + 8 * l + 8];
                for (j, o) in y.iter_mut().enumerate() {
                    *o = dl * (grid1(grid, j) + delta[l]);
                }
            }
        }
    }
    fn scale_values(&self) -> ScaleList {
        ScaleList::of(&[self.super_scale()])
    }
}

/// IQ4_NL — 4.5 bits per weight: 32 weights from the 16-value non-linear
/// table [`KVALUES_IQ4NL`], `w = d * table[q]`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Pod, Zeroable)]
pub struct BlockIq4Nl {
    /// Scale.
    pub d: f16,
    /// 4-bit table indices: low nibble weight `j`, high nibble `j + 16`.
    pub qs: [u8; 16],
}
block_format!(
    BlockIq4Nl,
    IQ4_NL,
    elems = 32,
    bytes = 18,
    partner = super::BlockQ8_0
);
byte_offsets!(BlockIq4Nl { d => D_OFFSET, qs => QS_OFFSET });

impl BlockIq4Nl {
    fn decode(&self, out: &mut [f32; 32]) {
        let d = f16_to_f32(self.d);
        for (j, &byte) in self.qs.iter().enumerate() {
            out[j] = d * KVALUES_IQ4NL[(byte & 0x0F) as usize] as f32;
            out[j + 16] = d * KVALUES_IQ4NL[(byte >> 4) as usize] as f32;
        }
    }
    fn scale_values(&self) -> ScaleList {
        ScaleList::of(&[f16_to_f32(self.d)])
    }
}

/// IQ4_XS — 4.25 bits per weight: IQ4_NL values in 256-weight super-blocks
/// with a 6-bit scale (offset 32) per 32 weights.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Pod, Zeroable)]
pub struct BlockIq4Xs {
    /// Super-block scale.
    pub d: f16,
    /// High 2 bits of the eight sub-block scales.
    pub scales_h: u16,
    /// Low 4 bits of the eight sub-block scales.
    pub scales_l: [u8; QK_K / 64],
    /// 4-bit table indices, 16 bytes per 32 weights (as IQ4_NL).
    pub qs: [u8; QK_K / 2],
}
block_format!(
    BlockIq4Xs,
    IQ4_XS,
    elems = 256,
    bytes = 136,
    partner = super::BlockQ8K
);
byte_offsets!(BlockIq4Xs { d => D_OFFSET, scales_h => SCALES_H_OFFSET, scales_l => SCALES_L_OFFSET, qs => QS_OFFSET });

impl BlockIq4Xs {
    fn decode(&self, out: &mut [f32; QK_K]) {
        let d = f16_to_f32(self.d);
        for ib in 0..QK_K / 32 {
            let low = (self.scales_l[ib / 2] >> (4 * (ib % 2))) & 0x0F;
            let high = ((self.scales_h >> (2 * ib)) & 3) as u8;
            let ls = (low | (high << 4)) as i32;
            let dl = d * (ls - 32) as f32;
            let qs = &self.qs[16 * ib..16 * ib + 16];
            let y = &mut out[32 * ib..32 * ib + 32];
            for (j, &byte) in qs.iter().enumerate() {
                y[j] = dl * KVALUES_IQ4NL[(byte & 0x0F) as usize] as f32;
                y[j + 16] = dl * KVALUES_IQ4NL[(byte >> 4) as usize] as f32;
            }
        }
    }
    fn scale_values(&self) -> ScaleList {
        ScaleList::of(&[f16_to_f32(self.d)])
    }
}
