//! Hyperparameters of a decoder-only transformer, read from GGUF metadata
//! (`{arch}.block_count`, `{arch}.embedding_length`, …) or from a Hugging Face
//! `config.json`. One [`ModelConfig`] describes every supported architecture;
//! the architecture-specific rules live in [`crate::arch`].

use crate::error::{ModelError, Result};
use flatrun_format::{MetaValue, Metadata};
use std::path::Path;

/// The family a config belongs to (a handle on its [`crate::arch::Architecture`]).
pub use crate::arch::Arch;

// RoPE layout and context scaling are the kernels' own types, so a config
// feeds `ops::rope` without translation.
pub use flatrun_kernels::ops::{RopeLayout, RopeScaling};

/// Feed-forward activation of the gated MLP.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// `silu(gate) * up` (Llama, Qwen).
    Silu,
    /// `gelu_tanh(gate) * up` (Gemma).
    GeluTanh,
}

/// Everything the forward pass needs to know about a model's shape.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub arch: Arch,
    /// Number of decoder layers.
    pub n_layer: usize,
    /// Width of the residual stream.
    pub n_embd: usize,
    /// Hidden width of the feed-forward network.
    pub n_ff: usize,
    /// Query heads.
    pub n_head: usize,
    /// Key/value heads (grouped-query attention when smaller than `n_head`).
    pub n_kv_head: usize,
    /// Dimension of one attention head (keys and values).
    pub head_dim: usize,
    /// Vocabulary size (rows of the embedding table); 0 until known.
    pub vocab_size: usize,
    /// RMS-norm epsilon.
    pub rms_eps: f32,
    /// Added to every RMS-norm weight (1 for Hugging Face/MLX Gemma, whose
    /// stored weights lack Gemma's "+1"; 0 otherwise, GGUF included).
    pub norm_weight_offset: f32,
    /// RoPE layout.
    pub rope_layout: RopeLayout,
    /// Rotated dimensions per head.
    pub rope_dims: usize,
    /// RoPE base of full-attention layers.
    pub rope_theta: f32,
    /// RoPE base of sliding-window layers.
    pub rope_theta_swa: f32,
    /// RoPE frequency scaling of full-attention layers.
    pub rope_scaling: RopeScaling,
    /// Training context length.
    pub context_length: usize,
    /// Sliding-window size, when the model has windowed layers.
    pub sliding_window: Option<usize>,
    /// Per layer: whether it uses sliding-window attention.
    pub swa_layers: Vec<bool>,
    /// Scale applied to `q·k` before the softmax.
    pub attn_scale: f32,
    /// Multiplier of the embedding rows (Gemma: sqrt(n_embd)).
    pub embed_scale: Option<f32>,
    /// Final logit soft-capping (`cap * tanh(x / cap)`), when set.
    pub final_logit_softcap: Option<f32>,
    /// Gated-FFN activation.
    pub activation: Activation,
    /// The linear-attention layers of a hybrid stack (Qwen3.5); `None` for
    /// pure-attention models.
    pub delta_net: Option<crate::arch::delta_net::DeltaNetConfig>,
    /// The routed experts of a mixture-of-experts model; `None` for dense
    /// FFNs.
    pub moe: Option<crate::arch::moe::MoeConfig>,
    /// How embeddings pool the final hidden states.
    pub pooling: crate::pooling::Pooling,
}

impl ModelConfig {
    /// Width of the keys (and values) of one token: `n_kv_head * head_dim`.
    pub fn kv_dim(&self) -> usize {
        self.n_kv_head * self.head_dim
    }
    /// Width of the queries of one token: `n_head * head_dim`.
    pub fn q_dim(&self) -> usize {
        self.n_head * self.head_dim
    }
    /// Whether layer `layer` is a recurrent (gated delta-net) layer of a
    /// hybrid stack, which keeps a recurrent state instead of a KV cache.
    pub fn is_recurrent(&self, layer: usize) -> bool {
        self.delta_net
            .as_ref()
            .is_some_and(|d| d.recurrent_layers.get(layer).copied().unwrap_or(false))
    }
    /// Whether layer `layer` uses sliding-window attention.
    pub fn is_swa(&self, layer: usize) -> bool {
        self.swa_layers.get(layer).copied().unwrap_or(false)
    }
    /// The attention window of layer `layer`, if it has one.
    pub fn window(&self, layer: usize) -> Option<usize> {
        if self.is_swa(layer) {
            self.sliding_window
        } else {
            None
        }
    }

