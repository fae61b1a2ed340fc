//! The mixture-of-experts FFN block, shared by every MoE family. A layer's
//! experts come in three projections (`ffn.{gate,up,down}_exps`), each
//! [`Experts`]: stacked in one matrix of `n_expert × rows` rows (GGUF), expert
//! `e` being the row range `e*rows..(e+1)*rows`, or one matrix per expert
//! (Hugging Face, `ffn.gate_exps.{e}`). Either way one expert is one byte
//! range of the checkpoint, so the kernels, the weight engine and a streamed
//! read see one expert as one more row range.
//!
//! ```text
//! x       = rmsnorm(h) · norm
//! logits  = x·W_routerᵀ (+ b)                       n_expert per token
//! probs   = softmax(logits)                         (Gating::Softmax)
//! top     = the n_expert_used largest, in descending order
//! w       = probs[top]                              (Gating::SoftmaxSelected: softmax(logits[top]))
//! w       = w / Σw                                  (normalize)       · scale
//! y       = Σ_k w_k · down_k(act(gate_k(x)) ⊙ up_k(x))   over the selected experts only
//! y      += sigmoid(x·g_shared) · down_s(act(gate_s(x)) ⊙ up_s(x))   (shared expert)
//! h      += y
//! ```
//!
//! The family's rules are data ([`MoeRules`] → [`MoeConfig`]): how the
//! router's scores become weights, whether they are renormalized, a shared
//! expert and its gate, the expert activation. Decode (one token) runs the
//! selected experts' gate and up projections as one pool job and their down
//! projections as another; a step of several tokens groups its tokens by
//! expert, so each expert's weights are decoded once per step through the
//! token-tiled kernels ([`Routing::groups`]).

use super::decoder::{Clock, Op, grow, matmul, matmul_many};
use super::{LayerTensors, Role, require_experts, require_matrix, require_vector};
use crate::config::{GgufKeys, HfKeys, ModelConfig};
use crate::error::{ModelError, Result};
use flatrun_kernels::{Kernels, Weight, ops};

/// How the router's scores become the selected experts' weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gating {
    /// Softmax over every expert's logit, then the top-k probabilities
    /// (Qwen2/3-MoE, OLMoE, Mixtral, Qwen3.5-MoE).
    Softmax,
    /// Top-k by logit, then a softmax over the selected logits only
    /// (llama.cpp's `SOFTMAX_WEIGHT`, gpt-oss).
    SoftmaxSelected,
    /// A sigmoid per expert (DeepSeek-V3-style routers).
    Sigmoid,
}

/// The gated activation inside each expert.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ExpertActivation {
    /// `silu(gate) ⊙ up`.
    Silu,
    /// gpt-oss: `g = min(gate, limit)`, `u = clamp(up, −limit, limit)`,
    /// `g · sigmoid(alpha·g) · (u + 1)`.
    SwigluClamped { alpha: f32, limit: f32 },
}

/// A family's MoE rules (what its llama.cpp graph hard-codes).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MoeRules {
    pub gating: Gating,
    /// Divide the selected weights by their sum.
    pub normalize: bool,
    /// The layers have a shared expert (`ffn.*_shexp`).
    pub shared_expert: bool,
    /// The shared expert's output is scaled by `sigmoid(x·ffn.gate_inp_shexp)`.
    pub shared_gate: bool,
    pub activation: ExpertActivation,
}

impl MoeRules {
    /// Softmax router, top-k, no renormalization, no shared expert.
    pub const SOFTMAX: MoeRules = MoeRules {
        gating: Gating::Softmax,
        normalize: false,
        shared_expert: false,
        shared_gate: false,
        activation: ExpertActivation::Silu,
    };
}

/// The shared expert of a layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SharedExpertConfig {
    /// Hidden width of the shared expert.
    pub n_ff: usize,
    /// Gated by `sigmoid(x·ffn.gate_inp_shexp)`.
    pub gated: bool,
}

