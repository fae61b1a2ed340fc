//! `flatrun bench`: prefill (`pp N`) and decode (`tg N`) speed over
//! repetitions, like `llama-bench`, for each residency mode asked for.
//!
//! Each repetition opens a fresh sequence, pushes `-p` prompt tokens through
//! the model in one step (timed as prefill), then feeds `-n` tokens one at a
//! time (timed as decode). The median, min and max tokens/s are reported
//! with the peak RSS of the mode (the peak is reset between modes).
//!
//! Like `llama-bench`, the context is sized to what the test needs (prompt +
//! generated tokens) unless `--ctx` is given, so the KV cache does not count
//! a 4096-token context the test never uses. With `--batch N` the decode test
//! steps N sequences together (one pass through the layers per step for all
//! of them: capped serving) and reports their aggregate tokens/s.

use crate::flags::{
    EngineFlags, OutputFlags, SpeculationFlags, human_bytes, parse_residency, read_text_file,
    residency_name,
};
use crate::generation::SpeculativeSummary;
use crate::loading::load;
use crate::progress::{Progress, on_terminal};
use anyhow::{Result, bail};
use flatrun_runtime::{
    ChatMessage, ExpertStats, GenerateOptions, Model, Residency, Sequence, Speculation,
    StepOptions, argmax,
};
use serde::Serialize;
use std::path::PathBuf;
use std::time::Instant;

/// Arguments of `flatrun bench`.
#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    /// Checkpoint: a GGUF file, a SafeTensors / MLX directory, or a pulled
    /// `OWNER/NAME[:QUANT]` from the hub cache.
    #[arg(long, short, value_parser = crate::hub::model_arg)]
    pub model: PathBuf,
    /// Prompt tokens of the prefill test (0 = skip).
    #[arg(short = 'p', long = "n-prompt", default_value_t = 128)]
    pub n_prompt: usize,
    /// Tokens of the decode test (0 = skip).
    #[arg(short = 'n', long = "n-gen", default_value_t = 64)]
    pub n_gen: usize,
    /// Repetitions of each test.
    #[arg(short = 'r', long = "repetitions", default_value_t = 3)]
    pub repetitions: usize,
    /// Decode this many sequences together (each its own KV cache, one pass
    /// through the layers per step); tokens/s counts every sequence's tokens.
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// Skip the untimed warm-up pass (the first test then starts cold,
    /// like `llama-bench --no-warmup`).
    #[arg(long)]
    pub no_warmup: bool,
    /// Use this text as the prompt (instead of `-p` synthetic tokens): the
    /// speculative proposers need a real text to propose from.
    #[arg(long, value_name = "FILE")]
    pub prompt_file: Option<PathBuf>,
    /// Wrap the `--prompt-file` text in the model's chat template as one user turn.
    #[arg(long, requires = "prompt_file")]
    pub chat: bool,
    /// Print JSON instead of a markdown table.
    #[arg(long)]
    pub json: bool,
    /// Mixture-of-experts models: write the routing trace of the timed
    /// tests (each layer pass's experts, in order) to this JSON file.
    #[arg(long, value_name = "FILE")]
    pub expert_trace: Option<PathBuf>,
    #[command(flatten)]
    pub engine: EngineFlags,
    #[command(flatten)]
    pub speculation: SpeculationFlags,
    #[command(flatten)]
    pub output: OutputFlags,
}

