//! GGUF v2/v3: header parser and the [`GgufBackend`].
//!
//! Layout (little-endian): magic `GGUF`, `u32` version, `u64` tensor count,
//! `u64` key/value count, the key/values, the tensor-info table (name,
//! `u32` n_dims, `u64` dims fastest axis first, `u32` GGML type, `u64`
//! offset relative to the data section), then the data section starting at
//! the next multiple of `general.alignment` (default 32).
//!
//! Every count and length is checked against the bytes that remain before
//! anything is allocated, so a hostile header gives a typed error.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use crate::byte_reader::ByteReader;
use crate::mapped_file::MappedFile;
use crate::names::canonical_gguf_name;
use crate::tensor_index::TensorIndex;
use crate::{
    DType, FormatError, GgmlType, MetaValue, Metadata, QuantDescriptor, Result, StorageBackend,
    TensorHandle, TensorInfo,
};

/// The four magic bytes at the start of every GGUF file.
pub const GGUF_MAGIC: [u8; 4] = *b"GGUF";
/// Data alignment when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// Most dimensions a GGML tensor can have.
pub const MAX_DIMS: u32 = 4;
/// Deepest nesting of arrays accepted in metadata.
pub const MAX_ARRAY_DEPTH: usize = 8;

/// Smallest encoding of one tensor-info entry: empty name (8), n_dims (4),
/// type (4), offset (8).
const MIN_TENSOR_INFO_BYTES: u64 = 24;
/// Smallest encoding of one key/value: empty key (8), type (4), one byte.
const MIN_KV_BYTES: u64 = 13;

/// GGUF metadata value type ids.
mod value_type {
    pub const U8: u32 = 0;
    pub const I8: u32 = 1;
    pub const U16: u32 = 2;
    pub const I16: u32 = 3;
    pub const U32: u32 = 4;
    pub const I32: u32 = 5;
    pub const F32: u32 = 6;
    pub const BOOL: u32 = 7;
    pub const STRING: u32 = 8;
    pub const ARRAY: u32 = 9;
    pub const U64: u32 = 10;
    pub const I64: u32 = 11;
    pub const F64: u32 = 12;
}

/// Smallest on-disk size of one value of a type id (for capping counts).
fn min_value_bytes(type_id: u32) -> Option<u64> {
    use value_type::*;
    Some(match type_id {
        U8 | I8 | BOOL => 1,
        U16 | I16 => 2,
        U32 | I32 | F32 => 4,
        U64 | I64 | F64 | STRING => 8,
        ARRAY => 12,
        _ => return None,
    })
}

/// A parsed GGUF header: everything but the tensor bytes.
#[derive(Clone, Debug, PartialEq)]
pub struct GgufHeader {
    /// Format version (2 or 3).
    pub version: u32,
    /// Key/values in file order.
    pub metadata: Metadata,
    /// Data alignment (`general.alignment`, default 32).
    pub alignment: u64,
    /// Absolute offset of the data section.
    pub data_offset: u64,
    /// Tensors in file order, with absolute offsets and row-major shapes.
    pub tensors: Vec<TensorInfo>,
}

