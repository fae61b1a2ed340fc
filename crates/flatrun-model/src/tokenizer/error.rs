//! Errors of tokenizer construction, encoding and decoding.

use std::path::PathBuf;

/// Everything that can go wrong while building or running a [`super::Tokenizer`].
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// A required GGUF metadata key is absent.
    #[error("GGUF metadata key `{key}` is missing")]
    MissingKey { key: String },
    /// A GGUF metadata key has the wrong type or an invalid value.
    #[error("GGUF metadata key `{key}`: {what}")]
    BadMetadata { key: String, what: String },
    /// `tokenizer.ggml.model` names a tokenizer family Flatrun does not implement.
    #[error("unsupported tokenizer model `{0}` (supported: gpt2 BPE, llama SentencePiece)")]
    UnsupportedModel(String),
    /// A file of a Hugging Face tokenizer directory could not be read or parsed.
    #[error("{path}: {what}")]
    HfFile { path: PathBuf, what: String },
    /// The `tokenizers` crate rejected the model we built, or failed while encoding.
    #[error("tokenizer machinery: {0}")]
    Machinery(String),
    /// A pre-tokenizer regex failed to compile.
    #[error("pre-tokenizer `{pre}`: regex {index} does not compile: {what}")]
    BadRegex {
        pre: String,
        index: usize,
        what: String,
    },
    /// `decode` was given an id outside the vocabulary.
    #[error("token id {id} is outside the vocabulary of {vocab_size} tokens")]
    IdOutOfRange { id: u32, vocab_size: usize },
}
