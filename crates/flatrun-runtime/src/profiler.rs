//! Timings and memory of a run: per layer and per op (I/O wait, matmuls,
//! attention, norms…), prefill and decode tokens/s, RSS after every layer,
//! and a Chrome-trace JSON export that opens in Perfetto (`ui.perfetto.dev`).

use crate::memory::{self, RssSample};
use crate::speculative::SpeculativeStats;
use flatrun_model::arch::{Op, OpObserver};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;
use std::time::{Duration, Instant};

/// Upper bound on stored trace events (older runs keep their totals).
const MAX_EVENTS: usize = 1 << 20;

/// One span of the trace.
#[derive(Clone, Debug)]
pub struct TraceEvent {
    pub name: &'static str,
    /// `layer N`, `embed`, `head`, `sampling`, `step`.
    pub track: String,
    pub start: Duration,
    pub duration: Duration,
}

/// Accumulated time of one layer.
#[derive(Clone, Debug, Default)]
pub struct LayerTimes {
    /// Waiting for the layer's pages (I/O or page faults).
    pub io_wait: Duration,
    /// Time per op.
    pub ops: BTreeMap<&'static str, Duration>,
    /// Bytes of mapped weights acquired (faulted in) for this layer.
    pub bytes_acquired: u64,
    /// Bytes of routed experts' rows read on demand for this layer
    /// (streamed mixture-of-experts layers).
    pub expert_bytes_read: u64,
    /// Routed experts this layer found in the expert cache.
    pub expert_hits: u64,
    /// Routed experts this layer read from storage.
    pub expert_misses: u64,
    /// Of the misses, those the previous layer had read ahead.
    pub expert_ahead_used: u64,
    /// Experts read ahead for this layer that its router did not choose.
    pub expert_ahead_wasted: u64,
    /// Bytes of a file-backed KV cache this layer used and then released
    /// (stream and capped modes: read back from the page cache or the
    /// file at the next step).
    pub kv_bytes_paged: u64,
}

/// What the routed experts of a streamed mixture-of-experts model cost:
/// each layer pass needs each expert its tokens chose once, found in the
/// expert cache (a hit) or read (a miss, its bytes read).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ExpertStats {
    pub hits: u64,
    pub misses: u64,
    /// Bytes of expert rows read, those read ahead included.
    pub bytes_read: u64,
    /// Misses whose read the previous layer had started (predicted from
    /// its residual stream with this layer's router).
    pub ahead_used: u64,
    /// Experts read ahead that the router then did not choose.
    pub ahead_wasted: u64,
}

impl std::ops::Add for ExpertStats {
    type Output = ExpertStats;
    fn add(self, o: ExpertStats) -> ExpertStats {
        ExpertStats {
            hits: self.hits + o.hits,
            misses: self.misses + o.misses,
            bytes_read: self.bytes_read + o.bytes_read,
            ahead_used: self.ahead_used + o.ahead_used,
            ahead_wasted: self.ahead_wasted + o.ahead_wasted,
        }
    }
}

impl ExpertStats {
    /// Share of the experts needed that the cache held (0 when none were needed).
    pub fn hit_rate(&self) -> f64 {
        let n = self.hits + self.misses;
        if n == 0 {
            0.0
        } else {
            self.hits as f64 / n as f64
        }
    }

    /// What was counted between `before` and `self`.
    pub fn since(&self, before: &ExpertStats) -> ExpertStats {
        ExpertStats {
            hits: self.hits.saturating_sub(before.hits),
            misses: self.misses.saturating_sub(before.misses),
            bytes_read: self.bytes_read.saturating_sub(before.bytes_read),
            ahead_used: self.ahead_used.saturating_sub(before.ahead_used),
            ahead_wasted: self.ahead_wasted.saturating_sub(before.ahead_wasted),
        }
    }
}

/// RSS after one layer step.
#[derive(Clone, Copy, Debug)]
pub struct MemorySample {
    pub layer: usize,
    pub rss: RssSample,
}

