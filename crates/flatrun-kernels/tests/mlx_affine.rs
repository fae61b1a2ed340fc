//! The fused MLX affine kernels, native at every SIMD level the host supports
//! against the reference backend, over shapes with ragged row counts and token
//! tiles:
//! * the default, the format's numerics (`MlxActivations::F32`: dequantized
//!   weights times f32 activations): every width mlx-lm writes (1, 2, 3, 4, 5, 6,
//!   8 bits), groups 32/64/128, f16/bf16/f32 scales, within f32 rounding of the
//!   reference's exact dot;
//! * ggml's numerics behind `MlxActivations::Q8` (4- and 8-bit): within the Q8
//!   activation budget, and on MLX copies of Q4_1/Q8_0 blocks (what
//!   `mlx.core.load` makes of a GGUF) bit for bit equal to ggml's dot of the
//!   GGUF blocks.

mod common;

use common::{
    MlxTensor, Rng, assert_gemv_equals_gemm_columns, assert_gemv_equals_gemm_columns_with,
    check_levels, mlx_format,
};
use flatrun_format::GgmlType;
use flatrun_kernels::native::quantize::{BlockQ8, quantize_q8};
use flatrun_kernels::{
    Kernels, MlxActivations, NativeKernels, ReferenceKernels, SimdLevel, Weight, WeightFormat,
    supported_levels,
};
use half::f16;
use proptest::prelude::*;

/// `|native − reference| ≤ MLX_BUDGET · Σ|w·x|` with Q8 activations: their
/// quantization to 8 bits is the only loss, as for Q4_1/Q8_0 (`GGML_BUDGETS` in
/// `tests/common`).
const MLX_BUDGET: f32 = 5e-3;
/// The same with f32 activations: only the order of the f32 sums differs.
const FLOAT_BUDGET: f32 = 1e-5;
/// Every width mlx-lm writes.
const WIDTHS: [u8; 7] = [1, 2, 3, 4, 5, 6, 8];

/// Native kernels at `level` with ggml's numerics for MLX weights.
fn q8_kernels(level: SimdLevel) -> NativeKernels {
    NativeKernels::with_mlx_activations(level, MlxActivations::Q8)
}

/// Scale/bias storage types MLX writes.
const SCALE_TYPES: [GgmlType; 3] = [GgmlType::F16, GgmlType::BF16, GgmlType::F32];

#[test]
fn every_layout_within_f32_rounding() {
    let mut rng = Rng(0xA5A5_1234_5678_9ABC);
    for bits in WIDTHS {
        for group in [32usize, 64, 128] {
            for scale in SCALE_TYPES {
                for symmetric in [false, true] {
                    let mlx = MlxTensor::random(bits, group, scale, 11, 512, symmetric, &mut rng);
                    let w = mlx.weight();
                    let worst = (1..=6)
                        .map(|n| check_levels(&w, n, FLOAT_BUDGET, &mut rng))
                        .fold(0f32, f32::max);
                    println!(
                        "{} {}: worst relative error {worst:.2e} (budget {FLOAT_BUDGET:.0e})",
                        w.format,
                        if symmetric { "symmetric" } else { "biased" }
                    );
                }
            }
        }
    }
}

#[test]
fn gemm_equals_gemv_bit_for_bit() {
    // Each token of a tile is summed exactly as a lone token is.
    let mut rng = Rng(99);
    let float = WIDTHS.map(|b| (b, 64usize, MlxActivations::F32));
    let q8 = [(4u8, 32usize), (4, 64), (8, 32), (8, 128)].map(|(b, g)| (b, g, MlxActivations::Q8));
    for (bits, group, acts) in float.into_iter().chain(q8) {
        let (rows, cols) = (9, 256);
        let mlx = MlxTensor::random(bits, group, GgmlType::F16, rows, cols, false, &mut rng);
        let w = mlx.weight();
        let n = 7;
        let x: Vec<f32> = (0..n * cols).map(|_| rng.f32()).collect();
        for level in supported_levels() {
            let k = NativeKernels::with_mlx_activations(level, acts);
            let mut gemm = vec![0f32; n * rows];
            k.matmul(&w, &x, n, &mut gemm).unwrap();
            for tok in 0..n {
                let mut gemv = vec![0f32; rows];
                k.matmul(&w, &x[tok * cols..(tok + 1) * cols], 1, &mut gemv)
                    .unwrap();
                assert_eq!(
                    &gemm[tok * rows..(tok + 1) * rows],
                    &gemv[..],
                    "{bits}-bit g{group} {acts:?} {level} token {tok}"
                );
            }
        }
    }
}