/// Parse a GGUF header from the start of `bytes` (the whole file, or at
/// least everything up to the data section). Tensor extents are not checked
/// against the file length here; see [`check_tensor_extents`].
pub fn parse_header(path: &Path, bytes: &[u8]) -> Result<GgufHeader> {
    let mut r = ByteReader::new(path, bytes);

    // Magic and version.
    let magic = r.take(4, &|| "GGUF magic".into())?;
    if magic != GGUF_MAGIC {
        return Err(r.invalid_at(0, format!("not a GGUF file (magic {magic:02x?})")));
    }
    let version = r.u32(&|| "GGUF version".into())?;
    match version {
        2 | 3 => {}
        1 => return Err(r.invalid_at(4, "GGUF version 1 is not supported (use v2 or v3)")),
        v if v.swap_bytes() <= 3 => {
            return Err(r.invalid_at(4, "big-endian GGUF is not supported"));
        }
        v => return Err(r.invalid_at(4, format!("unsupported GGUF version {v}"))),
    }

    // Counts, capped by the bytes that could possibly hold them.
    let tensor_count = r.u64(&|| "tensor count".into())?;
    let kv_count = r.u64(&|| "metadata key/value count".into())?;
    let needed = tensor_count
        .checked_mul(MIN_TENSOR_INFO_BYTES)
        .and_then(|t| {
            kv_count
                .checked_mul(MIN_KV_BYTES)
                .and_then(|k| t.checked_add(k))
        });
    if needed.is_none_or(|n| n > r.remaining() as u64) {
        return Err(FormatError::Truncated {
            path: path.to_path_buf(),
            offset: 8,
            what: format!(
                "header claims {tensor_count} tensors and {kv_count} key/values, \
                 more than the {} remaining bytes can hold",
                r.remaining()
            ),
        });
    }

    // Key/values.
    let mut metadata = Metadata::new();
    let mut seen_keys = HashSet::new();
    for i in 0..kv_count {
        let key_offset = r.position();
        let key = r.string(&|| format!("key of metadata entry {i}"))?;
        if !seen_keys.insert(key.clone()) {
            return Err(r.invalid_at(key_offset, format!("duplicate metadata key `{key}`")));
        }
        let type_id = r.u32(&|| format!("value type of `{key}`"))?;
        let value = read_value(&mut r, type_id, &key, 0)?;
        metadata.push(key, value);
    }

    // Alignment.
    let alignment = match metadata.get("general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some(v) => match v.as_u64() {
            Some(a) if a.is_power_of_two() => a,
            _ => {
                return Err(FormatError::Metadata {
                    key: "general.alignment".into(),
                    what: format!("{v:?} is not a power of two"),
                })
            }
        },
    };

    // Tensor-info table.
    let reserve = (tensor_count as usize).min(r.remaining() / std::mem::size_of::<TensorInfo>());
    let mut tensors = Vec::with_capacity(reserve);
    let mut relative_offsets = Vec::with_capacity(reserve);
    let mut seen_names = HashSet::new();
    for i in 0..tensor_count {
        let entry_offset = r.position();
        let name = r.string(&|| format!("name of tensor {i}"))?;
        let bad = |what: String| FormatError::BadTensor {
            path: path.to_path_buf(),
            tensor: name.clone(),
            what,
        };
        if !seen_names.insert(name.clone()) {
            return Err(bad(format!(
                "duplicate tensor name (entry at byte {entry_offset})"
            )));
        }
        let n_dims = r.u32(&|| format!("n_dims of tensor `{name}`"))?;
        if n_dims > MAX_DIMS {
            return Err(bad(format!("{n_dims} dimensions (at most {MAX_DIMS})")));
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for d in 0..n_dims {
            dims.push(r.u64(&|| format!("dim {d} of tensor `{name}`"))?);
        }
        let type_id = r.u32(&|| format!("type of tensor `{name}`"))?;
        let relative_offset = r.u64(&|| format!("offset of tensor `{name}`"))?;

        let ggml_type = GgmlType::from_id(type_id).ok_or_else(|| FormatError::UnknownGgmlType {
            path: path.to_path_buf(),
            tensor: name.clone(),
            id: type_id,
        })?;
        let n_elements = dims
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .filter(|&n| n <= i64::MAX as u64)
            .ok_or_else(|| bad(format!("dims {dims:?} overflow the element count")))?;
        let row = dims.first().copied().unwrap_or(1);
        if row % ggml_type.block_size() as u64 != 0 {
            return Err(bad(format!(
                "row length {row} is not a multiple of the {ggml_type} block size {}",
                ggml_type.block_size()
            )));
        }
        let byte_size = ggml_type.bytes_for(n_elements).ok_or_else(|| {
            bad(format!(
                "byte size of {n_elements} {ggml_type} values overflows"
            ))
        })?;
        if relative_offset % alignment != 0 {
            return Err(bad(format!(
                "data offset {relative_offset} is not a multiple of the alignment {alignment}"
            )));
        }
        let shape = dims
            .iter()
            .rev()
            .map(|&d| usize::try_from(d))
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|_| bad(format!("dims {dims:?} do not fit this platform")))?;
        let quant = if ggml_type.is_quantized() {
            QuantDescriptor::Ggml(ggml_type)
        } else {
            QuantDescriptor::None
        };
        relative_offsets.push(relative_offset);
        tensors.push(TensorInfo {
            name: canonical_gguf_name(&name).unwrap_or_else(|| name.clone()),
            original_name: name,
            shape,
            dtype: DType::Ggml(ggml_type),
            quant,
            byte_size,
            offset: 0,
            file_index: 0,
        });
    }

    // Data section: the next multiple of the alignment.
    let end_of_infos = r.position();
    let data_offset = end_of_infos
        .checked_next_multiple_of(alignment)
        .ok_or_else(|| r.invalid_at(end_of_infos, "data section offset overflows"))?;
    for (t, rel) in tensors.iter_mut().zip(relative_offsets) {
        t.offset = data_offset
            .checked_add(rel)
            .ok_or_else(|| FormatError::BadTensor {
                path: path.to_path_buf(),
                tensor: t.original_name.clone(),
                what: format!("offset {rel} overflows"),
            })?;
    }
    crate::backend_support::dedupe_canonical_names(&mut tensors);

    Ok(GgufHeader {
        version,
        metadata,
        alignment,
        data_offset,
        tensors,
    })
}

/// Check that every tensor's bytes lie inside a file of `file_len` bytes and
/// that no two tensors overlap.
pub fn check_tensor_extents(path: &Path, tensors: &[TensorInfo], file_len: u64) -> Result<()> {
    crate::backend_support::check_extents(path, tensors, file_len)
}

