//! `flatrun pull REPO[:QUANT or :FILE]`: fetch a model from the Hugging Face
//! Hub into the hub's cache with `hf-hub`.
//!
//! `hf-hub` downloads into `blobs/ID.part`, resumes a `.part` it finds with
//! a range request, renames it to `blobs/ID` when complete and links
//! `snapshots/COMMIT/FILE` to it. Around it this command adds what the
//! crate lacks: `HF_TOKEN`, `HF_HUB_CACHE`, the check of every fetched file
//! against its hub id (sha256 for LFS files, the git blob sha1 otherwise),
//! a byte progress bar with rate and time left (final lines only when
//! stderr is not a terminal) and errors that say what to do.

use crate::flags::human_bytes;
use crate::hub::{HubCache, ModelSpec, Selection};
use crate::progress::{Progress, on_terminal};
use anyhow::{Context, Result, anyhow, bail};
use hf_hub::api::sync::{ApiBuilder, ApiError, ApiRepo};
use hf_hub::{Cache, Repo, RepoType};
use sha2::Digest;
use std::cell::RefCell;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::time::Instant;

/// Arguments of `flatrun pull`.
#[derive(Debug, clap::Args)]
pub struct PullArgs {
    /// `OWNER/NAME` (a SafeTensors / MLX repo, or a GGUF repo with one
    /// quantization), `OWNER/NAME:QUANT` (e.g. `:Q4_K_M`) or `OWNER/NAME:FILE`.
    pub spec: String,
    /// Branch, tag or commit of the repository.
    #[arg(long, default_value = "main")]
    pub revision: String,
    /// Retries (resuming where the transfer stopped) when a connection drops.
    #[arg(long, default_value_t = 3)]
    pub retries: usize,
    /// Print only the path of the model.
    #[arg(short, long)]
    pub quiet: bool,
}

/// The hub endpoint: `$HF_ENDPOINT` or huggingface.co.
fn endpoint() -> String {
    std::env::var("HF_ENDPOINT")
        .ok()
        .filter(|e| !e.is_empty())
        .map(|e| e.trim_end_matches('/').to_string())
        .unwrap_or_else(|| "https://huggingface.co".to_string())
}

