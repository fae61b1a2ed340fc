//! Activations quantized once per matmul call to the weights' dot partner, so
//! the inner loops are integer dot products. Same arithmetic as ggml's CPU
//! quantizers (`quantize_row_q8_0`/`_q8_1` of its AVX2 and NEON builds, which
//! round differently from the scalar `_ref` ones; `quantize_row_q8_K_ref`),
//! stored unpacked (f32 scales) for the kernels.

use half::f16;

/// Values per [`BlockQ8`].
pub const QK8: usize = 32;
pub use flatrun_dequant::{BlockQ8K, QK_K};

/// 32 activations as `d * qs[i]`: the partner of Q4_0/Q5_0/Q8_0/IQ4_NL/Q1_0 (ggml Q8_0)
/// and, with `s = d * Σqs`, of Q4_1/Q5_1 (ggml Q8_1). `d` and `s` are rounded
/// through f16 exactly as ggml stores them, and kept as f32 so the kernels read
/// them without a conversion (flatrun-dequant's [`flatrun_dequant::BlockQ8_0`]
/// and [`flatrun_dequant::BlockQ8_1`] are the f16 on-disk layouts).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
#[repr(C)]
pub struct BlockQ8 {
    pub d: f32,
    pub s: f32,
    pub qs: [i8; QK8],
}

/// Quantize `x` (a multiple of 32 values) into `out` (`x.len() / 32` blocks).
pub fn quantize_q8(x: &[f32], out: &mut [BlockQ8]) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: AVX2/FMA/F16C were detected on this CPU just above.
        return unsafe { x86::quantize_q8(x, out) };
    }
    quantize_q8_body(x, out)
}

/// Quantize `x` (a multiple of 256 values) into `out` (`x.len() / 256` blocks).
pub fn quantize_q8k(x: &[f32], out: &mut [BlockQ8K]) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: AVX2/FMA/F16C were detected on this CPU just above.
        return unsafe { x86::quantize_q8k(x, out) };
    }
    quantize_q8k_body(x, out)
}

/// Whether the host has AVX2+FMA+F16C (detected once).
#[cfg(target_arch = "x86_64")]
fn has_avx2() -> bool {
    static AVX2: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AVX2.get_or_init(|| {
        is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
    })
}

