//! `flatrun inspect` end to end: the facts of each real model, JSON output,
//! a synthetic MLX directory, and a clean error on a bad file.

use std::path::PathBuf;

use assert_cmd::Command;
use predicates::prelude::*;

fn model_path(name: &str) -> Option<PathBuf> {
    let dir = std::env::var_os("FLATRUN_MODELS")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
                .join(".cache/flatrun/models")
        });
    let path = dir.join(name);
    if path.is_file() {
        return Some(path);
    }
    if std::env::var("FLATRUN_REQUIRE_MODELS").as_deref() == Ok("1") {
        panic!(
            "model {} is missing and FLATRUN_REQUIRE_MODELS=1",
            path.display()
        );
    }
    eprintln!(
        "skipping: model {} not found (set FLATRUN_MODELS)",
        path.display()
    );
    None
}

fn flatrun() -> Command {
    Command::cargo_bin("flatrun").expect("flatrun binary")
}

fn inspect_json(path: &std::path::Path, extra: &[&str]) -> serde_json::Value {
    let out = flatrun()
        .arg("inspect")
        .arg(path)
        .arg("--json")
        .args(extra)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("JSON output")
}

#[test]
fn smollm2_facts() {
    let Some(path) = model_path("SmolLM2-135M-Instruct.Q4_1.gguf") else {
        return;
    };
    flatrun()
        .arg("inspect")
        .arg(&path)
        .assert()
        .success()
        .stdout(predicate::str::contains("format:         gguf v3"))
        .stdout(predicate::str::contains("architecture:   llama"))
        .stdout(predicate::str::contains("layers:         30"))
        .stdout(predicate::str::contains("width:          576"))
        .stdout(predicate::str::contains(
            "heads:          9 (KV heads 3, head dim 64)",
        ))
        .stdout(predicate::str::contains("rope base:      100000"))
        .stdout(predicate::str::contains("output head:    tied to embed"))
        .stdout(predicate::str::contains(
            "gpt2 (pre smollm), 49152 tokens, add_bos_token=false",
        ))
        .stdout(predicate::str::contains("chat template:  yes"))
        .stdout(predicate::str::contains(
            "tensors:        272 (F32 61, Q4_1 210, Q8_0 1)",
        ));
}

#[test]
fn gemma3_facts_as_json() {
    let Some(path) = model_path("gemma-3-270m-q4_k_m.gguf") else {
        return;
    };
    let r = inspect_json(&path, &[]);
    let h = &r["hyperparameters"];
    assert_eq!(r["architecture"], "gemma3");
    assert_eq!(h["layers"], 18);
    assert_eq!(h["width"], 640);
    assert_eq!(h["heads"], 4);
    assert_eq!(h["kv_heads"], 1);
    assert_eq!(h["head_dim"], 256);
    assert_eq!(h["sliding_window"], 512);
    assert_eq!(r["tokenizer"]["kind"], "llama");
    assert_eq!(r["tokenizer"]["size"], 262144);
    assert_eq!(r["tokenizer"]["add_bos_token"], true);
    assert_eq!(r["chat_template"], false);
    assert_eq!(r["tied_output"], true);
    let types: Vec<&str> = r["tensors_by_type"]
        .as_object()
        .unwrap()
        .keys()
        .map(|k| k.as_str())
        .collect();
    assert_eq!(types, ["F32", "Q4_K", "Q5_0", "Q6_K", "Q8_0"]);
    assert!(r.get("tensors").is_none());
}

#[test]
fn qwen25_facts_and_tensor_listing() {
    let Some(path) = model_path("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf") else {
        return;
    };
    let r = inspect_json(&path, &["--tensors"]);
    let h = &r["hyperparameters"];
    assert_eq!(r["architecture"], "qwen2");
    assert_eq!(h["layers"], 24);
    assert_eq!(h["width"], 896);
    assert_eq!(h["heads"], 14);
    assert_eq!(h["kv_heads"], 2);
    assert_eq!(h["rope_base"], 1000000.0);
    assert_eq!(r["tokenizer"]["pre"], "qwen2");
    assert_eq!(r["tokenizer"]["size"], 151936);
    assert_eq!(r["chat_template"], true);
    assert_eq!(r["tied_output"], false);
    let tensors = r["tensors"].as_array().unwrap();
    assert_eq!(tensors.len(), 291);
    assert_eq!(r["tensor_count"], 291);
    let output = tensors.iter().find(|t| t["name"] == "output").unwrap();
    assert_eq!(output["original_name"], "output.weight");
    assert_eq!(output["dtype"], "Q8_0");
    assert_eq!(output["shape"], serde_json::json!([151936, 896]));
    let embed = tensors.iter().find(|t| t["name"] == "embed").unwrap();
    assert_eq!(embed["dtype"], "Q5_0");
    assert!(tensors.iter().any(|t| t["name"] == "layers.0.attn.q.bias"));
    let sum: u64 = tensors.iter().map(|t| t["bytes"].as_u64().unwrap()).sum();
    assert_eq!(r["total_bytes"], sum);
    // The text table lists the same tensors.
    flatrun()
        .arg("inspect")
        .arg(&path)
        .arg("--tensors")
        .assert()
        .success()
        .stdout(predicate::str::contains("layers.23.ffn.down"))
        .stdout(predicate::str::contains("blk.23.ffn_down.weight"));
}

