//! Activations and gated feed-forward combinations.

/// SiLU: `x * sigmoid(x)`, with ggml's `expf` (as its `ggml_v_silu`).
#[inline]
fn silu1(x: f32) -> f32 {
    x / (1.0 + super::softmax::ggml_expf(-x))
}

/// GELU, tanh approximation: `0.5 x (1 + tanh(sqrt(2/π) (x + 0.044715 x³)))`,
/// rounded as ggml's compiled `ggml_gelu_f32`: `1 + 0.044715·x·x` is one FMA.
#[inline]
fn gelu_tanh1(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    const GELU_COEF_A: f32 = 0.044715;
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * x * (GELU_COEF_A * x).mul_add(x, 1.0)).tanh())
}

/// SiLU in place.
pub fn silu(x: &mut [f32]) {
    for v in x {
        *v = silu1(*v);
    }
}

/// GELU (tanh approximation) in place.
pub fn gelu_tanh(x: &mut [f32]) {
    for v in x {
        *v = gelu_tanh1(*v);
    }
}

/// Values per pool task of the gated activations (a multiple of the 8-lane vectors).
const GATED_CHUNK: usize = 1024;

/// `op(gate, up)` over the common length of `gate` and `up`, in pieces of [`GATED_CHUNK`]
/// split over the pool when there are many: every element's value is the same whichever
/// piece (and whichever vector or scalar path) computes it.
fn gated(gate: &mut [f32], up: &[f32], op: fn(&mut [f32], &[f32])) {
    let n = gate.len().min(up.len());
    let (body, tail) = gate[..n].split_at_mut(n / GATED_CHUNK * GATED_CHUNK);
    let done = body.len();
    super::rows::par_rows_mut(body, GATED_CHUNK, |rows, g| {
        op(g, &up[rows.start * GATED_CHUNK..rows.end * GATED_CHUNK])
    });
    op(tail, &up[done..n]);
}

/// SwiGLU: `gate = silu(gate) * up`.
pub fn swiglu(gate: &mut [f32], up: &[f32]) {
    gated(gate, up, swiglu_serial)
}

/// [`swiglu`] on the calling thread.
fn swiglu_serial(gate: &mut [f32], up: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    if super::softmax::avx2_available() {
        // SAFETY: the host has AVX2, FMA and F16C.
        return unsafe { swiglu_avx2(gate, up) };
    }
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = silu1(*g) * u;
    }
}

/// [`swiglu`] eight values at a time (ggml's `ggml_v_silu`), the same value per element.
///
/// # Safety
/// The host must have AVX2, FMA and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn swiglu_avx2(gate: &mut [f32], up: &[f32]) {
    // SAFETY: the caller upholds this function's safety contract (its
    // `# Safety` section), which every unsafe operation below relies on.
    unsafe {
        use std::arch::x86_64::*;
        let n = gate.len().min(up.len());
        let (gp, up_p) = (gate.as_mut_ptr(), up.as_ptr());
        let one = _mm256_set1_ps(1.0);
        let mut i = 0;
        // Each step reads and writes lanes i..i+8 < n of both slices.
        while i + 8 <= n {
            let x = _mm256_loadu_ps(gp.add(i));
            // silu(x) = x / (1 + e^(−x)), then times up.
            let e = super::softmax::expf_avx2::expf8(_mm256_sub_ps(_mm256_setzero_ps(), x));
            let silu = _mm256_div_ps(x, _mm256_add_ps(one, e));
            _mm256_storeu_ps(gp.add(i), _mm256_mul_ps(silu, _mm256_loadu_ps(up_p.add(i))));
            i += 8;
        }
        for (g, &u) in gate[i..n].iter_mut().zip(&up[i..n]) {
            *g = silu1(*g) * u;
        }
    }
}

/// gpt-oss's clamped SwiGLU (ggml's `swiglu_oai`): with `g = min(gate, limit)`
/// and `u = clamp(up, −limit, limit)`, `gate = g·σ(alpha·g)·(u + 1)`.
pub fn swiglu_oai(gate: &mut [f32], up: &[f32], alpha: f32, limit: f32) {
    for (g, &u) in gate.iter_mut().zip(up) {
        let x = g.min(limit);
        let y = u.clamp(-limit, limit);
        *g = x / (1.0 + (alpha * -x).exp()) * (y + 1.0);
    }
}

/// GeGLU: `gate = gelu_tanh(gate) * up`, with ggml's GELU: for |x| < 10 it
/// looks `x` up in an f16 table (`GGML_GELU_FP16`), i.e. the GELU of `x`
/// rounded to f16, itself rounded to f16; 0 below −10 and `x` above 10.
pub fn geglu(gate: &mut [f32], up: &[f32]) {
    gated(gate, up, geglu_serial)
}

