//! [`MultiBackend`]: several backends (the shards of one checkpoint) seen as
//! one. Tensor lists are concatenated, `file_index` is renumbered over the
//! union of the shards' files, and a name may live in only one shard.

use std::path::{Path, PathBuf};

use crate::names::HfNaming;
use crate::safetensors_backend::SafetensorsBackend;
use crate::shard_index::list_shards;
use crate::tensor_index::TensorIndex;
use crate::{FormatError, Metadata, Result, StorageBackend, TensorHandle, TensorInfo};

/// Shards presented as one backend.
pub struct MultiBackend {
    name: &'static str,
    shards: Vec<Box<dyn StorageBackend>>,
    files: Vec<PathBuf>,
    directory: Option<PathBuf>,
    metadata: Metadata,
    tensors: Vec<TensorInfo>,
    /// For each entry of `tensors`: (shard, position in that shard).
    locations: Vec<(usize, usize)>,
    index: TensorIndex,
}

impl std::fmt::Debug for MultiBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MultiBackend")
            .field("name", &self.name)
            .field("files", &self.files)
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

impl MultiBackend {
    /// Join `shards` (reported under the format `name`). A tensor name that
    /// appears in two shards is an error naming the second shard's file.
    pub fn new(
        name: &'static str,
        shards: Vec<Box<dyn StorageBackend>>,
        directory: Option<PathBuf>,
    ) -> Result<MultiBackend> {
        let mut files = Vec::new();
        let mut metadata = Metadata::new();
        let mut tensors = Vec::new();
        let mut locations = Vec::new();
        let mut seen = std::collections::HashMap::new();
        for (s, shard) in shards.iter().enumerate() {
            let file_base = files.len();
            files.extend_from_slice(shard.files());
            for (k, v) in shard.metadata().iter() {
                if !metadata.contains(k) {
                    metadata.push(k, v.clone());
                }
            }
            for (i, t) in shard.tensors().iter().enumerate() {
                if let Some(first) = seen.insert(t.original_name.clone(), s) {
                    return Err(FormatError::BadTensor {
                        path: shard.files().first().cloned().unwrap_or_default(),
                        tensor: t.original_name.clone(),
                        what: format!(
                            "also present in shard {}",
                            shards[first]
                                .files()
                                .first()
                                .map_or(String::new(), |p| p.display().to_string())
                        ),
                    });
                }
                let mut t = t.clone();
                t.file_index += file_base;
                tensors.push(t);
                locations.push((s, i));
            }
        }
        let index = TensorIndex::new(&tensors);
        Ok(MultiBackend {
            name,
            shards,
            files,
            directory,
            metadata,
            tensors,
            locations,
            index,
        })
    }

    /// Open a Hugging Face checkpoint directory of several safetensors
    /// shards (`model.safetensors.index.json`, or every `*.safetensors`).
    /// When an index is present, every tensor it lists must be in its shard.
    pub fn open_safetensors_directory(dir: &Path, naming: &HfNaming) -> Result<MultiBackend> {
        let shards = list_shards(dir)?;
        let mut opened: Vec<Box<dyn StorageBackend>> = Vec::with_capacity(shards.files.len());
        for f in &shards.files {
            opened.push(Box::new(SafetensorsBackend::open_with(
                f,
                naming,
                Some(dir.to_path_buf()),
            )?));
        }
        if let Some(index_file) = &shards.index_file {
            for (tensor, &s) in &shards.weight_map {
                let shard = &opened[s];
                if !shard.tensors().iter().any(|t| &t.original_name == tensor) {
                    return Err(FormatError::BadTensor {
                        path: index_file.clone(),
                        tensor: tensor.clone(),
                        what: format!(
                            "listed in shard {}, which does not contain it",
                            shards.files[s].display()
                        ),
                    });
                }
            }
        }
        MultiBackend::new("safetensors", opened, Some(dir.to_path_buf()))
    }

    /// The shards.
    pub fn shards(&self) -> &[Box<dyn StorageBackend>] {
        &self.shards
    }
}

impl StorageBackend for MultiBackend {
    fn check_files(&self) -> Result<()> {
        self.shards.iter().try_for_each(|s| s.check_files())
    }
    fn name(&self) -> &'static str {
        self.name
    }
    fn supports_mmap(&self) -> bool {
        self.shards.iter().all(|s| s.supports_mmap())
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
        let i = self
            .index
            .find(name)
            .ok_or_else(|| FormatError::NoSuchTensor(name.to_string()))?;
        let (s, local) = self.locations[i];
        let shard = &self.shards[s];
        let inner = shard.tensor(&shard.tensors()[local].name)?;
        Ok(TensorHandle::new(
            &self.tensors[i],
            inner.bytes(),
            inner.parts().to_vec(),
        ))
    }
    fn total_bytes(&self) -> u64 {
        self.shards.iter().map(|s| s.total_bytes()).sum()
    }
}