    /// Read the hyperparameters from GGUF metadata.
    pub fn from_gguf(md: &Metadata) -> Result<ModelConfig> {
        let arch_name = meta_str(md, "general.architecture").ok_or(ModelError::MissingKey {
            arch: "?".into(),
            key: "general.architecture".into(),
        })?;
        let arch = Arch::from_name(arch_name)?;
        let keys = GgufKeys {
            md,
            arch: arch_name,
        };
        arch.config_from_gguf(&keys)
    }

    /// Read the hyperparameters from a Hugging Face `config.json` (also MLX
    /// checkpoints, which use the same file).
    pub fn from_hf_config_file(path: &Path) -> Result<ModelConfig> {
        let text = std::fs::read_to_string(path).map_err(|e| ModelError::ConfigFile {
            path: path.to_path_buf(),
            what: e.to_string(),
        })?;
        let json: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| ModelError::ConfigFile {
                path: path.to_path_buf(),
                what: format!("invalid JSON: {e}"),
            })?;
        ModelConfig::from_hf_json(&json)
    }

    /// Read the hyperparameters from a parsed `config.json`.
    pub fn from_hf_json(json: &serde_json::Value) -> Result<ModelConfig> {
        let (text, model_type) = hf_model_type(json)?;
        let arch = Arch::from_name(model_type)?;
        let keys = HfKeys {
            json: text,
            arch: model_type,
        };
        arch.config_from_hf(&keys)
    }
}

/// The text model's part of a `config.json` and its `model_type`
/// (multimodal Gemma 3 configs nest the text model under `text_config`).
pub(crate) fn hf_model_type(json: &serde_json::Value) -> Result<(&serde_json::Value, &str)> {
    let text = json.get("text_config").unwrap_or(json);
    let model_type = text
        .get("model_type")
        .or_else(|| json.get("model_type"))
        .and_then(|v| v.as_str())
        .ok_or(ModelError::MissingKey {
            arch: "?".into(),
            key: "model_type".into(),
        })?;
    Ok((text, model_type))
}

/// Typed access to GGUF hyperparameters `{arch}.{key}`; errors name the key.
pub struct GgufKeys<'a> {
    pub md: &'a Metadata,
    pub arch: &'a str,
}

