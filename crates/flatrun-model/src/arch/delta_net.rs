//! The gated delta net: the linear-attention token mixer of Qwen3.5's
//! recurrent layers, and the per-sequence state it carries between steps.
//!
//! For each token, with `H_k` key heads and `H_v` value heads (value head `h`
//! reads key head `h mod H_k`, llama.cpp's tiled order):
//!
//! ```text
//! [q k v] = silu(causal_conv1d(x·W_qkvᵀ))           short depthwise conv over time
//! q, k    = l2norm(q), l2norm(k)                    per head
//! g       = softplus(x·W_alphaᵀ + dt_bias) · a      per value head (a = −exp(A_log) < 0)
//! β       = sigmoid(x·W_betaᵀ)                      per value head
//! S       = exp(g) · S                              decay the state (S: S_v × S_k per head)
//! S       = S + β (v − S k) kᵀ                      delta rule: write v at key k
//! o       = S q / sqrt(S_k)
//! y       = (rmsnorm(o) · norm_w) ⊙ silu(x·W_zᵀ)   gated norm, per head
//! out     = y·W_outᵀ
//! ```
//!
//! The state of a sequence is the last `d_conv − 1` conv inputs and one
//! `S_v × S_k` matrix per value head ([`DeltaNetState`]); it is small and
//! independent of the sequence length.

use crate::error::{ModelError, Result};
use flatrun_kernels::{Kernels, Weight, ops};

/// Shape of the gated delta-net layers of a hybrid model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeltaNetConfig {
    /// Width of the causal conv1d kernel (`ssm.conv_kernel`).
    pub d_conv: usize,
    /// Dimension of one key (and query) head (`ssm.state_size`).
    pub head_k_dim: usize,
    /// Dimension of one value head (`ssm.inner_size / ssm.time_step_rank`).
    pub head_v_dim: usize,
    /// Key (and query) heads (`ssm.group_count`).
    pub n_k_heads: usize,
    /// Value heads (`ssm.time_step_rank`); a multiple of `n_k_heads`.
    pub n_v_heads: usize,
    /// Per layer: whether it is a delta-net layer (else full attention).
    pub recurrent_layers: Vec<bool>,
}

impl DeltaNetConfig {
    /// Width of all query (or key) heads together.
    pub fn key_dim(&self) -> usize {
        self.n_k_heads * self.head_k_dim
    }
    /// Width of all value heads together.
    pub fn value_dim(&self) -> usize {
        self.n_v_heads * self.head_v_dim
    }
    /// Channels of the conv1d: queries, keys and values.
    pub fn conv_channels(&self) -> usize {
        2 * self.key_dim() + self.value_dim()
    }
    /// Values of the conv state: the last `d_conv − 1` inputs of every channel.
    pub fn conv_state_len(&self) -> usize {
        self.d_conv.saturating_sub(1) * self.conv_channels()
    }
    /// Values of the recurrent state: one `S_v × S_k` matrix per value head.
    pub fn ssm_state_len(&self) -> usize {
        self.n_v_heads * self.head_v_dim * self.head_k_dim
    }
    /// Check the head counts divide as the delta rule needs.
    pub fn validate(&self, arch: &str) -> Result<()> {
        let bad = |key: &str, what: String| ModelError::BadValue {
            key: format!("{arch}.{key}"),
            what,
        };
        if self.d_conv == 0 {
            return Err(bad("ssm.conv_kernel", "must be at least 1".into()));
        }
        if self.n_k_heads == 0
            || self.n_v_heads == 0
            || !self.n_v_heads.is_multiple_of(self.n_k_heads)
        {
            return Err(bad(
                "ssm.time_step_rank",
                format!(
                    "{} value heads are not a multiple of {} key heads",
                    self.n_v_heads, self.n_k_heads
                ),
            ));
        }
        if self.head_k_dim == 0 || self.head_v_dim == 0 {
            return Err(bad(
                "ssm.state_size",
                "head dimensions must be positive".into(),
            ));
        }
        Ok(())
    }
}

/// The recurrent state of one delta-net layer of one sequence.
#[derive(Clone, Debug, PartialEq)]
pub struct DeltaNetState {
    /// The last `d_conv − 1` conv inputs, oldest first, `conv_channels` each.
    pub conv: Vec<f32>,
    /// Per value head the matrix `S` (`S_v` rows of `S_k`): row `j` maps a
    /// key to value component `j`.
    pub ssm: Vec<f32>,
}

impl DeltaNetState {
    /// An all-zero state (the state before the first token).
    pub fn new(cfg: &DeltaNetConfig) -> DeltaNetState {
        DeltaNetState {
            conv: vec![0.0; cfg.conv_state_len()],
            ssm: vec![0.0; cfg.ssm_state_len()],
        }
    }
    /// Back to the state before the first token.
    pub fn reset(&mut self) {
        self.conv.fill(0.0);
        self.ssm.fill(0.0);
    }
    /// Bytes held.
    pub fn bytes(&self) -> usize {
        (self.conv.len() + self.ssm.len()) * std::mem::size_of::<f32>()
    }
}

