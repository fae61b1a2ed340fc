//! Reference quantizers, byte for byte equal to ggml's `quantize_row_*_ref`:
//! the activation formats Q8_0, Q8_1 and Q8_K that the matmul kernels need,
//! and the weight formats Q4_0, Q4_1, Q5_0, Q5_1, Q1_0, Q2_0, MXFP4, TQ1_0 and
//! TQ2_0, IQ4_NL (without an importance matrix), and, in
//! [`crate::quantize_k`], Q2_K, Q3_K, Q4_K, Q5_K and Q6_K.
//!
//! Rounding follows ggml exactly: `roundf` (half away from zero) for the
//! 8-bit formats, truncation after adding 0.5 / 8.5 / 16.5 for the 4- and 5-bit
//! ones, and the `nearest_int` bit trick (half to even) for Q8_K.

use flatrun_format::GgmlType;
use half::f16;

use crate::blocks::fp4::e8m0_to_f32_half;
use crate::blocks::*;
use crate::error::{DequantError, Result};
use crate::iq_grids::{KVALUES_FP4, KVALUES_IQ4NL};

/// A block format with a reference quantizer.
pub trait BlockQuantizer: BlockFormat {
    /// Quantize `x[..Self::BLOCK_ELEMS]` into one block.
    ///
    /// # Panics
    /// If `x` is shorter than [`BlockFormat::BLOCK_ELEMS`].
    fn quantize_block(x: &[f32]) -> Self;
}

/// Absolute maximum of `x`, and the value that has it (first one wins).
fn abs_max_with_sign(x: &[f32]) -> (f32, f32) {
    let (mut amax, mut max) = (0.0f32, 0.0f32);
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    (amax, max)
}

/// Absolute maximum of `x` (`MAX(amax, fabsf(v))`).
fn abs_max(x: &[f32]) -> f32 {
    x.iter().fold(
        0.0f32,
        |amax, &v| if amax > v.abs() { amax } else { v.abs() },
    )
}

/// Minimum and maximum of `x`, starting from ±FLT_MAX.
fn min_max(x: &[f32]) -> (f32, f32) {
    let (mut min, mut max) = (f32::MAX, -f32::MAX);
    for &v in x {
        if v < min {
            min = v;
        }
        if v > max {
            max = v;
        }
    }
    (min, max)
}

/// `1/d`, or 0 when `d` is 0.
fn inverse(d: f32) -> f32 {
    if d != 0.0 { 1.0 / d } else { 0.0 }
}

/// ggml's `nearest_int`: round to nearest, ties to even, through the f32
/// mantissa (valid for |x| < 2^22).
pub(crate) fn nearest_int(x: f32) -> i32 {
    let bits = (x + 12_582_912.0).to_bits();
    (bits & 0x007F_FFFF) as i32 - 0x0040_0000
}

impl BlockQuantizer for BlockQ8_0 {
    fn quantize_block(x: &[f32]) -> Self {
        let x = &x[..32];
        // Scale so that the largest magnitude maps to ±127.
        let d = abs_max(x) / 127.0;
        let id = inverse(d);
        let mut qs = [0i8; 32];
        for (q, &v) in qs.iter_mut().zip(x) {
            *q = (v * id).round() as i8;
        }
        BlockQ8_0 {
            d: f16::from_f32(d),
            qs,
        }
    }
}

impl BlockQuantizer for BlockQ8_1 {
    fn quantize_block(x: &[f32]) -> Self {
        let x = &x[..32];
        let d = abs_max(x) / 127.0;
        let id = inverse(d);
        let mut qs = [0i8; 32];
        for (q, &v) in qs.iter_mut().zip(x) {
            *q = (v * id).round() as i8;
        }
        // The sum of the quants times d, for the min term of Q4_1/Q5_1 dots.
        let sum: i32 = qs.iter().map(|&q| q as i32).sum();
        BlockQ8_1 {
            d: f16::from_f32(d),
            s: f16::from_f32(sum as f32 * d),
            qs,
        }
    }
}

