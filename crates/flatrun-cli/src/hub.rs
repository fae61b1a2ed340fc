//! The Hugging Face Hub cache on disk and what a `REPO[:QUANT or :FILE]`
//! names in it.
//!
//! The layout is the hub's own (`huggingface_hub`, `hf-hub`):
//! `$HF_HUB_CACHE` (else `$HF_HOME/hub`, else `~/.cache/huggingface/hub`)
//! holds `models--OWNER--NAME/{blobs,snapshots/COMMIT,refs/REVISION}`, the
//! snapshot files being links to blobs named by their hub id (sha256 for
//! LFS files, the git blob sha1 otherwise). Files fetched by other tools are
//! found and reused.

use anyhow::{Result, bail};
use std::path::{Path, PathBuf};

/// A model named on the command line: `OWNER/NAME`, optionally with `:QUANT`
/// (a GGUF quantization such as `Q4_K_M`) or `:FILE` (a path in the repo).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelSpec {
    pub repo: String,
    pub select: Option<String>,
}

impl ModelSpec {
    /// Parse `OWNER/NAME[:X]`; `None` when `text` is not of that shape.
    pub fn parse(text: &str) -> Option<ModelSpec> {
        let (repo, select) = match text.split_once(':') {
            Some((repo, select)) if !select.is_empty() => (repo, Some(select.to_string())),
            Some(_) => return None,
            None => (text, None),
        };
        let (owner, name) = repo.split_once('/')?;
        let valid = |part: &str| {
            !part.is_empty()
                && !part.starts_with('.')
                && part
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        };
        (valid(owner) && valid(name)).then(|| ModelSpec {
            repo: repo.to_string(),
            select,
        })
    }
}

impl std::fmt::Display for ModelSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.select {
            Some(select) => write!(f, "{}:{select}", self.repo),
            None => f.write_str(&self.repo),
        }
    }
}

/// What a pull fetches from a repository's file list.
#[derive(Debug, PartialEq, Eq)]
pub enum Selection {
    /// One GGUF (or the parts of a split one); the model is the first file.
    Gguf(Vec<String>),
    /// A SafeTensors / MLX checkpoint: weights, config and tokenizer files;
    /// the model is the directory.
    Directory(Vec<String>),
}

impl Selection {
    pub fn files(&self) -> &[String] {
        match self {
            Selection::Gguf(files) | Selection::Directory(files) => files,
        }
    }
}

/// The quantization a GGUF file name carries (`...-Q4_K_M.gguf` → `Q4_K_M`).
pub fn quant_of(file: &str) -> Option<String> {
    let stem = file.strip_suffix(".gguf")?;
    stem.split(['/', '-', '.'])
        .rev()
        .find(|token| is_quant_token(token))
        .map(str::to_ascii_uppercase)
}

fn is_quant_token(token: &str) -> bool {
    let t = token.to_ascii_lowercase();
    matches!(t.as_str(), "f16" | "f32" | "bf16")
        || ((t.starts_with('q') || t.starts_with("iq") || t.starts_with("tq"))
            && t.trim_start_matches(['i', 't', 'q'])
                .starts_with(|c: char| c.is_ascii_digit()))
}

/// Whether a file of a SafeTensors / MLX repository is part of the checkpoint.
fn is_checkpoint_file(file: &str) -> bool {
    let name = file.rsplit('/').next().unwrap_or(file);
    name.ends_with(".safetensors")
        || name.ends_with(".json")
        || name.ends_with(".jinja")
        || name.ends_with(".tiktoken")
        || matches!(name, "tokenizer.model" | "merges.txt" | "vocab.txt")
}

