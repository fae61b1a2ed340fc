//! The real models' tensor tables match the listings the `gguf` Python
//! package produced (`scripts/gen_format_fixtures.py`).

mod common;

use common::{fixture, model_path};
use flatrun_format::{DType, GgufBackend, StorageBackend};

struct Listed {
    name: String,
    type_name: String,
    shape: Vec<usize>,
    offset: u64,
    bytes: u64,
}

fn read_listing(model: &str) -> (usize, u64, Vec<Listed>) {
    let path = fixture(&format!("{}.tensors.tsv", model.trim_end_matches(".gguf")));
    let text = std::fs::read_to_string(&path).expect("fixture listing");
    let mut lines = text.lines();
    let header = lines.next().expect("header line");
    let field = |key: &str| -> u64 {
        header
            .split_whitespace()
            .find_map(|kv| kv.strip_prefix(&format!("{key}=")))
            .and_then(|v| v.parse().ok())
            .expect("header field")
    };
    let rows = lines
        .map(|l| {
            let cols: Vec<&str> = l.split('\t').collect();
            Listed {
                name: cols[0].to_string(),
                type_name: cols[1].to_string(),
                shape: cols[2].split(',').map(|d| d.parse().unwrap()).collect(),
                offset: cols[3].parse().unwrap(),
                bytes: cols[4].parse().unwrap(),
            }
        })
        .collect();
    (field("tensors") as usize, field("data_offset"), rows)
}

fn check_model(model: &str) {
    let Some(path) = model_path(model) else {
        return;
    };
    let backend = GgufBackend::open(&path).expect("open real model");
    let (count, data_offset, listed) = read_listing(model);
    assert_eq!(backend.tensors().len(), count, "tensor count");
    assert_eq!(backend.header().data_offset, data_offset, "data offset");
    for (t, want) in backend.tensors().iter().zip(&listed) {
        assert_eq!(t.original_name, want.name);
        let DType::Ggml(ty) = t.dtype else {
            panic!("{}: not a GGML dtype", t.name)
        };
        assert_eq!(ty.to_string(), want.type_name, "{}", want.name);
        assert_eq!(t.shape, want.shape, "{}", want.name);
        assert_eq!(t.offset, want.offset, "{}", want.name);
        assert_eq!(t.byte_size, want.bytes, "{}", want.name);
        // Every handle's bytes are exactly its extent.
        let handle = backend.tensor(&t.name).expect("handle");
        assert_eq!(handle.bytes().len() as u64, want.bytes);
    }
    // Every GGUF tensor of these models has a canonical name.
    let unnamed: Vec<_> = backend
        .tensors()
        .iter()
        .filter(|t| t.name == t.original_name)
        .map(|t| t.name.clone())
        .collect();
    assert!(
        unnamed.is_empty(),
        "tensors without canonical names: {unnamed:?}"
    );
}

#[test]
fn smollm2_tensor_table_matches_gguf_package() {
    check_model("SmolLM2-135M-Instruct.Q4_1.gguf");
}

#[test]
fn gemma3_tensor_table_matches_gguf_package() {
    check_model("gemma-3-270m-q4_k_m.gguf");
}

#[test]
fn qwen25_tensor_table_matches_gguf_package() {
    check_model("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf");
}

#[test]
fn smollm2_metadata_facts() {
    let Some(path) = model_path("SmolLM2-135M-Instruct.Q4_1.gguf") else {
        return;
    };
    let b = flatrun_format::open(&path).expect("open");
    let m = b.metadata();
    assert_eq!(b.name(), "gguf");
    assert_eq!(m.get_str("general.architecture"), Some("llama"));
    assert_eq!(m.get_u64("llama.block_count"), Some(30));
    assert_eq!(m.get_u64("llama.embedding_length"), Some(576));
    assert_eq!(m.get_u64("llama.attention.head_count"), Some(9));
    assert_eq!(m.get_u64("llama.attention.head_count_kv"), Some(3));
    assert_eq!(m.get_f32("llama.rope.freq_base"), Some(100000.0));
    assert_eq!(m.get_str("tokenizer.ggml.model"), Some("gpt2"));
    assert_eq!(m.get_str("tokenizer.ggml.pre"), Some("smollm"));
    assert_eq!(
        m.get_str_array("tokenizer.ggml.tokens").map(|t| t.len()),
        Some(49152)
    );
    assert_eq!(m.get_bool("tokenizer.ggml.add_bos_token"), Some(false));
    assert!(m.get_str("tokenizer.chat_template").is_some());
    assert!(b.contains("embed") && !b.contains("output"));
    assert_eq!(
        b.tensor("layers.29.ffn.down").unwrap().shape(),
        &[576, 1536]
    );
}

#[test]
fn qwen25_has_biases_and_untied_output() {
    let Some(path) = model_path("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf") else {
        return;
    };
    let b = flatrun_format::open(&path).expect("open");
    assert!(b.contains("layers.0.attn.q.bias"));
    assert!(b.contains("output"));
    assert_eq!(
        b.metadata()
            .get_str_array("tokenizer.ggml.tokens")
            .map(|t| t.len()),
        Some(151936)
    );
    assert_eq!(
        b.metadata()
            .get_i32_array("tokenizer.ggml.token_type")
            .map(|t| t.len()),
        Some(151936)
    );
}

#[test]
fn gemma3_canonical_norms() {
    let Some(path) = model_path("gemma-3-270m-q4_k_m.gguf") else {
        return;
    };
    let b = flatrun_format::open(&path).expect("open");
    for name in [
        "layers.0.attn.q_norm",
        "layers.0.attn.k_norm",
        "layers.0.post_attn_norm",
        "layers.0.post_ffn_norm",
        "layers.17.ffn_norm",
    ] {
        assert!(b.contains(name), "{name}");
    }
    assert_eq!(
        b.metadata()
            .get_f32_array("tokenizer.ggml.scores")
            .map(|s| s.len()),
        Some(262144)
    );
}