#[test]
fn mlx_directory() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("config.json"),
        r#"{"model_type":"llama","num_hidden_layers":1,"hidden_size":64,"num_attention_heads":4,
            "num_key_value_heads":2,"rope_theta":10000.0,"vocab_size":3,"max_position_embeddings":128,
            "quantization":{"group_size":32,"bits":4}}"#,
    )
    .unwrap();
    std::fs::write(
        dir.path().join("tokenizer.json"),
        r#"{"model":{"type":"BPE","vocab":{"a":0,"b":1}},"added_tokens":[{"id":2,"content":"<s>"}]}"#,
    )
    .unwrap();
    std::fs::write(
        dir.path().join("tokenizer_config.json"),
        r#"{"chat_template":"{{ x }}"}"#,
    )
    .unwrap();
    // One 4-bit linear [8, 64]: 8x8 u32 words, scales/biases [8, 2] f16.
    let mut header = serde_json::Map::new();
    let mut data = Vec::new();
    for (name, dtype, shape, len) in [
        (
            "model.layers.0.self_attn.q_proj.weight",
            "U32",
            vec![8, 8],
            256usize,
        ),
        (
            "model.layers.0.self_attn.q_proj.scales",
            "F16",
            vec![8, 2],
            32,
        ),
        (
            "model.layers.0.self_attn.q_proj.biases",
            "F16",
            vec![8, 2],
            32,
        ),
    ] {
        let begin = data.len();
        data.resize(begin + len, 1u8);
        header.insert(name.into(), serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [begin, data.len()]}));
    }
    let header = serde_json::Value::from(header).to_string();
    let mut file = (header.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(header.as_bytes());
    file.extend_from_slice(&data);
    std::fs::write(dir.path().join("model.safetensors"), file).unwrap();

    let r = inspect_json(dir.path(), &["--tensors"]);
    assert_eq!(r["format"], "mlx");
    assert_eq!(r["architecture"], "llama");
    assert_eq!(r["hyperparameters"]["head_dim"], 16);
    assert_eq!(r["tokenizer"]["kind"], "BPE");
    assert_eq!(r["tokenizer"]["size"], 3);
    assert_eq!(r["chat_template"], true);
    assert_eq!(r["tensor_count"], 1);
    assert_eq!(r["total_bytes"], 320);
    assert_eq!(r["tensors"][0]["name"], "layers.0.attn.q");
    assert_eq!(r["tensors"][0]["shape"], serde_json::json!([8, 64]));
    assert_eq!(r["tensors_by_type"]["MLX_Q4/g32"], 1);
}

#[test]
fn bad_file_is_a_clean_error() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("broken.gguf");
    std::fs::write(
        &path,
        b"GGUF\x03\x00\x00\x00\xff\xff\xff\xff\xff\xff\xff\x0f",
    )
    .unwrap();
    flatrun()
        .arg("inspect")
        .arg(&path)
        .assert()
        .failure()
        .stderr(predicate::str::contains("broken.gguf"))
        .stderr(predicate::str::contains("truncated"))
        .stderr(predicate::str::contains("panicked").not());
}

/// Writes a safetensors file of `tensors` (name, dtype, shape), bytes zeroed.
fn write_safetensors(path: &std::path::Path, tensors: &[(&str, &str, Vec<usize>)]) {
    let mut header = serde_json::Map::new();
    let mut len = 0usize;
    for (name, dtype, shape) in tensors {
        let width = if *dtype == "F32" { 4 } else { 2 };
        let bytes = width * shape.iter().product::<usize>();
        header.insert(
            name.to_string(),
            serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [len, len + bytes]}),
        );
        len += bytes;
    }
    let header = serde_json::Value::from(header).to_string();
    let mut file = (header.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(header.as_bytes());
    file.resize(file.len() + len, 0);
    std::fs::write(path, file).unwrap();
}

