//! The f32 operations of a decoder layer besides the projections.

mod activation;
mod attention;
mod elementwise;
mod hadamard;
mod norm;
mod rope;
mod rows;
mod softmax;

pub use activation::{geglu, gelu_tanh, silu, swiglu, swiglu_oai};
pub use attention::{
    AttnConfig, KvPager, KvPart, KvSlice, PAGED_RUN_SLOTS, PAGED_SCORE_BYTES, attention,
    attention_paged, attention_with_sinks,
};
pub use elementwise::{add, scale};
pub use hadamard::hadamard;
pub use norm::{rms_norm, rms_norm_rows};
pub use rope::{RopeConfig, RopeLayout, RopeScaling, llama3_freq_factors, rope, rope_shift};
pub use softmax::{ggml_expf, softmax};
