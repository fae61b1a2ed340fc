//! Llama 1/2/3 and llama-shaped models (SmolLM2, Mistral without SWA).
//!
//! Pre-norm decoder: RMS norm → attention with RoPE → residual → RMS norm →
//! SwiGLU FFN → residual. Llama 3 extends RoPE either through the `llama3`
//! scaling rule (Hugging Face) or a `rope_freqs` tensor (GGUF). GGUF llama
//! checkpoints use the "normal" (adjacent pairs) RoPE layout because the
//! converter permuted the Q/K rows; Hugging Face ones use NeoX halves.

use crate::config::{Arch, GgufKeys, HfKeys, ModelConfig, RopeLayout};
use crate::error::Result;

/// Llama hyperparameters from GGUF metadata.
pub fn config_from_gguf(keys: &GgufKeys) -> Result<ModelConfig> {
    let mut cfg = super::common_from_gguf(Arch::Llama, keys)?;
    cfg.rope_layout = RopeLayout::Normal;
    Ok(cfg)
}

/// Llama hyperparameters from `config.json`.
pub fn config_from_hf(keys: &HfKeys) -> Result<ModelConfig> {
    super::common_from_hf(Arch::Llama, keys)
}
