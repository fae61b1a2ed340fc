//! Qwen2, Qwen2.5 and Qwen2.5-Coder: the Llama block with biases on the
//! Q, K and V projections and NeoX RoPE; the output head is usually untied.

use super::decoder::{self, DecoderLayout};
use super::{Arch, Architecture, Need, Role};
use crate::config::{GgufKeys, HfKeys, ModelConfig, RopeLayout};
use crate::error::Result;

/// The Qwen2 family.
#[derive(Debug)]
pub struct Qwen2;

impl Architecture for Qwen2 {
    fn name(&self) -> &'static str {
        "qwen2"
    }
    fn config_from_gguf(&self, keys: &GgufKeys) -> Result<ModelConfig> {
        let mut cfg = super::common_from_gguf(Arch::new(&Qwen2), keys)?;
        cfg.rope_layout = RopeLayout::Neox;
        Ok(cfg)
    }
    fn config_from_hf(&self, keys: &HfKeys) -> Result<ModelConfig> {
        super::common_from_hf(Arch::new(&Qwen2), keys)
    }
    fn layer_roles(&self, cfg: &ModelConfig, _: usize) -> Vec<(Role, Need)> {
        decoder::layer_roles(
            cfg,
            DecoderLayout {
                qkv_bias: true,
                ..DecoderLayout::default()
            },
        )
    }
}
