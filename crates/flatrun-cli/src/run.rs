//! `flatrun run --dump-logits FILE.npy`: generate greedily (or with the
//! sampling flags) and write the f32 logits of every evaluated position —
//! the prompt's, then one row per generated token that was fed back — as a
//! `[positions, vocab]` NumPy matrix. The fidelity and `--weights` /
//! `--layers` tests compare these dumps.

use crate::flags::{EngineFlags, OutputFlags};
use crate::loading::{finish_profile, header, load};
use anyhow::{Context, Result};
use flatrun_runtime::{SamplingParams, StepOptions};
use std::io::Write;
use std::path::Path;

/// What to evaluate and where the logits go.
pub struct DumpRequest<'a> {
    pub model: &'a Path,
    /// The prompt, already wrapped in the chat template when asked.
    pub prompt: DumpPrompt,
    pub max_new: usize,
    pub sampling: SamplingParams,
    pub engine: &'a EngineFlags,
    pub output: OutputFlags,
    pub path: &'a Path,
}

/// The prompt as plain text or as chat messages to render.
pub enum DumpPrompt {
    Text(String),
    Chat(Vec<flatrun_runtime::ChatMessage>),
}

/// Evaluate the prompt, generate, and write every position's logits.
pub fn dump_logits(req: DumpRequest<'_>) -> Result<()> {
    let quiet = req.output.quiet;
    let mut loaded = load(req.model, req.engine, quiet)?;
    if !quiet {
        eprintln!("{}", header(&loaded));
    }
    let model = &mut loaded.model;
    let text = match req.prompt {
        DumpPrompt::Text(text) => text,
        DumpPrompt::Chat(messages) => model.apply_chat_template(&messages, true)?,
    };
    let prompt = model.encode(&text, true)?;
    let tokenizer = model.tokenizer()?.clone();
    let stop_ids = tokenizer.stop_ids().to_vec();
    let vocab = model.executor().vocab_size();
    let mut sampler = flatrun_model::sampling::Sampler::new(req.sampling);

    // The prompt: every position's logits.
    let mut dumped: Vec<f32> = Vec::new();
    let mut session = model.session();
    let mut out = session.step_with(
        &prompt,
        StepOptions {
            all_logits: true,
            ..Default::default()
        },
    )?;
    if let Some(all) = out.all_logits.take() {
        dumped.extend_from_slice(&all);
    }
    // Each generated token is printed, fed back, and its logits appended.
    let mut decoder = flatrun_model::tokenizer::StreamDecoder::new(&tokenizer);
    let stdout = std::io::stdout();
    let mut stdout = stdout.lock();
    for _ in 0..req.max_new {
        let history = session.sequence().tokens().to_vec();
        let id = sampler.sample(&mut out.logits, &history);
        if stop_ids.contains(&id) {
            break;
        }
        if let Some(piece) = decoder.push(id) {
            write!(stdout, "{piece}")?;
            stdout.flush()?;
        }
        if session.sequence().len() + 1 > session.sequence().capacity() {
            eprintln!("\n[context full]");
            break;
        }
        out = session.step_with(&[id], StepOptions::default())?;
        dumped.extend_from_slice(&out.logits);
    }
    write!(stdout, "{}", decoder.finish())?;
    writeln!(stdout)?;
    drop(session);

    let rows = dumped.len() / vocab.max(1);
    flatrun_runtime::write_f32_matrix(req.path, &dumped, rows, vocab)
        .with_context(|| format!("cannot write {}", req.path.display()))?;
    if !quiet {
        eprintln!("wrote {rows} × {vocab} logits to {}", req.path.display());
        eprintln!("{}", model.profiler().summary().trim_end());
    }
    finish_profile(model, req.engine)
}
