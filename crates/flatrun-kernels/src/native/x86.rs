//! x86_64 kernels: AVX2+FMA (`maddubs` dots), the same code compiled for AVX-512VL,
//! and an AVX-512 VNNI variant whose legacy-format dots use `vpdpbusd`.
//!
//! Every kernel has the shape `fn(row, acts, out)` over one weight row and a tile
//! of 1..=4 tokens (`acts[t]`, `out[t]`): each weight block is loaded and
//! unpacked once, then multiplied with every token of the tile.
//! The public wrappers are safe: [`super::dispatch`] only hands them out after
//! detecting the features, and they check the slice lengths they rely on.
//!
//! # Safety (every `unsafe fn` below)
//! The caller must run on a CPU with the module's target features, pass a row of
//! whole blocks, and 1..=N activation rows each holding at least the matching
//! number of activation blocks; the kernels index with `get_unchecked` and raw
//! pointers inside those bounds only.

use std::arch::x86_64::*;

#[path = "x86_float.rs"]
#[macro_use]
mod float;
#[path = "x86_kquants.rs"]
#[macro_use]
mod kquants;
#[path = "x86_legacy.rs"]
#[macro_use]
mod legacy;
#[path = "x86_panel.rs"]
mod panel;

/// Whether a panel tile call is well formed: 4 token rows (or `wide`), each holding every
/// block of `blocks`, and room for the outputs of `rows` rows.
fn panel_call_ok<B, A>(blocks: &[B], acts: &[&[A]], out: &[f32], rows: usize, wide: usize) -> bool {
    (acts.len() == 4 || acts.len() == wide)
        && out.len() >= acts.len() * rows
        && acts.iter().all(|a| a.len() >= blocks.len())
}

/// One Q4_K panel × 4 or 8 tokens (see `x86_panel.rs`), checked: `false` for a malformed call.
/// Only for a host with AVX-512 VNNI (the dispatch table of that level hands it out).
pub(crate) fn q4k_panel_tile(
    lines: &[super::panel::Line],
    acts: &[&[super::quantize::BlockQ8K]],
    out: &mut [f32],
    one_token: bool,
) -> bool {
    let Ok(blocks) = bytemuck::try_cast_slice::<_, super::panel::Q4kPanelBlock>(lines) else {
        return false;
    };
    if !panel_call_ok(blocks, acts, out, super::panel::Q4K_PANEL_ROWS, 8) {
        return false;
    }
    // SAFETY: dispatch only hands this out on a host with the kernel's features, and the
    // slices were checked just above.
    unsafe {
        match (one_token, acts.len()) {
            (true, 4) => panel::q4_k_panel_16::<true, 4>(blocks, acts, out),
            (false, 4) => panel::q4_k_panel_16::<false, 4>(blocks, acts, out),
            (true, _) => panel::q4_k_panel_16::<true, 8>(blocks, acts, out),
            (false, _) => panel::q4_k_panel_16::<false, 8>(blocks, acts, out),
        }
    }
    true
}

/// One panel of a legacy format × 4 tokens, checked as [`q4k_panel_tile`]: `UNSIGNED` for
/// Q4_1 and Q5_1 (values with a min), else signed values against activations offset by
/// `panel::offset_acts`. Every call keeps the one-token order: these formats' order does
/// not depend on the tokens per call.
pub(crate) fn legacy_panel_tile<const UNSIGNED: bool>(
    lines: &[super::panel::Line],
    acts: &[&[super::quantize::BlockQ8]],
    out: &mut [f32],
    _one_token: bool,
) -> bool {
    let Ok(blocks) = bytemuck::try_cast_slice::<_, super::panel::LegacyPanelBlock>(lines) else {
        return false;
    };
    if !panel_call_ok(blocks, acts, out, super::panel::PANEL_ROWS, 4) {
        return false;
    }
    // SAFETY: as in `q4k_panel_tile`.
    unsafe { panel::legacy_panel_8x4::<UNSIGNED>(blocks, acts, out) };
    true
}