/// A model's mixture-of-experts settings.
#[derive(Clone, Debug, PartialEq)]
pub struct MoeConfig {
    /// Experts per layer.
    pub n_expert: usize,
    /// Experts each token uses (top-k).
    pub n_expert_used: usize,
    /// Hidden width of one expert.
    pub n_ff_expert: usize,
    pub gating: Gating,
    pub normalize: bool,
    /// Multiplies the final weights (1: none).
    pub weights_scale: f32,
    pub shared: Option<SharedExpertConfig>,
    pub activation: ExpertActivation,
}

impl MoeConfig {
    /// The MoE settings of a GGUF (`{arch}.expert_count` and friends) under
    /// the family's `rules`; `None` when the model has no experts.
    /// `n_ff` is the dense FFN width, the experts' width where the file
    /// gives none.
    pub fn from_gguf(keys: &GgufKeys, rules: MoeRules, n_ff: usize) -> Result<Option<MoeConfig>> {
        let n_expert = keys.u64("expert_count").unwrap_or(0) as usize;
        if n_expert == 0 {
            return Ok(None);
        }
        let n_expert_used = keys.u64("expert_used_count").unwrap_or(0) as usize;
        if n_expert_used == 0 || n_expert_used > n_expert {
            return Err(ModelError::BadValue {
                key: format!("{}.expert_used_count", keys.arch),
                what: format!("{n_expert_used} experts used of {n_expert}"),
            });
        }
        let n_ff_expert = keys
            .u64("expert_feed_forward_length")
            .map_or(n_ff, |v| v as usize);
        let shared = rules.shared_expert.then(|| SharedExpertConfig {
            n_ff: keys
                .u64("expert_shared_feed_forward_length")
                .map_or(n_ff_expert, |v| v as usize),
            gated: rules.shared_gate,
        });
        let scale = keys.f32("expert_weights_scale").unwrap_or(0.0);
        Ok(Some(MoeConfig {
            n_expert,
            n_expert_used,
            n_ff_expert,
            gating: rules.gating,
            normalize: rules.normalize,
            weights_scale: if scale == 0.0 { 1.0 } else { scale },
            shared,
            activation: rules.activation,
        }))
    }
}

impl MoeConfig {
    /// The MoE settings of a Hugging Face `config.json` under the family's
    /// `rules`: `num_experts` (Mixtral: `num_local_experts`),
    /// `num_experts_per_tok`, `moe_intermediate_size` (else `n_ff`),
    /// `shared_expert_intermediate_size`, and `norm_topk_prob` in place of the
    /// rules' renormalization when present. Every layer must be a MoE layer:
    /// a `decoder_sparse_step` above 1 or a non-empty `mlp_only_layers` (dense
    /// layers among them) is refused.
    pub fn from_hf(keys: &HfKeys, rules: MoeRules, n_ff: usize) -> Result<MoeConfig> {
        let n_expert = keys
            .u64("num_experts")
            .or_else(|| keys.u64("num_local_experts"))
            .ok_or_else(|| ModelError::MissingKey {
                arch: keys.arch.to_string(),
                key: "num_experts".into(),
            })? as usize;
        let n_expert_used = keys.require_usize("num_experts_per_tok")?;
        if n_expert == 0 || n_expert_used == 0 || n_expert_used > n_expert {
            return Err(ModelError::BadValue {
                key: "num_experts_per_tok".into(),
                what: format!("{n_expert_used} experts used of {n_expert}"),
            });
        }
        let step = keys.u64("decoder_sparse_step").unwrap_or(1);
        let dense = keys
            .get("mlp_only_layers")
            .and_then(|v| v.as_array())
            .is_some_and(|a| !a.is_empty());
        if step != 1 || dense {
            return Err(ModelError::BadValue {
                key: if dense {
                    "mlp_only_layers"
                } else {
                    "decoder_sparse_step"
                }
                .into(),
                what: "dense FFN layers among the expert layers are not supported".into(),
            });
        }
        let n_ff_expert = keys
            .u64("moe_intermediate_size")
            .map_or(n_ff, |v| v as usize);
        let shared = rules.shared_expert.then(|| SharedExpertConfig {
            n_ff: keys
                .u64("shared_expert_intermediate_size")
                .map_or(n_ff_expert, |v| v as usize),
            gated: rules.shared_gate,
        });
        Ok(MoeConfig {
            n_expert,
            n_expert_used,
            n_ff_expert,
            gating: rules.gating,
            normalize: keys.bool("norm_topk_prob").unwrap_or(rules.normalize),
            weights_scale: 1.0,
            shared,
            activation: rules.activation,
        })
    }