/// The profiler. Disabled, it only counts tokens and step times.
#[derive(Debug)]
pub struct Profiler {
    enabled: bool,
    trace_memory: bool,
    epoch: Instant,
    events: Vec<TraceEvent>,
    /// Per-layer totals (index = layer).
    pub layers: Vec<LayerTimes>,
    /// Time spent outside layers, by name (`embed`, `head`, `sampling`, `head_io_wait`).
    pub other: BTreeMap<&'static str, Duration>,
    pub prefill_tokens: usize,
    pub prefill_time: Duration,
    pub decode_tokens: usize,
    pub decode_time: Duration,
    /// RSS samples after each layer (when memory tracing is on).
    pub memory: Vec<MemorySample>,
    /// Largest RSS total seen in a sample.
    pub peak_rss: RssSample,
    /// Proposals, acceptances and passes of speculative decoding.
    pub speculative: SpeculativeStats,
    /// When enabled ([`Profiler::trace_experts`]): every (layer, expert)
    /// a layer pass needed, in order, the routing trace that expert-cache
    /// policies are compared on.
    pub expert_trace: Option<Vec<(u16, u16)>>,
}

impl Profiler {
    pub fn new(n_layer: usize, enabled: bool, trace_memory: bool) -> Profiler {
        Profiler {
            enabled,
            trace_memory,
            epoch: Instant::now(),
            events: Vec::new(),
            layers: vec![LayerTimes::default(); n_layer],
            other: BTreeMap::new(),
            prefill_tokens: 0,
            prefill_time: Duration::ZERO,
            decode_tokens: 0,
            decode_time: Duration::ZERO,
            memory: Vec::new(),
            peak_rss: RssSample::default(),
            speculative: SpeculativeStats::default(),
            expert_trace: None,
        }
    }

    /// Start recording the routing trace ([`Profiler::expert_trace`]).
    pub fn trace_experts(&mut self) {
        self.expert_trace.get_or_insert_with(Vec::new);
    }

    /// Whether per-op timings are recorded.
    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// Forget everything measured so far.
    pub fn reset(&mut self) {
        let tracing = self.expert_trace.is_some();
        *self = Profiler::new(self.layers.len(), self.enabled, self.trace_memory);
        if tracing {
            self.trace_experts();
        }
    }

    fn push_event(&mut self, name: &'static str, track: String, end: Instant, elapsed: Duration) {
        if self.events.len() < MAX_EVENTS {
            let start = end
                .saturating_duration_since(self.epoch)
                .saturating_sub(elapsed);
            self.events.push(TraceEvent {
                name,
                track,
                start,
                duration: elapsed,
            });
        }
    }

    /// Time compute waited for layer `layer`'s pages.
    pub fn record_io_wait(&mut self, layer: usize, elapsed: Duration) {
        if !self.enabled {
            return;
        }
        if let Some(l) = self.layers.get_mut(layer) {
            l.io_wait += elapsed;
        }
        self.push_event(
            "io_wait",
            format!("layer {layer:02}"),
            Instant::now(),
            elapsed,
        );
    }

    /// Bytes of mapped weights acquired for layer `layer` (counted even
    /// when timings are off, so tests can check which layers were read).
    pub fn record_bytes_acquired(&mut self, layer: usize, bytes: u64) {
        if let Some(l) = self.layers.get_mut(layer) {
            l.bytes_acquired += bytes;
        }
    }

    /// Bytes of a file-backed KV cache layer `layer` used and released
    /// (counted even when timings are off).
    pub fn record_kv_bytes_paged(&mut self, layer: usize, bytes: u64) {
        if let Some(l) = self.layers.get_mut(layer) {
            l.kv_bytes_paged += bytes;
        }
    }

    /// Bytes of routed experts' rows read for layer `layer` (counted even
    /// when timings are off).
    pub fn record_expert_bytes(&mut self, layer: usize, bytes: u64) {
        if let Some(l) = self.layers.get_mut(layer) {
            l.expert_bytes_read += bytes;
        }
    }

    /// The routed experts layer `layer` needed in one pass: `hits` from the
    /// expert cache, `misses` read, in the order `used` lists them (counted
    /// even when timings are off).
    pub fn record_experts(&mut self, layer: usize, hits: u64, misses: u64, used: &[u16]) {
        if let Some(l) = self.layers.get_mut(layer) {
            l.expert_hits += hits;
            l.expert_misses += misses;
        }
        if let Some(trace) = self.expert_trace.as_mut()
            && trace.len() < MAX_EVENTS * 4
        {
            trace.extend(used.iter().map(|&e| (layer as u16, e)));
        }
    }

