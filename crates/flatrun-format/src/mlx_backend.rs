//! MLX checkpoints: a directory of safetensors whose `config.json` carries
//! `quantization: {group_size, bits}`.
//!
//! A quantized linear `X` is stored as `X.weight` (u32 words, each holding
//! `32 / bits` values little-endian along the last axis), `X.scales` and
//! `X.biases` (one per `group_size` values; `w = scale * q + bias`). The
//! backend exposes it as ONE tensor named after `X.weight`, with the logical
//! (unpacked) shape, [`QuantDescriptor::MlxAffine`], and the scales and
//! biases as the handle's `part("scales")` / `part("biases")`. A per-module
//! entry in `quantization` (`"model.layers.0.mlp.up_proj": {…}` or `false`)
//! overrides the defaults.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use crate::backend_support::{check_extents, dedupe_canonical_names};
use crate::mapped_file::MappedFile;
use crate::names::{canonical_hf_name, HfNaming};
use crate::safetensors_backend::parse_header;
use crate::shard_index::list_shards;
use crate::tensor_index::TensorIndex;
use crate::{
    DType, FormatError, Metadata, QuantDescriptor, Result, StorageBackend, TensorHandle, TensorInfo,
};

/// Bit widths MLX affine quantization uses.
pub const MLX_BITS: &[u8] = &[2, 3, 4, 5, 6, 8];

/// Group size and bit width of one quantized module.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MlxQuantization {
    pub group_size: u32,
    pub bits: u8,
}

/// The quantization section of an MLX `config.json`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct MlxQuantConfig {
    /// Defaults for every quantized module.
    pub default: Option<MlxQuantization>,
    /// Per-module overrides (`None` = that module is not quantized).
    pub overrides: HashMap<String, Option<MlxQuantization>>,
}

/// One `{group_size, bits, mode}` object; a missing or `null` field takes
/// `inherit`'s value (mlx-lm writes per-module entries with
/// `"group_size": null`). `None` when a field is missing with nothing to inherit.
fn parse_quantization(
    v: &serde_json::Value,
    inherit: Option<MlxQuantization>,
) -> Option<MlxQuantization> {
    let group_size = match v.get("group_size").and_then(|g| g.as_u64()) {
        Some(g) => u32::try_from(g).ok()?,
        None => inherit?.group_size,
    };
    let bits = match v.get("bits").and_then(|b| b.as_u64()) {
        Some(b) => u8::try_from(b).ok()?,
        None => inherit?.bits,
    };
    Some(MlxQuantization { group_size, bits })
}

/// The `mode` of a quantization object (`affine` when absent, as mlx-lm
/// writes it for affine checkpoints before it named other modes).
fn mode(v: &serde_json::Value) -> &str {
    v.get("mode").and_then(|m| m.as_str()).unwrap_or("affine")
}

impl MlxQuantConfig {
    /// Read `quantization` (or `quantization_config`) from a `config.json`
    /// value; `None` when there is no such section with `group_size` and `bits`.
    /// Per-module entries (`"model.layers.0.mlp.down_proj": {"bits": 6, …}`,
    /// fields left `null` inherit the defaults) override the defaults; `false`
    /// marks a module unquantized.
    pub fn from_config(config: &serde_json::Value) -> Option<MlxQuantConfig> {
        let q = config
            .get("quantization")
            .or_else(|| config.get("quantization_config"))?;
        let default = parse_quantization(q, None)?;
        let overrides = q
            .as_object()
            .map(|o| {
                o.iter()
                    .filter(|(_, v)| v.is_object() || v.is_boolean())
                    .map(|(k, v)| {
                        let entry = match v {
                            serde_json::Value::Bool(true) => Some(default),
                            serde_json::Value::Bool(false) => None,
                            _ => parse_quantization(v, Some(default)),
                        };
                        (k.clone(), entry)
                    })
                    .collect()
            })
            .unwrap_or_default();
        Some(MlxQuantConfig {
            default: Some(default),
            overrides,
        })
    }

