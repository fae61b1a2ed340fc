//! Running a chunked layer's matrices chunk by chunk, and its routed
//! experts' rows as they are chosen.
//!
//! A layer's routed experts are found in the pass (already read for an
//! earlier projection), in the expert cache, among the reads started ahead
//! by the previous layer's prediction, or read now. Reads go to the
//! engine's background readers as soon as the router has chosen
//! ([`Kernels::routed`]); the products of the experts at hand run while
//! the others are read, and each read expert is multiplied as it arrives.
//! Then the next layer's router is applied to this layer's residual stream
//! and the experts it names are read ahead, behind this layer's own reads,
//! so that the disk works while this layer computes.

use super::experts::ExpertCache;
use super::plan::{ChunkedMatrix, ExpertMatrix, rows_from};
use super::readers::PendingRead;
use super::{OnDemand, WeightEngine, buffer_bytes};
use flatrun_kernels::{KernelError, Kernels, Weight, ops};
use std::collections::{HashMap, VecDeque};
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Experts whose reads a prefill keeps in flight (the union of its
/// tokens' choices can be every expert of the layer).
const READS_AHEAD: usize = 8;

/// Predictions of the next layer's experts are made for at most this many
/// tokens (a decode step or a small batch; a long prefill needs nearly
/// every expert anyway).
const PREDICT_TOKENS: usize = 16;

/// A routed expert of the pass: its bytes, or the read that brings them.
#[derive(Clone)]
enum Found {
    Ready(Arc<OnDemand>),
    Reading(Arc<PendingRead>),
}

/// The routed experts of one layer pass: those being used, and what
/// finding them cost.
#[derive(Default)]
struct Pass {
    /// Experts read or found for this pass and not yet done with (their
    /// last projection has not run).
    held: HashMap<usize, Found>,
    /// Experts the router chose whose reads are not asked for yet.
    queued: VecDeque<usize>,
    /// Each expert the pass needed, in order of first need.
    used: Vec<u16>,
    hits: u64,
    misses: u64,
    /// Misses whose read the previous layer had started.
    ahead_used: u64,
    /// The next layer's experts were predicted.
    predicted: bool,
}

impl Pass {
    /// Reads in flight.
    fn reading(&self) -> usize {
        self.held
            .values()
            .filter(|f| matches!(f, Found::Reading(_)))
            .count()
    }
}

/// The next layer's router, to predict its experts from this layer's
/// residual stream: the first ⌈k/2⌉ of `top-k(router · rmsnorm(h) · norm + bias)`.
pub(crate) struct NextRouter<'a> {
    pub layer: usize,
    pub router: Weight<'a>,
    pub bias: Option<Vec<f32>>,
    pub norm: Vec<f32>,
    pub eps: f32,
    pub norm_offset: f32,
    pub k: usize,
    /// The next layer's expert matrices (where each expert's rows are).
    pub experts: &'a [ExpertMatrix],
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
    next: Option<NextRouter<'a>>,
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
    /// Misses read ahead by the previous layer's prediction.
    pub ahead_used: u64,
    /// Reads ahead for this layer that its router did not choose.
    pub ahead_wasted: u64,
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
            next: None,
            pass: Mutex::new(Pass::default()),
            io_wait_ns: AtomicU64::new(0),
            expert_bytes: AtomicU64::new(0),
            part: Mutex::new(Vec::new()),
        }
    }

    /// Predict the next layer's experts with `next` once this layer has
    /// routed, and start reading them.
    pub(crate) fn predicting(mut self, next: Option<NextRouter<'a>>) -> Self {
        self.next = next;
        self
    }

    /// Time the matmuls waited for their chunks.
    pub(crate) fn io_wait(&self) -> Duration {
        Duration::from_nanos(self.io_wait_ns.load(Ordering::Relaxed))
    }

    /// What this pass's routed experts cost; forgets the reads started
    /// ahead for this layer that it did not use.
    pub(crate) fn experts_used(&self) -> PassExperts {
        let pass = self.lock_pass();
        let keep = self.next.as_ref().map_or(usize::MAX, |n| n.layer);
        PassExperts {
            hits: pass.hits,
            misses: pass.misses,
            bytes_read: self.expert_bytes.load(Ordering::Relaxed),
            used: pass.used.clone(),
            ahead_used: pass.ahead_used,
            ahead_wasted: self.cache.drop_ahead_except(keep),
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

    /// The spans of expert `e` of `matrices`: exactly its rows of each
    /// projection (and part).
    fn spans_of(matrices: &[ExpertMatrix], e: usize) -> Vec<super::Span> {
        matrices
            .iter()
            .filter_map(|m| m.expert_spans(e))
            .flatten()
            .collect()
    }

    /// Note that the pass needs expert `e`: held already, a cache hit, a
    /// read started ahead, or a read asked for now.
    fn want(&self, pass: &mut Pass, e: usize) {
        if pass.held.contains_key(&e) {
            return;
        }
        pass.queued.retain(|&q| q != e);
        pass.used.push(e as u16);
        let key = (self.layer, e);
        let found = if let Some(read) = self.cache.lookup(key) {
            pass.hits += 1;
            Found::Ready(read)
        } else if let Some(read) = self.cache.take_ahead(key) {
            pass.misses += 1;
            pass.ahead_used += 1;
            Found::Reading(read)
        } else {
            pass.misses += 1;
            let spans = Self::spans_of(self.experts, e);
            self.expert_bytes
                .fetch_add(spans.iter().map(|s| s.len).sum(), Ordering::Relaxed);
            Found::Reading(self.engine.read_later(spans))
        };
        pass.held.insert(e, found);
    }

    /// Ask for the queued experts' reads while fewer than
    /// [`READS_AHEAD`] are in flight.
    fn top_up(&self, pass: &mut Pass) {
        while pass.reading() < READS_AHEAD {
            let Some(e) = pass.queued.pop_front() else {
                break;
            };
            self.want(pass, e);
        }
    }

    /// Expert `e`'s bytes, waiting for its read if it is on its way (the
    /// read is then offered to the cache).
    fn resolve(&self, e: usize) -> Result<Arc<OnDemand>, KernelError> {
        let found = {
            let mut pass = self.lock_pass();
            self.want(&mut pass, e);
            pass.held.get(&e).cloned()
        };
        let pending = match found {
            Some(Found::Ready(read)) => return Ok(read),
            Some(Found::Reading(pending)) => pending,
            None => {
                return Err(KernelError::Unavailable {
                    what: format!("expert {e} was not read"),
                });
            }
        };
        let t_io = Instant::now();
        let read = pending.wait();
        self.io_wait_ns
            .fetch_add(t_io.elapsed().as_nanos() as u64, Ordering::Relaxed);
        let read = read.map_err(|what| KernelError::Unavailable { what })?;
        let spans = Self::spans_of(self.experts, e);
        self.cache
            .offer((self.layer, e), &read, buffer_bytes(&spans) as u64);
        let mut pass = self.lock_pass();
        pass.held.insert(e, Found::Ready(read.clone()));
        self.top_up(&mut pass);
        Ok(read)
    }

    /// Whether expert `e`'s bytes are at hand (no wait).
    fn ready(&self, e: usize) -> bool {
        matches!(self.lock_pass().held.get(&e), Some(Found::Ready(_)))
    }

    /// Start reading the experts the next layer's router would choose for
    /// `hidden` (behind this layer's own reads).
    fn predict_next(&self, hidden: &[f32]) -> Result<(), KernelError> {
        let Some(next) = &self.next else {
            return Ok(());
        };
        let d = next.router.cols;
        let ne = next.router.rows;
        let n = hidden.len() / d.max(1);
        if n == 0 || n > PREDICT_TOKENS || next.norm.len() != d || next.k == 0 {
            return Ok(());
        }
        let mut x = hidden[..n * d].to_vec();
        ops::rms_norm_rows(&mut x, d, &next.norm, next.eps, next.norm_offset);
        let mut logits = vec![0.0f32; n * ne];
        self.inner.matmul(&next.router, &x, n, &mut logits)?;
        let mut chosen: Vec<usize> = Vec::new();
        for row in logits.chunks_exact_mut(ne) {
            if let Some(b) = next.bias.as_ref().filter(|b| b.len() == ne) {
                row.iter_mut().zip(b).for_each(|(l, b)| *l += b);
            }
            let mut order: Vec<usize> = (0..ne).collect();
            order.sort_unstable_by(|&a, &b| row[b].total_cmp(&row[a]));
            // The top half of the prediction: on the scale bench 90% of
            // those were chosen, against 72% of the whole top-k, whose
            // wasted reads cost more disk time than the overlap saved.
            for &e in order.iter().take(next.k.div_ceil(2)) {
                if !chosen.contains(&e) {
                    chosen.push(e);
                }
            }
        }
        for e in chosen {
            let key = (next.layer, e);
            if self.cache.has(key) {
                continue;
            }
            let spans = Self::spans_of(next.experts, e);
            if spans.is_empty() {
                continue;
            }
            self.expert_bytes
                .fetch_add(spans.iter().map(|s| s.len).sum(), Ordering::Relaxed);
            self.cache.put_ahead(key, self.engine.read_later(spans));
        }
        Ok(())
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
        let read = self.resolve(m.expert_of(&rows))?;
        let rows_w = Self::expert_weight(m, &rows, w, &read)?;
        self.inner.matmul(&rows_w, x, n_tokens, out)?;
        self.done(m, &rows);
        Ok(())
    }

    /// `outs[i] = x·ws[i]ᵀ` for the products `idx` of routed experts'
    /// rows, whose experts are read, as one pool job of the inner kernels.
    fn expert_products(
        &self,
        found: &[(&'a ExpertMatrix, Range<usize>)],
        ws: &[&Weight],
        idx: &[usize],
        x: &[f32],
        n_tokens: usize,
        outs: &mut [&mut [f32]],
    ) -> Result<(), KernelError> {
        if idx.is_empty() {
            return Ok(());
        }
        let reads = idx
            .iter()
            .map(|&i| self.resolve(found[i].0.expert_of(&found[i].1)))
            .collect::<Result<Vec<_>, _>>()?;
        let weights = idx
            .iter()
            .zip(&reads)
            .map(|(&i, read)| Self::expert_weight(found[i].0, &found[i].1, ws[i], read))
            .collect::<Result<Vec<_>, _>>()?;
        let refs: Vec<&Weight> = weights.iter().collect();
        let mut sub: Vec<&mut [f32]> = outs
            .iter_mut()
            .enumerate()
            .filter(|(i, _)| idx.contains(i))
            .map(|(_, o)| &mut **o)
            .collect();
        self.inner.matmul_many(&refs, x, n_tokens, &mut sub)?;
        for &i in idx {
            self.done(found[i].0, &found[i].1);
        }
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
        // Every chunk multiplies the same activations: quantized once.
        flatrun_kernels::with_shared_input(x, || {
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
        })
    }

    /// Products of routed experts' rows (a decode's gate and up of every
    /// chosen expert): those of the experts at hand as one pool job of the
    /// inner kernels, then each other expert's as its read arrives;
    /// anything else one matmul at a time.
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
                {
                    let mut pass = self.lock_pass();
                    for &e in &es {
                        self.want(&mut pass, e);
                    }
                }
                // The experts at hand first, while the others are read.
                let (now, later): (Vec<usize>, Vec<usize>) =
                    (0..es.len()).partition(|&i| self.ready(es[i]));
                self.expert_products(&found, ws, &now, x, n_tokens, outs)?;
                // Then each other expert, in the order its read was asked for.
                let mut waiting: Vec<usize> = Vec::new();
                for &i in &later {
                    if !waiting.contains(&es[i]) {
                        waiting.push(es[i]);
                    }
                }
                for e in waiting {
                    let idx: Vec<usize> = later.iter().copied().filter(|&i| es[i] == e).collect();
                    self.expert_products(&found, ws, &idx, x, n_tokens, outs)?;
                }
                Ok(())
            }
            _ => {
                flatrun_kernels::check_output_list(ws, outs.len())?;
                for (w, out) in ws.iter().zip(outs.iter_mut()) {
                    self.matmul(w, x, n_tokens, out)?;
                }
                Ok(())
            }
        }
    }

    /// The router chose `experts`: ask for their reads (all of a decode's,
    /// a prefill's first few), then predict the next layer's from `hidden`
    /// and read those behind them.
    fn routed(&self, hidden: &[f32], experts: &[u32]) {
        let mut pass = self.lock_pass();
        pass.queued.extend(experts.iter().map(|&e| e as usize));
        self.top_up(&mut pass);
        let predict = !std::mem::replace(&mut pass.predicted, true);
        drop(pass);
        if predict {
            // A failed prediction only loses the read ahead.
            let _ = self.predict_next(hidden);
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