/// One row: a test of a residency mode.
#[derive(Debug, Serialize)]
pub struct BenchRow {
    pub model: String,
    pub residency: String,
    /// `pp128` or `tg64`.
    pub test: String,
    pub tokens: usize,
    pub repetitions: usize,
    pub median_tok_s: f64,
    pub min_tok_s: f64,
    pub max_tok_s: f64,
    pub samples_tok_s: Vec<f64>,
    pub peak_rss_bytes: u64,
    pub threads: Option<usize>,
    pub backend: String,
    /// Sequences decoded together (`--batch`).
    pub batch: usize,
    /// Context positions of each sequence.
    pub ctx: usize,
    /// Weight bytes the residency plan keeps resident.
    pub resident_weight_bytes: u64,
    /// Weight bytes re-read per step (every streamed layer and head chunk).
    pub streamed_bytes_per_token: u64,
    /// Bytes of one sequence's KV cache.
    pub kv_bytes: u64,
    /// Anonymous memory of the process after the test (its steady state:
    /// loading peaks higher while the checkpoint's header is parsed).
    pub anon_after_bytes: u64,
    /// Speculative decoding's counts over the decode test's repetitions.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub speculative: Option<SpeculativeSummary>,
    /// Routed experts over the test's repetitions (mixture-of-experts models).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub experts: Option<ExpertSummary>,
}

/// What a test's routed experts cost: found in the expert cache (hits) or
/// read (misses), per token.
#[derive(Debug, Serialize)]
pub struct ExpertSummary {
    pub policy: String,
    pub cache_budget_bytes: u64,
    /// Bytes the cache held at the end of the test.
    pub cache_bytes: u64,
    pub hits: u64,
    pub misses: u64,
    pub hit_rate: f64,
    /// Bytes of experts read per token of the test.
    pub bytes_read_per_token: f64,
    /// Bytes of the routed experts a token uses (hits and misses).
    pub used_bytes_per_token: u64,
    /// Misses the previous layer had read ahead on its prediction.
    pub ahead_used: u64,
    /// Experts read ahead that the router did not choose.
    pub ahead_wasted: u64,
}

impl ExpertSummary {
    fn of(model: &Model, stats: ExpertStats, tokens: usize, policy: &str) -> Option<ExpertSummary> {
        let exec = model.executor();
        exec.manifest().experts?;
        let (cache_bytes, cache_budget_bytes) = exec.expert_cache();
        Some(ExpertSummary {
            policy: policy.to_string(),
            cache_budget_bytes,
            cache_bytes,
            hits: stats.hits,
            misses: stats.misses,
            hit_rate: stats.hit_rate(),
            bytes_read_per_token: stats.bytes_read as f64 / tokens.max(1) as f64,
            used_bytes_per_token: exec.manifest().used_expert_bytes_per_token(),
            ahead_used: stats.ahead_used,
            ahead_wasted: stats.ahead_wasted,
        })
    }

    fn line(&self) -> String {
        let mut line = format!(
            "experts: {:.1}% hits ({} of {}), {} read per token of {} used, cache {} of {} ({})",
            100.0 * self.hit_rate,
            self.hits,
            self.hits + self.misses,
            human_bytes(self.bytes_read_per_token as u64),
            human_bytes(self.used_bytes_per_token),
            human_bytes(self.cache_bytes),
            human_bytes(self.cache_budget_bytes),
            self.policy
        );
        if self.ahead_used + self.ahead_wasted > 0 {
            line += &format!(
                "; read ahead {} used, {} wasted",
                self.ahead_used, self.ahead_wasted
            );
        }
        line
    }
}

fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// Reset the process's peak-RSS counter (`VmHWM`), where the kernel allows.
fn reset_peak_rss() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

/// The residency modes to measure: every `--residency` given, else the automatic one.
fn modes(args: &BenchArgs) -> Result<Vec<Residency>> {
    let texts: Vec<&String> = args
        .engine
        .residency
        .iter()
        .filter(|m| !m.trim().is_empty())
        .collect();
    if texts.is_empty() {
        return Ok(vec![args.engine.residency_for(&args.model)?]);
    }
    texts.iter().map(|t| parse_residency(t)).collect()
}

