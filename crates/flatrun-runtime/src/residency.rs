//! Which weights stay resident: the plan a [`crate::Residency`] policy makes
//! over the manifest; and the memory plan of a whole load (weights, KV
//! cache, buffers) checked before anything is read.

use crate::error::{Result, RuntimeError};
use crate::kv_cache::KvCache;
use crate::options::{KvType, LoadOptions, Prefetch, Residency};
use flatrun_model::{Manifest, ModelConfig};

/// Per-layer (and output-head) decision: keep resident or stream.
///
/// In a mixture-of-experts model a streamed layer's routed experts are
/// never read with the rest of it: a token reads only the experts its
/// router chose, once chosen. Under a cap that cannot hold the whole model
/// the kept layers keep only their dense part (attention, norms, router,
/// shared experts) and what the cap leaves after the dense parts and the
/// head goes to a cache of routed experts ([`ResidencyPlan::expert_cache_bytes`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResidencyPlan {
    /// `resident[i]`: layer `i` keeps its pages between tokens (only its
    /// dense part when [`ResidencyPlan::split_experts`]).
    pub resident: Vec<bool>,
    /// The output head keeps its pages between tokens.
    pub output_resident: bool,
    /// When the head is not kept whole: bytes at its start (whole rows,
    /// rounded down by the executor) kept anyway, so that what a cap leaves
    /// after the whole items it keeps is not wasted; the rest of the head is
    /// streamed. 0 when the head is kept whole or not at all.
    pub output_kept_bytes: u64,
    /// Kept layers keep only their dense part; the routed experts of every
    /// layer are read once routed, through the expert cache.
    pub split_experts: bool,
    /// Bytes of routed experts the expert cache may hold (0: none held
    /// beyond the layer that uses them).
    pub expert_cache_bytes: u64,
    /// Bytes kept resident by this plan (the expert cache included).
    pub resident_bytes: u64,
    /// Bytes streamed (re-read or re-faulted) per token; a
    /// mixture-of-experts layer counts the experts one token uses, as if
    /// none were cached.
    pub streamed_bytes_per_token: u64,
}

impl ResidencyPlan {
    /// Plan `policy` over `manifest`.
    ///
    /// For `Cap(bytes)`, every layer and the output head are read once per
    /// token, so the bytes streamed per token are the total minus what is
    /// kept: keeping the largest items first (greedy by size) minimizes
    /// streamed bytes for items of (nearly) equal size, which decoder layers
    /// are. What is left of the cap after that goes to the first rows of a
    /// head that did not fit whole ([`ResidencyPlan::output_kept_bytes`]),
    /// or in a mixture-of-experts model to the expert cache. A
    /// mixture-of-experts model that does not fit whole first sets aside
    /// what one layer's routed experts take while they run.
    pub fn new(policy: Residency, manifest: &Manifest) -> ResidencyPlan {
        let n = manifest.layers.len();
        let moe = manifest.experts;
        let total: u64 =
            manifest.layers.iter().map(|l| l.bytes).sum::<u64>() + manifest.output.bytes;
        let fits_whole = |cap: u64| total <= cap;
        let split = moe.is_some() && matches!(policy, Residency::Cap(cap) if !fits_whole(cap));
        // What keeping layer `l` holds, and what streaming it reads per token.
        let kept_bytes = |l: &flatrun_model::manifest::LayerEntry| {
            if split { l.dense_bytes() } else { l.bytes }
        };
        let streamed_bytes = |l: &flatrun_model::manifest::LayerEntry| match moe {
            Some(c) => l.dense_bytes() + c.used_bytes(l.expert_bytes()),
            None => l.bytes,
        };
        let (resident, output_resident, output_kept_bytes, expert_cache_bytes) = match policy {
            Residency::Resident => (vec![true; n], true, 0, 0),
            Residency::Stream => (vec![false; n], false, 0, 0),
            Residency::Custom(choose) => {
                let mut resident = choose(manifest);
                resident.resize(n, false);
                (resident, false, 0, 0)
            }
            Residency::Cap(cap) if moe.is_some() && fits_whole(cap) => (vec![true; n], true, 0, 0),
            Residency::Cap(cap) => {
                // The running layer's routed experts, held while it runs.
                let working = match moe {
                    Some(c) => manifest
                        .layers
                        .iter()
                        .map(|l| c.used_bytes(l.expert_bytes()))
                        .max()
                        .unwrap_or(0),
                    None => 0,
                };
                // Candidates: (bytes, Some(layer)) or (bytes, None) for the head.
                let mut items: Vec<(u64, Option<usize>)> = manifest
                    .layers
                    .iter()
                    .map(|l| (kept_bytes(l), Some(l.index)))
                    .chain(std::iter::once((manifest.output.bytes, None)))
                    .collect();
                items.sort_by_key(|&(bytes, _)| std::cmp::Reverse(bytes));
                let mut left = cap.saturating_sub(working);
                let mut resident = vec![false; n];
                let mut head = false;
                for (bytes, which) in items {
                    if bytes <= left {
                        left -= bytes;
                        match which {
                            Some(i) => resident[i] = true,
                            None => head = true,
                        }
                    }
                }
                // The rest of the cap: the expert cache, else the head's
                // first rows.
                match (split, head) {
                    (true, _) => (resident, head, 0, left),
                    (false, true) => (resident, head, 0, 0),
                    (false, false) => (resident, head, left, 0),
                }
            }
        };
        let kept: u64 = manifest
            .layers
            .iter()
            .filter(|l| resident[l.index])
            .map(kept_bytes)
            .sum::<u64>()
            + if output_resident {
                manifest.output.bytes
            } else {
                output_kept_bytes
            };
        let streamed: u64 = manifest
            .layers
            .iter()
            .map(|l| match (resident[l.index], moe) {
                // A kept dense part still reads its routed experts.
                (true, Some(c)) if split => c.used_bytes(l.expert_bytes()),
                (true, _) => 0,
                (false, _) => streamed_bytes(l),
            })
            .sum::<u64>()
            + if output_resident {
                0
            } else {
                manifest.output.bytes - output_kept_bytes
            };
        ResidencyPlan {
            resident,
            output_resident,
            output_kept_bytes,
            split_experts: split,
            expert_cache_bytes,
            resident_bytes: kept + expert_cache_bytes,
            streamed_bytes_per_token: streamed,
        }
    }

