//! The decoder layer shared by the attention-only families. One function,
//! [`forward_layer`], runs one layer for every token of a step at once (the
//! tokens of several sequences may be stacked; each sequence attends only to
//! its own KV cache through a [`Segment`]). Family differences are data:
//! optional biases, q/k norms, sandwich norms, the activation, the window and
//! RoPE base of the layer. Its two halves, the attention core
//! (`attention_core`) and the FFN block (`ffn_block`), are shared with the
//! layers of other families (Qwen3.5).

use super::delta_net::DeltaNetScratch;
use super::moe::{self, MoeScratch, MoeTensors};
use super::{LayerMemory, LayerTensors, Need, Role, Segment, require_matrix, require_vector};
use crate::config::{Activation, ModelConfig, RopeLayout};
use crate::error::{ModelError, Result};
use flatrun_kernels::ops::{self, AttnConfig, RopeConfig, RopeScaling};
use flatrun_kernels::{Kernels, Weight};
use std::time::{Duration, Instant};

/// The operations a profiler can tell apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Op {
    /// RMS norms (pre, post, q/k).
    Norm,
    /// Q, K, V projections (with biases).
    QkvMatmul,
    /// Rotary position embedding.
    Rope,
    /// Writing K and V into the cache.
    KvWrite,
    /// Softmax attention over the cache.
    Attention,
    /// Attention output projection.
    OutMatmul,
    /// Mixture of experts: the router and the choice of experts.
    Router,
    /// FFN gate and up projections.
    FfnUpMatmul,
    /// Gated activation.
    Activation,
    /// FFN down projection.
    FfnDownMatmul,
    /// Residual additions.
    Residual,
}

impl Op {
    /// Every op, in execution order.
    pub const ALL: &'static [Op] = &[
        Op::Norm,
        Op::QkvMatmul,
        Op::Rope,
        Op::KvWrite,
        Op::Attention,
        Op::OutMatmul,
        Op::Router,
        Op::FfnUpMatmul,
        Op::Activation,
        Op::FfnDownMatmul,
        Op::Residual,
    ];
    /// Short name for profiles.
    pub fn name(self) -> &'static str {
        match self {
            Op::Norm => "norm",
            Op::QkvMatmul => "matmul_qkv",
            Op::Rope => "rope",
            Op::KvWrite => "kv_write",
            Op::Attention => "attention",
            Op::OutMatmul => "matmul_o",
            Op::Router => "router",
            Op::FfnUpMatmul => "matmul_gate_up",
            Op::Activation => "activation",
            Op::FfnDownMatmul => "matmul_down",
            Op::Residual => "residual",
        }
    }
}

/// Receives the duration of every op of a layer (a profiler, or nothing).
pub trait OpObserver {
    fn record(&mut self, layer: usize, op: Op, elapsed: Duration);
}

/// Ignores every measurement.
impl OpObserver for () {
    fn record(&mut self, _: usize, _: Op, _: Duration) {}
}

/// Which optional tensors a decoder-shaped family's layers hold.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DecoderLayout {
    /// `attn.q.bias`, `attn.k.bias`, `attn.v.bias` (Qwen2).
    pub qkv_bias: bool,
    /// `attn.q_norm`, `attn.k_norm` (Qwen3, Gemma 3).
    pub qk_norm: bool,
    /// `post_attn_norm`, `post_ffn_norm` (Gemma 3).
    pub sandwich_norms: bool,
}

/// The FFN matrices of a layer of `cfg` (after its norm), in the order the
/// block multiplies them.
pub fn ffn_roles(cfg: &ModelConfig) -> Vec<(Role, Need)> {
    match &cfg.moe {
        Some(m) => moe::moe_roles(m),
        None => vec![
            (Role::FfnGate, Need::Required),
            (Role::FfnUp, Need::Required),
            (Role::FfnDown, Need::Required),
        ],
    }
}

