//! Load-time options: backend, threads, residency policy, prefetch, context.

use crate::error::{Result, RuntimeError};
pub use flatrun_kernels::{BackendKind, MlxActivations};
use flatrun_model::Manifest;
use std::str::FromStr;

/// How much of the model stays resident between uses.
#[derive(Clone, Copy, Debug, Default)]
pub enum Residency {
    /// Only the executing layer's weights are resident; each layer's pages are
    /// released (`MADV_DONTNEED`) right after it ran.
    #[default]
    Stream,
    /// Keep as many layers resident as fit in this many bytes (choosing the
    /// ones that save the most streamed bytes per token), stream the rest.
    Cap(u64),
    /// Everything mapped and kept.
    Resident,
    /// A policy of your own: the function gets the model's manifest (every
    /// layer's index, tensors and bytes) and returns, per layer, whether to keep
    /// it resident; the other layers and the output head are streamed as under
    /// [`Residency::Cap`] (read into reused buffers). Missing entries count as
    /// streamed, extra ones are ignored.
    ///
    /// ```
    /// use flatrun_runtime::{Manifest, Residency};
    /// // Keep the first half of the layers resident.
    /// fn first_half(m: &Manifest) -> Vec<bool> {
    ///     let n = m.layers.len();
    ///     (0..n).map(|i| i < n / 2).collect()
    /// }
    /// let policy = Residency::Custom(first_half);
    /// # let _ = policy;
    /// ```
    Custom(fn(&Manifest) -> Vec<bool>),
}

impl PartialEq for Residency {
    /// Policies are equal when they are the same variant with the same cap, or
    /// `Custom` with the same function address (function addresses are not
    /// guaranteed unique, so two `Custom` policies compare by address only).
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (Residency::Stream, Residency::Stream) | (Residency::Resident, Residency::Resident) => {
                true
            }
            (Residency::Cap(a), Residency::Cap(b)) => a == b,
            (Residency::Custom(f), Residency::Custom(g)) => std::ptr::fn_addr_eq(*f, *g),
            _ => false,
        }
    }
}

impl Eq for Residency {}

impl FromStr for Residency {
    type Err = RuntimeError;
    /// `stream`, `resident`, or `cap=SIZE` with SIZE like `300M`, `1.5G`, `4096`.
    fn from_str(s: &str) -> Result<Self> {
        match s.trim() {
            "stream" => Ok(Residency::Stream),
            "resident" => Ok(Residency::Resident),
            other => match other.strip_prefix("cap=") {
                Some(size) => parse_size(size).map(Residency::Cap),
                None => Err(RuntimeError::Option {
                    option: "residency",
                    what: format!("`{other}` (expected stream, resident or cap=SIZE)"),
                }),
            },
        }
    }
}

/// Parse `123`, `64K`, `300M`, `1.5G` (binary units) into bytes.
pub fn parse_size(s: &str) -> Result<u64> {
    let s = s.trim();
    let (num, mult) = match s.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let m = match c.to_ascii_uppercase() {
                'K' => 1u64 << 10,
                'M' => 1 << 20,
                'G' => 1 << 30,
                'B' => 1,
                _ => 0,
            };
            (&s[..i], m)
        }
        _ => (s, 1),
    };
    let value: f64 = num.trim_end_matches(['i', 'I']).parse().unwrap_or(-1.0);
    if mult == 0 || !value.is_finite() || value < 0.0 {
        return Err(RuntimeError::Option {
            option: "size",
            what: format!("`{s}` is not a size like 300M or 1.5G"),
        });
    }
    Ok((value * mult as f64) as u64)
}

/// How the KV cache stores keys or values (llama.cpp's `-ctk`/`-ctv`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KvType {
    #[default]
    F16,
    F32,
    /// Blocks of 32 values as `d · q`, `q` 8-bit (34 bytes per block).
    Q8_0,
    /// Blocks of 32 values as `d · (q − 8)`, `q` 4-bit (18 bytes per block).
    Q4_0,
}

