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

/// GeGLU: `gate = gelu_tanh(gate) * up`.
pub fn geglu(gate: &mut [f32], up: &[f32]) {
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = gelu_tanh1(*g) * u;
    }
}
