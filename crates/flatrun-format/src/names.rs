//! Canonical tensor names: one naming for every format.
//!
//! | canonical | GGUF | Hugging Face / MLX |
//! |---|---|---|
//! | `embed` | `token_embd.weight` | `model.embed_tokens.weight` |
//! | `output` | `output.weight` | `lm_head.weight` |
//! | `output_norm` | `output_norm.weight` | `model.norm.weight` |
//! | `rope_freqs` | `rope_freqs.weight` | — |
//! | `layers.{i}.attn_norm` | `blk.{i}.attn_norm.weight` | `model.layers.{i}.input_layernorm.weight` |
//! | `layers.{i}.attn.q` / `.k` / `.v` / `.o` | `blk.{i}.attn_q` / `attn_k` / `attn_v` / `attn_output` | `self_attn.q_proj` / `k_proj` / `v_proj` / `o_proj` |
//! | `layers.{i}.attn.q_norm` / `.k_norm` | `attn_q_norm` / `attn_k_norm` | `self_attn.q_norm` / `k_norm` |
//! | `layers.{i}.post_attn_norm` | `post_attention_norm` | per family ([`HfNaming`]) |
//! | `layers.{i}.ffn_norm` | `ffn_norm` | `pre_feedforward_layernorm`; `post_attention_layernorm` per family ([`HfNaming`]) |
//! | `layers.{i}.post_ffn_norm` | `post_ffw_norm` | `post_feedforward_layernorm` |
//! | `layers.{i}.ffn.gate` / `.up` / `.down` | `ffn_gate` / `ffn_up` / `ffn_down` | `mlp.gate_proj` / `up_proj` / `down_proj` |
//! | `layers.{i}.ffn.gate_inp` | `ffn_gate_inp` (the router) | per family: `mlp.gate` ([`HfNaming`]) |
//! | `layers.{i}.ffn.gate_exps` / `.up_exps` / `.down_exps` | `ffn_gate_exps` / `ffn_up_exps` / `ffn_down_exps` (experts stacked `[n_expert, rows, cols]`) | — |
//! | `layers.{i}.ffn.gate_exps.{e}` / `.up_exps.{e}` / `.down_exps.{e}` (expert `e` alone, `[rows, cols]`) | — | per family: `mlp.experts.{e}.gate_proj` / `up_proj` / `down_proj` ([`HfNaming::expert_stems`]) |
//! | `layers.{i}.ffn.gate_shexp` / `.up_shexp` / `.down_shexp` / `.gate_inp_shexp` | `ffn_*_shexp`, `ffn_gate_inp_shexp` (shared expert and its gate) | per family: `mlp.shared_expert.*`, `mlp.shared_expert_gate` |
//! | `layers.{i}.attn.qkv` / `.gate` | `attn_qkv` / `attn_gate` | — (Qwen3.5 delta-net input and output gate) |
//! | `layers.{i}.ssm.conv1d` / `.dt.bias` / `.a` / `.alpha` / `.beta` / `.norm` / `.out` | `ssm_conv1d` / `ssm_dt.bias` / `ssm_a` / `ssm_alpha` / `ssm_beta` / `ssm_norm` / `ssm_out` | — |
//!
//! Weights carry no suffix; biases get `.bias` (`layers.0.attn.q.bias`).
//! A name no rule knows is listed under its original name.

/// The Hugging Face per-layer names whose meaning depends on the model
/// family, supplied by the family (flatrun-model's `Architecture::hf_naming`):
/// `(stem, canonical stem)` pairs, consulted before the shared table, and how
/// the family stores its routed experts. The per-layer name every family
/// has is `post_attention_layernorm`, the pre-FFN norm in most families and
/// the norm of the attention output in others; mixture-of-experts families
/// add their router and shared expert (`mlp.gate`, `mlp.shared_expert.*`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HfNaming {
    pub layer_stems: &'static [(&'static str, &'static str)],
    /// Routed experts stored one tensor per expert and projection.
    pub expert_stems: &'static [HfExpertStem],
}

impl HfNaming {
    /// Only the shared table: a name whose meaning depends on the family
    /// keeps its original name.
    pub const GENERIC: HfNaming = HfNaming {
        layer_stems: &[],
        expert_stems: &[],
    };
}

