//! Hostile SafeTensors / sharded / MLX input: typed errors naming the file,
//! tensor and offset, never a panic.

mod common;

use std::path::Path;

use common::safetensors_writer::{pattern, raw_safetensors, safetensors_bytes};
use flatrun_format::FormatError;

fn write(path: &Path, bytes: &[u8]) {
    std::fs::write(path, bytes).unwrap();
}

fn open_bytes(
    bytes: &[u8],
) -> (
    tempfile::TempDir,
    Result<Box<dyn flatrun_format::StorageBackend>, FormatError>,
) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("x.safetensors");
    write(&path, bytes);
    let r = flatrun_format::open(&path);
    (dir, r)
}

fn one_tensor() -> Vec<u8> {
    safetensors_bytes(&[("a", "F32", vec![2, 2], pattern(16, 0))], &[])
}

#[test]
fn every_truncation_is_an_error() {
    let bytes = one_tensor();
    for len in 0..bytes.len() {
        let (_d, r) = open_bytes(&bytes[..len]);
        assert!(r.is_err(), "len {len}");
    }
}

#[test]
fn header_that_is_not_json() {
    let (_d, r) = open_bytes(&raw_safetensors("this is not json", &[]));
    let err = r.err().expect("error");
    assert!(
        matches!(&err, FormatError::Invalid { offset: 8, what, .. } if what.contains("JSON")),
        "{err}"
    );
    assert!(err.to_string().contains("x.safetensors"));
}

#[test]
fn header_length_past_end_of_file() {
    let mut bytes = one_tensor();
    bytes[..8].copy_from_slice(&(1u64 << 60).to_le_bytes());
    let (_d, r) = open_bytes(&bytes);
    assert!(matches!(r, Err(FormatError::Truncated { offset: 0, .. })));
}

#[test]
fn sizes_that_lie() {
    // Shape says 4 floats (16 bytes), offsets say 12.
    let header = r#"{"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,12]}}"#;
    let (_d, r) = open_bytes(&raw_safetensors(header, &[0; 12]));
    let err = r.err().expect("error");
    assert!(
        matches!(&err, FormatError::BadTensor { tensor, .. } if tensor == "a"),
        "{err}"
    );
    // Offsets past the data.
    let header = r#"{"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}}"#;
    let (_d, r) = open_bytes(&raw_safetensors(header, &[0; 8]));
    assert!(r.is_err());
    // A gap / overlap between tensors.
    let header = r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}}"#;
    let (_d, r) = open_bytes(&raw_safetensors(header, &[0; 6]));
    let err = r.err().expect("error");
    assert!(
        matches!(&err, FormatError::BadTensor { tensor, .. } if tensor == "b"),
        "{err}"
    );
    // Dims whose product overflows.
    let header =
        r#"{"a":{"dtype":"F32","shape":[4294967296,4294967296,4294967296],"data_offsets":[0,4]}}"#;
    let (_d, r) = open_bytes(&raw_safetensors(header, &[0; 4]));
    assert!(matches!(r, Err(FormatError::BadTensor { .. })));
}

#[test]
fn trailing_bytes_after_data() {
    let mut bytes = one_tensor();
    bytes.extend_from_slice(&[0; 5]);
    let (_d, r) = open_bytes(&bytes);
    assert!(matches!(r, Err(FormatError::Invalid { .. })));
}

#[test]
fn index_naming_a_missing_shard() {
    let dir = tempfile::tempdir().unwrap();
    write(
        &dir.path().join("model-00001-of-00002.safetensors"),
        &one_tensor(),
    );
    let index = r#"{"weight_map":{"a":"model-00001-of-00002.safetensors","b":"model-00002-of-00002.safetensors"}}"#;
    write(
        &dir.path().join("model.safetensors.index.json"),
        index.as_bytes(),
    );
    let err = flatrun_format::open(dir.path()).err().expect("error");
    assert!(
        matches!(&err, FormatError::MissingShard { shard, .. }
        if shard.ends_with("model-00002-of-00002.safetensors")),
        "{err}"
    );
}

#[test]
fn index_escaping_the_directory() {
    let dir = tempfile::tempdir().unwrap();
    write(
        &dir.path().join("model.safetensors.index.json"),
        br#"{"weight_map":{"a":"../../etc/passwd"}}"#,
    );
    let err = flatrun_format::open(dir.path()).err().expect("error");
    assert!(
        matches!(&err, FormatError::Invalid { what, .. } if what.contains("not a file name")),
        "{err}"
    );
}

#[test]
fn index_listing_a_tensor_its_shard_lacks() {
    let dir = tempfile::tempdir().unwrap();
    write(&dir.path().join("s1.safetensors"), &one_tensor());
    write(
        &dir.path().join("model.safetensors.index.json"),
        br#"{"weight_map":{"a":"s1.safetensors","zzz":"s1.safetensors"}}"#,
    );
    let err = flatrun_format::open(dir.path()).err().expect("error");
    assert!(
        matches!(&err, FormatError::BadTensor { tensor, .. } if tensor == "zzz"),
        "{err}"
    );
}

#[test]
fn index_that_is_not_json() {
    let dir = tempfile::tempdir().unwrap();
    write(&dir.path().join("model.safetensors.index.json"), b"{{{");
    assert!(matches!(
        flatrun_format::open(dir.path()),
        Err(FormatError::Invalid { .. })
    ));
}

#[test]
fn same_tensor_in_two_shards() {
    let dir = tempfile::tempdir().unwrap();
    write(&dir.path().join("s1.safetensors"), &one_tensor());
    write(&dir.path().join("s2.safetensors"), &one_tensor());
    let err = flatrun_format::open(dir.path()).err().expect("error");
    assert!(
        matches!(&err, FormatError::BadTensor { tensor, what, .. } if tensor == "a" && what.contains("also present")),
        "{err}"
    );
}

