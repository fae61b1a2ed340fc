//! Softmax.

/// Numerically stable softmax in place (max subtracted first). An all-`-inf`
/// row becomes all zeros instead of NaN.
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY {
        x.fill(0.0);
        return;
    }
    let mut sum = 0f64;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v as f64;
    }
    let inv = (1.0 / sum) as f32;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

/// ggml's vectorized `expf` (`ggml_v_expf` of its AVX2 build), one value at
/// a time: an exact range reduction by ln 2 and a degree-5 polynomial,
/// within ~1.5 ulp of `exp`. Softmax and SiLU use it so that their results
/// are llama.cpp's to the bit.
#[inline]
pub fn ggml_expf(x: f32) -> f32 {
    let c = f32::from_bits;
    // n = round(x · log2 e), by adding and subtracting 1.5 · 2^23.
    let shifter = c(0x4b40_0000);
    let n = x.mul_add(c(0x3fb8_aa3b), shifter) - shifter;
    if n.is_nan() {
        return f32::NAN;
    }
    // b = x − n · ln 2, with ln 2 split in a high and a low part.
    let b = (-n).mul_add(c(0x35bf_be8e), (-n).mul_add(c(0x3f31_7200), x));
    // 2^b − 1 ≈ b·c1 + b²·(c2 + b·c3) + b⁴·(c4 + b·c5)
    let u = b * b;
    let j = c(0x3c07_2010)
        .mul_add(b, c(0x3d2b_9f17))
        .mul_add(u, c(0x3e2a_af33).mul_add(b, c(0x3eff_fedb)))
        .mul_add(u, c(0x3f7f_fff6) * b);
    // 2^n · (1 + j), with ggml's two-step scaling outside the normal range.
    if n.abs() > 192.0 {
        return if n <= 0.0 { 0.0 } else { f32::INFINITY };
    }
    let ni = n as i32;
    if ni.abs() <= 126 {
        let k = c(((ni + 127) as u32) << 23);
        k.mul_add(j, k)
    } else if ni <= 0 {
        let s2 = c(((ni + 252) as u32) << 23);
        s2.mul_add(j, s2) * c(0x0100_0000)
    } else {
        let s2 = c((ni as u32) << 23);
        s2.mul_add(j, s2) * c(0x7f00_0000)
    }
}

/// Whether the AVX2 + FMA + F16C versions of the f32 ops may run (the native
/// kernels' level, so `FLATRUN_SIMD=scalar` turns them off too).
#[cfg(target_arch = "x86_64")]
#[inline]
pub(crate) fn avx2_available() -> bool {
    use crate::SimdLevel::{Avx2, Avx512, Avx512Vnni};
    matches!(crate::simd_level(), Avx2 | Avx512 | Avx512Vnni)
}

/// Eight lanes of [`ggml_expf`] at once, AVX2 + FMA (ggml's `ggml_v_expf`):
/// lanes whose exponent leaves the normal range take the scalar function, so
/// every lane equals [`ggml_expf`] bit for bit.
#[cfg(target_arch = "x86_64")]
pub(crate) mod expf_avx2 {
    use std::arch::x86_64::*;

    /// `ggml_expf` of each lane.
    ///
    /// # Safety
    /// The host must have AVX2 and FMA.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn expf8(x: __m256) -> __m256 {
        // SAFETY: the caller upholds this function's safety contract (its
        // `# Safety` section), which every unsafe operation below relies on.
        unsafe {
            let c = |bits: u32| _mm256_set1_ps(f32::from_bits(bits));
            // n = round(x · log2 e); z keeps n in its low mantissa bits.
            let shifter = c(0x4b40_0000);
            let z = _mm256_fmadd_ps(x, c(0x3fb8_aa3b), shifter);
            let n = _mm256_sub_ps(z, shifter);
            // b = x − n · ln 2 (high part, then low part).
            let b = _mm256_fnmadd_ps(n, c(0x35bf_be8e), _mm256_fnmadd_ps(n, c(0x3f31_7200), x));
            // 2^b − 1 by the same polynomial as the scalar version.
            let u = _mm256_mul_ps(b, b);
            let j = _mm256_fmadd_ps(
                _mm256_fmadd_ps(
                    _mm256_fmadd_ps(c(0x3c07_2010), b, c(0x3d2b_9f17)),
                    u,
                    _mm256_fmadd_ps(c(0x3e2a_af33), b, c(0x3eff_fedb)),
                ),
                u,
                _mm256_mul_ps(c(0x3f7f_fff6), b),
            );
            // Lanes with |n| > 126 need the two-step scaling: do those eight one at a time.
            let abs_n = _mm256_andnot_ps(_mm256_set1_ps(-0.0), n);
            if _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_GT_OQ>(abs_n, _mm256_set1_ps(126.0))) != 0 {
                let mut lanes = [0f32; 8];
                _mm256_storeu_ps(lanes.as_mut_ptr(), x);
                for v in lanes.iter_mut() {
                    *v = super::ggml_expf(*v);
                }
                return _mm256_loadu_ps(lanes.as_ptr());
            }
            // k = 2^n, built from n's bits; result 2^n · (1 + j).
            let k = _mm256_castsi256_ps(_mm256_add_epi32(
                _mm256_slli_epi32::<23>(_mm256_castps_si256(z)),
                _mm256_castps_si256(_mm256_set1_ps(1.0)),
            ));
            _mm256_fmadd_ps(k, j, k)
        }
    }
}

/// The sum of 8 values in the order of ggml's AVX2 horizontal sums (the
/// halves added lane-wise, then lanes 0+2 and 1+3, then the two).
#[inline]
pub(crate) fn reduce8(l: &[f32]) -> f32 {
    let c = [l[0] + l[4], l[1] + l[5], l[2] + l[6], l[3] + l[7]];
    (c[0] + c[2]) + (c[1] + c[3])
}

/// The sum of 32 partial sums (four vectors of 8) in the order of ggml's
/// AVX2 `ggml_vec_dot_f16` reduction: vectors 0+2 and 1+3, then the two,
/// then the halves, then two horizontal adds.
#[inline]
pub(crate) fn reduce32(a: &[f32]) -> f32 {
    let x: [f32; 8] = std::array::from_fn(|l| (a[l] + a[16 + l]) + (a[8 + l] + a[24 + l]));
    let t: [f32; 4] = std::array::from_fn(|i| x[i] + x[i + 4]);
    (t[0] + t[1]) + (t[2] + t[3])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ggml_expf_is_close_to_exp() {
        for i in -1000..=800 {
            let x = i as f32 * 0.1;
            let (got, want) = (ggml_expf(x), x.exp());
            let tol = want * 4.0 * f32::EPSILON + 1e-44;
            assert!((got - want).abs() <= tol, "exp({x}) = {got}, want {want}");
        }
        assert_eq!(ggml_expf(f32::NEG_INFINITY), 0.0);
        assert_eq!(ggml_expf(-200.0), 0.0);
        assert_eq!(ggml_expf(0.0), 1.0);
    }

    #[test]
    fn reductions_sum() {
        let l: [f32; 32] = std::array::from_fn(|i| i as f32);
        assert_eq!(reduce8(&l[..8]), 28.0);
        assert_eq!(reduce32(&l), 496.0);
    }
}
