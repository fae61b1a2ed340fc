//! The streaming executor: a step pushes the new tokens of one or more
//! sequences through the model one layer at a time.
//!
//! ```text
//! embed (only the rows of the step's tokens)
//! for each layer i (the scheduler's order = the manifest's):
//!     request read-ahead of layers i+1 ..= i+depth      (prefetch thread)
//!     acquire layer i: open its handles, fault its pages in   (I/O wait)
//!     run layer i for every token of every sequence at once
//!     update each sequence's KV cache of layer i
//!     release layer i unless the residency plan keeps it  (MADV_DONTNEED)
//! final RMS norm
//! output head, streamed in row chunks → logits
//! ```

use crate::chunk_stream::{file_bounds, ChunkPlan, ChunkStream, ChunkedKernels};
use crate::error::{Result, RuntimeError};
use crate::kv_cache::KvCache;
use crate::layer_range::LayerSelection;
use crate::layer_vectors::{LayerVectorStore, LayerView};
use crate::memory;
use crate::options::{KvType, LoadOptions, Prefetch};
use crate::prefetch::Prefetcher;
use crate::profiler::Profiler;
use crate::recurrent_state::RecurrentState;
use crate::residency::ResidencyPlan;
use crate::stream_reader::StreamSchedule;
use crate::weights_override::DenseLayers;
use flatrun_format::{StorageBackend, TensorHandle};
use flatrun_kernels::{ops, Kernels, Weight};
use flatrun_model::arch::{
    layer_tensor, LayerKv, LayerMemory, LayerPlan, LayerScratch, MemoryKind, Segment,
};
use flatrun_model::{Manifest, ModelConfig, Role};
use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

/// Bytes of one chunk of the output head (streamed row block).
const HEAD_CHUNK_BYTES: usize = 4 << 20;

/// Rows of one streamed chunk of an output head whose rows are `row_bytes` long.
fn head_chunk_rows(row_bytes: usize) -> usize {
    (HEAD_CHUNK_BYTES / row_bytes.max(1)).max(64)
}

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
}

/// What a step returns besides the last position's logits.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StepOptions {
    /// Logits of every position of the step, not only the last.
    pub all_logits: bool,
    /// The final-normed hidden state of the last position.
    pub hidden: bool,
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
    prefetcher: Option<Prefetcher>,
    /// Capped residency: explicit reads of the streamed layers and head
    /// chunks into reused buffers (see `stream_reader.rs`).
    streamer: Option<StreamSchedule>,
    /// Mapped, streamed matrices (every layer in `Stream` mode, and the head)
    /// run in row chunks of a fixed byte budget, read ahead chunk by chunk
    /// (see `chunk_stream.rs`).
    chunks: Option<ChunkStream>,
    /// `chunked_layer[i]`: layer `i`'s matrices are in the chunk plan.
    chunked_layer: Vec<bool>,
    /// Unless everything is kept: per backend file, the page-aligned span of
    /// its tensors in the mapping (where pages may be released in blocks).
    mapped_bounds: Vec<Range<usize>>,
    prefetch_depth: usize,
    /// Whether every layer has been faulted in once (resident layers then
    /// need no read-ahead).
    warmed: bool,
    /// Acquisitions so far (layers and head), the prefetcher's clock.
    acquisitions: u64,
    /// `faulted_in[i]`: layer `i` is kept resident and its pages were
    /// populated once, so later steps skip the populate call.
    faulted_in: Vec<bool>,
    /// The output head is kept resident and its pages were populated once.
    head_faulted_in: bool,
    /// Rows at the start of a head the cap streams that are kept mapped
    /// anyway (the rest of the cap); populated once with `head_faulted_in`.
    head_kept_rows: usize,
    /// Each layer's matrices (role, canonical name), in the order it
    /// multiplies them.
    matrix_names: Vec<Vec<(Role, String)>>,
    /// Buffers of a step (ids, positions, activations, logits), reused.
    buffers: StepBuffers,
    scratch: LayerScratch,
    ctx: usize,
    kv_type: KvType,
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