    /// The first quantization mode other than `affine` in `config`'s
    /// quantization section (its own or a module's), with the module's name
    /// (empty for the section itself): MLX's `mxfp4`, `nvfp4` and `mxfp8`
    /// layouts have no biases and other scales, and are not read.
    pub fn unsupported_mode(config: &serde_json::Value) -> Option<(String, String)> {
        let q = config
            .get("quantization")
            .or_else(|| config.get("quantization_config"))?;
        if mode(q) != "affine" {
            return Some((String::new(), mode(q).to_string()));
        }
        q.as_object()?
            .iter()
            .filter(|(_, v)| v.is_object() && mode(v) != "affine")
            .map(|(k, v)| (k.clone(), mode(v).to_string()))
            .next()
    }

    /// Parameters of module `module` (`model.layers.0.mlp.up_proj`).
    pub fn for_module(&self, module: &str) -> Option<MlxQuantization> {
        match self.overrides.get(module) {
            Some(o) => *o,
            None => self.default,
        }
    }
}

/// Whether `dir` is an MLX checkpoint: safetensors plus a `config.json`
/// with a `quantization` section.
pub fn is_mlx_directory(dir: &Path) -> bool {
    dir.is_dir()
        && crate::shard_index::has_safetensors(dir)
        && read_config(dir)
            .ok()
            .and_then(|c| MlxQuantConfig::from_config(&c))
            .is_some()
}

fn read_config(dir: &Path) -> Result<serde_json::Value> {
    let path = dir.join("config.json");
    let bytes = std::fs::read(&path).map_err(|source| FormatError::Io {
        path: path.clone(),
        source,
    })?;
    serde_json::from_slice(&bytes).map_err(|e| FormatError::Invalid {
        path,
        offset: e.column() as u64,
        what: format!("config.json is not JSON: {e}"),
    })
}

/// Where a companion array lives.
#[derive(Clone, Debug, PartialEq)]
struct PartLocation {
    name: &'static str,
    file_index: usize,
    offset: u64,
    byte_size: u64,
}

/// An MLX checkpoint directory.
#[derive(Debug)]
pub struct MlxBackend {
    maps: Vec<MappedFile>,
    files: Vec<PathBuf>,
    directory: PathBuf,
    metadata: Metadata,
    quant: MlxQuantConfig,
    tensors: Vec<TensorInfo>,
    parts: Vec<Vec<PartLocation>>,
    index: TensorIndex,
}

impl MlxBackend {
    /// Open the MLX checkpoint in `dir`, naming its tensors under `naming`.
    pub fn open(dir: &Path, naming: &HfNaming) -> Result<MlxBackend> {
        let config = read_config(dir)?;
        let quant = MlxQuantConfig::from_config(&config).ok_or_else(|| FormatError::Metadata {
            key: "quantization".into(),
            what: format!(
                "{}: config.json has no quantization {{group_size, bits}}",
                dir.display()
            ),
        })?;
        if let Some((module, mode)) = MlxQuantConfig::unsupported_mode(&config) {
            let scope = if module.is_empty() {
                String::new()
            } else {
                format!(" (module {module})")
            };
            return Err(FormatError::Metadata {
                key: "quantization.mode".into(),
                what: format!(
                    "{}: quantization mode {mode:?}{scope} is not supported; \
                     MLX checkpoints are read in mode \"affine\" (scales and biases)",
                    dir.display()
                ),
            });
        }
        let shards = list_shards(dir)?;

        // Map and parse every shard.
        let mut maps = Vec::with_capacity(shards.files.len());
        let mut metadata = Metadata::new();
        let mut raw: Vec<TensorInfo> = Vec::new();
        for (file_index, path) in shards.files.iter().enumerate() {
            let map = MappedFile::open(path)?;
            let header = parse_header(path, map.bytes())?;
            for (k, v) in header.metadata.iter() {
                if !metadata.contains(k) {
                    metadata.push(k, v.clone());
                }
            }
            for mut info in header.tensors {
                info.file_index = file_index;
                raw.push(info);
            }
            maps.push(map);
        }
        let (mut tensors, parts) = group_quantized(dir, &raw, &quant)?;

        // Canonical names, then per-file extent checks of every byte range.
        for t in tensors.iter_mut() {
            if let Some(name) = canonical_hf_name(&t.original_name, naming) {
                t.name = name;
            }
        }
        dedupe_canonical_names(&mut tensors);
        for (file_index, path) in shards.files.iter().enumerate() {
            let in_file: Vec<TensorInfo> = raw
                .iter()
                .filter(|t| t.file_index == file_index)
                .cloned()
                .collect();
            check_extents(path, &in_file, maps[file_index].len())?;
        }
        let index = TensorIndex::new(&tensors);
        Ok(MlxBackend {
            maps,
            files: shards.files,
            directory: dir.to_path_buf(),
            metadata,
            quant,
            tensors,
            parts,
            index,
        })
    }

