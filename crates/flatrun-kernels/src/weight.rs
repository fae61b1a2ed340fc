//! [`Weight`]: what a weight matrix looks like to a kernel.

use std::ops::Range;

use flatrun_format::{DType, GgmlType, QuantDescriptor, TensorHandle};

use crate::KernelError;
use crate::error::dtype_name;

/// How the bytes of a weight matrix encode its values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightFormat {
    /// Plain F32/F16/BF16 or a GGML block quantization along each row.
    Ggml(GgmlType),
    /// MLX affine quantization `w = scale * q + bias`: `bits`-bit values packed
    /// little-endian in u32 words, one scale and one bias per `group_size` values,
    /// stored as `scale_dtype` (F16, BF16 or F32) in [`Weight::scales`] / [`Weight::biases`].
    MlxAffine {
        bits: u8,
        group_size: u32,
        scale_dtype: DType,
    },
}

impl std::fmt::Display for WeightFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WeightFormat::Ggml(t) => f.write_str(t.traits().name),
            WeightFormat::MlxAffine {
                bits,
                group_size,
                scale_dtype,
            } => write!(f, "MLX{bits}/g{group_size}/{}", dtype_name(*scale_dtype)),
        }
    }
}

/// A weight matrix: `rows` output features by `cols` input features, `cols`
/// being the contiguous axis. Borrowed, zero-copy, usually straight from a mapping.
#[derive(Clone, Copy, Debug)]
pub struct Weight<'a> {
    pub format: WeightFormat,
    pub rows: usize,
    pub cols: usize,
    /// The packed values (blocks, or MLX u32 words), `rows * row_bytes()` bytes.
    pub data: &'a [u8],
    /// MLX scales (`rows * cols / group_size` values of `scale_dtype`).
    pub scales: Option<&'a [u8]>,
    /// MLX biases (same shape as the scales).
    pub biases: Option<&'a [u8]>,
}

/// Byte size of one scalar of an MLX scale dtype.
pub(crate) fn scale_dtype_size(d: DType) -> Option<usize> {
    match d {
        DType::Ggml(GgmlType::F16) | DType::Ggml(GgmlType::BF16) => Some(2),
        DType::Ggml(GgmlType::F32) => Some(4),
        _ => None,
    }
}

impl<'a> Weight<'a> {
    /// A weight over raw bytes, checked like [`Weight::from_handle`].
    pub fn new(
        format: WeightFormat,
        rows: usize,
        cols: usize,
        data: &'a [u8],
        scales: Option<&'a [u8]>,
        biases: Option<&'a [u8]>,
    ) -> Result<Self, KernelError> {
        let w = Weight {
            format,
            rows,
            cols,
            data,
            scales,
            biases,
        };
        w.validate()?;
        Ok(w)
    }

    /// View a storage tensor as a weight: shape `[rows, cols]`, `[cols]` as
    /// one row, or a stack `[n, rows, cols]` (a mixture-of-experts layer's
    /// experts) as `n * rows` rows, matrix `i` being rows `i*rows..(i+1)*rows`.
    pub fn from_handle(h: &TensorHandle<'a>) -> Result<Self, KernelError> {
        let (rows, cols) = match *h.shape() {
            [cols] => (1, cols),
            [rows, cols] => (rows, cols),
            [n, rows, cols] => (n * rows, cols),
            _ => {
                return Err(KernelError::BadShape {
                    tensor: h.name().to_string(),
                    shape: h.shape().to_vec(),
                });
            }
        };
        let format = match (h.quant(), h.dtype()) {
            (QuantDescriptor::Ggml(t), _) | (QuantDescriptor::None, DType::Ggml(t)) => {
                WeightFormat::Ggml(t)
            }
            (
                QuantDescriptor::MlxAffine {
                    bits,
                    group_size,
                    scale_dtype,
                },
                _,
            ) => WeightFormat::MlxAffine {
                bits,
                group_size,
                scale_dtype,
            },
            (QuantDescriptor::None, other) => {
                return Err(KernelError::UnsupportedFormat {
                    tensor: h.name().to_string(),
                    format: dtype_name(other),
                });
            }
        };
        let w = Weight {
            format,
            rows,
            cols,
            data: h.bytes(),
            scales: h.part("scales"),
            biases: h.part("biases"),
        };
        w.validate().map_err(|e| match e {
            KernelError::UnsupportedFormat { format, .. } => KernelError::UnsupportedFormat {
                tensor: h.name().to_string(),
                format,
            },
            other => other,
        })?;
        Ok(w)
    }

