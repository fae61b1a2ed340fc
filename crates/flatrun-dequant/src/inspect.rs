//! Helpers for `flatrun inspect --tensor NAME [--dump FILE.npy]`: value
//! statistics of a decoded tensor and an f32 `.npy` writer.

use std::fmt;
use std::io::Write;
use std::path::Path;

use crate::error::{DequantError, Result};

/// How many leading values [`Stats`] keeps.
pub const FIRST_VALUES: usize = 8;

/// Statistics of a decoded tensor. NaN and infinite values are counted and
/// left out of min/max/mean/std.
#[derive(Clone, Debug, PartialEq)]
pub struct Stats {
    /// Number of values.
    pub count: usize,
    pub min: f32,
    pub max: f32,
    pub mean: f64,
    /// Population standard deviation.
    pub std: f64,
    pub nan_count: usize,
    pub inf_count: usize,
    /// The first [`FIRST_VALUES`] values.
    pub first: Vec<f32>,
}

/// Statistics of `values` (one pass, f64 accumulation).
pub fn stats(values: &[f32]) -> Stats {
    let (mut min, mut max) = (f32::INFINITY, f32::NEG_INFINITY);
    let (mut sum, mut sum_sq) = (0f64, 0f64);
    let (mut nan_count, mut inf_count, mut finite) = (0, 0, 0usize);
    for &v in values {
        if v.is_nan() {
            nan_count += 1;
        } else if v.is_infinite() {
            inf_count += 1;
        } else {
            min = min.min(v);
            max = max.max(v);
            sum += v as f64;
            sum_sq += v as f64 * v as f64;
            finite += 1;
        }
    }
    let (mean, std) = if finite > 0 {
        let mean = sum / finite as f64;
        (mean, (sum_sq / finite as f64 - mean * mean).max(0.0).sqrt())
    } else {
        (f64::NAN, f64::NAN)
    };
    if finite == 0 {
        (min, max) = (f32::NAN, f32::NAN);
    }
    Stats {
        count: values.len(),
        min,
        max,
        mean,
        std,
        nan_count,
        inf_count,
        first: values.iter().take(FIRST_VALUES).copied().collect(),
    }
}

impl fmt::Display for Stats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "count {}  min {:.6}  max {:.6}  mean {:.6}  std {:.6}",
            self.count, self.min, self.max, self.mean, self.std
        )?;
        if self.nan_count + self.inf_count > 0 {
            write!(f, "  nan {}  inf {}", self.nan_count, self.inf_count)?;
        }
        write!(f, "\nfirst values: {:?}", self.first)
    }
}

/// The `.npy` (format 1.0) header for a little-endian f32 C-order array.
pub fn npy_header_f32(shape: &[usize]) -> Vec<u8> {
    let dims = match shape {
        [] => "()".to_owned(),
        [n] => format!("({n},)"),
        _ => format!(
            "({})",
            shape
                .iter()
                .map(|d| d.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    };
    let mut dict = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': {dims}, }}");
    // Magic (6) + version (2) + length (2) + dict + '\n', padded to 64 bytes.
    let unpadded = 10 + dict.len() + 1;
    dict.push_str(&" ".repeat((64 - unpadded % 64) % 64));
    dict.push('\n');
    let mut out = Vec::with_capacity(10 + dict.len());
    out.extend_from_slice(b"\x93NUMPY\x01\x00");
    out.extend_from_slice(&(dict.len() as u16).to_le_bytes());
    out.extend_from_slice(dict.as_bytes());
    out
}

/// Write `data` as an f32 `.npy` file of row-major `shape`.
pub fn write_npy_f32(path: &Path, shape: &[usize], data: &[f32]) -> Result<()> {
    let mut w = NpyWriter::create(path, shape)?;
    w.write(data)?;
    w.finish()
}

/// Writes an f32 `.npy` file piece by piece (e.g. a big tensor decoded in
/// row chunks), checking at the end that exactly `shape`'s count was written.
pub struct NpyWriter {
    path: std::path::PathBuf,
    out: std::io::BufWriter<std::fs::File>,
    expected: usize,
    written: usize,
}

impl NpyWriter {
    /// Create `path` and write the header for `shape`.
    pub fn create(path: &Path, shape: &[usize]) -> Result<NpyWriter> {
        let io = |source| DequantError::Io {
            path: path.to_owned(),
            source,
        };
        let file = std::fs::File::create(path).map_err(io)?;
        let mut out = std::io::BufWriter::new(file);
        out.write_all(&npy_header_f32(shape)).map_err(io)?;
        Ok(NpyWriter {
            path: path.to_owned(),
            out,
            expected: shape.iter().product(),
            written: 0,
        })
    }

    /// Append values (little-endian f32).
    pub fn write(&mut self, values: &[f32]) -> Result<()> {
        if self.written + values.len() > self.expected {
            return Err(self.size_error(self.written + values.len()));
        }
        let mut buf = [0u8; 4096];
        for chunk in values.chunks(buf.len() / 4) {
            for (b, v) in buf.chunks_exact_mut(4).zip(chunk) {
                b.copy_from_slice(&v.to_le_bytes());
            }
            self.out
                .write_all(&buf[..4 * chunk.len()])
                .map_err(|source| DequantError::Io {
                    path: self.path.clone(),
                    source,
                })?;
        }
        self.written += values.len();
        Ok(())
    }

    /// Flush, checking that the whole shape was written.
    pub fn finish(mut self) -> Result<()> {
        if self.written != self.expected {
            return Err(self.size_error(self.written));
        }
        self.out.flush().map_err(|source| DequantError::Io {
            path: self.path.clone(),
            source,
        })
    }

    fn size_error(&self, got: usize) -> DequantError {
        DequantError::OutputSize {
            what: format!("{}: .npy values", self.path.display()),
            expected: self.expected,
            got,
        }
    }
}
