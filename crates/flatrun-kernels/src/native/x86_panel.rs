//! The AVX-512 VNNI tiles over panels (`native/panel.rs`): 16 rows × 4 or 8 tokens (Q4_K,
//! Q6_K), 8 rows × 4 tokens (the 32-value formats).
// Index loops over parallel per-token arrays (registers, activations, outputs) read as the
// tile's equations.
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;

use crate::native::panel::{LegacyPanelBlock, PANEL_ROWS, Q4kPanelBlock, Q6kPanelBlock};
use crate::native::quantize::{BlockQ8, BlockQ8K};

/// `acc + Σ` of i16 pairs `a·b`, as one `vpdpwssd` (left to itself, LLVM splits it into
/// `vpmaddwd` + `vpaddd`, one more instruction on the two ports 512-bit code has).
#[inline]
#[target_feature(enable = "avx512f,avx512vnni")]
pub(super) fn dpwssd(acc: __m512i, a: __m512i, b: __m512i) -> __m512i {
    let mut acc = acc;
    // SAFETY: register-only, and this function's features include VNNI.
    unsafe {
        std::arch::asm!(
            "vpdpwssd {acc}, {a}, {b}",
            acc = inout(zmm_reg) acc,
            a = in(zmm_reg) a,
            b = in(zmm_reg) b,
            options(pure, nomem, nostack, preserves_flags)
        );
    }
    acc
}

