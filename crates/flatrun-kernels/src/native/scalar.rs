//! Portable kernels: the same integer arithmetic as the SIMD ones, one value at a time.
//! They serve `SimdLevel::Scalar` (and every level on a CPU without a SIMD version), and
//! every SIMD entry point falls back to them for a call whose slices it cannot vouch for.
//! Blocks are read through flatrun-dequant's structs, one unpacker per format.

use flatrun_dequant::blocks::fp4::e8m0_to_f32_half;
use flatrun_dequant::blocks::k_quants::{q3k_scales, scale_min_k4};
use flatrun_dequant::iq_grids::{KVALUES_FP4, KVALUES_IQ4NL};
use flatrun_dequant::{
    BlockFormat, BlockIq4Nl, BlockIq4Xs, BlockMxfp4, BlockQ1_0, BlockQ2K, BlockQ3K, BlockQ4_0,
    BlockQ4_1, BlockQ4K, BlockQ5_0, BlockQ5_1, BlockQ5K, BlockQ6K, BlockQ8_0,
};
use flatrun_format::GgmlType;
use half::{bf16, f16};

use super::dispatch::each_row;
use super::quantize::{BlockQ8, BlockQ8K, QK_K, QK8};

/// Rows × Q8 tile (legacy formats, Q1_0, IQ4_NL): the `Scalar` level's entry,
/// as `x86::*::rows_q8` and `arm::*::rows_q8` are the SIMD levels'.
pub(crate) fn rows_q8(t: GgmlType, rows: &[u8], rb: usize, acts: &[&[BlockQ8]], out: &mut [f32]) {
    each_row(dot_q8, t, rows, rb, acts, out)
}

/// Rows × Q8_K tile (K-quants, IQ4_XS).
pub(crate) fn rows_q8k(t: GgmlType, rows: &[u8], rb: usize, acts: &[&[BlockQ8K]], out: &mut [f32]) {
    each_row(dot_q8k, t, rows, rb, acts, out)
}

/// Rows × f32 tile (F32, F16, BF16).
pub(crate) fn rows_f32(t: GgmlType, rows: &[u8], rb: usize, acts: &[&[f32]], out: &mut [f32]) {
    each_row(dot_f32, t, rows, rb, acts, out)
}

/// The block at the start of `blk` (exactly one block's bytes: the callers
/// cut rows with `chunks_exact(type_size)`), copied out of the unaligned bytes.
#[inline]
fn read<B: BlockFormat>(blk: &[u8]) -> B {
    bytemuck::pod_read_unaligned(&blk[..B::BLOCK_BYTES])
}

/// A 32-value block of a legacy format as integers: value = `d * q + m`.
struct Block32 {
    q: [i8; QK8],
    d: f32,
    m: f32,
}

/// The 32 values of 16 bytes of nibbles `qs` (byte `j`: value `j` in the low
/// nibble, `j + 16` in the high one), each mapped by `value`.
#[inline]
fn split_nibbles(qs: &[u8], value: impl Fn(u8) -> i8) -> [i8; QK8] {
    let mut q = [0i8; QK8];
    for (j, &b) in qs.iter().enumerate() {
        q[j] = value(b & 0xF);
        q[j + 16] = value(b >> 4);
    }
    q
}

/// The 32 values of a 5-bit block: the nibbles of `qs` with bit `j` of `qh`
/// as the fifth bit of value `j`, less `bias`.
#[inline]
fn fifth_bits(qs: &[u8; 16], qh: [u8; 4], bias: i8) -> [i8; QK8] {
    let qh = u32::from_le_bytes(qh);
    let mut q = [0i8; QK8];
    for (j, &b) in qs.iter().enumerate() {
        let lo = (b & 0xF) | ((((qh >> j) & 1) as u8) << 4);
        let hi = (b >> 4) | ((((qh >> (j + 16)) & 1) as u8) << 4);
        q[j] = lo as i8 - bias;
        q[j + 16] = hi as i8 - bias;
    }
    q
}

