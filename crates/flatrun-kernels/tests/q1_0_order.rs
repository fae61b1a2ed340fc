//! Q1_0 on x86 keeps the float order of ggml's AVX2 `ggml_vec_dot_q1_0_q8_0` (llama.cpp 0.3.36,
//! `ggml-cpu/arch/x86/quants.c`; it has no other x86 path and repacks Q1_0 only on Arm): per
//! 128-value block the four Q8 sub-blocks' eight lane sums (four values each) are chained
//! `blk = d_a0·c_0`, `blk = fma(d_ak, c_k, blk)`, then `acc = fma(d_w, blk, acc)`, and the eight
//! lanes are summed as `hsum_float_8` does (each `d_a·c` is exact, an f16 scale times an
//! integer below 2^10: what the order fixes is how the sums associate). A scalar transcription
//! of that order is held to the native kernels bit for bit at every x86 SIMD level, for one
//! token (the four-row streaming kernel and its odd tail) and for token tiles. On the Bonsai
//! synthetic model this order gives llama.cpp's logits exactly (`flatrun-runtime`'s `families`
//! test), where one FMA per 32 values into a single accumulator did not.

#![cfg(target_arch = "x86_64")]

mod common;

use common::{Rng, matmul_with, random_case};
use flatrun_format::GgmlType;
use flatrun_kernels::native::quantize::{BlockQ8, quantize_q8};
use flatrun_kernels::{NativeKernels, SimdLevel, Weight, WeightFormat, supported_levels};
use half::f16;

/// One row of Q1_0 (18-byte blocks) · one token's Q8 blocks, in ggml's AVX2 order.
fn ggml_avx2_dot(row: &[u8], acts: &[BlockQ8]) -> f32 {
    let mut acc = [0f32; 8];
    for (i, blk) in row.chunks_exact(18).enumerate() {
        let d = f16::from_le_bytes([blk[0], blk[1]]).to_f32();
        let mut lanes = [0f32; 8];
        for sub in 0..4 {
            let a = &acts[4 * i + sub];
            let bits = u32::from_le_bytes(blk[2 + 4 * sub..6 + 4 * sub].try_into().unwrap());
            for (k, lane) in lanes.iter_mut().enumerate() {
                // The exact lane sum of four ±1 weights times their activations.
                let sum: i32 = (4 * k..4 * k + 4)
                    .map(|j| {
                        let q = a.qs[j] as i32;
                        if bits >> j & 1 == 1 { q } else { -q }
                    })
                    .sum();
                let c = sum as f32;
                *lane = if sub == 0 {
                    a.d * c
                } else {
                    a.d.mul_add(c, *lane)
                };
            }
        }
        for (acc, lane) in acc.iter_mut().zip(lanes) {
            *acc = d.mul_add(lane, *acc);
        }
    }
    // hsum_float_8: high half + low half, then pairs, then the last two.
    let h: [f32; 4] = std::array::from_fn(|k| acc[k + 4] + acc[k]);
    (h[0] + h[2]) + (h[1] + h[3])
}

fn check(rows: usize, cols: usize, tokens: usize, rng: &mut Rng) {
    let (bytes, x) = random_case(GgmlType::Q1_0, rows, cols, tokens, rng);
    let w = Weight::new(
        WeightFormat::Ggml(GgmlType::Q1_0),
        rows,
        cols,
        &bytes,
        None,
        None,
    )
    .unwrap();
    let want: Vec<f32> = (0..tokens)
        .flat_map(|t| {
            let mut acts = vec![BlockQ8::default(); cols / 32];
            quantize_q8(&x[t * cols..(t + 1) * cols], &mut acts);
            let row_bytes = cols / 128 * 18;
            (0..rows)
                .map(|r| ggml_avx2_dot(&bytes[r * row_bytes..(r + 1) * row_bytes], &acts))
                .collect::<Vec<_>>()
        })
        .collect();
    for level in supported_levels() {
        if level == SimdLevel::Scalar {
            continue;
        }
        let got = matmul_with(&NativeKernels::new(level), &w, &x, tokens);
        for (i, (g, e)) in got.iter().zip(&want).enumerate() {
            assert_eq!(
                g.to_bits(),
                e.to_bits(),
                "{level} {rows}x{cols}, {tokens} tokens: token {} row {}: native {g} vs ggml order {e}",
                i / rows,
                i % rows
            );
        }
    }
}

#[test]
fn q1_0_keeps_ggml_avx2_float_order() {
    let mut rng = Rng(41);
    // 37 rows: groups of four rows, pool chunks of 16 and a tail of one; 896 columns as
    // Qwen2.5; 1 token (GEMV), 3 (tiles of 3), 8 (the wide tile) and 13 (8 + 4 + 1).
    for tokens in [1, 3, 8, 13] {
        check(37, 896, tokens, &mut rng);
    }
    check(6, 128, 1, &mut rng);
    // Wider than the kernel's 1024-entry table of activation lane sums (1040 Q8 blocks).
    check(5, 1040 * 32, 1, &mut rng);
}