fn mlx_dir(tensors: &[(&str, &str, Vec<usize>, Vec<u8>)]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    write(
        &dir.path().join("config.json"),
        br#"{"model_type":"llama","quantization":{"group_size":32,"bits":4}}"#,
    );
    write(
        &dir.path().join("model.safetensors"),
        &safetensors_bytes(tensors, &[]),
    );
    dir
}

#[test]
fn mlx_scales_with_wrong_shape() {
    let dir = mlx_dir(&[
        ("m.weight", "U32", vec![2, 4], pattern(32, 0)),
        ("m.scales", "F16", vec![2, 3], pattern(12, 0)),
        ("m.biases", "F16", vec![2, 3], pattern(12, 0)),
    ]);
    let err = flatrun_format::open(dir.path()).err().expect("error");
    assert!(
        matches!(&err, FormatError::BadTensor { tensor, what, .. } if tensor == "m.weight" && what.contains("expected [2, 1]")),
        "{err}"
    );
}

#[test]
fn mlx_weight_not_u32_or_missing_biases() {
    let dir = mlx_dir(&[
        ("m.weight", "F16", vec![2, 4], pattern(16, 0)),
        ("m.scales", "F16", vec![2, 1], pattern(4, 0)),
        ("m.biases", "F16", vec![2, 1], pattern(4, 0)),
    ]);
    let err = flatrun_format::open(dir.path()).err().expect("error");
    assert!(err.to_string().contains("expected U32"), "{err}");
    let dir = mlx_dir(&[
        ("m.weight", "U32", vec![2, 4], pattern(32, 0)),
        ("m.scales", "F16", vec![2, 1], pattern(4, 0)),
    ]);
    let err = flatrun_format::open(dir.path()).err().expect("error");
    assert!(err.to_string().contains("no `m.biases`"), "{err}");
}

#[test]
fn mlx_config_that_is_not_json_is_not_mlx() {
    let dir = tempfile::tempdir().unwrap();
    write(&dir.path().join("config.json"), b"nope");
    write(&dir.path().join("model.safetensors"), &one_tensor());
    // Without a readable quantization section it is a plain HF directory.
    let b = flatrun_format::open(dir.path()).expect("plain safetensors");
    assert_eq!(b.name(), "safetensors");
    let err = flatrun_format::MlxBackend::open(dir.path(), &flatrun_format::HfNaming::GENERIC)
        .expect_err("error");
    assert!(
        matches!(&err, FormatError::Invalid { path, .. } if path.ends_with("config.json")),
        "{err}"
    );
}

#[test]
fn unknown_format() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("x.bin");
    write(&p, b"hello");
    assert!(matches!(
        flatrun_format::open(&p),
        Err(FormatError::UnknownFormat { .. })
    ));
    assert!(matches!(
        flatrun_format::open(dir.path()),
        Err(FormatError::UnknownFormat { .. })
    ));
    assert!(matches!(
        flatrun_format::open(&dir.path().join("missing.gguf")),
        Err(FormatError::Io { .. })
    ));
}

#[test]
fn mlx_lm_config_variants() {
    use flatrun_format::{MlxQuantConfig, MlxQuantization};
    // What mlx-lm's mixed recipes write: per-module entries with `group_size: null`
    // (the default's), `mode`, and `false` for a module left unquantized.
    let config: serde_json::Value = serde_json::from_str(
        r#"{"quantization_config":{"group_size":64,"bits":4,"mode":"affine",
            "model.layers.0.mlp.down_proj":{"group_size":null,"bits":6,"mode":"affine"},
            "model.layers.0.self_attn.q_proj":{"bits":3},
            "model.layers.1.mlp.up_proj":{"group_size":32,"bits":8},
            "lm_head":false}}"#,
    )
    .unwrap();
    let q = MlxQuantConfig::from_config(&config).expect("quantization_config");
    let at = |m: &str| q.for_module(m);
    let qz = |group_size, bits| Some(MlxQuantization { group_size, bits });
    assert_eq!(at("model.layers.5.mlp.up_proj"), qz(64, 4));
    assert_eq!(at("model.layers.0.mlp.down_proj"), qz(64, 6));
    assert_eq!(at("model.layers.0.self_attn.q_proj"), qz(64, 3));
    assert_eq!(at("model.layers.1.mlp.up_proj"), qz(32, 8));
    assert_eq!(at("lm_head"), None);
    assert_eq!(MlxQuantConfig::unsupported_mode(&config), None);
}

#[test]
fn mlx_non_affine_modes_are_refused() {
    for config in [
        r#"{"model_type":"llama","quantization":{"group_size":32,"bits":4,"mode":"mxfp4"}}"#,
        r#"{"model_type":"llama","quantization":{"group_size":64,"bits":4,
            "model.layers.0.mlp.up_proj":{"group_size":16,"bits":4,"mode":"nvfp4"}}}"#,
    ] {
        let dir = mlx_dir(&[
            ("m.weight", "U32", vec![2, 4], pattern(32, 0)),
            ("m.scales", "F16", vec![2, 1], pattern(4, 0)),
            ("m.biases", "F16", vec![2, 1], pattern(4, 0)),
        ]);
        write(&dir.path().join("config.json"), config.as_bytes());
        let err = flatrun_format::open(dir.path()).err().expect("error");
        assert!(
            matches!(&err, FormatError::Metadata { key, what } if key == "quantization.mode" && what.contains("affine")),
            "{err}"
        );
    }
}
