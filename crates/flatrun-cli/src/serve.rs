//! `flatrun serve`: bind the HTTP server at once, load the model in the
//! background, then serve it.
//!
//! The HTTP layer and the runtime's [`flatrun_server::BatchModel`] are both
//! in `flatrun-server` ([`flatrun_server::runtime::engine`]); this module
//! only turns the command line into their settings and reports progress.

use crate::flags::{EngineFlags, OutputFlags, SamplingFlags, residency_name};
use crate::loading::{check_model_path, header, load};
use anyhow::{Result, anyhow};
use flatrun_server::{Engine, ServeArgs, api_default_sampling};
use std::path::PathBuf;
use std::sync::Arc;

/// Arguments of `flatrun serve`.
#[derive(Debug, clap::Args)]
pub struct ServeCommand {
    /// Checkpoint: a GGUF file, a SafeTensors / MLX directory, or a pulled
    /// `OWNER/NAME[:QUANT]` from the hub cache.
    #[arg(long, short, value_parser = crate::hub::model_arg)]
    pub model: PathBuf,
    #[command(flatten)]
    pub server: ServeArgs,
    #[command(flatten)]
    pub engine: EngineFlags,
    #[command(flatten)]
    pub sampling: SamplingFlags,
    #[command(flatten)]
    pub output: OutputFlags,
}

/// Run `flatrun serve`. `explicit_sampling` names the sampling flags given on
/// the command line: only those override the APIs' own defaults.
pub fn run(cmd: ServeCommand, explicit_sampling: &[&str]) -> Result<()> {
    check_model_path(&cmd.model)?;
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
    let scheduler = cmd.server.scheduler_config();
    let quiet = cmd.output.quiet;
    let model_path = cmd.model.clone();
    let engine_flags = cmd.engine.clone();
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
            model_path.display()
        );
        let slot = server.engine_slot();
        let (failed_tx, failed_rx) = tokio::sync::oneshot::channel::<String>();
        tokio::task::spawn_blocking(move || {
            let result = load(&model_path, &engine_flags, true).and_then(|loaded| {
                if !quiet {
                    eprintln!("{}", header(&loaded));
                }
                let residency = residency_name(loaded.options.residency);
                let engine: Arc<dyn Engine> =
                    Arc::new(flatrun_server::runtime::engine(loaded.model, scheduler)?);
                eprintln!(
                    "ready: model `{}`, residency {residency}",
                    engine.model_name()
                );
                Ok(engine)
            });
            match result {
                Ok(engine) => slot.set(engine),
                Err(e) => {
                    let _ = failed_tx.send(format!("{e:#}"));
                }
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
