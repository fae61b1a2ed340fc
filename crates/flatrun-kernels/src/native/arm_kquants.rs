//! aarch64 kernels for the 256-value super-blocks against Q8_K activations:
//! Q2_K, Q3_K, Q4_K, Q5_K, Q6_K and IQ4_XS (see `arm.rs` for the levels and
//! the safety contract).
//!
//! Values are unpacked 16 or 32 at a time into signed bytes and dotted with the
//! activations into four i32 lanes; each sub-block's integer scale is applied
//! with one `mla` (`sumi += dot · scale`), so the block stays in integers until
//! one conversion and one fused multiply-add by `d_w · d_a`. Mins and offsets
//! are never applied per value: Q2_K/Q4_K/Q5_K subtract `dmin · Σ_g min_g ·
//! Σ_{i∈g} q_a` through the activations' per-16 sums (`bsums`), and Q3_K
//! (values −4..3) and Q6_K (−32..31) use their values unsigned and take the
//! offset off the integer sum up front, `−offset · Σ_g scale_g · bsums_g`.

// The kernels index several per-token arrays (accumulators, activation rows,
// outputs) with the same token `t`; a range loop says that most plainly.
#![allow(clippy::needless_range_loop)]

use std::arch::aarch64::*;

use crate::native::dispatch::each_row;
use crate::native::scalar;

use flatrun_format::GgmlType;

use super::{checked, dot16, dot32, f16_at, u32_at};
use crate::native::quantize::BlockQ8K;
use flatrun_dequant::iq_grids::KVALUES_IQ4NL;
use flatrun_dequant::{BlockFormat, BlockIq4Xs, BlockQ2K, BlockQ3K, BlockQ4K, BlockQ5K, BlockQ6K};

/// Σ_g `w[g] · a.bsums[g]` over the 16 groups, spread over four i32 lanes
/// (`w_lo` holds groups 0..8, `w_hi` 8..16).
#[inline(always)]
unsafe fn group_products(w_lo: int16x8_t, w_hi: int16x8_t, a: &BlockQ8K) -> int32x4_t {
    // SAFETY: the caller upholds this function's safety contract (its
    // `# Safety` section or the module's), which every unsafe operation
    // below relies on.
    unsafe {
        let bs_lo = vld1q_s16(a.bsums.as_ptr());
        let bs_hi = vld1q_s16(a.bsums.as_ptr().add(8));
        let p = vmull_s16(vget_low_s16(w_lo), vget_low_s16(bs_lo));
        let p = vmlal_high_s16(p, w_lo, bs_lo);
        let p = vmlal_s16(p, vget_low_s16(w_hi), vget_low_s16(bs_hi));
        vmlal_high_s16(p, w_hi, bs_hi)
    }
}

/// Sixteen signed bytes widened to i16: (bytes 0..8, bytes 8..16).
#[inline(always)]
unsafe fn widen(v: int8x16_t) -> (int16x8_t, int16x8_t) {
    // SAFETY: the caller upholds this function's safety contract (its
    // `# Safety` section or the module's), which every unsafe operation
    // below relies on.
    unsafe { (vmovl_s8(vget_low_s8(v)), vmovl_high_s8(v)) }
}

/// Two 16-value runs of block `i`, values `at..at + 32`, each with its own
/// sub-block scale, against every token of the tile:
/// `sumi[t] += s_lo · Σ v_lo·a[at..at+16] + s_hi · Σ v_hi·a[at+16..at+32]`.
#[inline(always)]
unsafe fn scaled_runs<const DOT: bool, const N: usize>(
    sumi: &mut [int32x4_t; N],
    acts: &[&[BlockQ8K]],
    i: usize,
    at: usize,
    (v_lo, s_lo): (int8x16_t, i32),
    (v_hi, s_hi): (int8x16_t, i32),
) {
    // SAFETY: the caller upholds this function's safety contract (its
    // `# Safety` section or the module's), which every unsafe operation
    // below relies on.
    unsafe {
        let zero = vdupq_n_s32(0);
        for t in 0..N {
            let a = acts.get_unchecked(t).get_unchecked(i).qs.as_ptr().add(at);
            sumi[t] = vmlaq_n_s32(sumi[t], dot16::<DOT>(zero, v_lo, vld1q_s8(a)), s_lo);
            sumi[t] = vmlaq_n_s32(sumi[t], dot16::<DOT>(zero, v_hi, vld1q_s8(a.add(16))), s_hi);
        }
    }
}

