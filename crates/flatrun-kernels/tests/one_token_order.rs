//! Inside `with_one_token_order`, a call carrying several tokens gives each
//! token the bits of a one-token call (speculative verification depends on
//! it): every quantized and float format, calls of 2 to 19 tokens, at the
//! host's SIMD level and the scalar one.

mod common;

use common::{LEGACY_FORMATS, Rng, random_case};
use flatrun_format::GgmlType;
use flatrun_kernels::{
    Kernels, NativeKernels, SimdLevel, Weight, WeightFormat, simd_level, with_one_token_order,
};

fn formats() -> impl Iterator<Item = GgmlType> {
    LEGACY_FORMATS.iter().copied().chain([
        GgmlType::Q2_K,
        GgmlType::Q3_K,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
        GgmlType::IQ4_XS,
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::BF16,
    ])
}

#[test]
fn several_tokens_in_one_token_order_equal_one_token_calls() {
    let mut rng = Rng(11);
    for level in [simd_level(), SimdLevel::Scalar] {
        let kernels = NativeKernels::new(level);
        for t in formats() {
            // 16 and 19: Q4_K through 8-row panels on AVX-512 VNNI. 67 rows: tiles of
            // 2 to 4 tokens run the GEMV over several 32-row groups and a partial one.
            for (n, rows) in [2usize, 3, 4, 5, 8, 9, 16, 19]
                .into_iter()
                .map(|n| (n, 19))
                .chain([(2, 67), (3, 67), (4, 67)])
            {
                let cols = 512;
                let (bytes, x) = random_case(t, rows, cols, n, &mut rng);
                let w = Weight::new(WeightFormat::Ggml(t), rows, cols, &bytes, None, None)
                    .expect("weight");
                let mut batch = vec![0f32; n * rows];
                with_one_token_order(|| kernels.matmul(&w, &x, n, &mut batch)).expect("matmul");
                for i in 0..n {
                    let mut one = vec![0f32; rows];
                    kernels
                        .matmul(&w, &x[i * cols..(i + 1) * cols], 1, &mut one)
                        .expect("matmul");
                    let got = &batch[i * rows..(i + 1) * rows];
                    let same = one.iter().zip(got).all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(
                        same,
                        "{level:?} {t:?}: token {i} of {n} differs from its own call"
                    );
                }
            }
        }
    }
}
