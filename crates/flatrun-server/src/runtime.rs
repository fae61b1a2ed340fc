//! The Flatrun runtime behind the server (feature `runtime`, on by default).
//!
//! [`RuntimeBatchModel`] implements [`BatchModel`] over a loaded
//! [`Model`] with [`StreamingExecutor::step_batch`], so every active
//! sequence shares one pass through the layers per step (in streaming mode
//! each layer is read once for the whole batch). [`RuntimeText`] is the text
//! side ([`TextModel`]: tokenizer, chat template), a clone of the model's
//! tokenizer and template shared with the HTTP handlers. [`engine`] puts the
//! two under a [`BatchEngine`].
//!
//! ```no_run
//! use std::sync::Arc;
//! use flatrun_runtime::{LoadOptions, Model};
//! use flatrun_server::{SchedulerConfig, Server, ServerConfig};
//!
//! # async fn serve() -> Result<(), Box<dyn std::error::Error>> {
//! let model = Model::load("SmolLM2-135M-Instruct.Q4_1.gguf", LoadOptions::default())?;
//! let engine = flatrun_server::runtime::engine(model, SchedulerConfig::default())?;
//! let server = Server::bind(ServerConfig::default()).await?;
//! server.engine_slot().set(Arc::new(engine));
//! server.run_until(flatrun_server::shutdown_signal()).await?;
//! # Ok(())
//! # }
//! ```
//!
//! [`StreamingExecutor::step_batch`]: flatrun_runtime::StreamingExecutor::step_batch

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

use flatrun_model::chat_template::tools::ToolSyntax;
use flatrun_model::chat_template::{ChatMessage, ChatTemplate};
use flatrun_model::sampling::{TokenLogprobs, Vocabulary};
use flatrun_model::tokenizer::StreamDecoder;
use flatrun_runtime::{
    DraftState, KvShift, Model, RuntimeError, SamplingParams, Sequence, SequenceCheckpoint,
    StepOptions, Tokenizer,
};

use crate::batch_model::{
    BatchModel, ModelError, Residency, SeqId, Shifted, StepInput, TextModel, TokenTextStream,
};
use crate::scheduler::{BatchEngine, SchedulerConfig};

/// Why [`engine`] could not start.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeEngineError {
    /// The model has no usable tokenizer.
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
    /// The scheduler thread could not be spawned.
    #[error(transparent)]
    Spawn(#[from] std::io::Error),
}

/// The text side of a loaded model: tokenizer and chat template.
#[derive(Clone)]
pub struct RuntimeText {
    name: String,
    context_length: usize,
    tokenizer: Tokenizer,
    template: Option<ChatTemplate>,
    /// Every token's bytes, made on first use (grammars).
    vocabulary: Arc<OnceLock<Arc<Vocabulary>>>,
}

