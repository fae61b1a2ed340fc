//! The reference backend: the math ggml computes for a quantized matmul, written
//! plainly. Each weight row is dequantized to f32 with flatrun-dequant's reference
//! decoders; the activations are rounded as ggml rounds them for that weight type
//! (quantized to the weights' dot partner — Q8 blocks of 32 or Q8_K blocks of 256 —
//! and dequantized back, or rounded to f16/bf16); then one dot product in f64. The one
//! term ggml does not take from those values is the min of Q4_1/Q5_1: it multiplies it
//! by the activations' block sum as its Q8_1 partner stores it (rounded to f16).
//! No summation order is imitated: that is the native backend's business.
//! Short and obviously correct; the yardstick the native backend is held to.

use std::ops::Range;

use flatrun_format::GgmlType;

use crate::check::{check_dequantize, check_matmul};
use crate::decode::decode_row;
use crate::native::quantize::QK8;
use crate::weight::WeightFormat;
use crate::{KernelError, Kernels, Weight};

use crate::decode::is_supported;

/// Dequantize-then-dot, single-threaded, no SIMD.
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
        let (x, block_sums) = round_activations(w, &x[..n_tokens * w.cols]);
        let mut row = vec![0f32; w.cols];
        for r in 0..w.rows {
            // Decode row r once, then dot it with every token.
            decode_row(w, r, &mut row)?;
            let mins = block_mins(w, r);
            for t in 0..n_tokens {
                let xt = &x[t * w.cols..(t + 1) * w.cols];
                // Accumulate in f64 so the yardstick carries no rounding of its own worth mentioning.
                let mut dot: f64 = row.iter().zip(xt).map(|(&a, &b)| a as f64 * b as f64).sum();
                // Q4_1/Q5_1: the min meets ggml's stored (f16) block sum, not the exact one.
                let sums = &block_sums[t * mins.len()..(t + 1) * mins.len()];
                for ((&m, &s), xb) in mins.iter().zip(sums).zip(xt.chunks_exact(QK8)) {
                    let exact: f64 = xb.iter().map(|&v| v as f64).sum();
                    dot += m as f64 * (s as f64 - exact);
                }
                out[t * w.rows + r] = dot as f32;
            }
        }
        Ok(())
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

/// `x` as ggml rounds it before a product with weights of `w`'s type: to
/// the weights' dot partner (Q8_0/Q8_1 blocks of 32, Q8_K blocks of 256),
/// to f16 or bf16, or unchanged. Also each 32-block's stored sum `s` (ggml's
/// Q8_1, an f16) when the weights have a min (Q4_1/Q5_1), else nothing.
fn round_activations(w: &Weight, x: &[f32]) -> (Vec<f32>, Vec<f32>) {
    use crate::native::quantize::{quantize_q8, quantize_q8k, BlockQ8, BlockQ8K, QK_K};
    use GgmlType::*;
    match w.format {
        WeightFormat::Ggml(t @ (Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | IQ4_NL | Q1_0))
            if x.len() % QK8 == 0 =>
        {
            let mut blocks = vec![BlockQ8::default(); x.len() / QK8];
            quantize_q8(x, &mut blocks);
            let values = blocks
                .iter()
                .flat_map(|b| b.qs.iter().map(move |&q| b.d * q as f32))
                .collect();
            let sums = match t {
                Q4_1 | Q5_1 => blocks.iter().map(|b| b.s).collect(),
                _ => Vec::new(),
            };
            (values, sums)
        }
        WeightFormat::Ggml(Q2_K | Q3_K | Q4_K | Q5_K | Q6_K | IQ4_XS) if x.len() % QK_K == 0 => {
            let mut blocks = vec![BlockQ8K::default(); x.len() / QK_K];
            quantize_q8k(x, &mut blocks);
            let values = blocks
                .iter()
                .flat_map(|b| b.qs.iter().map(move |&q| b.d * q as f32))
                .collect();
            (values, Vec::new())
        }
        WeightFormat::Ggml(F16) => (
            x.iter().map(|&v| half::f16::from_f32(v).to_f32()).collect(),
            Vec::new(),
        ),
        WeightFormat::Ggml(BF16) => (
            x.iter()
                .map(|&v| half::bf16::from_f32(v).to_f32())
                .collect(),
            Vec::new(),
        ),
        _ => (x.to_vec(), Vec::new()),
    }
}

/// The per-32-block mins `m` of row `r` for Q4_1/Q5_1 weights (an f16 at byte 2 of each
/// block), else nothing.
fn block_mins(w: &Weight, r: usize) -> Vec<f32> {
    match w.format {
        WeightFormat::Ggml(t @ (GgmlType::Q4_1 | GgmlType::Q5_1)) if w.cols % QK8 == 0 => {
            let rb = w.row_bytes();
            w.data[r * rb..(r + 1) * rb]
                .chunks_exact(t.type_size())
                .map(|b| half::f16::from_le_bytes([b[2], b[3]]).to_f32())
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
