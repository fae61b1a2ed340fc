//! `flatrun perplexity`: the perplexity of a model on a text, with
//! `llama-perplexity`'s method and output. The text is tokenized once (BOS
//! as the model adds it, special tokens not parsed) and cut into chunks of
//! `--ctx` tokens; each chunk is evaluated from an empty cache, its first
//! token replaced by BOS when the model adds one, and the second half of
//! its positions scored (each predicts the next token, so a chunk scores
//! `ctx - 1 - ctx/2` tokens). A running estimate is printed per chunk, then
//! the final value ± its standard error.
//!
//! `--kl-divergence-base FILE` also saves the scored positions'
//! log-probabilities (llama.cpp's `_logits_` format); with
//! `--kl-divergence` the tokens come from that file instead and the model
//! is compared with it.

use crate::flags::{EngineFlags, OutputFlags, read_text_file};
use crate::loading::{finish_profile, header, load};
use crate::perplexity_stats::{
    self as stats, BaseHeader, Kld, Nll, covariance, mean_and_error, median, percentile,
};
use crate::progress::{Progress, on_terminal};
use anyhow::{Context, Result, bail};
use flatrun_runtime::{Model, StepOptions};
use std::io::{BufReader, BufWriter, Write};
use std::path::PathBuf;

/// Window used when `--ctx` is not given (`llama-perplexity -c 512`).
const DEFAULT_WINDOW: usize = 512;

/// Arguments of `flatrun perplexity`.
#[derive(Debug, clap::Args)]
pub struct PerplexityArgs {
    /// Checkpoint: a GGUF file, a SafeTensors / MLX directory, or a pulled
    /// `OWNER/NAME[:QUANT]` from the hub cache.
    #[arg(long, short, value_parser = crate::hub::model_arg)]
    pub model: PathBuf,
    /// The text to score (needs at least 2 × ctx tokens). Not needed with
    /// --kl-divergence: the tokens come from the base file.
    #[arg(
        long,
        short,
        value_name = "FILE",
        required_unless_present = "kl_divergence"
    )]
    pub file: Option<PathBuf>,
    /// Score at most this many chunks [default: all].
    #[arg(long)]
    pub chunks: Option<usize>,
    /// Save the base model's log-probabilities to FILE (or, with
    /// --kl-divergence, read them from it).
    #[arg(long, value_name = "FILE")]
    pub kl_divergence_base: Option<PathBuf>,
    /// Compare the model with the base log-probabilities of --kl-divergence-base.
    #[arg(long, requires = "kl_divergence_base")]
    pub kl_divergence: bool,
    #[command(flatten)]
    pub engine: EngineFlags,
    #[command(flatten)]
    pub output: OutputFlags,
}

/// The tokens to score and how they are cut.
struct Plan {
    tokens: Vec<u32>,
    n_ctx: usize,
    n_chunk: usize,
    bos: Option<u32>,
}

impl Plan {
    /// Positions scored per chunk.
    fn scored(&self) -> usize {
        self.n_ctx - 1 - self.n_ctx / 2
    }

    /// Chunk `i` as fed to the model.
    fn chunk(&self, i: usize) -> Vec<u32> {
        let mut chunk = self.tokens[i * self.n_ctx..(i + 1) * self.n_ctx].to_vec();
        if let Some(bos) = self.bos {
            chunk[0] = bos;
        }
        chunk
    }

    /// The tokens the scored positions of chunk `i` predict.
    fn targets(&self, i: usize) -> &[u32] {
        let start = i * self.n_ctx + self.n_ctx / 2 + 1;
        &self.tokens[start..(i + 1) * self.n_ctx]
    }
}

