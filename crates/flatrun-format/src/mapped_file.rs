//! One read-only memory mapping per checkpoint file, guarded against the file
//! changing underneath it.
//!
//! A mapped file that another process truncates raises SIGBUS on the next
//! touch of a page past the new end, which would kill the whole process (a
//! server, with every client's request). Two layers keep it alive:
//!
//! - [`MappedFile::check`] compares the open file (`fstat` of the descriptor
//!   held since the mapping was made) with what was mapped: shorter, or
//!   modified in place (mtime), is a [`FormatError::FileChanged`]. The
//!   runtime checks before and after every pass through the layers, so a
//!   change between passes fails the pass before it reads anything.
//! - A process-wide SIGBUS handler covers a truncation in the middle of a
//!   pass: when the faulting address lies in a registered mapping, it maps a
//!   page of zeros over the faulting page (`MAP_FIXED` anonymous) and counts
//!   the fault; the read resumes with zeros, and the next [`MappedFile::check`]
//!   reports the file as changed, so the garbage never reaches a caller as a
//!   result. A fault anywhere else goes to the previous disposition
//!   (normally: the process dies, as it would without the handler).
//!
//! A file replaced by rename or deleted keeps its old inode alive while it is
//! mapped, so the mapping stays valid and serving continues with the
//! original bytes.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use memmap2::Mmap;

use crate::{FormatError, Result};

/// A file mapped read-only, once, for the lifetime of its backend.
#[derive(Debug)]
pub struct MappedFile {
    path: PathBuf,
    map: Option<Mmap>,
    /// The descriptor the mapping was made from, kept to `fstat` it.
    file: File,
    /// Modification time when mapped.
    mtime: Option<SystemTime>,
    /// This mapping's slot in the SIGBUS handler's table.
    guard: Option<fault::Registration>,
}

