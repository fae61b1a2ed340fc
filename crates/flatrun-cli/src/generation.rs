//! One streamed generation with its timings, shared by `run` and `chat`.
//!
//! The prompt is fed on top of a [`Sequence`] that may already hold a
//! cached prefix (the earlier turns of a chat). A long prompt goes through
//! in chunks of [`PREFILL_CHUNK`] tokens so that a progress bar can follow
//! it and Ctrl-C can stop it between chunks.

use crate::progress::Progress;
use anyhow::Result;
use flatrun_runtime::{
    FinishReason, GenerateOptions, Model, SamplingParams, Sequence, Speculation, SpeculativeStats,
    StepOptions,
};
use serde::Serialize;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// Tokens per prefill step when the prompt is long.
pub const PREFILL_CHUNK: usize = 128;

/// Counts and timings of one generation.
#[derive(Clone, Debug, Default, Serialize)]
pub struct GenerationStats {
    /// Prompt tokens evaluated by this generation (not counting the cached prefix).
    pub prompt_tokens: usize,
    /// Tokens that were already in the KV cache and were reused.
    pub cached_tokens: usize,
    pub generated_tokens: usize,
    /// Prompt evaluation (and the first sample), seconds.
    pub prefill_seconds: f64,
    /// Every later step, seconds.
    pub decode_seconds: f64,
    pub prefill_tok_s: f64,
    pub decode_tok_s: f64,
    /// `length`, `eos`, `stop`, `context` or `interrupted`.
    pub finish_reason: String,
    /// Speculative decoding's counts (with `--draft` or `--lookup`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub speculative: Option<SpeculativeSummary>,
}

/// Proposals and acceptances of one generation.
#[derive(Clone, Debug, Default, Serialize)]
pub struct SpeculativeSummary {
    /// Verification passes through the layers.
    pub passes: usize,
    pub proposed: usize,
    pub accepted: usize,
    /// Accepted ÷ proposed.
    pub acceptance_rate: f64,
    /// Tokens emitted per verification pass.
    pub tokens_per_pass: f64,
    /// Time the proposer took, seconds (the draft model's passes).
    pub propose_seconds: f64,
}

impl SpeculativeSummary {
    /// What happened between two readings of the profiler's counters.
    pub fn between(before: &SpeculativeStats, after: &SpeculativeStats) -> SpeculativeSummary {
        let delta = SpeculativeStats {
            passes: after.passes - before.passes,
            proposed: after.proposed - before.proposed,
            accepted: after.accepted - before.accepted,
            emitted: after.emitted - before.emitted,
            propose_time: after.propose_time.saturating_sub(before.propose_time),
        };
        SpeculativeSummary {
            passes: delta.passes,
            proposed: delta.proposed,
            accepted: delta.accepted,
            acceptance_rate: delta.acceptance_rate(),
            tokens_per_pass: delta.tokens_per_pass(),
            propose_seconds: delta.propose_time.as_secs_f64(),
        }
    }

    /// `speculative: … accepted …` for the end-of-run line.
    pub fn line(&self) -> String {
        format!(
            "speculative: {} of {} proposals accepted ({:.1}%), {:.2} tokens per pass",
            self.accepted,
            self.proposed,
            100.0 * self.acceptance_rate,
            self.tokens_per_pass
        )
    }
}

