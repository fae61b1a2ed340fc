//! The mixture-of-experts families: each is a dense family's layer with the
//! FFN replaced by routed experts ([`super::moe`]); what differs between
//! them is data, the [`MoeRules`] their llama.cpp graphs hard-code.
//!
//! | family | attention | router → weights | shared expert |
//! |---|---|---|---|
//! | `qwen3moe` (Qwen3-30B-A3B) | Qwen3: per-head q/k norms, NeoX | softmax, top-k, renormalized | — |
//! | `qwen2moe` (Qwen1.5/2-MoE) | Qwen2: Q/K/V biases, NeoX | softmax, top-k | yes, `sigmoid(x·gate_inp_shexp)` gate |
//! | `olmoe` | q/k norms over the whole q and k, NeoX | softmax, top-k | — |
//! | `qwen35moe` | Qwen3.5 hybrid (delta net + gated attention) | softmax, top-k, renormalized | yes, sigmoid gate |
//! | `llama` with `expert_count` (Mixtral) | Llama | softmax, top-k, renormalized (= softmax over the selected) | — |

use super::decoder::{self, DecoderLayout, LayerPlan, LayerScratch, OpObserver};
use super::moe::{MoeConfig, MoeRules};
use super::{Arch, Architecture, LayerTensors, MemoryKind, Need, Role, Segment, qwen35};
use crate::config::{GgufKeys, HfKeys, ModelConfig, RopeLayout};
use crate::error::{ModelError, Result};
use flatrun_format::HfNaming;
use flatrun_format::names::HF_MLP_EXPERTS;
use flatrun_kernels::Kernels;

/// How Qwen2-MoE, Qwen3-MoE and OLMoE checkpoints on Hugging Face name their
/// MoE tensors: the router `mlp.gate`, one tensor per expert and projection
/// (`mlp.experts.{e}.{gate,up,down}_proj`), Qwen2-MoE's shared expert
/// (`mlp.shared_expert.*`) and its gate (`mlp.shared_expert_gate`, `[1, n_embd]`).
pub const HF_MOE_NAMING: HfNaming = HfNaming {
    layer_stems: &[
        ("post_attention_layernorm", "ffn_norm"),
        ("mlp.gate", "ffn.gate_inp"),
        ("mlp.shared_expert.gate_proj", "ffn.gate_shexp"),
        ("mlp.shared_expert.up_proj", "ffn.up_shexp"),
        ("mlp.shared_expert.down_proj", "ffn.down_shexp"),
        ("mlp.shared_expert_gate", "ffn.gate_inp_shexp"),
    ],
    expert_stems: HF_MLP_EXPERTS,
};

/// `cfg` (read by `common_from_hf`) with its experts read from `config.json`
/// under `rules`.
fn with_hf_experts(mut cfg: ModelConfig, keys: &HfKeys, rules: MoeRules) -> Result<ModelConfig> {
    cfg.moe = Some(MoeConfig::from_hf(keys, rules, cfg.n_ff)?);
    Ok(cfg)
}

/// Qwen3-MoE's, Mixtral's and Qwen3.5-MoE's rules: softmax, renormalized top-k.
pub const RENORMALIZED: MoeRules = MoeRules {
    normalize: true,
    ..MoeRules::SOFTMAX
};

/// Qwen2-MoE's rules: softmax top-k as is, plus a sigmoid-gated shared expert.
pub const SHARED_GATED: MoeRules = MoeRules {
    shared_expert: true,
    shared_gate: true,
    ..MoeRules::SOFTMAX
};

/// Qwen3.5-MoE's rules.
pub const QWEN35_MOE: MoeRules = MoeRules {
    normalize: true,
    ..SHARED_GATED
};

/// `cfg` with its experts read from the GGUF under `rules`; a family that
/// has only MoE checkpoints refuses a file without experts.
fn with_experts(
    mut cfg: ModelConfig,
    keys: &GgufKeys,
    rules: MoeRules,
    required: bool,
) -> Result<ModelConfig> {
    cfg.moe = MoeConfig::from_gguf(keys, rules, cfg.n_ff)?;
    if required && cfg.moe.is_none() {
        return Err(ModelError::MissingKey {
            arch: keys.arch.to_string(),
            key: format!("{}.expert_count", keys.arch),
        });
    }
    Ok(cfg)
}

/// The experts of a `llama` GGUF (Mixtral), when it has any.
pub fn llama_experts(cfg: ModelConfig, keys: &GgufKeys) -> Result<ModelConfig> {
    with_experts(cfg, keys, RENORMALIZED, false)
}

fn gguf_only(keys: &HfKeys, family: &str) -> Result<ModelConfig> {
    Err(ModelError::UnsupportedArch {
        name: format!(
            "{} (Hugging Face SafeTensors; {family} runs from GGUF only)",
            keys.arch
        ),
        supported: super::supported(),
    })
}

/// Qwen3-MoE.
#[derive(Debug)]
pub struct Qwen3Moe;

