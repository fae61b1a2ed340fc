//! Flags shared by `run`, `chat`, `bench` and `serve`: how the model is
//! loaded ([`EngineFlags`]), how tokens are chosen ([`SamplingFlags`]),
//! speculative decoding ([`SpeculationFlags`]), and how chatty the command
//! is ([`OutputFlags`]).

use anyhow::{Context, Result, bail};
use flatrun_runtime::{
    BackendKind, ExpertPolicy, KvType, LayerSelection, LoadOptions, MlxActivations, Model,
    Prefetch, Residency, SamplingParams, Speculation, StreamReads, WeightsMode,
};
use std::path::{Path, PathBuf};

/// How the model is loaded and executed.
#[derive(Clone, Debug, clap::Args)]
pub struct EngineFlags {
    /// Kernels: `native` (SIMD, threaded) or `reference` (scalar, for checking).
    #[arg(long, default_value = "native", value_parser = ["native", "reference"])]
    pub backend: String,
    /// MLX weights on the native backend: `f32` (the format's numerics, as mlx-lm:
    /// dequantized weights times f32 activations) or `q8` (ggml's: activations
    /// quantized to 8 bits, integer dots; 4- and 8-bit layouts).
    #[arg(long, default_value = "f32", value_parser = ["f32", "q8"])]
    pub mlx_activations: String,
    /// Kernel threads [default: physical cores].
    #[arg(long)]
    pub threads: Option<usize>,
    /// Context size in tokens [default: the model's trained context].
    #[arg(long)]
    pub ctx: Option<usize>,
    /// `stream` (one layer resident), `resident`, or `cap=SIZE` (e.g. cap=512M, cap=2G)
    /// [default: resident when the weights and the whole KV cache fit comfortably in the
    /// memory available (inside a container: its memory cgroup's limit less its usage),
    /// else a cap of what fits].
    /// `bench` measures every mode given (repeat the flag or separate with commas).
    #[arg(long, value_name = "MODE", value_delimiter = ',')]
    pub residency: Vec<String>,
    /// Streamed items read ahead of the one in use (0 = no read-ahead
    /// thread): whole layers under a cap, row chunks of `--stream-chunk`
    /// bytes in stream mode.
    #[arg(long, default_value_t = 1)]
    pub prefetch: usize,
    /// Streamed matrices are read in row chunks of at most this size
    /// (e.g. 2M, 512K): at most (prefetch + 1) chunks of weights are in memory.
    #[arg(long, value_name = "SIZE", default_value = "2M")]
    pub stream_chunk: String,
    /// How streamed weights are read: `direct` (O_DIRECT, bypassing the
    /// page cache, so a tight memory cgroup keeps the kept layers),
    /// `page-cache` (buffered, fast when the file is cached), or `auto`
    /// (stream mode: page-cache; a cap: page-cache when free memory holds
    /// the kept bytes and twice the streamed ones).
    #[arg(long, value_name = "MODE", default_value = "auto")]
    pub stream_reads: String,
    /// Mixture-of-experts models: which routed experts the expert cache
    /// keeps when full, `lfu` (used most often) or `lru` (used most recently).
    #[arg(long, value_name = "POLICY", default_value = "lfu", value_parser = ["lfu", "lru"])]
    pub expert_policy: String,
    /// Mixture-of-experts models: do not read the next layer's predicted
    /// experts ahead while a layer computes.
    #[arg(long)]
    pub no_expert_prefetch: bool,
    /// Mixture-of-experts models: bytes of routed experts kept after use
    /// (e.g. 2G) [default: under a cap, what it leaves after the dense
    /// weights; in stream mode none].
    #[arg(long, value_name = "SIZE")]
    pub expert_cache: Option<String>,
    /// KV cache element type of keys and values: f16, f32, q8_0 or q4_0
    /// (quantized blocks of 32, read directly by attention).
    #[arg(long, default_value = "f16", value_parser = KV_TYPES)]
    pub kv_type: String,
    /// Element type of the keys only (like llama.cpp's -ctk) [default: --kv-type].
    #[arg(long, value_parser = KV_TYPES)]
    pub kv_type_k: Option<String>,
    /// Element type of the values only (like llama.cpp's -ctv) [default: --kv-type].
    #[arg(long, value_parser = KV_TYPES)]
    pub kv_type_v: Option<String>,
    /// Where the streamed KV cache (stream and cap residency) keeps its file: a
    /// directory, or a path the file is named after (removed on exit)
    /// [default: the temporary directory].
    #[arg(long, value_name = "PATH")]
    pub kv_file: Option<PathBuf>,
    /// Weights: `keep` (quantized blocks, fused kernels), or `f16`/`f32` (dequantize the
    /// resident layers once at load; needs --residency resident).
    #[arg(long, default_value = "keep", value_parser = ["keep", "f16", "f32"])]
    pub weights: String,
    /// Run only these decoder layers, e.g. `0-11`, `5` or `0-3,8-11` (research; the others
    /// are skipped: identity on the residual stream) [default: all].
    #[arg(long, value_name = "RANGE")]
    pub layers: Option<String>,
    /// Print the profile summary (per-op times, tokens/s, I/O wait, memory) at the end.
    #[arg(long)]
    pub profile: bool,
    /// Print a per-layer table (I/O wait, each op, total, bytes read) as well as the summary.
    #[arg(long)]
    pub profile_detailed: bool,
    /// Write a Chrome-trace JSON profile to FILE (open in ui.perfetto.dev).
    #[arg(long, value_name = "FILE")]
    pub profile_save: Option<PathBuf>,
    /// Sample RSS and page-cache residency after every layer.
    #[arg(long)]
    pub trace_memory: bool,
}

