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

//! The crate root is the whole public API: every module is private and
//! the items below are what callers use. [`Model`] and [`Session`] are the
//! usual entry points; [`StreamingExecutor`] is the layer scheduler under a
//! model, for callers that step several [`Sequence`]s themselves
//! ([`StreamingExecutor::step_batch`]).

mod error;
mod evaluate;
mod executor;
mod generate;
mod kv_cache;
mod layer_range;
mod layer_vectors;
mod memory;
mod model;
mod npy;
mod options;
mod profiler;
mod recurrent_state;
mod residency;
mod speculative;
mod weights;
mod weights_override;

// Loading and running a model.
pub use error::{Result, RuntimeError};
pub use executor::{
    KvShift, Sequence, SequenceCheckpoint, StepOptions, StepOutput, StreamingExecutor,
};
pub use generate::{GenerateOptions, Generation, Prompt, TokenEvent, argmax};
pub use model::{MemoryPlanner, Model, Session, default_residency};
pub use options::{
    BackendKind, ContextOverflow, ExpertPolicy, KvType, LoadOptions, MlxActivations, Prefetch,
    Residency, StreamReads,
};
pub use speculative::{DraftState, ProposerKind, Speculation, SpeculativeStats};

// What a loaded model reports about itself.
pub use kv_cache::{
    KvBacking, KvCache, KvLayout, LayerKvCache, LayerPages, PagesAhead, ShiftRefusal,
};
pub use layer_range::LayerSelection;
pub use profiler::{ExpertStats, LayerTimes, MemorySample, Profiler};
pub use residency::{FALLBACK_CONTEXT, MemoryPlan, ResidencyPlan, context_size};
pub use weights_override::WeightsMode;

// Helpers for command-line tools and tests: the process's resident set,
// `.npy` output, and byte sizes such as `512M`.
pub use memory::{RssSample, cgroup_headroom, mapped_file_rss, memory_headroom, rss};
pub use npy::write_f32_matrix;
pub use options::parse_size;
pub use residency::human_bytes;

// The model-side types that appear in this API.
pub use flatrun_model::chat_template::{ChatMessage, ChatTemplate};
pub use flatrun_model::sampling::{FinishReason, SamplingParams};
pub use flatrun_model::tokenizer::Tokenizer;
pub use flatrun_model::{Arch, Manifest, ModelConfig};