#[test]
fn gemv_keeps_the_per_row_float_order() {
    // The one-token kernels stream several rows at a time (4-bit: pairs in the "halves"
    // layout, two pairs per pass, then a last pair; 8-bit
    // pairs), but each output must be the bits of the token-tiled kernel that walks one
    // row at a time: GEMV of each token equals its column of a 3-token GEMM, at every level,
    // for every fused layout, biased and symmetric (8-bit: leftover bias exactly 0), on odd
    // row counts (the last row takes the one-row kernel), one lone pair, and wide rows.
    let mut rng = Rng(0x6E5F);
    let n = 3;
    for bits in [4u8, 8] {
        for group in [32usize, 64, 128] {
            for scale in SCALE_TYPES {
                for symmetric in [false, true] {
                    for (rows, cols) in
                        [(37, 896), (7, 256), (5, 256), (2, 128), (1, 384), (3, 8576)]
                    {
                        let mlx =
                            MlxTensor::random(bits, group, scale, rows, cols, symmetric, &mut rng);
                        let w = mlx.weight();
                        let x: Vec<f32> = (0..n * cols).map(|_| rng.f32()).collect();
                        let label = format!("{} symmetric {symmetric}", w.format);
                        assert_gemv_equals_gemm_columns_with(q8_kernels, &w, &x, n, &label);
                        assert_gemv_equals_gemm_columns(&w, &x, n, &label);
                    }
                }
            }
        }
    }
}

/// A GGUF legacy row (Q4_0, Q4_1 or Q8_0) as MLX 4/8-bit group-32 arrays, the way
/// `mlx.core.load` converts it: Q4_1 `(d, m)` → `(s, b)`; Q4_0 `b = −8d`; Q8_0 `q + 128`, `b = −128d`.
fn ggml_to_mlx(t: GgmlType, blocks: &[u8]) -> (Vec<u8>, Vec<u8>, Vec<u8>) {
    let (mut data, mut scales, mut biases) = (Vec::new(), Vec::new(), Vec::new());
    for blk in blocks.chunks_exact(t.type_size()) {
        let d = f16::from_le_bytes([blk[0], blk[1]]);
        match t {
            GgmlType::Q4_0 | GgmlType::Q4_1 => {
                let qs = &blk[if t == GgmlType::Q4_1 { 4 } else { 2 }..];
                // GGUF byte j holds values j and j+16; MLX byte k holds values 2k and 2k+1.
                let value = |j: usize| if j < 16 { qs[j] & 0xF } else { qs[j - 16] >> 4 };
                data.extend((0..16).map(|k| value(2 * k) | (value(2 * k + 1) << 4)));
                let m = if t == GgmlType::Q4_1 {
                    f16::from_le_bytes([blk[2], blk[3]])
                } else {
                    f16::from_f32(-8.0 * d.to_f32())
                };
                biases.extend(m.to_le_bytes());
            }
            _ => {
                data.extend(blk[2..34].iter().map(|&q| (q as i8 as i16 + 128) as u8));
                biases.extend(f16::from_f32(-128.0 * d.to_f32()).to_le_bytes());
            }
        }
        scales.extend(d.to_le_bytes());
    }
    (data, scales, biases)
}

/// ggml's AVX2 dot of one GGUF legacy row with Q8 activations, in its order: per
/// block, 8 lanes of 4-value integer sums, `fmadd` of `d_w·d_a` into one 8-lane
/// accumulator, the Q4_1 min term summed apart (one FMA per block), then `hsum_float_8`.
fn ggml_avx2_dot(t: GgmlType, row: &[u8], acts: &[BlockQ8]) -> f32 {
    let mut acc = [0f32; 8];
    let mut summs = 0f32;
    for (blk, a) in row.chunks_exact(t.type_size()).zip(acts) {
        let d = f16::from_le_bytes([blk[0], blk[1]]).to_f32();
        let q: Vec<i32> = match t {
            GgmlType::Q4_0 => (0..32)
                .map(|j| {
                    (if j < 16 {
                        blk[2 + j] & 0xF
                    } else {
                        blk[2 + j - 16] >> 4
                    }) as i32
                        - 8
                })
                .collect(),
            GgmlType::Q4_1 => (0..32)
                .map(|j| {
                    (if j < 16 {
                        blk[4 + j] & 0xF
                    } else {
                        blk[4 + j - 16] >> 4
                    }) as i32
                })
                .collect(),
            _ => blk[2..34].iter().map(|&q| q as i8 as i32).collect(),
        };
        if t == GgmlType::Q4_1 {
            // `summs += m·s`, contracted to an FMA by GCC.
            summs = f16::from_le_bytes([blk[2], blk[3]])
                .to_f32()
                .mul_add(a.s, summs);
        }
        let scale = d * a.d;
        for (k, lane) in acc.iter_mut().enumerate() {
            let sumi: i32 = (4 * k..4 * k + 4).map(|j| q[j] * a.qs[j] as i32).sum();
            *lane = scale.mul_add(sumi as f32, *lane);
        }
    }
    // hsum_float_8: high half + low half, then the two pairs, then the last two.
    let h: Vec<f32> = (0..4).map(|i| acc[4 + i] + acc[i]).collect();
    let (s0, s1) = (h[0] + h[2], h[1] + h[3]);
    s0 + s1 + summs
}