impl RuntimeText {
    /// The tokenizer and chat template of `model`, served under the name of
    /// its checkpoint (the file name without `.gguf`). A model without a chat
    /// template still serves completions; chat requests then fail.
    pub fn new(model: &Model) -> Result<RuntimeText, RuntimeError> {
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
            vocabulary: Arc::default(),
        })
    }

    /// The text of a special token (BOS, EOS) for the template; empty when
    /// the model has none.
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
        template
            .render(
                messages,
                true,
                &self.piece(self.tokenizer.bos()),
                &self.piece(self.tokenizer.eos()),
            )
            .map_err(|e| ModelError(e.to_string()))
    }

    fn render_chat_tools(
        &self,
        messages: &[ChatMessage],
        tools: &serde_json::Value,
    ) -> Option<Result<String, ModelError>> {
        let template = self.template.as_ref()?;
        template.tool_syntax()?;
        Some(
            template
                .render_with_tools(
                    messages,
                    tools,
                    true,
                    &self.piece(self.tokenizer.bos()),
                    &self.piece(self.tokenizer.eos()),
                )
                .map_err(|e| ModelError(e.to_string())),
        )
    }

    fn tool_syntax(&self) -> Option<ToolSyntax> {
        self.template.as_ref()?.tool_syntax()
    }

    fn vocab_size(&self) -> Option<usize> {
        Some(self.tokenizer.vocab_size())
    }

    fn vocabulary(&self) -> Option<Arc<Vocabulary>> {
        Some(
            self.vocabulary
                .get_or_init(|| {
                    let tokens = (0..self.tokenizer.vocab_size() as u32)
                        .map(|id| {
                            let piece = self.tokenizer.token_to_piece(id);
                            if self.tokenizer.is_special(id) {
                                [&[Vocabulary::SPECIAL][..], &piece].concat()
                            } else {
                                piece
                            }
                        })
                        .collect();
                    let eos = self
                        .tokenizer
                        .stop_ids()
                        .first()
                        .copied()
                        .or(self.tokenizer.eos())
                        .unwrap_or(0);
                    Arc::new(Vocabulary { tokens, eos })
                })
                .clone(),
        )
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
    /// The draft model's sequences (speculation with `--draft`), one per
    /// sequence that asked for proposals.
    drafts: HashMap<SeqId, DraftState>,
    /// Hybrid sequences as they were before a verification pass (their
    /// recurrent state, and the tokens the pass fed), to go back to.
    checkpoints: HashMap<SeqId, (SequenceCheckpoint, Vec<u32>)>,
    next_id: u64,
}

impl RuntimeBatchModel {
    pub fn new(model: Model) -> RuntimeBatchModel {
        RuntimeBatchModel {
            model,
            sequences: HashMap::new(),
            drafts: HashMap::new(),
            checkpoints: HashMap::new(),
            next_id: 0,
        }
    }

