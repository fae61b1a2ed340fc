//! Architectures: how each model family reads its hyperparameters into a
//! [`ModelConfig`], which tensors its layers hold ([`Role`]s), and how a layer
//! runs. Every family is one [`Architecture`]; the registry
//! ([`architecture`]) maps a GGUF `general.architecture` or a Hugging Face
//! `model_type` to it. The runtime's layer loop sees only this trait: it hands
//! a layer its tensors ([`LayerTensors`]) and each sequence's memory of it
//! ([`Segment`]) and calls [`Architecture::forward_layer`].
//!
//! | family | file | specifics |
//! |---|---|---|
//! | Llama 1/2/3, SmolLM2 | [`llama`] | RoPE scaling (llama3, `rope_freqs`), tied or untied output |
//! | Qwen2 / 2.5 | [`qwen2`] | Q/K/V biases, NeoX RoPE |
//! | Qwen3 | [`qwen3`] | per-head q/k RMS norms |
//! | Gemma 3 | [`gemma3`] | embedding scale, sandwich norms, GELU-tanh, sliding-window layers |
//! | Qwen3.5 | [`qwen35`], [`delta_net`] | hybrid: gated delta-net layers + gated full attention every Nth layer |
//! | Mixtral (`llama` with experts), Qwen3-MoE, Qwen2-MoE, OLMoE, Qwen3.5-MoE | [`llama`], [`moe_families`], [`moe`] | routed experts ([`moe::MoeConfig`]) in place of the dense FFN |
//! | gpt-oss | [`gptoss`] | attention sinks, every other layer windowed, YaRN, MXFP4 experts with biases, clamped SwiGLU |
//!
//! The first four run the one decoder layer ([`decoder`]), Qwen3.5 its own,
//! built from the decoder's attention core and FFN block.

pub mod decoder;
pub mod delta_net;
pub mod gemma3;
pub mod gptoss;
pub mod llama;
pub mod moe;
pub mod moe_families;
pub mod qwen2;
pub mod qwen3;
pub mod qwen35;
pub mod role;

pub use decoder::{DecoderTensors, LayerPlan, LayerScratch, Op, OpObserver};
pub use role::{
    Need, Role, TensorKind, expert_tensor, layer_tensor, parse_expert_tensor, parse_layer_tensor,
};

use crate::config::{Activation, GgufKeys, HfKeys, ModelConfig, RopeLayout};
use crate::error::{ModelError, Result};
use delta_net::DeltaNetState;
use flatrun_format::HfNaming;
use flatrun_kernels::ops::{KvPager, KvSlice};
use flatrun_kernels::{Kernels, Weight};
use std::ops::Range;

/// Every family, by its GGUF name. Adding a family: one file in this
/// directory and one line here.
static FAMILIES: &[&dyn Architecture] = &[
    &llama::Llama,
    &qwen2::Qwen2,
    &qwen3::Qwen3,
    &gemma3::Gemma3,
    &qwen35::Qwen35,
    &moe_families::Qwen3Moe,
    &moe_families::Qwen2Moe,
    &moe_families::Olmoe,
    &moe_families::Qwen35Moe,
    &gptoss::GptOss,
];

/// The family of a GGUF `general.architecture` or a Hugging Face `model_type`.
pub fn architecture(name: &str) -> Result<&'static dyn Architecture> {
    FAMILIES
        .iter()
        .copied()
        .find(|a| a.name() == name || a.aliases().contains(&name))
        .ok_or_else(|| ModelError::UnsupportedArch {
            name: name.to_string(),
            supported: supported(),
        })
}

/// Every supported family, by its GGUF name.
pub fn supported() -> Vec<&'static str> {
    FAMILIES.iter().map(|a| a.name()).collect()
}

/// How families that put the norm in front of the FFN after attention
/// (Llama, Qwen, Mistral, …) name it in Hugging Face checkpoints.
pub const PRE_FFN_NORM_NAMING: HfNaming = HfNaming {
    layer_stems: &[("post_attention_layernorm", "ffn_norm")],
    ..HfNaming::GENERIC
};