/// The KV cache element types the flags take.
const KV_TYPES: [&str; 4] = ["f16", "f32", "q8_0", "q4_0"];

/// How the next token is chosen.
#[derive(Clone, Debug, clap::Args)]
pub struct SamplingFlags {
    /// Sampling temperature (0 = greedy).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Keep only the K most likely tokens (0 = off).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Nucleus sampling: keep tokens up to this cumulative probability (1 = off).
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Drop tokens less likely than this × the most likely one (0 = off).
    #[arg(long, default_value_t = 0.0)]
    pub min_p: f32,
    /// Penalize recently seen tokens (1 = off).
    #[arg(long, default_value_t = 1.0)]
    pub repeat_penalty: f32,
    /// Random seed [default: from the clock].
    #[arg(long)]
    pub seed: Option<u64>,
    /// Stop when the text contains this string (repeatable).
    #[arg(long, value_name = "TEXT")]
    pub stop: Vec<String>,
}

/// Speculative decoding: proposals checked several at a time by one pass.
#[derive(Clone, Debug, Default, clap::Args)]
pub struct SpeculationFlags {
    /// Speculative decoding with this draft model (a smaller checkpoint with the same
    /// tokenizer as --model), kept resident.
    #[arg(long, value_name = "MODEL", conflicts_with = "lookup")]
    pub draft: Option<PathBuf>,
    /// Speculative decoding by prompt lookup: propose what followed the latest earlier
    /// occurrence of the text's last tokens (no extra model or memory).
    #[arg(long)]
    pub lookup: bool,
    /// Most tokens proposed per pass (the number adapts between 1 and this).
    #[arg(long, value_name = "N", default_value_t = 8)]
    pub draft_max: usize,
    /// Always propose --draft-max tokens instead of adapting the number.
    #[arg(long)]
    pub draft_fixed: bool,
}

impl SpeculationFlags {
    /// The runtime's settings, or `None` when neither `--draft` nor `--lookup` is given.
    pub fn speculation(&self) -> Result<Option<Speculation>> {
        if self.draft_max == 0 {
            bail!("--draft-max must be at least 1");
        }
        let spec = if self.lookup {
            Speculation::lookup(self.draft_max)
        } else if self.draft.is_some() {
            Speculation::draft(self.draft_max)
        } else {
            return Ok(None);
        };
        Ok(Some(Speculation {
            adaptive: !self.draft_fixed,
            ..spec
        }))
    }

