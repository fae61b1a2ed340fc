//! `flatrun chat`: an interactive conversation with history.
//!
//! Each turn renders the whole conversation with the model's chat template,
//! but only evaluates what the KV cache does not hold yet: the sequence is
//! kept between turns, rewound to the longest token prefix it shares with
//! the new rendering (an answer may tokenize differently once templated),
//! and only the rest is fed. Commands: `/reset` (forget the history and the
//! cache), `/stats` (counts, cached tokens, speed), `/help`, `exit` or
//! Ctrl-D (leave).
//! A line ending in `\` continues on the next line; `"""` opens and closes a
//! multi-line block. Ctrl-C stops the current answer and keeps the session.

use crate::flags::{EngineFlags, OutputFlags, SamplingFlags, SpeculationFlags, human_bytes};
use crate::generation::{GenerationRequest, GenerationStats, generate, reusable_prefix};
use crate::interrupt::Interrupt;
use crate::loading::{finish_profile, header, load, peak_rss};
use crate::progress::on_terminal;
use anyhow::Result;
use flatrun_model::chat_template::harmony::{self, HarmonyEvent, HarmonyStream};
use flatrun_runtime::{ChatMessage, ContextOverflow};
use std::io::{BufRead, Write};
use std::path::PathBuf;

/// Arguments of `flatrun chat`.
#[derive(Debug, clap::Args)]
pub struct ChatArgs {
    /// Checkpoint: a GGUF file, a SafeTensors / MLX directory, or a pulled
    /// `OWNER/NAME[:QUANT]` from the hub cache.
    #[arg(long, short, value_parser = crate::hub::model_arg)]
    pub model: PathBuf,
    /// Most tokens per answer.
    #[arg(long, short = 'n', default_value_t = 512)]
    pub max_new: usize,
    /// System prompt.
    #[arg(long)]
    pub system: Option<String>,
    /// A conversation longer than the context (less room for the answer):
    /// `error` refuses the turn, `truncate-middle` keeps the system prompt and
    /// the newest turns, dropping the oldest others.
    #[arg(long, default_value = "error", value_parser = ["error", "truncate-middle"])]
    pub context_overflow: String,
    #[command(flatten)]
    pub engine: EngineFlags,
    #[command(flatten)]
    pub sampling: SamplingFlags,
    #[command(flatten)]
    pub speculation: SpeculationFlags,
    #[command(flatten)]
    pub output: OutputFlags,
}

/// What the user typed.
enum Input {
    Message(String),
    Reset,
    Stats,
    Help,
    Exit,
    Empty,
}

/// The furthest a cached sequence is rewound; beyond it the prompt is
/// evaluated afresh (a sliding-window cache keeps only a little history
/// beyond its window, so a long rewind could need positions it dropped).
const MAX_REWIND: usize = 256;

const HELP: &str = "commands: /reset (forget the conversation), /stats, /help, exit (or Ctrl-D)\n\
                    multi-line: end a line with \\ to continue, or wrap text in \"\"\" ... \"\"\"\n\
                    Ctrl-C stops the current answer";

/// Read one user input (possibly several lines); `None` at end of input.
fn read_input(lines: &mut impl BufRead) -> Result<Option<Input>> {
    let mut read_line = |prompt: &str| -> Result<Option<String>> {
        eprint!("{prompt}");
        std::io::stderr().flush()?;
        let mut line = String::new();
        if lines.read_line(&mut line)? == 0 {
            return Ok(None);
        }
        Ok(Some(line.trim_end_matches(['\n', '\r']).to_string()))
    };
    let Some(first) = read_line(">>> ")? else {
        return Ok(None);
    };
    let mut text = String::new();
    if first.trim() == "\"\"\"" || first.trim_start().starts_with("\"\"\"") {
        // A """ block: everything up to the closing """.
        let mut rest = first.trim_start()[3..].to_string();
        loop {
            if let Some(end) = rest.find("\"\"\"") {
                text.push_str(&rest[..end]);
                break;
            }
            text.push_str(&rest);
            text.push('\n');
            match read_line("... ")? {
                Some(line) => rest = line,
                None => break,
            }
        }
    } else {
        // Trailing backslashes continue the line.
        let mut line = first;
        while let Some(stripped) = line.strip_suffix('\\') {
            text.push_str(stripped);
            text.push('\n');
            match read_line("... ")? {
                Some(next) => line = next,
                None => {
                    line = String::new();
                    break;
                }
            }
        }
        text.push_str(&line);
    }
    let trimmed = text.trim();
    Ok(Some(match trimmed {
        "" => Input::Empty,
        "exit" | "quit" | "/exit" | "/quit" | "/bye" => Input::Exit,
        "/reset" | "/clear" => Input::Reset,
        "/stats" => Input::Stats,
        "/help" | "/?" => Input::Help,
        _ => Input::Message(text.trim_matches('\n').to_string()),
    }))
}

