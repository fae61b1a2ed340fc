//! Portable kernels: the same integer arithmetic as the SIMD ones, one value at a time.
//! They serve `SimdLevel::Scalar` (and every level on a CPU without a SIMD version).

use flatrun_format::GgmlType;
use half::{bf16, f16};

use super::quantize::{BlockQ8, BlockQ8K, QK8, QK_K};
use crate::decode::{f16_at, k4_scale_min, q3k_scales, IQ4NL_LEVELS};

/// A 32-value block of a legacy format as integers: value = `d * q + m`.
struct Block32 {
    q: [i8; QK8],
    d: f32,
    m: f32,
}

/// Unpack sub-block `sub` of the weight block at `blk` (Q1_0 has 4 sub-blocks; the rest 1).
fn unpack_block32(t: GgmlType, blk: &[u8], sub: usize) -> Block32 {
    let mut q = [0i8; QK8];
    let (d, m) = match t {
        GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::IQ4_NL => {
            let off = if t == GgmlType::Q4_1 { 4 } else { 2 };
            for j in 0..16 {
                let (lo, hi) = (blk[off + j] & 0xF, blk[off + j] >> 4);
                let (lo, hi) = match t {
                    GgmlType::Q4_0 => (lo as i8 - 8, hi as i8 - 8),
                    GgmlType::IQ4_NL => (IQ4NL_LEVELS[lo as usize], IQ4NL_LEVELS[hi as usize]),
                    _ => (lo as i8, hi as i8),
                };
                q[j] = lo;
                q[j + 16] = hi;
            }
            let m = if t == GgmlType::Q4_1 {
                f16_at(blk, 2)
            } else {
                0.0
            };
            (f16_at(blk, 0), m)
        }
        GgmlType::Q5_0 | GgmlType::Q5_1 => {
            let off = if t == GgmlType::Q5_1 { 4 } else { 2 };
            let qh = u32::from_le_bytes([blk[off], blk[off + 1], blk[off + 2], blk[off + 3]]);
            let bias = if t == GgmlType::Q5_0 { 16 } else { 0 };
            for j in 0..16 {
                let b = blk[off + 4 + j];
                let lo = (b & 0xF) | ((((qh >> j) & 1) as u8) << 4);
                let hi = (b >> 4) | ((((qh >> (j + 16)) & 1) as u8) << 4);
                q[j] = lo as i8 - bias;
                q[j + 16] = hi as i8 - bias;
            }
            let m = if t == GgmlType::Q5_1 {
                f16_at(blk, 2)
            } else {
                0.0
            };
            (f16_at(blk, 0), m)
        }
        GgmlType::Q8_0 => {
            for j in 0..QK8 {
                q[j] = blk[2 + j] as i8;
            }
            (f16_at(blk, 0), 0.0)
        }
        GgmlType::Q1_0 => {
            for j in 0..QK8 {
                let bit = (blk[2 + 4 * sub + j / 8] >> (j % 8)) & 1;
                q[j] = if bit == 1 { 1 } else { -1 };
            }
            (f16_at(blk, 0), 0.0)
        }
        _ => (0.0, 0.0),
    };
    Block32 { q, d, m }
}

/// Row × Q8 activations for the legacy formats, Q1_0 and IQ4_NL.
pub(crate) fn dot_q8(t: GgmlType, row: &[u8], acts: &[&[BlockQ8]], out: &mut [f32]) {
    let ts = t.type_size();
    let subs = t.block_size() / QK8;
    for (a, o) in acts.iter().zip(out.iter_mut()) {
        let mut sum = 0f32;
        for (i, blk) in row.chunks_exact(ts).enumerate() {
            for sub in 0..subs {
                let w = unpack_block32(t, blk, sub);
                let Some(ab) = a.get(i * subs + sub) else {
                    break;
                };
                let sumi: i32 =
                    w.q.iter()
                        .zip(&ab.qs)
                        .map(|(&x, &y)| x as i32 * y as i32)
                        .sum();
                // d_w·d_a·Σq_w·q_a, plus the min times the activations' sum (Q4_1/Q5_1).
                sum += w.d * ab.d * sumi as f32 + w.m * ab.s;
            }
        }
        *o = sum;
    }
}

/// A 256-value super-block as integers: value = `d * scale[g] * q - dmin * min[g]` per 16-group `g`.
struct Block256 {
    q: [i8; QK_K],
    scale: [i32; 16],
    min: [i32; 16],
    d: f32,
    dmin: f32,
}