/// The tensors of a decoder layer of `layout` in a model of `cfg`,
/// matrices in the order the layer multiplies them; `attn.o.bias` is used
/// where a checkpoint has it.
pub fn layer_roles(cfg: &ModelConfig, layout: DecoderLayout) -> Vec<(Role, Need)> {
    use Need::{Optional, Required};
    let mut roles = vec![
        (Role::AttnNorm, Required),
        (Role::AttnQ, Required),
        (Role::AttnK, Required),
        (Role::AttnV, Required),
        (Role::AttnO, Required),
        (Role::FfnNorm, Required),
    ];
    roles.extend(ffn_roles(cfg));
    if layout.qkv_bias {
        roles.extend([
            (Role::AttnQBias, Required),
            (Role::AttnKBias, Required),
            (Role::AttnVBias, Required),
        ]);
    }
    if layout.qk_norm {
        roles.extend([(Role::AttnQNorm, Required), (Role::AttnKNorm, Required)]);
    }
    if layout.sandwich_norms {
        roles.extend([
            (Role::PostAttnNorm, Required),
            (Role::PostFfnNorm, Required),
        ]);
    }
    roles.push((Role::AttnOBias, Optional));
    roles
}

/// The weights of one decoder layer, by what they do. Matrices are borrowed
/// from storage; the small vectors (norms, biases) are f32.
pub struct DecoderTensors<'a> {
    pub attn_norm: &'a [f32],
    pub q: Weight<'a>,
    pub k: Weight<'a>,
    pub v: Weight<'a>,
    pub o: Weight<'a>,
    pub q_bias: Option<&'a [f32]>,
    pub k_bias: Option<&'a [f32]>,
    pub v_bias: Option<&'a [f32]>,
    pub o_bias: Option<&'a [f32]>,
    /// Per-head attention sink logits (gpt-oss).
    pub sinks: Option<&'a [f32]>,
    pub q_norm: Option<&'a [f32]>,
    pub k_norm: Option<&'a [f32]>,
    pub post_attn_norm: Option<&'a [f32]>,
    pub ffn: Ffn<'a>,
}

impl<'a> DecoderTensors<'a> {
    /// Layer `layer`'s tensors by role; an error names a missing one.
    pub fn from_layer(
        cfg: &ModelConfig,
        layer: usize,
        t: &'a dyn LayerTensors,
    ) -> Result<DecoderTensors<'a>> {
        Ok(DecoderTensors {
            attn_norm: require_vector(t, layer, Role::AttnNorm)?,
            q: require_matrix(t, layer, Role::AttnQ)?,
            k: require_matrix(t, layer, Role::AttnK)?,
            v: require_matrix(t, layer, Role::AttnV)?,
            o: require_matrix(t, layer, Role::AttnO)?,
            q_bias: t.vector(Role::AttnQBias),
            k_bias: t.vector(Role::AttnKBias),
            v_bias: t.vector(Role::AttnVBias),
            o_bias: t.vector(Role::AttnOBias),
            sinks: t.vector(Role::AttnSinks),
            q_norm: t.vector(Role::AttnQNorm),
            k_norm: t.vector(Role::AttnKNorm),
            post_attn_norm: t.vector(Role::PostAttnNorm),
            ffn: Ffn::from_layer(cfg, layer, t, Role::FfnNorm)?,
        })
    }
}

