//! The reference backend: the math ggml computes for a quantized matmul, written
//! plainly. Each weight row is dequantized to f32 with flatrun-dequant's reference
//! decoders; the activations are rounded as ggml rounds them for that weight type
//! (quantized to the weights' dot partner — Q8 blocks of 32 or Q8_K blocks of 256 —
//! and dequantized back, or rounded to f16/bf16); then one dot product in f64. The one
//! term ggml does not take from those values is the min of Q4_1/Q5_1: it multiplies it
//! by the activations' block sum as its Q8_1 partner stores it (rounded to f16).
//!
//! No summation order is imitated, ggml's or any other: that is the native backend's
//! business. The dot keeps [`DOT_LANES`] independent f64 partial sums (lane `i` takes
//! the products `i, i + 16, i + 32, …`), folded pairwise at the end, so the compiler
//! can vectorize it; that order is fixed by the code, not by the SIMD level, so the
//! result is the same bits with or without AVX2. In f64 the order moves a 576–8960
//! term dot of f32 products by far less than one f32 ulp of the result.
//!
//! Rows are split over the kernels' thread pool ([`crate::threads`]); each output is
//! computed by one task, whole, so the thread count does not change any result.
//! Short and obviously correct; the yardstick the native backend is held to.

use std::ops::Range;
use std::sync::Mutex;

use flatrun_format::GgmlType;

use crate::check::{check_dequantize, check_matmul};
use crate::decode::decode_row;
use crate::native::quantize::QK8;
use crate::native::{Partner, partner};
use crate::threads::{parallel_for, threads};
use crate::weight::WeightFormat;
use crate::{KernelError, Kernels, Weight};
use flatrun_dequant::{BlockQ4_1, BlockQ5_1};

use crate::decode::is_supported;

/// Independent partial sums of `dot` (this module's f64 dot product).
pub const DOT_LANES: usize = 16;
/// Decoded f32 weights one task holds (its rows are dotted with every token in turn).
const TASK_BYTES: usize = 64 << 10;

/// Dequantize-then-dot in f64, rows split over the thread pool.
#[derive(Debug, Default)]
pub struct ReferenceKernels;

impl Kernels for ReferenceKernels {
    fn name(&self) -> &'static str {
        "reference"
    }

    fn matmul(
        &self,
        w: &Weight,
        x: &[f32],
        n_tokens: usize,
        out: &mut [f32],
    ) -> Result<(), KernelError> {
        check_matmul(w, x, n_tokens, out)?;
        if w.rows == 0 || n_tokens == 0 {
            return Ok(());
        }
        let (x, min_terms) = round_activations(w, x);
        // Tasks of whole rows: about TASK_BYTES of decoded weights, and at least
        // four tasks per thread when the matrix is big enough.
        let rows_per_task = (TASK_BYTES / (4 * w.cols.max(1)))
            .min(w.rows.div_ceil(4 * threads()))
            .max(1);
        let n_tasks = w.rows.div_ceil(rows_per_task);
        let out = Mutex::new(out);
        let first_error = Mutex::new(None);
        parallel_for(n_tasks, &|task| {
            let rows = task * rows_per_task..((task + 1) * rows_per_task).min(w.rows);
            match dot_rows(w, rows.clone(), &x, &min_terms, n_tokens) {
                // Scatter the task's outputs (token-major, like `out`).
                Ok(dots) => {
                    let mut out = out.lock().unwrap_or_else(|e| e.into_inner());
                    for (t, dots_t) in dots.chunks_exact(rows.len()).enumerate() {
                        out[t * w.rows + rows.start..t * w.rows + rows.end].copy_from_slice(dots_t);
                    }
                }
                Err(e) => {
                    first_error
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .get_or_insert(e);
                }
            }
        });
        match first_error.into_inner().unwrap_or_else(|e| e.into_inner()) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    fn dequantize_rows(
        &self,
        w: &Weight,
        rows: Range<usize>,
        out: &mut [f32],
    ) -> Result<(), KernelError> {
        check_dequantize(w, &rows, out)?;
        for (i, r) in rows.enumerate() {
            decode_row(w, r, &mut out[i * w.cols..(i + 1) * w.cols])?;
        }
        Ok(())
    }
}

