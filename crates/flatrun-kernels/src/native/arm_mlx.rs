//! aarch64 kernels for MLX affine 4- and 8-bit weights against Q8 activations
//! (the maths is in `mlx_affine.rs`; the levels and the safety contract in `arm.rs`).
//!
//! Each 32-value block is the legacy Q4_1/Q8_0 step of `arm_legacy.rs` with
//! MLX's layout: the block is unpacked into two registers of 16 signed bytes
//! (values 0..16 and 16..32, in value order), dotted with the activation block
//! into four i32 lanes, converted once and fused-multiply-added by `s · d_a`
//! into one of two f32 accumulators per token (even and odd blocks); the bias
//! term `b · s_a` is summed apart. Only where the scale and bias come from
//! differs (one pair per group, read from their own arrays), and the unpack:
//!
//! - 4-bit: byte k holds values 2k (low nibble) and 2k + 1. `zip1`/`zip2` of
//!   the low and high nibbles put the 32 values back in order, so each i32
//!   lane sums the same products as Q4_1's kernel; the values stay unsigned
//!   (Q4_1's dot) and the bias is added through `s_a`.
//! - 8-bit: `q ^ 0x80` is `q − 128` as a signed byte (Q8_0's dot); the bias
//!   left after centring, `b + 128·s`, is 0 for a Q8_0 copy and then skipped.
//!
//! So a Q4_1 or Q8_0 row converted to MLX gives, bit for bit, what the
//! Q4_1/Q8_0 kernel of the same level gives for the GGUF row.

// The kernels index several per-token arrays (accumulators, activation rows,
// outputs) with the same token `t`; a range loop says that most plainly.
#![allow(clippy::needless_range_loop)]

use std::arch::aarch64::*;

use super::{dot32, f16_at, u32_at};
use crate::native::mlx_affine::{
    MlxLayout, MlxRowsData, ScaleKind, by_bits_and_tile, centre, rows_scalar,
};
use crate::native::quantize::{BlockQ8, QK8};

/// Value `g` of a row's scale (or bias) array at `p`.
#[inline(always)]
unsafe fn scale_at(kind: ScaleKind, p: *const u8, g: usize) -> f32 {
    // SAFETY: the caller upholds this function's safety contract (its
    // `# Safety` section or the module's), which every unsafe operation
    // below relies on.
    unsafe {
        match kind {
            ScaleKind::F16 => f16_at(p.add(2 * g)),
            // A bf16 is the top half of an f32.
            ScaleKind::BF16 => f32::from_bits(
                (u16::from_le_bytes([*p.add(2 * g), *p.add(2 * g + 1)]) as u32) << 16,
            ),
            ScaleKind::F32 => f32::from_bits(u32_at(p.add(4 * g))),
        }
    }
}

/// The 32 values of the block at `p` as signed bytes: (values 0..16, values 16..32).
#[inline(always)]
unsafe fn unpack<const BITS: u32>(p: *const u8) -> (int8x16_t, int8x16_t) {
    // SAFETY: the caller upholds this function's safety contract (its
    // `# Safety` section or the module's), which every unsafe operation
    // below relies on.
    unsafe {
        let s8 = vreinterpretq_s8_u8;
        if BITS == 4 {
            // Low nibbles are the even values, high nibbles the odd ones: interleave them.
            let q = vld1q_u8(p);
            let even = vandq_u8(q, vdupq_n_u8(0x0F));
            let odd = vshrq_n_u8(q, 4);
            (s8(vzip1q_u8(even, odd)), s8(vzip2q_u8(even, odd)))
        } else {
            // Flipping the top bit subtracts 128 in two's complement.
            let flip = vdupq_n_u8(0x80);
            (
                s8(veorq_u8(vld1q_u8(p), flip)),
                s8(veorq_u8(vld1q_u8(p.add(16)), flip)),
            )
        }
    }
}