/// Run `flatrun bench`.
pub fn run(args: BenchArgs) -> Result<()> {
    if args.repetitions == 0 {
        bail!("-r/--repetitions must be at least 1");
    }
    if args.n_prompt == 0 && args.n_gen == 0 {
        bail!("nothing to measure: both -p and -n are 0");
    }
    if args.batch == 0 {
        bail!("--batch must be at least 1");
    }
    let modes = modes(&args)?;
    let speculation = args.speculation.speculation()?;
    if speculation.is_some() && args.batch > 1 {
        bail!("--draft/--lookup measure one sequence: drop --batch");
    }
    let text = args
        .prompt_file
        .as_deref()
        .map(read_text_file)
        .transpose()?;
    let quiet = args.output.quiet;
    let mut rows = Vec::new();
    for mode in modes {
        let mut engine = args.engine.clone();
        engine.residency = vec![residency_name_exact(mode)];
        // The context the test needs (the warm-up uses at most 8 positions);
        // a prompt file's length is known once the tokenizer is loaded.
        if text.is_none() {
            engine.ctx = engine
                .ctx
                .or(Some((args.n_prompt.max(8) + args.n_gen + 1).max(16)));
        }
        reset_peak_rss();
        let mut loaded = load(&args.model, &engine, quiet)?;
        let model = &mut loaded.model;
        args.speculation.attach_draft(model, &engine, quiet)?;
        let ctx = model.executor().context_size();
        let prompt = match &text {
            Some(text) => prompt_from_text(model, text, args.chat)?,
            None => {
                // A deterministic prompt of ordinary tokens.
                let vocab = model.executor().vocab_size() as u32;
                (0..args.n_prompt.max(1) as u32)
                    .map(|i| 100 + (i * 7919) % vocab.saturating_sub(200).max(1))
                    .collect()
            }
        };
        let n_prompt = if text.is_some() {
            prompt.len()
        } else {
            args.n_prompt
        };
        if n_prompt + args.n_gen + 1 > ctx {
            bail!(
                "context overflow: a prompt of {n_prompt} tokens + -n {} does not fit the context of {ctx} tokens\nhint: lower -p/-n or raise --ctx",
                args.n_gen
            );
        }
        let spec_before = model.profiler().speculative;

        // One bar step per prefill and per decoded token of every repetition.
        let bar = Progress::bar(
            on_terminal(quiet),
            (args.repetitions * (1 + args.n_gen)) as u64,
            &format!("bench {}", residency_name(mode)),
        );
        let mut pp = Vec::new();
        let mut tg = Vec::new();
        // One untimed warm-up pass faults the weights in.
        if !args.no_warmup {
            let mut session = model.session();
            session.step(&prompt[..prompt.len().min(8)])?;
        }
        if args.expert_trace.is_some() {
            model.profiler_mut().trace_experts();
            if let Some(trace) = model.profiler_mut().expert_trace.as_mut() {
                trace.clear();
            }
        }
        let (mut pp_experts, mut tg_experts) = (ExpertStats::default(), ExpertStats::default());
        for _ in 0..args.repetitions {
            if let Some(spec) = &speculation {
                let (p, t) = speculative_repetition(model, &prompt, args.n_gen, spec, &bar)?;
                if n_prompt > 0 {
                    pp.push(p);
                }
                if args.n_gen > 0 {
                    tg.push(t);
                }
                continue;
            }
            if args.batch > 1 {
                let (p, t) = batch_repetition(model, &prompt, &args, &bar)?;
                pp.extend(p);
                tg.extend(t);
                continue;
            }
            let mut session = model.session();
            // Prefill: the whole prompt in one step.
            let before = session.model().profiler().experts();
            let started = Instant::now();
            let logits = session.step(&prompt)?;
            let prefill = started.elapsed();
            bar.inc();
            if n_prompt > 0 {
                pp.push(n_prompt as f64 / prefill.as_secs_f64().max(1e-9));
            }
            let after = session.model().profiler().experts();
            pp_experts = pp_experts + after.since(&before);
            // Decode: one token per step, greedy.
            let mut next = argmax(&logits);
            let started = Instant::now();
            for _ in 0..args.n_gen {
                let logits = session.step(&[next])?;
                next = argmax(&logits);
                bar.inc();
            }
            if args.n_gen > 0 {
                tg.push(args.n_gen as f64 / started.elapsed().as_secs_f64().max(1e-9));
            }
            tg_experts = tg_experts + session.model().profiler().experts().since(&after);
        }
        bar.finish();
        let speculative = speculation
            .as_ref()
            .map(|_| SpeculativeSummary::between(&spec_before, &model.profiler().speculative));
        let plan = model.executor().residency().clone();
        let kv_bytes = model.executor().new_sequence().kv_bytes() as u64;
        let rss_after = flatrun_runtime::rss();
        let peak = rss_after.peak;
        let row = |test: String, tokens: usize, samples: Vec<f64>| BenchRow {
            model: args
                .model
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default(),
            residency: residency_name(mode),
            test,
            tokens,
            repetitions: args.repetitions,
            median_tok_s: median(&samples),
            min_tok_s: samples.iter().copied().fold(f64::INFINITY, f64::min),
            max_tok_s: samples.iter().copied().fold(0.0, f64::max),
            samples_tok_s: samples,
            peak_rss_bytes: peak,
            threads: args.engine.threads,
            backend: args.engine.backend.clone(),
            batch: args.batch,
            ctx,
            resident_weight_bytes: plan.resident_bytes,
            streamed_bytes_per_token: plan.streamed_bytes_per_token,
            kv_bytes,
            anon_after_bytes: rss_after.anon,
            speculative: None,
            experts: None,
        };
        let policy = args.engine.expert_policy.as_str();
        let reps = args.repetitions.max(1);
        if n_prompt > 0 {
            let mut prefill = row(format!("pp{n_prompt}"), n_prompt, pp);
            prefill.experts = ExpertSummary::of(model, pp_experts, n_prompt * reps, policy);
            rows.push(prefill);
        }
        if args.n_gen > 0 {
            let mut decode = row(format!("tg{}", args.n_gen), args.n_gen, tg);
            decode.speculative = speculative;
            decode.experts = ExpertSummary::of(model, tg_experts, args.n_gen * reps, policy);
            rows.push(decode);
        }
        if let Some(path) = &args.expert_trace {
            write_expert_trace(model, path)?;
        }
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
    } else {
        print!("{}", markdown(&rows));
    }
    Ok(())
}

