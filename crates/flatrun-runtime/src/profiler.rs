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
        }
    }

    /// Whether per-op timings are recorded.
    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// Forget everything measured so far.
    pub fn reset(&mut self) {
        *self = Profiler::new(self.layers.len(), self.enabled, self.trace_memory);
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

    /// Bytes of routed experts' rows read for layer `layer` (counted even
    /// when timings are off).
    pub fn record_expert_bytes(&mut self, layer: usize, bytes: u64) {
        if let Some(l) = self.layers.get_mut(layer) {
            l.expert_bytes_read += bytes;
        }
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
