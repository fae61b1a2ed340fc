//! The weight engine: every byte of weights a step uses comes through it.
//!
//! At load the executor cuts the model into **items** — byte ranges of the
//! checkpoint's files: a whole layer, the small vectors of a layer, a row
//! chunk of one matrix, a row chunk of the output head — and gives each a
//! cache policy:
//!
//! * **kept** items stay in the file mapping. They are faulted in once
//!   (`MADV_POPULATE_READ`), by the read-ahead thread in its spare time or by
//!   the executor on first use, and never released.
//! * **streamed** items are read again at every step, in the order the step
//!   uses them (the *schedule*, cyclic): a read-ahead thread `pread`s the
//!   next `depth` of them into `depth + 1` reused, aligned buffers, through
//!   the page cache or around it ([`CachePolicy`]), and asks the system to
//!   start on the ones after them. Nothing of a streamed item is mapped.
//!
//! ```text
//! executor:   acquire(item) ─ wait while the thread reads it (I/O wait) ─► Lease ─► compute ─► drop
//! thread:     free buffer ─► pread the next scheduled item ─► ready ─┐      (buffer back to the pool)
//!             nothing to read: fault in the next cold kept item      │
//! ```
//!
//! Streamed items are numbered by a ticket that only grows (`ticket - 1`
//! modulo the schedule's length is the item's position), so a step that
//! skips part of the schedule (no logits wanted: no head) just jumps ahead;
//! what was read for the skipped part goes back to the pool.
//!
//! Every residency mode is a configuration of this one engine
//! ([`crate::residency`], `plan.rs`): resident keeps every layer; `stream`
//! streams row chunks of every matrix (a fixed byte budget in flight,
//! whatever a layer's size); `cap=SIZE` and custom policies keep some layers
//! and stream the others whole.
//!
//! A mixture-of-experts layer's routed experts are not part of any item
//! unless the whole model is kept: the router's choice is known only once
//! it ran, so each chosen expert (all its projections) is read then, in one
//! request outside the schedule ([`WeightEngine::read_later`]), and offered to
//! the expert cache (`experts.rs`), which keeps the experts used most
//! within what the cap leaves.
//!
//! A sequence's KV cache that lives in a file (stream and capped modes) is
//! one more kind of item, per layer and sequence
//! ([`crate::kv_cache::LayerPages`]): while a layer runs, the thread asks
//! the system for the next layer's keys and values from the cache's file
//! ([`WeightEngine::read_pages_ahead`]) before anything else it has to do,
//! and once the layer ran its pages leave the process
//! ([`WeightEngine::release_pages`]). Unlike a weight item the bytes are
//! written as well as read, so they stay mapped rather than copied into a
//! buffer: the page cache holds them between layers and writes them back.

pub(crate) mod buffer;
pub(crate) mod experts;
pub(crate) mod kernels;
pub(crate) mod plan;
pub(crate) mod readers;
mod source;

pub(crate) use plan::{LayerLayout, WeightPlan};
pub(crate) use source::CachePolicy;

use crate::kv_cache::{LayerPages, PagesAhead};
use buffer::AlignedBuffer;
use flatrun_format::StorageBackend;
use readers::{PendingRead, Readers};
use source::{DIRECT_ALIGN, ReadFile};
use std::ops::Range;
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::thread::JoinHandle;

/// One byte span of a checkpoint file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Span {
    /// Index into the backend's files.
    pub file: usize,
    /// Absolute offset in that file.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
}

impl Span {
    /// Whether `self` holds all of `file[offset .. offset + len]`.
    fn holds(&self, file: usize, offset: u64, len: u64) -> bool {
        self.file == file && self.offset <= offset && offset + len <= self.offset + self.len
    }
}

/// Concurrent on-demand reads (a decode step's routed experts).
const ON_DEMAND_READERS: usize = 4;

/// Spans closer than this are read as one request (a small gap costs less
/// than another request).
pub(crate) const COALESCE_GAP: u64 = 64 << 10;

/// Merge `spans` of the same file separated by at most `gap` bytes into as
/// few spans as possible (sorted by file and offset).
pub(crate) fn coalesce(mut spans: Vec<Span>, gap: u64) -> Vec<Span> {
    spans.sort_by_key(|s| (s.file, s.offset));
    let mut out: Vec<Span> = Vec::with_capacity(spans.len());
    for s in spans {
        match out.last_mut() {
            Some(last) if last.file == s.file && s.offset <= last.offset + last.len + gap => {
                let end = (last.offset + last.len).max(s.offset + s.len);
                last.len = end - last.offset;
            }
            _ => out.push(s),
        }
    }
    out
}

