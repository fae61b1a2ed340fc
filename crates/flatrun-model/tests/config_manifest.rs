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
        ("qwen3_moe", "qwen3moe"),
        ("qwen2_moe", "qwen2moe"),
        ("olmoe", "olmoe"),
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

/// A Hugging Face Qwen3-MoE `config.json` (the keys transformers writes).
fn qwen3_moe_json() -> serde_json::Value {
    serde_json::json!({
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "num_hidden_layers": 2, "hidden_size": 8, "intermediate_size": 48,
        "moe_intermediate_size": 4, "num_experts": 4, "num_experts_per_tok": 2,
        "norm_topk_prob": true, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8
    })
}

#[test]
fn hf_moe_configs() {
    let cfg = ModelConfig::from_hf_json(&qwen3_moe_json()).unwrap();
    assert_eq!(cfg.arch, "qwen3moe");
    let moe = cfg.moe.clone().expect("experts");
    assert_eq!(
        (moe.n_expert, moe.n_expert_used, moe.n_ff_expert),
        (4, 2, 4)
    );
    assert!(moe.normalize && moe.shared.is_none());
    // Qwen2-MoE: not renormalized, a gated shared expert of its own width.
    let json = serde_json::json!({
        "model_type": "qwen2_moe", "num_hidden_layers": 2, "hidden_size": 8,
        "intermediate_size": 48, "moe_intermediate_size": 4, "shared_expert_intermediate_size": 16,
        "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": false,
        "num_attention_heads": 2, "num_key_value_heads": 1
    });
    let moe = ModelConfig::from_hf_json(&json).unwrap().moe.unwrap();
    assert!(!moe.normalize);
    assert_eq!(moe.shared.map(|s| (s.n_ff, s.gated)), Some((16, true)));
    // OLMoE: the experts' width is `intermediate_size`.
    let json = serde_json::json!({
        "model_type": "olmoe", "num_hidden_layers": 2, "hidden_size": 8, "intermediate_size": 4,
        "num_experts": 4, "num_experts_per_tok": 2, "num_attention_heads": 2
    });
    let moe = ModelConfig::from_hf_json(&json).unwrap().moe.unwrap();
    assert_eq!((moe.n_ff_expert, moe.normalize), (4, false));
    // Dense layers among the expert layers are refused.
    for (key, value) in [
        ("decoder_sparse_step", serde_json::json!(2)),
        ("mlp_only_layers", serde_json::json!([1])),
    ] {
        let mut json = qwen3_moe_json();
        json[key] = value;
        match ModelConfig::from_hf_json(&json) {
            Err(ModelError::BadValue { key: k, .. }) => assert_eq!(k, key),
            other => panic!("{key}: expected a bad value, got {other:?}"),
        }
    }
    let mut json = qwen3_moe_json();
    json["num_experts_per_tok"] = 5.into();
    assert!(matches!(
        ModelConfig::from_hf_json(&json),
        Err(ModelError::BadValue { .. })
    ));
}

#[test]
fn manifest_lists_per_expert_tensors_in_expert_order() {
    use flatrun_format::{DType, GgmlType, QuantDescriptor, TensorInfo};
    use flatrun_model::arch::{Role, expert_tensor, layer_tensor};
    let cfg = ModelConfig::from_hf_json(&qwen3_moe_json()).unwrap();
    let info = |name: String, shape: Vec<usize>| TensorInfo {
        original_name: name.clone(),
        name,
        byte_size: 4 * shape.iter().product::<usize>() as u64,
        shape,
        dtype: DType::Ggml(GgmlType::F32),
        quant: QuantDescriptor::None,
        offset: 0,
        file_index: 0,
    };
    let mut tensors = vec![
        info("embed".into(), vec![32, 8]),
        info("output_norm".into(), vec![8]),
    ];
    for il in 0..2 {
        for role in [
            Role::AttnNorm,
            Role::AttnQNorm,
            Role::AttnKNorm,
            Role::FfnNorm,
        ] {
            tensors.push(info(layer_tensor(il, role), vec![8]));
        }
        for role in [Role::AttnQ, Role::AttnK, Role::AttnV, Role::AttnO] {
            tensors.push(info(layer_tensor(il, role), vec![8, 8]));
        }
        tensors.push(info(layer_tensor(il, Role::FfnGateInp), vec![4, 8]));
        // Experts in reverse order, as a file may hold them.
        for e in (0..4).rev() {
            for (role, shape) in [
                (Role::FfnDownExps, vec![8, 4]),
                (Role::FfnGateExps, vec![4, 8]),
                (Role::FfnUpExps, vec![4, 8]),
            ] {
                tensors.push(info(expert_tensor(il, role, e), shape));
            }
        }
    }
    let manifest = Manifest::build(&cfg, &tensors).unwrap();
    let names: Vec<&str> = manifest.layers[1]
        .tensors
        .iter()
        .filter(|t| t.role().is_some_and(|r| r.is_experts()))
        .map(|t| t.name.as_str())
        .collect();
    let want: Vec<String> = [Role::FfnGateExps, Role::FfnUpExps, Role::FfnDownExps]
        .iter()
        .flat_map(|&r| (0..4).map(move |e| expert_tensor(1, r, e)))
        .collect();
    assert_eq!(names, want);
    let expert_bytes: u64 = manifest.layers[1]
        .tensors
        .iter()
        .filter(|t| t.role().is_some_and(|r| r.is_experts()))
        .map(|t| t.bytes)
        .sum();
    assert_eq!(expert_bytes, 3 * 4 * 4 * 8 * 4);

    // A missing expert, a wrong shape, and more experts than the config declares.
    let without = |name: &str| -> Vec<TensorInfo> {
        tensors.iter().filter(|t| t.name != name).cloned().collect()
    };
    match Manifest::build(&cfg, &without("layers.1.ffn.up_exps.2")) {
        Err(ModelError::MissingTensor { tensor, .. }) => {
            assert_eq!(tensor, "layers.1.ffn.up_exps.2")
        }
        other => panic!("expected a missing expert, got {other:?}"),
    }
    let mut reshaped = tensors.clone();
    let t = reshaped
        .iter_mut()
        .find(|t| t.name == "layers.0.ffn.down_exps.3")
        .unwrap();
    t.shape = vec![4, 8];
    match Manifest::build(&cfg, &reshaped) {
        Err(ModelError::BadShape { tensor, shape, .. }) => {
            assert_eq!(
                (tensor.as_str(), shape),
                ("layers.0.ffn.down_exps.3", vec![4, 8])
            )
        }
        other => panic!("expected a bad shape, got {other:?}"),
    }
    let mut json = qwen3_moe_json();
    json["num_experts"] = 3.into();
    let fewer = ModelConfig::from_hf_json(&json).unwrap();
    match Manifest::build(&fewer, &tensors) {
        Err(ModelError::ExtraExpert {
            tensor,
            expert,
            n_expert,
        }) => assert_eq!(
            (tensor.as_str(), expert, n_expert),
            ("layers.0.ffn.gate_exps.3", 3, 3)
        ),
        other => panic!("expected an extra expert, got {other:?}"),
    }
    // No expert tensors at all: the stacked tensor is what is missing.
    let none: Vec<TensorInfo> = tensors
        .iter()
        .filter(|t| !t.name.starts_with("layers.0.ffn.gate_exps"))
        .cloned()
        .collect();
    match Manifest::build(&cfg, &none) {
        Err(ModelError::MissingTensor { tensor, .. }) => {
            assert_eq!(tensor, "layers.0.ffn.gate_exps")
        }
        other => panic!("expected a missing tensor, got {other:?}"),
    }
}
