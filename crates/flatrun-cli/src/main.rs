//! The `flatrun` command.

use anyhow::Result;
use clap::{Parser, Subcommand};

mod inspect;

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
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Inspect(args) => inspect::run(&args),
    }
}

fn main() -> Result<()> {
    run(Cli::parse())
}
