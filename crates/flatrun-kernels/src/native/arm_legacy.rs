//! aarch64 kernels for the 32-value block formats against Q8 activations:
//! Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL and Q1_0 (see `arm.rs` for the
//! levels and the safety contract).
//!
//! A block is unpacked into two registers of 16 signed bytes (values 0..16 and
//! 16..32), dotted with the activation block's 32 bytes into four i32 lanes,
//! converted once to f32 and scaled by `d_w · d_a` with one fused multiply-add.
//! Q4_1/Q5_1 keep their values unsigned (0..31 fit an i8) and add their min
//! through the activations' `s = d_a · Σ q_a`.

// The kernels index several per-token arrays (accumulators, activation rows,
// outputs) with the same token `t`; a range loop says that most plainly.
#![allow(clippy::needless_range_loop)]

use std::arch::aarch64::*;

use crate::native::dispatch::each_row;
use crate::native::scalar;

use flatrun_format::GgmlType;

use super::{bits_to_masks, checked, dot32, f16_at, u32_at};
use crate::native::quantize::BlockQ8;
use flatrun_dequant::blocks::fp4::e8m0_to_f32_half;
use flatrun_dequant::iq_grids::{KVALUES_FP4, KVALUES_IQ4NL};
use flatrun_dequant::{
    BlockFormat, BlockIq4Nl, BlockQ1_0, BlockQ4_0, BlockQ4_1, BlockQ5_0, BlockQ5_1, BlockQ8_0,
};

const Q4_0: u32 = GgmlType::Q4_0 as u32;
const Q4_1: u32 = GgmlType::Q4_1 as u32;
const Q5_0: u32 = GgmlType::Q5_0 as u32;
const Q5_1: u32 = GgmlType::Q5_1 as u32;
const Q8_0: u32 = GgmlType::Q8_0 as u32;
const IQ4_NL: u32 = GgmlType::IQ4_NL as u32;
const MXFP4: u32 = GgmlType::MXFP4 as u32;

/// One unpacked 32-value block: `d · q + m` for `q` in `lo` (values 0..16) and `hi` (16..32).
struct Block32 {
    lo: int8x16_t,
    hi: int8x16_t,
    d: f32,
    m: f32,
}

/// Unpack the legacy block of format `T` at `b` (`levels`: the IQ4_NL table).
#[inline(always)]
unsafe fn unpack<const T: u32>(b: *const u8, levels: int8x16_t) -> Block32 {
    // SAFETY: the caller upholds this function's safety contract (its
    // `# Safety` section or the module's), which every unsafe operation
    // below relies on.
    unsafe {
        let low4 = vdupq_n_u8(0x0F);
        // The 16 bytes of packed nibbles at `p`: low nibbles are values 0..16, high ones 16..32.
        let nibbles = |p: *const u8| {
            let q = vld1q_u8(p);
            (vandq_u8(q, low4), vshrq_n_u8(q, 4))
        };
        let s8 = vreinterpretq_s8_u8;
        match T {
            Q4_0 => {
                // Values 0..15 stored with an offset of 8.
                let (lo, hi) = nibbles(b.add(BlockQ4_0::QS_OFFSET));
                let eight = vdupq_n_s8(8);
                Block32 {
                    lo: vsubq_s8(s8(lo), eight),
                    hi: vsubq_s8(s8(hi), eight),
                    d: f16_at(b),
                    m: 0.0,
                }
            }
            Q4_1 => {
                let (lo, hi) = nibbles(b.add(BlockQ4_1::QS_OFFSET));
                Block32 {
                    lo: s8(lo),
                    hi: s8(hi),
                    d: f16_at(b),
                    m: f16_at(b.add(BlockQ4_1::M_OFFSET)),
                }
            }
            Q5_0 => {
                // Fifth bit clear ⇒ value − 16: or-ing 0xF0 into the nibble is exactly that in i8.
                let (lo, hi) = nibbles(b.add(BlockQ5_0::QS_OFFSET));
                let (set_lo, set_hi) = bits_to_masks(u32_at(b.add(BlockQ5_0::QH_OFFSET)));
                let f0 = vdupq_n_u8(0xF0);
                Block32 {
                    lo: s8(vorrq_u8(lo, vbicq_u8(f0, set_lo))),
                    hi: s8(vorrq_u8(hi, vbicq_u8(f0, set_hi))),
                    d: f16_at(b),
                    m: 0.0,
                }
            }
            Q5_1 => {
                // Fifth bit set ⇒ + 16.
                let (lo, hi) = nibbles(b.add(BlockQ5_1::QS_OFFSET));
                let (set_lo, set_hi) = bits_to_masks(u32_at(b.add(BlockQ5_1::QH_OFFSET)));
                let sixteen = vdupq_n_u8(0x10);
                Block32 {
                    lo: s8(vorrq_u8(lo, vandq_u8(set_lo, sixteen))),
                    hi: s8(vorrq_u8(hi, vandq_u8(set_hi, sixteen))),
                    d: f16_at(b),
                    m: f16_at(b.add(BlockQ5_1::M_OFFSET)),
                }
            }
            Q8_0 => Block32 {
                lo: vld1q_s8(b.add(BlockQ8_0::QS_OFFSET) as *const i8),
                hi: vld1q_s8(b.add(BlockQ8_0::QS_OFFSET + 16) as *const i8),
                d: f16_at(b),
                m: 0.0,
            },
            IQ4_NL => {
                // Each nibble indexes the 16 non-linear levels (one `tbl` per 16 values).
                let (lo, hi) = nibbles(b.add(BlockIq4Nl::QS_OFFSET));
                Block32 {
                    lo: vqtbl1q_s8(levels, lo),
                    hi: vqtbl1q_s8(levels, hi),
                    d: f16_at(b),
                    m: 0.0,
                }
            }
            MXFP4 => {
                // The exponent byte, then the nibbles of the doubled E2M1 levels.
                let fp4 = vld1q_s8(KVALUES_FP4.as_ptr());
                let (lo, hi) = nibbles(b.add(1));
                Block32 {
                    lo: vqtbl1q_s8(fp4, lo),
                    hi: vqtbl1q_s8(fp4, hi),
                    d: e8m0_to_f32_half(*b),
                    m: 0.0,
                }
            }
            _ => Block32 {
                lo: vdupq_n_s8(0),
                hi: vdupq_n_s8(0),
                d: 0.0,
                m: 0.0,
            },
        }
    }
}

