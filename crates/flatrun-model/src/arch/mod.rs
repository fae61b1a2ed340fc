//! Architectures: how each model family maps its hyperparameters onto a
//! [`ModelConfig`], which tensors it needs, and the decoder layer they all
//! share ([`decoder`]).
//!
//! | family | file | specifics |
//! |---|---|---|
//! | Llama 1/2/3, SmolLM2 | [`llama`] | RoPE scaling (llama3, `rope_freqs`), tied or untied output |
//! | Qwen2 / 2.5 | [`qwen2`] | Q/K/V biases, NeoX RoPE |
//! | Qwen3 | [`qwen3`] | per-head q/k RMS norms |
//! | Gemma 3 | [`gemma3`] | embedding scale, sandwich norms, GELU-tanh, sliding-window layers |
//! | Qwen3.5 | [`qwen35`], [`delta_net`] | hybrid: gated delta-net layers + gated full attention every Nth layer |

pub mod decoder;
pub mod delta_net;
pub mod gemma3;
pub mod llama;
pub mod qwen2;
pub mod qwen3;
pub mod qwen35;

pub use decoder::{
    forward_layer, AttentionSegment, DecoderScratch, LayerKv, LayerPlan, LayerWeights, Op,
    OpObserver,
};

use crate::config::{Activation, Arch, GgufKeys, HfKeys, ModelConfig, RopeLayout, RopeScaling};
use crate::error::Result;

/// Build the config of `arch` from GGUF metadata.
pub fn config_from_gguf(arch: Arch, keys: &GgufKeys) -> Result<ModelConfig> {
    match arch {
        Arch::Llama => llama::config_from_gguf(keys),
        Arch::Qwen2 => qwen2::config_from_gguf(keys),
        Arch::Qwen3 => qwen3::config_from_gguf(keys),
        Arch::Gemma3 => gemma3::config_from_gguf(keys),
        Arch::Qwen35 => qwen35::config_from_gguf(keys),
    }
}

/// Build the config of `arch` from a Hugging Face `config.json`.
pub fn config_from_hf(arch: Arch, keys: &HfKeys) -> Result<ModelConfig> {
    match arch {
        Arch::Llama => llama::config_from_hf(keys),
        Arch::Qwen2 => qwen2::config_from_hf(keys),
        Arch::Qwen3 => qwen3::config_from_hf(keys),
        Arch::Gemma3 => gemma3::config_from_hf(keys),
        Arch::Qwen35 => qwen35::config_from_hf(keys),
    }
}

/// Which optional per-layer tensors an architecture requires (beyond the
/// attention and FFN matrices and the two pre-norms every family has).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerTensorRules {
    /// `attn.q.bias`, `attn.k.bias`, `attn.v.bias`.
    pub qkv_bias: bool,
    /// `attn.q_norm`, `attn.k_norm`.
    pub qk_norm: bool,
    /// `post_attn_norm`, `post_ffn_norm`.
    pub sandwich_norms: bool,
}

/// The per-layer tensor rules of `arch`.
pub fn layer_tensor_rules(arch: Arch) -> LayerTensorRules {
    match arch {
        Arch::Llama => LayerTensorRules {
            qkv_bias: false,
            qk_norm: false,
            sandwich_norms: false,
        },
        Arch::Qwen2 => LayerTensorRules {
            qkv_bias: true,
            qk_norm: false,
            sandwich_norms: false,
        },
        Arch::Qwen3 => LayerTensorRules {
            qkv_bias: false,
            qk_norm: true,
            sandwich_norms: false,
        },
        Arch::Gemma3 => LayerTensorRules {
            qkv_bias: false,
            qk_norm: true,
            sandwich_norms: true,
        },
        // Per-layer tensors of the hybrid stack: see `qwen35::layer_roles`.
        Arch::Qwen35 => LayerTensorRules {
            qkv_bias: false,
            qk_norm: true,
            sandwich_norms: false,
        },
    }
}

