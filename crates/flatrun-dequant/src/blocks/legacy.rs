//! The legacy 32-weight formats: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the
//! activation format Q8_1.
//!
//! Nibble order: byte `j` of `qs` holds weight `j` in its low nibble and
//! weight `j + 16` in its high nibble. The 5-bit formats keep the fifth bit of
//! weight `j` in bit `j` of the little-endian `qh` word.

use bytemuck::{Pod, Zeroable};
use half::f16;

use super::{ScaleList, block_format, byte_offsets, f16_to_f32};

/// Weights per legacy block.
pub const QK: usize = 32;

/// Q4_0 — 4.5 bits per weight: `w = d * (q - 8)`, q in 0..16.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Pod, Zeroable)]
pub struct BlockQ4_0 {
    /// Scale.
    pub d: f16,
    /// 32 4-bit quants (see the module docs for the nibble order).
    pub qs: [u8; QK / 2],
}
block_format!(BlockQ4_0, Q4_0, elems = 32, bytes = 18, partner = BlockQ8_0);
byte_offsets!(BlockQ4_0 { d => D_OFFSET, qs => QS_OFFSET });

impl BlockQ4_0 {
    fn decode(&self, out: &mut [f32; QK]) {
        let d = f16_to_f32(self.d);
        for (j, &byte) in self.qs.iter().enumerate() {
            // Low nibble → first half, high nibble → second half, centred on 8.
            out[j] = ((byte & 0x0F) as i32 - 8) as f32 * d;
            out[j + QK / 2] = ((byte >> 4) as i32 - 8) as f32 * d;
        }
    }
    fn scale_values(&self) -> ScaleList {
        ScaleList::of(&[f16_to_f32(self.d)])
    }
}

/// Q4_1 — 5 bits per weight: `w = d * q + m`, q in 0..16.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Pod, Zeroable)]
pub struct BlockQ4_1 {
    /// Scale.
    pub d: f16,
    /// Minimum (offset).
    pub m: f16,
    /// 32 4-bit quants.
    pub qs: [u8; QK / 2],
}
block_format!(BlockQ4_1, Q4_1, elems = 32, bytes = 20, partner = BlockQ8_1);
byte_offsets!(BlockQ4_1 { d => D_OFFSET, m => M_OFFSET, qs => QS_OFFSET });

impl BlockQ4_1 {
    fn decode(&self, out: &mut [f32; QK]) {
        let d = f16_to_f32(self.d);
        let m = f16_to_f32(self.m);
        for (j, &byte) in self.qs.iter().enumerate() {
            out[j] = (byte & 0x0F) as f32 * d + m;
            out[j + QK / 2] = (byte >> 4) as f32 * d + m;
        }
    }
    fn scale_values(&self) -> ScaleList {
        ScaleList::of(&[f16_to_f32(self.d), f16_to_f32(self.m)])
    }
}

/// Q5_0 — 5.5 bits per weight: `w = d * (q - 16)`, q in 0..32.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Pod, Zeroable)]
pub struct BlockQ5_0 {
    /// Scale.
    pub d: f16,
    /// Fifth bits, a little-endian u32: bit `j` belongs to weight `j`.
    pub qh: [u8; 4],
    /// Low 4 bits of the 32 quants.
    pub qs: [u8; QK / 2],
}
block_format!(BlockQ5_0, Q5_0, elems = 32, bytes = 22, partner = BlockQ8_0);
byte_offsets!(BlockQ5_0 { d => D_OFFSET, qh => QH_OFFSET, qs => QS_OFFSET });

impl BlockQ5_0 {
    fn decode(&self, out: &mut [f32; QK]) {
        let d = f16_to_f32(self.d);
        let qh = u32::from_le_bytes(self.qh);
        for (j, &byte) in self.qs.iter().enumerate() {
            // Fifth bit of weight j and of weight j + 16.
            let hi0 = ((qh >> j) & 1) << 4;
            let hi1 = ((qh >> (j + QK / 2)) & 1) << 4;
            out[j] = (((byte & 0x0F) as u32 | hi0) as i32 - 16) as f32 * d;
            out[j + QK / 2] = (((byte >> 4) as u32 | hi1) as i32 - 16) as f32 * d;
        }
    }
    fn scale_values(&self) -> ScaleList {
        ScaleList::of(&[f16_to_f32(self.d)])
    }
}

/// Q5_1 — 6 bits per weight: `w = d * q + m`, q in 0..32.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Pod, Zeroable)]
pub struct BlockQ5_1 {
    /// Scale.
    pub d: f16,
    /// Minimum (offset).
    pub m: f16,
    /// Fifth bits, a little-endian u32.
    pub qh: [u8; 4],
    /// Low 4 bits of the 32 quants.
    pub qs: [u8; QK / 2],
}
block_format!(BlockQ5_1, Q5_1, elems = 32, bytes = 24, partner = BlockQ8_1);
byte_offsets!(BlockQ5_1 { d => D_OFFSET, m => M_OFFSET, qh => QH_OFFSET, qs => QS_OFFSET });

impl BlockQ5_1 {
    fn decode(&self, out: &mut [f32; QK]) {
        let d = f16_to_f32(self.d);
        let m = f16_to_f32(self.m);
        let qh = u32::from_le_bytes(self.qh);
        for (j, &byte) in self.qs.iter().enumerate() {
            let hi0 = ((qh >> j) & 1) << 4;
            let hi1 = ((qh >> (j + QK / 2)) & 1) << 4;
            out[j] = ((byte & 0x0F) as u32 | hi0) as f32 * d + m;
            out[j + QK / 2] = ((byte >> 4) as u32 | hi1) as f32 * d + m;
        }
    }
    fn scale_values(&self) -> ScaleList {
        ScaleList::of(&[f16_to_f32(self.d), f16_to_f32(self.m)])
    }
}

/// Q8_0 — 8.5 bits per weight: `w = d * q`, q an i8.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Pod, Zeroable)]
pub struct BlockQ8_0 {
    /// Scale.
    pub d: f16,
    /// 32 signed quants.
    pub qs: [i8; QK],
}
block_format!(BlockQ8_0, Q8_0, elems = 32, bytes = 34, partner = BlockQ8_0);
byte_offsets!(BlockQ8_0 { d => D_OFFSET, qs => QS_OFFSET });

impl BlockQ8_0 {
    fn decode(&self, out: &mut [f32; QK]) {
        let d = f16_to_f32(self.d);
        for (o, &q) in out.iter_mut().zip(&self.qs) {
            *o = q as f32 * d;
        }
    }
    fn scale_values(&self) -> ScaleList {
        ScaleList::of(&[f16_to_f32(self.d)])
    }
}

/// Q8_1 — 9 bits per weight: `w = d * q`, with `s = d * sum(q)` precomputed
/// for the dot products of Q4_1/Q5_1 (an activation format).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Pod, Zeroable)]
pub struct BlockQ8_1 {
    /// Scale.
    pub d: f16,
    /// `d * sum(qs)`.
    pub s: f16,
    /// 32 signed quants.
    pub qs: [i8; QK],
}
block_format!(BlockQ8_1, Q8_1, elems = 32, bytes = 36, partner = BlockQ8_1);

impl BlockQ8_1 {
    fn decode(&self, out: &mut [f32; QK]) {
        let d = f16_to_f32(self.d);
        for (o, &q) in out.iter_mut().zip(&self.qs) {
            *o = q as f32 * d;
        }
    }
    fn scale_values(&self) -> ScaleList {
        ScaleList::of(&[f16_to_f32(self.d), f16_to_f32(self.s)])
    }
}
