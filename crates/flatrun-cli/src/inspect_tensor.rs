//! `flatrun inspect PATH --tensor NAME [--dump FILE.npy]`: decode one tensor
//! (any storage dtype or quantization) to f32, print its value statistics and
//! optionally write it as a row-major f32 `.npy`.
//!
//! The tensor is decoded in row chunks, so a 150k-row output head never needs
//! more than one chunk of f32 in memory.

use std::path::Path;

use anyhow::{Context, Result, bail};
use flatrun_dequant::inspect::{FIRST_VALUES, NpyWriter};
use serde::Serialize;

/// Values decoded per chunk (about 16 MiB of f32).
const CHUNK_VALUES: usize = 1 << 22;

/// What `--tensor` reports.
#[derive(Debug, Serialize)]
pub struct TensorReport {
    pub name: String,
    pub original_name: String,
    pub dtype: String,
    pub shape: Vec<usize>,
    pub bytes: u64,
    pub count: u64,
    pub min: f32,
    pub max: f32,
    pub mean: f64,
    pub std: f64,
    pub nan_count: u64,
    pub inf_count: u64,
    pub first: Vec<f32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dumped_to: Option<String>,
}

/// Running statistics over chunks (f64 accumulation; NaN/Inf counted apart).
#[derive(Default)]
struct Accumulator {
    count: u64,
    finite: u64,
    min: f32,
    max: f32,
    sum: f64,
    sum_sq: f64,
    nan: u64,
    inf: u64,
    first: Vec<f32>,
}

impl Accumulator {
    fn push(&mut self, values: &[f32]) {
        if self.count == 0 {
            self.min = f32::INFINITY;
            self.max = f32::NEG_INFINITY;
        }
        let room = FIRST_VALUES.saturating_sub(self.first.len());
        self.first.extend(values.iter().take(room));
        self.count += values.len() as u64;
        for &v in values {
            if v.is_nan() {
                self.nan += 1;
            } else if v.is_infinite() {
                self.inf += 1;
            } else {
                self.finite += 1;
                self.min = self.min.min(v);
                self.max = self.max.max(v);
                self.sum += v as f64;
                self.sum_sq += v as f64 * v as f64;
            }
        }
    }
}

/// Decode `name` from the checkpoint at `path`.
pub fn inspect_tensor(path: &Path, name: &str, dump: Option<&Path>) -> Result<TensorReport> {
    let backend =
        flatrun_format::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let handle = backend.tensor(name).with_context(|| {
        format!(
            "no tensor `{name}` in {} (list them with --tensors)",
            path.display()
        )
    })?;
    let info = handle.info();
    let shape = info.shape.clone();
    let row_len = shape.last().copied().unwrap_or(1).max(1);
    let n_values = info.n_elements();
    if n_values % row_len as u64 != 0 {
        bail!("tensor `{name}`: shape {shape:?} is not whole rows");
    }
    let n_rows = (n_values / row_len as u64) as usize;
    let rows_per_chunk = (CHUNK_VALUES / row_len).max(1);

    let mut writer = match dump {
        Some(p) => Some(NpyWriter::create(p, &shape)?),
        None => None,
    };
    let mut acc = Accumulator::default();
    let mut buf = Vec::new();
    let mut row = 0;
    while row < n_rows {
        let end = (row + rows_per_chunk).min(n_rows);
        buf.resize((end - row) * row_len, 0.0);
        flatrun_dequant::dequantize_handle_rows(&handle, row..end, &mut buf)
            .with_context(|| format!("decoding `{name}` rows {row}..{end}"))?;
        acc.push(&buf);
        if let Some(w) = writer.as_mut() {
            w.write(&buf)?;
        }
        row = end;
    }
    if let Some(w) = writer {
        w.finish()?;
    }

    let (mean, std) = if acc.finite > 0 {
        let mean = acc.sum / acc.finite as f64;
        let var = (acc.sum_sq / acc.finite as f64 - mean * mean).max(0.0);
        (mean, var.sqrt())
    } else {
        (f64::NAN, f64::NAN)
    };
    let (min, max) = if acc.finite > 0 {
        (acc.min, acc.max)
    } else {
        (f32::NAN, f32::NAN)
    };
    Ok(TensorReport {
        name: info.name.clone(),
        original_name: info.original_name.clone(),
        dtype: match info.quant {
            flatrun_format::QuantDescriptor::MlxAffine {
                bits, group_size, ..
            } => format!("MLX affine {bits}-bit, group {group_size}"),
            _ => info.dtype.to_string(),
        },
        shape,
        bytes: info.byte_size,
        count: acc.count,
        min,
        max,
        mean,
        std,
        nan_count: acc.nan,
        inf_count: acc.inf,
        first: acc.first,
        dumped_to: dump.map(|p| p.display().to_string()),
    })
}

/// Human-readable form of a [`TensorReport`].
pub fn render_text(r: &TensorReport) -> String {
    let mut s = String::new();
    s += &format!("tensor:   {} (in file: {})\n", r.name, r.original_name);
    s += &format!("dtype:    {}\n", r.dtype);
    s += &format!(
        "shape:    {:?} ({} values, {} bytes)\n",
        r.shape, r.count, r.bytes
    );
    s += &format!("min/max:  {} / {}\n", r.min, r.max);
    s += &format!("mean/std: {:.6} / {:.6}\n", r.mean, r.std);
    if r.nan_count + r.inf_count > 0 {
        s += &format!("non-finite: {} NaN, {} Inf\n", r.nan_count, r.inf_count);
    }
    s += &format!("first:    {:?}\n", r.first);
    if let Some(p) = &r.dumped_to {
        s += &format!("dumped:   {p} (f32 .npy, row-major)\n");
    }
    s
}