/// `−offset · Σ_g scale_g · bsums_g` for every token: where the integer sums of
/// block `i` start when its values are used unsigned (Q3_K, Q6_K).
#[inline(always)]
unsafe fn offset_start<const N: usize>(
    sc_lo: int16x8_t,
    sc_hi: int16x8_t,
    offset: i32,
    acts: &[&[BlockQ8K]],
    i: usize,
) -> [int32x4_t; N] {
    // SAFETY: the caller upholds this function's safety contract (its
    // `# Safety` section or the module's), which every unsafe operation
    // below relies on.
    unsafe {
        std::array::from_fn(|t| {
            let a = acts.get_unchecked(t).get_unchecked(i);
            vmulq_n_s32(group_products(sc_lo, sc_hi, a), -offset)
        })
    }
}

/// The end of block `i`: `acc[t] += d · d_a · sumi[t]`, one conversion and one
/// fused multiply-add per token.
#[inline(always)]
unsafe fn scale_block<const N: usize>(
    acc: &mut [float32x4_t; N],
    sumi: &[int32x4_t; N],
    d: f32,
    acts: &[&[BlockQ8K]],
    i: usize,
) {
    // SAFETY: the caller upholds this function's safety contract (its
    // `# Safety` section or the module's), which every unsafe operation
    // below relies on.
    unsafe {
        for t in 0..N {
            let a = acts.get_unchecked(t).get_unchecked(i);
            acc[t] = vfmaq_n_f32(acc[t], vcvtq_f32_s32(sumi[t]), d * a.d);
        }
    }
}

/// `out[t]`: the lanes of `acc[t]` summed, less those of `acc_m[t]` when there are mins.
#[inline(always)]
unsafe fn store<const N: usize>(
    out: &mut [f32],
    acc: &[float32x4_t; N],
    acc_m: Option<&[float32x4_t; N]>,
) {
    // SAFETY: the caller upholds this function's safety contract (its
    // `# Safety` section or the module's), which every unsafe operation
    // below relies on.
    unsafe {
        for t in 0..N {
            let sum = vaddvq_f32(acc[t]);
            *out.get_unchecked_mut(t) = match acc_m {
                Some(m) => sum - vaddvq_f32(m[t]),
                None => sum,
            };
        }
    }
}

/// The eight 6-bit scales and eight 6-bit mins of a Q4_K/Q5_K block (12 bytes at
/// `p`), unpacked four at a time with whole-word masks.
#[inline(always)]
unsafe fn k4_scales_mins(p: *const u8) -> ([u8; 8], [u8; 8]) {
    // SAFETY: the caller upholds this function's safety contract (its
    // `# Safety` section or the module's), which every unsafe operation
    // below relies on.
    unsafe {
        const LOW6: u32 = 0x3f3f_3f3f;
        const LOW4: u32 = 0x0f0f_0f0f;
        const TOP2: u32 = 0x0303_0303;
        let (w0, w1, w2) = (u32_at(p), u32_at(p.add(4)), u32_at(p.add(8)));
        // Scales/mins 0..4: the low 6 bits of bytes 0..4 / 4..8. Scales/mins 4..8:
        // low 4 bits from the nibbles of bytes 8..12, top 2 bits from bits 6..8 of bytes 0..8.
        let sc_lo = w0 & LOW6;
        let sc_hi = (w2 & LOW4) | (((w0 >> 6) & TOP2) << 4);
        let mn_lo = w1 & LOW6;
        let mn_hi = ((w2 >> 4) & LOW4) | (((w1 >> 6) & TOP2) << 4);
        let scales = (sc_lo as u64 | (sc_hi as u64) << 32).to_le_bytes();
        let mins = (mn_lo as u64 | (mn_hi as u64) << 32).to_le_bytes();
        (scales, mins)
    }
}

