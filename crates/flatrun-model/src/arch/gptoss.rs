//! gpt-oss (GGUF `gpt-oss`, llama.cpp's `LLM_ARCH_OPENAI_MOE`): a decoder
//! whose FFN is a routed mixture of experts.
//!
//! - Attention: biases on Q, K, V and the output projection; a learned sink
//!   logit per head joins each softmax (the weights of the real keys sum to
//!   less than one); scale `1/sqrt(head_dim)`; NeoX RoPE with YaRN scaling
//!   (`rope.scaling.*`) on every layer, windowed or not.
//! - Sliding-window attention on every other layer: layer `il` is windowed
//!   when `il` is even (llama.cpp's `set_swa_pattern(2)`), window
//!   `attention.sliding_window` (128 in the released models).
//! - FFN behind `post_attention_norm` (the only norm between attention and
//!   experts): a router with a bias; the top `expert_used_count` experts by
//!   raw logit, weighted by a softmax over the selected logits only (no
//!   renormalization); experts with biases on their gate, up and down
//!   projections, stored in MXFP4 in the released files; the clamped SwiGLU
//!   `g·σ(1.702·g)·(u + 1)` with `g = min(gate, 7)`, `u = clamp(up, ±7)`.
//!
//! GGUF only: the Hugging Face checkpoints keep their experts as MXFP4
//! blocks and scales under names this loader does not map.

use super::decoder::{self, DecoderTensors, Ffn, LayerPlan, LayerScratch, OpObserver};
use super::moe::{ExpertActivation, Gating, MoeConfig, MoeRules};
use super::{
    Arch, Architecture, LayerTensors, Need, Role, Segment, require_matrix, require_vector,
};
use crate::config::{GgufKeys, HfKeys, ModelConfig, RopeLayout};
use crate::error::{ModelError, Result};
use flatrun_kernels::Kernels;

/// The gpt-oss family.
#[derive(Debug)]
pub struct GptOss;

/// One full-attention layer every this many layers (the last of each pair).
pub const SWA_PATTERN: usize = 2;
/// The clamped SwiGLU's constants (llama.cpp's `LLM_FFN_SWIGLU_OAI_MOE`).
pub const SWIGLU_ALPHA: f32 = 1.702;
pub const SWIGLU_LIMIT: f32 = 7.0;

/// gpt-oss's router and experts (llama.cpp's `SOFTMAX_WEIGHT` gating).
pub const MOE_RULES: MoeRules = MoeRules {
    gating: Gating::SoftmaxSelected,
    normalize: false,
    shared_expert: false,
    shared_gate: false,
    activation: ExpertActivation::SwigluClamped {
        alpha: SWIGLU_ALPHA,
        limit: SWIGLU_LIMIT,
    },
};

