//! The streaming executor: a step pushes the new tokens of one or more
//! sequences through the model one layer at a time.
//!
//! ```text
//! embed (only the rows of the step's tokens)
//! for each layer i (the manifest's order):
//!     acquire layer i from the weight engine      (I/O wait: kept, read, or chunk by chunk)
//!     run layer i for every token of every sequence at once
//!     release layer i (a streamed layer's buffers go back for the next reads)
//! final RMS norm
//! output head: kept rows from the mapping, streamed rows chunk by chunk → logits
//! ```

use crate::error::{Result, RuntimeError};
use crate::kv_cache::{KvBacking, KvCache, KvLayout, ShiftRefusal};
use crate::layer_range::LayerSelection;
use crate::layer_vectors::{LayerVectorStore, LayerView, split_experts};
use crate::memory;
use crate::options::{LoadOptions, Prefetch, Residency, StreamReads};
use crate::profiler::Profiler;
use crate::recurrent_state::RecurrentState;
use crate::residency::ResidencyPlan;
use crate::weights::experts::ExpertCache;
use crate::weights::kernels::{ChunkedKernels, NextRouter, scatter};
use crate::weights::plan::{Granularity, PlanInput, file_bounds, rows_from};
use crate::weights::{CachePolicy, LayerLayout, Lease, WeightEngine, WeightPlan};
use crate::weights_override::DenseLayers;
use flatrun_format::{StorageBackend, TensorHandle};
use flatrun_kernels::{Kernels, Weight, ops};
use flatrun_model::arch::{
    LayerKv, LayerMemory, LayerPlan, LayerScratch, MemoryKind, Segment, layer_tensor,
};
use flatrun_model::{Manifest, ModelConfig, Role};
use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

/// Largest chunk of a head the cap streams.
const HEAD_CHUNK_BYTES: usize = 4 << 20;

/// Bytes of one chunk of a head the cap streams: no more than the largest
/// layer (the read buffers hold a layer anyway, so head chunks cost no extra
/// memory), at least 1 MiB (fewer, larger reads).
fn capped_head_chunk_bytes(manifest: &Manifest) -> usize {
    (manifest.largest_layer_bytes() as usize).clamp(1 << 20, HEAD_CHUNK_BYTES)
}

/// One sequence: its tokens so far and its KV cache.
#[derive(Debug)]
pub struct Sequence {
    tokens: Vec<u32>,
    kv: KvCache,
    /// Delta-net states of a hybrid model (empty otherwise).
    recurrent: RecurrentState,
}

impl Sequence {
    /// Tokens evaluated so far (the next token's position is `len()`).
    pub fn len(&self) -> usize {
        self.tokens.len()
    }
    /// Whether nothing has been evaluated yet.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }
    /// Every token evaluated so far.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }
    /// Positions the KV cache can hold.
    pub fn capacity(&self) -> usize {
        self.kv.capacity()
    }
    /// Bytes of the KV cache.
    pub fn kv_bytes(&self) -> usize {
        self.kv.bytes()
    }
    /// Bytes of the KV cache's written slots (what it occupies so far).
    pub fn kv_used_bytes(&self) -> usize {
        self.kv.used_bytes()
    }
    /// Bytes of the recurrent states (hybrid models; 0 otherwise).
    pub fn recurrent_bytes(&self) -> usize {
        self.recurrent.bytes()
    }
    /// Drop every token from position `len` on (to rewind or reuse a prefix).
    /// A hybrid model's recurrent state is rebuilt from the kept tokens at
    /// the next step.
    pub fn truncate(&mut self, len: usize) {
        if len < self.tokens.len() {
            self.tokens.truncate(len);
            self.kv.truncate(len);
            self.recurrent.mark_stale();
        }
    }

    /// Whether dropping tokens costs a replay (a hybrid model's recurrent
    /// state cannot be rewound by truncation alone).
    pub fn has_recurrent_state(&self) -> bool {
        self.recurrent.is_used()
    }

    /// A point to come back to with [`Sequence::rollback`]: the length, and
    /// a copy of the recurrent state (hybrid models only; a few hundred KiB).
    pub fn checkpoint(&self) -> SequenceCheckpoint {
        SequenceCheckpoint {
            len: self.tokens.len(),
            recurrent: self.recurrent.is_used().then(|| self.recurrent.clone()),
        }
    }

    /// Back to `point`: later tokens and their KV dropped, the recurrent
    /// state as it was then (no replay needed).
    pub fn rollback(&mut self, point: SequenceCheckpoint) {
        self.tokens.truncate(point.len);
        self.kv.truncate(point.len);
        if let Some(state) = point.recurrent {
            self.recurrent = state;
        }
    }
}

/// What [`StreamingExecutor::shift_sequence`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvShift {
    /// The cache was shifted in place: the sequence goes on at position
    /// `len − dropped`.
    Rotated,
    /// Nothing changed: the caller computes the kept tokens again (a fresh
    /// or forked sequence fed them at their new positions), for this reason.
    Recompute(ShiftRefusal),
}

/// A saved point of a [`Sequence`] (see [`Sequence::checkpoint`]).
#[derive(Debug)]
pub struct SequenceCheckpoint {
    len: usize,
    recurrent: Option<RecurrentState>,
}

impl SequenceCheckpoint {
    /// Tokens the sequence held at the checkpoint.
    pub fn position(&self) -> usize {
        self.len
    }
}

/// What a step returns besides the last position's logits.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StepOptions {
    /// Logits of every position of the step, not only the last.
    pub all_logits: bool,
    /// The final-normed hidden state of the last position.
    pub hidden: bool,
    /// The final-normed hidden state of every position of the step.
    pub all_hidden: bool,
    /// Skip the output head: no logits at all (an embedding pass).
    pub no_logits: bool,
}

