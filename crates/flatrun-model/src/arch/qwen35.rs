//! Qwen3.5 (`qwen35` in llama.cpp): a hybrid stack. Most layers mix tokens
//! with a gated delta net (linear attention with a recurrent state, see
//! [`super::delta_net`]); every `full_attention_interval`-th layer (layer `il`
//! with `(il + 1) % interval == 0`, or the `attention.recurrent_layers` flags)
//! is gated full attention:
//!
//! ```text
//! [q | gate] = x·W_qᵀ        per head: head_dim query values, then head_dim gate values
//! q, k       = rmsnorm(q)·q_norm, rmsnorm(k)·k_norm     per head
//! q, k       = rope(q, k)    NeoX on the first rope.dimension_count dims
//! att        = softmax(q·kᵀ/sqrt(head_dim)) · v          over the KV cache
//! out        = (att ⊙ sigmoid(gate))·W_oᵀ
//! ```
//!
//! Every layer is `h += mixer(rmsnorm(h)·attn_norm)` then
//! `h += swiglu_ffn(rmsnorm(h)·post_attention_norm)`.
//!
//! Positions: llama.cpp rotates Qwen3.5 with interleaved multi-axis RoPE
//! (`rope.dimension_sections`); for text every axis holds the token's
//! position, which makes it exactly NeoX RoPE over the rotated dimensions.

use super::decoder::{
    Clock, Ffn, FfnBuffers, LayerPlan, LayerScratch, Op, OpObserver, attention_core, check_hidden,
    ffn_roles, run_ffn, wrong_memory,
};
use super::delta_net::{self, DeltaNetConfig, DeltaNetSegment, DeltaNetWeights, project};
use super::{
    Arch, Architecture, LayerMemory, LayerTensors, MemoryKind, Need, Role, Segment, require_matrix,
    require_vector,
};
use crate::config::{GgufKeys, HfKeys, ModelConfig, RopeLayout};
use crate::error::{ModelError, Result};
use flatrun_kernels::{Kernels, Weight, ops};
use std::time::Instant;

/// Full-attention layer interval when the checkpoint does not say.
pub const DEFAULT_FULL_ATTENTION_INTERVAL: usize = 4;

/// The Qwen3.5 family.
#[derive(Debug)]
pub struct Qwen35;

impl Architecture for Qwen35 {
    fn name(&self) -> &'static str {
        "qwen35"
    }
    fn aliases(&self) -> &'static [&'static str] {
        &["qwen3_5", "qwen3_5_text"]
    }
    fn config_from_gguf(&self, keys: &GgufKeys) -> Result<ModelConfig> {
        config_from_gguf(keys)
    }
    fn config_from_hf(&self, keys: &HfKeys) -> Result<ModelConfig> {
        config_from_hf(keys)
    }
    fn layer_roles(&self, cfg: &ModelConfig, il: usize) -> Vec<(Role, Need)> {
        let roles = if cfg.is_recurrent(il) {
            DELTA_NET_ROLES
        } else {
            ATTENTION_ROLES
        };
        let mut roles: Vec<(Role, Need)> = roles.iter().map(|&r| (r, Need::Required)).collect();
        roles.extend(ffn_roles(cfg));
        roles
    }
    /// GGUF `post_attention_norm`: the norm in front of the FFN.
    fn ffn_norm(&self) -> Role {
        Role::PostAttnNorm
    }
    fn layer_memory(&self, cfg: &ModelConfig, il: usize) -> MemoryKind {
        if cfg.is_recurrent(il) {
            MemoryKind::Recurrent
        } else {
            MemoryKind::Kv
        }
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
        forward_layer(
            cfg, plan, tensors, hidden, positions, segments, kernels, scratch, observer,
        )
    }
}

/// The tensors of a delta-net layer up to its FFN (whose matrices follow,
/// dense or routed: [`ffn_roles`]), matrices in the order it multiplies them.
pub const DELTA_NET_ROLES: &[Role] = &[
    Role::AttnNorm,
    Role::AttnQkv,
    Role::AttnGate,
    Role::SsmConv1d,
    Role::SsmDtBias,
    Role::SsmA,
    Role::SsmAlpha,
    Role::SsmBeta,
    Role::SsmNorm,
    Role::SsmOut,
    Role::PostAttnNorm,
];

/// The tensors of a gated full-attention layer up to its FFN.
pub const ATTENTION_ROLES: &[Role] = &[
    Role::AttnNorm,
    Role::AttnQ,
    Role::AttnK,
    Role::AttnV,
    Role::AttnO,
    Role::AttnQNorm,
    Role::AttnKNorm,
    Role::PostAttnNorm,
];

/// Qwen3.5 hyperparameters from GGUF metadata.
pub fn config_from_gguf(keys: &GgufKeys) -> Result<ModelConfig> {
    hybrid_config_from_gguf(Arch::new(&Qwen35), keys)
}