/// One projection of a family's routed experts as Hugging Face checkpoints
/// store them, one tensor per expert: `model.layers.{i}.{prefix}{e}.{projection}.weight`
/// (`[rows, cols]`) is expert `e` of the stacked canonical tensor
/// `layers.{i}.{canonical}` and is named `layers.{i}.{canonical}.{e}`. A
/// family's table of these is all a new per-expert naming needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HfExpertStem {
    /// The module path up to the expert index (`mlp.experts.`).
    pub prefix: &'static str,
    /// The projection after it (`gate_proj`).
    pub projection: &'static str,
    /// The canonical stem of the stack (`ffn.gate_exps`).
    pub canonical: &'static str,
}

/// `mlp.experts.{e}.{gate,up,down}_proj`: Qwen2-MoE, Qwen3-MoE, OLMoE.
pub const HF_MLP_EXPERTS: &[HfExpertStem] = &[
    HfExpertStem {
        prefix: "mlp.experts.",
        projection: "gate_proj",
        canonical: "ffn.gate_exps",
    },
    HfExpertStem {
        prefix: "mlp.experts.",
        projection: "up_proj",
        canonical: "ffn.up_exps",
    },
    HfExpertStem {
        prefix: "mlp.experts.",
        projection: "down_proj",
        canonical: "ffn.down_exps",
    },
];

/// `block_sparse_moe.experts.{e}.w1` (gate) / `w3` (up) / `w2` (down): Mixtral.
pub const HF_MIXTRAL_EXPERTS: &[HfExpertStem] = &[
    HfExpertStem {
        prefix: "block_sparse_moe.experts.",
        projection: "w1",
        canonical: "ffn.gate_exps",
    },
    HfExpertStem {
        prefix: "block_sparse_moe.experts.",
        projection: "w3",
        canonical: "ffn.up_exps",
    },
    HfExpertStem {
        prefix: "block_sparse_moe.experts.",
        projection: "w2",
        canonical: "ffn.down_exps",
    },
];

/// The canonical name part of expert `e`'s tensor of the stack `canonical`
/// (`ffn.gate_exps`, 3 → `ffn.gate_exps.3`).
pub fn expert_stem(canonical: &str, e: usize) -> String {
    format!("{canonical}.{e}")
}

/// The canonical stem of a Hugging Face per-expert tensor under the
/// family's expert rules (`mlp.experts.3.up_proj` → `ffn.up_exps.3`).
fn hf_expert_stem(stem: &str, naming: &HfNaming) -> Option<String> {
    naming.expert_stems.iter().find_map(|rule| {
        let (e, projection) = stem.strip_prefix(rule.prefix)?.split_once('.')?;
        let index = !e.is_empty() && e.bytes().all(|b| b.is_ascii_digit());
        if !index || projection != rule.projection {
            return None;
        }
        Some(expert_stem(rule.canonical, e.parse().ok()?))
    })
}

/// GGUF per-layer stems and their canonical stems (`attn_q` ↔ `attn.q`).
const GGUF_LAYER_STEMS: &[(&str, &str)] = &[
    ("attn_q", "attn.q"),
    ("attn_k", "attn.k"),
    ("attn_v", "attn.v"),
    ("attn_qkv", "attn.qkv"),
    ("attn_output", "attn.o"),
    ("attn_norm", "attn_norm"),
    ("attn_q_norm", "attn.q_norm"),
    ("attn_k_norm", "attn.k_norm"),
    ("attn_sinks", "attn.sinks"),
    ("post_attention_norm", "post_attn_norm"),
    ("ffn_norm", "ffn_norm"),
    ("ffn_gate", "ffn.gate"),
    ("ffn_up", "ffn.up"),
    ("ffn_down", "ffn.down"),
    ("post_ffw_norm", "post_ffn_norm"),
    ("rope_freqs", "rope_freqs"),
    // Mixture of experts: router, stacked experts, shared expert.
    ("ffn_gate_inp", "ffn.gate_inp"),
    ("ffn_gate_exps", "ffn.gate_exps"),
    ("ffn_up_exps", "ffn.up_exps"),
    ("ffn_down_exps", "ffn.down_exps"),
    ("ffn_gate_shexp", "ffn.gate_shexp"),
    ("ffn_up_shexp", "ffn.up_shexp"),
    ("ffn_down_shexp", "ffn.down_shexp"),
    ("ffn_gate_inp_shexp", "ffn.gate_inp_shexp"),
    // Qwen3.5 gated delta-net layers and the attention output gate.
    ("attn_gate", "attn.gate"),
    ("ssm_conv1d", "ssm.conv1d"),
    ("ssm_dt", "ssm.dt"),
    ("ssm_alpha", "ssm.alpha"),
    ("ssm_beta", "ssm.beta"),
    ("ssm_norm", "ssm.norm"),
    ("ssm_out", "ssm.out"),
];