/// One panel (16 rows, `blocks` = its `nb` super-blocks) × `T` Q8_K token rows, bit for bit
/// the outputs of the one-row Q4_K kernels in the same order: per output, one FMA per
/// 64-value chunk into a scale and a min accumulator (ggml's repacked GEMM), or with
/// `ONE_TOKEN` one FMA per 256 values (its repacked GEMV, the one-token order). The integer
/// sums are exact whatever their grouping, so only the FMAs fix the bits, and they are the
/// one-row kernels' FMAs. Each i32 lane is one row's, so a chunk's sums go to the FMA
/// as they are: no horizontal sums. `out[r·T + t]` = row r, token t. With `T` = 8 each
/// unpacked weight vector serves twice the tokens.
///
/// # Safety
/// The CPU has AVX2, FMA, AVX-512 F/BW/VL and VNNI; every `acts[t]` (`T` of them) holds at
/// least `blocks.len()` blocks; `out` holds `16·T` values.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) unsafe fn q4_k_panel_16<const ONE_TOKEN: bool, const T: usize>(
    blocks: &[Q4kPanelBlock],
    acts: &[&[BlockQ8K]],
    out: &mut [f32],
) {
    // SAFETY: every pointer read below lies in `blocks` or in the first `blocks.len()`
    // blocks of each of the 4 activation rows (the caller's promise).
    unsafe {
        let m4 = _mm512_set1_epi8(0x0F);
        let zero = _mm512_setzero_si512();
        let mut acc = [_mm512_setzero_ps(); T];
        let mut acc_m = [_mm512_setzero_ps(); T];
        for (i, blk) in blocks.iter().enumerate() {
            let a: [&BlockQ8K; T] = std::array::from_fn(|t| acts.get_unchecked(t).get_unchecked(i));
            let d = _mm512_loadu_ps(blk.d.as_ptr());
            // Per token: d_w·d_a for the 16 rows, the one-row kernels' product.
            let dd: [__m512; T] = std::array::from_fn(|t| _mm512_mul_ps(d, _mm512_set1_ps(a[t].d)));
            let mut whole = [zero; T];
            for c in 0..4 {
                let s_lo = _mm512_loadu_si512(blk.scales[2 * c].as_ptr() as *const __m512i);
                let s_hi = _mm512_loadu_si512(blk.scales[2 * c + 1].as_ptr() as *const __m512i);
                let mut sum = if ONE_TOKEN { whole } else { [zero; T] };
                // Two halves of 16 values per sub-block, so that each lane's unscaled sum
                // fits the i16 that `vpdpwssd` multiplies by the scale.
                for half in 0..2 {
                    let mut sub_lo = [zero; T];
                    let mut sub_hi = [zero; T];
                    for g in 4 * half..4 * half + 4 {
                        let w = _mm512_loadu_si512(blk.qs[8 * c + g].as_ptr() as *const __m512i);
                        let lo = _mm512_and_si512(w, m4);
                        let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(w), m4);
                        for t in 0..T {
                            let p = a[t].qs.as_ptr().add(64 * c + 4 * g);
                            let a_lo = _mm512_set1_epi32((p as *const i32).read_unaligned());
                            let a_hi =
                                _mm512_set1_epi32((p.add(32) as *const i32).read_unaligned());
                            sub_lo[t] = _mm512_dpbusd_epi32(sub_lo[t], lo, a_lo);
                            sub_hi[t] = _mm512_dpbusd_epi32(sub_hi[t], hi, a_hi);
                        }
                    }
                    // Scaled into the chunk's sums: the scale vectors hold 0 in each i32
                    // lane's high i16, which meets the sum's sign bits (`Q4kPanelBlock::scales`).
                    for t in 0..T {
                        sum[t] = dpwssd(dpwssd(sum[t], sub_lo[t], s_lo), sub_hi[t], s_hi);
                    }
                }
                if ONE_TOKEN {
                    whole = sum;
                } else {
                    for t in 0..T {
                        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[t]), dd[t], acc[t]);
                    }
                }
            }
            if ONE_TOKEN {
                for t in 0..T {
                    acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(whole[t]), dd[t], acc[t]);
                }
            }
            // The mins against each token's 16-value sums: per chunk c, row r's
            // `min[2c]·(b[4c] + b[4c+1]) + min[2c+1]·(b[4c+2] + b[4c+3])`, each pair of sums
            // broadcast from memory.
            let dmin = _mm512_loadu_ps(blk.dmin.as_ptr());
            let mins: [__m512i; 8] =
                std::array::from_fn(|j| _mm512_loadu_si512(blk.mins[j].as_ptr() as *const __m512i));
            for t in 0..T {
                let dm = _mm512_mul_ps(dmin, _mm512_set1_ps(a[t].d));
                let bs = a[t].bsums.as_ptr() as *const i32;
                let m: [__m512i; 4] = std::array::from_fn(|c| {
                    let lo = _mm512_set1_epi32(bs.add(2 * c).read_unaligned());
                    let hi = _mm512_set1_epi32(bs.add(2 * c + 1).read_unaligned());
                    dpwssd(_mm512_madd_epi16(mins[2 * c], lo), mins[2 * c + 1], hi)
                });
                if ONE_TOKEN {
                    let all = _mm512_add_epi32(
                        _mm512_add_epi32(m[0], m[1]),
                        _mm512_add_epi32(m[2], m[3]),
                    );
                    acc_m[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(all), dm, acc_m[t]);
                } else {
                    for mc in m {
                        acc_m[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(mc), dm, acc_m[t]);
                    }
                }
            }
        }
        store_transposed_16::<T>(
            std::array::from_fn(|t| _mm512_sub_ps(acc[t], acc_m[t])),
            out,
        );
    }
}

/// Each of `T` tokens' 16 row outputs into `out[r·T + t]`.
///
/// # Safety
/// `out` holds `16·T` values; the CPU has AVX-512 F.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn store_transposed_16<const T: usize>(v: [__m512; T], out: &mut [f32]) {
    let mut res = [[0f32; 16]; T];
    for t in 0..T {
        // SAFETY: `res[t]` holds 16 floats.
        unsafe { _mm512_storeu_ps(res[t].as_mut_ptr(), v[t]) };
    }
    for r in 0..16 {
        for t in 0..T {
            // SAFETY: T·r + t < 16·T ≤ out.len() (the caller's promise).
            unsafe { *out.get_unchecked_mut(T * r + t) = res[t][r] };
        }
    }
}