/// The 16 signed scales of a Q3_K block (12 bytes at `p`), −32 offset removed.
/// Scale j has its low 4 bits in the nibble of byte j % 8 (low nibble for j < 8)
/// and its top 2 bits at bits 2·(j / 4) of byte 8 + j % 4: word masks do four at a time.
#[inline(always)]
unsafe fn q3k_scales(p: *const u8) -> [i8; 16] {
    // SAFETY: the caller upholds this function's safety contract (its
    // `# Safety` section or the module's), which every unsafe operation
    // below relies on.
    unsafe {
        const LOW4: u32 = 0x0f0f_0f0f;
        const TOP2: u32 = 0x0303_0303;
        let (a0, a1, hi) = (u32_at(p), u32_at(p.add(4)), u32_at(p.add(8)));
        let words = [
            (a0 & LOW4) | ((hi & TOP2) << 4),
            (a1 & LOW4) | (((hi >> 2) & TOP2) << 4),
            ((a0 >> 4) & LOW4) | (((hi >> 4) & TOP2) << 4),
            ((a1 >> 4) & LOW4) | (((hi >> 6) & TOP2) << 4),
        ];
        let mut out = [0i8; 16];
        for (o, w) in out.chunks_exact_mut(4).zip(words) {
            for (o, b) in o.iter_mut().zip(w.to_le_bytes()) {
                *o = (b as i8).wrapping_sub(32);
            }
        }
        out
    }
}

/// Q2_K (16 bytes of 4-bit scale/min pairs, 64 bytes of 2-bit values, `d`, `dmin`)
/// × a tile of `N` Q8_K token rows.
#[inline(always)]
pub(super) unsafe fn q2_k_n<const DOT: bool, const N: usize>(
    row: &[u8],
    acts: &[&[BlockQ8K]],
    out: &mut [f32],
) {
    // SAFETY: the caller upholds this function's safety contract (its
    // `# Safety` section or the module's), which every unsafe operation
    // below relies on.
    unsafe {
        let nb = row.len() / BlockQ2K::BLOCK_BYTES;
        let three = vdupq_n_u8(3);
        let mut acc = [vdupq_n_f32(0.0); N];
        let mut acc_m = [vdupq_n_f32(0.0); N];
        for i in 0..nb {
            let b = row.as_ptr().add(i * BlockQ2K::BLOCK_BYTES);
            let (d, dmin) = (
                f16_at(b.add(BlockQ2K::D_OFFSET)),
                f16_at(b.add(BlockQ2K::DMIN_OFFSET)),
            );
            // Group g's scale is the low nibble of byte g, its min the high nibble.
            let packed = vld1q_u8(b);
            let mut scales = [0u8; 16];
            vst1q_u8(scales.as_mut_ptr(), vandq_u8(packed, vdupq_n_u8(0x0F)));
            let (min_lo, min_hi) = widen(vreinterpretq_s8_u8(vshrq_n_u8(packed, 4)));
            let mut sumi = [vdupq_n_s32(0); N];
            for half in 0..2 {
                // 128 values: bits 2s..2s+2 of 32 bytes are values 32s..32s+32 (groups 2s, 2s+1).
                let mut q_lo = vld1q_u8(b.add(BlockQ2K::QS_OFFSET + 32 * half));
                let mut q_hi = vld1q_u8(b.add(BlockQ2K::QS_OFFSET + 16 + 32 * half));
                for s in 0..4 {
                    let v_lo = vreinterpretq_s8_u8(vandq_u8(q_lo, three));
                    let v_hi = vreinterpretq_s8_u8(vandq_u8(q_hi, three));
                    q_lo = vshrq_n_u8(q_lo, 2);
                    q_hi = vshrq_n_u8(q_hi, 2);
                    let g = 8 * half + 2 * s;
                    let (s_lo, s_hi) = (scales[g] as i32, scales[g + 1] as i32);
                    let at = 128 * half + 32 * s;
                    scaled_runs::<DOT, N>(&mut sumi, acts, i, at, (v_lo, s_lo), (v_hi, s_hi));
                }
            }
            // The mins against the activations' group sums, then the block scales.
            let mins: [int32x4_t; N] = std::array::from_fn(|t| {
                group_products(min_lo, min_hi, acts.get_unchecked(t).get_unchecked(i))
            });
            scale_block(&mut acc_m, &mins, dmin, acts, i);
            scale_block(&mut acc, &sumi, d, acts, i);
        }
        store(out, &acc, Some(&acc_m));
    }
}

