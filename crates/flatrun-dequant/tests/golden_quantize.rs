//! Reference quantizers against ggml's `quantize_row_*_ref`, byte for byte.

mod common;

use common::*;
use flatrun_dequant::{QUANTIZABLE, quantize_to_vec};

#[test]
fn quantizers_match_ggml_ref() {
    let recs = records("blocks.txt", "quantize");
    let mut checked = 0;
    let mut failures = Vec::new();
    for r in &recs {
        let ty = ggml_type(&r[0]);
        if !QUANTIZABLE.contains(&ty) {
            continue;
        }
        let seed: u64 = r[1].parse().unwrap();
        let n_chunks: usize = r[2].parse().unwrap();
        let expected = u64::from_str_radix(&r[3], 16).unwrap();
        let first_block = hex(&r[4]);
        let x = test_inputs(seed, n_chunks);
        let bytes = quantize_to_vec(ty, &x).unwrap();
        if bytes[..first_block.len()] != first_block[..] {
            failures.push(format!(
                "{ty}: first block {:02x?}, ggml {:02x?}",
                &bytes[..first_block.len()],
                first_block
            ));
        } else if checksum_bytes(&bytes) != expected {
            let size = ty.type_size();
            failures.push(format!(
                "{ty}: checksum differs (first block equal, {} blocks)",
                bytes.len() / size
            ));
        }
        checked += 1;
    }
    assert_eq!(checked, QUANTIZABLE.len(), "a quantizer lacks its fixture");
    assert!(failures.is_empty(), "{failures:#?}");
}