    /// Whether every layer is kept whole, routed experts included (so none
    /// is read once routed).
    pub fn keeps_experts_whole(&self) -> bool {
        !self.split_experts && self.resident.iter().all(|&r| r)
    }

    /// The plan with an expert cache of `bytes` in place of the one it
    /// planned (a mixture-of-experts model given a cache explicitly); a
    /// model without routed experts, or with all of them kept, has none.
    pub fn with_expert_cache(mut self, manifest: &Manifest, bytes: Option<u64>) -> ResidencyPlan {
        let Some(bytes) = bytes else { return self };
        let bytes = if manifest.experts.is_none() || self.keeps_experts_whole() {
            0
        } else {
            bytes
        };
        self.resident_bytes = self.resident_bytes - self.expert_cache_bytes + bytes;
        self.expert_cache_bytes = bytes;
        self
    }

    /// Plan `policy` like [`ResidencyPlan::new`], where a `Cap` also pays
    /// for the buffers that streamed items are read into: `depth + 1`
    /// buffers of the largest layer or head chunk (`chunk_bytes`), so that
    /// kept weights plus read buffers stay within the cap.
    pub fn with_stream_buffers(
        policy: Residency,
        manifest: &Manifest,
        depth: usize,
        chunk_bytes: u64,
    ) -> ResidencyPlan {
        let policy = match policy {
            Residency::Cap(cap) => {
                let largest = manifest.largest_dense_layer_bytes().max(chunk_bytes);
                let reserve = largest.saturating_mul(depth.max(1) as u64 + 1);
                Residency::Cap(cap.saturating_sub(reserve))
            }
            other => other,
        };
        ResidencyPlan::new(policy, manifest)
    }

    /// The same plan with nothing of a partly kept head kept (for paths
    /// that stream the head whole).
    pub fn without_partial_head(mut self) -> ResidencyPlan {
        self.resident_bytes -= self.output_kept_bytes;
        self.streamed_bytes_per_token += self.output_kept_bytes;
        self.output_kept_bytes = 0;
        self
    }

    /// The plan with the partly kept head rounded down to whole rows of
    /// `row_bytes`; returns the plan and the number of kept rows.
    pub fn with_head_rows(mut self, row_bytes: u64) -> (ResidencyPlan, usize) {
        let rows = self.output_kept_bytes / row_bytes.max(1);
        let kept = rows * row_bytes;
        self.resident_bytes -= self.output_kept_bytes - kept;
        self.streamed_bytes_per_token += self.output_kept_bytes - kept;
        self.output_kept_bytes = kept;
        (self, rows as usize)
    }

