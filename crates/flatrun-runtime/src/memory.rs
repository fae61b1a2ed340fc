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

/// Resident bytes of the process's mappings of `path` (the model file's
/// weights mapped in right now), summed over `/proc/self/smaps`; `None`
/// where that file is unavailable. Unlike [`RssSample::file`] this leaves
/// out the executable and libraries: it is exactly the weights in flight.
pub fn mapped_file_rss(path: &std::path::Path) -> Option<u64> {
    let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
    let target = std::fs::canonicalize(path).ok()?;
    let target = target.to_str()?;
    let mut in_target = false;
    let mut total = 0;
    for line in smaps.lines() {
        let mut fields = line.split_whitespace();
        let first = fields.next().unwrap_or("");
        if first.contains('-') && first.chars().all(|c| c.is_ascii_hexdigit() || c == '-') {
            // A mapping's header: `start-end perms offset dev inode [path]`.
            in_target = fields.skip(4).collect::<Vec<_>>().join(" ") == target;
        } else if in_target && first == "Rss:" {
            total += fields
                .next()
                .and_then(|kb| kb.parse::<u64>().ok())
                .unwrap_or(0)
                * 1024;
        }
    }
    Some(total)
}

/// Ask the system to start reading `file[offset .. offset + len]` into the
/// page cache; returns at once (advisory: nothing where unsupported).
#[cfg(target_os = "linux")]
pub(crate) fn will_need(file: &std::fs::File, offset: u64, len: u64) {
    use std::os::fd::AsRawFd;
    // SAFETY: an advisory call on a descriptor owned by `file`.
    unsafe {
        libc::posix_fadvise(
            file.as_raw_fd(),
            offset as libc::off_t,
            len as libc::off_t,
            libc::POSIX_FADV_WILLNEED,
        );
    }
}

/// See the Linux variant.
#[cfg(target_os = "macos")]
pub(crate) fn will_need(file: &std::fs::File, offset: u64, len: u64) {
    use std::os::fd::AsRawFd;
    let advice = libc::radvisory {
        ra_offset: offset as libc::off_t,
        ra_count: len.min(i32::MAX as u64) as libc::c_int,
    };
    // SAFETY: fcntl(F_RDADVISE) reads one `radvisory` through the pointer,
    // which points to a live local.
    unsafe { libc::fcntl(file.as_raw_fd(), libc::F_RDADVISE, &advice) };
}

/// See the Linux variant.
#[cfg(not(any(target_os = "linux", target_os = "macos")))]
pub(crate) fn will_need(_file: &std::fs::File, _offset: u64, _len: u64) {}

/// The system page size.
pub fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 { p as usize } else { 4096 }
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
    // mapping because mappings are page-granular); `vec` has one byte per
    // page (the element type is `unsigned char` on Linux, `char` on macOS).
    let rc = unsafe { libc::mincore(start as *mut libc::c_void, len, vec.as_mut_ptr().cast()) };
    if rc != 0 {
        return None;
    }
    Some(vec.iter().filter(|&&b| b & 1 == 1).count() as u64 * page as u64)
}