impl StreamingExecutor {
    /// Prepare an executor: read the small vectors, plan residency, start
    /// the prefetch thread.
    pub fn new(
        backend: Arc<dyn StorageBackend>,
        cfg: ModelConfig,
        manifest: Manifest,
        kernels: Arc<dyn Kernels>,
        opts: &LoadOptions,
    ) -> Result<StreamingExecutor> {
        let b = backend.as_ref();
        let k = kernels.as_ref();
        // Layers with a recurrent memory (Qwen3.5's delta nets) are not yet
        // proven under the capped stream reader or the chunked stream: their
        // weights are mapped and released whole.
        let recurrent_stack =
            (0..cfg.n_layer).any(|il| cfg.arch.layer_memory(&cfg, il) == MemoryKind::Recurrent);
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
            Prefetch::Ahead { depth } => depth.max(1),
            Prefetch::Off => 1,
        };
        let capped_chunk = capped_head_chunk_bytes(&manifest);
        let mut residency = ResidencyPlan::with_stream_buffers(
            opts.residency,
            &manifest,
            read_depth,
            capped_chunk as u64,
        );
        let selection = match &opts.layers {
            Some(selection) => {
                selection.check(cfg.n_layer)?;
                selection.clone()
            }
            None => LayerSelection::all(cfg.n_layer),
        };
        let dense = DenseLayers::build(opts.weights, b, k, &matrix_names, &residency, &selection)?;
        let (prefetcher, prefetch_depth) = match opts.prefetch {
            Prefetch::Ahead { depth } if depth > 0 => {
                let mut lists: Vec<Vec<String>> = manifest
                    .layers
                    .iter()
                    .map(|l| l.tensors.iter().map(|t| t.name.clone()).collect())
                    .collect();
                lists.push(vec![manifest.output.name.clone()]);
                (Some(Prefetcher::start(backend.clone(), lists)), depth)
            }
            _ => (None, 0),
        };
        // Capped residency reads what it streams explicitly (not through
        // the page cache, where it would evict the kept layers). What the cap
        // leaves after whole layers keeps the head's first rows (whole rows).
        let head_row_bytes = open(b, &manifest.output.name)
            .and_then(|h| weight(&h).map(|w| w.row_bytes() as u64))
            .unwrap_or(0);
        let mut head_kept_rows = 0;
        let streamer = match (opts.residency, opts.prefetch) {
            (crate::Residency::Cap(_) | crate::Residency::Custom(_), Prefetch::Ahead { .. })
                if !recurrent_stack && head_row_bytes > 0 =>
            {
                (residency, head_kept_rows) = residency.with_head_rows(head_row_bytes);
                StreamSchedule::build(
                    backend.as_ref(),
                    &manifest,
                    &residency,
                    |il| selection.runs(il) && dense.layer(il).is_none(),
                    |row_bytes| (capped_chunk / row_bytes.max(1)).max(64),
                    head_kept_rows,
                    read_depth,
                    opts.stream_reads,
                )
            }
            _ => None,
        };
        if streamer
            .as_ref()
            .is_none_or(|st| st.head_chunks().is_empty())
        {
            // Only the stream reader's head path keeps part of a head.
            residency = residency.without_partial_head();
            head_kept_rows = 0;
        }
        // Every other matrix that is neither kept nor read by the stream
        // reader is mapped chunk by chunk, a fixed byte budget at a time.
        let chunked_layer: Vec<bool> = (0..cfg.n_layer)
            .map(|il| {
                !recurrent_stack
                    && selection.runs(il)
                    && dense.layer(il).is_none()
                    && !residency.is_resident(il)
                    && streamer.as_ref().is_none_or(|st| st.layer(il).is_none())
            })
            .collect();
        let mut chunk_names: Vec<String> = chunked_layer
            .iter()
            .enumerate()
            .filter(|(_, &chunked)| chunked)
            .flat_map(|(il, _)| matrix_names[il].iter().map(|(_, name)| name.clone()))
            .collect();
        if !residency.output_resident
            && streamer
                .as_ref()
                .is_none_or(|st| st.head_chunks().is_empty())
        {
            chunk_names.push(manifest.output.name.clone());
        }
        // The layers' norms and biases: kept as f32 copies, except those of
        // chunked layers, read again whenever the layer runs.
        let vectors =
            LayerVectorStore::load(b, k, &manifest, cfg.n_layer, |il| !chunked_layer[il])?;
        // Unless everything is kept, drop what loading mapped (the norms and
        // biases just copied, and the blocks the kernel faulted in around
        // them): from here on only the weights in use are mapped.
        let mapped_bounds = if opts.residency == crate::Residency::Resident {
            Vec::new()
        } else {
            file_bounds(b)
        };
        for within in &mapped_bounds {
            // SAFETY: `within` spans the tensors of one file, all slices of
            // that file's one read-only mapping, which `backend` keeps alive.
            unsafe { memory::release_span(within) };
        }
        let chunks = if chunk_names.is_empty() {
            None
        } else {
            let plan = ChunkPlan::build(b, chunk_names, opts.stream_chunk_bytes)?;
            let depth = match opts.prefetch {
                Prefetch::Ahead { depth } => depth,
                Prefetch::Off => 0,
            };
            Some(ChunkStream::start(backend.clone(), plan, depth))
        };
        let ctx = opts
            .ctx
            .unwrap_or_else(|| cfg.context_length.clamp(1, 4096));
        let max_batch = opts.max_batch.max(1);
        let n_layer = cfg.n_layer;
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
            prefetcher,
            streamer,
            chunks,
            chunked_layer,
            mapped_bounds,
            prefetch_depth,
            warmed: false,
            acquisitions: 0,
            faulted_in: vec![false; n_layer],
            head_faulted_in: false,
            head_kept_rows,
            matrix_names,
            buffers: StepBuffers::default(),
            ctx,
            kv_type: opts.kv_type,
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
    /// How a capped model reads what it streams: `Some(true)` through the
    /// page cache, `Some(false)` around it (`O_DIRECT`), `None` when no
    /// layer is read explicitly ([`crate::StreamReads`]).
    pub fn streams_through_page_cache(&self) -> Option<bool> {
        self.streamer.as_ref().map(|st| st.reader.page_cache())
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
            kv: KvCache::new(&self.cfg, ctx, self.max_batch, self.kv_type),
            recurrent: RecurrentState::new(&self.cfg),
        }
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
        let started = Instant::now();
        let n_total: usize = batch.iter().map(|(_, t)| t.len()).sum();
        let is_decode = batch.iter().all(|(_, t)| t.len() == 1);

