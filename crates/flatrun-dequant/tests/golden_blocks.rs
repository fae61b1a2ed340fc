//! Decoders against ggml's own `dequantize_row_*`, bit for bit
//! (fixtures from `scripts/gen_dequant_fixtures.py fixtures`).

mod common;

use common::*;
use flatrun_dequant::{dequantize, dequantize_to_vec};

#[test]
fn random_bytes_decode_like_ggml() {
    let recs = records("blocks.txt", "random");
    assert!(
        recs.len() >= 26,
        "expected every block type, got {}",
        recs.len()
    );
    let mut failures = Vec::new();
    for r in &recs {
        let ty = ggml_type(&r[0]);
        let seed: u64 = r[1].parse().unwrap();
        let n_blocks: usize = r[2].parse().unwrap();
        let expected = u64::from_str_radix(&r[3], 16).unwrap();
        let bytes = SplitMix64(seed).bytes(n_blocks * ty.type_size());
        let mut out = vec![0f32; n_blocks * ty.block_size()];
        dequantize(ty, &bytes, &mut out).unwrap();
        let got = checksum_f32(&out, 0);
        if got != expected {
            failures.push(format!("{ty}: checksum {got:016x}, ggml {expected:016x}"));
        }
        // Unaligned input must decode the same.
        let mut shifted = vec![0u8; bytes.len() + 1];
        shifted[1..].copy_from_slice(&bytes);
        let again = dequantize_to_vec(ty, &shifted[1..]).unwrap();
        assert_eq!(
            checksum_f32(&again, 0),
            got,
            "{ty}: unaligned decode differs"
        );
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
fn quantized_blocks_decode_like_ggml() {
    let recs = records("blocks.txt", "block");
    assert!(!recs.is_empty());
    for r in &recs {
        let ty = ggml_type(&r[0]);
        let bytes = hex(&r[1]);
        let expected = f32s(&hex(&r[2]));
        let got = dequantize_to_vec(ty, &bytes).unwrap();
        assert_eq!(got.len(), expected.len(), "{ty}");
        for (i, (g, e)) in got.iter().zip(&expected).enumerate() {
            assert!(same_bits(*g, *e), "{ty} value {i}: got {g:e}, ggml {e:e}");
        }
    }
}
