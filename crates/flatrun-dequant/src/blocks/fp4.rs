//! Microscaling FP4 formats: E2M1 values with a shared power-of-two (MXFP4)
//! or UE4M3 (NVFP4) scale.
//!
//! The codebook [`KVALUES_FP4`] holds the E2M1 values doubled (0, ±0.5, ±1,
//! …, ±6 become 0, ±1, ±2, …, ±12), so both scale decoders return half the
//! nominal scale.

use bytemuck::{Pod, Zeroable};

use super::{ScaleList, block_format};
use crate::iq_grids::KVALUES_FP4;

/// Half of the E8M0 value `2^(e - 127)`, as ggml's `ggml_e8m0_to_fp32_half`.
#[inline]
pub fn e8m0_to_f32_half(e: u8) -> f32 {
    let bits = if e < 2 {
        // 2^-128 and 2^-127 are subnormal.
        0x0020_0000u32 << e
    } else {
        ((e as u32) - 1) << 23
    };
    f32::from_bits(bits)
}

/// Half of an unsigned E4M3 scale (bias 7, no sign; 0 and 0x7F decode to 0),
/// as ggml's `ggml_ue4m3_to_fp32`. The top bit is ignored.
#[inline]
pub fn ue4m3_to_f32_half(x: u8) -> f32 {
    if x == 0 || x == 0x7F {
        return 0.0;
    }
    let exp = ((x >> 3) & 0x0F) as i32;
    let man = (x & 0x07) as f32;
    let raw = if exp == 0 {
        // Subnormal: man * 2^-9.
        man * f32::from_bits(((127 - 9) as u32) << 23)
    } else {
        (1.0 + man / 8.0) * f32::from_bits(((exp - 7 + 127) as u32) << 23)
    };
    raw * 0.5
}

/// MXFP4 — 4.25 bits per weight: 32 E2M1 values sharing one E8M0 exponent.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Pod, Zeroable)]
pub struct BlockMxfp4 {
    /// Shared exponent (E8M0).
    pub e: u8,
    /// 32 4-bit codes: low nibble weight `j`, high nibble weight `j + 16`.
    pub qs: [u8; 16],
}
block_format!(
    BlockMxfp4,
    MXFP4,
    elems = 32,
    bytes = 17,
    partner = super::BlockQ8_0
);

impl BlockMxfp4 {
    fn decode(&self, out: &mut [f32; 32]) {
        let d = e8m0_to_f32_half(self.e);
        for (j, &byte) in self.qs.iter().enumerate() {
            out[j] = KVALUES_FP4[(byte & 0x0F) as usize] as f32 * d;
            out[j + 16] = KVALUES_FP4[(byte >> 4) as usize] as f32 * d;
        }
    }
    fn scale_values(&self) -> ScaleList {
        // Every E8M0 byte decodes to a finite power of two.
        ScaleList::EMPTY
    }
}

/// NVFP4 — 4.5 bits per weight: 64 E2M1 values in four sub-blocks of 16,
/// each with a UE4M3 scale.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Pod, Zeroable)]
pub struct BlockNvfp4 {
    /// One UE4M3 scale per 16-weight sub-block.
    pub d: [u8; 4],
    /// 8 bytes per sub-block: low nibble weight `j`, high nibble `j + 8`.
    pub qs: [u8; 32],
}
block_format!(
    BlockNvfp4,
    NVFP4,
    elems = 64,
    bytes = 36,
    partner = super::BlockQ8_0
);

impl BlockNvfp4 {
    fn decode(&self, out: &mut [f32; 64]) {
        for s in 0..4 {
            let d = ue4m3_to_f32_half(self.d[s]);
            let y = &mut out[16 * s..16 * s + 16];
            for j in 0..8 {
                let byte = self.qs[8 * s + j];
                y[j] = KVALUES_FP4[(byte & 0x0F) as usize] as f32 * d;
                y[j + 8] = KVALUES_FP4[(byte >> 4) as usize] as f32 * d;
            }
        }
    }
    fn scale_values(&self) -> ScaleList {
        // Every UE4M3 byte decodes to a finite value.
        ScaleList::EMPTY
    }
}