/// A layer's FFN: dense, or routed experts. (Built once per layer step on
/// the stack, borrowed views only: its size does not matter.)
#[derive(Clone, Copy, Debug)]
#[allow(clippy::large_enum_variant)]
pub enum Ffn<'a> {
    Dense(FfnTensors<'a>),
    Moe(MoeTensors<'a>),
}

impl<'a> Ffn<'a> {
    /// Layer `layer`'s FFN, behind the norm `norm`: experts when `cfg`
    /// has them; the output norm (`post_ffn_norm`) where the layer has one.
    pub fn from_layer(
        cfg: &ModelConfig,
        layer: usize,
        t: &'a dyn LayerTensors,
        norm: Role,
    ) -> Result<Ffn<'a>> {
        let post_norm = t.vector(Role::PostFfnNorm);
        Ok(match &cfg.moe {
            Some(m) => Ffn::Moe(MoeTensors {
                post_norm,
                ..MoeTensors::from_layer(layer, t, norm, m)?
            }),
            None => Ffn::Dense(FfnTensors {
                norm: require_vector(t, layer, norm)?,
                gate: require_matrix(t, layer, Role::FfnGate)?,
                up: require_matrix(t, layer, Role::FfnUp)?,
                down: require_matrix(t, layer, Role::FfnDown)?,
                post_norm,
            }),
        })
    }
}

/// The weights of a gated FFN block.
#[derive(Clone, Copy, Debug)]
pub struct FfnTensors<'a> {
    /// The RMS norm in front of the block.
    pub norm: &'a [f32],
    pub gate: Weight<'a>,
    pub up: Weight<'a>,
    pub down: Weight<'a>,
    /// The RMS norm of the block's output (Gemma 3).
    pub post_norm: Option<&'a [f32]>,
}

/// Per-layer constants computed once at load: the RoPE and attention settings.
#[derive(Clone, Debug)]
pub struct LayerPlan {
    pub index: usize,
    pub rope: RopeConfig,
    pub attn: AttnConfig,
    /// Gemma 3: the attention scale multiplies the queries in f32 after RoPE
    /// (before ggml rounds them to f16 against the cache), as llama.cpp's graph
    /// does, and `attn.scale` is 1. Elsewhere `None`: the scores are scaled.
    pub q_scale: Option<f32>,
    /// Hugging Face llama checkpoints (SafeTensors, MLX) keep each head's
    /// rotary dims as two halves (NeoX RoPE); llama.cpp's converter permutes
    /// the Q/K rows into adjacent pairs. `true`: q and k are reordered into
    /// pairs after the projection and rotated with the normal layout, so the
    /// cache and every q·k sum run in llama.cpp's order (same maths either way).
    pub qk_halves_to_pairs: bool,
}

impl LayerPlan {
    /// The plan of layer `index`; `freq_factors` is the `rope_freqs` tensor.
    pub fn new(cfg: &ModelConfig, index: usize, freq_factors: Option<&[f32]>) -> LayerPlan {
        let windowed = cfg.is_swa(index);
        // Windowed layers rotate with their own base and no context scaling.
        let (theta_base, scaling) = if windowed {
            (cfg.rope_theta_swa, RopeScaling::None)
        } else {
            (cfg.rope_theta, cfg.rope_scaling)
        };
        LayerPlan {
            index,
            rope: RopeConfig {
                layout: cfg.rope_layout,
                n_rot: cfg.rope_dims,
                theta_base,
                scaling,
                freq_factors: if windowed {
                    None
                } else {
                    freq_factors.map(|f| f.to_vec())
                },
            },
            attn: AttnConfig {
                n_head: cfg.n_head,
                n_kv_head: cfg.n_kv_head,
                head_dim: cfg.head_dim,
                scale: cfg.attn_scale,
                window: cfg.window(index),
                softcap: None,
            },
            q_scale: None,
            qk_halves_to_pairs: false,
        }
    }

    /// The plan with the attention scale applied to the queries in f32
    /// after RoPE instead of to the scores (Gemma 3, as llama.cpp's graph).
    pub fn scaling_queries(mut self) -> LayerPlan {
        self.q_scale = Some(self.attn.scale);
        self.attn.scale = 1.0;
        self
    }

