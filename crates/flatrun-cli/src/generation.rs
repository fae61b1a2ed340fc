//! One streamed generation with its timings, shared by `run` and `chat`.

use anyhow::Result;
use flatrun_runtime::{FinishReason, GenerateOptions, Model, SamplingParams};
use serde::Serialize;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// Counts and timings of one generation.
#[derive(Clone, Debug, Default, Serialize)]
pub struct GenerationStats {
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    /// Prompt evaluation (and the first sample), seconds.
    pub prefill_seconds: f64,
    /// Every later step, seconds.
    pub decode_seconds: f64,
    pub prefill_tok_s: f64,
    pub decode_tok_s: f64,
    /// `length`, `eos`, `stop`, `context` or `interrupted`.
    pub finish_reason: String,
}

impl GenerationStats {
    /// The one-line summary printed at the end of `run` and by `/stats`.
    pub fn summary_line(&self, peak_rss: u64) -> String {
        format!(
            "prompt {} tok, generated {} tok, prefill {:.1} tok/s, decode {:.1} tok/s, peak RSS {} ({})",
            self.prompt_tokens,
            self.generated_tokens,
            self.prefill_tok_s,
            self.decode_tok_s,
            crate::flags::human_bytes(peak_rss),
            self.finish_reason,
        )
    }
}

fn rate(tokens: usize, time: Duration) -> f64 {
    if time.is_zero() {
        0.0
    } else {
        tokens as f64 / time.as_secs_f64()
    }
}

/// Generate from `prompt` (token ids), calling `emit` with each piece of text
/// as soon as it is complete. Stops early when `interrupt` becomes true.
pub fn generate(
    model: &mut Model,
    prompt: Vec<u32>,
    sampling: SamplingParams,
    max_new: usize,
    stop: Vec<String>,
    interrupt: Option<&AtomicBool>,
    mut emit: impl FnMut(&str) -> Result<()>,
) -> Result<GenerationStats> {
    let capacity = model.executor().context_size();
    if prompt.len() >= capacity {
        anyhow::bail!(
            "context overflow: the prompt has {} tokens but the context holds {capacity}\nhint: shorten the prompt or raise --ctx",
            prompt.len()
        );
    }
    let mut stats = GenerationStats {
        prompt_tokens: prompt.len(),
        finish_reason: "length".into(),
        ..GenerationStats::default()
    };
    if max_new == 0 {
        return Ok(stats);
    }
    let opts = GenerateOptions {
        sampling,
        max_new,
        stop,
        stop_at_eos: true,
    };
    // The first event pays for the prompt; every later one is one decode step.
    let mut started = Instant::now();
    let mut prefill = Duration::ZERO;
    let generation = model.generate(prompt, opts)?;
    for event in generation {
        let event = event?;
        if stats.generated_tokens == 0 && prefill.is_zero() {
            prefill = started.elapsed();
            started = Instant::now();
        }
        if event.finish != Some(FinishReason::Context) {
            stats.generated_tokens += 1;
        }
        emit(&event.text)?;
        if let Some(finish) = &event.finish {
            stats.finish_reason = match finish {
                FinishReason::Length => "length",
                FinishReason::Eos => "eos",
                FinishReason::Stop(_) => "stop",
                FinishReason::Context => "context",
            }
            .into();
            break;
        }
        if interrupt.is_some_and(|flag| flag.load(Ordering::Relaxed)) {
            stats.finish_reason = "interrupted".into();
            break;
        }
    }
    let decode = started.elapsed();
    // The EOS token ends the text but is not part of it.
    if stats.finish_reason == "eos" {
        stats.generated_tokens = stats.generated_tokens.saturating_sub(1);
    }
    stats.prefill_seconds = prefill.as_secs_f64();
    stats.decode_seconds = decode.as_secs_f64();
    stats.prefill_tok_s = rate(stats.prompt_tokens, prefill);
    stats.decode_tok_s = rate(stats.generated_tokens.saturating_sub(1), decode);
    Ok(stats)
}