/// Run the command.
pub fn run(mut args: PerplexityArgs) -> Result<()> {
    let quiet = args.output.quiet;
    let mut base_in = None;
    let window = match &args.kl_divergence_base {
        Some(path) if args.kl_divergence => {
            let file = std::fs::File::open(path)
                .with_context(|| format!("cannot open {}", path.display()))?;
            let mut reader = BufReader::new(file);
            let h = stats::read_header(&mut reader)
                .with_context(|| format!("{} is not usable", path.display()))?;
            if args.engine.ctx.is_some_and(|c| c != h.n_ctx) {
                bail!(
                    "--ctx {} differs from the {} tokens per chunk of {}\nhint: drop --ctx",
                    args.engine.ctx.unwrap_or(0),
                    h.n_ctx,
                    path.display()
                );
            }
            let n_ctx = h.n_ctx;
            base_in = Some((h, reader));
            n_ctx
        }
        _ => args.engine.ctx.unwrap_or(DEFAULT_WINDOW),
    };
    if window < 4 {
        bail!("--ctx must be at least 4 for perplexity (half of each chunk is scored)");
    }
    args.engine.ctx = Some(window);
    let text = match (&args.file, &base_in) {
        (Some(path), None) => Some(read_text_file(path)?),
        _ => None,
    };

    let mut loaded = load(&args.model, &args.engine, quiet)?;
    if !quiet {
        eprintln!("{}", header(&loaded));
    }
    let model = &mut loaded.model;
    let tokenizer = model.tokenizer()?.clone();
    let bos = if tokenizer.adds_bos() {
        tokenizer.bos()
    } else {
        None
    };
    let vocab = model.executor().vocab_size();
    let plan = match (text, &base_in) {
        (Some(text), _) => {
            let tokens = tokenizer
                .encode(&text, true, false)
                .map_err(|e| anyhow::anyhow!("cannot tokenize the text: {e}"))?;
            if tokens.len() < 2 * window {
                bail!(
                    "the text has {} tokens; perplexity with --ctx {window} needs at least {}\n\
                     hint: use a longer text or a smaller --ctx",
                    tokens.len(),
                    2 * window
                );
            }
            let max = tokens.len() / window;
            Plan {
                n_chunk: args.chunks.map_or(max, |c| c.min(max)),
                tokens,
                n_ctx: window,
                bos,
            }
        }
        (None, Some((h, _))) => {
            if h.n_vocab != vocab {
                bail!(
                    "the base file has a vocabulary of {} tokens, the model {vocab}: not the same tokenizer",
                    h.n_vocab
                );
            }
            if let Some(&bad) = h.tokens.iter().find(|&&t| t as usize >= vocab) {
                bail!("the base file holds token id {bad}, beyond the model's vocabulary");
            }
            Plan {
                n_chunk: args.chunks.map_or(h.n_chunk, |c| c.min(h.n_chunk)),
                tokens: h.tokens.clone(),
                n_ctx: h.n_ctx,
                bos,
            }
        }
        (None, None) => bail!("--file is needed"),
    };
    if plan.n_chunk == 0 {
        bail!("--chunks must be at least 1");
    }
    if !quiet {
        eprintln!(
            "perplexity: {} tokens, {} chunks of {} (scoring {} positions each)",
            plan.tokens.len(),
            plan.n_chunk,
            plan.n_ctx,
            plan.scored()
        );
    }

    let mut scorer = match base_in {
        Some((_, reader)) => Scorer::Compare {
            kld: Kld::default(),
            reader,
            rows: Vec::new(),
        },
        None => match &args.kl_divergence_base {
            Some(path) => {
                let file = std::fs::File::create(path)
                    .with_context(|| format!("cannot create {}", path.display()))?;
                let mut writer = BufWriter::new(file);
                stats::write_header(
                    &mut writer,
                    &BaseHeader {
                        n_ctx: plan.n_ctx,
                        n_vocab: vocab,
                        n_chunk: plan.n_chunk,
                        tokens: plan.tokens.clone(),
                    },
                )
                .with_context(|| format!("cannot write {}", path.display()))?;
                Scorer::Save {
                    nll: Nll::default(),
                    writer,
                    path: path.clone(),
                    rows: vec![0; plan.scored() * stats::row_len(vocab)],
                }
            }
            None => Scorer::Plain(Nll::default()),
        },
    };

    let bar = Progress::bar(on_terminal(quiet), plan.n_chunk as u64, "chunks");
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    if matches!(scorer, Scorer::Compare { .. }) {
        writeln!(
            out,
            "chunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence              Δp RMS            Same top p"
        )?;
    }
    for i in 0..plan.n_chunk {
        let logits = scored_logits(model, &plan, i)?;
        let line = scorer.score(i, &logits, plan.targets(i), vocab)?;
        bar.inc();
        bar.suspend(|| -> std::io::Result<()> {
            write!(out, "{line}")?;
            out.flush()
        })?;
    }
    bar.finish();
    writeln!(out)?;
    scorer.finish(&mut out)?;
    drop(out);
    finish_profile(model, &args.engine)
}

