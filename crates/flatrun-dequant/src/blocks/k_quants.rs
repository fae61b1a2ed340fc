//! The K-quants: 256-weight super-blocks split into sub-blocks of 16 or 32
//! weights, each with its own quantized scale (and minimum), plus the
//! activation format Q8_K.

use bytemuck::{Pod, Zeroable};
use half::f16;

use super::{QK_K, ScaleList, block_format, byte_offsets, f16_to_f32};

/// Bytes of the packed 6-bit scales and mins of Q4_K and Q5_K.
pub const K_SCALE_SIZE: usize = 12;

/// Q2_K — 2.625 bits per weight: 16 sub-blocks of 16, `w = d*sc*q - dmin*m`
/// with 4-bit `sc`, `m` and 2-bit q.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Pod, Zeroable)]
pub struct BlockQ2K {
    /// Per sub-block: scale in the low nibble, min in the high nibble.
    pub scales: [u8; QK_K / 16],
    /// 2-bit quants: byte `l` of each 32-byte group holds four weights
    /// 32 apart (bit pairs 0-1, 2-3, 4-5, 6-7).
    pub qs: [u8; QK_K / 4],
    /// Super-block scale of the scales.
    pub d: f16,
    /// Super-block scale of the mins.
    pub dmin: f16,
}
block_format!(BlockQ2K, Q2_K, elems = 256, bytes = 84, partner = BlockQ8K);
byte_offsets!(BlockQ2K { scales => SCALES_OFFSET, qs => QS_OFFSET, d => D_OFFSET, dmin => DMIN_OFFSET });

impl BlockQ2K {
    fn decode(&self, out: &mut [f32; QK_K]) {
        let d = f16_to_f32(self.d);
        let min = f16_to_f32(self.dmin);
        let mut y = 0;
        let mut is = 0;
        // Two halves of 128 weights, each reading 32 bytes of qs four times.
        for q in self.qs.chunks_exact(32) {
            for shift in [0, 2, 4, 6] {
                // Two sub-blocks of 16 per shift: bytes 0..16 and 16..32.
                for half_bytes in q.chunks_exact(16) {
                    let sc = self.scales[is];
                    is += 1;
                    let dl = d * (sc & 0x0F) as f32;
                    let ml = min * (sc >> 4) as f32;
                    for &byte in half_bytes {
                        out[y] = dl * ((byte >> shift) & 3) as f32 - ml;
                        y += 1;
                    }
                }
            }
        }
    }
    fn scale_values(&self) -> ScaleList {
        ScaleList::of(&[f16_to_f32(self.d), f16_to_f32(self.dmin)])
    }
}

/// Q3_K — 3.4375 bits per weight: 16 sub-blocks of 16, `w = d*(sc-32)*q`
/// with 6-bit `sc` and q in -4..4 (2 low bits in `qs`, the high bit in
/// `hmask`, set meaning "no −4").
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Pod, Zeroable)]
pub struct BlockQ3K {
    /// High bit of each quant: bit `k` of byte `l` for weight `32*k + l`.
    pub hmask: [u8; QK_K / 8],
    /// Low 2 bits of each quant (same order as Q2_K).
    pub qs: [u8; QK_K / 4],
    /// Sixteen 6-bit scales packed into 12 bytes.
    pub scales: [u8; 12],
    /// Super-block scale.
    pub d: f16,
}
block_format!(BlockQ3K, Q3_K, elems = 256, bytes = 110, partner = BlockQ8K);
byte_offsets!(BlockQ3K { hmask => HMASK_OFFSET, qs => QS_OFFSET, scales => SCALES_OFFSET, d => D_OFFSET });

impl BlockQ3K {
    /// Unpack the sixteen 6-bit scales (as signed values, still offset by 32).
    pub fn unpacked_scales(&self) -> [i8; 16] {
        q3k_scales(&self.scales)
    }

    fn decode(&self, out: &mut [f32; QK_K]) {
        let d_all = f16_to_f32(self.d);
        let scales = self.unpacked_scales();
        let mut y = 0;
        let mut is = 0;
        let mut m: u8 = 1;
        for q in self.qs.chunks_exact(32) {
            for shift in [0, 2, 4, 6] {
                for half in 0..2 {
                    let dl = d_all * (scales[is] as i32 - 32) as f32;
                    is += 1;
                    for l in 0..16 {
                        let k = half * 16 + l;
                        let low = ((q[k] >> shift) & 3) as i32;
                        let sub = if self.hmask[k] & m != 0 { 0 } else { 4 };
                        out[y] = dl * (low - sub) as f32;
                        y += 1;
                    }
                }
                m <<= 1;
            }
        }
    }
    fn scale_values(&self) -> ScaleList {
        ScaleList::of(&[f16_to_f32(self.d)])
    }
}

