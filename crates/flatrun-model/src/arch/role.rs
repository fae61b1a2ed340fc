//! Typed tensor roles: what each per-layer tensor of a checkpoint is for.
//!
//! A [`Role`] is the part of a canonical tensor name after `layers.{i}.`
//! ([`Role::suffix`], [`layer_tensor`]); the families list the roles a layer
//! holds ([`super::Architecture::layer_roles`]), the manifest records them, and
//! a running layer asks for its weights by role ([`super::LayerTensors`]).
//!
//! Mixture-of-experts families add their roles here: the router
//! (`ffn_gate_inp`, a matrix), the stacked experts (`ffn_{gate,up,down}_exps`,
//! one matrix of `n_expert × rows` rows each, whose experts are row ranges)
//! and the shared expert (`ffn_{gate,up,down}_shexp`); the runtime's layer
//! loop hands them out like any other matrix.

/// One per-layer tensor of any supported family.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Role {
    /// RMS norm in front of the token mixer (`attn_norm`).
    AttnNorm,
    /// Query projection (Qwen3.5 attention layers: queries and gates).
    AttnQ,
    AttnK,
    AttnV,
    /// Attention output projection.
    AttnO,
    AttnQBias,
    AttnKBias,
    AttnVBias,
    AttnOBias,
    /// Learned per-head attention sink logits (gpt-oss), `n_head` values.
    AttnSinks,
    /// Per-head RMS norm of the queries (Qwen3, Gemma 3, Qwen3.5).
    AttnQNorm,
    /// Per-head RMS norm of the keys.
    AttnKNorm,
    /// RMS norm of the attention output (Gemma 3); Qwen3.5's pre-FFN norm
    /// (GGUF `post_attention_norm`).
    PostAttnNorm,
    /// RMS norm in front of the FFN.
    FfnNorm,
    FfnGate,
    FfnUp,
    FfnDown,
    /// RMS norm of the FFN output (Gemma 3).
    PostFfnNorm,
    /// Qwen3.5 delta net: the fused query/key/value projection.
    AttnQkv,
    /// Qwen3.5 delta net: the output gate `z`.
    AttnGate,
    /// Qwen3.5 delta net: the causal conv1d kernel (`channels × d_conv`).
    SsmConv1d,
    /// Qwen3.5 delta net: the decay bias per value head.
    SsmDtBias,
    /// Qwen3.5 delta net: `−exp(A_log)` per value head.
    SsmA,
    /// Qwen3.5 delta net: the decay projection.
    SsmAlpha,
    /// Qwen3.5 delta net: the write-strength projection.
    SsmBeta,
    /// Qwen3.5 delta net: the gated output norm (one head wide).
    SsmNorm,
    /// Qwen3.5 delta net: the output projection.
    SsmOut,
    /// Mixture of experts: the router, `n_expert × n_embd`.
    FfnGateInp,
    /// The router's bias (gpt-oss).
    FfnGateInpBias,
    /// The experts' gate projections, stacked: `n_expert × n_ff_expert` rows.
    FfnGateExps,
    /// The experts' up projections, stacked like the gates.
    FfnUpExps,
    /// The experts' down projections, stacked: `n_expert × n_embd` rows.
    FfnDownExps,
    /// Per-expert biases of the gate, up and down projections (gpt-oss),
    /// `n_expert × rows`.
    FfnGateExpsBias,
    FfnUpExpsBias,
    FfnDownExpsBias,
    /// The shared expert's projections (Qwen2-MoE, Qwen3.5-MoE).
    FfnGateShexp,
    FfnUpShexp,
    FfnDownShexp,
    /// The shared expert's sigmoid gate, one row of `n_embd`.
    FfnGateInpShexp,
}

/// Whether a layer must hold a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Need {
    /// The checkpoint is refused without it.
    Required,
    /// Used when the checkpoint has it.
    Optional,
}

/// How a running layer reads a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TensorKind {
    /// A matrix the kernels multiply, handed out as stored
    /// ([`flatrun_kernels::Weight`]); the runtime may stream it.
    Matrix,
    /// A small tensor (norm, bias, conv kernel, per-head constants) the layer
    /// reads as f32 values.
    Vector,
}

