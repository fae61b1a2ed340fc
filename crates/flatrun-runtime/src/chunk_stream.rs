//! Stream mode with a fixed byte budget for the weights in flight.
//!
//! A streamed weight matrix is never held whole. Its rows are cut into
//! chunks of at most `chunk_bytes` (rows × (row bytes + MLX scale and bias row
//! bytes)), and a matmul walks them in order. A chunk's bytes come from one
//! of two sources:
//!
//! * **read** (the default wherever every planned tensor is one plain byte
//!   range of its file): a read-ahead thread `pread`s the next `depth` chunks
//!   of the plan into `depth + 1` reused buffers (through the page cache) and
//!   asks the kernel to start reading the ones after them
//!   (`POSIX_FADV_WILLNEED`); the matmul multiplies the rows in the buffer.
//!   Nothing of the weights is ever mapped into the process, so neither
//!   fault-around nor large page-cache folios can map more than was asked.
//! * **mapped** (MLX checkpoints, whose scales and biases are companion
//!   arrays): fault chunk `k` in through the file mapping, multiply its rows,
//!   drop its pages again (`MADV_DONTNEED`), while the read-ahead thread
//!   faults in the next `depth` chunks (`MADV_POPULATE_READ`) and
//!   `MADV_WILLNEED`s the ones after them.
//!
//! Either way the weight bytes in the process at any moment are at most
//! `(depth + 1) × chunk_bytes`, whatever the size of a layer or of the model;
//! a larger model only means more chunks per token.
//!
//! ```text
//! plan (one step, cyclic):  L0.q#0 L0.q#1 L0.k#0 … L0.down#3 L1.q#0 … head#0 … head#n
//! read-ahead thread:        fetch tickets t+1 ..= t+depth, WILLNEED t+depth+1 ..= t+2·depth
//! matmul (executor):        acquire t (wait while the thread is on it; fetch if it is not done)
//!                           → rows·x → release t (mapped: drop its pages; read: its buffer is reused)
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
use std::fs::File;
use std::ops::Range;
use std::os::unix::fs::FileExt;
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