    /// The plan with a NeoX (two halves) checkpoint's q and k reordered into
    /// adjacent pairs and rotated with the normal layout, where the rotated
    /// dims allow it (Hugging Face llama checkpoints).
    pub fn pairing_halves(mut self) -> LayerPlan {
        let n_rot = self.rope.n_rot;
        if self.rope.layout == RopeLayout::Neox
            && n_rot.is_multiple_of(2)
            && n_rot <= self.attn.head_dim.min(MAX_PAIRED_DIMS)
        {
            self.qk_halves_to_pairs = true;
            self.rope.layout = RopeLayout::Normal;
        }
        self
    }
}

/// Activation buffers of a layer step, allocated once and grown only when a
/// step has more tokens than any before it. The decoder's buffers, and those
/// other layers need besides them.
#[derive(Debug, Default)]
pub struct LayerScratch {
    /// Normalized input, `n × n_embd`.
    pub(crate) xb: Vec<f32>,
    /// Queries `n × q_dim`.
    pub(crate) q: Vec<f32>,
    /// New keys and values, `n × kv_dim`.
    pub(crate) k: Vec<f32>,
    pub(crate) v: Vec<f32>,
    /// Attention output, `n × q_dim`.
    pub(crate) att: Vec<f32>,
    /// A projection back to the residual width, `n × n_embd`.
    pub(crate) proj: Vec<f32>,
    /// FFN gate and up, `n × n_ff`.
    pub(crate) gate: Vec<f32>,
    pub(crate) up: Vec<f32>,
    /// Qwen3.5 gated attention: the query projection (queries and gates).
    pub(crate) q_gate: Vec<f32>,
    /// Qwen3.5 gated attention: the output gates, `n × q_dim`.
    pub(crate) attn_gate: Vec<f32>,
    /// Qwen3.5 delta-net layers.
    pub(crate) delta_net: DeltaNetScratch,
    /// Mixture-of-experts layers.
    pub(crate) moe: MoeScratch,
}

impl LayerScratch {
    /// Buffers for steps of up to `max_tokens` tokens.
    pub fn new(cfg: &ModelConfig, max_tokens: usize) -> LayerScratch {
        let mut s = LayerScratch::default();
        s.reserve(cfg, max_tokens);
        s
    }

    /// Make room for `n` tokens in the decoder's buffers.
    pub(crate) fn reserve(&mut self, cfg: &ModelConfig, n: usize) {
        grow(&mut self.xb, n * cfg.n_embd);
        grow(&mut self.q, n * cfg.q_dim());
        grow(&mut self.k, n * cfg.kv_dim());
        grow(&mut self.v, n * cfg.kv_dim());
        grow(&mut self.att, n * cfg.q_dim());
        grow(&mut self.proj, n * cfg.n_embd);
        grow(&mut self.gate, n * cfg.n_ff);
        grow(&mut self.up, n * cfg.n_ff);
    }
}

/// Grow `b` to at least `len` values and return its first `len`.
pub(crate) fn grow(b: &mut Vec<f32>, len: usize) -> &mut [f32] {
    if b.len() < len {
        b.resize(len, 0.0);
    }
    &mut b[..len]
}

/// The error of a layer handed the wrong kind of memory for a sequence.
pub(crate) fn wrong_memory(layer: usize, want: &str) -> ModelError {
    ModelError::Kernel {
        layer,
        op: "memory",
        what: format!("layer {layer} needs a {want} for every sequence"),
    }
}

/// Check that `hidden` holds `n` rows of the residual width.
pub(crate) fn check_hidden(
    cfg: &ModelConfig,
    layer: usize,
    hidden: &[f32],
    n: usize,
) -> Result<()> {
    let d = cfg.n_embd;
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
    Ok(())
}

