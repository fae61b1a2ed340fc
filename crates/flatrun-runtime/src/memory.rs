//! Memory facts of the running process: resident set (anonymous vs
//! file-backed, from `/proc/self/status`), page-cache residency of mapped
//! bytes (`mincore`), and populating or dropping page ranges.

/// One RSS sample, in bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RssSample {
    /// Anonymous memory (heap, KV cache, activations).
    pub anon: u64,
    /// File-backed pages mapped into the process (model weights).
    pub file: u64,
    /// Peak resident set of the process so far (`VmHWM`).
    pub peak: u64,
}

impl RssSample {
    /// Anonymous plus file-backed.
    pub fn total(&self) -> u64 {
        self.anon + self.file
    }
}

/// Read the current RSS split from `/proc/self/status` (zeros where unavailable).
pub fn rss() -> RssSample {
    let Ok(status) = std::fs::read_to_string("/proc/self/status") else {
        return RssSample::default();
    };
    let field = |name: &str| -> u64 {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|kb| kb.parse::<u64>().ok())
            .map_or(0, |kb| kb * 1024)
    };
    RssSample {
        anon: field("RssAnon:"),
        file: field("RssFile:") + field("RssShmem:"),
        peak: field("VmHWM:"),
    }
}

fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 {
        p as usize
    } else {
        4096
    }
}

/// The page-aligned span covering `bytes`: (start, length).
fn covering_pages(bytes: &[u8]) -> Option<(usize, usize)> {
    if bytes.is_empty() {
        return None;
    }
    let page = page_size();
    let start = bytes.as_ptr() as usize / page * page;
    let end = (bytes.as_ptr() as usize + bytes.len()).div_ceil(page) * page;
    Some((start, end - start))
}

/// How many bytes of `bytes` (a file mapping) are in the page cache, by
/// `mincore`; `None` where the call is unavailable.
pub fn page_cache_resident(bytes: &[u8]) -> Option<u64> {
    let (start, len) = covering_pages(bytes)?;
    let page = page_size();
    let mut vec = vec![0u8; len / page];
    // SAFETY: the span covers pages of a live mapping borrowed through
    // `bytes` (rounded out to page boundaries, which stay inside the same
    // mapping because mappings are page-granular); `vec` has one byte per page.
    let rc = unsafe { libc::mincore(start as *mut libc::c_void, len, vec.as_mut_ptr()) };
    if rc != 0 {
        return None;
    }
    Some(vec.iter().filter(|&&b| b & 1 == 1).count() as u64 * page as u64)
}

/// Linux `MADV_POPULATE_READ` (5.14+): fault every page of the range in.
const MADV_POPULATE_READ: libc::c_int = 22;

/// Make every page of `bytes` resident now (reading from disk if needed),
/// so that compute never faults on it.
pub fn populate(bytes: &[u8]) {
    let Some((start, len)) = covering_pages(bytes) else {
        return;
    };
    // SAFETY: the span lies inside a live read-only mapping (see
    // `covering_pages`); POPULATE_READ only faults pages in.
    let rc = unsafe { libc::madvise(start as *mut libc::c_void, len, MADV_POPULATE_READ) };
    if rc != 0 {
        // Older kernels: touch one byte per page.
        let page = page_size();
        let mut sum = 0u8;
        for i in (0..bytes.len()).step_by(page) {
            // SAFETY: `i < bytes.len()`, so the read is inside the slice;
            // volatile keeps the touch from being optimized away.
            sum = sum.wrapping_add(unsafe { std::ptr::read_volatile(bytes.as_ptr().add(i)) });
        }
        std::hint::black_box(sum);
    }
}

/// Start asynchronous read-ahead of `bytes` (`MADV_WILLNEED`).
pub fn will_need(bytes: &[u8]) {
    flatrun_format::mem::advise_willneed(bytes);
}

/// Drop the mapping's pages covering `bytes` (`MADV_DONTNEED`), whatever
/// their size: for a read-only file mapping this only unmaps them from the
/// process (they stay in the page cache and fault back in on the next touch),
/// so rounding out to whole pages never loses data.
pub fn release(bytes: &[u8]) {
    let Some((start, len)) = covering_pages(bytes) else {
        return;
    };
    // SAFETY: the span lies inside a live, read-only, file-backed mapping
    // (see `covering_pages`); DONTNEED on it drops page-table entries only,
    // and later reads fault the same file bytes back in.
    unsafe {
        libc::madvise(start as *mut libc::c_void, len, libc::MADV_DONTNEED);
    }
}
