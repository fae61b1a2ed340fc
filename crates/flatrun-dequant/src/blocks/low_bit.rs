//! 1-bit, 2-bit and ternary formats: Q1_0, Q2_0, TQ1_0, TQ2_0.

use bytemuck::{Pod, Zeroable};
use half::f16;

use super::{QK_K, ScaleList, block_format, byte_offsets, f16_to_f32};

/// Q1_0 — 1.125 bits per weight: 128 signs, `w = +d` for bit 1, `-d` for bit 0
/// (bits LSB first).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Pod, Zeroable)]
pub struct BlockQ1_0 {
    /// Scale (the mean absolute value of the block).
    pub d: f16,
    /// Sign bits: bit `j % 8` of byte `j / 8` is weight `j`.
    pub qs: [u8; 128 / 8],
}
block_format!(
    BlockQ1_0,
    Q1_0,
    elems = 128,
    bytes = 18,
    partner = super::BlockQ8_0
);
byte_offsets!(BlockQ1_0 { d => D_OFFSET, qs => QS_OFFSET });

impl BlockQ1_0 {
    fn decode(&self, out: &mut [f32; 128]) {
        let d = f16_to_f32(self.d);
        for (j, o) in out.iter_mut().enumerate() {
            let bit = (self.qs[j / 8] >> (j % 8)) & 1;
            *o = if bit != 0 { d } else { -d };
        }
    }
    fn scale_values(&self) -> ScaleList {
        ScaleList::of(&[f16_to_f32(self.d)])
    }
}

/// Q2_0 — 2.25 bits per weight: 64 weights, `w = d * (q - 1)` with q in 0..4
/// (so −d, 0, +d, +2d), four per byte LSB first.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Pod, Zeroable)]
pub struct BlockQ2_0 {
    /// Scale (the absolute maximum of the block).
    pub d: f16,
    /// 2-bit quants: bits `2*(j%4)..` of byte `j / 4` are weight `j`.
    pub qs: [u8; 64 / 4],
}
block_format!(
    BlockQ2_0,
    Q2_0,
    elems = 64,
    bytes = 18,
    partner = super::BlockQ8_0
);

impl BlockQ2_0 {
    fn decode(&self, out: &mut [f32; 64]) {
        let d = f16_to_f32(self.d);
        for (j, o) in out.iter_mut().enumerate() {
            let q = (self.qs[j / 4] >> (2 * (j % 4))) & 3;
            *o = (q as i32 - 1) as f32 * d;
        }
    }
    fn scale_values(&self) -> ScaleList {
        ScaleList::of(&[f16_to_f32(self.d)])
    }
}

/// TQ1_0 — 1.6875 bits per weight: ternary `w = d * t`, t in {−1, 0, 1},
/// five trits per byte in base 3 (stored as a fixed-point fraction).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Pod, Zeroable)]
pub struct BlockTq1_0 {
    /// 240 weights, five per byte.
    pub qs: [u8; (QK_K - 4 * QK_K / 64) / 5],
    /// The last 16 weights, four per byte.
    pub qh: [u8; QK_K / 64],
    /// Scale.
    pub d: f16,
}
block_format!(
    BlockTq1_0,
    TQ1_0,
    elems = 256,
    bytes = 54,
    partner = super::BlockQ8K
);

/// Trit `n` of a TQ1_0 byte: multiply by 3^n (mod 256) and take the top
/// "digit" of `3 * q / 256`, giving 0, 1 or 2.
#[inline]
fn tq1_trit(byte: u8, n: usize) -> i32 {
    const POW3: [u8; 6] = [1, 3, 9, 27, 81, 243];
    let q = byte.wrapping_mul(POW3[n]);
    ((q as u16 * 3) >> 8) as i32
}

impl BlockTq1_0 {
    fn decode(&self, out: &mut [f32; QK_K]) {
        let d = f16_to_f32(self.d);
        let mut y = 0;
        // qs[0..32]: five rows of 32 weights; qs[32..48]: five rows of 16.
        for chunk in [&self.qs[..32], &self.qs[32..]] {
            for n in 0..5 {
                for &byte in chunk {
                    out[y] = (tq1_trit(byte, n) - 1) as f32 * d;
                    y += 1;
                }
            }
        }
        // qh: four rows of 4 weights.
        for n in 0..4 {
            for &byte in &self.qh {
                out[y] = (tq1_trit(byte, n) - 1) as f32 * d;
                y += 1;
            }
        }
    }
    fn scale_values(&self) -> ScaleList {
        ScaleList::of(&[f16_to_f32(self.d)])
    }
}

/// TQ2_0 — 2.0625 bits per weight: ternary `w = d * (q - 1)`, q in 0..4,
/// four per byte (byte `m` of each 32-byte group holds weights 32 apart).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Pod, Zeroable)]
pub struct BlockTq2_0 {
    /// 2-bit quants.
    pub qs: [u8; QK_K / 4],
    /// Scale.
    pub d: f16,
}
block_format!(
    BlockTq2_0,
    TQ2_0,
    elems = 256,
    bytes = 66,
    partner = super::BlockQ8K
);

impl BlockTq2_0 {
    fn decode(&self, out: &mut [f32; QK_K]) {
        let d = f16_to_f32(self.d);
        let mut y = 0;
        for group in self.qs.chunks_exact(32) {
            for l in 0..4 {
                for &byte in group {
                    let q = ((byte >> (2 * l)) & 3) as i32;
                    out[y] = (q - 1) as f32 * d;
                    y += 1;
                }
            }
        }
    }
    fn scale_values(&self) -> ScaleList {
        ScaleList::of(&[f16_to_f32(self.d)])
    }
}