impl GgufKeys<'_> {
    fn full(&self, key: &str) -> String {
        format!("{}.{}", self.arch, key)
    }
    fn missing(&self, key: &str) -> ModelError {
        ModelError::MissingKey {
            arch: self.arch.to_string(),
            key: self.full(key),
        }
    }
    /// An optional unsigned integer `{arch}.{key}`.
    pub fn u64(&self, key: &str) -> Option<u64> {
        meta_u64(self.md, &self.full(key))
    }
    /// A required unsigned integer `{arch}.{key}`.
    pub fn require_usize(&self, key: &str) -> Result<usize> {
        self.u64(key)
            .map(|v| v as usize)
            .ok_or_else(|| self.missing(key))
    }
    /// An optional number `{arch}.{key}`.
    pub fn f32(&self, key: &str) -> Option<f32> {
        meta_f32(self.md, &self.full(key))
    }
    /// A required number `{arch}.{key}`.
    pub fn require_f32(&self, key: &str) -> Result<f32> {
        self.f32(key).ok_or_else(|| self.missing(key))
    }
    /// An optional string `{arch}.{key}`.
    pub fn str(&self, key: &str) -> Option<&str> {
        meta_str(self.md, &self.full(key))
    }
    /// An optional per-layer integer array or a scalar broadcast to all layers
    /// (GGUF stores `head_count_kv` either way).
    pub fn per_layer_u64(&self, key: &str) -> Option<Vec<u64>> {
        match self.md.entries.iter().find(|(k, _)| *k == self.full(key)) {
            Some((_, MetaValue::Array(items))) => items.iter().map(value_u64).collect(),
            Some((_, v)) => value_u64(v).map(|x| vec![x]),
            None => None,
        }
    }
    /// An optional boolean array `{arch}.{key}`.
    pub fn bool_array(&self, key: &str) -> Option<Vec<bool>> {
        match self.md.entries.iter().find(|(k, _)| *k == self.full(key)) {
            Some((_, MetaValue::Array(items))) => items
                .iter()
                .map(|v| match v {
                    MetaValue::Bool(b) => Some(*b),
                    other => value_u64(other).map(|x| x != 0),
                })
                .collect(),
            _ => None,
        }
    }
    /// Length of the `tokenizer.ggml.tokens` array (the vocabulary size).
    pub fn token_count(&self) -> Option<usize> {
        match self
            .md
            .entries
            .iter()
            .find(|(k, _)| k == "tokenizer.ggml.tokens")
        {
            Some((_, MetaValue::Array(items))) => Some(items.len()),
            _ => None,
        }
    }
}

/// Typed access to `config.json` keys; errors name the key.
pub struct HfKeys<'a> {
    pub json: &'a serde_json::Value,
    pub arch: &'a str,
}

impl HfKeys<'_> {
    fn missing(&self, key: &str) -> ModelError {
        ModelError::MissingKey {
            arch: self.arch.to_string(),
            key: key.to_string(),
        }
    }
    /// The raw JSON value of `key`.
    pub fn get(&self, key: &str) -> Option<&serde_json::Value> {
        self.json.get(key).filter(|v| !v.is_null())
    }
    /// An optional unsigned integer.
    pub fn u64(&self, key: &str) -> Option<u64> {
        self.get(key).and_then(|v| v.as_u64())
    }
    /// A required unsigned integer.
    pub fn require_usize(&self, key: &str) -> Result<usize> {
        self.u64(key)
            .map(|v| v as usize)
            .ok_or_else(|| self.missing(key))
    }
    /// An optional number.
    pub fn f32(&self, key: &str) -> Option<f32> {
        self.get(key).and_then(|v| v.as_f64()).map(|v| v as f32)
    }
    /// A required number.
    pub fn require_f32(&self, key: &str) -> Result<f32> {
        self.f32(key).ok_or_else(|| self.missing(key))
    }
    /// An optional boolean.
    pub fn bool(&self, key: &str) -> Option<bool> {
        self.get(key).and_then(|v| v.as_bool())
    }
    /// The `rope_scaling` object, as a [`RopeScaling`].
    pub fn rope_scaling(&self) -> Result<RopeScaling> {
        let Some(obj) = self.get("rope_scaling") else {
            return Ok(RopeScaling::None);
        };
        let kind = obj
            .get("rope_type")
            .or_else(|| obj.get("type"))
            .and_then(|v| v.as_str())
            .unwrap_or("default");
        let num = |k: &str, d: f32| obj.get(k).and_then(|v| v.as_f64()).map_or(d, |v| v as f32);
        let orig = obj
            .get("original_max_position_embeddings")
            .and_then(|v| v.as_u64())
            .map(|v| v as usize);
        match kind {
            "default" => Ok(RopeScaling::None),
            "linear" => Ok(RopeScaling::Linear {
                factor: num("factor", 1.0),
            }),
            "llama3" => Ok(RopeScaling::Llama3 {
                factor: num("factor", 8.0),
                low_freq_factor: num("low_freq_factor", 1.0),
                high_freq_factor: num("high_freq_factor", 4.0),
                orig_ctx: orig.unwrap_or(8192),
            }),
            "yarn" => Ok(RopeScaling::Yarn {
                factor: num("factor", 1.0),
                orig_ctx: orig.unwrap_or(0),
                ext_factor: 1.0,
                attn_factor: num("attention_factor", 1.0),
                beta_fast: num("beta_fast", 32.0),
                beta_slow: num("beta_slow", 1.0),
            }),
            other => Err(ModelError::BadValue {
                key: "rope_scaling.rope_type".into(),
                what: format!("unsupported RoPE scaling `{other}`"),
            }),
        }
    }
}