    /// The shape `[rows, cols]` of one expert of a stacked expert role:
    /// gate and up `[n_ff_expert, n_embd]`, down `[n_embd, n_ff_expert]`.
    pub fn expert_shape(&self, n_embd: usize, role: Role) -> Option<[usize; 2]> {
        match role {
            Role::FfnGateExps | Role::FfnUpExps => Some([self.n_ff_expert, n_embd]),
            Role::FfnDownExps => Some([n_embd, self.n_ff_expert]),
            _ => None,
        }
    }
}

/// The roles of a MoE FFN (after its norm), matrices in the order the block
/// multiplies them; the biases are used where a checkpoint has them.
pub fn moe_roles(moe: &MoeConfig) -> Vec<(Role, super::Need)> {
    use super::Need::{Optional, Required};
    let mut roles = vec![
        (Role::FfnGateInp, Required),
        (Role::FfnGateExps, Required),
        (Role::FfnUpExps, Required),
        (Role::FfnDownExps, Required),
        (Role::FfnGateInpBias, Optional),
        (Role::FfnGateExpsBias, Optional),
        (Role::FfnUpExpsBias, Optional),
        (Role::FfnDownExpsBias, Optional),
    ];
    if let Some(shared) = moe.shared {
        roles.extend([
            (Role::FfnGateShexp, Required),
            (Role::FfnUpShexp, Required),
            (Role::FfnDownShexp, Required),
        ]);
        if shared.gated {
            roles.push((Role::FfnGateInpShexp, Required));
        }
    }
    roles
}

/// Expert `e` of a stacked expert matrix whose experts have `rows` rows.
pub fn expert<'a>(w: &Weight<'a>, e: usize, rows: usize) -> Result<Weight<'a>> {
    w.row_range(e * rows..(e + 1) * rows)
        .map_err(|err| ModelError::Kernel {
            layer: usize::MAX,
            op: "ffn.experts",
            what: format!("expert {e}: {err}"),
        })
}

/// One projection of a layer's routed experts, as the checkpoint stores it.
#[derive(Clone, Copy, Debug)]
pub enum Experts<'a> {
    /// One matrix of `n_expert × rows` rows (GGUF's `ffn_*_exps`): expert `e`
    /// is rows `e*rows..(e+1)*rows`.
    Stacked(Weight<'a>),
    /// One matrix of `rows` rows per expert, in expert order (Hugging Face).
    Split(&'a [Weight<'a>]),
}

impl<'a> Experts<'a> {
    /// Expert `e`, whose matrix has `rows` rows.
    pub fn expert(&self, e: usize, rows: usize) -> Result<Weight<'a>> {
        match self {
            Experts::Stacked(w) => expert(w, e, rows),
            Experts::Split(ws) => ws.get(e).copied().ok_or_else(|| ModelError::Kernel {
                layer: usize::MAX,
                op: "ffn.experts",
                what: format!("expert {e} of {}", ws.len()),
            }),
        }
    }

    /// Whether these are `n` experts of `rows × cols` each; what is wrong
    /// otherwise.
    fn check(&self, n: usize, rows: usize, cols: usize) -> std::result::Result<(), String> {
        match self {
            Experts::Stacked(w) if w.rows != n * rows || w.cols != cols => Err(format!(
                "is {}×{}, expected {}×{cols} ({n} experts of {rows} rows)",
                w.rows,
                w.cols,
                n * rows
            )),
            Experts::Split(ws) if ws.len() != n => {
                Err(format!("has {} experts, expected {n}", ws.len()))
            }
            Experts::Split(ws) => match ws.iter().position(|w| w.rows != rows || w.cols != cols) {
                Some(e) => Err(format!(
                    "expert {e} is {}×{}, expected {rows}×{cols}",
                    ws[e].rows, ws[e].cols
                )),
                None => Ok(()),
            },
            Experts::Stacked(_) => Ok(()),
        }
    }
}

