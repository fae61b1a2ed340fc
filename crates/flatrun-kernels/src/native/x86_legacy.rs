//! x86 kernels for the 32-value block formats against Q8 activations: Q4_0,
//! Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL and Q1_0 (see `x86.rs` for the levels and
//! the safety contract). `legacy_kernels!` is expanded once per level inside
//! `x86.rs`'s level modules; the activation layout below is shared by them.

/// One Q8 activation block as the one-token 4/5-bit legacy kernels read it
/// (`legacy_gemv_halves`), everything a block needs in two cache lines: its values, the offset
/// sums of Q4_0 already in both 128-bit lanes, and its `d` and `s` four times each (plain
/// loads instead of broadcasts in the loop).
#[repr(C, align(32))]
#[derive(Clone, Copy)]
pub(super) struct HalvesAct {
    /// The block's 32 values.
    pub(super) qs: [i8; 32],
    /// Q4_0: the offset 8 times each four values' sum, values 0..16 (four i32 lanes) in both
    /// lanes; unused for the other formats.
    pub(super) off_lo: [i32; 8],
    /// The same for values 16..32.
    pub(super) off_hi: [i32; 8],
    /// The block's scale `d`, four times.
    pub(super) d: [f32; 4],
    /// The block's `s` (`d · Σ q`), four times.
    pub(super) s: [f32; 4],
}

impl HalvesAct {
    pub(super) const ZERO: HalvesAct = HalvesAct {
        qs: [0; 32],
        off_lo: [0; 8],
        off_hi: [0; 8],
        d: [0.0; 4],
        s: [0.0; 4],
    };
}