/// Logits of the scored positions of chunk `i` (`scored × vocab`): the
/// first half is evaluated without output, the second with every position's.
fn scored_logits(model: &mut Model, plan: &Plan, i: usize) -> Result<Vec<f32>> {
    let chunk = plan.chunk(i);
    let first = plan.n_ctx / 2;
    let mut session = model.session();
    session.step(&chunk[..first])?;
    let out = session.step_with(
        &chunk[first..],
        StepOptions {
            all_logits: true,
            ..Default::default()
        },
    )?;
    let mut all = out
        .all_logits
        .context("the executor returned no per-position logits")?;
    let vocab = session.model().executor().vocab_size();
    all.truncate(plan.scored() * vocab);
    Ok(all)
}

/// What is done with each chunk's logits.
enum Scorer {
    /// Perplexity only.
    Plain(Nll),
    /// Perplexity, and the log-probabilities saved as a base file.
    Save {
        nll: Nll,
        writer: BufWriter<std::fs::File>,
        path: PathBuf,
        rows: Vec<u16>,
    },
    /// Comparison with a base file.
    Compare {
        kld: Kld,
        reader: BufReader<std::fs::File>,
        rows: Vec<u16>,
    },
}

impl Scorer {
    /// Score one chunk and return its line of output.
    fn score(&mut self, i: usize, logits: &[f32], targets: &[u32], vocab: usize) -> Result<String> {
        let rows = logits.chunks_exact(vocab).zip(targets);
        match self {
            Scorer::Plain(nll) => {
                for (row, &t) in rows {
                    nll.add(stats::nll(row, t as usize));
                }
                Ok(format!("[{}]{:.4},", i + 1, nll.ppl()))
            }
            Scorer::Save {
                nll,
                writer,
                path,
                rows: stored,
            } => {
                let len = stats::row_len(vocab);
                for ((row, &t), dst) in rows.zip(stored.chunks_exact_mut(len)) {
                    nll.add(stats::compress(row, dst, t as usize));
                }
                stats::write_rows(writer, stored)
                    .with_context(|| format!("cannot write {}", path.display()))?;
                Ok(format!("[{}]{:.4},", i + 1, nll.ppl()))
            }
            Scorer::Compare {
                kld,
                reader,
                rows: stored,
            } => {
                stats::read_rows(reader, vocab, targets.len(), stored)
                    .with_context(|| format!("the base file ends before chunk {}", i + 1))?;
                let len = stats::row_len(vocab);
                for ((row, &t), base) in rows.zip(stored.chunks_exact(len)) {
                    kld.add(row, base, t as usize);
                }
                Ok(kld_line(i, kld))
            }
        }
    }