/// Pick the files `select` names among a repository's `files`.
pub fn select(repo: &str, files: &[String], wanted: Option<&str>) -> Result<Selection> {
    let ggufs: Vec<&String> = files.iter().filter(|f| f.ends_with(".gguf")).collect();
    if let Some(wanted) = wanted {
        if files.iter().any(|f| f == wanted) {
            return Ok(if wanted.ends_with(".gguf") {
                Selection::Gguf(vec![wanted.to_string()])
            } else {
                Selection::Directory(vec![wanted.to_string()])
            });
        }
        let mut parts: Vec<String> = ggufs
            .iter()
            .filter(|f| quant_of(f).is_some_and(|q| q.eq_ignore_ascii_case(wanted)))
            .map(|f| f.to_string())
            .collect();
        if parts.is_empty() {
            bail!(
                "{repo} has no {wanted}\nhint: {}",
                available(repo, &ggufs, files)
            );
        }
        parts.sort();
        return Ok(Selection::Gguf(parts));
    }
    if files.iter().any(|f| f.ends_with(".safetensors")) {
        let mut wanted: Vec<String> = files
            .iter()
            .filter(|f| is_checkpoint_file(f))
            .cloned()
            .collect();
        wanted.sort();
        return Ok(Selection::Directory(wanted));
    }
    match ggufs.as_slice() {
        [one] => Ok(Selection::Gguf(vec![one.to_string()])),
        [] => bail!("{repo} holds no .gguf or .safetensors file"),
        _ => {
            let quants = quants(&ggufs);
            if quants.len() == 1 {
                return select(repo, files, Some(&quants[0]));
            }
            bail!(
                "{repo} holds several quantizations\nhint: {}",
                available(repo, &ggufs, files)
            )
        }
    }
}

/// The distinct quantizations of `ggufs`, in name order.
fn quants(ggufs: &[&String]) -> Vec<String> {
    let mut quants: Vec<String> = ggufs.iter().filter_map(|f| quant_of(f)).collect();
    quants.sort();
    quants.dedup();
    quants
}

/// "pick one of ..." for an error about `repo`.
fn available(repo: &str, ggufs: &[&String], files: &[String]) -> String {
    let quants = quants(ggufs);
    if !quants.is_empty() {
        return format!(
            "pick one of {} (e.g. `flatrun pull {repo}:{}`)",
            quants.join(", "),
            quants[0]
        );
    }
    let mut names: Vec<&str> = files.iter().map(String::as_str).collect();
    names.truncate(12);
    format!("the repository holds: {}", names.join(", "))
}

/// The hub cache directory.
#[derive(Debug, Clone)]
pub struct HubCache {
    pub root: PathBuf,
}

impl HubCache {
    /// `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `~/.cache/huggingface/hub`.
    pub fn from_env() -> HubCache {
        let var = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty());
        let root = if let Some(dir) = var("HF_HUB_CACHE") {
            PathBuf::from(dir)
        } else if let Some(home) = var("HF_HOME") {
            PathBuf::from(home).join("hub")
        } else {
            PathBuf::from(var("HOME").unwrap_or_default()).join(".cache/huggingface/hub")
        };
        HubCache { root }
    }

    /// `models--OWNER--NAME` of `repo`.
    pub fn repo_dir(&self, repo: &str) -> PathBuf {
        self.root
            .join(format!("models--{}", repo.replace('/', "--")))
    }

    /// The snapshot directory `revision` (a branch, tag or commit) points at.
    pub fn snapshot(&self, repo: &str, revision: &str) -> Option<PathBuf> {
        let dir = self.repo_dir(repo);
        let commit = std::fs::read_to_string(dir.join("refs").join(revision))
            .map(|c| c.trim().to_string())
            .unwrap_or_else(|_| revision.to_string());
        let snapshot = dir.join("snapshots").join(commit);
        snapshot.is_dir().then_some(snapshot)
    }

    /// The repositories in the cache, by name (`OWNER/NAME`).
    pub fn repos(&self) -> Vec<String> {
        let Ok(entries) = std::fs::read_dir(&self.root) else {
            return Vec::new();
        };
        let mut repos: Vec<String> = entries
            .filter_map(|e| e.ok())
            .filter_map(|e| {
                let name = e.file_name().to_string_lossy().to_string();
                let rest = name.strip_prefix("models--")?;
                let (owner, model) = rest.split_once("--")?;
                Some(format!("{owner}/{model}"))
            })
            .collect();
        repos.sort();
        repos
    }

    /// What `spec` names in the cache at `revision`: the GGUF file or the
    /// checkpoint directory.
    pub fn resolve(&self, spec: &ModelSpec, revision: &str) -> Result<PathBuf> {
        let Some(snapshot) = self.snapshot(&spec.repo, revision) else {
            bail!(
                "{} is not in the cache ({})\nhint: fetch it with `flatrun pull {spec}`",
                spec.repo,
                self.root.display()
            );
        };
        let files = files_under(&snapshot);
        Ok(match select(&spec.repo, &files, spec.select.as_deref())? {
            Selection::Gguf(parts) => snapshot.join(&parts[0]),
            Selection::Directory(_) => snapshot,
        })
    }
}