/// Legacy format `T` (32-value blocks of `TS` bytes) × a tile of `N` Q8 token rows.
#[inline(always)]
pub(super) unsafe fn legacy_n<const T: u32, const TS: usize, const DOT: bool, const N: usize>(
    row: &[u8],
    acts: &[&[BlockQ8]],
    out: &mut [f32],
) {
    // SAFETY: the caller upholds this function's safety contract (its
    // `# Safety` section or the module's), which every unsafe operation
    // below relies on.
    unsafe {
        let levels = vld1q_s8(KVALUES_IQ4NL.as_ptr());
        let nb = row.len() / TS;
        // Two accumulators per token (even and odd blocks) halve the FMA dependency chain.
        let mut even = [vdupq_n_f32(0.0); N];
        let mut odd = [vdupq_n_f32(0.0); N];
        let mut mins = [0f32; N];
        let mut i = 0;
        while i + 1 < nb {
            block_step::<T, TS, DOT, N>(row, acts, i, levels, &mut even, &mut mins);
            block_step::<T, TS, DOT, N>(row, acts, i + 1, levels, &mut odd, &mut mins);
            i += 2;
        }
        if i < nb {
            block_step::<T, TS, DOT, N>(row, acts, i, levels, &mut even, &mut mins);
        }
        for t in 0..N {
            *out.get_unchecked_mut(t) = vaddvq_f32(vaddq_f32(even[t], odd[t])) + mins[t];
        }
    }
}

/// Block `i` of the row × the tile: `acc[t] += d_w · d_a · Σ q_w · q_a`, `mins[t] += m_w · s_a`.
#[inline(always)]
unsafe fn block_step<const T: u32, const TS: usize, const DOT: bool, const N: usize>(
    row: &[u8],
    acts: &[&[BlockQ8]],
    i: usize,
    levels: int8x16_t,
    acc: &mut [float32x4_t; N],
    mins: &mut [f32; N],
) {
    // SAFETY: the caller upholds this function's safety contract (its
    // `# Safety` section or the module's), which every unsafe operation
    // below relies on.
    unsafe {
        let with_min = T == Q4_1 || T == Q5_1;
        // Unpack the weight block once…
        let w = unpack::<T>(row.as_ptr().add(i * TS), levels);
        // …and dot it with every token of the tile.
        for t in 0..N {
            let a = acts.get_unchecked(t).get_unchecked(i);
            let sumi = dot32::<DOT>(vdupq_n_s32(0), w.lo, w.hi, a.qs.as_ptr());
            acc[t] = vfmaq_n_f32(acc[t], vcvtq_f32_s32(sumi), w.d * a.d);
            if with_min {
                mins[t] += w.m * a.s;
            }
        }
    }
}

