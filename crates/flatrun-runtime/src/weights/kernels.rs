//! Running a chunked layer's matrices chunk by chunk, and its routed
//! experts' rows as they are chosen.

use super::experts::ExpertCache;
use super::plan::{ChunkedMatrix, ExpertMatrix, rows_from};
use super::{OnDemand, WeightEngine, buffer_bytes};
use flatrun_kernels::{KernelError, Kernels, Weight};
use std::collections::HashMap;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// The routed experts of one layer pass: those being used, and what
/// finding them cost.
#[derive(Default)]
struct Pass {
    /// Experts read or found for this pass and not yet done with (their
    /// last projection has not run).
    held: HashMap<usize, Arc<OnDemand>>,
    /// Each expert the pass needed, in order of first need.
    used: Vec<u16>,
    hits: u64,
    misses: u64,
}

/// A [`Kernels`] whose `matmul` walks a streamed matrix's row chunks
/// (acquire chunk k from the engine, multiply its rows, release it) and
/// hands everything else to `inner`. The per-row arithmetic is the inner
/// kernels' own, so the result is bit-identical to one call over the whole
/// matrix.
pub(crate) struct ChunkedKernels<'a> {
    pub inner: &'a dyn Kernels,
    pub engine: &'a WeightEngine,
    pub matrices: &'a [ChunkedMatrix],
    /// Routed experts' matrices: a matmul over one expert's rows finds
    /// that expert in the pass or the cache, or reads it (all its
    /// projections at once).
    pub experts: &'a [ExpertMatrix],
    /// The layer (the experts' key in the cache).
    layer: usize,
    cache: &'a ExpertCache,
    pass: Mutex<Pass>,
    /// Time spent waiting for chunks.
    io_wait_ns: AtomicU64,
    /// Bytes of expert rows read.
    expert_bytes: AtomicU64,
    /// One chunk's output for multi-token steps, scattered into the full output.
    part: Mutex<Vec<f32>>,
}

/// What a layer pass's routed experts cost.
pub(crate) struct PassExperts {
    pub hits: u64,
    pub misses: u64,
    pub bytes_read: u64,
    pub used: Vec<u16>,
}