/// Make every page of `bytes` resident now (reading from disk if needed),
/// so that compute never faults on it: Linux's `MADV_POPULATE_READ`
/// (5.14+), else a touch of one byte per page.
pub fn populate(bytes: &[u8]) {
    if bytes.is_empty() || !populate_read(bytes) {
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

/// `MADV_POPULATE_READ` over the pages of `bytes`; `false` where unsupported.
#[cfg(target_os = "linux")]
fn populate_read(bytes: &[u8]) -> bool {
    /// Linux `MADV_POPULATE_READ` (5.14+): fault every page of the range in.
    const MADV_POPULATE_READ: libc::c_int = 22;
    let Some((start, len)) = covering_pages(bytes) else {
        return true;
    };
    // SAFETY: the span lies inside a live read-only mapping (see
    // `covering_pages`); POPULATE_READ only faults pages in.
    unsafe { libc::madvise(start as *mut libc::c_void, len, MADV_POPULATE_READ) == 0 }
}

#[cfg(not(target_os = "linux"))]
fn populate_read(_bytes: &[u8]) -> bool {
    false
}

/// Bytes around a faulting page that the kernel maps along with it from
/// the page cache ("fault-around", `fault_around_bytes`, 64 KiB by default):
/// touching one page of a file mapping may map the whole aligned block
/// around it, so releases that must leave nothing behind work in such blocks.
pub const FAULT_AROUND_BYTES: usize = 64 << 10;

/// The release granularity: fault-around blocks (at least a page).
pub fn release_block() -> usize {
    FAULT_AROUND_BYTES.max(page_size()) / page_size() * page_size()
}

/// Drop the pages of the fault-around blocks covering `bytes`, clipped to
/// `within` (page-aligned addresses that are all part of the same read-only
/// file mapping as `bytes`). With `keep_tail`, the block holding the last
/// byte stays when `bytes` ends inside it: the bytes after belong to what
/// comes next (maybe mapped already, and dropping it would make its next
/// touch fault a whole block back in); whoever uses them releases that block.
///
/// # Safety
/// `within` must lie inside one live, read-only, file-backed mapping (as the
/// spans of `weights::plan::file_bounds` do while their backend lives).
pub unsafe fn release_blocks(bytes: &[u8], within: &std::ops::Range<usize>, keep_tail: bool) {
    if bytes.is_empty() {
        return;
    }
    let block = release_block();
    let first = bytes.as_ptr() as usize;
    let last = first + bytes.len();
    let start = first / block * block;
    let end = if keep_tail {
        last / block * block
    } else {
        last.div_ceil(block) * block
    };
    // SAFETY: clipped to `within`, which the caller vouches for.
    unsafe { release_span(&(start.max(within.start)..end.min(within.end))) };
}

/// Drop every page of `span` (page-aligned addresses).
///
/// # Safety
/// `span` must lie inside one live, read-only, file-backed mapping (e.g. a
/// span of `weights::plan::file_bounds` while its backend lives).
pub unsafe fn release_span(span: &std::ops::Range<usize>) {
    let page = page_size();
    if span.end <= span.start || !span.start.is_multiple_of(page) {
        return;
    }
    let (start, end) = (span.start, span.end);
    // SAFETY: the caller guarantees `start..end` lies in one live, read-only,
    // file-backed mapping; DONTNEED on it drops page-table entries only (the
    // next read faults the same file bytes back in), never data.
    unsafe {
        libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_DONTNEED);
    }
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

/// Bytes this process may still fill before memory gets tight: the smallest
/// of `MemAvailable` (`/proc/meminfo`) and what its memory cgroups leave
/// ([`cgroup_headroom`] over `/sys/fs/cgroup` and `/proc/self/cgroup`).
/// `None` when none of these can be read (not Linux).
pub fn memory_headroom() -> Option<u64> {
    let available = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|text| meminfo_field(&text, "MemAvailable:"));
    let cgroups = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    let cgroup = cgroup_headroom(std::path::Path::new("/sys/fs/cgroup"), &cgroups);
    match (available, cgroup) {
        (Some(a), Some(c)) => Some(a.min(c)),
        (a, c) => a.or(c),
    }
}

/// A `/proc/meminfo` field in bytes (`MemAvailable:` → its kB × 1024).
fn meminfo_field(text: &str, name: &str) -> Option<u64> {
    let line = text.lines().find_map(|l| l.strip_prefix(name))?;
    let kib: u64 = line.trim().trim_end_matches("kB").trim().parse().ok()?;
    Some(kib * 1024)
}

/// What the memory cgroups of a process leave it: for every memory cgroup
/// from the process's own up to the root (`proc_cgroup` is the text of
/// `/proc/self/cgroup`, `sys_root` where the hierarchy is mounted, usually
/// `/sys/fs/cgroup`), its limit less its usage, the smallest over the
/// levels. cgroup v2 (`0::/path`): `memory.max` − `memory.current`; v1
/// (`N:memory:/path`, under `sys_root/memory`): `memory.limit_in_bytes` −
/// `memory.usage_in_bytes`. The usage counts page cache, whose clean file
/// pages (`inactive_file` and `active_file` in `memory.stat`, v1 with a
/// `total_` prefix) are reclaimed before anything is killed, so they count
/// as free (the model file read once before loading must not shrink the
/// plan; under a cap, the weights it keeps are planned for). A level without a
/// limit (`max`, or v1's huge sentinel) limits nothing. `None` when no
/// level has a limit.
pub fn cgroup_headroom(sys_root: &std::path::Path, proc_cgroup: &str) -> Option<u64> {
    let read_u64 = |path: &std::path::Path| -> Option<u64> {
        std::fs::read_to_string(path).ok()?.trim().parse().ok()
    };
    // Clean page cache (`inactive_file` + `active_file`, v1 with a `total_`
    // prefix): reclaimed before anything is killed.
    let file_cache = |dir: &std::path::Path, prefix: &str| -> u64 {
        let stat = std::fs::read_to_string(dir.join("memory.stat")).unwrap_or_default();
        let field = |key: String| -> u64 {
            stat.lines()
                .find_map(|l| {
                    let (k, v) = l.split_once(' ')?;
                    (k == key).then(|| v.trim().parse().ok()).flatten()
                })
                .unwrap_or(0)
        };
        field(format!("{prefix}inactive_file")) + field(format!("{prefix}active_file"))
    };
    let mut headroom: Option<u64> = None;
    for line in proc_cgroup.lines() {
        // "0::/path" (v2) or "N:memory:/path" (v1; controllers comma-separated).
        let mut parts = line.splitn(3, ':');
        let (controllers, path) = match (parts.next(), parts.next(), parts.next()) {
            (Some(_), Some(c), Some(p)) => (c, p),
            _ => continue,
        };
        let (root, limit_file, usage_file, stat_prefix) = if controllers.is_empty() {
            (sys_root.to_path_buf(), "memory.max", "memory.current", "")
        } else if controllers.split(',').any(|c| c == "memory") {
            (
                sys_root.join("memory"),
                "memory.limit_in_bytes",
                "memory.usage_in_bytes",
                "total_",
            )
        } else {
            continue;
        };
        let mut dir = root.join(path.trim().trim_start_matches('/'));
        loop {
            // "max" (v2) does not parse: no limit at this level.
            if let (Some(limit), Some(usage)) = (
                read_u64(&dir.join(limit_file)),
                read_u64(&dir.join(usage_file)),
            ) {
                let used = usage.saturating_sub(file_cache(&dir, stat_prefix));
                let left = limit.saturating_sub(used);
                headroom = Some(headroom.map_or(left, |h| h.min(left)));
            }
            if dir.as_os_str().len() <= root.as_os_str().len() || !dir.pop() {
                break;
            }
        }
    }
    headroom
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    #[test]
    fn headroom_is_known_and_at_most_mem_available() {
        let headroom = memory_headroom().expect("/proc/meminfo is readable on Linux");
        let available: u64 = std::fs::read_to_string("/proc/meminfo")
            .unwrap()
            .lines()
            .find_map(|l| l.strip_prefix("MemAvailable:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .map(|kib: u64| kib * 1024)
            .unwrap();
        // MemAvailable moves between the two reads; allow for that.
        assert!(
            headroom <= available + (64 << 20),
            "{headroom} > {available}"
        );
        assert!(headroom > 0);
    }

    /// Write `files` (path relative to `root`, contents) as a fake cgroup tree.
    fn tree(files: &[(&str, &str)]) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        for (path, text) in files {
            let path = dir.path().join(path);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, text).unwrap();
        }
        dir
    }

    #[test]
    fn cgroup_v2_limits_walk_up_the_hierarchy() {
        // A pod with a 1 GiB limit, the container under it with none of its own.
        let root = tree(&[
            ("kubepods/memory.max", "1073741824\n"),
            ("kubepods/memory.current", "104857600\n"),
            (
                "kubepods/memory.stat",
                "anon 50000000\ninactive_file 4857600\n",
            ),
            ("kubepods/app/memory.max", "max\n"),
            ("kubepods/app/memory.current", "90000000\n"),
        ]);
        let left = cgroup_headroom(root.path(), "0::/kubepods/app\n");
        // 1 GiB − (100 MiB − 4.63 MiB of clean page cache).
        assert_eq!(left, Some(1_073_741_824 - (104_857_600 - 4_857_600)));
        // The tighter of two levels wins.
        let root = tree(&[
            ("a/memory.max", "1000000000"),
            ("a/memory.current", "0"),
            ("a/b/memory.max", "245366784"),
            ("a/b/memory.current", "5000000"),
        ]);
        assert_eq!(
            cgroup_headroom(root.path(), "0::/a/b"),
            Some(245_366_784 - 5_000_000)
        );
        // No limit anywhere.
        let root = tree(&[("x/memory.max", "max"), ("x/memory.current", "123")]);
        assert_eq!(cgroup_headroom(root.path(), "0::/x"), None);
    }

    #[test]
    fn cgroup_v1_memory_controller() {
        let root = tree(&[
            ("memory/job/memory.limit_in_bytes", "245366784\n"),
            ("memory/job/memory.usage_in_bytes", "20000000\n"),
            (
                "memory/job/memory.stat",
                "cache 15000000\ntotal_inactive_file 10000000\n",
            ),
            // The root's "unlimited" sentinel.
            ("memory/memory.limit_in_bytes", "9223372036854771712"),
            ("memory/memory.usage_in_bytes", "8000000000"),
        ]);
        let text = "12:cpu,cpuacct:/job\n7:memory:/job\n1:name=systemd:/\n";
        assert_eq!(
            cgroup_headroom(root.path(), text),
            Some(245_366_784 - 10_000_000)
        );
        // No memory controller line: nothing known.
        assert_eq!(cgroup_headroom(root.path(), "12:cpu:/job\n"), None);
    }
}
