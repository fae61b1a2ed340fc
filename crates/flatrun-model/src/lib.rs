//! Model definitions for Flatrun: hyperparameters, architectures, the layer
//! manifest, tokenizers, chat templates and sampling.

// Runtime engineer's modules.
pub mod arch;
pub mod config;
pub mod error;
pub mod manifest;
pub use config::{Arch, ModelConfig};
pub use error::ModelError;
pub use manifest::Manifest;

// Tokenizer engineer's modules.
pub mod chat_template;
pub mod sampling;
pub mod tokenizer;
