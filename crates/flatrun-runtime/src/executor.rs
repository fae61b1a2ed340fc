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

use crate::error::{Result, RuntimeError};
use crate::kv_cache::KvCache;
use crate::memory;
use crate::options::{KvType, LoadOptions, Prefetch};
use crate::prefetch::Prefetcher;
use crate::profiler::Profiler;
use crate::residency::ResidencyPlan;
use flatrun_format::{StorageBackend, TensorHandle};
use flatrun_kernels::{ops, Kernels, Weight};
use flatrun_model::arch::{
    forward_layer, AttentionSegment, DecoderScratch, LayerKv, LayerPlan, LayerWeights,
};
use flatrun_model::manifest::layer_tensor;
use flatrun_model::{Manifest, ModelConfig};
use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

/// Bytes of one chunk of the output head (streamed row block).
const HEAD_CHUNK_BYTES: usize = 4 << 20;

/// One sequence: its tokens so far and its KV cache.
#[derive(Debug)]
pub struct Sequence {
    tokens: Vec<u32>,
    kv: KvCache,
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
    /// Drop every token from position `len` on (to rewind or reuse a prefix).
    pub fn truncate(&mut self, len: usize) {
        if len < self.tokens.len() {
            self.tokens.truncate(len);
            self.kv.truncate(len);
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

/// f32 copies of one layer's small vectors (norms, biases), kept resident.
#[derive(Debug, Default)]
struct LayerVectors {
    attn_norm: Vec<f32>,
    ffn_norm: Vec<f32>,
    q_bias: Option<Vec<f32>>,
    k_bias: Option<Vec<f32>>,
    v_bias: Option<Vec<f32>>,
    o_bias: Option<Vec<f32>>,
    q_norm: Option<Vec<f32>>,
    k_norm: Option<Vec<f32>>,
    post_attn_norm: Option<Vec<f32>>,
    post_ffn_norm: Option<Vec<f32>>,
}

/// The matrix roles of a layer, in the order [`LayerWeights`] takes them.
const MATRIX_ROLES: [&str; 7] = [
    "attn.q", "attn.k", "attn.v", "attn.o", "ffn.gate", "ffn.up", "ffn.down",
];

/// Runs steps layer by layer over a storage backend.
pub struct StreamingExecutor {
    backend: Arc<dyn StorageBackend>,
    cfg: ModelConfig,
    manifest: Manifest,
    kernels: Arc<dyn Kernels>,
    plans: Vec<LayerPlan>,
    vectors: Vec<LayerVectors>,
    output_norm: Vec<f32>,
    residency: ResidencyPlan,
    prefetcher: Option<Prefetcher>,
    prefetch_depth: usize,
    /// Whether every layer has been faulted in once (resident layers then
    /// need no read-ahead).
    warmed: bool,
    /// Acquisitions so far (layers and head), the prefetcher's clock.
    acquisitions: u64,
    scratch: DecoderScratch,
    ctx: usize,
    kv_type: KvType,
    max_batch: usize,
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
        let optional = |i: usize, role: &str| -> Result<Option<Vec<f32>>> {
            let name = layer_tensor(i, role);
            if manifest.layers[i].tensors.iter().any(|t| t.name == name) {
                read_vector(b, k, &name).map(Some)
            } else {
                Ok(None)
            }
        };
        let mut vectors = Vec::with_capacity(cfg.n_layer);
        for i in 0..cfg.n_layer {
            vectors.push(LayerVectors {
                attn_norm: read_vector(b, k, &layer_tensor(i, "attn_norm"))?,
                ffn_norm: read_vector(b, k, &layer_tensor(i, "ffn_norm"))?,
                q_bias: optional(i, "attn.q.bias")?,
                k_bias: optional(i, "attn.k.bias")?,
                v_bias: optional(i, "attn.v.bias")?,
                o_bias: optional(i, "attn.o.bias")?,
                q_norm: optional(i, "attn.q_norm")?,
                k_norm: optional(i, "attn.k_norm")?,
                post_attn_norm: optional(i, "post_attn_norm")?,
                post_ffn_norm: optional(i, "post_ffn_norm")?,
            });
        }
        let output_norm = read_vector(b, k, &manifest.output_norm.name)?;
        let freq_factors = match &manifest.rope_freqs {
            Some(t) => Some(read_vector(b, k, &t.name)?),
            None => None,
        };
        let plans = (0..cfg.n_layer)
            .map(|i| LayerPlan::new(&cfg, i, freq_factors.as_deref()))
            .collect();
        let residency = ResidencyPlan::new(opts.residency, &manifest);
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
        let ctx = opts
            .ctx
            .unwrap_or_else(|| cfg.context_length.clamp(1, 4096));
        let max_batch = opts.max_batch.max(1);
        Ok(StreamingExecutor {
            scratch: DecoderScratch::new(&cfg, 1),
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
            prefetch_depth,
            warmed: false,
            acquisitions: 0,
            ctx,
            kv_type: opts.kv_type,
            max_batch,
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

    /// A new, empty sequence with its own KV cache.
    pub fn new_sequence(&self) -> Sequence {
        Sequence {
            tokens: Vec::new(),
            kv: KvCache::new(&self.cfg, self.ctx, self.max_batch, self.kv_type),
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

    /// One pass through the model for `pieces` (sequence index, token range).
    fn run_pieces(
        &mut self,
        batch: &mut [(&mut Sequence, &[u32])],
        pieces: &[(usize, Range<usize>)],
        opts: StepOptions,
        outputs: &mut [StepOutput],
    ) -> Result<()> {
        let d = self.cfg.n_embd;
        // Stack the pieces: token ids, absolute positions, and row ranges.
        let mut ids = Vec::new();
        let mut positions = Vec::new();
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
        let mut hidden = vec![0.0f32; n * d];
        self.embed(&ids, &mut hidden)?;

        // The layers, in manifest order.
        let backend = self.backend.clone();
        for il in 0..self.cfg.n_layer {
            self.request_prefetch(il);
            // Acquire: open the layer's matrices and fault their pages in.
            let t_io = Instant::now();
            let mut handles = Vec::with_capacity(MATRIX_ROLES.len());
            for role in MATRIX_ROLES {
                let h = open(backend.as_ref(), &layer_tensor(il, role))?;
                memory::populate(h.bytes());
                handles.push(h);
            }
            self.profiler.record_io_wait(il, t_io.elapsed());

            let v = &self.vectors[il];
            let weights = LayerWeights {
                attn_norm: &v.attn_norm,
                q: weight(&handles[0])?,
                k: weight(&handles[1])?,
                v: weight(&handles[2])?,
                o: weight(&handles[3])?,
                q_bias: v.q_bias.as_deref(),
                k_bias: v.k_bias.as_deref(),
                v_bias: v.v_bias.as_deref(),
                o_bias: v.o_bias.as_deref(),
                q_norm: v.q_norm.as_deref(),
                k_norm: v.k_norm.as_deref(),
                post_attn_norm: v.post_attn_norm.as_deref(),
                ffn_norm: &v.ffn_norm,
                gate: weight(&handles[4])?,
                up: weight(&handles[5])?,
                down: weight(&handles[6])?,
                post_ffn_norm: v.post_ffn_norm.as_deref(),
            };
            // Each sequence attends through its own cache of this layer.
            let mut segments: Vec<AttentionSegment> = Vec::with_capacity(pieces.len());
            for (s, (seq, _)) in batch.iter_mut().enumerate() {
                let Some(k) = pieces.iter().position(|(ps, _)| *ps == s) else {
                    continue;
                };
                if let Some(kv) = seq.kv.layer_mut(il) {
                    segments.push(AttentionSegment {
                        tokens: rows[k].clone(),
                        kv: kv as &mut dyn LayerKv,
                    });
                }
            }
            // Run the layer for every token of the step.
            forward_layer(
                &self.cfg,
                &self.plans[il],
                &weights,
                &mut hidden,
                &positions,
                &mut segments,
                self.kernels.as_ref(),
                &mut self.scratch,
                &mut self.profiler,
            )?;
            drop(segments);
            // Release: streamed layers give their pages back.
            if !self.residency.is_resident(il) {
                for h in &handles {
                    memory::release(h.bytes());
                }
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
            return Ok(());
        }
        // x = rmsnorm(h[wanted]) · output_norm
        let t_norm = Instant::now();
        let mut normed = vec![0.0f32; wanted.len() * d];
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
        // logits = x · Woutᵀ, streamed in row chunks
        let logits = self.output_head(&normed, wanted.len())?;
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
        if let Some(scale) = self.cfg.embed_scale {
            hidden.iter_mut().for_each(|x| *x *= scale);
        }
        self.profiler.record_other("embed", t0.elapsed());
        Ok(())
    }

    /// `logits = x · Woutᵀ` for `m` rows of `x`, reading the head in chunks
    /// of rows so that a large vocabulary never has to be resident at once.
    fn output_head(&mut self, x: &[f32], m: usize) -> Result<Vec<f32>> {
        self.acquisitions += 1;
        if let Some(p) = &self.prefetcher {
            p.advance(self.acquisitions);
        }
        let backend = self.backend.clone();
        let name = self.manifest.output.name.clone();
        let h = open(backend.as_ref(), &name)?;
        let w = weight(&h)?;
        let vocab = w.rows;
        let chunk_rows = (HEAD_CHUNK_BYTES / w.row_bytes().max(1)).max(64);
        let mut logits = vec![0.0f32; m * vocab];
        let mut part = vec![0.0f32; m * chunk_rows.min(vocab)];
        let mut r0 = 0;
        while r0 < vocab {
            let r1 = (r0 + chunk_rows).min(vocab);
            let chunk = w.row_range(r0..r1).map_err(|source| RuntimeError::Kernel {
                tensor: name.clone(),
                source,
            })?;
            let t_io = Instant::now();
            memory::populate(chunk.data);
            self.profiler.record_other("head_io_wait", t_io.elapsed());
            let t_mm = Instant::now();
            let rows = r1 - r0;
            let out = &mut part[..m * rows];
            self.kernels
                .matmul(&chunk, x, m, out)
                .map_err(|source| RuntimeError::Kernel {
                    tensor: name.clone(),
                    source,
                })?;
            for t in 0..m {
                logits[t * vocab + r0..t * vocab + r1]
                    .copy_from_slice(&out[t * rows..(t + 1) * rows]);
            }
            self.profiler.record_other("matmul_head", t_mm.elapsed());
            if !self.residency.output_resident {
                memory::release(chunk.data);
            }
            r0 = r1;
        }
        // logits = cap · tanh(logits / cap) (final soft-capping, when set)
        if let Some(cap) = self.cfg.final_logit_softcap {
            logits.iter_mut().for_each(|l| *l = cap * (*l / cap).tanh());
        }
        Ok(logits)
    }
}
