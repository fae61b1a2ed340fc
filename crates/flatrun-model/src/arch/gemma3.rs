//! Gemma 3 (text): embeddings scaled by sqrt(n_embd), per-head q/k RMS norms,
//! "sandwich" norms after attention and after the FFN, a GELU-tanh gated
//! FFN, and sliding-window attention on five layers out of six (layer `il`
//! is windowed unless `il % 6 == 5`, as in llama.cpp's `set_swa_pattern(6)`).
//! Windowed layers use their own RoPE base (10 000 by default), full layers
//! `rope.freq_base` (1e6). The attention scale is `1/sqrt(head_dim)` (GGUF)
//! or `1/sqrt(query_pre_attn_scalar)` (Hugging Face).
//!
//! GGUF norm weights already include Gemma's "+1"; Hugging Face and MLX
//! checkpoints store `w` and the model computes `x * (1 + w)`, which the
//! config expresses as `norm_weight_offset = 1`.

use super::decoder::{self, DecoderLayout, LayerPlan};
use super::{Arch, Architecture, Need, Role};
use crate::config::{Activation, GgufKeys, HfKeys, ModelConfig, RopeLayout};
use crate::error::Result;
use flatrun_format::HfNaming;

/// The Gemma 3 family.
#[derive(Debug)]
pub struct Gemma3;

impl Architecture for Gemma3 {
    fn name(&self) -> &'static str {
        "gemma3"
    }
    fn aliases(&self) -> &'static [&'static str] {
        &["gemma3_text"]
    }
    fn config_from_gguf(&self, keys: &GgufKeys) -> Result<ModelConfig> {
        config_from_gguf(keys)
    }
    fn config_from_hf(&self, keys: &HfKeys) -> Result<ModelConfig> {
        config_from_hf(keys)
    }
    /// `post_attention_layernorm` is the norm of the attention output;
    /// `pre_feedforward_layernorm` is the pre-FFN norm.
    fn hf_naming(&self) -> HfNaming {
        HfNaming {
            layer_stems: &[("post_attention_layernorm", "post_attn_norm")],
            ..HfNaming::GENERIC
        }
    }
    fn layer_roles(&self, cfg: &ModelConfig, _: usize) -> Vec<(Role, Need)> {
        decoder::layer_roles(
            cfg,
            DecoderLayout {
                qkv_bias: false,
                qk_norm: true,
                sandwich_norms: true,
            },
        )
    }
    /// The attention scale multiplies the queries in f32 after RoPE (before
    /// ggml rounds them to f16 against the cache), as llama.cpp's graph does.
    fn layer_plan(&self, cfg: &ModelConfig, il: usize, freq_factors: Option<&[f32]>) -> LayerPlan {
        LayerPlan::new(cfg, il, freq_factors).scaling_queries()
    }
}

/// One full-attention layer every this many layers.
pub const SWA_PATTERN: usize = 6;
/// RoPE base of the windowed layers when the checkpoint does not say.
pub const DEFAULT_LOCAL_ROPE_BASE: f32 = 10_000.0;

/// Layer `il` is windowed unless it is the last of each group of `pattern`.
pub fn swa_layers(n_layer: usize, pattern: usize) -> Vec<bool> {
    (0..n_layer)
        .map(|il| pattern == 0 || il % pattern < pattern - 1)
        .collect()
}

/// Gemma 3 hyperparameters from GGUF metadata.
pub fn config_from_gguf(keys: &GgufKeys) -> Result<ModelConfig> {
    let mut cfg = super::common_from_gguf(Arch::new(&Gemma3), keys)?;
    cfg.rope_layout = RopeLayout::Neox;
    cfg.activation = Activation::GeluTanh;
    cfg.embed_scale = Some((cfg.n_embd as f32).sqrt());
    cfg.final_logit_softcap = keys.f32("final_logit_softcapping").filter(|&c| c > 0.0);
    if let Some(window) = keys.u64("attention.sliding_window").filter(|&w| w > 0) {
        cfg.sliding_window = Some(window as usize);
        cfg.swa_layers = match keys.bool_array("attention.sliding_window_pattern") {
            Some(per_layer) if per_layer.len() == cfg.n_layer => per_layer,
            _ => {
                let pattern = keys
                    .u64("attention.sliding_window_pattern")
                    .map_or(SWA_PATTERN, |p| p as usize);
                swa_layers(cfg.n_layer, pattern)
            }
        };
        cfg.rope_theta_swa = keys
            .f32("rope.freq_base_swa")
            .unwrap_or(DEFAULT_LOCAL_ROPE_BASE);
    }
    Ok(cfg)
}

/// Gemma 3 hyperparameters from `config.json` (`gemma3_text`, or the
/// `text_config` of a multimodal checkpoint).
pub fn config_from_hf(keys: &HfKeys) -> Result<ModelConfig> {
    let mut cfg = super::common_from_hf(Arch::new(&Gemma3), keys)?;
    cfg.activation = Activation::GeluTanh;
    cfg.embed_scale = Some((cfg.n_embd as f32).sqrt());
    cfg.norm_weight_offset = 1.0;
    cfg.head_dim = keys.u64("head_dim").map_or(256, |v| v as usize);
    cfg.rope_dims = cfg.head_dim;
    cfg.final_logit_softcap = keys.f32("final_logit_softcapping").filter(|&c| c > 0.0);
    let scalar = keys
        .f32("query_pre_attn_scalar")
        .unwrap_or(cfg.head_dim as f32);
    cfg.attn_scale = 1.0 / scalar.sqrt();
    if let Some(window) = keys.u64("sliding_window").filter(|&w| w > 0) {
        cfg.sliding_window = Some(window as usize);
        let from_types = keys.get("layer_types").and_then(|v| v.as_array()).map(|a| {
            a.iter()
                .map(|t| t.as_str() == Some("sliding_attention"))
                .collect::<Vec<bool>>()
        });
        cfg.swa_layers = match from_types {
            Some(per_layer) if per_layer.len() == cfg.n_layer => per_layer,
            _ => {
                let pattern = keys
                    .u64("sliding_window_pattern")
                    .map_or(SWA_PATTERN, |p| p as usize);
                swa_layers(cfg.n_layer, pattern)
            }
        };
        cfg.rope_theta_swa = keys
            .f32("rope_local_base_freq")
            .unwrap_or(DEFAULT_LOCAL_ROPE_BASE);
    }
    Ok(cfg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_sixth_layer_is_global() {
        let swa = swa_layers(18, SWA_PATTERN);
        let global: Vec<usize> = (0..18).filter(|&i| !swa[i]).collect();
        assert_eq!(global, vec![5, 11, 17]);
    }
}