    /// Experts of `layer` read ahead and used, and read ahead in vain.
    pub fn record_experts_ahead(&mut self, layer: usize, used: u64, wasted: u64) {
        if let Some(l) = self.layers.get_mut(layer) {
            l.expert_ahead_used += used;
            l.expert_ahead_wasted += wasted;
        }
    }

    /// Routed experts' hits, misses and bytes read, over every layer.
    pub fn experts(&self) -> ExpertStats {
        self.layers
            .iter()
            .map(|l| ExpertStats {
                hits: l.expert_hits,
                misses: l.expert_misses,
                bytes_read: l.expert_bytes_read,
                ahead_used: l.expert_ahead_used,
                ahead_wasted: l.expert_ahead_wasted,
            })
            .fold(ExpertStats::default(), |a, b| a + b)
    }

    /// Time of work outside the layers (`embed`, `head`, `head_io_wait`, `sampling`).
    pub fn record_other(&mut self, name: &'static str, elapsed: Duration) {
        if !self.enabled {
            return;
        }
        *self.other.entry(name).or_default() += elapsed;
        self.push_event(name, name.to_string(), Instant::now(), elapsed);
    }

    /// Count a prefill step of `tokens` tokens.
    pub fn add_prefill(&mut self, tokens: usize, elapsed: Duration) {
        self.prefill_tokens += tokens;
        self.prefill_time += elapsed;
    }

    /// Count a decode step of `tokens` tokens.
    pub fn add_decode(&mut self, tokens: usize, elapsed: Duration) {
        self.decode_tokens += tokens;
        self.decode_time += elapsed;
    }

    /// Sample RSS after layer `layer` (when memory tracing is on).
    pub fn sample_memory(&mut self, layer: usize) {
        if !self.trace_memory {
            return;
        }
        let rss = memory::rss();
        if rss.total() > self.peak_rss.total() {
            self.peak_rss = rss;
        }
        self.memory.push(MemorySample { layer, rss });
    }

    /// Prefill tokens per second.
    pub fn prefill_tok_s(&self) -> f64 {
        rate(self.prefill_tokens, self.prefill_time)
    }

    /// Decode tokens per second.
    pub fn decode_tok_s(&self) -> f64 {
        rate(self.decode_tokens, self.decode_time)
    }

    /// Total time compute waited for pages (layers and head).
    pub fn io_wait(&self) -> Duration {
        self.layers.iter().map(|l| l.io_wait).sum::<Duration>()
            + self.other.get("head_io_wait").copied().unwrap_or_default()
    }

    /// Share of step time spent waiting for pages.
    pub fn io_wait_share(&self) -> f64 {
        let total = (self.prefill_time + self.decode_time).as_secs_f64();
        if total > 0.0 {
            self.io_wait().as_secs_f64() / total
        } else {
            0.0
        }
    }