/// Run `flatrun pull`: print where the model is (stdout), progress and
/// what was fetched (stderr).
pub fn run(args: &PullArgs) -> Result<()> {
    let spec = ModelSpec::parse(&args.spec).ok_or_else(|| {
        anyhow!(
            "`{}` is not a hub model name\nhint: write OWNER/NAME, OWNER/NAME:QUANT or OWNER/NAME:FILE (e.g. Qwen/Qwen2.5-0.5B-Instruct-GGUF:Q4_K_M)",
            args.spec
        )
    })?;
    let cache = HubCache::from_env();
    let endpoint = endpoint();
    let mut builder = ApiBuilder::from_cache(Cache::new(cache.root.clone()))
        .with_endpoint(endpoint.clone())
        .with_retries(args.retries)
        .with_progress(false)
        .with_user_agent("flatrun", env!("CARGO_PKG_VERSION"));
    if let Some(token) = std::env::var("HF_TOKEN").ok().filter(|t| !t.is_empty()) {
        builder = builder.with_token(Some(token));
    }
    let api = builder
        .build()
        .map_err(|e| anyhow!("cannot set up the hub client: {e}"))?;
    let repo = api.repo(Repo::with_revision(
        spec.repo.clone(),
        RepoType::Model,
        args.revision.clone(),
    ));
    let info = match repo.info() {
        Ok(info) => info,
        Err(e) => {
            let error = hub_error(e, &spec, &endpoint);
            // Offline with the model already here: say so and use it.
            if let Ok(path) = cache.resolve(&spec, &args.revision) {
                eprintln!("warning: {error:#}; using the cached copy");
                println!("{}", path.display());
                return Ok(());
            }
            return Err(error);
        }
    };
    // Names from the hub become paths here: nothing may climb out.
    let safe = |name: &str| !name.split('/').any(|p| p == ".." || p.is_empty());
    if info.sha.is_empty() || !info.sha.chars().all(|c| c.is_ascii_alphanumeric()) {
        bail!("the hub answered a malformed commit id for {}", spec.repo);
    }
    let files: Vec<String> = info
        .siblings
        .iter()
        .map(|s| s.rfilename.clone())
        .filter(|name| safe(name))
        .collect();
    let selection = crate::hub::select(&spec.repo, &files, spec.select.as_deref())?;
    let show = on_terminal(args.quiet);
    let mut fetched = 0u64;
    let started = Instant::now();
    for file in selection.files() {
        let cached = cache
            .repo_dir(&spec.repo)
            .join("snapshots")
            .join(&info.sha)
            .join(file);
        if cached.exists() {
            if !args.quiet {
                eprintln!("{file}: already in the cache");
            }
            continue;
        }
        let path =
            download(&repo, file, show, args.quiet).map_err(|e| hub_error(e, &spec, &endpoint))?;
        verify(&path, file)?;
        fetched += std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
    }
    // The revision now points at the commit the files came from (hf-hub
    // writes it only when it downloads something).
    let refs = cache.repo_dir(&spec.repo).join("refs");
    std::fs::create_dir_all(&refs)
        .and_then(|()| std::fs::write(refs.join(&args.revision), &info.sha))
        .with_context(|| format!("cannot write the revision under {}", refs.display()))?;
    let snapshot = cache.repo_dir(&spec.repo).join("snapshots").join(&info.sha);
    let model = match &selection {
        Selection::Gguf(parts) => snapshot.join(&parts[0]),
        Selection::Directory(_) => snapshot,
    };
    if !args.quiet {
        let seconds = started.elapsed().as_secs_f64();
        eprintln!(
            "pulled {spec} ({} file(s), {} fetched in {seconds:.1} s); run it with `flatrun run --model {spec}`",
            selection.files().len(),
            human_bytes(fetched),
        );
    }
    println!("{}", model.display());
    Ok(())
}

/// What the transfer of one file got to, shared with its progress hook.
#[derive(Default)]
struct Transfer {
    size: u64,
    done: u64,
    resumed_at: Option<u64>,
    offset_pending: bool,
    bar: Option<Progress>,
}

/// hf-hub's progress hook over a [`Progress`] bar.
#[derive(Clone)]
struct Hook {
    state: Rc<RefCell<Transfer>>,
    show: bool,
    label: String,
}

impl hf_hub::api::Progress for Hook {
    fn init(&mut self, size: usize, _filename: &str) {
        let mut state = self.state.borrow_mut();
        state.size = size as u64;
        state.done = 0;
        state.offset_pending = true;
        // hf-hub calls this again before each (re)try: keep one bar.
        if state.bar.is_none() {
            state.bar = Some(Progress::bytes(self.show, size as u64, &self.label));
        }
    }

    fn update(&mut self, size: usize) {
        let mut state = self.state.borrow_mut();
        state.done += size as u64;
        // hf-hub reports the bytes already in the `.part` first.
        let offset = std::mem::take(&mut state.offset_pending);
        if offset && size > 0 && state.resumed_at.is_none() {
            state.resumed_at = Some(size as u64);
        }
        if let Some(bar) = &state.bar {
            bar.set(state.done);
            if offset {
                bar.restart_rate();
            }
        }
    }

    fn finish(&mut self) {
        if let Some(bar) = &self.state.borrow().bar {
            bar.finish();
        }
    }
}