/// [`geglu`] on the calling thread.
fn geglu_serial(gate: &mut [f32], up: &[f32]) {
    use half::f16;
    let table = gelu_f16_table();
    // Only x86_64 has a SIMD version that advances `done`.
    #[cfg_attr(not(target_arch = "x86_64"), allow(unused_mut))]
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if super::softmax::avx2_available() {
        // SAFETY: the host has AVX2, FMA and F16C.
        done = unsafe { geglu_avx2(gate, up, table) };
    }
    for (g, &u) in gate[done..].iter_mut().zip(&up[done..]) {
        let x = *g;
        *g = if x <= -10.0 {
            0.0
        } else if x >= 10.0 {
            x * u
        } else {
            f16::from_bits(table[f16::from_f32(x).to_bits() as usize]).to_f32() * u
        };
    }
}

/// ggml's GELU table: for every f16 `h`, the bits of `f16(gelu_tanh(h))` (built once).
fn gelu_f16_table() -> &'static [u16] {
    use half::f16;
    static TABLE: std::sync::OnceLock<Vec<u16>> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| {
        (0..=u16::MAX)
            .map(|h| f16::from_f32(gelu_tanh1(f16::from_bits(h).to_f32())).to_bits())
            .collect()
    })
}

/// The whole vectors of [`geglu`] (same values: the f16 roundings by `vcvtps2ph`, round to
/// nearest even like `half`); returns how many values it did.
///
/// # Safety
/// The host must have AVX2, FMA and F16C; `table` has 65536 entries.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn geglu_avx2(gate: &mut [f32], up: &[f32], table: &[u16]) -> usize {
    // SAFETY: the caller upholds this function's safety contract (its
    // `# Safety` section), which every unsafe operation below relies on.
    unsafe {
        use std::arch::x86_64::*;
        let n8 = gate.len().min(up.len()) / 8 * 8;
        let (gp, up_p) = (gate.as_mut_ptr(), up.as_ptr());
        let (lo, hi) = (_mm256_set1_ps(-10.0), _mm256_set1_ps(10.0));
        let mut bits = [0u16; 8];
        // Each step reads and writes lanes i..i+8 ≤ n8 of both slices.
        for i in (0..n8).step_by(8) {
            let x = _mm256_loadu_ps(gp.add(i));
            let u = _mm256_loadu_ps(up_p.add(i));
            // x → f16 → table → f32, then times up.
            _mm_storeu_si128(
                bits.as_mut_ptr() as *mut __m128i,
                _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(x),
            );
            for b in bits.iter_mut() {
                *b = *table.get_unchecked(*b as usize);
            }
            let g = _mm256_mul_ps(
                _mm256_cvtph_ps(_mm_loadu_si128(bits.as_ptr() as *const __m128i)),
                u,
            );
            // Outside (−10, 10): 0 below, x · up above.
            let g = _mm256_blendv_ps(g, _mm256_mul_ps(x, u), _mm256_cmp_ps::<_CMP_GE_OQ>(x, hi));
            let g = _mm256_blendv_ps(g, _mm256_setzero_ps(), _mm256_cmp_ps::<_CMP_LE_OQ>(x, lo));
            _mm256_storeu_ps(gp.add(i), g);
        }
        n8
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_geglu_equals_direct_geglu() {
        use half::f16;
        let gate: Vec<f32> = (0..2003).map(|i| (i as f32 - 1000.0) * 0.0123).collect();
        let up: Vec<f32> = (0..2003).map(|i| 1.0 + (i % 5) as f32 * 0.5).collect();
        let direct = |x: f32, u: f32| {
            if x <= -10.0 {
                0.0
            } else if x >= 10.0 {
                x * u
            } else {
                f16::from_f32(gelu_tanh1(f16::from_f32(x).to_f32())).to_f32() * u
            }
        };
        let want: Vec<f32> = gate.iter().zip(&up).map(|(&g, &u)| direct(g, u)).collect();
        let mut got = gate.clone();
        geglu(&mut got, &up);
        for (g, w) in got.iter().zip(&want) {
            assert_eq!(g.to_bits(), w.to_bits());
        }
    }

    #[test]
    fn swiglu_oai_clamps_gate_above_and_up_both_ways() {
        let mut gate = [10.0f32, -3.0, 0.0, 2.0];
        let up = [0.5f32, 9.0, 1.0, -8.0];
        swiglu_oai(&mut gate, &up, 1.702, 7.0);
        let f = |x: f32, y: f32| x / (1.0 + (-1.702 * x).exp()) * (y + 1.0);
        assert_eq!(gate, [f(7.0, 0.5), f(-3.0, 7.0), 0.0, f(2.0, -7.0)]);
    }

    #[test]
    fn vector_swiglu_equals_scalar_swiglu() {
        let gate: Vec<f32> = (0..1003).map(|i| (i as f32 - 500.0) * 0.37).collect();
        let up: Vec<f32> = (0..1003).map(|i| 1.0 + (i % 7) as f32 * 0.25).collect();
        let want: Vec<f32> = gate.iter().zip(&up).map(|(&g, &u)| silu1(g) * u).collect();
        let mut got = gate.clone();
        swiglu(&mut got, &up);
        for (g, w) in got.iter().zip(&want) {
            assert_eq!(g.to_bits(), w.to_bits());
        }
    }
}