/// Q3_K (32 bytes of high bits, 64 bytes of low 2 bits, 12 bytes of 6-bit scales, `d`)
/// × a tile of `N` Q8_K token rows. Values are used as 0..8; the −4 offset comes off up front.
#[inline(always)]
pub(super) unsafe fn q3_k_n<const DOT: bool, const N: usize>(
    row: &[u8],
    acts: &[&[BlockQ8K]],
    out: &mut [f32],
) {
    // SAFETY: the caller upholds this function's safety contract (its
    // `# Safety` section or the module's), which every unsafe operation
    // below relies on.
    unsafe {
        let nb = row.len() / BlockQ3K::BLOCK_BYTES;
        let three = vdupq_n_u8(3);
        let one = vdupq_n_u8(1);
        let mut acc = [vdupq_n_f32(0.0); N];
        for i in 0..nb {
            let b = row.as_ptr().add(i * BlockQ3K::BLOCK_BYTES);
            let d = f16_at(b.add(BlockQ3K::D_OFFSET));
            let scales = q3k_scales(b.add(BlockQ3K::SCALES_OFFSET));
            let (sc_lo, sc_hi) = widen(vld1q_s8(scales.as_ptr()));
            // The −4 offset of every value, taken off up front.
            let mut sumi = offset_start::<N>(sc_lo, sc_hi, 4, acts, i);
            // Bit 4·half + s of high-mask byte l is the third bit of value 128·half + 32·s + l.
            let mut hm_lo = vld1q_u8(b.add(BlockQ3K::HMASK_OFFSET));
            let mut hm_hi = vld1q_u8(b.add(BlockQ3K::HMASK_OFFSET + 16));
            for half in 0..2 {
                let mut q_lo = vld1q_u8(b.add(BlockQ3K::QS_OFFSET + 32 * half));
                let mut q_hi = vld1q_u8(b.add(BlockQ3K::QS_OFFSET + 16 + 32 * half));
                for s in 0..4 {
                    let v_lo = vorrq_u8(vandq_u8(q_lo, three), vshlq_n_u8(vandq_u8(hm_lo, one), 2));
                    let v_hi = vorrq_u8(vandq_u8(q_hi, three), vshlq_n_u8(vandq_u8(hm_hi, one), 2));
                    q_lo = vshrq_n_u8(q_lo, 2);
                    q_hi = vshrq_n_u8(q_hi, 2);
                    hm_lo = vshrq_n_u8(hm_lo, 1);
                    hm_hi = vshrq_n_u8(hm_hi, 1);
                    let (v_lo, v_hi) = (vreinterpretq_s8_u8(v_lo), vreinterpretq_s8_u8(v_hi));
                    // Scale g for the first 16 values, g + 1 for the next 16.
                    let g = 8 * half + 2 * s;
                    let (s_lo, s_hi) = (scales[g] as i32, scales[g + 1] as i32);
                    let at = 128 * half + 32 * s;
                    scaled_runs::<DOT, N>(&mut sumi, acts, i, at, (v_lo, s_lo), (v_hi, s_hi));
                }
            }
            scale_block(&mut acc, &sumi, d, acts, i);
        }
        store(out, &acc, None);
    }
}