/// The quantizers in AVX2 intrinsics, bit for bit the portable bodies: the same scale
/// from the same largest magnitude, products `v·id` rounded to nearest even (`vroundps`),
/// the same sums. A block with a NaN, an infinity or a scale that overflows takes the
/// portable body, whose saturating casts decide those cases, so the vector path only
/// ever converts values within ±127.
#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{BlockQ8, BlockQ8K, QK_K, QK8, quantize_q8_body, quantize_q8k_body};

    /// `|v|` of 8 floats.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn abs(v: __m256) -> __m256 {
        _mm256_and_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff)))
    }

    /// The largest of 8 floats (none NaN).
    #[inline]
    #[target_feature(enable = "avx2")]
    fn hmax(v: __m256) -> f32 {
        let m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)))
    }

    /// The largest magnitude of `x` (8·k values), or `None` if one of them is NaN.
    ///
    /// # Safety
    /// `x.len()` is a multiple of 8; the CPU has AVX2.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn amax(x: &[f32]) -> Option<f32> {
        let mut m = _mm256_setzero_ps();
        let mut nan = _mm256_setzero_ps();
        for c in x.chunks_exact(8) {
            // SAFETY: `c` holds 8 floats.
            let v = unsafe { _mm256_loadu_ps(c.as_ptr()) };
            nan = _mm256_or_ps(nan, _mm256_cmp_ps::<_CMP_UNORD_Q>(v, v));
            m = _mm256_max_ps(abs(v), m);
        }
        (_mm256_movemask_ps(nan) == 0).then(|| hmax(m))
    }

    /// `round_ties_even(v·scale)` of 8 floats as i32, the products within ±127.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn round8(v: __m256, scale: __m256) -> __m256i {
        let r = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm256_mul_ps(v, scale),
        );
        _mm256_cvttps_epi32(r)
    }

    /// 32 values `x` scaled, rounded and stored as i8 into `q`; returns the four i32
    /// vectors (values 0–7, 8–15, 16–23, 24–31) for their sums.
    ///
    /// # Safety
    /// `x` holds 32 floats, `q` 32 bytes; the CPU has AVX2.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn quantize32(x: &[f32], scale: __m256, q: &mut [i8]) -> [__m256i; 4] {
        // SAFETY: 32 floats in `x`, 32 bytes in `q` (the caller's promise).
        unsafe {
            let v: [__m256i; 4] =
                std::array::from_fn(|k| round8(_mm256_loadu_ps(x.as_ptr().add(8 * k)), scale));
            // packs works within 128-bit lanes: [v0 0-3, v1 0-3, v0 4-7, v1 4-7] as i16, then
            // bytes [v0 0-3, v1 0-3, v2 0-3, v3 0-3 | v0 4-7, …], put back in order.
            let w = _mm256_packs_epi16(
                _mm256_packs_epi32(v[0], v[1]),
                _mm256_packs_epi32(v[2], v[3]),
            );
            let w = _mm256_permutevar8x32_epi32(w, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256(q.as_mut_ptr() as *mut __m256i, w);
            v
        }
    }

    /// The i32 sums of `a` and of `b`.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn hsum2(a: __m256i, b: __m256i) -> (i32, i32) {
        // [a01, a23, b01, b23 | a45, a67, b45, b67] → [a0123, b0123, … | a4567, b4567, …].
        let h = _mm256_hadd_epi32(a, b);
        let h = _mm256_hadd_epi32(h, h);
        let s = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256::<1>(h));
        (_mm_cvtsi128_si32(s), _mm_extract_epi32::<1>(s))
    }

    /// # Safety
    /// The CPU must support AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn quantize_q8(x: &[f32], out: &mut [BlockQ8]) {
        for (xb, b) in x.chunks_exact(QK8).zip(out.iter_mut()) {
            // SAFETY: `xb` holds 32 floats.
            let amax = unsafe { amax(xb) };
            match amax {
                Some(amax) if amax > 0.0 && amax.is_finite() && (127.0 / amax).is_finite() => {
                    let d = amax / 127.0;
                    // SAFETY: 32 floats in `xb`, 32 quants in `b.qs`.
                    let v = unsafe { quantize32(xb, _mm256_set1_ps(127.0 / amax), &mut b.qs) };
                    let (s01, s23) =
                        hsum2(_mm256_add_epi32(v[0], v[1]), _mm256_add_epi32(v[2], v[3]));
                    b.d = super::f16::from_f32(d).to_f32();
                    b.s = super::f16::from_f32((s01 + s23) as f32 * d).to_f32();
                }
                _ => quantize_q8_body(xb, std::slice::from_mut(b)),
            }
        }
    }

    /// # Safety
    /// The CPU must support AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn quantize_q8k(x: &[f32], out: &mut [BlockQ8K]) {
        for (xb, b) in x.chunks_exact(QK_K).zip(out.iter_mut()) {
            // SAFETY: `xb` holds 256 floats.
            let Some(amax) = (unsafe { amax(xb) }).filter(|a| a.is_finite()) else {
                quantize_q8k_body(xb, std::slice::from_mut(b));
                continue;
            };
            if amax == 0.0 {
                *b = BlockQ8K::default();
                continue;
            }
            // The first value of that magnitude, signed.
            let target = _mm256_set1_ps(amax);
            let mut max = amax;
            for (k, c) in xb.chunks_exact(8).enumerate() {
                // SAFETY: `c` holds 8 floats.
                let v = unsafe { _mm256_loadu_ps(c.as_ptr()) };
                let hit = _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_EQ_OQ>(abs(v), target));
                if hit != 0 {
                    max = xb[8 * k + hit.trailing_zeros() as usize];
                    break;
                }
            }
            let iscale = -127.0 / max;
            if !iscale.is_finite() {
                quantize_q8k_body(xb, std::slice::from_mut(b));
                continue;
            }
            let scale = _mm256_set1_ps(iscale);
            for (g, (xg, qg)) in xb
                .chunks_exact(32)
                .zip(b.qs.chunks_exact_mut(32))
                .enumerate()
            {
                // SAFETY: 32 floats in `xg`, 32 quants in `qg`.
                let v = unsafe { quantize32(xg, scale, qg) };
                let (lo, hi) = hsum2(_mm256_add_epi32(v[0], v[1]), _mm256_add_epi32(v[2], v[3]));
                b.bsums[2 * g] = lo as i16;
                b.bsums[2 * g + 1] = hi as i16;
            }
            b.d = 1.0 / iscale;
        }
    }
}

