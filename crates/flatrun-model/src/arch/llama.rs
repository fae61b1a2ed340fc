//! Llama 1/2/3 and llama-shaped models (SmolLM2, Mistral without SWA,
//! Mixtral: a llama with routed experts).
//!
//! Pre-norm decoder: RMS norm → attention with RoPE → residual → RMS norm →
//! SwiGLU FFN → residual. Llama 3 extends RoPE either through the `llama3`
//! scaling rule (Hugging Face) or a `rope_freqs` tensor (GGUF). GGUF llama
//! checkpoints use the "normal" (adjacent pairs) RoPE layout because the
//! converter permuted the Q/K rows; Hugging Face ones use NeoX halves.

use super::decoder::{self, DecoderLayout, LayerPlan};
use super::moe::MoeConfig;
use super::{Arch, Architecture, Need, Role};
use crate::config::{GgufKeys, HfKeys, ModelConfig, RopeLayout};
use crate::error::Result;
use flatrun_format::HfNaming;
use flatrun_format::names::HF_MIXTRAL_EXPERTS;

/// Llama's Hugging Face names: the pre-FFN norm, and Mixtral's router
/// (`block_sparse_moe.gate`) and experts (`block_sparse_moe.experts.{e}.w1/w3/w2`).
pub const LLAMA_NAMING: HfNaming = HfNaming {
    layer_stems: &[
        ("post_attention_layernorm", "ffn_norm"),
        ("block_sparse_moe.gate", "ffn.gate_inp"),
    ],
    expert_stems: HF_MIXTRAL_EXPERTS,
};

/// The Llama family.
#[derive(Debug)]
pub struct Llama;

impl Architecture for Llama {
    fn name(&self) -> &'static str {
        "llama"
    }
    fn aliases(&self) -> &'static [&'static str] {
        &["smollm", "smollm2", "mistral", "mixtral"]
    }
    fn config_from_gguf(&self, keys: &GgufKeys) -> Result<ModelConfig> {
        let mut cfg = super::common_from_gguf(Arch::new(&Llama), keys)?;
        cfg.rope_layout = RopeLayout::Normal;
        // Mixtral: a llama with `expert_count` experts per layer.
        super::moe_families::llama_experts(cfg, keys)
    }
    fn config_from_hf(&self, keys: &HfKeys) -> Result<ModelConfig> {
        let mut cfg = super::common_from_hf(Arch::new(&Llama), keys)?;
        // Mixtral: `num_local_experts` experts per layer.
        if keys.u64("num_local_experts").is_some_and(|n| n > 0) {
            let rules = super::moe_families::RENORMALIZED;
            cfg.moe = Some(MoeConfig::from_hf(keys, rules, cfg.n_ff)?);
        }
        Ok(cfg)
    }
    fn hf_naming(&self) -> HfNaming {
        LLAMA_NAMING
    }
    fn layer_roles(&self, cfg: &ModelConfig, _: usize) -> Vec<(Role, Need)> {
        decoder::layer_roles(cfg, DecoderLayout::default())
    }
    /// Hugging Face checkpoints keep each head's rotary dims as two halves
    /// (NeoX); llama.cpp's converter permutes the Q/K rows into adjacent
    /// pairs. q and k are reordered into pairs after the projection, so the
    /// cache and every q·k sum run in llama.cpp's order.
    fn layer_plan(&self, cfg: &ModelConfig, il: usize, freq_factors: Option<&[f32]>) -> LayerPlan {
        LayerPlan::new(cfg, il, freq_factors).pairing_halves()
    }
}