/// The sixteen 6-bit scales of a Q3_K block from its 12 packed bytes
/// ([`BlockQ3K::scales`]), still offset by 32: scale `j` takes its low 4 bits
/// from the nibble of byte `j % 8` (the high nibble for `j >= 8`) and its top
/// 2 bits from bits `2·(j / 4)` of byte `8 + j % 4`.
#[inline]
pub fn q3k_scales(s: &[u8; 12]) -> [i8; 16] {
    let mut out = [0i8; 16];
    for (j, o) in out.iter_mut().enumerate() {
        let low = if j < 8 { s[j] & 0x0F } else { s[j - 8] >> 4 };
        let high = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
        *o = (low | (high << 4)) as i8;
    }
    out
}

/// Scale and min of sub-block `j` of Q4_K/Q5_K (6 bits each, packed in 12 bytes).
#[inline]
pub fn scale_min_k4(j: usize, q: &[u8; K_SCALE_SIZE]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// Q4_K — 4.5 bits per weight: 8 sub-blocks of 32, `w = d*sc*q - dmin*m`
/// with 6-bit `sc`, `m` and 4-bit q.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Pod, Zeroable)]
pub struct BlockQ4K {
    /// Super-block scale of the scales.
    pub d: f16,
    /// Super-block scale of the mins.
    pub dmin: f16,
    /// Eight 6-bit scales and eight 6-bit mins (see [`scale_min_k4`]).
    pub scales: [u8; K_SCALE_SIZE],
    /// 4-bit quants: each 32-byte group holds 64 weights, low nibbles first.
    pub qs: [u8; QK_K / 2],
}
block_format!(BlockQ4K, Q4_K, elems = 256, bytes = 144, partner = BlockQ8K);
byte_offsets!(BlockQ4K { d => D_OFFSET, dmin => DMIN_OFFSET, scales => SCALES_OFFSET, qs => QS_OFFSET });

impl BlockQ4K {
    fn decode(&self, out: &mut [f32; QK_K]) {
        let d = f16_to_f32(self.d);
        let min = f16_to_f32(self.dmin);
        for (g, q) in self.qs.chunks_exact(32).enumerate() {
            let (sc1, m1) = scale_min_k4(2 * g, &self.scales);
            let (sc2, m2) = scale_min_k4(2 * g + 1, &self.scales);
            let (d1, m1) = (d * sc1 as f32, min * m1 as f32);
            let (d2, m2) = (d * sc2 as f32, min * m2 as f32);
            let y = &mut out[64 * g..64 * g + 64];
            for (l, &byte) in q.iter().enumerate() {
                y[l] = d1 * (byte & 0x0F) as f32 - m1;
                y[l + 32] = d2 * (byte >> 4) as f32 - m2;
            }
        }
    }
    fn scale_values(&self) -> ScaleList {
        ScaleList::of(&[f16_to_f32(self.d), f16_to_f32(self.dmin)])
    }
}

/// Q5_K — 5.5 bits per weight: as Q4_K with a fifth bit per weight in `qh`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Pod, Zeroable)]
pub struct BlockQ5K {
    /// Super-block scale of the scales.
    pub d: f16,
    /// Super-block scale of the mins.
    pub dmin: f16,
    /// Eight 6-bit scales and eight 6-bit mins.
    pub scales: [u8; K_SCALE_SIZE],
    /// Fifth bits: bit `2g` / `2g+1` of byte `l` for the low / high nibble of
    /// group `g`.
    pub qh: [u8; QK_K / 8],
    /// Low 4 bits of the quants (as Q4_K).
    pub qs: [u8; QK_K / 2],
}
block_format!(BlockQ5K, Q5_K, elems = 256, bytes = 176, partner = BlockQ8K);
byte_offsets!(BlockQ5K { d => D_OFFSET, dmin => DMIN_OFFSET, scales => SCALES_OFFSET, qh => QH_OFFSET, qs => QS_OFFSET });

impl BlockQ5K {
    fn decode(&self, out: &mut [f32; QK_K]) {
        let d = f16_to_f32(self.d);
        let min = f16_to_f32(self.dmin);
        for (g, ql) in self.qs.chunks_exact(32).enumerate() {
            let (sc1, m1) = scale_min_k4(2 * g, &self.scales);
            let (sc2, m2) = scale_min_k4(2 * g + 1, &self.scales);
            let (d1, m1) = (d * sc1 as f32, min * m1 as f32);
            let (d2, m2) = (d * sc2 as f32, min * m2 as f32);
            let (u1, u2) = (1u8 << (2 * g), 2u8 << (2 * g));
            let y = &mut out[64 * g..64 * g + 64];
            for (l, &byte) in ql.iter().enumerate() {
                let h1 = if self.qh[l] & u1 != 0 { 16 } else { 0 };
                let h2 = if self.qh[l] & u2 != 0 { 16 } else { 0 };
                y[l] = d1 * ((byte & 0x0F) + h1) as f32 - m1;
                y[l + 32] = d2 * ((byte >> 4) + h2) as f32 - m2;
            }
        }
    }
    fn scale_values(&self) -> ScaleList {
        ScaleList::of(&[f16_to_f32(self.d), f16_to_f32(self.dmin)])
    }
}

/// Q6_K — 6.5625 bits per weight: 16 sub-blocks of 16, `w = d*sc*(q-32)`
/// with 8-bit signed `sc` and 6-bit q (4 low bits in `ql`, 2 high in `qh`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Pod, Zeroable)]
pub struct BlockQ6K {
    /// Low 4 bits of the quants.
    pub ql: [u8; QK_K / 2],
    /// High 2 bits of the quants.
    pub qh: [u8; QK_K / 4],
    /// Sixteen 8-bit signed sub-block scales.
    pub scales: [i8; QK_K / 16],
    /// Super-block scale.
    pub d: f16,
}
block_format!(BlockQ6K, Q6_K, elems = 256, bytes = 210, partner = BlockQ8K);
byte_offsets!(BlockQ6K { ql => QL_OFFSET, qh => QH_OFFSET, scales => SCALES_OFFSET, d => D_OFFSET });

impl BlockQ6K {
    fn decode(&self, out: &mut [f32; QK_K]) {
        let d = f16_to_f32(self.d);
        // Two halves of 128 weights: 64 bytes of ql, 32 of qh, 8 scales each.
        for n in 0..2 {
            let ql = &self.ql[64 * n..64 * n + 64];
            let qh = &self.qh[32 * n..32 * n + 32];
            let sc = &self.scales[8 * n..8 * n + 8];
            let y = &mut out[128 * n..128 * n + 128];
            for l in 0..32 {
                let is = l / 16;
                let q1 = ((ql[l] & 0x0F) | ((qh[l] & 3) << 4)) as i32 - 32;
                let q2 = ((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                y[l] = d * sc[is] as f32 * q1 as f32;
                y[l + 32] = d * sc[is + 2] as f32 * q2 as f32;
                y[l + 64] = d * sc[is + 4] as f32 * q3 as f32;
                y[l + 96] = d * sc[is + 6] as f32 * q4 as f32;
            }
        }
    }
    fn scale_values(&self) -> ScaleList {
        ScaleList::of(&[f16_to_f32(self.d)])
    }
}

/// Q8_K — 9.125 bits per weight: `w = d * q` with an f32 scale and the sums
/// of each group of 16 quants (an activation format for the K-quant dots).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Pod, Zeroable)]
pub struct BlockQ8K {
    /// Scale (f32).
    pub d: f32,
    /// 256 signed quants.
    pub qs: [i8; QK_K],
    /// Sum of each group of 16 quants.
    pub bsums: [i16; QK_K / 16],
}
block_format!(BlockQ8K, Q8_K, elems = 256, bytes = 292, partner = BlockQ8K);

impl Default for BlockQ8K {
    /// All zeros (the quantization of 256 zeros).
    fn default() -> Self {
        bytemuck::Zeroable::zeroed()
    }
}

impl BlockQ8K {
    fn decode(&self, out: &mut [f32; QK_K]) {
        for (o, &q) in out.iter_mut().zip(&self.qs) {
            *o = self.d * q as f32;
        }
    }
    fn scale_values(&self) -> ScaleList {
        ScaleList::of(&[self.d])
    }
}