impl BlockQuantizer for BlockQ8K {
    fn quantize_block(x: &[f32]) -> Self {
        let x = &x[..QK_K];
        let (amax, max) = {
            let (mut amax, mut max) = (0.0f32, 0.0f32);
            for &v in x {
                if v.abs() > amax {
                    amax = v.abs();
                    max = v;
                }
            }
            (amax, max)
        };
        let mut block = BlockQ8K {
            d: 0.0,
            qs: [0; QK_K],
            bsums: [0; QK_K / 16],
        };
        if amax == 0.0 {
            return block;
        }
        // -127/max (not -128): the sign of the largest value maps to -127.
        let iscale = -127.0 / max;
        for (q, &v) in block.qs.iter_mut().zip(x) {
            *q = nearest_int(iscale * v).min(127) as i8;
        }
        for (sum, group) in block.bsums.iter_mut().zip(block.qs.chunks_exact(16)) {
            *sum = group.iter().map(|&q| q as i16).sum();
        }
        block.d = 1.0 / iscale;
        block
    }
}

impl BlockQuantizer for BlockQ4_0 {
    fn quantize_block(x: &[f32]) -> Self {
        let x = &x[..32];
        // The signed value of largest magnitude maps to -8.
        let (_, max) = abs_max_with_sign(x);
        let d = max / -8.0;
        let id = inverse(d);
        let mut qs = [0u8; 16];
        for (j, q) in qs.iter_mut().enumerate() {
            let q0 = ((x[j] * id + 8.5) as i8).min(15) as u8;
            let q1 = ((x[j + 16] * id + 8.5) as i8).min(15) as u8;
            *q = q0 | (q1 << 4);
        }
        BlockQ4_0 {
            d: f16::from_f32(d),
            qs,
        }
    }
}

impl BlockQuantizer for BlockQ4_1 {
    fn quantize_block(x: &[f32]) -> Self {
        let x = &x[..32];
        let (min, max) = min_max(x);
        let d = (max - min) / 15.0;
        let id = inverse(d);
        let mut qs = [0u8; 16];
        for (j, q) in qs.iter_mut().enumerate() {
            let q0 = (((x[j] - min) * id + 0.5) as i8).min(15) as u8;
            let q1 = (((x[j + 16] - min) * id + 0.5) as i8).min(15) as u8;
            *q = q0 | (q1 << 4);
        }
        BlockQ4_1 {
            d: f16::from_f32(d),
            m: f16::from_f32(min),
            qs,
        }
    }
}

impl BlockQuantizer for BlockQ5_0 {
    fn quantize_block(x: &[f32]) -> Self {
        let x = &x[..32];
        let (_, max) = abs_max_with_sign(x);
        let d = max / -16.0;
        let id = inverse(d);
        let mut qs = [0u8; 16];
        let mut qh = 0u32;
        for (j, q) in qs.iter_mut().enumerate() {
            let q0 = ((x[j] * id + 16.5) as i8).min(31) as u8;
            let q1 = ((x[j + 16] * id + 16.5) as i8).min(31) as u8;
            *q = (q0 & 0x0F) | ((q1 & 0x0F) << 4);
            // Fifth bits: weight j at bit j, weight j + 16 at bit j + 16.
            qh |= ((q0 as u32 & 0x10) >> 4) << j;
            qh |= ((q1 as u32 & 0x10) >> 4) << (j + 16);
        }
        BlockQ5_0 {
            d: f16::from_f32(d),
            qh: qh.to_le_bytes(),
            qs,
        }
    }
}

impl BlockQuantizer for BlockQ5_1 {
    fn quantize_block(x: &[f32]) -> Self {
        let x = &x[..32];
        let (min, max) = min_max(x);
        let d = (max - min) / 31.0;
        let id = inverse(d);
        let mut qs = [0u8; 16];
        let mut qh = 0u32;
        for (j, q) in qs.iter_mut().enumerate() {
            let q0 = ((x[j] - min) * id + 0.5) as u8;
            let q1 = ((x[j + 16] - min) * id + 0.5) as u8;
            *q = (q0 & 0x0F) | ((q1 & 0x0F) << 4);
            qh |= ((q0 as u32 & 0x10) >> 4) << j;
            qh |= ((q1 as u32 & 0x10) >> 4) << (j + 16);
        }
        BlockQ5_1 {
            d: f16::from_f32(d),
            m: f16::from_f32(min),
            qh: qh.to_le_bytes(),
            qs,
        }
    }
}

