//! The runtime's error type.

use std::path::PathBuf;

/// Everything that can go wrong while loading or running a model. Each
/// variant carries what it is about (file, layer, sizes).
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    /// The checkpoint could not be opened or a tensor could not be read.
    #[error("{0}")]
    Format(#[from] flatrun_format::FormatError),
    /// Hyperparameters, manifest or a decoder layer failed.
    #[error("{0}")]
    Model(#[from] flatrun_model::ModelError),
    /// A kernel refused an embedding lookup or the output head.
    #[error("{tensor}: {source}")]
    Kernel {
        tensor: String,
        #[source]
        source: flatrun_kernels::KernelError,
    },
    /// Reading a streamed layer or head chunk (capped residency) failed.
    #[error("{tensor}: streamed read: {what}")]
    StreamRead { tensor: String, what: String },
    /// The sequence would grow past its KV cache.
    #[error(
        "context overflow: {used} tokens in the sequence + {new} new > context size {capacity}"
    )]
    ContextOverflow {
        used: usize,
        new: usize,
        capacity: usize,
    },
    /// A context shift that asks for more positions than the sequence has.
    #[error("context shift: keeping {keep} and dropping {dropped} of a sequence of {len} tokens")]
    Shift {
        keep: usize,
        dropped: usize,
        len: usize,
    },
    /// A token id outside the vocabulary.
    #[error("token id {id} is outside the vocabulary of {vocab} tokens")]
    BadToken { id: u32, vocab: usize },
    /// Embeddings asked of a model whose `pooling_type` gives no sequence
    /// vector (`none`: one per token; `rank`: a reranker's score).
    #[error("the model's pooling type is `{0}`: it gives no sequence embedding")]
    Pooling(&'static str),
    /// A step with no tokens.
    #[error("a step needs at least one token")]
    EmptyStep,
    /// The tokenizer failed or is missing.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// The chat template failed or is missing.
    #[error("chat template: {0}")]
    ChatTemplate(String),
    /// A checkpoint side file (`config.json`) is unreadable.
    #[error("{path}: {what}")]
    Config { path: PathBuf, what: String },
    /// A draft model that cannot propose for this target: its tokenizer
    /// differs, or none is attached.
    #[error("draft model: {0}")]
    Draft(String),
    /// The memory plan does not fit (checked before loading).
    #[error("memory plan: {0}")]
    MemoryPlan(String),
    /// A bad option value (`--residency cap=…`).
    #[error("invalid option {option}: {what}")]
    Option { option: &'static str, what: String },
    /// Writing a profile or a logits dump failed.
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

pub type Result<T, E = RuntimeError> = std::result::Result<T, E>;