impl GenerationStats {
    /// The one-line summary printed at the end of `run` and by `/stats`.
    pub fn summary_line(&self, peak_rss: u64) -> String {
        let cached = if self.cached_tokens > 0 {
            format!(" (+{} cached)", self.cached_tokens)
        } else {
            String::new()
        };
        let speculative = self
            .speculative
            .as_ref()
            .map(|s| format!("; {}", s.line()))
            .unwrap_or_default();
        format!(
            "prompt {} tok{cached}, generated {} tok, prefill {:.1} tok/s, decode {:.1} tok/s, peak RSS {} ({}){speculative}",
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

/// What one generation is asked to do.
pub struct GenerationRequest<'a> {
    pub sampling: SamplingParams,
    pub max_new: usize,
    pub stop: Vec<String>,
    /// Stop early when this becomes true (Ctrl-C).
    pub interrupt: Option<&'a AtomicBool>,
    /// Show a prefill progress bar (on a terminal, for long prompts).
    pub progress: bool,
    /// Speculative decoding (`--lookup`, `--draft`).
    pub speculation: Option<Speculation>,
}

/// Feed `prompt` on top of `seq`, then generate, calling `emit` with each
/// piece of text as soon as it is complete. Returns the statistics and the
/// sequence (every token fed; the last sampled token is not).
pub fn generate(
    model: &mut Model,
    mut seq: Sequence,
    prompt: Vec<u32>,
    req: GenerationRequest<'_>,
    mut emit: impl FnMut(&str) -> Result<()>,
) -> Result<(GenerationStats, Sequence)> {
    let capacity = seq.capacity();
    let cached = seq.len();
    if cached + prompt.len() >= capacity {
        anyhow::bail!(
            "context overflow: the prompt has {} tokens but the context holds {capacity}\nhint: shorten the prompt or raise --ctx",
            cached + prompt.len()
        );
    }
    if prompt.is_empty() {
        anyhow::bail!("the prompt is empty after tokenization");
    }
    let mut stats = GenerationStats {
        prompt_tokens: prompt.len(),
        cached_tokens: cached,
        finish_reason: "length".into(),
        ..GenerationStats::default()
    };
    let interrupted = || {
        req.interrupt
            .is_some_and(|flag| flag.load(Ordering::Relaxed))
    };
    let started = Instant::now();

    // Prefill all but the last chunk step by step (progress, Ctrl-C).
    let mut fed = 0;
    if prompt.len() > PREFILL_CHUNK {
        let bar = Progress::bar(req.progress, prompt.len() as u64, "prefill");
        while prompt.len() - fed > PREFILL_CHUNK {
            let end = fed + PREFILL_CHUNK;
            model
                .executor_mut()
                .step(&mut seq, &prompt[fed..end], StepOptions::default())?;
            fed = end;
            bar.set(fed as u64);
            if interrupted() {
                stats.prompt_tokens = fed;
                stats.finish_reason = "interrupted".into();
                stats.prefill_seconds = started.elapsed().as_secs_f64();
                return Ok((stats, seq));
            }
        }
        bar.finish();
    }
    if req.max_new == 0 {
        if fed < prompt.len() {
            model
                .executor_mut()
                .step(&mut seq, &prompt[fed..], StepOptions::default())?;
        }
        stats.prefill_seconds = started.elapsed().as_secs_f64();
        stats.prefill_tok_s = rate(stats.prompt_tokens, started.elapsed());
        return Ok((stats, seq));
    }

    // The last chunk and the first sample, then one decode step per event
    // (or, speculating, one verification pass per few events).
    let speculating = req.speculation.is_some();
    let spec_before = model.profiler().speculative;
    let opts = GenerateOptions {
        sampling: req.sampling,
        max_new: req.max_new,
        stop: req.stop,
        stop_at_eos: true,
        speculation: req.speculation,
    };
    let mut generation = model.generate_in(seq, prompt[fed..].to_vec(), opts)?;
    let mut prefill = Duration::ZERO;
    let mut decode_started = Instant::now();
    let mut failure = None;
    for event in generation.by_ref() {
        let event = match event {
            Ok(event) => event,
            Err(e) => {
                failure = Some(e);
                break;
            }
        };
        if stats.generated_tokens == 0 && prefill.is_zero() {
            prefill = started.elapsed();
            decode_started = Instant::now();
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
        if interrupted() {
            stats.finish_reason = "interrupted".into();
            break;
        }
    }
    if speculating {
        stats.speculative = Some(SpeculativeSummary::between(
            &spec_before,
            &generation.model().profiler().speculative,
        ));
    }
    let seq = generation.into_sequence();
    if let Some(e) = failure {
        return Err(e.into());
    }
    let decode = decode_started.elapsed();
    // The EOS token ends the text but is not part of it.
    if stats.finish_reason == "eos" {
        stats.generated_tokens = stats.generated_tokens.saturating_sub(1);
    }
    stats.prefill_seconds = prefill.as_secs_f64();
    stats.decode_seconds = decode.as_secs_f64();
    stats.prefill_tok_s = rate(stats.prompt_tokens, prefill);
    stats.decode_tok_s = rate(stats.generated_tokens.saturating_sub(1), decode);
    Ok((stats, seq))
}

/// How many leading tokens `cached` and `prompt` share, keeping at least one
/// prompt token to feed (a step needs a token to produce logits).
pub fn reusable_prefix(cached: &[u32], prompt: &[u32]) -> usize {
    let common = cached
        .iter()
        .zip(prompt)
        .take_while(|(a, b)| a == b)
        .count();
    common.min(prompt.len().saturating_sub(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_reuse_keeps_one_token_to_feed() {
        assert_eq!(reusable_prefix(&[1, 2, 3], &[1, 2, 3, 4, 5]), 3);
        assert_eq!(reusable_prefix(&[1, 2, 9], &[1, 2, 3, 4]), 2);
        assert_eq!(reusable_prefix(&[1, 2, 3], &[1, 2, 3]), 2);
        assert_eq!(reusable_prefix(&[], &[7]), 0);
    }
}
