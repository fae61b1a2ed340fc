//! The public entry point: [`Model::load`] opens a checkpoint, reads its
//! hyperparameters, tokenizer and chat template, and prepares a
//! [`StreamingExecutor`]; [`Session`] gives step-level access.

use crate::error::{Result, RuntimeError};
use crate::executor::{KvShift, Sequence, StepOptions, StepOutput, StreamingExecutor};
use crate::generate::{GenerateOptions, Generation, Prompt};
use crate::options::{ContextOverflow, LoadOptions, Residency};
use crate::profiler::Profiler;
use crate::residency::MemoryPlan;
use crate::speculative::{DraftProposer, DraftState, Proposal, Proposer};
use flatrun_format::StorageBackend;
use flatrun_model::chat_template::{ChatMessage, ChatTemplate};
use flatrun_model::sampling::SamplingParams;
use flatrun_model::tokenizer::Tokenizer;
use flatrun_model::{Checkpoint, Manifest, ModelConfig};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Metadata arrays longer than this (vocabularies, merges) are dropped
/// from the backend once the tokenizer is built.
const METADATA_ARRAY_KEEP: usize = 4096;

/// A loaded model.
pub struct Model {
    path: PathBuf,
    pub(crate) executor: StreamingExecutor,
    pub(crate) tokenizer: std::result::Result<Tokenizer, String>,
    template: std::result::Result<ChatTemplate, String>,
    /// A smaller model with the same vocabulary, for speculative decoding.
    pub(crate) draft: Option<Box<Model>>,
    memory_plan: MemoryPlan,
}

/// The residency a load with no explicit policy should use for the model at
/// `path` with the rest of `opts`: planned from the memory the process really
/// has (inside a memory cgroup, its limit less its usage; see
/// [`MemoryPlan::default_residency`]). Reads only the checkpoint's header.
pub fn default_residency(path: impl AsRef<Path>, opts: &LoadOptions) -> Result<Residency> {
    let MemoryPlanner { cfg, manifest } = MemoryPlanner::open(path)?;
    Ok(MemoryPlan::default_residency(
        &cfg,
        &manifest,
        opts,
        crate::memory::memory_headroom(),
    ))
}

/// The memory plans of one checkpoint, worked out from its header alone
/// (read once, however many plans are asked for).
pub struct MemoryPlanner {
    cfg: ModelConfig,
    manifest: Manifest,
}

impl MemoryPlanner {
    /// Reads the header of the checkpoint at `path`.
    pub fn open(path: impl AsRef<Path>) -> Result<MemoryPlanner> {
        let checkpoint = Checkpoint::open(path.as_ref())?;
        let mut cfg = checkpoint.config()?;
        let manifest = Manifest::build(&cfg, checkpoint.backend().tensors())?;
        cfg.vocab_size = manifest.vocab_size();
        Ok(MemoryPlanner { cfg, manifest })
    }

    /// The plan of a load with `opts` (what [`Model::load`] would check).
    pub fn plan(&self, opts: &LoadOptions) -> MemoryPlan {
        MemoryPlan::new(
            &self.cfg,
            &self.manifest,
            opts,
            crate::memory::memory_headroom(),
        )
    }

    /// The plan that keeps the model within `budget` bytes
    /// ([`MemoryPlan::within`]: resident, capped or streamed); load it with
    /// `plan.residency`.
    pub fn within(&self, opts: &LoadOptions, budget: u64) -> MemoryPlan {
        MemoryPlan::within(&self.cfg, &self.manifest, opts, budget)
    }
}

impl Model {
    /// Open the checkpoint at `path` (a GGUF file, a SafeTensors file or
    /// directory, or an MLX directory) with `opts`.
    pub fn load(path: impl AsRef<Path>, opts: LoadOptions) -> Result<Model> {
        let path = path.as_ref().to_path_buf();
        let mut checkpoint = Checkpoint::open(&path)?;
        let mut cfg = checkpoint.config()?;
        let tokenizer = checkpoint.tokenizer().map_err(|e| e.to_string());
        let template = checkpoint
            .chat_template(cfg.arch)
            .map_err(|e| e.to_string());
        // The tokenizer has its own tables now: drop the header's parsed
        // copies of the vocabulary (tens of MiB that would otherwise stay
        // resident, and under a memory cap leave less room for weights).
        checkpoint
            .backend_mut()
            .forget_large_metadata_arrays(METADATA_ARRAY_KEEP);
        let backend: Arc<dyn StorageBackend> = Arc::from(checkpoint.into_backend());
        let manifest = Manifest::build(&cfg, backend.tensors())?;
        cfg.vocab_size = manifest.vocab_size();
        // Refuse a plan that cannot fit before anything is read.
        let memory_plan = MemoryPlan::new(&cfg, &manifest, &opts, crate::memory::memory_headroom());
        memory_plan.check()?;
        if let Some(n) = opts.threads {
            flatrun_kernels::set_threads(n);
        }
        let kernels = flatrun_kernels::backend_with(opts.backend, opts.mlx_activations);
        let executor = StreamingExecutor::new(backend, cfg, manifest, kernels, &opts)?;
        Ok(Model {
            path,
            executor,
            tokenizer,
            template,
            draft: None,
            memory_plan,
        })
    }