/// One Q6_K panel × 4 or 8 tokens (offset, `panel::offset_acts`), checked as
/// [`q4k_panel_tile`]; the one-token order is not kept (`false`).
pub(crate) fn q6k_panel_tile(
    lines: &[super::panel::Line],
    acts: &[&[super::quantize::BlockQ8K]],
    out: &mut [f32],
    one_token: bool,
) -> bool {
    let Ok(blocks) = bytemuck::try_cast_slice::<_, super::panel::Q6kPanelBlock>(lines) else {
        return false;
    };
    if one_token || !panel_call_ok(blocks, acts, out, super::panel::Q6K_PANEL_ROWS, 8) {
        return false;
    }
    // SAFETY: as in `q4k_panel_tile`.
    unsafe {
        match acts.len() {
            4 => panel::q6_k_panel_16::<4>(blocks, acts, out),
            _ => panel::q6_k_panel_16::<8>(blocks, acts, out),
        }
    }
    true
}

/// `Σ` of 4-byte groups of `u8 × i8` products, AVX2: `maddubs` then `madd` with ones.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn mul_sum_maddubs(ax: __m256i, sy: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(ax, sy), _mm256_set1_epi16(1))
}

/// The same with one VNNI instruction.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn mul_sum_vnni(ax: __m256i, sy: __m256i) -> __m256i {
    _mm256_dpbusd_epi32(_mm256_setzero_si256(), ax, sy)
}

/// How far ahead of its reading position a one-token kernel prefetches its weight rows.
/// Matrices larger than the last-level cache stream from DRAM; the hardware prefetcher alone
/// keeps too few lines in flight behind a kernel that spends several cycles per block.
/// Measured with a C copy of the Q8_0 two-row kernel on the 151936×896 head (one thread,
/// huge pages, load 3): no software prefetch 5.3 GB/s, one prefetch per row per block (two
/// interleaved streams) 8.2–8.6 GB/s, one linear stream 4 KiB ahead 12.8–13.1 GB/s, against
/// 13–14.7 GB/s of plain reads (`docs/performance.md`).
pub(crate) const PREFETCH_AHEAD: usize = 4096;

/// Prefetch (into L1) the weight bytes `PREFETCH_AHEAD` past `pos`, for a kernel that reads
/// `step` bytes per iteration in one linear sweep: one line per iteration, two when an
/// iteration eats more than a line. A hint only: it never faults, and changes no value.
#[inline(always)]
pub(crate) fn prefetch_linear(pos: *const u8, step: usize) {
    let ahead = pos.wrapping_add(PREFETCH_AHEAD);
    // SAFETY: `prefetcht0` reads no architectural state and cannot fault, whatever the address.
    unsafe {
        _mm_prefetch::<_MM_HINT_T0>(ahead as *const i8);
        if step > 64 {
            _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(64) as *const i8);
        }
    }
}

/// [`prefetch_linear`] for a kernel that eats `step` bytes per iteration, any number of lines:
/// one `prefetcht0` per 64 bytes of `step` (rounded up), so the stream keeps up with the kernel
/// (the K-quant row pairs eat 168–272 bytes per block). A hint only, as `prefetch_linear`.
#[inline(always)]
fn prefetch_lines(pos: *const u8, step: usize) {
    let ahead = pos.wrapping_add(PREFETCH_AHEAD);
    for k in 0..step.div_ceil(64) {
        // SAFETY: `prefetcht0` reads no architectural state and cannot fault, whatever the address.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(64 * k) as *const i8) };
    }
}