/// The `--prompt-file` text as tokens (in the chat template with `--chat`).
fn prompt_from_text(model: &Model, text: &str, chat: bool) -> Result<Vec<u32>> {
    let rendered = if chat {
        model.apply_chat_template(&[ChatMessage::new("user", text)], true)?
    } else {
        text.to_string()
    };
    Ok(model.encode(&rendered, true)?)
}

/// One repetition with speculative decoding: the prompt in one step (timed
/// as prefill, with the first sample), then `n_gen` greedy tokens through
/// the generation loop, proposals verified several per pass. Returns
/// (prefill, decode) tokens/s.
fn speculative_repetition(
    model: &mut Model,
    prompt: &[u32],
    n_gen: usize,
    spec: &Speculation,
    bar: &Progress,
) -> Result<(f64, f64)> {
    let opts = GenerateOptions {
        max_new: n_gen + 1,
        stop_at_eos: false,
        speculation: Some(spec.clone()),
        ..GenerateOptions::default()
    };
    let started = Instant::now();
    let seq = model.new_sequence();
    let mut generation = model.generate_in(seq, prompt.to_vec(), opts)?;
    generation.next().transpose()?;
    let prefill = started.elapsed();
    bar.inc();
    let started = Instant::now();
    let mut decoded = 0;
    for event in generation {
        event?;
        decoded += 1;
        bar.inc();
    }
    let decode = started.elapsed();
    Ok((
        prompt.len() as f64 / prefill.as_secs_f64().max(1e-9),
        decoded as f64 / decode.as_secs_f64().max(1e-9),
    ))
}