/// Where one tensor's data is mapped, and where it is in its file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct TensorPlace {
    address: usize,
    row_bytes: usize,
    /// The backend file it is in.
    file: usize,
    /// Absolute offset of its first data byte in that file.
    offset: u64,
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
    /// Every planned tensor is one plain byte range of its file (no MLX
    /// companion arrays), so its chunks can be read with `pread`.
    readable: bool,
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
        let mut readable = true;
        for (tensor, name) in names.iter().enumerate() {
            let h = backend.tensor(name)?;
            readable &= h.parts().is_empty() && w_is_plain(&h);
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
                offset: h.info().offset,
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
            readable,
        })
    }

    /// The file span of the chunk at `position`: (file, offset, length).
    fn span(&self, position: usize) -> Option<(usize, u64, usize)> {
        let c = self.chunks.get(position)?;
        let place = self.places.get(c.tensor)?;
        Some((
            place.file,
            place.offset + (c.rows.start * place.row_bytes) as u64,
            c.rows.len() * place.row_bytes,
        ))
    }

    /// Bytes of the largest chunk's data.
    fn largest_chunk(&self) -> usize {
        (0..self.chunks.len())
            .filter_map(|p| self.span(p).map(|(_, _, len)| len))
            .max()
            .unwrap_or(0)
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
        !data_end.is_multiple_of(block)
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

/// Whether the handle's bytes are exactly its file span (`offset ..
/// offset + byte_size`), so that reading that span gives the same bytes.
fn w_is_plain(h: &flatrun_format::TensorHandle) -> bool {
    h.bytes().len() as u64 == h.info().byte_size
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
    /// The ticket the thread is fetching right now.
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

/// Alignment of a read buffer's first byte (the mapping's tensors are at
/// least this aligned too; kernels may load whole vectors from it).
const BUFFER_ALIGN: usize = 64;

/// One read buffer: the chunk of one ticket.
struct ReadSlot {
    /// The ticket whose chunk the buffer holds (0: none).
    ticket: u64,
    /// Bytes of that chunk.
    len: usize,
    /// `BUFFER_ALIGN` bytes of slack, then room for the largest chunk.
    storage: Vec<u8>,
}

impl ReadSlot {
    /// Offset of the first aligned byte of `storage`.
    fn start(&self) -> usize {
        self.storage
            .as_ptr()
            .align_offset(BUFFER_ALIGN)
            .min(BUFFER_ALIGN)
    }

    /// The chunk's bytes.
    fn bytes(&self) -> &[u8] {
        let s = self.start();
        &self.storage[s..s + self.len]
    }
}

/// The buffers of explicit reads: ticket `t` goes to slot `t % slots.len()`
/// (`depth + 1` slots: the executor's chunk and the `depth` read ahead, which
/// the ticket protocol keeps on distinct slots).
struct ReadBuffers {
    /// The backend's files, opened for `pread` (through the page cache).
    files: Vec<File>,
    slots: Vec<Mutex<ReadSlot>>,
}

impl ReadBuffers {
    /// Open `backend`'s files and make `count` buffers of `bytes` each
    /// (zeroed lazily: untouched pages cost nothing until the first read).
    fn new(backend: &dyn StorageBackend, count: usize, bytes: usize) -> Option<ReadBuffers> {
        let files = backend
            .files()
            .iter()
            .map(File::open)
            .collect::<std::io::Result<Vec<_>>>()
            .ok()?;
        let slots = (0..count.max(1))
            .map(|_| {
                Mutex::new(ReadSlot {
                    ticket: 0,
                    len: 0,
                    storage: vec![0u8; bytes + BUFFER_ALIGN],
                })
            })
            .collect();
        Some(ReadBuffers { files, slots })
    }

    /// The slot of `ticket`, locked.
    fn slot(&self, ticket: u64) -> MutexGuard<'_, ReadSlot> {
        let i = (ticket % self.slots.len() as u64) as usize;
        // A panic elsewhere leaves at worst a stale ticket, which is re-read.
        self.slots[i].lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Read the chunk of `ticket` (at `position` in `plan`) into `slot`;
    /// on failure the slot holds no ticket (the caller maps the chunk instead).
    fn read(&self, plan: &ChunkPlan, position: usize, ticket: u64, slot: &mut ReadSlot) {
        slot.ticket = 0;
        let Some((file, offset, len)) = plan.span(position) else {
            return;
        };
        let Some(f) = self.files.get(file) else {
            return;
        };
        let s = slot.start();
        let Some(out) = slot.storage.get_mut(s..s + len) else {
            return;
        };
        if read_exact_at(f, out, offset).is_ok() {
            slot.len = len;
            slot.ticket = ticket;
        }
    }

    /// Ask the kernel to start reading the chunk at `position` into the
    /// page cache (nothing is mapped).
    fn will_need(&self, plan: &ChunkPlan, position: usize) {
        let Some((file, offset, len)) = plan.span(position) else {
            return;
        };
        if let Some(f) = self.files.get(file) {
            use std::os::fd::AsRawFd;
            // SAFETY: an advisory call on a file descriptor this struct owns.
            unsafe {
                libc::posix_fadvise(
                    f.as_raw_fd(),
                    offset as libc::off_t,
                    len as libc::off_t,
                    libc::POSIX_FADV_WILLNEED,
                );
            }
        }
    }
}

/// Fill `out` from `file` at `offset` (an error when the file is shorter).
fn read_exact_at(file: &File, out: &mut [u8], offset: u64) -> std::io::Result<()> {
    let mut done = 0;
    while done < out.len() {
        match file.read_at(&mut out[done..], offset + done as u64) {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Where chunks come from (see the module docs).
enum Source {
    /// Faulted in through the file mapping, dropped after use.
    Mapped,
    /// Read into reused buffers; nothing of the weights is mapped.
    Read(Arc<ReadBuffers>),
}

/// Streams the planned matrices chunk by chunk, reading ahead on a thread.
pub struct ChunkStream {
    backend: Arc<dyn StorageBackend>,
    plan: Arc<ChunkPlan>,
    shared: Arc<Shared>,
    source: Source,
    worker: Option<JoinHandle<()>>,
    /// Time matmuls waited for chunks since the last [`ChunkStream::take_io_wait`].
    io_wait_ns: AtomicU64,
    /// One chunk's output for multi-token steps, scattered into the full output.
    part: Mutex<Vec<f32>>,
}

impl ChunkStream {
    /// Start streaming `plan`, with a thread reading `depth` chunks ahead
    /// (none when `depth` is 0). Chunks are read into `depth + 1` buffers
    /// when the plan allows it (and the files open), else mapped.
    pub fn start(backend: Arc<dyn StorageBackend>, plan: ChunkPlan, depth: usize) -> ChunkStream {
        // More read-ahead than the plan holds would fetch the chunk in use.
        let depth = depth.min(plan.len().saturating_sub(1));
        let source = plan
            .readable
            .then(|| ReadBuffers::new(backend.as_ref(), depth + 1, plan.largest_chunk()))
            .flatten()
            .map_or(Source::Mapped, |b| Source::Read(Arc::new(b)));
        let plan = Arc::new(plan);
        let shared = Arc::new(Shared::default());
        let worker = (depth > 0)
            .then(|| {
                let (backend, plan, shared) = (backend.clone(), plan.clone(), shared.clone());
                let buffers = match &source {
                    Source::Read(b) => Some(b.clone()),
                    Source::Mapped => None,
                };
                std::thread::Builder::new()
                    .name("flatrun-chunk-reader".into())
                    .spawn(move || {
                        read_ahead(
                            backend.as_ref(),
                            &plan,
                            buffers.as_deref(),
                            &shared,
                            depth as u64,
                        )
                    })
                    .ok()
            })
            .flatten();
        ChunkStream {
            backend,
            plan,
            shared,
            source,
            worker,
            io_wait_ns: AtomicU64::new(0),
            part: Mutex::new(Vec::new()),
        }
    }

    /// The plan.
    pub fn plan(&self) -> &ChunkPlan {
        &self.plan
    }

    /// Whether chunks are read into buffers (`false`: mapped).
    pub fn reads_explicitly(&self) -> bool {
        matches!(self.source, Source::Read(_))
    }

    /// Time matmuls waited for chunks since the last call.
    pub fn take_io_wait(&self) -> Duration {
        Duration::from_nanos(self.io_wait_ns.swap(0, Ordering::Relaxed))
    }

    /// Make the chunk at `position` the executor's and return its ticket:
    /// wait while the thread is fetching it (or a chunk before it), and
    /// release what the thread mapped in a skipped part of the plan.
    fn acquire(&self, position: usize) -> u64 {
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
        if matches!(self.source, Source::Read(_)) {
            // Skipped reads just leave their buffers to be reused.
            return ticket;
        }
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
        ticket
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
            let mut chunk = w.row_range(rows.clone())?;
            let t_io = Instant::now();
            let ticket = self.acquire(position);
            // Read: the chunk's rows from its buffer (read now when the
            // read-ahead was not in time).
            if let Source::Read(buffers) = &self.source {
                let mut slot = buffers.slot(ticket);
                if slot.ticket != ticket {
                    buffers.read(&self.plan, position, ticket, &mut slot);
                }
                if slot.ticket == ticket && slot.len == chunk.data.len() {
                    self.io_wait_ns
                        .fetch_add(t_io.elapsed().as_nanos() as u64, Ordering::Relaxed);
                    chunk.data = slot.bytes();
                    self.multiply(inner, &chunk, rows, w.rows, x, n, out)?;
                    continue;
                }
                // A failed read: the mapping below serves this chunk.
            }
            // Mapped: fault the chunk in (already done when the read-ahead was in time).
            touch(&chunk, memory::populate);
            self.io_wait_ns
                .fetch_add(t_io.elapsed().as_nanos() as u64, Ordering::Relaxed);
            let result = self.multiply(inner, &chunk, rows, w.rows, x, n, out);
            // Drop the chunk's pages (and whatever fault-around mapped next
            // to them), except a block the next chunk shares.
            self.plan.release(position, &chunk);
            result?;
        }
        Ok(())
    }

    /// `out[t, rows] = x[t] · chunkᵀ` for the `n` tokens of `x`, where `out`
    /// holds `n` rows of `out_rows` values.
    #[allow(clippy::too_many_arguments)]
    fn multiply(
        &self,
        inner: &dyn Kernels,
        chunk: &Weight,
        rows: Range<usize>,
        out_rows: usize,
        x: &[f32],
        n: usize,
        out: &mut [f32],
    ) -> std::result::Result<(), KernelError> {
        if n == 1 {
            return inner.matmul(chunk, x, 1, &mut out[rows]);
        }
        let mut part = self.part.lock().unwrap_or_else(|e| e.into_inner());
        part.resize(n * rows.len(), 0.0);
        inner.matmul(chunk, x, n, &mut part)?;
        for (t, row) in part.chunks_exact(rows.len()).enumerate() {
            out[t * out_rows + rows.start..t * out_rows + rows.end].copy_from_slice(row);
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

/// The read-ahead thread: keep the `depth` chunks after the executor's
/// fetched (read into `buffers`, or else populated in the mapping).
fn read_ahead(
    backend: &dyn StorageBackend,
    plan: &ChunkPlan,
    buffers: Option<&ReadBuffers>,
    shared: &Shared,
    depth: u64,
) {
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
        let position = plan.position(ticket);
        let later = plan.position(ticket + depth);
        match buffers {
            Some(b) => {
                // The executor is at most at `ticket - 1`: this slot is free.
                b.read(plan, position, ticket, &mut b.slot(ticket));
                // Start the disk on the chunk `depth` further (page cache only).
                b.will_need(plan, later);
            }
            None => {
                if let Some(c) = plan.chunks.get(position) {
                    touch_planned(backend, plan, c, memory::populate);
                }
                if let Some(c) = plan.chunks.get(later) {
                    touch_planned(backend, plan, c, memory::will_need);
                }
            }
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