/// Length of the aligned read covering `offset .. offset + len`.
fn aligned_len(offset: u64, len: u64) -> u64 {
    let start = offset / DIRECT_ALIGN * DIRECT_ALIGN;
    (offset + len).div_ceil(DIRECT_ALIGN) * DIRECT_ALIGN - start
}

/// Buffer bytes a streamed item of `spans` needs: each span widened to
/// aligned bounds, each starting aligned.
fn buffer_bytes(spans: &[Span]) -> usize {
    spans
        .iter()
        .map(|s| (aligned_len(s.offset, s.len) + DIRECT_ALIGN) as usize)
        .sum()
}

/// A mapped byte range of a kept item (address and length in the
/// backend's mapping).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Mapped {
    pub addr: usize,
    pub len: usize,
}

impl Mapped {
    pub(crate) fn of(bytes: &[u8]) -> Mapped {
        Mapped {
            addr: bytes.as_ptr() as usize,
            len: bytes.len(),
        }
    }
}

/// Warm-up state of a kept item.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Warmth {
    Cold,
    Warming,
    Warm,
}

/// What the executor and the read-ahead thread share.
struct Window {
    /// The ticket the executor acquired last (0: none yet).
    at: u64,
    /// The thread has handled every ticket up to this one.
    done: u64,
    /// The ticket the thread is reading right now.
    busy: Option<u64>,
    /// The executor is gone.
    stop: bool,
    /// Buffers free for the next read.
    free: Vec<AlignedBuffer>,
    /// Items read ahead, by ticket.
    ready: Vec<(u64, Fetched)>,
    /// Per kept item.
    warmth: Vec<Warmth>,
    /// File-backed layer memory to ask the system for, oldest first.
    pages: Vec<PagesAhead>,
}

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

/// A streamed item's bytes, read into a buffer.
struct Fetched {
    buffer: AlignedBuffer,
    /// Per span of the item: the span and where its first byte is in `buffer`.
    placed: Vec<(Span, usize)>,
    error: Option<String>,
}

impl Fetched {
    /// The bytes of `file[offset .. offset + len]`, if they were read.
    fn bytes(&self, file: usize, offset: u64, len: u64) -> Option<&[u8]> {
        let (span, at) = self
            .placed
            .iter()
            .find(|(s, _)| s.holds(file, offset, len))?;
        let start = at + (offset - span.offset) as usize;
        self.buffer.as_slice().get(start..start + len as usize)
    }
}

/// Bytes read on demand, outside the schedule (a routed expert's rows): its
/// own buffer, freed when dropped.
pub(crate) struct OnDemand {
    fetched: Fetched,
}

impl OnDemand {
    /// The bytes of `file[offset .. offset + len]`, if the read holds them.
    pub(crate) fn bytes(&self, file: usize, offset: u64, len: u64) -> Option<&[u8]> {
        self.fetched.bytes(file, offset, len)
    }
}

/// The files of a checkpoint, opened lazily for reads.
struct Files {
    paths: Vec<PathBuf>,
    open: Vec<Option<ReadFile>>,
    policy: CachePolicy,
}

impl Files {
    fn new(paths: Vec<PathBuf>, policy: CachePolicy) -> Files {
        Files {
            open: paths.iter().map(|_| None).collect(),
            paths,
            policy,
        }
    }

    fn get(&mut self, file: usize) -> Result<&mut ReadFile, String> {
        let path = self
            .paths
            .get(file)
            .ok_or_else(|| format!("no checkpoint file {file}"))?;
        let slot = &mut self.open[file];
        if slot.is_none() {
            *slot = Some(
                ReadFile::open(path, self.policy)
                    .map_err(|e| format!("opening {}: {e}", path.display()))?,
            );
        }
        Ok(slot.as_mut().expect("opened just above"))
    }

