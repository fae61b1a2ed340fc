//! The reference backend's vectorized, multi-threaded f64 dot against the plain
//! math it stands for: one sequential f64 sum per (row, token), rounded to f32.
//!
//! F32 weights take the activations unrounded, so the only difference is the
//! order of the f64 additions (16 partial sums folded pairwise, rows split over
//! the pool): far below one f32 ulp of the result, so the outputs may differ
//! by at most one rounding of that sum (budget: 2 ulp relative, 2.4e-7, of the
//! row's Σ|w·x|). Shapes have ragged tails (columns not a multiple of 16) and
//! enough rows to split into several tasks.

mod common;

use common::Rng;
use flatrun_format::GgmlType;
use flatrun_kernels::{Kernels, ReferenceKernels, Weight, WeightFormat};

#[test]
fn f64_partial_sums_match_a_sequential_sum() {
    let mut rng = Rng(0x5DEECE66D);
    for &(rows, cols) in &[(1, 1), (3, 15), (7, 16), (33, 100), (1000, 37), (257, 576)] {
        let weights: Vec<f32> = (0..rows * cols).map(|_| rng.f32()).collect();
        let bytes: Vec<u8> = weights.iter().flat_map(|v| v.to_le_bytes()).collect();
        let w = Weight::new(
            WeightFormat::Ggml(GgmlType::F32),
            rows,
            cols,
            &bytes,
            None,
            None,
        )
        .expect("weight");
        for n_tokens in 1..=3 {
            let x: Vec<f32> = (0..n_tokens * cols).map(|_| rng.f32()).collect();
            let mut got = vec![0f32; n_tokens * rows];
            ReferenceKernels
                .matmul(&w, &x, n_tokens, &mut got)
                .expect("matmul");
            for t in 0..n_tokens {
                let xt = &x[t * cols..(t + 1) * cols];
                for r in 0..rows {
                    let row = &weights[r * cols..(r + 1) * cols];
                    let want: f64 = row.iter().zip(xt).map(|(&a, &b)| a as f64 * b as f64).sum();
                    let scale: f64 = row
                        .iter()
                        .zip(xt)
                        .map(|(&a, &b)| (a as f64 * b as f64).abs())
                        .sum();
                    let diff = (got[t * rows + r] as f64 - want).abs();
                    assert!(
                        diff <= 2.4e-7 * scale.max(f64::MIN_POSITIVE),
                        "{rows}x{cols}, token {t}, row {r}: {} vs {want} (Σ|w·x| {scale})",
                        got[t * rows + r]
                    );
                }
            }
        }
    }
}
