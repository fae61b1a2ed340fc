//! A bounds-checked little-endian cursor over a byte slice.
//!
//! Every read checks the remaining length first, so a lying header can only
//! ever produce a [`FormatError::Truncated`] or [`FormatError::Invalid`],
//! never a panic or an allocation larger than the input.

use std::path::Path;

use crate::{FormatError, Result};

/// A cursor over `bytes` that reports errors against `path`.
pub(crate) struct ByteReader<'a> {
    path: &'a Path,
    bytes: &'a [u8],
    position: usize,
}

impl<'a> ByteReader<'a> {
    pub(crate) fn new(path: &'a Path, bytes: &'a [u8]) -> Self {
        ByteReader {
            path,
            bytes,
            position: 0,
        }
    }

    /// Absolute byte offset of the next read.
    pub(crate) fn position(&self) -> u64 {
        self.position as u64
    }

    /// Bytes left after the cursor.
    pub(crate) fn remaining(&self) -> usize {
        self.bytes.len() - self.position
    }

    pub(crate) fn path(&self) -> &'a Path {
        self.path
    }

    /// A `Truncated` error at the current offset.
    pub(crate) fn truncated(&self, what: impl Into<String>) -> FormatError {
        FormatError::Truncated {
            path: self.path.to_path_buf(),
            offset: self.position(),
            what: what.into(),
        }
    }

    /// An `Invalid` error at `offset`.
    pub(crate) fn invalid_at(&self, offset: u64, what: impl Into<String>) -> FormatError {
        FormatError::Invalid {
            path: self.path.to_path_buf(),
            offset,
            what: what.into(),
        }
    }

    /// The next `len` bytes, or a `Truncated` error naming `what`.
    pub(crate) fn take(&mut self, len: u64, what: &dyn Fn() -> String) -> Result<&'a [u8]> {
        let len = usize::try_from(len).ok().filter(|&n| n <= self.remaining());
        match len {
            Some(n) => {
                let slice = &self.bytes[self.position..self.position + n];
                self.position += n;
                Ok(slice)
            }
            None => Err(self.truncated(what())),
        }
    }

    fn array<const N: usize>(&mut self, what: &dyn Fn() -> String) -> Result<[u8; N]> {
        let slice = self.take(N as u64, what)?;
        let mut out = [0u8; N];
        out.copy_from_slice(slice);
        Ok(out)
    }

    pub(crate) fn u8(&mut self, what: &dyn Fn() -> String) -> Result<u8> {
        Ok(self.array::<1>(what)?[0])
    }
    pub(crate) fn u16(&mut self, what: &dyn Fn() -> String) -> Result<u16> {
        Ok(u16::from_le_bytes(self.array(what)?))
    }
    pub(crate) fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }
    pub(crate) fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// A GGUF string: u64 byte length, then UTF-8 bytes. The length is checked
    /// against the remaining input before anything is allocated.
    pub(crate) fn string(&mut self, what: &dyn Fn() -> String) -> Result<String> {
        let start = self.position();
        let len = self.u64(&|| format!("length of {}", what()))?;
        if len > self.remaining() as u64 {
            return Err(FormatError::Truncated {
                path: self.path.to_path_buf(),
                offset: start,
                what: format!(
                    "{} claims {len} bytes but only {} remain",
                    what(),
                    self.remaining()
                ),
            });
        }
        let bytes = self.take(len, what)?;
        match std::str::from_utf8(bytes) {
            Ok(s) => Ok(s.to_owned()),
            Err(e) => Err(self.invalid_at(
                start + 8 + e.valid_up_to() as u64,
                format!("{} is not valid UTF-8", what()),
            )),
        }
    }
}
