//! Synthetic SafeTensors files, Hugging Face directories (single and
//! sharded) and MLX directories, written by the test, read back with the
//! right names, shapes, dtypes and bytes.

mod common;

use std::path::Path;

use common::safetensors_writer::{pattern, safetensors_bytes};
use flatrun_format::{DType, GgmlType, HfNaming, QuantDescriptor};

/// The naming a pre-norm family (Llama, Qwen) gives: `post_attention_layernorm`
/// is the pre-FFN norm.
const PRE_FFN: HfNaming = HfNaming {
    layer_stems: &[("post_attention_layernorm", "ffn_norm")],
    ..HfNaming::GENERIC
};
/// The naming a sandwich-norm family (Gemma) gives.
const SANDWICH: HfNaming = HfNaming {
    layer_stems: &[("post_attention_layernorm", "post_attn_norm")],
    ..HfNaming::GENERIC
};

fn write(path: &Path, bytes: &[u8]) {
    std::fs::write(path, bytes).unwrap();
}

#[test]
fn single_file_dtypes_names_and_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("weights.safetensors");
    let tensors = vec![
        (
            "model.embed_tokens.weight",
            "F32",
            vec![4, 3],
            pattern(48, 1),
        ),
        (
            "model.layers.0.self_attn.q_proj.weight",
            "F16",
            vec![3, 3],
            pattern(18, 2),
        ),
        (
            "model.layers.0.self_attn.q_proj.bias",
            "BF16",
            vec![3],
            pattern(6, 3),
        ),
        (
            "model.layers.0.post_attention_layernorm.weight",
            "F32",
            vec![3],
            pattern(12, 4),
        ),
        ("lm_head.weight", "U8", vec![2, 2], pattern(4, 5)),
        ("extra.ids", "I32", vec![2], pattern(8, 6)),
        ("extra.flags", "BOOL", vec![1], vec![1]),
    ];
    write(&path, &safetensors_bytes(&tensors, &[("format", "pt")]));
    // Without a family's naming, the family-dependent norm keeps its name.
    let generic = flatrun_format::open(&path).expect("open");
    assert!(generic.contains("model.layers.0.post_attention_layernorm.weight"));
    assert!(!generic.contains("layers.0.ffn_norm"));
    let b = flatrun_format::open_with(&path, &PRE_FFN).expect("open");
    assert_eq!(b.name(), "safetensors");
    assert_eq!(b.metadata().get_str("format"), Some("pt"));
    let expect = [
        ("embed", DType::Ggml(GgmlType::F32)),
        ("layers.0.attn.q", DType::Ggml(GgmlType::F16)),
        ("layers.0.attn.q.bias", DType::Ggml(GgmlType::BF16)),
        ("layers.0.ffn_norm", DType::Ggml(GgmlType::F32)),
        ("output", DType::U8),
        ("extra.ids", DType::Ggml(GgmlType::I32)),
        ("extra.flags", DType::Bool),
    ];
    for ((name, dtype), (original, _, shape, bytes)) in expect.iter().zip(&tensors) {
        let h = b.tensor(name).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(h.info().original_name, *original);
        assert_eq!(h.dtype(), *dtype, "{name}");
        assert_eq!(h.shape(), shape.as_slice(), "{name}");
        assert_eq!(h.bytes(), bytes.as_slice(), "{name}");
        assert_eq!(h.quant(), QuantDescriptor::None);
        // The recorded offset is absolute in the file.
        let file = std::fs::read(&path).unwrap();
        let off = h.info().offset as usize;
        assert_eq!(&file[off..off + bytes.len()], bytes.as_slice());
    }
}

#[test]
fn directory_names_follow_the_given_naming() {
    let dir = tempfile::tempdir().unwrap();
    write(
        &dir.path().join("config.json"),
        br#"{"model_type":"gemma3_text","architectures":["Gemma3ForCausalLM"]}"#,
    );
    write(&dir.path().join("tokenizer.json"), b"{}");
    let tensors = vec![
        (
            "model.layers.0.post_attention_layernorm.weight",
            "F32",
            vec![2],
            pattern(8, 1),
        ),
        (
            "model.layers.0.pre_feedforward_layernorm.weight",
            "F32",
            vec![2],
            pattern(8, 2),
        ),
        (
            "model.layers.0.post_feedforward_layernorm.weight",
            "F32",
            vec![2],
            pattern(8, 3),
        ),
        ("model.norm.weight", "F32", vec![2], pattern(8, 4)),
    ];
    write(
        &dir.path().join("model.safetensors"),
        &safetensors_bytes(&tensors, &[]),
    );
    let b = flatrun_format::open_with(dir.path(), &SANDWICH).expect("open dir");
    assert_eq!(b.name(), "safetensors");
    assert_eq!(b.directory(), Some(dir.path()));
    for name in [
        "layers.0.post_attn_norm",
        "layers.0.ffn_norm",
        "layers.0.post_ffn_norm",
        "output_norm",
    ] {
        assert!(b.contains(name), "{name}");
    }
}

