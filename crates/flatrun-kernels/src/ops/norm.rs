//! RMSNorm.

/// One row: `out = x / rms(x) * (weight + weight_offset)`, `rms = sqrt(mean(x²) + eps)`.
/// `weight_offset` is 1 for checkpoints that store Gemma's `weight - 1` (Hugging Face, MLX),
/// 0 otherwise.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, weight_offset: f32, out: &mut [f32]) {
    // Mean square: f32 squares accumulated in f64, like ggml's ggml_float sum.
    let sum_sq: f64 = x.iter().map(|&v| (v * v) as f64).sum();
    let mean_sq = (sum_sq / x.len().max(1) as f64) as f32;
    let inv_rms = 1.0 / (mean_sq + eps).sqrt();
    // Scale each value, then apply the (offset) weight.
    for ((o, &v), &g) in out.iter_mut().zip(x).zip(weight) {
        *o = v * inv_rms * (g + weight_offset);
    }
}

/// RMSNorm in place over consecutive rows of `dim` values each (rows split over the
/// pool when there are many).
pub fn rms_norm_rows(x: &mut [f32], dim: usize, weight: &[f32], eps: f32, weight_offset: f32) {
    if dim == 0 {
        return;
    }
    super::rows::par_rows_mut(x, dim, |_, rows| {
        rms_norm_rows_serial(rows, dim, weight, eps, weight_offset)
    });
}

/// [`rms_norm_rows`] on the calling thread.
fn rms_norm_rows_serial(x: &mut [f32], dim: usize, weight: &[f32], eps: f32, weight_offset: f32) {
    for row in x.chunks_exact_mut(dim) {
        let sum_sq: f64 = row.iter().map(|&v| (v * v) as f64).sum();
        let inv_rms = 1.0 / ((sum_sq / dim as f64) as f32 + eps).sqrt();
        for (v, &g) in row.iter_mut().zip(weight) {
            *v = *v * inv_rms * (g + weight_offset);
        }
    }
}