#[test]
fn converted_ggml_rows_give_ggml_dots_bit_for_bit() {
    // At every level the MLX kernel sums a converted row exactly as that level's
    // Q4_1/Q8_0 kernel sums the GGUF row, one token or a tile; on x86 that is
    // ggml's AVX2 order, checked against `ggml_avx2_dot` directly.
    let mut rng = Rng(0x51);
    // (A Q4_0 copy is within budget but not exact: MLX 4-bit takes Q4_1's dot.)
    for t in [GgmlType::Q4_1, GgmlType::Q8_0] {
        let (rows, cols) = (5, 576);
        let blocks = common::random_ggml(t, rows, cols, &mut rng);
        let (d, s, b) = ggml_to_mlx(t, &blocks);
        let bits = if t == GgmlType::Q8_0 { 8 } else { 4 };
        let mlx = Weight::new(
            mlx_format(bits, 32, GgmlType::F16),
            rows,
            cols,
            &d,
            Some(&s),
            Some(&b),
        )
        .unwrap();
        let gguf = Weight::new(WeightFormat::Ggml(t), rows, cols, &blocks, None, None).unwrap();
        let x: Vec<f32> = (0..3 * cols).map(|_| rng.f32()).collect();
        for level in supported_levels() {
            let k = q8_kernels(level);
            for n in [1, 3] {
                let (mut got, mut want) = (vec![0f32; n * rows], vec![0f32; n * rows]);
                k.matmul(&mlx, &x[..n * cols], n, &mut got).unwrap();
                k.matmul(&gguf, &x[..n * cols], n, &mut want).unwrap();
                let (got, want): (Vec<u32>, Vec<u32>) = (
                    got.iter().map(|v| v.to_bits()).collect(),
                    want.iter().map(|v| v.to_bits()).collect(),
                );
                assert_eq!(got, want, "{t:?} as MLX at {level}, {n} token(s)");
            }
        }
        // x86: ggml's AVX2 order exactly.
        let mut acts = vec![BlockQ8::default(); cols / 32];
        quantize_q8(&x[..cols], &mut acts);
        let rb = t.type_size() * cols / 32;
        for level in supported_levels() {
            if !matches!(
                level,
                SimdLevel::Avx2 | SimdLevel::Avx512 | SimdLevel::Avx512Vnni
            ) {
                continue;
            }
            let mut got = vec![0f32; rows];
            q8_kernels(level)
                .matmul(&mlx, &x[..cols], 1, &mut got)
                .unwrap();
            for r in 0..rows {
                let want = ggml_avx2_dot(t, &blocks[r * rb..(r + 1) * rb], &acts);
                assert_eq!(
                    got[r].to_bits(),
                    want.to_bits(),
                    "{t:?} as MLX at {level}, row {r}: {} vs {want}",
                    got[r]
                );
            }
        }
    }
}

#[test]
fn q8_activations_within_budget() {
    // ggml's numerics (4- and 8-bit); the other widths keep the float kernels under the flag.
    let mut rng = Rng(3);
    for bits in WIDTHS {
        for group in [32usize, 128] {
            let (rows, cols) = (13, 384);
            let mlx = MlxTensor::random(bits, group, GgmlType::F16, rows, cols, false, &mut rng);
            let w = mlx.weight();
            for n in [1, 5] {
                let x: Vec<f32> = (0..n * cols).map(|_| rng.f32()).collect();
                let (mut want, mut float) = (vec![0f32; n * rows], vec![0f32; n * rows]);
                ReferenceKernels.matmul(&w, &x, n, &mut want).unwrap();
                let mag = common::magnitudes(&w, &x, n);
                for level in supported_levels() {
                    let mut got = vec![0f32; n * rows];
                    q8_kernels(level).matmul(&w, &x, n, &mut got).unwrap();
                    NativeKernels::new(level)
                        .matmul(&w, &x, n, &mut float)
                        .unwrap();
                    if !matches!(bits, 4 | 8) {
                        assert_eq!(
                            got, float,
                            "{} at {level}: the flag changed a float width",
                            w.format
                        );
                    }
                    for (i, (g, r)) in got.iter().zip(&want).enumerate() {
                        assert!(
                            (g - r).abs() <= MLX_BUDGET * mag[i].max(1e-20),
                            "{} at {level}: output {i}: {g} vs {r}",
                            w.format
                        );
                    }
                }
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn ragged_shapes_within_budget(
        width in 0usize..WIDTHS.len(),
        group_pow in 0u32..3,
        scale in 0usize..3,
        symmetric in any::<bool>(),
        rows in 1usize..37,
        groups in 1usize..5,
        n_tokens in 1usize..10,
        seed in any::<u64>(),
    ) {
        let bits = WIDTHS[width];
        let group = 32usize << group_pow;
        let cols = groups * group;
        let mut rng = Rng(seed | 1);
        let mlx = MlxTensor::random(bits, group, SCALE_TYPES[scale], rows, cols, symmetric, &mut rng);
        check_levels(&mlx.weight(), n_tokens, FLOAT_BUDGET, &mut rng);
    }
}
