//! The reference backend: dequantize each row to f32 with flatrun-dequant's
//! reference decoders, then a plain dot product (in f64) with the activations
//! rounded as ggml rounds them for that weight type (to Q8 blocks for
//! quantized weights, to f16/bf16 for f16/bf16 weights) — the one rounding
//! llama.cpp's answers depend on most.
//! Short and obviously correct; the yardstick the native backend is held to.

use std::ops::Range;

use flatrun_format::GgmlType;

use crate::check::{check_dequantize, check_matmul};
use crate::decode::decode_row;
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
        let x = &round_activations(w, &x[..n_tokens * w.cols]);
        let mut row = vec![0f32; w.cols];
        for r in 0..w.rows {
            // Decode row r once, then dot it with every token.
            decode_row(w, r, &mut row)?;
            for t in 0..n_tokens {
                let xt = &x[t * w.cols..(t + 1) * w.cols];
                // Accumulate in f64 so the yardstick carries no rounding of its own worth mentioning.
                let dot: f64 = row.iter().zip(xt).map(|(&a, &b)| a as f64 * b as f64).sum();
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
/// to f16 or bf16, or unchanged.
fn round_activations(w: &Weight, x: &[f32]) -> Vec<f32> {
    use crate::native::quantize::{quantize_q8, quantize_q8k, BlockQ8, BlockQ8K, QK8, QK_K};
    use crate::weight::WeightFormat;
    use GgmlType::*;
    match w.format {
        WeightFormat::Ggml(Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | IQ4_NL | Q1_0)
            if x.len() % QK8 == 0 =>
        {
            let mut blocks = vec![BlockQ8::default(); x.len() / QK8];
            quantize_q8(x, &mut blocks);
            blocks
                .iter()
                .flat_map(|b| b.qs.iter().map(move |&q| b.d * q as f32))
                .collect()
        }
        WeightFormat::Ggml(Q2_K | Q3_K | Q4_K | Q5_K | Q6_K | IQ4_XS) if x.len() % QK_K == 0 => {
            let mut blocks = vec![BlockQ8K::default(); x.len() / QK_K];
            quantize_q8k(x, &mut blocks);
            blocks
                .iter()
                .flat_map(|b| b.qs.iter().map(move |&q| b.d * q as f32))
                .collect()
        }
        WeightFormat::Ggml(F16) => x.iter().map(|&v| half::f16::from_f32(v).to_f32()).collect(),
        WeightFormat::Ggml(BF16) => x
            .iter()
            .map(|&v| half::bf16::from_f32(v).to_f32())
            .collect(),
        _ => x.to_vec(),
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
