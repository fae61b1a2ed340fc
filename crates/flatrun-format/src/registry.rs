//! Picks the backend for a path.
//!
//! | path | backend |
//! |---|---|
//! | `*.gguf` file (or any file starting with `GGUF`) | [`GgufBackend`] |
//! | `*.safetensors` file | [`SafetensorsBackend`] |
//! | directory with `model.safetensors.index.json` | [`MultiBackend`] over the shards |
//! | directory with `model.safetensors` (or several `*.safetensors`) | [`SafetensorsBackend`] / [`MultiBackend`] |
//! | directory whose `config.json` has `quantization: {group_size, bits}` | [`MlxBackend`] |
//!
//! Adding a format: implement [`StorageBackend`], add
//! a [`Detector`] to [`DETECTORS`].

use std::path::Path;

use crate::gguf::{GgufBackend, GGUF_MAGIC};
use crate::mlx_backend::{is_mlx_directory, MlxBackend};
use crate::multi_backend::MultiBackend;
use crate::names::HfNaming;
use crate::safetensors_backend::SafetensorsBackend;
use crate::shard_index::{has_safetensors, list_shards};
use crate::{FormatError, Result, StorageBackend};

/// A format's test for "is this path mine?" and its opener.
pub struct Detector {
    /// Format name, as [`StorageBackend::name`] reports it.
    pub name: &'static str,
    /// Whether this format claims `path`.
    pub detect: fn(&Path) -> bool,
    /// Open `path` with this format's backend (Hugging Face tensor names
    /// under the given naming).
    pub open: fn(&Path, &HfNaming) -> Result<Box<dyn StorageBackend>>,
}

fn has_extension(path: &Path, ext: &str) -> bool {
    path.is_file()
        && path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case(ext))
}

fn starts_with_gguf_magic(path: &Path) -> bool {
    use std::io::Read;
    let mut magic = [0u8; 4];
    path.is_file()
        && std::fs::File::open(path)
            .and_then(|mut f| f.read_exact(&mut magic))
            .is_ok()
        && magic == GGUF_MAGIC
}

/// Every known format, tried in order.
pub const DETECTORS: &[Detector] = &[
    Detector {
        name: "gguf",
        detect: |p| has_extension(p, "gguf") || starts_with_gguf_magic(p),
        open: |p, _| Ok(Box::new(GgufBackend::open(p)?)),
    },
    Detector {
        name: "safetensors",
        detect: |p| has_extension(p, "safetensors"),
        open: |p, naming| Ok(Box::new(SafetensorsBackend::open(p, naming)?)),
    },
    Detector {
        name: "mlx",
        detect: is_mlx_directory,
        open: |p, naming| Ok(Box::new(MlxBackend::open(p, naming)?)),
    },
    Detector {
        name: "safetensors",
        detect: |p| p.is_dir() && has_safetensors(p),
        open: open_safetensors_directory,
    },
];

/// A Hugging Face directory: one file, or shards joined by a [`MultiBackend`].
fn open_safetensors_directory(dir: &Path, naming: &HfNaming) -> Result<Box<dyn StorageBackend>> {
    let shards = list_shards(dir)?;
    if shards.files.len() == 1 && shards.index_file.is_none() {
        let single =
            SafetensorsBackend::open_with(&shards.files[0], naming, Some(dir.to_path_buf()))?;
        return Ok(Box::new(single));
    }
    Ok(Box::new(MultiBackend::open_safetensors_directory(
        dir, naming,
    )?))
}

/// Open the checkpoint at `path` with the backend its layout calls for.
/// Hugging Face tensor names whose meaning depends on the model family keep
/// their original names ([`HfNaming::GENERIC`]; see [`open_with`]).
///
/// ```no_run
/// let backend = flatrun_format::open("model.gguf".as_ref())?;
/// for t in backend.tensors() {
///     println!("{} {:?}", t.name, t.shape);
/// }
/// # Ok::<(), flatrun_format::FormatError>(())
/// ```
pub fn open(path: &Path) -> Result<Box<dyn StorageBackend>> {
    open_with(path, &HfNaming::GENERIC)
}

/// [`open`], naming Hugging Face (SafeTensors, MLX) tensors under `naming`,
/// the model family's rule for the names whose meaning depends on it.
pub fn open_with(path: &Path, naming: &HfNaming) -> Result<Box<dyn StorageBackend>> {
    if !path.exists() {
        return Err(FormatError::Io {
            path: path.to_path_buf(),
            source: std::io::Error::new(std::io::ErrorKind::NotFound, "no such file or directory"),
        });
    }
    for d in DETECTORS {
        if (d.detect)(path) {
            return (d.open)(path, naming);
        }
    }
    Err(FormatError::UnknownFormat {
        path: path.to_path_buf(),
        reason: "expected a .gguf or .safetensors file, or a directory with model.safetensors, \
                 model.safetensors.index.json or an MLX config.json"
            .into(),
    })
}
