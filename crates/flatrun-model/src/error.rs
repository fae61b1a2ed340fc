//! Errors of the model definitions (configs, manifests, architectures).

use std::path::PathBuf;

/// What can go wrong while reading hyperparameters, building a manifest or
/// running a decoder layer. Every variant names what it is about.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A required hyperparameter is absent.
    #[error("missing hyperparameter `{key}` (needed for architecture `{arch}`)")]
    MissingKey { arch: String, key: String },
    /// A hyperparameter has the wrong type or an impossible value.
    #[error("hyperparameter `{key}`: {what}")]
    BadValue { key: String, what: String },
    /// The checkpoint names an architecture this crate cannot run.
    #[error("unsupported architecture `{name}`; supported: {}", supported.join(", "))]
    UnsupportedArch {
        name: String,
        supported: Vec<&'static str>,
    },
    /// A tensor the architecture needs is absent from the checkpoint.
    #[error("architecture `{arch}` needs tensor `{tensor}`, which the checkpoint lacks")]
    MissingTensor { arch: String, tensor: String },
    /// A running layer asked for a tensor its weights do not hold.
    #[error("layer {layer} has no tensor `{tensor}`")]
    MissingLayerTensor { layer: usize, tensor: &'static str },
    /// A checkpoint that stores one tensor per expert holds an expert beyond
    /// the count its config declares.
    #[error("tensor `{tensor}` is expert {expert}, but the config declares {n_expert} experts")]
    ExtraExpert {
        tensor: String,
        expert: usize,
        n_expert: usize,
    },
    /// A tensor exists but has the wrong shape.
    #[error("tensor `{tensor}` has shape {shape:?}, expected {expected}")]
    BadShape {
        tensor: String,
        shape: Vec<usize>,
        expected: String,
    },
    /// The `config.json` of a Hugging Face checkpoint could not be read.
    #[error("{path}: {what}")]
    ConfigFile { path: PathBuf, what: String },
    /// The key/value cache of a layer has no room for the new positions.
    #[error(
        "KV cache of layer {layer} is full: capacity {capacity} tokens, position {position} requested"
    )]
    KvFull {
        layer: usize,
        capacity: usize,
        position: usize,
    },
    /// A kernel refused its input (shape mismatch, unsupported format…).
    #[error("layer {layer}, {op}: {what}")]
    Kernel {
        layer: usize,
        op: &'static str,
        what: String,
    },
    /// The tokenizer could not be built.
    #[error(transparent)]
    Tokenizer(#[from] crate::tokenizer::TokenizerError),
    /// The chat template could not be built.
    #[error(transparent)]
    ChatTemplate(#[from] crate::chat_template::TemplateError),
    /// Storage errors surfaced while reading a tensor.
    #[error(transparent)]
    Format(#[from] flatrun_format::FormatError),
}

pub type Result<T, E = ModelError> = std::result::Result<T, E>;
