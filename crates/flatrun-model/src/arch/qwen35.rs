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

use super::decoder::{Clock, LayerKv, LayerPlan, Op, OpObserver};
use super::delta_net::{
    self, project, DeltaNetConfig, DeltaNetScratch, DeltaNetSegment, DeltaNetState, DeltaNetWeights,
};
use crate::config::{Arch, GgufKeys, HfKeys, ModelConfig, RopeLayout};
use crate::error::{ModelError, Result};
use flatrun_kernels::{ops, Kernels, Weight};
use std::ops::Range;
use std::time::Instant;

/// Full-attention layer interval when the checkpoint does not say.
pub const DEFAULT_FULL_ATTENTION_INTERVAL: usize = 4;

/// Per-layer tensor roles of a delta-net layer.
pub const DELTA_NET_ROLES: &[&str] = &[
    "attn_norm",
    "attn.qkv",
    "attn.gate",
    "ssm.conv1d",
    "ssm.dt.bias",
    "ssm.a",
    "ssm.alpha",
    "ssm.beta",
    "ssm.norm",
    "ssm.out",
    "post_attn_norm",
    "ffn.gate",
    "ffn.up",
    "ffn.down",
];

/// Per-layer tensor roles of a gated full-attention layer.
pub const ATTENTION_ROLES: &[&str] = &[
    "attn_norm",
    "attn.q",
    "attn.k",
    "attn.v",
    "attn.o",
    "attn.q_norm",
    "attn.k_norm",
    "post_attn_norm",
    "ffn.gate",
    "ffn.up",
    "ffn.down",
];

/// The tensor roles of layer `il`.
pub fn layer_roles(cfg: &ModelConfig, il: usize) -> &'static [&'static str] {
    if cfg.is_recurrent(il) {
        DELTA_NET_ROLES
    } else {
        ATTENTION_ROLES
    }
}

/// Qwen3.5 hyperparameters from GGUF metadata.
pub fn config_from_gguf(keys: &GgufKeys) -> Result<ModelConfig> {
    let mut cfg = super::common_from_gguf(Arch::Qwen35, keys)?;
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
        supported: Arch::SUPPORTED.to_vec(),
    })
}

/// The weights of a gated full-attention layer's mixer.
#[derive(Clone, Copy, Debug)]
pub struct GatedAttentionWeights<'a> {
    /// `attn_q`: `2 · n_head · head_dim × n_embd` (query and gate per head).
    pub q: Weight<'a>,
    pub k: Weight<'a>,
    pub v: Weight<'a>,
    pub o: Weight<'a>,
    pub q_norm: &'a [f32],
    pub k_norm: &'a [f32],
}

/// The token mixer of a layer.
#[derive(Clone, Copy, Debug)]
pub enum Mixer<'a> {
    Attention(GatedAttentionWeights<'a>),
    DeltaNet(DeltaNetWeights<'a>),
}

/// The weights of one Qwen3.5 layer.
#[derive(Clone, Copy, Debug)]
pub struct Qwen35LayerWeights<'a> {
    pub attn_norm: &'a [f32],
    pub mixer: Mixer<'a>,
    /// `post_attention_norm`: the norm in front of the FFN.
    pub ffn_norm: &'a [f32],
    pub gate: Weight<'a>,
    pub up: Weight<'a>,
    pub down: Weight<'a>,
}

/// What a layer keeps per sequence: a KV cache (attention layers) or a
/// recurrent state (delta-net layers).
pub enum LayerMemory<'s> {
    Kv(&'s mut dyn LayerKv),
    Recurrent(&'s mut DeltaNetState),
}

/// The tokens of one sequence inside a step, and that sequence's memory of
/// this layer.
pub struct HybridSegment<'s> {
    /// Rows of the step's token batch that belong to this sequence.
    pub tokens: Range<usize>,
    pub memory: LayerMemory<'s>,
}