/// Run decoder layer `plan.index` on `hidden` (`n × n_embd`, updated in
/// place) for tokens at `positions`. `segments` split the rows by sequence.
#[allow(clippy::too_many_arguments)]
pub fn forward_layer(
    cfg: &ModelConfig,
    plan: &LayerPlan,
    w: &DecoderTensors,
    hidden: &mut [f32],
    positions: &[usize],
    segments: &mut [Segment],
    kernels: &dyn Kernels,
    scratch: &mut LayerScratch,
    obs: &mut dyn OpObserver,
) -> Result<()> {
    let layer = plan.index;
    let n = positions.len();
    let (d, qd, kvd, ff) = (cfg.n_embd, cfg.q_dim(), cfg.kv_dim(), cfg.n_ff);
    let (eps, offset) = (cfg.rms_eps, cfg.norm_weight_offset);
    check_hidden(cfg, layer, hidden, n)?;
    scratch.reserve(cfg, n);
    let xb = &mut scratch.xb[..n * d];
    let q = &mut scratch.q[..n * qd];
    let k = &mut scratch.k[..n * kvd];
    let v = &mut scratch.v[..n * kvd];
    let att = &mut scratch.att[..n * qd];
    let proj = &mut scratch.proj[..n * d];
    let gate = &mut scratch.gate[..n * ff];
    let up = &mut scratch.up[..n * ff];
    let moe_scratch = &mut scratch.moe;
    let mut clock = Clock { obs, layer };

    // ---- attention block ----
    // xb = rmsnorm(h) · attn_norm
    clock.time(Op::Norm, || {
        xb.copy_from_slice(hidden);
        ops::rms_norm_rows(xb, d, w.attn_norm, eps, offset);
    });
    // q = xb·Wqᵀ + bq ; k = xb·Wkᵀ + bk ; v = xb·Wvᵀ + bv
    // (one pool job for the three: the threads meet once)
    clock.try_time(Op::QkvMatmul, || {
        let mut outs = [&mut *q, &mut *k, &mut *v];
        matmul_many(
            kernels,
            &[&w.q, &w.k, &w.v],
            xb,
            n,
            &mut outs,
            layer,
            "attn.qkv",
        )?;
        add_bias(q, w.q_bias, w.q.rows, layer, "attn.q")?;
        add_bias(k, w.k_bias, w.k.rows, layer, "attn.k")?;
        add_bias(v, w.v_bias, w.v.rows, layer, "attn.v")
    })?;
    // att = attention(q, k, v) over each sequence's cache
    let qk_norms = w.q_norm.zip(w.k_norm);
    attention_core(
        cfg, plan, qk_norms, w.sinks, q, k, v, positions, segments, att, &mut clock,
    )?;
    // proj = att·Woᵀ (+ bo)
    clock.try_time(Op::OutMatmul, || {
        matmul(kernels, &w.o, att, n, proj, w.o_bias, layer, "attn.o")
    })?;
    // proj = rmsnorm(proj) · post_attn_norm (Gemma 3)
    if let Some(pn) = w.post_attn_norm {
        clock.time(Op::Norm, || ops::rms_norm_rows(proj, d, pn, eps, offset));
    }
    // h = h + proj
    clock.time(Op::Residual, || ops::add(hidden, proj));

    // ---- feed-forward block ----
    let bufs = FfnBuffers {
        xb,
        gate,
        up,
        proj,
        moe: moe_scratch,
    };
    run_ffn(cfg, layer, &w.ffn, hidden, bufs, kernels, &mut clock)
}

/// The scratch an FFN block writes: `xb`, `proj` (`n × n_embd`), `gate`,
/// `up` (`n × n_ff`) and the MoE block's own buffers.
pub(crate) struct FfnBuffers<'b> {
    pub xb: &'b mut [f32],
    pub gate: &'b mut [f32],
    pub up: &'b mut [f32],
    pub proj: &'b mut [f32],
    pub moe: &'b mut MoeScratch,
}

