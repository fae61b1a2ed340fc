//! `flatrun chat`: an interactive conversation with history.
//!
//! Each turn renders the whole conversation with the model's chat template
//! and generates the assistant's answer. Commands: `/reset` (forget the
//! history), `/stats` (counts and speed), `/help`, `exit` or Ctrl-D (leave).
//! A line ending in `\` continues on the next line; `"""` opens and closes a
//! multi-line block. Ctrl-C stops the current answer and keeps the session.

use crate::flags::{human_bytes, EngineFlags, OutputFlags, SamplingFlags};
use crate::generation::{generate, GenerationStats};
use crate::interrupt::Interrupt;
use crate::loading::{finish_profile, header, load, peak_rss};
use anyhow::Result;
use flatrun_runtime::ChatMessage;
use std::io::{BufRead, Write};
use std::path::PathBuf;

/// Arguments of `flatrun chat`.
#[derive(Debug, clap::Args)]
pub struct ChatArgs {
    /// Checkpoint: a GGUF file, or a SafeTensors / MLX directory.
    #[arg(long, short)]
    pub model: PathBuf,
    /// Most tokens per answer.
    #[arg(long, short = 'n', default_value_t = 512)]
    pub max_new: usize,
    /// System prompt.
    #[arg(long)]
    pub system: Option<String>,
    #[command(flatten)]
    pub engine: EngineFlags,
    #[command(flatten)]
    pub sampling: SamplingFlags,
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
    let mut loaded = load(&args.model, &args.engine, args.output.quiet)?;
    if !args.output.quiet {
        eprintln!("{}", header(&loaded));
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
                eprintln!("(conversation cleared)");
                continue;
            }
            Input::Stats => {
                eprintln!(
                    "turns {turns}, history {} messages, generated {total_generated} tok in all, peak RSS {}\nlast answer: {}",
                    history.len(),
                    human_bytes(peak_rss()),
                    last.summary_line(peak_rss())
                );
                continue;
            }
            Input::Message(text) => text,
        };

        // Render the conversation with the new user turn and answer it.
        history.push(ChatMessage::new("user", message));
        let rendered = model.apply_chat_template(&history, true)?;
        let prompt = model.encode(&rendered, true)?;
        let mut answer = String::new();
        let stdout = std::io::stdout();
        let mut out = stdout.lock();
        let result = generate(
            model,
            prompt,
            sampling.clone(),
            args.max_new,
            args.sampling.stop.clone(),
            Some(interrupt.flag()),
            |piece| {
                answer.push_str(piece);
                out.write_all(piece.as_bytes())?;
                out.flush()?;
                Ok(())
            },
        );
        writeln!(out)?;
        out.flush()?;
        match result {
            Ok(stats) => {
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
                history.push(ChatMessage::new("assistant", answer));
            }
            Err(e) => {
                // Keep the session: drop the failed turn and say why.
                history.pop();
                eprintln!("error: {e:#}");
            }
        }
    }
    finish_profile(model, &args.engine)
}