impl Role {
    /// Every role.
    pub const ALL: &'static [Role] = &[
        Role::AttnNorm,
        Role::AttnQ,
        Role::AttnK,
        Role::AttnV,
        Role::AttnO,
        Role::AttnQBias,
        Role::AttnKBias,
        Role::AttnVBias,
        Role::AttnOBias,
        Role::AttnSinks,
        Role::AttnQNorm,
        Role::AttnKNorm,
        Role::PostAttnNorm,
        Role::FfnNorm,
        Role::FfnGate,
        Role::FfnUp,
        Role::FfnDown,
        Role::PostFfnNorm,
        Role::AttnQkv,
        Role::AttnGate,
        Role::SsmConv1d,
        Role::SsmDtBias,
        Role::SsmA,
        Role::SsmAlpha,
        Role::SsmBeta,
        Role::SsmNorm,
        Role::SsmOut,
        Role::FfnGateInp,
        Role::FfnGateInpBias,
        Role::FfnGateExps,
        Role::FfnUpExps,
        Role::FfnDownExps,
        Role::FfnGateExpsBias,
        Role::FfnUpExpsBias,
        Role::FfnDownExpsBias,
        Role::FfnGateShexp,
        Role::FfnUpShexp,
        Role::FfnDownShexp,
        Role::FfnGateInpShexp,
    ];

    /// Number of roles (the length of a table indexed by `role as usize`).
    pub const COUNT: usize = Role::ALL.len();

    /// The canonical name part after `layers.{i}.` (`"attn.q"`).
    pub fn suffix(self) -> &'static str {
        match self {
            Role::AttnNorm => "attn_norm",
            Role::AttnQ => "attn.q",
            Role::AttnK => "attn.k",
            Role::AttnV => "attn.v",
            Role::AttnO => "attn.o",
            Role::AttnQBias => "attn.q.bias",
            Role::AttnKBias => "attn.k.bias",
            Role::AttnVBias => "attn.v.bias",
            Role::AttnOBias => "attn.o.bias",
            Role::AttnSinks => "attn.sinks",
            Role::AttnQNorm => "attn.q_norm",
            Role::AttnKNorm => "attn.k_norm",
            Role::PostAttnNorm => "post_attn_norm",
            Role::FfnNorm => "ffn_norm",
            Role::FfnGate => "ffn.gate",
            Role::FfnUp => "ffn.up",
            Role::FfnDown => "ffn.down",
            Role::PostFfnNorm => "post_ffn_norm",
            Role::AttnQkv => "attn.qkv",
            Role::AttnGate => "attn.gate",
            Role::SsmConv1d => "ssm.conv1d",
            Role::SsmDtBias => "ssm.dt.bias",
            Role::SsmA => "ssm.a",
            Role::SsmAlpha => "ssm.alpha",
            Role::SsmBeta => "ssm.beta",
            Role::SsmNorm => "ssm.norm",
            Role::SsmOut => "ssm.out",
            Role::FfnGateInp => "ffn.gate_inp",
            Role::FfnGateInpBias => "ffn.gate_inp.bias",
            Role::FfnGateExps => "ffn.gate_exps",
            Role::FfnUpExps => "ffn.up_exps",
            Role::FfnDownExps => "ffn.down_exps",
            Role::FfnGateExpsBias => "ffn.gate_exps.bias",
            Role::FfnUpExpsBias => "ffn.up_exps.bias",
            Role::FfnDownExpsBias => "ffn.down_exps.bias",
            Role::FfnGateShexp => "ffn.gate_shexp",
            Role::FfnUpShexp => "ffn.up_shexp",
            Role::FfnDownShexp => "ffn.down_shexp",
            Role::FfnGateInpShexp => "ffn.gate_inp_shexp",
        }
    }

    /// The role of a canonical name part (`"attn.q"` → [`Role::AttnQ`]).
    pub fn from_suffix(suffix: &str) -> Option<Role> {
        Role::ALL.iter().copied().find(|r| r.suffix() == suffix)
    }

    /// How a layer reads the tensor.
    pub fn kind(self) -> TensorKind {
        match self {
            Role::AttnQ
            | Role::AttnK
            | Role::AttnV
            | Role::AttnO
            | Role::FfnGate
            | Role::FfnUp
            | Role::FfnDown
            | Role::AttnQkv
            | Role::AttnGate
            | Role::SsmAlpha
            | Role::SsmBeta
            | Role::SsmOut
            | Role::FfnGateInp
            | Role::FfnGateExps
            | Role::FfnUpExps
            | Role::FfnDownExps
            | Role::FfnGateShexp
            | Role::FfnUpShexp
            | Role::FfnDownShexp => TensorKind::Matrix,
            _ => TensorKind::Vector,
        }
    }

    /// Whether the tensor stacks the matrices of a layer's routed experts
    /// (one expert is one row range of it).
    pub fn is_experts(self) -> bool {
        matches!(
            self,
            Role::FfnGateExps | Role::FfnUpExps | Role::FfnDownExps
        )
    }

    /// Whether the layer multiplies by the tensor ([`TensorKind::Matrix`]).
    pub fn is_matrix(self) -> bool {
        self.kind() == TensorKind::Matrix
    }
}