    /// Bytes of one row of [`Weight::data`].
    pub fn row_bytes(&self) -> usize {
        match self.format {
            WeightFormat::Ggml(t) => self.cols / t.block_size().max(1) * t.type_size(),
            WeightFormat::MlxAffine { bits, .. } => self.cols * bits as usize / 8,
        }
    }

    /// Bytes of one row of the MLX scales (and of the biases); 0 for GGML formats.
    pub fn scale_row_bytes(&self) -> usize {
        match self.format {
            WeightFormat::Ggml(_) => 0,
            WeightFormat::MlxAffine {
                group_size,
                scale_dtype,
                ..
            } => {
                self.cols / (group_size.max(1) as usize)
                    * scale_dtype_size(scale_dtype).unwrap_or(0)
            }
        }
    }

    /// The sub-matrix of rows `r`, zero-copy (for streaming a big output head in chunks).
    pub fn row_range(&self, r: Range<usize>) -> Result<Weight<'a>, KernelError> {
        if r.start > r.end || r.end > self.rows {
            return Err(KernelError::RowRange {
                format: self.format.to_string(),
                rows: self.rows,
                cols: self.cols,
                start: r.start,
                end: r.end,
            });
        }
        let rb = self.row_bytes();
        let sb = self.scale_row_bytes();
        let data = &self.data[r.start * rb..r.end * rb];
        let scales = self.scales.map(|s| &s[r.start * sb..r.end * sb]);
        let biases = self.biases.map(|b| &b[r.start * sb..r.end * sb]);
        Ok(Weight {
            format: self.format,
            rows: r.len(),
            cols: self.cols,
            data,
            scales,
            biases,
        })
    }

    fn byte_error(&self, what: &'static str, expected: usize, got: usize) -> KernelError {
        KernelError::ByteLength {
            format: self.format.to_string(),
            rows: self.rows,
            cols: self.cols,
            what,
            expected,
            got,
        }
    }

    /// Check that the format is known and every byte length matches the shape.
    pub(crate) fn validate(&self) -> Result<(), KernelError> {
        let unsupported = || KernelError::UnsupportedFormat {
            tensor: String::new(),
            format: self.format.to_string(),
        };
        let block = match self.format {
            WeightFormat::Ggml(t) => {
                if !crate::decode::is_supported(t) {
                    return Err(unsupported());
                }
                t.block_size()
            }
            WeightFormat::MlxAffine { group_size, .. } => {
                if crate::decode::mlx_params(self.format).is_err() {
                    return Err(unsupported());
                }
                // A group fills whole bytes for every supported bit width.
                group_size as usize
            }
        };
        if block == 0 || !self.cols.is_multiple_of(block) {
            return Err(KernelError::RaggedRow {
                format: self.format.to_string(),
                rows: self.rows,
                cols: self.cols,
                block,
            });
        }
        let expected = self.rows * self.row_bytes();
        if self.data.len() != expected {
            return Err(self.byte_error("data", expected, self.data.len()));
        }
        if let WeightFormat::MlxAffine { .. } = self.format {
            let expected = self.rows * self.scale_row_bytes();
            for (what, part) in [("scales", self.scales), ("biases", self.biases)] {
                let got = part.map_or(0, |p| p.len());
                if got != expected {
                    return Err(self.byte_error(what, expected, got));
                }
            }
        }
        Ok(())
    }
}
