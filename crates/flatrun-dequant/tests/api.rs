//! The public API: sizes, errors, rows, f16/bf16 output, validation,
//! handles, statistics and `.npy` output.

use flatrun_dequant::*;
use flatrun_format::{DType, QuantDescriptor, TensorHandle, TensorInfo};
use half::{bf16, f16};

fn q8_0_block(d: f32, start: i8) -> Vec<u8> {
    let mut b = f16::from_f32(d).to_le_bytes().to_vec();
    b.extend((0..32).map(|i| start.wrapping_add(i) as u8));
    b
}

#[test]
fn partial_blocks_and_wrong_buffers_are_errors() {
    let bytes = q8_0_block(0.5, 0);
    let mut out = vec![0f32; 32];
    assert!(matches!(
        dequantize(GgmlType::Q8_0, &bytes[..33], &mut out),
        Err(DequantError::PartialBlock { .. })
    ));
    assert!(matches!(
        dequantize(GgmlType::Q8_0, &bytes, &mut out[..31]),
        Err(DequantError::OutputSize {
            expected: 32,
            got: 31,
            ..
        })
    ));
    assert!(matches!(
        dequantize_rows(GgmlType::Q8_0, &bytes, 48, 0..1, &mut out),
        Err(DequantError::PartialBlockElements { .. })
    ));
    assert!(matches!(
        dequantize_rows(GgmlType::Q8_0, &bytes, 32, 1..2, &mut out),
        Err(DequantError::RowRange { .. })
    ));
    let msg = dequantize(GgmlType::Q4_K, &[0; 10], &mut out)
        .unwrap_err()
        .to_string();
    assert!(msg.contains("Q4_K") && msg.contains("144"), "{msg}");
}

#[test]
fn rows_decode_like_the_whole_tensor() {
    let mut bytes = Vec::new();
    for r in 0..6 {
        bytes.extend(q8_0_block(0.25 * (r + 1) as f32, r as i8 * 3));
        bytes.extend(q8_0_block(-0.125, -(r as i8)));
    }
    let all = dequantize_to_vec(GgmlType::Q8_0, &bytes).unwrap();
    let mut part = vec![0f32; 3 * 64];
    dequantize_rows(GgmlType::Q8_0, &bytes, 64, 2..5, &mut part).unwrap();
    assert_eq!(part[..], all[2 * 64..5 * 64]);
    let mut one = vec![0f32; 64];
    dequantize_row(GgmlType::Q8_0, &bytes, 64, 5, &mut one).unwrap();
    assert_eq!(one[..], all[5 * 64..]);
}

#[test]
fn f16_and_bf16_outputs_round_the_f32_values() {
    let x: Vec<f32> = (0..512)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
        .collect();
    for ty in [GgmlType::Q4_K, GgmlType::Q8_0, GgmlType::Q1_0] {
        let bytes = match quantize_to_vec(ty, &x) {
            Ok(b) => b,
            // Q4_K has no quantizer here: use arbitrary finite blocks.
            Err(_) => (0..512 / 256 * 144)
                .map(|i| if i % 144 < 4 { 0x10 } else { i as u8 })
                .collect(),
        };
        let f = dequantize_to_vec(ty, &bytes).unwrap();
        let mut h = vec![f16::ZERO; f.len()];
        let mut b = vec![bf16::ZERO; f.len()];
        dequantize_to_f16(ty, &bytes, &mut h).unwrap();
        dequantize_to_bf16(ty, &bytes, &mut b).unwrap();
        for i in 0..f.len() {
            assert_eq!(h[i], f16::from_f32(f[i]), "{ty} {i}");
            assert_eq!(b[i], bf16::from_f32(f[i]), "{ty} {i}");
        }
    }
}