    /// Whether layer `i` is kept resident.
    pub fn is_resident(&self, i: usize) -> bool {
        self.resident.get(i).copied().unwrap_or(false)
    }
}

/// Context size used when a checkpoint does not say its trained context.
pub const FALLBACK_CONTEXT: usize = 4096;

/// Share of the headroom the default residency lets the model plan for
/// when everything (weights and the whole cache) stays resident; above it
/// the default streams.
const RESIDENT_SHARE: f64 = 0.6;
/// Share of the headroom a default cap gives the weights (kept layers and
/// read buffers): the rest is left for the work buffers, the allocator and
/// the cache pages in flight. (Qwen2.5-Coder-0.5B in a 234 MB cgroup decodes
/// fastest with a cap near 85% of it.)
const CAP_SHARE: f64 = 0.9;

/// What a model will hold in memory with some [`LoadOptions`], worked out
/// from the manifest before any weight is read: weights kept resident,
/// read buffers of what streams, the KV cache at the context size (and how
/// much of it is in memory at once), and the work buffers of a step. The
/// executor loads only a plan that fits ([`MemoryPlan::check`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemoryPlan {
    /// The residency policy planned for.
    pub residency: Residency,
    /// Context size in tokens (the model's trained context unless lowered).
    pub ctx: usize,
    /// Element types of keys and values.
    pub kv_types: (KvType, KvType),
    /// Bytes of one sequence's whole KV cache at `ctx`.
    pub kv_bytes: u64,
    /// The cache lives in a file mapping, a layer at a time in memory
    /// (stream and cap residency), rather than in anonymous memory.
    pub kv_streamed: bool,
    /// Bytes of the cache mapped at once: all of it, or when streamed the
    /// two largest layers (the one running and the one read ahead).
    pub kv_in_memory_bytes: u64,
    /// Weight bytes kept resident.
    pub resident_weight_bytes: u64,
    /// Weight bytes read per token.
    pub streamed_bytes_per_token: u64,
    /// Read buffers of streamed weights.
    pub stream_buffer_bytes: u64,
    /// Activations and scratch of one step of `max_batch` tokens, logits.
    pub work_bytes: u64,
    /// The estimated peak: the sum of the above that are in memory at once.
    pub peak_bytes: u64,
    /// What the process may still fill ([`crate::memory::memory_headroom`]),
    /// when known.
    pub headroom: Option<u64>,
    /// Head size (quantized caches need whole blocks of 32 per head).
    head_dim: usize,
}

/// The context a model runs at: `opts.ctx`, else its trained context.
pub fn context_size(cfg: &ModelConfig, opts: &LoadOptions) -> usize {
    match (opts.ctx, cfg.context_length) {
        (Some(n), _) => n.max(1),
        (None, 0) => FALLBACK_CONTEXT,
        (None, n) => n,
    }
}

/// Read-ahead depth of the options' prefetch.
fn read_depth(opts: &LoadOptions) -> usize {
    match opts.prefetch {
        Prefetch::Ahead { depth } => depth,
        Prefetch::Off => 0,
    }
}

