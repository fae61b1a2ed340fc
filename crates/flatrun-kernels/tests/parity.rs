//! Native against reference, every format, every SIMD level the host supports,
//! over shapes with ragged tails (rows, token tiles, float columns).

mod common;

use common::{GGML_BUDGETS, MLX_FORMATS, MlxTensor, Rng, check_levels, magnitudes, random_ggml};
use flatrun_format::GgmlType;
use flatrun_kernels::{Kernels, NativeKernels, Weight, WeightFormat, supported_levels};
use proptest::prelude::*;

#[test]
fn every_format_within_budget_on_a_fixed_shape() {
    let mut rng = Rng(0x9E3779B97F4A7C15);
    for &(t, budget) in GGML_BUDGETS {
        let cols = 512;
        let bytes = random_ggml(t, 13, cols, &mut rng);
        let w = Weight::new(WeightFormat::Ggml(t), 13, cols, &bytes, None, None).unwrap();
        let worst = (1..=6)
            .map(|n| check_levels(&w, n, budget, &mut rng))
            .fold(0f32, f32::max);
        println!(
            "{:>7}: worst relative error {worst:.2e} (budget {budget:.0e})",
            t.traits().name
        );
    }
}

#[test]
fn mlx_formats_match_reference() {
    let mut rng = Rng(42);
    for &(bits, group) in MLX_FORMATS {
        let mlx = MlxTensor::random(bits, group, GgmlType::F16, 7, 256, false, &mut rng);
        let w = mlx.weight();
        // 4/8-bit have fused kernels (8-bit activations, like Q4_1/Q8_0; see
        // tests/mlx_affine.rs); the other widths decode rows then take an f32 dot.
        let budget = if matches!(bits, 4 | 8) { 5e-3 } else { 1e-5 };
        check_levels(&w, 3, budget, &mut rng);
    }
}

#[test]
fn gemm_equals_gemv_per_token() {
    // The token-tiled GEMM path must give the same numbers as one GEMV per token.
    let mut rng = Rng(7);
    for &(t, _) in GGML_BUDGETS {
        let (rows, cols) = (9, 256);
        let bytes = random_ggml(t, rows, cols, &mut rng);
        let w = Weight::new(WeightFormat::Ggml(t), rows, cols, &bytes, None, None).unwrap();
        let n = 7;
        let x: Vec<f32> = (0..n * cols).map(|_| rng.f32()).collect();
        for level in supported_levels() {
            let k = NativeKernels::new(level);
            let mut gemm = vec![0f32; n * rows];
            k.matmul(&w, &x, n, &mut gemm).unwrap();
            for tok in 0..n {
                let mut gemv = vec![0f32; rows];
                k.matmul(&w, &x[tok * cols..(tok + 1) * cols], 1, &mut gemv)
                    .unwrap();
                for r in 0..rows {
                    let (a, b) = (gemm[tok * rows + r], gemv[r]);
                    assert!(
                        (a - b).abs() <= 1e-5 * (1.0 + b.abs()),
                        "{t:?} {level}: token {tok} row {r}: {a} vs {b}"
                    );
                }
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn ragged_shapes_within_budget(
        fmt in 0..GGML_BUDGETS.len(),
        rows in 1usize..37,
        blocks in 1usize..5,
        extra_cols in 0usize..8,
        n_tokens in 1usize..10,
        seed in any::<u64>(),
    ) {
        let (t, budget) = GGML_BUDGETS[fmt];
        // Float formats take any width: add a ragged tail past the 8-lane SIMD width.
        let cols = if t.is_quantized() { blocks * t.block_size() } else { blocks * 32 + extra_cols };
        let mut rng = Rng(seed | 1);
        let bytes = random_ggml(t, rows, cols, &mut rng);
        let w = Weight::new(WeightFormat::Ggml(t), rows, cols, &bytes, None, None).unwrap();
        check_levels(&w, n_tokens, budget, &mut rng);
    }
}

#[test]
fn bad_calls_are_errors_not_panics() {
    let bytes = vec![0u8; 18 * 4];
    let w = Weight::new(
        WeightFormat::Ggml(GgmlType::Q4_0),
        2,
        64,
        &bytes,
        None,
        None,
    )
    .unwrap();
    let k = NativeKernels::new(flatrun_kernels::simd_level());
    let mut out = vec![0f32; 2];
    assert!(k.matmul(&w, &[0.0; 63], 1, &mut out).is_err());
    assert!(k.matmul(&w, &[0.0; 64], 1, &mut out[..1]).is_err());
    assert!(k.dequantize_rows(&w, 1..3, &mut [0.0; 128]).is_err());
    assert!(
        Weight::new(
            WeightFormat::Ggml(GgmlType::Q4_0),
            2,
            60,
            &bytes,
            None,
            None
        )
        .is_err()
    );
    assert!(
        Weight::new(
            WeightFormat::Ggml(GgmlType::Q4_0),
            3,
            64,
            &bytes,
            None,
            None
        )
        .is_err()
    );
    assert!(w.row_range(1..3).is_err());
    let half = w.row_range(1..2).unwrap();
    assert_eq!(half.rows, 1);
    assert_eq!(half.data.len(), 36);
}

#[test]
fn simd_levels_agree_with_scalar_kernels() {
    // Same integer arithmetic at every level: only f32 summation order differs.
    let mut rng = Rng(99);
    let scalar = NativeKernels::new(flatrun_kernels::SimdLevel::Scalar);
    for &(t, _) in GGML_BUDGETS {
        let (rows, cols) = (11, 768);
        let bytes = random_ggml(t, rows, cols, &mut rng);
        let w = Weight::new(WeightFormat::Ggml(t), rows, cols, &bytes, None, None).unwrap();
        let n = 5;
        let x: Vec<f32> = (0..n * cols).map(|_| rng.f32()).collect();
        let mag = magnitudes(&w, &x, n);
        let mut want = vec![0f32; n * rows];
        scalar.matmul(&w, &x, n, &mut want).unwrap();
        for level in supported_levels() {
            let mut got = vec![0f32; n * rows];
            NativeKernels::new(level)
                .matmul(&w, &x, n, &mut got)
                .unwrap();
            for i in 0..got.len() {
                let rel = (got[i] - want[i]).abs() / mag[i].max(1e-20);
                assert!(
                    rel < 2e-6,
                    "{t:?} at {level}: output {i}: {} vs scalar {} (rel {rel:e})",
                    got[i],
                    want[i]
                );
            }
        }
    }
}

#[test]
fn unfused_formats_fall_back_to_decode_then_dot() {
    // Types with no fused kernel (here Q8_1 stored as weights, and I8) still multiply.
    let mut rng = Rng(5);
    let rows = 3;
    let cols = 64;
    let bytes: Vec<u8> = (0..rows * cols).map(|_| rng.byte() % 16).collect();
    let w = Weight::new(
        WeightFormat::Ggml(GgmlType::I8),
        rows,
        cols,
        &bytes,
        None,
        None,
    )
    .unwrap();
    check_levels(&w, 2, 1e-5, &mut rng);
}
