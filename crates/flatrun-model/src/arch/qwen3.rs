//! Qwen3: the Qwen2 block without Q/K/V biases, with an RMS norm applied to
//! every query and key head before RoPE; the head dimension comes from
//! `attention.key_length` (it is not `n_embd / n_head`).

use super::decoder::{self, DecoderLayout};
use super::{Arch, Architecture, Need, Role};
use crate::config::{GgufKeys, HfKeys, ModelConfig, RopeLayout};
use crate::error::Result;

/// The Qwen3 family.
#[derive(Debug)]
pub struct Qwen3;

impl Architecture for Qwen3 {
    fn name(&self) -> &'static str {
        "qwen3"
    }
    fn config_from_gguf(&self, keys: &GgufKeys) -> Result<ModelConfig> {
        let mut cfg = super::common_from_gguf(Arch::new(&Qwen3), keys)?;
        cfg.rope_layout = RopeLayout::Neox;
        Ok(cfg)
    }
    fn config_from_hf(&self, keys: &HfKeys) -> Result<ModelConfig> {
        super::common_from_hf(Arch::new(&Qwen3), keys)
    }
    fn layer_roles(&self, cfg: &ModelConfig, _: usize) -> Vec<(Role, Need)> {
        decoder::layer_roles(
            cfg,
            DecoderLayout {
                qk_norm: true,
                ..DecoderLayout::default()
            },
        )
    }
}