    /// Time per op summed over layers.
    pub fn op_totals(&self) -> BTreeMap<&'static str, Duration> {
        let mut totals: BTreeMap<&'static str, Duration> = BTreeMap::new();
        for l in &self.layers {
            for (op, d) in &l.ops {
                *totals.entry(op).or_default() += *d;
            }
            *totals.entry("io_wait").or_default() += l.io_wait;
        }
        for (name, d) in &self.other {
            *totals.entry(name).or_default() += *d;
        }
        totals
    }

    /// A human-readable summary table.
    pub fn summary(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "prefill: {} tokens in {:.3} s ({:.1} tok/s); decode: {} tokens in {:.3} s ({:.1} tok/s)",
            self.prefill_tokens,
            self.prefill_time.as_secs_f64(),
            self.prefill_tok_s(),
            self.decode_tokens,
            self.decode_time.as_secs_f64(),
            self.decode_tok_s()
        );
        let spec = &self.speculative;
        if spec.passes > 0 {
            let _ = writeln!(
                s,
                "speculative: {} proposed, {} accepted ({:.1}%), {:.2} tokens per pass over {} passes, {:.3} s proposing",
                spec.proposed,
                spec.accepted,
                100.0 * spec.acceptance_rate(),
                spec.tokens_per_pass(),
                spec.passes,
                spec.propose_time.as_secs_f64()
            );
        }
        let experts = self.experts();
        if experts.hits + experts.misses > 0 {
            let tokens = (self.prefill_tokens + self.decode_tokens).max(1);
            let _ = writeln!(
                s,
                "routed experts: {} hits, {} misses ({:.1}% hits), {:.1} MB read ({:.2} MB per token)",
                experts.hits,
                experts.misses,
                100.0 * experts.hit_rate(),
                mb(experts.bytes_read),
                mb(experts.bytes_read) / tokens as f64
            );
            if experts.ahead_used + experts.ahead_wasted > 0 {
                let _ = writeln!(
                    s,
                    "experts read ahead: {} used, {} wasted",
                    experts.ahead_used, experts.ahead_wasted
                );
            }
        }
        let total = (self.prefill_time + self.decode_time)
            .as_secs_f64()
            .max(1e-9);
        if self.enabled {
            let _ = writeln!(s, "{:<16} {:>10} {:>7}", "op", "ms", "share");
            for (op, d) in self.op_totals() {
                let _ = writeln!(
                    s,
                    "{:<16} {:>10.2} {:>6.1}%",
                    op,
                    d.as_secs_f64() * 1e3,
                    100.0 * d.as_secs_f64() / total
                );
            }
            let _ = writeln!(s, "I/O wait share: {:.1}%", 100.0 * self.io_wait_share());
        }
        if self.trace_memory {
            let _ = writeln!(
                s,
                "peak RSS sample: {:.1} MB (anon {:.1} MB, file {:.1} MB); VmHWM {:.1} MB",
                mb(self.peak_rss.total()),
                mb(self.peak_rss.anon),
                mb(self.peak_rss.file),
                mb(memory::rss().peak)
            );
        }
        s
    }

    /// Write the trace as Chrome-trace JSON (one track per layer).
    pub fn write_chrome_trace(&self, path: &Path) -> std::io::Result<()> {
        let mut tracks: Vec<&str> = self.events.iter().map(|e| e.track.as_str()).collect();
        tracks.sort_unstable();
        tracks.dedup();
        let tid = |t: &str| tracks.binary_search(&t).map_or(0, |i| i + 1);
        let mut events = Vec::with_capacity(self.events.len() + tracks.len());
        for t in &tracks {
            events.push(serde_json::json!({
                "ph": "M", "name": "thread_name", "pid": 1, "tid": tid(t),
                "args": { "name": t }
            }));
        }
        for e in &self.events {
            events.push(serde_json::json!({
                "ph": "X", "name": e.name, "cat": e.track, "pid": 1, "tid": tid(&e.track),
                "ts": e.start.as_secs_f64() * 1e6, "dur": e.duration.as_secs_f64() * 1e6,
            }));
        }
        for m in &self.memory {
            events.push(serde_json::json!({
                "ph": "C", "name": "rss_mb", "pid": 1, "ts": 0,
                "args": { "anon": mb(m.rss.anon), "file": mb(m.rss.file) }
            }));
        }
        let json = serde_json::json!({ "traceEvents": events, "displayTimeUnit": "ms" });
        std::fs::write(path, serde_json::to_vec(&json).unwrap_or_default())
    }
}

impl OpObserver for Profiler {
    fn record(&mut self, layer: usize, op: Op, elapsed: Duration) {
        if !self.enabled {
            return;
        }
        if let Some(l) = self.layers.get_mut(layer) {
            *l.ops.entry(op.name()).or_default() += elapsed;
        }
        self.push_event(
            op.name(),
            format!("layer {layer:02}"),
            Instant::now(),
            elapsed,
        );
    }
}

fn rate(tokens: usize, t: Duration) -> f64 {
    if t.is_zero() {
        0.0
    } else {
        tokens as f64 / t.as_secs_f64()
    }
}

fn mb(bytes: u64) -> f64 {
    bytes as f64 / 1e6
}