fn unpack_block256(t: GgmlType, blk: &[u8]) -> Block256 {
    let mut b = Block256 {
        q: [0; QK_K],
        scale: [0; 16],
        min: [0; 16],
        d: 0.0,
        dmin: 0.0,
    };
    match t {
        GgmlType::Q2_K => {
            b.d = f16_at(blk, 80);
            b.dmin = f16_at(blk, 82);
            for (g, &sc) in blk[..16].iter().enumerate() {
                b.scale[g] = (sc & 0xF) as i32;
                b.min[g] = (sc >> 4) as i32;
            }
            for i in 0..QK_K {
                let (half, s, l) = (i / 128, (i % 128) / 32, i % 32);
                b.q[i] = ((blk[16 + 32 * half + l] >> (2 * s)) & 3) as i8;
            }
        }
        GgmlType::Q3_K => {
            b.d = f16_at(blk, 108);
            let sc = q3k_scales(&blk[96..108]);
            for (s, &v) in b.scale.iter_mut().zip(&sc) {
                *s = v as i32;
            }
            for i in 0..QK_K {
                let (half, s, l) = (i / 128, (i % 128) / 32, i % 32);
                let low = (blk[32 + 32 * half + l] >> (2 * s)) & 3;
                let high = (blk[l] >> (4 * half + s)) & 1;
                b.q[i] = (low | (high << 2)) as i8 - 4;
            }
        }
        GgmlType::Q4_K | GgmlType::Q5_K => {
            b.d = f16_at(blk, 0);
            b.dmin = f16_at(blk, 2);
            for j in 0..8 {
                let (s, m) = k4_scale_min(j, &blk[4..16]);
                b.scale[2 * j] = s as i32;
                b.scale[2 * j + 1] = s as i32;
                b.min[2 * j] = m as i32;
                b.min[2 * j + 1] = m as i32;
            }
            let qs = if t == GgmlType::Q4_K {
                &blk[16..144]
            } else {
                &blk[48..176]
            };
            for i in 0..QK_K {
                let (c, hi, l) = (i / 64, (i % 64) / 32, i % 32);
                let mut v = (qs[32 * c + l] >> (4 * hi)) & 0xF;
                if t == GgmlType::Q5_K {
                    v |= ((blk[16 + l] >> (2 * c + hi)) & 1) << 4;
                }
                b.q[i] = v as i8;
            }
        }
        GgmlType::Q6_K => {
            b.d = f16_at(blk, 208);
            for g in 0..16 {
                b.scale[g] = blk[192 + g] as i8 as i32;
            }
            for i in 0..QK_K {
                let (half, k, l) = (i / 128, (i % 128) / 32, i % 32);
                let ql = blk[64 * half + l + 32 * (k % 2)];
                let low = if k < 2 { ql & 0xF } else { ql >> 4 };
                let high = (blk[128 + 32 * half + l] >> (2 * k)) & 3;
                b.q[i] = (low | (high << 4)) as i8 - 32;
            }
        }
        GgmlType::IQ4_XS => {
            b.d = f16_at(blk, 0);
            let scales_h = u16::from_le_bytes([blk[2], blk[3]]);
            for ib in 0..8 {
                let ls = ((blk[4 + ib / 2] >> (4 * (ib % 2))) & 0xF) as i32
                    | ((((scales_h >> (2 * ib)) & 3) as i32) << 4);
                b.scale[2 * ib] = ls - 32;
                b.scale[2 * ib + 1] = ls - 32;
                for j in 0..16 {
                    let q = blk[8 + 16 * ib + j];
                    b.q[32 * ib + j] = IQ4NL_LEVELS[(q & 0xF) as usize];
                    b.q[32 * ib + j + 16] = IQ4NL_LEVELS[(q >> 4) as usize];
                }
            }
        }
        _ => {}
    }
    b
}

/// Row × Q8_K activations for the K-quants and IQ4_XS.
pub(crate) fn dot_q8k(t: GgmlType, row: &[u8], acts: &[&[BlockQ8K]], out: &mut [f32]) {
    let ts = t.type_size();
    for (a, o) in acts.iter().zip(out.iter_mut()) {
        let mut sum = 0f32;
        for (i, blk) in row.chunks_exact(ts).enumerate() {
            let Some(ab) = a.get(i) else { break };
            let w = unpack_block256(t, blk);
            // Σ_g scale_g·Σ q_w·q_a, and the mins against the activations' group sums.
            let mut sumi = 0i32;
            let mut summ = 0i32;
            for g in 0..16 {
                let dot: i32 = (0..16)
                    .map(|l| w.q[16 * g + l] as i32 * ab.qs[16 * g + l] as i32)
                    .sum();
                sumi += w.scale[g] * dot;
                summ += w.min[g] * ab.bsums[g] as i32;
            }
            sum += w.d * ab.d * sumi as f32 - w.dmin * ab.d * summ as f32;
        }
        *o = sum;
    }
}

/// Row of plain floats × f32 activations.
pub(crate) fn dot_f32(t: GgmlType, row: &[u8], acts: &[&[f32]], out: &mut [f32]) {
    for (a, o) in acts.iter().zip(out.iter_mut()) {
        *o = match t {
            GgmlType::F32 => row
                .chunks_exact(4)
                .zip(a.iter())
                .map(|(b, &x)| f32::from_le_bytes([b[0], b[1], b[2], b[3]]) * x)
                .sum(),
            GgmlType::F16 => row
                .chunks_exact(2)
                .zip(a.iter())
                .map(|(b, &x)| f16::from_le_bytes([b[0], b[1]]).to_f32() * x)
                .sum(),
            GgmlType::BF16 => row
                .chunks_exact(2)
                .zip(a.iter())
                .map(|(b, &x)| bf16::from_le_bytes([b[0], b[1]]).to_f32() * x)
                .sum(),
            _ => 0.0,
        };
    }
}
