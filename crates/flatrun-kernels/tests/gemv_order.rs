//! The one-token (GEMV) kernels of the legacy and float formats stream two rows at a time
//! (`legacy_gemv_halves`, `legacy_gemv2`, `float_gemv2` in `native/x86.rs`) for memory
//! bandwidth, but each output must keep ggml's per-output float order: the same bits as the
//! token-tiled kernel that walks one row at a time. The Q2_K, Q3_K and IQ4_XS one-token kernels
//! (`q2_k_gemv_rows`, `q3_k_gemv_rows`, `iq4_xs_gemv_rows`) likewise take two rows at a time and
//! must give the bits of `*_n::<false, N>` (ggml's `vec_dot` order). Checked bit for bit at every SIMD level,
//! on odd row counts (the last row of a group takes the single-row kernel), rows wide enough
//! for several pool chunks, and rows wider than the kernels' stack table of activation sums.

mod common;

use common::{matmul_with, random_case, Rng, LEGACY_FORMATS};
use flatrun_format::GgmlType;
use flatrun_kernels::{supported_levels, NativeKernels, Weight, WeightFormat};

/// The legacy formats and the plain floats.
fn formats() -> impl Iterator<Item = GgmlType> {
    LEGACY_FORMATS
        .iter()
        .copied()
        .chain([GgmlType::F32, GgmlType::F16, GgmlType::BF16])
}

/// GEMV of every token equals, bit for bit, that token's column of a 3-token GEMM.
fn gemv_bits_equal_gemm(t: GgmlType, rows: usize, cols: usize, rng: &mut Rng) {
    let n = 3;
    let (bytes, x) = random_case(t, rows, cols, n, rng);
    let w = Weight::new(WeightFormat::Ggml(t), rows, cols, &bytes, None, None).unwrap();
    for level in supported_levels() {
        let k = NativeKernels::new(level);
        let gemm = matmul_with(&k, &w, &x, n);
        for tok in 0..n {
            let gemv = matmul_with(&k, &w, &x[tok * cols..(tok + 1) * cols], 1);
            for r in 0..rows {
                let (a, b) = (gemm[tok * rows + r], gemv[r]);
                assert_eq!(
                    a.to_bits(),
                    b.to_bits(),
                    "{t:?} {level} {rows}x{cols}: token {tok} row {r}: GEMM {a} vs GEMV {b}"
                );
            }
        }
    }
}

#[test]
fn gemv_keeps_the_per_row_float_order() {
    let mut rng = Rng(11);
    for t in formats() {
        // 37 rows: pool chunks of 16 and an odd tail; 896 columns as Qwen2.5's head.
        gemv_bits_equal_gemm(t, 37, 896, &mut rng);
        gemv_bits_equal_gemm(t, 5, 128, &mut rng);
    }
}

#[test]
fn gemv_of_rows_wider_than_the_offset_table_keeps_the_order() {
    // 1040 blocks of 32: more than the 1024 activation sums the Q4_0/Q5_0 and Q1_0 kernels keep.
    let mut rng = Rng(12);
    for t in [
        GgmlType::Q4_0,
        GgmlType::Q5_0,
        GgmlType::Q4_1,
        GgmlType::Q1_0,
    ] {
        gemv_bits_equal_gemm(t, 3, 1040 * 32, &mut rng);
    }
}

#[test]
fn kquant_gemv_keeps_the_vec_dot_float_order() {
    let mut rng = Rng(13);
    for t in [GgmlType::Q2_K, GgmlType::Q3_K, GgmlType::IQ4_XS] {
        // 37 rows: pool chunks of 16 and an odd tail; 4096 columns = 16 blocks.
        gemv_bits_equal_gemm(t, 37, 4096, &mut rng);
        gemv_bits_equal_gemm(t, 5, 256, &mut rng);
        gemv_bits_equal_gemm(t, 2, 768, &mut rng);
        gemv_bits_equal_gemm(t, 1, 512, &mut rng);
    }
    // 129 blocks: more than the 128 activation blocks the IQ4_XS kernel keeps `|a|` of.
    gemv_bits_equal_gemm(GgmlType::IQ4_XS, 3, 129 * 256, &mut rng);
}
