//! `flatrun quantize IN OUT TYPE`: a GGUF in F32/F16/BF16 (or, with
//! `--allow-requantize`, already quantized) written again with the tensor
//! types of a llama-quantize mix. Metadata is copied, with
//! `general.file_type` and `general.quantization_version` set; tensors are
//! written in llama-quantize's order; each tensor is quantized by all
//! threads, rows split between them; the output appears under its name only
//! once complete.

use crate::progress::{Progress, on_terminal};
use crate::quantize_rules::{Chooser, MIXES, Mix, ModelFacts, llama_order};
use anyhow::{Context, Result, bail};
use flatrun_format::gguf_writer::{GgufWriter, TensorSpec};
use flatrun_format::{
    DType, GgmlType, GgufBackend, MetaValue, Metadata, QuantDescriptor, StorageBackend, TensorInfo,
};
use std::path::PathBuf;
use std::time::Instant;

/// Arguments of `flatrun quantize`.
#[derive(Debug, clap::Args)]
pub struct QuantizeArgs {
    /// The GGUF to quantize (F32, F16 or BF16 weights).
    pub input: PathBuf,
    /// Where to write the result.
    pub output: PathBuf,
    /// The mix: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K_S, Q3_K_M, Q3_K_L,
    /// Q4_K_S, Q4_K_M, Q5_K_S, Q5_K_M, Q6_K, IQ4_NL or Q1_0.
    #[arg(value_name = "TYPE")]
    pub mix: String,
    /// Quantize tensors that are already quantized (dequantized first;
    /// the quality is that of the worse of the two).
    #[arg(long)]
    pub allow_requantize: bool,
    /// Worker threads [default: all cores].
    #[arg(long)]
    pub threads: Option<usize>,
    /// Print nothing but errors.
    #[arg(short, long)]
    pub quiet: bool,
}

/// The GGML type of a GGUF tensor.
fn ggml_type(info: &TensorInfo) -> Option<GgmlType> {
    match (info.quant, info.dtype) {
        (QuantDescriptor::Ggml(t), _) | (QuantDescriptor::None, DType::Ggml(t)) => Some(t),
        _ => None,
    }
}

fn meta_usize(md: &Metadata, key: &str) -> Option<usize> {
    match md.get(key)? {
        MetaValue::Array(items) => items.first().and_then(MetaValue::as_u64),
        v => v.as_u64(),
    }
    .map(|v| v as usize)
}

/// What the rules need to know about the model.
fn model_facts(md: &Metadata, names: &[&str]) -> ModelFacts {
    let arch = md.get_str("general.architecture").unwrap_or("");
    let key = |k: &str| meta_usize(md, &format!("{arch}.{k}"));
    let n_head = key("attention.head_count").unwrap_or(1);
    let n_kv = key("attention.head_count_kv").unwrap_or(n_head).max(1);
    ModelFacts {
        falcon: arch == "falcon",
        n_gqa: n_head / n_kv,
        n_expert: key("expert_count").unwrap_or(0),
        n_layer: key("block_count").unwrap_or(0),
        tied_embeddings: !names.contains(&"output.weight"),
        n_attention_wv: names
            .iter()
            .filter(|n| {
                n.contains("attn_v.weight")
                    || n.contains("attn_qkv.weight")
                    || n.contains("attn_kv_b.weight")
            })
            .count(),
    }
}

