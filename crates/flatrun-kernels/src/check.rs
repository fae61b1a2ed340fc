//! Argument checks shared by both backends: kernels never panic on a bad call.

use std::ops::Range;

use crate::{KernelError, Weight};

fn buffer_error(w: &Weight, what: &'static str, expected: usize, got: usize) -> KernelError {
    KernelError::BufferLength {
        format: w.format.to_string(),
        rows: w.rows,
        cols: w.cols,
        what,
        expected,
        got,
    }
}

/// Validate a [`crate::Kernels::matmul_many`] call's lists: one output per
/// weight.
pub fn check_output_list(ws: &[&Weight], outs: usize) -> Result<(), KernelError> {
    match ws.first() {
        Some(w) if ws.len() != outs => Err(buffer_error(w, "output list", ws.len(), outs)),
        _ => Ok(()),
    }
}

/// Validate a matmul call: the weight's bytes and the buffer lengths.
pub(crate) fn check_matmul(
    w: &Weight,
    x: &[f32],
    n_tokens: usize,
    out: &[f32],
) -> Result<(), KernelError> {
    w.validate()?;
    let nx = n_tokens.saturating_mul(w.cols);
    if x.len() != nx {
        return Err(buffer_error(w, "activations", nx, x.len()));
    }
    let no = n_tokens.saturating_mul(w.rows);
    if out.len() != no {
        return Err(buffer_error(w, "output", no, out.len()));
    }
    Ok(())
}

/// Validate a dequantize_rows call.
pub(crate) fn check_dequantize(
    w: &Weight,
    rows: &Range<usize>,
    out: &[f32],
) -> Result<(), KernelError> {
    w.validate()?;
    if rows.start > rows.end || rows.end > w.rows {
        return Err(KernelError::RowRange {
            format: w.format.to_string(),
            rows: w.rows,
            cols: w.cols,
            start: rows.start,
            end: rows.end,
        });
    }
    let n = rows.len() * w.cols;
    if out.len() != n {
        return Err(buffer_error(w, "output", n, out.len()));
    }
    Ok(())
}