/// The result of a step for one sequence.
#[derive(Clone, Debug, Default)]
pub struct StepOutput {
    /// Logits of the last position (`vocab` values).
    pub logits: Vec<f32>,
    /// With [`StepOptions::all_logits`]: `n_tokens × vocab` logits.
    pub all_logits: Option<Vec<f32>>,
    /// With [`StepOptions::hidden`]: the last position's final-normed hidden state.
    pub hidden: Option<Vec<f32>>,
    /// With [`StepOptions::all_hidden`]: `n_tokens × n_embd` final-normed
    /// hidden states.
    pub all_hidden: Option<Vec<f32>>,
}

/// The matrices of each manifest layer (role, canonical name), in the
/// order the layer multiplies them.
fn layer_matrices(manifest: &Manifest) -> Vec<Vec<(Role, String)>> {
    manifest
        .layers
        .iter()
        .map(|l| {
            l.tensors
                .iter()
                .filter_map(|t| Some((t.role().filter(|r| r.is_matrix())?, t.name.clone())))
                .collect()
        })
        .collect()
}

/// The buffers of a step, kept from step to step so that a decode step
/// allocates nothing large (each grows to the largest step seen).
#[derive(Debug, Default)]
struct StepBuffers {
    /// Token ids of the stacked pieces.
    ids: Vec<u32>,
    /// Absolute position of each stacked token.
    positions: Vec<usize>,
    /// The residual stream, `n × n_embd`.
    hidden: Vec<f32>,
    /// Final-normed rows that need logits.
    normed: Vec<f32>,
    /// Logits of those rows, `rows × vocab`.
    logits: Vec<f32>,
    /// One streamed chunk of the output head's result.
    head_part: Vec<f32>,
}

/// Runs steps layer by layer over a storage backend.
pub struct StreamingExecutor {
    backend: Arc<dyn StorageBackend>,
    cfg: ModelConfig,
    manifest: Manifest,
    kernels: Arc<dyn Kernels>,
    plans: Vec<LayerPlan>,
    /// Per-layer norms and biases (kept, or read per use in stream mode).
    vectors: LayerVectorStore,
    output_norm: Vec<f32>,
    residency: ResidencyPlan,
    /// How each layer and the head reach the kernels.
    weights: WeightPlan,
    /// Every byte of weights comes through it.
    engine: WeightEngine,
    /// Routed experts kept after use (mixture-of-experts models).
    expert_cache: ExpertCache,
    /// Read the next layer's predicted experts ahead.
    expert_prefetch: bool,
    /// Unless everything is kept: per backend file, the page-aligned span of
    /// its tensors in the mapping (where pages may be released in blocks).
    mapped_bounds: Vec<Range<usize>>,
    /// Each layer's matrices (role, canonical name), in the order it
    /// multiplies them.
    matrix_names: Vec<Vec<(Role, String)>>,
    /// Buffers of a step (ids, positions, activations, logits), reused.
    buffers: StepBuffers,
    scratch: LayerScratch,
    ctx: usize,
    /// Element types and backing of new sequences' caches.
    kv_layout: KvLayout,
    max_batch: usize,
    /// The decoder layers that run (`--layers`; all by default).
    selection: LayerSelection,
    /// Dequantized matrices of the resident layers (`--weights f16|f32`).
    dense: DenseLayers,
    /// Timings and memory samples.
    pub profiler: Profiler,
}

/// Open `name` or fail naming it.
fn open<'b>(backend: &'b dyn StorageBackend, name: &str) -> Result<TensorHandle<'b>> {
    Ok(backend.tensor(name)?)
}

/// A 1-D tensor as f32 (norm weights and biases are tiny; any dtype).
fn read_vector(
    backend: &dyn StorageBackend,
    kernels: &dyn Kernels,
    name: &str,
) -> Result<Vec<f32>> {
    let h = open(backend, name)?;
    let w = Weight::from_handle(&h).map_err(|source| RuntimeError::Kernel {
        tensor: name.to_string(),
        source,
    })?;
    let mut out = vec![0.0; w.rows * w.cols];
    kernels
        .dequantize_rows(&w, 0..w.rows, &mut out)
        .map_err(|source| RuntimeError::Kernel {
            tensor: name.to_string(),
            source,
        })?;
    Ok(out)
}

fn weight<'a>(h: &TensorHandle<'a>) -> Result<Weight<'a>> {
    Weight::from_handle(h).map_err(|source| RuntimeError::Kernel {
        tensor: h.name().to_string(),
        source,
    })
}

/// The next layer's router settings a layer predicts its experts with
/// (its router matrix is a handle beside them).
struct NextParts {
    layer: usize,
    norm: Vec<f32>,
    bias: Option<Vec<f32>>,
    k: usize,
}

/// The layer a canonical tensor name belongs to (`usize::MAX` for others).
fn info_layer(info: &flatrun_format::TensorInfo) -> usize {
    flatrun_format::canonical_layer_index(&info.name).unwrap_or(usize::MAX)
}

/// How streamed weights are read. Stream mode reads through the page cache
/// unless told otherwise; a cap or a custom policy reads through it only
/// when memory is plentiful: the process's headroom
/// ([`memory::memory_headroom`]) holds the kept bytes, the streamed ones
/// twice over (page cache and a margin for what else runs) and 256 MiB.
fn read_policy(opts: &LoadOptions, plan: &ResidencyPlan, streamed_bytes: u64) -> CachePolicy {
    let keep = match (opts.stream_reads, opts.residency) {
        (StreamReads::Direct, _) => false,
        (StreamReads::PageCache, _) | (StreamReads::Auto, Residency::Stream) => true,
        (StreamReads::Auto, _) => memory::memory_headroom().is_some_and(|headroom| {
            headroom >= plan.resident_bytes + 2 * streamed_bytes + (256 << 20)
        }),
    };
    if keep {
        CachePolicy::Keep
    } else {
        CachePolicy::Bypass
    }
}