/// The FFN block of a layer, dense or routed, with its residual.
pub(crate) fn run_ffn(
    cfg: &ModelConfig,
    layer: usize,
    ffn: &Ffn,
    hidden: &mut [f32],
    b: FfnBuffers,
    kernels: &dyn Kernels,
    clock: &mut Clock,
) -> Result<()> {
    match (ffn, &cfg.moe) {
        (Ffn::Dense(w), _) => ffn_block(
            cfg, layer, w, hidden, b.xb, b.gate, b.up, b.proj, kernels, clock,
        ),
        (Ffn::Moe(w), Some(m)) => moe::moe_block(
            cfg, m, layer, w, hidden, b.xb, b.proj, b.moe, kernels, clock,
        ),
        (Ffn::Moe(_), None) => Err(ModelError::Kernel {
            layer,
            op: "ffn.experts",
            what: "the layer has experts but the config has none".into(),
        }),
    }
}

/// The attention core of a layer, after the projections: q/k RMS norms per
/// head (when the layer has them), RoPE, the cache write and softmax
/// attention per sequence. `q` (`n × q_dim`) and `k`, `v` (`n × kv_dim`) hold
/// the projections; `att` (`n × q_dim`) receives the attention output.
#[allow(clippy::too_many_arguments)]
pub(crate) fn attention_core(
    cfg: &ModelConfig,
    plan: &LayerPlan,
    qk_norms: Option<(&[f32], &[f32])>,
    sinks: Option<&[f32]>,
    q: &mut [f32],
    k: &mut [f32],
    v: &mut [f32],
    positions: &[usize],
    segments: &mut [Segment],
    att: &mut [f32],
    clock: &mut Clock,
) -> Result<()> {
    let layer = plan.index;
    let (qd, kvd, hd) = (cfg.q_dim(), cfg.kv_dim(), cfg.head_dim);
    let (eps, offset) = (cfg.rms_eps, cfg.norm_weight_offset);
    // q, k = rmsnorm per head (Qwen3, Gemma 3, Qwen3.5), or over each
    // token's whole q and k (OLMoE): the norm's length says which
    if let Some((qn, kn)) = qk_norms {
        let width = |norm: &[f32], full: usize| if norm.len() == full { full } else { hd };
        let (qw, kw) = (width(qn, qd), width(kn, kvd));
        if qn.len() != qw || kn.len() != kw {
            return Err(ModelError::Kernel {
                layer,
                op: "attn.qk_norm",
                what: format!(
                    "q/k norms of {} and {} values for heads of {hd} (q {qd}, k {kvd})",
                    qn.len(),
                    kn.len()
                ),
            });
        }
        clock.time(Op::Norm, || {
            ops::rms_norm_rows(q, qw, qn, eps, offset);
            ops::rms_norm_rows(k, kw, kn, eps, offset);
        });
    }
    if let Some(s) = sinks.filter(|s| s.len() != cfg.n_head) {
        return Err(ModelError::Kernel {
            layer,
            op: "attn.sinks",
            what: format!("{} sinks for {} heads", s.len(), cfg.n_head),
        });
    }
    // q, k = rope(q, k, position)
    clock.time(Op::Rope, || {
        // (Hugging Face llama layout: halves → adjacent pairs first)
        if plan.qk_halves_to_pairs {
            halves_to_pairs(q, hd, plan.rope.n_rot);
            halves_to_pairs(k, hd, plan.rope.n_rot);
        }
        ops::rope(q, cfg.n_head, hd, positions, &plan.rope);
        ops::rope(k, cfg.n_kv_head, hd, positions, &plan.rope);
        // q = q · scale (Gemma 3 scales the queries, not the scores)
        if let Some(s) = plan.q_scale {
            ops::scale(q, s);
        }
    });
    // cache[pos] = (k, v), per sequence; a quantized cache holds rotated
    // rows: q, k = H·q, H·k and v = H·v (queries rotated with their keys)
    clock.try_time(Op::KvWrite, || {
        for seg in segments.iter_mut() {
            let r = seg.tokens.clone();
            let LayerMemory::Kv(kv) = &mut seg.memory else {
                return Err(wrong_memory(layer, "KV cache"));
            };
            let rot = kv.rotation();
            if let Some(n) = rot.keys {
                ops::hadamard(&mut q[r.start * qd..r.end * qd], n);
                ops::hadamard(&mut k[r.start * kvd..r.end * kvd], n);
            }
            if let Some(n) = rot.values {
                ops::hadamard(&mut v[r.start * kvd..r.end * kvd], n);
            }
            kv.write(
                &positions[r.clone()],
                &k[r.start * kvd..r.end * kvd],
                &v[r.start * kvd..r.end * kvd],
            )?;
        }
        Ok(())
    })?;
    // att = softmax(q·kᵀ · scale + causal/window mask [+ sink]) · v, per sequence
    clock.time(Op::Attention, || {
        for seg in segments.iter() {
            let r = seg.tokens.clone();
            if let LayerMemory::Kv(kv) = &seg.memory {
                let (q, pos) = (&q[r.start * qd..r.end * qd], &positions[r.clone()]);
                let (keys, values, slots) = (kv.keys(), kv.values(), kv.slot_positions());
                let out = &mut att[r.start * qd..r.end * qd];
                match kv.pager() {
                    Some(pager) => ops::attention_paged(
                        q, pos, keys, values, slots, &plan.attn, sinks, pager, out,
                    ),
                    None => ops::attention_with_sinks(
                        q, pos, keys, values, slots, &plan.attn, sinks, out,
                    ),
                }
                // att = H·att (undoes the rotation of the values)
                if let Some(n) = kv.rotation().values {
                    ops::hadamard(&mut att[r.start * qd..r.end * qd], n);
                }
            }
        }
    });
    Ok(())
}

