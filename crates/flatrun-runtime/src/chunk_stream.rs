//! Stream mode with a fixed byte budget for the weights in flight.
//!
//! A streamed weight matrix is never mapped whole. Its rows are cut into
//! chunks of at most `chunk_bytes` (rows × (row bytes + MLX scale and bias row
//! bytes)), and a matmul walks them in order: fault chunk `k` in, multiply its
//! rows, drop its pages again (`MADV_DONTNEED`). Meanwhile a read-ahead thread
//! faults in the next `depth` chunks of the plan (`MADV_POPULATE_READ`) and
//! asks the kernel to start reading the ones after them (`MADV_WILLNEED`,
//! page cache only). So the weight bytes mapped into the process at any
//! moment are at most `(depth + 1) × chunk_bytes`, whatever the size of a
//! layer or of the model; a larger model only means more chunks per token.
//!
//! ```text
//! plan (one step, cyclic):  L0.q#0 L0.q#1 L0.k#0 … L0.down#3 L1.q#0 … head#0 … head#n
//! read-ahead thread:        populate tickets t+1 ..= t+depth, WILLNEED t+depth+1 ..= t+2·depth
//! matmul (executor):        acquire t (wait while the thread is on it; populate) → rows·x → release t
//! ```
//!
//! Chunks are numbered by a ticket that only grows (`ticket - 1` modulo the
//! plan's length is the chunk's position), so a step that skips part of the
//! plan (no logits wanted: no head) just jumps ahead; the chunks the thread
//! had already populated in the skipped part are released on the way.

use crate::error::{Result, RuntimeError};
use crate::memory;
use flatrun_format::StorageBackend;
use flatrun_kernels::{KernelError, Kernels, Weight};
use std::collections::HashMap;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Default bytes of one chunk: with the default read-ahead of one chunk,
/// at most 4 MiB of weights are mapped at once.
pub const DEFAULT_CHUNK_BYTES: usize = 2 << 20;

/// Rows `rows` of the plan's tensor `tensor`.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Chunk {
    tensor: usize,
    rows: Range<usize>,
}

/// Where one tensor's chunks sit in the plan: positions `first .. first + count`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct TensorChunks {
    first: usize,
    count: usize,
    rows: usize,
}

/// Where one tensor's data is mapped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct TensorPlace {
    address: usize,
    row_bytes: usize,
    /// The backend file it is in.
    file: usize,
}

/// Per file of `backend`: the page-aligned address range spanned by its
/// tensors, which lies inside that file's one read-only mapping (so
/// releasing pages in it never touches another mapping). Empty ranges for
/// files without tensors.
pub fn file_bounds(backend: &dyn StorageBackend) -> Vec<Range<usize>> {
    let page = memory::page_size();
    let mut bounds: Vec<Option<(usize, usize)>> = vec![None; backend.files().len()];
    for info in backend.tensors() {
        let Ok(h) = backend.tensor(&info.name) else {
            continue;
        };
        let bytes = h.bytes();
        if bytes.is_empty() {
            continue;
        }
        let (lo, hi) = (
            bytes.as_ptr() as usize,
            bytes.as_ptr() as usize + bytes.len(),
        );
        if let Some(slot) = bounds.get_mut(info.file_index) {
            *slot = Some(match *slot {
                Some((a, b)) => (a.min(lo), b.max(hi)),
                None => (lo, hi),
            });
        }
    }
    bounds
        .into_iter()
        .map(|b| b.map_or(0..0, |(lo, hi)| lo / page * page..hi.div_ceil(page) * page))
        .collect()
}

/// The chunks of every streamed matrix, in the order a step multiplies them.
#[derive(Debug)]
pub struct ChunkPlan {
    names: Vec<String>,
    /// `places[i]`: where tensor `names[i]`'s data is mapped.
    places: Vec<TensorPlace>,
    chunks: Vec<Chunk>,
    /// [`file_bounds`] of the backend.
    bounds: Vec<Range<usize>>,
    /// Address of each planned tensor's mapped data → its chunks (a matmul
    /// is handed a [`Weight`], and recognizes it by where its bytes are).
    by_address: HashMap<usize, TensorChunks>,
    chunk_bytes: usize,
}