/// GGUF stems outside the layers and their canonical names.
const GGUF_GLOBAL_STEMS: &[(&str, &str)] = &[
    ("token_embd", "embed"),
    ("output", "output"),
    ("output_norm", "output_norm"),
    ("rope_freqs", "rope_freqs"),
];

/// Canonical stem of a GGUF per-layer tensor (`attn_q` → `attn.q`).
fn gguf_layer_stem(stem: &str) -> Option<&'static str> {
    GGUF_LAYER_STEMS
        .iter()
        .find(|(g, _)| *g == stem)
        .map(|(_, c)| *c)
}

/// Canonical name of a GGUF tensor outside the layers.
fn gguf_global_stem(stem: &str) -> Option<&'static str> {
    GGUF_GLOBAL_STEMS
        .iter()
        .find(|(g, _)| *g == stem)
        .map(|(_, c)| *c)
}

/// Split `stem.weight` / `stem.bias` into the stem and the canonical suffix.
fn split_param(name: &str) -> Option<(&str, &'static str)> {
    if let Some(stem) = name.strip_suffix(".weight") {
        Some((stem, ""))
    } else {
        name.strip_suffix(".bias").map(|stem| (stem, ".bias"))
    }
}

/// `"{index}.{rest}"` → `(index, rest)`.
fn split_layer(rest: &str) -> Option<(usize, &str)> {
    let (index, rest) = rest.split_once('.')?;
    if index.is_empty() || !index.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some((index.parse().ok()?, rest))
}

/// The canonical name of a GGUF tensor, or `None` when no rule knows it.
///
/// ```
/// use flatrun_format::names::canonical_gguf_name;
/// assert_eq!(canonical_gguf_name("blk.3.attn_q.weight").as_deref(), Some("layers.3.attn.q"));
/// assert_eq!(canonical_gguf_name("blk.3.attn_q.bias").as_deref(), Some("layers.3.attn.q.bias"));
/// assert_eq!(canonical_gguf_name("token_embd.weight").as_deref(), Some("embed"));
/// assert_eq!(canonical_gguf_name("blk.0.mystery.weight"), None);
/// ```
pub fn canonical_gguf_name(name: &str) -> Option<String> {
    // `blk.{i}.ssm_a` (the delta-net decay rate) is stored without a suffix.
    if let Some((layer, "ssm_a")) = name.strip_prefix("blk.").and_then(split_layer) {
        return Some(format!("layers.{layer}.ssm.a"));
    }
    let (stem, suffix) = split_param(name)?;
    if let Some(rest) = stem.strip_prefix("blk.") {
        let (layer, stem) = split_layer(rest)?;
        let canonical = gguf_layer_stem(stem)?;
        return Some(format!("layers.{layer}.{canonical}{suffix}"));
    }
    gguf_global_stem(stem).map(|c| format!("{c}{suffix}"))
}

