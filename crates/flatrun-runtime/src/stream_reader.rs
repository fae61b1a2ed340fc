//! Explicit reads of the streamed weights of a capped model.
//!
//! Under `Residency::Cap` the layers that do not fit are re-read every token.
//! Faulting them in through the file mapping would put them in the page
//! cache, where (inside a memory cgroup) they evict the very layers the cap
//! keeps. Instead a background thread reads each streamed item — a layer's
//! matrices, or one row chunk of a streamed output head — with large `pread`s
//! into one of a few reused, page-aligned buffers, with `O_DIRECT` where the
//! file system allows it (the page cache is bypassed; otherwise the read
//! pages are dropped again with `POSIX_FADV_DONTNEED`). When memory is
//! plentiful ([`StreamReads`]), the reads go through the page cache and stay
//! there instead: a warm cache then serves them at memory speed. The thread walks the
//! streamed items in the order a step uses them, cyclically, up to `depth`
//! items ahead of the executor, so disk reads overlap compute.
//!
//! ```text
//! reader thread:  free buffer ← pool;  pread item k into it;  ready ← (k, buffer)
//! executor:       acquire(k): wait for (k, buffer) (the I/O wait); compute; release → pool
//! ```

use crate::options::StreamReads;
use crate::residency::ResidencyPlan;
use flatrun_format::StorageBackend;
use flatrun_kernels::Weight;
use flatrun_model::Manifest;
use std::fs::File;
use std::ops::Range;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

/// How often an idle reader thread checks whether it should stop.
const STOP_POLL: Duration = Duration::from_millis(50);

/// Alignment of `O_DIRECT` offsets, lengths and buffer addresses.
const DIRECT_ALIGN: u64 = 4096;

/// One byte span of a file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Span {
    /// Index into the backend's files.
    pub file: usize,
    /// Absolute offset in that file.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
}

/// What the reader reads as one unit: the spans of one layer's matrices,
/// or of one chunk of the output head.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StreamItem {
    pub spans: Vec<Span>,
}

impl StreamItem {
    /// Buffer bytes the item needs: each span widened to aligned bounds.
    fn buffer_bytes(&self) -> u64 {
        self.spans
            .iter()
            .map(|s| aligned_len(s.offset, s.len) + DIRECT_ALIGN)
            .sum()
    }
}

/// Length of the aligned read covering `offset .. offset + len`.
fn aligned_len(offset: u64, len: u64) -> u64 {
    let start = offset / DIRECT_ALIGN * DIRECT_ALIGN;
    let end = (offset + len).div_ceil(DIRECT_ALIGN) * DIRECT_ALIGN;
    end - start
}

/// A heap buffer whose address is `DIRECT_ALIGN`-aligned.
struct AlignedBuffer {
    ptr: std::ptr::NonNull<u8>,
    len: usize,
}

// SAFETY: the buffer owns its allocation exclusively (like a `Vec<u8>`); it
// moves between the reader thread and the executor through channels, and
// only its current holder touches it.
unsafe impl Send for AlignedBuffer {}

impl AlignedBuffer {
    fn layout(len: usize) -> Option<std::alloc::Layout> {
        std::alloc::Layout::from_size_align(len.max(1), DIRECT_ALIGN as usize).ok()
    }

    /// A zeroed buffer of `len` bytes, or `None` when it cannot be allocated.
    fn new(len: usize) -> Option<AlignedBuffer> {
        let layout = Self::layout(len)?;
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { std::alloc::alloc_zeroed(layout) };
        std::ptr::NonNull::new(raw).map(|ptr| AlignedBuffer { ptr, len })
    }

    fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` points to `len` initialized (zeroed, then read into)
        // bytes owned by this buffer.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`, and `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuffer {
    fn drop(&mut self) {
        if let Some(layout) = Self::layout(self.len) {
            // SAFETY: allocated in `new` with this same layout.
            unsafe { std::alloc::dealloc(self.ptr.as_ptr(), layout) };
        }
    }
}

/// One file opened for streaming reads.
struct Source {
    file: File,
    /// `O_DIRECT` is in force (aligned reads bypass the page cache).
    direct: bool,
    /// Buffered reads stay in the page cache (else they are dropped again).
    keep_cached: bool,
}

impl Source {
    /// Open `path` for direct reads, or for cached ones when `keep_cached`.
    fn open(path: &std::path::Path, keep_cached: bool) -> std::io::Result<Source> {
        if keep_cached {
            return Ok(Source {
                file: File::open(path)?,
                direct: false,
                keep_cached,
            });
        }
        match std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECT)
            .open(path)
        {
            Ok(file) => Ok(Source {
                file,
                direct: true,
                keep_cached,
            }),
            Err(_) => Ok(Source {
                file: File::open(path)?,
                direct: false,
                keep_cached,
            }),
        }
    }

    /// Read `out.len()` bytes at `offset` (fewer at the end of the file).
    fn read_at(&mut self, out: &mut [u8], offset: u64) -> std::io::Result<()> {
        let mut done = 0;
        while done < out.len() {
            match self.file.read_at(&mut out[done..], offset + done as u64) {
                Ok(0) => break,
                Ok(n) => done += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) if self.direct && e.raw_os_error() == Some(libc::EINVAL) => {
                    // The file system refuses direct I/O here: read through
                    // the page cache from now on.
                    self.direct = false;
                    self.file = reopen_buffered(&self.file)?;
                }
                Err(e) => return Err(e),
            }
        }
        if !self.direct && !self.keep_cached {
            // Buffered reads: drop the pages again so that streamed bytes do
            // not crowd the kept layers out of the page cache.
            use std::os::fd::AsRawFd;
            // SAFETY: a plain advisory call on a file descriptor we own.
            unsafe {
                libc::posix_fadvise(
                    self.file.as_raw_fd(),
                    offset as libc::off_t,
                    out.len() as libc::off_t,
                    libc::POSIX_FADV_DONTNEED,
                );
            }
        }
        Ok(())
    }
}

/// The same file without `O_DIRECT`.
fn reopen_buffered(file: &File) -> std::io::Result<File> {
    use std::os::fd::AsRawFd;
    File::open(format!("/proc/self/fd/{}", file.as_raw_fd()))
}

/// A streamed item that has been read: its bytes, located by file span.
/// Dropping it (or [`StreamReader::release`]) hands its buffer back to the
/// reader, also when a step fails half-way.
pub struct ReadItem {
    index: usize,
    buffer: Option<AlignedBuffer>,
    /// Where the buffer goes back to.
    pool: Sender<AlignedBuffer>,
    /// Per span of the item: (span, byte offset of the span's first byte in `buffer`).
    placed: Vec<(Span, usize)>,
    /// The read failed: why.
    error: Option<String>,
}

impl ReadItem {
    /// The bytes of `file[offset .. offset + len]`, if the item holds them.
    pub fn bytes(&self, file: usize, offset: u64, len: u64) -> Option<&[u8]> {
        let (span, at) = self.placed.iter().find(|(s, _)| {
            s.file == file && s.offset <= offset && offset + len <= s.offset + s.len
        })?;
        let start = at + (offset - span.offset) as usize;
        self.buffer
            .as_ref()?
            .as_slice()
            .get(start..start + len as usize)
    }
}

impl Drop for ReadItem {
    fn drop(&mut self) {
        if let Some(buffer) = self.buffer.take() {
            // The reader may be gone (shutting down): then the buffer is freed.
            let _ = self.pool.send(buffer);
        }
    }
}

/// Reads the streamed items of a capped model ahead of the executor.
pub struct StreamReader {
    items: Vec<StreamItem>,
    /// Tells the reader thread to stop (buffers in flight hold senders of
    /// the pool, so the pool channel alone never closes).
    stop: Arc<AtomicBool>,
    ready: Receiver<ReadItem>,
    worker: Option<JoinHandle<()>>,
    buffer_bytes: u64,
    page_cache: bool,
}

impl StreamReader {
    /// Start the reader over `files` for `items`, read in this order
    /// cyclically, at most `depth` items ahead of the one in use, through
    /// the page cache (`page_cache`) or around it. `None` when there is
    /// nothing to stream or the buffers cannot be allocated.
    pub fn start(
        files: Vec<PathBuf>,
        items: Vec<StreamItem>,
        depth: usize,
        page_cache: bool,
    ) -> Option<StreamReader> {
        if items.is_empty() {
            return None;
        }
        let size = items.iter().map(StreamItem::buffer_bytes).max()? as usize;
        let count = depth.max(1) + 1;
        let (free_tx, free_rx) = channel::<AlignedBuffer>();
        for _ in 0..count {
            free_tx.send(AlignedBuffer::new(size)?).ok()?;
        }
        let (ready_tx, ready_rx) = channel::<ReadItem>();
        let schedule = items.clone();
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let worker = std::thread::Builder::new()
            .name("flatrun-stream-reader".into())
            .spawn(move || {
                read_loop(
                    files, schedule, free_rx, free_tx, ready_tx, stopped, page_cache,
                )
            })
            .ok()?;
        Some(StreamReader {
            items,
            stop,
            ready: ready_rx,
            worker: Some(worker),
            buffer_bytes: size as u64 * count as u64,
            page_cache,
        })
    }

    /// The reads go through the page cache and stay there.
    pub fn page_cache(&self) -> bool {
        self.page_cache
    }

    /// The items, in reading order.
    pub fn items(&self) -> &[StreamItem] {
        &self.items
    }

    /// Bytes of the read buffers (anonymous memory).
    pub fn buffer_bytes(&self) -> u64 {
        self.buffer_bytes
    }

    /// Wait until item `index` has been read and take it. Items read ahead
    /// that the executor skipped (a step without logits skips the head) are
    /// handed back on the way. `Err` names a failed read.
    pub fn acquire(&mut self, index: usize) -> Result<ReadItem, String> {
        if index >= self.items.len() {
            return Err(format!("no streamed item {index}"));
        }
        // The reader visits every item once per cycle, so `index` comes
        // within one cycle (plus the buffers already read ahead).
        for _ in 0..=(2 * self.items.len() + 4) {
            let item = self
                .ready
                .recv()
                .map_err(|_| "the stream reader thread stopped".to_string())?;
            if item.index == index {
                if let Some(e) = &item.error {
                    let e = e.clone();
                    self.release(item);
                    return Err(e);
                }
                return Ok(item);
            }
            self.release(item);
        }
        Err(format!("streamed item {index} never arrived"))
    }

    /// Give an item's buffer back for the next read (the same as dropping it).
    pub fn release(&self, item: ReadItem) {
        drop(item);
    }
}

impl Drop for StreamReader {
    fn drop(&mut self) {
        // The thread checks the flag at least every `STOP_POLL`.
        self.stop.store(true, Ordering::Release);
        while self.ready.try_recv().is_ok() {}
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}

/// The reader thread: fill free buffers with the items in cyclic order.
fn read_loop(
    paths: Vec<PathBuf>,
    schedule: Vec<StreamItem>,
    free: Receiver<AlignedBuffer>,
    pool: Sender<AlignedBuffer>,
    ready: Sender<ReadItem>,
    stop: Arc<AtomicBool>,
    page_cache: bool,
) {
    let mut sources: Vec<Option<Source>> = paths.iter().map(|_| None).collect();
    let mut next = 0usize;
    loop {
        if stop.load(Ordering::Acquire) {
            return;
        }
        let mut buffer = match free.recv_timeout(STOP_POLL) {
            Ok(buffer) => buffer,
            Err(RecvTimeoutError::Timeout) => continue,
            Err(RecvTimeoutError::Disconnected) => return,
        };
        let index = next;
        next = (next + 1) % schedule.len();
        let mut placed = Vec::with_capacity(schedule[index].spans.len());
        let mut error = None;
        let mut at = 0usize;
        for span in &schedule[index].spans {
            let start = span.offset / DIRECT_ALIGN * DIRECT_ALIGN;
            let len = aligned_len(span.offset, span.len) as usize;
            let result = match sources.get_mut(span.file) {
                Some(slot) => {
                    if slot.is_none() {
                        *slot = paths
                            .get(span.file)
                            .and_then(|p| Source::open(p, page_cache).ok());
                    }
                    match (slot.as_mut(), buffer.as_mut_slice().get_mut(at..at + len)) {
                        (Some(source), Some(out)) => source
                            .read_at(out, start)
                            .map_err(|e| format!("reading {}: {e}", paths[span.file].display())),
                        (None, _) => Err(format!("cannot open {}", paths[span.file].display())),
                        (_, None) => Err("stream buffer too small".to_string()),
                    }
                }
                None => Err(format!("no file {}", span.file)),
            };
            if let Err(e) = result {
                error = Some(e);
                break;
            }
            placed.push((*span, at + (span.offset - start) as usize));
            at += len + DIRECT_ALIGN as usize;
            at = at / DIRECT_ALIGN as usize * DIRECT_ALIGN as usize;
        }
        let item = ReadItem {
            index,
            buffer: Some(buffer),
            pool: pool.clone(),
            placed,
            error,
        };
        if ready.send(item).is_err() {
            return;
        }
    }
}

/// Which weights of a capped model the [`StreamReader`] reads, and where
/// each is in its order: the streamed layers, then the streamed head's row
/// chunks.
pub struct StreamSchedule {
    /// The reader thread and its buffers.
    pub reader: StreamReader,
    /// `layer_item[i]`: the item holding layer `i`'s tensors, if streamed.
    layer_item: Vec<Option<usize>>,
    /// Row range and item of each chunk of a streamed output head.
    head_chunks: Vec<(Range<usize>, usize)>,
}

/// Neighbouring tensors closer than this are read in one request.
const COALESCE_GAP: u64 = 64 << 10;

impl StreamSchedule {
    /// Plan explicit reads of every layer `plan` does not keep (and for
    /// which `streamed(i)` holds), and of the output head from row
    /// `head_first_row` on (the rows before are kept) in chunks of
    /// `head_chunk_rows(row_bytes)` rows when it is not kept. `None` when
    /// nothing is streamed, or the checkpoint's tensors are not plain byte
    /// ranges of its files (MLX companion arrays): the mapping is used then.
    pub fn build(
        backend: &dyn StorageBackend,
        manifest: &Manifest,
        plan: &ResidencyPlan,
        streamed: impl Fn(usize) -> bool,
        head_chunk_rows: impl Fn(usize) -> usize,
        head_first_row: usize,
        depth: usize,
        reads: StreamReads,
    ) -> Option<StreamSchedule> {
        let span_of = |name: &str| -> Option<Span> {
            let h = backend.tensor(name).ok()?;
            if !h.parts().is_empty() {
                return None;
            }
            let info = h.info();
            Some(Span {
                file: info.file_index,
                offset: info.offset,
                len: h.bytes().len() as u64,
            })
        };
        let mut items = Vec::new();
        let mut layer_item = vec![None; manifest.layers.len()];
        for layer in &manifest.layers {
            if plan.is_resident(layer.index) || !streamed(layer.index) {
                continue;
            }
            let spans = layer
                .tensors
                .iter()
                .map(|t| span_of(&t.name))
                .collect::<Option<Vec<_>>>()?;
            if let Some(slot) = layer_item.get_mut(layer.index) {
                *slot = Some(items.len());
            }
            items.push(StreamItem {
                spans: coalesce(spans, COALESCE_GAP),
            });
        }
        let mut head_chunks = Vec::new();
        if !plan.output_resident {
            let h = backend.tensor(&manifest.output.name).ok()?;
            let head = span_of(&manifest.output.name)?;
            let w = Weight::from_handle(&h).ok()?;
            let row_bytes = w.row_bytes() as u64;
            let chunk_rows = head_chunk_rows(w.row_bytes()).max(1);
            let mut r0 = head_first_row.min(w.rows);
            while r0 < w.rows {
                let r1 = (r0 + chunk_rows).min(w.rows);
                head_chunks.push((r0..r1, items.len()));
                items.push(StreamItem {
                    spans: vec![Span {
                        file: head.file,
                        offset: head.offset + r0 as u64 * row_bytes,
                        len: (r1 - r0) as u64 * row_bytes,
                    }],
                });
                r0 = r1;
            }
        }
        let streamed_bytes: u64 = items
            .iter()
            .flat_map(|item| item.spans.iter().map(|s| s.len))
            .sum();
        let page_cache = match reads {
            StreamReads::Direct => false,
            StreamReads::PageCache => true,
            // Plentiful: the kept bytes, the streamed ones twice over
            // (page cache and a margin for what else runs) and 256 MiB.
            StreamReads::Auto => crate::memory::memory_headroom().is_some_and(|headroom| {
                headroom >= plan.resident_bytes + 2 * streamed_bytes + (256 << 20)
            }),
        };
        let reader = StreamReader::start(backend.files().to_vec(), items, depth, page_cache)?;
        Some(StreamSchedule {
            reader,
            layer_item,
            head_chunks,
        })
    }

    /// The item of layer `il`, if the reader streams it.
    pub fn layer(&self, il: usize) -> Option<usize> {
        self.layer_item.get(il).copied().flatten()
    }

    /// The streamed head's chunks (row range, item); empty when the head is
    /// kept or mapped.
    pub fn head_chunks(&self) -> &[(Range<usize>, usize)] {
        &self.head_chunks
    }
}

/// Group `spans` (sorted or not) into as few spans as possible, merging
/// neighbours of the same file separated by at most `gap` bytes (reading a
/// small gap costs less than another request).
pub fn coalesce(mut spans: Vec<Span>, gap: u64) -> Vec<Span> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn reads_items_in_order_and_skips_unwanted_ones() {
        let mut f = tempfile::NamedTempFile::new().expect("temp file");
        let data: Vec<u8> = (0..100_000u32).map(|i| (i * 7 % 251) as u8).collect();
        f.write_all(&data).expect("write");
        let items = vec![
            StreamItem {
                spans: vec![Span {
                    file: 0,
                    offset: 10,
                    len: 5000,
                }],
            },
            StreamItem {
                spans: coalesce(
                    vec![
                        Span {
                            file: 0,
                            offset: 60_000,
                            len: 100,
                        },
                        Span {
                            file: 0,
                            offset: 50_001,
                            len: 333,
                        },
                    ],
                    4096,
                ),
            },
        ];
        assert_eq!(items[1].spans.len(), 2);
        // Around the page cache (O_DIRECT where allowed), then through it.
        for page_cache in [false, true] {
            read_items_cyclically(f.path(), items.clone(), &data, page_cache);
        }
    }

    fn read_items_cyclically(
        path: &std::path::Path,
        items: Vec<StreamItem>,
        data: &[u8],
        page_cache: bool,
    ) {
        let mut r =
            StreamReader::start(vec![path.to_path_buf()], items, 1, page_cache).expect("start");
        assert_eq!(r.page_cache(), page_cache);
        for round in 0..3 {
            let a = r.acquire(0).expect("item 0");
            assert_eq!(a.bytes(0, 100, 50), Some(&data[100..150]));
            assert_eq!(a.bytes(0, 6000, 10), None);
            r.release(a);
            if round == 1 {
                continue; // skip item 1 this round
            }
            let b = r.acquire(1).expect("item 1");
            assert_eq!(b.bytes(0, 60_010, 90), Some(&data[60_010..60_100]));
            assert_eq!(b.bytes(0, 50_001, 333), Some(&data[50_001..50_334]));
            r.release(b);
        }
    }
}