/// Each token's 8 row outputs into `out[r·4 + t]`.
///
/// # Safety
/// `out` holds 32 values; the CPU has AVX.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn store_transposed(v: [__m256; 4], out: &mut [f32]) {
    let mut res = [[0f32; PANEL_ROWS]; 4];
    for t in 0..4 {
        // SAFETY: `res[t]` holds 8 floats.
        unsafe { _mm256_storeu_ps(res[t].as_mut_ptr(), v[t]) };
    }
    for r in 0..PANEL_ROWS {
        for t in 0..4 {
            // SAFETY: 4r + t < 32 ≤ out.len() (the caller's promise).
            unsafe { *out.get_unchecked_mut(4 * r + t) = res[t][r] };
        }
    }
}

/// One Q6_K panel (16 rows) × `T` Q8_K token rows offset to `a + 128`
/// (`panel::offset_acts`), in the order of ggml's tiled K-quant matmul (which
/// `q6_k_n::<true, _>` keeps): per output and block, the exact integer sum `isum` of
/// `scale·q·a`, then `acc = fma(d_w·isum, d_a, acc)`. Each i32 lane is one row's. Per 8
/// values (two vectors) a token's `vpdpbusd` sums start from `−128·Σq` of those values,
/// made once for the `T` tokens, so they end at `Σ a·q`, which fits the i16 that
/// `vpdpwssd` multiplies by the scale. `out[r·T + t]`.
///
/// # Safety
/// As [`q4_k_panel_16`]; the activations are offset.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) unsafe fn q6_k_panel_16<const T: usize>(
    blocks: &[Q6kPanelBlock],
    acts: &[&[BlockQ8K]],
    out: &mut [f32],
) {
    // SAFETY: every pointer read below lies in `blocks` or in the first `blocks.len()`
    // blocks of each of the `T` activation rows (the caller's promise).
    unsafe {
        let zero = _mm512_setzero_si512();
        let m128 = _mm512_set1_epi8(-128);
        let mut acc = [_mm512_setzero_ps(); T];
        for (i, blk) in blocks.iter().enumerate() {
            let a: [&BlockQ8K; T] = std::array::from_fn(|t| acts.get_unchecked(t).get_unchecked(i));
            let mut sum = [zero; T];
            for g in 0..16 {
                let s = _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                    blk.scales[g].as_ptr() as *const __m256i
                ));
                for e in [2 * g, 2 * g + 1] {
                    let q0 = _mm512_loadu_si512(blk.q[2 * e].as_ptr() as *const __m512i);
                    let q1 = _mm512_loadu_si512(blk.q[2 * e + 1].as_ptr() as *const __m512i);
                    let offset = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, m128, q0), m128, q1);
                    let start = _mm512_sub_epi32(zero, offset);
                    for t in 0..T {
                        let p = a[t].qs.as_ptr().add(8 * e) as *const i32;
                        let a0 = _mm512_set1_epi32(p.read_unaligned());
                        let a1 = _mm512_set1_epi32(p.add(1).read_unaligned());
                        let part = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(start, a0, q0), a1, q1);
                        sum[t] = dpwssd(sum[t], part, s);
                    }
                }
            }
            let d = _mm512_loadu_ps(blk.d.as_ptr());
            for t in 0..T {
                let res = _mm512_mul_ps(d, _mm512_cvtepi32_ps(sum[t]));
                acc[t] = _mm512_fmadd_ps(res, _mm512_set1_ps(a[t].d), acc[t]);
            }
        }
        store_transposed_16(acc, out);
    }
}