/// The GGUF name of a canonical tensor name (the inverse of
/// [`canonical_gguf_name`]), or `None` when GGUF has no name for it.
///
/// ```
/// use flatrun_format::names::gguf_name;
/// assert_eq!(gguf_name("layers.3.attn.q").as_deref(), Some("blk.3.attn_q.weight"));
/// assert_eq!(gguf_name("layers.3.attn.q.bias").as_deref(), Some("blk.3.attn_q.bias"));
/// assert_eq!(gguf_name("embed").as_deref(), Some("token_embd.weight"));
/// assert_eq!(gguf_name("layers.0.mystery"), None);
/// ```
pub fn gguf_name(canonical: &str) -> Option<String> {
    let (stem, suffix) = match canonical.strip_suffix(".bias") {
        Some(stem) => (stem, "bias"),
        None => (canonical, "weight"),
    };
    if let Some(rest) = stem.strip_prefix("layers.") {
        let (layer, stem) = split_layer(rest)?;
        if stem == "ssm.a" && suffix == "weight" {
            return Some(format!("blk.{layer}.ssm_a"));
        }
        let (gguf, _) = GGUF_LAYER_STEMS.iter().find(|(_, c)| *c == stem)?;
        return Some(format!("blk.{layer}.{gguf}.{suffix}"));
    }
    let (gguf, _) = GGUF_GLOBAL_STEMS.iter().find(|(_, c)| *c == stem)?;
    Some(format!("{gguf}.{suffix}"))
}

/// Canonical stem of a Hugging Face per-layer tensor: the family's own
/// names first, then the names every family shares.
fn hf_layer_stem(stem: &str, naming: &HfNaming) -> Option<&'static str> {
    if let Some((_, canonical)) = naming.layer_stems.iter().find(|(s, _)| *s == stem) {
        return Some(canonical);
    }
    Some(match stem {
        "self_attn.q_proj" => "attn.q",
        "self_attn.k_proj" => "attn.k",
        "self_attn.v_proj" => "attn.v",
        "self_attn.o_proj" => "attn.o",
        "self_attn.qkv_proj" => "attn.qkv",
        "self_attn.q_norm" => "attn.q_norm",
        "self_attn.k_norm" => "attn.k_norm",
        "input_layernorm" => "attn_norm",
        "pre_feedforward_layernorm" => "ffn_norm",
        "post_feedforward_layernorm" => "post_ffn_norm",
        "mlp.gate_proj" => "ffn.gate",
        "mlp.up_proj" => "ffn.up",
        "mlp.down_proj" => "ffn.down",
        _ => return None,
    })
}

/// Prefixes under which Hugging Face checkpoints keep the text model
/// (plain causal LMs, and the text tower of multimodal ones).
const HF_MODEL_PREFIXES: &[&str] = &["model.language_model.", "language_model.model.", "model."];

/// The canonical name of a Hugging Face (or MLX) tensor, or `None`.
///
/// ```
/// use flatrun_format::names::{canonical_hf_name, HfNaming};
/// let q = canonical_hf_name("model.layers.2.self_attn.q_proj.weight", &HfNaming::GENERIC);
/// assert_eq!(q.as_deref(), Some("layers.2.attn.q"));
/// let sandwich = HfNaming {
///     layer_stems: &[("post_attention_layernorm", "post_attn_norm")],
///     ..HfNaming::GENERIC
/// };
/// let n = canonical_hf_name("model.layers.2.post_attention_layernorm.weight", &sandwich);
/// assert_eq!(n.as_deref(), Some("layers.2.post_attn_norm"));
/// let n = canonical_hf_name("model.layers.2.post_attention_layernorm.weight", &HfNaming::GENERIC);
/// assert_eq!(n, None);
/// ```
pub fn canonical_hf_name(name: &str, naming: &HfNaming) -> Option<String> {
    let (stem, suffix) = split_param(name)?;
    if stem == "lm_head" || stem == "language_model.lm_head" {
        return Some(format!("output{suffix}"));
    }
    let inner = HF_MODEL_PREFIXES
        .iter()
        .find_map(|p| stem.strip_prefix(p))?;
    if let Some(rest) = inner.strip_prefix("layers.") {
        let (layer, stem) = split_layer(rest)?;
        if let Some(expert) = hf_expert_stem(stem, naming) {
            return Some(format!("layers.{layer}.{expert}{suffix}"));
        }
        let canonical = hf_layer_stem(stem, naming)?;
        return Some(format!("layers.{layer}.{canonical}{suffix}"));
    }
    let canonical = match inner {
        "embed_tokens" => "embed",
        "norm" => "output_norm",
        _ => return None,
    };
    Some(format!("{canonical}{suffix}"))
}