/// The hyperparameters of a Qwen3.5-shaped hybrid stack of family `arch`
/// (`qwen35`, `qwen35moe`).
pub fn hybrid_config_from_gguf(arch: Arch, keys: &GgufKeys) -> Result<ModelConfig> {
    let mut cfg = super::common_from_gguf(arch, keys)?;
    cfg.rope_layout = RopeLayout::Neox;
    let n_layer = cfg.n_layer;
    let recurrent_layers = match keys.bool_array("attention.recurrent_layers") {
        Some(flags) if flags.len() >= n_layer => flags[..n_layer].to_vec(),
        _ => {
            let interval = keys
                .u64("full_attention_interval")
                .map_or(DEFAULT_FULL_ATTENTION_INTERVAL, |v| v as usize);
            if interval == 0 {
                return Err(ModelError::BadValue {
                    key: format!("{}.full_attention_interval", keys.arch),
                    what: "must be at least 1".into(),
                });
            }
            (0..n_layer).map(|il| (il + 1) % interval != 0).collect()
        }
    };
    let n_v_heads = keys.require_usize("ssm.time_step_rank")?;
    let d_inner = keys.require_usize("ssm.inner_size")?;
    let delta = DeltaNetConfig {
        d_conv: keys.require_usize("ssm.conv_kernel")?,
        head_k_dim: keys.require_usize("ssm.state_size")?,
        head_v_dim: d_inner.checked_div(n_v_heads).unwrap_or(0),
        n_k_heads: keys.require_usize("ssm.group_count")?,
        n_v_heads,
        recurrent_layers,
    };
    delta.validate(keys.arch)?;
    cfg.delta_net = Some(delta);
    Ok(cfg)
}

/// Qwen3.5 from a Hugging Face `config.json`: not supported yet (the
/// checkpoint's tensor names, `A_log` and its norm convention are not mapped).
pub fn config_from_hf(keys: &HfKeys) -> Result<ModelConfig> {
    Err(ModelError::UnsupportedArch {
        name: format!(
            "{} (Hugging Face SafeTensors; Qwen3.5 runs from GGUF only)",
            keys.arch
        ),
        supported: super::supported(),
    })
}

/// The weights of a gated full-attention layer's mixer.
#[derive(Clone, Copy, Debug)]
struct GatedAttentionWeights<'a> {
    /// `attn_q`: `2 · n_head · head_dim × n_embd` (query and gate per head).
    q: Weight<'a>,
    k: Weight<'a>,
    v: Weight<'a>,
    o: Weight<'a>,
    q_norm: &'a [f32],
    k_norm: &'a [f32],
}

/// A delta-net layer's mixer weights by role.
fn delta_net_weights<'a>(t: &'a dyn LayerTensors, layer: usize) -> Result<DeltaNetWeights<'a>> {
    Ok(DeltaNetWeights {
        qkv: require_matrix(t, layer, Role::AttnQkv)?,
        z: require_matrix(t, layer, Role::AttnGate)?,
        alpha: require_matrix(t, layer, Role::SsmAlpha)?,
        beta: require_matrix(t, layer, Role::SsmBeta)?,
        out: require_matrix(t, layer, Role::SsmOut)?,
        conv1d: require_vector(t, layer, Role::SsmConv1d)?,
        dt_bias: require_vector(t, layer, Role::SsmDtBias)?,
        a: require_vector(t, layer, Role::SsmA)?,
        norm: require_vector(t, layer, Role::SsmNorm)?,
    })
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// Run Qwen3.5 layer `plan.index` on `hidden` (`n × n_embd`, updated in
/// place) for tokens at `positions`; `segments` split the rows by sequence.
#[allow(clippy::too_many_arguments)]
pub fn forward_layer(
    cfg: &ModelConfig,
    plan: &LayerPlan,
    t: &dyn LayerTensors,
    hidden: &mut [f32],
    positions: &[usize],
    segments: &mut [Segment],
    kernels: &dyn Kernels,
    scratch: &mut LayerScratch,
    obs: &mut dyn OpObserver,
) -> Result<()> {
    let layer = plan.index;
    let n = positions.len();
    let (d, ff, eps, offset) = (cfg.n_embd, cfg.n_ff, cfg.rms_eps, cfg.norm_weight_offset);
    check_hidden(cfg, layer, hidden, n)?;
    let attn_norm = require_vector(t, layer, Role::AttnNorm)?;
    let ffn = Ffn::from_layer(cfg, layer, t, Qwen35.ffn_norm())?;
    scratch.reserve(cfg, n);
    let LayerScratch {
        xb,
        q,
        k,
        v,
        att,
        proj,
        gate,
        up,
        q_gate,
        attn_gate,
        delta_net: dn_scratch,
        moe: moe_scratch,
    } = scratch;
    let xb = &mut xb[..n * d];
    let mixed = &mut proj[..n * d];
    let mut clock = Clock { obs, layer };

    // ---- token mixer ----
    // xb = rmsnorm(h) · attn_norm
    clock.time(Op::Norm, || {
        xb.copy_from_slice(hidden);
        ops::rms_norm_rows(xb, d, attn_norm, eps, offset);
    });
    // mixed = gated_delta_net(xb) or gated_attention(xb)
    if cfg.is_recurrent(layer) {
        let Some(dcfg) = cfg.delta_net.as_ref() else {
            return Err(ModelError::Kernel {
                layer,
                op: "delta_net",
                what: "the config has no delta-net shape".into(),
            });
        };
        let dw = delta_net_weights(t, layer)?;
        let mut states = Vec::with_capacity(segments.len());
        for seg in segments.iter_mut() {
            match &mut seg.memory {
                LayerMemory::Recurrent(state) => states.push(DeltaNetSegment {
                    tokens: seg.tokens.clone(),
                    state,
                }),
                LayerMemory::Kv(_) => return Err(wrong_memory(layer, "recurrent state")),
            }
        }
        let start = Instant::now();
        delta_net::forward(
            dcfg,
            eps,
            layer,
            &dw,
            xb,
            n,
            &mut states,
            kernels,
            dn_scratch,
            mixed,
        )?;
        clock.obs.record(layer, Op::Attention, start.elapsed());
    } else {
        let aw = GatedAttentionWeights {
            q: require_matrix(t, layer, Role::AttnQ)?,
            k: require_matrix(t, layer, Role::AttnK)?,
            v: require_matrix(t, layer, Role::AttnV)?,
            o: require_matrix(t, layer, Role::AttnO)?,
            q_norm: require_vector(t, layer, Role::AttnQNorm)?,
            k_norm: require_vector(t, layer, Role::AttnKNorm)?,
        };
        let (qd, kvd) = (cfg.q_dim(), cfg.kv_dim());
        let bufs = AttentionBuffers {
            q_gate: grow_slice(q_gate, n * 2 * qd),
            q: &mut q[..n * qd],
            gate: grow_slice(attn_gate, n * qd),
            k: &mut k[..n * kvd],
            v: &mut v[..n * kvd],
            att: &mut att[..n * qd],
        };
        gated_attention(
            cfg, plan, &aw, xb, positions, segments, kernels, bufs, &mut clock, mixed,
        )?;
    }
    // h = h + mixed
    clock.time(Op::Residual, || ops::add(hidden, mixed));

    // ---- feed-forward block ----
    let bufs = FfnBuffers {
        xb,
        gate: &mut gate[..n * ff],
        up: &mut up[..n * ff],
        proj: mixed,
        moe: moe_scratch,
    };
    run_ffn(cfg, layer, &ffn, hidden, bufs, kernels, &mut clock)
}