/// One model family: its config rules, the tensors of its layers, and how a
/// layer runs. Decoder-shaped families implement the first four methods and
/// keep the defaults (the decoder layer, a KV cache per layer).
pub trait Architecture: Send + Sync {
    /// The GGUF `general.architecture` (also the metadata key prefix).
    fn name(&self) -> &'static str;
    /// Other names of the family: Hugging Face `model_type`s.
    fn aliases(&self) -> &'static [&'static str] {
        &[]
    }
    /// The config from GGUF metadata.
    fn config_from_gguf(&self, keys: &GgufKeys) -> Result<ModelConfig>;
    /// The config from a Hugging Face `config.json`.
    fn config_from_hf(&self, keys: &HfKeys) -> Result<ModelConfig>;
    /// What Hugging Face checkpoints of the family mean by the per-layer
    /// names whose meaning differs between families.
    fn hf_naming(&self) -> HfNaming {
        PRE_FFN_NORM_NAMING
    }
    /// The tensors layer `il` holds, in the order the layer multiplies its
    /// matrices (the runtime streams them in this order).
    fn layer_roles(&self, cfg: &ModelConfig, il: usize) -> Vec<(Role, Need)>;
    /// Which memory layer `il` keeps per sequence.
    fn layer_memory(&self, cfg: &ModelConfig, il: usize) -> MemoryKind {
        let _ = (cfg, il);
        MemoryKind::Kv
    }
    /// The norm in front of the FFN (and of a mixture-of-experts layer's
    /// router): `ffn_norm`, or `post_attention_norm` where the family names
    /// it so.
    fn ffn_norm(&self) -> Role {
        Role::FfnNorm
    }
    /// The constants of layer `il` (RoPE, attention), computed once at load;
    /// `freq_factors` is the `rope_freqs` tensor.
    fn layer_plan(&self, cfg: &ModelConfig, il: usize, freq_factors: Option<&[f32]>) -> LayerPlan {
        LayerPlan::new(cfg, il, freq_factors)
    }
    /// Run layer `plan.index` for every token of the step: `hidden` is
    /// `n_tokens × n_embd`, updated in place; `segments` split the tokens by
    /// sequence and carry each one's memory of this layer.
    #[allow(clippy::too_many_arguments)]
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
        let weights = DecoderTensors::from_layer(cfg, plan.index, tensors)?;
        decoder::forward_layer(
            cfg, plan, &weights, hidden, positions, segments, kernels, scratch, observer,
        )
    }
}

/// A model's family, as a config carries it: compares, hashes and prints by
/// name.
#[derive(Clone, Copy)]
pub struct Arch(&'static dyn Architecture);

impl Arch {
    /// The family of a GGUF `general.architecture` or Hugging Face `model_type`.
    pub fn from_name(name: &str) -> Result<Arch> {
        architecture(name).map(Arch)
    }
    /// The handle of `family`.
    pub const fn new(family: &'static dyn Architecture) -> Arch {
        Arch(family)
    }
    /// The GGUF spelling of the family (the metadata key prefix).
    pub fn name(self) -> &'static str {
        self.0.name()
    }
    /// The family's rules.
    pub fn family(self) -> &'static dyn Architecture {
        self.0
    }
}

impl std::ops::Deref for Arch {
    type Target = dyn Architecture;
    fn deref(&self) -> &Self::Target {
        self.0
    }
}

impl PartialEq for Arch {
    fn eq(&self, other: &Arch) -> bool {
        self.name() == other.name()
    }
}

impl Eq for Arch {}

impl PartialEq<&str> for Arch {
    fn eq(&self, other: &&str) -> bool {
        self.name() == *other
    }
}

impl std::hash::Hash for Arch {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.name().hash(state);
    }
}

impl std::fmt::Debug for Arch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Arch({})", self.name())
    }
}

impl std::fmt::Display for Arch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What a running layer sees of its weights, whatever the residency mode:
/// the runtime hands matrices out of the mapping, a read buffer, a
/// row-chunked stream or a dense copy.
pub trait LayerTensors {
    /// A matrix of the layer ([`Role::is_matrix`]), if it holds one.
    fn matrix(&self, role: Role) -> Option<Weight<'_>>;
    /// A small tensor of the layer as f32 values, if it holds one.
    fn vector(&self, role: Role) -> Option<&[f32]>;
    /// The routed experts of a stacked expert role ([`Role::is_experts`]):
    /// one stacked matrix (GGUF), or one matrix per expert (Hugging Face).
    fn experts(&self, role: Role) -> Option<moe::Experts<'_>> {
        self.matrix(role).map(moe::Experts::Stacked)
    }
}

/// The experts of role `role` of layer `layer`, or an error naming them.
pub fn require_experts<'t>(
    t: &'t dyn LayerTensors,
    layer: usize,
    role: Role,
) -> Result<moe::Experts<'t>> {
    t.experts(role).ok_or(ModelError::MissingLayerTensor {
        layer,
        tensor: role.suffix(),
    })
}

