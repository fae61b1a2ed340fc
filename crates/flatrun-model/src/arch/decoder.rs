//! The decoder layer shared by every supported family. One function,
//! [`forward_layer`], runs one layer for every token of a step at once (the
//! tokens of several sequences may be stacked; each sequence attends only to
//! its own KV cache through an [`AttentionSegment`]). Family differences are
//! data: optional biases, q/k norms, sandwich norms, the activation, the
//! window and RoPE base of the layer.

use crate::config::{Activation, ModelConfig};
use crate::error::{ModelError, Result};
use flatrun_kernels::ops::{self, AttnConfig, KvSlice, RopeConfig, RopeScaling};
use flatrun_kernels::{Kernels, Weight};
use std::ops::Range;
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

/// The key/value cache of one layer of one sequence.
pub trait LayerKv {
    /// Store the keys and values (`positions.len()` rows of `kv_dim` each)
    /// of new tokens; an error when there is no room.
    fn write(&mut self, positions: &[usize], k: &[f32], v: &[f32]) -> Result<()>;
    /// Cached keys, `n_slots × kv_dim`.
    fn keys(&self) -> KvSlice<'_>;
    /// Cached values, `n_slots × kv_dim`.
    fn values(&self) -> KvSlice<'_>;
    /// Absolute position held by each slot (`usize::MAX` when empty).
    fn slot_positions(&self) -> &[usize];
}

/// The tokens of one sequence inside a step, and that sequence's cache.
pub struct AttentionSegment<'s> {
    /// Rows of the step's token batch that belong to this sequence.
    pub tokens: Range<usize>,
    /// This layer's cache of this sequence.
    pub kv: &'s mut dyn LayerKv,
}

/// The weights of one layer. Matrices are borrowed from storage; the small
/// vectors (norms, biases) are f32 copies the runtime keeps resident.
pub struct LayerWeights<'a> {
    pub attn_norm: &'a [f32],
    pub q: Weight<'a>,
    pub k: Weight<'a>,
    pub v: Weight<'a>,
    pub o: Weight<'a>,
    pub q_bias: Option<&'a [f32]>,
    pub k_bias: Option<&'a [f32]>,
    pub v_bias: Option<&'a [f32]>,
    pub o_bias: Option<&'a [f32]>,
    pub q_norm: Option<&'a [f32]>,
    pub k_norm: Option<&'a [f32]>,
    pub post_attn_norm: Option<&'a [f32]>,
    pub ffn_norm: &'a [f32],
    pub gate: Weight<'a>,
    pub up: Weight<'a>,
    pub down: Weight<'a>,
    pub post_ffn_norm: Option<&'a [f32]>,
}

/// Per-layer constants computed once at load: the RoPE and attention settings.
#[derive(Clone, Debug)]
pub struct LayerPlan {
    pub index: usize,
    pub rope: RopeConfig,
    pub attn: AttnConfig,
}

impl LayerPlan {
    /// The plan of layer `index`; `freq_factors` is the `rope_freqs` tensor.
    pub fn new(cfg: &ModelConfig, index: usize, freq_factors: Option<&[f32]>) -> LayerPlan {
        let windowed = cfg.is_swa(index);
        let layout = cfg.rope_layout;
        // Windowed layers rotate with their own base and no context scaling.
        let (theta_base, scaling) = if windowed {
            (cfg.rope_theta_swa, RopeScaling::None)
        } else {
            (cfg.rope_theta, cfg.rope_scaling)
        };
        LayerPlan {
            index,
            rope: RopeConfig {
                layout,
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
        }
    }
}

/// Activation buffers of a layer step, allocated once and grown only when a
/// step has more tokens than any before it.
#[derive(Debug, Default)]
pub struct DecoderScratch {
    /// Normalized input, `n × n_embd`.
    xb: Vec<f32>,
    /// Queries `n × q_dim`.
    q: Vec<f32>,
    /// New keys and values, `n × kv_dim`.
    k: Vec<f32>,
    v: Vec<f32>,
    /// Attention output, `n × q_dim`.
    att: Vec<f32>,
    /// A projection back to the residual width, `n × n_embd`.
    proj: Vec<f32>,
    /// FFN gate and up, `n × n_ff`.
    gate: Vec<f32>,
    up: Vec<f32>,
}

impl DecoderScratch {
    /// Buffers for steps of up to `max_tokens` tokens.
    pub fn new(cfg: &ModelConfig, max_tokens: usize) -> DecoderScratch {
        let mut s = DecoderScratch::default();
        s.reserve(cfg, max_tokens);
        s
    }