/// Q4_K and Q5_K share everything but the fifth bit: `FIFTH_BIT` selects Q5_K
/// (`d`, `dmin`, 12 scale bytes, [32 bytes of fifth bits,] 128 bytes of nibbles).
#[inline(always)]
unsafe fn k45_n<const FIFTH_BIT: bool, const DOT: bool, const N: usize>(
    row: &[u8],
    acts: &[&[BlockQ8K]],
    out: &mut [f32],
) {
    // SAFETY: the caller upholds this function's safety contract (its
    // `# Safety` section or the module's), which every unsafe operation
    // below relies on.
    unsafe {
        let (block, qs_at) = if FIFTH_BIT {
            (BlockQ5K::BLOCK_BYTES, BlockQ5K::QS_OFFSET)
        } else {
            (BlockQ4K::BLOCK_BYTES, BlockQ4K::QS_OFFSET)
        };
        const _: () = assert!(BlockQ4K::DMIN_OFFSET == BlockQ5K::DMIN_OFFSET);
        const _: () = assert!(BlockQ4K::SCALES_OFFSET == BlockQ5K::SCALES_OFFSET);
        let nb = row.len() / block;
        let low4 = vdupq_n_u8(0x0F);
        let one = vdupq_n_u8(1);
        let two = vdupq_n_u8(2);
        let mut acc = [vdupq_n_f32(0.0); N];
        let mut acc_m = [vdupq_n_f32(0.0); N];
        for i in 0..nb {
            let b = row.as_ptr().add(i * block);
            let (d, dmin) = (f16_at(b), f16_at(b.add(BlockQ4K::DMIN_OFFSET)));
            let (scales, mins) = k4_scales_mins(b.add(BlockQ4K::SCALES_OFFSET));
            let mins = vreinterpretq_s16_u16(vmovl_u8(vld1_u8(mins.as_ptr())));
            // Q5_K: bit 2c of byte l is the fifth bit of value 64c + l, bit 2c + 1 of value 64c + 32 + l.
            let (mut hb_lo, mut hb_hi) = if FIFTH_BIT {
                (
                    vld1q_u8(b.add(BlockQ5K::QH_OFFSET)),
                    vld1q_u8(b.add(BlockQ5K::QH_OFFSET + 16)),
                )
            } else {
                (vdupq_n_u8(0), vdupq_n_u8(0))
            };
            let mut sumi = [vdupq_n_s32(0); N];
            for c in 0..4 {
                // 64 values: the low nibbles of 32 bytes (scale 2c), then their high nibbles (scale 2c + 1).
                let q_lo = vld1q_u8(b.add(qs_at + 32 * c));
                let q_hi = vld1q_u8(b.add(qs_at + 16 + 32 * c));
                let (mut lo_lo, mut lo_hi) = (vandq_u8(q_lo, low4), vandq_u8(q_hi, low4));
                let (mut hi_lo, mut hi_hi) = (vshrq_n_u8(q_lo, 4), vshrq_n_u8(q_hi, 4));
                if FIFTH_BIT {
                    lo_lo = vorrq_u8(lo_lo, vshlq_n_u8(vandq_u8(hb_lo, one), 4));
                    lo_hi = vorrq_u8(lo_hi, vshlq_n_u8(vandq_u8(hb_hi, one), 4));
                    hi_lo = vorrq_u8(hi_lo, vshlq_n_u8(vandq_u8(hb_lo, two), 3));
                    hi_hi = vorrq_u8(hi_hi, vshlq_n_u8(vandq_u8(hb_hi, two), 3));
                    hb_lo = vshrq_n_u8(hb_lo, 2);
                    hb_hi = vshrq_n_u8(hb_hi, 2);
                }
                let s8 = vreinterpretq_s8_u8;
                let (s_lo, s_hi) = (scales[2 * c] as i32, scales[2 * c + 1] as i32);
                for t in 0..N {
                    let a = acts
                        .get_unchecked(t)
                        .get_unchecked(i)
                        .qs
                        .as_ptr()
                        .add(64 * c);
                    let zero = vdupq_n_s32(0);
                    let p_lo = dot32::<DOT>(zero, s8(lo_lo), s8(lo_hi), a);
                    let p_hi = dot32::<DOT>(zero, s8(hi_lo), s8(hi_hi), a.add(32));
                    sumi[t] = vmlaq_n_s32(sumi[t], p_lo, s_lo);
                    sumi[t] = vmlaq_n_s32(sumi[t], p_hi, s_hi);
                }
            }
            // The mins against the activations' sums over each 32 values (adjacent group
            // sums), then the block scales.
            let min_sums: [int32x4_t; N] = std::array::from_fn(|t| {
                let a = acts.get_unchecked(t).get_unchecked(i);
                let pairs = vpaddq_s16(
                    vld1q_s16(a.bsums.as_ptr()),
                    vld1q_s16(a.bsums.as_ptr().add(8)),
                );
                vmlal_high_s16(
                    vmull_s16(vget_low_s16(mins), vget_low_s16(pairs)),
                    mins,
                    pairs,
                )
            });
            scale_block(&mut acc_m, &min_sums, dmin, acts, i);
            scale_block(&mut acc, &sumi, d, acts, i);
        }
        store(out, &acc, Some(&acc_m));
    }
}

