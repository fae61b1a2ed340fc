//! `matmul_many` (several matrices sharing their input, one pool job) gives
//! exactly what one `matmul` per matrix gives, at every SIMD level, for mixed
//! formats (each with its own dot partner), GEMV and GEMM token counts, and
//! for formats it hands back to `matmul` one at a time.

mod common;

use common::{Rng, random_ggml};
use flatrun_format::GgmlType;
use flatrun_kernels::{Kernels, NativeKernels, Weight, WeightFormat, supported_levels};

fn same_as_one_by_one(formats: &[GgmlType], rows: &[usize], cols: usize, n_tokens: usize) {
    let mut rng = Rng(0x5eed ^ (cols * 31 + n_tokens) as u64);
    let bytes: Vec<Vec<u8>> = formats
        .iter()
        .zip(rows)
        .map(|(&t, &r)| random_ggml(t, r, cols, &mut rng))
        .collect();
    let ws: Vec<Weight> = formats
        .iter()
        .zip(rows)
        .zip(&bytes)
        .map(|((&t, &r), b)| Weight::new(WeightFormat::Ggml(t), r, cols, b, None, None).unwrap())
        .collect();
    let x: Vec<f32> = (0..n_tokens * cols).map(|_| rng.f32()).collect();
    for level in supported_levels() {
        let k = NativeKernels::new(level);
        let want: Vec<Vec<f32>> = ws
            .iter()
            .map(|w| {
                let mut o = vec![0f32; n_tokens * w.rows];
                k.matmul(w, &x, n_tokens, &mut o).unwrap();
                o
            })
            .collect();
        let mut got: Vec<Vec<f32>> = ws
            .iter()
            .map(|w| vec![f32::NAN; n_tokens * w.rows])
            .collect();
        let refs: Vec<&Weight> = ws.iter().collect();
        let mut outs: Vec<&mut [f32]> = got.iter_mut().map(|o| &mut o[..]).collect();
        k.matmul_many(&refs, &x, n_tokens, &mut outs).unwrap();
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            let same = g.iter().zip(w).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(
                same,
                "{level:?}: matrix {i} ({:?}), {n_tokens} tokens",
                formats[i]
            );
        }
    }
}

#[test]
fn shared_job_equals_separate_calls() {
    use GgmlType::*;
    for n_tokens in [1, 3, 4, 9, 17] {
        // Q, K, V of mixed partners (Q8 and Q8_K) and sizes, as in Q4_K_M files.
        same_as_one_by_one(&[Q4_K, Q6_K, Q5_0], &[96, 32, 32], 512, n_tokens);
        // Legacy formats and F32 together.
        same_as_one_by_one(&[Q4_1, Q8_0, F32], &[70, 33, 5], 256, n_tokens);
        // F16 is not shared: handed to `matmul` one at a time.
        same_as_one_by_one(&[F16, Q4_0], &[40, 40], 64, n_tokens);
    }
}

#[test]
fn mismatched_outputs_are_an_error() {
    let mut rng = Rng(7);
    let b = random_ggml(GgmlType::Q8_0, 4, 32, &mut rng);
    let w = Weight::new(WeightFormat::Ggml(GgmlType::Q8_0), 4, 32, &b, None, None).unwrap();
    let x = vec![0.5f32; 32];
    let k = NativeKernels::new(flatrun_kernels::simd_level());
    let mut o = [0f32; 4];
    assert!(k.matmul_many(&[&w, &w], &x, 1, &mut [&mut o[..]]).is_err());
    let mut short = [0f32; 3];
    assert!(k.matmul_many(&[&w], &x, 1, &mut [&mut short[..]]).is_err());
}