impl BlockQuantizer for BlockQ1_0 {
    fn quantize_block(x: &[f32]) -> Self {
        let x = &x[..128];
        // Scale: the mean absolute value; bits: the signs.
        let sum_abs: f32 = x.iter().fold(0.0, |s, v| s + v.abs());
        let d = sum_abs / 128.0;
        let mut qs = [0u8; 16];
        for (j, &v) in x.iter().enumerate() {
            if v >= 0.0 {
                qs[j / 8] |= 1 << (j % 8);
            }
        }
        BlockQ1_0 {
            d: f16::from_f32(d),
            qs,
        }
    }
}

impl BlockQuantizer for BlockQ2_0 {
    fn quantize_block(x: &[f32]) -> Self {
        let x = &x[..64];
        let d = x
            .iter()
            .fold(0.0f32, |a, v| if v.abs() > a { v.abs() } else { a });
        let id = if d > 0.0 { 1.0 / d } else { 0.0 };
        let mut qs = [0u8; 16];
        for (j, &w) in x.iter().enumerate() {
            // round(w/d) in -1..=2, stored plus one.
            let q = ((w * id).round() as i32 + 1).clamp(0, 3) as u8;
            qs[j / 4] |= q << (2 * (j % 4));
        }
        BlockQ2_0 {
            d: f16::from_f32(d),
            qs,
        }
    }
}

/// Index of the FP4 code nearest to `x` at scale `e` (first one on ties).
fn best_index_fp4(x: f32, e: f32) -> u8 {
    let mut best = 0u8;
    let mut best_err = (KVALUES_FP4[0] as f32 * e - x).abs();
    for (i, &k) in KVALUES_FP4.iter().enumerate().skip(1) {
        let err = (k as f32 * e - x).abs();
        if err < best_err {
            best = i as u8;
            best_err = err;
        }
    }
    best
}

impl BlockQuantizer for BlockMxfp4 {
    fn quantize_block(x: &[f32]) -> Self {
        let x = &x[..32];
        let amax = x
            .iter()
            .fold(0.0f32, |a, v| if a < v.abs() { v.abs() } else { a });
        // Shared exponent: two below the exponent of the largest magnitude.
        let e = if amax > 0.0 {
            (amax.log2().floor() - 2.0 + 127.0) as u8
        } else {
            0
        };
        let d = e8m0_to_f32_half(e);
        let mut qs = [0u8; 16];
        for (j, q) in qs.iter_mut().enumerate() {
            *q = best_index_fp4(x[j], d) | (best_index_fp4(x[j + 16], d) << 4);
        }
        BlockMxfp4 { e, qs }
    }
}

/// ggml's `best_index_int8`: the index of the table value nearest to `x`
/// (the lower one on ties), by bisection of the sorted table.
fn best_index_int8(values: &[i8; 16], x: f32) -> usize {
    if x <= values[0] as f32 {
        return 0;
    }
    if x >= values[15] as f32 {
        return 15;
    }
    let (mut ml, mut mu) = (0usize, 15usize);
    while mu - ml > 1 {
        let mid = (ml + mu) / 2;
        if x < values[mid] as f32 {
            mu = mid;
        } else {
            ml = mid;
        }
    }
    if x - (values[mu - 1] as f32) < values[mu] as f32 - x {
        mu - 1
    } else {
        mu
    }
}