/// The shared expert's weights.
#[derive(Clone, Copy, Debug)]
pub struct SharedExpertTensors<'a> {
    pub gate: Weight<'a>,
    pub up: Weight<'a>,
    pub down: Weight<'a>,
    /// The sigmoid gate's weights (`n_embd`).
    pub gate_inp: Option<&'a [f32]>,
}

/// The weights of a MoE FFN block.
#[derive(Clone, Copy, Debug)]
pub struct MoeTensors<'a> {
    /// The RMS norm in front of the block.
    pub norm: &'a [f32],
    /// `n_expert × n_embd`.
    pub router: Weight<'a>,
    pub router_bias: Option<&'a [f32]>,
    /// The experts: gate and up `n_ff_expert × n_embd` each, down
    /// `n_embd × n_ff_expert`.
    pub gate: Experts<'a>,
    pub up: Experts<'a>,
    pub down: Experts<'a>,
    /// Per-expert biases, `n_expert × rows` (gpt-oss).
    pub gate_bias: Option<&'a [f32]>,
    pub up_bias: Option<&'a [f32]>,
    pub down_bias: Option<&'a [f32]>,
    pub shared: Option<SharedExpertTensors<'a>>,
    /// The RMS norm of the block's output, where a family has one.
    pub post_norm: Option<&'a [f32]>,
}

impl<'a> MoeTensors<'a> {
    /// Layer `layer`'s MoE weights, its pre-FFN norm being `norm`.
    pub fn from_layer(
        layer: usize,
        t: &'a dyn LayerTensors,
        norm: Role,
        moe: &MoeConfig,
    ) -> Result<MoeTensors<'a>> {
        let shared = match moe.shared {
            Some(s) => Some(SharedExpertTensors {
                gate: require_matrix(t, layer, Role::FfnGateShexp)?,
                up: require_matrix(t, layer, Role::FfnUpShexp)?,
                down: require_matrix(t, layer, Role::FfnDownShexp)?,
                gate_inp: if s.gated {
                    Some(require_vector(t, layer, Role::FfnGateInpShexp)?)
                } else {
                    None
                },
            }),
            None => None,
        };
        Ok(MoeTensors {
            norm: require_vector(t, layer, norm)?,
            router: require_matrix(t, layer, Role::FfnGateInp)?,
            router_bias: t.vector(Role::FfnGateInpBias),
            gate: require_experts(t, layer, Role::FfnGateExps)?,
            up: require_experts(t, layer, Role::FfnUpExps)?,
            down: require_experts(t, layer, Role::FfnDownExps)?,
            gate_bias: t.vector(Role::FfnGateExpsBias),
            up_bias: t.vector(Role::FfnUpExpsBias),
            down_bias: t.vector(Role::FfnDownExpsBias),
            shared,
            post_norm: None,
        })
    }

    /// Check every shape against `cfg` (a wrong file is an error, not a panic).
    fn check(&self, cfg: &ModelConfig, moe: &MoeConfig, layer: usize) -> Result<()> {
        let (d, e, ff) = (cfg.n_embd, moe.n_expert, moe.n_ff_expert);
        let bad = |what: String| ModelError::Kernel {
            layer,
            op: "ffn.experts",
            what,
        };
        let shape = |w: &Weight, name: &str, rows: usize, cols: usize| {
            if w.rows != rows || w.cols != cols {
                return Err(bad(format!(
                    "{name} is {}×{}, expected {rows}×{cols}",
                    w.rows, w.cols
                )));
            }
            Ok(())
        };
        shape(&self.router, "ffn.gate_inp", e, d)?;
        for (experts, name, rows, cols) in [
            (&self.gate, "ffn.gate_exps", ff, d),
            (&self.up, "ffn.up_exps", ff, d),
            (&self.down, "ffn.down_exps", d, ff),
        ] {
            experts
                .check(e, rows, cols)
                .map_err(|what| bad(format!("{name} {what}")))?;
        }
        let len = |v: Option<&[f32]>, name: &str, want: usize| match v {
            Some(v) if v.len() != want => Err(bad(format!(
                "{name} has {} values, expected {want}",
                v.len()
            ))),
            _ => Ok(()),
        };
        len(self.router_bias, "ffn.gate_inp.bias", e)?;
        len(self.gate_bias, "ffn.gate_exps.bias", e * ff)?;
        len(self.up_bias, "ffn.up_exps.bias", e * ff)?;
        len(self.down_bias, "ffn.down_exps.bias", e * d)?;
        len(Some(self.norm), "ffn norm", d)?;
        if let (Some(s), Some(sc)) = (&self.shared, moe.shared) {
            shape(&s.gate, "ffn.gate_shexp", sc.n_ff, d)?;
            shape(&s.up, "ffn.up_shexp", sc.n_ff, d)?;
            shape(&s.down, "ffn.down_shexp", d, sc.n_ff)?;
            len(s.gate_inp, "ffn.gate_inp_shexp", d)?;
        }
        Ok(())
    }
}

