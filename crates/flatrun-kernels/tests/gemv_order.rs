//! The one-token (GEMV) kernels of the legacy and float formats stream several rows at a time
//! (`legacy_gemv_halves`: two row pairs per pass for the 4-bit formats, then a last pair;
//! `legacy_gemv2`, `float_gemv2`: pairs; all in `native/x86.rs`) for memory
//! bandwidth, but each output must keep ggml's per-output float order: the same bits as the
//! token-tiled kernel that walks one row at a time. The K-quant and IQ4_XS one-token kernels
//! (`q2_k_gemv_rows` … `q6_k_gemv_rows`, `iq4_xs_gemv_rows`) likewise take two rows at a time
//! and must give the bits of the single-row kernels (`*_n::<false, N>`, ggml's `vec_dot` order;
//! Q4_K: `q4_k_n::<N>`, ggml's repacked GEMV order). Checked bit for bit at every SIMD level,
//! on odd row counts (the last row of a group takes the single-row kernel), odd pair counts
//! (the last pair of a group takes a one-pair pass), rows wide enough
//! for several pool chunks, and rows wider than the kernels' stack table of activation sums.

mod common;

use common::{LEGACY_FORMATS, Rng, assert_gemv_equals_gemm_columns, random_case};
use flatrun_format::GgmlType;
use flatrun_kernels::{Weight, WeightFormat};

/// The legacy formats and the plain floats.
fn formats() -> impl Iterator<Item = GgmlType> {
    LEGACY_FORMATS
        .iter()
        .copied()
        .chain([GgmlType::F32, GgmlType::F16, GgmlType::BF16])
}

/// GEMV of every token equals, bit for bit, that token's column of a 3-token GEMM.
fn gemv_bits_equal_gemm(t: GgmlType, rows: usize, cols: usize, rng: &mut Rng) {
    let (bytes, x) = random_case(t, rows, cols, 3, rng);
    bits_equal_gemm(t, rows, cols, &bytes, &x);
}

/// [`gemv_bits_equal_gemm`] on given weights and 3 tokens `x`.
fn bits_equal_gemm(t: GgmlType, rows: usize, cols: usize, bytes: &[u8], x: &[f32]) {
    let w = Weight::new(WeightFormat::Ggml(t), rows, cols, bytes, None, None).unwrap();
    assert_gemv_equals_gemm_columns(&w, x, 3, &format!("{t:?}"));
}

#[test]
fn gemv_keeps_the_per_row_float_order() {
    let mut rng = Rng(11);
    for t in formats() {
        // 37 rows: pool chunks of 16 and an odd tail; 896 columns as Qwen2.5's head.
        gemv_bits_equal_gemm(t, 37, 896, &mut rng);
        gemv_bits_equal_gemm(t, 5, 128, &mut rng);
        // Two pairs, a last pair and a last row; a lone pair.
        gemv_bits_equal_gemm(t, 7, 256, &mut rng);
        gemv_bits_equal_gemm(t, 2, 128, &mut rng);
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
    for t in [
        GgmlType::Q2_K,
        GgmlType::Q3_K,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
        GgmlType::IQ4_XS,
    ] {
        // 37 rows: pool chunks of 16 and an odd tail; 4096 columns = 16 blocks.
        gemv_bits_equal_gemm(t, 37, 4096, &mut rng);
        gemv_bits_equal_gemm(t, 5, 256, &mut rng);
        gemv_bits_equal_gemm(t, 2, 768, &mut rng);
        gemv_bits_equal_gemm(t, 1, 512, &mut rng);
    }
    // 129 blocks: more than the 128 activation blocks the IQ4_XS kernel keeps `|a|` of.
    gemv_bits_equal_gemm(GgmlType::IQ4_XS, 3, 129 * 256, &mut rng);
}

#[test]
fn q3_k_gemv_keeps_the_order_at_extreme_values() {
    // Every value 7 (all `qs` and `hmask` bits set) with every scale 31, or every value 0 with
    // every scale −32, against activations at both ends of Q8_K's range (−128 and 127): the
    // one-token kernel's products of 16·value (its high-nibble chunks) and its sums must
    // neither saturate nor overflow. d = 2^-10 (f16 0x1400).
    let (rows, cols) = (5, 1024);
    let block = |fill: u8| {
        let mut b = vec![fill; 110];
        b[108..110].copy_from_slice(&0x1400u16.to_le_bytes());
        b
    };
    let x: Vec<f32> = (0..3 * cols)
        .map(|i| match (i / cols, i % 4) {
            (0, 0 | 1) => -1.0,
            (0, _) => 1.0,
            (1, _) => -1.0,
            _ => {
                if i % 2 == 0 {
                    1.0
                } else {
                    -0.5
                }
            }
        })
        .collect();
    for fill in [0xFF, 0x00] {
        let bytes: Vec<u8> = (0..rows * cols / 256).flat_map(|_| block(fill)).collect();
        bits_equal_gemm(GgmlType::Q3_K, rows, cols, &bytes, &x);
    }
    // Blocks cycling through the two extremes and random blocks.
    let mut rng = Rng(14);
    let (random, _) = random_case(GgmlType::Q3_K, rows, cols, 1, &mut rng);
    let bytes: Vec<u8> = (0..rows * cols / 256)
        .flat_map(|k| match k % 3 {
            0 => block(0xFF),
            1 => block(0x00),
            _ => random[k * 110..(k + 1) * 110].to_vec(),
        })
        .collect();
    bits_equal_gemm(GgmlType::Q3_K, rows, cols, &bytes, &x);
}