impl Architecture for Qwen3Moe {
    fn name(&self) -> &'static str {
        "qwen3moe"
    }
    fn aliases(&self) -> &'static [&'static str] {
        &["qwen3_moe"]
    }
    fn config_from_gguf(&self, keys: &GgufKeys) -> Result<ModelConfig> {
        let mut cfg = super::common_from_gguf(Arch::new(&Qwen3Moe), keys)?;
        cfg.rope_layout = RopeLayout::Neox;
        with_experts(cfg, keys, RENORMALIZED, true)
    }
    fn config_from_hf(&self, keys: &HfKeys) -> Result<ModelConfig> {
        let cfg = super::common_from_hf(Arch::new(&Qwen3Moe), keys)?;
        with_hf_experts(cfg, keys, RENORMALIZED)
    }
    fn hf_naming(&self) -> HfNaming {
        HF_MOE_NAMING
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

/// Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B).
#[derive(Debug)]
pub struct Qwen2Moe;

impl Architecture for Qwen2Moe {
    fn name(&self) -> &'static str {
        "qwen2moe"
    }
    fn aliases(&self) -> &'static [&'static str] {
        &["qwen2_moe"]
    }
    fn config_from_gguf(&self, keys: &GgufKeys) -> Result<ModelConfig> {
        let mut cfg = super::common_from_gguf(Arch::new(&Qwen2Moe), keys)?;
        cfg.rope_layout = RopeLayout::Neox;
        with_experts(cfg, keys, SHARED_GATED, true)
    }
    fn config_from_hf(&self, keys: &HfKeys) -> Result<ModelConfig> {
        let cfg = super::common_from_hf(Arch::new(&Qwen2Moe), keys)?;
        with_hf_experts(cfg, keys, SHARED_GATED)
    }
    fn hf_naming(&self) -> HfNaming {
        HF_MOE_NAMING
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

/// OLMoE.
#[derive(Debug)]
pub struct Olmoe;

impl Architecture for Olmoe {
    fn name(&self) -> &'static str {
        "olmoe"
    }
    fn config_from_gguf(&self, keys: &GgufKeys) -> Result<ModelConfig> {
        let mut cfg = super::common_from_gguf(Arch::new(&Olmoe), keys)?;
        cfg.rope_layout = RopeLayout::Neox;
        with_experts(cfg, keys, MoeRules::SOFTMAX, true)
    }
    fn config_from_hf(&self, keys: &HfKeys) -> Result<ModelConfig> {
        if keys.f32("clip_qkv").is_some() {
            return Err(ModelError::BadValue {
                key: "clip_qkv".into(),
                what: "clipping of q, k and v is not supported".into(),
            });
        }
        let cfg = super::common_from_hf(Arch::new(&Olmoe), keys)?;
        with_hf_experts(cfg, keys, MoeRules::SOFTMAX)
    }
    fn hf_naming(&self) -> HfNaming {
        HF_MOE_NAMING
    }
    fn layer_roles(&self, cfg: &ModelConfig, _: usize) -> Vec<(Role, Need)> {
        // q/k norms over each token's whole q and k (their length says so).
        decoder::layer_roles(
            cfg,
            DecoderLayout {
                qk_norm: true,
                ..DecoderLayout::default()
            },
        )
    }
}

/// Qwen3.5-MoE: the Qwen3.5 hybrid stack with routed experts and a gated
/// shared expert in every layer.
#[derive(Debug)]
pub struct Qwen35Moe;

impl Architecture for Qwen35Moe {
    fn name(&self) -> &'static str {
        "qwen35moe"
    }
    fn aliases(&self) -> &'static [&'static str] {
        &["qwen3_5_moe", "qwen3_5_moe_text"]
    }
    fn config_from_gguf(&self, keys: &GgufKeys) -> Result<ModelConfig> {
        let cfg = qwen35::hybrid_config_from_gguf(Arch::new(&Qwen35Moe), keys)?;
        with_experts(cfg, keys, QWEN35_MOE, true)
    }
    fn config_from_hf(&self, keys: &HfKeys) -> Result<ModelConfig> {
        gguf_only(keys, "Qwen3.5-MoE")
    }
    fn layer_roles(&self, cfg: &ModelConfig, il: usize) -> Vec<(Role, Need)> {
        qwen35::Qwen35.layer_roles(cfg, il)
    }
    fn layer_memory(&self, cfg: &ModelConfig, il: usize) -> MemoryKind {
        qwen35::Qwen35.layer_memory(cfg, il)
    }
    fn ffn_norm(&self) -> Role {
        qwen35::Qwen35.ffn_norm()
    }
    fn forward_layer(
        &self,
        cfg: &ModelConfig,
        plan: &LayerPlan,
        tensors: &dyn LayerTensors,
        hidden: &mut [f32],
        positions: &[usize],
        segments: &mut [Segment],
        kernels: &dyn Kernels,
        scratch: &mut LayerScratch,
        observer: &mut dyn OpObserver,
    ) -> Result<()> {
        qwen35::forward_layer(
            cfg, plan, tensors, hidden, positions, segments, kernels, scratch, observer,
        )
    }
}
