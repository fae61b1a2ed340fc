//! The reference backend: dequantize each row to f32 with flatrun-dequant's
//! reference decoders, then a plain dot product.
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

/// Formats the reference backend decodes (every one the crate accepts).
pub fn supported_ggml_types() -> Vec<GgmlType> {
    GgmlType::ALL
        .iter()
        .copied()
        .filter(|&t| is_supported(t))
        .collect()
}
