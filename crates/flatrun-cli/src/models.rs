//! `flatrun list` (the models in the hub cache) and `flatrun rm`.

use crate::flags::human_bytes;
use crate::hub::{HubCache, ModelSpec, files_under, quant_of};
use anyhow::{Result, bail};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// Arguments of `flatrun list`.
#[derive(Debug, clap::Args)]
pub struct ListArgs {
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// Arguments of `flatrun rm`.
#[derive(Debug, clap::Args)]
pub struct RmArgs {
    /// `OWNER/NAME` (the whole repository) or `OWNER/NAME:QUANT` / `:FILE`.
    pub spec: String,
}

/// One model in the cache.
#[derive(Debug, serde::Serialize)]
pub struct Entry {
    /// What `--model` accepts: `OWNER/NAME[:QUANT]`.
    pub name: String,
    pub format: String,
    pub architecture: String,
    /// Tensor types with their counts, most common first.
    pub quant_mix: String,
    pub bytes: u64,
    pub path: PathBuf,
}

/// The models of every snapshot in `cache`: each GGUF (the first part of a
/// split one) and each SafeTensors / MLX directory.
pub fn entries(cache: &HubCache) -> Vec<Entry> {
    let mut out = Vec::new();
    for repo in cache.repos() {
        let Ok(snapshots) = std::fs::read_dir(cache.repo_dir(&repo).join("snapshots")) else {
            continue;
        };
        for snapshot in snapshots.filter_map(|e| e.ok()).map(|e| e.path()) {
            let files = files_under(&snapshot);
            for file in files.iter().filter(|f| f.ends_with(".gguf")) {
                if file.contains("-of-") && !file.contains("-00001-of-") {
                    continue;
                }
                let name = match quant_of(file) {
                    Some(q) => format!("{repo}:{q}"),
                    None => format!("{repo}:{file}"),
                };
                out.push(describe(name, &snapshot.join(file)));
            }
            if files.iter().any(|f| f.ends_with(".safetensors")) {
                out.push(describe(repo.clone(), &snapshot));
            }
        }
    }
    out
}

fn describe(name: String, path: &Path) -> Entry {
    match crate::inspect::inspect(path, false) {
        Ok(report) => {
            let mut mix: Vec<(&String, &usize)> = report.tensors_by_type.iter().collect();
            mix.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
            let quant_mix = mix
                .iter()
                .map(|(t, n)| format!("{t}×{n}"))
                .collect::<Vec<_>>()
                .join(" ");
            Entry {
                name,
                format: report.format,
                architecture: report.architecture.unwrap_or_else(|| "?".into()),
                quant_mix,
                bytes: crate::flags::weight_bytes(path),
                path: path.to_path_buf(),
            }
        }
        Err(e) => Entry {
            name,
            format: "unreadable".into(),
            architecture: "?".into(),
            quant_mix: format!("({})", e.root_cause()),
            bytes: crate::flags::weight_bytes(path),
            path: path.to_path_buf(),
        },
    }
}

/// Run `flatrun list`.
pub fn list(args: &ListArgs) -> Result<()> {
    let cache = HubCache::from_env();
    let entries = entries(&cache);
    if args.json {
        println!("{}", serde_json::to_string_pretty(&entries)?);
        return Ok(());
    }
    if entries.is_empty() {
        eprintln!(
            "no models in {}\nhint: fetch one with `flatrun pull OWNER/NAME:QUANT`",
            cache.root.display()
        );
        return Ok(());
    }
    let width = |f: fn(&Entry) -> usize, title: &str| {
        entries.iter().map(f).max().unwrap_or(0).max(title.len())
    };
    let (wn, wf, wa) = (
        width(|e| e.name.len(), "NAME"),
        width(|e| e.format.len(), "FORMAT"),
        width(|e| e.architecture.len(), "ARCH"),
    );
    println!(
        "{:wn$}  {:wf$}  {:wa$}  {:>10}  QUANT MIX / PATH",
        "NAME", "FORMAT", "ARCH", "SIZE"
    );
    for e in &entries {
        println!(
            "{:wn$}  {:wf$}  {:wa$}  {:>10}  {}\n{:pad$}{}",
            e.name,
            e.format,
            e.architecture,
            human_bytes(e.bytes),
            e.quant_mix,
            "",
            e.path.display(),
            pad = wn + wf + wa + 18,
        );
    }
    Ok(())
}

/// Run `flatrun rm`: remove the snapshot links `spec` names and the blobs no
/// other snapshot links to; a whole repository when no quant is given.
pub fn rm(args: &RmArgs) -> Result<()> {
    let Some(spec) = ModelSpec::parse(&args.spec) else {
        bail!(
            "`{}` is not a hub model name\nhint: write OWNER/NAME or OWNER/NAME:QUANT (see `flatrun list`)",
            args.spec
        );
    };
    let cache = HubCache::from_env();
    let dir = cache.repo_dir(&spec.repo);
    if !dir.is_dir() {
        bail!(
            "{} is not in the cache\nhint: `flatrun list` shows what is",
            spec.repo
        );
    }
    let freed = if spec.select.is_none() {
        let bytes = tree_bytes(&dir);
        std::fs::remove_dir_all(&dir)?;
        bytes
    } else {
        let path = cache.resolve(&spec, "main")?;
        let snapshot = cache.snapshot(&spec.repo, "main").unwrap_or_default();
        let selection =
            crate::hub::select(&spec.repo, &files_under(&snapshot), spec.select.as_deref())?;
        let mut blobs = BTreeSet::new();
        for file in selection.files() {
            let link = snapshot.join(file);
            if let Ok(blob) = std::fs::canonicalize(&link) {
                blobs.insert(blob);
            }
            std::fs::remove_file(&link)?;
        }
        let still_linked: BTreeSet<PathBuf> = linked_blobs(&dir);
        // Only the repository's own blobs, never a file a link leads out to.
        let own = std::fs::canonicalize(dir.join("blobs")).unwrap_or_default();
        let mut freed = 0;
        for blob in blobs
            .difference(&still_linked)
            .filter(|b| b.starts_with(&own))
        {
            freed += std::fs::metadata(blob).map(|m| m.len()).unwrap_or(0);
            std::fs::remove_file(blob)?;
        }
        eprintln!("removed {}", path.display());
        if linked_blobs(&dir).is_empty() {
            std::fs::remove_dir_all(&dir)?;
        }
        freed
    };
    eprintln!("removed {spec} ({} freed)", human_bytes(freed));
    Ok(())
}

/// The blobs the snapshots of a repository directory link to.
fn linked_blobs(dir: &Path) -> BTreeSet<PathBuf> {
    let snapshots = dir.join("snapshots");
    files_under(&snapshots)
        .iter()
        .filter_map(|f| std::fs::canonicalize(snapshots.join(f)).ok())
        .collect()
}

/// Bytes of the regular files under `dir` (links not followed).
fn tree_bytes(dir: &Path) -> u64 {
    let mut total = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(current) = stack.pop() {
        for entry in std::fs::read_dir(&current).into_iter().flatten().flatten() {
            match entry.metadata() {
                Ok(m) if m.is_dir() => stack.push(entry.path()),
                Ok(m) if m.is_file() => total += m.len(),
                _ => {}
            }
        }
    }
    total
}
