//! Qwen3: the Qwen2 block without Q/K/V biases, with an RMS norm applied to
//! every query and key head before RoPE; the head dimension comes from
//! `attention.key_length` (it is not `n_embd / n_head`).

use crate::config::{Arch, GgufKeys, HfKeys, ModelConfig, RopeLayout};
use crate::error::Result;

/// Qwen3 hyperparameters from GGUF metadata.
pub fn config_from_gguf(keys: &GgufKeys) -> Result<ModelConfig> {
    let mut cfg = super::common_from_gguf(Arch::Qwen3, keys)?;
    cfg.rope_layout = RopeLayout::Neox;
    Ok(cfg)
}

/// Qwen3 hyperparameters from `config.json`.
pub fn config_from_hf(keys: &HfKeys) -> Result<ModelConfig> {
    super::common_from_hf(Arch::Qwen3, keys)
}