/// A handle of `h`'s tensor whose bytes (and MLX parts) come from `lease`.
fn leased<'l>(
    backend: &dyn StorageBackend,
    h: &TensorHandle<'l>,
    lease: &'l Lease,
) -> Result<TensorHandle<'l>> {
    let info = h.info();
    let missing = || RuntimeError::StreamRead {
        tensor: info.name.clone(),
        what: "not in the streamed layer".into(),
    };
    let data = lease
        .bytes(info.file_index, info.offset, h.bytes().len() as u64)
        .ok_or_else(missing)?;
    let parts = backend
        .part_spans(&info.name)
        .into_iter()
        .map(|p| {
            lease
                .bytes(p.file_index, p.offset, p.byte_size)
                .map(|bytes| (p.name, bytes))
                .ok_or_else(missing)
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(TensorHandle::new(info, data, parts))
}

impl StreamingExecutor {
    /// Prepare an executor: read the small vectors, plan residency and the
    /// weights' items, start the weight engine.
    pub fn new(
        backend: Arc<dyn StorageBackend>,
        cfg: ModelConfig,
        manifest: Manifest,
        kernels: Arc<dyn Kernels>,
        opts: &LoadOptions,
    ) -> Result<StreamingExecutor> {
        let b = backend.as_ref();
        let k = kernels.as_ref();
        let matrix_names = layer_matrices(&manifest);
        let output_norm = read_vector(b, k, &manifest.output_norm.name)?;
        let freq_factors = match &manifest.rope_freqs {
            Some(t) => Some(read_vector(b, k, &t.name)?),
            None => None,
        };
        let plans = (0..cfg.n_layer)
            .map(|i| cfg.arch.layer_plan(&cfg, i, freq_factors.as_deref()))
            .collect();
        let read_depth = match opts.prefetch {
            Prefetch::Ahead { depth } => depth,
            Prefetch::Off => 0,
        };
        let capped_chunk = capped_head_chunk_bytes(&manifest);
        let residency = ResidencyPlan::with_stream_buffers(
            opts.residency,
            &manifest,
            read_depth.max(1),
            capped_chunk as u64,
        )
        .with_expert_cache(&manifest, opts.expert_cache_bytes);
        let selection = match &opts.layers {
            Some(selection) => {
                selection.check(cfg.n_layer)?;
                selection.clone()
            }
            None => LayerSelection::all(cfg.n_layer),
        };
        let dense = DenseLayers::build(opts.weights, b, k, &matrix_names, &residency, &selection)?;
        // The weight plan: which layers are kept, how the others are
        // streamed (whole, or in row chunks of a fixed byte budget), and
        // which rows of the head are kept.
        let head_row_bytes = open(b, &manifest.output.name)
            .and_then(|h| weight(&h).map(|w| (w.rows, w.row_bytes() as u64)))?;
        let (residency, head_kept_rows) = match opts.residency {
            Residency::Resident => (residency, head_row_bytes.0),
            Residency::Stream => (residency.without_partial_head(), 0),
            Residency::Cap(_) | Residency::Custom(_) if residency.output_resident => {
                (residency, head_row_bytes.0)
            }
            Residency::Cap(_) | Residency::Custom(_) => residency.with_head_rows(head_row_bytes.1),
        };
        let (granularity, head_chunk_bytes) = match opts.residency {
            Residency::Stream => (
                Granularity::Chunks(opts.stream_chunk_bytes.max(1)),
                opts.stream_chunk_bytes.max(1),
            ),
            _ => (Granularity::Layer, capped_chunk),
        };
        let (weights, items) = WeightPlan::build(&PlanInput {
            backend: b,
            manifest: &manifest,
            skipped: &|il| !selection.runs(il) || dense.layer(il).is_some(),
            kept: &|il| residency.is_resident(il),
            split_experts: residency.split_experts,
            is_matrix: &|info| {
                matrix_names
                    .get(info_layer(info))
                    .is_some_and(|names| names.iter().any(|(_, n)| *n == info.name))
            },
            layers: granularity,
            head_kept_rows,
            head_chunk_bytes,
        })?;
        let policy = read_policy(opts, &residency, items.streamed_bytes());
        // The layers' norms and biases: kept as f32 copies, except those of
        // chunked layers, read again whenever the layer runs.
        let vectors = LayerVectorStore::load(b, k, &manifest, cfg.n_layer, |il| {
            !matches!(weights.layers.get(il), Some(LayerLayout::Chunked { .. }))
        })?;
        // Unless everything is kept, drop what loading mapped (the norms and
        // biases just copied, and the blocks the kernel faulted in around
        // them): from here on only the weights in use are mapped.
        let mapped_bounds = if opts.residency == Residency::Resident {
            Vec::new()
        } else {
            file_bounds(b)
        };
        for within in &mapped_bounds {
            // SAFETY: `within` spans the tensors of one file, all slices of
            // that file's one read-only mapping, which `backend` keeps alive.
            unsafe { memory::release_span(within) };
        }
        let engine = WeightEngine::start(
            backend.clone(),
            items.streamed,
            items.kept,
            read_depth,
            policy,
        );
        let ctx = crate::residency::context_size(&cfg, opts);
        let (keys, values) = opts.kv_types();
        let kv_layout = KvLayout {
            keys,
            values,
            // Stream and cap residency stream the cache from a file too.
            backing: match opts.residency {
                Residency::Resident => KvBacking::Anonymous,
                _ => KvBacking::File(opts.kv_file.clone()),
            },
        };
        let max_batch = opts.max_batch.max(1);
        let expert_cache = ExpertCache::new(residency.expert_cache_bytes, opts.expert_policy);
        Ok(StreamingExecutor {
            scratch: LayerScratch::new(&cfg, 1),
            profiler: Profiler::new(cfg.n_layer, opts.profile, opts.trace_memory),
            backend,
            cfg,
            manifest,
            kernels,
            plans,
            vectors,
            output_norm,
            residency,
            weights,
            engine,
            expert_cache,
            expert_prefetch: opts.expert_prefetch,
            mapped_bounds,
            matrix_names,
            buffers: StepBuffers::default(),
            ctx,
            kv_layout,
            max_batch,
            selection,
            dense,
        })
    }

    /// The hyperparameters.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }
    /// The layer manifest.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }
    /// The residency plan in force.
    pub fn residency(&self) -> &ResidencyPlan {
        &self.residency
    }
    /// Bytes of routed experts the expert cache holds now, and its budget
    /// (mixture-of-experts models; both 0 otherwise).
    pub fn expert_cache(&self) -> (u64, u64) {
        (self.expert_cache.bytes(), self.expert_cache.budget())
    }
    /// How streamed weights are read: `Some(true)` through the page cache,
    /// `Some(false)` around it (`O_DIRECT`), `None` when nothing is
    /// streamed ([`crate::StreamReads`]).
    pub fn streams_through_page_cache(&self) -> Option<bool> {
        self.engine.streams().then(|| self.engine.page_cache())
    }
    /// The storage backend.
    pub fn backend(&self) -> &Arc<dyn StorageBackend> {
        &self.backend
    }
    /// Vocabulary size (rows of the output head).
    pub fn vocab_size(&self) -> usize {
        self.manifest.output.shape.first().copied().unwrap_or(0)
    }
    /// Context size of new sequences.
    pub fn context_size(&self) -> usize {
        self.ctx
    }
    /// The decoder layers that run.
    pub fn layer_selection(&self) -> &LayerSelection {
        &self.selection
    }
    /// Bytes of the dequantized layer matrices (`--weights f16|f32`; 0 with `keep`).
    pub fn dense_weight_bytes(&self) -> u64 {
        self.dense.bytes()
    }

    /// A new, empty sequence with its own KV cache.
    pub fn new_sequence(&self) -> Sequence {
        self.new_sequence_with_capacity(self.ctx)
    }

    /// A new, empty sequence whose KV cache holds at most `positions`
    /// positions (clamped to `1..=context_size`): a server sizes each
    /// request's cache to its prompt plus `max_tokens` rather than the whole
    /// context, so many short requests do not each hold a full-context cache.
    pub fn new_sequence_with_capacity(&self, positions: usize) -> Sequence {
        let ctx = positions.clamp(1, self.ctx);
        Sequence {
            tokens: Vec::new(),
            kv: KvCache::with_layout(&self.cfg, ctx, self.max_batch, &self.kv_layout),
            recurrent: RecurrentState::new(&self.cfg),
        }
    }

    /// A new sequence of `positions` positions (at least `len`) that starts
    /// with `src`'s first `len` tokens and their KV, copied, so that it goes
    /// on exactly as `src` would from there: a server reuses a cached
    /// prompt prefix this way instead of recomputing it. `None` when `src`
    /// cannot give that prefix: a hybrid model (its recurrent state is a
    /// summary of every token and cannot be cut), a sliding-window ring
    /// that dropped a position the window still needs, or `len` beyond
    /// `src`.
    pub fn fork_sequence(&self, src: &Sequence, len: usize, positions: usize) -> Option<Sequence> {
        if len > src.len() || len > self.ctx || src.recurrent.is_used() {
            return None;
        }
        let mut seq = self.new_sequence_with_capacity(positions.max(len));
        if !seq.kv.copy_prefix_from(&src.kv, len) {
            return None;
        }
        seq.tokens.extend_from_slice(&src.tokens[..len]);
        Some(seq)
    }

    /// Context shift of `seq`, as llama.cpp's: its first `keep` tokens
    /// stay, the `dropped` after them go, and the later ones move down by
    /// `dropped` positions, their cached keys re-rotated in place (RoPE of
    /// −dropped with each layer's own settings) instead of computed again.
    /// [`KvShift::Recompute`] (and `seq` unchanged) when that cannot be done:
    /// a hybrid model's recurrent state, or a sliding-window ring that no
    /// longer holds what its window would need.
    pub fn shift_sequence(
        &self,
        seq: &mut Sequence,
        keep: usize,
        dropped: usize,
    ) -> Result<KvShift> {
        let len = seq.len();
        if keep.checked_add(dropped).is_none_or(|end| end > len) {
            return Err(RuntimeError::Shift { keep, dropped, len });
        }
        let recurrent = (0..self.cfg.n_layer).any(|il| self.cfg.is_recurrent(il));
        if recurrent || seq.recurrent.is_used() {
            return Ok(KvShift::Recompute(ShiftRefusal::Recurrent));
        }
        if dropped == 0 {
            return Ok(KvShift::Rotated);
        }
        if let Some(refusal) = seq.kv.shift(keep, dropped, len, &self.plans)? {
            return Ok(KvShift::Recompute(refusal));
        }
        seq.tokens.drain(keep..keep + dropped);
        Ok(KvShift::Rotated)
    }

    /// Bytes of the model file resident in the page cache (`mincore`), and
    /// the bytes the manifest covers.
    pub fn page_cache_residency(&self) -> (u64, u64) {
        let (mut resident, mut total) = (0, 0);
        for t in self.backend.tensors() {
            if let Ok(h) = self.backend.tensor(&t.name) {
                resident += memory::page_cache_resident(h.bytes()).unwrap_or(0);
                total += h.bytes().len() as u64;
            }
        }
        (resident, total)
    }

    /// Run `tokens` through `seq` and return the logits of the last position.
    pub fn step(
        &mut self,
        seq: &mut Sequence,
        tokens: &[u32],
        opts: StepOptions,
    ) -> Result<StepOutput> {
        let mut batch = [(seq, tokens)];
        let mut out = self.step_batch(&mut batch, opts)?;
        Ok(out.pop().unwrap_or_default())
    }

    /// One pass through the layers for several sequences at once: the new
    /// tokens of all of them go through each layer together; each attends
    /// to its own KV cache. Returns one output per sequence, in order.
    pub fn step_batch(
        &mut self,
        batch: &mut [(&mut Sequence, &[u32])],
        opts: StepOptions,
    ) -> Result<Vec<StepOutput>> {
        self.run_step(batch, opts, true)
    }

    /// [`StreamingExecutor::step_batch`] for a speculative verification
    /// pass: every position gets the logits a one-token step would give it
    /// (the kernels sum in the one-token order,
    /// [`flatrun_kernels::with_one_token_order`]), so verification accepts
    /// exactly what plain decoding would produce; and the pass is not counted
    /// as prefill or decode in the profiler (the caller counts the tokens it
    /// keeps, with [`Profiler::add_decode`]).
    pub fn step_batch_verify(
        &mut self,
        batch: &mut [(&mut Sequence, &[u32])],
        opts: StepOptions,
    ) -> Result<Vec<StepOutput>> {
        flatrun_kernels::with_one_token_order(|| self.run_step(batch, opts, false))
    }

    fn run_step(
        &mut self,
        batch: &mut [(&mut Sequence, &[u32])],
        opts: StepOptions,
        timed: bool,
    ) -> Result<Vec<StepOutput>> {
        let vocab = self.vocab_size();
        for (seq, tokens) in batch.iter() {
            if tokens.is_empty() {
                return Err(RuntimeError::EmptyStep);
            }
            if let Some(&id) = tokens.iter().find(|&&t| t as usize >= vocab) {
                return Err(RuntimeError::BadToken { id, vocab });
            }
            if seq.len() + tokens.len() > seq.capacity() {
                return Err(RuntimeError::ContextOverflow {
                    used: seq.len(),
                    new: tokens.len(),
                    capacity: seq.capacity(),
                });
            }
        }
        // A truncated hybrid sequence first rebuilds its recurrent state from
        // the tokens it kept (a recurrent state cannot be rewound).
        for (seq, _) in batch.iter_mut() {
            if seq.recurrent.is_stale() {
                self.replay(seq)?;
            }
        }
        // A model file truncated or rewritten since the last pass fails the
        // step before it reads; one changed during the pass (its reads gave
        // zeros, see flatrun-format's mapped_file) fails it after.
        self.backend.check_files()?;
        let started = Instant::now();
        let n_total: usize = batch.iter().map(|(_, t)| t.len()).sum();
        let is_decode = batch.iter().all(|(_, t)| t.len() == 1);

        let mut outputs: Vec<StepOutput> = batch
            .iter()
            .map(|(_, t)| StepOutput {
                all_logits: (opts.all_logits && !opts.no_logits)
                    .then(|| Vec::with_capacity(t.len() * vocab)),
                all_hidden: opts
                    .all_hidden
                    .then(|| Vec::with_capacity(t.len() * self.cfg.n_embd)),
                ..StepOutput::default()
            })
            .collect();
        // Long prompts go through in pieces of at most `max_batch` tokens per
        // sequence (this bounds activations and the sliding-window rings).
        let mut done = vec![0usize; batch.len()];
        loop {
            let pieces: Vec<(usize, Range<usize>)> = batch
                .iter()
                .enumerate()
                .filter(|(s, (_, t))| done[*s] < t.len())
                .map(|(s, (_, t))| (s, done[s]..(done[s] + self.max_batch).min(t.len())))
                .collect();
            if pieces.is_empty() {
                break;
            }
            self.run_pieces(batch, &pieces, opts, &mut outputs)?;
            self.backend.check_files()?;
            for (s, r) in &pieces {
                done[*s] = r.end;
            }
        }
        let elapsed = started.elapsed();
        if !timed {
            // Counted by the caller.
        } else if is_decode {
            self.profiler.add_decode(n_total, elapsed);
        } else {
            self.profiler.add_prefill(n_total, elapsed);
        }
        Ok(outputs)
    }

    /// Rebuild a truncated hybrid sequence: clear its caches and run the
    /// tokens it kept again.
    fn replay(&mut self, seq: &mut Sequence) -> Result<()> {
        let kept = std::mem::take(&mut seq.tokens);
        seq.kv.truncate(0);
        seq.recurrent.reset();
        if !kept.is_empty() {
            self.step(seq, &kept, StepOptions::default())?;
        }
        Ok(())
    }

    /// What layer `il` needs to predict the next layer's routed experts
    /// and read them ahead: the next layer's router (only when that layer's
    /// dense part is kept, so that using it reads nothing) with its FFN norm
    /// and router bias, copied. `None` when there is nothing to predict.
    fn next_router<'b>(
        &self,
        backend: &'b dyn StorageBackend,
        il: usize,
    ) -> Result<Option<(TensorHandle<'b>, NextParts)>> {
        let next = il + 1;
        let (Some(moe), true) = (&self.cfg.moe, self.expert_prefetch) else {
            return Ok(None);
        };
        if next >= self.cfg.n_layer
            || !self.selection.runs(next)
            || self.weights.layers[il].experts().is_empty()
            || !matches!(self.weights.layers.get(next), Some(LayerLayout::Kept { experts, .. }) if !experts.is_empty())
        {
            return Ok(None);
        }
        let Some(vectors) = self.vectors.kept(next) else {
            return Ok(None);
        };
        let (Some(norm), Some((_, name))) = (
            vectors.get(self.cfg.arch.ffn_norm()),
            self.matrix_names[next]
                .iter()
                .find(|(role, _)| *role == Role::FfnGateInp),
        ) else {
            return Ok(None);
        };
        let parts = NextParts {
            layer: next,
            norm: norm.to_vec(),
            bias: vectors.get(Role::FfnGateInpBias).map(<[f32]>::to_vec),
            k: moe.n_expert_used,
        };
        Ok(Some((open(backend, name)?, parts)))
    }

    /// One pass through the model for `pieces` (sequence index, token range).
    fn run_pieces(
        &mut self,
        batch: &mut [(&mut Sequence, &[u32])],
        pieces: &[(usize, Range<usize>)],
        opts: StepOptions,
        outputs: &mut [StepOutput],
    ) -> Result<()> {
        let d = self.cfg.n_embd;
        // The step's buffers, reused from the previous step (put back at the end).
        let mut buf = std::mem::take(&mut self.buffers);
        // Stack the pieces: token ids, absolute positions, and row ranges.
        let ids = &mut buf.ids;
        let positions = &mut buf.positions;
        ids.clear();
        positions.clear();
        let mut rows = Vec::with_capacity(pieces.len());
        for (s, r) in pieces {
            let (seq, tokens) = &batch[*s];
            let start = ids.len();
            let base = seq.len();
            ids.extend_from_slice(&tokens[r.clone()]);
            positions.extend(base..base + r.len());
            rows.push(start..ids.len());
        }
        let n = ids.len();

        // h = embed[ids] (· sqrt(n_embd) for Gemma)
        let hidden = &mut buf.hidden;
        hidden.resize(n * d, 0.0); // every row is overwritten by `embed`
        self.embed(ids, hidden)?;

        // The layers, in manifest order.
        let backend = self.backend.clone();
        for il in 0..self.cfg.n_layer {
            // A layer left out by `--layers` is the identity on the residual stream.
            if !self.selection.runs(il) {
                continue;
            }
            // Acquire: a kept layer is faulted in once, a streamed one read
            // whole (or, chunked, row chunk by row chunk in its matmuls).
            let t_io = Instant::now();
            let dense = self.dense.layer(il);
            let layout = &self.weights.layers[il];
            let fetch_error = |what: crate::weights::FetchError| RuntimeError::StreamRead {
                tensor: format!("layers.{il}.*"),
                what: what.0,
            };
            let (whole, vector_lease) = match layout {
                LayerLayout::Kept { item, .. } => {
                    self.engine.warm(*item);
                    (None, None)
                }
                LayerLayout::Whole { item, .. } => {
                    (Some(self.engine.acquire(*item).map_err(fetch_error)?), None)
                }
                LayerLayout::Chunked { vectors, .. } => (
                    None,
                    Some(self.engine.acquire(*vectors).map_err(fetch_error)?),
                ),
                LayerLayout::Skipped => (None, None),
            };
            let mut handles = Vec::with_capacity(self.matrix_names[il].len());
            if dense.is_none() {
                for (role, name) in &self.matrix_names[il] {
                    let h = open(backend.as_ref(), name)?;
                    // Routed experts stay views of the mapping, read once
                    // routed.
                    handles.push(match &whole {
                        Some(lease) if !role.is_experts() => leased(backend.as_ref(), &h, lease)?,
                        _ => h,
                    });
                }
            }
            self.profiler.record_io_wait(il, t_io.elapsed());
            self.profiler
                .record_bytes_acquired(il, handles.iter().map(|h| h.bytes().len() as u64).sum());
            let roles = self.matrix_names[il].iter().map(|(role, _)| *role);
            let matrices: Vec<(Role, Weight)> = match dense {
                Some(dense) => roles
                    .zip(dense)
                    .map(|(role, m)| {
                        let w = m.weight().map_err(|source| RuntimeError::Kernel {
                            tensor: layer_tensor(il, role),
                            source,
                        })?;
                        Ok((role, w))
                    })
                    .collect::<Result<_>>()?,
                None => roles
                    .zip(&handles)
                    .map(|(role, h)| Ok((role, weight(h)?)))
                    .collect::<Result<_>>()?,
            };
            // The next layer's router, when its dense part is kept: this
            // layer predicts its experts and reads them ahead.
            let next_router = self.next_router(backend.as_ref(), il)?;
            let vectors = self.vectors.get(
                backend.as_ref(),
                self.kernels.as_ref(),
                &self.manifest,
                il,
                vector_lease.as_ref(),
            )?;
            // Converted: the buffer goes back for the layer's chunks.
            drop(vector_lease);
            let experts = split_experts(&matrices);
            let tensors = LayerView {
                matrices: &matrices,
                experts: &experts,
                vectors,
            };
            // Each sequence runs through its own memory of this layer: a KV
            // cache, or a recurrent state. A cache in a file is read ahead
            // by the engine, the next layer's (after the last layer, the
            // first's, for the next step) while this one runs.
            let next_layer = (il + 1) % self.cfg.n_layer.max(1);
            for (seq, _) in batch.iter() {
                if let Some(pages) = seq.kv.layer_pages(next_layer) {
                    self.engine.read_pages_ahead(pages.ahead());
                }
            }
            let memory = self.cfg.arch.layer_memory(&self.cfg, il);
            let mut segments: Vec<Segment> = Vec::with_capacity(pieces.len());
            for (s, (seq, _)) in batch.iter_mut().enumerate() {
                let Some(k) = pieces.iter().position(|(ps, _)| *ps == s) else {
                    continue;
                };
                let memory = match memory {
                    MemoryKind::Kv => seq
                        .kv
                        .layer_mut(il)
                        .map(|kv| LayerMemory::Kv(kv as &mut dyn LayerKv)),
                    MemoryKind::Recurrent => {
                        seq.recurrent.layer_mut(il).map(LayerMemory::Recurrent)
                    }
                };
                if let Some(memory) = memory {
                    segments.push(Segment {
                        tokens: rows[k].clone(),
                        memory,
                    });
                }
            }
            // A chunked layer's matmuls acquire, use and release one chunk
            // of rows at a time; routed experts are found or read once
            // routed.
            let (chunks, routed): (&[_], &[_]) = match layout {
                LayerLayout::Chunked {
                    matrices, experts, ..
                } => (matrices, experts),
                LayerLayout::Kept { experts, .. } | LayerLayout::Whole { experts, .. } => {
                    (&[], experts)
                }
                LayerLayout::Skipped => (&[], &[]),
            };
            let chunked =
                (dense.is_none() && !(chunks.is_empty() && routed.is_empty())).then(|| {
                    let next = next_router.as_ref().and_then(|(h, parts)| {
                        Some(NextRouter {
                            router: weight(h).ok()?,
                            layer: parts.layer,
                            bias: parts.bias.clone(),
                            norm: parts.norm.clone(),
                            eps: self.cfg.rms_eps,
                            norm_offset: self.cfg.norm_weight_offset,
                            k: parts.k,
                            experts: self.weights.layers[parts.layer].experts(),
                        })
                    });
                    ChunkedKernels::new(
                        self.kernels.as_ref(),
                        &self.engine,
                        chunks,
                        routed,
                        il,
                        &self.expert_cache,
                    )
                    .predicting(next)
                });
            let kernels: &dyn Kernels = match &chunked {
                Some(k) => k,
                None => self.kernels.as_ref(),
            };
            // Run the layer for every token of the step.
            self.cfg.arch.forward_layer(
                &self.cfg,
                &self.plans[il],
                &tensors,
                hidden,
                positions,
                &mut segments,
                kernels,
                &mut self.scratch,
                &mut self.profiler,
            )?;
            drop(segments);
            // A cache in a file: this layer's pages leave the process.
            for (seq, _) in batch.iter() {
                if let Some(pages) = seq.kv.layer_pages(il) {
                    let bytes = self.engine.release_pages(pages);
                    self.profiler.record_kv_bytes_paged(il, bytes);
                }
            }
            if let Some(k) = &chunked {
                // The matmuls' waits for their chunks are this layer's I/O wait.
                self.profiler.record_io_wait(il, k.io_wait());
                let used = k.experts_used();
                self.profiler.record_expert_bytes(il, used.bytes_read);
                self.profiler
                    .record_experts(il, used.hits, used.misses, &used.used);
                self.profiler
                    .record_experts_ahead(il, used.ahead_used, used.ahead_wasted);
            }
            // Release: a streamed layer's buffers go back for the next reads.
            drop(experts);
            drop(matrices);
            drop(handles);
            drop(whole);
            self.profiler.sample_memory(il);
        }

        // Record the evaluated tokens.
        for ((s, r), _) in pieces.iter().zip(&rows) {
            let (seq, tokens) = &mut batch[*s];
            seq.tokens.extend_from_slice(&tokens[r.clone()]);
        }

        // Which rows need logits: all of them, or each sequence's last token
        // once its whole input has gone through.
        let mut wanted: Vec<(usize, usize, bool)> = Vec::new(); // (row, seq, is_last)
        for ((s, r), rr) in pieces.iter().zip(&rows) {
            let finished = r.end == batch[*s].1.len();
            for (j, row) in rr.clone().enumerate() {
                let last = finished && j + 1 == rr.len();
                if opts.all_logits || opts.all_hidden || last {
                    wanted.push((row, *s, last));
                }
            }
        }
        if wanted.is_empty() {
            self.buffers = buf;
            return Ok(());
        }
        // x = rmsnorm(h[wanted]) · output_norm
        let t_norm = Instant::now();
        let normed = &mut buf.normed;
        normed.resize(wanted.len() * d, 0.0); // every row is overwritten below
        for (i, (row, _, _)) in wanted.iter().enumerate() {
            ops::rms_norm(
                &hidden[row * d..(row + 1) * d],
                &self.output_norm,
                self.cfg.rms_eps,
                self.cfg.norm_weight_offset,
                &mut normed[i * d..(i + 1) * d],
            );
        }
        self.profiler.record_other("output_norm", t_norm.elapsed());
        for (i, (_, s, last)) in wanted.iter().enumerate() {
            let state = &normed[i * d..(i + 1) * d];
            let out = &mut outputs[*s];
            if let Some(all) = out.all_hidden.as_mut() {
                all.extend_from_slice(state);
            }
            if *last && opts.hidden {
                out.hidden = Some(state.to_vec());
            }
        }
        if opts.no_logits {
            self.buffers = buf;
            return Ok(());
        }
        if opts.all_hidden && !opts.all_logits {
            // Only the last rows go on through the head.
            let mut kept = 0;
            for i in 0..wanted.len() {
                if wanted[i].2 {
                    normed.copy_within(i * d..(i + 1) * d, kept * d);
                    wanted[kept] = wanted[i];
                    kept += 1;
                }
            }
            wanted.truncate(kept);
            normed.truncate(kept * d);
            if wanted.is_empty() {
                self.buffers = buf;
                return Ok(());
            }
        }
        // logits = x · Woutᵀ (streamed in row chunks unless the head is kept)
        let logits = &mut buf.logits;
        self.output_head(normed, wanted.len(), logits, &mut buf.head_part)?;
        let vocab = self.vocab_size();
        for (i, (_, s, last)) in wanted.iter().enumerate() {
            let row = &logits[i * vocab..(i + 1) * vocab];
            let out = &mut outputs[*s];
            if let Some(all) = out.all_logits.as_mut() {
                all.extend_from_slice(row);
            }
            if *last {
                out.logits = row.to_vec();
            }
        }
        self.buffers = buf;
        Ok(())
    }

    /// `hidden[t] = embed[ids[t]] (· embed_scale)`, touching only those rows.
    fn embed(&mut self, ids: &[u32], hidden: &mut [f32]) -> Result<()> {
        let t0 = Instant::now();
        let d = self.cfg.n_embd;
        let h = open(self.backend.as_ref(), &self.manifest.embed.name)?;
        let w = weight(&h)?;
        // Unless the table is kept (a resident or kept tied head), each
        // looked-up row's pages go as soon as the row is read: over a long
        // generation they would add up, and a long prompt's rows at once
        // would be a fault-around block each.
        let kept = self.residency.output_resident
            && (self.manifest.output_tied || self.residency.resident.iter().all(|&r| r));
        let within = self
            .mapped_bounds
            .get(h.info().file_index)
            .filter(|_| !kept);
        for (t, &id) in ids.iter().enumerate() {
            let r = id as usize;
            self.kernels
                .dequantize_rows(&w, r..r + 1, &mut hidden[t * d..(t + 1) * d])
                .map_err(|source| RuntimeError::Kernel {
                    tensor: self.manifest.embed.name.clone(),
                    source,
                })?;
            // Rows of a tied head's kept part stay.
            let kept_row = self.manifest.output_tied && r < self.weights.head.kept_rows;
            if let (Some(within), false, Ok(row)) = (within, kept_row, w.row_range(r..r + 1)) {
                // SAFETY: `within` is the span of the embedding's file in its
                // read-only mapping, alive with `self.backend`.
                unsafe { memory::release_blocks(row.data, within, false) };
            }
        }
        if let Some(scale) = self.cfg.embed_scale {
            hidden.iter_mut().for_each(|x| *x *= scale);
        }
        self.profiler.record_other("embed", t0.elapsed());
        Ok(())
    }

    /// `logits = x · Woutᵀ` for `m` rows of `x`: the head's kept rows from
    /// the mapping, the rest in streamed row chunks, so that a large
    /// vocabulary never has to be resident at once.
    fn output_head(
        &mut self,
        x: &[f32],
        m: usize,
        logits: &mut Vec<f32>,
        part: &mut Vec<f32>,
    ) -> Result<()> {
        let name = &self.manifest.output.name;
        let h = open(self.backend.as_ref(), name)?;
        let w = weight(&h)?;
        let vocab = w.rows;
        let kernel_error = |source| RuntimeError::Kernel {
            tensor: name.clone(),
            source,
        };
        logits.resize(m * vocab, 0.0); // every value is overwritten below
        let head = &self.weights.head;
        if let Some(k) = head.kept.filter(|&k| !self.engine.is_warm(k)) {
            let t_io = Instant::now();
            self.engine.warm(k);
            self.profiler.record_other("head_io_wait", t_io.elapsed());
        }
        // `logits[.., rows] = x · chunkᵀ`, through `part` when m > 1.
        let kernels = self.kernels.as_ref();
        let mut multiply = |chunk: &Weight, rows: Range<usize>, profiler: &mut Profiler| {
            let t_mm = Instant::now();
            if m == 1 {
                kernels
                    .matmul(chunk, x, 1, &mut logits[rows])
                    .map_err(kernel_error)?;
            } else {
                part.resize(m * rows.len(), 0.0);
                kernels.matmul(chunk, x, m, part).map_err(kernel_error)?;
                scatter(part, rows, vocab, logits);
            }
            profiler.record_other("matmul_head", t_mm.elapsed());
            Ok::<(), RuntimeError>(())
        };
        if head.kept_rows == vocab {
            multiply(&w, 0..vocab, &mut self.profiler)?;
        } else if head.kept_rows > 0 {
            let kept = w.row_range(0..head.kept_rows).map_err(kernel_error)?;
            multiply(&kept, 0..head.kept_rows, &mut self.profiler)?;
        }
        for (rows, item) in &head.chunks {
            let t_io = Instant::now();
            let lease = self
                .engine
                .acquire(*item)
                .map_err(|what| RuntimeError::StreamRead {
                    tensor: name.clone(),
                    what: what.0,
                })?;
            self.profiler.record_other("head_io_wait", t_io.elapsed());
            let chunk = rows_from(&w, &head.sources, rows.clone(), &lease).ok_or_else(|| {
                RuntimeError::StreamRead {
                    tensor: name.clone(),
                    what: format!("rows {rows:?} not in the streamed chunk"),
                }
            })?;
            multiply(&chunk, rows.clone(), &mut self.profiler)?;
        }
        // logits = cap · tanh(logits / cap) (final soft-capping, when set)
        if let Some(cap) = self.cfg.final_logit_softcap {
            logits.iter_mut().for_each(|l| *l = cap * (*l / cap).tanh());
        }
        Ok(())
    }
}
