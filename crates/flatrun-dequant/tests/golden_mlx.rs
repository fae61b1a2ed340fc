//! MLX affine decoding against the real `mlx` package (`mx.quantize` /
//! `mx.dequantize`), for every bit width, group size and scale dtype.

mod common;

use common::*;
use flatrun_dequant::{MlxAffine, ScaleType};

#[test]
fn mlx_affine_matches_mlx() {
    let recs = records("blocks.txt", "mlx");
    assert_eq!(recs.len(), 7 * 3 * 3, "bits x group sizes x scale dtypes");
    for r in &recs {
        let bits: u8 = r[0].parse().unwrap();
        let group: usize = r[1].parse().unwrap();
        let scale_type = match r[2].as_str() {
            "F32" => ScaleType::F32,
            "F16" => ScaleType::F16,
            "BF16" => ScaleType::BF16,
            other => panic!("dtype {other}"),
        };
        let (packed, scales, biases) = (hex(&r[3]), hex(&r[4]), hex(&r[5]));
        let mlx_sum = u64::from_str_radix(&r[6], 16).unwrap();
        let f32_sum = u64::from_str_radix(&r[7], 16).unwrap();
        let q = MlxAffine::new(bits, group, scale_type).unwrap();
        let mut out = vec![0f32; 512];
        q.dequantize_like_mlx(&packed, &scales, &biases, &mut out)
            .unwrap();
        assert_eq!(
            checksum_f32(&out, 0),
            mlx_sum,
            "{bits} bits, group {group}, {scale_type:?}: like-MLX"
        );
        q.dequantize(&packed, &scales, &biases, &mut out).unwrap();
        assert_eq!(
            checksum_f32(&out, 0),
            f32_sum,
            "{bits} bits, group {group}, {scale_type:?}: f32"
        );
    }
}

#[test]
fn mlx_rejects_bad_parameters_and_sizes() {
    assert!(MlxAffine::new(7, 64, ScaleType::F16).is_err());
    assert!(MlxAffine::new(4, 48, ScaleType::F16).is_err());
    let q = MlxAffine::new(4, 32, ScaleType::F16).unwrap();
    let mut out = vec![0f32; 32];
    // 16 packed bytes = 32 values = one group: scales must be 2 bytes.
    assert!(q.dequantize(&[0; 16], &[0; 4], &[0; 2], &mut out).is_err());
    assert!(q.dequantize(&[0; 15], &[0; 2], &[0; 2], &mut out).is_err());
    assert!(
        q.dequantize(&[0; 16], &[0; 2], &[0; 2], &mut out[..31])
            .is_err()
    );
    q.dequantize(&[0; 16], &[0; 2], &[0; 2], &mut out).unwrap();
}