    /// Read `spans` into `buffer`, each span from an aligned offset.
    fn read(&mut self, spans: &[Span], mut buffer: AlignedBuffer) -> Fetched {
        let mut placed = Vec::with_capacity(spans.len());
        let mut at = 0usize;
        let mut error = None;
        for span in spans {
            let start = span.offset / DIRECT_ALIGN * DIRECT_ALIGN;
            let len = aligned_len(span.offset, span.len) as usize;
            let result = self.get(span.file).and_then(|f| {
                let out = buffer
                    .as_mut_slice()
                    .get_mut(at..at + len)
                    .ok_or_else(|| "read buffer too small".to_string())?;
                f.read_at(out, start).map_err(|e| e.to_string())
            });
            if let Err(e) = result {
                let path = self.paths.get(span.file).map(|p| p.display().to_string());
                error = Some(format!(
                    "reading {} at {}: {e}",
                    path.unwrap_or_default(),
                    span.offset
                ));
                break;
            }
            placed.push((*span, at + (span.offset - start) as usize));
            at = (at + len).next_multiple_of(DIRECT_ALIGN as usize);
        }
        Fetched {
            buffer,
            placed,
            error,
        }
    }

    fn will_need(&mut self, spans: &[Span]) {
        for s in spans {
            if let Ok(f) = self.get(s.file) {
                f.will_need(s.offset, s.len);
            }
        }
    }
}

/// A streamed item the executor holds: its bytes, located by file span.
/// Dropping it hands its buffer back for the next read.
pub(crate) struct Lease {
    fetched: Option<Fetched>,
    shared: Arc<Shared>,
}

impl Lease {
    /// The bytes of `file[offset .. offset + len]`, if the item holds them.
    pub(crate) fn bytes(&self, file: usize, offset: u64, len: u64) -> Option<&[u8]> {
        self.fetched.as_ref()?.bytes(file, offset, len)
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if let Some(f) = self.fetched.take() {
            self.shared.lock().free.push(f.buffer);
            self.shared.changed.notify_all();
        }
    }
}

/// Why an item could not be acquired.
#[derive(Debug)]
pub(crate) struct FetchError(pub String);

/// The engine: the items, the read-ahead thread and its buffers.
pub(crate) struct WeightEngine {
    /// Streamed items, by index.
    streamed: Arc<Vec<Vec<Span>>>,
    /// Kept items' mapped ranges, by index.
    kept: Arc<Vec<Vec<Mapped>>>,
    shared: Arc<Shared>,
    /// The executor's own reads (when the thread is behind or absent), and
    /// on-demand reads: one set of descriptors per concurrent reader.
    files: Vec<Mutex<Files>>,
    policy: CachePolicy,
    buffer_bytes: usize,
    worker: Option<JoinHandle<()>>,
    /// The checkpoint's files, for the background readers.
    paths: Vec<PathBuf>,
    /// Background readers of routed experts, started on first use.
    readers: OnceLock<Readers>,
    /// Keeps the mapping that `kept` points into alive.
    _backend: Arc<dyn StorageBackend>,
}

impl WeightEngine {
    /// Start the engine over `backend`: `streamed` items are read in
    /// schedule order (their index order), cyclically, up to `depth` ahead
    /// of the executor under `policy`; `kept` items are faulted in once.
    /// With `depth` 0 there is no thread: the executor reads each item
    /// when it acquires it.
    pub(crate) fn start(
        backend: Arc<dyn StorageBackend>,
        streamed: Vec<Vec<Span>>,
        kept: Vec<Vec<Mapped>>,
        depth: usize,
        policy: CachePolicy,
    ) -> WeightEngine {
        // No read-ahead: no thread; the executor reads and faults in
        // everything itself, when it acquires it.
        let needs_thread = depth > 0;
        // More read-ahead than there are items would read the one in use.
        let depth = depth.min(streamed.len().saturating_sub(1));
        let buffer_bytes = streamed.iter().map(|s| buffer_bytes(s)).max().unwrap_or(0);
        let buffer_count = if streamed.is_empty() { 0 } else { depth + 1 };
        let free = (0..buffer_count)
            .filter_map(|_| AlignedBuffer::new(buffer_bytes))
            .collect();
        let shared = Arc::new(Shared {
            window: Mutex::new(Window {
                at: 0,
                done: 0,
                busy: None,
                stop: false,
                free,
                ready: Vec::new(),
                warmth: vec![Warmth::Cold; kept.len()],
                pages: Vec::new(),
            }),
            changed: Condvar::new(),
        });
        let paths = backend.files().to_vec();
        let streamed = Arc::new(streamed);
        let kept = Arc::new(kept);
        let worker = needs_thread
            .then(|| {
                let (streamed, kept, shared) = (streamed.clone(), kept.clone(), shared.clone());
                let files = Files::new(paths.clone(), policy);
                std::thread::Builder::new()
                    .name("flatrun-weights".into())
                    .spawn(move || read_ahead(&streamed, &kept, &shared, files, depth as u64))
                    .ok()
            })
            .flatten();
        WeightEngine {
            streamed,
            kept,
            shared,
            files: (0..ON_DEMAND_READERS)
                .map(|_| Mutex::new(Files::new(paths.clone(), policy)))
                .collect(),
            policy,
            buffer_bytes,
            worker,
            paths,
            readers: OnceLock::new(),
            _backend: backend,
        }
    }