/// Q4_K × a tile of `N` Q8_K token rows.
#[inline(always)]
pub(super) unsafe fn q4_k_n<const DOT: bool, const N: usize>(
    row: &[u8],
    acts: &[&[BlockQ8K]],
    out: &mut [f32],
) {
    // SAFETY: the caller upholds this function's safety contract (its
    // `# Safety` section or the module's), which every unsafe operation
    // below relies on.
    unsafe { k45_n::<false, DOT, N>(row, acts, out) }
}

/// Q5_K × a tile of `N` Q8_K token rows.
#[inline(always)]
pub(super) unsafe fn q5_k_n<const DOT: bool, const N: usize>(
    row: &[u8],
    acts: &[&[BlockQ8K]],
    out: &mut [f32],
) {
    // SAFETY: the caller upholds this function's safety contract (its
    // `# Safety` section or the module's), which every unsafe operation
    // below relies on.
    unsafe { k45_n::<true, DOT, N>(row, acts, out) }
}

/// Q6_K (128 bytes of low nibbles, 64 bytes of high 2 bits, 16 signed scales, `d`)
/// × a tile of `N` Q8_K token rows. Values are used as 0..64; the −32 offset comes off up front.
#[inline(always)]
pub(super) unsafe fn q6_k_n<const DOT: bool, const N: usize>(
    row: &[u8],
    acts: &[&[BlockQ8K]],
    out: &mut [f32],
) {
    // SAFETY: the caller upholds this function's safety contract (its
    // `# Safety` section or the module's), which every unsafe operation
    // below relies on.
    unsafe {
        let nb = row.len() / BlockQ6K::BLOCK_BYTES;
        let low4 = vdupq_n_u8(0x0F);
        let mut acc = [vdupq_n_f32(0.0); N];
        for i in 0..nb {
            let b = row.as_ptr().add(i * BlockQ6K::BLOCK_BYTES);
            let d = f16_at(b.add(BlockQ6K::D_OFFSET));
            let scales: [i8; 16] = b.add(BlockQ6K::SCALES_OFFSET).cast::<[i8; 16]>().read();
            let (sc_lo, sc_hi) = widen(vld1q_s8(scales.as_ptr()));
            // The −32 offset of every value, taken off up front.
            let mut sumi = offset_start::<N>(sc_lo, sc_hi, 32, acts, i);
            for half in 0..2 {
                // 128 values from 64 bytes of nibbles (ql0, ql1) and 32 bytes of 2-bit pairs (qh).
                let ql0 = [
                    vld1q_u8(b.add(BlockQ6K::QL_OFFSET + 64 * half)),
                    vld1q_u8(b.add(BlockQ6K::QL_OFFSET + 64 * half + 16)),
                ];
                let ql1 = [
                    vld1q_u8(b.add(BlockQ6K::QL_OFFSET + 64 * half + 32)),
                    vld1q_u8(b.add(BlockQ6K::QL_OFFSET + 64 * half + 48)),
                ];
                let qh = [
                    vld1q_u8(b.add(BlockQ6K::QH_OFFSET + 32 * half)),
                    vld1q_u8(b.add(BlockQ6K::QH_OFFSET + 16 + 32 * half)),
                ];
                for k in 0..4 {
                    // Run k (32 values): nibble k / 2 of ql(k % 2), with bits 2k..2k+2 of qh on top.
                    let run = |j: usize| {
                        let ql = if k % 2 == 0 { ql0[j] } else { ql1[j] };
                        let low = if k < 2 {
                            vandq_u8(ql, low4)
                        } else {
                            vshrq_n_u8(ql, 4)
                        };
                        let high = match k {
                            0 => vshlq_n_u8(vandq_u8(qh[j], vdupq_n_u8(0x03)), 4),
                            1 => vshlq_n_u8(vandq_u8(qh[j], vdupq_n_u8(0x0C)), 2),
                            2 => vandq_u8(qh[j], vdupq_n_u8(0x30)),
                            _ => vshrq_n_u8(vandq_u8(qh[j], vdupq_n_u8(0xC0)), 2),
                        };
                        vreinterpretq_s8_u8(vorrq_u8(low, high))
                    };
                    let (v_lo, v_hi) = (run(0), run(1));
                    // Scale g for the first 16 values, g + 1 for the next 16.
                    let g = 8 * half + 2 * k;
                    let (s_lo, s_hi) = (scales[g] as i32, scales[g + 1] as i32);
                    let at = 128 * half + 32 * k;
                    scaled_runs::<DOT, N>(&mut sumi, acts, i, at, (v_lo, s_lo), (v_hi, s_hi));
                }
            }
            scale_block(&mut acc, &sumi, d, acts, i);
        }
        store(out, &acc, None);
    }
}

