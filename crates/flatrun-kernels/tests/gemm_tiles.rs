//! The register-blocked GEMM tiles hold each output's float order: their results equal,
//! bit for bit, the one-row kernels they stand in for, at every SIMD level the host supports.
//!
//! - Q4_K runs pairs of rows as one 2-row × 4-token tile (every tile of 4 tokens); an odd
//!   last row, or a one-row matrix, takes the one-row kernel. So a matrix must give the same
//!   bits as each of its rows multiplied alone (checked for Q6_K too, whose wide calls take
//!   ggml's tiled order).
//! - The legacy formats take tiles of 8 tokens on x86, whose order per output is the 4-token
//!   tile's: a call of 8+ tokens must give the same bits as calls of 4 tokens.

mod common;

use common::{LEGACY_FORMATS, Rng, matmul_with, random_case};
use flatrun_format::GgmlType;
use flatrun_kernels::{NativeKernels, Weight, WeightFormat, supported_levels};
use proptest::prelude::*;

/// Every row of a `t` matrix multiplied alone gives the bits of the whole matrix.
fn rows_alone_match_matrix(t: GgmlType, rows: usize, blocks: usize, n: usize, seed: u64) {
    let mut rng = Rng(seed | 1);
    let cols = blocks * t.block_size();
    let (bytes, x) = random_case(t, rows, cols, n, &mut rng);
    let w = Weight::new(WeightFormat::Ggml(t), rows, cols, &bytes, None, None).unwrap();
    for level in supported_levels() {
        let k = NativeKernels::new(level);
        let whole = matmul_with(&k, &w, &x, n);
        for r in 0..rows {
            let alone = matmul_with(&k, &w.row_range(r..r + 1).unwrap(), &x, n);
            for tok in 0..n {
                let (a, b) = (whole[tok * rows + r], alone[tok]);
                assert_eq!(
                    a.to_bits(),
                    b.to_bits(),
                    "{t:?} {level}: {rows} rows × {n} tokens: row {r} token {tok}: {a} vs {b} alone"
                );
            }
        }
    }
}

/// A call of `n` tokens gives the bits of calls of 4 tokens (and a last call of the rest).
fn wide_tiles_match_tiles_of_4(t: GgmlType, rows: usize, blocks: usize, n: usize, seed: u64) {
    let mut rng = Rng(seed | 1);
    let cols = blocks * t.block_size();
    let (bytes, x) = random_case(t, rows, cols, n, &mut rng);
    let w = Weight::new(WeightFormat::Ggml(t), rows, cols, &bytes, None, None).unwrap();
    for level in supported_levels() {
        let k = NativeKernels::new(level);
        let whole = matmul_with(&k, &w, &x, n);
        for t0 in (0..n).step_by(4) {
            let m = 4.min(n - t0);
            let part = matmul_with(&k, &w, &x[t0 * cols..(t0 + m) * cols], m);
            for (i, (a, b)) in whole[t0 * rows..(t0 + m) * rows]
                .iter()
                .zip(&part)
                .enumerate()
            {
                assert_eq!(
                    a.to_bits(),
                    b.to_bits(),
                    "{t:?} {level}: {n} tokens: token {} row {}: {a} vs {b} in a call of {m}",
                    t0 + i / rows,
                    i % rows
                );
            }
        }
    }
}

#[test]
fn k_quant_pair_tiles_match_one_row_kernels() {
    // 4 tokens (Q4_K's GEMM tile), 8 and 13 (wide calls, a ragged last tile).
    for (i, t) in [GgmlType::Q4_K, GgmlType::Q6_K].into_iter().enumerate() {
        for (j, n) in [4, 8, 13].into_iter().enumerate() {
            rows_alone_match_matrix(t, 7, 3, n, (10 * i + j) as u64);
        }
    }
}

/// From 16 tokens, Q4_K and Q6_K row groups go through 16-row panels (on AVX-512
/// VNNI): whole panels, the group's last rows, and a ragged last token tile all keep the bits.
#[test]
fn k_quant_panels_match_one_row_kernels() {
    for (i, t) in [GgmlType::Q4_K, GgmlType::Q6_K].into_iter().enumerate() {
        for (j, (rows, n)) in [(8, 16), (37, 16), (37, 19), (64, 23), (129, 17), (16, 16)]
            .into_iter()
            .enumerate()
        {
            rows_alone_match_matrix(t, rows, 3, n, (40 + 10 * i + j) as u64);
        }
        // Rows of 40 blocks (5,760 / 8,400 bytes): row groups of 33 / 23 rows, cut to
        // whole panels (32 / 16 rows).
        rows_alone_match_matrix(t, 80, 40, 16, 47 + i as u64);
    }
}

/// From 16 tokens, the 32-value formats' row groups go through 8-row panels too (on
/// AVX-512 VNNI): the same bits as calls of 4 tokens and as each row alone.
#[test]
fn legacy_panels_match_tiles_of_4() {
    for (i, &t) in LEGACY_FORMATS.iter().enumerate() {
        for (j, (rows, blocks, n)) in [(8, 3, 16), (37, 5, 19), (64, 2, 23), (129, 1, 17)]
            .into_iter()
            .enumerate()
        {
            let seed = (60 + 10 * i + j) as u64;
            wide_tiles_match_tiles_of_4(t, rows, blocks, n, seed);
            rows_alone_match_matrix(t, rows, blocks, n, seed);
        }
    }
}

#[test]
fn legacy_wide_tiles_match_tiles_of_4() {
    for (i, &t) in LEGACY_FORMATS.iter().enumerate() {
        wide_tiles_match_tiles_of_4(t, 5, 3, 19, i as u64);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn k_quant_pair_tiles_over_shapes(
        q6 in any::<bool>(),
        rows in 1usize..12,
        blocks in 1usize..4,
        n in 1usize..18,
        seed in any::<u64>(),
    ) {
        let t = if q6 { GgmlType::Q6_K } else { GgmlType::Q4_K };
        rows_alone_match_matrix(t, rows, blocks, n, seed);
    }

    #[test]
    fn legacy_wide_tiles_over_shapes(
        fmt in 0..LEGACY_FORMATS.len(),
        rows in 1usize..12,
        blocks in 1usize..5,
        n in 1usize..26,
        seed in any::<u64>(),
    ) {
        wide_tiles_match_tiles_of_4(LEGACY_FORMATS[fmt], rows, blocks, n, seed);
    }
}