/// A sharded Hugging Face directory (bf16, `model.safetensors.index.json`):
/// inspect reports the format, both shards, the dtype and the architecture.
#[test]
fn hf_sharded_directory() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("config.json"),
        r#"{"architectures":["Qwen2ForCausalLM"],"model_type":"qwen2","num_hidden_layers":1,
            "hidden_size":64,"intermediate_size":128,"num_attention_heads":4,"num_key_value_heads":2,
            "rope_theta":1000000.0,"vocab_size":8,"max_position_embeddings":128,"rms_norm_eps":1e-6,
            "tie_word_embeddings":true,"torch_dtype":"bfloat16"}"#,
    )
    .unwrap();
    let layer = |s: &str| format!("model.layers.0.{s}");
    let first: Vec<(String, &str, Vec<usize>)> = vec![
        ("model.embed_tokens.weight".into(), "BF16", vec![8, 64]),
        (layer("input_layernorm.weight"), "BF16", vec![64]),
        (layer("self_attn.q_proj.weight"), "BF16", vec![64, 64]),
        (layer("self_attn.q_proj.bias"), "BF16", vec![64]),
        (layer("self_attn.k_proj.weight"), "BF16", vec![32, 64]),
        (layer("self_attn.k_proj.bias"), "BF16", vec![32]),
        (layer("self_attn.v_proj.weight"), "BF16", vec![32, 64]),
        (layer("self_attn.v_proj.bias"), "BF16", vec![32]),
    ];
    let second: Vec<(String, &str, Vec<usize>)> = vec![
        (layer("self_attn.o_proj.weight"), "BF16", vec![64, 64]),
        (layer("post_attention_layernorm.weight"), "BF16", vec![64]),
        (layer("mlp.gate_proj.weight"), "BF16", vec![128, 64]),
        (layer("mlp.up_proj.weight"), "BF16", vec![128, 64]),
        (layer("mlp.down_proj.weight"), "BF16", vec![64, 128]),
        ("model.norm.weight".into(), "BF16", vec![64]),
    ];
    let mut weight_map = serde_json::Map::new();
    for (file, tensors) in [
        ("model-00001-of-00002.safetensors", &first),
        ("model-00002-of-00002.safetensors", &second),
    ] {
        let list: Vec<(&str, &str, Vec<usize>)> = tensors
            .iter()
            .map(|(n, d, s)| (n.as_str(), *d, s.clone()))
            .collect();
        write_safetensors(&dir.path().join(file), &list);
        for (name, _, _) in tensors {
            weight_map.insert(name.clone(), file.into());
        }
    }
    std::fs::write(
        dir.path().join("model.safetensors.index.json"),
        serde_json::json!({"metadata": {"total_size": 0}, "weight_map": weight_map}).to_string(),
    )
    .unwrap();

    let r = inspect_json(dir.path(), &[]);
    assert_eq!(r["format"], "safetensors");
    assert_eq!(r["files"].as_array().map(Vec::len), Some(2));
    assert_eq!(r["architecture"], "qwen2");
    assert_eq!(r["hyperparameters"]["layers"], 1);
    assert_eq!(r["hyperparameters"]["kv_heads"], 2);
    assert_eq!(r["tied_output"], true);
    assert_eq!(r["tensor_count"], 14);
    assert_eq!(r["tensors_by_type"]["BF16"], 14);
    flatrun()
        .arg("inspect")
        .arg(dir.path())
        .assert()
        .success()
        .stdout(predicate::str::contains(
            "format:         safetensors (2 files)",
        ))
        .stdout(predicate::str::contains("architecture:   qwen2"))
        .stdout(predicate::str::contains("tensors:        14 (BF16 14)"));
}

/// The HF directories of `scripts/gen_hf_checkpoints.py` and
/// `scripts/gen_hf_moe.py`, when present (`crates/flatrun-runtime/tests/hf_parity.rs`
/// and `hf_moe.rs` write and require them).
#[test]
fn hf_directories_from_real_models() {
    let root = std::env::var_os("FLATRUN_HF_CKPT")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
                .join(".cache/flatrun/hf-ckpt")
        });
    for (dir, arch, files, dtype, count) in [
        ("smollm2-135m-f16-sharded", "llama", 3, "F16", 272),
        ("smollm2-135m-bf16", "llama", 1, "BF16", 272),
        // `architecture` is config.json's `model_type`.
        ("gemma-3-270m-f16", "gemma3_text", 1, "F16", 236),
        // scripts/gen_hf_moe.py: experts one tensor each (3 layers × 16 × 3
        // of them, plus attention, embedding and head in F16; norms and
        // routers F32).
        ("qwen3moe-synth-f16", "qwen3_moe", 1, "F16", 158),
        ("qwen3moe-synth-f16-sharded", "qwen3_moe", 3, "F16", 158),
        ("qwen3moe-synth-bf16", "qwen3_moe", 1, "BF16", 158),
    ] {
        let path = root.join(dir);
        if !path.join("config.json").exists() {
            eprintln!(
                "skipping: {} not found (scripts/gen_hf_checkpoints.py)",
                path.display()
            );
            continue;
        }
        let r = inspect_json(&path, &[]);
        assert_eq!(r["format"], "safetensors", "{dir}");
        assert_eq!(r["architecture"], arch, "{dir}");
        assert_eq!(r["files"].as_array().map(Vec::len), Some(files), "{dir}");
        assert_eq!(r["tensors_by_type"][dtype], count, "{dir}");
        assert_eq!(r["chat_template"], arch != "gemma3_text", "{dir}");
    }
}
