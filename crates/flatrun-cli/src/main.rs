//! The `flatrun` command.

use anyhow::Result;
use clap::{Parser, Subcommand};

mod inspect;
mod run;

/// Flatrun: streaming LLM inference from GGUF, SafeTensors and MLX checkpoints.
#[derive(Debug, Parser)]
#[command(name = "flatrun", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Describe a checkpoint: format, architecture, hyperparameters, tokenizer, tensors.
    Inspect(inspect::InspectArgs),
    /// Generate from a prompt (greedy by default); optionally dump logits and a profile.
    Run(run::RunArgs),
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Inspect(args) => inspect::run(&args),
        Command::Run(args) => run::run(args),
    }
}

fn main() -> Result<()> {
    run(Cli::parse())
}