/// One panel of a 32-value format × 4 Q8 token rows, bit for bit `legacy_n` (ggml's
/// `vec_dot` order): per output, eight lanes of four values each, `lane = fma(d_w·d_a,
/// Σ4 q·a, lane)` per block, then `hsum` of the lanes (the tree of `super::hsum`) plus the
/// mins' chain (`UNSIGNED`: `mins = fma(m_w, s_a, mins)` per block). Vector v's `vpdpbusd`
/// gives row r the lanes `2v`, `2v + 1` in its lanes `2r`, `2r + 1`, so four accumulators
/// per token hold every output's eight lanes. Signed values (`UNSIGNED` false) take their
/// activations offset to `a + 128` (`panel::offset_acts`) as the unsigned operand: each
/// lane's `Σ4 (a + 128)·q` starts from `−128·Σ4 q`, made once per vector for the 4 tokens,
/// so the integer sums are exactly `Σ4 a·q`. `out[r·4 + t]`.
///
/// # Safety
/// As [`q4_k_panel_16`] with `T` = 4; for signed values the activations are offset.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(crate) unsafe fn legacy_panel_8x4<const UNSIGNED: bool>(
    blocks: &[LegacyPanelBlock],
    acts: &[&[BlockQ8]],
    out: &mut [f32],
) {
    // SAFETY: every pointer read below lies in `blocks` or in the first `blocks.len()`
    // blocks of each of the 4 activation rows (the caller's promise).
    unsafe {
        let mut lanes = [[_mm512_setzero_ps(); 4]; 4];
        let mut mins = [_mm256_setzero_ps(); 4];
        for (i, blk) in blocks.iter().enumerate() {
            let a: [&BlockQ8; 4] = std::array::from_fn(|t| acts.get_unchecked(t).get_unchecked(i));
            let d = _mm512_loadu_ps(blk.d.as_ptr());
            let dd: [__m512; 4] = std::array::from_fn(|t| _mm512_mul_ps(d, _mm512_set1_ps(a[t].d)));
            for v in 0..4 {
                let q = _mm512_loadu_si512(blk.q[v].as_ptr() as *const __m512i);
                // −128·Σ4 q per lane: what the offset activations add.
                let start = if UNSIGNED {
                    _mm512_setzero_si512()
                } else {
                    let zero = _mm512_setzero_si512();
                    _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, _mm512_set1_epi8(-128), q))
                };
                for t in 0..4 {
                    let p = a[t].qs.as_ptr().add(8 * v);
                    let av = _mm512_set1_epi64((p as *const i64).read_unaligned());
                    let sum = if UNSIGNED {
                        _mm512_dpbusd_epi32(start, q, av)
                    } else {
                        _mm512_dpbusd_epi32(start, av, q)
                    };
                    lanes[t][v] = _mm512_fmadd_ps(dd[t], _mm512_cvtepi32_ps(sum), lanes[t][v]);
                }
            }
            if UNSIGNED {
                let m = _mm256_loadu_ps(blk.m.as_ptr());
                for t in 0..4 {
                    mins[t] = _mm256_fmadd_ps(m, _mm256_set1_ps(a[t].s), mins[t]);
                }
            }
        }
        let res: [__m256; 4] = std::array::from_fn(|t| {
            let l = &lanes[t];
            // Lanes 2r, 2r + 1 of `c`: (l0+l4)+(l2+l6) and (l1+l5)+(l3+l7) of row r.
            let c = _mm512_add_ps(_mm512_add_ps(l[0], l[2]), _mm512_add_ps(l[1], l[3]));
            let idx_even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 0, 0, 0, 0, 0, 0, 0, 0);
            let idx_odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 0, 0, 0, 0, 0, 0, 0, 0);
            let even = _mm512_castps512_ps256(_mm512_permutexvar_ps(idx_even, c));
            let odd = _mm512_castps512_ps256(_mm512_permutexvar_ps(idx_odd, c));
            _mm256_add_ps(_mm256_add_ps(even, odd), mins[t])
        });
        store_transposed(res, out);
    }
}