impl KvType {
    /// Bytes of `n` values (`n` a multiple of 32 for the block types).
    pub fn bytes(self, n: usize) -> usize {
        match self {
            KvType::F16 => n * 2,
            KvType::F32 => n * 4,
            KvType::Q8_0 => n.div_ceil(32) * 34,
            KvType::Q4_0 => n.div_ceil(32) * 18,
        }
    }
    /// Whether values are stored in blocks of 32 (a head must be whole blocks).
    pub fn is_block(self) -> bool {
        matches!(self, KvType::Q8_0 | KvType::Q4_0)
    }
    /// The name the flag takes.
    pub fn name(self) -> &'static str {
        match self {
            KvType::F16 => "f16",
            KvType::F32 => "f32",
            KvType::Q8_0 => "q8_0",
            KvType::Q4_0 => "q4_0",
        }
    }
}

impl std::fmt::Display for KvType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for KvType {
    type Err = RuntimeError;
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "f16" => Ok(KvType::F16),
            "f32" => Ok(KvType::F32),
            "q8_0" => Ok(KvType::Q8_0),
            "q4_0" => Ok(KvType::Q4_0),
            other => Err(RuntimeError::Option {
                option: "kv-type",
                what: format!("`{other}` (expected f32, f16, q8_0 or q4_0)"),
            }),
        }
    }
}

/// What a conversation longer than the context becomes
/// ([`crate::Model::fit_conversation`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ContextOverflow {
    /// Refuse it ([`RuntimeError::ContextOverflow`]).
    #[default]
    Error,
    /// Keep the system messages and the newest turns: drop the oldest other
    /// messages until the rendered conversation fits.
    TruncateMiddle,
}

impl FromStr for ContextOverflow {
    type Err = RuntimeError;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "error" => Ok(ContextOverflow::Error),
            "truncate-middle" => Ok(ContextOverflow::TruncateMiddle),
            other => Err(RuntimeError::Option {
                option: "context-overflow",
                what: format!("`{other}` (expected error or truncate-middle)"),
            }),
        }
    }
}

/// How streamed weights are read.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum StreamReads {
    /// `Stream` residency: `PageCache`. A cap or a custom policy:
    /// `PageCache` when memory is plentiful — the process's headroom
    /// (`memory_headroom` in `memory.rs`: `MemAvailable` and every memory
    /// cgroup's limit less its usage) holds the kept bytes, twice the
    /// streamed bytes and 256 MiB more — else `Direct`.
    #[default]
    Auto,
    /// `O_DIRECT` reads that bypass the page cache (or buffered reads
    /// dropped again with `POSIX_FADV_DONTNEED`): streamed bytes never
    /// crowd the kept layers out of a tight memory cgroup, but every token
    /// re-reads them from the disk.
    Direct,
    /// Buffered reads left in the page cache: a warm cache serves the
    /// streamed layers at memory speed when memory is not tight.
    PageCache,
}

impl FromStr for StreamReads {
    type Err = RuntimeError;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(StreamReads::Auto),
            "direct" => Ok(StreamReads::Direct),
            "page-cache" => Ok(StreamReads::PageCache),
            other => Err(RuntimeError::Option {
                option: "stream-reads",
                what: format!("`{other}` (expected auto, direct or page-cache)"),
            }),
        }
    }
}

/// Which routed experts the expert cache gives up first when it is full
/// (see [`crate::ResidencyPlan::expert_cache_bytes`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ExpertPolicy {
    /// The least recently used expert.
    Lru,
    /// The expert used least often since load (ties: least recently); a
    /// read expert used less often than every cached one is not cached.
    #[default]
    Lfu,
}

impl std::fmt::Display for ExpertPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ExpertPolicy::Lru => "lru",
            ExpertPolicy::Lfu => "lfu",
        })
    }
}

impl FromStr for ExpertPolicy {
    type Err = RuntimeError;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "lru" => Ok(ExpertPolicy::Lru),
            "lfu" => Ok(ExpertPolicy::Lfu),
            other => Err(RuntimeError::Option {
                option: "expert-policy",
                what: format!("`{other}` (expected lru or lfu)"),
            }),
        }
    }
}