/// The layer index of a canonical name (`layers.7.attn.q` → 7).
///
/// ```
/// use flatrun_format::names::canonical_layer_index;
/// assert_eq!(canonical_layer_index("layers.7.attn.q"), Some(7));
/// assert_eq!(canonical_layer_index("embed"), None);
/// ```
pub fn canonical_layer_index(name: &str) -> Option<usize> {
    split_layer(name.strip_prefix("layers.")?).map(|(i, _)| i)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gguf_names() {
        let cases = [
            ("blk.0.attn_q.weight", "layers.0.attn.q"),
            ("blk.0.attn_k.weight", "layers.0.attn.k"),
            ("blk.0.attn_v.weight", "layers.0.attn.v"),
            ("blk.12.attn_output.weight", "layers.12.attn.o"),
            ("blk.1.attn_q.bias", "layers.1.attn.q.bias"),
            ("blk.1.attn_norm.weight", "layers.1.attn_norm"),
            ("blk.1.ffn_norm.weight", "layers.1.ffn_norm"),
            ("blk.1.ffn_gate.weight", "layers.1.ffn.gate"),
            ("blk.1.ffn_up.weight", "layers.1.ffn.up"),
            ("blk.1.ffn_down.weight", "layers.1.ffn.down"),
            ("blk.1.attn_q_norm.weight", "layers.1.attn.q_norm"),
            ("blk.1.attn_k_norm.weight", "layers.1.attn.k_norm"),
            (
                "blk.1.post_attention_norm.weight",
                "layers.1.post_attn_norm",
            ),
            ("blk.1.post_ffw_norm.weight", "layers.1.post_ffn_norm"),
            ("token_embd.weight", "embed"),
            ("output.weight", "output"),
            ("output_norm.weight", "output_norm"),
            ("rope_freqs.weight", "rope_freqs"),
        ];
        for (gguf, canonical) in cases {
            assert_eq!(
                canonical_gguf_name(gguf).as_deref(),
                Some(canonical),
                "{gguf}"
            );
        }
        for unknown in [
            "blk.x.attn_q.weight",
            "blk..attn_q.weight",
            "blk.0.attn_q",
            "foo.weight",
            "blk.0.attn_q.scale",
        ] {
            assert_eq!(canonical_gguf_name(unknown), None, "{unknown}");
        }
    }

    #[test]
    fn hf_expert_names_follow_the_family_table() {
        const QWEN_MOE: HfNaming = HfNaming {
            layer_stems: &[("mlp.gate", "ffn.gate_inp")],
            expert_stems: HF_MLP_EXPERTS,
        };
        const MIXTRAL: HfNaming = HfNaming {
            layer_stems: &[("block_sparse_moe.gate", "ffn.gate_inp")],
            expert_stems: HF_MIXTRAL_EXPERTS,
        };
        let n = |s: &str, f| canonical_hf_name(s, f);
        let q = &QWEN_MOE;
        assert_eq!(
            n("model.layers.3.mlp.experts.12.gate_proj.weight", q).as_deref(),
            Some("layers.3.ffn.gate_exps.12")
        );
        assert_eq!(
            n("model.layers.0.mlp.experts.0.up_proj.weight", q).as_deref(),
            Some("layers.0.ffn.up_exps.0")
        );
        assert_eq!(
            n("model.layers.0.mlp.experts.7.down_proj.weight", q).as_deref(),
            Some("layers.0.ffn.down_exps.7")
        );
        assert_eq!(
            n("model.layers.1.mlp.gate.weight", q).as_deref(),
            Some("layers.1.ffn.gate_inp")
        );
        // The dense FFN keeps its names next to the expert rules.
        assert_eq!(
            n("model.layers.1.mlp.gate_proj.weight", q).as_deref(),
            Some("layers.1.ffn.gate")
        );
        for odd in [
            "model.layers.0.mlp.experts.x.gate_proj.weight",
            "model.layers.0.mlp.experts..gate_proj.weight",
            "model.layers.0.mlp.experts.3.w1.weight",
            "model.layers.0.mlp.experts.3.gate_proj.extra.weight",
        ] {
            assert_eq!(n(odd, q), None, "{odd}");
        }
        assert_eq!(
            n(
                "model.layers.2.mlp.experts.1.gate_proj.weight",
                &HfNaming::GENERIC
            ),
            None
        );
        let m = &MIXTRAL;
        for (hf, canonical) in [
            ("w1", "layers.5.ffn.gate_exps.3"),
            ("w3", "layers.5.ffn.up_exps.3"),
            ("w2", "layers.5.ffn.down_exps.3"),
        ] {
            let name = format!("model.layers.5.block_sparse_moe.experts.3.{hf}.weight");
            assert_eq!(n(&name, m).as_deref(), Some(canonical));
        }
    }

    #[test]
    fn hf_names_follow_the_given_naming() {
        const PRE_FFN: HfNaming = HfNaming {
            layer_stems: &[("post_attention_layernorm", "ffn_norm")],
            ..HfNaming::GENERIC
        };
        const SANDWICH: HfNaming = HfNaming {
            layer_stems: &[("post_attention_layernorm", "post_attn_norm")],
            ..HfNaming::GENERIC
        };
        let (l, g) = (&PRE_FFN, &SANDWICH);
        let n = |s: &str, f| canonical_hf_name(s, f);
        assert_eq!(n("model.embed_tokens.weight", l).as_deref(), Some("embed"));
        assert_eq!(n("lm_head.weight", l).as_deref(), Some("output"));
        assert_eq!(n("model.norm.weight", l).as_deref(), Some("output_norm"));
        assert_eq!(
            n("model.layers.3.self_attn.o_proj.weight", l).as_deref(),
            Some("layers.3.attn.o")
        );
        assert_eq!(
            n("model.layers.3.self_attn.k_proj.bias", l).as_deref(),
            Some("layers.3.attn.k.bias")
        );
        assert_eq!(
            n("model.layers.3.input_layernorm.weight", l).as_deref(),
            Some("layers.3.attn_norm")
        );
        assert_eq!(
            n("model.layers.3.post_attention_layernorm.weight", l).as_deref(),
            Some("layers.3.ffn_norm")
        );
        assert_eq!(
            n("model.layers.3.post_attention_layernorm.weight", g).as_deref(),
            Some("layers.3.post_attn_norm")
        );
        assert_eq!(
            n(
                "model.layers.3.post_attention_layernorm.weight",
                &HfNaming::GENERIC
            ),
            None
        );
        assert_eq!(
            n("model.layers.3.pre_feedforward_layernorm.weight", g).as_deref(),
            Some("layers.3.ffn_norm")
        );
        assert_eq!(
            n("model.layers.3.post_feedforward_layernorm.weight", g).as_deref(),
            Some("layers.3.post_ffn_norm")
        );
        assert_eq!(
            n("model.layers.3.mlp.gate_proj.weight", l).as_deref(),
            Some("layers.3.ffn.gate")
        );
        assert_eq!(
            n("model.layers.3.self_attn.q_norm.weight", g).as_deref(),
            Some("layers.3.attn.q_norm")
        );
        assert_eq!(
            n("language_model.model.layers.0.mlp.up_proj.weight", g).as_deref(),
            Some("layers.0.ffn.up")
        );
        assert_eq!(n("model.layers.3.mlp.experts.weight", l), None);
        assert_eq!(n("vision_tower.x.weight", l), None);
    }

    #[test]
    fn gguf_names_round_trip() {
        for (gguf, _) in GGUF_LAYER_STEMS {
            for suffix in ["weight", "bias"] {
                let name = format!("blk.7.{gguf}.{suffix}");
                let canonical = canonical_gguf_name(&name).unwrap();
                assert_eq!(gguf_name(&canonical).as_deref(), Some(name.as_str()));
            }
        }
        for name in [
            "token_embd.weight",
            "output.weight",
            "output_norm.weight",
            "blk.2.ssm_a",
        ] {
            let canonical = canonical_gguf_name(name).unwrap();
            assert_eq!(gguf_name(&canonical).as_deref(), Some(name), "{name}");
        }
    }

    #[test]
    fn layer_index() {
        assert_eq!(canonical_layer_index("layers.0.ffn.down"), Some(0));
        assert_eq!(canonical_layer_index("layers.29.attn_norm"), Some(29));
        assert_eq!(canonical_layer_index("layers.x.attn_norm"), None);
        assert_eq!(canonical_layer_index("output"), None);
    }
}
