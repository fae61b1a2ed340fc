//! Reading a checkpoint file around (or through) the page cache, the way
//! each operating system allows it.
//!
//! | | around the page cache | start reading ahead |
//! |---|---|---|
//! | Linux | `O_DIRECT` (aligned reads), else buffered reads dropped again with `POSIX_FADV_DONTNEED` | `POSIX_FADV_WILLNEED` |
//! | macOS | `F_NOCACHE` on the descriptor | `F_RDADVISE` |
//! | elsewhere | buffered reads (the page cache keeps them) | nothing |

use std::fs::File;
use std::path::{Path, PathBuf};

/// Alignment of direct-I/O offsets, lengths and buffer addresses.
pub(crate) const DIRECT_ALIGN: u64 = 4096;

/// What reading does to the page cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum CachePolicy {
    /// Buffered reads; the pages stay cached (a warm cache serves the next
    /// read at memory speed).
    Keep,
    /// Around the page cache: streamed bytes never crowd kept weights out of
    /// a tight memory cgroup, but every read goes to the disk.
    Bypass,
}

/// One file of a checkpoint, opened for explicit reads.
pub(crate) struct ReadFile {
    path: PathBuf,
    file: File,
    policy: CachePolicy,
    /// The descriptor bypasses the page cache itself (`O_DIRECT`,
    /// `F_NOCACHE`); reads must then be aligned on Linux.
    uncached: bool,
}

impl ReadFile {
    /// Open `path` for reads under `policy`.
    pub(crate) fn open(path: &Path, policy: CachePolicy) -> std::io::Result<ReadFile> {
        let (file, uncached) = match policy {
            CachePolicy::Keep => (File::open(path)?, false),
            CachePolicy::Bypass => match open_uncached(path) {
                Ok(file) => (file, true),
                Err(_) => (File::open(path)?, false),
            },
        };
        Ok(ReadFile {
            path: path.to_path_buf(),
            file,
            policy,
            uncached,
        })
    }

    /// Fill `out` from `offset` (fewer bytes only at the end of the file:
    /// the rest of `out` is left as it was).
    pub(crate) fn read_at(&mut self, out: &mut [u8], offset: u64) -> std::io::Result<()> {
        let mut done = 0;
        while done < out.len() {
            match read_at(&self.file, &mut out[done..], offset + done as u64) {
                Ok(0) => break,
                Ok(n) => done += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) if self.uncached && is_invalid_argument(&e) => {
                    // The file system refuses direct I/O here: buffered reads
                    // (dropped again below) from now on.
                    self.file = File::open(&self.path)?;
                    self.uncached = false;
                }
                Err(e) => return Err(e),
            }
        }
        if self.policy == CachePolicy::Bypass && !self.uncached {
            drop_cached(&self.file, offset, out.len() as u64);
        }
        Ok(())
    }

    /// Ask the system to start reading `offset .. offset + len` into the
    /// page cache (only under [`CachePolicy::Keep`]; a hint).
    pub(crate) fn will_need(&self, offset: u64, len: u64) {
        if self.policy == CachePolicy::Keep {
            crate::memory::will_need(&self.file, offset, len);
        }
    }
}

fn is_invalid_argument(e: &std::io::Error) -> bool {
    e.raw_os_error() == Some(libc::EINVAL)
}

fn read_at(file: &File, out: &mut [u8], offset: u64) -> std::io::Result<usize> {
    use std::os::unix::fs::FileExt;
    file.read_at(out, offset)
}

#[cfg(target_os = "linux")]
fn open_uncached(path: &Path) -> std::io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
}

#[cfg(target_os = "macos")]
fn open_uncached(path: &Path) -> std::io::Result<File> {
    use std::os::fd::AsRawFd;
    let file = File::open(path)?;
    // SAFETY: fcntl on a descriptor this function owns; F_NOCACHE takes an int.
    let rc = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_NOCACHE, 1) };
    if rc == -1 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(file)
}

#[cfg(not(any(target_os = "linux", target_os = "macos")))]
fn open_uncached(_path: &Path) -> std::io::Result<File> {
    Err(std::io::ErrorKind::Unsupported.into())
}

/// Drop the cached pages of a span just read (buffered reads that were
/// meant to bypass the cache).
#[cfg(target_os = "linux")]
fn drop_cached(file: &File, offset: u64, len: u64) {
    use std::os::fd::AsRawFd;
    // SAFETY: an advisory call on a descriptor owned by `file`.
    unsafe {
        libc::posix_fadvise(
            file.as_raw_fd(),
            offset as libc::off_t,
            len as libc::off_t,
            libc::POSIX_FADV_DONTNEED,
        );
    }
}

#[cfg(not(target_os = "linux"))]
fn drop_cached(_file: &File, _offset: u64, _len: u64) {}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn both_policies_read_the_same_bytes() {
        let mut f = tempfile::NamedTempFile::new().expect("temp file");
        let data: Vec<u8> = (0..3 * DIRECT_ALIGN as u32)
            .map(|i| (i * 13 % 251) as u8)
            .collect();
        f.write_all(&data).expect("write");
        for policy in [CachePolicy::Keep, CachePolicy::Bypass] {
            let mut r = ReadFile::open(f.path(), policy).expect("open");
            let mut out = crate::weights::buffer::AlignedBuffer::new(2 * DIRECT_ALIGN as usize)
                .expect("buffer");
            r.read_at(out.as_mut_slice(), DIRECT_ALIGN).expect("read");
            assert_eq!(
                out.as_slice(),
                &data[DIRECT_ALIGN as usize..3 * DIRECT_ALIGN as usize]
            );
            r.will_need(0, DIRECT_ALIGN);
        }
    }
}
