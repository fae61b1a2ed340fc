//! `flatrun serve`: bind the HTTP server at once, load the first model in
//! the background, then serve: the first `--model` answers requests that
//! name no model (or its own name), every other one (more `--model`s, the
//! checkpoints in `--models-dir`) requests naming it (its file or
//! directory name, as `/v1/models` lists it). The others load on their
//! first request, all with the same engine flags; with `--max-resident`
//! each gets the residency that fits what the budget has left
//! ([`flatrun_server::models`]).
//!
//! The HTTP layer and the runtime's [`flatrun_server::BatchModel`] are both
//! in `flatrun-server` ([`flatrun_server::runtime::engine`]); this module
//! only turns the command line into their settings and reports progress.

use crate::flags::{EngineFlags, OutputFlags, SamplingFlags, SpeculationFlags, residency_name};
use crate::loading::{check_model_path, header, load_with};
use anyhow::{Context, Result, anyhow, bail};
use flatrun_runtime::{LoadOptions, Residency};
use flatrun_server::{
    Engine, Footprint, LoadedModel, ModelLoader, SchedulerConfig, ServeArgs, api_default_sampling,
};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Arguments of `flatrun serve`.
#[derive(Debug, clap::Args)]
pub struct ServeCommand {
    /// Checkpoint: a GGUF file, a SafeTensors / MLX directory, or a pulled
    /// `OWNER/NAME[:QUANT]` from the hub cache.
    /// Repeat to serve several models: each request picks one by its
    /// `model` field; the first also answers requests naming none.
    #[arg(long, short, value_parser = crate::hub::model_arg, required_unless_present = "models_dir")]
    pub model: Vec<PathBuf>,
    /// Also serve every checkpoint in this directory (`*.gguf` files and
    /// directories with a `config.json`), in name order.
    #[arg(long, value_name = "DIR")]
    pub models_dir: Option<PathBuf>,
    #[command(flatten)]
    pub server: ServeArgs,
    #[command(flatten)]
    pub engine: EngineFlags,
    #[command(flatten)]
    pub sampling: SamplingFlags,
    /// Speculative decoding for every request that does not turn it off
    /// (`speculative.n_max: 0`); `--draft` drafts for the first `--model`.
    #[command(flatten)]
    pub speculation: SpeculationFlags,
    #[command(flatten)]
    pub output: OutputFlags,
}

/// Run `flatrun serve`. `explicit_sampling` names the sampling flags given on
/// the command line: only those override the APIs' own defaults.
pub fn run(cmd: ServeCommand, explicit_sampling: &[&str]) -> Result<()> {
    let mut paths = cmd.model.clone();
    if let Some(dir) = &cmd.models_dir {
        paths.extend(checkpoints_in(dir)?);
    }
    let Some((first, others)) = paths.split_first() else {
        bail!(
            "no model to serve\nhint: pass --model, or a --models-dir holding .gguf files or checkpoint directories"
        );
    };
    for path in &paths {
        check_model_path(path)?;
    }
    let mut names = vec![served_name(first)];
    for path in others {
        let name = served_name(path);
        if names.contains(&name) {
            bail!(
                "two models would both be served as `{name}`\nhint: rename one file or directory"
            );
        }
        names.push(name);
    }
    if cmd.server.max_resident.is_some() && !cmd.engine.residency.is_empty() {
        bail!(
            "--max-resident chooses each model's residency itself\nhint: drop --residency, or drop --max-resident"
        );
    }
    let flags = cmd.sampling.params()?;
    let mut sampling = api_default_sampling();
    if explicit_sampling.contains(&"temperature") {
        sampling.temperature = flags.temperature;
    }
    if explicit_sampling.contains(&"top_p") {
        sampling.top_p = flags.top_p;
    }
    if explicit_sampling.contains(&"top_k") {
        sampling.top_k = flags.top_k;
    }
    sampling.seed = flags.seed;
    let config = cmd.server.server_config(sampling);
    let mut scheduler = cmd.server.scheduler_config();
    scheduler.speculation = cmd.speculation.speculation()?;
    let mut engine_flags = cmd.engine.clone();
    if cmd.server.max_resident.is_some() {
        // Each load's residency comes from the budget; naming one here
        // keeps the flags from planning another from the free memory
        // (a header read per load).
        engine_flags.residency = vec!["stream".into()];
    }
    let loaders: Vec<(String, Arc<dyn ModelLoader>)> = paths
        .iter()
        .zip(names)
        .enumerate()
        .map(|(i, (path, name))| {
            let loader: Arc<dyn ModelLoader> = Arc::new(CheckpointLoader {
                path: path.clone(),
                flags: engine_flags.clone(),
                scheduler: scheduler.clone(),
                speculation: (i == 0).then(|| cmd.speculation.clone()),
                quiet: cmd.output.quiet,
            });
            (name, loader)
        })
        .collect();
    let first_path = paths[0].clone();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let address = format!("{}:{}", config.host, config.port);
    runtime.block_on(async move {
        let server = flatrun_server::Server::bind(config).await.map_err(|e| {
            anyhow!("{e}\nhint: pick another --port (0 = any free port) or stop the other server")
        })?;
        let bound = server.local_addr().map_err(|e| anyhow!("{e}"))?;
        // Tests read this line to learn the port.
        eprintln!(
            "listening on http://{bound} (loading {})",
            first_path.display()
        );
        let models = server.models();
        let mut loaders = loaders.into_iter();
        if let Some((name, loader)) = loaders.next() {
            models.set_default_loader(&name, loader);
        }
        for (name, loader) in loaders {
            models.add_loader(&name, loader);
        }
        // The first model loads now (`/health` is 503 until it is ready);
        // a failure stops the server.
        let (failed_tx, failed_rx) = tokio::sync::oneshot::channel::<String>();
        let first = models.clone();
        tokio::spawn(async move {
            if let Err(e) = first.acquire(0).await {
                let _ = failed_tx.send(format!("{}: {e}", first_path.display()));
            }
        });
        let (error_tx, mut error_rx) = tokio::sync::oneshot::channel::<String>();
        let stop = async move {
            tokio::select! {
                _ = flatrun_server::shutdown_signal() => {}
                failed = failed_rx => match failed {
                    Ok(message) => { let _ = error_tx.send(message); }
                    Err(_) => flatrun_server::shutdown_signal().await,
                },
            }
        };
        server
            .run_until(stop)
            .await
            .map_err(|e| anyhow!("serving on {address}: {e}"))?;
        if let Ok(message) = error_rx.try_recv() {
            return Err(anyhow!(message));
        }
        eprintln!("server stopped");
        Ok(())
    })
}