/// Run `flatrun chat`.
pub fn run(args: ChatArgs) -> Result<()> {
    let sampling = args.sampling.params()?;
    let speculation = args.speculation.speculation()?;
    let overflow: ContextOverflow = args
        .context_overflow
        .parse()
        .map_err(|e| anyhow::anyhow!("--context-overflow: {e}"))?;
    let mut loaded = load(&args.model, &args.engine, args.output.quiet)?;
    if !args.output.quiet {
        eprintln!("{}", header(&loaded));
    }
    args.speculation
        .attach_draft(&mut loaded.model, &args.engine, args.output.quiet)?;
    if !args.output.quiet {
        eprintln!("{HELP}");
    }
    let interrupt = Interrupt::install()?;
    let model = &mut loaded.model;
    let system: Vec<ChatMessage> = args
        .system
        .iter()
        .map(|s| ChatMessage::new("system", s.clone()))
        .collect();
    let mut history = system.clone();
    // The KV cache of the conversation so far, reused across turns.
    let mut cache = Some(model.new_sequence());
    let mut last = GenerationStats::default();
    let mut turns = 0usize;
    let mut total_generated = 0usize;
    let stdin = std::io::stdin();
    let mut lines = stdin.lock();
    loop {
        interrupt.clear();
        let input = match read_input(&mut lines)? {
            Some(input) => input,
            None => {
                eprintln!();
                break;
            }
        };
        let message = match input {
            Input::Exit => break,
            Input::Empty => continue,
            Input::Help => {
                eprintln!("{HELP}");
                continue;
            }
            Input::Reset => {
                history = system.clone();
                cache = Some(model.new_sequence());
                eprintln!("(conversation cleared)");
                continue;
            }
            Input::Stats => {
                let (cached, capacity) = cache
                    .as_ref()
                    .map_or((0, 0), |seq| (seq.len(), seq.capacity()));
                eprintln!(
                    "turns {turns}, history {} messages, cached {cached} of {capacity} tokens, generated {total_generated} tok in all, peak RSS {}\n\
                     last turn: prefilled {} tok, reused {} cached tok\nlast answer: {}",
                    history.len(),
                    human_bytes(peak_rss()),
                    last.prompt_tokens,
                    last.cached_tokens,
                    last.summary_line(peak_rss())
                );
                continue;
            }
            Input::Message(text) => text,
        };

        // Render the conversation with the new user turn and answer it.
        history.push(ChatMessage::new("user", message));
        // Leave room for the answer (at most half the context).
        let ctx = model.executor().context_size();
        let room = ctx - args.max_new.min(ctx / 2);
        let prompt = match model.fit_conversation(&history, room, overflow) {
            Ok((kept, prompt, dropped)) => {
                if dropped > 0 {
                    eprintln!("[context full: dropped the {dropped} oldest messages]");
                    history = kept;
                }
                prompt
            }
            Err(e) => {
                history.pop();
                eprintln!(
                    "error: {e}\nhint: /reset, raise --ctx, or use --context-overflow truncate-middle"
                );
                continue;
            }
        };
        // Reuse the cached prefix; feed only the tokens after it.
        let mut seq = cache.take().unwrap_or_else(|| model.new_sequence());
        let keep = reusable_prefix(seq.tokens(), &prompt);
        if seq.len() - keep > MAX_REWIND {
            seq = model.new_sequence();
        } else {
            seq.truncate(keep);
        }
        let new_tokens = prompt[seq.len()..].to_vec();
        let mut answer = String::new();
        let stdout = std::io::stdout();
        let mut out = stdout.lock();
        let request = GenerationRequest {
            sampling: sampling.clone(),
            max_new: args.max_new,
            stop: args.sampling.stop.clone(),
            interrupt: Some(interrupt.flag()),
            progress: on_terminal(args.output.quiet),
            speculation: speculation.clone(),
        };
        // gpt-oss answers in channels: show the final one (the reasoning
        // with --verbose, on stderr); other models' text passes through.
        let mut channels = HarmonyStream::new();
        let verbose = args.output.verbose;
        let result = generate(model, seq, new_tokens, request, |piece| {
            answer.push_str(piece);
            for part in channels.push(piece) {
                show(&mut out, part, verbose)?;
            }
            out.flush()?;
            Ok(())
        });
        for part in channels.finish() {
            show(&mut out, part, verbose)?;
        }
        writeln!(out)?;
        out.flush()?;
        match result {
            Ok((stats, seq)) => {
                cache = Some(seq);
                if stats.finish_reason == "interrupted" {
                    eprintln!("[stopped]");
                } else if stats.finish_reason == "context" {
                    eprintln!("[the context is full: /reset to start over, or raise --ctx]");
                }
                if args.output.verbose {
                    eprintln!("{}", stats.summary_line(peak_rss()));
                }
                total_generated += stats.generated_tokens;
                last = stats;
                turns += 1;
                history.push(ChatMessage::new("assistant", harmony::final_text(&answer)));
            }
            Err(e) => {
                // Keep the session: drop the failed turn (and the cache,
                // which may hold part of it) and say why.
                history.pop();
                cache = Some(model.new_sequence());
                eprintln!("error: {e:#}");
            }
        }
    }
    finish_profile(model, &args.engine)
}

/// One part of an answer on the terminal: its text on stdout, reasoning on
/// stderr when verbose; a tool call (chat offers no tools) is not shown.
fn show(out: &mut impl Write, part: HarmonyEvent, verbose: bool) -> std::io::Result<()> {
    match part {
        HarmonyEvent::Content(text) => out.write_all(text.as_bytes()),
        HarmonyEvent::Reasoning(text) if verbose => {
            eprint!("{text}");
            Ok(())
        }
        _ => Ok(()),
    }
}