#[test]
fn plain_types_decode() {
    let v = [1.5f32, -2.25, 0.0, 65504.0];
    let f32_bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    let f16_bytes: Vec<u8> = v
        .iter()
        .flat_map(|x| f16::from_f32(*x).to_le_bytes())
        .collect();
    let bf16_bytes: Vec<u8> = v
        .iter()
        .flat_map(|x| bf16::from_f32(*x).to_le_bytes())
        .collect();
    assert_eq!(dequantize_to_vec(GgmlType::F32, &f32_bytes).unwrap(), v);
    assert_eq!(dequantize_to_vec(GgmlType::F16, &f16_bytes).unwrap(), v);
    let b = dequantize_to_vec(GgmlType::BF16, &bf16_bytes).unwrap();
    assert_eq!(b[..3], v[..3]);
    assert_eq!(
        dequantize_to_vec(GgmlType::I16, &(-7i16).to_le_bytes()).unwrap(),
        [-7.0]
    );
}

#[test]
fn validate_reports_non_finite_scales_with_offsets() {
    let mut bytes = q8_0_block(1.0, 0);
    bytes.extend(q8_0_block(f32::INFINITY, 0));
    match validate(GgmlType::Q8_0, &bytes) {
        Err(DequantError::NonFiniteScale {
            block: 1,
            offset: 34,
            ..
        }) => {}
        other => panic!("{other:?}"),
    }
    assert!(validate(GgmlType::Q8_0, &bytes[..34]).is_ok());
    assert!(validate(GgmlType::Q8_0, &bytes[..35]).is_err());
}

#[test]
fn block_constants_agree_with_the_type_table() {
    fn check<B: BlockFormat>() {
        assert_eq!(B::BLOCK_BYTES, std::mem::size_of::<B>());
        assert_eq!(B::BLOCK_BYTES, B::TYPE.type_size());
        assert_eq!(B::BLOCK_ELEMS, B::TYPE.block_size());
        // Partners are the 8-bit activation formats.
        assert!(matches!(
            <B::DotPartner as BlockFormat>::TYPE,
            GgmlType::Q8_0 | GgmlType::Q8_1 | GgmlType::Q8_K
        ));
    }
    check::<BlockQ4_0>();
    check::<BlockQ4_1>();
    check::<BlockQ5_0>();
    check::<BlockQ5_1>();
    check::<BlockQ8_0>();
    check::<BlockQ8_1>();
    check::<BlockQ2K>();
    check::<BlockQ3K>();
    check::<BlockQ4K>();
    check::<BlockQ5K>();
    check::<BlockQ6K>();
    check::<BlockQ8K>();
    check::<BlockIq2Xxs>();
    check::<BlockIq2Xs>();
    check::<BlockIq2S>();
    check::<BlockIq3Xxs>();
    check::<BlockIq3S>();
    check::<BlockIq1S>();
    check::<BlockIq1M>();
    check::<BlockIq4Nl>();
    check::<BlockIq4Xs>();
    check::<BlockTq1_0>();
    check::<BlockTq2_0>();
    check::<BlockMxfp4>();
    check::<BlockNvfp4>();
    check::<BlockQ1_0>();
    check::<BlockQ2_0>();
    assert_eq!(<BlockQ4_1 as BlockFormat>::DotPartner::TYPE, GgmlType::Q8_1);
    assert_eq!(
        <BlockIq4Xs as BlockFormat>::DotPartner::TYPE,
        GgmlType::Q8_K
    );
    assert_eq!(
        <BlockIq4Nl as BlockFormat>::DotPartner::TYPE,
        GgmlType::Q8_0
    );
}

fn info(
    name: &str,
    shape: Vec<usize>,
    dtype: DType,
    quant: QuantDescriptor,
    bytes: usize,
) -> TensorInfo {
    TensorInfo {
        name: name.into(),
        original_name: name.into(),
        shape,
        dtype,
        quant,
        byte_size: bytes as u64,
        offset: 0,
        file_index: 0,
    }
}

