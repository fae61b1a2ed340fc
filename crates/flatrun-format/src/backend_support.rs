//! Checks and helpers shared by the backends.

use std::collections::HashSet;
use std::path::Path;

use crate::mapped_file::MappedFile;
use crate::{FormatError, Result, TensorInfo};

/// Check that every tensor's bytes lie inside a file of `file_len` bytes and
/// that no two tensors share bytes. All tensors must come from that file.
pub(crate) fn check_extents(path: &Path, tensors: &[TensorInfo], file_len: u64) -> Result<()> {
    let bad = |t: &TensorInfo, what: String| FormatError::BadTensor {
        path: path.to_path_buf(),
        tensor: t.original_name.clone(),
        what,
    };
    // Every tensor ends inside the file.
    for t in tensors {
        match t.offset.checked_add(t.byte_size) {
            Some(end) if end <= file_len => {}
            _ => {
                return Err(bad(
                    t,
                    format!(
                    "data at byte {} ({} bytes) runs past the end of the file ({file_len} bytes)",
                    t.offset, t.byte_size
                ),
                ))
            }
        }
    }
    // No two non-empty tensors overlap.
    let mut by_offset: Vec<&TensorInfo> = tensors.iter().filter(|t| t.byte_size > 0).collect();
    by_offset.sort_by_key(|t| t.offset);
    for pair in by_offset.windows(2) {
        let (a, b) = (pair[0], pair[1]);
        if b.offset < a.offset + a.byte_size {
            return Err(bad(
                b,
                format!(
                    "data at byte {} overlaps tensor `{}` (bytes {}..{})",
                    b.offset,
                    a.original_name,
                    a.offset,
                    a.offset + a.byte_size
                ),
            ));
        }
    }
    Ok(())
}

/// The bytes of `info` inside `file` (extents were checked at open).
pub(crate) fn tensor_bytes<'a>(file: &'a MappedFile, info: &TensorInfo) -> Result<&'a [u8]> {
    file.range(info.offset, info.byte_size)
        .ok_or_else(|| FormatError::BadTensor {
            path: file.path().to_path_buf(),
            tensor: info.original_name.clone(),
            what: format!(
                "data at byte {} ({} bytes) lies outside the file",
                info.offset, info.byte_size
            ),
        })
}

/// When two tensors translate to the same canonical name (or a canonical name
/// equals another tensor's original name), the later ones keep their original
/// names so every name stays unique.
pub(crate) fn dedupe_canonical_names(tensors: &mut [TensorInfo]) {
    let originals: HashSet<String> = tensors.iter().map(|t| t.original_name.clone()).collect();
    let mut taken: HashSet<String> = HashSet::new();
    for t in tensors.iter_mut() {
        let clashes_with_other_original = t.name != t.original_name && originals.contains(&t.name);
        if clashes_with_other_original || !taken.insert(t.name.clone()) {
            t.name = t.original_name.clone();
            taken.insert(t.name.clone());
        }
    }
}
