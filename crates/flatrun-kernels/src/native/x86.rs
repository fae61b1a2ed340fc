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
/// 13–14.7 GB/s of plain reads (`docs/performance.md`, session 4).
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

/// One Q8 activation block as the one-token 4/5-bit legacy kernels read it
/// (`legacy_gemv_halves`), everything a block needs in two cache lines: its values, the offset
/// sums of Q4_0 already in both 128-bit lanes, and its `d` and `s` four times each (plain
/// loads where the loop used to broadcast).
#[repr(C, align(32))]
#[derive(Clone, Copy)]
pub(crate) struct HalvesAct {
    /// The block's 32 values.
    qs: [i8; 32],
    /// Q4_0: the offset 8 times each four values' sum, values 0..16 (four i32 lanes) in both
    /// lanes; unused for the other formats.
    off_lo: [i32; 8],
    /// The same for values 16..32.
    off_hi: [i32; 8],
    /// The block's scale `d`, four times.
    d: [f32; 4],
    /// The block's `s` (`d · Σ q`), four times.
    s: [f32; 4],
}

impl HalvesAct {
    const ZERO: HalvesAct = HalvesAct {
        qs: [0; 32],
        off_lo: [0; 8],
        off_hi: [0; 8],
        d: [0.0; 4],
        s: [0.0; 4],
    };
}