fn grow_slice(b: &mut Vec<f32>, len: usize) -> &mut [f32] {
    super::decoder::grow(b, len)
}

/// Buffers of the gated attention mixer, sized for the step.
struct AttentionBuffers<'b> {
    q_gate: &'b mut [f32],
    q: &'b mut [f32],
    gate: &'b mut [f32],
    k: &'b mut [f32],
    v: &'b mut [f32],
    att: &'b mut [f32],
}

/// The gated full-attention mixer: writes `out` (`n × n_embd`).
#[allow(clippy::too_many_arguments)]
fn gated_attention(
    cfg: &ModelConfig,
    plan: &LayerPlan,
    w: &GatedAttentionWeights,
    xb: &[f32],
    positions: &[usize],
    segments: &mut [Segment],
    kernels: &dyn Kernels,
    bufs: AttentionBuffers,
    clock: &mut Clock,
    out: &mut [f32],
) -> Result<()> {
    let layer = plan.index;
    let n = positions.len();
    let hd = cfg.head_dim;
    let AttentionBuffers {
        q_gate,
        q,
        gate,
        k,
        v,
        att,
    } = bufs;

    // [q | gate] = xb·W_qᵀ ; k = xb·W_kᵀ ; v = xb·W_vᵀ
    clock.try_time(Op::QkvMatmul, || {
        project(kernels, &w.q, xb, n, q_gate, layer, "attn.q")?;
        project(kernels, &w.k, xb, n, k, layer, "attn.k")?;
        project(kernels, &w.v, xb, n, v, layer, "attn.v")
    })?;
    // split each head's 2·head_dim values into its query and its gate
    for (src, (qh, gh)) in q_gate
        .chunks_exact(2 * hd)
        .zip(q.chunks_exact_mut(hd).zip(gate.chunks_exact_mut(hd)))
    {
        qh.copy_from_slice(&src[..hd]);
        gh.copy_from_slice(&src[hd..]);
    }
    // att = attention(rmsnorm(q), rmsnorm(k), v) over each sequence's cache
    attention_core(
        cfg,
        plan,
        Some((w.q_norm, w.k_norm)),
        None,
        q,
        k,
        v,
        positions,
        segments,
        att,
        clock,
    )?;
    // att = att ⊙ sigmoid(gate)
    for (a, &g) in att.iter_mut().zip(gate.iter()) {
        *a *= sigmoid(g);
    }
    // out = att·W_oᵀ
    clock.try_time(Op::OutMatmul, || {
        project(kernels, &w.o, att, n, out, layer, "attn.o")
    })
}