/// The weights of one delta-net layer. Matrices are borrowed from storage;
/// the small vectors are resident f32 copies.
#[derive(Clone, Copy, Debug)]
pub struct DeltaNetWeights<'a> {
    /// `attn_qkv`: `conv_channels × n_embd`.
    pub qkv: Weight<'a>,
    /// `attn_gate` (z): `value_dim × n_embd`.
    pub z: Weight<'a>,
    /// `ssm_alpha`: `n_v_heads × n_embd`.
    pub alpha: Weight<'a>,
    /// `ssm_beta`: `n_v_heads × n_embd`.
    pub beta: Weight<'a>,
    /// `ssm_out`: `n_embd × value_dim`.
    pub out: Weight<'a>,
    /// `ssm_conv1d`: `conv_channels × d_conv`, row-major.
    pub conv1d: &'a [f32],
    /// `ssm_dt.bias`: `n_v_heads`.
    pub dt_bias: &'a [f32],
    /// `ssm_a` (= −exp(A_log)): `n_v_heads`.
    pub a: &'a [f32],
    /// `ssm_norm`: `head_v_dim`.
    pub norm: &'a [f32],
}

/// Activation buffers of the delta-net mixer, grown on demand.
#[derive(Debug, Default)]
pub struct DeltaNetScratch {
    qkv: Vec<f32>,
    conv_out: Vec<f32>,
    z: Vec<f32>,
    alpha: Vec<f32>,
    beta: Vec<f32>,
    core: Vec<f32>,
    window: Vec<f32>,
    delta: Vec<f32>,
}

fn grow(b: &mut Vec<f32>, len: usize) -> &mut [f32] {
    if b.len() < len {
        b.resize(len, 0.0);
    }
    &mut b[..len]
}

/// `softplus(x) = ln(1 + eˣ)`, linear past 20 like ggml.
fn softplus(x: f32) -> f32 {
    if x > 20.0 { x } else { x.exp().ln_1p() }
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// `x /= sqrt(Σx² + eps)` (ggml's `rms_norm(x, eps/n) / sqrt(n)`).
fn l2_normalize(x: &mut [f32], eps: f32) {
    let sum_sq: f64 = x.iter().map(|&v| v as f64 * v as f64).sum();
    let inv = 1.0 / ((sum_sq as f32) + eps).sqrt();
    x.iter_mut().for_each(|v| *v *= inv);
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(&x, &y)| x * y).sum()
}

/// `out = x·Wᵀ` for `n` tokens, with errors naming the tensor.
pub(crate) fn project(
    kernels: &dyn Kernels,
    w: &Weight,
    x: &[f32],
    n: usize,
    out: &mut [f32],
    layer: usize,
    op: &'static str,
) -> Result<()> {
    kernels
        .matmul(w, x, n, out)
        .map_err(|e| ModelError::Kernel {
            layer,
            op,
            what: e.to_string(),
        })
}

/// One sequence's tokens inside a step and its state of this layer.
pub struct DeltaNetSegment<'s> {
    /// Rows of the step's token batch that belong to this sequence.
    pub tokens: std::ops::Range<usize>,
    pub state: &'s mut DeltaNetState,
}