/// The files under `dir`, relative to it, with `/` separators.
pub fn files_under(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(current) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&current) else {
            continue;
        };
        for entry in entries.filter_map(|e| e.ok()) {
            let path = entry.path();
            if path.is_dir() {
                stack.push(path);
            } else if let Ok(relative) = path.strip_prefix(dir) {
                out.push(relative.to_string_lossy().replace('\\', "/"));
            }
        }
    }
    out.sort();
    out
}

/// The `--model` value parser: an existing path as given, else
/// `OWNER/NAME[:QUANT]` resolved from the hub cache, else the text as a path
/// (loading then says why it is not found: [`not_found`]).
pub fn model_arg(text: &str) -> Result<PathBuf, String> {
    let path = PathBuf::from(text);
    if path.exists() {
        return Ok(path);
    }
    Ok(ModelSpec::parse(text)
        .and_then(|spec| HubCache::from_env().resolve(&spec, "main").ok())
        .unwrap_or(path))
}

/// Why a `--model` that names no file is not in the hub cache either, when
/// it has the shape of a hub name.
pub fn not_found(text: &str) -> Option<String> {
    let spec = ModelSpec::parse(text)?;
    HubCache::from_env()
        .resolve(&spec, "main")
        .err()
        .map(|e| format!("{e:#}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn specs() {
        let spec = ModelSpec::parse("Qwen/Qwen2.5-0.5B-Instruct-GGUF:Q4_K_M").unwrap();
        assert_eq!(spec.repo, "Qwen/Qwen2.5-0.5B-Instruct-GGUF");
        assert_eq!(spec.select.as_deref(), Some("Q4_K_M"));
        assert_eq!(ModelSpec::parse("a/b").unwrap().select, None);
        assert!(ModelSpec::parse("model.gguf").is_none());
        assert!(ModelSpec::parse("./x/y").is_none());
        assert!(ModelSpec::parse("a/b/c").is_none());
        assert!(ModelSpec::parse("a/b:").is_none());
    }

    #[test]
    fn quant_names() {
        assert_eq!(
            quant_of("qwen2.5-0.5b-instruct-q4_k_m.gguf").as_deref(),
            Some("Q4_K_M")
        );
        assert_eq!(
            quant_of("SmolLM2-135M-Instruct.Q4_1.gguf").as_deref(),
            Some("Q4_1")
        );
        assert_eq!(quant_of("m-IQ4_NL.gguf").as_deref(), Some("IQ4_NL"));
        assert_eq!(
            quant_of("Q8_0/m-Q8_0-00001-of-00002.gguf").as_deref(),
            Some("Q8_0")
        );
        assert_eq!(quant_of("m-f16.gguf").as_deref(), Some("F16"));
        assert_eq!(quant_of("model.gguf"), None);
    }

    #[test]
    fn selections() {
        let files = names(&[
            "README.md",
            "m-q4_k_m.gguf",
            "m-q8_0-00001-of-00002.gguf",
            "m-q8_0-00002-of-00002.gguf",
        ]);
        assert_eq!(
            select("o/m", &files, Some("Q4_K_M")).unwrap(),
            Selection::Gguf(names(&["m-q4_k_m.gguf"]))
        );
        assert_eq!(
            select("o/m", &files, Some("q8_0")).unwrap().files().len(),
            2
        );
        let missing = format!("{:#}", select("o/m", &files, Some("Q5_K_M")).unwrap_err());
        assert!(missing.contains("has no Q5_K_M"), "{missing}");
        assert!(missing.contains("Q4_K_M, Q8_0"), "{missing}");
        let several = format!("{:#}", select("o/m", &files, None).unwrap_err());
        assert!(several.contains("several"), "{several}");
        let dir = names(&[
            ".gitattributes",
            "README.md",
            "config.json",
            "model.safetensors",
            "tokenizer.json",
        ]);
        assert_eq!(
            select("o/m", &dir, None).unwrap(),
            Selection::Directory(names(&[
                "config.json",
                "model.safetensors",
                "tokenizer.json"
            ]))
        );
    }
}
