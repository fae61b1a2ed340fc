//! `flatrun quantize IN OUT TYPE`: a GGUF in F32/F16/BF16 (or, with
//! `--allow-requantize`, already quantized) written again with the tensor
//! types of a llama-quantize mix. Metadata is copied, with
//! `general.file_type` and `general.quantization_version` set; tensors are
//! written in llama-quantize's order; each tensor is quantized by all
//! threads, rows split between them; the output appears under its name only
//! once complete.
//!
//! `IN` may also be a Hugging Face SafeTensors directory: it is read as the
//! F16 GGUF llama.cpp's converter would make of it (names, Q/K permutation,
//! norm offsets, hyperparameters, tokenizer and chat template:
//! [`flatrun_model::gguf_export`]), then quantized the same way.

use crate::progress::{Progress, on_terminal};
use crate::quantize_rules::{Chooser, MIXES, Mix, ModelFacts, llama_order};
use anyhow::{Context, Result, bail};
use flatrun_format::gguf_writer::{GgufWriter, TensorSpec};
use flatrun_format::{
    DType, GgmlType, GgufBackend, MetaValue, Metadata, QuantDescriptor, StorageBackend, TensorInfo,
};
use flatrun_model::Checkpoint;
use flatrun_model::gguf_export::{ExportTensor, GgufExport};
use std::path::PathBuf;
use std::time::Instant;

/// Arguments of `flatrun quantize`.
#[derive(Debug, clap::Args)]
pub struct QuantizeArgs {
    /// The GGUF to quantize (F32, F16 or BF16 weights), or a Hugging Face
    /// SafeTensors directory (converted as llama.cpp's convert_hf_to_gguf.py
    /// does, then quantized).
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
    if args.threads == Some(0) {
        bail!("--threads must be at least 1");
    }
    let input = Input::open(&args.input)?;
    if args.output.exists() && same_file(&args.input, &args.output) {
        bail!("the output {} is the input", args.output.display());
    }
    let tensors = input.tensors();
    let names: Vec<&str> = tensors.iter().map(|t| t.name.as_str()).collect();
    let facts = model_facts(input.metadata(), &names);
    let order = llama_order(&names);
    let mut chooser = Chooser::new(mix, facts);
    let mut plan = Vec::with_capacity(order.len());
    for &i in &order {
        let t = &tensors[i];
        let current = t.ty;
        let dims = t.dims.clone();
        let Some(target) = chooser.choose(&t.name, &dims, current) else {
            bail!(
                "tensor {}: rows of {} values do not hold whole {} blocks, and {} has no fallback type\nhint: choose another type",
                t.name,
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
                t.name
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
            name: tensors[*i].name.clone(),
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
        let name = &tensors[*i].name;
        let (data, read) = input
            .tensor_bytes(*i, *target, threads)
            .with_context(|| format!("tensor {name}"))?;
        bytes_in += read;
        bytes_out += data.len() as u64;
        writer
            .write_tensor(&data)
            .with_context(|| format!("cannot write {}", args.output.display()))?;
        if !args.quiet {
            let line = format!(
                "[{:4}/{:4}] {:<36} {:>20} {:>6} -> {}",
                n + 1,
                plan.len(),
                name,
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

/// A tensor of the input, as the GGUF it is (or would be) names and stores it.
struct InputTensor {
    name: String,
    dims: Vec<u64>,
    ty: GgmlType,
}

/// What `flatrun quantize` reads: a GGUF, or a Hugging Face directory seen
/// as the F16 GGUF llama.cpp's converter would write.
enum Input {
    Gguf {
        file: GgufBackend,
        tensors: Vec<InputTensor>,
    },
    HuggingFace {
        ckpt: Box<Checkpoint>,
        export: GgufExport,
        tensors: Vec<InputTensor>,
    },
}

impl Input {
    fn open(path: &std::path::Path) -> Result<Input> {
        if path.is_dir() {
            let ckpt = Checkpoint::open(path)
                .map_err(|e| anyhow::anyhow!("cannot read {}: {e}", path.display()))?;
            let export = GgufExport::plan(&ckpt)
                .map_err(|e| anyhow::anyhow!("cannot convert {}: {e}", path.display()))?;
            let tensors = export
                .tensors
                .iter()
                .map(|t| InputTensor {
                    name: t.name.clone(),
                    dims: t.dims.clone(),
                    ty: t.ty,
                })
                .collect();
            return Ok(Input::HuggingFace {
                ckpt: Box::new(ckpt),
                export,
                tensors,
            });
        }
        let file = GgufBackend::open(path)
            .map_err(|e| anyhow::anyhow!("cannot read {}: {e}", path.display()))?;
        let tensors = file
            .tensors()
            .iter()
            .map(|info| {
                Ok(InputTensor {
                    name: info.original_name.clone(),
                    dims: info.shape.iter().rev().map(|&d| d as u64).collect(),
                    ty: ggml_type(info).with_context(|| {
                        format!("tensor {} has no GGML type", info.original_name)
                    })?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Input::Gguf { file, tensors })
    }

    fn tensors(&self) -> &[InputTensor] {
        match self {
            Input::Gguf { tensors, .. } | Input::HuggingFace { tensors, .. } => tensors,
        }
    }

    fn metadata(&self) -> &Metadata {
        match self {
            Input::Gguf { file, .. } => file.metadata(),
            Input::HuggingFace { export, .. } => &export.metadata,
        }
    }

    /// Tensor `i` encoded as `target`, and the bytes read for it.
    fn tensor_bytes(&self, i: usize, target: GgmlType, threads: usize) -> Result<(Vec<u8>, u64)> {
        let row = self.tensors()[i].dims[0] as usize;
        match self {
            Input::Gguf { file, tensors } => {
                let info = &file.tensors()[i];
                let handle = file
                    .tensor(&info.name)
                    .map_err(|e| anyhow::anyhow!("cannot read it: {e}"))?;
                let read = handle.bytes().len() as u64;
                if tensors[i].ty == target {
                    return Ok((handle.bytes().to_vec(), read));
                }
                let values = flatrun_dequant::dequantize_handle_to_vec(&handle)
                    .map_err(|e| anyhow::anyhow!("cannot decode it: {e}"))?;
                Ok((encode(target, &values, row, threads)?, read))
            }
            Input::HuggingFace { ckpt, export, .. } => {
                let t: &ExportTensor = &export.tensors[i];
                let handle = ckpt
                    .backend()
                    .tensor(&t.source)
                    .map_err(|e| anyhow::anyhow!("cannot read it: {e}"))?;
                let read = handle.bytes().len() as u64;
                let values = flatrun_dequant::dequantize_handle_to_vec(&handle)
                    .map_err(|e| anyhow::anyhow!("cannot decode it: {e}"))?;
                let values = GgufExport::values(t, values);
                Ok((encode(target, &values, row, threads)?, read))
            }
        }
    }
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