        let mut outputs: Vec<StepOutput> = batch
            .iter()
            .map(|(_, t)| StepOutput {
                all_logits: opts.all_logits.then(|| Vec::with_capacity(t.len() * vocab)),
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
            for (s, r) in &pieces {
                done[*s] = r.end;
            }
        }
        let elapsed = started.elapsed();
        if is_decode {
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
            self.request_prefetch(il);
            // Acquire: open the layer's matrices and fault their pages in
            // (nothing to read when they were dequantized at load).
            let t_io = Instant::now();
            let dense = self.dense.layer(il);
            let mut handles = Vec::with_capacity(self.matrix_names[il].len());
            // A layer the cap streams arrives read into a buffer.
            let streamed =
                match (&mut self.streamer, dense.is_none()) {
                    (Some(st), true) => match st.layer(il) {
                        Some(item) => Some(st.reader.acquire(item).map_err(|what| {
                            RuntimeError::StreamRead {
                                tensor: format!("layers.{il}.*"),
                                what,
                            }
                        })?),
                        None => None,
                    },
                    _ => None,
                };
            if let Some(item) = &streamed {
                for (_, name) in &self.matrix_names[il] {
                    let info =
                        backend
                            .tensor_info(name)
                            .ok_or_else(|| RuntimeError::StreamRead {
                                tensor: name.clone(),
                                what: "not in the checkpoint".into(),
                            })?;
                    let bytes = item
                        .bytes(info.file_index, info.offset, info.byte_size)
                        .ok_or_else(|| RuntimeError::StreamRead {
                            tensor: name.clone(),
                            what: "not in the streamed item".into(),
                        })?;
                    handles.push(TensorHandle::new(info, bytes, Vec::new()));
                }
            } else if dense.is_none() {
                // A kept layer is populated once; later steps find it mapped.
                // A chunked layer is faulted in chunk by chunk by its matmuls.
                let populate = !self.faulted_in[il] && !self.chunked_layer[il];
                for (_, name) in &self.matrix_names[il] {
                    let h = open(backend.as_ref(), name)?;
                    if populate {
                        memory::populate(h.bytes());
                    }
                    handles.push(h);
                }
                self.faulted_in[il] = self.residency.is_resident(il);
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

            let vectors =
                self.vectors
                    .get(backend.as_ref(), self.kernels.as_ref(), &self.manifest, il)?;
            let tensors = LayerView {
                matrices: &matrices,
                vectors,
            };
            // Each sequence runs through its own memory of this layer: a KV
            // cache, or a recurrent state.
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
            // A chunked layer's matmuls fault in, use and drop one chunk
            // of rows at a time.
            let chunked = match (&self.chunks, self.chunked_layer[il] && dense.is_none()) {
                (Some(stream), true) => Some(ChunkedKernels {
                    inner: self.kernels.as_ref(),
                    stream,
                }),
                _ => None,
            };
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
            if let Some(k) = &chunked {
                // The matmuls' waits for their chunks are this layer's I/O wait.
                self.profiler.record_io_wait(il, k.stream.take_io_wait());
            }
            // Release: streamed layers give their pages (or read buffer) back
            // (chunked layers did, chunk by chunk).
            drop(matrices);
            if streamed.is_none() && chunked.is_none() && !self.residency.is_resident(il) {
                for h in &handles {
                    memory::release(h.bytes());
                }
            }
            drop(handles);
            if let (Some(item), Some(st)) = (streamed, &self.streamer) {
                st.reader.release(item);
            }
            self.profiler.sample_memory(il);
        }
        self.warmed = true;

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
                if opts.all_logits || last {
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
                if opts.hidden {
                    out.hidden = Some(normed[i * d..(i + 1) * d].to_vec());
                }
            }
        }
        self.buffers = buf;
        Ok(())
    }