/// ggml's `quantize_row_iq4_nl_impl` for one block of 32 without an
/// importance matrix (weights x²). With `ntry > 0` (what `llama-quantize`
/// uses, 7) the scale is refined over `2*ntry + 1` trial scales around
/// `max / values[0]` and the weights requantized with the best; with
/// `ntry <= 0` (`quantize_row_iq4_nl_ref`, −1) one least-squares fit of the
/// first guess is kept. `l` is ggml's index buffer, kept from block to
/// block. An all-zero block gets scale 0; its indices are requantized at
/// inverse scale 0 (all 8, the value nearest 0) with `ntry > 0`, as ggml's
/// final pass runs for it too, and stay the previous block's otherwise.
fn quantize_iq4_nl_block(x: &[f32], ntry: i32, l: &mut [u8; 32]) -> BlockIq4Nl {
    let x = &x[..32];
    let values = &KVALUES_IQ4NL;
    let v0 = values[0] as f32;
    let mut block = BlockIq4Nl {
        d: f16::from_f32(0.0),
        qs: [0; 16],
    };
    let (mut amax, mut max) = (0.0f32, 0.0f32);
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax < 1e-15 {
        if ntry > 0 {
            l.fill(best_index_int8(values, 0.0) as u8);
        }
        for j in 0..16 {
            block.qs[j] = l[j] | (l[16 + j] << 4);
        }
        return block;
    }
    // Σ w·q·x and Σ w·q² at inverse scale `id`, the indices into `l`.
    let fit = |id: f32, l: &mut [u8; 32]| {
        let (mut sumqx, mut sumq2) = (0.0f32, 0.0f32);
        for (lj, &v) in l.iter_mut().zip(x) {
            let idx = best_index_int8(values, id * v);
            *lj = idx as u8;
            let q = values[idx] as f32;
            let w = v * v;
            sumqx += w * q * v;
            sumq2 += w * q * q;
        }
        (sumqx, sumq2)
    };
    let d0 = if ntry > 0 { -max / v0 } else { max / v0 };
    let (sumqx, sumq2) = fit(1.0 / d0, l);
    let mut d = if sumq2 > 0.0 { sumqx / sumq2 } else { 0.0 };
    let mut best = d * sumqx;
    let mut trial = [0u8; 32];
    for itry in -ntry..=ntry {
        let (sumqx, sumq2) = fit((itry as f32 + v0) / max, &mut trial);
        if sumq2 > 0.0 && sumqx * sumqx > best * sumq2 {
            d = sumqx / sumq2;
            best = d * sumqx;
        }
    }
    block.d = f16::from_f32(d);
    if ntry > 0 {
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        for (lj, &v) in l.iter_mut().zip(x) {
            *lj = best_index_int8(values, id * v) as u8;
        }
    }
    for j in 0..16 {
        block.qs[j] = l[j] | (l[16 + j] << 4);
    }
    block
}

impl BlockQuantizer for BlockIq4Nl {
    /// `quantize_row_iq4_nl_ref` on one block.
    fn quantize_block(x: &[f32]) -> Self {
        quantize_iq4_nl_block(x, -1, &mut [0; 32])
    }
}

/// IQ4_NL blocks of `src` into `dst`, ggml's index buffer carried across them.
fn quantize_iq4_nl(src: &[f32], dst: &mut [u8], ntry: i32) -> Result<()> {
    let (elems, bytes) = (BlockIq4Nl::BLOCK_ELEMS, BlockIq4Nl::BLOCK_BYTES);
    if !src.len().is_multiple_of(elems) {
        return Err(DequantError::PartialBlockElements {
            ty: GgmlType::IQ4_NL,
            elems: src.len(),
            block_elems: elems,
        });
    }
    if dst.len() != src.len() / elems * bytes {
        return Err(DequantError::OutputSize {
            what: format!("IQ4_NL bytes for {} values", src.len()),
            expected: src.len() / elems * bytes,
            got: dst.len(),
        });
    }
    let mut l = [0u8; 32];
    for (raw, x) in dst.chunks_exact_mut(bytes).zip(src.chunks_exact(elems)) {
        raw.copy_from_slice(bytemuck::bytes_of(&quantize_iq4_nl_block(x, ntry, &mut l)));
    }
    Ok(())
}

/// Ternary digit of `v * id`: 0, 1 or 2 for −1, 0, 1 (`lroundf` + 1).
fn trit(v: f32, id: f32) -> u8 {
    ((v * id).round() as i32 + 1) as u8
}

impl BlockQuantizer for BlockTq1_0 {
    fn quantize_block(x: &[f32]) -> Self {
        let x = &x[..QK_K];
        let d = abs_max(x);
        let id = inverse(d);
        let mut block = BlockTq1_0 {
            qs: [0; 48],
            qh: [0; 4],
            d: f16::from_f32(d),
        };
        // Five trits per byte, most significant first, then scaled to a
        // fixed-point fraction of 256 (ceiling division by 243).
        let pack = |trits: &mut dyn Iterator<Item = u8>| -> u8 {
            let mut q: u8 = 0;
            for t in trits {
                q = q.wrapping_mul(3).wrapping_add(t);
            }
            (q as u16 * 256).div_ceil(243) as u8
        };
        // qs[0..32]: weights m + 32n of the first 160.
        for m in 0..32 {
            block.qs[m] = pack(&mut (0..5).map(|n| trit(x[m + 32 * n], id)));
        }
        // qs[32..48]: weights 160 + m + 16n.
        for m in 0..16 {
            block.qs[32 + m] = pack(&mut (0..5).map(|n| trit(x[160 + m + 16 * n], id)));
        }
        // qh: weights 240 + j + 4m, four trits then a zero trit.
        for j in 0..4 {
            block.qh[j] = pack(&mut (0..4).map(|m| trit(x[240 + j + 4 * m], id)).chain([0]));
        }
        block
    }
}

