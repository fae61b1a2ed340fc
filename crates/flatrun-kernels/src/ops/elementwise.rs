//! Element-wise arithmetic.

/// Residual add: `acc += x`.
pub fn add(acc: &mut [f32], x: &[f32]) {
    for (a, &b) in acc.iter_mut().zip(x) {
        *a += b;
    }
}

/// `x *= s` (e.g. Gemma's embedding scale).
pub fn scale(x: &mut [f32], s: f32) {
    for v in x {
        *v *= s;
    }
}
