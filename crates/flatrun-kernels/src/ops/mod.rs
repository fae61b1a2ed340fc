//! The f32 operations of a decoder layer besides the projections.

mod activation;
mod attention;
mod elementwise;
mod norm;
mod rope;
mod rows;
mod softmax;

pub use activation::{geglu, gelu_tanh, silu, swiglu};
pub use attention::{attention, AttnConfig, KvSlice};
pub use elementwise::{add, scale};
pub use norm::{rms_norm, rms_norm_rows};
pub use rope::{llama3_freq_factors, rope, RopeConfig, RopeLayout, RopeScaling};
pub use softmax::{ggml_expf, softmax};