    /// Print the final estimate (or the comparison's statistics).
    fn finish(self, out: &mut impl Write) -> Result<()> {
        match self {
            Scorer::Plain(nll) => final_estimate(out, &nll),
            Scorer::Save {
                nll,
                mut writer,
                path,
                ..
            } => {
                writer
                    .flush()
                    .with_context(|| format!("cannot write {}", path.display()))?;
                final_estimate(out, &nll)?;
                writeln!(out, "base log-probabilities saved to {}", path.display())?;
                Ok(())
            }
            Scorer::Compare { kld, .. } => kld_summary(out, kld),
        }
    }
}

fn final_estimate(out: &mut impl Write, nll: &Nll) -> Result<()> {
    match nll.estimate() {
        (ppl, Some(err)) => writeln!(out, "Final estimate: PPL = {ppl:.4} +/- {err:.5}")?,
        (ppl, None) => writeln!(
            out,
            "Final estimate: PPL = {ppl:.4} (no spread to estimate an error)"
        )?,
    }
    Ok(())
}

/// The per-chunk line of a comparison, as `llama-perplexity --kl-divergence`.
fn kld_line(i: usize, k: &Kld) -> String {
    let n = k.nll.count;
    let log_ppl = mean_and_error(k.nll.sum, k.nll.sum2, n);
    let ppl = log_ppl.0.exp();
    let base = mean_and_error(k.nll_base.sum, k.nll_base.sum2, n);
    let cov = covariance(k.nll.sum, k.nll_base.sum, k.sum_nll_nll_base, n);
    let ratio_err = (log_ppl.1 * log_ppl.1 + base.1 * base.1 - 2.0 * cov).sqrt();
    let kl = mean_and_error(k.kld.sum, k.kld.sum2, n);
    let mse = mean_and_error(k.p_diff.sum2, k.p_diff4, n);
    let rms = mse.0.sqrt();
    let top = k.same_top as f64 / n as f64;
    let top_err = (top * (1.0 - top) / (n as f64 - 1.0)).sqrt();
    format!(
        "{:4}    {:9.4} ± {:9.4}    {:10.5} ± {:10.5}    {:10.5} ± {:10.5}    {:6.3} ± {:6.3} %    {:6.3} ± {:6.3} %\n",
        i + 1,
        ppl,
        ppl * log_ppl.1,
        log_ppl.0 - base.0,
        ratio_err,
        kl.0,
        kl.1,
        100.0 * rms,
        100.0 * 0.5 / rms * mse.1,
        100.0 * top,
        100.0 * top_err
    )
}