impl ChunkPlan {
    /// Cut `names` (in the order a step uses them) into row chunks of at
    /// most `chunk_bytes` each (at least one row).
    pub fn build(
        backend: &dyn StorageBackend,
        names: Vec<String>,
        chunk_bytes: usize,
    ) -> Result<ChunkPlan> {
        let chunk_bytes = chunk_bytes.max(1);
        let bounds = file_bounds(backend);
        let mut chunks = Vec::new();
        let mut places = Vec::with_capacity(names.len());
        let mut by_address = HashMap::new();
        for (tensor, name) in names.iter().enumerate() {
            let h = backend.tensor(name)?;
            let w = Weight::from_handle(&h).map_err(|source| RuntimeError::Kernel {
                tensor: name.clone(),
                source,
            })?;
            let rows_per_chunk = (chunk_bytes / bytes_per_row(&w).max(1)).max(1);
            let first = chunks.len();
            let mut r0 = 0;
            while r0 < w.rows {
                let r1 = (r0 + rows_per_chunk).min(w.rows);
                chunks.push(Chunk {
                    tensor,
                    rows: r0..r1,
                });
                r0 = r1;
            }
            places.push(TensorPlace {
                address: w.data.as_ptr() as usize,
                row_bytes: w.row_bytes(),
                file: h.info().file_index,
            });
            by_address.insert(
                w.data.as_ptr() as usize,
                TensorChunks {
                    first,
                    count: chunks.len() - first,
                    rows: w.rows,
                },
            );
        }
        Ok(ChunkPlan {
            names,
            places,
            chunks,
            bounds,
            by_address,
            chunk_bytes,
        })
    }

    /// Chunks per step.
    pub fn len(&self) -> usize {
        self.chunks.len()
    }

    /// Whether nothing is planned.
    pub fn is_empty(&self) -> bool {
        self.chunks.is_empty()
    }

    /// The chunk budget in bytes.
    pub fn chunk_bytes(&self) -> usize {
        self.chunk_bytes
    }

    /// Whether tensor `name` is streamed in chunks.
    pub fn contains(&self, name: &str) -> bool {
        self.names.iter().any(|n| n == name)
    }

    /// Address of the first data byte of the chunk at `position`.
    fn data_start(&self, position: usize) -> Option<usize> {
        let c = self.chunks.get(position)?;
        let place = self.places.get(c.tensor)?;
        Some(place.address + c.rows.start * place.row_bytes)
    }

    /// Whether the chunk after `position` (in plan order) starts in the
    /// release block where `data_end` (one past the chunk's last data byte) lies.
    fn next_shares_block(&self, position: usize, data_end: usize) -> bool {
        let block = memory::release_block();
        let next = (position + 1) % self.chunks.len().max(1);
        data_end % block != 0
            && self
                .data_start(next)
                .is_some_and(|s| s / block == data_end / block)
    }

    /// Drop the pages of chunk `position` of `w` (a view of that chunk's
    /// rows), leaving a block the next chunk shares to that chunk.
    fn release(&self, position: usize, chunk: &Weight) {
        let Some(place) = self
            .chunks
            .get(position)
            .and_then(|c| self.places.get(c.tensor))
        else {
            return;
        };
        let Some(within) = self.bounds.get(place.file) else {
            return;
        };
        let data_end = chunk.data.as_ptr() as usize + chunk.data.len();
        let keep_tail = self.next_shares_block(position, data_end);
        // SAFETY: `within` is the span of this tensor's file's tensors in its
        // read-only mapping (`file_bounds`), alive while the stream holds
        // the backend.
        unsafe { memory::release_blocks(chunk.data, within, keep_tail) };
        // MLX scales and biases may live elsewhere: whole pages only.
        for part in [chunk.scales, chunk.biases].into_iter().flatten() {
            memory::release(part);
        }
    }

    /// Position in the plan of the chunk with `ticket` (tickets start at 1).
    fn position(&self, ticket: u64) -> usize {
        (ticket.saturating_sub(1) % self.chunks.len().max(1) as u64) as usize
    }
}

/// Bytes of one row of `w`, MLX scales and biases included.
fn bytes_per_row(w: &Weight) -> usize {
    let parts = usize::from(w.scales.is_some()) + usize::from(w.biases.is_some());
    w.row_bytes() + parts * w.scale_row_bytes()
}

