//! Flags shared by `run`, `chat`, `bench` and `serve`: how the model is
//! loaded ([`EngineFlags`]), how tokens are chosen ([`SamplingFlags`]),
//! speculative decoding ([`SpeculationFlags`]), and how chatty the command
//! is ([`OutputFlags`]).

use anyhow::{Context, Result, bail};
use flatrun_runtime::{
    BackendKind, KvType, LayerSelection, LoadOptions, Model, Prefetch, Residency, SamplingParams,
    Speculation, StreamReads, WeightsMode,
};
use std::path::{Path, PathBuf};

/// How the model is loaded and executed.
#[derive(Clone, Debug, clap::Args)]
pub struct EngineFlags {
    /// Kernels: `native` (SIMD, threaded) or `reference` (scalar, for checking).
    #[arg(long, default_value = "native", value_parser = ["native", "reference"])]
    pub backend: String,
    /// Kernel threads [default: physical cores].
    #[arg(long)]
    pub threads: Option<usize>,
    /// Context size in tokens [default: the model's, at most 4096].
    #[arg(long)]
    pub ctx: Option<usize>,
    /// `stream` (one layer resident), `resident`, or `cap=SIZE` (e.g. cap=512M, cap=2G)
    /// [default: resident when the model fits comfortably in free memory, else a cap].
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
    /// KV cache element type: f16 or f32.
    #[arg(long, default_value = "f16", value_parser = ["f16", "f32"])]
    pub kv_type: String,
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

    /// The residency policy: the flag, or one chosen from free memory.
    pub fn residency_for(&self, model: &Path) -> Result<Residency> {
        match self.residency.last() {
            Some(text) => parse_residency(text),
            None => Ok(default_residency(weight_bytes(model), available_memory())),
        }
    }

    /// Check the flag values and build the runtime's [`LoadOptions`].
    pub fn load_options(&self, model: &Path) -> Result<LoadOptions> {
        let backend: BackendKind = self
            .backend
            .parse()
            .map_err(|e| anyhow::anyhow!("--backend: {e}"))?;
        let kv_type: KvType = self
            .kv_type
            .parse()
            .map_err(|e| anyhow::anyhow!("--kv-type: {e}"))?;
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
        let residency = self.residency_for(model)?;
        if weights != WeightsMode::Keep && residency == Residency::Stream {
            bail!(
                "--weights {weights} needs --residency resident: streamed layers would be dequantized again \
                 at every acquisition (several times the bytes per token)\n\
                 hint: add --residency resident, or use --weights keep"
            );
        }
        if self.threads == Some(0) {
            bail!("--threads must be at least 1");
        }
        if self.ctx == Some(0) {
            bail!("--ctx must be at least 1");
        }
        Ok(LoadOptions {
            backend,
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
            kv_type,
            stream_chunk_bytes: flatrun_runtime::parse_size(&self.stream_chunk)?.max(1) as usize,
            profile: self.profiling(),
            trace_memory: self.trace_memory || self.profile_detailed,
            weights,
            layers,
            stream_reads,
            ..LoadOptions::default()
        })
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
                    .filter_map(|e| e.metadata().ok())
                    .map(|m| m.len())
                    .sum()
            })
            .unwrap_or(0)
    } else {
        std::fs::metadata(model).map(|m| m.len()).unwrap_or(0)
    }
}

/// `MemAvailable` from `/proc/meminfo`, if readable.
pub fn available_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    info.lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|kb| kb.parse::<u64>().ok())
        .map(|kb| kb * 1024)
}

/// Resident when the weights take at most 60% of the available memory,
/// otherwise keep half of the available memory's worth of layers.
pub fn default_residency(model_bytes: u64, available: Option<u64>) -> Residency {
    match available {
        Some(free) if model_bytes.saturating_mul(10) > free.saturating_mul(6) => {
            Residency::Cap(free / 2)
        }
        _ => Residency::Resident,
    }
}

/// Read a prompt file, with a message naming it.
pub fn read_text_file(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))
}

/// Human-readable bytes (binary units).
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
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
    fn default_residency_follows_free_memory() {
        assert_eq!(default_residency(100, Some(1000)), Residency::Resident);
        assert_eq!(default_residency(900, Some(1000)), Residency::Cap(500));
        assert_eq!(default_residency(900, None), Residency::Resident);
    }

    #[test]
    fn layer_ranges() {
        assert_eq!(parse_layers("0-11").unwrap().count(30), 12);
        assert_eq!(parse_layers("3").unwrap().count(30), 1);
        assert_eq!(parse_layers("0-3,8-11").unwrap().count(30), 8);
        assert!(parse_layers("5-2").is_err());
        assert!(parse_layers("x").is_err());
    }
}
