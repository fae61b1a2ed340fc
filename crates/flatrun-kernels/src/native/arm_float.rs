//! aarch64 kernels for plain-float weights: F32, F16 and BF16 rows against f32
//! activations (see `arm.rs` for the safety contract). Eight weights per step
//! are widened to f32 (F16 by `fcvtl`, BF16 by a 16-bit shift) and fused-multiply-
//! added into two accumulators per token; a ragged tail is done one value at a time.

// The kernels index several per-token arrays (accumulators, activation rows,
// outputs) with the same token `t`; a range loop says that most plainly.
#![allow(clippy::needless_range_loop)]

use std::arch::aarch64::*;

use crate::native::dispatch::each_row;
use crate::native::scalar;

use flatrun_format::GgmlType;

use super::{checked, f16x4_to_f32};

const F16: u32 = GgmlType::F16 as u32;
const BF16: u32 = GgmlType::BF16 as u32;

/// Eight weights of format `T` at `p` as two vectors of four f32.
#[inline(always)]
unsafe fn load8<const T: u32>(p: *const u8) -> (float32x4_t, float32x4_t) {
    // SAFETY: the caller upholds this function's safety contract (its
    // `# Safety` section or the module's), which every unsafe operation
    // below relies on.
    unsafe {
        match T {
            F16 => {
                let h = vld1q_u16(p as *const u16);
                (
                    f16x4_to_f32(vget_low_u16(h)),
                    f16x4_to_f32(vget_high_u16(h)),
                )
            }
            BF16 => {
                // A bf16 is the top half of an f32.
                let h = vld1q_u16(p as *const u16);
                (
                    vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(h), 16)),
                    vreinterpretq_f32_u32(vshll_high_n_u16(h, 16)),
                )
            }
            _ => (
                vld1q_f32(p as *const f32),
                vld1q_f32((p as *const f32).add(4)),
            ),
        }
    }
}

/// One weight of format `T` at `p` as f32.
#[inline(always)]
unsafe fn load1<const T: u32>(p: *const u8) -> f32 {
    // SAFETY: the caller upholds this function's safety contract (its
    // `# Safety` section or the module's), which every unsafe operation
    // below relies on.
    unsafe {
        let bits16 = || u16::from_le_bytes([*p, *p.add(1)]);
        match T {
            F16 => super::f16_to_f32(bits16()),
            BF16 => f32::from_bits((bits16() as u32) << 16),
            _ => f32::from_le_bytes([*p, *p.add(1), *p.add(2), *p.add(3)]),
        }
    }
}

/// F32/F16/BF16 row (`ES` bytes per value) × a tile of `N` f32 token rows.
#[inline(always)]
pub(super) unsafe fn float_n<const T: u32, const ES: usize, const N: usize>(
    row: &[u8],
    acts: &[&[f32]],
    out: &mut [f32],
) {
    // SAFETY: the caller upholds this function's safety contract (its
    // `# Safety` section or the module's), which every unsafe operation
    // below relies on.
    unsafe {
        let n = row.len() / ES;
        let n8 = n / 8 * 8;
        let mut acc = [[vdupq_n_f32(0.0); 2]; N];
        let mut j = 0;
        while j < n8 {
            let (w0, w1) = load8::<T>(row.as_ptr().add(j * ES));
            for t in 0..N {
                let x = acts.get_unchecked(t).as_ptr().add(j);
                acc[t][0] = vfmaq_f32(acc[t][0], w0, vld1q_f32(x));
                acc[t][1] = vfmaq_f32(acc[t][1], w1, vld1q_f32(x.add(4)));
            }
            j += 8;
        }
        for t in 0..N {
            // Ragged tail, one value at a time.
            let a = acts.get_unchecked(t);
            let mut s = vaddvq_f32(vaddq_f32(acc[t][0], acc[t][1]));
            for j in n8..n {
                s += load1::<T>(row.as_ptr().add(j * ES)) * *a.get_unchecked(j);
            }
            *out.get_unchecked_mut(t) = s;
        }
    }
}

/// Rows × f32 tile for F32/F16/BF16 (no integer dots: the same code at both levels).
#[inline(always)]
pub(super) fn rows_f32(t: GgmlType, rows: &[u8], rb: usize, acts: &[&[f32]], out: &mut [f32]) {
    if !checked(rows, rb, t.type_size(), 1, acts, out) {
        return each_row(scalar::dot_f32, t, rows, rb, acts, out);
    }
    const F32: u32 = GgmlType::F32 as u32;
    const F16: u32 = GgmlType::F16 as u32;
    const BF16: u32 = GgmlType::BF16 as u32;
    match t {
        GgmlType::F32 => tile!(float_n, F32, 4; rows, rb, acts, out),
        GgmlType::F16 => tile!(float_n, F16, 2; rows, rb, acts, out),
        GgmlType::BF16 => tile!(float_n, BF16, 2; rows, rb, acts, out),
        _ => each_row(scalar::dot_f32, t, rows, rb, acts, out),
    }
}