/// The final statistics of a comparison, as `llama-perplexity --kl-divergence`.
fn kld_summary(out: &mut impl Write, mut k: Kld) -> Result<()> {
    let n = k.nll.count;
    if n < 100 {
        writeln!(out, "({n} positions: too few for the summary statistics)")?;
        return Ok(());
    }
    k.kld_values.sort_by(f32::total_cmp);
    k.p_diff_values.sort_by(f32::total_cmp);
    let log_ppl = mean_and_error(k.nll.sum, k.nll.sum2, n);
    let ppl = log_ppl.0.exp();
    let ppl_err = ppl * log_ppl.1;
    let base = mean_and_error(k.nll_base.sum, k.nll_base.sum2, n);
    let ppl_base = base.0.exp();
    let ppl_base_err = ppl_base * base.1;
    let cov = covariance(k.nll.sum, k.nll_base.sum, k.sum_nll_nll_base, n);
    let ratio = log_ppl.0 - base.0;
    let ratio_err = (log_ppl.1 * log_ppl.1 + base.1 * base.1 - 2.0 * cov).sqrt();
    let ppl_cov = ppl * ppl_base * cov;
    writeln!(out, "====== Perplexity statistics ======")?;
    writeln!(
        out,
        "Mean PPL(Q)                   : {ppl:10.6} ± {ppl_err:10.6}"
    )?;
    writeln!(
        out,
        "Mean PPL(base)                : {ppl_base:10.6} ± {ppl_base_err:10.6}"
    )?;
    writeln!(
        out,
        "Cor(ln(PPL(Q)), ln(PPL(base))): {:6.2}%",
        100.0 * cov / (log_ppl.1 * base.1)
    )?;
    writeln!(
        out,
        "Mean ln(PPL(Q)/PPL(base))     : {ratio:10.6} ± {ratio_err:10.6}"
    )?;
    writeln!(
        out,
        "Mean PPL(Q)/PPL(base)         : {:10.6} ± {:10.6}",
        ratio.exp(),
        ratio.exp() * ratio_err
    )?;
    writeln!(
        out,
        "Mean PPL(Q)-PPL(base)         : {:10.6} ± {:10.6}",
        ppl - ppl_base,
        (ppl_err * ppl_err + ppl_base_err * ppl_base_err - 2.0 * ppl_cov).sqrt()
    )?;
    writeln!(out)?;
    writeln!(out, "====== KL divergence statistics ======")?;
    let kl = mean_and_error(k.kld.sum, k.kld.sum2, n);
    let v = &k.kld_values;
    writeln!(out, "Mean    KLD: {:10.6} ± {:10.6}", kl.0, kl.1)?;
    writeln!(out, "Maximum KLD: {:10.6}", v[v.len() - 1])?;
    for (label, f) in [
        ("99.9%", 0.999),
        ("99.0%", 0.99),
        ("95.0%", 0.95),
        ("90.0%", 0.9),
    ] {
        writeln!(out, "{label}   KLD: {:10.6}", percentile(v, f))?;
    }
    writeln!(out, "Median  KLD: {:10.6}", median(v))?;
    for (label, f) in [
        ("10.0%", 0.1),
        (" 5.0%", 0.05),
        (" 1.0%", 0.01),
        (" 0.1%", 0.001),
    ] {
        writeln!(out, "{label}   KLD: {:10.6}", percentile(v, f))?;
    }
    writeln!(out, "Minimum KLD: {:10.6}", v[0])?;
    writeln!(out)?;
    writeln!(out, "====== Token probability statistics ======")?;
    let pd = mean_and_error(k.p_diff.sum, k.p_diff.sum2, n);
    let d = &k.p_diff_values;
    writeln!(
        out,
        "Mean    Δp: {:6.3} ± {:5.3} %",
        100.0 * pd.0,
        100.0 * pd.1
    )?;
    writeln!(out, "Maximum Δp: {:6.3}%", 100.0 * d[d.len() - 1])?;
    for (label, f) in [
        ("99.9%", 0.999),
        ("99.0%", 0.99),
        ("95.0%", 0.95),
        ("90.0%", 0.9),
        ("75.0%", 0.75),
    ] {
        writeln!(out, "{label}   Δp: {:6.3}%", 100.0 * percentile(d, f))?;
    }
    writeln!(out, "Median  Δp: {:6.3}%", 100.0 * median(d))?;
    for (label, f) in [
        ("25.0%", 0.25),
        ("10.0%", 0.1),
        (" 5.0%", 0.05),
        (" 1.0%", 0.01),
        (" 0.1%", 0.001),
    ] {
        writeln!(out, "{label}   Δp: {:6.3}%", 100.0 * percentile(d, f))?;
    }
    writeln!(out, "Minimum Δp: {:6.3}%", 100.0 * d[0])?;
    let rms = mean_and_error(k.p_diff.sum2, k.p_diff4, n);
    writeln!(
        out,
        "RMS Δp    : {:6.3} ± {:5.3} %",
        100.0 * rms.0.sqrt(),
        100.0 * 0.5 / rms.0.sqrt() * rms.1
    )?;
    let top = k.same_top as f64 / n as f64;
    writeln!(
        out,
        "Same top p: {:6.3} ± {:5.3} %",
        100.0 * top,
        100.0 * (top * (1.0 - top) / (n as f64 - 1.0)).sqrt()
    )?;
    Ok(())
}
