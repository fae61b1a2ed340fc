//! `flatrun run` (the default command): load, print what was detected,
//! stream the generated text to stdout, end with a one-line summary.
//!
//! With `--dump-logits` it hands over to the logits-dumping runner
//! ([`crate::run`]), which the fidelity, `--weights` and `--layers` tests drive.

use crate::flags::{EngineFlags, OutputFlags, SamplingFlags, SpeculationFlags, read_text_file};
use crate::generation::{GenerationRequest, GenerationStats, generate};
use crate::loading::{finish_profile, header, load, peak_rss};
use crate::progress::on_terminal;
use anyhow::{Result, bail};
use flatrun_runtime::ChatMessage;
use serde::Serialize;
use std::io::{IsTerminal, Read, Write};
use std::path::PathBuf;

/// Arguments of `flatrun run`.
#[derive(Debug, clap::Args)]
pub struct RunCommand {
    /// Checkpoint: a GGUF file, a SafeTensors / MLX directory, or a pulled
    /// `OWNER/NAME[:QUANT]` from the hub cache.
    #[arg(long, short, value_parser = crate::hub::model_arg)]
    pub model: PathBuf,
    /// Prompt text [default: read from --prompt-file or standard input].
    #[arg(long, short)]
    pub prompt: Option<String>,
    /// Read the prompt from this file.
    #[arg(long, value_name = "FILE", conflicts_with = "prompt")]
    pub prompt_file: Option<PathBuf>,
    /// Most tokens to generate.
    #[arg(long, short = 'n', default_value_t = 128)]
    pub max_new: usize,
    /// Wrap the prompt in the model's chat template as one user turn.
    #[arg(long)]
    pub chat: bool,
    /// System prompt (implies --chat).
    #[arg(long)]
    pub system: Option<String>,
    /// Print one JSON object (text, counts, timings) instead of streaming.
    #[arg(long)]
    pub json: bool,
    /// Write the f32 logits of every evaluated position as `[positions, vocab]` .npy (greedy).
    #[arg(long, value_name = "FILE")]
    pub dump_logits: Option<PathBuf>,
    #[command(flatten)]
    pub engine: EngineFlags,
    #[command(flatten)]
    pub sampling: SamplingFlags,
    #[command(flatten)]
    pub speculation: SpeculationFlags,
    #[command(flatten)]
    pub output: OutputFlags,
}

/// The `--json` result.
#[derive(Debug, Serialize)]
struct RunResult {
    model: String,
    format: String,
    architecture: String,
    text: String,
    #[serde(flatten)]
    stats: GenerationStats,
    load_seconds: f64,
    peak_rss_bytes: u64,
}

/// The prompt from the flag, the file, or standard input.
fn prompt_text(cmd: &RunCommand) -> Result<String> {
    if let Some(p) = &cmd.prompt {
        return Ok(p.clone());
    }
    if let Some(path) = &cmd.prompt_file {
        return read_text_file(path);
    }
    let stdin = std::io::stdin();
    if stdin.is_terminal() {
        bail!(
            "no prompt given\nhint: pass --prompt TEXT, --prompt-file FILE, pipe the prompt on stdin, or use `flatrun chat`"
        );
    }
    let mut text = String::new();
    stdin.lock().read_to_string(&mut text)?;
    if text.trim().is_empty() {
        bail!(
            "the prompt read from standard input is empty\nhint: pipe some text in, or pass --prompt TEXT or --prompt-file FILE"
        );
    }
    Ok(text)
}

/// Run `flatrun run`.
pub fn run(cmd: RunCommand) -> Result<()> {
    let text = prompt_text(&cmd)?;
    let sampling = cmd.sampling.params()?;
    let chat = cmd.chat || cmd.system.is_some();
    let messages = |text: String| {
        let mut messages = Vec::new();
        if let Some(system) = &cmd.system {
            messages.push(ChatMessage::new("system", system.clone()));
        }
        messages.push(ChatMessage::new("user", text));
        messages
    };
    if let Some(path) = &cmd.dump_logits {
        return crate::run::dump_logits(crate::run::DumpRequest {
            model: &cmd.model,
            prompt: if chat {
                crate::run::DumpPrompt::Chat(messages(text))
            } else {
                crate::run::DumpPrompt::Text(text)
            },
            max_new: cmd.max_new,
            sampling,
            engine: &cmd.engine,
            output: cmd.output,
            path,
        });
    }
    let speculation = cmd.speculation.speculation()?;
    let quiet = cmd.output.quiet || cmd.json;
    let mut loaded = load(&cmd.model, &cmd.engine, quiet)?;
    if !quiet {
        eprintln!("{}", header(&loaded));
    }
    let model = &mut loaded.model;
    cmd.speculation.attach_draft(model, &cmd.engine, quiet)?;

    // Render the chat template when asked, then tokenize.
    let rendered = if chat {
        model.apply_chat_template(&messages(text), true)?
    } else {
        text
    };
    let prompt = model.encode(&rendered, true)?;
    if cmd.output.verbose {
        eprintln!("prompt: {} tokens", prompt.len());
    }

    // Stream the text to stdout (or collect it for --json).
    let mut collected = String::new();
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let json = cmd.json;
    let seq = model.new_sequence();
    let request = GenerationRequest {
        sampling,
        max_new: cmd.max_new,
        stop: cmd.sampling.stop.clone(),
        interrupt: None,
        progress: on_terminal(quiet),
        speculation,
    };
    let (stats, _) = generate(model, seq, prompt, request, |piece| {
        if json {
            collected.push_str(piece);
        } else {
            out.write_all(piece.as_bytes())?;
            out.flush()?;
        }
        Ok(())
    })?;
    let peak = peak_rss();
    if json {
        let result = RunResult {
            model: model.path().display().to_string(),
            format: model.executor().backend().name().to_string(),
            architecture: model.config().arch.name().to_string(),
            text: collected,
            stats,
            load_seconds: loaded.load_time.as_secs_f64(),
            peak_rss_bytes: peak,
        };
        writeln!(out, "{}", serde_json::to_string(&result)?)?;
    } else {
        writeln!(out)?;
        out.flush()?;
        if stats.finish_reason == "context" {
            eprintln!(
                "[stopped: the context of {} tokens is full; raise --ctx]",
                model.executor().context_size()
            );
        }
        if !cmd.output.quiet {
            eprintln!("{}", stats.summary_line(peak));
        }
    }
    finish_profile(model, &cmd.engine)
}
