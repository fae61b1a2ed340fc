//! Calls inside `with_shared_input` give the bits of calls outside it: the quantization
//! made for the first call on the shared slice serves only calls of the same shape on it.

mod common;

use common::{Rng, matmul_with, random_case};
use flatrun_format::GgmlType;
use flatrun_kernels::{NativeKernels, Weight, WeightFormat, simd_level, with_shared_input};

fn weight(t: GgmlType, rows: usize, cols: usize, seed: u64) -> (Vec<u8>, Vec<f32>) {
    let mut rng = Rng(seed | 1);
    random_case(t, rows, cols, 4, &mut rng)
}

#[test]
fn shared_activations_give_the_unshared_bits() {
    let k = NativeKernels::new(simd_level());
    // The same 4 × 512 values as 4 tokens of 512 (Q4_K, Q8_0 and a row range of each), then
    // as 8 tokens of 256 and 2 of 1,024: a new shape must quantize again.
    let cases = [
        (GgmlType::Q4_K, 512, 4),
        (GgmlType::Q8_0, 512, 4),
        (GgmlType::Q4_K, 256, 8),
        (GgmlType::Q6_K, 1024, 2),
        (GgmlType::Q4_K, 512, 4),
    ];
    let (_, x) = weight(GgmlType::Q4_K, 1, 512, 7);
    let mut weights = Vec::new();
    for (i, &(t, cols, n)) in cases.iter().enumerate() {
        let (bytes, _) = weight(t, 40, cols, 11 + i as u64);
        assert_eq!(n * cols, x.len());
        weights.push((t, cols, n, bytes));
    }
    let alone: Vec<Vec<f32>> = weights
        .iter()
        .map(|(t, cols, n, bytes)| {
            let w = Weight::new(WeightFormat::Ggml(*t), 40, *cols, bytes, None, None).unwrap();
            matmul_with(&k, &w, &x, *n)
        })
        .collect();
    with_shared_input(&x, || {
        for round in 0..2 {
            for (i, (t, cols, n, bytes)) in weights.iter().enumerate() {
                let w = Weight::new(WeightFormat::Ggml(*t), 40, *cols, bytes, None, None).unwrap();
                assert_eq!(
                    matmul_with(&k, &w, &x, *n),
                    alone[i],
                    "{t:?} case {i} round {round}"
                );
                // A row range (a streamed chunk) on the same activations.
                let part = w.row_range(8..24).unwrap();
                let got = matmul_with(&k, &part, &x, *n);
                for tok in 0..*n {
                    assert_eq!(
                        got[tok * 16..(tok + 1) * 16],
                        alone[i][tok * 40 + 8..tok * 40 + 24],
                        "{t:?} case {i} rows 8..24 token {tok}"
                    );
                }
            }
        }
    });
    // The same slice, changed in place after the scope (the same address and length):
    // a new scope quantizes it afresh.
    let mut x = x;
    x.iter_mut().for_each(|v| *v = -*v);
    let (t, cols, n, bytes) = &weights[0];
    let w = Weight::new(WeightFormat::Ggml(*t), 40, *cols, bytes, None, None).unwrap();
    // First in a scope: the thread's buffer still holds the old values' blocks of the same
    // shape, made under the scope above.
    let shared = with_shared_input(&x, || matmul_with(&k, &w, &x, *n));
    let negated = matmul_with(&k, &w, &x, *n);
    assert_ne!(negated, alone[0]);
    assert_eq!(negated, shared);
}