#[test]
fn handles_dispatch_on_the_quant_descriptor() {
    // GGML Q8_0, 2 rows of 32.
    let mut bytes = q8_0_block(0.5, 1);
    bytes.extend(q8_0_block(2.0, -5));
    let ti = info(
        "w",
        vec![2, 32],
        DType::Ggml(GgmlType::Q8_0),
        QuantDescriptor::Ggml(GgmlType::Q8_0),
        bytes.len(),
    );
    let h = TensorHandle::new(&ti, &bytes, vec![]);
    let all = dequantize_handle_to_vec(&h).unwrap();
    assert_eq!(all, dequantize_to_vec(GgmlType::Q8_0, &bytes).unwrap());
    let mut row = vec![0f32; 32];
    dequantize_handle_rows(&h, 1..2, &mut row).unwrap();
    assert_eq!(row[..], all[32..]);

    // MLX 4-bit, group 32, f16 scales: 2 rows of 64.
    let packed: Vec<u8> = (0..64u8).map(|i| i.wrapping_mul(29)).collect();
    let scales: Vec<u8> = [0.5f32, 1.0, -0.25, 2.0]
        .iter()
        .flat_map(|s| f16::from_f32(*s).to_le_bytes())
        .collect();
    let biases: Vec<u8> = [1.0f32, 0.0, 0.5, -3.0]
        .iter()
        .flat_map(|s| f16::from_f32(*s).to_le_bytes())
        .collect();
    let quant = QuantDescriptor::MlxAffine {
        bits: 4,
        group_size: 32,
        scale_dtype: DType::Ggml(GgmlType::F16),
    };
    let ti = info("m", vec![2, 64], DType::U32, quant, packed.len());
    let h = TensorHandle::new(&ti, &packed, vec![("scales", &scales), ("biases", &biases)]);
    let all = dequantize_handle_to_vec(&h).unwrap();
    // Value 1 of group 0: high nibble of byte 0 (0), scale 0.5, bias 1.
    assert_eq!(all[0], 0.5 * (packed[0] & 15) as f32 + 1.0);
    assert_eq!(all[1], 0.5 * (packed[0] >> 4) as f32 + 1.0);
    assert_eq!(all[64], -0.25 * (packed[32] & 15) as f32 + 0.5);
    let mut row = vec![0f32; 64];
    dequantize_handle_rows(&h, 1..2, &mut row).unwrap();
    assert_eq!(row[..], all[64..]);

    // A missing part is a typed error naming the tensor.
    let h = TensorHandle::new(&ti, &packed, vec![("scales", &scales)]);
    let err = dequantize_handle_to_vec(&h).unwrap_err().to_string();
    assert!(err.contains("`m`") && err.contains("biases"), "{err}");
}

#[test]
fn stats_and_npy() {
    let s = stats(&[1.0, -3.0, f32::NAN, 2.0, f32::INFINITY]);
    assert_eq!((s.count, s.nan_count, s.inf_count), (5, 1, 1));
    assert_eq!((s.min, s.max), (-3.0, 2.0));
    assert_eq!(s.mean, 0.0);
    assert!((s.std - (14.0f64 / 3.0).sqrt()).abs() < 1e-12);
    assert_eq!(s.first.len(), 5);

    let header = inspect::npy_header_f32(&[2, 3]);
    assert_eq!(header.len() % 64, 0);
    assert!(header.starts_with(b"\x93NUMPY\x01\x00"));
    let text = String::from_utf8_lossy(&header[10..]);
    assert!(
        text.contains("'descr': '<f4'") && text.contains("'shape': (2, 3)") && text.ends_with('\n')
    );
    assert!(String::from_utf8_lossy(&inspect::npy_header_f32(&[7])).contains("(7,)"));

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.npy");
    let data = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0];
    write_npy_f32(&path, &[2, 3], &data).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    assert_eq!(bytes.len(), header.len() + 24);
    assert_eq!(
        &bytes[header.len()..header.len() + 4],
        &1.0f32.to_le_bytes()
    );
    assert!(write_npy_f32(&path, &[4], &data).is_err());
}