/// `W[rows] · x_t` for every token `t`, token-major (`n_tokens × rows.len()`): each
/// row decoded once, then dotted with every token's rounded activations `x`.
fn dot_rows(
    w: &Weight,
    rows: Range<usize>,
    x: &[f32],
    min_terms: &[f64],
    n_tokens: usize,
) -> Result<Vec<f32>, KernelError> {
    let cols = w.cols;
    // Decode the rows, and their Q4_1/Q5_1 block mins.
    let mut decoded = vec![0f32; rows.len() * cols];
    let mut mins = Vec::new();
    for (r, row) in rows.clone().zip(decoded.chunks_exact_mut(cols)) {
        decode_row(w, r, row)?;
        mins.extend(block_mins(w, r));
    }
    let blocks = if min_terms.is_empty() { 0 } else { cols / QK8 };
    let mut dots = Vec::with_capacity(n_tokens * rows.len());
    for t in 0..n_tokens {
        let xt = &x[t * cols..(t + 1) * cols];
        let min_terms_t = &min_terms[t * blocks..(t + 1) * blocks];
        for (i, row) in decoded.chunks_exact(cols).enumerate() {
            // Σ_c W[r][c] · x[c], in f64 so the yardstick carries no rounding of its own worth mentioning.
            let mut sum = dot(row, xt);
            // Q4_1/Q5_1: the min meets ggml's stored (f16) block sum, not the exact one.
            let mins_r = mins.get(i * blocks..(i + 1) * blocks).unwrap_or(&[]);
            sum += mins_r
                .iter()
                .zip(min_terms_t)
                .map(|(&m, &d)| m as f64 * d)
                .sum::<f64>();
            dots.push(sum as f32);
        }
    }
    Ok(dots)
}

/// `Σ a[i]·b[i]` in f64, over [`DOT_LANES`] independent partial sums.
fn dot(a: &[f32], b: &[f32]) -> f64 {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: AVX2 was detected on this CPU just above.
        return unsafe { dot_avx2(a, b) };
    }
    dot_body(a, b)
}

/// [`dot_body`] compiled for AVX2 (4 f64 per vector instead of SSE2's 2). Rust never
/// fuses a multiply and an add on its own, so the two builds give the same bits.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn dot_avx2(a: &[f32], b: &[f32]) -> f64 {
    dot_body(a, b)
}

#[cfg(target_arch = "x86_64")]
fn has_avx2() -> bool {
    static AVX2: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AVX2.get_or_init(|| is_x86_feature_detected!("avx2"))
}

#[inline(always)]
fn dot_body(a: &[f32], b: &[f32]) -> f64 {
    let mut lanes = [0f64; DOT_LANES];
    let whole = a.len().min(b.len()) / DOT_LANES * DOT_LANES;
    for (ca, cb) in a[..whole]
        .chunks_exact(DOT_LANES)
        .zip(b[..whole].chunks_exact(DOT_LANES))
    {
        let ca: [f64; DOT_LANES] = std::array::from_fn(|i| ca[i] as f64);
        let cb: [f64; DOT_LANES] = std::array::from_fn(|i| cb[i] as f64);
        for i in 0..DOT_LANES {
            lanes[i] += ca[i] * cb[i];
        }
    }
    for (i, (&va, &vb)) in a[whole..].iter().zip(&b[whole..]).enumerate() {
        lanes[i] += va as f64 * vb as f64;
    }
    // Fold the lanes pairwise: 16 -> 8 -> 4 -> 2 -> 1.
    let mut width = DOT_LANES;
    while width > 1 {
        width /= 2;
        for i in 0..width {
            lanes[i] += lanes[i + width];
        }
    }
    lanes[0]
}

