//! `/metrics`: Prometheus text exposition of the server and engine counters.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;
use std::time::Instant;

use crate::engine::Engine;
use crate::models::ModelStatus;

/// HTTP-side counters.
#[derive(Debug)]
pub struct Metrics {
    started: Instant,
    /// (endpoint, status) → count.
    requests: Mutex<BTreeMap<(String, u16), u64>>,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            started: Instant::now(),
            requests: Mutex::new(BTreeMap::new()),
        }
    }
}

/// Resident and peak resident memory of this process, from `/proc/self/status`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProcessMemory {
    pub rss_bytes: u64,
    pub peak_rss_bytes: u64,
}

impl ProcessMemory {
    /// Zeros where `/proc` is unavailable.
    pub fn read() -> Self {
        let Ok(status) = std::fs::read_to_string("/proc/self/status") else {
            return ProcessMemory::default();
        };
        let field = |name: &str| -> u64 {
            status
                .lines()
                .find_map(|line| line.strip_prefix(name))
                .and_then(|rest| rest.split_whitespace().next())
                .and_then(|kb| kb.parse::<u64>().ok())
                .map_or(0, |kb| kb * 1024)
        };
        ProcessMemory {
            rss_bytes: field("VmRSS:"),
            peak_rss_bytes: field("VmHWM:"),
        }
    }
}

impl Metrics {
    pub fn record_request(&self, endpoint: &str, status: u16) {
        if let Ok(mut requests) = self.requests.lock() {
            *requests.entry((endpoint.to_string(), status)).or_insert(0) += 1;
        }
    }

