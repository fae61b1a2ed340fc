//! Flatrun's streaming runtime: load a GGUF, SafeTensors or MLX checkpoint
//! and run it layer by layer straight from storage.
//!
//! Only the executing decoder layer (plus the KV cache) needs to be resident
//! ([`Residency::Stream`]); [`Residency::Cap`] keeps as many layers as fit in
//! a budget and [`Residency::Resident`] keeps everything. A background thread
//! reads the next layers ahead ([`Prefetch`]), and the [`Profiler`] reports
//! per-layer and per-op timings, the I/O wait, and memory.
//!
//! ```no_run
//! use flatrun_runtime::{GenerateOptions, LoadOptions, Model, Residency};
//!
//! # fn main() -> Result<(), flatrun_runtime::RuntimeError> {
//! let mut model = Model::load(
//!     "SmolLM2-135M-Instruct.Q4_1.gguf",
//!     LoadOptions { residency: Residency::Stream, ..LoadOptions::default() },
//! )?;
//! for event in model.generate("The capital of France is", GenerateOptions::greedy(16))? {
//!     print!("{}", event?.text);
//! }
//! # Ok(())
//! # }
//! ```

pub mod error;
pub mod executor;
pub mod generate;
pub mod kv_cache;
pub mod layer_range;
mod layer_vectors;
pub mod memory;
pub mod model;
pub mod npy;
pub mod options;
pub mod profiler;
pub mod recurrent_state;
pub mod residency;
mod weights;
pub mod weights_override;

pub use error::{Result, RuntimeError};
pub use executor::{Sequence, StepOptions, StepOutput, StreamingExecutor};
pub use generate::{FinishReason, GenerateOptions, Generation, Prompt, TokenEvent, argmax};
pub use layer_range::LayerSelection;
pub use model::{Model, Session};
pub use options::{BackendKind, KvType, LoadOptions, Prefetch, Residency, StreamReads};
pub use profiler::Profiler;
pub use residency::ResidencyPlan;
pub use weights_override::WeightsMode;

pub use flatrun_model::chat_template::{ChatMessage, ChatTemplate};
pub use flatrun_model::sampling::SamplingParams;
pub use flatrun_model::tokenizer::Tokenizer;
pub use flatrun_model::{Arch, Manifest, ModelConfig};
