//! `flatrun serve`: the runtime behind the HTTP server.
//!
//! The server crate's scheduler ([`BatchEngine`]) drives a [`BatchModel`];
//! this module implements it over a loaded [`Model`] with
//! [`flatrun_runtime::StreamingExecutor::step_batch`], so every active
//! sequence shares one pass through the layers per step (in streaming mode
//! each layer is read once for the whole batch). The text side
//! ([`TextModel`]: tokenizer, chat template) is a cheap clone shared with the
//! HTTP handlers. The HTTP layer itself stays in `flatrun-server`.

use crate::flags::{residency_name, EngineFlags, OutputFlags, SamplingFlags};
use crate::loading::{check_model_path, header, load};
use anyhow::{anyhow, Result};
use flatrun_model::chat_template::{ChatMessage as TemplateMessage, ChatTemplate};
use flatrun_model::tokenizer::StreamDecoder;
use flatrun_runtime::{Model, Sequence, StepOptions, Tokenizer};
use flatrun_server::engine::ChatMessage;
use flatrun_server::{
    BatchEngine, BatchModel, Engine, ModelError, Residency, SamplingParams, SeqId, ServeArgs,
    StepInput, TextModel, TokenTextStream,
};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

/// Arguments of `flatrun serve`.
#[derive(Debug, clap::Args)]
pub struct ServeCommand {
    /// Checkpoint: a GGUF file, or a SafeTensors / MLX directory.
    #[arg(long, short)]
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

/// The text side of a loaded model: tokenizer and chat template.
pub struct RuntimeText {
    name: String,
    context_length: usize,
    tokenizer: Tokenizer,
    template: Option<ChatTemplate>,
}

impl RuntimeText {
    fn new(model: &Model) -> Result<RuntimeText> {
        let name = model
            .path()
            .file_name()
            .map(|n| n.to_string_lossy().trim_end_matches(".gguf").to_string())
            .unwrap_or_else(|| "flatrun".into());
        Ok(RuntimeText {
            name,
            context_length: model.executor().context_size(),
            tokenizer: model.tokenizer()?.clone(),
            template: model.chat_template().ok().cloned(),
        })
    }

    fn piece(&self, id: Option<u32>) -> String {
        id.map(|i| String::from_utf8_lossy(&self.tokenizer.token_to_piece(i)).into_owned())
            .unwrap_or_default()
    }
}

impl TextModel for RuntimeText {
    fn model_name(&self) -> &str {
        &self.name
    }
    fn context_length(&self) -> usize {
        self.context_length
    }
    fn tokenize(&self, text: &str, add_special: bool) -> Result<Vec<u32>, ModelError> {
        self.tokenizer
            .encode(text, add_special, true)
            .map_err(|e| ModelError(e.to_string()))
    }
    fn detokenize(&self, tokens: &[u32]) -> Result<String, ModelError> {
        self.tokenizer
            .decode(tokens, false)
            .map_err(|e| ModelError(e.to_string()))
    }
    fn render_chat(&self, messages: &[ChatMessage]) -> Result<String, ModelError> {
        let template = self
            .template
            .as_ref()
            .ok_or_else(|| ModelError("this model has no chat template".into()))?;
        let messages: Vec<TemplateMessage> = messages
            .iter()
            .map(|m| TemplateMessage::new(m.role.as_str(), m.content.clone()))
            .collect();
        template
            .render(
                &messages,
                true,
                &self.piece(self.tokenizer.bos()),
                &self.piece(self.tokenizer.eos()),
            )
            .map_err(|e| ModelError(e.to_string()))
    }
    fn is_end_of_generation(&self, token: u32) -> bool {
        self.tokenizer.stop_ids().contains(&token)
    }
    fn stream_decoder(&self) -> Box<dyn TokenTextStream + '_> {
        Box::new(StreamDecoder::new(&self.tokenizer))
    }
}

/// The compute side: the model and its live sequences.
pub struct RuntimeBatchModel {
    model: Model,
    sequences: HashMap<SeqId, Sequence>,
    next_id: u64,
}

impl RuntimeBatchModel {
    pub fn new(model: Model) -> RuntimeBatchModel {
        RuntimeBatchModel {
            model,
            sequences: HashMap::new(),
            next_id: 0,
        }
    }
}

impl BatchModel for RuntimeBatchModel {
    fn new_sequence(&mut self, positions: usize) -> Result<SeqId, ModelError> {
        let id = SeqId(self.next_id);
        self.next_id += 1;
        // A KV cache for this request's positions only, not the whole context.
        let sequence = self.model.executor().new_sequence_with_capacity(positions);
        self.sequences.insert(id, sequence);
        Ok(id)
    }

    fn step(&mut self, batch: &[StepInput<'_>]) -> Result<Vec<Vec<f32>>, ModelError> {
        // Take the batch's sequences out of the map to borrow them all mutably.
        let mut taken = Vec::with_capacity(batch.len());
        for input in batch {
            match self.sequences.remove(&input.seq) {
                Some(seq) => taken.push((input.seq, seq)),
                None => {
                    self.sequences.extend(taken);
                    return Err(ModelError(format!("unknown sequence {:?}", input.seq)));
                }
            }
        }
        // One pass through the layers for every sequence of the batch.
        let result = {
            let mut pairs: Vec<(&mut Sequence, &[u32])> = taken
                .iter_mut()
                .zip(batch)
                .map(|((_, seq), input)| (seq, input.tokens))
                .collect();
            self.model
                .executor_mut()
                .step_batch(&mut pairs, StepOptions::default())
        };
        self.sequences.extend(taken);
        let outputs = result.map_err(|e| ModelError(e.to_string()))?;
        Ok(outputs
            .into_iter()
            .zip(batch)
            .map(|(out, input)| {
                if input.logits_needed {
                    out.logits
                } else {
                    Vec::new()
                }
            })
            .collect())
    }

    fn free(&mut self, seq: SeqId) {
        self.sequences.remove(&seq);
    }

    fn residency(&self) -> Option<Residency> {
        let exec = self.model.executor();
        Some(Residency {
            resident_bytes: exec.residency().resident_bytes,
            total_bytes: exec.manifest().total_bytes(),
        })
    }
}

/// Build the server's engine over a loaded model.
pub fn engine(model: Model, scheduler: flatrun_server::SchedulerConfig) -> Result<Arc<dyn Engine>> {
    let text: Arc<dyn TextModel> = Arc::new(RuntimeText::new(&model)?);
    let engine = BatchEngine::start(RuntimeBatchModel::new(model), text, scheduler)?;
    Ok(Arc::new(engine))
}

/// Run `flatrun serve`. `explicit_sampling` names the sampling flags given on
/// the command line: only those override the APIs' own defaults.
pub fn run(cmd: ServeCommand, explicit_sampling: &[&str]) -> Result<()> {
    check_model_path(&cmd.model)?;
    let flags = cmd.sampling.params()?;
    let mut sampling = SamplingParams::default();
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
                let engine = engine(loaded.model, scheduler)?;
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
