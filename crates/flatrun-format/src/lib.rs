//! Storage layer of Flatrun: every checkpoint format behind one trait.
//!
//! The runtime asks for tensors only through a [`StorageBackend`]. A backend
//! lists [`TensorInfo`]s under *canonical names* (see [`names`]) and hands out
//! cheap [`TensorHandle`]s whose bytes are borrowed from a memory mapping and
//! touched only when viewed.
//!
//! | format | backend | picked for |
//! |---|---|---|
//! | GGUF v2/v3 | [`GgufBackend`] | a `.gguf` file |
//! | SafeTensors | [`SafetensorsBackend`] | a `.safetensors` file, or a directory with `model.safetensors` |
//! | sharded SafeTensors | [`MultiBackend`] | a directory with `model.safetensors.index.json` |
//! | MLX | [`MlxBackend`] | a directory whose `config.json` has `quantization` |
//!
//! [`open`] picks the backend from the path ([`registry`]). Every file is
//! mapped once, read-only; hostile input gives a [`FormatError`] naming the
//! file, tensor or key and byte offset, never a panic.
//!
//! ```
//! use flatrun_format::{DType, GgmlType, StorageBackend};
//!
//! let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/synthetic.gguf");
//! let backend = flatrun_format::open(&path)?;
//! assert_eq!(backend.name(), "gguf");
//!
//! // Typed metadata getters; `require_*` names the missing key.
//! assert_eq!(backend.metadata().require_str("general.architecture")?, "llama");
//! assert_eq!(backend.metadata().get_u64("llama.block_count"), Some(1));
//!
//! // Canonical names: `token_embd.weight` is `embed`, shapes are row-major.
//! let embed = backend.tensor("embed")?;
//! assert_eq!(embed.shape(), &[2, 3]);
//! assert_eq!(embed.dtype(), DType::Ggml(GgmlType::F32));
//! let first = f32::from_le_bytes(embed.bytes()[..4].try_into().unwrap());
//! assert_eq!(first, 0.0);
//! embed.close(); // ≥ 1 MiB handles give their pages back here
//! # Ok::<(), flatrun_format::FormatError>(())
//! ```

pub mod ggml_type;
pub use ggml_type::{GgmlType, TypeTraits};

mod backend_support;
mod byte_reader;
pub mod gguf;
pub mod gguf_writer;
pub mod mapped_file;
pub mod metadata;
pub mod mlx_backend;
pub mod multi_backend;
pub mod names;
pub mod registry;
pub mod safetensors_backend;
pub mod shard_index;
pub mod tensor_index;

pub use gguf::GgufBackend;
pub use mlx_backend::{MlxBackend, MlxQuantConfig, MlxQuantization};
pub use multi_backend::MultiBackend;
pub use names::canonical_layer_index;
pub use names::{HfExpertStem, HfNaming};
pub use registry::{open, open_with};
pub use safetensors_backend::SafetensorsBackend;

use std::path::{Path, PathBuf};

/// Errors of the storage layer. Each carries the file and, where it applies,
/// the tensor or key and the byte offset.
#[derive(Debug, thiserror::Error)]
pub enum FormatError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: the model file changed: {what}; restart to load it again")]
    FileChanged { path: PathBuf, what: String },
    #[error("{path}: unrecognized checkpoint format: {reason}")]
    UnknownFormat { path: PathBuf, reason: String },
    #[error("{path}: truncated at byte {offset}: {what}")]
    Truncated {
        path: PathBuf,
        offset: u64,
        what: String,
    },
    #[error("{path}: invalid data at byte {offset}: {what}")]
    Invalid {
        path: PathBuf,
        offset: u64,
        what: String,
    },
    #[error("{path}: tensor `{tensor}` has unknown GGML type id {id}")]
    UnknownGgmlType {
        path: PathBuf,
        tensor: String,
        id: u32,
    },
    #[error("{path}: tensor `{tensor}`: {what}")]
    BadTensor {
        path: PathBuf,
        tensor: String,
        what: String,
    },
    #[error("{index}: names shard {shard}, which does not exist")]
    MissingShard { index: PathBuf, shard: PathBuf },
    #[error("no tensor named `{0}`")]
    NoSuchTensor(String),
    #[error("metadata key `{key}`: {what}")]
    Metadata { key: String, what: String },
}

pub type Result<T, E = FormatError> = std::result::Result<T, E>;