/// `x` as ggml rounds it before a product with weights of `w`'s type: to
/// the weights' dot partner (Q8_0/Q8_1 blocks of 32, Q8_K blocks of 256),
/// to f16 or bf16, or unchanged. Also, when the weights have a min
/// (Q4_1/Q5_1), each token's 32-blocks' `s − Σx`: ggml's Q8_1 stored sum `s`
/// (an f16) less the exact sum of the rounded values, which the dot already
/// counted; else nothing.
fn round_activations(w: &Weight, x: &[f32]) -> (Vec<f32>, Vec<f64>) {
    use crate::native::quantize::{BlockQ8, BlockQ8K, QK_K, quantize_q8, quantize_q8k};
    match (partner(w.format), w.format) {
        (Partner::Q8, WeightFormat::Ggml(t)) if x.len().is_multiple_of(QK8) => {
            let mut blocks = vec![BlockQ8::default(); x.len() / QK8];
            quantize_q8(x, &mut blocks);
            let values: Vec<f32> = blocks
                .iter()
                .flat_map(|b| b.qs.iter().map(move |&q| b.d * q as f32))
                .collect();
            let min_terms = if has_min(t) {
                blocks
                    .iter()
                    .zip(values.chunks_exact(QK8))
                    .map(|(b, xb)| b.s as f64 - xb.iter().map(|&v| v as f64).sum::<f64>())
                    .collect()
            } else {
                Vec::new()
            };
            (values, min_terms)
        }
        (Partner::Q8K, WeightFormat::Ggml(_)) if x.len().is_multiple_of(QK_K) => {
            let mut blocks = vec![BlockQ8K::default(); x.len() / QK_K];
            quantize_q8k(x, &mut blocks);
            let values = blocks
                .iter()
                .flat_map(|b| b.qs.iter().map(move |&q| b.d * q as f32))
                .collect();
            (values, Vec::new())
        }
        (_, WeightFormat::Ggml(GgmlType::F16)) => (
            x.iter().map(|&v| half::f16::from_f32(v).to_f32()).collect(),
            Vec::new(),
        ),
        (_, WeightFormat::Ggml(GgmlType::BF16)) => (
            x.iter()
                .map(|&v| half::bf16::from_f32(v).to_f32())
                .collect(),
            Vec::new(),
        ),
        _ => (x.to_vec(), Vec::new()),
    }
}

/// Whether weights of `t` carry a per-block min that ggml multiplies by the
/// activations' stored block sum: the formats whose dot partner is Q8_1
/// (Q4_1, Q5_1).
fn has_min(t: GgmlType) -> bool {
    flatrun_dequant::dot_partner(t) == Some(GgmlType::Q8_1)
}

// Q4_1 and Q5_1 keep their min at the same offset, which `block_mins` relies on.
const MIN_OFFSET: usize = BlockQ4_1::M_OFFSET;
const _: () = assert!(BlockQ5_1::M_OFFSET == MIN_OFFSET);

/// The per-32-block mins `m` of row `r` for Q4_1/Q5_1 weights (the f16 `m` of
/// each block), else nothing.
fn block_mins(w: &Weight, r: usize) -> Vec<f32> {
    match w.format {
        WeightFormat::Ggml(t)
            if has_min(t) && partner(w.format) == Partner::Q8 && w.cols.is_multiple_of(QK8) =>
        {
            let rb = w.row_bytes();
            w.data[r * rb..(r + 1) * rb]
                .chunks_exact(t.type_size())
                .map(|b| half::f16::from_le_bytes([b[MIN_OFFSET], b[MIN_OFFSET + 1]]).to_f32())
                .collect()
        }
        _ => Vec::new(),
    }
}

/// Formats the reference backend decodes (every one the crate accepts).
pub fn supported_ggml_types() -> Vec<GgmlType> {
    GgmlType::ALL
        .iter()
        .copied()
        .filter(|&t| is_supported(t))
        .collect()
}
