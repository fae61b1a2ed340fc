//! The weights override (`--weights keep|f16|f32`): run the decoder layers'
//! matrices from quantized blocks with the fused kernels (`keep`, the
//! default), or dequantize them once at load into anonymous f16 or f32
//! buffers that the kernels' F16/F32 paths then read.
//!
//! Only resident layers can be dequantized. A streamed layer is re-read
//! from storage at every acquisition precisely because its quantized bytes
//! are small; dequantizing it on every acquisition would multiply the bytes
//! touched per token (×3.6 to f16, ×7 to f32 for Q4_1) and add a full
//! dequantization pass per layer per step, and keeping the dense copy would
//! break the residency budget. So a plan that streams any layer that runs
//! is refused with an error that says so. The embedding and the output
//! head stay as stored.
//!
//! ```
//! use flatrun_runtime::WeightsMode;
//!
//! let mode: WeightsMode = "f16".parse().unwrap();
//! assert_eq!(mode, WeightsMode::F16);
//! assert_eq!(mode.to_string(), "f16");
//! assert!("q8".parse::<WeightsMode>().is_err());
//! ```

use crate::error::{Result, RuntimeError};
use crate::layer_range::LayerSelection;
use crate::memory;
use crate::residency::ResidencyPlan;
use flatrun_format::{GgmlType, StorageBackend};
use flatrun_kernels::{KernelError, Kernels, Weight, WeightFormat};
use flatrun_model::Role;
use half::f16;
use std::str::FromStr;

/// What the decoder layers' matrices are run from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WeightsMode {
    /// The checkpoint's blocks, through the fused dequant×matmul kernels.
    #[default]
    Keep,
    /// Dequantized once at load to f16.
    F16,
    /// Dequantized once at load to f32.
    F32,
}

impl std::fmt::Display for WeightsMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            WeightsMode::Keep => "keep",
            WeightsMode::F16 => "f16",
            WeightsMode::F32 => "f32",
        })
    }
}

impl FromStr for WeightsMode {
    type Err = RuntimeError;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "keep" => Ok(WeightsMode::Keep),
            "f16" => Ok(WeightsMode::F16),
            "f32" => Ok(WeightsMode::F32),
            other => Err(RuntimeError::Option {
                option: "weights",
                what: format!("`{other}` (expected keep, f16 or f32)"),
            }),
        }
    }
}

/// The values of one dequantized matrix.
#[derive(Debug)]
enum DenseValues {
    F16(Vec<f16>),
    F32(Vec<f32>),
}

/// One matrix, dequantized: `rows × cols`, row-major.
#[derive(Debug)]
pub(crate) struct DenseMatrix {
    rows: usize,
    cols: usize,
    values: DenseValues,
}

impl DenseMatrix {
    /// The matrix as a weight the kernels' F16/F32 paths read.
    pub(crate) fn weight(&self) -> std::result::Result<Weight<'_>, KernelError> {
        let (format, data): (GgmlType, &[u8]) = match &self.values {
            DenseValues::F16(v) => (GgmlType::F16, bytemuck::cast_slice(v)),
            DenseValues::F32(v) => (GgmlType::F32, bytemuck::cast_slice(v)),
        };
        Weight::new(
            WeightFormat::Ggml(format),
            self.rows,
            self.cols,
            data,
            None,
            None,
        )
    }

    fn bytes(&self) -> u64 {
        match &self.values {
            DenseValues::F16(v) => v.len() as u64 * 2,
            DenseValues::F32(v) => v.len() as u64 * 4,
        }
    }
}

/// The dequantized matrices of every layer that has them (index = layer;
/// matrices in the order of the layer's list given to [`DenseLayers::build`]).
#[derive(Debug, Default)]
pub(crate) struct DenseLayers {
    layers: Vec<Option<Vec<DenseMatrix>>>,
    bytes: u64,
}

/// Rows dequantized at a time when converting to f16 (bounds the f32 scratch).
const F16_CHUNK_ROWS: usize = 64;

impl DenseLayers {
    /// Dequantize the matrices `layers[il]` (role, canonical name) of every
    /// layer of `selection` as `mode` asks; nothing for [`WeightsMode::Keep`].
    pub(crate) fn build(
        mode: WeightsMode,
        backend: &dyn StorageBackend,
        kernels: &dyn Kernels,
        layers: &[Vec<(Role, String)>],
        plan: &ResidencyPlan,
        selection: &LayerSelection,
    ) -> Result<DenseLayers> {
        let n_layer = layers.len();
        let mut dense = DenseLayers {
            layers: (0..n_layer).map(|_| None).collect(),
            bytes: 0,
        };
        if mode == WeightsMode::Keep {
            return Ok(dense);
        }
        if let Some(il) = (0..n_layer).find(|&il| selection.runs(il) && !plan.is_resident(il)) {
            return Err(RuntimeError::Option {
                option: "weights",
                what: format!(
                    "--weights {mode} needs every layer resident, but the residency plan streams layer {il}: \
                     a streamed layer would be dequantized again at every acquisition \
                     (several times the bytes per token) and a kept dense copy would break the memory budget; \
                     use --residency resident or --weights keep"
                ),
            });
        }
        for (il, slot) in dense.layers.iter_mut().enumerate() {
            if !selection.runs(il) {
                continue;
            }
            let mut matrices = Vec::with_capacity(layers[il].len());
            for (_, name) in &layers[il] {
                let matrix = dequantize(backend, kernels, name, mode)?;
                dense.bytes += matrix.bytes();
                matrices.push(matrix);
            }
            *slot = Some(matrices);
        }
        Ok(dense)
    }

    /// Layer `il`'s dense matrices, when it has them.
    pub(crate) fn layer(&self, il: usize) -> Option<&[DenseMatrix]> {
        self.layers.get(il).and_then(|l| l.as_deref())
    }

    /// Bytes of all dense buffers.
    pub(crate) fn bytes(&self) -> u64 {
        self.bytes
    }
}

/// Dequantize tensor `name` into a dense matrix, then give its mapped pages back.
fn dequantize(
    backend: &dyn StorageBackend,
    kernels: &dyn Kernels,
    name: &str,
    mode: WeightsMode,
) -> Result<DenseMatrix> {
    let handle = backend.tensor(name)?;
    let kernel_error = |source| RuntimeError::Kernel {
        tensor: name.to_string(),
        source,
    };
    let w = Weight::from_handle(&handle).map_err(kernel_error)?;
    let (rows, cols) = (w.rows, w.cols);
    let values = match mode {
        WeightsMode::F32 | WeightsMode::Keep => {
            let mut out = vec![0.0f32; rows * cols];
            kernels
                .dequantize_rows(&w, 0..rows, &mut out)
                .map_err(kernel_error)?;
            DenseValues::F32(out)
        }
        WeightsMode::F16 => {
            let mut out = Vec::with_capacity(rows * cols);
            let mut scratch = vec![0.0f32; F16_CHUNK_ROWS.min(rows) * cols];
            let mut r0 = 0;
            while r0 < rows {
                let r1 = (r0 + F16_CHUNK_ROWS).min(rows);
                let part = &mut scratch[..(r1 - r0) * cols];
                kernels
                    .dequantize_rows(&w, r0..r1, part)
                    .map_err(kernel_error)?;
                out.extend(part.iter().map(|&x| f16::from_f32(x)));
                r0 = r1;
            }
            DenseValues::F16(out)
        }
    };
    memory::release(handle.bytes());
    Ok(DenseMatrix { rows, cols, values })
}
