//! The fused MLX affine kernels (4- and 8-bit, groups 32/64/128, f16/bf16/f32
//! scales): native at every SIMD level the host supports against the reference
//! backend, over shapes with ragged row counts and token tiles; and, on MLX
//! copies of Q4_1/Q8_0 blocks (what `mlx.core.load` makes of a GGUF), bit
//! for bit equal to ggml's dot of the GGUF blocks.

mod common;

use common::Rng;
use flatrun_format::{DType, GgmlType};
use flatrun_kernels::native::quantize::{quantize_q8, BlockQ8};
use flatrun_kernels::{
    supported_levels, Kernels, NativeKernels, ReferenceKernels, SimdLevel, Weight, WeightFormat,
};
use half::{bf16, f16};
use proptest::prelude::*;

/// `|native − reference| ≤ MLX_BUDGET · Σ|w·x|`: the activations' quantization to
/// 8 bits is the only loss, as for Q4_1/Q8_0 (`GGML_BUDGETS` in `tests/common`).
const MLX_BUDGET: f32 = 5e-3;

/// Scale/bias storage types MLX writes.
const SCALE_TYPES: [GgmlType; 3] = [GgmlType::F16, GgmlType::BF16, GgmlType::F32];

fn format(bits: u8, group: usize, scale: GgmlType) -> WeightFormat {
    WeightFormat::MlxAffine {
        bits,
        group_size: group as u32,
        scale_dtype: DType::Ggml(scale),
    }
}

fn encode(v: f32, t: GgmlType) -> Vec<u8> {
    match t {
        GgmlType::F16 => f16::from_f32(v).to_le_bytes().to_vec(),
        GgmlType::BF16 => bf16::from_f32(v).to_le_bytes().to_vec(),
        _ => v.to_le_bytes().to_vec(),
    }
}

/// `v` rounded to storage type `t`.
fn round_to(v: f32, t: GgmlType) -> f32 {
    match t {
        GgmlType::F16 => f16::from_f32(v).to_f32(),
        GgmlType::BF16 => bf16::from_f32(v).to_f32(),
        _ => v,
    }
}

/// Random MLX weights; `symmetric` groups get the bias `−2^(bits−1)·s` (a Q4_0/Q8_0 copy).
fn random_mlx(
    bits: u8,
    group: usize,
    scale: GgmlType,
    rows: usize,
    cols: usize,
    symmetric: bool,
    rng: &mut Rng,
) -> (Vec<u8>, Vec<u8>, Vec<u8>) {
    let data = (0..rows * cols * bits as usize / 8)
        .map(|_| rng.byte())
        .collect();
    let (mut scales, mut biases) = (Vec::new(), Vec::new());
    for _ in 0..rows * cols / group {
        // Rounded to the storage type first, so −c·s is exact there too.
        let s = round_to(rng.f32().abs() * 0.02 + 0.001, scale);
        let b = if symmetric {
            -((1u32 << (bits - 1)) as f32) * s
        } else {
            rng.f32() * 0.1
        };
        scales.extend(encode(s, scale));
        biases.extend(encode(b, scale));
    }
    (data, scales, biases)
}

/// Σ|w·x| per output, the scale the error budget is relative to.
fn magnitudes(w: &Weight, x: &[f32], n_tokens: usize) -> Vec<f32> {
    let mut dense = vec![0f32; w.rows * w.cols];
    ReferenceKernels
        .dequantize_rows(w, 0..w.rows, &mut dense)
        .unwrap();
    let mut m = vec![0f32; n_tokens * w.rows];
    for t in 0..n_tokens {
        for r in 0..w.rows {
            m[t * w.rows + r] = (0..w.cols)
                .map(|c| (dense[r * w.cols + c] * x[t * w.cols + c]).abs())
                .sum();
        }
    }
    m
}

/// Every SIMD level against the reference; the worst relative error.
fn check(w: &Weight, n_tokens: usize, rng: &mut Rng) -> f32 {
    let x: Vec<f32> = (0..n_tokens * w.cols).map(|_| rng.f32()).collect();
    let mut want = vec![0f32; n_tokens * w.rows];
    ReferenceKernels.matmul(w, &x, n_tokens, &mut want).unwrap();
    let mag = magnitudes(w, &x, n_tokens);
    let mut worst = 0f32;
    for level in supported_levels() {
        let mut got = vec![f32::NAN; n_tokens * w.rows];
        NativeKernels::new(level)
            .matmul(w, &x, n_tokens, &mut got)
            .unwrap();
        for i in 0..got.len() {
            let rel = (got[i] - want[i]).abs() / mag[i].max(1e-20);
            assert!(
                rel <= MLX_BUDGET,
                "{} at {level}: [{} x {}] x {n_tokens} tokens, output {i}: native {} reference {} (rel {rel:e})",
                w.format,
                w.rows,
                w.cols,
                got[i],
                want[i]
            );
            worst = worst.max(rel);
        }
    }
    worst
}