/// Block `i` of the row × the tile: `acc[t] += s · d_a · Σ q·a`, and with a bias
/// `bias[t] += rest · s_a` (as `arm_legacy.rs`'s `block_step`).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn block_step<const BITS: u32, const DOT: bool, const N: usize>(
    row: *const u8,
    i: usize,
    s: f32,
    rest: Option<f32>,
    acts: &[&[BlockQ8]],
    acc: &mut [float32x4_t; N],
    bias: &mut [f32; N],
) {
    // SAFETY: the caller upholds this function's safety contract (its
    // `# Safety` section or the module's), which every unsafe operation
    // below relies on.
    unsafe {
        // Unpack the weight block once…
        let (lo, hi) = unpack::<BITS>(row.add(i * QK8 * BITS as usize / 8));
        // …and dot it with every token of the tile.
        for t in 0..N {
            let a = acts.get_unchecked(t).get_unchecked(i);
            let sumi = dot32::<DOT>(vdupq_n_s32(0), lo, hi, a.qs.as_ptr());
            acc[t] = vfmaq_n_f32(acc[t], vcvtq_f32_s32(sumi), s * a.d);
            if let Some(rest) = rest {
                bias[t] += rest * a.s;
            }
        }
    }
}

/// One row of `n_groups` groups (scales and biases at `scales`, `biases`) × a
/// tile of `N` Q8 token rows.
#[inline(always)]
unsafe fn row_n<const BITS: u32, const DOT: bool, const N: usize>(
    layout: MlxLayout,
    row: &[u8],
    scales: *const u8,
    biases: *const u8,
    acts: &[&[BlockQ8]],
    out: &mut [f32],
) {
    // SAFETY: the caller upholds this function's safety contract (its
    // `# Safety` section or the module's), which every unsafe operation
    // below relies on.
    unsafe {
        let blocks_per_group = layout.group / QK8;
        let n_groups = row.len() / (QK8 * BITS as usize / 8 * blocks_per_group);
        let c = centre(BITS) as f32;
        // Two accumulators per token (even and odd blocks of the row) halve the FMA chain.
        let mut even = [vdupq_n_f32(0.0); N];
        let mut odd = [vdupq_n_f32(0.0); N];
        let mut bias = [0f32; N];
        for g in 0..n_groups {
            let s = scale_at(layout.scales, scales, g);
            let b = scale_at(layout.scales, biases, g);
            // 8-bit values are centred (Q8_0's dot) and the bias left over is often 0;
            // 4-bit ones are used as they are (Q4_1's), their bias always added.
            let rest = if BITS == 8 { b + c * s } else { b };
            let rest = (BITS == 4 || rest != 0.0).then_some(rest);
            for k in 0..blocks_per_group {
                let i = g * blocks_per_group + k;
                if i.is_multiple_of(2) {
                    block_step::<BITS, DOT, N>(
                        row.as_ptr(),
                        i,
                        s,
                        rest,
                        acts,
                        &mut even,
                        &mut bias,
                    );
                } else {
                    block_step::<BITS, DOT, N>(row.as_ptr(), i, s, rest, acts, &mut odd, &mut bias);
                }
            }
        }
        for t in 0..N {
            *out.get_unchecked_mut(t) = vaddvq_f32(vaddq_f32(even[t], odd[t])) + bias[t];
        }
    }
}

/// Every row of `rows` × the tile, `BITS` and `N` fixed.
#[inline(always)]
unsafe fn rows_n<const BITS: u32, const DOT: bool, const N: usize>(
    layout: MlxLayout,
    rows: &MlxRowsData,
    acts: &[&[BlockQ8]],
    out: &mut [f32],
) {
    // SAFETY: the caller upholds this function's safety contract (its
    // `# Safety` section or the module's), which every unsafe operation
    // below relies on.
    unsafe {
        for (r, o) in (0..rows.n_rows()).zip(out.chunks_exact_mut(N)) {
            let (data, scales, biases) = rows.row(r);
            row_n::<BITS, DOT, N>(layout, data, scales.as_ptr(), biases.as_ptr(), acts, o);
        }
    }
}

/// Rows × a tile of 1..=4 Q8 token rows (the portable kernel on a call it
/// cannot prove in bounds).
///
/// # Safety
/// With `DOT = true` the CPU must support the dot-product extension.
#[inline(always)]
pub(super) unsafe fn rows_mlx<const DOT: bool>(
    layout: MlxLayout,
    rows: &MlxRowsData,
    acts: &[&[BlockQ8]],
    out: &mut [f32],
) {
    if !rows.fits(layout, acts, out) {
        return rows_scalar(layout, rows, acts, out);
    }
    // SAFETY: `fits` proved every row holds whole groups with their scales and
    // biases, every activation row a Q8 block per 32 values, and `out` a value
    // per row and token; `DOT = true` is the caller's to guarantee.
    unsafe { by_bits_and_tile!(rows_n, DOT; layout, rows, acts, out) }
}