/// The experts each token of a step chose and their weights, `k` per token
/// in descending order of the router's score (llama.cpp's order).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Routing {
    k: usize,
    experts: Vec<u32>,
    weights: Vec<f32>,
    /// Per expert: the (token, slot) pairs routed to it (see [`Routing::groups`]).
    groups: Vec<Vec<(u32, u32)>>,
}

impl Routing {
    /// Experts per token.
    pub fn k(&self) -> usize {
        self.k
    }
    /// Number of tokens routed.
    pub fn n_tokens(&self) -> usize {
        self.experts.len().checked_div(self.k).unwrap_or(0)
    }
    /// The experts token `t` chose and their weights.
    pub fn token(&self, t: usize) -> (&[u32], &[f32]) {
        let r = t * self.k..(t + 1) * self.k;
        (&self.experts[r.clone()], &self.weights[r])
    }
    /// Every expert chosen by some token of the step, ascending: the experts
    /// a step reads, each once.
    pub fn union(&self) -> Vec<u32> {
        (0..self.groups.len() as u32)
            .filter(|&e| !self.groups[e as usize].is_empty())
            .collect()
    }
    /// The (token, slot) pairs routed to expert `e`, tokens ascending.
    pub fn groups(&self, e: usize) -> &[(u32, u32)] {
        self.groups.get(e).map_or(&[], |g| g.as_slice())
    }