/// `bits` in the low 64 bits of an xmm register, the rest zeroed: one `vmovq`. Written as asm
/// because left to itself LLVM builds it from inserts that wait for the register's old
/// contents, often a loop accumulator (see `f16_pair`).
///
/// # Safety
/// The CPU must support AVX (every caller is compiled for AVX2 or above).
#[inline(always)]
pub(crate) unsafe fn vmovq_to_xmm(bits: u64) -> __m128i {
    // SAFETY: this function's contract (the module's: the CPU has this level's
    // features; whole blocks, and activation rows long enough for every read).
    unsafe {
        let v: __m128i;
        // SAFETY: `vmovq` only moves a general register into a vector register (zeroing the
        // rest); it touches no memory. AVX is the caller's promise.
        {
            std::arch::asm!(
                "vmovq {v}, {b}",
                v = lateout(xmm_reg) v,
                b = in(reg) bits,
                options(pure, nomem, nostack, preserves_flags)
            );
        }
        v
    }
}

/// Horizontal sum of 8 floats in ggml's `hsum_float_8` order: lane k + lane k + 4, then
/// [`hsum128`]. (Shared, like the three helpers below, by every x86 kernel module: a
/// `target_feature` function inlines into callers whose features include its own.)
#[inline]
#[target_feature(enable = "avx")]
pub(crate) fn hsum(v: __m256) -> f32 {
    hsum128(_mm_add_ps(
        _mm256_castps256_ps128(v),
        _mm256_extractf128_ps(v, 1),
    ))
}

