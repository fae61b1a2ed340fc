//! x86 kernels for the 256-value super-block formats against Q8_K
//! activations: Q2_K, Q3_K, Q4_K, Q5_K, Q6_K and IQ4_XS (see `x86.rs` for the
//! levels and the safety contract). `kquant_kernels!` is expanded once per
//! level inside `x86.rs`'s level modules; the tables below are shared by them.

/// One Q8_K activation block (256 values) as the one-token IQ4_XS kernel reads it
/// (`iq4_xs_gemv_rows`): for each 32-value sub-block `ib`, rows `4·ib ..` hold `|a|` of values
/// 0..16, `|a|` of values 16..32, then `a` of values 0..16 and 16..32, each 16 bytes twice (both
/// 128-bit lanes), so the loop reads them with plain loads instead of broadcasts.
#[repr(C, align(32))]
#[derive(Clone, Copy)]
pub(super) struct Iq4XsAct(pub(super) [[i8; 32]; 32]);

thread_local! {
    /// Per thread: the one-token activations as [`Iq4XsAct`] blocks, reused across calls.
    pub(super) static IQ4_XS_ACTS: std::cell::RefCell<Vec<Iq4XsAct>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The 32-byte `vpshufb` patterns of the one-token Q3_K kernel, read as memory operands
/// (see [`shuffle_bytes_at`]).
#[repr(C, align(32))]
pub(super) struct Q3kPatterns {
    /// Word c of each lane (c = 0..8): chunk c's pair of scales from the scales by
    /// parity (see [`q3k_block_sumi`]).
    pub(super) chunk_scales: [[u8; 32]; 8],
    /// Byte j of each lane ← the scale byte holding the low 4 bits of scale j
    /// (`s[j % 8]`, at 2 + j % 8 of a load from block byte 94), and the one holding its
    /// top 2 bits (`s[8 + j % 4]`, at 10 + j % 4); see [`q3k_scales_pair`].
    pub(super) scale_low_bytes: [u8; 32],
    pub(super) scale_high_bytes: [u8; 32],
}

pub(super) static Q3K_PATTERNS: Q3kPatterns = {
    let mut p = Q3kPatterns {
        chunk_scales: [[0; 32]; 8],
        scale_low_bytes: [0; 32],
        scale_high_bytes: [0; 32],
    };
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

/// The K-quant and IQ4_XS kernels of one x86 level and its `rows_q8k` / `rows_q8k_wide`
/// entry points, expanded by `x86_level!` inside each level module (`$features`: the
/// level's `#[target_feature]` list; `$zmm`: whether the level multiplies Q4_K row pairs
/// with [`q4_k_2x4_zmm`], which needs AVX-512 VNNI).
macro_rules! kquant_kernels {
    ($features:literal, $zmm:literal) => {
        /// The f16 at `p` (reads `p - 2 .. p + 2`: only for scales not at the start of a block).
        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn f16_after(p: *const u8) -> f32 {
            // SAFETY: the caller upholds the module's contract (see `x86.rs`): the CPU has
            // this level's features, and every pointer read below lies inside the caller's
            // rows (whole blocks), its activation rows, or this function's own buffers.
            unsafe {
                f16_pair(p.sub(2)).1
            }
        }

        /// Two i16 scales: `lo` for the first 16 bytes of a 32-byte vector, `hi` for the rest.
        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn scales16(lo: i32, hi: i32) -> __m256i {
            _mm256_set_m128i(_mm_set1_epi16(hi as i16), _mm_set1_epi16(lo as i16))
        }

        /// `Σ` over 16-byte halves: `madd(maddubs(q, a), scales)` as 8 i32 lanes.
        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn scaled_dot(q: __m256i, a: *const i8, sc: __m256i) -> __m256i {
            // SAFETY: the caller upholds the module's contract (see `x86.rs`): the CPU has
            // this level's features, and every pointer read below lies inside the caller's
            // rows (whole blocks), its activation rows, or this function's own buffers.
            unsafe {
                let a = _mm256_loadu_si256(a as *const __m256i);
                _mm256_madd_epi16(_mm256_maddubs_epi16(q, a), sc)
            }
        }

        /// The eight 6-bit scales and mins of a Q4_K/Q5_K block (12 bytes at `p`), unpacked
        /// with whole-word masks: the scales as i16 in both 128-bit lanes (for `vpshufb`
        /// broadcasts), and the mins as eight i16.
        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn k4_scales_mins(p: *const u8) -> (__m256i, __m128i) {
            // SAFETY: the caller upholds the module's contract (see `x86.rs`): the CPU has
            // this level's features, and every pointer read below lies inside the caller's
            // rows (whole blocks), its activation rows, or this function's own buffers.
            unsafe {
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
            // SAFETY: the caller upholds the module's contract (see `x86.rs`): the CPU has
            // this level's features, and every pointer read below lies inside the caller's
            // rows (whole blocks), its activation rows, or this function's own buffers.
            unsafe {
                let bs = _mm256_loadu_si256(a.bsums.as_ptr() as *const __m256i);
                let pairs = _mm_hadd_epi16(_mm256_castsi256_si128(bs), _mm256_extracti128_si256(bs, 1));
                _mm_madd_epi16(mins, pairs)
            }
        }

        /// Horizontal sum of 8 i32 lanes (exact).
        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn hsum_i32(v: __m256i) -> i32 {
            // SAFETY: the caller upholds the module's contract (see `x86.rs`): the CPU has
            // this level's features, and every pointer read below lies inside the caller's
            // rows (whole blocks), its activation rows, or this function's own buffers.
            unsafe {
                hsum128_i32(_mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)))
            }
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
            // SAFETY: the caller upholds the module's contract (see `x86.rs`): the CPU has
            // this level's features, and every pointer read below lies inside the caller's
            // rows (whole blocks), its activation rows, or this function's own buffers.
            unsafe {
                let nb = row.len() / BlockQ4K::BLOCK_BYTES;
                let m4 = _mm256_set1_epi8(0x0F);
                let mut acc = [0f32; N];
                let mut acc_m = [0f32; N];
                for i in 0..nb {
                    let b = row.as_ptr().add(i * BlockQ4K::BLOCK_BYTES);
                    let (d, dmin) = f16_pair(b);
                    let (scales, mins) = k4_scales_mins(b.add(BlockQ4K::SCALES_OFFSET));
                    // Integer sums of each 64-value chunk, per token (8 lanes each).
                    let mut chunk = [[_mm256_setzero_si256(); 4]; N];
                    for c in 0..4 {
                        // 64 values: low nibbles (scale 2c), then high nibbles (scale 2c+1).
                        let q = _mm256_loadu_si256(b.add(BlockQ4K::QS_OFFSET + 32 * c) as *const __m256i);
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
        }

        /// Two Q4_K rows × a full tile of 4 Q8_K token rows: bit for bit the outputs of
        /// `q4_k_n::<4>` (the order of ggml's repacked GEMM: per output, one FMA per 64 values
        /// into a scale and a min accumulator), with the eight (row, token) outputs in the
        /// lanes of one vector (lane 4·row + token, which is also their place in `out`). Each
        /// 64-value chunk's eight integer sums are reduced by one transposing `vphaddd` tree
        /// and its FMAs run for all eight outputs at once, where `q4_k_n` takes horizontal
        /// sums and scalar FMAs per output; the activation loads serve both rows.
        ///
        /// `ONE_TOKEN`: each output in the one-token order instead (`q4_k_n::<1>`'s, ggml's
        /// repacked GEMV order: one FMA per 256 values), the four chunks' exact integer sums
        /// added before their FMA; a speculative verification pass multiplies its tiles so.
        #[target_feature(enable = $features)]
        unsafe fn q4_k_2x4<const ONE_TOKEN: bool>(r0: &[u8], r1: &[u8], acts: &[&[BlockQ8K]], out: &mut [f32]) {
            // SAFETY: the caller upholds the module's contract (see `x86.rs`): the CPU has
            // this level's features, and every pointer read below lies inside the caller's
            // rows (whole blocks), its activation rows, or this function's own buffers.
            unsafe {
                let nb = r0.len() / BlockQ4K::BLOCK_BYTES;
                let m4 = _mm256_set1_epi8(0x0F);
                let mut acc = _mm256_setzero_ps();
                let mut acc_m = _mm256_setzero_ps();
                for i in 0..nb {
                    let b = [r0.as_ptr().add(i * BlockQ4K::BLOCK_BYTES), r1.as_ptr().add(i * BlockQ4K::BLOCK_BYTES)];
                    let a: [&BlockQ8K; 4] = std::array::from_fn(|t| acts.get_unchecked(t).get_unchecked(i));
                    let (d0, dmin0) = f16_pair(b[0]);
                    let (d1, dmin1) = f16_pair(b[1]);
                    let (sc0, mn0) = k4_scales_mins(b[0].add(BlockQ4K::SCALES_OFFSET));
                    let (sc1, mn1) = k4_scales_mins(b[1].add(BlockQ4K::SCALES_OFFSET));
                    // Per lane: d_w·d_a and dmin_w·d_a, the same f32 products as `q4_k_n`.
                    let da = _mm_setr_ps(a[0].d, a[1].d, a[2].d, a[3].d);
                    let da = _mm256_set_m128(da, da);
                    let dd = _mm256_mul_ps(_mm256_set_m128(_mm_set1_ps(d1), _mm_set1_ps(d0)), da);
                    let dm = _mm256_mul_ps(_mm256_set_m128(_mm_set1_ps(dmin1), _mm_set1_ps(dmin0)), da);
                    // Scale sums: for each 64-value chunk, the eight outputs' integer sums, then one
                    // FMA (one-token order: one FMA of the block's exact sum).
                    let mut block_sum = _mm256_setzero_si256();
                    for c in 0..4 {
                        let mut g = [_mm256_setzero_si256(); 2];
                        for (r, sc) in [sc0, sc1].into_iter().enumerate() {
                            // 64 values: low nibbles (scale 2c), then high nibbles (scale 2c+1).
                            let q = _mm256_loadu_si256(b[r].add(BlockQ4K::QS_OFFSET + 32 * c) as *const __m256i);
                            let lo = _mm256_and_si256(q, m4);
                            let hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
                            let (s_lo, s_hi) = (k4_scale(sc, 2 * c), k4_scale(sc, 2 * c + 1));
                            g[r] = half_sums4(std::array::from_fn(|t| {
                                let p = a[t].qs.as_ptr().add(64 * c);
                                _mm256_add_epi32(scaled_dot(lo, p, s_lo), scaled_dot(hi, p.add(32), s_hi))
                            }));
                        }
                        let sums = join_halves(g[0], g[1]);
                        if ONE_TOKEN {
                            block_sum = _mm256_add_epi32(block_sum, sums);
                        } else {
                            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), dd, acc);
                        }
                    }
                    if ONE_TOKEN {
                        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(block_sum), dd, acc);
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
                    let chunks = [
                        _mm256_unpacklo_epi64(m01l, m23l),
                        _mm256_unpackhi_epi64(m01l, m23l),
                        _mm256_unpacklo_epi64(m01h, m23h),
                        _mm256_unpackhi_epi64(m01h, m23h),
                    ];
                    if ONE_TOKEN {
                        let all = _mm256_add_epi32(_mm256_add_epi32(chunks[0], chunks[1]), _mm256_add_epi32(chunks[2], chunks[3]));
                        acc_m = _mm256_fmadd_ps(_mm256_cvtepi32_ps(all), dm, acc_m);
                    } else {
                        for mc in chunks {
                            acc_m = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mc), dm, acc_m);
                        }
                    }
                }
                _mm256_storeu_ps(out.as_mut_ptr(), _mm256_sub_ps(acc, acc_m));
            }
        }

        /// [`q4_k_2x4`] on 512-bit registers, for CPUs with AVX-512 VNNI: the same outputs, bit
        /// for bit (every integer sum is exact, and each output's FMAs are the same, in the
        /// same order). One register holds a 64-value chunk's nibbles of both rows (row 0 in
        /// the low half) against a token's activations in both halves, so each `vpmaddubsw`
        /// does both rows' work, and `vpdpwssd` applies the scales and adds in one
        /// instruction (`vpmaddwd` + `vpaddd` before). Each token's sums are reduced by one
        /// transposing tree of unpacks to the tile's eight outputs (lane 4·row + token).
        /// `ONE_TOKEN`: the one-token order, each token's four chunk sums added (exact)
        /// before the one reduction and FMA of the block.
        #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
        unsafe fn q4_k_2x4_zmm<const ONE_TOKEN: bool>(r0: &[u8], r1: &[u8], acts: &[&[BlockQ8K]], out: &mut [f32]) {
            // SAFETY: as `q4_k_2x4` (the module's contract); the caller also promises the CPU
            // has AVX-512 F/BW/VL and VNNI (only the VNNI level calls this).
            unsafe {
                /// Per 128-bit lane L of the result, `[Σ_L v0, Σ_L v1, Σ_L v2, Σ_L v3]`; then
                /// lanes 0+1 (row 0) and 2+3 (row 1) added: `[row 0: t0..t4 | row 1: t0..t4]`.
                #[inline]
                #[target_feature(enable = "avx2,avx512f")]
                unsafe fn reduce(v: [__m512i; 4]) -> __m256i {
                    let x01 = _mm512_add_epi32(_mm512_unpacklo_epi32(v[0], v[1]), _mm512_unpackhi_epi32(v[0], v[1]));
                    let x23 = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2], v[3]), _mm512_unpackhi_epi32(v[2], v[3]));
                    let y = _mm512_add_epi32(_mm512_unpacklo_epi64(x01, x23), _mm512_unpackhi_epi64(x01, x23));
                    // [L0 L2 | L1 L3], then the two 256-bit halves added.
                    let z = _mm512_shuffle_i32x4::<0b11_01_10_00>(y, y);
                    _mm256_add_epi32(_mm512_castsi512_si256(z), _mm512_extracti64x4_epi64::<1>(z))
                }
                use super::panel::dpwssd;
                let nb = r0.len() / BlockQ4K::BLOCK_BYTES;
                let m4 = _mm512_set1_epi8(0x0F);
                let mut acc = _mm256_setzero_ps();
                let mut acc_m = _mm256_setzero_ps();
                for i in 0..nb {
                    let b = [r0.as_ptr().add(i * BlockQ4K::BLOCK_BYTES), r1.as_ptr().add(i * BlockQ4K::BLOCK_BYTES)];
                    let a: [&BlockQ8K; 4] = std::array::from_fn(|t| acts.get_unchecked(t).get_unchecked(i));
                    let (d0, dmin0) = f16_pair(b[0]);
                    let (d1, dmin1) = f16_pair(b[1]);
                    let (sc0, mn0) = k4_scales_mins(b[0].add(BlockQ4K::SCALES_OFFSET));
                    let (sc1, mn1) = k4_scales_mins(b[1].add(BlockQ4K::SCALES_OFFSET));
                    let da = _mm_setr_ps(a[0].d, a[1].d, a[2].d, a[3].d);
                    let da = _mm256_set_m128(da, da);
                    let dd = _mm256_mul_ps(_mm256_set_m128(_mm_set1_ps(d1), _mm_set1_ps(d0)), da);
                    let dm = _mm256_mul_ps(_mm256_set_m128(_mm_set1_ps(dmin1), _mm_set1_ps(dmin0)), da);
                    // Each row's scales as i16 in its two 128-bit lanes.
                    let sc = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(sc0), sc1);
                    let mut block = [_mm512_setzero_si512(); 4];
                    for c in 0..4 {
                        let q = _mm512_inserti64x4::<1>(
                            _mm512_castsi256_si512(_mm256_loadu_si256(b[0].add(BlockQ4K::QS_OFFSET + 32 * c) as *const __m256i)),
                            _mm256_loadu_si256(b[1].add(BlockQ4K::QS_OFFSET + 32 * c) as *const __m256i),
                        );
                        // 64 values: low nibbles (scale 2c), then high nibbles (scale 2c+1).
                        let lo = _mm512_and_si512(q, m4);
                        let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(q), m4);
                        let pick = |j: usize| _mm512_set1_epi16((((2 * j + 1) << 8) | (2 * j)) as i16);
                        let s_lo = _mm512_shuffle_epi8(sc, pick(2 * c));
                        let s_hi = _mm512_shuffle_epi8(sc, pick(2 * c + 1));
                        let v: [__m512i; 4] = std::array::from_fn(|t| {
                            let p = a[t].qs.as_ptr().add(64 * c);
                            let a_lo = _mm512_broadcast_i64x4(_mm256_loadu_si256(p as *const __m256i));
                            let a_hi = _mm512_broadcast_i64x4(_mm256_loadu_si256(p.add(32) as *const __m256i));
                            let init = if ONE_TOKEN { block[t] } else { _mm512_setzero_si512() };
                            let s = dpwssd(init, _mm512_maddubs_epi16(lo, a_lo), s_lo);
                            dpwssd(s, _mm512_maddubs_epi16(hi, a_hi), s_hi)
                        });
                        if ONE_TOKEN {
                            block = v;
                        } else {
                            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(reduce(v)), dd, acc);
                        }
                    }
                    if ONE_TOKEN {
                        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(reduce(block)), dd, acc);
                    }
                    // Min sums, as `q4_k_2x4`.
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
                    let chunks = [
                        _mm256_unpacklo_epi64(m01l, m23l),
                        _mm256_unpackhi_epi64(m01l, m23l),
                        _mm256_unpacklo_epi64(m01h, m23h),
                        _mm256_unpackhi_epi64(m01h, m23h),
                    ];
                    if ONE_TOKEN {
                        let all = _mm256_add_epi32(_mm256_add_epi32(chunks[0], chunks[1]), _mm256_add_epi32(chunks[2], chunks[3]));
                        acc_m = _mm256_fmadd_ps(_mm256_cvtepi32_ps(all), dm, acc_m);
                    } else {
                        for mc in chunks {
                            acc_m = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mc), dm, acc_m);
                        }
                    }
                }
                _mm256_storeu_ps(out.as_mut_ptr(), _mm256_sub_ps(acc, acc_m));
            }
        }

        /// The Q4_K row-pair tile of this level (see `$zmm`).
        #[inline(always)]
        unsafe fn q4_k_pair<const ONE_TOKEN: bool>(r0: &[u8], r1: &[u8], acts: &[&[BlockQ8K]], out: &mut [f32]) {
            // SAFETY: the caller upholds the module's contract, and `$zmm` is set only for
            // the level whose features include AVX-512 VNNI.
            unsafe {
                if $zmm {
                    q4_k_2x4_zmm::<ONE_TOKEN>(r0, r1, acts, out)
                } else {
                    q4_k_2x4::<ONE_TOKEN>(r0, r1, acts, out)
                }
            }
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
            // SAFETY: the caller upholds the module's contract (see `x86.rs`): the CPU has
            // this level's features, and every pointer read below lies inside the caller's
            // rows (whole blocks), its activation rows, or this function's own buffers.
            unsafe {
                // Bytes 4..20 of each block: the 12 scale bytes (w0, w1, w2) and 4 bytes not used.
                let raw = _mm256_set_m128i(
                    _mm_loadu_si128(b1.add(BlockQ4K::SCALES_OFFSET) as *const __m128i),
                    _mm_loadu_si128(b0.add(BlockQ4K::SCALES_OFFSET) as *const __m128i),
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
            // SAFETY: the caller upholds the module's contract (see `x86.rs`): the CPU has
            // this level's features, and every pointer read below lies inside the caller's
            // rows (whole blocks), its activation rows, or this function's own buffers.
            unsafe {
                let m4 = _mm256_set1_epi8(0x0F);
                let one = _mm256_set1_epi8(1);
                // Q5_K: 32 bytes of `qh` between the scales and the values.
                let qs = if FIFTH { BlockQ5K::QS_OFFSET } else { BlockQ4K::QS_OFFSET };
                let mut hb = if FIFTH { _mm256_loadu_si256(b.add(BlockQ5K::QH_OFFSET) as *const __m256i) } else { _mm256_setzero_si256() };
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
            // SAFETY: the caller upholds the module's contract (see `x86.rs`): the CPU has
            // this level's features, and every pointer read below lies inside the caller's
            // rows (whole blocks), its activation rows, or this function's own buffers.
            unsafe {
                const TS: usize = BlockQ4K::BLOCK_BYTES;
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
            // SAFETY: the caller upholds the module's contract (see `x86.rs`): the CPU has
            // this level's features, and every pointer read below lies inside the caller's
            // rows (whole blocks), its activation rows, or this function's own buffers.
            unsafe {
                let nb = row.len() / BlockQ5K::BLOCK_BYTES;
                let m4 = _mm256_set1_epi8(0x0F);
                let one = _mm256_set1_epi8(1);
                let mut acc = [_mm256_setzero_ps(); N];
                let mut acc_m = [_mm_setzero_ps(); N];
                let mut acc_s = [0f32; N];
                for i in 0..nb {
                    let b = row.as_ptr().add(i * BlockQ5K::BLOCK_BYTES);
                    let (d, dmin) = f16_pair(b);
                    let (scales, mins) = k4_scales_mins(b.add(BlockQ5K::SCALES_OFFSET));
                    let mut hb = _mm256_loadu_si256(b.add(BlockQ5K::QH_OFFSET) as *const __m256i);
                    let mut sumi = [_mm256_setzero_si256(); N];
                    for c in 0..4 {
                        // Fifth bits: bit 2c of qh for the low nibbles, 2c+1 for the high ones.
                        let q = _mm256_loadu_si256(b.add(BlockQ5K::QS_OFFSET + 32 * c) as *const __m256i);
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
            // SAFETY: the caller upholds the module's contract (see `x86.rs`): the CPU has
            // this level's features, and every pointer read below lies inside the caller's
            // rows (whole blocks), its activation rows, or this function's own buffers.
            unsafe {
                const TS: usize = BlockQ5K::BLOCK_BYTES;
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
        }

        /// Q6_K × a tile of `N` Q8_K token rows. Values are used unsigned (0..64) and
        /// the −32 offset is taken off once per block through the activations' group sums.
        /// Float order: `ggml_vec_dot_q6_K_q8_K` (8 lanes, one FMA per block, then a
        /// horizontal sum), or with `WIDE` ggml's tiled matmul (one scalar chain, see `tiled_step`).
        #[target_feature(enable = $features)]
        unsafe fn q6_k_n<const WIDE: bool, const N: usize>(row: &[u8], acts: &[&[BlockQ8K]], out: &mut [f32]) {
            // SAFETY: the caller upholds the module's contract (see `x86.rs`): the CPU has
            // this level's features, and every pointer read below lies inside the caller's
            // rows (whole blocks), its activation rows, or this function's own buffers.
            unsafe {
                let nb = row.len() / BlockQ6K::BLOCK_BYTES;
                let m4 = _mm256_set1_epi8(0x0F);
                let mut acc = [_mm256_setzero_ps(); N];
                let mut acc_s = [0f32; N];
                for i in 0..nb {
                    let b = row.as_ptr().add(i * BlockQ6K::BLOCK_BYTES);
                    let d = f16_after(b.add(BlockQ6K::D_OFFSET));
                    // The 16 signed scales as bytes, and as i16 for the offset term.
                    let sc8 = _mm_loadu_si128(b.add(BlockQ6K::SCALES_OFFSET) as *const __m128i);
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
                        let ql0 = _mm256_loadu_si256(b.add(BlockQ6K::QL_OFFSET + 64 * half) as *const __m256i);
                        let ql1 = _mm256_loadu_si256(b.add(BlockQ6K::QL_OFFSET + 64 * half + 32) as *const __m256i);
                        let qh = _mm256_loadu_si256(b.add(BlockQ6K::QH_OFFSET + 32 * half) as *const __m256i);
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
            // SAFETY: the caller upholds the module's contract (see `x86.rs`): the CPU has
            // this level's features, and every pointer read below lies inside the caller's
            // rows (whole blocks), its activation rows, or this function's own buffers.
            unsafe {
                let m4 = _mm256_set1_epi8(0x0F);
                let mut sumi = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(_mm256_madd_epi16(sc16, bs), 5));
                for half in 0..2 {
                    // Scales 8·half .. 8·half + 8 (as i16) in both lanes.
                    let sc_half = if half == 0 {
                        _mm256_permute2x128_si256(sc16, sc16, 0x00)
                    } else {
                        _mm256_permute2x128_si256(sc16, sc16, 0x11)
                    };
                    let ql0 = _mm256_loadu_si256(b.add(BlockQ6K::QL_OFFSET + 64 * half) as *const __m256i);
                    let ql1 = _mm256_loadu_si256(b.add(BlockQ6K::QL_OFFSET + 64 * half + 32) as *const __m256i);
                    let qh = _mm256_loadu_si256(b.add(BlockQ6K::QH_OFFSET + 32 * half) as *const __m256i);
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
        }

        /// One token × every row of a group of Q6_K, two adjacent rows at a time (an odd last
        /// row through `q6_k_n::<false, 1>`). Each output is bit for bit `q6_k_n::<false, 1>`'s
        /// (ggml's `vec_dot` order): the same 8 i32 lanes of a block's `sumi` (see
        /// [`q6k_block_sumi`]), `acc = fma(d·d_a, sumi, acc)` per block, then `hsum(acc)`.
        /// Cheaper per block: one linear prefetch stream, both rows' `d` in one f16
        /// conversion, and the activation and group-sum loads shared by the rows.
        #[target_feature(enable = $features)]
        unsafe fn q6_k_gemv_rows(rows: &[u8], rb: usize, a: &[BlockQ8K], out: &mut [f32]) {
            // SAFETY: the caller upholds the module's contract (see `x86.rs`): the CPU has
            // this level's features, and every pointer read below lies inside the caller's
            // rows (whole blocks), its activation rows, or this function's own buffers.
            unsafe {
                const TS: usize = BlockQ6K::BLOCK_BYTES;
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
                        let dd = _mm_mul_ps(f16_quad(b0.add(BlockQ6K::D_OFFSET - 2), b1.add(BlockQ6K::D_OFFSET - 2)), _mm_set1_ps(ab.d));
                        let bs = _mm256_loadu_si256(ab.bsums.as_ptr() as *const __m256i);
                        // Each row's 16 signed scales as i16.
                        let sc0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(b0.add(BlockQ6K::SCALES_OFFSET) as *const __m128i));
                        let sc1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(b1.add(BlockQ6K::SCALES_OFFSET) as *const __m128i));
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
        }

        /// Q2_K × a tile of `N` Q8_K token rows (`WIDE`: in the order of ggml's tiled matmul).
        #[target_feature(enable = $features)]
        unsafe fn q2_k_n<const WIDE: bool, const N: usize>(row: &[u8], acts: &[&[BlockQ8K]], out: &mut [f32]) {
            // SAFETY: the caller upholds the module's contract (see `x86.rs`): the CPU has
            // this level's features, and every pointer read below lies inside the caller's
            // rows (whole blocks), its activation rows, or this function's own buffers.
            unsafe {
                let nb = row.len() / BlockQ2K::BLOCK_BYTES;
                let m3 = _mm256_set1_epi8(3);
                let mut acc = [_mm256_setzero_ps(); N];
                let mut mins = [0f32; N];
                for i in 0..nb {
                    let b = row.as_ptr().add(i * BlockQ2K::BLOCK_BYTES);
                    let sc = std::slice::from_raw_parts(b.add(BlockQ2K::SCALES_OFFSET), 16);
                    let (d, dmin) = f16_pair(b.add(BlockQ2K::D_OFFSET));
                    // The 16 mins (high nibbles of the scale bytes) as i16, for one `vpmaddwd`
                    // against each token's group sums.
                    let raw = _mm_loadu_si128(b.add(BlockQ2K::SCALES_OFFSET) as *const __m128i);
                    let mins16 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(0x0F)));
                    let mut sumi = [_mm256_setzero_si256(); N];
                    for half in 0..2 {
                        let mut q = _mm256_loadu_si256(b.add(BlockQ2K::QS_OFFSET + 32 * half) as *const __m256i);
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
        }

        /// Two f16 pairs, the 32-bit words at `p0` and `p1`, as `[p0 lo, p0 hi, p1 lo, p1 hi]`
        /// in f32: one zero-extending 64-bit move and one conversion for two rows' block scales.
        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn f16_quad(p0: *const u8, p1: *const u8) -> __m128 {
            // SAFETY: the caller upholds the module's contract (see `x86.rs`): the CPU has
            // this level's features, and every pointer read below lies inside the caller's
            // rows (whole blocks), its activation rows, or this function's own buffers.
            unsafe {
                let word = |p: *const u8| u32::from_le_bytes([*p, *p.add(1), *p.add(2), *p.add(3)]) as u64;
                let bits = word(p0) | (word(p1) << 32);
                // SAFETY: this module's functions run with AVX2 (see `vmovq_to_xmm`).
                let v = super::vmovq_to_xmm(bits);
                _mm_cvtph_ps(v)
            }
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
            // SAFETY: the caller upholds the module's contract (see `x86.rs`): the CPU has
            // this level's features, and every pointer read below lies inside the caller's
            // rows (whole blocks), its activation rows, or this function's own buffers.
            unsafe {
                const TS: usize = BlockQ2K::BLOCK_BYTES;
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
                        let dd = _mm_mul_ps(f16_quad(b0.add(BlockQ2K::D_OFFSET), b1.add(BlockQ2K::D_OFFSET)), _mm_set1_ps(ab.d));
                        // Each row's 16 scale bytes in both lanes: scale = low nibble, min = high nibble.
                        let raw0 = _mm256_broadcastsi128_si256(_mm_loadu_si128(b0.add(BlockQ2K::SCALES_OFFSET) as *const __m128i));
                        let raw1 = _mm256_broadcastsi128_si256(_mm_loadu_si128(b1.add(BlockQ2K::SCALES_OFFSET) as *const __m128i));
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
                            let mut q0 = _mm256_loadu_si256(b0.add(BlockQ2K::QS_OFFSET + 32 * half) as *const __m256i);
                            let mut q1 = _mm256_loadu_si256(b1.add(BlockQ2K::QS_OFFSET + 32 * half) as *const __m256i);
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
        }

        /// Q3_K × a tile of `N` Q8_K token rows (values used as 0..8, offset 4 removed via group
        /// sums; `WIDE`: in the order of ggml's tiled matmul).
        #[target_feature(enable = $features)]
        unsafe fn q3_k_n<const WIDE: bool, const N: usize>(row: &[u8], acts: &[&[BlockQ8K]], out: &mut [f32]) {
            // SAFETY: the caller upholds the module's contract (see `x86.rs`): the CPU has
            // this level's features, and every pointer read below lies inside the caller's
            // rows (whole blocks), its activation rows, or this function's own buffers.
            unsafe {
                let nb = row.len() / BlockQ3K::BLOCK_BYTES;
                let m3 = _mm256_set1_epi8(3);
                let one = _mm256_set1_epi8(1);
                let mut acc = [_mm256_setzero_ps(); N];
                let mut acc_s = [0f32; N];
                for i in 0..nb {
                    let b = row.as_ptr().add(i * BlockQ3K::BLOCK_BYTES);
                    let d = f16_after(b.add(BlockQ3K::D_OFFSET));
                    let sc8 = q3k_scales_vec(b.add(BlockQ3K::SCALES_OFFSET));
                    let sc16 = _mm256_cvtepi8_epi16(sc8);
                    let mut sumi = [_mm256_setzero_si256(); N];
                    for t in 0..N {
                        // −4 · Σ_g scale[g] · bsums[g]: the offset of every value, taken off up front.
                        let a = acts.get_unchecked(t).get_unchecked(i);
                        let bs = _mm256_loadu_si256(a.bsums.as_ptr() as *const __m256i);
                        let off = _mm256_slli_epi32(_mm256_madd_epi16(sc16, bs), 2);
                        sumi[t] = _mm256_sub_epi32(_mm256_setzero_si256(), off);
                    }
                    let mut hm = _mm256_loadu_si256(b.add(BlockQ3K::HMASK_OFFSET) as *const __m256i);
                    for half in 0..2 {
                        let mut q = _mm256_loadu_si256(b.add(BlockQ3K::QS_OFFSET + 32 * half) as *const __m256i);
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
        }

        /// The 16 signed scales of a Q3_K block (12 bytes at `p`), −32 offset removed, as bytes.
        /// Scale j has its low 4 bits in the nibble of byte j % 8 (low nibble for j < 8) and its
        /// top 2 bits in bits 2·(j / 4) of byte 8 + j % 4: whole-word masks do four at a time.
        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn q3k_scales_vec(p: *const u8) -> __m128i {
            // SAFETY: the caller upholds the module's contract (see `x86.rs`): the CPU has
            // this level's features, and every pointer read below lies inside the caller's
            // rows (whole blocks), its activation rows, or this function's own buffers.
            unsafe {
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
        }

        /// A `vpshufb` table (in both lanes) over a Q3_K half block's `hmask` nibble (bit s:
        /// the high bit of the half's 32-value chunk s): bit `first` of the nibble to bit 2,
        /// bit `first + 2` to bit 6 — the high bits of chunks `first` and `first + 2` just above
        /// their two low bits when those sit at bits 0..2 and 4..6 of a byte.
        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn q3k_high_bits_table(first: usize) -> __m256i {
            // SAFETY: the caller upholds the module's contract (see `x86.rs`): the CPU has
            // this level's features, and every pointer read below lies inside the caller's
            // rows (whole blocks), its activation rows, or this function's own buffers.
            unsafe {
                let mut table = [0u8; 16];
                for (nibble, entry) in table.iter_mut().enumerate() {
                    *entry = ((((nibble >> first) & 1) << 2) | (((nibble >> (first + 2)) & 1) << 6)) as u8;
                }
                _mm256_broadcastsi128_si256(_mm_loadu_si128(table.as_ptr() as *const __m128i))
            }
        }

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
            // SAFETY: the caller upholds the module's contract (see `x86.rs`): the CPU has
            // this level's features, and every pointer read below lies inside the caller's
            // rows (whole blocks), its activation rows, or this function's own buffers.
            unsafe {
                let raw = _mm256_set_m128i(
                    _mm_loadu_si128(b1.add(BlockQ3K::SCALES_OFFSET - 2) as *const __m128i),
                    _mm_loadu_si128(b0.add(BlockQ3K::SCALES_OFFSET - 2) as *const __m128i),
                );
                // Bytes j of each lane: s[j % 8] and s[8 + j % 4], shifted to put scale j's bits lowest.
                let low = shuffle_bytes_at(raw, super::kquants::Q3K_PATTERNS.scale_low_bytes.as_ptr());
                let high = shuffle_bytes_at(raw, super::kquants::Q3K_PATTERNS.scale_high_bytes.as_ptr());
                let low = _mm256_srlv_epi32(low, _mm256_set_epi32(4, 4, 0, 0, 4, 4, 0, 0));
                let high = _mm256_srlv_epi32(high, _mm256_set_epi32(6, 4, 2, 0, 6, 4, 2, 0));
                let low = _mm256_and_si256(low, _mm256_set1_epi8(0x0F));
                let high = _mm256_slli_epi16(_mm256_and_si256(high, _mm256_set1_epi8(0x03)), 4);
                _mm256_sub_epi8(_mm256_or_si256(low, high), _mm256_set1_epi8(32))
            }
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
            // SAFETY: the caller upholds the module's contract (see `x86.rs`): the CPU has
            // this level's features, and every pointer read below lies inside the caller's
            // rows (whole blocks), its activation rows, or this function's own buffers.
            unsafe {
                let (low2, low_nibble) = (_mm256_set1_epi8(0x33), _mm256_set1_epi8(0x0F));
                let hm = _mm256_loadu_si256(b.add(BlockQ3K::HMASK_OFFSET) as *const __m256i);
                // Σ over the chunks whose values are used as is (from `offset`), and 16·Σ over the rest.
                let (mut sum, mut sum16) = (offset, _mm256_setzero_si256());
                for half in 0..2 {
                    let q = _mm256_loadu_si256(b.add(BlockQ3K::QS_OFFSET + 32 * half) as *const __m256i);
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
                            shuffle_bytes_at(by_parity, super::kquants::Q3K_PATTERNS.chunk_scales[c].as_ptr()),
                            shuffle_bytes_at(by_parity, super::kquants::Q3K_PATTERNS.chunk_scales[c + 2].as_ptr()),
                        );
                        sum = _mm256_add_epi32(sum, scaled_dot_at(value, ay, sc));
                        sum16 = _mm256_add_epi32(sum16, scaled_dot_at(value16, ay2, sc2));
                    }
                }
                _mm256_add_epi32(sum, _mm256_srai_epi32(sum16, 4))
            }
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
            // SAFETY: the caller upholds the module's contract (see `x86.rs`): the CPU has
            // this level's features, and every pointer read below lies inside the caller's
            // rows (whole blocks), its activation rows, or this function's own buffers.
            unsafe {
                const TS: usize = BlockQ3K::BLOCK_BYTES;
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
                        let dd = _mm_mul_ps(f16_quad(b0.add(BlockQ3K::D_OFFSET - 2), b1.add(BlockQ3K::D_OFFSET - 2)), _mm_set1_ps(ab.d));
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
        }

        /// IQ4_XS × a tile of `N` Q8_K token rows (`WIDE`: in the order of ggml's tiled matmul).
        #[target_feature(enable = $features)]
        unsafe fn iq4_xs_n<const WIDE: bool, const N: usize>(row: &[u8], acts: &[&[BlockQ8K]], out: &mut [f32]) {
            // SAFETY: the caller upholds the module's contract (see `x86.rs`): the CPU has
            // this level's features, and every pointer read below lies inside the caller's
            // rows (whole blocks), its activation rows, or this function's own buffers.
            unsafe {
                let nb = row.len() / BlockIq4Xs::BLOCK_BYTES;
                let table = iq4nl_table();
                let mut acc = [_mm256_setzero_ps(); N];
                let mut acc_s = [0f32; N];
                for i in 0..nb {
                    let b = row.as_ptr().add(i * BlockIq4Xs::BLOCK_BYTES);
                    let d = f16_at(b);
                    let scales_h = u16::from_le_bytes([*b.add(BlockIq4Xs::SCALES_H_OFFSET), *b.add(BlockIq4Xs::SCALES_H_OFFSET + 1)]);
                    let mut sumi = [_mm256_setzero_si256(); N];
                    for ib in 0..8 {
                        let ls = ((*b.add(BlockIq4Xs::SCALES_L_OFFSET + ib / 2) >> (4 * (ib % 2))) & 0xF) as i32
                            | ((((scales_h >> (2 * ib)) & 3) as i32) << 4);
                        let v = _mm256_shuffle_epi8(table, nibbles(b.add(BlockIq4Xs::QS_OFFSET + 16 * ib)));
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
        }

        /// The eight 6-bit sub-block scales of the IQ4_XS block at `b` (unbiased, 0..64), one
        /// per byte, sub-block 0 in the low byte: nibble k of `scales_l` and 2-bit field k of
        /// `scales_h` spread to byte k by shift-and-mask steps.
        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn iq4_xs_scale_bytes(b: *const u8) -> u64 {
            // SAFETY: the caller upholds the module's contract (see `x86.rs`): the CPU has
            // this level's features, and every pointer read below lies inside the caller's
            // rows (whole blocks), its activation rows, or this function's own buffers.
            unsafe {
                let high = u16::from_le(std::ptr::read_unaligned(b.add(BlockIq4Xs::SCALES_H_OFFSET) as *const u16)) as u64;
                let low = u32::from_le(std::ptr::read_unaligned(b.add(BlockIq4Xs::SCALES_L_OFFSET) as *const u32)) as u64;
                let mut l = (low | (low << 16)) & 0x0000_FFFF_0000_FFFF;
                l = (l | (l << 8)) & 0x00FF_00FF_00FF_00FF;
                l = (l | (l << 4)) & 0x0F0F_0F0F_0F0F_0F0F;
                let mut h = (high | (high << 24)) & 0x0000_00FF_0000_00FF;
                h = (h | (h << 12)) & 0x000F_000F_000F_000F;
                h = (h | (h << 6)) & 0x0303_0303_0303_0303;
                l | (h << 4)
            }
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
            // SAFETY: the caller upholds the module's contract (see `x86.rs`): the CPU has
            // this level's features, and every pointer read below lies inside the caller's
            // rows (whole blocks), its activation rows, or this function's own buffers.
            unsafe {
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
        }

        /// One token × every row of a group of IQ4_XS, two adjacent rows at a time in the
        /// "halves" layout of [`legacy_gemv_halves`] (an odd last row through
        /// `iq4_xs_n::<false, 1>`). A sub-block's 16 bytes of both rows are unpacked together:
        /// `lo` = [row 0 values 0..16 | row 1 values 0..16], `hi` = the values 16..32, dotted
        /// with the matching 16 activations in both lanes as `maddubs(|a|, sign(L, a))`: the
        /// same pair sums as `iq4_xs_n`'s `maddubs(|L|, sign(a, L))` (Q8_K values are in
        /// −127..=127, so nothing wraps, and |a·L| ≤ 127² never saturates), with `|a|` and `a`
        /// laid out once per call ([`super::kquants::Iq4XsAct`]); each weighted by `[row 0 scale | row 1 scale]`. Lanes 0..4 of a block's `lo` sum are row 0's
        /// lanes 0..4 of `iq4_xs_n`'s `sumi`, lanes 0..4 of `hi` its lanes 4..8 (lanes 4..8:
        /// row 1), so two lane permutes give each row's `sumi` exactly; then `acc =
        /// fma(d·d_a, sumi, acc)` per block and `hsum(acc)`, bit for bit `iq4_xs_n::<false, 1>`.
        /// All eight scales of both rows are unpacked at once, a block ahead (their bit
        /// twiddling is a long dependency chain), and one `vpshufd` picks a sub-block's.
        #[target_feature(enable = $features)]
        unsafe fn iq4_xs_gemv_rows(rows: &[u8], rb: usize, a: &[BlockQ8K], out: &mut [f32]) {
            // SAFETY: the caller upholds the module's contract (see `x86.rs`): the CPU has
            // this level's features, and every pointer read below lies inside the caller's
            // rows (whole blocks), its activation rows, or this function's own buffers.
            unsafe {
                const TS: usize = BlockIq4Xs::BLOCK_BYTES;
                let n = rows.len() / rb;
                let nb = rb / TS;
                let mut prep = super::kquants::IQ4_XS_ACTS.with(|c| c.take());
                prep.clear();
                prep.resize(nb, super::kquants::Iq4XsAct([[0; 32]; 32]));
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
                            let v = super::pair_halves(b0.add(BlockIq4Xs::QS_OFFSET + 16 * ib), b1.add(BlockIq4Xs::QS_OFFSET + 16 * ib));
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
                super::kquants::IQ4_XS_ACTS.with(|c| c.replace(prep));
                if n % 2 == 1 {
                    iq4_xs_n::<false, 1>(&rows[(n - 1) * rb..], &[a], &mut out[n - 1..n]);
                }
            }
        }

        /// Rows × Q8_K tile for a K-quant or IQ4_XS, in the float order ggml uses for
        /// calls of fewer than 8 tokens (its `vec_dot` kernels; Q4_K: its repacked kernels).
        pub(crate) fn rows_q8k(t: GgmlType, rows: &[u8], rb: usize, acts: &[&[BlockQ8K]], out: &mut [f32]) {
            if gemv_order(t, acts.len()) {
                return gemv_each_token(t, rows, rb, acts, out);
            }
            rows_q8k_order::<false>(t, rows, rb, acts, out)
        }

        /// Whether a tile of `nt` tokens sums each token as a one-token call does
        /// and has a one-token kernel to do it with: every K-quant and IQ4_XS tile
        /// of 2 to 4 tokens but Q4_K's of 4 (ggml's repacked GEMM order).
        fn gemv_order(t: GgmlType, nt: usize) -> bool {
            has_gemv(t) && (2..=4).contains(&nt) && !(t == GgmlType::Q4_K && nt == 4)
        }

        /// The formats with a one-token GEMV kernel (`*_gemv_rows`).
        fn has_gemv(t: GgmlType) -> bool {
            matches!(
                t,
                GgmlType::Q2_K | GgmlType::Q3_K | GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K | GgmlType::IQ4_XS
            )
        }

        /// The same for calls of 8 tokens or more, in the order of ggml's tiled K-quant
        /// matmul (Q4_K: its repacked kernels, as for fewer tokens).
        pub(crate) fn rows_q8k_wide(t: GgmlType, rows: &[u8], rb: usize, acts: &[&[BlockQ8K]], out: &mut [f32]) {
            rows_q8k_order::<true>(t, rows, rb, acts, out)
        }

        /// The same in the one-token order whatever the tile (see `call_order`): each
        /// output has the bits a one-token call gives it. Only Q4_K differs from
        /// `rows_q8k`: its full tiles of 4 tokens follow ggml's repacked GEMM order there,
        /// and the repacked GEMV order here (`q4_k_2x4::<true>`).
        pub(crate) fn rows_q8k_one_token(t: GgmlType, rows: &[u8], rb: usize, acts: &[&[BlockQ8K]], out: &mut [f32]) {
            if gemv_order(t, acts.len()) {
                return gemv_each_token(t, rows, rb, acts, out);
            }
            if t != GgmlType::Q4_K || acts.len() != 4 || !checked(rows, rb, t.type_size(), 1, acts, out, 4) {
                return rows_q8k_order::<false>(t, rows, rb, acts, out);
            }
            // SAFETY: the caller (dispatch) checked the host supports this module's
            // features, and `checked` verified every slice the kernels index.
            unsafe {
                // Pairs of rows through the 2×4 tile in the one-token order, an odd last
                // row through pairs of tokens.
                let n = rows.len() / rb;
                for (pair, o) in rows.chunks_exact(2 * rb).zip(out.chunks_exact_mut(8)) {
                    q4_k_pair::<true>(&pair[..rb], &pair[rb..], acts, o);
                }
                if n % 2 == 1 {
                    let row = &rows[(n - 1) * rb..];
                    let (first, second) = out[4 * (n - 1)..4 * n].split_at_mut(2);
                    q4_k_n::<2>(row, &acts[..2], first);
                    q4_k_n::<2>(row, &acts[2..], second);
                }
            }
        }

        /// A tile of a few tokens through the one-token kernel, token by token over
        /// groups of rows small enough to stay in cache: the weights come from memory
        /// once, and each output has a one-token call's bits (the token-tiled kernels
        /// of 2 to 4 tokens cost about a whole GEMV per token).
        fn gemv_each_token(t: GgmlType, rows: &[u8], rb: usize, acts: &[&[BlockQ8K]], out: &mut [f32]) {
            const GROUP: usize = 32;
            let nt = acts.len();
            let n = rows.len() / rb.max(1);
            if rb == 0 || out.len() != n * nt {
                return rows_q8k_order::<false>(t, rows, rb, acts, out);
            }
            let mut one = [0.0f32; GROUP];
            for (g, group) in rows.chunks(GROUP * rb).enumerate() {
                let m = group.len() / rb;
                for (k, a) in acts.iter().enumerate() {
                    rows_q8k_order::<false>(t, group, rb, std::slice::from_ref(a), &mut one[..m]);
                    for (i, &v) in one[..m].iter().enumerate() {
                        out[(g * GROUP + i) * nt + k] = v;
                    }
                }
            }
        }

        fn rows_q8k_order<const WIDE: bool>(t: GgmlType, rows: &[u8], rb: usize, acts: &[&[BlockQ8K]], out: &mut [f32]) {
            if !checked(rows, rb, t.type_size(), 1, acts, out, 4) {
                return super::super::dispatch::each_row(super::super::scalar::dot_q8k, t, rows, rb, acts, out);
            }
            match t {
                // One token in the `vec_dot` order (Q4_K: the repacked GEMV order): two rows at a time.
                _ if has_gemv(t) && !WIDE && acts.len() == 1 => {
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
                            q4_k_pair::<false>(&pair[..rb], &pair[rb..], acts, o);
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
    };
}