/// Apply `f` (populate, release, will-need) to every byte range of `w`.
fn touch(w: &Weight, f: fn(&[u8])) {
    f(w.data);
    if let Some(s) = w.scales {
        f(s);
    }
    if let Some(b) = w.biases {
        f(b);
    }
}

/// Apply `f` to chunk `c` of `plan`, looked up in `backend` (the read-ahead
/// thread's view; a tensor that fails to open is reported by the executor).
fn touch_planned(backend: &dyn StorageBackend, plan: &ChunkPlan, c: &Chunk, f: fn(&[u8])) {
    let Some(name) = plan.names.get(c.tensor) else {
        return;
    };
    let Ok(h) = backend.tensor(name) else {
        return;
    };
    if let Ok(w) = Weight::from_handle(&h).and_then(|w| w.row_range(c.rows.clone())) {
        touch(&w, f);
    }
}

/// What the executor and the read-ahead thread share.
#[derive(Debug, Default)]
struct Window {
    /// The ticket the executor acquired last (0: none yet).
    at: u64,
    /// The thread has handled every ticket up to this one.
    done: u64,
    /// The ticket the thread is populating right now.
    busy: Option<u64>,
    /// The executor is gone.
    stop: bool,
}

#[derive(Debug, Default)]
struct Shared {
    window: Mutex<Window>,
    changed: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Window> {
        // A panic elsewhere cannot leave the counters inconsistent.
        self.window.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn wait<'g>(&self, guard: MutexGuard<'g, Window>) -> MutexGuard<'g, Window> {
        self.changed.wait(guard).unwrap_or_else(|e| e.into_inner())
    }
}

/// Streams the planned matrices chunk by chunk, reading ahead on a thread.
pub struct ChunkStream {
    backend: Arc<dyn StorageBackend>,
    plan: Arc<ChunkPlan>,
    shared: Arc<Shared>,
    worker: Option<JoinHandle<()>>,
    /// Time matmuls waited for chunks since the last [`ChunkStream::take_io_wait`].
    io_wait_ns: AtomicU64,
    /// One chunk's output for multi-token steps, scattered into the full output.
    part: Mutex<Vec<f32>>,
}

impl ChunkStream {
    /// Start streaming `plan`, with a thread reading `depth` chunks ahead
    /// (none when `depth` is 0).
    pub fn start(backend: Arc<dyn StorageBackend>, plan: ChunkPlan, depth: usize) -> ChunkStream {
        // More read-ahead than the plan holds would populate the chunk in use.
        let depth = depth.min(plan.len().saturating_sub(1));
        let plan = Arc::new(plan);
        let shared = Arc::new(Shared::default());
        let worker = (depth > 0)
            .then(|| {
                let (backend, plan, shared) = (backend.clone(), plan.clone(), shared.clone());
                std::thread::Builder::new()
                    .name("flatrun-chunk-reader".into())
                    .spawn(move || read_ahead(backend.as_ref(), &plan, &shared, depth as u64))
                    .ok()
            })
            .flatten();
        ChunkStream {
            backend,
            plan,
            shared,
            worker,
            io_wait_ns: AtomicU64::new(0),
            part: Mutex::new(Vec::new()),
        }
    }

    /// The plan.
    pub fn plan(&self) -> &ChunkPlan {
        &self.plan
    }

    /// Time matmuls waited for chunk pages since the last call.
    pub fn take_io_wait(&self) -> Duration {
        Duration::from_nanos(self.io_wait_ns.swap(0, Ordering::Relaxed))
    }

    /// Make the chunk at `position` the executor's: wait while the thread
    /// is populating it (or a chunk before it), and release what the thread
    /// populated in a skipped part of the plan.
    fn acquire(&self, position: usize) {
        let len = self.plan.len().max(1) as u64;
        let mut w = self.shared.lock();
        let old = w.at;
        let ticket = old + 1 + (position as u64 + len - old % len) % len;
        w.at = ticket;
        self.shared.changed.notify_all();
        while w.busy.is_some_and(|b| b <= ticket) {
            w = self.shared.wait(w);
        }
        let done = w.done;
        drop(w);
        // At most `depth` chunks: the thread never gets further ahead.
        for skipped in old + 1..ticket.min(done + 1) {
            let position = self.plan.position(skipped);
            if let Some(c) = self.plan.chunks.get(position) {
                let Some(name) = self.plan.names.get(c.tensor) else {
                    continue;
                };
                if let Ok(h) = self.backend.tensor(name) {
                    if let Ok(w) = Weight::from_handle(&h).and_then(|w| w.row_range(c.rows.clone()))
                    {
                        self.plan.release(position, &w);
                    }
                }
            }
        }
    }