/// Q1_0 (one f16 scale, then 128 sign bits: four 32-value sub-blocks, each
/// matched with one Q8 block) × a tile of `N` Q8 token rows.
#[inline(always)]
pub(super) unsafe fn q1_0_n<const DOT: bool, const N: usize>(
    row: &[u8],
    acts: &[&[BlockQ8]],
    out: &mut [f32],
) {
    // SAFETY: the caller upholds this function's safety contract (its
    // `# Safety` section or the module's), which every unsafe operation
    // below relies on.
    unsafe {
        let nb = row.len() / BlockQ1_0::BLOCK_BYTES;
        let one = vdupq_n_s8(1);
        let two = vdupq_n_u8(2);
        let mut acc = [vdupq_n_f32(0.0); N];
        for i in 0..nb {
            let b = row.as_ptr().add(i * BlockQ1_0::BLOCK_BYTES);
            let d = f16_at(b);
            for sub in 0..4 {
                // A set bit is +1, a clear one −1: (mask & 2) − 1.
                let (set_lo, set_hi) = bits_to_masks(u32_at(b.add(BlockQ1_0::QS_OFFSET + 4 * sub)));
                let lo = vsubq_s8(vreinterpretq_s8_u8(vandq_u8(set_lo, two)), one);
                let hi = vsubq_s8(vreinterpretq_s8_u8(vandq_u8(set_hi, two)), one);
                for t in 0..N {
                    let a = acts.get_unchecked(t).get_unchecked(4 * i + sub);
                    let sumi = dot32::<DOT>(vdupq_n_s32(0), lo, hi, a.qs.as_ptr());
                    acc[t] = vfmaq_n_f32(acc[t], vcvtq_f32_s32(sumi), d * a.d);
                }
            }
        }
        for t in 0..N {
            *out.get_unchecked_mut(t) = vaddvq_f32(acc[t]);
        }
    }
}

/// Rows × Q8 tile for a legacy format, Q1_0 or IQ4_NL.
///
/// # Safety
/// With `DOT = true` the CPU must support the dot-product extension.
#[inline(always)]
pub(super) unsafe fn rows_q8<const DOT: bool>(
    t: GgmlType,
    rows: &[u8],
    rb: usize,
    acts: &[&[BlockQ8]],
    out: &mut [f32],
) {
    let subs = t.block_size() / 32;
    if !checked(rows, rb, t.type_size(), subs, acts, out) {
        return each_row(scalar::dot_q8, t, rows, rb, acts, out);
    }
    const Q4_0: u32 = GgmlType::Q4_0 as u32;
    const Q4_1: u32 = GgmlType::Q4_1 as u32;
    const Q5_0: u32 = GgmlType::Q5_0 as u32;
    const Q5_1: u32 = GgmlType::Q5_1 as u32;
    const Q8_0: u32 = GgmlType::Q8_0 as u32;
    const IQ4_NL: u32 = GgmlType::IQ4_NL as u32;
    match t {
        GgmlType::Q4_0 => tile!(legacy_n, Q4_0, 18, DOT; rows, rb, acts, out),
        GgmlType::Q4_1 => tile!(legacy_n, Q4_1, 20, DOT; rows, rb, acts, out),
        GgmlType::Q5_0 => tile!(legacy_n, Q5_0, 22, DOT; rows, rb, acts, out),
        GgmlType::Q5_1 => tile!(legacy_n, Q5_1, 24, DOT; rows, rb, acts, out),
        GgmlType::Q8_0 => tile!(legacy_n, Q8_0, 34, DOT; rows, rb, acts, out),
        GgmlType::IQ4_NL => tile!(legacy_n, IQ4_NL, 18, DOT; rows, rb, acts, out),
        GgmlType::MXFP4 => tile!(legacy_n, MXFP4, 17, DOT; rows, rb, acts, out),
        GgmlType::Q1_0 => tile!(q1_0_n, DOT; rows, rb, acts, out),
        _ => each_row(scalar::dot_q8, t, rows, rb, acts, out),
    }
}
