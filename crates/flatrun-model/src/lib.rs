//! Model definitions for Flatrun: hyperparameters, architectures, the layer
//! manifest, tokenizers, chat templates and sampling.

pub mod arch;
pub mod checkpoint;
pub mod config;
pub mod error;
pub mod gguf_export;
pub mod manifest;
pub mod pooling;
pub use arch::{Architecture, Role, architecture};
pub use checkpoint::Checkpoint;
pub use config::{Arch, ModelConfig};
pub use error::ModelError;
pub use manifest::{ExpertCounts, Manifest};
pub use pooling::Pooling;

pub mod chat_template;
pub mod sampling;
pub mod tokenizer;