/// The matrix `role` of layer `layer`, or an error naming it.
pub fn require_matrix<'t>(t: &'t dyn LayerTensors, layer: usize, role: Role) -> Result<Weight<'t>> {
    t.matrix(role).ok_or(ModelError::MissingLayerTensor {
        layer,
        tensor: role.suffix(),
    })
}

/// The vector `role` of layer `layer`, or an error naming it.
pub fn require_vector(t: &dyn LayerTensors, layer: usize, role: Role) -> Result<&[f32]> {
    t.vector(role).ok_or(ModelError::MissingLayerTensor {
        layer,
        tensor: role.suffix(),
    })
}

/// Which memory a layer keeps per sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemoryKind {
    /// A key/value cache (attention layers).
    Kv,
    /// A fixed-size recurrent state (Qwen3.5's delta-net layers).
    Recurrent,
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
    /// The rotation the cache's rows are stored under.
    fn rotation(&self) -> KvRotation {
        KvRotation::NONE
    }
    /// A cache whose rows live in a file mapping: what attention tells
    /// which rows it has gone past (see [`KvPager`]). `None`: rows in
    /// memory.
    fn pager(&self) -> Option<&dyn KvPager> {
        None
    }
}

/// The Hadamard rotations of a quantized cache (see `ops::hadamard`), as
/// llama.cpp applies them: keys (and so queries) in pieces of the largest
/// power of two ≥ 64 that divides the head size, values (and so the
/// attention output) in pieces of 64; each only when its type is block
/// quantized and the head size is a multiple of 64.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KvRotation {
    /// Piece size of the key and query rotation.
    pub keys: Option<usize>,
    /// Piece size of the value and output rotation.
    pub values: Option<usize>,
}

impl KvRotation {
    /// No rotation (f16 and f32 caches).
    pub const NONE: KvRotation = KvRotation {
        keys: None,
        values: None,
    };

    /// The rotation of a cache of heads of `head_dim` values whose keys
    /// and values are (or are not) block quantized.
    pub fn for_cache(head_dim: usize, keys_quantized: bool, values_quantized: bool) -> KvRotation {
        let fits = head_dim > 0 && head_dim.is_multiple_of(64);
        let mut n = 64;
        while fits && head_dim.is_multiple_of(2 * n) {
            n *= 2;
        }
        KvRotation {
            keys: (fits && keys_quantized).then_some(n),
            values: (fits && values_quantized).then_some(64),
        }
    }
}

/// Per-sequence memory of one layer for one run of tokens.
pub enum LayerMemory<'s> {
    Kv(&'s mut dyn LayerKv),
    Recurrent(&'s mut DeltaNetState),
}

/// The tokens of one sequence inside a step, and that sequence's memory of
/// the layer.
pub struct Segment<'s> {
    /// Rows of the step's token batch that belong to this sequence.
    pub tokens: Range<usize>,
    pub memory: LayerMemory<'s>,
}

/// The hyperparameters every family stores under the same GGUF keys.
pub fn common_from_gguf(arch: Arch, keys: &GgufKeys) -> Result<ModelConfig> {
    let n_layer = keys.require_usize("block_count")?;
    let n_embd = keys.require_usize("embedding_length")?;
    // (Mixture-of-experts files may give only the experts' width.)
    let n_ff = keys
        .per_layer_u64("feed_forward_length")
        .and_then(|v| v.first().copied())
        .or_else(|| keys.u64("expert_feed_forward_length"))
        .map(|v| v as usize)
        .ok_or_else(|| keys_missing(keys, "feed_forward_length"))?;
    let n_head = keys
        .per_layer_u64("attention.head_count")
        .and_then(|v| v.first().copied())
        .map(|v| v as usize)
        .ok_or_else(|| keys_missing(keys, "attention.head_count"))?;
    let n_kv_head = keys
        .per_layer_u64("attention.head_count_kv")
        .and_then(|v| v.first().copied())
        .map_or(n_head, |v| v as usize);
    if n_head == 0 || n_kv_head == 0 || n_head % n_kv_head != 0 {
        return Err(ModelError::BadValue {
            key: format!("{}.attention.head_count_kv", keys.arch),
            what: format!("{n_kv_head} KV heads do not divide {n_head} query heads"),
        });
    }
    let head_dim = keys
        .u64("attention.key_length")
        .map_or(n_embd / n_head, |v| v as usize);
    let rope_dims = keys
        .u64("rope.dimension_count")
        .map_or(head_dim, |v| v as usize);
    let rope_theta = keys.f32("rope.freq_base").unwrap_or(10_000.0);
    let vocab_size = keys
        .u64("vocab_size")
        .map(|v| v as usize)
        .or_else(|| keys.token_count())
        .unwrap_or(0);
    Ok(ModelConfig {
        arch,
        n_layer,
        n_embd,
        n_ff,
        n_head,
        n_kv_head,
        head_dim,
        vocab_size,
        rms_eps: keys.require_f32("attention.layer_norm_rms_epsilon")?,
        norm_weight_offset: 0.0,
        rope_layout: RopeLayout::Neox,
        rope_dims,
        rope_theta,
        rope_theta_swa: rope_theta,
        rope_scaling: crate::config::gguf_rope_scaling(keys)?,
        context_length: keys.u64("context_length").unwrap_or(2048) as usize,
        sliding_window: None,
        swa_layers: vec![false; n_layer],
        attn_scale: 1.0 / (head_dim as f32).sqrt(),
        embed_scale: None,
        final_logit_softcap: None,
        activation: Activation::Silu,
        delta_net: None,
        moe: None,
        pooling: match keys.u64("pooling_type") {
            Some(code) => crate::pooling::Pooling::from_code(code)?,
            None => crate::pooling::Pooling::Mean,
        },
    })
}