    /// Whether streamed reads go through the page cache and stay there.
    pub(crate) fn page_cache(&self) -> bool {
        self.policy == CachePolicy::Keep
    }

    /// Whether anything is streamed.
    pub(crate) fn streams(&self) -> bool {
        !self.streamed.is_empty()
    }

    /// Make kept item `k` resident: at once if warm, else wait for the
    /// thread or fault it in here.
    pub(crate) fn warm(&self, k: usize) {
        let mut w = self.shared.lock();
        loop {
            match w.warmth.get(k).copied() {
                None | Some(Warmth::Warm) => return,
                Some(Warmth::Warming) => w = self.shared.wait(w),
                Some(Warmth::Cold) => {
                    w.warmth[k] = Warmth::Warming;
                    drop(w);
                    populate_kept(&self.kept[k]);
                    self.shared.lock().warmth[k] = Warmth::Warm;
                    self.shared.changed.notify_all();
                    return;
                }
            }
        }
    }

    /// Whether kept item `k` has been faulted in.
    pub(crate) fn is_warm(&self, k: usize) -> bool {
        self.shared.lock().warmth.get(k) == Some(&Warmth::Warm)
    }

    /// A reader's descriptors: a free one, else the first (waiting for it).
    fn reader(&self) -> MutexGuard<'_, Files> {
        for f in &self.files {
            if let Ok(guard) = f.try_lock() {
                return guard;
            }
        }
        self.files[0].lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Ask for `spans` (one expert's rows, say) to be read outside the
    /// schedule, in the background, after every request asked for before;
    /// wait on the handle when the bytes are needed.
    pub(crate) fn read_later(&self, spans: Vec<Span>) -> Arc<PendingRead> {
        self.readers
            .get_or_init(|| Readers::start(&self.paths, self.policy, ON_DEMAND_READERS))
            .submit(spans)
    }

    /// Read a layer's file-backed memory ahead of its use (a streamed KV
    /// cache's keys and values): the read-ahead thread asks the system for
    /// it before its next read, or this call does when there is no thread.
    /// Returns at once, with the bytes asked for.
    pub(crate) fn read_pages_ahead(&self, pages: PagesAhead) -> u64 {
        let bytes = pages.bytes();
        if self.worker.is_some() {
            self.shared.lock().pages.push(pages);
            self.shared.changed.notify_all();
        } else {
            pages.start();
        }
        bytes
    }

    /// Done with a layer's file-backed memory for this step: its pages
    /// leave the process (the page cache and the file keep the bytes).
    /// Returns the bytes released.
    pub(crate) fn release_pages(&self, pages: LayerPages<'_>) -> u64 {
        let bytes = pages.bytes();
        pages.release();
        bytes
    }

    /// Take streamed item `item`: wait while the thread reads it (or an item
    /// before it), read it here when the thread is not on it.
    pub(crate) fn acquire(&self, item: usize) -> Result<Lease, FetchError> {
        // The schedule is the items' index order.
        if item >= self.streamed.len() {
            return Err(FetchError(format!("no streamed item {item}")));
        }
        let (position, len) = (item as u64, self.streamed.len() as u64);
        let mut w = self.shared.lock();
        let old = w.at;
        let ticket = old + 1 + (position + len - old % len) % len;
        w.at = ticket;
        self.shared.changed.notify_all();
        while w.busy.is_some_and(|b| b <= ticket) {
            w = self.shared.wait(w);
        }
        // What was read for skipped tickets goes back to the pool.
        let mut found = None;
        let mut k = 0;
        while k < w.ready.len() {
            if w.ready[k].0 < ticket {
                let (_, f) = w.ready.swap_remove(k);
                w.free.push(f.buffer);
            } else if w.ready[k].0 == ticket {
                found = Some(w.ready.swap_remove(k).1);
            } else {
                k += 1;
            }
        }
        let fetched = match found {
            Some(f) => f,
            None => {
                // Not read ahead (no thread, or it was behind): read it here.
                let buffer = w.free.pop();
                drop(w);
                let buffer = buffer
                    .or_else(|| AlignedBuffer::new(self.buffer_bytes))
                    .ok_or_else(|| FetchError("cannot allocate a read buffer".into()))?;
                let mut files = self.reader();
                files.read(&self.streamed[item], buffer)
            }
        };
        self.shared.changed.notify_all();
        let lease = Lease {
            fetched: Some(fetched),
            shared: self.shared.clone(),
        };
        match lease.fetched.as_ref().and_then(|f| f.error.clone()) {
            Some(e) => Err(FetchError(e)),
            None => Ok(lease),
        }
    }
}

impl Drop for WeightEngine {
    fn drop(&mut self) {
        self.shared.lock().stop = true;
        self.shared.changed.notify_all();
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}

/// Fault in every range of a kept item.
fn populate_kept(ranges: &[Mapped]) {
    for m in ranges {
        // SAFETY: the range was taken from a tensor's bytes in the backend's
        // read-only mapping, which the engine keeps alive (`_backend`) for
        // as long as this thread and the executor run.
        let bytes = unsafe { std::slice::from_raw_parts(m.addr as *const u8, m.len) };
        crate::memory::populate(bytes);
    }
}

/// What the thread does next.
enum Task {
    Read(u64, AlignedBuffer),
    Warm(usize),
    Pages(Vec<PagesAhead>),
}

/// The read-ahead thread: first ask for the layer memory the executor
/// announced (cheap: the system reads it in the background), then keep the
/// `depth` streamed items after the executor's read; with nothing to read,
/// fault in the cold kept items in order.
fn read_ahead(
    streamed: &[Vec<Span>],
    kept: &[Vec<Mapped>],
    shared: &Shared,
    mut files: Files,
    depth: u64,
) {
    let len = streamed.len() as u64;
    loop {
        let task = {
            let mut w = shared.lock();
            loop {
                if w.stop {
                    return;
                }
                if !w.pages.is_empty() {
                    break Task::Pages(std::mem::take(&mut w.pages));
                }
                let next = w.done.max(w.at) + 1;
                if len > 0 && next <= w.at + depth && !w.free.is_empty() {
                    let buffer = w.free.pop().expect("checked non-empty");
                    w.busy = Some(next);
                    break Task::Read(next, buffer);
                }
                if let Some(k) = w.warmth.iter().position(|&s| s == Warmth::Cold) {
                    w.warmth[k] = Warmth::Warming;
                    break Task::Warm(k);
                }
                w = shared.wait(w);
            }
        };
        match task {
            Task::Read(ticket, buffer) => {
                let position = ((ticket - 1) % len) as usize;
                let fetched = files.read(&streamed[position], buffer);
                // Start the disk on the item `depth` further (page cache only).
                files.will_need(&streamed[((ticket - 1 + depth) % len) as usize]);
                let mut w = shared.lock();
                w.busy = None;
                w.done = w.done.max(ticket);
                if ticket >= w.at {
                    w.ready.push((ticket, fetched));
                } else {
                    // The executor jumped past it (or read it itself).
                    w.free.push(fetched.buffer);
                }
            }
            Task::Warm(k) => {
                populate_kept(&kept[k]);
                shared.lock().warmth[k] = Warmth::Warm;
            }
            Task::Pages(pages) => {
                for p in &pages {
                    p.start();
                }
            }
        }
        shared.changed.notify_all();
    }
}

/// The byte range of rows `rows` of a matrix whose rows are `row_bytes`
/// long and start at `offset`.
pub(crate) fn row_span(file: usize, offset: u64, row_bytes: usize, rows: Range<usize>) -> Span {
    Span {
        file,
        offset: offset + (rows.start * row_bytes) as u64,
        len: (rows.len() * row_bytes) as u64,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flatrun_format::{Metadata, TensorHandle, TensorInfo};
    use std::io::Write;
    use std::path::Path;

    /// A backend with no tensors over one file (the engine only reads files).
    struct Files1 {
        files: Vec<PathBuf>,
        meta: Metadata,
    }

    impl StorageBackend for Files1 {
        fn name(&self) -> &'static str {
            "test"
        }
        fn supports_mmap(&self) -> bool {
            false
        }
        fn files(&self) -> &[PathBuf] {
            &self.files
        }
        fn directory(&self) -> Option<&Path> {
            None
        }
        fn metadata(&self) -> &Metadata {
            &self.meta
        }
        fn tensors(&self) -> &[TensorInfo] {
            &[]
        }
        fn tensor(&self, name: &str) -> flatrun_format::Result<TensorHandle<'_>> {
            Err(flatrun_format::FormatError::NoSuchTensor(name.to_string()))
        }
    }

