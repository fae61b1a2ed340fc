//! Page residency helpers over mapped bytes: `madvise` hints, no-ops where
//! unsupported.

/// Handles smaller than this keep their pages on close.
pub const RELEASE_THRESHOLD: usize = 1 << 20;

fn page_range(bytes: &[u8]) -> Option<(*mut libc::c_void, usize)> {
    if bytes.is_empty() {
        return None;
    }
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    let page = if page > 0 { page as usize } else { 4096 };
    let start = bytes.as_ptr() as usize;
    let end = start + bytes.len();
    // Only whole pages inside the range, so neighbours are never dropped.
    let a = start.div_ceil(page) * page;
    let b = end / page * page;
    (b > a).then_some((a as *mut libc::c_void, b - a))
}

/// `MADV_WILLNEED` over the pages of `bytes` (start read-ahead).
pub fn advise_willneed(bytes: &[u8]) {
    #[cfg(unix)]
    if let Some((p, len)) = page_range(bytes) {
        // SAFETY: the range lies inside a live mapping borrowed by `bytes`;
        // WILLNEED only starts read-ahead and never changes contents.
        unsafe {
            libc::madvise(p, len, libc::MADV_WILLNEED);
        }
    }
}

/// `MADV_DONTNEED` over the whole pages of `bytes` when it is at least
/// [`RELEASE_THRESHOLD`] long. Only for read-only file mappings: the pages
/// are re-read from the file on the next touch.
pub fn release(bytes: &[u8]) {
    #[cfg(unix)]
    if bytes.len() >= RELEASE_THRESHOLD {
        if let Some((p, len)) = page_range(bytes) {
            // SAFETY: the range lies inside a live, read-only, file-backed
            // mapping; DONTNEED on such a mapping drops clean page-cache
            // references and later reads fault the same bytes back in.
            unsafe {
                libc::madvise(p, len, libc::MADV_DONTNEED);
            }
        }
    }
}