    /// The quantization settings from `config.json`.
    pub fn quantization(&self) -> &MlxQuantConfig {
        &self.quant
    }

    fn bytes(&self, file_index: usize, offset: u64, len: u64, tensor: &str) -> Result<&[u8]> {
        self.maps
            .get(file_index)
            .and_then(|m| m.range(offset, len))
            .ok_or_else(|| FormatError::BadTensor {
                path: self.files.get(file_index).cloned().unwrap_or_default(),
                tensor: tensor.to_string(),
                what: format!(
                    "bytes {offset}..{} lie outside the file",
                    offset.saturating_add(len)
                ),
            })
    }
}

/// Fold each `X.weight` + `X.scales` + `X.biases` triple of `raw` (tensors
/// under their original names) into one logical tensor, checking shapes
/// and dtypes. Files are not touched; used by [`MlxBackend::open`] and the
/// fuzz target.
pub fn fold_quantized_tensors(
    dir: &Path,
    raw: &[TensorInfo],
    quant: &MlxQuantConfig,
) -> Result<Vec<TensorInfo>> {
    group_quantized(dir, raw, quant).map(|(tensors, _)| tensors)
}

/// [`fold_quantized_tensors`], also returning where each tensor's parts lie.
fn group_quantized(
    dir: &Path,
    raw: &[TensorInfo],
    quant: &MlxQuantConfig,
) -> Result<(Vec<TensorInfo>, Vec<Vec<PartLocation>>)> {
    let by_name: HashMap<&str, &TensorInfo> =
        raw.iter().map(|t| (t.original_name.as_str(), t)).collect();
    let is_consumed_part = |name: &str| -> bool {
        ["scales", "biases"].iter().any(|part| {
            name.strip_suffix(&format!(".{part}"))
                .is_some_and(|module| {
                    by_name.contains_key(format!("{module}.weight").as_str())
                        && by_name.contains_key(format!("{module}.scales").as_str())
                })
        })
    };
    let mut tensors = Vec::new();
    let mut parts = Vec::new();
    for t in raw {
        let name = t.original_name.as_str();
        if is_consumed_part(name) {
            continue;
        }
        let module = name.strip_suffix(".weight");
        let scales = module.and_then(|m| by_name.get(format!("{m}.scales").as_str()).copied());
        match (module, scales) {
            (Some(module), Some(scales)) => {
                let biases = by_name.get(format!("{module}.biases").as_str()).copied();
                let (info, locations) = fold_triple(dir, module, t, scales, biases, quant)?;
                tensors.push(info);
                parts.push(locations);
            }
            _ => {
                tensors.push(t.clone());
                parts.push(Vec::new());
            }
        }
    }
    Ok((tensors, parts))
}

