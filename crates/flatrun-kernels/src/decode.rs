//! Scalar row decoders: the bytes of one weight row to f32.
//!
//! They are the yardstick of the reference backend and the fallback of the
//! native one for formats without a fused kernel. Layouts follow ggml's
//! `ggml-common.h` (a block is a little-endian f16 scale or two, then packed
//! values); each decoder reads top to bottom like the format's definition.

use flatrun_format::{DType, GgmlType};
use half::{bf16, f16};

use crate::weight::{Weight, WeightFormat};

/// The 16 non-linear levels of IQ4_NL and IQ4_XS.
pub(crate) const IQ4NL_LEVELS: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// Whether [`decode_row`] knows this GGML type.
pub(crate) fn is_supported(t: GgmlType) -> bool {
    use GgmlType::*;
    matches!(
        t,
        F32 | F16
            | BF16
            | Q4_0
            | Q4_1
            | Q5_0
            | Q5_1
            | Q8_0
            | Q2_K
            | Q3_K
            | Q4_K
            | Q5_K
            | Q6_K
            | IQ4_NL
            | IQ4_XS
            | Q1_0
    )
}

/// Little-endian f16 at `b[i..i+2]` as f32.
#[inline(always)]
pub(crate) fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// The 6-bit scale and min `j` (0..8) of a Q4_K/Q5_K block's 12 packed scale bytes.
#[inline(always)]
pub(crate) fn k4_scale_min(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

/// The 16 signed 6-bit scales of a Q3_K block (stored as 12 bytes), without the −32 offset removed.
#[inline(always)]
pub(crate) fn q3k_scales(s: &[u8]) -> [i8; 16] {
    let mut out = [0i8; 16];
    for (j, o) in out.iter_mut().enumerate() {
        // Low 4 bits: nibble of byte j%8 (low nibble for j<8, high for j>=8);
        // high 2 bits: 2-bit field j/4.. of bytes 8..12.
        let low = if j < 8 { s[j] & 0xF } else { s[j - 8] >> 4 };
        let high = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
        *o = ((low | (high << 4)) as i8) - 32;
    }
    out
}

/// Decode one row of `w` (row index `r`) into `out` (`w.cols` values).
pub(crate) fn decode_row(w: &Weight, r: usize, out: &mut [f32]) {
    let rb = w.row_bytes();
    let row = &w.data[r * rb..(r + 1) * rb];
    match w.format {
        WeightFormat::Ggml(t) => decode_ggml_row(t, row, out),
        WeightFormat::MlxAffine {
            bits,
            group_size,
            scale_dtype,
        } => {
            let sb = w.scale_row_bytes();
            let scales = w.scales.map_or(&[][..], |s| &s[r * sb..(r + 1) * sb]);
            let biases = w.biases.map_or(&[][..], |b| &b[r * sb..(r + 1) * sb]);
            decode_mlx_row(bits, group_size as usize, scale_dtype, row, scales, biases, out)
        }
    }
}

/// One scalar of an MLX scale/bias array.
#[inline(always)]
pub(crate) fn mlx_scalar(dtype: DType, b: &[u8], i: usize) -> f32 {
    match dtype {
        DType::Ggml(GgmlType::F32) => {
            f32::from_le_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]])
        }
        DType::Ggml(GgmlType::BF16) => bf16::from_le_bytes([b[2 * i], b[2 * i + 1]]).to_f32(),
        _ => f16::from_le_bytes([b[2 * i], b[2 * i + 1]]).to_f32(),
    }
}

/// One MLX affine row: value `i` is bits `[i*bits, (i+1)*bits)` of the
/// little-endian word stream, then `scale * q + bias` of its group.
pub(crate) fn decode_mlx_row(
    bits: u8,
    group_size: usize,
    scale_dtype: DType,
    row: &[u8],
    scales: &[u8],
    biases: &[u8],
    out: &mut [f32],
) {
    let bits = bits as usize;
    let mask = (1u64 << bits) - 1;
    for (i, o) in out.iter_mut().enumerate() {
        let bit = i * bits;
        let byte = bit / 8;
        // Up to 8 bits spanning at most two bytes (bits ≤ 8).
        let lo = row[byte] as u64;
        let hi = row.get(byte + 1).copied().unwrap_or(0) as u64;
        let q = ((lo | (hi << 8)) >> (bit % 8)) & mask;
        let g = i / group_size;
        *o = mlx_scalar(scale_dtype, scales, g) * q as f32 + mlx_scalar(scale_dtype, biases, g);
    }
}

