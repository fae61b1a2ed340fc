//! Activations and gated feed-forward combinations.

/// SiLU: `x * sigmoid(x)`, with ggml's `expf` (as its `ggml_v_silu`).
#[inline]
fn silu1(x: f32) -> f32 {
    x / (1.0 + super::softmax::ggml_expf(-x))
}

/// GELU, tanh approximation: `0.5 x (1 + tanh(sqrt(2/π) (x + 0.044715 x³)))`.
#[inline]
fn gelu_tanh1(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * x * (1.0 + 0.044715 * x * x)).tanh())
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

/// SwiGLU: `gate = silu(gate) * up`.
pub fn swiglu(gate: &mut [f32], up: &[f32]) {
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = silu1(*g) * u;
    }
}

/// GeGLU: `gate = gelu_tanh(gate) * up`, with ggml's GELU: for |x| < 10 it
/// looks `x` up in an f16 table (`GGML_GELU_FP16`), i.e. the GELU of `x`
/// rounded to f16, itself rounded to f16; 0 below −10 and `x` above 10.
pub fn geglu(gate: &mut [f32], up: &[f32]) {
    use half::f16;
    for (g, &u) in gate.iter_mut().zip(up) {
        let x = *g;
        *g = if x <= -10.0 {
            0.0
        } else if x >= 10.0 {
            x * u
        } else {
            f16::from_f32(gelu_tanh1(f16::from_f32(x).to_f32())).to_f32() * u
        };
    }
}