impl<'a> ChunkedKernels<'a> {
    pub(crate) fn new(
        inner: &'a dyn Kernels,
        engine: &'a WeightEngine,
        matrices: &'a [ChunkedMatrix],
        experts: &'a [ExpertMatrix],
        layer: usize,
        cache: &'a ExpertCache,
    ) -> ChunkedKernels<'a> {
        ChunkedKernels {
            inner,
            engine,
            matrices,
            experts,
            layer,
            cache,
            pass: Mutex::new(Pass::default()),
            io_wait_ns: AtomicU64::new(0),
            expert_bytes: AtomicU64::new(0),
            part: Mutex::new(Vec::new()),
        }
    }

    /// Time the matmuls waited for their chunks.
    pub(crate) fn io_wait(&self) -> Duration {
        Duration::from_nanos(self.io_wait_ns.load(Ordering::Relaxed))
    }

    /// What this pass's routed experts cost.
    pub(crate) fn experts_used(&self) -> PassExperts {
        let pass = self.lock_pass();
        PassExperts {
            hits: pass.hits,
            misses: pass.misses,
            bytes_read: self.expert_bytes.load(Ordering::Relaxed),
            used: pass.used.clone(),
        }
    }

    fn lock_pass(&self) -> MutexGuard<'_, Pass> {
        self.pass.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The expert matrix `w` is some rows of, and those rows.
    fn expert_rows(&self, w: &Weight) -> Option<(&'a ExpertMatrix, Range<usize>)> {
        self.experts
            .iter()
            .find_map(|e| e.rows_of(w).map(|rows| (e, rows)))
    }

    /// Expert `e`'s bytes (all its projections): held by this pass, else
    /// from the cache, else read now (and offered to the cache).
    fn expert(&self, e: usize) -> Result<Arc<OnDemand>, KernelError> {
        let mut found = self.experts_of(&[e])?;
        found.pop().ok_or_else(|| KernelError::Unavailable {
            what: format!("expert {e} was not read"),
        })
    }

    /// The bytes of experts `es`, in order: each held by this pass, else
    /// from the cache, else read (the missing ones concurrently, each
    /// offered to the cache).
    fn experts_of(&self, es: &[usize]) -> Result<Vec<Arc<OnDemand>>, KernelError> {
        let mut pass = self.lock_pass();
        let mut missing: Vec<usize> = Vec::new();
        for &e in es {
            if pass.held.contains_key(&e) || missing.contains(&e) {
                continue;
            }
            pass.used.push(e as u16);
            match self.cache.lookup((self.layer, e)) {
                Some(read) => {
                    pass.hits += 1;
                    pass.held.insert(e, read);
                }
                None => missing.push(e),
            }
        }
        if !missing.is_empty() {
            pass.misses += missing.len() as u64;
            // One span per projection (and part): exactly the expert's rows.
            let spans: Vec<Vec<_>> = missing
                .iter()
                .map(|&e| {
                    self.experts
                        .iter()
                        .filter_map(|m| m.expert_spans(e))
                        .flatten()
                        .collect()
                })
                .collect();
            let t_io = Instant::now();
            let reads = self.engine.read_now_many(&spans);
            self.io_wait_ns
                .fetch_add(t_io.elapsed().as_nanos() as u64, Ordering::Relaxed);
            for ((&e, spans), read) in missing.iter().zip(&spans).zip(reads) {
                let read = Arc::new(read.map_err(|err| KernelError::Unavailable { what: err.0 })?);
                self.expert_bytes
                    .fetch_add(spans.iter().map(|s| s.len).sum(), Ordering::Relaxed);
                self.cache
                    .offer((self.layer, e), &read, buffer_bytes(spans) as u64);
                pass.held.insert(e, read);
            }
        }
        es.iter()
            .map(|e| {
                pass.held
                    .get(e)
                    .cloned()
                    .ok_or_else(|| KernelError::Unavailable {
                        what: format!("expert {e} was not read"),
                    })
            })
            .collect()
    }

    /// `w` (rows `rows` of expert matrix `m`) with its bytes from its
    /// expert's read.
    fn expert_weight<'r>(
        m: &ExpertMatrix,
        rows: &Range<usize>,
        w: &Weight,
        read: &'r OnDemand,
    ) -> Result<Weight<'r>, KernelError> {
        m.rows_from(w, rows.clone(), read)
            .ok_or_else(|| KernelError::Unavailable {
                what: format!("expert rows {rows:?} are not in their read"),
            })
    }

    /// Done with the experts whose last projection `m` is.
    fn done(&self, m: &ExpertMatrix, rows: &Range<usize>) {
        if m.last {
            self.lock_pass().held.remove(&m.expert_of(rows));
        }
    }

    /// `out = x·wᵀ` where `w` is one routed expert's rows of an expert
    /// matrix: find or read the expert, then multiply.
    fn expert_matmul(
        &self,
        m: &ExpertMatrix,
        rows: Range<usize>,
        w: &Weight,
        x: &[f32],
        n_tokens: usize,
        out: &mut [f32],
    ) -> Result<(), KernelError> {
        let read = self.expert(m.expert_of(&rows))?;
        let rows_w = Self::expert_weight(m, &rows, w, &read)?;
        self.inner.matmul(&rows_w, x, n_tokens, out)?;
        self.done(m, &rows);
        Ok(())
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
        if let Some((e, rows)) = self.expert_rows(w) {
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

    /// Products of routed experts' rows (a decode's gate and up of every
    /// chosen expert) as one pool job of the inner kernels, once every
    /// expert is found or read; anything else one matmul at a time.
    fn matmul_many(
        &self,
        ws: &[&Weight],
        x: &[f32],
        n_tokens: usize,
        outs: &mut [&mut [f32]],
    ) -> Result<(), KernelError> {
        let found: Option<Vec<_>> = ws.iter().map(|w| self.expert_rows(w)).collect();
        match found {
            Some(found) if !found.is_empty() && ws.len() == outs.len() => {
                let es: Vec<usize> = found.iter().map(|(m, rows)| m.expert_of(rows)).collect();
                let reads = self.experts_of(&es)?;
                let weights = found
                    .iter()
                    .zip(ws)
                    .zip(&reads)
                    .map(|(((m, rows), w), read)| Self::expert_weight(m, rows, w, read))
                    .collect::<Result<Vec<_>, _>>()?;
                let refs: Vec<&Weight> = weights.iter().collect();
                self.inner.matmul_many(&refs, x, n_tokens, outs)?;
                for (m, rows) in &found {
                    self.done(m, rows);
                }
                Ok(())
            }
            _ => {
                if let (Some(w), true) = (ws.first(), ws.len() != outs.len()) {
                    return Err(KernelError::BufferLength {
                        format: w.format.to_string(),
                        rows: w.rows,
                        cols: w.cols,
                        what: "output list",
                        expected: ws.len(),
                        got: outs.len(),
                    });
                }
                for (w, out) in ws.iter().zip(outs.iter_mut()) {
                    self.matmul(w, x, n_tokens, out)?;
                }
                Ok(())
            }
        }
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