/// IQ4_XS (`d`, 8 six-bit sub-block scales, 128 bytes of level indices) × a tile
/// of `N` Q8_K token rows.
#[inline(always)]
pub(super) unsafe fn iq4_xs_n<const DOT: bool, const N: usize>(
    row: &[u8],
    acts: &[&[BlockQ8K]],
    out: &mut [f32],
) {
    // SAFETY: the caller upholds this function's safety contract (its
    // `# Safety` section or the module's), which every unsafe operation
    // below relies on.
    unsafe {
        let nb = row.len() / BlockIq4Xs::BLOCK_BYTES;
        let levels = vld1q_s8(KVALUES_IQ4NL.as_ptr());
        let low4 = vdupq_n_u8(0x0F);
        let mut acc = [vdupq_n_f32(0.0); N];
        for i in 0..nb {
            let b = row.as_ptr().add(i * BlockIq4Xs::BLOCK_BYTES);
            let d = f16_at(b);
            let h = b.add(BlockIq4Xs::SCALES_H_OFFSET);
            let scales_h = u16::from_le_bytes([*h, *h.add(1)]);
            let mut sumi = [vdupq_n_s32(0); N];
            for ib in 0..8 {
                // Sub-block scale: 4 low bits from a nibble of bytes 4..8, 2 high bits from scales_h.
                let ls = ((*b.add(BlockIq4Xs::SCALES_L_OFFSET + ib / 2) >> (4 * (ib % 2))) & 0xF)
                    as i32
                    | ((((scales_h >> (2 * ib)) & 3) as i32) << 4);
                // 32 values: the levels of 16 low nibbles, then of 16 high nibbles.
                let q = vld1q_u8(b.add(BlockIq4Xs::QS_OFFSET + 16 * ib));
                let lo = vqtbl1q_s8(levels, vandq_u8(q, low4));
                let hi = vqtbl1q_s8(levels, vshrq_n_u8(q, 4));
                for t in 0..N {
                    let a = acts
                        .get_unchecked(t)
                        .get_unchecked(i)
                        .qs
                        .as_ptr()
                        .add(32 * ib);
                    let p = dot32::<DOT>(vdupq_n_s32(0), lo, hi, a);
                    sumi[t] = vmlaq_n_s32(sumi[t], p, ls - 32);
                }
            }
            scale_block(&mut acc, &sumi, d, acts, i);
        }
        store(out, &acc, None);
    }
}

/// Rows × Q8_K tile for a K-quant or IQ4_XS.
///
/// # Safety
/// With `DOT = true` the CPU must support the dot-product extension.
#[inline(always)]
pub(super) unsafe fn rows_q8k<const DOT: bool>(
    t: GgmlType,
    rows: &[u8],
    rb: usize,
    acts: &[&[BlockQ8K]],
    out: &mut [f32],
) {
    if !checked(rows, rb, t.type_size(), 1, acts, out) {
        return each_row(scalar::dot_q8k, t, rows, rb, acts, out);
    }
    match t {
        GgmlType::Q2_K => tile!(q2_k_n, DOT; rows, rb, acts, out),
        GgmlType::Q3_K => tile!(q3_k_n, DOT; rows, rb, acts, out),
        GgmlType::Q4_K => tile!(q4_k_n, DOT; rows, rb, acts, out),
        GgmlType::Q5_K => tile!(q5_k_n, DOT; rows, rb, acts, out),
        GgmlType::Q6_K => tile!(q6_k_n, DOT; rows, rb, acts, out),
        GgmlType::IQ4_XS => tile!(iq4_xs_n, DOT; rows, rb, acts, out),
        _ => each_row(scalar::dot_q8k, t, rows, rb, acts, out),
    }
}
