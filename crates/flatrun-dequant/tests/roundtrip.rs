//! Property tests: quantize → dequantize stays within each format's error
//! bound, and no decoder panics on arbitrary bytes.

use flatrun_dequant::*;
use proptest::prelude::*;

/// Largest decode error of each quantizer on a block of absolute maximum
/// `amax`: a relative part (the quantization step) and, for f16 scales, an
/// absolute part (`qmax` times half an f16 subnormal step, 2^-25, for when the
/// scale underflows into f16 subnormals).
///   Q8_0/Q8_1: half a step of amax/127, plus f16 rounding of d (2^-11 relative).
///   Q8_K: half a step (f32 scale).
///   Q4_0/Q5_0: scale max/-8 (max/-16); the far end is clamped to 15 (31), one
///     full step off.
///   Q4_1/Q5_1: half a step of (max-min)/15 (/31) <= 2*amax/15 (/31), plus f16
///     rounding of d and m.
///   Q1_0: a sign times the mean magnitude: at most 2*amax off.
///   Q2_0, TQ1_0, TQ2_0: steps of amax: half a step.
///   MXFP4: E2M1 steps are at most half the largest value's power of two:
///     a quarter of amax.
///   Q4_K/Q5_K/Q6_K: one step of the block's range (2*amax/15, /31, and
///     amax/32 for the symmetric Q6_K): the scale search may trade rounding
///     error for outliers, and the 6/8-bit sub-block scales add up to half a
///     step (measured worst cases on random data: 0.082, 0.041, 0.016 amax;
///     a Q5_K block of half zeros reached 0.066 amax, 1.03 steps, so Q5_K
///     gets a step and a half);
///     the absolute part covers f16-subnormal super-block scales times the
///     largest sub-block scale and quant.
///   Q2_K/Q3_K: one step of 2*amax/3 (amax/4) plus 4-bit (6-bit) sub-block
///     scales: a loose amax (amax/2).
///   IQ4_NL: half the widest gap of its table (24/127 of the scale) plus the
///     scale fit: 0.15 amax.
fn bound(ty: GgmlType, amax: f32) -> f32 {
    let f16_rel = 1.0 / 2048.0;
    let (rel, qmax) = match ty {
        GgmlType::Q8_0 | GgmlType::Q8_1 => (0.5 / 127.0 + f16_rel, 127.0),
        GgmlType::Q8_K => (0.5 / 127.0 * 1.01, 0.0),
        GgmlType::Q4_0 => (1.0 / 8.0 + f16_rel, 8.0),
        GgmlType::Q5_0 => (1.0 / 16.0 + f16_rel, 16.0),
        GgmlType::Q4_1 => (1.0 / 15.0 + 3.0 * f16_rel, 16.0),
        GgmlType::Q5_1 => (1.0 / 31.0 + 3.0 * f16_rel, 32.0),
        GgmlType::Q1_0 => (2.0 + f16_rel, 1.0),
        GgmlType::Q2_0 => (0.5 + 2.0 * f16_rel, 2.0),
        GgmlType::TQ1_0 | GgmlType::TQ2_0 => (0.5 + f16_rel, 1.0),
        GgmlType::MXFP4 => (0.25, 0.0),
        GgmlType::Q4_K => (2.0 / 15.0, 63.0 * 15.0 + 63.0),
        GgmlType::Q5_K => (3.0 / 31.0, 63.0 * 31.0 + 63.0),
        GgmlType::Q6_K => (1.0 / 32.0, 127.0 * 32.0),
        GgmlType::Q2_K => (1.0, 15.0 * 3.0 + 15.0),
        GgmlType::Q3_K => (0.5, 32.0 * 4.0),
        GgmlType::IQ4_NL => (0.15, 127.0),
        _ => unreachable!(),
    };
    rel * amax + qmax * 2f32.powi(-25) * 1.01
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn quantize_roundtrip_within_bound(
        values in prop::collection::vec(-1.0f32..1.0, 256),
        exp in -10i32..10,
    ) {
        let scale = 2f32.powi(exp);
        let x: Vec<f32> = values.iter().map(|v| v * scale).collect();
        for &ty in QUANTIZABLE {
            let bytes = quantize_to_vec(ty, &x).unwrap();
            let y = dequantize_to_vec(ty, &bytes).unwrap();
            let block = ty.block_size();
            for (xb, yb) in x.chunks(block).zip(y.chunks(block)) {
                let amax = xb.iter().fold(0f32, |a, v| a.max(v.abs()));
                for (a, b) in xb.iter().zip(yb) {
                    let err = (a - b).abs();
                    prop_assert!(
                        err <= bound(ty, amax),
                        "{}: {} decoded as {} (amax {}, err {} > {})",
                        ty, a, b, amax, err, bound(ty, amax)
                    );
                }
            }
        }
    }

    #[test]
    fn decoders_never_panic(seed_bytes in prop::collection::vec(any::<u8>(), 292 * 2)) {
        for &ty in GgmlType::ALL {
            let n = seed_bytes.len() / ty.type_size() * ty.type_size();
            let bytes = &seed_bytes[..n];
            let mut out = vec![0f32; n / ty.type_size() * ty.block_size()];
            prop_assert!(dequantize(ty, bytes, &mut out).is_ok());
            let _ = validate(ty, bytes);
            // A wrong length is an error, never a panic.
            if n > 0 {
                prop_assert!(dequantize(ty, &bytes[..n - 1], &mut out).is_err() || ty.type_size() == 1);
            }
        }
    }

    #[test]
    fn mlx_never_panics(packed in prop::collection::vec(any::<u8>(), 0..96), bits in 1u8..9, g in 0usize..3) {
        let group = [32usize, 64, 128][g];
        if let Ok(q) = MlxAffine::new(bits, group, ScaleType::F16) {
            let n = packed.len() * 8 / bits as usize;
            let groups = n / group;
            let scales = vec![0x3c; groups * 2];
            let mut out = vec![0f32; n];
            let _ = q.dequantize(&packed, &scales, &scales, &mut out);
        }
    }
}