fn write_sharded(dir: &Path) -> Vec<(&'static str, Vec<u8>)> {
    let a = vec![
        (
            "model.embed_tokens.weight",
            "F32",
            vec![2, 2],
            pattern(16, 1),
        ),
        (
            "model.layers.0.mlp.up_proj.weight",
            "F16",
            vec![2, 2],
            pattern(8, 2),
        ),
    ];
    let b = vec![
        (
            "model.layers.1.mlp.down_proj.weight",
            "BF16",
            vec![2, 2],
            pattern(8, 3),
        ),
        ("model.norm.weight", "F32", vec![2], pattern(8, 4)),
    ];
    write(
        &dir.join("model-00001-of-00002.safetensors"),
        &safetensors_bytes(&a, &[]),
    );
    write(
        &dir.join("model-00002-of-00002.safetensors"),
        &safetensors_bytes(&b, &[]),
    );
    let index = serde_json::json!({
        "metadata": {"total_size": 40},
        "weight_map": {
            "model.embed_tokens.weight": "model-00001-of-00002.safetensors",
            "model.layers.0.mlp.up_proj.weight": "model-00001-of-00002.safetensors",
            "model.layers.1.mlp.down_proj.weight": "model-00002-of-00002.safetensors",
            "model.norm.weight": "model-00002-of-00002.safetensors",
        }
    });
    write(
        &dir.join("model.safetensors.index.json"),
        index.to_string().as_bytes(),
    );
    write(&dir.join("config.json"), br#"{"model_type":"llama"}"#);
    a.into_iter()
        .chain(b)
        .map(|(n, _, _, bytes)| (n, bytes))
        .collect()
}

#[test]
fn sharded_directory_looks_like_one_backend() {
    let dir = tempfile::tempdir().unwrap();
    let expected = write_sharded(dir.path());
    let b = flatrun_format::open(dir.path()).expect("open sharded");
    assert_eq!(b.name(), "safetensors");
    assert_eq!(b.files().len(), 2);
    assert_eq!(b.tensors().len(), 4);
    assert_eq!(b.directory(), Some(dir.path()));
    for (original, bytes) in &expected {
        let h = b.tensor(original).unwrap();
        assert_eq!(h.bytes(), bytes.as_slice(), "{original}");
    }
    let down = b.tensor("layers.1.ffn.down").unwrap();
    assert_eq!(down.info().file_index, 1);
    assert_eq!(
        b.files()[1].file_name().unwrap(),
        "model-00002-of-00002.safetensors"
    );
    assert_eq!(b.tensor("embed").unwrap().info().file_index, 0);
    assert_eq!(b.total_bytes(), 40);
}

#[test]
fn mlx_directory_folds_quantized_triples() {
    let dir = tempfile::tempdir().unwrap();
    write(
        &dir.path().join("config.json"),
        br#"{"model_type":"qwen2","quantization":{"group_size":32,"bits":4,"model.layers.0.mlp.down_proj":{"group_size":64,"bits":8}}}"#,
    );
    // q_proj: 8 rows x 64 values at 4 bits = 8 x 8 u32 words; 2 groups per row.
    let w = pattern(8 * 8 * 4, 1);
    let s = pattern(8 * 2 * 2, 2);
    let bi = pattern(8 * 2 * 2, 3);
    // down_proj: 4 rows x 64 values at 8 bits = 4 x 16 words; 1 group of 64 per row.
    let dw = pattern(4 * 16 * 4, 4);
    let ds = pattern(4 * 2, 5);
    let db = pattern(4 * 2, 6);
    let tensors = vec![
        (
            "model.layers.0.self_attn.q_proj.weight",
            "U32",
            vec![8, 8],
            w.clone(),
        ),
        (
            "model.layers.0.self_attn.q_proj.scales",
            "F16",
            vec![8, 2],
            s.clone(),
        ),
        (
            "model.layers.0.self_attn.q_proj.biases",
            "F16",
            vec![8, 2],
            bi.clone(),
        ),
        (
            "model.layers.0.mlp.down_proj.weight",
            "U32",
            vec![4, 16],
            dw.clone(),
        ),
        (
            "model.layers.0.mlp.down_proj.scales",
            "BF16",
            vec![4, 1],
            ds.clone(),
        ),
        (
            "model.layers.0.mlp.down_proj.biases",
            "BF16",
            vec![4, 1],
            db.clone(),
        ),
        (
            "model.layers.0.input_layernorm.weight",
            "F16",
            vec![64],
            pattern(128, 7),
        ),
    ];
    write(
        &dir.path().join("model.safetensors"),
        &safetensors_bytes(&tensors, &[]),
    );
    let b = flatrun_format::open(dir.path()).expect("open mlx");
    assert_eq!(b.name(), "mlx");
    assert_eq!(b.tensors().len(), 3, "{:?}", b.tensors());
    let q = b.tensor("layers.0.attn.q").unwrap();
    assert_eq!(q.shape(), &[8, 64]);
    assert_eq!(q.dtype(), DType::U32);
    assert_eq!(
        q.quant(),
        QuantDescriptor::MlxAffine {
            bits: 4,
            group_size: 32,
            scale_dtype: DType::Ggml(GgmlType::F16)
        }
    );
    assert_eq!(q.bytes(), w.as_slice());
    assert_eq!(q.part("scales"), Some(s.as_slice()));
    assert_eq!(q.part("biases"), Some(bi.as_slice()));
    let d = b.tensor("layers.0.ffn.down").unwrap();
    assert_eq!(d.shape(), &[4, 64]);
    assert_eq!(
        d.quant(),
        QuantDescriptor::MlxAffine {
            bits: 8,
            group_size: 64,
            scale_dtype: DType::Ggml(GgmlType::BF16)
        }
    );
    assert_eq!(d.part("biases"), Some(db.as_slice()));
    let norm = b.tensor("layers.0.attn_norm").unwrap();
    assert_eq!(norm.quant(), QuantDescriptor::None);
    assert_eq!(norm.part("scales"), None);
    assert_eq!(
        b.total_bytes(),
        (w.len() + s.len() + bi.len() + dw.len() + ds.len() + db.len() + 128) as u64
    );
}

#[test]
fn sharded_mlx_directory_with_a_triple_split_across_shards() {
    let dir = tempfile::tempdir().unwrap();
    write(
        &dir.path().join("config.json"),
        br#"{"model_type":"gemma3_text","quantization":{"group_size":64,"bits":8}}"#,
    );
    let w = pattern(2 * 16 * 4, 1);
    let s = pattern(2 * 2, 2);
    let bi = pattern(2 * 2, 3);
    let first = vec![
        (
            "model.layers.0.mlp.up_proj.weight",
            "U32",
            vec![2, 16],
            w.clone(),
        ),
        (
            "model.layers.0.post_attention_layernorm.weight",
            "BF16",
            vec![64],
            pattern(128, 4),
        ),
    ];
    let second = vec![
        (
            "model.layers.0.mlp.up_proj.scales",
            "BF16",
            vec![2, 1],
            s.clone(),
        ),
        (
            "model.layers.0.mlp.up_proj.biases",
            "BF16",
            vec![2, 1],
            bi.clone(),
        ),
    ];
    write(
        &dir.path().join("model-00001-of-00002.safetensors"),
        &safetensors_bytes(&first, &[]),
    );
    write(
        &dir.path().join("model-00002-of-00002.safetensors"),
        &safetensors_bytes(&second, &[]),
    );
    let index = serde_json::json!({"weight_map": {
        "model.layers.0.mlp.up_proj.weight": "model-00001-of-00002.safetensors",
        "model.layers.0.post_attention_layernorm.weight": "model-00001-of-00002.safetensors",
        "model.layers.0.mlp.up_proj.scales": "model-00002-of-00002.safetensors",
        "model.layers.0.mlp.up_proj.biases": "model-00002-of-00002.safetensors",
    }});
    write(
        &dir.path().join("model.safetensors.index.json"),
        index.to_string().as_bytes(),
    );

    let b = flatrun_format::open_with(dir.path(), &SANDWICH).expect("open sharded mlx");
    assert_eq!(b.name(), "mlx");
    assert_eq!(b.files().len(), 2);
    let up = b.tensor("layers.0.ffn.up").unwrap();
    assert_eq!(up.shape(), &[2, 64]);
    assert_eq!(up.bytes(), w.as_slice());
    assert_eq!(up.part("scales"), Some(s.as_slice()));
    assert_eq!(up.part("biases"), Some(bi.as_slice()));
    // Sandwich naming: post_attention_layernorm is the post-attention norm.
    assert!(b.contains("layers.0.post_attn_norm"));
}