/// Download `file` with a progress bar, then print its final line.
fn download(repo: &ApiRepo, file: &str, show: bool, quiet: bool) -> Result<PathBuf, ApiError> {
    let state = Rc::new(RefCell::new(Transfer::default()));
    let hook = Hook {
        state: state.clone(),
        show,
        label: file.to_string(),
    };
    let started = Instant::now();
    let result = repo.download_with_progress(file, hook);
    let state = state.borrow();
    if !quiet {
        let seconds = started.elapsed().as_secs_f64().max(1e-3);
        let resumed = state.resumed_at.unwrap_or(0).min(state.done);
        let moved = state.done - resumed;
        let resumed_note = match state.resumed_at {
            Some(at) if at > 0 && result.is_ok() && at < state.size => {
                format!(", resumed at {}", human_bytes(at))
            }
            _ => String::new(),
        };
        let status = if result.is_ok() { "" } else { " (stopped)" };
        eprintln!(
            "{file}: {} of {}{status} in {seconds:.1} s, {}/s{resumed_note}",
            human_bytes(state.done),
            human_bytes(state.size),
            human_bytes((moved as f64 / seconds) as u64),
        );
    }
    result
}

/// Check the downloaded `file` (a snapshot link to its blob) against the
/// id its blob is named by; remove it when it does not match.
fn verify(path: &Path, file: &str) -> Result<()> {
    let blob =
        std::fs::canonicalize(path).with_context(|| format!("cannot follow {}", path.display()))?;
    let id = blob
        .file_name()
        .map(|n| n.to_string_lossy().to_ascii_lowercase())
        .unwrap_or_default();
    let actual = match id.len() {
        64 => digest::<sha2::Sha256>(&blob, None)?,
        40 => {
            let size = std::fs::metadata(&blob)?.len();
            digest::<sha1::Sha1>(&blob, Some(format!("blob {size}\0").as_bytes()))?
        }
        // An id of another kind (not a hub file id): nothing to check against.
        _ => return Ok(()),
    };
    if actual != id {
        let _ = std::fs::remove_file(path);
        let _ = std::fs::remove_file(&blob);
        bail!(
            "{file} is corrupt: the hub says {} {id}, the download has {actual}; it was removed\nhint: run the pull again",
            if id.len() == 64 { "sha256" } else { "git sha1" }
        );
    }
    Ok(())
}

/// Hex digest of `prefix` followed by the file at `path`.
fn digest<D: Digest>(path: &Path, prefix: Option<&[u8]>) -> Result<String> {
    let mut hasher = D::new();
    if let Some(prefix) = prefix {
        hasher.update(prefix);
    }
    let mut file =
        std::fs::File::open(path).with_context(|| format!("cannot read {}", path.display()))?;
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}

/// One line (and a hint) for an hf-hub error.
fn hub_error(e: ApiError, spec: &ModelSpec, endpoint: &str) -> anyhow::Error {
    match e {
        ApiError::RequestError(error) => match *error {
            ureq::Error::Status(401 | 403 | 404, response) => {
                let url = response.get_url().to_string();
                if url.contains("/api/models/") {
                    anyhow!(
                        "repository {} not found on {endpoint}\nhint: check the name; a private or gated repository needs HF_TOKEN",
                        spec.repo
                    )
                } else {
                    anyhow!("{url} not found on the hub (status {})", response.status())
                }
            }
            ureq::Error::Status(code, response) => anyhow!(
                "the hub answered {code} {} for {}",
                response.status_text(),
                response.get_url()
            ),
            ureq::Error::Transport(transport) => anyhow!(
                "cannot reach {endpoint}: {transport}\nhint: check the network connection, or set HF_ENDPOINT to a mirror"
            ),
        },
        ApiError::IoError(io) if io.kind() == std::io::ErrorKind::StorageFull => anyhow!(
            "the disk is full: {io}\nhint: free some space and pull again; the part already fetched is kept (blobs/*.part) and the download resumes"
        ),
        ApiError::IoError(io) if io.kind() == std::io::ErrorKind::UnexpectedEof => anyhow!(
            "the connection closed before the end of the file: {io}\nhint: pull again; the download resumes where it stopped"
        ),
        ApiError::TooManyRetries(inner) => {
            let error = hub_error(*inner, spec, endpoint);
            anyhow!("{error:#} (after retrying)")
        }
        other => anyhow!("pulling {spec}: {other}"),
    }
}