/// Canonical name of a per-layer tensor: `layers.{layer}.{role suffix}`.
///
/// ```
/// use flatrun_model::arch::{layer_tensor, Role};
/// assert_eq!(layer_tensor(3, Role::AttnQ), "layers.3.attn.q");
/// assert_eq!(layer_tensor(0, Role::AttnQBias), "layers.0.attn.q.bias");
/// ```
pub fn layer_tensor(layer: usize, role: Role) -> String {
    format!("layers.{layer}.{}", role.suffix())
}

/// Canonical name of expert `e`'s own tensor of a stacked expert role, as
/// checkpoints that store one tensor per expert (Hugging Face) name it:
/// `layers.{layer}.{role suffix}.{e}`.
///
/// ```
/// use flatrun_model::arch::{expert_tensor, parse_expert_tensor, Role};
/// assert_eq!(expert_tensor(3, Role::FfnUpExps, 5), "layers.3.ffn.up_exps.5");
/// assert_eq!(parse_expert_tensor("layers.3.ffn.up_exps.5"), Some((3, Role::FfnUpExps, Some(5))));
/// assert_eq!(parse_expert_tensor("layers.3.ffn.up_exps"), Some((3, Role::FfnUpExps, None)));
/// ```
pub fn expert_tensor(layer: usize, role: Role, e: usize) -> String {
    format!("layers.{layer}.{}.{e}", role.suffix())
}

/// The layer and role of a canonical per-layer name (`layers.3.attn.q`);
/// one expert's tensor of a stacked expert role (`layers.3.ffn.up_exps.5`)
/// has that role.
pub fn parse_layer_tensor(name: &str) -> Option<(usize, Role)> {
    parse_expert_tensor(name).map(|(layer, role, _)| (layer, role))
}

/// The layer, role and, for one expert's own tensor ([`expert_tensor`]),
/// the expert of a canonical per-layer name.
pub fn parse_expert_tensor(name: &str) -> Option<(usize, Role, Option<usize>)> {
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    let (index, suffix) = name.strip_prefix("layers.")?.split_once('.')?;
    if !digits(index) {
        return None;
    }
    let layer = index.parse().ok()?;
    if let Some(role) = Role::from_suffix(suffix) {
        return Some((layer, role, None));
    }
    let (stem, e) = suffix.rsplit_once('.')?;
    let role = Role::from_suffix(stem).filter(|r| r.is_experts())?;
    if !digits(e) {
        return None;
    }
    Some((layer, role, Some(e.parse().ok()?)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_role_round_trips_through_its_name() {
        for (i, &role) in Role::ALL.iter().enumerate() {
            assert_eq!(role as usize, i, "{role:?} is out of order in Role::ALL");
            assert_eq!(Role::from_suffix(role.suffix()), Some(role));
            assert_eq!(
                parse_layer_tensor(&layer_tensor(12, role)),
                Some((12, role))
            );
        }
        assert_eq!(parse_layer_tensor("layers.x.attn.q"), None);
        assert_eq!(
            parse_layer_tensor("layers.2.ffn.down_exps.17"),
            Some((2, Role::FfnDownExps))
        );
        assert_eq!(parse_layer_tensor("layers.2.attn.q.17"), None);
        assert_eq!(parse_layer_tensor("layers.2.ffn.down_exps.x"), None);
        assert_eq!(parse_layer_tensor("layers.2.ffn.down_exps."), None);
        assert_eq!(parse_layer_tensor("layers.1.mystery"), None);
        assert_eq!(parse_layer_tensor("embed"), None);
    }

    #[test]
    fn matrices_and_vectors() {
        assert!(Role::AttnQ.is_matrix() && Role::SsmOut.is_matrix());
        assert!(!Role::AttnQBias.is_matrix() && !Role::SsmConv1d.is_matrix());
    }
}
