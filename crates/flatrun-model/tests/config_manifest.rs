//! Hyperparameters and manifests: Hugging Face `config.json` parsing,
//! unknown architectures, and the real models' GGUF metadata.

use flatrun_model::config::{Activation, RopeLayout, RopeScaling};
use flatrun_model::{Manifest, ModelConfig, ModelError};
use std::path::PathBuf;

#[test]
fn unknown_architecture_names_it_and_lists_supported() {
    let json = serde_json::json!({ "model_type": "mamba", "num_hidden_layers": 2 });
    let err = ModelConfig::from_hf_json(&json).unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("`mamba`"), "{msg}");
    for arch in ["llama", "qwen2", "qwen3", "gemma3"] {
        assert!(msg.contains(arch), "{msg}");
    }
}

#[test]
fn registry_maps_names_and_aliases_to_families() {
    for (name, family) in [
        ("llama", "llama"),
        ("smollm2", "llama"),
        ("mistral", "llama"),
        ("qwen2", "qwen2"),
        ("qwen3", "qwen3"),
        ("gemma3_text", "gemma3"),
        ("qwen3_5", "qwen35"),
    ] {
        let arch = flatrun_model::architecture(name).unwrap();
        assert_eq!(arch.name(), family, "{name}");
    }
    assert!(flatrun_model::architecture("mamba").is_err());
}

#[test]
fn manifest_lists_each_layers_roles_in_multiplication_order() {
    use flatrun_format::{DType, GgmlType, QuantDescriptor, TensorInfo};
    use flatrun_model::arch::{Role, layer_tensor};
    let json = serde_json::json!({
        "model_type": "qwen2", "num_hidden_layers": 1, "hidden_size": 8, "intermediate_size": 16,
        "num_attention_heads": 2, "num_key_value_heads": 1
    });
    let cfg = ModelConfig::from_hf_json(&json).unwrap();
    let info = |name: String| TensorInfo {
        original_name: name.clone(),
        name,
        shape: vec![8, 8],
        dtype: DType::Ggml(GgmlType::F32),
        quant: QuantDescriptor::None,
        byte_size: 256,
        offset: 0,
        file_index: 0,
    };
    let roles = [
        Role::AttnNorm,
        Role::AttnQ,
        Role::AttnK,
        Role::AttnV,
        Role::AttnO,
        Role::FfnNorm,
        Role::FfnGate,
        Role::FfnUp,
        Role::FfnDown,
        Role::AttnQBias,
        Role::AttnKBias,
        Role::AttnVBias,
    ];
    let mut tensors: Vec<TensorInfo> = ["embed", "output_norm"]
        .iter()
        .map(|n| info(n.to_string()))
        .collect();
    tensors.extend(roles.iter().map(|&r| info(layer_tensor(0, r))));
    let manifest = Manifest::build(&cfg, &tensors).unwrap();
    let listed: Vec<Role> = manifest.layers[0]
        .tensors
        .iter()
        .map(|t| t.role().unwrap())
        .collect();
    assert_eq!(listed, roles);
    // Qwen2's biases are required.
    tensors.retain(|t| t.name != "layers.0.attn.k.bias");
    match Manifest::build(&cfg, &tensors) {
        Err(ModelError::MissingTensor { tensor, .. }) => assert_eq!(tensor, "layers.0.attn.k.bias"),
        other => panic!("expected a missing tensor, got {other:?}"),
    }
}

