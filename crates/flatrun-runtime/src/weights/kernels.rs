//! Running a chunked layer's matrices chunk by chunk, and its routed
//! experts' rows as they are chosen.

use super::WeightEngine;
use super::plan::{ChunkedMatrix, ExpertMatrix, rows_from};
use flatrun_kernels::{KernelError, Kernels, Weight};
use std::ops::Range;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// A [`Kernels`] whose `matmul` walks a streamed matrix's row chunks
/// (acquire chunk k from the engine, multiply its rows, release it) and
/// hands everything else to `inner`. The per-row arithmetic is the inner
/// kernels' own, so the result is bit-identical to one call over the whole
/// matrix.
pub(crate) struct ChunkedKernels<'a> {
    pub inner: &'a dyn Kernels,
    pub engine: &'a WeightEngine,
    pub matrices: &'a [ChunkedMatrix],
    /// Stacked expert matrices: a matmul over some of their rows (one
    /// routed expert) reads just those rows.
    pub experts: &'a [ExpertMatrix],
    /// Time spent waiting for chunks.
    io_wait_ns: AtomicU64,
    /// Bytes of expert rows read.
    expert_bytes: AtomicU64,
    /// One chunk's output for multi-token steps, scattered into the full output.
    part: Mutex<Vec<f32>>,
}

impl<'a> ChunkedKernels<'a> {
    pub(crate) fn new(
        inner: &'a dyn Kernels,
        engine: &'a WeightEngine,
        matrices: &'a [ChunkedMatrix],
        experts: &'a [ExpertMatrix],
    ) -> ChunkedKernels<'a> {
        ChunkedKernels {
            inner,
            engine,
            matrices,
            experts,
            io_wait_ns: AtomicU64::new(0),
            expert_bytes: AtomicU64::new(0),
            part: Mutex::new(Vec::new()),
        }
    }

    /// Time the matmuls waited for their chunks.
    pub(crate) fn io_wait(&self) -> Duration {
        Duration::from_nanos(self.io_wait_ns.load(Ordering::Relaxed))
    }

    /// Bytes of routed experts' rows the matmuls read.
    pub(crate) fn expert_bytes(&self) -> u64 {
        self.expert_bytes.load(Ordering::Relaxed)
    }

    /// `out = x·wᵀ` where `w` is some rows of a stacked expert matrix: read
    /// those rows (and nothing else of the stack), then multiply.
    fn expert_matmul(
        &self,
        e: &ExpertMatrix,
        rows: Range<usize>,
        w: &Weight,
        x: &[f32],
        n_tokens: usize,
        out: &mut [f32],
    ) -> Result<(), KernelError> {
        let spans = e.spans(rows.clone());
        let t_io = Instant::now();
        let read = self
            .engine
            .read_now(&spans)
            .map_err(|err| KernelError::Unavailable { what: err.0 })?;
        self.io_wait_ns
            .fetch_add(t_io.elapsed().as_nanos() as u64, Ordering::Relaxed);
        self.expert_bytes
            .fetch_add(spans.iter().map(|s| s.len).sum(), Ordering::Relaxed);
        let rows_w =
            e.rows_from(w, rows.clone(), &read)
                .ok_or_else(|| KernelError::Unavailable {
                    what: format!("expert rows {rows:?} are not in their read"),
                })?;
        self.inner.matmul(&rows_w, x, n_tokens, out)
    }

    /// `out[t, rows] = x[t] · chunkᵀ` for the `n` tokens of `x`, where `out`
    /// holds `n` rows of `out_rows` values.
    fn multiply(
        &self,
        chunk: &Weight,
        rows: Range<usize>,
        out_rows: usize,
        x: &[f32],
        n: usize,
        out: &mut [f32],
    ) -> Result<(), KernelError> {
        if n == 1 {
            return self.inner.matmul(chunk, x, 1, &mut out[rows]);
        }
        let mut part = self.part.lock().unwrap_or_else(|e| e.into_inner());
        part.resize(n * rows.len(), 0.0);
        self.inner.matmul(chunk, x, n, &mut part)?;
        scatter(&part, rows, out_rows, out);
        Ok(())
    }
}

/// Copy `part` (`n` rows of `rows.len()` values) into columns `rows` of
/// `out` (`n` rows of `out_rows` values).
pub(crate) fn scatter(part: &[f32], rows: Range<usize>, out_rows: usize, out: &mut [f32]) {
    for (t, row) in part.chunks_exact(rows.len().max(1)).enumerate() {
        out[t * out_rows + rows.start..t * out_rows + rows.end].copy_from_slice(row);
    }
}

impl Kernels for ChunkedKernels<'_> {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn matmul(
        &self,
        w: &Weight,
        x: &[f32],
        n_tokens: usize,
        out: &mut [f32],
    ) -> Result<(), KernelError> {
        if let Some((e, rows)) = self
            .experts
            .iter()
            .find_map(|e| e.rows_of(w).map(|rows| (e, rows)))
        {
            return self.expert_matmul(e, rows, w, x, n_tokens, out);
        }
        let Some(m) = self
            .matrices
            .iter()
            .find(|m| m.is(w) && out.len() == n_tokens * w.rows)
        else {
            return self.inner.matmul(w, x, n_tokens, out);
        };
        for (rows, item) in m.chunks() {
            let t_io = Instant::now();
            let lease = self
                .engine
                .acquire(*item)
                .map_err(|e| KernelError::Unavailable { what: e.0 })?;
            self.io_wait_ns
                .fetch_add(t_io.elapsed().as_nanos() as u64, Ordering::Relaxed);
            let chunk = rows_from(w, m.sources(), rows.clone(), &lease).ok_or_else(|| {
                KernelError::Unavailable {
                    what: format!("rows {rows:?} are not in their streamed chunk"),
                }
            })?;
            self.multiply(&chunk, rows.clone(), w.rows, x, n_tokens, out)?;
        }
        Ok(())
    }

    fn dequantize_rows(
        &self,
        w: &Weight,
        rows: Range<usize>,
        out: &mut [f32],
    ) -> Result<(), KernelError> {
        self.inner.dequantize_rows(w, rows, out)
    }
}