/// Run the gated delta-net mixer of layer `layer` on the normed input `xb`
/// (`n × n_embd`), writing `out` (`n × n_embd`) and advancing each
/// sequence's state over its tokens in order.
#[allow(clippy::too_many_arguments)]
pub fn forward(
    cfg: &DeltaNetConfig,
    rms_eps: f32,
    layer: usize,
    w: &DeltaNetWeights,
    xb: &[f32],
    n: usize,
    segments: &mut [DeltaNetSegment],
    kernels: &dyn Kernels,
    scratch: &mut DeltaNetScratch,
    out: &mut [f32],
) -> Result<()> {
    let (channels, key_dim, value_dim) = (cfg.conv_channels(), cfg.key_dim(), cfg.value_dim());
    let (h_k, h_v, s_k, s_v) = (cfg.n_k_heads, cfg.n_v_heads, cfg.head_k_dim, cfg.head_v_dim);
    let taps = cfg.d_conv;
    let check = |what: &str, got: usize, want: usize| -> Result<()> {
        if got == want {
            Ok(())
        } else {
            Err(ModelError::Kernel {
                layer,
                op: "delta_net",
                what: format!("{what} has {got} values, expected {want}"),
            })
        }
    };
    check("ssm_conv1d", w.conv1d.len(), channels * taps)?;
    check("ssm_dt.bias", w.dt_bias.len(), h_v)?;
    check("ssm_a", w.a.len(), h_v)?;
    check("ssm_norm", w.norm.len(), s_v)?;

    let qkv = grow(&mut scratch.qkv, n * channels);
    let conv_out = grow(&mut scratch.conv_out, n * channels);
    let z = grow(&mut scratch.z, n * value_dim);
    let alpha = grow(&mut scratch.alpha, n * h_v);
    let beta = grow(&mut scratch.beta, n * h_v);
    let core = grow(&mut scratch.core, n * value_dim);
    let delta = grow(&mut scratch.delta, s_v);

    // qkv = xb·W_qkvᵀ ; z = xb·W_zᵀ ; α = xb·W_alphaᵀ ; β = xb·W_betaᵀ
    project(kernels, &w.qkv, xb, n, qkv, layer, "attn.qkv")?;
    project(kernels, &w.z, xb, n, z, layer, "attn.gate")?;
    project(kernels, &w.alpha, xb, n, alpha, layer, "ssm.alpha")?;
    project(kernels, &w.beta, xb, n, beta, layer, "ssm.beta")?;

    // g = softplus(α + dt_bias) · a ; β = sigmoid(β)   (per token, per value head)
    for t in 0..n {
        for h in 0..h_v {
            let i = t * h_v + h;
            alpha[i] = softplus(alpha[i] + w.dt_bias[h]) * w.a[h];
            beta[i] = sigmoid(beta[i]);
        }
    }
    let gate_log = &*alpha;

    let scale = 1.0 / (s_k as f32).sqrt();
    for seg in segments.iter_mut() {
        let state = &mut *seg.state;
        check("conv state", state.conv.len(), cfg.conv_state_len())?;
        check("recurrent state", state.ssm.len(), cfg.ssm_state_len())?;
        // window = [conv state (d_conv − 1 rows) ; this sequence's qkv rows]
        let rows = seg.tokens.clone();
        let history = taps.saturating_sub(1);
        let window = grow(&mut scratch.window, (history + rows.len()) * channels);
        window[..history * channels].copy_from_slice(&state.conv);
        window[history * channels..]
            .copy_from_slice(&qkv[rows.start * channels..rows.end * channels]);

        for (i, t) in rows.clone().enumerate() {
            // conv_out[t][c] = silu(Σ_tap window[i + tap][c] · w[c][tap])
            let row = &mut conv_out[t * channels..(t + 1) * channels];
            for (c, o) in row.iter_mut().enumerate() {
                let kernel = &w.conv1d[c * taps..(c + 1) * taps];
                let mut sum = 0.0f32;
                for (tap, &k) in kernel.iter().enumerate() {
                    sum += window[(i + tap) * channels + c] * k;
                }
                *o = silu(sum);
            }
            // q, k = l2norm per key head
            let (qs, rest) = row.split_at_mut(key_dim);
            let (ks, vs) = rest.split_at_mut(key_dim);
            for head in qs.chunks_exact_mut(s_k) {
                l2_normalize(head, rms_eps);
            }
            for head in ks.chunks_exact_mut(s_k) {
                l2_normalize(head, rms_eps);
            }
            // Per value head: decay, delta-rule write, read.
            for h in 0..h_v {
                let kh = h % h_k;
                let q = &qs[kh * s_k..(kh + 1) * s_k];
                let k = &ks[kh * s_k..(kh + 1) * s_k];
                let v = &vs[h * s_v..(h + 1) * s_v];
                let s = &mut state.ssm[h * s_v * s_k..(h + 1) * s_v * s_k];
                let b = beta[t * h_v + h];
                // S = exp(g) · S
                let decay = gate_log[t * h_v + h].exp();
                s.iter_mut().for_each(|x| *x *= decay);
                // δ = β (v − S k)
                for (j, d) in delta.iter_mut().enumerate() {
                    *d = (v[j] - dot(&s[j * s_k..(j + 1) * s_k], k)) * b;
                }
                // S = S + δ kᵀ
                for (j, &d) in delta.iter().enumerate() {
                    for (x, &kk) in s[j * s_k..(j + 1) * s_k].iter_mut().zip(k) {
                        *x += d * kk;
                    }
                }
                // o = S q / sqrt(S_k)
                let o = &mut core[t * value_dim + h * s_v..t * value_dim + (h + 1) * s_v];
                for (j, oj) in o.iter_mut().enumerate() {
                    *oj = dot(&s[j * s_k..(j + 1) * s_k], q) * scale;
                }
            }
        }
        // conv state = the last d_conv − 1 rows of the window
        let len = window.len();
        state
            .conv
            .copy_from_slice(&window[len - history * channels..]);
    }

    // y = rmsnorm(o) · norm_w ⊙ silu(z), per value head
    ops::rms_norm_rows(core, s_v, w.norm, rms_eps, 0.0);
    for (y, &g) in core.iter_mut().zip(z.iter()) {
        *y *= silu(g);
    }
    // out = y·W_outᵀ
    project(kernels, &w.out, core, n, out, layer, "ssm.out")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn l2_normalize_gives_unit_length() {
        let mut x = [3.0f32, 4.0];
        l2_normalize(&mut x, 0.0);
        assert!((x[0] - 0.6).abs() < 1e-6 && (x[1] - 0.8).abs() < 1e-6);
    }

    #[test]
    fn softplus_matches_definition() {
        assert!((softplus(0.0) - std::f32::consts::LN_2).abs() < 1e-6);
        assert_eq!(softplus(30.0), 30.0);
    }
}