    /// The memory plan the model was loaded with (checked before loading).
    pub fn memory_plan(&self) -> &MemoryPlan {
        &self.memory_plan
    }

    /// Attach `draft` as this model's draft model for speculative decoding
    /// ([`crate::Speculation::draft`]). It must share this model's tokenizer
    /// (the same bytes for every id), or this fails with
    /// [`RuntimeError::Draft`].
    pub fn set_draft(&mut self, draft: Model) -> Result<()> {
        crate::speculative::check_same_vocabulary(self.tokenizer()?, draft.tokenizer()?)?;
        self.draft = Some(Box::new(draft));
        Ok(())
    }

    /// The attached draft model.
    pub fn draft(&self) -> Option<&Model> {
        self.draft.as_deref()
    }

    /// The draft model's side of one generation (its own sequence of at
    /// most `positions` positions, and its sampler), for
    /// [`Model::draft_proposals`]. Proposals are drawn with `sampling`
    /// (greedy with [`SamplingParams::default`]: each proposal is then the
    /// draft's most likely token). Fails with [`RuntimeError::Draft`] when
    /// no draft model is attached.
    pub fn new_draft_state(
        &self,
        sampling: &SamplingParams,
        positions: usize,
    ) -> Result<DraftState> {
        let draft = self
            .draft()
            .ok_or_else(|| RuntimeError::Draft("no draft model is attached".into()))?;
        Ok(DraftState::new(draft, sampling, positions))
    }

    /// Up to `max` tokens the attached draft model proposes after `context`
    /// (every token so far, the one about to be fed included), run in
    /// `state`'s sequence, which keeps what it already evaluated of
    /// `context` and re-feeds only what changed.
    pub fn draft_proposals(
        &mut self,
        state: &mut DraftState,
        context: &[u32],
        max: usize,
    ) -> Result<Vec<u32>> {
        Ok(self.propose_with_draft(state, context, max)?.tokens)
    }

    /// [`Model::draft_proposals`] with the distribution each proposal was
    /// drawn from, cut at the first id outside this model's vocabulary.
    pub(crate) fn propose_with_draft(
        &mut self,
        state: &mut DraftState,
        context: &[u32],
        max: usize,
    ) -> Result<Proposal> {
        let draft = self
            .draft
            .as_deref_mut()
            .ok_or_else(|| RuntimeError::Draft("no draft model is attached".into()))?;
        let mut proposal = DraftProposer::new(draft, state).propose(context, max)?;
        // A draft with a larger embedding table could name ids the target has not.
        let vocab = self.executor.vocab_size();
        let valid = proposal
            .tokens
            .iter()
            .take_while(|&&t| (t as usize) < vocab)
            .count();
        proposal.tokens.truncate(valid);
        Ok(proposal)
    }

    /// Detach and return the draft model.
    pub fn take_draft(&mut self) -> Option<Model> {
        self.draft.take().map(|d| *d)
    }

    /// The checkpoint path.
    pub fn path(&self) -> &Path {
        &self.path
    }
    /// Hyperparameters.
    pub fn config(&self) -> &ModelConfig {
        self.executor.config()
    }
    /// The executor (manifest, residency plan, backend).
    pub fn executor(&self) -> &StreamingExecutor {
        &self.executor
    }
    /// The executor, mutably (to step sequences directly).
    pub fn executor_mut(&mut self) -> &mut StreamingExecutor {
        &mut self.executor
    }
    /// Timings and memory samples so far.
    pub fn profiler(&self) -> &Profiler {
        &self.executor.profiler
    }
    /// Timings, mutably (to reset between phases).
    pub fn profiler_mut(&mut self) -> &mut Profiler {
        &mut self.executor.profiler
    }
    /// The tokenizer, or why it could not be built.
    pub fn tokenizer(&self) -> Result<&Tokenizer> {
        self.tokenizer
            .as_ref()
            .map_err(|e| RuntimeError::Tokenizer(e.clone()))
    }

    /// The chat template (from the checkpoint, or the family's built-in one).
    pub fn chat_template(&self) -> Result<&ChatTemplate> {
        self.template
            .as_ref()
            .map_err(|e| RuntimeError::ChatTemplate(e.clone()))
    }