/// Loads one checkpoint with the engine flags, within the budget the
/// server gives it.
struct CheckpointLoader {
    path: PathBuf,
    flags: EngineFlags,
    scheduler: SchedulerConfig,
    /// The `--draft` to attach (the first model only).
    speculation: Option<SpeculationFlags>,
    quiet: bool,
}

impl CheckpointLoader {
    fn options(&self) -> Result<LoadOptions, String> {
        self.flags
            .load_options(&self.path)
            .map_err(|e| format!("{e:#}"))
    }

    fn planner(&self) -> Result<flatrun_runtime::MemoryPlanner, String> {
        flatrun_runtime::MemoryPlanner::open(&self.path)
            .map_err(|e| format!("cannot plan {}: {e}", self.path.display()))
    }
}

impl ModelLoader for CheckpointLoader {
    fn footprint(&self) -> Result<Footprint, String> {
        let options = self.options()?;
        let planner = self.planner()?;
        let peak = |residency| {
            planner
                .plan(&LoadOptions {
                    residency,
                    ..options.clone()
                })
                .peak_bytes
        };
        Ok(Footprint {
            resident: peak(Residency::Resident),
            least: peak(Residency::Stream),
        })
    }

    fn load(&self, budget: Option<u64>) -> Result<LoadedModel, String> {
        let mut options = self.options()?;
        if let Some(budget) = budget {
            options.residency = self.planner()?.within(&options, budget).residency;
        }
        let result = load_with(&self.path, options, true).and_then(|mut loaded| {
            if !self.quiet {
                eprintln!("{}", header(&loaded));
            }
            if let Some(speculation) = &self.speculation {
                speculation.attach_draft(&mut loaded.model, &self.flags, self.quiet)?;
            }
            let residency = residency_name(loaded.options.residency);
            let memory_bytes = loaded.model.memory_plan().peak_bytes;
            let engine: Arc<dyn Engine> = Arc::new(flatrun_server::runtime::engine(
                loaded.model,
                self.scheduler.clone(),
            )?);
            eprintln!(
                "ready: model `{}`, residency {residency}",
                engine.model_name()
            );
            Ok(LoadedModel {
                engine,
                memory_bytes,
                residency,
            })
        });
        result.map_err(|e| format!("{e:#}"))
    }

    fn unloaded(&self, why: &str) {
        eprintln!("unloaded: model `{}` ({why})", served_name(&self.path));
    }
}

/// The name a model is served under: its file name without `.gguf`, or its
/// directory name, as the runtime names it.
fn served_name(path: &Path) -> String {
    path.file_name()
        .map(|n| n.to_string_lossy().trim_end_matches(".gguf").to_string())
        .unwrap_or_else(|| path.display().to_string())
}

/// The checkpoints in `dir`: `*.gguf` files and directories holding a
/// `config.json`, by name.
fn checkpoints_in(dir: &Path) -> Result<Vec<PathBuf>> {
    let entries = std::fs::read_dir(dir)
        .with_context(|| format!("cannot read --models-dir {}", dir.display()))?;
    let mut found: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.extension()
                .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
                && p.is_file()
                || p.join("config.json").is_file()
        })
        .collect();
    found.sort();
    if found.is_empty() {
        bail!(
            "--models-dir {} holds no .gguf file or checkpoint directory",
            dir.display()
        );
    }
    Ok(found)
}
