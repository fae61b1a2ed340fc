//! The activation quantizers give ggml's CPU results bit for bit: Q8_K as flatrun-dequant's
//! reference quantizer, Q8_0/Q8_1 as ggml's AVX2/NEON quantizers (nearest-even rounding of
//! x·127/amax on x86, x/d on ARM, where the scalar reference rounds x/d half away from zero).

mod common;

use common::Rng;
use flatrun_dequant::{
    BlockQ8_0, BlockQ8_1, BlockQ8K as RefQ8K, quantize_row_q8_0, quantize_row_q8_1,
    quantize_row_q8_k,
};
use flatrun_kernels::native::quantize::{BlockQ8, BlockQ8K, quantize_q8, quantize_q8k};

fn inputs(rng: &mut Rng) -> Vec<Vec<f32>> {
    let n = 1024;
    vec![
        (0..n).map(|_| rng.f32()).collect(),
        (0..n).map(|_| rng.f32() * 1e-3).collect(),
        (0..n)
            .map(|i| if i % 64 < 32 { 0.0 } else { rng.f32() * 40.0 })
            .collect(),
        // Exact .5 ties after scaling (127 / 127 * k / 2).
        (0..n).map(|i| (i % 255) as f32 * 0.5 - 63.5).collect(),
    ]
}

#[test]
fn q8_and_q8_1_match_reference() {
    let mut rng = Rng(11);
    for x in inputs(&mut rng) {
        let mut mine = vec![BlockQ8::default(); x.len() / 32];
        quantize_q8(&x, &mut mine);
        let mut r0 = vec![
            BlockQ8_0 {
                d: half::f16::ZERO,
                qs: [0; 32]
            };
            x.len() / 32
        ];
        quantize_row_q8_0(&x, &mut r0).unwrap();
        let mut r1 = vec![
            BlockQ8_1 {
                d: half::f16::ZERO,
                s: half::f16::ZERO,
                qs: [0; 32]
            };
            x.len() / 32
        ];
        quantize_row_q8_1(&x, &mut r1).unwrap();
        for (((m, a), b), xb) in mine.iter().zip(&r0).zip(&r1).zip(x.chunks_exact(32)) {
            // ggml's CPU quantizer rounds x·(127/amax) (AVX2; x/d on NEON) to nearest even;
            // the scalar reference rounds x·(1/d) half away from zero. The scales are the same.
            let amax = xb.iter().fold(0f32, |acc, v| acc.max(v.abs()));
            let id = if amax == 0.0 {
                0.0
            } else if cfg!(target_arch = "aarch64") {
                1.0 / (amax / 127.0)
            } else {
                127.0 / amax
            };
            let cpu_qs: Vec<i8> = xb
                .iter()
                .map(|v| (v * id).round_ties_even() as i8)
                .collect();
            assert_eq!(m.qs.to_vec(), cpu_qs);
            assert_eq!(m.d, a.d.to_f32());
            assert_eq!(m.d, b.d.to_f32());
            let sum: i32 = cpu_qs.iter().map(|&q| q as i32).sum();
            assert_eq!(
                m.s,
                half::f16::from_f32(sum as f32 * (amax / 127.0)).to_f32()
            );
            // Elsewhere both rules give the reference's quants, at most one step apart.
            for (&p, &q) in m.qs.iter().zip(&a.qs) {
                assert!((p as i32 - q as i32).abs() <= 1, "{p} vs reference {q}");
            }
        }
    }
}

#[test]
fn q8k_matches_reference() {
    let mut rng = Rng(12);
    for x in inputs(&mut rng) {
        let mut mine = vec![BlockQ8K::default(); x.len() / 256];
        quantize_q8k(&x, &mut mine);
        let mut r = vec![
            RefQ8K {
                d: 0.0,
                qs: [0; 256],
                bsums: [0; 16]
            };
            x.len() / 256
        ];
        quantize_row_q8_k(&x, &mut r).unwrap();
        for (m, a) in mine.iter().zip(&r) {
            assert_eq!(m.d.to_bits(), a.d.to_bits());
            assert_eq!(m.qs, a.qs);
            assert_eq!(m.bsums, a.bsums);
        }
    }
}
