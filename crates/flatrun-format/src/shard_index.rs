//! Which `.safetensors` files make up a Hugging Face / MLX checkpoint
//! directory: `model.safetensors.index.json` (`weight_map`: tensor → shard
//! file), else `model.safetensors`, else every `*.safetensors` in name order.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use crate::{FormatError, Result};

/// Name of the shard index file.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// Name of the single-file checkpoint.
pub const SINGLE_FILE: &str = "model.safetensors";

/// The shards of a checkpoint directory.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ShardList {
    /// Shard files, in order.
    pub files: Vec<PathBuf>,
    /// Tensor name → index into `files`, when an index file gave one.
    pub weight_map: BTreeMap<String, usize>,
    /// The index file, when there was one.
    pub index_file: Option<PathBuf>,
}

/// Whether `dir` holds a safetensors checkpoint.
pub fn has_safetensors(dir: &Path) -> bool {
    dir.join(INDEX_FILE).is_file() || !safetensors_files(dir).is_empty()
}

/// Every `*.safetensors` file in `dir`, sorted by name.
fn safetensors_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.is_file() && p.extension().is_some_and(|e| e == "safetensors"))
                .collect()
        })
        .unwrap_or_default();
    files.sort();
    files
}

/// Find the shards of the checkpoint in `dir`.
pub fn list_shards(dir: &Path) -> Result<ShardList> {
    let index_path = dir.join(INDEX_FILE);
    if index_path.is_file() {
        return read_index(dir, &index_path);
    }
    let single = dir.join(SINGLE_FILE);
    let files = if single.is_file() {
        vec![single]
    } else {
        safetensors_files(dir)
    };
    if files.is_empty() {
        return Err(FormatError::UnknownFormat {
            path: dir.to_path_buf(),
            reason: format!("no {INDEX_FILE}, {SINGLE_FILE} or *.safetensors file"),
        });
    }
    Ok(ShardList {
        files,
        weight_map: BTreeMap::new(),
        index_file: None,
    })
}

/// Read `model.safetensors.index.json`; every shard it names must exist.
fn read_index(dir: &Path, index_path: &Path) -> Result<ShardList> {
    let invalid = |what: String| FormatError::Invalid {
        path: index_path.to_path_buf(),
        offset: 0,
        what,
    };
    let text = std::fs::read(index_path).map_err(|source| FormatError::Io {
        path: index_path.to_path_buf(),
        source,
    })?;
    let json: serde_json::Value =
        serde_json::from_slice(&text).map_err(|e| invalid(format!("not JSON: {e}")))?;
    let map = json
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| invalid("no `weight_map` object".into()))?;

    // Shard file names, validated: plain names inside `dir` only.
    let mut shard_names = BTreeSet::new();
    for (tensor, shard) in map {
        let shard = shard
            .as_str()
            .ok_or_else(|| invalid(format!("weight_map[`{tensor}`] is not a string")))?;
        let plain =
            !shard.is_empty() && !shard.contains(['/', '\\']) && shard != "." && shard != "..";
        if !plain {
            return Err(invalid(format!(
                "weight_map[`{tensor}`] names `{shard}`, which is not a file name in the directory"
            )));
        }
        shard_names.insert(shard.to_string());
    }
    let files: Vec<PathBuf> = shard_names.iter().map(|s| dir.join(s)).collect();
    for f in &files {
        if !f.is_file() {
            return Err(FormatError::MissingShard {
                index: index_path.to_path_buf(),
                shard: f.clone(),
            });
        }
    }
    let position: BTreeMap<&str, usize> = shard_names
        .iter()
        .enumerate()
        .map(|(i, s)| (s.as_str(), i))
        .collect();
    let weight_map = map
        .iter()
        .filter_map(|(t, s)| Some((t.clone(), *position.get(s.as_str()?)?)))
        .collect();
    Ok(ShardList {
        files,
        weight_map,
        index_file: Some(index_path.to_path_buf()),
    })
}