impl MappedFile {
    /// Map `path` read-only. An empty file gives an empty view (nothing is
    /// mapped, since zero-length mappings are not portable).
    pub fn open(path: &Path) -> Result<MappedFile> {
        let io_error = |source| FormatError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = File::open(path).map_err(io_error)?;
        let meta = file.metadata().map_err(io_error)?;
        let len = meta.len();
        let map = if len == 0 {
            None
        } else {
            // SAFETY: the mapping is read-only; Flatrun never writes checkpoint
            // files while they are open. Another process truncating the file
            // would make reads past the new end raise SIGBUS: the handler of
            // `fault` turns those into zero pages and a failed `check`.
            Some(unsafe { Mmap::map(&file) }.map_err(io_error)?)
        };
        let guard = map.as_deref().and_then(fault::register);
        Ok(MappedFile {
            path: path.to_path_buf(),
            map,
            file,
            mtime: meta.modified().ok(),
            guard,
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// All bytes of the file.
    pub fn bytes(&self) -> &[u8] {
        self.map.as_deref().unwrap_or(&[])
    }

    /// The file length in bytes.
    pub fn len(&self) -> u64 {
        self.bytes().len() as u64
    }

    /// Whether the file is empty.
    pub fn is_empty(&self) -> bool {
        self.bytes().is_empty()
    }

    /// The bytes `[offset, offset + len)`, or `None` when out of range.
    pub fn range(&self, offset: u64, len: u64) -> Option<&[u8]> {
        let start = usize::try_from(offset).ok()?;
        let end = start.checked_add(usize::try_from(len).ok()?)?;
        self.bytes().get(start..end)
    }

    /// Whether the bytes read so far are still the file's: an error when the
    /// file was truncated (now, or at any time a read faulted past its end)
    /// or modified in place since it was mapped. Renaming another file over
    /// the path, or deleting it, is not an error: the mapping keeps the
    /// original inode.
    pub fn check(&self) -> Result<()> {
        let changed = |what: String| FormatError::FileChanged {
            path: self.path.clone(),
            what,
        };
        let faults = self.guard.as_ref().map_or(0, fault::Registration::faults);
        if faults > 0 {
            return Err(changed(format!(
                "truncated while in use: {faults} read(s) past its end returned zeros"
            )));
        }
        let meta = self.file.metadata().map_err(|source| FormatError::Io {
            path: self.path.clone(),
            source,
        })?;
        if meta.len() < self.len() {
            return Err(changed(format!(
                "truncated while in use, from {} to {} bytes",
                self.len(),
                meta.len()
            )));
        }
        if meta.modified().ok() != self.mtime {
            return Err(changed(
                "modified in place while in use (its modification time changed)".to_string(),
            ));
        }
        Ok(())
    }
}

impl Drop for MappedFile {
    fn drop(&mut self) {
        // Unregister before the mapping goes away (fields drop after this).
        self.guard.take();
    }
}

/// The SIGBUS handler and its table of mapped ranges.
#[cfg(unix)]
mod fault {
    use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
    use std::sync::Once;

    /// Mappings guarded at once; more are mapped unguarded (and a
    /// truncation under them kills the process, as without the handler).
    const SLOTS: usize = 1024;

    struct Slot {
        start: AtomicUsize,
        len: AtomicUsize,
        faults: AtomicU64,
    }

    #[allow(clippy::declare_interior_mutable_const)]
    const EMPTY: Slot = Slot {
        start: AtomicUsize::new(0),
        len: AtomicUsize::new(0),
        faults: AtomicU64::new(0),
    };
    static TABLE: [Slot; SLOTS] = [EMPTY; SLOTS];
    static PAGE: AtomicUsize = AtomicUsize::new(4096);
    static INSTALL: Once = Once::new();
    /// The disposition before ours, restored for faults outside our table.
    static mut PREVIOUS: Option<libc::sigaction> = None;

    /// A mapped range in the table; removed on drop.
    #[derive(Debug)]
    pub(super) struct Registration {
        slot: usize,
    }

    impl Registration {
        /// Faults repaired in this range so far.
        pub(super) fn faults(&self) -> u64 {
            TABLE[self.slot].faults.load(Ordering::Acquire)
        }
    }

    impl Drop for Registration {
        fn drop(&mut self) {
            let slot = &TABLE[self.slot];
            slot.len.store(0, Ordering::Release);
            slot.faults.store(0, Ordering::Release);
            slot.start.store(0, Ordering::Release);
        }
    }

    /// Adds `bytes` (a live mapping) to the table, installing the handler
    /// on first use. `None` when the table is full.
    pub(super) fn register(bytes: &[u8]) -> Option<Registration> {
        INSTALL.call_once(install);
        let start = bytes.as_ptr() as usize;
        for (i, slot) in TABLE.iter().enumerate() {
            // Claim a free slot (start 0), then publish its length.
            if slot
                .start
                .compare_exchange(0, usize::MAX, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
            {
                slot.faults.store(0, Ordering::Release);
                slot.len.store(bytes.len(), Ordering::Release);
                slot.start.store(start, Ordering::Release);
                return Some(Registration { slot: i });
            }
        }
        None
    }

    fn install() {
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        if page > 0 {
            PAGE.store(page as usize, Ordering::Relaxed);
        }
        // SAFETY: a zeroed sigaction is a valid "no flags, empty mask"
        // value; `on_sigbus` has the SA_SIGINFO signature; PREVIOUS is
        // written here once, inside `Once`, before the handler can run.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_sigbus as *const () as libc::sighandler_t;
            action.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
            libc::sigemptyset(&mut action.sa_mask);
            let mut previous: libc::sigaction = std::mem::zeroed();
            if libc::sigaction(libc::SIGBUS, &action, &mut previous) == 0 {
                *std::ptr::addr_of_mut!(PREVIOUS) = Some(previous);
            }
        }
    }

    /// Async-signal-safe: atomics, `mmap` and `sigaction` only.
    extern "C" fn on_sigbus(signal: libc::c_int, info: *mut libc::siginfo_t, _: *mut libc::c_void) {
        // SAFETY: the kernel passes a valid siginfo for SA_SIGINFO handlers.
        let address = unsafe { (*info).si_addr() } as usize;
        let page = PAGE.load(Ordering::Relaxed);
        for slot in &TABLE {
            let start = slot.start.load(Ordering::Acquire);
            let len = slot.len.load(Ordering::Acquire);
            if start == 0 || start == usize::MAX || address < start || address - start >= len {
                continue;
            }
            let base = address & !(page - 1);
            // SAFETY: `base` is the page holding the faulting address, which
            // lies inside a live read-only mapping of ours (its slot is
            // cleared before it is unmapped); replacing that one page with
            // zeros changes only what readers of the broken file see.
            let mapped = unsafe {
                libc::mmap(
                    base as *mut libc::c_void,
                    page,
                    libc::PROT_READ,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                    -1,
                    0,
                )
            };
            if mapped != libc::MAP_FAILED {
                slot.faults.fetch_add(1, Ordering::AcqRel);
                return;
            }
            break;
        }
        // Not ours (or not repairable): restore the previous disposition and
        // return; the faulting instruction runs again and gets it.
        // SAFETY: PREVIOUS was set once before the handler was installed;
        // sigaction is async-signal-safe. With no previous action, the
        // default (terminate) is restored.
        unsafe {
            let previous = *std::ptr::addr_of!(PREVIOUS);
            match previous {
                Some(previous) => {
                    libc::sigaction(signal, &previous, std::ptr::null_mut());
                }
                None => {
                    libc::signal(signal, libc::SIG_DFL);
                }
            }
        }
    }
}

/// No SIGBUS on this platform: nothing to guard.
#[cfg(not(unix))]
mod fault {
    #[derive(Debug)]
    pub(super) struct Registration;

    impl Registration {
        pub(super) fn faults(&self) -> u64 {
            0
        }
    }

    pub(super) fn register(_: &[u8]) -> Option<Registration> {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn temp_file(name: &str, len: usize) -> PathBuf {
        let path =
            std::env::temp_dir().join(format!("flatrun-mapped-{}-{name}", std::process::id()));
        let mut f = File::create(&path).unwrap();
        f.write_all(&vec![7u8; len]).unwrap();
        path
    }

    #[test]
    fn truncation_under_the_mapping_reads_zeros_and_fails_the_check() {
        let len = 1 << 20;
        let path = temp_file("truncate", len);
        let map = MappedFile::open(&path).unwrap();
        assert!(map.check().is_ok());
        assert_eq!(map.bytes()[len - 1], 7);
        File::options()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(4096)
            .unwrap();
        let err = map.check().unwrap_err().to_string();
        assert!(
            err.contains("truncated while in use, from 1048576 to 4096"),
            "{err}"
        );
        // Past the new end: SIGBUS, repaired to zeros, and counted.
        let tail: u64 = map.bytes()[8192..].iter().map(|&b| b as u64).sum();
        assert_eq!(tail, 0);
        assert_eq!(map.bytes()[100], 7, "pages before the cut are intact");
        // Even if the file grows back, the faults are remembered.
        File::options()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(len as u64)
            .unwrap();
        let err = map.check().unwrap_err().to_string();
        assert!(err.contains("read(s) past its end"), "{err}");
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn deletion_and_rename_keep_the_mapped_bytes() {
        let path = temp_file("replace", 1 << 16);
        let map = MappedFile::open(&path).unwrap();
        let other = temp_file("replacement", 10);
        std::fs::rename(&other, &path).unwrap();
        assert!(map.check().is_ok());
        std::fs::remove_file(&path).unwrap();
        assert!(map.check().is_ok());
        assert!(map.bytes().iter().all(|&b| b == 7));
    }

    #[test]
    fn modification_in_place_fails_the_check() {
        let path = temp_file("modify", 1 << 16);
        let map = MappedFile::open(&path).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
        let mut f = File::options().write(true).open(&path).unwrap();
        f.write_all(b"new bytes").unwrap();
        f.sync_all().unwrap();
        let err = map.check().unwrap_err().to_string();
        assert!(err.contains("modified in place"), "{err}");
        std::fs::remove_file(&path).unwrap();
    }
}