/// A GGUF RoPE scaling description (`{arch}.rope.scaling.*`).
pub(crate) fn gguf_rope_scaling(keys: &GgufKeys) -> Result<RopeScaling> {
    let factor = keys.f32("rope.scaling.factor").unwrap_or(1.0);
    let orig_ctx = keys
        .u64("rope.scaling.original_context_length")
        .unwrap_or(0) as usize;
    match keys.str("rope.scaling.type").unwrap_or("none") {
        "none" => Ok(RopeScaling::None),
        "linear" if factor != 1.0 && factor != 0.0 => Ok(RopeScaling::Linear { factor }),
        "linear" => Ok(RopeScaling::None),
        "yarn" => Ok(RopeScaling::Yarn {
            factor,
            orig_ctx,
            ext_factor: keys.f32("rope.scaling.yarn_ext_factor").unwrap_or(1.0),
            attn_factor: keys.f32("rope.scaling.attn_factor").unwrap_or(1.0),
            beta_fast: keys.f32("rope.scaling.yarn_beta_fast").unwrap_or(32.0),
            beta_slow: keys.f32("rope.scaling.yarn_beta_slow").unwrap_or(1.0),
        }),
        other => Err(ModelError::BadValue {
            key: format!("{}.rope.scaling.type", keys.arch),
            what: format!("unsupported RoPE scaling `{other}`"),
        }),
    }
}

fn value_u64(v: &MetaValue) -> Option<u64> {
    match *v {
        MetaValue::U8(x) => Some(x as u64),
        MetaValue::U16(x) => Some(x as u64),
        MetaValue::U32(x) => Some(x as u64),
        MetaValue::U64(x) => Some(x),
        MetaValue::I8(x) => u64::try_from(x).ok(),
        MetaValue::I16(x) => u64::try_from(x).ok(),
        MetaValue::I32(x) => u64::try_from(x).ok(),
        MetaValue::I64(x) => u64::try_from(x).ok(),
        _ => None,
    }
}

fn value_f32(v: &MetaValue) -> Option<f32> {
    match *v {
        MetaValue::F32(x) => Some(x),
        MetaValue::F64(x) => Some(x as f32),
        MetaValue::I8(x) => Some(x as f32),
        MetaValue::I16(x) => Some(x as f32),
        MetaValue::I32(x) => Some(x as f32),
        MetaValue::I64(x) => Some(x as f32),
        ref other => value_u64(other).map(|x| x as f32),
    }
}

/// A metadata value as an unsigned integer (any integer type).
pub fn meta_u64(md: &Metadata, key: &str) -> Option<u64> {
    md.entries
        .iter()
        .find(|(k, _)| k == key)
        .and_then(|(_, v)| value_u64(v))
}

/// A metadata value as f32 (any numeric type).
pub fn meta_f32(md: &Metadata, key: &str) -> Option<f32> {
    md.entries
        .iter()
        .find(|(k, _)| k == key)
        .and_then(|(_, v)| value_f32(v))
}

/// A metadata string.
pub fn meta_str<'m>(md: &'m Metadata, key: &str) -> Option<&'m str> {
    md.entries
        .iter()
        .find(|(k, _)| k == key)
        .and_then(|(_, v)| match v {
            MetaValue::String(s) => Some(s.as_str()),
            _ => None,
        })
}