impl BlockQuantizer for BlockTq2_0 {
    fn quantize_block(x: &[f32]) -> Self {
        let x = &x[..QK_K];
        let d = abs_max(x);
        let id = inverse(d);
        let mut qs = [0u8; 64];
        for (g, group) in qs.chunks_exact_mut(32).enumerate() {
            for (m, q) in group.iter_mut().enumerate() {
                for n in 0..4 {
                    *q += (trit(x[128 * g + m + 32 * n], id) & 3) << (2 * n);
                }
            }
        }
        BlockTq2_0 {
            qs,
            d: f16::from_f32(d),
        }
    }
}

/// Quantize `src` (a whole number of blocks) into `dst` blocks.
pub fn quantize_blocks<B: BlockQuantizer>(src: &[f32], dst: &mut [B]) -> Result<()> {
    if !src.len().is_multiple_of(B::BLOCK_ELEMS) {
        return Err(DequantError::PartialBlockElements {
            ty: B::TYPE,
            elems: src.len(),
            block_elems: B::BLOCK_ELEMS,
        });
    }
    if dst.len() != src.len() / B::BLOCK_ELEMS {
        return Err(DequantError::OutputSize {
            what: format!("{} blocks for {} values", B::TYPE, src.len()),
            expected: src.len() / B::BLOCK_ELEMS,
            got: dst.len(),
        });
    }
    for (block, x) in dst.iter_mut().zip(src.chunks_exact(B::BLOCK_ELEMS)) {
        *block = B::quantize_block(x);
    }
    Ok(())
}

/// Quantize a row of activations to Q8_0 (for the Q4_0/Q5_0/Q8_0/IQ4_NL/... dots).
pub fn quantize_row_q8_0(src: &[f32], dst: &mut [BlockQ8_0]) -> Result<()> {
    quantize_blocks(src, dst)
}

/// Quantize a row of activations to Q8_1 (for the Q4_1/Q5_1 dots).
pub fn quantize_row_q8_1(src: &[f32], dst: &mut [BlockQ8_1]) -> Result<()> {
    quantize_blocks(src, dst)
}

/// Quantize a row of activations to Q8_K (for the K-quant and IQ dots).
pub fn quantize_row_q8_k(src: &[f32], dst: &mut [BlockQ8K]) -> Result<()> {
    quantize_blocks(src, dst)
}

fn quantize_bytes<B: BlockQuantizer>(src: &[f32], dst: &mut [u8]) -> Result<()> {
    if !src.len().is_multiple_of(B::BLOCK_ELEMS) {
        return Err(DequantError::PartialBlockElements {
            ty: B::TYPE,
            elems: src.len(),
            block_elems: B::BLOCK_ELEMS,
        });
    }
    let n_blocks = src.len() / B::BLOCK_ELEMS;
    if dst.len() != n_blocks * B::BLOCK_BYTES {
        return Err(DequantError::OutputSize {
            what: format!("{} bytes for {} values", B::TYPE, src.len()),
            expected: n_blocks * B::BLOCK_BYTES,
            got: dst.len(),
        });
    }
    for (raw, x) in dst
        .chunks_exact_mut(B::BLOCK_BYTES)
        .zip(src.chunks_exact(B::BLOCK_ELEMS))
    {
        raw.copy_from_slice(bytemuck::bytes_of(&B::quantize_block(x)));
    }
    Ok(())
}

/// Types [`quantize`] can produce.
pub const QUANTIZABLE: &[GgmlType] = &[
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q8_1,
    GgmlType::Q8_K,
    GgmlType::Q1_0,
    GgmlType::Q2_0,
    GgmlType::MXFP4,
    GgmlType::TQ1_0,
    GgmlType::TQ2_0,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::IQ4_NL,
];