/// Activation buffers of a Qwen3.5 layer step, grown on demand.
#[derive(Debug, Default)]
pub struct Qwen35Scratch {
    xb: Vec<f32>,
    mixed: Vec<f32>,
    q_gate: Vec<f32>,
    q: Vec<f32>,
    gate: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    att: Vec<f32>,
    ffn_gate: Vec<f32>,
    ffn_up: Vec<f32>,
    delta_net: DeltaNetScratch,
}

fn grow(b: &mut Vec<f32>, len: usize) -> &mut [f32] {
    if b.len() < len {
        b.resize(len, 0.0);
    }
    &mut b[..len]
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

fn wrong_memory(layer: usize, want: &str) -> ModelError {
    ModelError::Kernel {
        layer,
        op: "memory",
        what: format!("layer {layer} needs a {want} for every sequence"),
    }
}

/// Run Qwen3.5 layer `plan.index` on `hidden` (`n × n_embd`, updated in
/// place) for tokens at `positions`; `segments` split the rows by sequence.
#[allow(clippy::too_many_arguments)]
pub fn forward_layer(
    cfg: &ModelConfig,
    plan: &LayerPlan,
    w: &Qwen35LayerWeights,
    hidden: &mut [f32],
    positions: &[usize],
    segments: &mut [HybridSegment],
    kernels: &dyn Kernels,
    scratch: &mut Qwen35Scratch,
    obs: &mut dyn OpObserver,
) -> Result<()> {
    let layer = plan.index;
    let n = positions.len();
    let (d, eps) = (cfg.n_embd, cfg.rms_eps);
    if hidden.len() != n * d {
        return Err(ModelError::Kernel {
            layer,
            op: "input",
            what: format!(
                "hidden has {} values for {n} tokens of width {d}",
                hidden.len()
            ),
        });
    }
    let mut clock = Clock { obs, layer };

    // ---- token mixer ----
    // xb = rmsnorm(h) · attn_norm
    let xb = grow(&mut scratch.xb, n * d);
    clock.time(Op::Norm, || {
        xb.copy_from_slice(hidden);
        ops::rms_norm_rows(xb, d, w.attn_norm, eps, 0.0);
    });
    // mixed = gated_attention(xb) or gated_delta_net(xb)
    let mixed = grow(&mut scratch.mixed, n * d);
    match &w.mixer {
        Mixer::Attention(aw) => {
            let bufs = AttentionBuffers {
                q_gate: &mut scratch.q_gate,
                q: &mut scratch.q,
                gate: &mut scratch.gate,
                k: &mut scratch.k,
                v: &mut scratch.v,
                att: &mut scratch.att,
            };
            gated_attention(
                cfg, plan, aw, xb, positions, segments, kernels, bufs, &mut clock, mixed,
            )?
        }
        Mixer::DeltaNet(dw) => {
            let Some(dcfg) = cfg.delta_net.as_ref() else {
                return Err(ModelError::Kernel {
                    layer,
                    op: "delta_net",
                    what: "the config has no delta-net shape".into(),
                });
            };
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
                dw,
                xb,
                n,
                &mut states,
                kernels,
                &mut scratch.delta_net,
                mixed,
            )?;
            clock.obs.record(layer, Op::Attention, start.elapsed());
        }
    }
    // h = h + mixed
    clock.time(Op::Residual, || ops::add(hidden, mixed));

    // ---- feed-forward block ----
    // xb = rmsnorm(h) · post_attention_norm
    clock.time(Op::Norm, || {
        xb.copy_from_slice(hidden);
        ops::rms_norm_rows(xb, d, w.ffn_norm, eps, 0.0);
    });
    // gate = xb·Wgateᵀ ; up = xb·Wupᵀ
    let gate = grow(&mut scratch.ffn_gate, n * cfg.n_ff);
    let up = grow(&mut scratch.ffn_up, n * cfg.n_ff);
    clock.try_time(Op::FfnUpMatmul, || {
        project(kernels, &w.gate, xb, n, gate, layer, "ffn.gate")?;
        project(kernels, &w.up, xb, n, up, layer, "ffn.up")
    })?;
    // gate = silu(gate) ⊙ up
    clock.time(Op::Activation, || ops::swiglu(gate, up));
    // mixed = gate·Wdownᵀ
    clock.try_time(Op::FfnDownMatmul, || {
        project(kernels, &w.down, gate, n, mixed, layer, "ffn.down")
    })?;
    // h = h + mixed
    clock.time(Op::Residual, || ops::add(hidden, mixed));
    Ok(())
}