    /// Load the `--draft` model (resident, with the target's kernels and
    /// threads) and attach it to `model`.
    pub fn attach_draft(&self, model: &mut Model, engine: &EngineFlags, quiet: bool) -> Result<()> {
        let Some(path) = &self.draft else {
            return Ok(());
        };
        crate::loading::check_model_path(path)?;
        let mut flags = engine.clone();
        flags.residency = vec!["resident".into()];
        flags.ctx = Some(model.executor().context_size());
        flags.profile = false;
        flags.profile_detailed = false;
        flags.profile_save = None;
        let options = flags.load_options(path)?;
        let started = std::time::Instant::now();
        let draft = Model::load(path, options)
            .with_context(|| format!("loading the draft model {}", path.display()))?;
        model
            .set_draft(draft)
            .with_context(|| format!("{} cannot draft for this model", path.display()))?;
        if !quiet {
            eprintln!(
                "draft model: {} ({}, resident, {:.2} s)",
                path.display(),
                human_bytes(weight_bytes(path)),
                started.elapsed().as_secs_f64()
            );
        }
        Ok(())
    }
}

/// Verbosity.
#[derive(Clone, Copy, Debug, clap::Args)]
pub struct OutputFlags {
    /// Print more details (timings, residency plan).
    #[arg(short, long, conflicts_with = "quiet")]
    pub verbose: bool,
    /// Print only the generated text (no header, no summary).
    #[arg(short, long)]
    pub quiet: bool,
}

impl EngineFlags {
    /// Whether any profiling output was asked for.
    pub fn profiling(&self) -> bool {
        self.profile || self.profile_detailed || self.profile_save.is_some()
    }

    /// The residency policy: the flag, or the one the memory plan picks
    /// from the memory available ([`flatrun_runtime::default_residency`]).
    pub fn residency_for(&self, model: &Path) -> Result<Residency> {
        Ok(self.load_options(model)?.residency)
    }

    /// Check the flag values and build the runtime's [`LoadOptions`].
    pub fn load_options(&self, model: &Path) -> Result<LoadOptions> {
        let backend: BackendKind = self
            .backend
            .parse()
            .map_err(|e| anyhow::anyhow!("--backend: {e}"))?;
        let mlx_activations: MlxActivations = self
            .mlx_activations
            .parse()
            .map_err(|e| anyhow::anyhow!("--mlx-activations: {e}"))?;
        let kv_type = |flag: &str, text: &str| -> Result<KvType> {
            text.parse().map_err(|e| anyhow::anyhow!("--{flag}: {e}"))
        };
        let both = kv_type("kv-type", &self.kv_type)?;
        let keys = match &self.kv_type_k {
            Some(t) => kv_type("kv-type-k", t)?,
            None => both,
        };
        let values = match &self.kv_type_v {
            Some(t) => kv_type("kv-type-v", t)?,
            None => both,
        };
        let weights: WeightsMode = self
            .weights
            .parse()
            .map_err(|e| anyhow::anyhow!("--weights: {e}"))?;
        let layers = match &self.layers {
            Some(range) => Some(parse_layers(range)?),
            None => None,
        };
        let stream_reads: StreamReads = self
            .stream_reads
            .parse()
            .map_err(|e| anyhow::anyhow!("--stream-reads: {e}"))?;
        let expert_policy: ExpertPolicy = self
            .expert_policy
            .parse()
            .map_err(|e| anyhow::anyhow!("--expert-policy: {e}"))?;
        let expert_cache_bytes = match &self.expert_cache {
            Some(size) => Some(
                flatrun_runtime::parse_size(size)
                    .map_err(|e| anyhow::anyhow!("--expert-cache: {e}"))?,
            ),
            None => None,
        };
        let residency = match self.residency.last() {
            Some(text) => parse_residency(text)?,
            None => Residency::Resident,
        };
        if self.threads == Some(0) {
            bail!("--threads must be at least 1");
        }
        if self.ctx == Some(0) {
            bail!("--ctx must be at least 1");
        }
        let mut options = LoadOptions {
            backend,
            mlx_activations,
            threads: self.threads,
            residency,
            prefetch: if self.prefetch == 0 {
                Prefetch::Off
            } else {
                Prefetch::Ahead {
                    depth: self.prefetch,
                }
            },
            ctx: self.ctx,
            kv_type: keys,
            kv_type_v: Some(values),
            kv_file: self.kv_file.clone(),
            stream_chunk_bytes: flatrun_runtime::parse_size(&self.stream_chunk)?.max(1) as usize,
            profile: self.profiling(),
            trace_memory: self.trace_memory || self.profile_detailed,
            weights,
            layers,
            stream_reads,
            expert_policy,
            expert_prefetch: !self.no_expert_prefetch,
            expert_cache_bytes,
            ..LoadOptions::default()
        };
        if self.residency.is_empty() && model.exists() {
            options.residency = flatrun_runtime::default_residency(model, &options)
                .map_err(|e| anyhow::anyhow!("cannot load {}: {e}", model.display()))?;
        }
        if weights != WeightsMode::Keep && options.residency == Residency::Stream {
            bail!(
                "--weights {weights} needs --residency resident: streamed layers would be dequantized again \
                 at every acquisition (several times the bytes per token)\n\
                 hint: add --residency resident, or use --weights keep"
            );
        }
        Ok(options)
    }
}