impl Architecture for GptOss {
    fn name(&self) -> &'static str {
        "gpt-oss"
    }
    fn aliases(&self) -> &'static [&'static str] {
        &["gpt_oss"]
    }
    fn ffn_norm(&self) -> Role {
        Role::PostAttnNorm
    }
    fn config_from_gguf(&self, keys: &GgufKeys) -> Result<ModelConfig> {
        config_from_gguf(keys)
    }
    fn config_from_hf(&self, _: &HfKeys) -> Result<ModelConfig> {
        Err(ModelError::BadValue {
            key: "model_type".into(),
            what: "gpt-oss runs from GGUF files only (convert the checkpoint with \
                   llama.cpp's convert_hf_to_gguf.py)"
                .into(),
        })
    }
    fn layer_roles(&self, cfg: &ModelConfig, _: usize) -> Vec<(Role, Need)> {
        use Need::Required;
        let mut roles = vec![
            (Role::AttnNorm, Required),
            (Role::AttnQ, Required),
            (Role::AttnK, Required),
            (Role::AttnV, Required),
            (Role::AttnO, Required),
            (Role::AttnQBias, Required),
            (Role::AttnKBias, Required),
            (Role::AttnVBias, Required),
            (Role::AttnOBias, Required),
            (Role::AttnSinks, Required),
            (Role::PostAttnNorm, Required),
        ];
        roles.extend(decoder::ffn_roles(cfg));
        roles
    }
    /// Windowed layers keep the full layers' YaRN scaling (llama.cpp sets
    /// gpt-oss's windowed base and scale to the trained ones).
    fn layer_plan(&self, cfg: &ModelConfig, il: usize, freq_factors: Option<&[f32]>) -> LayerPlan {
        let mut plan = LayerPlan::new(cfg, il, freq_factors);
        plan.rope.scaling = cfg.rope_scaling;
        plan
    }
    #[allow(clippy::too_many_arguments)]
    fn forward_layer(
        &self,
        cfg: &ModelConfig,
        plan: &LayerPlan,
        t: &dyn LayerTensors,
        hidden: &mut [f32],
        positions: &[usize],
        segments: &mut [Segment],
        kernels: &dyn Kernels,
        scratch: &mut LayerScratch,
        observer: &mut dyn OpObserver,
    ) -> Result<()> {
        let il = plan.index;
        // `post_attention_norm` is the experts' input norm, not a norm of
        // the attention output.
        let w = DecoderTensors {
            attn_norm: require_vector(t, il, Role::AttnNorm)?,
            q: require_matrix(t, il, Role::AttnQ)?,
            k: require_matrix(t, il, Role::AttnK)?,
            v: require_matrix(t, il, Role::AttnV)?,
            o: require_matrix(t, il, Role::AttnO)?,
            q_bias: Some(require_vector(t, il, Role::AttnQBias)?),
            k_bias: Some(require_vector(t, il, Role::AttnKBias)?),
            v_bias: Some(require_vector(t, il, Role::AttnVBias)?),
            o_bias: Some(require_vector(t, il, Role::AttnOBias)?),
            sinks: Some(require_vector(t, il, Role::AttnSinks)?),
            q_norm: None,
            k_norm: None,
            post_attn_norm: None,
            ffn: Ffn::from_layer(cfg, il, t, GptOss.ffn_norm())?,
        };
        decoder::forward_layer(
            cfg, plan, &w, hidden, positions, segments, kernels, scratch, observer,
        )
    }
}

/// Layer `il` is windowed unless it is the last of each group of `pattern`.
pub fn swa_layers(n_layer: usize, pattern: usize) -> Vec<bool> {
    super::gemma3::swa_layers(n_layer, pattern)
}

/// gpt-oss hyperparameters from GGUF metadata.
pub fn config_from_gguf(keys: &GgufKeys) -> Result<ModelConfig> {
    let mut cfg = super::common_from_gguf(Arch::new(&GptOss), keys)?;
    cfg.rope_layout = RopeLayout::Neox;
    let moe = MoeConfig::from_gguf(keys, MOE_RULES, cfg.n_ff)?;
    cfg.moe = Some(moe.ok_or_else(|| ModelError::MissingKey {
        arch: keys.arch.to_string(),
        key: format!("{}.expert_count", keys.arch),
    })?);
    let window = keys.require_usize("attention.sliding_window")?;
    if window == 0 {
        return Err(ModelError::BadValue {
            key: format!("{}.attention.sliding_window", keys.arch),
            what: "a window of 0 tokens".into(),
        });
    }
    cfg.sliding_window = Some(window);
    cfg.swa_layers = match keys.bool_array("attention.sliding_window_pattern") {
        Some(per_layer) if per_layer.len() == cfg.n_layer => per_layer,
        _ => {
            let pattern = keys
                .u64("attention.sliding_window_pattern")
                .map_or(SWA_PATTERN, |p| p as usize);
            swa_layers(cfg.n_layer, pattern)
        }
    };
    cfg.rope_theta_swa = keys.f32("rope.freq_base_swa").unwrap_or(cfg.rope_theta);
    Ok(cfg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn even_layers_are_windowed() {
        let swa = swa_layers(6, SWA_PATTERN);
        assert_eq!(swa, [true, false, true, false, true, false]);
    }
}