/// Buffers of the gated attention mixer.
struct AttentionBuffers<'b> {
    q_gate: &'b mut Vec<f32>,
    q: &'b mut Vec<f32>,
    gate: &'b mut Vec<f32>,
    k: &'b mut Vec<f32>,
    v: &'b mut Vec<f32>,
    att: &'b mut Vec<f32>,
}

/// The gated full-attention mixer: writes `out` (`n × n_embd`).
#[allow(clippy::too_many_arguments)]
fn gated_attention(
    cfg: &ModelConfig,
    plan: &LayerPlan,
    w: &GatedAttentionWeights,
    xb: &[f32],
    positions: &[usize],
    segments: &mut [HybridSegment],
    kernels: &dyn Kernels,
    bufs: AttentionBuffers,
    clock: &mut Clock,
    out: &mut [f32],
) -> Result<()> {
    let layer = plan.index;
    let n = positions.len();
    let (hd, qd, kvd, eps) = (cfg.head_dim, cfg.q_dim(), cfg.kv_dim(), cfg.rms_eps);
    let q_gate = grow(bufs.q_gate, n * 2 * qd);
    let q = grow(bufs.q, n * qd);
    let gate = grow(bufs.gate, n * qd);
    let k = grow(bufs.k, n * kvd);
    let v = grow(bufs.v, n * kvd);
    let att = grow(bufs.att, n * qd);

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
    // q, k = rmsnorm per head
    clock.time(Op::Norm, || {
        ops::rms_norm_rows(q, hd, w.q_norm, eps, 0.0);
        ops::rms_norm_rows(k, hd, w.k_norm, eps, 0.0);
    });
    // q, k = rope(q, k, position)
    clock.time(Op::Rope, || {
        ops::rope(q, cfg.n_head, hd, positions, &plan.rope);
        ops::rope(k, cfg.n_kv_head, hd, positions, &plan.rope);
    });
    // cache[pos] = (k, v), per sequence
    clock.try_time(Op::KvWrite, || {
        for seg in segments.iter_mut() {
            let r = seg.tokens.clone();
            let LayerMemory::Kv(kv) = &mut seg.memory else {
                return Err(wrong_memory(layer, "KV cache"));
            };
            kv.write(
                &positions[r.clone()],
                &k[r.start * kvd..r.end * kvd],
                &v[r.start * kvd..r.end * kvd],
            )?;
        }
        Ok(())
    })?;
    // att = softmax(q·kᵀ · scale + causal mask) · v, per sequence
    clock.time(Op::Attention, || {
        for seg in segments.iter() {
            let r = seg.tokens.clone();
            if let LayerMemory::Kv(kv) = &seg.memory {
                ops::attention(
                    &q[r.start * qd..r.end * qd],
                    &positions[r.clone()],
                    kv.keys(),
                    kv.values(),
                    kv.slot_positions(),
                    &plan.attn,
                    &mut att[r.start * qd..r.end * qd],
                );
            }
        }
    });
    // att = att ⊙ sigmoid(gate)
    for (a, &g) in att.iter_mut().zip(gate.iter()) {
        *a *= sigmoid(g);
    }
    // out = att·W_oᵀ
    clock.try_time(Op::OutMatmul, || {
        project(kernels, &w.o, att, n, out, layer, "attn.o")
    })
}