#[test]
fn every_fused_layout_within_budget() {
    let mut rng = Rng(0xA5A5_1234_5678_9ABC);
    for bits in [4u8, 8] {
        for group in [32usize, 64, 128] {
            for scale in SCALE_TYPES {
                for symmetric in [false, true] {
                    let (rows, cols) = (11, 512);
                    let (d, s, b) = random_mlx(bits, group, scale, rows, cols, symmetric, &mut rng);
                    let f = format(bits, group, scale);
                    let w = Weight::new(f, rows, cols, &d, Some(&s), Some(&b)).unwrap();
                    let worst = (1..=6).map(|n| check(&w, n, &mut rng)).fold(0f32, f32::max);
                    println!(
                        "{f} {}: worst relative error {worst:.2e} (budget {MLX_BUDGET:.0e})",
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
    for (bits, group) in [(4u8, 32usize), (4, 64), (8, 32), (8, 128)] {
        let (rows, cols) = (9, 256);
        let (d, s, b) = random_mlx(bits, group, GgmlType::F16, rows, cols, false, &mut rng);
        let w = Weight::new(
            format(bits, group, GgmlType::F16),
            rows,
            cols,
            &d,
            Some(&s),
            Some(&b),
        )
        .unwrap();
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
                assert_eq!(
                    &gemm[tok * rows..(tok + 1) * rows],
                    &gemv[..],
                    "{bits}-bit g{group} {level} token {tok}"
                );
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
    // The x86 levels reproduce ggml's AVX2 float order; aarch64 runs MLX
    // weights through the portable kernel, which is only within budget.
    let simd: Vec<SimdLevel> = supported_levels()
        .into_iter()
        .filter(|&l| {
            matches!(
                l,
                SimdLevel::Avx2 | SimdLevel::Avx512 | SimdLevel::Avx512Vnni
            )
        })
        .collect();
    let mut rng = Rng(0x51);
    // (A Q4_0 copy is within budget but not exact: MLX 4-bit takes Q4_1's dot.)
    for t in [GgmlType::Q4_1, GgmlType::Q8_0] {
        let (rows, cols) = (5, 576);
        let blocks = common::random_ggml(t, rows, cols, &mut rng);
        let (d, s, b) = ggml_to_mlx(t, &blocks);
        let bits = if t == GgmlType::Q8_0 { 8 } else { 4 };
        let mlx = Weight::new(
            format(bits, 32, GgmlType::F16),
            rows,
            cols,
            &d,
            Some(&s),
            Some(&b),
        )
        .unwrap();
        let gguf = Weight::new(WeightFormat::Ggml(t), rows, cols, &blocks, None, None).unwrap();
        let x: Vec<f32> = (0..cols).map(|_| rng.f32()).collect();
        let mut acts = vec![BlockQ8::default(); cols / 32];
        quantize_q8(&x, &mut acts);
        let rb = t.type_size() * cols / 32;
        // SIMD levels: ggml's AVX2 order exactly.
        for &level in &simd {
            let mut got = vec![0f32; rows];
            NativeKernels::new(level)
                .matmul(&mlx, &x, 1, &mut got)
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
        // Scalar: the same numbers as the scalar kernel of the GGUF format.
        let k = NativeKernels::new(SimdLevel::Scalar);
        let (mut got, mut want) = (vec![0f32; rows], vec![0f32; rows]);
        k.matmul(&mlx, &x, 1, &mut got).unwrap();
        k.matmul(&gguf, &x, 1, &mut want).unwrap();
        assert_eq!(got, want, "{t:?} as MLX, scalar");
    }
}

#[test]
fn other_layouts_still_decode_rows() {
    // 2/3/6-bit have no fused kernel: they decode each row (f32-exact against the reference).
    let mut rng = Rng(3);
    for (bits, group) in [(2u8, 64usize), (3, 32), (6, 128)] {
        let (rows, cols) = (4, 256);
        let (d, s, b) = random_mlx(bits, group, GgmlType::F16, rows, cols, false, &mut rng);
        let w = Weight::new(
            format(bits, group, GgmlType::F16),
            rows,
            cols,
            &d,
            Some(&s),
            Some(&b),
        )
        .unwrap();
        let x: Vec<f32> = (0..cols).map(|_| rng.f32()).collect();
        let (mut got, mut want) = (vec![0f32; rows], vec![0f32; rows]);
        ReferenceKernels.matmul(&w, &x, 1, &mut want).unwrap();
        NativeKernels::new(SimdLevel::Scalar)
            .matmul(&w, &x, 1, &mut got)
            .unwrap();
        for (g, r) in got.iter().zip(&want) {
            assert!(
                (g - r).abs() <= 1e-5 * (1.0 + r.abs()),
                "{bits}-bit: {g} vs {r}"
            );
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn ragged_shapes_within_budget(
        eight in any::<bool>(),
        group_pow in 0u32..3,
        scale in 0usize..3,
        symmetric in any::<bool>(),
        rows in 1usize..37,
        groups in 1usize..5,
        n_tokens in 1usize..10,
        seed in any::<u64>(),
    ) {
        let bits = if eight { 8 } else { 4 };
        let group = 32usize << group_pow;
        let cols = groups * group;
        let mut rng = Rng(seed | 1);
        let (d, s, b) = random_mlx(bits, group, SCALE_TYPES[scale], rows, cols, symmetric, &mut rng);
        let w = Weight::new(format(bits, group, SCALE_TYPES[scale]), rows, cols, &d, Some(&s), Some(&b))
            .unwrap();
        check(&w, n_tokens, &mut rng);
    }
}