/// One repetition with `--batch` sequences: each prefilled on its own
/// (timed together as prefill), then decoded together, one token per
/// sequence per step (timed as decode). Returns (prefill, decode) tokens/s.
fn batch_repetition(
    model: &mut flatrun_runtime::Model,
    prompt: &[u32],
    args: &BenchArgs,
    bar: &Progress,
) -> Result<(Option<f64>, Option<f64>)> {
    let exec = model.executor_mut();
    let mut seqs: Vec<Sequence> = (0..args.batch).map(|_| exec.new_sequence()).collect();
    let mut next = Vec::with_capacity(args.batch);
    // Prefill: every sequence's prompt (shifted per sequence so the
    // sequences differ), one step each.
    let started = Instant::now();
    for (i, seq) in seqs.iter_mut().enumerate() {
        let vocab = exec.vocab_size().max(1) as u32;
        let own: Vec<u32> = prompt.iter().map(|&t| (t + i as u32) % vocab).collect();
        let out = exec.step(seq, &own, StepOptions::default())?;
        next.push(argmax(&out.logits));
    }
    let prefill = started.elapsed();
    bar.inc();
    // Decode: all sequences in one step, greedy.
    let started = Instant::now();
    for _ in 0..args.n_gen {
        let inputs: Vec<[u32; 1]> = next.iter().map(|&t| [t]).collect();
        let mut batch: Vec<(&mut Sequence, &[u32])> = seqs
            .iter_mut()
            .zip(&inputs)
            .map(|(s, t)| (s, &t[..]))
            .collect();
        let outs = exec.step_batch(&mut batch, StepOptions::default())?;
        for (n, out) in next.iter_mut().zip(outs) {
            *n = argmax(&out.logits);
        }
        bar.inc();
    }
    let decode = started.elapsed();
    let tokens = (args.n_gen * args.batch) as f64;
    Ok((
        (args.n_prompt > 0)
            .then(|| (args.n_prompt * args.batch) as f64 / prefill.as_secs_f64().max(1e-9)),
        (args.n_gen > 0).then(|| tokens / decode.as_secs_f64().max(1e-9)),
    ))
}

/// `cap=SIZE` in bytes (exact, for passing back through the flag parser).
fn residency_name_exact(r: Residency) -> String {
    match r {
        Residency::Cap(bytes) => format!("cap={bytes}"),
        other => residency_name(other),
    }
}

/// The rows as a markdown table.
pub fn markdown(rows: &[BenchRow]) -> String {
    let mut s = String::from(
        "| model | residency | test | tok/s (median) | min | max | peak RSS |\n|---|---|---|---:|---:|---:|---:|\n",
    );
    for r in rows {
        s.push_str(&format!(
            "| {} | {} | {} | {:.2} | {:.2} | {:.2} | {} |\n",
            r.model,
            r.residency,
            r.test,
            r.median_tok_s,
            r.min_tok_s,
            r.max_tok_s,
            human_bytes(r.peak_rss_bytes)
        ));
    }
    for r in rows {
        if let Some(spec) = &r.speculative {
            s.push_str(&format!("\n{} {}: {}\n", r.residency, r.test, spec.line()));
        }
        if let Some(experts) = &r.experts {
            s.push_str(&format!(
                "\n{} {}: {}\n",
                r.residency,
                r.test,
                experts.line()
            ));
        }
    }
    s
}

/// The routing trace as JSON: `{"n_layer", "n_expert", "n_used", "trace":
/// [[layer, expert], ...]}`, each layer pass's experts in order of first use.
fn write_expert_trace(model: &Model, path: &std::path::Path) -> Result<()> {
    let exec = model.executor();
    let counts = exec.manifest().experts;
    let trace = model.profiler().expert_trace.clone().unwrap_or_default();
    let json = serde_json::json!({
        "n_layer": exec.config().n_layer,
        "n_expert": counts.map_or(0, |c| c.n_expert),
        "n_used": counts.map_or(0, |c| c.n_used),
        "trace": trace,
    });
    std::fs::write(path, serde_json::to_vec(&json)?)
        .map_err(|e| anyhow::anyhow!("writing {}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::median;

    #[test]
    fn median_of_odd_and_even() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert_eq!(median(&[]), 0.0);
    }
}