/// The gated FFN block with its residual:
/// `h += post_norm(down(act(gate(x)) ⊙ up(x)))`, `x = rmsnorm(h) · norm`.
/// `xb` (`n × n_embd`), `gate`, `up` (`n × n_ff`) and `proj` (`n × n_embd`)
/// are scratch.
#[allow(clippy::too_many_arguments)]
pub(crate) fn ffn_block(
    cfg: &ModelConfig,
    layer: usize,
    w: &FfnTensors,
    hidden: &mut [f32],
    xb: &mut [f32],
    gate: &mut [f32],
    up: &mut [f32],
    proj: &mut [f32],
    kernels: &dyn Kernels,
    clock: &mut Clock,
) -> Result<()> {
    let n = xb.len() / cfg.n_embd.max(1);
    let (d, eps, offset) = (cfg.n_embd, cfg.rms_eps, cfg.norm_weight_offset);
    // xb = rmsnorm(h) · ffn_norm
    clock.time(Op::Norm, || {
        xb.copy_from_slice(hidden);
        ops::rms_norm_rows(xb, d, w.norm, eps, offset);
    });
    // gate = xb·Wgateᵀ ; up = xb·Wupᵀ
    // (one pool job for the two)
    clock.try_time(Op::FfnUpMatmul, || {
        let mut outs = [&mut *gate, &mut *up];
        matmul_many(
            kernels,
            &[&w.gate, &w.up],
            xb,
            n,
            &mut outs,
            layer,
            "ffn.gate_up",
        )
    })?;
    // gate = act(gate) ⊙ up
    clock.time(Op::Activation, || match cfg.activation {
        Activation::Silu => ops::swiglu(gate, up),
        Activation::GeluTanh => ops::geglu(gate, up),
    });
    // proj = gate·Wdownᵀ
    clock.try_time(Op::FfnDownMatmul, || {
        matmul(kernels, &w.down, gate, n, proj, None, layer, "ffn.down")
    })?;
    // proj = rmsnorm(proj) · post_ffn_norm (Gemma 3)
    if let Some(pn) = w.post_norm {
        clock.time(Op::Norm, || ops::rms_norm_rows(proj, d, pn, eps, offset));
    }
    // h = h + proj
    clock.time(Op::Residual, || ops::add(hidden, proj));
    Ok(())
}