/// Decode one row of GGML blocks.
pub(crate) fn decode_ggml_row(t: GgmlType, row: &[u8], out: &mut [f32]) {
    use GgmlType::*;
    let bs = t.block_size();
    let ts = t.type_size();
    match t {
        F32 => {
            for (o, b) in out.iter_mut().zip(row.chunks_exact(4)) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
            return;
        }
        F16 => {
            for (o, b) in out.iter_mut().zip(row.chunks_exact(2)) {
                *o = f16::from_le_bytes([b[0], b[1]]).to_f32();
            }
            return;
        }
        BF16 => {
            for (o, b) in out.iter_mut().zip(row.chunks_exact(2)) {
                *o = bf16::from_le_bytes([b[0], b[1]]).to_f32();
            }
            return;
        }
        _ => {}
    }
    for (blk, y) in row.chunks_exact(ts).zip(out.chunks_exact_mut(bs)) {
        match t {
            Q4_0 => {
                // d, then 16 bytes: low nibbles are values 0..16, high nibbles 16..32.
                let d = f16_at(blk, 0);
                for j in 0..16 {
                    let q = blk[2 + j];
                    y[j] = ((q & 0xF) as i32 - 8) as f32 * d;
                    y[j + 16] = ((q >> 4) as i32 - 8) as f32 * d;
                }
            }
            Q4_1 => {
                // d, m, then nibbles as in Q4_0: value = d*q + m.
                let d = f16_at(blk, 0);
                let m = f16_at(blk, 2);
                for j in 0..16 {
                    let q = blk[4 + j];
                    y[j] = (q & 0xF) as f32 * d + m;
                    y[j + 16] = (q >> 4) as f32 * d + m;
                }
            }
            Q5_0 | Q5_1 => {
                // d, [m], 32 high bits (bit j = fifth bit of value j), then nibbles.
                let (d, m, off, bias) = if t == Q5_0 {
                    (f16_at(blk, 0), 0.0, 2, 16)
                } else {
                    (f16_at(blk, 0), f16_at(blk, 2), 4, 0)
                };
                let qh = u32::from_le_bytes([blk[off], blk[off + 1], blk[off + 2], blk[off + 3]]);
                for j in 0..16 {
                    let q = blk[off + 4 + j];
                    let h0 = ((qh >> j) & 1) << 4;
                    let h1 = ((qh >> (j + 16)) & 1) << 4;
                    y[j] = (((q & 0xF) as u32 | h0) as i32 - bias) as f32 * d + m;
                    y[j + 16] = (((q >> 4) as u32 | h1) as i32 - bias) as f32 * d + m;
                }
            }
            Q8_0 => {
                let d = f16_at(blk, 0);
                for j in 0..32 {
                    y[j] = blk[2 + j] as i8 as f32 * d;
                }
            }
            IQ4_NL => {
                let d = f16_at(blk, 0);
                for j in 0..16 {
                    let q = blk[2 + j];
                    y[j] = IQ4NL_LEVELS[(q & 0xF) as usize] as f32 * d;
                    y[j + 16] = IQ4NL_LEVELS[(q >> 4) as usize] as f32 * d;
                }
            }
            Q1_0 => {
                // d, then 128 sign bits LSB first: 1 → +d, 0 → −d.
                let d = f16_at(blk, 0);
                for j in 0..128 {
                    let bit = (blk[2 + j / 8] >> (j % 8)) & 1;
                    y[j] = if bit == 1 { d } else { -d };
                }
            }
            Q2_K => {
                // scales[16] (low nibble scale, high nibble min), qs[64], d, dmin.
                let scales = &blk[0..16];
                let d = f16_at(blk, 80);
                let dmin = f16_at(blk, 82);
                for half in 0..2 {
                    let q = &blk[16 + 32 * half..16 + 32 * half + 32];
                    for shift_i in 0..4 {
                        for sub in 0..2 {
                            let sc = scales[half * 8 + shift_i * 2 + sub];
                            let dl = d * (sc & 0xF) as f32;
                            let ml = dmin * (sc >> 4) as f32;
                            let base = half * 128 + shift_i * 32 + sub * 16;
                            for l in 0..16 {
                                let v = (q[sub * 16 + l] >> (2 * shift_i)) & 3;
                                y[base + l] = dl * v as f32 - ml;
                            }
                        }
                    }
                }
            }
            Q3_K => {
                // hmask[32], qs[64], scales[12], d: value = d*(scale-32)*((q2 | hbit<<2) - 4).
                let hmask = &blk[0..32];
                let d = f16_at(blk, 108);
                let scales = q3k_scales(&blk[96..108]);
                for half in 0..2 {
                    let q = &blk[32 + 32 * half..32 + 32 * half + 32];
                    for shift_i in 0..4 {
                        let m = 1u8 << (half * 4 + shift_i);
                        for sub in 0..2 {
                            let dl = d * scales[half * 8 + shift_i * 2 + sub] as f32;
                            let base = half * 128 + shift_i * 32 + sub * 16;
                            for l in 0..16 {
                                let i = sub * 16 + l;
                                let low = ((q[i] >> (2 * shift_i)) & 3) as i32;
                                let high = if hmask[i] & m != 0 { 0 } else { 4 };
                                y[base + l] = dl * (low - high) as f32;
                            }
                        }
                    }
                }
            }
            Q4_K | Q5_K => {
                // d, dmin, scales[12] (8 six-bit scale/min pairs), [qh[32]], qs[128].
                let d = f16_at(blk, 0);
                let dmin = f16_at(blk, 2);
                let scales = &blk[4..16];
                let (qh, qs) = if t == Q4_K {
                    (&[][..], &blk[16..144])
                } else {
                    (&blk[16..48], &blk[48..176])
                };
                for chunk in 0..4 {
                    let q = &qs[32 * chunk..32 * chunk + 32];
                    let (s1, m1) = k4_scale_min(2 * chunk, scales);
                    let (s2, m2) = k4_scale_min(2 * chunk + 1, scales);
                    for l in 0..32 {
                        let (h1, h2) = if qh.is_empty() {
                            (0, 0)
                        } else {
                            (
                                ((qh[l] >> (2 * chunk)) & 1) << 4,
                                ((qh[l] >> (2 * chunk + 1)) & 1) << 4,
                            )
                        };
                        y[64 * chunk + l] =
                            d * s1 as f32 * ((q[l] & 0xF) | h1) as f32 - dmin * m1 as f32;
                        y[64 * chunk + 32 + l] =
                            d * s2 as f32 * ((q[l] >> 4) | h2) as f32 - dmin * m2 as f32;
                    }
                }
            }
            Q6_K => {
                // ql[128] low nibbles, qh[64] high 2-bit pairs, scales[16] i8, d.
                let d = f16_at(blk, 208);
                for half in 0..2 {
                    let ql = &blk[64 * half..64 * half + 64];
                    let qh = &blk[128 + 32 * half..128 + 32 * half + 32];
                    let sc = &blk[192 + 8 * half..192 + 8 * half + 8];
                    let y = &mut y[128 * half..128 * half + 128];
                    for l in 0..32 {
                        let is = l / 16;
                        let q1 = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i32 - 32;
                        let q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                        let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                        let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                        y[l] = d * (sc[is] as i8) as f32 * q1 as f32;
                        y[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
                        y[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
                        y[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
                    }
                }
            }
            IQ4_XS => {
                // d, scales_h u16, scales_l[4], qs[128]: 8 sub-blocks of 32 with 6-bit scales.
                let d = f16_at(blk, 0);
                let scales_h = u16::from_le_bytes([blk[2], blk[3]]);
                let scales_l = &blk[4..8];
                for ib in 0..8 {
                    let ls = ((scales_l[ib / 2] >> (4 * (ib % 2))) & 0xF) as i32
                        | ((((scales_h >> (2 * ib)) & 3) as i32) << 4);
                    let dl = d * (ls - 32) as f32;
                    let qs = &blk[8 + 16 * ib..8 + 16 * ib + 16];
                    for j in 0..16 {
                        y[32 * ib + j] = dl * IQ4NL_LEVELS[(qs[j] & 0xF) as usize] as f32;
                        y[32 * ib + j + 16] = dl * IQ4NL_LEVELS[(qs[j] >> 4) as usize] as f32;
                    }
                }
            }
            _ => y.fill(0.0),
        }
    }
}
