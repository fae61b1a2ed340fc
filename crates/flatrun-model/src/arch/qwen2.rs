//! Qwen2, Qwen2.5 and Qwen2.5-Coder: the Llama block with biases on the
//! Q, K and V projections and NeoX RoPE; the output head is usually untied.

use crate::config::{Arch, GgufKeys, HfKeys, ModelConfig, RopeLayout};
use crate::error::Result;

/// Qwen2 hyperparameters from GGUF metadata.
pub fn config_from_gguf(keys: &GgufKeys) -> Result<ModelConfig> {
    let mut cfg = super::common_from_gguf(Arch::Qwen2, keys)?;
    cfg.rope_layout = RopeLayout::Neox;
    Ok(cfg)
}

/// Qwen2 hyperparameters from `config.json`.
pub fn config_from_hf(keys: &HfKeys) -> Result<ModelConfig> {
    super::common_from_hf(Arch::Qwen2, keys)
}