    /// Ask the prefetch thread for the layers after `il` (wrapping to the
    /// output head and then the next step's first layers).
    fn request_prefetch(&mut self, il: usize) {
        self.acquisitions += 1;
        let Some(p) = &self.prefetcher else {
            return;
        };
        p.advance(self.acquisitions);
        let n = self.cfg.n_layer;
        for ahead in 1..=self.prefetch_depth {
            let next = (il + ahead) % (n + 1);
            // Layers left out by `--layers`, or dequantized at load, are never read.
            if next < n && (!self.selection.runs(next) || self.dense.layer(next).is_some()) {
                continue;
            }
            // Chunked layers are read ahead chunk by chunk (`chunk_stream.rs`).
            if next < n && self.chunked_layer[next] {
                continue;
            }
            // Layers the stream reader reads are not mapped.
            if next < n
                && self
                    .streamer
                    .as_ref()
                    .is_some_and(|st| st.layer(next).is_some())
            {
                continue;
            }
            // A streamed head is read chunk by chunk by `output_head`;
            // populating it whole here would map all of it at once.
            if next == n && !self.residency.output_resident {
                continue;
            }
            let keep = next == n || self.residency.is_resident(next);
            if !(keep && self.warmed) {
                p.request(next, self.acquisitions + ahead as u64);
            }
        }
    }