    /// Route `n` tokens whose router logits are `logits` (`n × n_expert`,
    /// overwritten), with the router bias already added.
    pub fn route(&mut self, moe: &MoeConfig, logits: &mut [f32], n: usize) {
        let (ne, k) = (moe.n_expert, moe.n_expert_used);
        self.k = k;
        self.experts.clear();
        self.weights.clear();
        self.groups.resize_with(ne, Vec::new);
        self.groups.iter_mut().for_each(Vec::clear);
        let mut order: Vec<u32> = Vec::with_capacity(ne);
        for (t, row) in logits.chunks_exact_mut(ne).take(n).enumerate() {
            match moe.gating {
                Gating::Softmax => ops::softmax(row),
                Gating::Sigmoid => row.iter_mut().for_each(|x| *x = sigmoid(*x)),
                Gating::SoftmaxSelected => {}
            }
            // Top k, descending; ties keep the lower expert first.
            order.clear();
            order.extend(0..ne as u32);
            order.sort_by(|&a, &b| row[b as usize].total_cmp(&row[a as usize]).then(a.cmp(&b)));
            let start = self.weights.len();
            for (slot, &e) in order[..k].iter().enumerate() {
                self.experts.push(e);
                self.weights.push(row[e as usize]);
                self.groups[e as usize].push((t as u32, slot as u32));
            }
            let w = &mut self.weights[start..];
            if moe.gating == Gating::SoftmaxSelected {
                ops::softmax(w);
            }
            if moe.normalize {
                // As llama.cpp: the sum clamped to f16's smallest normal.
                let sum = w.iter().sum::<f32>().max(6.103_515_6e-5);
                w.iter_mut().for_each(|x| *x /= sum);
            }
            if moe.weights_scale != 1.0 {
                w.iter_mut().for_each(|x| *x *= moe.weights_scale);
            }
        }
    }
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// Buffers of the MoE block, allocated once and grown with the step.
#[derive(Debug, Default)]
pub struct MoeScratch {
    /// Router logits, `n × n_expert`.
    logits: Vec<f32>,
    /// The step's routing.
    pub routing: Routing,
    /// Rows of the normalized input gathered for one expert, `m × n_embd`.
    xg: Vec<f32>,
    /// Gate and up of the selected experts (`rows × n_ff_expert`).
    gate: Vec<f32>,
    up: Vec<f32>,
    /// Down outputs of one expert, `m × n_embd`.
    yg: Vec<f32>,
    /// Every (token, slot) expert output, `n × k × n_embd`.
    ys: Vec<f32>,
    /// The shared expert's hidden values and output.
    sh_gate: Vec<f32>,
    sh_up: Vec<f32>,
    sh_out: Vec<f32>,
}

/// `h += moe(rmsnorm(h) · norm)` for the `n` tokens of `hidden`; `xb`
/// (`n × n_embd`) and `proj` (`n × n_embd`) are scratch.
#[allow(clippy::too_many_arguments)]
pub(crate) fn moe_block(
    cfg: &ModelConfig,
    moe: &MoeConfig,
    layer: usize,
    w: &MoeTensors,
    hidden: &mut [f32],
    xb: &mut [f32],
    proj: &mut [f32],
    s: &mut MoeScratch,
    kernels: &dyn Kernels,
    clock: &mut Clock,
) -> Result<()> {
    let d = cfg.n_embd;
    let n = xb.len() / d.max(1);
    let (ne, k, ff) = (moe.n_expert, moe.n_expert_used, moe.n_ff_expert);
    let (eps, offset) = (cfg.rms_eps, cfg.norm_weight_offset);
    w.check(cfg, moe, layer)?;
    let err = |what: String| ModelError::Kernel {
        layer,
        op: "ffn.experts",
        what,
    };

    // xb = rmsnorm(h) · ffn_norm
    clock.time(Op::Norm, || {
        xb.copy_from_slice(hidden);
        ops::rms_norm_rows(xb, d, w.norm, eps, offset);
    });
    // logits = xb·W_routerᵀ (+ b) ; route
    let logits = grow(&mut s.logits, n * ne);
    clock.try_time(Op::Router, || {
        matmul(
            kernels,
            &w.router,
            xb,
            n,
            logits,
            w.router_bias,
            layer,
            "ffn.gate_inp",
        )?;
        s.routing.route(moe, logits, n);
        Ok(())
    })?;
    // (a streaming backend starts reading the chosen experts now)
    kernels.routed(hidden, &s.routing.union());

    let ys = grow(&mut s.ys, n * k * d);
    if n == 1 {
        // Decode: the k experts' gate and up as one pool job, then their
        // downs as another.
        let (sel, _) = s.routing.token(0);
        let sel: Vec<usize> = sel.iter().map(|&e| e as usize).collect();
        let gates = sel
            .iter()
            .map(|&e| w.gate.expert(e, ff))
            .collect::<Result<Vec<_>>>()?;
        let ups = sel
            .iter()
            .map(|&e| w.up.expert(e, ff))
            .collect::<Result<Vec<_>>>()?;
        let downs = sel
            .iter()
            .map(|&e| w.down.expert(e, d))
            .collect::<Result<Vec<_>>>()?;
        let gate = grow(&mut s.gate, k * ff);
        let up = grow(&mut s.up, k * ff);
        clock.try_time(Op::FfnUpMatmul, || {
            let ws: Vec<&Weight> = gates.iter().chain(ups.iter()).collect();
            let mut outs: Vec<&mut [f32]> = gate
                .chunks_exact_mut(ff)
                .chain(up.chunks_exact_mut(ff))
                .collect();
            matmul_many(kernels, &ws, xb, 1, &mut outs, layer, "ffn.gate_up_exps")
        })?;
        for (j, &e) in sel.iter().enumerate() {
            let r = j * ff..(j + 1) * ff;
            add_expert_bias(&mut gate[r.clone()], w.gate_bias, e, ff);
            add_expert_bias(&mut up[r], w.up_bias, e, ff);
        }
        clock.time(Op::Activation, || activate(moe.activation, gate, up));
        clock.try_time(Op::FfnDownMatmul, || {
            let ws: Vec<&Weight> = downs.iter().collect();
            let mut outs: Vec<&mut [f32]> = ys.chunks_exact_mut(d).collect();
            // Each down has its own input: one row of `gate` per expert.
            for (j, (w, out)) in ws.iter().zip(outs.iter_mut()).enumerate() {
                matmul(
                    kernels,
                    w,
                    &gate[j * ff..(j + 1) * ff],
                    1,
                    out,
                    None,
                    layer,
                    "ffn.down_exps",
                )?;
            }
            Ok(())
        })?;
        for (j, &e) in sel.iter().enumerate() {
            add_expert_bias(&mut ys[j * d..(j + 1) * d], w.down_bias, e, d);
        }
    } else {
        // Prefill: each expert once, over the tokens routed to it.
        for e in s.routing.union() {
            let e = e as usize;
            let group = s.routing.groups(e);
            let m = group.len();
            let xg = grow(&mut s.xg, m * d);
            for (i, &(t, _)) in group.iter().enumerate() {
                let t = t as usize;
                xg[i * d..(i + 1) * d].copy_from_slice(&xb[t * d..(t + 1) * d]);
            }
            let (ge, ue, de) = (
                w.gate.expert(e, ff)?,
                w.up.expert(e, ff)?,
                w.down.expert(e, d)?,
            );
            let gate = grow(&mut s.gate, m * ff);
            let up = grow(&mut s.up, m * ff);
            clock.try_time(Op::FfnUpMatmul, || {
                let mut outs = [&mut *gate, &mut *up];
                matmul_many(
                    kernels,
                    &[&ge, &ue],
                    xg,
                    m,
                    &mut outs,
                    layer,
                    "ffn.gate_up_exps",
                )
            })?;
            for i in 0..m {
                let r = i * ff..(i + 1) * ff;
                add_expert_bias(&mut gate[r.clone()], w.gate_bias, e, ff);
                add_expert_bias(&mut up[r], w.up_bias, e, ff);
            }
            clock.time(Op::Activation, || activate(moe.activation, gate, up));
            let yg = grow(&mut s.yg, m * d);
            clock.try_time(Op::FfnDownMatmul, || {
                matmul(kernels, &de, gate, m, yg, None, layer, "ffn.down_exps")
            })?;
            for (i, &(t, slot)) in group.iter().enumerate() {
                let at = (t as usize * k + slot as usize) * d;
                let y = &mut ys[at..at + d];
                y.copy_from_slice(&yg[i * d..(i + 1) * d]);
                add_expert_bias(y, w.down_bias, e, d);
            }
        }
    }

    // proj[t] = Σ_slot w · ys[t, slot], in slot order (as llama.cpp sums)
    clock.time(Op::Residual, || {
        for t in 0..n {
            let (_, weights) = s.routing.token(t);
            let out = &mut proj[t * d..(t + 1) * d];
            for (j, &wt) in weights.iter().enumerate() {
                let y = &ys[(t * k + j) * d..(t * k + j + 1) * d];
                if j == 0 {
                    out.iter_mut().zip(y).for_each(|(o, &v)| *o = v * wt);
                } else {
                    out.iter_mut().zip(y).for_each(|(o, &v)| *o += v * wt);
                }
            }
        }
    });

    // proj += sigmoid(xb·g) · shared(xb)
    if let (Some(sw), Some(sc)) = (&w.shared, moe.shared) {
        let sff = sc.n_ff;
        let g = grow(&mut s.sh_gate, n * sff);
        let u = grow(&mut s.sh_up, n * sff);
        let out = grow(&mut s.sh_out, n * d);
        clock.try_time(Op::FfnUpMatmul, || {
            let mut outs = [&mut *g, &mut *u];
            matmul_many(
                kernels,
                &[&sw.gate, &sw.up],
                xb,
                n,
                &mut outs,
                layer,
                "ffn.gate_up_shexp",
            )
        })?;
        clock.time(Op::Activation, || ops::swiglu(g, u));
        clock.try_time(Op::FfnDownMatmul, || {
            matmul(kernels, &sw.down, g, n, out, None, layer, "ffn.down_shexp")
        })?;
        clock.time(Op::Residual, || {
            for t in 0..n {
                let x = &xb[t * d..(t + 1) * d];
                let scale = sw.gate_inp.map_or(1.0, |gi| {
                    sigmoid(x.iter().zip(gi).map(|(a, b)| a * b).sum())
                });
                let (o, p) = (&out[t * d..(t + 1) * d], &mut proj[t * d..(t + 1) * d]);
                p.iter_mut().zip(o).for_each(|(p, &v)| *p += v * scale);
            }
        });
    } else if w.shared.is_some() != moe.shared.is_some() {
        return Err(err(
            "the layer's shared expert does not match the config".into()
        ));
    }
    if let Some(pn) = w.post_norm {
        clock.time(Op::Norm, || ops::rms_norm_rows(proj, d, pn, eps, offset));
    }
    // h = h + proj
    clock.time(Op::Residual, || ops::add(hidden, proj));
    Ok(())
}

/// `x += bias[e]` for a per-expert bias of `rows` values per expert.
fn add_expert_bias(x: &mut [f32], bias: Option<&[f32]>, e: usize, rows: usize) {
    if let Some(b) = bias.and_then(|b| b.get(e * rows..(e + 1) * rows)) {
        ops::add(x, b);
    }
}

/// `gate = act(gate, up)` elementwise.
fn activate(act: ExpertActivation, gate: &mut [f32], up: &[f32]) {
    match act {
        ExpertActivation::Silu => ops::swiglu(gate, up),
        ExpertActivation::SwigluClamped { alpha, limit } => {
            for (g, &u) in gate.iter_mut().zip(up) {
                let x = g.min(limit);
                let y = u.clamp(-limit, limit);
                *g = x / (1.0 + (-alpha * x).exp()) * (y + 1.0);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(gating: Gating, normalize: bool, k: usize) -> MoeConfig {
        MoeConfig {
            n_expert: 4,
            n_expert_used: k,
            n_ff_expert: 2,
            gating,
            normalize,
            weights_scale: 1.0,
            shared: None,
            activation: ExpertActivation::Silu,
        }
    }

    #[test]
    fn softmax_then_top_k_with_and_without_renormalization() {
        let logits = [1.0f32, 3.0, 2.0, 0.0, 0.0, 0.0, 5.0, 1.0];
        let mut r = Routing::default();
        r.route(&cfg(Gating::Softmax, false, 2), &mut logits.clone(), 2);
        let (e, w) = r.token(0);
        assert_eq!(e, [1, 2]);
        let z: f32 = [1.0f32, 3.0, 2.0, 0.0].iter().map(|x| x.exp()).sum();
        assert!((w[0] - 3f32.exp() / z).abs() < 1e-6 && (w[1] - 2f32.exp() / z).abs() < 1e-6);
        assert_eq!(r.token(1).0, [2, 3]);
        assert_eq!(r.union(), [1, 2, 3]);
        assert_eq!(r.groups(2), [(0, 1), (1, 0)]);

        r.route(&cfg(Gating::Softmax, true, 2), &mut logits.clone(), 2);
        let w = r.token(0).1.to_vec();
        assert!((w[0] + w[1] - 1.0).abs() < 1e-6);
        // Renormalized softmax-then-top-k equals a softmax over the selected.
        let mut sel = logits;
        r.route(&cfg(Gating::SoftmaxSelected, false, 2), &mut sel, 2);
        let (_, w2) = r.token(0);
        assert!((w[0] - w2[0]).abs() < 1e-6);
        assert!((w2[0] - 1.0 / (1.0 + (-1f32).exp())).abs() < 1e-6);
    }

    #[test]
    fn clamped_swiglu_matches_its_formula() {
        let mut g = [10.0f32, -1.0];
        activate(
            ExpertActivation::SwigluClamped {
                alpha: 1.702,
                limit: 7.0,
            },
            &mut g,
            &[9.0, 0.5],
        );
        assert!((g[0] - 7.0 / (1.0 + (-1.702f32 * 7.0).exp()) * 8.0).abs() < 1e-5);
        assert!((g[1] - (-1.0 / (1.0 + 1.702f32.exp())) * 1.5).abs() < 1e-5);
    }
}