    /// The exposition text; `engine` is `None` while the model loads.
    /// The metrics text: the counters of the default model's `engine` (when
    /// in memory), then every served model's state under a `model` label.
    pub fn render(
        &self,
        engine: Option<&dyn Engine>,
        models: &[ModelStatus],
        budget: Option<u64>,
    ) -> String {
        let mut out = String::new();
        let mut metric = |name: &str, kind: &str, help: &str, samples: &[(String, String)]| {
            let _ = writeln!(out, "# HELP {name} {help}");
            let _ = writeln!(out, "# TYPE {name} {kind}");
            for (labels, value) in samples {
                let _ = writeln!(out, "{name}{labels} {value}");
            }
        };
        let plain = |value: String| vec![(String::new(), value)];

        let requests: Vec<(String, String)> = self
            .requests
            .lock()
            .map(|requests| {
                requests
                    .iter()
                    .map(|((endpoint, status), count)| {
                        (
                            format!("{{endpoint=\"{endpoint}\",status=\"{status}\"}}"),
                            count.to_string(),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default();
        metric(
            "flatrun_requests_total",
            "counter",
            "HTTP requests answered, by endpoint and status.",
            &requests,
        );
        metric(
            "flatrun_model_loaded",
            "gauge",
            "1 once the model is loaded and serving.",
            &plain(u8::from(engine.is_some()).to_string()),
        );
        let stats = engine.map(|e| e.stats()).unwrap_or_default();
        metric(
            "flatrun_prompt_tokens_total",
            "counter",
            "Prompt tokens evaluated (tokens in).",
            &plain(stats.prompt_tokens_total.to_string()),
        );
        metric(
            "flatrun_generated_tokens_total",
            "counter",
            "Tokens generated (tokens out).",
            &plain(stats.generated_tokens_total.to_string()),
        );
        metric(
            "flatrun_context_shifts_total",
            "counter",
            "Context shifts (--context-overflow shift), by how: cached keys re-rotated in place, or the kept tokens computed again.",
            &[
                (
                    "{how=\"rotated\"}".to_string(),
                    stats.context_shifts_rotated_total.to_string(),
                ),
                (
                    "{how=\"recomputed\"}".to_string(),
                    stats.context_shifts_recomputed_total.to_string(),
                ),
            ],
        );
        metric(
            "flatrun_generated_tokens_per_second",
            "gauge",
            "Recent generation throughput over all sequences.",
            &plain(format!("{:.3}", stats.generated_tokens_per_second)),
        );
        metric(
            "flatrun_decode_steps_total",
            "counter",
            "Batched steps run (one pass through the layers each).",
            &plain(stats.steps_total.to_string()),
        );
        metric(
            "flatrun_active_sequences",
            "gauge",
            "Sequences in the running batch.",
            &plain(stats.active_sequences.to_string()),
        );
        metric(
            "flatrun_queue_depth",
            "gauge",
            "Requests waiting for a sequence slot.",
            &plain(stats.queued_requests.to_string()),
        );
        metric(
            "flatrun_grammar_masks_total",
            "counter",
            "Grammar masks computed (one per constrained sequence per step).",
            &plain(stats.grammar_masks_total.to_string()),
        );
        metric(
            "flatrun_grammar_mask_seconds_total",
            "counter",
            "Time computing grammar masks, on threads beside the layers.",
            &plain(format!("{:.6}", stats.grammar_mask_seconds_total)),
        );
        metric(
            "flatrun_grammar_wait_seconds_total",
            "counter",
            "Time steps waited for grammar masks after the layers had run.",
            &plain(format!("{:.6}", stats.grammar_wait_seconds_total)),
        );
        for (name, kind, help, value) in [
            (
                "flatrun_speculative_passes_total",
                "counter",
                "Verification passes of a sequence with proposed tokens.",
                stats.speculative_passes_total,
            ),
            (
                "flatrun_speculative_proposed_tokens_total",
                "counter",
                "Tokens proposed by speculative decoding (prompt lookup or the draft model).",
                stats.speculative_proposed_total,
            ),
            (
                "flatrun_speculative_accepted_tokens_total",
                "counter",
                "Proposed tokens the target model accepted.",
                stats.speculative_accepted_total,
            ),
            (
                "flatrun_prefix_cache_lookups_total",
                "counter",
                "Requests that looked for a shared prompt prefix to reuse.",
                stats.prefix_lookups_total,
            ),
            (
                "flatrun_prefix_cache_hits_total",
                "counter",
                "Requests that reused the KV of a shared prompt prefix.",
                stats.prefix_hits_total,
            ),
            (
                "flatrun_prefix_reused_tokens_total",
                "counter",
                "Prompt tokens whose KV was reused instead of computed.",
                stats.prefix_reused_tokens_total,
            ),
            (
                "flatrun_prompt_cache_sequences",
                "gauge",
                "Finished sequences kept for prefix reuse.",
                stats.prompt_cache_entries as u64,
            ),
            (
                "flatrun_prompt_cache_bytes",
                "gauge",
                "KV bytes of the sequences kept for prefix reuse.",
                stats.prompt_cache_bytes,
            ),
            (
                "flatrun_prompt_cache_evictions_total",
                "counter",
                "Kept sequences dropped to stay under --prompt-cache.",
                stats.prompt_cache_evictions_total,
            ),
            (
                "flatrun_kv_bytes",
                "gauge",
                "KV cache bytes in use: running sequences and the prompt cache.",
                stats.kv_bytes,
            ),
        ] {
            metric(name, kind, help, &plain(value.to_string()));
        }
        if let (Some(resident), Some(total)) = (stats.resident_bytes, stats.model_bytes) {
            metric(
                "flatrun_model_resident_bytes",
                "gauge",
                "Model weight bytes resident in memory.",
                &plain(resident.to_string()),
            );
            metric(
                "flatrun_model_bytes",
                "gauge",
                "Model weight bytes in total.",
                &plain(total.to_string()),
            );
        }
        let labelled = |value: &dyn Fn(&ModelStatus) -> String| -> Vec<(String, String)> {
            models
                .iter()
                .map(|m| (format!("{{model=\"{}\"}}", label(&m.name)), value(m)))
                .collect()
        };
        metric(
            "flatrun_served_model_loaded",
            "gauge",
            "1 while the served model is in memory.",
            &labelled(&|m| u8::from(m.loaded).to_string()),
        );
        metric(
            "flatrun_served_model_memory_bytes",
            "gauge",
            "Peak memory of the plan a loaded model runs with (models the server loads itself).",
            &labelled(&|m| m.memory_bytes.to_string()),
        );
        metric(
            "flatrun_served_model_loads_total",
            "counter",
            "Times the served model was loaded.",
            &labelled(&|m| m.loads.to_string()),
        );
        metric(
            "flatrun_served_model_unloads_total",
            "counter",
            "Times the served model was unloaded (idle, or to make room).",
            &labelled(&|m| m.unloads.to_string()),
        );
        if let Some(budget) = budget {
            metric(
                "flatrun_served_models_memory_budget_bytes",
                "gauge",
                "The memory the served models may plan for together (--max-resident).",
                &plain(budget.to_string()),
            );
        }
        let memory = ProcessMemory::read();
        metric(
            "flatrun_process_resident_memory_bytes",
            "gauge",
            "Resident set size of the server process.",
            &plain(memory.rss_bytes.to_string()),
        );
        metric(
            "flatrun_process_peak_resident_memory_bytes",
            "gauge",
            "Peak resident set size of the server process.",
            &plain(memory.peak_rss_bytes.to_string()),
        );
        metric(
            "flatrun_uptime_seconds",
            "gauge",
            "Seconds since the server started.",
            &plain(format!("{:.3}", self.started.elapsed().as_secs_f64())),
        );
        out
    }
}

/// A Prometheus label value: backslashes, quotes and newlines escaped.
fn label(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}