/// Quantize `src` to `ty` into `dst` (exactly the encoded size), as ggml's
/// `quantize_row_*_ref`. Types without a quantizer here give
/// [`DequantError::Unsupported`].
pub fn quantize(ty: GgmlType, src: &[f32], dst: &mut [u8]) -> Result<()> {
    match ty {
        GgmlType::Q4_0 => quantize_bytes::<BlockQ4_0>(src, dst),
        GgmlType::Q4_1 => quantize_bytes::<BlockQ4_1>(src, dst),
        GgmlType::Q5_0 => quantize_bytes::<BlockQ5_0>(src, dst),
        GgmlType::Q5_1 => quantize_bytes::<BlockQ5_1>(src, dst),
        GgmlType::Q8_0 => quantize_bytes::<BlockQ8_0>(src, dst),
        GgmlType::Q8_1 => quantize_bytes::<BlockQ8_1>(src, dst),
        GgmlType::Q8_K => quantize_bytes::<BlockQ8K>(src, dst),
        GgmlType::Q1_0 => quantize_bytes::<BlockQ1_0>(src, dst),
        GgmlType::Q2_0 => quantize_bytes::<BlockQ2_0>(src, dst),
        GgmlType::MXFP4 => quantize_bytes::<BlockMxfp4>(src, dst),
        GgmlType::TQ1_0 => quantize_bytes::<BlockTq1_0>(src, dst),
        GgmlType::TQ2_0 => quantize_bytes::<BlockTq2_0>(src, dst),
        GgmlType::Q2_K => quantize_bytes::<BlockQ2K>(src, dst),
        GgmlType::Q3_K => quantize_bytes::<BlockQ3K>(src, dst),
        GgmlType::Q4_K => quantize_bytes::<BlockQ4K>(src, dst),
        GgmlType::Q5_K => quantize_bytes::<BlockQ5K>(src, dst),
        GgmlType::Q6_K => quantize_bytes::<BlockQ6K>(src, dst),
        GgmlType::IQ4_NL => quantize_iq4_nl(src, dst, -1),
        other => Err(DequantError::Unsupported(format!(
            "{other} (no reference quantizer)"
        ))),
    }
}

/// Quantize `src` (whole rows) to `ty` as `ggml_quantize_chunk` does
/// without an importance matrix, which is what `llama-quantize` writes: the
/// same as [`quantize`] except IQ4_NL, whose scale search runs 7 trials
/// each way instead of the reference's none.
pub fn quantize_chunk(ty: GgmlType, src: &[f32], dst: &mut [u8]) -> Result<()> {
    match ty {
        GgmlType::IQ4_NL => quantize_iq4_nl(src, dst, 7),
        _ => quantize(ty, src, dst),
    }
}

/// Quantize into a new byte vector.
pub fn quantize_to_vec(ty: GgmlType, src: &[f32]) -> Result<Vec<u8>> {
    let block_elems = ty.block_size().max(1);
    let mut dst = vec![0u8; src.len() / block_elems * ty.type_size()];
    quantize(ty, src, &mut dst)?;
    Ok(dst)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A block of zeros after a block of data: llama-quantize's search
    /// (`ntry` 7) requantizes it to index 8 everywhere (0x88 bytes), the
    /// reference quantizer keeps the previous block's indices.
    #[test]
    fn a_zero_block_takes_index_8_in_the_search_and_the_last_indices_in_the_reference() {
        let mut src: Vec<f32> = (0..32).map(|i| (i as f32 - 15.5) / 7.0).collect();
        src.extend([0.0f32; 32]);
        let mut searched = vec![0u8; 2 * BlockIq4Nl::BLOCK_BYTES];
        quantize_chunk(GgmlType::IQ4_NL, &src, &mut searched).unwrap();
        let zero = &searched[BlockIq4Nl::BLOCK_BYTES..];
        assert_eq!(&zero[..2], &[0, 0], "scale 0");
        assert!(zero[2..].iter().all(|&b| b == 0x88), "{zero:?}");
        let mut reference = vec![0u8; 2 * BlockIq4Nl::BLOCK_BYTES];
        quantize(GgmlType::IQ4_NL, &src, &mut reference).unwrap();
        assert_eq!(
            &reference[BlockIq4Nl::BLOCK_BYTES + 2..],
            &reference[2..BlockIq4Nl::BLOCK_BYTES]
        );
    }
}