/// The hyperparameters every family stores under the same GGUF keys.
pub(crate) fn common_from_gguf(arch: Arch, keys: &GgufKeys) -> Result<ModelConfig> {
    let n_layer = keys.require_usize("block_count")?;
    let n_embd = keys.require_usize("embedding_length")?;
    let n_ff = keys
        .per_layer_u64("feed_forward_length")
        .and_then(|v| v.first().copied())
        .map(|v| v as usize)
        .ok_or_else(|| keys_missing(keys, "feed_forward_length"))?;
    let n_head = keys
        .per_layer_u64("attention.head_count")
        .and_then(|v| v.first().copied())
        .map(|v| v as usize)
        .ok_or_else(|| keys_missing(keys, "attention.head_count"))?;
    let n_kv_head = keys
        .per_layer_u64("attention.head_count_kv")
        .and_then(|v| v.first().copied())
        .map_or(n_head, |v| v as usize);
    if n_head == 0 || n_kv_head == 0 || n_head % n_kv_head != 0 {
        return Err(crate::ModelError::BadValue {
            key: format!("{}.attention.head_count_kv", keys.arch),
            what: format!("{n_kv_head} KV heads do not divide {n_head} query heads"),
        });
    }
    let head_dim = keys
        .u64("attention.key_length")
        .map_or(n_embd / n_head, |v| v as usize);
    let rope_dims = keys
        .u64("rope.dimension_count")
        .map_or(head_dim, |v| v as usize);
    let rope_theta = keys.f32("rope.freq_base").unwrap_or(10_000.0);
    let vocab_size = keys
        .u64("vocab_size")
        .map(|v| v as usize)
        .or_else(|| keys.token_count())
        .unwrap_or(0);
    Ok(ModelConfig {
        arch,
        n_layer,
        n_embd,
        n_ff,
        n_head,
        n_kv_head,
        head_dim,
        vocab_size,
        rms_eps: keys.require_f32("attention.layer_norm_rms_epsilon")?,
        norm_weight_offset: 0.0,
        rope_layout: RopeLayout::Neox,
        rope_dims,
        rope_theta,
        rope_theta_swa: rope_theta,
        rope_scaling: crate::config::gguf_rope_scaling(keys)?,
        context_length: keys.u64("context_length").unwrap_or(2048) as usize,
        sliding_window: None,
        swa_layers: vec![false; n_layer],
        attn_scale: 1.0 / (head_dim as f32).sqrt(),
        embed_scale: None,
        final_logit_softcap: None,
        activation: Activation::Silu,
        delta_net: None,
    })
}

fn keys_missing(keys: &GgufKeys, key: &str) -> crate::ModelError {
    crate::ModelError::MissingKey {
        arch: keys.arch.to_string(),
        key: format!("{}.{}", keys.arch, key),
    }
}

/// The hyperparameters every family stores under the same `config.json` keys.
pub(crate) fn common_from_hf(arch: Arch, keys: &HfKeys) -> Result<ModelConfig> {
    let n_layer = keys.require_usize("num_hidden_layers")?;
    let n_embd = keys.require_usize("hidden_size")?;
    let n_head = keys.require_usize("num_attention_heads")?;
    let n_kv_head = keys
        .u64("num_key_value_heads")
        .map_or(n_head, |v| v as usize);
    if n_head == 0 || n_kv_head == 0 || n_head % n_kv_head != 0 {
        return Err(crate::ModelError::BadValue {
            key: "num_key_value_heads".into(),
            what: format!("{n_kv_head} KV heads do not divide {n_head} query heads"),
        });
    }
    let head_dim = keys.u64("head_dim").map_or(n_embd / n_head, |v| v as usize);
    let rope_theta = keys.f32("rope_theta").unwrap_or(10_000.0);
    let partial = keys.f32("partial_rotary_factor").unwrap_or(1.0);
    Ok(ModelConfig {
        arch,
        n_layer,
        n_embd,
        n_ff: keys.require_usize("intermediate_size")?,
        n_head,
        n_kv_head,
        head_dim,
        vocab_size: keys.u64("vocab_size").unwrap_or(0) as usize,
        rms_eps: keys.f32("rms_norm_eps").unwrap_or(1e-6),
        norm_weight_offset: 0.0,
        // Hugging Face checkpoints keep the rotate-half (NeoX) layout.
        rope_layout: RopeLayout::Neox,
        rope_dims: ((head_dim as f32) * partial) as usize,
        rope_theta,
        rope_theta_swa: rope_theta,
        rope_scaling: keys.rope_scaling()?,
        context_length: keys.u64("max_position_embeddings").unwrap_or(2048) as usize,
        sliding_window: None,
        swa_layers: vec![false; n_layer],
        attn_scale: 1.0 / (head_dim as f32).sqrt(),
        embed_scale: None,
        final_logit_softcap: None,
        activation: Activation::Silu,
        delta_net: None,
    })
}

/// `RopeScaling::None` helper for families that never scale.
#[allow(dead_code)]
pub(crate) const NO_SCALING: RopeScaling = RopeScaling::None;