impl MemoryPlan {
    /// Plan `opts` for a model of `cfg` and `manifest`, with `headroom`
    /// bytes of memory left to the process (`None`: unknown).
    pub fn new(
        cfg: &ModelConfig,
        manifest: &Manifest,
        opts: &LoadOptions,
        headroom: Option<u64>,
    ) -> MemoryPlan {
        let ctx = context_size(cfg, opts);
        let kv_types = opts.kv_types();
        let layers =
            KvCache::planned_layer_bytes(cfg, ctx, opts.max_batch.max(1), kv_types.0, kv_types.1);
        let kv_bytes: u64 = layers.iter().sum();
        let kv_streamed = !matches!(opts.residency, Residency::Resident);
        let kv_in_memory_bytes = if kv_streamed {
            let mut sorted = layers.clone();
            sorted.sort_unstable_by(|a, b| b.cmp(a));
            sorted.iter().take(2).sum()
        } else {
            kv_bytes
        };
        let depth = read_depth(opts).max(1) as u64;
        let largest = manifest.largest_dense_layer_bytes();
        let weights = ResidencyPlan::with_stream_buffers(
            opts.residency,
            manifest,
            depth as usize,
            largest.min(4 << 20),
        )
        .with_expert_cache(manifest, opts.expert_cache_bytes);
        let all_kept = weights.resident.iter().all(|&r| r);
        let stream_buffer_bytes = match opts.residency {
            Residency::Resident => 0,
            // Row chunks in flight, and one chunk of the head.
            Residency::Stream => (depth + 2) * opts.stream_chunk_bytes as u64,
            Residency::Cap(_) | Residency::Custom(_) => {
                if all_kept {
                    0
                } else {
                    (depth + 1) * largest
                }
            }
        };
        // The running layer's routed experts, read once routed, and the
        // next layer's, read ahead on a prediction.
        let experts_in_flight = match manifest.experts {
            Some(c) if !weights.keeps_experts_whole() => {
                let ahead = if opts.expert_prefetch { 2 } else { 1 };
                ahead
                    * manifest
                        .layers
                        .iter()
                        .map(|l| c.used_bytes(l.expert_bytes()))
                        .max()
                        .unwrap_or(0)
            }
            _ => 0,
        };
        let stream_buffer_bytes = stream_buffer_bytes + experts_in_flight;
        let work_bytes = work_bytes(cfg, opts.max_batch.max(1), manifest.vocab_size());
        let peak_bytes =
            weights.resident_bytes + stream_buffer_bytes + kv_in_memory_bytes + work_bytes;
        MemoryPlan {
            residency: opts.residency,
            ctx,
            kv_types,
            kv_bytes,
            kv_streamed,
            kv_in_memory_bytes,
            resident_weight_bytes: weights.resident_bytes,
            streamed_bytes_per_token: weights.streamed_bytes_per_token,
            stream_buffer_bytes,
            work_bytes,
            peak_bytes,
            headroom,
            head_dim: cfg.head_dim,
        }
    }

    /// The residency a user who passes no flag gets: everything resident
    /// when the weights, the whole cache and the work buffers take at most
    /// 60% of the headroom (inside a memory cgroup, its limit less its
    /// usage: see [`crate::memory::memory_headroom`]); else a cap of 90% of
    /// the headroom, with the cache streamed from its file (whose pages,
    /// like the kept weights', are file pages the kernel can write back and
    /// reclaim, so a long context slows down rather than fails); stream mode
    /// when the cap would not hold the layers in flight. Resident when the
    /// headroom is unknown.
    pub fn default_residency(
        cfg: &ModelConfig,
        manifest: &Manifest,
        opts: &LoadOptions,
        headroom: Option<u64>,
    ) -> Residency {
        let Some(headroom) = headroom else {
            return Residency::Resident;
        };
        let resident = MemoryPlan::new(
            cfg,
            manifest,
            &LoadOptions {
                residency: Residency::Resident,
                ..opts.clone()
            },
            Some(headroom),
        );
        if resident.peak_bytes as f64 <= headroom as f64 * RESIDENT_SHARE {
            return Residency::Resident;
        }
        let cap = (headroom as f64 * CAP_SHARE) as u64;
        let in_flight = (read_depth(opts).max(1) as u64 + 1) * manifest.largest_dense_layer_bytes();
        if cap <= in_flight {
            Residency::Stream
        } else {
            Residency::Cap(cap)
        }
    }

    /// The plan that keeps a model within `budget` bytes of peak memory:
    /// everything resident when that whole plan fits (weights, the cache at
    /// the context size, work buffers), else a cap on the kept weights with
    /// the cache streamed from its file, else stream mode. The plan
    /// returned may still exceed `budget` (stream mode is the least a model
    /// needs); callers compare [`MemoryPlan::peak_bytes`].
    pub fn within(
        cfg: &ModelConfig,
        manifest: &Manifest,
        opts: &LoadOptions,
        budget: u64,
    ) -> MemoryPlan {
        let plan = |residency| {
            MemoryPlan::new(
                cfg,
                manifest,
                &LoadOptions {
                    residency,
                    ..opts.clone()
                },
                None,
            )
        };
        let resident = plan(Residency::Resident);
        if resident.peak_bytes <= budget {
            return resident;
        }
        let stream = plan(Residency::Stream);
        // A cap holds the kept weights and the read buffers; the streamed
        // cache's layers in memory and the work buffers come on top.
        if let Some(cap) = budget.checked_sub(stream.kv_in_memory_bytes + stream.work_bytes) {
            let capped = plan(Residency::Cap(cap));
            if capped.check().is_ok()
                && capped.resident_weight_bytes > 0
                && capped.peak_bytes <= budget
            {
                return capped;
            }
        }
        stream
    }

