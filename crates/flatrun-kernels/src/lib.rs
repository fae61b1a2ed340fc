//! Every numeric operation of Flatrun's forward pass.
//!
//! Weight matrices are multiplied through a [`Kernels`] backend:
//! - [`BackendKind::Reference`]: dequantize each row to f32, then a plain dot
//!   product. Short, obviously correct, the yardstick.
//! - [`BackendKind::Native`]: fused dequantize×dot kernels that never
//!   materialize f32 weights; activations are quantized once per call to the
//!   format's integer dot partner (Q8_0/Q8_1/Q8_K), the SIMD level (AVX2,
//!   AVX-512 VNNI, NEON dotprod, or scalar) is picked once at run time, and rows
//!   are split over a persistent spinning thread pool ([`set_threads`]).
//!
//! The other f32 operations of a decoder layer (RMSNorm, RoPE, softmax,
//! activations, attention) live in [`ops`].
//!
//! ```
//! use flatrun_format::GgmlType;
//! use flatrun_kernels::{backend, BackendKind, Weight, WeightFormat};
//!
//! // A 2×32 F32 matrix: row 0 all ones, row 1 all twos.
//! let values: Vec<f32> = (0..64).map(|i| if i < 32 { 1.0 } else { 2.0 }).collect();
//! let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
//! let w = Weight::new(WeightFormat::Ggml(GgmlType::F32), 2, 32, &bytes, None, None).unwrap();
//!
//! let x = vec![0.5f32; 32];
//! let mut out = vec![0f32; 2];
//! backend(BackendKind::Native).matmul(&w, &x, 1, &mut out).unwrap();
//! assert_eq!(out, vec![16.0, 32.0]);
//! ```

mod call_order;
mod check;
mod decode;
mod error;
pub mod native;
pub mod ops;
pub mod reference;
mod shared_input;
mod simd;
mod threads;
mod weight;

use std::ops::Range;
use std::str::FromStr;
use std::sync::{Arc, OnceLock};

pub use call_order::with_one_token_order;
pub use check::check_output_list;
pub use error::KernelError;
pub use native::NativeKernels;
pub use reference::ReferenceKernels;
pub use shared_input::with_shared_input;
pub use simd::{SimdLevel, clamp_to_host, simd_level, supported_levels};
pub use threads::{physical_cores, set_threads, threads};
pub use weight::{Weight, WeightFormat};

/// Which implementation of [`Kernels`] to use.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum BackendKind {
    /// Dequantize-then-dot, scalar, single-threaded.
    Reference,
    /// Fused, SIMD, multi-threaded (the default).
    #[default]
    Native,
}

/// How the native backend multiplies MLX affine weights.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum MlxActivations {
    /// The format's numerics, as mlx-lm computes them: weights dequantized in
    /// registers (`s·q + b`) times f32 activations, f32 sums (the default).
    #[default]
    F32,
    /// ggml's numerics: activations quantized to Q8 blocks of 32, integer dots
    /// (4- and 8-bit layouts; the others run the float kernels). An MLX copy of
    /// a Q4_1/Q8_0 GGUF then gives llama.cpp's logits bit for bit.
    Q8,
}

impl FromStr for MlxActivations {
    type Err = KernelError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "f32" | "float" => Ok(MlxActivations::F32),
            "q8" => Ok(MlxActivations::Q8),
            other => Err(KernelError::Parse {
                what: "MLX activations",
                got: other.to_string(),
                expected: "f32, q8",
            }),
        }
    }
}

impl FromStr for BackendKind {
    type Err = KernelError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "reference" | "ref" => Ok(BackendKind::Reference),
            "native" => Ok(BackendKind::Native),
            other => Err(KernelError::Parse {
                what: "backend",
                got: other.to_string(),
                expected: "reference, native",
            }),
        }
    }
}

/// Matrix kernels over a [`Weight`].
pub trait Kernels: Send + Sync {
    fn name(&self) -> &'static str;
    /// `out[t*rows + r] = sum_c W[r][c] * x[t*cols + c]` for `t in 0..n_tokens`
    /// (`x`: `n_tokens*cols` f32, `out`: `n_tokens*rows` f32).
    /// `n_tokens == 1` is the GEMV path; more tokens take the GEMM path, which
    /// decodes each weight block once per token tile.
    fn matmul(
        &self,
        w: &Weight,
        x: &[f32],
        n_tokens: usize,
        out: &mut [f32],
    ) -> Result<(), KernelError>;
    /// Several products of the same activations: `outs[i] = x·ws[i]ᵀ` (e.g. Q, K and V,
    /// or gate and up). The native backend runs them as one pool job, so the threads
    /// meet once instead of once per matrix; the results are those of [`Kernels::matmul`].
    fn matmul_many(
        &self,
        ws: &[&Weight],
        x: &[f32],
        n_tokens: usize,
        outs: &mut [&mut [f32]],
    ) -> Result<(), KernelError> {
        check_output_list(ws, outs.len())?;
        for (w, out) in ws.iter().zip(outs.iter_mut()) {
            self.matmul(w, x, n_tokens, out)?;
        }
        Ok(())
    }
    /// A layer's router chose `experts` (ascending, each once) for the
    /// tokens whose residual stream is `hidden` (`n_tokens × n_embd`),
    /// before any of their products run. Kernels that read experts from
    /// storage start on them here (and on a prediction of the next
    /// layer's); the default does nothing.
    fn routed(&self, _hidden: &[f32], _experts: &[u32]) {}
    /// Dequantize rows `rows` of `w` into `out` (`rows.len() * cols` values), e.g. embedding lookups.
    fn dequantize_rows(
        &self,
        w: &Weight,
        rows: Range<usize>,
        out: &mut [f32],
    ) -> Result<(), KernelError>;
}

/// The shared backend of this kind (the native one at [`simd_level`]).
pub fn backend(kind: BackendKind) -> Arc<dyn Kernels> {
    backend_with(kind, MlxActivations::default())
}

/// [`backend`] with the native backend's MLX numerics chosen (the reference
/// backend always multiplies decoded weights by f32 activations).
pub fn backend_with(kind: BackendKind, mlx: MlxActivations) -> Arc<dyn Kernels> {
    static REFERENCE: OnceLock<Arc<ReferenceKernels>> = OnceLock::new();
    static NATIVE: OnceLock<Arc<NativeKernels>> = OnceLock::new();
    static NATIVE_MLX_Q8: OnceLock<Arc<NativeKernels>> = OnceLock::new();
    match (kind, mlx) {
        (BackendKind::Reference, _) => REFERENCE.get_or_init(|| Arc::new(ReferenceKernels)).clone(),
        (BackendKind::Native, MlxActivations::F32) => NATIVE
            .get_or_init(|| Arc::new(NativeKernels::new(simd_level())))
            .clone(),
        (BackendKind::Native, MlxActivations::Q8) => NATIVE_MLX_Q8
            .get_or_init(|| {
                Arc::new(NativeKernels::with_mlx_activations(
                    simd_level(),
                    MlxActivations::Q8,
                ))
            })
            .clone(),
    }
}