    fn engine(
        path: &Path,
        depth: usize,
        policy: CachePolicy,
        items: Vec<Vec<Span>>,
    ) -> WeightEngine {
        let backend = Arc::new(Files1 {
            files: vec![path.to_path_buf()],
            meta: Metadata::default(),
        });
        WeightEngine::start(backend, items, Vec::new(), depth, policy)
    }

    fn span(offset: u64, len: u64) -> Span {
        Span {
            file: 0,
            offset,
            len,
        }
    }

    #[test]
    fn reads_items_in_order_skips_and_repeats() {
        let mut f = tempfile::NamedTempFile::new().expect("temp file");
        let data: Vec<u8> = (0..100_000u32).map(|i| (i * 7 % 251) as u8).collect();
        f.write_all(&data).expect("write");
        let items = vec![
            vec![span(10, 5000)],
            coalesce(vec![span(60_000, 100), span(50_001, 333)], 4096),
            vec![span(99_000, 1000)],
        ];
        assert_eq!(items[1].len(), 2);
        for policy in [CachePolicy::Keep, CachePolicy::Bypass] {
            for depth in [0, 1, 2] {
                let e = engine(f.path(), depth, policy, items.clone());
                assert_eq!(e.page_cache(), policy == CachePolicy::Keep);
                for round in 0..4 {
                    let a = e.acquire(0).expect("item 0");
                    assert_eq!(a.bytes(0, 100, 50), Some(&data[100..150]));
                    assert_eq!(a.bytes(0, 6000, 10), None);
                    drop(a);
                    if round != 1 {
                        // Round 1 skips item 1.
                        let b = e.acquire(1).expect("item 1");
                        assert_eq!(b.bytes(0, 60_010, 90), Some(&data[60_010..60_100]));
                        assert_eq!(b.bytes(0, 50_001, 333), Some(&data[50_001..50_334]));
                    }
                    let c = e.acquire(2).expect("item 2");
                    assert_eq!(c.bytes(0, 99_500, 500), Some(&data[99_500..100_000]));
                }
            }
        }
    }