/// Read one metadata value of type `type_id` (arrays recurse up to
/// [`MAX_ARRAY_DEPTH`]).
fn read_value(r: &mut ByteReader<'_>, type_id: u32, key: &str, depth: usize) -> Result<MetaValue> {
    use value_type::*;
    let what = || format!("value of `{key}`");
    Ok(match type_id {
        U8 => MetaValue::U8(r.u8(&what)?),
        I8 => MetaValue::I8(r.u8(&what)? as i8),
        U16 => MetaValue::U16(r.u16(&what)?),
        I16 => MetaValue::I16(r.u16(&what)? as i16),
        U32 => MetaValue::U32(r.u32(&what)?),
        I32 => MetaValue::I32(r.u32(&what)? as i32),
        U64 => MetaValue::U64(r.u64(&what)?),
        I64 => MetaValue::I64(r.u64(&what)? as i64),
        F32 => MetaValue::F32(f32::from_bits(r.u32(&what)?)),
        F64 => MetaValue::F64(f64::from_bits(r.u64(&what)?)),
        BOOL => {
            let offset = r.position();
            match r.u8(&what)? {
                0 => MetaValue::Bool(false),
                1 => MetaValue::Bool(true),
                b => {
                    return Err(
                        r.invalid_at(offset, format!("`{key}`: bool byte {b} is not 0 or 1"))
                    )
                }
            }
        }
        STRING => MetaValue::String(r.string(&what)?),
        ARRAY => {
            let start = r.position();
            if depth >= MAX_ARRAY_DEPTH {
                return Err(r.invalid_at(
                    start,
                    format!("`{key}`: arrays nested deeper than {MAX_ARRAY_DEPTH}"),
                ));
            }
            let element_type = r.u32(&|| format!("element type of `{key}`"))?;
            let count = r.u64(&|| format!("element count of `{key}`"))?;
            let min = min_value_bytes(element_type).ok_or_else(|| {
                r.invalid_at(
                    start,
                    format!("`{key}`: unknown array element type {element_type}"),
                )
            })?;
            if count
                .checked_mul(min)
                .is_none_or(|n| n > r.remaining() as u64)
            {
                return Err(FormatError::Truncated {
                    path: r.path().to_path_buf(),
                    offset: start,
                    what: format!(
                        "`{key}` claims {count} elements but only {} bytes remain",
                        r.remaining()
                    ),
                });
            }
            // Reserve no more than the remaining bytes could fill; real
            // elements beyond that grow the vector as they are parsed.
            let reserve = (count as usize).min(r.remaining() / std::mem::size_of::<MetaValue>());
            let mut items = Vec::with_capacity(reserve);
            for _ in 0..count {
                items.push(read_value(r, element_type, key, depth + 1)?);
            }
            MetaValue::Array(items)
        }
        other => {
            let offset = r.position().saturating_sub(4);
            return Err(r.invalid_at(offset, format!("`{key}`: unknown value type {other}")));
        }
    })
}

/// A GGUF file, mapped once.
#[derive(Debug)]
pub struct GgufBackend {
    file: MappedFile,
    files: Vec<PathBuf>,
    header: GgufHeader,
    index: TensorIndex,
}

impl GgufBackend {
    /// Map and parse `path`, checking every tensor's extent.
    pub fn open(path: &Path) -> Result<GgufBackend> {
        let file = MappedFile::open(path)?;
        let header = parse_header(path, file.bytes())?;
        check_tensor_extents(path, &header.tensors, file.len())?;
        let index = TensorIndex::new(&header.tensors);
        Ok(GgufBackend {
            files: vec![path.to_path_buf()],
            file,
            header,
            index,
        })
    }

    /// The parsed header.
    pub fn header(&self) -> &GgufHeader {
        &self.header
    }
}

impl StorageBackend for GgufBackend {
    fn check_files(&self) -> Result<()> {
        self.file.check()
    }
    fn name(&self) -> &'static str {
        "gguf"
    }
    fn supports_mmap(&self) -> bool {
        true
    }
    fn files(&self) -> &[PathBuf] {
        &self.files
    }
    fn directory(&self) -> Option<&Path> {
        None
    }
    fn metadata(&self) -> &Metadata {
        &self.header.metadata
    }
    fn tensors(&self) -> &[TensorInfo] {
        &self.header.tensors
    }
    fn format_version(&self) -> Option<u32> {
        Some(self.header.version)
    }
    fn forget_large_metadata_arrays(&mut self, max_elements: usize) -> usize {
        self.header.metadata.forget_arrays_over(max_elements)
    }
    fn tensor(&self, name: &str) -> Result<TensorHandle<'_>> {
        let info = self
            .index
            .find(name)
            .and_then(|i| self.header.tensors.get(i))
            .ok_or_else(|| FormatError::NoSuchTensor(name.to_string()))?;
        let data = crate::backend_support::tensor_bytes(&self.file, info)?;
        Ok(TensorHandle::new(info, data, Vec::new()))
    }
}