impl SamplingFlags {
    /// Check the values and build the runtime's [`SamplingParams`].
    pub fn params(&self) -> Result<SamplingParams> {
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            bail!("--temperature must be a number >= 0 (0 = greedy)");
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            bail!("--top-p must be in (0, 1]");
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            bail!("--min-p must be in [0, 1]");
        }
        if !(self.repeat_penalty > 0.0 && self.repeat_penalty.is_finite()) {
            bail!("--repeat-penalty must be > 0 (1 = off)");
        }
        Ok(SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repeat_penalty: self.repeat_penalty,
            penalty_window: if self.repeat_penalty != 1.0 { 64 } else { 0 },
            seed: self.seed,
            ..SamplingParams::default()
        })
    }
}

/// `stream`, `resident` or `cap=SIZE`, with a message that says what to do.
pub fn parse_residency(text: &str) -> Result<Residency> {
    text.parse::<Residency>().map_err(|e| {
        anyhow::anyhow!(
            "--residency: {e}\nhint: use stream, resident, or cap=SIZE such as cap=512M or cap=2G"
        )
    })
}

/// `0-11`, `5` or `0-3,8-11`, with a message that says what to write.
pub fn parse_layers(range: &str) -> Result<LayerSelection> {
    range.parse::<LayerSelection>().map_err(|_| {
        anyhow::anyhow!(
            "--layers `{range}` is not a layer range\nhint: write it like 0-11, 5, or 0-3,8-11 (inclusive, 0-based)"
        )
    })
}

/// Bytes of the checkpoint's weight files (a file, or the files of a directory).
pub fn weight_bytes(model: &Path) -> u64 {
    if model.is_dir() {
        std::fs::read_dir(model)
            .map(|entries| {
                entries
                    .filter_map(|e| e.ok())
                    .filter(|e| {
                        let name = e.file_name().to_string_lossy().to_string();
                        name.ends_with(".safetensors") || name.ends_with(".gguf")
                    })
                    // Followed: hub cache snapshots hold links to blobs.
                    .filter_map(|e| std::fs::metadata(e.path()).ok())
                    .map(|m| m.len())
                    .sum()
            })
            .unwrap_or(0)
    } else {
        std::fs::metadata(model).map(|m| m.len()).unwrap_or(0)
    }
}

/// Read a prompt file, with a message naming it.
pub fn read_text_file(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))
}

/// Human-readable bytes (binary units).
pub use flatrun_runtime::human_bytes;

/// A residency policy as the flag would spell it.
pub fn residency_name(r: Residency) -> String {
    match r {
        Residency::Stream => "stream".into(),
        Residency::Resident => "resident".into(),
        Residency::Cap(bytes) => format!("cap={}", human_bytes(bytes).replace(' ', "")),
        Residency::Custom(_) => "custom".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layer_ranges() {
        assert_eq!(parse_layers("0-11").unwrap().count(30), 12);
        assert_eq!(parse_layers("3").unwrap().count(30), 1);
        assert_eq!(parse_layers("0-3,8-11").unwrap().count(30), 8);
        assert!(parse_layers("5-2").is_err());
        assert!(parse_layers("x").is_err());
    }
}