/// The last two steps of [`hsum`], on four floats: lane 0 + lane 2 and lane 1 + lane 3, then
/// their sum.
#[inline]
#[target_feature(enable = "avx")]
pub(crate) fn hsum128(v: __m128) -> f32 {
    let s = _mm_add_ps(v, _mm_movehl_ps(v, v));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// The 16 bytes at `p0` in the low 128-bit lane and the 16 at `p1` in the high one,
/// from two 32-byte loads and a `vpblendd` (any vector pipe) rather than a load and
/// a `vinserti128` (a shuffle µop, and the one-token kernels are short of shuffle
/// pipes on Zen 3).
///
/// # Safety
/// The CPU must support AVX2, and `p0 .. p0 + 32` and `p1 − 16 .. p1 + 16` must be readable:
/// callers pass `p0` in a row before `p1`'s row of one slice, so the 16 bytes past `p0 + 16`
/// and the 16 before `p1` lie inside it.
#[inline]
#[target_feature(enable = "avx2")]
pub(crate) unsafe fn pair_halves(p0: *const u8, p1: *const u8) -> __m256i {
    // SAFETY: the caller upholds the module's contract (see `x86.rs`): the CPU has
    // this level's features, and every pointer read below lies inside the caller's
    // rows (whole blocks), its activation rows, or this function's own buffers.
    unsafe {
        let first = _mm256_loadu_si256(p0 as *const __m256i);
        let second = _mm256_loadu_si256(p1.sub(16) as *const __m256i);
        _mm256_blend_epi32(first, second, 0xF0)
    }
}

/// The high nibble of every byte, by a 16-bit multiply-high (`x · 2^12 >> 16`, on the
/// multiply pipes) instead of a shift (on the shuffle pipes), then a mask. As asm:
/// LLVM turns the intrinsic back into the shift.
///
/// # Safety
/// The CPU must support AVX2.
#[inline]
#[target_feature(enable = "avx2")]
pub(crate) unsafe fn high_nibbles(v: __m256i) -> __m256i {
    // SAFETY: this function's contract (the module's: the CPU has this level's
    // features; whole blocks, and activation rows long enough for every read).
    unsafe {
        let shifted: __m256i;
        // SAFETY: `vpmulhuw` only reads and writes vector registers (AVX2, enabled here).
        {
            std::arch::asm!(
                "vpmulhuw {s}, {v}, {k}",
                s = lateout(ymm_reg) shifted,
                v = in(ymm_reg) v,
                k = in(ymm_reg) _mm256_set1_epi16(1 << 12),
                options(pure, nomem, nostack, preserves_flags)
            );
        }
        _mm256_and_si256(shifted, _mm256_set1_epi8(0x0F))
    }
}

/// Run `$kernel::<.., N>` (N = the tile size, 1..=4) on every row of a group.
macro_rules! tile {
    ($kernel:ident $(, $c:expr)*; $rows:expr, $rb:expr, $acts:expr, $out:expr) => {{
        let (rows, rb, acts, out) = ($rows, $rb, $acts, $out);
        // SAFETY: the caller (dispatch) checked the host supports this module's
        // features, and `checked` verified every slice the kernel indexes.
        unsafe {
            match acts.len() {
                1 => for (row, o) in rows.chunks_exact(rb).zip(out.chunks_exact_mut(1)) {
                    $kernel::<$($c,)* 1>(row, acts, o)
                },
                2 => for (row, o) in rows.chunks_exact(rb).zip(out.chunks_exact_mut(2)) {
                    $kernel::<$($c,)* 2>(row, acts, o)
                },
                3 => for (row, o) in rows.chunks_exact(rb).zip(out.chunks_exact_mut(3)) {
                    $kernel::<$($c,)* 3>(row, acts, o)
                },
                _ => for (row, o) in rows.chunks_exact(rb).zip(out.chunks_exact_mut(4)) {
                    $kernel::<$($c,)* 4>(row, acts, o)
                },
            }
        }
    }};
}

/// [`tile!`] that also takes tiles of exactly 8 tokens (for the legacy formats, whose float
/// order does not depend on the tile: one block unpack shared by 8 tokens).
macro_rules! tile_wide {
    ($kernel:ident $(, $c:expr)*; $rows:expr, $rb:expr, $acts:expr, $out:expr) => {{
        let (rows, rb, acts, out) = ($rows, $rb, $acts, $out);
        if acts.len() == 8 {
            // SAFETY: the caller (dispatch) checked the host supports this module's
            // features, and `checked` verified every slice the kernel indexes.
            unsafe {
                for (row, o) in rows.chunks_exact(rb).zip(out.chunks_exact_mut(8)) {
                    $kernel::<$($c,)* 8>(row, acts, o)
                }
            }
        } else {
            tile!($kernel $(, $c)*; rows, rb, acts, out)
        }
    }};
}

/// One x86 level: the shared per-level helpers below and every family's kernels
/// (`legacy_kernels!` in `x86_legacy.rs`, `kquant_kernels!` in `x86_kquants.rs`,
/// `float_kernels!` in `x86_float.rs`), all compiled with `$features`.
macro_rules! x86_level {
    ($level:ident, $features:literal, $mul_sum:path, $zmm:literal) => {
        /// Kernels compiled for one x86 feature set.
        pub(crate) mod $level {
            use std::arch::x86_64::*;

            use flatrun_dequant::BlockFormat;
            use flatrun_dequant::iq_grids::KVALUES_IQ4NL;
            use flatrun_dequant::{BlockIq4Nl, BlockIq4Xs, BlockMxfp4, BlockQ1_0, BlockQ2K, BlockQ3K, BlockQ4_0, BlockQ4_1, BlockQ4K, BlockQ5_0, BlockQ5_1, BlockQ5K, BlockQ6K, BlockQ8_0};
            use flatrun_format::GgmlType;

            use super::{hsum, hsum128};
            use crate::native::quantize::{BlockQ8, BlockQ8K};

            /// The two little-endian f16 values at `p` and `p + 2` as f32 (4 bytes read).
            /// A zero-extending 32-bit load: converting from a 16-bit insert instead would
            /// merge into (and wait for) whatever register LLVM picks, often an accumulator.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn f16_pair(p: *const u8) -> (f32, f32) {
                // SAFETY: the caller upholds the module's contract (see `x86.rs`): the CPU has
                // this level's features, and every pointer read below lies inside the caller's
                // rows (whole blocks), its activation rows, or this function's own buffers.
                unsafe {
                    let bits = u32::from_le_bytes([*p, *p.add(1), *p.add(2), *p.add(3)]);
                    let v: __m128i;
                    // `vmovd` only moves a general register into a vector register
                    // (zeroing the rest); it touches no memory. Written as asm so LLVM cannot
                    // narrow it into an insert that depends on the register's old contents.
                    std::arch::asm!(
                        "vmovd {v}, {b:e}",
                        v = lateout(xmm_reg) v,
                        b = in(reg) bits,
                        options(pure, nomem, nostack, preserves_flags)
                    );
                    let f = _mm_cvtph_ps(v);
                    (_mm_cvtss_f32(f), _mm_cvtss_f32(_mm_movehdup_ps(f)))
                }
            }

            /// The f16 at `p` (reads `p .. p + 4`: only for scales not at the end of a block).
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn f16_at(p: *const u8) -> f32 {
                // SAFETY: the caller upholds the module's contract (see `x86.rs`): the CPU has
                // this level's features, and every pointer read below lies inside the caller's
                // rows (whole blocks), its activation rows, or this function's own buffers.
                unsafe {
                    f16_pair(p).0
                }
            }

            /// 16 bytes of nibbles → 32 bytes: low nibbles first, then high nibbles.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn nibbles(p: *const u8) -> __m256i {
                // SAFETY: the caller upholds the module's contract (see `x86.rs`): the CPU has
                // this level's features, and every pointer read below lies inside the caller's
                // rows (whole blocks), its activation rows, or this function's own buffers.
                unsafe {
                    let t = _mm_loadu_si128(p as *const __m128i);
                    let b = _mm256_set_m128i(_mm_srli_epi16(t, 4), t);
                    _mm256_and_si256(b, _mm256_set1_epi8(0x0F))
                }
            }

            /// The 16 MXFP4 levels (E2M1 doubled) in both lanes, for `shuffle_epi8` lookups.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn fp4_table() -> __m256i {
                // SAFETY: the load reads the table's 16 bytes, and the CPU has this level's
                // features (the caller's promise, the module's contract).
                unsafe {
                    let t = _mm_loadu_si128(flatrun_dequant::iq_grids::KVALUES_FP4.as_ptr() as *const __m128i);
                    _mm256_set_m128i(t, t)
                }
            }

            /// The 16 IQ4_NL levels in both lanes, for `shuffle_epi8` lookups.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn iq4nl_table() -> __m256i {
                // SAFETY: the load reads the table's 16 bytes, and the CPU has this level's
                // features (the caller's promise, the module's contract).
                unsafe {
                    let t = _mm_loadu_si128(KVALUES_IQ4NL.as_ptr() as *const __m128i);
                    _mm256_set_m128i(t, t)
                }
            }

            /// Whether a call is well formed: whole rows of whole blocks, 1..=4 tokens (or
            /// exactly `wide_tile`), room for every output, every activation row long enough.
            #[inline]
            fn checked<A>(
                rows: &[u8],
                rb: usize,
                ts: usize,
                acts_per_block: usize,
                acts: &[&[A]],
                out: &[f32],
                wide_tile: usize,
            ) -> bool {
                let need = rb / ts.max(1) * acts_per_block;
                rb > 0
                    && rb % ts == 0
                    && rows.len() % rb == 0
                    && ((1..=4).contains(&acts.len()) || acts.len() == wide_tile)
                    && out.len() >= rows.len() / rb * acts.len()
                    && acts.iter().all(|a| a.len() >= need)
            }

            legacy_kernels!($features, $mul_sum);
            kquant_kernels!($features, $zmm);
            float_kernels!($features);
        }
    };
}

x86_level!(avx2, "avx2,fma,f16c", super::mul_sum_maddubs, false);
x86_level!(
    avx512,
    "avx2,fma,f16c,avx512f,avx512bw,avx512vl",
    super::mul_sum_maddubs,
    false
);
x86_level!(
    vnni,
    "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni",
    super::mul_sum_vnni,
    true
);