/// `out = x·Wᵀ (+ bias)` for `n` tokens, with errors naming the tensor.
#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul(
    kernels: &dyn Kernels,
    w: &Weight,
    x: &[f32],
    n: usize,
    out: &mut [f32],
    bias: Option<&[f32]>,
    layer: usize,
    op: &'static str,
) -> Result<()> {
    kernels
        .matmul(w, x, n, out)
        .map_err(|e| ModelError::Kernel {
            layer,
            op,
            what: e.to_string(),
        })?;
    if let Some(b) = bias {
        if b.len() != w.rows {
            return Err(ModelError::Kernel {
                layer,
                op,
                what: format!("bias has {} values for {} rows", b.len(), w.rows),
            });
        }
        for row in out.chunks_exact_mut(w.rows) {
            ops::add(row, b);
        }
    }
    Ok(())
}

/// `outs[i] = x·ws[i]ᵀ` for matrices sharing their input, with errors naming the op.
#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul_many(
    kernels: &dyn Kernels,
    ws: &[&Weight],
    x: &[f32],
    n: usize,
    outs: &mut [&mut [f32]],
    layer: usize,
    op: &'static str,
) -> Result<()> {
    kernels
        .matmul_many(ws, x, n, outs)
        .map_err(|e| ModelError::Kernel {
            layer,
            op,
            what: e.to_string(),
        })
}

/// `out[t] += bias` for every token row of a `rows`-wide output.
fn add_bias(
    out: &mut [f32],
    bias: Option<&[f32]>,
    rows: usize,
    layer: usize,
    op: &'static str,
) -> Result<()> {
    let Some(b) = bias else {
        return Ok(());
    };
    if b.len() != rows {
        return Err(ModelError::Kernel {
            layer,
            op,
            what: format!("bias has {} values for {rows} rows", b.len()),
        });
    }
    for row in out.chunks_exact_mut(rows) {
        ops::add(row, b);
    }
    Ok(())
}

/// Times closures and reports them to the observer (shared by every architecture's layer).
pub(crate) struct Clock<'o> {
    pub(crate) obs: &'o mut dyn OpObserver,
    pub(crate) layer: usize,
}

impl Clock<'_> {
    pub(crate) fn time<R>(&mut self, op: Op, f: impl FnOnce() -> R) -> R {
        let start = Instant::now();
        let r = f();
        self.obs.record(self.layer, op, start.elapsed());
        r
    }
    pub(crate) fn try_time(&mut self, op: Op, f: impl FnOnce() -> Result<()>) -> Result<()> {
        self.time(op, f)
    }
}

/// The most rotary dims per head [`halves_to_pairs`] reorders (a stack buffer).
const MAX_PAIRED_DIMS: usize = 512;

/// Reorder the first `n_rot` dims of every `hd`-wide head of `x` from two
/// halves `[a0 … a(r/2-1), b0 … b(r/2-1)]` to pairs `[a0, b0, a1, b1, …]`: the
/// row permutation llama.cpp's converter applies to llama Q/K weights.
fn halves_to_pairs(x: &mut [f32], hd: usize, n_rot: usize) {
    let half = n_rot / 2;
    let mut buf = [0f32; MAX_PAIRED_DIMS];
    for head in x.chunks_exact_mut(hd) {
        buf[..n_rot].copy_from_slice(&head[..n_rot]);
        for i in 0..half {
            head[2 * i] = buf[i];
            head[2 * i + 1] = buf[half + i];
        }
    }
}

#[cfg(test)]
mod halves_to_pairs_tests {
    use super::halves_to_pairs;

    #[test]
    fn interleaves_each_head_and_keeps_the_unrotated_tail() {
        // two heads of 6 dims, 4 rotated
        let mut x = [0., 1., 2., 3., 4., 5., 10., 11., 12., 13., 14., 15.];
        halves_to_pairs(&mut x, 6, 4);
        assert_eq!(x, [0., 2., 1., 3., 4., 5., 10., 12., 11., 13., 14., 15.]);
    }
}