#[inline(always)]
fn quantize_q8_body(x: &[f32], out: &mut [BlockQ8]) {
    for (xb, b) in x.chunks_exact(QK8).zip(out.iter_mut()) {
        // Scale so the largest magnitude maps to ±127.
        let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
        // As ggml's CPU quantizer (`quantize_row_q8_0`/`_q8_1`, not the
        // scalar `_ref`): rounding is to nearest even (`vroundps`,
        // `vcvtnq`), and on x86 the multiplier is 127/amax rather than 1/d.
        // Either difference alone moves ~1e-3 of the quants by one step.
        let d = amax / 127.0;
        let id = if amax == 0.0 {
            0.0
        } else if cfg!(target_arch = "aarch64") {
            1.0 / d
        } else {
            127.0 / amax
        };
        // Round half to even, and sum the quants.
        let mut sum = 0i32;
        for (q, &v) in b.qs.iter_mut().zip(xb) {
            *q = (v * id).round_ties_even() as i8;
            sum += *q as i32;
        }
        b.d = f16::from_f32(d).to_f32();
        b.s = f16::from_f32(sum as f32 * d).to_f32();
    }
}

#[inline(always)]
fn quantize_q8k_body(x: &[f32], out: &mut [BlockQ8K]) {
    for (xb, b) in x.chunks_exact(QK_K).zip(out.iter_mut()) {
        // The value of largest magnitude (first one on ties) sets the scale: the largest
        // magnitude first (a max reduction LLVM vectorizes), then the first value that has it.
        let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
        if amax == 0.0 {
            *b = BlockQ8K::default();
            continue;
        }
        let max = xb.iter().copied().find(|v| v.abs() == amax).unwrap_or(amax);
        let iscale = -127.0 / max;
        // Round half to even (ggml's nearest_int), clamp to 127.
        for (q, &v) in b.qs.iter_mut().zip(xb) {
            *q = ((iscale * v).round_ties_even() as i32).min(127) as i8;
        }
        for (s, g) in b.bsums.iter_mut().zip(b.qs.chunks_exact(16)) {
            *s = g.iter().map(|&q| q as i16).sum();
        }
        b.d = 1.0 / iscale;
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    /// Inputs meant to break a vector path: NaN, infinities, subnormal maxima, ties, the
    /// largest magnitude negative or repeated with both signs.
    fn awkward() -> Vec<Vec<f32>> {
        let mut seed = 0x9e37_79b9_u32;
        let mut rnd = move || {
            seed ^= seed << 13;
            seed ^= seed >> 17;
            seed ^= seed << 5;
            seed as f32 / u32::MAX as f32 * 2.0 - 1.0
        };
        let base: Vec<f32> = (0..512).map(|_| rnd() * 3.0).collect();
        let mut cases = vec![base.clone()];
        for (i, special) in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, -7.5, 1e-40]
            .into_iter()
            .enumerate()
        {
            let mut x = base.clone();
            x[37 * (i + 1)] = special;
            cases.push(x);
        }
        let mut tiny: Vec<f32> = base.iter().map(|v| v * 1e-39).collect();
        tiny[300] = 0.0;
        cases.push(tiny);
        cases.push((0..512).map(|i| (i % 255) as f32 * 0.5 - 63.5).collect());
        cases.push(
            (0..512)
                .map(|i| {
                    if i % 9 == 0 {
                        -2.0
                    } else if i % 7 == 0 {
                        2.0
                    } else {
                        0.5
                    }
                })
                .collect(),
        );
        cases.push(vec![0.0; 512]);
        cases
    }

    #[test]
    fn vector_quantizers_are_the_portable_bodies() {
        if !has_avx2() {
            return;
        }
        for x in awkward() {
            let mut fast = vec![BlockQ8K::default(); 2];
            let mut plain = vec![BlockQ8K::default(); 2];
            quantize_q8k(&x, &mut fast);
            quantize_q8k_body(&x, &mut plain);
            for (f, p) in fast.iter().zip(&plain) {
                assert_eq!(f.d.to_bits(), p.d.to_bits());
                assert_eq!(f.qs, p.qs);
                assert_eq!(f.bsums, p.bsums);
            }
            let mut fast = vec![BlockQ8::default(); 16];
            let mut plain = vec![BlockQ8::default(); 16];
            quantize_q8(&x, &mut fast);
            quantize_q8_body(&x, &mut plain);
            for (f, p) in fast.iter().zip(&plain) {
                assert_eq!(
                    (f.d.to_bits(), f.s.to_bits()),
                    (p.d.to_bits(), p.s.to_bits())
                );
                assert_eq!(f.qs, p.qs);
            }
        }
    }
}