    /// Render a conversation with the chat template, ending with the
    /// assistant's turn opened when `add_generation_prompt`.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String> {
        let tok = self.tokenizer()?;
        let piece = |id: Option<u32>| {
            id.map(|i| String::from_utf8_lossy(&tok.token_to_piece(i)).into_owned())
                .unwrap_or_default()
        };
        self.chat_template()?
            .render(
                messages,
                add_generation_prompt,
                &piece(tok.bos()),
                &piece(tok.eos()),
            )
            .map_err(|e| RuntimeError::ChatTemplate(e.to_string()))
    }

    /// Tokenize `text` (BOS/EOS per the checkpoint when `add_special`;
    /// special tokens such as `<|im_start|>` are recognized).
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        self.tokenizer()?
            .encode(text, add_special, true)
            .map_err(|e| RuntimeError::Tokenizer(e.to_string()))
    }

    /// Render `messages` (ending with the assistant's turn opened) and
    /// tokenize them so that at most `room` tokens remain; returns the kept
    /// messages, their tokens and how many messages were dropped. With
    /// [`ContextOverflow::TruncateMiddle`], the oldest messages that are not
    /// system messages are dropped first (never the last one); with
    /// [`ContextOverflow::Error`], or when even the system messages and the
    /// last message do not fit, a [`RuntimeError::ContextOverflow`].
    pub fn fit_conversation(
        &self,
        messages: &[ChatMessage],
        room: usize,
        policy: ContextOverflow,
    ) -> Result<(Vec<ChatMessage>, Vec<u32>, usize)> {
        let mut kept = messages.to_vec();
        loop {
            let tokens = self.encode(&self.apply_chat_template(&kept, true)?, true)?;
            if tokens.len() <= room {
                let dropped = messages.len() - kept.len();
                return Ok((kept, tokens, dropped));
            }
            let droppable = kept
                .iter()
                .take(kept.len().saturating_sub(1))
                .position(|m| m.role != "system");
            match (policy, droppable) {
                (ContextOverflow::TruncateMiddle, Some(i)) => {
                    kept.remove(i);
                }
                _ => {
                    return Err(RuntimeError::ContextOverflow {
                        used: 0,
                        new: tokens.len(),
                        capacity: room,
                    });
                }
            }
        }
    }

    /// Detokenize `ids`.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.tokenizer()?
            .decode(ids, false)
            .map_err(|e| RuntimeError::Tokenizer(e.to_string()))
    }

    /// A new, empty sequence.
    pub fn new_sequence(&self) -> Sequence {
        self.executor.new_sequence()
    }

    /// Context shift of `seq`: keep its first `keep` tokens, drop the
    /// `dropped` after them and move the rest down, re-rotating their cached
    /// keys ([`StreamingExecutor::shift_sequence`]). [`KvShift::Recompute`]
    /// when this model or sequence cannot (`seq` is then unchanged);
    /// [`RuntimeError::Shift`] when `keep + dropped` exceeds its length.
    pub fn shift(&self, seq: &mut Sequence, keep: usize, dropped: usize) -> Result<KvShift> {
        self.executor.shift_sequence(seq, keep, dropped)
    }

    /// Step-level access with a fresh sequence.
    pub fn session(&mut self) -> Session<'_> {
        let seq = self.executor.new_sequence();
        Session { model: self, seq }
    }

    /// Generate from a prompt (text, tokenized with BOS as the checkpoint
    /// wants, or token ids) as a stream of [`crate::TokenEvent`]s.
    pub fn generate(
        &mut self,
        prompt: impl Into<Prompt>,
        opts: GenerateOptions,
    ) -> Result<Generation<'_>> {
        let tokens = match prompt.into() {
            Prompt::Text(text) => self.encode(&text, true)?,
            Prompt::Tokens(ids) => ids,
        };
        let seq = self.executor.new_sequence();
        Generation::new(self, seq, tokens, opts)
    }

    /// Generate by continuing `seq` (which may already hold a cached prefix,
    /// e.g. the earlier turns of a chat): `tokens` are fed first. Take the
    /// sequence back with [`Generation::into_sequence`] to continue it later.
    pub fn generate_in(
        &mut self,
        seq: Sequence,
        tokens: Vec<u32>,
        opts: GenerateOptions,
    ) -> Result<Generation<'_>> {
        Generation::new(self, seq, tokens, opts)
    }
}

/// One sequence over a model: feed tokens, read logits.
pub struct Session<'m> {
    model: &'m mut Model,
    seq: Sequence,
}

impl Session<'_> {
    /// Run `tokens` and return the logits of the last position.
    pub fn step(&mut self, tokens: &[u32]) -> Result<Vec<f32>> {
        Ok(self
            .model
            .executor
            .step(&mut self.seq, tokens, StepOptions::default())?
            .logits)
    }
    /// Run `tokens` and return what `opts` asks for.
    pub fn step_with(&mut self, tokens: &[u32], opts: StepOptions) -> Result<StepOutput> {
        self.model.executor.step(&mut self.seq, tokens, opts)
    }
    /// The sequence so far.
    pub fn sequence(&self) -> &Sequence {
        &self.seq
    }
    /// Rewind to `len` tokens.
    pub fn truncate(&mut self, len: usize) {
        self.seq.truncate(len);
    }
    /// The model.
    pub fn model(&self) -> &Model {
        self.model
    }
}
