//! Hostile GGUF input: each case gives a typed error naming the file, the
//! tensor or key and the offset — never a panic or a huge allocation.

mod common;

use std::path::Path;

use common::gguf_writer::GgufBytes;
use flatrun_format::gguf::{check_tensor_extents, parse_header};
use flatrun_format::{FormatError, GgufBackend};

const F32: u32 = 0;
const Q8_0: u32 = 8;

fn parse(bytes: &[u8]) -> Result<flatrun_format::gguf::GgufHeader, FormatError> {
    let path = Path::new("hostile.gguf");
    let header = parse_header(path, bytes)?;
    check_tensor_extents(path, &header.tensors, bytes.len() as u64)?;
    Ok(header)
}

/// One F32 tensor of 8 values at offset 0, data included.
fn valid_file() -> Vec<u8> {
    let mut g = GgufBytes::header(3, 1, 1);
    g.kv_str("general.architecture", "llama")
        .tensor("blk.0.attn_norm.weight", &[8], F32, 0)
        .align(32)
        .zeros(32);
    g.build()
}

#[test]
fn valid_file_parses() {
    let h = parse(&valid_file()).expect("valid");
    assert_eq!(h.tensors[0].name, "layers.0.attn_norm");
    assert_eq!(h.tensors[0].shape, vec![8]);
}

#[test]
fn every_truncation_is_an_error() {
    let bytes = valid_file();
    for len in 0..bytes.len() {
        let err = parse(&bytes[..len]).expect_err("truncated must fail");
        assert!(
            matches!(
                err,
                FormatError::Truncated { .. }
                    | FormatError::BadTensor { .. }
                    | FormatError::Invalid { .. }
            ),
            "len {len}: {err}"
        );
    }
}

#[test]
fn truncated_file_on_disk_names_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("short.gguf");
    std::fs::write(&path, &valid_file()[..20]).unwrap();
    let err = GgufBackend::open(&path).unwrap_err();
    assert!(
        matches!(&err, FormatError::Truncated { path: p, .. } if p == &path),
        "{err}"
    );
    assert!(err.to_string().contains("short.gguf"));
    let empty = dir.path().join("empty.gguf");
    std::fs::write(&empty, b"").unwrap();
    assert!(matches!(
        flatrun_format::open(&empty),
        Err(FormatError::Truncated { offset: 0, .. })
    ));
}

#[test]
fn huge_tensor_count_is_refused_before_allocating() {
    let bytes = GgufBytes::header(3, 1 << 60, 0).build();
    let err = parse(&bytes).unwrap_err();
    assert!(
        matches!(&err, FormatError::Truncated { offset: 8, what, .. } if what.contains("1152921504606846976")),
        "{err}"
    );
    let bytes = GgufBytes::header(3, 0, u64::MAX).build();
    assert!(matches!(parse(&bytes), Err(FormatError::Truncated { .. })));
}

#[test]
fn huge_string_length_is_refused() {
    let mut g = GgufBytes::header(3, 0, 1);
    g.u64(1 << 60).raw(b"abc").zeros(16);
    let err = parse(&g.build()).unwrap_err();
    assert!(
        matches!(&err, FormatError::Truncated { offset: 24, .. }),
        "{err}"
    );
    // A string value, not a key.
    let mut g = GgufBytes::header(3, 0, 1);
    g.string("k").u32(8).u64(1 << 60);
    let err = parse(&g.build()).unwrap_err();
    assert!(err.to_string().contains("`k`"), "{err}");
}

#[test]
fn huge_array_count_is_refused() {
    let mut g = GgufBytes::header(3, 0, 1);
    g.string("tokenizer.ggml.tokens")
        .u32(9)
        .u32(8)
        .u64(1 << 60)
        .zeros(64);
    let err = parse(&g.build()).unwrap_err();
    assert!(
        matches!(&err, FormatError::Truncated { what, .. } if what.contains("tokenizer.ggml.tokens")),
        "{err}"
    );
}

#[test]
fn deeply_nested_arrays_are_refused() {
    let mut g = GgufBytes::header(3, 0, 1);
    g.string("deep").u32(9);
    for _ in 0..100 {
        g.u32(9).u64(1);
    }
    let err = parse(&g.build()).unwrap_err();
    assert!(err.to_string().contains("nested"), "{err}");
}

#[test]
fn offset_past_end_of_file() {
    let mut g = GgufBytes::header(3, 1, 0);
    g.tensor("output.weight", &[8], F32, 1024)
        .align(32)
        .zeros(32);
    let err = parse(&g.build()).unwrap_err();
    assert!(
        matches!(&err, FormatError::BadTensor { tensor, what, .. }
        if tensor == "output.weight" && what.contains("past the end")),
        "{err}"
    );
    // An offset that overflows when added to the data section start.
    let mut g = GgufBytes::header(3, 1, 0);
    g.tensor("output.weight", &[8], F32, u64::MAX - 31)
        .align(32)
        .zeros(32);
    assert!(matches!(
        parse(&g.build()),
        Err(FormatError::BadTensor { .. })
    ));
}

#[test]
fn overlapping_tensors() {
    let mut g = GgufBytes::header(3, 2, 0);
    g.tensor("a", &[16], F32, 0)
        .tensor("b", &[16], F32, 32)
        .align(32)
        .zeros(128);
    let err = parse(&g.build()).unwrap_err();
    assert!(
        matches!(&err, FormatError::BadTensor { tensor, what, .. }
        if tensor == "b" && what.contains("overlaps tensor `a`")),
        "{err}"
    );
}