/// Check one quantized triple and describe it as one logical tensor.
fn fold_triple(
    dir: &Path,
    module: &str,
    weight: &TensorInfo,
    scales: &TensorInfo,
    biases: Option<&TensorInfo>,
    quant: &MlxQuantConfig,
) -> Result<(TensorInfo, Vec<PartLocation>)> {
    let bad = |what: String| FormatError::BadTensor {
        path: dir.to_path_buf(),
        tensor: weight.original_name.clone(),
        what,
    };
    let q = quant
        .for_module(module)
        .ok_or_else(|| bad("has scales but config.json marks it unquantized".into()))?;
    if !MLX_BITS.contains(&q.bits) || q.group_size == 0 {
        return Err(bad(format!(
            "unsupported quantization bits={} group_size={}",
            q.bits, q.group_size
        )));
    }
    if weight.dtype != DType::U32 {
        return Err(bad(format!(
            "packed weight has dtype {}, expected U32",
            weight.dtype
        )));
    }
    let biases =
        biases.ok_or_else(|| bad(format!("has `{module}.scales` but no `{module}.biases`")))?;
    // Unpack the last axis: each u32 holds 32 / bits values.
    let (&packed, outer) = weight
        .shape
        .split_last()
        .ok_or_else(|| bad("packed weight is a scalar".into()))?;
    let unpacked = packed
        .checked_mul(32)
        .filter(|n| n % q.bits as usize == 0)
        .map(|n| n / q.bits as usize)
        .ok_or_else(|| {
            bad(format!(
                "{packed} packed words do not hold whole {}-bit values",
                q.bits
            ))
        })?;
    if unpacked % q.group_size as usize != 0 {
        return Err(bad(format!(
            "row of {unpacked} values is not a multiple of group size {}",
            q.group_size
        )));
    }
    let mut group_shape = outer.to_vec();
    group_shape.push(unpacked / q.group_size as usize);
    for part in [scales, biases] {
        if part.shape != group_shape {
            return Err(bad(format!(
                "`{}` has shape {:?}, expected {group_shape:?}",
                part.original_name, part.shape
            )));
        }
    }
    if biases.dtype != scales.dtype {
        return Err(bad(format!(
            "scales are {} but biases are {}",
            scales.dtype, biases.dtype
        )));
    }
    let mut shape = outer.to_vec();
    shape.push(unpacked);
    let info = TensorInfo {
        name: weight.original_name.clone(),
        original_name: weight.original_name.clone(),
        shape,
        dtype: DType::U32,
        quant: QuantDescriptor::MlxAffine {
            bits: q.bits,
            group_size: q.group_size,
            scale_dtype: scales.dtype,
        },
        byte_size: weight.byte_size,
        offset: weight.offset,
        file_index: weight.file_index,
    };
    let locate = |name: &'static str, t: &TensorInfo| PartLocation {
        name,
        file_index: t.file_index,
        offset: t.offset,
        byte_size: t.byte_size,
    };
    Ok((
        info,
        vec![locate("scales", scales), locate("biases", biases)],
    ))
}

impl StorageBackend for MlxBackend {
    fn check_files(&self) -> Result<()> {
        self.maps.iter().try_for_each(MappedFile::check)
    }
    fn name(&self) -> &'static str {
        "mlx"
    }
    fn supports_mmap(&self) -> bool {
        true
    }
    fn files(&self) -> &[PathBuf] {
        &self.files
    }
    fn directory(&self) -> Option<&Path> {
        Some(&self.directory)
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
        let info = &self.tensors[i];
        let data = self.bytes(
            info.file_index,
            info.offset,
            info.byte_size,
            &info.original_name,
        )?;
        let mut parts = Vec::with_capacity(self.parts[i].len());
        for p in &self.parts[i] {
            parts.push((
                p.name,
                self.bytes(p.file_index, p.offset, p.byte_size, &info.original_name)?,
            ));
        }
        Ok(TensorHandle::new(info, data, parts))
    }
    fn part_spans(&self, name: &str) -> Vec<crate::PartSpan> {
        let Some(i) = self.index.find(name) else {
            return Vec::new();
        };
        self.parts[i]
            .iter()
            .map(|p| crate::PartSpan {
                name: p.name,
                file_index: p.file_index,
                offset: p.offset,
                byte_size: p.byte_size,
            })
            .collect()
    }
    fn total_bytes(&self) -> u64 {
        let parts: u64 = self.parts.iter().flatten().map(|p| p.byte_size).sum();
        self.tensors.iter().map(|t| t.byte_size).sum::<u64>() + parts
    }
}