    /// `out = x · Wᵀ` for `n` tokens, one chunk of rows at a time when `w`
    /// is a planned matrix (else in one call of `inner`).
    pub fn matmul(
        &self,
        inner: &dyn Kernels,
        w: &Weight,
        x: &[f32],
        n: usize,
        out: &mut [f32],
    ) -> std::result::Result<(), KernelError> {
        let planned = self
            .plan
            .by_address
            .get(&(w.data.as_ptr() as usize))
            .copied()
            .filter(|tc| tc.rows == w.rows && out.len() == n * w.rows);
        let Some(tc) = planned else {
            return inner.matmul(w, x, n, out);
        };
        for position in tc.first..tc.first + tc.count {
            let rows = self.plan.chunks[position].rows.clone();
            let chunk = w.row_range(rows.clone())?;
            // Fault the chunk in (already done when the read-ahead was in time).
            let t_io = Instant::now();
            self.acquire(position);
            touch(&chunk, memory::populate);
            self.io_wait_ns
                .fetch_add(t_io.elapsed().as_nanos() as u64, Ordering::Relaxed);
            // out[t, rows] = x[t] · chunkᵀ
            let result = if n == 1 {
                inner.matmul(&chunk, x, 1, &mut out[rows.clone()])
            } else {
                let mut part = self.part.lock().unwrap_or_else(|e| e.into_inner());
                part.resize(n * rows.len(), 0.0);
                let r = inner.matmul(&chunk, x, n, &mut part);
                for (t, row) in part.chunks_exact(rows.len()).enumerate() {
                    out[t * w.rows + rows.start..t * w.rows + rows.end].copy_from_slice(row);
                }
                r
            };
            // Drop the chunk's pages (and whatever fault-around mapped next
            // to them), except a block the next chunk shares.
            self.plan.release(position, &chunk);
            result?;
        }
        Ok(())
    }
}

impl Drop for ChunkStream {
    fn drop(&mut self) {
        self.shared.lock().stop = true;
        self.shared.changed.notify_all();
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}

/// The read-ahead thread: keep the `depth` chunks after the executor's populated.
fn read_ahead(backend: &dyn StorageBackend, plan: &ChunkPlan, shared: &Shared, depth: u64) {
    loop {
        let ticket = {
            let mut w = shared.lock();
            loop {
                if w.stop {
                    return;
                }
                let next = w.done.max(w.at) + 1;
                if next <= w.at + depth {
                    w.busy = Some(next);
                    break next;
                }
                w = shared.wait(w);
            }
        };
        if let Some(c) = plan.chunks.get(plan.position(ticket)) {
            touch_planned(backend, plan, c, memory::populate);
        }
        // Start the disk on the chunk `depth` further (page cache only).
        if let Some(c) = plan.chunks.get(plan.position(ticket + depth)) {
            touch_planned(backend, plan, c, memory::will_need);
        }
        let mut w = shared.lock();
        w.busy = None;
        w.done = w.done.max(ticket);
        drop(w);
        shared.changed.notify_all();
    }
}

/// A [`Kernels`] that runs planned matrices through a [`ChunkStream`] and
/// everything else through `inner`.
pub struct ChunkedKernels<'a> {
    pub inner: &'a dyn Kernels,
    pub stream: &'a ChunkStream,
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
    ) -> std::result::Result<(), KernelError> {
        self.stream.matmul(self.inner, w, x, n_tokens, out)
    }

    fn dequantize_rows(
        &self,
        w: &Weight,
        rows: Range<usize>,
        out: &mut [f32],
    ) -> std::result::Result<(), KernelError> {
        self.inner.dequantize_rows(w, rows, out)
    }
}