#[test]
fn misaligned_tensor_offset() {
    let mut g = GgufBytes::header(3, 1, 0);
    g.tensor("a", &[4], F32, 4).align(32).zeros(64);
    let err = parse(&g.build()).unwrap_err();
    assert!(
        matches!(&err, FormatError::BadTensor { tensor, what, .. }
        if tensor == "a" && what.contains("alignment")),
        "{err}"
    );
}

#[test]
fn bad_alignment_key() {
    let mut g = GgufBytes::header(3, 0, 1);
    g.kv_u32("general.alignment", 3);
    let err = parse(&g.build()).unwrap_err();
    assert!(
        matches!(&err, FormatError::Metadata { key, .. } if key == "general.alignment"),
        "{err}"
    );
}

#[test]
fn dims_product_overflow() {
    let mut g = GgufBytes::header(3, 1, 0);
    g.tensor("big", &[1 << 32, 1 << 32, 1 << 32], F32, 0)
        .align(32);
    let err = parse(&g.build()).unwrap_err();
    assert!(
        matches!(&err, FormatError::BadTensor { tensor, what, .. }
        if tensor == "big" && what.contains("overflow")),
        "{err}"
    );
    // Fits u64 elements but not bytes.
    let mut g = GgufBytes::header(3, 1, 0);
    g.tensor("big", &[1 << 31, 1 << 31], F32, 0).align(32);
    assert!(matches!(
        parse(&g.build()),
        Err(FormatError::BadTensor { .. })
    ));
}

#[test]
fn too_many_dims() {
    let mut g = GgufBytes::header(3, 1, 0);
    g.tensor("t", &[1, 1, 1, 1, 1], F32, 0).align(32).zeros(32);
    assert!(matches!(
        parse(&g.build()),
        Err(FormatError::BadTensor { .. })
    ));
}

#[test]
fn row_not_a_whole_number_of_blocks() {
    let mut g = GgufBytes::header(3, 1, 0);
    g.tensor("q", &[48, 2], Q8_0, 0).align(32).zeros(256);
    let err = parse(&g.build()).unwrap_err();
    assert!(err.to_string().contains("block size"), "{err}");
}

#[test]
fn non_utf8_key() {
    let mut g = GgufBytes::header(3, 0, 1);
    g.u64(3).raw(&[b'a', 0xff, b'b']).u32(4).u32(1);
    let err = parse(&g.build()).unwrap_err();
    assert!(
        matches!(&err, FormatError::Invalid { offset: 33, what, .. } if what.contains("UTF-8")),
        "{err}"
    );
}

#[test]
fn non_utf8_tensor_name() {
    let mut g = GgufBytes::header(3, 1, 0);
    g.u64(2).raw(&[0xc3, 0x28]).u32(1).u64(4).u32(F32).u64(0);
    assert!(matches!(
        parse(&g.build()),
        Err(FormatError::Invalid { .. })
    ));
}

#[test]
fn unknown_ggml_type_names_id_and_tensor() {
    let mut g = GgufBytes::header(3, 1, 0);
    g.tensor("blk.0.ffn_up.weight", &[32], 77, 0)
        .align(32)
        .zeros(64);
    let err = parse(&g.build()).unwrap_err();
    assert!(
        matches!(&err, FormatError::UnknownGgmlType { tensor, id: 77, .. } if tensor == "blk.0.ffn_up.weight"),
        "{err}"
    );
    // Removed ids (Q4_2 = 4, Q4_0_4_4 = 31) are unknown too.
    for id in [4, 5, 31, 36, 43] {
        let mut g = GgufBytes::header(3, 1, 0);
        g.tensor("t", &[256], id, 0).align(32).zeros(1024);
        assert!(
            matches!(parse(&g.build()), Err(FormatError::UnknownGgmlType { .. })),
            "id {id}"
        );
    }
}

#[test]
fn unknown_value_type_and_bad_bool() {
    let mut g = GgufBytes::header(3, 0, 1);
    g.string("k").u32(13).u32(0);
    assert!(matches!(
        parse(&g.build()),
        Err(FormatError::Invalid { .. })
    ));
    let mut g = GgufBytes::header(3, 0, 1);
    g.string("k").u32(7).u8(2);
    assert!(matches!(
        parse(&g.build()),
        Err(FormatError::Invalid { .. })
    ));
}

#[test]
fn duplicate_key_and_tensor() {
    let mut g = GgufBytes::header(3, 0, 2);
    g.kv_u32("a", 1).kv_u32("a", 2);
    assert!(matches!(
        parse(&g.build()),
        Err(FormatError::Invalid { .. })
    ));
    let mut g = GgufBytes::header(3, 2, 0);
    g.tensor("t", &[8], F32, 0)
        .tensor("t", &[8], F32, 32)
        .align(32)
        .zeros(64);
    assert!(matches!(
        parse(&g.build()),
        Err(FormatError::BadTensor { .. })
    ));
}

#[test]
fn wrong_magic_and_versions() {
    let mut bytes = valid_file();
    bytes[0] = b'X';
    assert!(matches!(
        parse(&bytes),
        Err(FormatError::Invalid { offset: 0, .. })
    ));
    for (version, needle) in [
        (1u32, "version 1"),
        (3u32.swap_bytes(), "big-endian"),
        (99, "version 99"),
    ] {
        let mut bytes = valid_file();
        bytes[4..8].copy_from_slice(&version.to_le_bytes());
        let err = parse(&bytes).unwrap_err();
        assert!(err.to_string().contains(needle), "{err}");
    }
    // v2 is accepted.
    let mut bytes = valid_file();
    bytes[4..8].copy_from_slice(&2u32.to_le_bytes());
    assert!(parse(&bytes).is_ok());
}
