//! SafeTensors: one `.safetensors` file, parsed by the `safetensors` crate
//! and mapped once.
//!
//! Layout: `u64` header length `n`, `n` bytes of JSON
//! (`{"name": {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {…}}`),
//! then the data, offsets relative to byte `8 + n`. F32/F16/BF16 (and the
//! signed integer and F64 types) map onto [`DType::Ggml`]; U8/U16/U32/U64,
//! BOOL and the FP8 types are exposed raw under their own [`DType`].

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use ::safetensors::tensor::TensorInfo as StTensorInfo;
use ::safetensors::{Dtype, SafeTensorError, SafeTensors};

use crate::backend_support::{dedupe_canonical_names, tensor_bytes};
use crate::mapped_file::MappedFile;
use crate::names::{canonical_hf_name, HfNaming};
use crate::tensor_index::TensorIndex;
use crate::{
    DType, FormatError, GgmlType, MetaValue, Metadata, QuantDescriptor, Result, StorageBackend,
    TensorHandle, TensorInfo,
};

/// The [`DType`] of a safetensors dtype.
pub fn dtype_of(dtype: Dtype) -> Option<DType> {
    Some(match dtype {
        Dtype::F32 => DType::Ggml(GgmlType::F32),
        Dtype::F16 => DType::Ggml(GgmlType::F16),
        Dtype::BF16 => DType::Ggml(GgmlType::BF16),
        Dtype::F64 => DType::Ggml(GgmlType::F64),
        Dtype::I8 => DType::Ggml(GgmlType::I8),
        Dtype::I16 => DType::Ggml(GgmlType::I16),
        Dtype::I32 => DType::Ggml(GgmlType::I32),
        Dtype::I64 => DType::Ggml(GgmlType::I64),
        Dtype::U8 => DType::U8,
        Dtype::U16 => DType::U16,
        Dtype::U32 => DType::U32,
        Dtype::U64 => DType::U64,
        Dtype::BOOL => DType::Bool,
        Dtype::F8_E4M3 => DType::F8E4M3,
        Dtype::F8_E5M2 => DType::F8E5M2,
        _ => return None,
    })
}

/// A parsed safetensors header.
#[derive(Clone, Debug, PartialEq)]
pub struct SafetensorsHeader {
    /// Absolute offset of the data section (`8 + n`).
    pub data_offset: u64,
    /// The `__metadata__` strings, sorted by key.
    pub metadata: Metadata,
    /// Tensors in data order, under their original names (`name ==
    /// original_name`), absolute offsets, `file_index` 0.
    pub tensors: Vec<TensorInfo>,
}

/// Parse and validate the header of a whole safetensors file `bytes`.
pub fn parse_header(path: &Path, bytes: &[u8]) -> Result<SafetensorsHeader> {
    let (header_len, parsed) =
        SafeTensors::read_metadata(bytes).map_err(|e| explain(path, bytes, e))?;
    let data_offset = 8 + header_len as u64;

    let mut metadata = Metadata::new();
    if let Some(strings) = parsed.metadata() {
        let mut sorted: Vec<_> = strings.iter().collect();
        sorted.sort();
        for (k, v) in sorted {
            metadata.push(k.clone(), MetaValue::String(v.clone()));
        }
    }

    let mut tensors = Vec::new();
    for (name, info) in parsed.tensors() {
        let dtype = dtype_of(info.dtype).ok_or_else(|| FormatError::BadTensor {
            path: path.to_path_buf(),
            tensor: name.clone(),
            what: format!("unsupported safetensors dtype {:?}", info.dtype),
        })?;
        let (begin, end) = info.data_offsets;
        tensors.push(TensorInfo {
            name: name.clone(),
            original_name: name,
            shape: info.shape.clone(),
            dtype,
            quant: QuantDescriptor::None,
            byte_size: (end - begin) as u64,
            offset: data_offset + begin as u64,
            file_index: 0,
        });
    }
    tensors.sort_by(|a, b| a.offset.cmp(&b.offset).then_with(|| a.name.cmp(&b.name)));
    Ok(SafetensorsHeader {
        data_offset,
        metadata,
        tensors,
    })
}