    /// Make room for `n` tokens.
    fn reserve(&mut self, cfg: &ModelConfig, n: usize) {
        let grow = |b: &mut Vec<f32>, len: usize| {
            if b.len() < len {
                b.resize(len, 0.0);
            }
        };
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

/// Run decoder layer `plan.index` on `hidden` (`n × n_embd`, updated in
/// place) for tokens at `positions`. `segments` split the rows by sequence.
#[allow(clippy::too_many_arguments)]
pub fn forward_layer(
    cfg: &ModelConfig,
    plan: &LayerPlan,
    w: &LayerWeights,
    hidden: &mut [f32],
    positions: &[usize],
    segments: &mut [AttentionSegment],
    kernels: &dyn Kernels,
    scratch: &mut DecoderScratch,
    obs: &mut dyn OpObserver,
) -> Result<()> {
    let layer = plan.index;
    let n = positions.len();
    let (d, qd, kvd, ff, hd) = (
        cfg.n_embd,
        cfg.q_dim(),
        cfg.kv_dim(),
        cfg.n_ff,
        cfg.head_dim,
    );
    let (eps, offset) = (cfg.rms_eps, cfg.norm_weight_offset);
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
    scratch.reserve(cfg, n);
    let xb = &mut scratch.xb[..n * d];
    let q = &mut scratch.q[..n * qd];
    let k = &mut scratch.k[..n * kvd];
    let v = &mut scratch.v[..n * kvd];
    let att = &mut scratch.att[..n * qd];
    let proj = &mut scratch.proj[..n * d];
    let gate = &mut scratch.gate[..n * ff];
    let up = &mut scratch.up[..n * ff];
    let mut clock = Clock { obs, layer };

    // ---- attention block ----
    // xb = rmsnorm(h) · attn_norm
    clock.time(Op::Norm, || {
        xb.copy_from_slice(hidden);
        ops::rms_norm_rows(xb, d, w.attn_norm, eps, offset);
    });
    // q = xb·Wqᵀ + bq ; k = xb·Wkᵀ + bk ; v = xb·Wvᵀ + bv
    clock.try_time(Op::QkvMatmul, || {
        matmul(kernels, &w.q, xb, n, q, w.q_bias, layer, "attn.q")?;
        matmul(kernels, &w.k, xb, n, k, w.k_bias, layer, "attn.k")?;
        matmul(kernels, &w.v, xb, n, v, w.v_bias, layer, "attn.v")
    })?;
    // q, k = rmsnorm per head (Qwen3, Gemma 3)
    if let (Some(qn), Some(kn)) = (w.q_norm, w.k_norm) {
        clock.time(Op::Norm, || {
            ops::rms_norm_rows(q, hd, qn, eps, offset);
            ops::rms_norm_rows(k, hd, kn, eps, offset);
        });
    }
    // q, k = rope(q, k, position)
    clock.time(Op::Rope, || {
        ops::rope(q, cfg.n_head, hd, positions, &plan.rope);
        ops::rope(k, cfg.n_kv_head, hd, positions, &plan.rope);
    });
    // cache[pos] = (k, v), per sequence
    clock.try_time(Op::KvWrite, || {
        for seg in segments.iter_mut() {
            let r = seg.tokens.clone();
            seg.kv.write(
                &positions[r.clone()],
                &k[r.start * kvd..r.end * kvd],
                &v[r.start * kvd..r.end * kvd],
            )?;
        }
        Ok(())
    })?;
    // att = softmax(q·kᵀ · scale + causal/window mask) · v, per sequence
    clock.time(Op::Attention, || {
        for seg in segments.iter() {
            let r = seg.tokens.clone();
            ops::attention(
                &q[r.start * qd..r.end * qd],
                &positions[r.clone()],
                seg.kv.keys(),
                seg.kv.values(),
                seg.kv.slot_positions(),
                &plan.attn,
                &mut att[r.start * qd..r.end * qd],
            );
        }
    });
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
    // xb = rmsnorm(h) · ffn_norm
    clock.time(Op::Norm, || {
        xb.copy_from_slice(hidden);
        ops::rms_norm_rows(xb, d, w.ffn_norm, eps, offset);
    });
    // gate = xb·Wgateᵀ ; up = xb·Wupᵀ
    clock.try_time(Op::FfnUpMatmul, || {
        matmul(kernels, &w.gate, xb, n, gate, None, layer, "ffn.gate")?;
        matmul(kernels, &w.up, xb, n, up, None, layer, "ffn.up")
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
    if let Some(pn) = w.post_ffn_norm {
        clock.time(Op::Norm, || ops::rms_norm_rows(proj, d, pn, eps, offset));
    }
    // h = h + proj
    clock.time(Op::Residual, || ops::add(hidden, proj));
    Ok(())
}

/// `out = x·Wᵀ (+ bias)` for `n` tokens, with errors naming the tensor.
#[allow(clippy::too_many_arguments)]
fn matmul(
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