thread_local! {
    /// Per thread: the one-token activations as [`HalvesAct`] blocks, reused across calls.
    static HALVES_ACTS: std::cell::RefCell<Vec<HalvesAct>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// One Q8_K activation block (256 values) as the one-token IQ4_XS kernel reads it
/// (`iq4_xs_gemv_rows`): for each 32-value sub-block `ib`, rows `4·ib ..` hold `|a|` of values
/// 0..16, `|a|` of values 16..32, then `a` of values 0..16 and 16..32, each 16 bytes twice (both
/// 128-bit lanes), so the loop reads them with plain loads instead of broadcasts.
#[repr(C, align(32))]
#[derive(Clone, Copy)]
pub(crate) struct Iq4XsAct([[i8; 32]; 32]);

thread_local! {
    /// Per thread: the one-token activations as [`Iq4XsAct`] blocks, reused across calls.
    static IQ4_XS_ACTS: std::cell::RefCell<Vec<Iq4XsAct>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Horizontal sum of 8 floats in ggml's `hsum_float_8` order: lane k + lane k + 4, then
/// [`hsum128`]. (Shared, like the three helpers below, by every x86 kernel module: a
/// `target_feature` function inlines into callers whose features include its own.)
///
/// # Safety
/// The CPU must support AVX.
#[inline]
#[target_feature(enable = "avx")]
pub(crate) unsafe fn hsum(v: __m256) -> f32 {
    hsum128(_mm_add_ps(
        _mm256_castps256_ps128(v),
        _mm256_extractf128_ps(v, 1),
    ))
}

/// The last two steps of [`hsum`], on four floats: lane 0 + lane 2 and lane 1 + lane 3, then
/// their sum.
///
/// # Safety
/// The CPU must support AVX.
#[inline]
#[target_feature(enable = "avx")]
pub(crate) unsafe fn hsum128(v: __m128) -> f32 {
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
    let first = _mm256_loadu_si256(p0 as *const __m256i);
    let second = _mm256_loadu_si256(p1.sub(16) as *const __m256i);
    _mm256_blend_epi32(first, second, 0xF0)
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

/// One token over a group of legacy-format rows: two rows at a time, through
/// `legacy_gemv_halves` (4/5-bit formats) or `legacy_gemv2` (Q8_0), an odd last row through
/// `legacy_n::<.., 1>`; otherwise the token tiles of [`tile!`].
macro_rules! legacy_rows {
    ($t:expr, $ts:expr; $rows:expr, $rb:expr, $acts:expr, $out:expr) => {{
        let (rows, rb, acts, out) = ($rows, $rb, $acts, $out);
        if acts.len() == 1 && $t != GgmlType::Q8_0 as u32 {
            // SAFETY: the caller (dispatch) checked the host supports this module's
            // features, and `checked` verified every slice the kernel indexes.
            unsafe { legacy_gemv_halves::<$t, $ts>(rows, rb, acts[0], out) }
        } else if acts.len() == 1 {
            let n = rows.len() / rb;
            // SAFETY: as above.
            unsafe {
                for (pair, o) in rows.chunks_exact(2 * rb).zip(out.chunks_exact_mut(2)) {
                    legacy_gemv2::<$t, $ts>(&pair[..rb], &pair[rb..], acts[0], o);
                }
                if n % 2 == 1 {
                    legacy_n::<$t, $ts, 1>(&rows[(n - 1) * rb..], acts, &mut out[n - 1..n]);
                }
            }
        } else {
            tile_wide!(legacy_n, $t, $ts; rows, rb, acts, out)
        }
    }};
}

/// One token over a group of plain-float rows: two rows per `float_gemv2` call (an odd last
/// row through `float_n::<.., 1>`); otherwise the token tiles of [`tile!`].
macro_rules! float_rows {
    ($t:expr, $es:expr; $rows:expr, $rb:expr, $acts:expr, $out:expr) => {{
        let (rows, rb, acts, out) = ($rows, $rb, $acts, $out);
        if acts.len() == 1 {
            let n = rows.len() / rb;
            // SAFETY: the caller (dispatch) checked the host supports this module's
            // features, and `checked` verified every slice the kernel indexes.
            unsafe {
                for (pair, o) in rows.chunks_exact(2 * rb).zip(out.chunks_exact_mut(2)) {
                    float_gemv2::<$t, $es>(&pair[..rb], &pair[rb..], acts[0], o);
                }
                if n % 2 == 1 {
                    float_n::<$t, $es, 1>(&rows[(n - 1) * rb..], acts, &mut out[n - 1..n]);
                }
            }
        } else {
            tile!(float_n, $t, $es; rows, rb, acts, out)
        }
    }};
}

macro_rules! x86_kernels {
    ($level:ident, $features:literal, $mul_sum:path) => {
        /// Kernels compiled for one x86 feature set.
        pub(crate) mod $level {
            use std::arch::x86_64::*;

            use flatrun_format::GgmlType;

            use super::{hsum, hsum128};
            use crate::decode::IQ4NL_LEVELS;
            use crate::native::quantize::{BlockQ8, BlockQ8K};

            /// The two little-endian f16 values at `p` and `p + 2` as f32 (4 bytes read).
            /// A zero-extending 32-bit load: converting from a 16-bit insert instead would
            /// merge into (and wait for) whatever register LLVM picks, often an accumulator.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn f16_pair(p: *const u8) -> (f32, f32) {
                let bits = u32::from_le_bytes([*p, *p.add(1), *p.add(2), *p.add(3)]);
                let v: __m128i;
                // SAFETY: `vmovd` only moves a general register into a vector register
                // (zeroing the rest); it touches no memory. Written as asm so LLVM cannot
                // narrow it into an insert that depends on the register's old contents.
                unsafe {
                    std::arch::asm!(
                        "vmovd {v}, {b:e}",
                        v = lateout(xmm_reg) v,
                        b = in(reg) bits,
                        options(pure, nomem, nostack, preserves_flags)
                    );
                }
                let f = _mm_cvtph_ps(v);
                (_mm_cvtss_f32(f), _mm_cvtss_f32(_mm_movehdup_ps(f)))
            }

            /// The f16 at `p` (reads `p - 2 .. p + 2`: only for scales not at the start of a block).
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn f16_after(p: *const u8) -> f32 {
                f16_pair(p.sub(2)).1
            }

            /// The f16 at `p` (reads `p .. p + 4`: only for scales not at the end of a block).
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn f16_at(p: *const u8) -> f32 {
                f16_pair(p).0
            }

            /// 16 bytes of nibbles → 32 bytes: low nibbles first, then high nibbles.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn nibbles(p: *const u8) -> __m256i {
                let t = _mm_loadu_si128(p as *const __m128i);
                let b = _mm256_set_m128i(_mm_srli_epi16(t, 4), t);
                _mm256_and_si256(b, _mm256_set1_epi8(0x0F))
            }

            /// 32 bits at `p` → 32 bytes, 0xFF where the bit is set.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn bits_to_bytes(p: *const u8) -> __m256i {
                let x = i32::from_le_bytes([*p, *p.add(1), *p.add(2), *p.add(3)]);
                let shuf = _mm256_set_epi64x(
                    0x0303030303030303,
                    0x0202020202020202,
                    0x0101010101010101,
                    0,
                );
                let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(x), shuf);
                let bit = _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe);
                _mm256_cmpeq_epi8(_mm256_or_si256(bytes, bit), _mm256_set1_epi64x(-1))
            }

            /// The 16 IQ4_NL levels in both lanes, for `shuffle_epi8` lookups.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn iq4nl_table() -> __m256i {
                let t = _mm_loadu_si128(IQ4NL_LEVELS.as_ptr() as *const __m128i);
                _mm256_set_m128i(t, t)
            }

            /// Two i16 scales: `lo` for the first 16 bytes of a 32-byte vector, `hi` for the rest.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn scales16(lo: i32, hi: i32) -> __m256i {
                _mm256_set_m128i(_mm_set1_epi16(hi as i16), _mm_set1_epi16(lo as i16))
            }

            /// 32 weights of one legacy block as bytes (`i8`, or `u8` for the formats with a min),
            /// with the block's scale and min.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn legacy_block<const T: u32>(b: *const u8, table: __m256i) -> (__m256i, f32, f32) {
                const Q4_0: u32 = GgmlType::Q4_0 as u32;
                const Q4_1: u32 = GgmlType::Q4_1 as u32;
                const Q5_0: u32 = GgmlType::Q5_0 as u32;
                const Q5_1: u32 = GgmlType::Q5_1 as u32;
                const Q8_0: u32 = GgmlType::Q8_0 as u32;
                const IQ4_NL: u32 = GgmlType::IQ4_NL as u32;
                match T {
                    Q4_0 => (_mm256_sub_epi8(nibbles(b.add(2)), _mm256_set1_epi8(8)), f16_at(b), 0.0),
                    Q4_1 => {
                        let (d, m) = f16_pair(b);
                        (nibbles(b.add(4)), d, m)
                    }
                    Q5_0 => {
                        // Missing fifth bit ⇒ value − 16, i.e. the high nibble 0xF0 in two's complement.
                        let hi = _mm256_andnot_si256(bits_to_bytes(b.add(2)), _mm256_set1_epi8(0xF0u8 as i8));
                        (_mm256_or_si256(nibbles(b.add(6)), hi), f16_at(b), 0.0)
                    }
                    Q5_1 => {
                        let hi = _mm256_and_si256(bits_to_bytes(b.add(4)), _mm256_set1_epi8(0x10));
                        let (d, m) = f16_pair(b);
                        (_mm256_or_si256(nibbles(b.add(8)), hi), d, m)
                    }
                    Q8_0 => (_mm256_loadu_si256(b.add(2) as *const __m256i), f16_at(b), 0.0),
                    IQ4_NL => (_mm256_shuffle_epi8(table, nibbles(b.add(2))), f16_at(b), 0.0),
                    _ => (_mm256_setzero_si256(), 0.0, 0.0),
                }
            }

            /// One token × two rows of legacy format `T` (32-value blocks of `TS` bytes). Each row
            /// is ggml's single chain `acc = fma(d_w·d_a, Σ q_w·q_a, acc)`, then `hsum(acc) + Σ m·s`
            /// (the mins also by FMA, as GCC compiles `summs += m·s`), bit for bit
            /// `ggml_vec_dot_*_q8_*`; the two independent rows hide the FMA latency of one chain.
            #[target_feature(enable = $features)]
            unsafe fn legacy_gemv2<const T: u32, const TS: usize>(r0: &[u8], r1: &[u8], a: &[BlockQ8], out: &mut [f32]) {
                let unsigned = T == GgmlType::Q4_1 as u32 || T == GgmlType::Q5_1 as u32;
                let table = iq4nl_table();
                let nb = r0.len() / TS;
                let (mut acc0, mut acc1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
                let (mut min0, mut min1) = (0f32, 0f32);
                for i in 0..nb {
                    // The two rows are adjacent in memory: ask for the bytes `PREFETCH_AHEAD`
                    // past this pair's progress through them, one linear stream (a hint only:
                    // it never faults, and changes no value).
                    super::prefetch_linear(r0.as_ptr().wrapping_add(2 * i * TS), 2 * TS);
                    let ab = a.get_unchecked(i);
                    let ay = _mm256_loadu_si256(ab.qs.as_ptr() as *const __m256i);
                    let (q0, d0, m0) = legacy_block::<T>(r0.as_ptr().add(i * TS), table);
                    let (q1, d1, m1) = legacy_block::<T>(r1.as_ptr().add(i * TS), table);
                    let (p0, p1) = if unsigned {
                        ($mul_sum(q0, ay), $mul_sum(q1, ay))
                    } else {
                        (
                            $mul_sum(_mm256_sign_epi8(q0, q0), _mm256_sign_epi8(ay, q0)),
                            $mul_sum(_mm256_sign_epi8(q1, q1), _mm256_sign_epi8(ay, q1)),
                        )
                    };
                    acc0 = _mm256_fmadd_ps(_mm256_set1_ps(d0 * ab.d), _mm256_cvtepi32_ps(p0), acc0);
                    acc1 = _mm256_fmadd_ps(_mm256_set1_ps(d1 * ab.d), _mm256_cvtepi32_ps(p1), acc1);
                    if unsigned {
                        min0 = m0.mul_add(ab.s, min0);
                        min1 = m1.mul_add(ab.s, min1);
                    }
                }
                out[0] = hsum(acc0) + min0;
                out[1] = hsum(acc1) + min1;
            }

            /// The same block of two rows (`b0`, `b1`) of a 4/5-bit legacy format as two vectors
            /// in "halves" layout: `lo` = [row 0 values 0..16 | row 1 values 0..16], `hi` = [row 0
            /// values 16..32 | row 1 values 16..32] (the low and the high nibbles of each row's
            /// 16 bytes), as `u8` for Q4_0/Q4_1/Q5_1 (Q4_0 without its −8 offset), as `i8` for
            /// Q5_0 (its values − 16: a missing fifth bit sets the high nibble) and as the signed
            /// levels for IQ4_NL. The 5-bit formats also give `head`: the first 16 bytes of each
            /// row's block (row 0 in the low lane), which hold its `d` (and `m`) and `qh`.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn halves_block<const T: u32>(b0: *const u8, b1: *const u8, table: __m256i) -> (__m256i, __m256i, __m256i) {
                const Q4_1: u32 = GgmlType::Q4_1 as u32;
                const Q5_0: u32 = GgmlType::Q5_0 as u32;
                const Q5_1: u32 = GgmlType::Q5_1 as u32;
                const IQ4_NL: u32 = GgmlType::IQ4_NL as u32;
                let qs = match T {
                    Q4_1 => 4,
                    Q5_0 => 6,
                    Q5_1 => 8,
                    _ => 2,
                };
                // (`b1` is a later row of the caller's slice than `b0`: see `pair_halves`.)
                let five = T == Q5_0 || T == Q5_1;
                let v = if five {
                    _mm256_set_m128i(_mm_loadu_si128(b1.add(qs) as *const __m128i), _mm_loadu_si128(b0.add(qs) as *const __m128i))
                } else {
                    super::pair_halves(b0.add(qs), b1.add(qs))
                };
                let m4 = _mm256_set1_epi8(0x0F);
                let hi = if five { _mm256_and_si256(_mm256_srli_epi16(v, 4), m4) } else { super::high_nibbles(v) };
                let (mut lo, mut hi) = (_mm256_and_si256(v, m4), hi);
                let mut head = _mm256_setzero_si256();
                if T == Q5_0 || T == Q5_1 {
                    // The fifth bits: bit j of a block's 32-bit `qh` (at byte `h` of the block)
                    // belongs to value j. From each row's first 16 bytes (row 0 in the low lane),
                    // `vpshufb` spreads qh bytes 0–1 (values 0..16) or 2–3 (values 16..32) over the
                    // row's lane, 8 bytes each, and each byte keeps its own bit (as
                    // `bits_to_bytes`). One load per row for the scale and the fifth bits (and
                    // not two) measured 0.97–0.99× the time for Q5_0, 0.95–0.98× for Q5_1.
                    head = _mm256_set_m128i(_mm_loadu_si128(b1 as *const __m128i), _mm_loadu_si128(b0 as *const __m128i));
                    let h = if T == Q5_0 { 0x0202_0202_0202_0202i64 } else { 0x0404_0404_0404_0404 };
                    let bit = _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe);
                    let fifth = _mm256_set1_epi8(0x10);
                    let spread = |pick: __m256i| {
                        let set = _mm256_cmpeq_epi8(_mm256_or_si256(_mm256_shuffle_epi8(head, pick), bit), _mm256_set1_epi64x(-1));
                        if T == Q5_0 {
                            // Q5_0's value − 16: 0xF0 (−16 in two's complement) where the bit is clear.
                            _mm256_andnot_si256(set, _mm256_set1_epi8(0xF0u8 as i8))
                        } else {
                            _mm256_and_si256(set, fifth)
                        }
                    };
                    let (first, second) = (0x0101_0101_0101_0101i64, 0x0202_0202_0202_0202i64);
                    lo = _mm256_or_si256(lo, spread(_mm256_set_epi64x(first + h, h, first + h, h)));
                    hi = _mm256_or_si256(hi, spread(_mm256_set_epi64x(second + first + h, second + h, second + first + h, second + h)));
                }
                if T == IQ4_NL {
                    lo = _mm256_shuffle_epi8(table, lo);
                    hi = _mm256_shuffle_epi8(table, hi);
                }
                (lo, hi, head)
            }

            /// One token × every row of a group of a 4/5-bit legacy format (Q4_0, Q4_1, Q5_0,
            /// Q5_1, IQ4_NL), two adjacent rows at a time in the "halves" layout of
            /// [`halves_block`]: one nibble unpack, one scale conversion and one pair of FMAs serve
            /// both rows. Each output is still ggml's sum (see [`legacy_gemv2`]): lane `k` of
            /// accumulator `lo` holds row 0's lane `k` (k < 4) or row 1's lane `k − 4`, `hi` the
            /// lanes 4..8, each `fma(d_w·d_a, Σ q_w·q_a, ·)` over the same four values in the same
            /// block order, and `hsum` starts by adding lane `k` to lane `k + 4` — so adding the
            /// two halves of a row is that first step. Q4_0 dots its values unsigned and takes
            /// `8·Σa` (per four values, computed once per call) off the exact integer sum instead
            /// of the sign trick; Q5_0 and IQ4_NL dot their signed values as `|a|·(q·sgn a)`. The
            /// 4-bit formats take two pairs per pass ([`halves_pair_runs`]), then a last pair; an
            /// odd last row goes through `legacy_n`.
            #[target_feature(enable = $features)]
            unsafe fn legacy_gemv_halves<const T: u32, const TS: usize>(rows: &[u8], rb: usize, a: &[BlockQ8], out: &mut [f32]) {
                const Q5_0: u32 = GgmlType::Q5_0 as u32;
                let n = rows.len() / rb;
                let nb = rb / TS;
                let offset: i8 = if T == GgmlType::Q4_0 as u32 { 8 } else { 0 };
                // The activations once per call as the loop reads them; the offset sums exact
                // (at most 8 · 4 · 127).
                let mut prep = super::HALVES_ACTS.with(|c| c.take());
                prep.clear();
                prep.resize(nb, super::HalvesAct::ZERO);
                let off = _mm256_set1_epi8(offset);
                for (p, ab) in prep.iter_mut().zip(&a[..nb]) {
                    let ay = _mm256_loadu_si256(ab.qs.as_ptr() as *const __m256i);
                    _mm256_store_si256(p.qs.as_mut_ptr() as *mut __m256i, ay);
                    if offset != 0 {
                        let o = $mul_sum(off, ay);
                        _mm256_store_si256(p.off_lo.as_mut_ptr() as *mut __m256i, _mm256_permute2x128_si256(o, o, 0x00));
                        _mm256_store_si256(p.off_hi.as_mut_ptr() as *mut __m256i, _mm256_permute2x128_si256(o, o, 0x11));
                    }
                    p.d = [ab.d; 4];
                    p.s = [ab.s; 4];
                }
                let n_pairs = n / 2;
                // Two pairs per pass, but for the 5-bit formats, whose fifth-bit constants
                // would not fit in registers beside a second pair's accumulators.
                let bulk = if T == Q5_0 || T == GgmlType::Q5_1 as u32 { 0 } else { n_pairs / 2 * 2 };
                halves_pair_runs::<T, TS, 2>(rows.as_ptr(), rb, &prep, 0..bulk, out);
                halves_pair_runs::<T, TS, 1>(rows.as_ptr(), rb, &prep, bulk..n_pairs, out);
                super::HALVES_ACTS.with(|c| c.replace(prep));
                if n % 2 == 1 {
                    legacy_n::<T, TS, 1>(&rows[(n - 1) * rb..], &[a], &mut out[n - 1..n]);
                }
            }

            /// Row pairs `pairs` (a multiple of `P` of them) of [`legacy_gemv_halves`], `P`
            /// adjacent pairs per pass: the activation loads and the prefetch stream serve all
            /// `2P` rows. `a` is the token's activations prepared once per call
            /// ([`super::HalvesAct`]: halves already in both lanes, offset sums, `d` and `s`).
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn halves_pair_runs<const T: u32, const TS: usize, const P: usize>(
                rows: *const u8,
                rb: usize,
                a: &[super::HalvesAct],
                pairs: std::ops::Range<usize>,
                out: &mut [f32],
            ) {
                const Q4_0: u32 = GgmlType::Q4_0 as u32;
                const Q4_1: u32 = GgmlType::Q4_1 as u32;
                const Q5_0: u32 = GgmlType::Q5_0 as u32;
                const Q5_1: u32 = GgmlType::Q5_1 as u32;
                const IQ4_NL: u32 = GgmlType::IQ4_NL as u32;
                let nb = rb / TS;
                let with_min = T == Q4_1 || T == Q5_1;
                let offset = T == Q4_0;
                let table = iq4nl_table();
                for first in pairs.step_by(P) {
                    let r0 = rows.add(2 * first * rb);
                    let mut acc_lo = [_mm256_setzero_ps(); P];
                    let mut acc_hi = [_mm256_setzero_ps(); P];
                    // Lanes 1 and 5: the min sums of the pair's rows 0 and 1 (see below).
                    let mut mins = [_mm256_setzero_ps(); P];
                    for i in 0..nb {
                        // One linear prefetch stream over the pass's rows (see `legacy_gemv2`).
                        super::prefetch_linear(r0.wrapping_add(2 * P * i * TS), 2 * P * TS);
                        let ab = a.get_unchecked(i);
                        // (Broadcast loads: measured no slower than stored copies in both lanes,
                        // and faster for the 5-bit formats.)
                        let ay_lo = _mm256_broadcastsi128_si256(_mm_load_si128(ab.qs.as_ptr() as *const __m128i));
                        let ay_hi = _mm256_broadcastsi128_si256(_mm_load_si128(ab.qs.as_ptr().add(16) as *const __m128i));
                        let da = _mm_load_ps(ab.d.as_ptr());
                        // Two pairs without mins: the four rows' f16 scales in one 64-bit move, one
                        // conversion and one multiply, `[d0·d_a ×4 | d1·d_a ×4]` and `[d2·d_a ×4 |
                        // d3·d_a ×4]` by two lane permutes (the same f32 products as ggml's).
                        let four_rows = P == 2 && !with_min;
                        let mut dd4 = [_mm256_setzero_ps(); P];
                        if four_rows {
                            let word = |k: usize| {
                                let p = r0.add(k * rb + i * TS);
                                u16::from_le_bytes([*p, *p.add(1)]) as u64
                            };
                            let bits = word(0) | word(1) << 16 | word(2) << 32 | word(3) << 48;
                            // SAFETY: this module's functions run with AVX2 (see `vmovq_to_xmm`).
                            let d4 = _mm_cvtph_ps(unsafe { super::vmovq_to_xmm(bits) });
                            let scaled = _mm256_castps128_ps256(_mm_mul_ps(d4, da));
                            dd4[0] = _mm256_permutevar8x32_ps(scaled, _mm256_set_epi32(1, 1, 1, 1, 0, 0, 0, 0));
                            dd4[P - 1] = _mm256_permutevar8x32_ps(scaled, _mm256_set_epi32(3, 3, 3, 3, 2, 2, 2, 2));
                        }
                        for q in 0..P {
                            let b0 = r0.add(2 * q * rb + i * TS);
                            let (lo, hi, head) = halves_block::<T>(b0, b0.add(rb), table);
                            let (mut p_lo, mut p_hi) = if T == Q5_0 || T == IQ4_NL {
                                // Signed values × signed activations as `|a|·(q·sgn a)`, one sign op
                                // per vector (the exact products of ggml's `|q|·(a·sgn q)`), `|a|`
                                // by `vpabsb` on the loaded activations. For Q5_0 this measured
                                // 0.81–0.91× the time, streamed, of unsigned values with `16·Σa`
                                // loaded and taken off (one load fewer per vector), though 1.05×
                                // when the rows sit in L2.
                                let (abs_lo, abs_hi) = (_mm256_abs_epi8(ay_lo), _mm256_abs_epi8(ay_hi));
                                ($mul_sum(abs_lo, _mm256_sign_epi8(lo, ay_lo)), $mul_sum(abs_hi, _mm256_sign_epi8(hi, ay_hi)))
                            } else {
                                ($mul_sum(lo, ay_lo), $mul_sum(hi, ay_hi))
                            };
                            if offset {
                                p_lo = _mm256_sub_epi32(p_lo, _mm256_load_si256(ab.off_lo.as_ptr() as *const __m256i));
                                p_hi = _mm256_sub_epi32(p_hi, _mm256_load_si256(ab.off_hi.as_ptr() as *const __m256i));
                            }
                            // [d0·d_a ×4 | d1·d_a ×4]: the same f32 products as ggml's `d_w * d_a`.
                            let dd = if four_rows {
                                dd4[q]
                            } else {
                                // The pair's f16 scales (and mins) converted in 8 lanes: `[d0 ×4 |
                                // d1 ×4]`, or with mins `[d0, m0, d0, m0 | d1, m1, d1, m1]`. The
                                // 5-bit formats permute them out of `head` (each row's first 32-bit
                                // word twice; Q5_0's second half of it is qh, dropped below), the
                                // others take two broadcast loads and a blend. (A shorter chain
                                // than building them in a general register: 0.96–0.99× the cycles
                                // for Q5_0, 0.89–0.98× for Q4_1's single pairs. `d` and `s` are
                                // 16-byte aligned in the 32-byte aligned `HalvesAct`.)
                                let b1 = b0.add(rb);
                                let five = T == Q5_0 || T == Q5_1;
                                let halves = if five {
                                    let words = _mm256_set_epi32(4, 4, 0, 0, 4, 4, 0, 0);
                                    _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(head, words))
                                } else if with_min {
                                    let word = |p: *const u8| i32::from_le_bytes([*p, *p.add(1), *p.add(2), *p.add(3)]);
                                    _mm_blend_epi32::<0b1100>(_mm_set1_epi32(word(b0)), _mm_set1_epi32(word(b1)))
                                } else {
                                    let half = |p: *const u8| i16::from_le_bytes([*p, *p.add(1)]);
                                    _mm_blend_epi32::<0b1100>(_mm_set1_epi16(half(b0)), _mm_set1_epi16(half(b1)))
                                };
                                let dm = _mm256_cvtph_ps(halves);
                                if with_min {
                                    // Lanes 1 and 5: `m·s` fused into each row's min sum, as ggml's `summs`.
                                    mins[q] = _mm256_fmadd_ps(dm, _mm256_broadcast_ps(&*(ab.s.as_ptr() as *const __m128)), mins[q]);
                                }
                                let d = if with_min || T == Q5_0 { _mm256_moveldup_ps(dm) } else { dm };
                                _mm256_mul_ps(d, _mm256_broadcast_ps(&*(ab.d.as_ptr() as *const __m128)))
                            };
                            acc_lo[q] = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(p_lo), acc_lo[q]);
                            acc_hi[q] = _mm256_fmadd_ps(dd, _mm256_cvtepi32_ps(p_hi), acc_hi[q]);
                        }
                    }
                    for q in 0..P {
                        let (lo, hi, m) = (acc_lo[q], acc_hi[q], mins[q]);
                        let row0 = _mm_add_ps(_mm256_castps256_ps128(lo), _mm256_castps256_ps128(hi));
                        let row1 = _mm_add_ps(_mm256_extractf128_ps(lo, 1), _mm256_extractf128_ps(hi, 1));
                        let (min0, min1) = if with_min {
                            let lane1 = |v: __m128| _mm_cvtss_f32(_mm_movehdup_ps(v));
                            (lane1(_mm256_castps256_ps128(m)), lane1(_mm256_extractf128_ps(m, 1)))
                        } else {
                            (0.0, 0.0)
                        };
                        let o = 2 * (first + q);
                        *out.get_unchecked_mut(o) = hsum128(row0) + min0;
                        *out.get_unchecked_mut(o + 1) = hsum128(row1) + min1;
                    }
                }
            }

            /// Legacy format `T` (32-value blocks of `TS` bytes) × a tile of `N` Q8 token rows.
            #[target_feature(enable = $features)]
            unsafe fn legacy_n<const T: u32, const TS: usize, const N: usize>(
                row: &[u8],
                acts: &[&[BlockQ8]],
                out: &mut [f32],
            ) {
                // Formats with a min store unsigned values: no sign trick needed.
                let unsigned = T == GgmlType::Q4_1 as u32 || T == GgmlType::Q5_1 as u32;
                let table = iq4nl_table();
                let nb = row.len() / TS;
                let mut acc = [_mm256_setzero_ps(); N];
                let mut mins = [0f32; N];
                for i in 0..nb {
                    // Unpack the block once…
                    let (qx, dw, mw) = legacy_block::<T>(row.as_ptr().add(i * TS), table);
                    let ax = if unsigned { qx } else { _mm256_sign_epi8(qx, qx) };
                    // …and dot it with every token of the tile.
                    for t in 0..N {
                        let a = acts.get_unchecked(t).get_unchecked(i);
                        let ay = _mm256_loadu_si256(a.qs.as_ptr() as *const __m256i);
                        let sy = if unsigned { ay } else { _mm256_sign_epi8(ay, qx) };
                        let p = _mm256_cvtepi32_ps($mul_sum(ax, sy));
                        acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(dw * a.d), p, acc[t]);
                        if unsigned {
                            // ggml's `summs += m·s` is compiled to one FMA.
                            mins[t] = mw.mul_add(a.s, mins[t]);
                        }
                    }
                }
                for t in 0..N {
                    out[t] = hsum(acc[t]) + mins[t];
                }
            }

            /// Q1_0 (128 sign bits per block, one scale) × a tile of `N` Q8 token rows, in the
            /// float order of ggml's AVX2 `ggml_vec_dot_q1_0_q8_0` (llama.cpp 0.3.36, which has no
            /// other x86 path and repacks Q1_0 only on Arm): per 128-value block, the four Q8
            /// sub-blocks' lane sums `c_k` (eight i32 lanes of four values each) are chained as
            /// `blk = d_a0·c_0`, `blk = fma(d_ak, c_k, blk)` for k = 1, 2, 3, then
            /// `acc = fma(d_w, blk, acc)`; `hsum(acc)` at the end (`tests/q1_0_order.rs`).
            /// Each `d_a·c` is exact (an f16 scale times an integer below 2^10), so what this
            /// fixes is how the sums associate: one FMA per 32 values into a single
            /// accumulator, as this kernel did before, moved Bonsai's logits by up to 0.15.
            #[target_feature(enable = $features)]
            unsafe fn q1_0_n<const N: usize>(row: &[u8], acts: &[&[BlockQ8]], out: &mut [f32]) {
                let nb = row.len() / 18;
                let ones = _mm256_set1_epi8(1);
                let mut acc = [_mm256_setzero_ps(); N];
                for i in 0..nb {
                    let b = row.as_ptr().add(i * 18);
                    let mut blk = [_mm256_setzero_ps(); N];
                    for sub in 0..4 {
                        // ±1 per bit: 0xFF&2 − 1 = +1, 0 − 1 = −1.
                        let mask = bits_to_bytes(b.add(2 + 4 * sub));
                        let w = _mm256_sub_epi8(_mm256_and_si256(mask, _mm256_set1_epi8(2)), ones);
                        for t in 0..N {
                            let a = acts.get_unchecked(t).get_unchecked(4 * i + sub);
                            let ay = _mm256_loadu_si256(a.qs.as_ptr() as *const __m256i);
                            let c = _mm256_cvtepi32_ps($mul_sum(ones, _mm256_sign_epi8(ay, w)));
                            let da = _mm256_set1_ps(a.d);
                            blk[t] = if sub == 0 { _mm256_mul_ps(da, c) } else { _mm256_fmadd_ps(da, c, blk[t]) };
                        }
                    }
                    let d = _mm256_set1_ps(f16_at(b));
                    for t in 0..N {
                        acc[t] = _mm256_fmadd_ps(d, blk[t], acc[t]);
                    }
                }
                for t in 0..N {
                    out[t] = hsum(acc[t]);
                }
            }

            /// Most activation blocks (columns / 32) whose `Σ a` [`q1_0_gemv_rows`] keeps on the
            /// stack (32 KiB); wider rows compute it in the loop.
            const MAX_OFFSET_BLOCKS: usize = 1024;

            /// Rows per group of the one-token Q1_0 kernel [`q1_0_gemv_rows`] (at most 4: their
            /// f16 scales share one 64-bit move).
            const Q1_ROWS: usize = 4;
            const _: () = assert!(Q1_ROWS <= 4);

            /// `min(x, y)` of unsigned bytes, as asm: on the 0 / `2^m` bytes of [`q1_0_gemv_rows`]
            /// LLVM rewrites the intrinsic into `vpcmpeqb` + `vpand`, one instruction more.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn min_epu8(x: __m256i, y: __m256i) -> __m256i {
                let m: __m256i;
                // SAFETY: `vpminub` only reads and writes vector registers (AVX2, enabled here).
                unsafe {
                    std::arch::asm!(
                        "vpminub {m}, {x}, {y}",
                        m = lateout(ymm_reg) m,
                        x = in(ymm_reg) x,
                        y = in(ymm_reg) y,
                        options(pure, nomem, nostack, preserves_flags)
                    );
                }
                m
            }

            /// `vpshufb` as asm: LLVM would turn the in-lane shuffle of a 128-bit broadcast into
            /// a cross-lane `vpermq`/`vpbroadcastd` and another shuffle.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn shuffle_bytes(x: __m256i, pick: __m256i) -> __m256i {
                let y: __m256i;
                // SAFETY: `vpshufb` only reads and writes vector registers (AVX2, enabled here).
                unsafe {
                    std::arch::asm!(
                        "vpshufb {y}, {x}, {p}",
                        y = lateout(ymm_reg) y,
                        x = in(ymm_reg) x,
                        p = in(ymm_reg) pick,
                        options(pure, nomem, nostack, preserves_flags)
                    );
                }
                y
            }

            /// One token × every row of a group of Q1_0, [`Q1_ROWS`] adjacent rows at a time,
            /// each in [`q1_0_n`]'s float order, so every output is bit for bit that of
            /// `q1_0_n::<1>` (which takes the last `rows % Q1_ROWS`). The activations' loads and
            /// scale broadcasts serve every row of the group. Each lane integer (four values) is
            /// the same exact sum `Σ ±a`, computed as `2·Σ_{bit set} a − Σ a`: the bits become
            /// 0/1 bytes (one 16-byte load per row and block, in both lanes; for sub-block `s`
            /// `vpshufb` spreads bits byte `4s + j/8` to byte `j`, `and` keeps bit `j%8`, `min`
            /// with 1), `maddubs` and `madd` with 2 give `2·Σ_{set} a` per four values, and `Σ a`
            /// per four values comes from a table made once per call (computed in place for
            /// rows wider than the table). Eight vector instructions per row and 32 values, all
            /// four vector pipes of the development CPU (Zen 3) busy: it is compute-bound at
            /// about 10–11 cycles per 128-value block (see `docs/performance.md`).
            #[target_feature(enable = $features)]
            unsafe fn q1_0_gemv_rows(rows: &[u8], rb: usize, a: &[BlockQ8], out: &mut [f32]) {
                const R: usize = Q1_ROWS;
                let n = rows.len() / rb;
                let nb = rb / 18;
                let spread = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
                let bit = _mm256_set1_epi64x(0x8040201008040201u64 as i64);
                let ones = _mm256_set1_epi8(1);
                let (ones16, twos16) = (_mm256_set1_epi16(1), _mm256_set1_epi16(2));
                let lane_sums = |ab: &BlockQ8| {
                    let ay = _mm256_loadu_si256(ab.qs.as_ptr() as *const __m256i);
                    _mm256_madd_epi16(_mm256_maddubs_epi16(ones, ay), ones16)
                };
                // Σ a per four values of every activation block (exact: at most 4 · 127).
                let mut totals = [const { std::mem::MaybeUninit::<__m256i>::uninit() }; MAX_OFFSET_BLOCKS];
                let table = 4 * nb <= MAX_OFFSET_BLOCKS;
                if table {
                    for (slot, ab) in totals.iter_mut().zip(&a[..4 * nb]) {
                        slot.write(lane_sums(ab));
                    }
                }
                for (group, o) in rows.chunks_exact(R * rb).zip(out.chunks_exact_mut(R)) {
                    let base = group.as_ptr();
                    let mut acc = [_mm256_setzero_ps(); R];
                    for i in 0..nb {
                        // One linear prefetch stream over the rows (see `legacy_gemv2`).
                        super::prefetch_linear(base.wrapping_add(R * i * 18), R * 18);
                        let block = |r: usize| base.add(r * rb + i * 18);
                        // Each row's 128 bits in both lanes: one load serves its four sub-blocks.
                        let bits: [__m256i; R] = std::array::from_fn(|r| _mm256_broadcastsi128_si256(_mm_loadu_si128(block(r).add(2) as *const __m128i)));
                        let mut blk = [_mm256_setzero_ps(); R];
                        for sub in 0..4 {
                            let ab = a.get_unchecked(4 * i + sub);
                            let ay = _mm256_loadu_si256(ab.qs.as_ptr() as *const __m256i);
                            let total = if table { totals.get_unchecked(4 * i + sub).assume_init() } else { lane_sums(ab) };
                            let da = _mm256_set1_ps(ab.d);
                            // Bytes 4·sub, 4·sub + 1 of the bits to the low lane, 4·sub + 2, 4·sub + 3 to the high one.
                            let spread = _mm256_add_epi8(spread, _mm256_set1_epi8(4 * sub as i8));
                            for r in 0..R {
                                let spread_bits = shuffle_bytes(bits[r], spread);
                                let set = min_epu8(_mm256_and_si256(spread_bits, bit), ones);
                                // The lane sums of the ±1 weights: 2·Σ_{set} a − Σ a.
                                let twice_set = _mm256_madd_epi16(_mm256_maddubs_epi16(set, ay), twos16);
                                let c = _mm256_cvtepi32_ps(_mm256_sub_epi32(twice_set, total));
                                blk[r] = if sub == 0 { _mm256_mul_ps(da, c) } else { _mm256_fmadd_ps(da, c, blk[r]) };
                            }
                        }
                        // The rows' f16 scales in one zero-extending 64-bit move, converted at once.
                        let packed = (0..R).fold(0u64, |w, r| w | (u16::from_le_bytes([*block(r), *block(r).add(1)]) as u64) << (16 * r));
                        // SAFETY: this module's functions run with AVX2 (see `vmovq_to_xmm`).
                        let halves = unsafe { super::vmovq_to_xmm(packed) };
                        let mut d = [0f32; 4];
                        _mm_storeu_ps(d.as_mut_ptr(), _mm_cvtph_ps(halves));
                        for r in 0..R {
                            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d[r]), blk[r], acc[r]);
                        }
                    }
                    for r in 0..R {
                        o[r] = hsum(acc[r]);
                    }
                }
                for r in n / R * R..n {
                    q1_0_n::<1>(&rows[r * rb..(r + 1) * rb], &[a], &mut out[r..r + 1]);
                }
            }

            /// `Σ` over 16-byte halves: `madd(maddubs(q, a), scales)` as 8 i32 lanes.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn scaled_dot(q: __m256i, a: *const i8, sc: __m256i) -> __m256i {
                let a = _mm256_loadu_si256(a as *const __m256i);
                _mm256_madd_epi16(_mm256_maddubs_epi16(q, a), sc)
            }

            /// The eight 6-bit scales and mins of a Q4_K/Q5_K block (12 bytes at `p`), unpacked
            /// with whole-word masks: the scales as i16 in both 128-bit lanes (for `vpshufb`
            /// broadcasts), and the mins as eight i16.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn k4_scales_mins(p: *const u8) -> (__m256i, __m128i) {
                const LOW6: u32 = 0x3f3f_3f3f;
                const LOW4: u32 = 0x0f0f_0f0f;
                const TOP2: u32 = 0x0303_0303;
                let w = |k: usize| u32::from_le_bytes([*p.add(4 * k), *p.add(4 * k + 1), *p.add(4 * k + 2), *p.add(4 * k + 3)]);
                let (w0, w1, w2) = (w(0), w(1), w(2));
                // Scales/mins 0..4 are the low 6 bits of bytes 0..4 / 4..8; 4..8 take their low
                // 4 bits from the nibbles of bytes 8..12 and their top 2 bits from bits 6..8 of bytes 0..8.
                let sc_lo = w0 & LOW6;
                let sc_hi = (w2 & LOW4) | (((w0 >> 6) & TOP2) << 4);
                let mn_lo = w1 & LOW6;
                let mn_hi = ((w2 >> 4) & LOW4) | (((w1 >> 6) & TOP2) << 4);
                let both = _mm256_cvtepu8_epi16(_mm_set_epi32(mn_hi as i32, mn_lo as i32, sc_hi as i32, sc_lo as i32));
                (_mm256_permute2x128_si256(both, both, 0x00), _mm256_extracti128_si256(both, 1))
            }

            /// i16 scale `j` (0..8) of `scales` (as from [`k4_scales_mins`]) in every lane.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn k4_scale(scales: __m256i, j: usize) -> __m256i {
                _mm256_shuffle_epi8(scales, _mm256_set1_epi16((((2 * j + 1) << 8) | (2 * j)) as i16))
            }

            /// `Σ_j mins[j] · (bsums[2j] + bsums[2j+1])` as four i32 lanes.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn k4_min_products(mins: __m128i, a: &BlockQ8K) -> __m128i {
                let bs = _mm256_loadu_si256(a.bsums.as_ptr() as *const __m256i);
                let pairs = _mm_hadd_epi16(_mm256_castsi256_si128(bs), _mm256_extracti128_si256(bs, 1));
                _mm_madd_epi16(mins, pairs)
            }

            /// Horizontal sum of 8 i32 lanes (exact).
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn hsum_i32(v: __m256i) -> i32 {
                hsum128_i32(_mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)))
            }

            /// Horizontal sum of 4 i32 lanes (exact).
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn hsum128_i32(v: __m128i) -> i32 {
                let s = _mm_add_epi32(v, _mm_shuffle_epi32(v, 0b01_00_11_10));
                let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b10_11_00_01));
                _mm_cvtsi128_si32(s)
            }

            /// The lane sums of four 8-lane i32 vectors, as four i32 lanes `[Σv0, Σv1, Σv2, Σv3]` (exact).
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn hsum4_i32(v: [__m256i; 4]) -> __m128i {
                let h = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
                _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1))
            }

            /// One K-quant block's contribution in the float order of ggml's tiled K-quant matmul
            /// (`tiled/tiled-kernel.cpp`, which llama.cpp uses for calls of ≥ 8 tokens):
            /// `acc = fma(d_w·Σscale·q·a − dmin_w·Σmin·bsum, d_a, acc)`, the difference fused.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn tiled_step(acc: f32, isum: i32, imin: i32, d: f32, dmin: f32, da: f32) -> f32 {
                let res = d * isum as f32;
                (-dmin).mul_add(imin as f32, res).mul_add(da, acc)
            }

            /// Q4_K × a tile of `N` Q8_K token rows, in the float order of ggml's repacked Q4_K
            /// kernels (on AVX2 llama.cpp repacks Q4_K weights whose row count is a multiple of 8
            /// at load): a full tile of 4 tokens as `ggml_gemm_q4_K_8x8_q8_K`, one FMA per 64
            /// values into a scale and a min accumulator; fewer tokens as
            /// `ggml_gemv_q4_K_8x8_q8_K`, one FMA per 256 values. Output: scale sum − min sum.
            #[target_feature(enable = $features)]
            unsafe fn q4_k_n<const N: usize>(row: &[u8], acts: &[&[BlockQ8K]], out: &mut [f32]) {
                let nb = row.len() / 144;
                let m4 = _mm256_set1_epi8(0x0F);
                let mut acc = [0f32; N];
                let mut acc_m = [0f32; N];
                for i in 0..nb {
                    let b = row.as_ptr().add(i * 144);
                    let (d, dmin) = f16_pair(b);
                    let (scales, mins) = k4_scales_mins(b.add(4));
                    // Integer sums of each 64-value chunk, per token (8 lanes each).
                    let mut chunk = [[_mm256_setzero_si256(); 4]; N];
                    for c in 0..4 {
                        // 64 values: low nibbles (scale 2c), then high nibbles (scale 2c+1).
                        let q = _mm256_loadu_si256(b.add(16 + 32 * c) as *const __m256i);
                        let lo = _mm256_and_si256(q, m4);
                        let hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
                        let s_lo = k4_scale(scales, 2 * c);
                        let s_hi = k4_scale(scales, 2 * c + 1);
                        for t in 0..N {
                            let a = acts.get_unchecked(t).get_unchecked(i).qs.as_ptr().add(64 * c);
                            chunk[t][c] = _mm256_add_epi32(scaled_dot(lo, a, s_lo), scaled_dot(hi, a.add(32), s_hi));
                        }
                    }
                    for t in 0..N {
                        let a = acts.get_unchecked(t).get_unchecked(i);
                        let (dd, dm) = (d * a.d, dmin * a.d);
                        // The mins against the activations' group sums, one lane per 64-value chunk.
                        let mins4 = k4_min_products(mins, a);
                        if N == 4 {
                            let mut s = [0f32; 4];
                            let mut m = [0f32; 4];
                            _mm_storeu_ps(s.as_mut_ptr(), _mm_cvtepi32_ps(hsum4_i32(chunk[t])));
                            _mm_storeu_ps(m.as_mut_ptr(), _mm_cvtepi32_ps(mins4));
                            for c in 0..4 {
                                acc[t] = s[c].mul_add(dd, acc[t]);
                                acc_m[t] = m[c].mul_add(dm, acc_m[t]);
                            }
                        } else {
                            let c = &chunk[t];
                            let all = _mm256_add_epi32(_mm256_add_epi32(c[0], c[1]), _mm256_add_epi32(c[2], c[3]));
                            acc[t] = (hsum_i32(all) as f32).mul_add(dd, acc[t]);
                            acc_m[t] = (hsum128_i32(mins4) as f32).mul_add(dm, acc_m[t]);
                        }
                    }
                }
                for t in 0..N {
                    out[t] = acc[t] - acc_m[t];
                }
            }

            /// Two Q4_K rows × a full tile of 4 Q8_K token rows: bit for bit the outputs of
            /// `q4_k_n::<4>` (the order of ggml's repacked GEMM: per output, one FMA per 64 values
            /// into a scale and a min accumulator), with the eight (row, token) outputs in the
            /// lanes of one vector (lane 4·row + token, which is also their place in `out`). Each
            /// 64-value chunk's eight integer sums are reduced by one transposing `vphaddd` tree
            /// and its FMAs run for all eight outputs at once, where `q4_k_n` takes horizontal
            /// sums and scalar FMAs per output; the activation loads serve both rows.
            #[target_feature(enable = $features)]
            unsafe fn q4_k_2x4(r0: &[u8], r1: &[u8], acts: &[&[BlockQ8K]], out: &mut [f32]) {
                let nb = r0.len() / 144;
                let m4 = _mm256_set1_epi8(0x0F);
                let mut acc = _mm256_setzero_ps();
                let mut acc_m = _mm256_setzero_ps();
                for i in 0..nb {
                    let b = [r0.as_ptr().add(i * 144), r1.as_ptr().add(i * 144)];
                    let a: [&BlockQ8K; 4] = std::array::from_fn(|t| acts.get_unchecked(t).get_unchecked(i));
                    let (d0, dmin0) = f16_pair(b[0]);
                    let (d1, dmin1) = f16_pair(b[1]);
                    let (sc0, mn0) = k4_scales_mins(b[0].add(4));
                    let (sc1, mn1) = k4_scales_mins(b[1].add(4));
                    // Per lane: d_w·d_a and dmin_w·d_a, the same f32 products as `q4_k_n`.
                    let da = _mm_setr_ps(a[0].d, a[1].d, a[2].d, a[3].d);
                    let da = _mm256_set_m128(da, da);
                    let dd = _mm256_mul_ps(_mm256_set_m128(_mm_set1_ps(d1), _mm_set1_ps(d0)), da);
                    let dm = _mm256_mul_ps(_mm256_set_m128(_mm_set1_ps(dmin1), _mm_set1_ps(dmin0)), da);
                    // Scale sums: for each 64-value chunk, the eight outputs' integer sums, then one FMA.
                    for c in 0..4 {
                        let mut g = [_mm256_setzero_si256(); 2];
                        for (r, sc) in [sc0, sc1].into_iter().enumerate() {
                            // 64 values: low nibbles (scale 2c), then high nibbles (scale 2c+1).
                            let q = _mm256_loadu_si256(b[r].add(16 + 32 * c) as *const __m256i);
                            let lo = _mm256_and_si256(q, m4);
                            let hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
                            let (s_lo, s_hi) = (k4_scale(sc, 2 * c), k4_scale(sc, 2 * c + 1));
                            g[r] = half_sums4(std::array::from_fn(|t| {
                                let p = a[t].qs.as_ptr().add(64 * c);
                                _mm256_add_epi32(scaled_dot(lo, p, s_lo), scaled_dot(hi, p.add(32), s_hi))
                            }));
                        }
                        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(join_halves(g[0], g[1])), dd, acc);
                    }
                    // Min sums: each token's pairwise group sums against each row's mins gives
                    // [row 0: chunks 0..4 | row 1: chunks 0..4] per token; transposed to one
                    // vector per chunk (lane 4·row + token), then one FMA each.
                    let mins = _mm256_set_m128i(mn1, mn0);
                    let m: [__m256i; 4] = std::array::from_fn(|t| {
                        let bs = _mm256_loadu_si256(a[t].bsums.as_ptr() as *const __m256i);
                        let pairs = _mm_hadd_epi16(_mm256_castsi256_si128(bs), _mm256_extracti128_si256(bs, 1));
                        _mm256_madd_epi16(mins, _mm256_set_m128i(pairs, pairs))
                    });
                    let m01l = _mm256_unpacklo_epi32(m[0], m[1]);
                    let m01h = _mm256_unpackhi_epi32(m[0], m[1]);
                    let m23l = _mm256_unpacklo_epi32(m[2], m[3]);
                    let m23h = _mm256_unpackhi_epi32(m[2], m[3]);
                    for mc in [
                        _mm256_unpacklo_epi64(m01l, m23l),
                        _mm256_unpackhi_epi64(m01l, m23l),
                        _mm256_unpacklo_epi64(m01h, m23h),
                        _mm256_unpackhi_epi64(m01h, m23h),
                    ] {
                        acc_m = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mc), dm, acc_m);
                    }
                }
                _mm256_storeu_ps(out.as_mut_ptr(), _mm256_sub_ps(acc, acc_m));
            }

            /// The scales and mins of the Q4_K/Q5_K blocks at `b0` and `b1`, as [`k4_scales_mins`]
            /// gives them per block, unpacked for both rows at once in one vector (row 0 in the
            /// low lane): the same whole-word masks on the words `w0, w1, w2` of the 12 scale
            /// bytes, each lane computing `[sc_lo, sc_hi, mn_lo, mn_hi]` (as 4 bytes each).
            /// Returns each row's scales as i16 in both lanes, and both rows' mins as i16
            /// (row 0's in the low lane).
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn k4_scales_mins_pair(b0: *const u8, b1: *const u8) -> ([__m256i; 2], __m256i) {
                // Bytes 4..20 of each block: the 12 scale bytes (w0, w1, w2) and 4 bytes not used.
                let raw = _mm256_set_m128i(
                    _mm_loadu_si128(b1.add(4) as *const __m128i),
                    _mm_loadu_si128(b0.add(4) as *const __m128i),
                );
                // [w0, w2, w1, w2] and [w0, w0, w1, w1].
                let low_words = _mm256_shuffle_epi32(raw, 0b10_01_10_00);
                let top_words = _mm256_shuffle_epi32(raw, 0b01_01_00_00);
                // Low bits: w0 & LOW6, w2 & LOW4, w1 & LOW6, (w2 >> 4) & LOW4.
                const LOW6: i32 = 0x3f3f_3f3f;
                const LOW4: i32 = 0x0f0f_0f0f;
                let low = _mm256_and_si256(
                    _mm256_srlv_epi32(low_words, _mm256_setr_epi32(0, 0, 0, 4, 0, 0, 0, 4)),
                    _mm256_setr_epi32(LOW6, LOW4, LOW6, LOW4, LOW6, LOW4, LOW6, LOW4),
                );
                // Top 2 bits of scales/mins 4..8: bits 6..8 of bytes 0..8 moved to bits 4..6
                // (`((w >> 6) & 0x03) << 4` per byte).
                let top = _mm256_and_si256(
                    _mm256_srli_epi32(top_words, 2),
                    _mm256_setr_epi32(0, 0x3030_3030, 0, 0x3030_3030, 0, 0x3030_3030, 0, 0x3030_3030),
                );
                let bytes = _mm256_or_si256(low, top);
                // Row r: bytes 0..8 of its lane are its scales, bytes 8..16 its mins.
                let sc0 = _mm256_cvtepu8_epi16(_mm256_castsi256_si128(bytes));
                let sc1 = _mm256_cvtepu8_epi16(_mm256_extracti128_si256(bytes, 1));
                let scales = [_mm256_permute2x128_si256(sc0, sc0, 0x00), _mm256_permute2x128_si256(sc1, sc1, 0x00)];
                (scales, _mm256_permute2x128_si256(sc0, sc1, 0x31))
            }

            /// A Q4_K block's (`FIFTH` false) or Q5_K block's (`FIFTH` true) 8-lane integer scale
            /// sum for one token: `madd(maddubs(q, a), scale)` of its eight runs of 32 values (the
            /// low nibbles of each 32 bytes with scale 2c, the high nibbles with 2c + 1; Q5_K adds
            /// bits 2c and 2c + 1 of `qh` as the fifth bits), the same i32 lanes as `q4_k_n` /
            /// `q5_k_n`. The activations are read as memory operands, so two rows share them
            /// without a spill.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn k45_block_sumi<const FIFTH: bool>(b: *const u8, scales: __m256i, ab: &BlockQ8K) -> __m256i {
                let m4 = _mm256_set1_epi8(0x0F);
                let one = _mm256_set1_epi8(1);
                // Q5_K: 32 bytes of `qh` between the scales and the values.
                let qs = if FIFTH { 48 } else { 16 };
                let mut hb = if FIFTH { _mm256_loadu_si256(b.add(16) as *const __m256i) } else { _mm256_setzero_si256() };
                let mut sum = _mm256_setzero_si256();
                for c in 0..4 {
                    let q = _mm256_loadu_si256(b.add(qs + 32 * c) as *const __m256i);
                    let mut lo = _mm256_and_si256(q, m4);
                    let mut hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
                    if FIFTH {
                        // Fifth bits: bit 2c of qh for the low nibbles, 2c+1 for the high ones.
                        lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(hb, one), 4));
                        hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 1), one), 4));
                        hb = _mm256_srli_epi16(hb, 2);
                    }
                    let ay = ab.qs.as_ptr().add(64 * c);
                    let dot_lo = scaled_dot_at(lo, ay, k4_scale(scales, 2 * c));
                    let dot_hi = scaled_dot_at(hi, ay.add(32), k4_scale(scales, 2 * c + 1));
                    sum = _mm256_add_epi32(sum, _mm256_add_epi32(dot_lo, dot_hi));
                }
                sum
            }

            /// One token × every row of a group of Q4_K, two adjacent rows at a time (an odd last
            /// row through `q4_k_n::<1>`). Each output is bit for bit `q4_k_n::<1>`'s (ggml's
            /// repacked GEMV order): per block, the exact integer scale sum `Σ scale·q·a` and min
            /// sum `Σ min·bsum` of each row, then `acc = fma(sum, d·d_a, acc)` and
            /// `acc_m = fma(min sum, dmin·d_a, acc_m)`, and at the end `acc − acc_m`. The four
            /// chains (two rows × scale and min) are the four lanes of one vector, so a block
            /// costs one f16 conversion, one multiply by `d_a` and one FMA for both rows; the
            /// activation loads and their pairwise group sums serve both rows, and the two rows'
            /// eight lane sums and mins are reduced together.
            #[target_feature(enable = $features)]
            unsafe fn q4_k_gemv_rows(rows: &[u8], rb: usize, a: &[BlockQ8K], out: &mut [f32]) {
                const TS: usize = 144;
                let n = rows.len() / rb;
                let nb = rb / TS;
                for (pair, o) in rows.chunks_exact(2 * rb).zip(out.chunks_exact_mut(2)) {
                    let (r0, r1) = (pair.as_ptr(), pair.as_ptr().add(rb));
                    // Lanes: row 0's scale chain, row 0's min chain, row 1's scale chain, row 1's min chain.
                    let mut acc = _mm_setzero_ps();
                    for i in 0..nb {
                        // One linear prefetch stream over the pair (see `legacy_gemv2`).
                        super::prefetch_lines(r0.wrapping_add(2 * i * TS), 2 * TS);
                        let ab = a.get_unchecked(i);
                        let (b0, b1) = (r0.add(i * TS), r1.add(i * TS));
                        // [d0·d_a, dmin0·d_a, d1·d_a, dmin1·d_a]: the f32 products of `q4_k_n`.
                        let dd = _mm_mul_ps(f16_quad(b0, b1), _mm_set1_ps(ab.d));
                        let ([sc0, sc1], mn) = k4_scales_mins_pair(b0, b1);
                        // Scale sums, 8 lanes per row.
                        let sum0 = k45_block_sumi::<false>(b0, sc0, ab);
                        let sum1 = k45_block_sumi::<false>(b1, sc1, ab);
                        // Min sums: the activations' pairwise group sums against each row's mins
                        // (row 0 in the low lane, row 1 in the high lane, 4 lanes each).
                        let bs = _mm256_loadu_si256(ab.bsums.as_ptr() as *const __m256i);
                        let pairs = _mm_hadd_epi16(_mm256_castsi256_si128(bs), _mm256_extracti128_si256(bs, 1));
                        let mins = _mm256_madd_epi16(mn, _mm256_set_m128i(pairs, pairs));
                        // [Σsum0, Σmins0, Σsum1, Σmins1], exact: fold each row's sums to 4 lanes
                        // (row 0 low, row 1 high), then two pairwise adds per lane.
                        let folded = join_halves(sum0, sum1);
                        let h = _mm256_hadd_epi32(folded, mins);
                        let h = _mm256_hadd_epi32(h, h);
                        let totals = _mm256_castsi256_si128(_mm256_permute4x64_epi64(h, 0b00_00_10_00));
                        acc = _mm_fmadd_ps(_mm_cvtepi32_ps(totals), dd, acc);
                    }
                    o[0] = _mm_cvtss_f32(acc) - _mm_cvtss_f32(_mm_movehdup_ps(acc));
                    o[1] = _mm_cvtss_f32(_mm_movehl_ps(acc, acc)) - _mm_cvtss_f32(_mm_shuffle_ps(acc, acc, 3));
                }
                if n % 2 == 1 {
                    q4_k_n::<1>(&rows[(n - 1) * rb..], &[a], &mut out[n - 1..n]);
                }
            }

            /// Four 8-lane i32 vectors → per 128-bit half, `[Σv0 Σv1 Σv2 Σv3]` over that half's
            /// four lanes (exact; [`join_halves`] finishes the sums).
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn half_sums4(v: [__m256i; 4]) -> __m256i {
                _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]))
            }

            /// Two [`half_sums4`] results → lanes `[Σv0 … Σv3 | Σv4 … Σv7]`: the full lane sums of
            /// the eight vectors, in one vector (exact).
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn join_halves(g0: __m256i, g1: __m256i) -> __m256i {
                // [g0.lo | g1.lo] + [g0.hi | g1.hi].
                _mm256_add_epi32(_mm256_permute2x128_si256(g0, g1, 0x20), _mm256_permute2x128_si256(g0, g1, 0x31))
            }

            /// Q5_K × a tile of `N` Q8_K token rows (`WIDE`: in the order of ggml's tiled matmul).
            #[target_feature(enable = $features)]
            unsafe fn q5_k_n<const WIDE: bool, const N: usize>(row: &[u8], acts: &[&[BlockQ8K]], out: &mut [f32]) {
                let nb = row.len() / 176;
                let m4 = _mm256_set1_epi8(0x0F);
                let one = _mm256_set1_epi8(1);
                let mut acc = [_mm256_setzero_ps(); N];
                let mut acc_m = [_mm_setzero_ps(); N];
                let mut acc_s = [0f32; N];
                for i in 0..nb {
                    let b = row.as_ptr().add(i * 176);
                    let (d, dmin) = f16_pair(b);
                    let (scales, mins) = k4_scales_mins(b.add(4));
                    let mut hb = _mm256_loadu_si256(b.add(16) as *const __m256i);
                    let mut sumi = [_mm256_setzero_si256(); N];
                    for c in 0..4 {
                        // Fifth bits: bit 2c of qh for the low nibbles, 2c+1 for the high ones.
                        let q = _mm256_loadu_si256(b.add(48 + 32 * c) as *const __m256i);
                        let h_lo = _mm256_slli_epi16(_mm256_and_si256(hb, one), 4);
                        let h_hi = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 1), one), 4);
                        hb = _mm256_srli_epi16(hb, 2);
                        let lo = _mm256_or_si256(_mm256_and_si256(q, m4), h_lo);
                        let hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q, 4), m4), h_hi);
                        let s_lo = k4_scale(scales, 2 * c);
                        let s_hi = k4_scale(scales, 2 * c + 1);
                        for t in 0..N {
                            let a = acts.get_unchecked(t).get_unchecked(i).qs.as_ptr().add(64 * c);
                            let p = _mm256_add_epi32(scaled_dot(lo, a, s_lo), scaled_dot(hi, a.add(32), s_hi));
                            sumi[t] = _mm256_add_epi32(sumi[t], p);
                        }
                    }
                    for t in 0..N {
                        let a = acts.get_unchecked(t).get_unchecked(i);
                        let mp = k4_min_products(mins, a);
                        if WIDE {
                            acc_s[t] = tiled_step(acc_s[t], hsum_i32(sumi[t]), hsum128_i32(mp), d, dmin, a.d);
                        } else {
                            let m = _mm_cvtepi32_ps(mp);
                            acc_m[t] = _mm_fmadd_ps(_mm_set1_ps(dmin * a.d), m, acc_m[t]);
                            acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d * a.d), _mm256_cvtepi32_ps(sumi[t]), acc[t]);
                        }
                    }
                }
                for t in 0..N {
                    out[t] = if WIDE { acc_s[t] } else { hsum(acc[t]) - hsum128(acc_m[t]) };
                }
            }

            /// One token × every row of a group of Q5_K, two adjacent rows at a time (an odd last
            /// row through `q5_k_n::<false, 1>`). Each output is bit for bit `q5_k_n::<false, 1>`'s
            /// (ggml's `vec_dot` order): the same 8 i32 lanes of a block's `sumi` into
            /// `acc = fma(d·d_a, sumi, acc)`, the same 4 lanes of min products into
            /// `acc_m = fma(dmin·d_a, mins, acc_m)`, then `hsum(acc) − hsum(acc_m)`. The two rows'
            /// min chains are the halves of one vector (the same f32 operations per lane); the
            /// f16 conversion, the activation loads and their pairwise group sums serve both rows.
            #[target_feature(enable = $features)]
            unsafe fn q5_k_gemv_rows(rows: &[u8], rb: usize, a: &[BlockQ8K], out: &mut [f32]) {
                const TS: usize = 176;
                let n = rows.len() / rb;
                let nb = rb / TS;
                // [dmin0·d_a ×4 | dmin1·d_a ×4] from lanes 1 and 3 of the block's scale products.
                let dmin_lanes = _mm256_setr_epi32(1, 1, 1, 1, 3, 3, 3, 3);
                for (pair, o) in rows.chunks_exact(2 * rb).zip(out.chunks_exact_mut(2)) {
                    let (r0, r1) = (pair.as_ptr(), pair.as_ptr().add(rb));
                    let (mut acc0, mut acc1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
                    // Row 0's min chain in the low lane, row 1's in the high lane.
                    let mut acc_m = _mm256_setzero_ps();
                    for i in 0..nb {
                        // One linear prefetch stream over the pair (see `legacy_gemv2`).
                        super::prefetch_lines(r0.wrapping_add(2 * i * TS), 2 * TS);
                        let ab = a.get_unchecked(i);
                        let (b0, b1) = (r0.add(i * TS), r1.add(i * TS));
                        // [d0·d_a, dmin0·d_a, d1·d_a, dmin1·d_a]: the f32 products of `q5_k_n`.
                        let dd = _mm_mul_ps(f16_quad(b0, b1), _mm_set1_ps(ab.d));
                        let ([sc0, sc1], mn) = k4_scales_mins_pair(b0, b1);
                        let sumi0 = k45_block_sumi::<true>(b0, sc0, ab);
                        let sumi1 = k45_block_sumi::<true>(b1, sc1, ab);
                        // Each row's 4 lanes of min products against the activations' pairwise group sums.
                        let bs = _mm256_loadu_si256(ab.bsums.as_ptr() as *const __m256i);
                        let pairs = _mm_hadd_epi16(_mm256_castsi256_si128(bs), _mm256_extracti128_si256(bs, 1));
                        let mins = _mm256_madd_epi16(mn, _mm256_set_m128i(pairs, pairs));
                        let dmins = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(dd), dmin_lanes);
                        acc_m = _mm256_fmadd_ps(dmins, _mm256_cvtepi32_ps(mins), acc_m);
                        acc0 = _mm256_fmadd_ps(splat_lane(dd, 0), _mm256_cvtepi32_ps(sumi0), acc0);
                        acc1 = _mm256_fmadd_ps(splat_lane(dd, 2), _mm256_cvtepi32_ps(sumi1), acc1);
                    }
                    o[0] = hsum(acc0) - hsum128(_mm256_castps256_ps128(acc_m));
                    o[1] = hsum(acc1) - hsum128(_mm256_extractf128_ps(acc_m, 1));
                }
                if n % 2 == 1 {
                    q5_k_n::<false, 1>(&rows[(n - 1) * rb..], &[a], &mut out[n - 1..n]);
                }
            }

            /// Q6_K × a tile of `N` Q8_K token rows. Values are used unsigned (0..64) and
            /// the −32 offset is taken off once per block through the activations' group sums.
            /// Float order: `ggml_vec_dot_q6_K_q8_K` (8 lanes, one FMA per block, then a
            /// horizontal sum), or with `WIDE` ggml's tiled matmul (one scalar chain, see `tiled_step`).
            #[target_feature(enable = $features)]
            unsafe fn q6_k_n<const WIDE: bool, const N: usize>(row: &[u8], acts: &[&[BlockQ8K]], out: &mut [f32]) {
                let nb = row.len() / 210;
                let m4 = _mm256_set1_epi8(0x0F);
                let mut acc = [_mm256_setzero_ps(); N];
                let mut acc_s = [0f32; N];
                for i in 0..nb {
                    let b = row.as_ptr().add(i * 210);
                    let d = f16_after(b.add(208));
                    // The 16 signed scales as bytes, and as i16 for the offset term.
                    let sc8 = _mm_loadu_si128(b.add(192) as *const __m128i);
                    let sc16 = _mm256_cvtepi8_epi16(sc8);
                    let mut sumi = [_mm256_setzero_si256(); N];
                    for t in 0..N {
                        // −32 · Σ_g scale[g] · bsums[g]: the offset of every value, taken off up front.
                        let a = acts.get_unchecked(t).get_unchecked(i);
                        let bs = _mm256_loadu_si256(a.bsums.as_ptr() as *const __m256i);
                        sumi[t] = _mm256_slli_epi32(_mm256_madd_epi16(sc16, bs), 5);
                        sumi[t] = _mm256_sub_epi32(_mm256_setzero_si256(), sumi[t]);
                    }
                    for half in 0..2 {
                        let ql0 = _mm256_loadu_si256(b.add(64 * half) as *const __m256i);
                        let ql1 = _mm256_loadu_si256(b.add(64 * half + 32) as *const __m256i);
                        let qh = _mm256_loadu_si256(b.add(128 + 32 * half) as *const __m256i);
                        // Four 32-value runs: low/high nibbles of ql0/ql1 with 2 bits of qh each.
                        let q = [
                            _mm256_or_si256(
                                _mm256_and_si256(ql0, m4),
                                _mm256_slli_epi16(_mm256_and_si256(qh, _mm256_set1_epi8(0x03)), 4),
                            ),
                            _mm256_or_si256(
                                _mm256_and_si256(ql1, m4),
                                _mm256_slli_epi16(_mm256_and_si256(qh, _mm256_set1_epi8(0x0C)), 2),
                            ),
                            _mm256_or_si256(
                                _mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4),
                                _mm256_and_si256(qh, _mm256_set1_epi8(0x30)),
                            ),
                            _mm256_or_si256(
                                _mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                                _mm256_srli_epi16(_mm256_and_si256(qh, _mm256_set1_epi8(0xC0u8 as i8)), 2),
                            ),
                        ];
                        for k in 0..4 {
                            // Scale g for the first 16 values, g + 1 for the next 16.
                            let g = (8 * half + 2 * k) as i64;
                            let pick = _mm_set_epi64x((g + 1) * 0x0101_0101_0101_0101, g * 0x0101_0101_0101_0101);
                            let s = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc8, pick));
                            for t in 0..N {
                                let a = acts.get_unchecked(t).get_unchecked(i).qs.as_ptr().add(128 * half + 32 * k);
                                sumi[t] = _mm256_add_epi32(sumi[t], scaled_dot(q[k], a, s));
                            }
                        }
                    }
                    for t in 0..N {
                        let a = acts.get_unchecked(t).get_unchecked(i);
                        if WIDE {
                            acc_s[t] = tiled_step(acc_s[t], hsum_i32(sumi[t]), 0, d, 0.0, a.d);
                        } else {
                            acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d * a.d), _mm256_cvtepi32_ps(sumi[t]), acc[t]);
                        }
                    }
                }
                for t in 0..N {
                    out[t] = if WIDE { acc_s[t] } else { hsum(acc[t]) };
                }
            }

            /// A Q6_K block's `sumi` for one token, the same i32 in each of the 8 lanes as
            /// `q6_k_n`'s: −32·`madd(scales, bsums)` (the offset of every value), plus
            /// `madd(maddubs(q, a), scale pair)` of each 32 values 0..64 (integer sums: their
            /// grouping does not matter). `sc16`: the block's 16 scales as i16. Each 32 values'
            /// scale pair (g for the first 16, g + 1 for the rest) is one in-lane `vpshufb` of
            /// the half block's 8 scales in both lanes (where `q6_k_n` shuffles bytes and widens
            /// them), and the activations are memory operands, so two rows share them.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn q6k_block_sumi(b: *const u8, sc16: __m256i, bs: __m256i, ab: &BlockQ8K) -> __m256i {
                let m4 = _mm256_set1_epi8(0x0F);
                let mut sumi = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(_mm256_madd_epi16(sc16, bs), 5));
                for half in 0..2 {
                    // Scales 8·half .. 8·half + 8 (as i16) in both lanes.
                    let sc_half = if half == 0 {
                        _mm256_permute2x128_si256(sc16, sc16, 0x00)
                    } else {
                        _mm256_permute2x128_si256(sc16, sc16, 0x11)
                    };
                    let ql0 = _mm256_loadu_si256(b.add(64 * half) as *const __m256i);
                    let ql1 = _mm256_loadu_si256(b.add(64 * half + 32) as *const __m256i);
                    let qh = _mm256_loadu_si256(b.add(128 + 32 * half) as *const __m256i);
                    // Four 32-value runs: low/high nibbles of ql0/ql1 with 2 bits of qh each.
                    let q = [
                        _mm256_or_si256(
                            _mm256_and_si256(ql0, m4),
                            _mm256_slli_epi16(_mm256_and_si256(qh, _mm256_set1_epi8(0x03)), 4),
                        ),
                        _mm256_or_si256(
                            _mm256_and_si256(ql1, m4),
                            _mm256_slli_epi16(_mm256_and_si256(qh, _mm256_set1_epi8(0x0C)), 2),
                        ),
                        _mm256_or_si256(
                            _mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4),
                            _mm256_and_si256(qh, _mm256_set1_epi8(0x30)),
                        ),
                        _mm256_or_si256(
                            _mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                            _mm256_srli_epi16(_mm256_and_si256(qh, _mm256_set1_epi8(0xC0u8 as i8)), 2),
                        ),
                    ];
                    for (k, &qk) in q.iter().enumerate() {
                        // Word 2k (scale g = 8·half + 2k) in the low lane, word 2k + 1 in the high lane.
                        let word = |w: usize| _mm_set1_epi16((((2 * w + 1) << 8) | (2 * w)) as i16);
                        let s = _mm256_shuffle_epi8(sc_half, _mm256_set_m128i(word(2 * k + 1), word(2 * k)));
                        let ay = ab.qs.as_ptr().add(128 * half + 32 * k);
                        sumi = _mm256_add_epi32(sumi, scaled_dot_at(qk, ay, s));
                    }
                }
                sumi
            }

            /// One token × every row of a group of Q6_K, two adjacent rows at a time (an odd last
            /// row through `q6_k_n::<false, 1>`). Each output is bit for bit `q6_k_n::<false, 1>`'s
            /// (ggml's `vec_dot` order): the same 8 i32 lanes of a block's `sumi` (see
            /// [`q6k_block_sumi`]), `acc = fma(d·d_a, sumi, acc)` per block, then `hsum(acc)`.
            /// Cheaper per block: one linear prefetch stream, both rows' `d` in one f16
            /// conversion, and the activation and group-sum loads shared by the rows.
            #[target_feature(enable = $features)]
            unsafe fn q6_k_gemv_rows(rows: &[u8], rb: usize, a: &[BlockQ8K], out: &mut [f32]) {
                const TS: usize = 210;
                let n = rows.len() / rb;
                let nb = rb / TS;
                for (pair, o) in rows.chunks_exact(2 * rb).zip(out.chunks_exact_mut(2)) {
                    let (r0, r1) = (pair.as_ptr(), pair.as_ptr().add(rb));
                    let (mut acc0, mut acc1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
                    for i in 0..nb {
                        // One linear prefetch stream over the pair (see `legacy_gemv2`).
                        super::prefetch_lines(r0.wrapping_add(2 * i * TS), 2 * TS);
                        let ab = a.get_unchecked(i);
                        let (b0, b1) = (r0.add(i * TS), r1.add(i * TS));
                        // Lanes 1 and 3: d0·d_a, d1·d_a (the f16 `d` ends the block).
                        let dd = _mm_mul_ps(f16_quad(b0.add(206), b1.add(206)), _mm_set1_ps(ab.d));
                        let bs = _mm256_loadu_si256(ab.bsums.as_ptr() as *const __m256i);
                        // Each row's 16 signed scales as i16.
                        let sc0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(b0.add(192) as *const __m128i));
                        let sc1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(b1.add(192) as *const __m128i));
                        let sumi0 = q6k_block_sumi(b0, sc0, bs, ab);
                        let sumi1 = q6k_block_sumi(b1, sc1, bs, ab);
                        acc0 = _mm256_fmadd_ps(splat_lane(dd, 1), _mm256_cvtepi32_ps(sumi0), acc0);
                        acc1 = _mm256_fmadd_ps(splat_lane(dd, 3), _mm256_cvtepi32_ps(sumi1), acc1);
                    }
                    o[0] = hsum(acc0);
                    o[1] = hsum(acc1);
                }
                if n % 2 == 1 {
                    q6_k_n::<false, 1>(&rows[(n - 1) * rb..], &[a], &mut out[n - 1..n]);
                }
            }

            /// Q2_K × a tile of `N` Q8_K token rows (`WIDE`: in the order of ggml's tiled matmul).
            #[target_feature(enable = $features)]
            unsafe fn q2_k_n<const WIDE: bool, const N: usize>(row: &[u8], acts: &[&[BlockQ8K]], out: &mut [f32]) {
                let nb = row.len() / 84;
                let m3 = _mm256_set1_epi8(3);
                let mut acc = [_mm256_setzero_ps(); N];
                let mut mins = [0f32; N];
                for i in 0..nb {
                    let b = row.as_ptr().add(i * 84);
                    let sc = std::slice::from_raw_parts(b, 16);
                    let (d, dmin) = f16_pair(b.add(80));
                    // The 16 mins (high nibbles of the scale bytes) as i16, for one `vpmaddwd`
                    // against each token's group sums.
                    let raw = _mm_loadu_si128(b as *const __m128i);
                    let mins16 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(0x0F)));
                    let mut sumi = [_mm256_setzero_si256(); N];
                    for half in 0..2 {
                        let mut q = _mm256_loadu_si256(b.add(16 + 32 * half) as *const __m256i);
                        for s in 0..4 {
                            // Bits 2s..2s+2 of each byte: 32 values with scales g, g+1.
                            let v = _mm256_and_si256(q, m3);
                            q = _mm256_srli_epi16(q, 2);
                            let g = 8 * half + 2 * s;
                            let scv = scales16((sc[g] & 0xF) as i32, (sc[g + 1] & 0xF) as i32);
                            for t in 0..N {
                                let a = acts.get_unchecked(t).get_unchecked(i).qs.as_ptr().add(128 * half + 32 * s);
                                sumi[t] = _mm256_add_epi32(sumi[t], scaled_dot(v, a, scv));
                            }
                        }
                    }
                    for t in 0..N {
                        let a = acts.get_unchecked(t).get_unchecked(i);
                        // Σ_g min[g]·bsums[g], exact.
                        let bs = _mm256_loadu_si256(a.bsums.as_ptr() as *const __m256i);
                        let summ = hsum_i32(_mm256_madd_epi16(mins16, bs));
                        if WIDE {
                            mins[t] = tiled_step(mins[t], hsum_i32(sumi[t]), summ, d, dmin, a.d);
                        } else {
                            mins[t] += dmin * a.d * summ as f32;
                            acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d * a.d), _mm256_cvtepi32_ps(sumi[t]), acc[t]);
                        }
                    }
                }
                for t in 0..N {
                    // WIDE: the whole result is in `mins` (see `tiled_step`).
                    out[t] = if WIDE { mins[t] } else { hsum(acc[t]) - mins[t] };
                }
            }

            /// Two f16 pairs, the 32-bit words at `p0` and `p1`, as `[p0 lo, p0 hi, p1 lo, p1 hi]`
            /// in f32: one zero-extending 64-bit move and one conversion for two rows' block scales.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn f16_quad(p0: *const u8, p1: *const u8) -> __m128 {
                let word = |p: *const u8| u32::from_le_bytes([*p, *p.add(1), *p.add(2), *p.add(3)]) as u64;
                let bits = word(p0) | (word(p1) << 32);
                // SAFETY: this module's functions run with AVX2 (see `vmovq_to_xmm`).
                let v = unsafe { super::vmovq_to_xmm(bits) };
                _mm_cvtph_ps(v)
            }

            /// The lane sums of two 8-lane i32 vectors as `[Σv0, Σv0, Σv1, Σv1]` (exact).
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn pair_sums_i32(v0: __m256i, v1: __m256i) -> __m128i {
                let h = _mm256_hadd_epi32(v0, v1);
                let h = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
                let h = _mm_hadd_epi32(h, h);
                _mm_shuffle_epi32(h, 0b01_01_00_00)
            }

            /// Lane `k` (0..4) of `v` in all eight lanes.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn splat_lane(v: __m128, k: i32) -> __m256 {
                _mm256_permutevar8x32_ps(_mm256_castps128_ps256(v), _mm256_set1_epi32(k))
            }

            /// One token × every row of a group of Q2_K, two adjacent rows at a time (an odd last
            /// row through `q2_k_n::<false, 1>`). Each output is bit for bit `q2_k_n::<false, 1>`'s:
            /// the same `madd(maddubs(q, a), scale)` per 32 values into the same 8 i32 lanes of a
            /// block's `sumi`, `acc = fma(d·d_a, sumi, acc)` per block, the min chain
            /// `mins += (dmin·d_a)·Σ min·bsum` (in lanes 1 and 3 of one vector: the same f32
            /// operations per row), then `hsum(acc) − mins`. Cheaper per block: each 32 values'
            /// scale pair is one `vpshufb` of the block's 16 scale bytes, the 16 mins meet the
            /// activations' group sums in one `vpmaddwd`, and the activation loads, the f16
            /// conversion and the min reduction serve both rows.
            #[target_feature(enable = $features)]
            unsafe fn q2_k_gemv_rows(rows: &[u8], rb: usize, a: &[BlockQ8K], out: &mut [f32]) {
                const TS: usize = 84;
                let n = rows.len() / rb;
                let nb = rb / TS;
                let m3 = _mm256_set1_epi8(3);
                let m4 = _mm256_set1_epi8(0x0F);
                for (pair, o) in rows.chunks_exact(2 * rb).zip(out.chunks_exact_mut(2)) {
                    let (r0, r1) = (pair.as_ptr(), pair.as_ptr().add(rb));
                    let (mut acc0, mut acc1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
                    // Lane 1: row 0's min sum, lane 3: row 1's (lanes 0 and 2 are not used).
                    let mut mins = _mm_setzero_ps();
                    for i in 0..nb {
                        // One linear prefetch stream over the pair (see `legacy_gemv2`).
                        super::prefetch_lines(r0.wrapping_add(2 * i * TS), 2 * TS);
                        let ab = a.get_unchecked(i);
                        let (b0, b1) = (r0.add(i * TS), r1.add(i * TS));
                        // [d0, dmin0, d1, dmin1] · d_a: the f32 products `d·d_a`, `dmin·d_a` of each row.
                        let dd = _mm_mul_ps(f16_quad(b0.add(80), b1.add(80)), _mm_set1_ps(ab.d));
                        // Each row's 16 scale bytes in both lanes: scale = low nibble, min = high nibble.
                        let raw0 = _mm256_broadcastsi128_si256(_mm_loadu_si128(b0 as *const __m128i));
                        let raw1 = _mm256_broadcastsi128_si256(_mm_loadu_si128(b1 as *const __m128i));
                        let (sc0, sc1) = (_mm256_and_si256(raw0, m4), _mm256_and_si256(raw1, m4));
                        // Σ_g min[g]·bsums[g] of each row, exact.
                        let bs = _mm256_loadu_si256(ab.bsums.as_ptr() as *const __m256i);
                        let min_products = |raw: __m256i| {
                            let m = _mm_and_si128(_mm_srli_epi16(_mm256_castsi256_si128(raw), 4), _mm256_castsi256_si128(m4));
                            _mm256_madd_epi16(_mm256_cvtepu8_epi16(m), bs)
                        };
                        let summ = pair_sums_i32(min_products(raw0), min_products(raw1));
                        // Scale sums: 32 values at a time, 2 bits each.
                        let (mut sumi0, mut sumi1) = (_mm256_setzero_si256(), _mm256_setzero_si256());
                        for half in 0..2 {
                            let mut q0 = _mm256_loadu_si256(b0.add(16 + 32 * half) as *const __m256i);
                            let mut q1 = _mm256_loadu_si256(b1.add(16 + 32 * half) as *const __m256i);
                            for s in 0..4 {
                                // Scale g (as i16) for the first 16 values, g + 1 for the next 16.
                                // (`vpshufb` zeroes the byte picked by 0x80: each word is `[g, 0]`.)
                                let g = (8 * half + 2 * s) as u16;
                                let word = |k: u16| _mm_set1_epi16((0x8000 | k) as i16);
                                let pick = _mm256_set_m128i(word(g + 1), word(g));
                                let ay = ab.qs.as_ptr().add(128 * half + 32 * s);
                                let (v0, v1) = (_mm256_and_si256(q0, m3), _mm256_and_si256(q1, m3));
                                q0 = _mm256_srli_epi16(q0, 2);
                                q1 = _mm256_srli_epi16(q1, 2);
                                sumi0 = _mm256_add_epi32(sumi0, scaled_dot(v0, ay, _mm256_shuffle_epi8(sc0, pick)));
                                sumi1 = _mm256_add_epi32(sumi1, scaled_dot(v1, ay, _mm256_shuffle_epi8(sc1, pick)));
                            }
                        }
                        acc0 = _mm256_fmadd_ps(splat_lane(dd, 0), _mm256_cvtepi32_ps(sumi0), acc0);
                        acc1 = _mm256_fmadd_ps(splat_lane(dd, 2), _mm256_cvtepi32_ps(sumi1), acc1);
                        // Lanes 1 and 3: `mins += (dmin·d_a)·Σ`, as `q2_k_n`'s scalar chain.
                        mins = _mm_add_ps(mins, _mm_mul_ps(dd, _mm_cvtepi32_ps(summ)));
                    }
                    o[0] = hsum(acc0) - _mm_cvtss_f32(_mm_movehdup_ps(mins));
                    o[1] = hsum(acc1) - _mm_cvtss_f32(_mm_shuffle_ps(mins, mins, 3));
                }
                if n % 2 == 1 {
                    q2_k_n::<false, 1>(&rows[(n - 1) * rb..], &[a], &mut out[n - 1..n]);
                }
            }

            /// Q3_K × a tile of `N` Q8_K token rows (values used as 0..8, offset 4 removed via group
            /// sums; `WIDE`: in the order of ggml's tiled matmul).
            #[target_feature(enable = $features)]
            unsafe fn q3_k_n<const WIDE: bool, const N: usize>(row: &[u8], acts: &[&[BlockQ8K]], out: &mut [f32]) {
                let nb = row.len() / 110;
                let m3 = _mm256_set1_epi8(3);
                let one = _mm256_set1_epi8(1);
                let mut acc = [_mm256_setzero_ps(); N];
                let mut acc_s = [0f32; N];
                for i in 0..nb {
                    let b = row.as_ptr().add(i * 110);
                    let d = f16_after(b.add(108));
                    let sc8 = q3k_scales_vec(b.add(96));
                    let sc16 = _mm256_cvtepi8_epi16(sc8);
                    let mut sumi = [_mm256_setzero_si256(); N];
                    for t in 0..N {
                        // −4 · Σ_g scale[g] · bsums[g]: the offset of every value, taken off up front.
                        let a = acts.get_unchecked(t).get_unchecked(i);
                        let bs = _mm256_loadu_si256(a.bsums.as_ptr() as *const __m256i);
                        let off = _mm256_slli_epi32(_mm256_madd_epi16(sc16, bs), 2);
                        sumi[t] = _mm256_sub_epi32(_mm256_setzero_si256(), off);
                    }
                    let mut hm = _mm256_loadu_si256(b as *const __m256i);
                    for half in 0..2 {
                        let mut q = _mm256_loadu_si256(b.add(32 + 32 * half) as *const __m256i);
                        for s in 0..4 {
                            let low = _mm256_and_si256(q, m3);
                            let high = _mm256_slli_epi16(_mm256_and_si256(hm, one), 2);
                            q = _mm256_srli_epi16(q, 2);
                            hm = _mm256_srli_epi16(hm, 1);
                            let v = _mm256_or_si256(low, high);
                            // Scale g for the first 16 values, g + 1 for the next 16.
                            let g = (8 * half + 2 * s) as i64;
                            let pick = _mm_set_epi64x((g + 1) * 0x0101_0101_0101_0101, g * 0x0101_0101_0101_0101);
                            let scv = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc8, pick));
                            for t in 0..N {
                                let a = acts.get_unchecked(t).get_unchecked(i).qs.as_ptr().add(128 * half + 32 * s);
                                sumi[t] = _mm256_add_epi32(sumi[t], scaled_dot(v, a, scv));
                            }
                        }
                    }
                    for t in 0..N {
                        let a = acts.get_unchecked(t).get_unchecked(i);
                        if WIDE {
                            acc_s[t] = tiled_step(acc_s[t], hsum_i32(sumi[t]), 0, d, 0.0, a.d);
                        } else {
                            acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d * a.d), _mm256_cvtepi32_ps(sumi[t]), acc[t]);
                        }
                    }
                }
                for t in 0..N {
                    out[t] = if WIDE { acc_s[t] } else { hsum(acc[t]) };
                }
            }

            /// The 16 signed scales of a Q3_K block (12 bytes at `p`), −32 offset removed, as bytes.
            /// Scale j has its low 4 bits in the nibble of byte j % 8 (low nibble for j < 8) and its
            /// top 2 bits in bits 2·(j / 4) of byte 8 + j % 4: whole-word masks do four at a time.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn q3k_scales_vec(p: *const u8) -> __m128i {
                const LOW4: u32 = 0x0f0f_0f0f;
                const TOP2: u32 = 0x0303_0303;
                let w = |k: usize| u32::from_le_bytes([*p.add(4 * k), *p.add(4 * k + 1), *p.add(4 * k + 2), *p.add(4 * k + 3)]);
                let (a0, a1, hi) = (w(0), w(1), w(2));
                let s0 = (a0 & LOW4) | ((hi & TOP2) << 4);
                let s1 = (a1 & LOW4) | (((hi >> 2) & TOP2) << 4);
                let s2 = ((a0 >> 4) & LOW4) | (((hi >> 4) & TOP2) << 4);
                let s3 = ((a1 >> 4) & LOW4) | (((hi >> 6) & TOP2) << 4);
                let v = _mm_set_epi32(s3 as i32, s2 as i32, s1 as i32, s0 as i32);
                _mm_sub_epi8(v, _mm_set1_epi8(32))
            }

            /// A `vpshufb` table (in both lanes) over a Q3_K half block's `hmask` nibble (bit s:
            /// the high bit of the half's 32-value chunk s): bit `first` of the nibble to bit 2,
            /// bit `first + 2` to bit 6 — the high bits of chunks `first` and `first + 2` just above
            /// their two low bits when those sit at bits 0..2 and 4..6 of a byte.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn q3k_high_bits_table(first: usize) -> __m256i {
                let mut table = [0u8; 16];
                for (nibble, entry) in table.iter_mut().enumerate() {
                    *entry = ((((nibble >> first) & 1) << 2) | (((nibble >> (first + 2)) & 1) << 6)) as u8;
                }
                _mm256_broadcastsi128_si256(_mm_loadu_si128(table.as_ptr() as *const __m128i))
            }

            /// The 32-byte `vpshufb` patterns of the one-token Q3_K kernel, read as memory operands
            /// (see [`shuffle_bytes_at`]).
            #[repr(C, align(32))]
            struct Q3kPatterns {
                /// Word c of each lane (c = 0..8): chunk c's pair of scales from the scales by
                /// parity (see [`q3k_block_sumi`]).
                chunk_scales: [[u8; 32]; 8],
                /// Byte j of each lane ← the scale byte holding the low 4 bits of scale j
                /// (`s[j % 8]`, at 2 + j % 8 of a load from block byte 94), and the one holding its
                /// top 2 bits (`s[8 + j % 4]`, at 10 + j % 4); see [`q3k_scales_pair`].
                scale_low_bytes: [u8; 32],
                scale_high_bytes: [u8; 32],
            }
            static Q3K_PATTERNS: Q3kPatterns = {
                let mut p = Q3kPatterns { chunk_scales: [[0; 32]; 8], scale_low_bytes: [0; 32], scale_high_bytes: [0; 32] };
                let mut k = 0;
                while k < 32 {
                    let mut c = 0;
                    while c < 8 {
                        p.chunk_scales[c][k] = (2 * c + k % 2) as u8;
                        c += 1;
                    }
                    p.scale_low_bytes[k] = (2 + k % 8) as u8;
                    p.scale_high_bytes[k] = (10 + k % 4) as u8;
                    k += 1;
                }
                p
            };

            /// The 16 signed scales (−32 offset removed) of the Q3_K blocks at `b0` and `b1` as
            /// bytes, row 0's in the low lane and row 1's in the high lane: the values of
            /// [`q3k_scales_vec`], unpacked for both rows at once in vector registers. The 12
            /// scale bytes `s` are bytes 96..108 of a block (loaded from byte 94, inside the
            /// block); scale j takes its low 4 bits from `s[j % 8]` (the high nibble for j ≥ 8)
            /// and its top 2 bits from bits 2·(j / 4) of `s[8 + j % 4]`, so one `vpshufb` and one
            /// per-dword shift place each part (both shuffles as asm: LLVM splits one of them in two).
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn q3k_scales_pair(b0: *const u8, b1: *const u8) -> __m256i {
                let raw = _mm256_set_m128i(
                    _mm_loadu_si128(b1.add(94) as *const __m128i),
                    _mm_loadu_si128(b0.add(94) as *const __m128i),
                );
                // Bytes j of each lane: s[j % 8] and s[8 + j % 4], shifted to put scale j's bits lowest.
                let low = shuffle_bytes_at(raw, Q3K_PATTERNS.scale_low_bytes.as_ptr());
                let high = shuffle_bytes_at(raw, Q3K_PATTERNS.scale_high_bytes.as_ptr());
                let low = _mm256_srlv_epi32(low, _mm256_set_epi32(4, 4, 0, 0, 4, 4, 0, 0));
                let high = _mm256_srlv_epi32(high, _mm256_set_epi32(6, 4, 2, 0, 6, 4, 2, 0));
                let low = _mm256_and_si256(low, _mm256_set1_epi8(0x0F));
                let high = _mm256_slli_epi16(_mm256_and_si256(high, _mm256_set1_epi8(0x03)), 4);
                _mm256_sub_epi8(_mm256_or_si256(low, high), _mm256_set1_epi8(32))
            }

            /// `vpshufb` of `x` by the 32 bytes at `pick`, as asm with a memory operand: LLVM
            /// would load a repeating pattern with a broadcast (a shuffle µop of its own) or split
            /// the shuffle into two word shuffles.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn shuffle_bytes_at(x: __m256i, pick: *const u8) -> __m256i {
                let y: __m256i;
                // SAFETY: `vpshufb` reads the 32 bytes at `pick` (the caller guarantees them) and
                // writes only a vector register (AVX2, enabled here).
                unsafe {
                    std::arch::asm!(
                        "vpshufb {y}, {x}, ymmword ptr [{p}]",
                        y = lateout(ymm_reg) y,
                        x = in(ymm_reg) x,
                        p = in(reg) pick,
                        options(pure, readonly, nostack, preserves_flags)
                    );
                }
                y
            }

            /// `madd(maddubs(q, the 32 bytes at a), sc)`, the activations a memory operand of the
            /// `maddubs` (as asm): when two rows meet the same activations, LLVM would otherwise
            /// load them once into registers and spill them to the stack for the second row.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn scaled_dot_at(q: __m256i, a: *const i8, sc: __m256i) -> __m256i {
                let products: __m256i;
                // SAFETY: `vpmaddubsw` reads the 32 bytes at `a` (the caller guarantees them) and
                // writes only a vector register (AVX2, enabled here).
                unsafe {
                    std::arch::asm!(
                        "vpmaddubsw {y}, {q}, ymmword ptr [{a}]",
                        y = lateout(ymm_reg) products,
                        q = in(ymm_reg) q,
                        a = in(reg) a,
                        options(pure, readonly, nostack, preserves_flags)
                    );
                }
                _mm256_madd_epi16(products, sc)
            }

            /// A Q3_K block's `sumi` for one token, the same i32 in each of the 8 lanes as
            /// `q3_k_n`'s: `offset` (each lane's −4·Σ scale·group sum) plus `madd(maddubs(q, a),
            /// scales)` of every 32 values 0..8 (integer sums: their grouping does not matter).
            /// `by_parity`: the block's scales as i16, the even ones in the low lane and the odd
            /// ones in the high lane, so chunk c's pair (2c for its first 16 values, 2c + 1 for
            /// the rest) is one `vpshufb` of word c. `high_tables`: [`q3k_high_bits_table`] 0 and 1.
            ///
            /// The values are unpacked two chunks at a time: chunks s and s + 2 of a half (s is 0
            /// or 1) take their low bits from bits 2s..2s+2 and 2s+4..2s+6 of `qs` with one mask, and
            /// their high bits from one `vpshufb` of the half's `hmask` nibble into bits 2 and 6,
            /// so one byte holds chunk s's value in its low nibble and chunk s + 2's in its high
            /// nibble. The high nibble is used in place, as 16·value (≤ 112: `maddubs` cannot
            /// saturate), into a second sum that is divided by 16, exactly, at the end.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn q3k_block_sumi(
                b: *const u8,
                by_parity: __m256i,
                offset: __m256i,
                ab: &BlockQ8K,
                high_tables: [__m256i; 2],
            ) -> __m256i {
                let (low2, low_nibble) = (_mm256_set1_epi8(0x33), _mm256_set1_epi8(0x0F));
                let hm = _mm256_loadu_si256(b as *const __m256i);
                // Σ over the chunks whose values are used as is (from `offset`), and 16·Σ over the rest.
                let (mut sum, mut sum16) = (offset, _mm256_setzero_si256());
                for half in 0..2 {
                    let q = _mm256_loadu_si256(b.add(32 + 32 * half) as *const __m256i);
                    // The half's `hmask` nibble: bit s is the high bit of its chunk s.
                    let nibble = _mm256_and_si256(if half == 0 { hm } else { _mm256_srli_epi16(hm, 4) }, low_nibble);
                    for s in 0..2 {
                        // Chunk s in the low nibble, chunk s + 2 in the high nibble.
                        let low_bits = if s == 0 { q } else { _mm256_srli_epi16(q, 2) };
                        let both = _mm256_or_si256(_mm256_and_si256(low_bits, low2), _mm256_shuffle_epi8(high_tables[s], nibble));
                        let value = _mm256_and_si256(both, low_nibble);
                        let value16 = _mm256_xor_si256(both, value);
                        let c = 4 * half + s;
                        let (ay, ay2) = (ab.qs.as_ptr().add(32 * c), ab.qs.as_ptr().add(32 * (c + 2)));
                        let (sc, sc2) = (
                            shuffle_bytes_at(by_parity, Q3K_PATTERNS.chunk_scales[c].as_ptr()),
                            shuffle_bytes_at(by_parity, Q3K_PATTERNS.chunk_scales[c + 2].as_ptr()),
                        );
                        sum = _mm256_add_epi32(sum, scaled_dot_at(value, ay, sc));
                        sum16 = _mm256_add_epi32(sum16, scaled_dot_at(value16, ay2, sc2));
                    }
                }
                _mm256_add_epi32(sum, _mm256_srai_epi32(sum16, 4))
            }

            /// One token × every row of a group of Q3_K, two adjacent rows at a time (an odd last
            /// row through `q3_k_n::<false, 1>`). Each output is bit for bit `q3_k_n::<false, 1>`'s:
            /// every lane of a block's `sumi` holds the same integer — −4·(its pair of scale ×
            /// group sums) plus `madd(maddubs(q, a), scale)` over the block's chunks of 32 values
            /// 0..8 — then `acc = fma(d·d_a, sumi, acc)` per block and `hsum(acc)`. Cheaper per
            /// block: the 16 scales of both rows are unpacked together and each chunk's pair is
            /// one in-lane `vpshufb`; two chunks' values are unpacked at once (see
            /// [`q3k_block_sumi`]); the −4·group sums and the f16 conversion serve both rows.
            #[target_feature(enable = $features)]
            unsafe fn q3_k_gemv_rows(rows: &[u8], rb: usize, a: &[BlockQ8K], out: &mut [f32]) {
                const TS: usize = 110;
                let n = rows.len() / rb;
                let nb = rb / TS;
                let high_tables = [q3k_high_bits_table(0), q3k_high_bits_table(1)];
                // Scale bytes 0, 2, .., 14, then 1, 3, .., 15 (in each lane).
                let parity_order = _mm256_broadcastsi128_si256(_mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15));
                for (pair, o) in rows.chunks_exact(2 * rb).zip(out.chunks_exact_mut(2)) {
                    let (r0, r1) = (pair.as_ptr(), pair.as_ptr().add(rb));
                    let (mut acc0, mut acc1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
                    for i in 0..nb {
                        // One linear prefetch stream over the pair (see `legacy_gemv2`).
                        super::prefetch_lines(r0.wrapping_add(2 * i * TS), 2 * TS);
                        let ab = a.get_unchecked(i);
                        let (b0, b1) = (r0.add(i * TS), r1.add(i * TS));
                        // Lanes 1 and 3: d0·d_a, d1·d_a (the f16 `d` ends the block).
                        let dd = _mm_mul_ps(f16_quad(b0.add(106), b1.add(106)), _mm_set1_ps(ab.d));
                        // Both rows' 16 signed scales (row 0 in the low lane).
                        let scales = q3k_scales_pair(b0, b1);
                        // −4 · Σ_g scale[g] · bsums[g] per lane (scales in their own order): the
                        // offset of every value, taken off up front.
                        let bs = _mm256_loadu_si256(ab.bsums.as_ptr() as *const __m256i);
                        let minus4_bs = _mm256_sub_epi16(_mm256_setzero_si256(), _mm256_slli_epi16(bs, 2));
                        let offset0 = _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm256_castsi256_si128(scales)), minus4_bs);
                        let offset1 = _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm256_extracti128_si256(scales, 1)), minus4_bs);
                        // Even scales then odd ones, as i16, for the chunks' scale pairs.
                        let by_parity = _mm256_shuffle_epi8(scales, parity_order);
                        let parity0 = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(by_parity));
                        let parity1 = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(by_parity, 1));
                        let sumi0 = q3k_block_sumi(b0, parity0, offset0, ab, high_tables);
                        let sumi1 = q3k_block_sumi(b1, parity1, offset1, ab, high_tables);
                        acc0 = _mm256_fmadd_ps(splat_lane(dd, 1), _mm256_cvtepi32_ps(sumi0), acc0);
                        acc1 = _mm256_fmadd_ps(splat_lane(dd, 3), _mm256_cvtepi32_ps(sumi1), acc1);
                    }
                    o[0] = hsum(acc0);
                    o[1] = hsum(acc1);
                }
                if n % 2 == 1 {
                    q3_k_n::<false, 1>(&rows[(n - 1) * rb..], &[a], &mut out[n - 1..n]);
                }
            }

            /// IQ4_XS × a tile of `N` Q8_K token rows (`WIDE`: in the order of ggml's tiled matmul).
            #[target_feature(enable = $features)]
            unsafe fn iq4_xs_n<const WIDE: bool, const N: usize>(row: &[u8], acts: &[&[BlockQ8K]], out: &mut [f32]) {
                let nb = row.len() / 136;
                let table = iq4nl_table();
                let mut acc = [_mm256_setzero_ps(); N];
                let mut acc_s = [0f32; N];
                for i in 0..nb {
                    let b = row.as_ptr().add(i * 136);
                    let d = f16_at(b);
                    let scales_h = u16::from_le_bytes([*b.add(2), *b.add(3)]);
                    let mut sumi = [_mm256_setzero_si256(); N];
                    for ib in 0..8 {
                        let ls = ((*b.add(4 + ib / 2) >> (4 * (ib % 2))) & 0xF) as i32
                            | ((((scales_h >> (2 * ib)) & 3) as i32) << 4);
                        let v = _mm256_shuffle_epi8(table, nibbles(b.add(8 + 16 * ib)));
                        let ax = _mm256_sign_epi8(v, v);
                        let s = _mm256_set1_epi16((ls - 32) as i16);
                        for t in 0..N {
                            let a = acts.get_unchecked(t).get_unchecked(i).qs.as_ptr().add(32 * ib);
                            let ay = _mm256_loadu_si256(a as *const __m256i);
                            let p = _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(ay, v)), s);
                            sumi[t] = _mm256_add_epi32(sumi[t], p);
                        }
                    }
                    for t in 0..N {
                        let a = acts.get_unchecked(t).get_unchecked(i);
                        if WIDE {
                            acc_s[t] = tiled_step(acc_s[t], hsum_i32(sumi[t]), 0, d, 0.0, a.d);
                        } else {
                            acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d * a.d), _mm256_cvtepi32_ps(sumi[t]), acc[t]);
                        }
                    }
                }
                for t in 0..N {
                    out[t] = if WIDE { acc_s[t] } else { hsum(acc[t]) };
                }
            }

            /// The eight 6-bit sub-block scales of the IQ4_XS block at `b` (unbiased, 0..64), one
            /// per byte, sub-block 0 in the low byte: nibble k of `scales_l` and 2-bit field k of
            /// `scales_h` spread to byte k by shift-and-mask steps.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn iq4_xs_scale_bytes(b: *const u8) -> u64 {
                let high = u16::from_le(std::ptr::read_unaligned(b.add(2) as *const u16)) as u64;
                let low = u32::from_le(std::ptr::read_unaligned(b.add(4) as *const u32)) as u64;
                let mut l = (low | (low << 16)) & 0x0000_FFFF_0000_FFFF;
                l = (l | (l << 8)) & 0x00FF_00FF_00FF_00FF;
                l = (l | (l << 4)) & 0x0F0F_0F0F_0F0F_0F0F;
                let mut h = (high | (high << 24)) & 0x0000_00FF_0000_00FF;
                h = (h | (h << 12)) & 0x000F_000F_000F_000F;
                h = (h | (h << 6)) & 0x0303_0303_0303_0303;
                l | (h << 4)
            }

            /// Dword `ib % 4` of each lane of `s03` (ib < 4) or `s47` in all four dwords of its lane.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn iq4_xs_pick_scale(s03: __m256i, s47: __m256i, ib: usize) -> __m256i {
                match ib {
                    0 => _mm256_shuffle_epi32(s03, 0x00),
                    1 => _mm256_shuffle_epi32(s03, 0x55),
                    2 => _mm256_shuffle_epi32(s03, 0xAA),
                    3 => _mm256_shuffle_epi32(s03, 0xFF),
                    4 => _mm256_shuffle_epi32(s47, 0x00),
                    5 => _mm256_shuffle_epi32(s47, 0x55),
                    6 => _mm256_shuffle_epi32(s47, 0xAA),
                    _ => _mm256_shuffle_epi32(s47, 0xFF),
                }
            }

            /// The sub-block scales − 32 of the IQ4_XS blocks at `b0` and `b1` (two rows), each
            /// i16 doubled into an i32 so that one `vpshufd` broadcasts it: `[row 0 sub-blocks
            /// 0..4 | row 1 sub-blocks 0..4]` and the same for sub-blocks 4..8 (one `vpshufb` each
            /// from the two rows' scale bytes, zero-extending and doubling at once).
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn iq4_xs_scales_pair(b0: *const u8, b1: *const u8) -> (__m256i, __m256i) {
                let bytes = _mm_set_epi64x(iq4_xs_scale_bytes(b1) as i64, iq4_xs_scale_bytes(b0) as i64);
                let bytes = _mm256_set_m128i(bytes, bytes);
                // Dword k of lane r: [byte, 0, byte, 0] of row r's scale k (k + 4 for `s47`).
                let pick = |k0: i32, k1: i32| {
                    let dword = |k: i32| 0x8000_8000u32 as i32 | (k << 16) | k;
                    _mm256_set_epi32(dword(k1 + 3), dword(k1 + 2), dword(k1 + 1), dword(k1), dword(k0 + 3), dword(k0 + 2), dword(k0 + 1), dword(k0))
                };
                let minus32 = _mm256_set1_epi16(32);
                (
                    _mm256_sub_epi16(_mm256_shuffle_epi8(bytes, pick(0, 8)), minus32),
                    _mm256_sub_epi16(_mm256_shuffle_epi8(bytes, pick(4, 12)), minus32),
                )
            }

            /// One token × every row of a group of IQ4_XS, two adjacent rows at a time in the
            /// "halves" layout of [`legacy_gemv_halves`] (an odd last row through
            /// `iq4_xs_n::<false, 1>`). A sub-block's 16 bytes of both rows are unpacked together:
            /// `lo` = [row 0 values 0..16 | row 1 values 0..16], `hi` = the values 16..32, dotted
            /// with the matching 16 activations in both lanes as `maddubs(|a|, sign(L, a))`: the
            /// same pair sums as `iq4_xs_n`'s `maddubs(|L|, sign(a, L))` (Q8_K values are in
            /// −127..=127, so nothing wraps, and |a·L| ≤ 127² never saturates), with `|a|` and `a`
            /// laid out once per call ([`super::Iq4XsAct`]); each weighted by `[row 0 scale | row 1 scale]`. Lanes 0..4 of a block's `lo` sum are row 0's
            /// lanes 0..4 of `iq4_xs_n`'s `sumi`, lanes 0..4 of `hi` its lanes 4..8 (lanes 4..8:
            /// row 1), so two lane permutes give each row's `sumi` exactly; then `acc =
            /// fma(d·d_a, sumi, acc)` per block and `hsum(acc)`, bit for bit `iq4_xs_n::<false, 1>`.
            /// All eight scales of both rows are unpacked at once, a block ahead (their bit
            /// twiddling is a long dependency chain), and one `vpshufd` picks a sub-block's.
            #[target_feature(enable = $features)]
            unsafe fn iq4_xs_gemv_rows(rows: &[u8], rb: usize, a: &[BlockQ8K], out: &mut [f32]) {
                const TS: usize = 136;
                let n = rows.len() / rb;
                let nb = rb / TS;
                let mut prep = super::IQ4_XS_ACTS.with(|c| c.take());
                prep.clear();
                prep.resize(nb, super::Iq4XsAct([[0; 32]; 32]));
                for (p, ab) in prep.iter_mut().zip(&a[..nb]) {
                    for ib in 0..8 {
                        let ay = _mm256_loadu_si256(ab.qs.as_ptr().add(32 * ib) as *const __m256i);
                        let abs = _mm256_abs_epi8(ay);
                        let dst = p.0.as_mut_ptr().add(4 * ib) as *mut __m256i;
                        _mm256_store_si256(dst, _mm256_permute2x128_si256(abs, abs, 0x00));
                        _mm256_store_si256(dst.add(1), _mm256_permute2x128_si256(abs, abs, 0x11));
                        _mm256_store_si256(dst.add(2), _mm256_permute2x128_si256(ay, ay, 0x00));
                        _mm256_store_si256(dst.add(3), _mm256_permute2x128_si256(ay, ay, 0x11));
                    }
                }
                let table = iq4nl_table();
                let m4 = _mm256_set1_epi8(0x0F);
                for (pair, o) in rows.chunks_exact(2 * rb).zip(out.chunks_exact_mut(2)) {
                    let (r0, r1) = (pair.as_ptr(), pair.as_ptr().add(rb));
                    let (mut acc0, mut acc1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
                    let mut scales = iq4_xs_scales_pair(r0, r1);
                    for i in 0..nb {
                        // One linear prefetch stream over the pair (see `legacy_gemv2`).
                        super::prefetch_lines(r0.wrapping_add(2 * i * TS), 2 * TS);
                        let ab = a.get_unchecked(i);
                        let act = prep.get_unchecked(i).0.as_ptr() as *const __m256i;
                        let (b0, b1) = (r0.add(i * TS), r1.add(i * TS));
                        // Lanes 0 and 2: d0·d_a, d1·d_a.
                        let dd = _mm_mul_ps(f16_quad(b0, b1), _mm_set1_ps(ab.d));
                        let (s03, s47) = scales;
                        if i + 1 < nb {
                            scales = iq4_xs_scales_pair(b0.add(TS), b1.add(TS));
                        }
                        let (mut sum_lo, mut sum_hi) = (_mm256_setzero_si256(), _mm256_setzero_si256());
                        for ib in 0..8 {
                            let v = super::pair_halves(b0.add(8 + 16 * ib), b1.add(8 + 16 * ib));
                            let lo = _mm256_shuffle_epi8(table, _mm256_and_si256(v, m4));
                            let hi = _mm256_shuffle_epi8(table, super::high_nibbles(v));
                            let s = iq4_xs_pick_scale(s03, s47, ib);
                            let (abs_lo, abs_hi) = (_mm256_load_si256(act.add(4 * ib)), _mm256_load_si256(act.add(4 * ib + 1)));
                            let (a_lo, a_hi) = (_mm256_load_si256(act.add(4 * ib + 2)), _mm256_load_si256(act.add(4 * ib + 3)));
                            let p_lo = _mm256_maddubs_epi16(abs_lo, _mm256_sign_epi8(lo, a_lo));
                            let p_hi = _mm256_maddubs_epi16(abs_hi, _mm256_sign_epi8(hi, a_hi));
                            sum_lo = _mm256_add_epi32(sum_lo, _mm256_madd_epi16(p_lo, s));
                            sum_hi = _mm256_add_epi32(sum_hi, _mm256_madd_epi16(p_hi, s));
                        }
                        let sumi0 = _mm256_permute2x128_si256(sum_lo, sum_hi, 0x20);
                        let sumi1 = _mm256_permute2x128_si256(sum_lo, sum_hi, 0x31);
                        acc0 = _mm256_fmadd_ps(splat_lane(dd, 0), _mm256_cvtepi32_ps(sumi0), acc0);
                        acc1 = _mm256_fmadd_ps(splat_lane(dd, 2), _mm256_cvtepi32_ps(sumi1), acc1);
                    }
                    o[0] = hsum(acc0);
                    o[1] = hsum(acc1);
                }
                super::IQ4_XS_ACTS.with(|c| c.replace(prep));
                if n % 2 == 1 {
                    iq4_xs_n::<false, 1>(&rows[(n - 1) * rb..], &[a], &mut out[n - 1..n]);
                }
            }

            /// Eight weights of a plain-float row as f32.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn load8<const T: u32>(p: *const u8) -> __m256 {
                const F16: u32 = GgmlType::F16 as u32;
                const BF16: u32 = GgmlType::BF16 as u32;
                match T {
                    F16 => _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)),
                    BF16 => {
                        let h = _mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i));
                        _mm256_castsi256_ps(_mm256_slli_epi32(h, 16))
                    }
                    _ => _mm256_loadu_ps(p as *const f32),
                }
            }

            /// F32/F16/BF16 row (`ES` bytes per value) × a tile of `N` f32 token rows.
            #[target_feature(enable = $features)]
            unsafe fn float_n<const T: u32, const ES: usize, const N: usize>(
                row: &[u8],
                acts: &[&[f32]],
                out: &mut [f32],
            ) {
                let n = row.len() / ES;
                let n8 = n / 8 * 8;
                let mut acc = [_mm256_setzero_ps(); N];
                let mut j = 0;
                while j < n8 {
                    let w = load8::<T>(row.as_ptr().add(j * ES));
                    for t in 0..N {
                        let x = _mm256_loadu_ps(acts.get_unchecked(t).as_ptr().add(j));
                        acc[t] = _mm256_fmadd_ps(w, x, acc[t]);
                    }
                    j += 8;
                }
                for t in 0..N {
                    // Ragged tail, one value at a time.
                    let a = acts.get_unchecked(t);
                    let mut s = hsum(acc[t]);
                    for j in n8..n {
                        s += scalar_value::<T>(row.as_ptr().add(j * ES)) * *a.get_unchecked(j);
                    }
                    out[t] = s;
                }
            }

            /// One token × two adjacent plain-float rows (`ES` bytes per value): each row keeps
            /// [`float_n`]'s order (one 8-lane FMA chain, `hsum`, then the ragged tail one value at
            /// a time), so the outputs are bit for bit those of `float_n::<T, ES, 1>`; the two
            /// independent chains hide each other's FMA latency (one chain of F16 needs 4 cycles
            /// per 16 bytes, less than DRAM delivers).
            #[target_feature(enable = $features)]
            unsafe fn float_gemv2<const T: u32, const ES: usize>(r0: &[u8], r1: &[u8], a: &[f32], out: &mut [f32]) {
                let n = r0.len() / ES;
                let n8 = n / 8 * 8;
                let (mut acc0, mut acc1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
                let mut j = 0;
                while j < n8 {
                    // One linear prefetch stream over the pair (see `legacy_gemv2`).
                    super::prefetch_linear(r0.as_ptr().wrapping_add(2 * j * ES), 16 * ES);
                    let x = _mm256_loadu_ps(a.as_ptr().add(j));
                    acc0 = _mm256_fmadd_ps(load8::<T>(r0.as_ptr().add(j * ES)), x, acc0);
                    acc1 = _mm256_fmadd_ps(load8::<T>(r1.as_ptr().add(j * ES)), x, acc1);
                    j += 8;
                }
                let (mut s0, mut s1) = (hsum(acc0), hsum(acc1));
                for j in n8..n {
                    s0 += scalar_value::<T>(r0.as_ptr().add(j * ES)) * *a.get_unchecked(j);
                    s1 += scalar_value::<T>(r1.as_ptr().add(j * ES)) * *a.get_unchecked(j);
                }
                out[0] = s0;
                out[1] = s1;
            }

            /// One weight of a plain-float row as f32.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn scalar_value<const T: u32>(p: *const u8) -> f32 {
                const F16: u32 = GgmlType::F16 as u32;
                const BF16: u32 = GgmlType::BF16 as u32;
                match T {
                    F16 => half::f16::from_bits(u16::from_le_bytes([*p, *p.add(1)])).to_f32(),
                    BF16 => half::bf16::from_bits(u16::from_le_bytes([*p, *p.add(1)])).to_f32(),
                    _ => f32::from_le_bytes([*p, *p.add(1), *p.add(2), *p.add(3)]),
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

            /// Rows × Q8 tile for a legacy format, Q1_0 or IQ4_NL.
            pub(crate) fn rows_q8(t: GgmlType, rows: &[u8], rb: usize, acts: &[&[BlockQ8]], out: &mut [f32]) {
                let subs = t.block_size() / 32;
                if !checked(rows, rb, t.type_size(), subs, acts, out, 8) {
                    return super::super::dispatch::each_row(super::super::scalar::dot_q8, t, rows, rb, acts, out);
                }
                const Q4_0: u32 = GgmlType::Q4_0 as u32;
                const Q4_1: u32 = GgmlType::Q4_1 as u32;
                const Q5_0: u32 = GgmlType::Q5_0 as u32;
                const Q5_1: u32 = GgmlType::Q5_1 as u32;
                const Q8_0: u32 = GgmlType::Q8_0 as u32;
                const IQ4_NL: u32 = GgmlType::IQ4_NL as u32;
                match t {
                    GgmlType::Q4_0 => legacy_rows!(Q4_0, 18; rows, rb, acts, out),
                    GgmlType::Q4_1 => legacy_rows!(Q4_1, 20; rows, rb, acts, out),
                    GgmlType::Q5_0 => legacy_rows!(Q5_0, 22; rows, rb, acts, out),
                    GgmlType::Q5_1 => legacy_rows!(Q5_1, 24; rows, rb, acts, out),
                    GgmlType::Q8_0 => legacy_rows!(Q8_0, 34; rows, rb, acts, out),
                    GgmlType::IQ4_NL => legacy_rows!(IQ4_NL, 18; rows, rb, acts, out),
                    // SAFETY: as in `tile!`: features checked by dispatch, slices by `checked`.
                    GgmlType::Q1_0 if acts.len() == 1 => unsafe { q1_0_gemv_rows(rows, rb, acts[0], out) },
                    GgmlType::Q1_0 => tile_wide!(q1_0_n; rows, rb, acts, out),
                    _ => super::super::dispatch::each_row(super::super::scalar::dot_q8, t, rows, rb, acts, out),
                }
            }

            /// Rows × Q8_K tile for a K-quant or IQ4_XS, in the float order ggml uses for
            /// calls of fewer than 8 tokens (its `vec_dot` kernels; Q4_K: its repacked kernels).
            pub(crate) fn rows_q8k(t: GgmlType, rows: &[u8], rb: usize, acts: &[&[BlockQ8K]], out: &mut [f32]) {
                rows_q8k_order::<false>(t, rows, rb, acts, out)
            }

            /// The same for calls of 8 tokens or more, in the order of ggml's tiled K-quant
            /// matmul (Q4_K: its repacked kernels, as for fewer tokens).
            pub(crate) fn rows_q8k_wide(t: GgmlType, rows: &[u8], rb: usize, acts: &[&[BlockQ8K]], out: &mut [f32]) {
                rows_q8k_order::<true>(t, rows, rb, acts, out)
            }

            fn rows_q8k_order<const WIDE: bool>(t: GgmlType, rows: &[u8], rb: usize, acts: &[&[BlockQ8K]], out: &mut [f32]) {
                if !checked(rows, rb, t.type_size(), 1, acts, out, 4) {
                    return super::super::dispatch::each_row(super::super::scalar::dot_q8k, t, rows, rb, acts, out);
                }
                match t {
                    // One token in the `vec_dot` order (Q4_K: the repacked GEMV order): two rows at a time.
                    GgmlType::Q2_K | GgmlType::Q3_K | GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K | GgmlType::IQ4_XS
                        if !WIDE && acts.len() == 1 =>
                    {
                        // SAFETY: as in `tile!`: features checked by dispatch, slices by `checked`.
                        unsafe {
                            match t {
                                GgmlType::Q2_K => q2_k_gemv_rows(rows, rb, acts[0], out),
                                GgmlType::Q3_K => q3_k_gemv_rows(rows, rb, acts[0], out),
                                GgmlType::Q4_K => q4_k_gemv_rows(rows, rb, acts[0], out),
                                GgmlType::Q5_K => q5_k_gemv_rows(rows, rb, acts[0], out),
                                GgmlType::Q6_K => q6_k_gemv_rows(rows, rb, acts[0], out),
                                _ => iq4_xs_gemv_rows(rows, rb, acts[0], out),
                            }
                        }
                    }
                    GgmlType::Q2_K => tile!(q2_k_n, WIDE; rows, rb, acts, out),
                    GgmlType::Q3_K => tile!(q3_k_n, WIDE; rows, rb, acts, out),
                    GgmlType::Q4_K if acts.len() == 4 => {
                        // Pairs of rows through the 2×4 tile, an odd last row alone.
                        let n = rows.len() / rb;
                        // SAFETY: the caller (dispatch) checked the host supports this module's
                        // features, and `checked` verified every slice the kernels index.
                        unsafe {
                            for (pair, o) in rows.chunks_exact(2 * rb).zip(out.chunks_exact_mut(8)) {
                                q4_k_2x4(&pair[..rb], &pair[rb..], acts, o);
                            }
                            if n % 2 == 1 {
                                q4_k_n::<4>(&rows[(n - 1) * rb..], acts, &mut out[4 * (n - 1)..4 * n]);
                            }
                        }
                    }
                    GgmlType::Q4_K => tile!(q4_k_n; rows, rb, acts, out),
                    GgmlType::Q5_K => tile!(q5_k_n, WIDE; rows, rb, acts, out),
                    GgmlType::Q6_K => tile!(q6_k_n, WIDE; rows, rb, acts, out),
                    GgmlType::IQ4_XS => tile!(iq4_xs_n, WIDE; rows, rb, acts, out),
                    _ => super::super::dispatch::each_row(super::super::scalar::dot_q8k, t, rows, rb, acts, out),
                }
            }

            /// Rows × f32 tile for F32/F16/BF16.
            pub(crate) fn rows_f32(t: GgmlType, rows: &[u8], rb: usize, acts: &[&[f32]], out: &mut [f32]) {
                if !checked(rows, rb, t.type_size(), 1, acts, out, 4) {
                    return super::super::dispatch::each_row(super::super::scalar::dot_f32, t, rows, rb, acts, out);
                }
                const F32: u32 = GgmlType::F32 as u32;
                const F16: u32 = GgmlType::F16 as u32;
                const BF16: u32 = GgmlType::BF16 as u32;
                match t {
                    GgmlType::F32 => float_rows!(F32, 4; rows, rb, acts, out),
                    GgmlType::F16 => float_rows!(F16, 2; rows, rb, acts, out),
                    GgmlType::BF16 => float_rows!(BF16, 2; rows, rb, acts, out),
                    _ => super::super::dispatch::each_row(super::super::scalar::dot_f32, t, rows, rb, acts, out),
                }
            }
        }
    };
}

x86_kernels!(avx2, "avx2,fma,f16c", super::mul_sum_maddubs);
x86_kernels!(
    avx512,
    "avx2,fma,f16c,avx512f,avx512bw,avx512vl",
    super::mul_sum_maddubs
);
x86_kernels!(
    vnni,
    "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni",
    super::mul_sum_vnni
);