/// Storage dtype of a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// A GGML type: F32, F16, BF16, the integer types and every block quant.
    Ggml(GgmlType),
    U8,
    U16,
    U32,
    U64,
    Bool,
    F8E4M3,
    F8E5M2,
}

/// How the bytes of a tensor encode its logical values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QuantDescriptor {
    /// Plain values of the storage dtype.
    None,
    /// GGML block quantization, blocks along the contiguous (last) axis.
    Ggml(GgmlType),
    /// MLX affine quantization `w = scale * q + bias`: `bits`-bit values packed
    /// little-endian into u32 words along the last axis, one scale and bias per
    /// `group_size` values. The handle's `part("scales")` / `part("biases")`
    /// hold them in `scale_dtype`.
    MlxAffine {
        bits: u8,
        group_size: u32,
        scale_dtype: DType,
    },
}

/// What a backend knows about one tensor, without touching its bytes.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorInfo {
    /// Canonical name (`layers.3.attn.q`, `embed`, …), or the original name
    /// when no rule knows it.
    pub name: String,
    /// The name in the file.
    pub original_name: String,
    /// Logical row-major shape (slowest axis first; for MLX the unpacked shape).
    pub shape: Vec<usize>,
    /// Storage dtype (for MLX quantized weights: `U32`).
    pub dtype: DType,
    /// How values are encoded.
    pub quant: QuantDescriptor,
    /// Byte size of the main data.
    pub byte_size: u64,
    /// Absolute byte offset of the data in its file.
    pub offset: u64,
    /// Which file (index into [`StorageBackend::files`]).
    pub file_index: usize,
}

impl TensorInfo {
    /// Number of logical elements.
    pub fn n_elements(&self) -> u64 {
        self.shape.iter().map(|&d| d as u64).product()
    }
}

/// One metadata value (GGUF value types; `config.json` values map onto them).
#[derive(Clone, Debug, PartialEq)]
pub enum MetaValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<MetaValue>),
}

/// Ordered key → value metadata of a checkpoint.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Metadata {
    pub entries: Vec<(String, MetaValue)>,
}

impl Metadata {
    /// Drop every entry holding an array of more than `max_elements`
    /// elements; returns how many were dropped.
    pub fn forget_arrays_over(&mut self, max_elements: usize) -> usize {
        let before = self.entries.len();
        self.entries
            .retain(|(_, v)| !matches!(v, MetaValue::Array(a) if a.len() > max_elements));
        self.entries.shrink_to_fit();
        before - self.entries.len()
    }
}

/// Where one companion part of a tensor lies ([`StorageBackend::part_spans`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PartSpan {
    /// `"scales"` or `"biases"`, as [`TensorHandle::part`] names it.
    pub name: &'static str,
    /// Index into [`StorageBackend::files`].
    pub file_index: usize,
    /// Absolute offset of its first byte in that file.
    pub offset: u64,
    /// Bytes.
    pub byte_size: u64,
}

/// A storage backend: one opened checkpoint.
pub trait StorageBackend: Send + Sync {
    /// Short format name: `"gguf"`, `"safetensors"`, `"mlx"`.
    fn name(&self) -> &'static str;
    /// Whether tensor bytes are memory-mapped (zero-copy views).
    fn supports_mmap(&self) -> bool;
    /// Files backing this checkpoint.
    fn files(&self) -> &[PathBuf];
    /// The checkpoint's directory for side files (`config.json`,
    /// `tokenizer.json`, …), if it has one.
    fn directory(&self) -> Option<&Path>;
    /// GGUF key/values, or the safetensors `__metadata__` strings.
    fn metadata(&self) -> &Metadata;
    /// Every tensor, in file order.
    fn tensors(&self) -> &[TensorInfo];
    /// Open a handle by canonical (or original) name.
    fn tensor(&self, name: &str) -> Result<TensorHandle<'_>>;