/// Run the command.
pub fn run(args: &QuantizeArgs) -> Result<()> {
    let Some(mix) = Mix::parse(&args.mix) else {
        let names: Vec<&str> = MIXES.iter().map(|m| m.name).collect();
        bail!(
            "unknown quantization type `{}`\nhint: use one of {}",
            args.mix,
            names.join(", ")
        );
    };
    if args.input.is_dir() {
        bail!(
            "{} is a directory: `flatrun quantize` reads a GGUF file\nhint: convert a SafeTensors checkpoint to an F16 GGUF first (llama.cpp's convert_hf_to_gguf.py)",
            args.input.display()
        );
    }
    if args.threads == Some(0) {
        bail!("--threads must be at least 1");
    }
    let input = GgufBackend::open(&args.input)
        .map_err(|e| anyhow::anyhow!("cannot read {}: {e}", args.input.display()))?;
    if args.output.exists() && same_file(&args.input, &args.output) {
        bail!("the output {} is the input", args.output.display());
    }
    let tensors = input.tensors();
    let names: Vec<&str> = tensors.iter().map(|t| t.original_name.as_str()).collect();
    let facts = model_facts(input.metadata(), &names);
    let order = llama_order(&names);
    let mut chooser = Chooser::new(mix, facts);
    let mut plan = Vec::with_capacity(order.len());
    for &i in &order {
        let info = &tensors[i];
        let current = ggml_type(info)
            .with_context(|| format!("tensor {} has no GGML type", info.original_name))?;
        let dims: Vec<u64> = info.shape.iter().rev().map(|&d| d as u64).collect();
        let Some(target) = chooser.choose(&info.original_name, &dims, current) else {
            bail!(
                "tensor {}: rows of {} values do not hold whole {} blocks, and {} has no fallback type\nhint: choose another type",
                info.original_name,
                dims[0],
                mix.base,
                mix.base
            );
        };
        if target != current
            && !matches!(current, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16)
            && !args.allow_requantize
        {
            bail!(
                "tensor {} is already {current}: requantizing it to {target} loses more than quantizing the original\nhint: start from an F16/BF16/F32 GGUF, or pass --allow-requantize",
                info.original_name
            );
        }
        plan.push((i, dims, current, target));
    }

    let mut metadata = Metadata::new();
    for (k, v) in input.metadata().iter() {
        if k != "general.file_type" && k != "general.quantization_version" {
            metadata.push(k, v.clone());
        }
    }
    metadata.push("general.quantization_version", MetaValue::U32(2));
    metadata.push("general.file_type", MetaValue::U32(mix.ftype));
    let specs: Vec<TensorSpec> = plan
        .iter()
        .map(|(i, dims, _, target)| TensorSpec {
            name: tensors[*i].original_name.clone(),
            dims: dims.clone(),
            ty: *target,
        })
        .collect();
    let mut writer = GgufWriter::create(&args.output, &metadata, &specs)
        .with_context(|| format!("cannot create {}", args.output.display()))?;

    let threads = args
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let bar = Progress::bar(on_terminal(args.quiet), plan.len() as u64, "tensors");
    let started = Instant::now();
    let (mut bytes_in, mut bytes_out) = (0u64, 0u64);
    for (n, (i, dims, current, target)) in plan.iter().enumerate() {
        let info = &tensors[*i];
        let handle = input
            .tensor(&info.name)
            .map_err(|e| anyhow::anyhow!("cannot read tensor {}: {e}", info.original_name))?;
        bytes_in += handle.bytes().len() as u64;
        let data = if current == target {
            handle.bytes().to_vec()
        } else {
            let values = flatrun_dequant::dequantize_handle_to_vec(&handle)
                .map_err(|e| anyhow::anyhow!("cannot decode tensor {}: {e}", info.original_name))?;
            encode(*target, &values, dims[0] as usize, threads)
                .with_context(|| format!("cannot quantize tensor {}", info.original_name))?
        };
        bytes_out += data.len() as u64;
        writer
            .write_tensor(&data)
            .with_context(|| format!("cannot write {}", args.output.display()))?;
        if !args.quiet {
            let line = format!(
                "[{:4}/{:4}] {:<36} {:>20} {:>6} -> {}",
                n + 1,
                plan.len(),
                info.original_name,
                format!("{dims:?}"),
                current.to_string(),
                target
            );
            bar.suspend(|| eprintln!("{line}"));
        }
        bar.inc();
    }
    bar.finish();
    let path = writer
        .finish()
        .with_context(|| format!("cannot write {}", args.output.display()))?;
    if !args.quiet {
        eprintln!(
            "quantized {} to {} ({}): {:.1} MiB -> {:.1} MiB in {:.1} s",
            args.input.display(),
            path.display(),
            mix.name,
            bytes_in as f64 / 1048576.0,
            bytes_out as f64 / 1048576.0,
            started.elapsed().as_secs_f64()
        );
    }
    Ok(())
}

fn same_file(a: &std::path::Path, b: &std::path::Path) -> bool {
    match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    }
}

/// `values` (rows of `row` values) encoded as `ty`, rows split over `threads`.
fn encode(ty: GgmlType, values: &[f32], row: usize, threads: usize) -> Result<Vec<u8>> {
    let row_bytes = ty
        .bytes_for(row as u64)
        .context("the row does not hold whole blocks")? as usize;
    let rows = values.len() / row.max(1);
    let mut out = vec![0u8; rows * row_bytes];
    match ty {
        GgmlType::F32 => {
            for (o, v) in out.chunks_exact_mut(4).zip(values) {
                o.copy_from_slice(&v.to_le_bytes());
            }
            return Ok(out);
        }
        GgmlType::F16 => {
            for (o, v) in out.chunks_exact_mut(2).zip(values) {
                o.copy_from_slice(&half::f16::from_f32(*v).to_le_bytes());
            }
            return Ok(out);
        }
        _ => {}
    }
    let per_thread = rows.div_ceil(threads.max(1)).max(1);
    std::thread::scope(|s| -> Result<()> {
        let jobs: Vec<_> = out
            .chunks_mut(per_thread * row_bytes)
            .zip(values.chunks(per_thread * row))
            .map(|(dst, src)| s.spawn(move || flatrun_dequant::quantize_chunk(ty, src, dst)))
            .collect();
        for job in jobs {
            job.join()
                .map_err(|_| anyhow::anyhow!("a quantizer thread panicked"))??;
        }
        Ok(())
    })?;
    Ok(out)
}