    /// Runs one pass over the batch's sequences: `verify` gives every
    /// position the logits of a one-token step and returns them all.
    fn pass(&mut self, batch: &[StepInput<'_>], verify: bool) -> Result<Vec<Vec<f32>>, ModelError> {
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
        self.checkpoints.clear();
        if verify {
            for ((id, seq), input) in taken.iter().zip(batch) {
                if seq.has_recurrent_state() && input.tokens.len() > 1 {
                    self.checkpoints
                        .insert(*id, (seq.checkpoint(), input.tokens.to_vec()));
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
            let executor = self.model.executor_mut();
            if verify {
                let opts = StepOptions {
                    all_logits: true,
                    ..StepOptions::default()
                };
                executor.step_batch_verify(&mut pairs, opts)
            } else {
                executor.step_batch(&mut pairs, StepOptions::default())
            }
        };
        self.sequences.extend(taken);
        let outputs = result.map_err(|e| ModelError(e.to_string()))?;
        Ok(outputs
            .into_iter()
            .zip(batch)
            .map(|(out, input)| match out.all_logits {
                Some(all) if verify => all,
                _ if input.logits_needed => out.logits,
                _ => Vec::new(),
            })
            .collect())
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
        self.pass(batch, false)
    }

    fn speculates(&self) -> bool {
        true
    }

    fn verify(&mut self, batch: &[StepInput<'_>]) -> Result<Vec<Vec<f32>>, ModelError> {
        self.pass(batch, true)
    }

    fn truncate(&mut self, seq: SeqId, len: usize) -> Result<(), ModelError> {
        let sequence = self
            .sequences
            .get_mut(&seq)
            .ok_or_else(|| ModelError(format!("unknown sequence {seq:?}")))?;
        match self.checkpoints.remove(&seq) {
            // A recurrent state has absorbed the rejected proposals: back to
            // its checkpoint, and the kept tokens once more.
            Some((point, fed)) if len < sequence.len() && (point.position()..).contains(&len) => {
                let kept = fed[..(len - point.position()).min(fed.len())].to_vec();
                sequence.rollback(point);
                if !kept.is_empty() {
                    let opts = StepOptions {
                        no_logits: true,
                        ..StepOptions::default()
                    };
                    self.model
                        .executor_mut()
                        .step_batch_verify(&mut [(sequence, &kept[..])], opts)
                        .map_err(|e| ModelError(e.to_string()))?;
                }
            }
            _ => sequence.truncate(len),
        }
        Ok(())
    }

    fn has_draft(&self) -> bool {
        self.model.draft().is_some()
    }

    fn propose(&mut self, seq: SeqId, context: &[u32], max: usize) -> Result<Vec<u32>, ModelError> {
        // The draft's cache holds as many positions as the target's.
        let positions = self
            .sequences
            .get(&seq)
            .ok_or_else(|| ModelError(format!("unknown sequence {seq:?}")))?
            .capacity();
        let state = match self.drafts.entry(seq) {
            std::collections::hash_map::Entry::Occupied(entry) => entry.into_mut(),
            std::collections::hash_map::Entry::Vacant(entry) => entry.insert(
                self.model
                    .new_draft_state(&SamplingParams::default(), positions)
                    .map_err(|e| ModelError(e.to_string()))?,
            ),
        };
        self.model
            .draft_proposals(state, context, max)
            .map_err(|e| ModelError(e.to_string()))
    }

    fn free(&mut self, seq: SeqId) {
        self.sequences.remove(&seq);
        self.drafts.remove(&seq);
        self.checkpoints.remove(&seq);
    }

    fn reuses_prefixes(&self) -> bool {
        let cfg = self.model.config();
        !(0..cfg.n_layer).any(|il| cfg.is_recurrent(il))
    }

    fn fork(
        &mut self,
        source: SeqId,
        len: usize,
        positions: usize,
    ) -> Option<Result<SeqId, ModelError>> {
        let sequence =
            self.model
                .executor()
                .fork_sequence(self.sequences.get(&source)?, len, positions)?;
        let id = SeqId(self.next_id);
        self.next_id += 1;
        self.sequences.insert(id, sequence);
        Some(Ok(id))
    }

    fn shift(&mut self, seq: SeqId, keep: usize, dropped: usize) -> Result<Shifted, ModelError> {
        let sequence = self
            .sequences
            .get_mut(&seq)
            .ok_or_else(|| ModelError(format!("unknown sequence {seq:?}")))?;
        match self.model.shift(sequence, keep, dropped) {
            Ok(KvShift::Rotated) => Ok(Shifted::Rotated),
            Ok(KvShift::Recompute(why)) => Ok(Shifted::Recompute(why.to_string())),
            Err(e) => Err(ModelError(e.to_string())),
        }
    }

    fn kv_bytes(&self, seq: SeqId) -> u64 {
        self.sequences
            .get(&seq)
            .map_or(0, |s| (s.kv_used_bytes() + s.recurrent_bytes()) as u64)
    }

    fn embed(&mut self, inputs: &[Vec<u32>]) -> Option<Result<Vec<Vec<f32>>, ModelError>> {
        Some(
            self.model
                .embed(inputs)
                .map_err(|e| ModelError(e.to_string())),
        )
    }

    fn score(
        &mut self,
        tokens: &[u32],
        top: usize,
    ) -> Option<Result<Vec<TokenLogprobs>, ModelError>> {
        Some(
            self.model
                .score(tokens, top)
                .map_err(|e| ModelError(e.to_string())),
        )
    }

    fn residency(&self) -> Option<Residency> {
        let exec = self.model.executor();
        Some(Residency {
            resident_bytes: exec.residency().resident_bytes,
            total_bytes: exec.manifest().total_bytes(),
        })
    }
}

/// A [`BatchEngine`] over a loaded model: its scheduler thread owns the
/// model, the HTTP handlers share its [`RuntimeText`].
pub fn engine(model: Model, scheduler: SchedulerConfig) -> Result<BatchEngine, RuntimeEngineError> {
    let text: Arc<dyn TextModel> = Arc::new(RuntimeText::new(&model)?);
    Ok(BatchEngine::start(
        RuntimeBatchModel::new(model),
        text,
        scheduler,
    )?)
}