/// How the weight engine reads ahead.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Prefetch {
    /// No read-ahead thread: the executor reads each streamed item, and
    /// faults in each kept layer, when it first needs it.
    Off,
    /// A background thread reads the `depth` streamed items (whole layers
    /// under a cap, row chunks in stream mode) after the one in use, and in
    /// its spare time faults in the kept layers before their first use.
    Ahead { depth: usize },
}

impl Default for Prefetch {
    fn default() -> Self {
        Prefetch::Ahead { depth: 1 }
    }
}

/// Default bytes of one streamed row chunk: with the default read-ahead of
/// one chunk, at most 4 MiB of weights are in flight.
pub const DEFAULT_CHUNK_BYTES: usize = 2 << 20;

/// Options of [`crate::Model::load`].
#[derive(Clone, Debug)]
pub struct LoadOptions {
    /// Kernel implementation.
    pub backend: BackendKind,
    /// How the native kernels multiply MLX weights: the format's numerics
    /// (f32 activations, the default) or ggml's (Q8 activations, 4/8-bit).
    pub mlx_activations: MlxActivations,
    /// Worker threads for the kernels (`None`: physical cores).
    pub threads: Option<usize>,
    /// Residency policy.
    pub residency: Residency,
    /// Read-ahead of upcoming layers.
    pub prefetch: Prefetch,
    /// Context size in tokens per sequence (`None`: the model's trained
    /// context, see [`crate::MemoryPlan`]).
    pub ctx: Option<usize>,
    /// KV cache element type of the keys, and of the values unless
    /// `kv_type_v` says otherwise.
    pub kv_type: KvType,
    /// KV cache element type of the values (`None`: `kv_type`).
    pub kv_type_v: Option<KvType>,
    /// Where a streamed KV cache (`Stream` and `Cap` residency) keeps its
    /// file (`None`: an unnamed temporary file).
    pub kv_file: Option<std::path::PathBuf>,
    /// Largest number of tokens pushed through a layer at once; longer
    /// prompts are split (this also sizes sliding-window ring buffers).
    pub max_batch: usize,
    /// Record per-op timings.
    pub profile: bool,
    /// Sample RSS and page-cache residency after every layer.
    pub trace_memory: bool,
    /// Run the layers' matrices quantized (`Keep`) or dequantized once to f16/f32.
    pub weights: crate::weights_override::WeightsMode,
    /// Run only these decoder layers (`None`: all).
    pub layers: Option<crate::layer_range::LayerSelection>,
    /// Streamed matrices (every layer in `Stream` mode, the head too) are
    /// read in row chunks of at most this many bytes, `prefetch` depth
    /// chunks ahead: at most `(depth + 1) × stream_chunk_bytes` of weights are
    /// in memory at once, however large a layer is.
    pub stream_chunk_bytes: usize,
    /// Whether streamed weights are read through the page cache or around it.
    pub stream_reads: StreamReads,
    /// Which experts a mixture-of-experts model's expert cache keeps.
    pub expert_policy: ExpertPolicy,
    /// Whether a layer predicts the next layer's routed experts (its router
    /// applied to this layer's residual stream) and reads them ahead, when
    /// that router is kept in memory. On by default.
    pub expert_prefetch: bool,
    /// Bytes of the expert cache (`None`: what a cap leaves after the dense
    /// weights; nothing in stream mode).
    pub expert_cache_bytes: Option<u64>,
}

impl LoadOptions {
    /// The element types of the keys and of the values.
    pub fn kv_types(&self) -> (KvType, KvType) {
        (self.kv_type, self.kv_type_v.unwrap_or(self.kv_type))
    }
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            backend: BackendKind::Native,
            mlx_activations: MlxActivations::F32,
            threads: None,
            residency: Residency::Resident,
            prefetch: Prefetch::default(),
            ctx: None,
            kv_type: KvType::F16,
            kv_type_v: None,
            kv_file: None,
            max_batch: 512,
            profile: false,
            trace_memory: false,
            weights: crate::weights_override::WeightsMode::Keep,
            layers: None,
            stream_chunk_bytes: DEFAULT_CHUNK_BYTES,
            stream_reads: StreamReads::Auto,
            expert_policy: ExpertPolicy::default(),
            expert_prefetch: true,
            expert_cache_bytes: None,
        }
    }
}
