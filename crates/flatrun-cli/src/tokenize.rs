//! `flatrun tokenize`: the token ids of a text, like `llama-tokenize`.
//!
//! Only the tokenizer (and, with `--chat`, the chat template) is read from
//! the checkpoint; no weights are touched.

use crate::flags::read_text_file;
use crate::loading::check_model_path;
use anyhow::{Result, anyhow};
use flatrun_model::Checkpoint;
use flatrun_model::chat_template::{ChatMessage, ChatTemplate};
use flatrun_model::tokenizer::Tokenizer;
use serde::Serialize;
use std::io::Write;
use std::path::{Path, PathBuf};

/// Arguments of `flatrun tokenize`.
#[derive(Debug, clap::Args)]
#[command(group(clap::ArgGroup::new("input").required(true).args(["text", "file"])))]
pub struct TokenizeArgs {
    /// Checkpoint: a GGUF file, a SafeTensors / MLX directory, or a pulled
    /// `OWNER/NAME[:QUANT]` from the hub cache.
    #[arg(long, short, value_parser = crate::hub::model_arg)]
    pub model: PathBuf,
    /// Text to tokenize.
    #[arg(long, short)]
    pub text: Option<String>,
    /// Read the text from this file.
    #[arg(long, short, value_name = "FILE")]
    pub file: Option<PathBuf>,
    /// Do not add BOS/EOS and do not recognize special tokens in the text.
    #[arg(long)]
    pub no_special: bool,
    /// Wrap the text in the model's chat template as one user turn.
    #[arg(long)]
    pub chat: bool,
    /// Print JSON (`ids` and `pieces`) instead of one `id -> 'piece'` line per token.
    #[arg(long)]
    pub json: bool,
    /// Print only the ids, as a list.
    #[arg(long, conflicts_with = "json")]
    pub ids: bool,
}

#[derive(Serialize)]
struct TokenizeResult {
    ids: Vec<u32>,
    pieces: Vec<String>,
    count: usize,
}

/// The tokenizer and chat template of a checkpoint, without its weights.
fn open_tokenizer(path: &Path, with_template: bool) -> Result<(Tokenizer, Option<ChatTemplate>)> {
    check_model_path(path)?;
    let checkpoint =
        Checkpoint::open(path).map_err(|e| anyhow!("cannot open {}: {e}", path.display()))?;
    let unsupported = |e: String| anyhow!("{}: {e}", path.display());
    let tokenizer = checkpoint
        .tokenizer()
        .map_err(|e| unsupported(e.to_string()))?;
    let template = if with_template {
        let cfg = checkpoint
            .config()
            .map_err(|e| unsupported(e.to_string()))?;
        Some(
            checkpoint
                .chat_template(cfg.arch)
                .map_err(|e| unsupported(e.to_string()))?,
        )
    } else {
        None
    };
    Ok((tokenizer, template))
}

/// Run `flatrun tokenize`.
pub fn run(args: &TokenizeArgs) -> Result<()> {
    let mut text = match (&args.text, &args.file) {
        (Some(t), _) => t.clone(),
        (None, Some(path)) => read_text_file(path)?,
        (None, None) => return Err(anyhow!("pass --text TEXT or --file FILE")),
    };
    let (tokenizer, template) = open_tokenizer(&args.model, args.chat)?;
    if let Some(template) = template {
        let piece = |id: Option<u32>| {
            id.map(|i| String::from_utf8_lossy(&tokenizer.token_to_piece(i)).into_owned())
                .unwrap_or_default()
        };
        text = template
            .render(
                &[ChatMessage::new("user", text)],
                true,
                &piece(tokenizer.bos()),
                &piece(tokenizer.eos()),
            )
            .map_err(|e| anyhow!("chat template: {e}"))?;
    }
    let special = !args.no_special;
    let ids = tokenizer
        .encode(&text, special, special)
        .map_err(|e| anyhow!("tokenizer: {e}"))?;
    let pieces: Vec<String> = ids
        .iter()
        .map(|&id| String::from_utf8_lossy(&tokenizer.token_to_piece(id)).into_owned())
        .collect();
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    if args.json {
        let count = ids.len();
        writeln!(
            out,
            "{}",
            serde_json::to_string(&TokenizeResult { ids, pieces, count })?
        )?;
    } else if args.ids {
        let list: Vec<String> = ids.iter().map(u32::to_string).collect();
        writeln!(out, "[{}]", list.join(", "))?;
    } else {
        for (id, piece) in ids.iter().zip(&pieces) {
            writeln!(out, "{id:6} -> '{piece}'")?;
        }
        eprintln!("{} tokens", ids.len());
    }
    Ok(())
}
