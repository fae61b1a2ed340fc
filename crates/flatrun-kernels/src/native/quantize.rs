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

/// The same quantizers compiled for AVX2, so LLVM vectorizes their loops (its
/// rounding lowerings are exact: `round` stays half-away-from-zero and
/// `round_ties_even` becomes `vroundps`, instead of a libm call per value).
#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{BlockQ8, BlockQ8K, quantize_q8_body, quantize_q8k_body};

    /// # Safety
    /// The CPU must support AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn quantize_q8(x: &[f32], out: &mut [BlockQ8]) {
        quantize_q8_body(x, out)
    }

    /// # Safety
    /// The CPU must support AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn quantize_q8k(x: &[f32], out: &mut [BlockQ8K]) {
        quantize_q8k_body(x, out)
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