fn keys_missing(keys: &GgufKeys, key: &str) -> ModelError {
    ModelError::MissingKey {
        arch: keys.arch.to_string(),
        key: format!("{}.{}", keys.arch, key),
    }
}

/// The hyperparameters every family stores under the same `config.json` keys.
pub fn common_from_hf(arch: Arch, keys: &HfKeys) -> Result<ModelConfig> {
    let n_layer = keys.require_usize("num_hidden_layers")?;
    let n_embd = keys.require_usize("hidden_size")?;
    let n_head = keys.require_usize("num_attention_heads")?;
    let n_kv_head = keys
        .u64("num_key_value_heads")
        .map_or(n_head, |v| v as usize);
    if n_head == 0 || n_kv_head == 0 || n_head % n_kv_head != 0 {
        return Err(ModelError::BadValue {
            key: "num_key_value_heads".into(),
            what: format!("{n_kv_head} KV heads do not divide {n_head} query heads"),
        });
    }
    let head_dim = keys.u64("head_dim").map_or(n_embd / n_head, |v| v as usize);
    let rope_theta = keys.f32("rope_theta").unwrap_or(10_000.0);
    let partial = keys.f32("partial_rotary_factor").unwrap_or(1.0);
    Ok(ModelConfig {
        arch,
        n_layer,
        n_embd,
        n_ff: keys.require_usize("intermediate_size")?,
        n_head,
        n_kv_head,
        head_dim,
        vocab_size: keys.u64("vocab_size").unwrap_or(0) as usize,
        rms_eps: keys.f32("rms_norm_eps").unwrap_or(1e-6),
        norm_weight_offset: 0.0,
        // Hugging Face checkpoints keep the rotate-half (NeoX) layout.
        rope_layout: RopeLayout::Neox,
        rope_dims: ((head_dim as f32) * partial) as usize,
        rope_theta,
        rope_theta_swa: rope_theta,
        rope_scaling: keys.rope_scaling()?,
        context_length: keys.u64("max_position_embeddings").unwrap_or(2048) as usize,
        sliding_window: None,
        swa_layers: vec![false; n_layer],
        attn_scale: 1.0 / (head_dim as f32).sqrt(),
        embed_scale: None,
        final_logit_softcap: None,
        activation: Activation::Silu,
        delta_net: None,
        moe: None,
        pooling: crate::pooling::Pooling::Mean,
    })
}

#[cfg(test)]
mod kv_rotation_tests {
    use super::KvRotation;

    #[test]
    fn rotation_sizes_follow_the_head_size_and_types() {
        let r = KvRotation::for_cache(64, true, true);
        assert_eq!((r.keys, r.values), (Some(64), Some(64)));
        let r = KvRotation::for_cache(256, true, false);
        assert_eq!((r.keys, r.values), (Some(256), None));
        assert_eq!(KvRotation::for_cache(192, true, true).keys, Some(64));
        assert_eq!(KvRotation::for_cache(96, true, true), KvRotation::NONE);
        assert_eq!(KvRotation::for_cache(0, true, true), KvRotation::NONE);
        assert_eq!(KvRotation::for_cache(128, false, false), KvRotation::NONE);
    }
}
