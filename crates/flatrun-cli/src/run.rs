//! `flatrun run`: generate from a prompt (greedy by default), optionally
//! dumping the logits of every evaluated position and a profile.

use anyhow::{Context, Result};
use flatrun_runtime::model::Session;
use flatrun_runtime::{
    BackendKind, ChatMessage, KvType, LoadOptions, Model, Prefetch, Residency, SamplingParams,
    StepOptions,
};
use std::io::Write;
use std::path::PathBuf;

/// Arguments of `flatrun run`.
#[derive(Debug, clap::Args)]
pub struct RunArgs {
    /// Checkpoint: a GGUF file, or a SafeTensors / MLX directory.
    #[arg(long, short)]
    pub model: PathBuf,
    /// Prompt text.
    #[arg(long, short)]
    pub prompt: String,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 128)]
    pub max_new: usize,
    /// `stream` (one layer resident), `resident`, or `cap=SIZE` (e.g. cap=200M).
    #[arg(long, default_value = "resident")]
    pub residency: String,
    /// `native` (SIMD, threaded) or `reference` (scalar).
    #[arg(long, default_value = "native")]
    pub backend: String,
    /// Kernel threads (default: physical cores).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Wrap the prompt in the model's chat template as one user turn.
    #[arg(long)]
    pub chat: bool,
    /// Write the f32 logits of every evaluated position as `[positions, vocab]` .npy.
    #[arg(long)]
    pub dump_logits: Option<PathBuf>,
    /// Context size in tokens.
    #[arg(long)]
    pub ctx: Option<usize>,
    /// KV cache type: f16 or f32.
    #[arg(long, default_value = "f16")]
    pub kv_type: String,
    /// Layers read ahead by the prefetch thread (0 = off).
    #[arg(long, default_value_t = 1)]
    pub prefetch: usize,
    /// Sampling temperature (0 = greedy).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Sampling seed.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Print the profile summary (per-op times, tokens/s, I/O wait, memory).
    #[arg(long)]
    pub profile: bool,
    /// Write a Chrome-trace JSON profile (open in ui.perfetto.dev).
    #[arg(long)]
    pub profile_save: Option<PathBuf>,
}

/// Run `flatrun run`.
pub fn run(args: RunArgs) -> Result<()> {
    let residency: Residency = args.residency.parse()?;
    let backend: BackendKind = args.backend.parse()?;
    let kv_type: KvType = args.kv_type.parse()?;
    let profiling = args.profile || args.profile_save.is_some();
    let opts = LoadOptions {
        backend,
        threads: args.threads,
        residency,
        prefetch: if args.prefetch == 0 {
            Prefetch::Off
        } else {
            Prefetch::Ahead {
                depth: args.prefetch,
            }
        },
        ctx: args.ctx,
        kv_type,
        profile: profiling,
        trace_memory: profiling,
        ..LoadOptions::default()
    };
    let mut model = Model::load(&args.model, opts)
        .with_context(|| format!("loading {}", args.model.display()))?;

    let text = if args.chat {
        model.apply_chat_template(&[ChatMessage::new("user", args.prompt.clone())], true)?
    } else {
        args.prompt.clone()
    };
    let prompt = model.encode(&text, true)?;
    let tokenizer = model.tokenizer()?.clone();
    let stop_ids = tokenizer.stop_ids().to_vec();
    let vocab = model.executor().vocab_size();
    let mut sampler = flatrun_model::sampling::Sampler::new(SamplingParams {
        temperature: args.temperature,
        seed: args.seed,
        ..SamplingParams::default()
    });

    let dump = args.dump_logits.is_some();
    let mut dumped: Vec<f32> = Vec::new();
    let mut session: Session = model.session();
    let mut out = session.step_with(
        &prompt,
        StepOptions {
            all_logits: dump,
            hidden: false,
        },
    )?;
    if let Some(all) = out.all_logits.take() {
        dumped.extend_from_slice(&all);
    }
    let mut decoder = flatrun_model::tokenizer::StreamDecoder::new(&tokenizer);
    let stdout = std::io::stdout();
    let mut stdout = stdout.lock();
    for _ in 0..args.max_new {
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
        if dump {
            dumped.extend_from_slice(&out.logits);
        }
    }
    write!(stdout, "{}", decoder.finish())?;
    writeln!(stdout)?;
    drop(session);

    if let Some(path) = &args.dump_logits {
        let rows = dumped.len() / vocab.max(1);
        flatrun_runtime::npy::write_f32_matrix(path, &dumped, rows, vocab)
            .with_context(|| format!("writing {}", path.display()))?;
        eprintln!("wrote {rows} × {vocab} logits to {}", path.display());
    }
    let profiler = model.profiler();
    eprintln!("{}", profiler.summary().trim_end());
    if let Some(path) = &args.profile_save {
        profiler
            .write_chrome_trace(path)
            .with_context(|| format!("writing {}", path.display()))?;
        eprintln!("profile written to {}", path.display());
    }
    Ok(())
}