thread_local! {
    /// Per thread: the one-token activations as [`HalvesAct`] blocks, reused across calls.
    pub(super) static HALVES_ACTS: std::cell::RefCell<Vec<HalvesAct>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// One token over a group of legacy-format rows: two rows at a time, through
/// `legacy_gemv_halves` (4/5-bit formats) or `legacy_gemv2` (Q8_0), an odd last row through
/// `legacy_n::<.., 1>`; otherwise the token tiles of [`tile!`].
macro_rules! legacy_rows {
    ($t:expr, $ts:expr; $rows:expr, $rb:expr, $acts:expr, $out:expr) => {{
        let (rows, rb, acts, out) = ($rows, $rb, $acts, $out);
        if acts.len() == 1 && $t != GgmlType::Q8_0 as u32 && $t != GgmlType::MXFP4 as u32 {
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

/// The legacy-format kernels of one x86 level and its `rows_q8` entry point, expanded by
/// `x86_level!` inside each level module: `$features` is the level's `#[target_feature]`
/// list, `$mul_sum` its `u8 × i8` dot (`vpmaddubsw` + `vpmaddwd`, or `vpdpbusd`).
macro_rules! legacy_kernels {
    ($features:literal, $mul_sum:path) => {
        /// 32 bits at `p` → 32 bytes, 0xFF where the bit is set.
        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn bits_to_bytes(p: *const u8) -> __m256i {
            // SAFETY: the caller upholds the module's contract (see `x86.rs`): the CPU has
            // this level's features, and every pointer read below lies inside the caller's
            // rows (whole blocks), its activation rows, or this function's own buffers.
            unsafe {
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
        }

        /// The codebook of format `T` for [`legacy_block`]: MXFP4's levels, else IQ4_NL's.
        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn levels_table<const T: u32>() -> __m256i {
            // SAFETY: the CPU has this level's features (the module's contract).
            unsafe { if T == GgmlType::MXFP4 as u32 { fp4_table() } else { iq4nl_table() } }
        }

        /// 32 weights of one legacy block as bytes (`i8`, or `u8` for the formats with a min),
        /// with the block's scale and min.
        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn legacy_block<const T: u32>(b: *const u8, table: __m256i) -> (__m256i, f32, f32) {
            // SAFETY: the caller upholds the module's contract (see `x86.rs`): the CPU has
            // this level's features, and every pointer read below lies inside the caller's
            // rows (whole blocks), its activation rows, or this function's own buffers.
            unsafe {
                const Q4_0: u32 = GgmlType::Q4_0 as u32;
                const Q4_1: u32 = GgmlType::Q4_1 as u32;
                const Q5_0: u32 = GgmlType::Q5_0 as u32;
                const Q5_1: u32 = GgmlType::Q5_1 as u32;
                const Q8_0: u32 = GgmlType::Q8_0 as u32;
                const IQ4_NL: u32 = GgmlType::IQ4_NL as u32;
                const MXFP4: u32 = GgmlType::MXFP4 as u32;
                match T {
                    Q4_0 => (_mm256_sub_epi8(nibbles(b.add(BlockQ4_0::QS_OFFSET)), _mm256_set1_epi8(8)), f16_at(b), 0.0),
                    Q4_1 => {
                        let (d, m) = f16_pair(b);
                        (nibbles(b.add(BlockQ4_1::QS_OFFSET)), d, m)
                    }
                    Q5_0 => {
                        // Missing fifth bit ⇒ value − 16, i.e. the high nibble 0xF0 in two's complement.
                        let hi = _mm256_andnot_si256(bits_to_bytes(b.add(BlockQ5_0::QH_OFFSET)), _mm256_set1_epi8(0xF0u8 as i8));
                        (_mm256_or_si256(nibbles(b.add(BlockQ5_0::QS_OFFSET)), hi), f16_at(b), 0.0)
                    }
                    Q5_1 => {
                        let hi = _mm256_and_si256(bits_to_bytes(b.add(BlockQ5_1::QH_OFFSET)), _mm256_set1_epi8(0x10));
                        let (d, m) = f16_pair(b);
                        (_mm256_or_si256(nibbles(b.add(BlockQ5_1::QS_OFFSET)), hi), d, m)
                    }
                    Q8_0 => (_mm256_loadu_si256(b.add(BlockQ8_0::QS_OFFSET) as *const __m256i), f16_at(b), 0.0),
                    IQ4_NL => (_mm256_shuffle_epi8(table, nibbles(b.add(BlockIq4Nl::QS_OFFSET))), f16_at(b), 0.0),
                    // The exponent byte, then 16 bytes of nibbles (`table` holds the FP4 levels).
                    MXFP4 => (_mm256_shuffle_epi8(table, nibbles(b.add(1))), flatrun_dequant::blocks::fp4::e8m0_to_f32_half(*b), 0.0),
                    _ => (_mm256_setzero_si256(), 0.0, 0.0),
                }
            }
        }

        /// One token × two rows of legacy format `T` (32-value blocks of `TS` bytes). Each row
        /// is ggml's single chain `acc = fma(d_w·d_a, Σ q_w·q_a, acc)`, then `hsum(acc) + Σ m·s`
        /// (the mins also by FMA, as GCC compiles `summs += m·s`), bit for bit
        /// `ggml_vec_dot_*_q8_*`; the two independent rows hide the FMA latency of one chain.
        #[target_feature(enable = $features)]
        unsafe fn legacy_gemv2<const T: u32, const TS: usize>(r0: &[u8], r1: &[u8], a: &[BlockQ8], out: &mut [f32]) {
            // SAFETY: the caller upholds the module's contract (see `x86.rs`): the CPU has
            // this level's features, and every pointer read below lies inside the caller's
            // rows (whole blocks), its activation rows, or this function's own buffers.
            unsafe {
                let unsigned = T == GgmlType::Q4_1 as u32 || T == GgmlType::Q5_1 as u32;
                let table = levels_table::<T>();
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
            // SAFETY: the caller upholds the module's contract (see `x86.rs`): the CPU has
            // this level's features, and every pointer read below lies inside the caller's
            // rows (whole blocks), its activation rows, or this function's own buffers.
            unsafe {
                const Q4_1: u32 = GgmlType::Q4_1 as u32;
                const Q5_0: u32 = GgmlType::Q5_0 as u32;
                const Q5_1: u32 = GgmlType::Q5_1 as u32;
                const IQ4_NL: u32 = GgmlType::IQ4_NL as u32;
                let qs = match T {
                    Q4_1 => BlockQ4_1::QS_OFFSET,
                    Q5_0 => BlockQ5_0::QS_OFFSET,
                    Q5_1 => BlockQ5_1::QS_OFFSET,
                    _ => BlockQ4_0::QS_OFFSET,
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
                    let qh = if T == Q5_0 { BlockQ5_0::QH_OFFSET } else { BlockQ5_1::QH_OFFSET };
                        let h = qh as i64 * 0x0101_0101_0101_0101;
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
            // SAFETY: the caller upholds the module's contract (see `x86.rs`): the CPU has
            // this level's features, and every pointer read below lies inside the caller's
            // rows (whole blocks), its activation rows, or this function's own buffers.
            unsafe {
                const Q5_0: u32 = GgmlType::Q5_0 as u32;
                let n = rows.len() / rb;
                let nb = rb / TS;
                let offset: i8 = if T == GgmlType::Q4_0 as u32 { 8 } else { 0 };
                // The activations once per call as the loop reads them; the offset sums exact
                // (at most 8 · 4 · 127).
                let mut prep = super::legacy::HALVES_ACTS.with(|c| c.take());
                prep.clear();
                prep.resize(nb, super::legacy::HalvesAct::ZERO);
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
                super::legacy::HALVES_ACTS.with(|c| c.replace(prep));
                if n % 2 == 1 {
                    legacy_n::<T, TS, 1>(&rows[(n - 1) * rb..], &[a], &mut out[n - 1..n]);
                }
            }
        }

        /// Row pairs `pairs` (a multiple of `P` of them) of [`legacy_gemv_halves`], `P`
        /// adjacent pairs per pass: the activation loads and the prefetch stream serve all
        /// `2P` rows. `a` is the token's activations prepared once per call
        /// ([`super::legacy::HalvesAct`]: halves already in both lanes, offset sums, `d` and `s`).
        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn halves_pair_runs<const T: u32, const TS: usize, const P: usize>(
            rows: *const u8,
            rb: usize,
            a: &[super::legacy::HalvesAct],
            pairs: std::ops::Range<usize>,
            out: &mut [f32],
        ) {
            // SAFETY: the caller upholds the module's contract (see `x86.rs`): the CPU has
            // this level's features, and every pointer read below lies inside the caller's
            // rows (whole blocks), its activation rows, or this function's own buffers.
            unsafe {
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
                            let d4 = _mm_cvtph_ps(super::vmovq_to_xmm(bits));
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
        }

        /// Legacy format `T` (32-value blocks of `TS` bytes) × a tile of `N` Q8 token rows.
        #[target_feature(enable = $features)]
        unsafe fn legacy_n<const T: u32, const TS: usize, const N: usize>(
            row: &[u8],
            acts: &[&[BlockQ8]],
            out: &mut [f32],
        ) {
            // SAFETY: the caller upholds the module's contract (see `x86.rs`): the CPU has
            // this level's features, and every pointer read below lies inside the caller's
            // rows (whole blocks), its activation rows, or this function's own buffers.
            unsafe {
                // Formats with a min store unsigned values: no sign trick needed.
                let unsigned = T == GgmlType::Q4_1 as u32 || T == GgmlType::Q5_1 as u32;
                let table = levels_table::<T>();
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
        }

        /// Q1_0 (128 sign bits per block, one scale) × a tile of `N` Q8 token rows, in the
        /// float order of ggml's AVX2 `ggml_vec_dot_q1_0_q8_0` (llama.cpp 0.3.36, which has no
        /// other x86 path and repacks Q1_0 only on Arm): per 128-value block, the four Q8
        /// sub-blocks' lane sums `c_k` (eight i32 lanes of four values each) are chained as
        /// `blk = d_a0·c_0`, `blk = fma(d_ak, c_k, blk)` for k = 1, 2, 3, then
        /// `acc = fma(d_w, blk, acc)`; `hsum(acc)` at the end (`tests/q1_0_order.rs`).
        /// Each `d_a·c` is exact (an f16 scale times an integer below 2^10), so what this
        /// fixes is how the sums associate: one FMA per 32 values into a single
        /// accumulator instead moves Bonsai's logits by up to 0.15.
        #[target_feature(enable = $features)]
        unsafe fn q1_0_n<const N: usize>(row: &[u8], acts: &[&[BlockQ8]], out: &mut [f32]) {
            // SAFETY: the caller upholds the module's contract (see `x86.rs`): the CPU has
            // this level's features, and every pointer read below lies inside the caller's
            // rows (whole blocks), its activation rows, or this function's own buffers.
            unsafe {
                let nb = row.len() / BlockQ1_0::BLOCK_BYTES;
                let ones = _mm256_set1_epi8(1);
                let mut acc = [_mm256_setzero_ps(); N];
                for i in 0..nb {
                    let b = row.as_ptr().add(i * BlockQ1_0::BLOCK_BYTES);
                    let mut blk = [_mm256_setzero_ps(); N];
                    for sub in 0..4 {
                        // ±1 per bit: 0xFF&2 − 1 = +1, 0 − 1 = −1.
                        let mask = bits_to_bytes(b.add(BlockQ1_0::QS_OFFSET + 4 * sub));
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
            // SAFETY: the caller upholds the module's contract (see `x86.rs`): the CPU has
            // this level's features, and every pointer read below lies inside the caller's
            // rows (whole blocks), its activation rows, or this function's own buffers.
            unsafe {
                const R: usize = Q1_ROWS;
                let n = rows.len() / rb;
                const TS: usize = BlockQ1_0::BLOCK_BYTES;
                    let nb = rb / TS;
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
                        super::prefetch_linear(base.wrapping_add(R * i * TS), R * TS);
                        let block = |r: usize| base.add(r * rb + i * TS);
                        // Each row's 128 bits in both lanes: one load serves its four sub-blocks.
                        let bits: [__m256i; R] = std::array::from_fn(|r| _mm256_broadcastsi128_si256(_mm_loadu_si128(block(r).add(BlockQ1_0::QS_OFFSET) as *const __m128i)));
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
                        let halves = super::vmovq_to_xmm(packed);
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
            const MXFP4: u32 = GgmlType::MXFP4 as u32;
            match t {
                GgmlType::Q4_0 => legacy_rows!(Q4_0, { BlockQ4_0::BLOCK_BYTES }; rows, rb, acts, out),
                GgmlType::Q4_1 => legacy_rows!(Q4_1, { BlockQ4_1::BLOCK_BYTES }; rows, rb, acts, out),
                GgmlType::Q5_0 => legacy_rows!(Q5_0, { BlockQ5_0::BLOCK_BYTES }; rows, rb, acts, out),
                GgmlType::Q5_1 => legacy_rows!(Q5_1, { BlockQ5_1::BLOCK_BYTES }; rows, rb, acts, out),
                GgmlType::Q8_0 => legacy_rows!(Q8_0, { BlockQ8_0::BLOCK_BYTES }; rows, rb, acts, out),
                GgmlType::IQ4_NL => legacy_rows!(IQ4_NL, { BlockIq4Nl::BLOCK_BYTES }; rows, rb, acts, out),
                GgmlType::MXFP4 => legacy_rows!(MXFP4, { BlockMxfp4::BLOCK_BYTES }; rows, rb, acts, out),
                // SAFETY: as in `tile!`: features checked by dispatch, slices by `checked`.
                GgmlType::Q1_0 if acts.len() == 1 => unsafe { q1_0_gemv_rows(rows, rb, acts[0], out) },
                GgmlType::Q1_0 => tile_wide!(q1_0_n; rows, rb, acts, out),
                _ => super::super::dispatch::each_row(super::super::scalar::dot_q8, t, rows, rb, acts, out),
            }
        }
    };
}