    /// `hidden[t] = embed[ids[t]] (· embed_scale)`, touching only those rows.
    fn embed(&mut self, ids: &[u32], hidden: &mut [f32]) -> Result<()> {
        let t0 = Instant::now();
        let d = self.cfg.n_embd;
        let h = open(self.backend.as_ref(), &self.manifest.embed.name)?;
        let w = weight(&h)?;
        for (t, &id) in ids.iter().enumerate() {
            let r = id as usize;
            self.kernels
                .dequantize_rows(&w, r..r + 1, &mut hidden[t * d..(t + 1) * d])
                .map_err(|source| RuntimeError::Kernel {
                    tensor: self.manifest.embed.name.clone(),
                    source,
                })?;
        }
        // Unless the table is kept (a resident or kept tied head), drop the
        // looked-up rows' pages: over a long generation they would add up.
        let kept = self.residency.output_resident
            && (self.manifest.output_tied || self.residency.resident.iter().all(|&r| r));
        if !kept {
            if let Some(within) = self.mapped_bounds.get(h.info().file_index) {
                for &id in ids {
                    let r = id as usize;
                    // Rows of a tied head's kept part stay.
                    if self.manifest.output_tied && r < self.head_kept_rows {
                        continue;
                    }
                    if let Ok(row) = w.row_range(r..r + 1) {
                        // SAFETY: `within` is the span of the embedding's
                        // file in its read-only mapping, alive with `self.backend`.
                        unsafe { memory::release_blocks(row.data, within, false) };
                    }
                }
            }
        }
        if let Some(scale) = self.cfg.embed_scale {
            hidden.iter_mut().for_each(|x| *x *= scale);
        }
        self.profiler.record_other("embed", t0.elapsed());
        Ok(())
    }