    /// An error, before anything is read, when the plan cannot work: a
    /// quantized cache whose heads are not whole blocks, a cap below the
    /// read buffers it must hold, or more than the memory left to the
    /// process in what must stay in memory: the kept weights, the read
    /// buffers and an anonymous (resident) cache. (The work buffers are
    /// sized for the largest batch and a streamed cache's pages are file
    /// pages the kernel reclaims; both count in the peak shown, not here.)
    /// The message says what would fit.
    pub fn check(&self) -> Result<()> {
        let refuse = |what: String| Err(RuntimeError::MemoryPlan(what));
        for kind in [self.kv_types.0, self.kv_types.1] {
            if kind.is_block() && !self.head_dim.is_multiple_of(32) {
                return refuse(format!(
                    "a {kind} KV cache needs heads of a multiple of 32 values; this model's have {} \
                     (use --kv-type f16)",
                    self.head_dim
                ));
            }
        }
        if let Residency::Cap(cap) = self.residency
            && self.stream_buffer_bytes > cap
        {
            return refuse(format!(
                "cap={} cannot hold the {} of read buffers that streaming needs (the layers in flight); \
                 use a larger cap or --residency stream",
                human_bytes(cap),
                human_bytes(self.stream_buffer_bytes)
            ));
        }
        let must_fit = self.resident_weight_bytes
            + self.stream_buffer_bytes
            + if self.kv_streamed { 0 } else { self.kv_bytes };
        if let Some(headroom) = self.headroom
            && must_fit > headroom
        {
            let kv_hint = if self.kv_streamed {
                String::new()
            } else {
                format!(
                    "; the KV cache alone is {} at {} tokens: lower --ctx, use --kv-type q8_0, \
                     or --residency stream (which streams the cache from a file)",
                    human_bytes(self.kv_bytes),
                    self.ctx
                )
            };
            return refuse(format!(
                "this plan keeps {} in memory (weights {}, read buffers {}, KV cache {}; work buffers {} more) \
                 but only {} is available{kv_hint}",
                human_bytes(must_fit),
                human_bytes(self.resident_weight_bytes),
                human_bytes(self.stream_buffer_bytes),
                human_bytes(if self.kv_streamed { 0 } else { self.kv_bytes }),
                human_bytes(self.work_bytes),
                human_bytes(headroom),
            ));
        }
        Ok(())
    }

    /// The plan in a few lines, as `run -v` and `inspect` print it.
    pub fn summary(&self) -> String {
        let kv = if self.kv_streamed {
            format!(
                "{} at {} tokens, {}/{} (streamed from a file: {} in memory)",
                human_bytes(self.kv_bytes),
                self.ctx,
                self.kv_types.0,
                self.kv_types.1,
                human_bytes(self.kv_in_memory_bytes)
            )
        } else {
            format!(
                "{} at {} tokens, {}/{} (in memory, filled as the context grows)",
                human_bytes(self.kv_bytes),
                self.ctx,
                self.kv_types.0,
                self.kv_types.1
            )
        };
        let headroom = match self.headroom {
            Some(h) => format!(" of {} available", human_bytes(h)),
            None => String::new(),
        };
        format!(
            "weights:   {} resident, {} streamed per token, {} read buffers\n\
             kv cache:  {kv}\n\
             peak:      about {} with the context full{headroom} (work buffers {})",
            human_bytes(self.resident_weight_bytes),
            human_bytes(self.streamed_bytes_per_token),
            human_bytes(self.stream_buffer_bytes),
            human_bytes(self.peak_bytes),
            human_bytes(self.work_bytes),
        )
    }
}

/// Activations and scratch of a step of `batch` tokens (hidden states,
/// projections, FFN intermediates), and two rows of logits.
fn work_bytes(cfg: &ModelConfig, batch: usize, vocab: usize) -> u64 {
    let per_token = 4 * cfg.n_embd + 2 * cfg.n_ff + cfg.q_dim() + 2 * cfg.kv_dim();
    ((batch * per_token + 2 * vocab) * 4) as u64
}

/// Bytes in binary units (`512.0 MiB`), for messages and tables.
pub fn human_bytes(bytes: u64) -> String {
    let mut value = bytes as f64;
    let mut unit = 0;
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}
