//! One way to open a checkpoint of any format: [`Checkpoint::open`] maps the
//! weights (GGUF, SafeTensors, MLX) and tells where the config, tokenizer and
//! chat template come from — the GGUF header, or the side files
//! (`config.json`, `tokenizer.json`, …) of a Hugging Face or MLX directory.
//! Hugging Face tensor names follow the naming of the family `config.json`
//! declares ([`crate::arch::Architecture::hf_naming`]).

use crate::arch::{self, Arch};
use crate::chat_template::ChatTemplate;
use crate::config::{ModelConfig, hf_model_type};
use crate::error::{ModelError, Result};
use crate::tokenizer::Tokenizer;
use flatrun_format::{HfNaming, StorageBackend};
use std::path::{Path, PathBuf};

/// An opened checkpoint: its storage backend and where its side data lives.
pub struct Checkpoint {
    path: PathBuf,
    backend: Box<dyn StorageBackend>,
    /// The directory of `config.json` and the tokenizer files; `None` for GGUF.
    side_files: Option<PathBuf>,
    gguf: bool,
}

impl std::fmt::Debug for Checkpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Checkpoint")
            .field("path", &self.path)
            .field("format", &self.backend.name())
            .field("side_files", &self.side_files)
            .finish()
    }
}

impl Checkpoint {
    /// Open `path`: a GGUF file, a SafeTensors file or directory (one file
    /// or shards), or an MLX directory.
    pub fn open(path: &Path) -> Result<Checkpoint> {
        let naming = hf_naming_near(path);
        let backend = flatrun_format::open_with(path, &naming)?;
        let gguf = backend.name() == "gguf";
        let side_files = if gguf {
            None
        } else {
            backend.directory().map(Path::to_path_buf)
        };
        Ok(Checkpoint {
            path: path.to_path_buf(),
            backend,
            side_files,
            gguf,
        })
    }

    /// The path it was opened from.
    pub fn path(&self) -> &Path {
        &self.path
    }
    /// The storage backend.
    pub fn backend(&self) -> &dyn StorageBackend {
        self.backend.as_ref()
    }
    /// The storage backend, mutably.
    pub fn backend_mut(&mut self) -> &mut dyn StorageBackend {
        self.backend.as_mut()
    }
    /// The storage backend, keeping nothing else.
    pub fn into_backend(self) -> Box<dyn StorageBackend> {
        self.backend
    }
    /// Whether config, tokenizer and template come from a GGUF header.
    pub fn is_gguf(&self) -> bool {
        self.gguf
    }
    /// The directory of `config.json` and the tokenizer files (Hugging Face
    /// and MLX checkpoints that have one).
    pub fn side_files(&self) -> Option<&Path> {
        self.side_files.as_deref()
    }

    /// The hyperparameters.
    pub fn config(&self) -> Result<ModelConfig> {
        if self.gguf {
            return ModelConfig::from_gguf(self.backend.metadata());
        }
        ModelConfig::from_hf_config_file(&self.side_dir()?.join("config.json"))
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> Result<Tokenizer> {
        if self.gguf {
            return Ok(Tokenizer::from_gguf_metadata(self.backend.metadata())?);
        }
        Ok(Tokenizer::from_hf_dir(self.side_dir()?)?)
    }

    /// The chat template: the checkpoint's own, or the built-in one of `arch`.
    pub fn chat_template(&self, arch: Arch) -> Result<ChatTemplate> {
        if self.gguf {
            return Ok(ChatTemplate::from_gguf_metadata(
                self.backend.metadata(),
                arch.name(),
            )?);
        }
        Ok(ChatTemplate::from_hf_dir(self.side_dir()?, arch.name())?)
    }

    fn side_dir(&self) -> Result<&Path> {
        self.side_files().ok_or_else(|| ModelError::ConfigFile {
            path: self.path.clone(),
            what: "no directory with a config.json next to the weights".into(),
        })
    }
}

/// The Hugging Face naming of the family the `config.json` at `path` (a
/// directory, or a weights file in one) declares; the generic naming when
/// there is none or flatrun does not know the family.
fn hf_naming_near(path: &Path) -> HfNaming {
    let dir = if path.is_dir() {
        Some(path)
    } else if path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("safetensors"))
    {
        path.parent()
    } else {
        None
    };
    let family = dir
        .and_then(|d| std::fs::read(d.join("config.json")).ok())
        .and_then(|bytes| serde_json::from_slice::<serde_json::Value>(&bytes).ok())
        .and_then(|json| {
            let (_, model_type) = hf_model_type(&json).ok()?;
            arch::architecture(model_type).ok()
        });
    family.map_or(HfNaming::GENERIC, |f| f.hf_naming())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naming_of(config: &str) -> HfNaming {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("config.json"), config).unwrap();
        hf_naming_near(dir.path())
    }

    #[test]
    fn naming_follows_the_declared_family() {
        let pre_ffn = naming_of(r#"{"model_type":"qwen2"}"#);
        assert_eq!(pre_ffn, arch::PRE_FFN_NORM_NAMING);
        let gemma =
            naming_of(r#"{"model_type":"gemma3","text_config":{"model_type":"gemma3_text"}}"#);
        assert_eq!(
            gemma.layer_stems,
            &[("post_attention_layernorm", "post_attn_norm")]
        );
        assert_eq!(naming_of(r#"{"model_type":"mamba"}"#), HfNaming::GENERIC);
        assert_eq!(naming_of("not json"), HfNaming::GENERIC);
    }
}