/// Turn a `safetensors` crate error into a [`FormatError`] naming the file,
/// and where possible the tensor and offset.
fn explain(path: &Path, bytes: &[u8], error: SafeTensorError) -> FormatError {
    let path = path.to_path_buf();
    let header_len = bytes
        .get(..8)
        .and_then(|b| b.try_into().ok())
        .map(u64::from_le_bytes)
        .unwrap_or(0);
    let data_offset = header_len.saturating_add(8);
    match error {
        SafeTensorError::HeaderTooSmall => FormatError::Truncated {
            path,
            offset: 0,
            what: "safetensors header length (8 bytes)".into(),
        },
        SafeTensorError::InvalidHeaderLength | SafeTensorError::HeaderTooLarge => {
            FormatError::Truncated {
                path,
                offset: 0,
                what: format!(
                    "safetensors header claims {header_len} bytes, file has {}",
                    bytes.len()
                ),
            }
        }
        SafeTensorError::InvalidHeader => FormatError::Invalid {
            path,
            offset: 8,
            what: "safetensors header is not valid UTF-8".into(),
        },
        SafeTensorError::InvalidHeaderStart | SafeTensorError::InvalidHeaderDeserialization => {
            FormatError::Invalid {
                path,
                offset: 8,
                what: "safetensors header is not valid JSON of tensor entries".into(),
            }
        }
        SafeTensorError::InvalidOffset(tensor) => FormatError::BadTensor {
            path,
            tensor,
            what: "data_offsets leave a gap, overlap, or run backwards".into(),
        },
        SafeTensorError::TensorInvalidInfo | SafeTensorError::ValidationOverflow => {
            let tensor = find_inconsistent_tensor(bytes, header_len);
            FormatError::BadTensor {
                path,
                tensor: tensor.unwrap_or_else(|| "?".into()),
                what: "shape × dtype size does not match data_offsets (or overflows)".into(),
            }
        }
        SafeTensorError::MetadataIncompleteBuffer => FormatError::Invalid {
            path,
            offset: data_offset,
            what: format!(
                "tensor data does not end exactly at the end of the file ({} bytes)",
                bytes.len()
            ),
        },
        other => FormatError::Invalid {
            path,
            offset: 0,
            what: format!("safetensors: {other:?}"),
        },
    }
}

/// The first tensor whose shape and dtype disagree with its offsets (for the
/// error message only).
fn find_inconsistent_tensor(bytes: &[u8], header_len: u64) -> Option<String> {
    let end = usize::try_from(header_len).ok()?.checked_add(8)?;
    let json = std::str::from_utf8(bytes.get(8..end)?).ok()?;
    let mut entries: HashMap<String, serde_json::Value> = serde_json::from_str(json).ok()?;
    entries.remove("__metadata__");
    let mut names: Vec<_> = entries.keys().cloned().collect();
    names.sort();
    names.into_iter().find(|name| {
        let Ok(info) = serde_json::from_value::<StTensorInfo>(entries[name].clone()) else {
            return true;
        };
        let n = info
            .shape
            .iter()
            .try_fold(info.dtype.size(), |a, &d| a.checked_mul(d));
        n != info.data_offsets.1.checked_sub(info.data_offsets.0)
    })
}

/// Rename `tensors` to canonical Hugging Face names under `naming`.
pub(crate) fn apply_hf_names(tensors: &mut [TensorInfo], naming: &HfNaming) {
    for t in tensors.iter_mut() {
        if let Some(name) = canonical_hf_name(&t.original_name, naming) {
            t.name = name;
        }
    }
    dedupe_canonical_names(tensors);
}

/// One `.safetensors` file, mapped once.
#[derive(Debug)]
pub struct SafetensorsBackend {
    file: MappedFile,
    files: Vec<PathBuf>,
    directory: Option<PathBuf>,
    metadata: Metadata,
    tensors: Vec<TensorInfo>,
    index: TensorIndex,
}

impl SafetensorsBackend {
    /// Open a file; the directory holding it is the side-file directory
    /// when it has a `config.json`.
    pub fn open(path: &Path, naming: &HfNaming) -> Result<SafetensorsBackend> {
        let directory = path
            .parent()
            .filter(|d| d.join("config.json").is_file())
            .map(Path::to_path_buf);
        Self::open_with(path, naming, directory)
    }

    /// Open a file with an explicit side-file directory.
    pub fn open_with(
        path: &Path,
        naming: &HfNaming,
        directory: Option<PathBuf>,
    ) -> Result<SafetensorsBackend> {
        let file = MappedFile::open(path)?;
        let header = parse_header(path, file.bytes())?;
        let mut tensors = header.tensors;
        apply_hf_names(&mut tensors, naming);
        let index = TensorIndex::new(&tensors);
        Ok(SafetensorsBackend {
            files: vec![path.to_path_buf()],
            file,
            directory,
            metadata: header.metadata,
            tensors,
            index,
        })
    }
}

impl StorageBackend for SafetensorsBackend {
    fn check_files(&self) -> Result<()> {
        self.file.check()
    }
    fn name(&self) -> &'static str {
        "safetensors"
    }
    fn supports_mmap(&self) -> bool {
        true
    }
    fn files(&self) -> &[PathBuf] {
        &self.files
    }
    fn directory(&self) -> Option<&Path> {
        self.directory.as_deref()
    }
    fn metadata(&self) -> &Metadata {
        &self.metadata
    }
    fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }
    fn tensor(&self, name: &str) -> Result<TensorHandle<'_>> {
        let info = self
            .index
            .find(name)
            .and_then(|i| self.tensors.get(i))
            .ok_or_else(|| FormatError::NoSuchTensor(name.to_string()))?;
        Ok(TensorHandle::new(
            info,
            tensor_bytes(&self.file, info)?,
            Vec::new(),
        ))
    }
}