    /// `logits = x · Woutᵀ` for `m` rows of `x`, reading the head in chunks
    /// of rows so that a large vocabulary never has to be resident at once.
    fn output_head(
        &mut self,
        x: &[f32],
        m: usize,
        logits: &mut Vec<f32>,
        part: &mut Vec<f32>,
    ) -> Result<()> {
        self.acquisitions += 1;
        if let Some(p) = &self.prefetcher {
            p.advance(self.acquisitions);
        }
        let name = &self.manifest.output.name;
        let h = open(self.backend.as_ref(), name)?;
        let w = weight(&h)?;
        let vocab = w.rows;
        let kernel_error = |source| RuntimeError::Kernel {
            tensor: name.clone(),
            source,
        };
        logits.resize(m * vocab, 0.0); // every value is overwritten below
        if self.residency.output_resident {
            // A kept head: populated once, then one matmul over every row.
            if !self.head_faulted_in {
                let t_io = Instant::now();
                memory::populate(w.data);
                self.head_faulted_in = true;
                self.profiler.record_other("head_io_wait", t_io.elapsed());
            }
            let t_mm = Instant::now();
            self.kernels
                .matmul(&w, x, m, logits)
                .map_err(kernel_error)?;
            self.profiler.record_other("matmul_head", t_mm.elapsed());
        } else if let Some(st) = self
            .streamer
            .as_mut()
            .filter(|st| !st.head_chunks().is_empty())
        {
            // A head the cap streams: its kept first rows from the mapping
            // (populated once), then row chunks read ahead into buffers.
            let max_rows = st
                .head_chunks()
                .iter()
                .map(|(r, _)| r.len())
                .max()
                .unwrap_or(0);
            let kept = self.head_kept_rows;
            part.clear();
            part.resize(m * max_rows.max(kept), 0.0);
            if kept > 0 {
                let chunk = w.row_range(0..kept).map_err(kernel_error)?;
                if !self.head_faulted_in {
                    let t_io = Instant::now();
                    memory::populate(chunk.data);
                    self.head_faulted_in = true;
                    self.profiler.record_other("head_io_wait", t_io.elapsed());
                }
                let t_mm = Instant::now();
                let out = &mut part[..m * kept];
                self.kernels
                    .matmul(&chunk, x, m, out)
                    .map_err(kernel_error)?;
                for t in 0..m {
                    logits[t * vocab..t * vocab + kept]
                        .copy_from_slice(&out[t * kept..(t + 1) * kept]);
                }
                self.profiler.record_other("matmul_head", t_mm.elapsed());
            }
            for k in 0..st.head_chunks().len() {
                let (range, item) = st.head_chunks()[k].clone();
                let t_io = Instant::now();
                let read = st
                    .reader
                    .acquire(item)
                    .map_err(|what| RuntimeError::StreamRead {
                        tensor: name.clone(),
                        what,
                    })?;
                self.profiler.record_other("head_io_wait", t_io.elapsed());
                let t_mm = Instant::now();
                let mut chunk = w.row_range(range.clone()).map_err(kernel_error)?;
                let info = h.info();
                let at = info.offset + (range.start * w.row_bytes()) as u64;
                chunk.data = read
                    .bytes(info.file_index, at, chunk.data.len() as u64)
                    .ok_or_else(|| RuntimeError::StreamRead {
                        tensor: name.clone(),
                        what: format!("rows {range:?} not in the streamed chunk"),
                    })?;
                let rows = range.len();
                let out = &mut part[..m * rows];
                self.kernels
                    .matmul(&chunk, x, m, out)
                    .map_err(kernel_error)?;
                for t in 0..m {
                    logits[t * vocab + range.start..t * vocab + range.end]
                        .copy_from_slice(&out[t * rows..(t + 1) * rows]);
                }
                self.profiler.record_other("matmul_head", t_mm.elapsed());
                st.reader.release(read);
            }
        } else if let Some(stream) = self.chunks.as_ref().filter(|c| c.plan().contains(name)) {
            // A streamed head: row chunks of the chunk budget, read ahead,
            // each faulted in, multiplied and released.
            let t_mm = Instant::now();
            let chunked = ChunkedKernels {
                inner: self.kernels.as_ref(),
                stream,
            };
            chunked.matmul(&w, x, m, logits).map_err(kernel_error)?;
            let waited = stream.take_io_wait();
            self.profiler.record_other("head_io_wait", waited);
            self.profiler
                .record_other("matmul_head", t_mm.elapsed().saturating_sub(waited));
        } else {
            // A streamed head: row chunks, each faulted in, used, released.
            let chunk_rows = head_chunk_rows(w.row_bytes());
            part.clear();
            part.resize(m * chunk_rows.min(vocab), 0.0);
            let mut r0 = 0;
            while r0 < vocab {
                let r1 = (r0 + chunk_rows).min(vocab);
                let chunk = w.row_range(r0..r1).map_err(kernel_error)?;
                let t_io = Instant::now();
                memory::populate(chunk.data);
                self.profiler.record_other("head_io_wait", t_io.elapsed());
                let t_mm = Instant::now();
                let rows = r1 - r0;
                let out = &mut part[..m * rows];
                self.kernels
                    .matmul(&chunk, x, m, out)
                    .map_err(kernel_error)?;
                for t in 0..m {
                    logits[t * vocab + r0..t * vocab + r1]
                        .copy_from_slice(&out[t * rows..(t + 1) * rows]);
                }
                self.profiler.record_other("matmul_head", t_mm.elapsed());
                memory::release(chunk.data);
                r0 = r1;
            }
        }
        // logits = cap · tanh(logits / cap) (final soft-capping, when set)
        if let Some(cap) = self.cfg.final_logit_softcap {
            logits.iter_mut().for_each(|l| *l = cap * (*l / cap).tanh());
        }
        Ok(())
    }
}