/// Unpack sub-block `sub` of the weight block at `blk` (Q1_0 has 4 sub-blocks; the rest 1).
fn unpack_block32(t: GgmlType, blk: &[u8], sub: usize) -> Block32 {
    let block = |q, d: f16, m: f32| Block32 {
        q,
        d: d.to_f32(),
        m,
    };
    match t {
        GgmlType::Q4_0 => {
            let b: BlockQ4_0 = read(blk);
            block(split_nibbles(&b.qs, |v| v as i8 - 8), b.d, 0.0)
        }
        GgmlType::Q4_1 => {
            let b: BlockQ4_1 = read(blk);
            block(split_nibbles(&b.qs, |v| v as i8), b.d, b.m.to_f32())
        }
        GgmlType::IQ4_NL => {
            let b: BlockIq4Nl = read(blk);
            block(
                split_nibbles(&b.qs, |v| KVALUES_IQ4NL[v as usize]),
                b.d,
                0.0,
            )
        }
        GgmlType::MXFP4 => {
            // The doubled E2M1 levels times half the E8M0 scale (ggml's
            // `ggml_vec_dot_mxfp4_q8_0`).
            let b: BlockMxfp4 = read(blk);
            Block32 {
                q: split_nibbles(&b.qs, |v| KVALUES_FP4[v as usize]),
                d: e8m0_to_f32_half(b.e),
                m: 0.0,
            }
        }
        GgmlType::Q5_0 => {
            let b: BlockQ5_0 = read(blk);
            block(fifth_bits(&b.qs, b.qh, 16), b.d, 0.0)
        }
        GgmlType::Q5_1 => {
            let b: BlockQ5_1 = read(blk);
            block(fifth_bits(&b.qs, b.qh, 0), b.d, b.m.to_f32())
        }
        GgmlType::Q8_0 => {
            let b: BlockQ8_0 = read(blk);
            block(b.qs, b.d, 0.0)
        }
        GgmlType::Q1_0 => {
            let b: BlockQ1_0 = read(blk);
            let mut q = [0i8; QK8];
            for (j, v) in q.iter_mut().enumerate() {
                let bit = (b.qs[4 * sub + j / 8] >> (j % 8)) & 1;
                *v = if bit == 1 { 1 } else { -1 };
            }
            block(q, b.d, 0.0)
        }
        _ => Block32 {
            q: [0; QK8],
            d: 0.0,
            m: 0.0,
        },
    }
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

/// The values, scales and mins of a Q4_K (`qh = None`) or Q5_K block.
fn unpack_k45(
    b: &mut Block256,
    (d, dmin): (f16, f16),
    scales: &[u8; 12],
    qs: &[u8; QK_K / 2],
    qh: Option<&[u8; QK_K / 8]>,
) {
    b.d = d.to_f32();
    b.dmin = dmin.to_f32();
    for j in 0..8 {
        let (s, m) = scale_min_k4(j, scales);
        b.scale[2 * j] = s as i32;
        b.scale[2 * j + 1] = s as i32;
        b.min[2 * j] = m as i32;
        b.min[2 * j + 1] = m as i32;
    }
    for i in 0..QK_K {
        let (c, hi, l) = (i / 64, (i % 64) / 32, i % 32);
        let mut v = (qs[32 * c + l] >> (4 * hi)) & 0xF;
        if let Some(qh) = qh {
            v |= ((qh[l] >> (2 * c + hi)) & 1) << 4;
        }
        b.q[i] = v as i8;
    }
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
            let w: BlockQ2K = read(blk);
            b.d = w.d.to_f32();
            b.dmin = w.dmin.to_f32();
            for (g, &sc) in w.scales.iter().enumerate() {
                b.scale[g] = (sc & 0xF) as i32;
                b.min[g] = (sc >> 4) as i32;
            }
            for i in 0..QK_K {
                let (half, s, l) = (i / 128, (i % 128) / 32, i % 32);
                b.q[i] = ((w.qs[32 * half + l] >> (2 * s)) & 3) as i8;
            }
        }
        GgmlType::Q3_K => {
            let w: BlockQ3K = read(blk);
            b.d = w.d.to_f32();
            for (s, &v) in b.scale.iter_mut().zip(&q3k_scales(&w.scales)) {
                *s = v as i32 - 32;
            }
            for i in 0..QK_K {
                let (half, s, l) = (i / 128, (i % 128) / 32, i % 32);
                let low = (w.qs[32 * half + l] >> (2 * s)) & 3;
                let high = (w.hmask[l] >> (4 * half + s)) & 1;
                b.q[i] = (low | (high << 2)) as i8 - 4;
            }
        }
        GgmlType::Q4_K => {
            let w: BlockQ4K = read(blk);
            unpack_k45(&mut b, (w.d, w.dmin), &w.scales, &w.qs, None);
        }
        GgmlType::Q5_K => {
            let w: BlockQ5K = read(blk);
            unpack_k45(&mut b, (w.d, w.dmin), &w.scales, &w.qs, Some(&w.qh));
        }
        GgmlType::Q6_K => {
            let w: BlockQ6K = read(blk);
            b.d = w.d.to_f32();
            for (s, &v) in b.scale.iter_mut().zip(&w.scales) {
                *s = v as i32;
            }
            for i in 0..QK_K {
                let (half, k, l) = (i / 128, (i % 128) / 32, i % 32);
                let ql = w.ql[64 * half + l + 32 * (k % 2)];
                let low = if k < 2 { ql & 0xF } else { ql >> 4 };
                let high = (w.qh[32 * half + l] >> (2 * k)) & 3;
                b.q[i] = (low | (high << 4)) as i8 - 32;
            }
        }
        GgmlType::IQ4_XS => {
            let w: BlockIq4Xs = read(blk);
            b.d = w.d.to_f32();
            for ib in 0..8 {
                let ls = ((w.scales_l[ib / 2] >> (4 * (ib % 2))) & 0xF) as i32
                    | ((((w.scales_h >> (2 * ib)) & 3) as i32) << 4);
                b.scale[2 * ib] = ls - 32;
                b.scale[2 * ib + 1] = ls - 32;
                let q = split_nibbles(&w.qs[16 * ib..16 * ib + 16], |v| KVALUES_IQ4NL[v as usize]);
                b.q[32 * ib..32 * ib + 32].copy_from_slice(&q);
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
