//! One read-only memory mapping per checkpoint file.

use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use crate::{FormatError, Result};

/// A file mapped read-only, once, for the lifetime of its backend.
#[derive(Debug)]
pub struct MappedFile {
    path: PathBuf,
    map: Option<Mmap>,
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
        let len = file.metadata().map_err(io_error)?.len();
        let map = if len == 0 {
            None
        } else {
            // SAFETY: the mapping is read-only and private to this process's
            // view; Flatrun never writes checkpoint files while they are open.
            // A file truncated by another process underneath us would raise
            // SIGBUS on access, which is the documented limit of mmap.
            Some(unsafe { Mmap::map(&file) }.map_err(io_error)?)
        };
        Ok(MappedFile {
            path: path.to_path_buf(),
            map,
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
}