#[test]
fn missing_key_is_named() {
    let json =
        serde_json::json!({ "model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64 });
    match ModelConfig::from_hf_json(&json) {
        Err(ModelError::MissingKey { key, .. }) => assert_eq!(key, "num_attention_heads"),
        other => panic!("expected a missing key, got {other:?}"),
    }
}

#[test]
fn hf_llama3_config() {
    let json = serde_json::json!({
        "model_type": "llama", "num_hidden_layers": 16, "hidden_size": 2048, "intermediate_size": 8192,
        "num_attention_heads": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "max_position_embeddings": 131072,
        "rope_scaling": { "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192 }
    });
    let cfg = ModelConfig::from_hf_json(&json).unwrap();
    assert_eq!(cfg.arch, "llama");
    assert_eq!((cfg.n_head, cfg.n_kv_head, cfg.head_dim), (32, 8, 64));
    assert_eq!(
        cfg.rope_layout,
        RopeLayout::Neox,
        "HF llama keeps rotate-half"
    );
    assert!(
        matches!(cfg.rope_scaling, RopeScaling::Llama3 { factor, orig_ctx: 8192, .. } if factor == 32.0)
    );
}

#[test]
fn hf_gemma3_config_has_offset_window_and_local_base() {
    let json = serde_json::json!({
        "model_type": "gemma3_text", "num_hidden_layers": 18, "hidden_size": 640, "intermediate_size": 2048,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "sliding_window": 512,
        "query_pre_attn_scalar": 256, "max_position_embeddings": 32768
    });
    let cfg = ModelConfig::from_hf_json(&json).unwrap();
    assert_eq!(cfg.arch, "gemma3");
    assert_eq!(cfg.norm_weight_offset, 1.0);
    assert_eq!(cfg.activation, Activation::GeluTanh);
    assert_eq!(cfg.sliding_window, Some(512));
    assert_eq!(cfg.rope_theta_swa, 10_000.0);
    assert!(cfg.is_swa(0) && !cfg.is_swa(5) && cfg.is_swa(6) && !cfg.is_swa(17));
    assert!((cfg.attn_scale - 1.0 / 16.0).abs() < 1e-7);
    assert!((cfg.embed_scale.unwrap() - 640f32.sqrt()).abs() < 1e-5);
}

fn model(file: &str) -> Option<PathBuf> {
    let dir = std::env::var_os("FLATRUN_MODELS")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
                .join(".cache/flatrun/models")
        });
    let path = dir.join(file);
    if path.exists() {
        return Some(path);
    }
    if std::env::var("FLATRUN_REQUIRE_MODELS").as_deref() == Ok("1") {
        panic!("{} is missing and FLATRUN_REQUIRE_MODELS=1", path.display());
    }
    eprintln!("skipping: {} not found", path.display());
    None
}

#[test]
fn real_models_configs_and_manifests() {
    // (file, arch, layers, width, heads, kv heads, head dim, tied, layout, windowed layers)
    let cases = [
        (
            "SmolLM2-135M-Instruct.Q4_1.gguf",
            "llama",
            30,
            576,
            9,
            3,
            64,
            true,
            RopeLayout::Normal,
            0,
        ),
        (
            "gemma-3-270m-q4_k_m.gguf",
            "gemma3",
            18,
            640,
            4,
            1,
            256,
            true,
            RopeLayout::Neox,
            15,
        ),
        (
            "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            "qwen2",
            24,
            896,
            14,
            2,
            64,
            false,
            RopeLayout::Neox,
            0,
        ),
    ];
    for (file, arch, n_layer, n_embd, n_head, n_kv, hd, tied, layout, n_swa) in cases {
        let Some(path) = model(file) else { continue };
        let backend = flatrun_format::open(&path).unwrap();
        let cfg = ModelConfig::from_gguf(backend.metadata()).unwrap();
        assert_eq!(cfg.arch, arch, "{file}");
        assert_eq!(
            (
                cfg.n_layer,
                cfg.n_embd,
                cfg.n_head,
                cfg.n_kv_head,
                cfg.head_dim
            ),
            (n_layer, n_embd, n_head, n_kv, hd),
            "{file}"
        );
        assert_eq!(cfg.rope_layout, layout, "{file}");
        assert_eq!(
            cfg.swa_layers.iter().filter(|&&w| w).count(),
            n_swa,
            "{file}"
        );
        let manifest = Manifest::build(&cfg, backend.tensors()).unwrap();
        assert_eq!(manifest.layers.len(), n_layer);
        assert_eq!(manifest.output_tied, tied, "{file}");
        assert!(manifest.largest_layer_bytes() > 0);
        assert!(manifest.total_bytes() <= std::fs::metadata(&path).unwrap().len());
        if arch == "qwen2" {
            assert!(
                manifest.layers[0]
                    .tensors
                    .iter()
                    .any(|t| t.name == "layers.0.attn.q.bias")
            );
        }
    }
}