    #[test]
    fn a_read_past_the_end_is_an_error_not_a_panic() {
        let mut f = tempfile::NamedTempFile::new().expect("temp file");
        f.write_all(&[1u8; 100]).expect("write");
        let e = engine(
            f.path(),
            1,
            CachePolicy::Keep,
            vec![vec![Span {
                file: 3,
                offset: 0,
                len: 10,
            }]],
        );
        assert!(e.acquire(0).is_err());
        assert!(e.acquire(7).is_err());
    }

    #[test]
    fn kept_items_are_warmed_once() {
        let data = vec![3u8; 1 << 16];
        let backend = Arc::new(Files1 {
            files: Vec::new(),
            meta: Metadata::default(),
        });
        let kept = vec![vec![Mapped::of(&data)], vec![Mapped::of(&data[100..200])]];
        let e = WeightEngine::start(backend, Vec::new(), kept, 1, CachePolicy::Keep);
        e.warm(1);
        assert!(e.is_warm(1));
        e.warm(0);
        assert!(e.is_warm(0));
        assert!(!e.streams());
    }

    #[test]
    fn coalesce_merges_close_spans() {
        let out = coalesce(vec![span(100, 10), span(0, 50), span(200_000, 5)], 64);
        assert_eq!(out, vec![span(0, 110), span(200_000, 5)]);
    }
}
