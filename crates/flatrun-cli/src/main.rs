//! The `flatrun` command.
//!
//! `flatrun --model M --prompt "..."` (the same as `flatrun run ...`)
//! generates from a prompt; `chat`, `bench`, `inspect`, `tokenize`,
//! `serve`, `perplexity`, `quantize`, `pull`, `list` and `rm` are the other commands. Every error is printed as one or two
//! lines (cause, then a hint) with exit code 1; clap reports bad flags with
//! exit code 2.

use anyhow::Result;
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};

mod bench;
mod chat;
mod flags;
mod generation;
mod hub;
mod inspect;
mod inspect_plan;
mod inspect_tensor;
mod interrupt;
mod loading;
mod models;
mod perplexity;
mod perplexity_stats;
mod profile_table;
mod progress;
#[cfg(feature = "hub")]
mod pull;
mod quantize;
mod quantize_rules;
mod run;
mod run_cmd;
mod serve;
mod tokenize;

/// Flatrun: streaming LLM inference from GGUF, SafeTensors and MLX checkpoints.
///
/// Without a command, `flatrun --model M --prompt TEXT ...` is `flatrun run --model M --prompt TEXT ...`.
#[derive(Debug, Parser)]
#[command(name = "flatrun", version, arg_required_else_help = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Generate from a prompt and stream the text (the default command).
    Run(run_cmd::RunCommand),
    /// Talk with a model interactively (history, /reset, /stats, Ctrl-C stops an answer).
    Chat(chat::ChatArgs),
    /// Measure prefill and decode tokens/s (pp N / tg N) for each residency mode.
    Bench(bench::BenchArgs),
    /// Describe a checkpoint: format, architecture, tokenizer, tensors, memory plan.
    Inspect(inspect::InspectArgs),
    /// Turn text into token ids with the model's tokenizer.
    Tokenize(tokenize::TokenizeArgs),
    /// Serve OpenAI- and Anthropic-compatible HTTP endpoints.
    Serve(serve::ServeCommand),
    /// Perplexity of a text (llama-perplexity's method), or KL divergence against a base model.
    Perplexity(perplexity::PerplexityArgs),
    /// Write a GGUF again with the tensor types of a quantization mix (Q4_K_M, Q8_0, ...).
    Quantize(quantize::QuantizeArgs),
    /// Fetch a model from the Hugging Face Hub (OWNER/NAME[:QUANT or :FILE]) into its cache.
    #[cfg(feature = "hub")]
    Pull(pull::PullArgs),
    /// List the models in the Hugging Face Hub cache (name, format, architecture, quant mix, size, path).
    List(models::ListArgs),
    /// Remove a model (`OWNER/NAME[:QUANT]`) from the Hugging Face Hub cache.
    Rm(models::RmArgs),
}

/// The sampling flags given explicitly on the command line of `serve`.
fn explicit_sampling(matches: &clap::ArgMatches) -> Vec<&'static str> {
    let Some(("serve", sub)) = matches.subcommand() else {
        return Vec::new();
    };
    ["temperature", "top_p", "top_k", "seed"]
        .into_iter()
        .filter(|id| sub.value_source(id) == Some(clap::parser::ValueSource::CommandLine))
        .collect()
}

fn dispatch(cli: Cli, explicit: &[&str]) -> Result<()> {
    match cli.command {
        Command::Run(args) => run_cmd::run(args),
        Command::Chat(args) => chat::run(args),
        Command::Bench(args) => bench::run(args),
        Command::Inspect(args) => inspect::run(&args),
        Command::Tokenize(args) => tokenize::run(&args),
        Command::Serve(args) => serve::run(args, explicit),
        Command::Perplexity(args) => perplexity::run(args),
        Command::Quantize(args) => quantize::run(&args),
        #[cfg(feature = "hub")]
        Command::Pull(args) => pull::run(&args),
        Command::List(args) => models::list(&args),
        Command::Rm(args) => models::rm(&args),
    }
}

/// The command line with `run` inserted when it starts with a flag other
/// than help/version: `flatrun --model M ...` is `flatrun run --model M ...`.
fn with_default_command(mut args: Vec<std::ffi::OsString>) -> Vec<std::ffi::OsString> {
    let starts_with_flag = args
        .get(1)
        .and_then(|a| a.to_str())
        .is_some_and(|a| a.starts_with('-') && !matches!(a, "-h" | "--help" | "-V" | "--version"));
    if starts_with_flag {
        args.insert(1, "run".into());
    }
    args
}

fn main() -> std::process::ExitCode {
    let args = with_default_command(std::env::args_os().collect());
    let verbose = args.iter().any(|a| a == "-v" || a == "--verbose");
    let matches = Cli::command().get_matches_from(args);
    let cli = match Cli::from_arg_matches(&matches) {
        Ok(cli) => cli,
        Err(e) => e.exit(),
    };
    let explicit = explicit_sampling(&matches);
    match dispatch(cli, &explicit) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            // Closing the pipe we write to (`flatrun ... | head`) is not an error.
            if e.downcast_ref::<std::io::Error>()
                .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
            {
                return std::process::ExitCode::SUCCESS;
            }
            eprintln!("error: {}", one_or_two_lines(&e));
            // A backtrace is for panics; an error gets one only when asked
            // for twice (RUST_BACKTRACE and -v), never just from the shell.
            if verbose && e.backtrace().status() == std::backtrace::BacktraceStatus::Captured {
                eprintln!("{}", e.backtrace());
            }
            std::process::ExitCode::FAILURE
        }
    }
}

/// The error and its causes, joined, without repeating text a cause already
/// contains.
fn one_or_two_lines(e: &anyhow::Error) -> String {
    let mut parts: Vec<String> = Vec::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if !parts.iter().any(|p| p.contains(&text)) {
            parts.push(text);
        }
    }
    parts.join(": ")
}