    /// The info of a tensor by canonical (or original) name.
    fn tensor_info(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors()
            .iter()
            .find(|t| t.name == name)
            .or_else(|| self.tensors().iter().find(|t| t.original_name == name))
    }
    /// Whether a tensor of this canonical (or original) name exists.
    fn contains(&self, name: &str) -> bool {
        self.tensor_info(name).is_some()
    }
    /// Whether the files are still the bytes that were mapped: an error
    /// ([`FormatError::FileChanged`]) once one was truncated or modified in
    /// place. Callers check around each pass that reads tensor bytes, and
    /// discard that pass's results on error.
    fn check_files(&self) -> Result<()> {
        Ok(())
    }
    /// Start read-ahead (`MADV_WILLNEED`) of the named tensors; unknown names
    /// are ignored (prefetch is only a hint).
    fn advise_willneed(&self, names: &[&str]) {
        for name in names {
            if let Ok(handle) = self.tensor(name) {
                handle.prefetch();
            }
        }
    }
    /// Forget metadata arrays of more than `max_elements` elements (a
    /// vocabulary, its scores and merges) once the caller has built its own
    /// structures from them: parsed value by value they are the bulk of a
    /// GGUF header's memory (~25 MiB for a 262144-token vocabulary). Later
    /// [`StorageBackend::metadata`] calls no longer list those keys. Returns
    /// how many entries were dropped.
    fn forget_large_metadata_arrays(&mut self, max_elements: usize) -> usize {
        let _ = max_elements;
        0
    }
    /// Where the companion parts of tensor `name` (MLX scales and biases)
    /// lie in the files, so that they can be read like the main data; empty
    /// for formats whose tensors are one byte range.
    fn part_spans(&self, name: &str) -> Vec<PartSpan> {
        let _ = name;
        Vec::new()
    }
    /// Version of the container format where it has one (GGUF: 2 or 3).
    fn format_version(&self) -> Option<u32> {
        None
    }
    /// Total bytes of all tensors (main data plus companion parts).
    fn total_bytes(&self) -> u64 {
        self.tensors().iter().map(|t| t.byte_size).sum()
    }
}

/// A cheap view of one tensor: metadata plus bytes borrowed from the mapping.
/// Nothing is read from disk until [`TensorHandle::bytes`] is touched.
#[derive(Clone, Debug)]
pub struct TensorHandle<'a> {
    info: &'a TensorInfo,
    data: &'a [u8],
    /// Companion arrays (MLX `scales`, `biases`).
    parts: Vec<(&'static str, &'a [u8])>,
}

impl<'a> TensorHandle<'a> {
    /// Build a handle (for backends).
    pub fn new(info: &'a TensorInfo, data: &'a [u8], parts: Vec<(&'static str, &'a [u8])>) -> Self {
        TensorHandle { info, data, parts }
    }
    pub fn info(&self) -> &'a TensorInfo {
        self.info
    }
    pub fn name(&self) -> &'a str {
        &self.info.name
    }
    pub fn shape(&self) -> &'a [usize] {
        &self.info.shape
    }
    pub fn dtype(&self) -> DType {
        self.info.dtype
    }
    pub fn quant(&self) -> QuantDescriptor {
        self.info.quant
    }
    pub fn byte_size(&self) -> u64 {
        self.info.byte_size
    }
    /// Zero-copy view of the main data.
    pub fn bytes(&self) -> &'a [u8] {
        self.data
    }
    /// Every companion array, by name.
    pub fn parts(&self) -> &[(&'static str, &'a [u8])] {
        &self.parts
    }
    /// A companion array by name (`"scales"`, `"biases"`).
    pub fn part(&self, name: &str) -> Option<&'a [u8]> {
        self.parts.iter().find(|(n, _)| *n == name).map(|(_, b)| *b)
    }
    /// An owned copy of the main data.
    pub fn to_vec(&self) -> Vec<u8> {
        self.data.to_vec()
    }
    /// Hint that these bytes will be needed soon (`MADV_WILLNEED`).
    pub fn prefetch(&self) {
        mem::advise_willneed(self.data);
        for (_, p) in &self.parts {
            mem::advise_willneed(p);
        }
    }
    /// Close the handle; a handle of at least [`mem::RELEASE_THRESHOLD`] bytes
    /// returns its pages to the OS (`MADV_DONTNEED`).
    pub fn close(self) {
        mem::release(self.data);
        for (_, p) in &self.parts {
            mem::release(p);
        }
    }
}

pub mod mem;

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DType::Ggml(t) => write!(f, "{t}"),
            DType::U8 => f.write_str("U8"),
            DType::U16 => f.write_str("U16"),
            DType::U32 => f.write_str("U32"),
            DType::U64 => f.write_str("U64"),
            DType::Bool => f.write_str("BOOL"),
            DType::F8E4M3 => f.write_str("F8_E4M3"),
            DType::F8E5M2 => f.write_str("F8_E5M2"),
        }
    }
}
