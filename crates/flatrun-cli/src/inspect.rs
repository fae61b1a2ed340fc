//! `flatrun inspect PATH [--tensors] [--json]`: what a checkpoint is, read
//! through the storage layer without touching tensor bytes.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use flatrun_runtime::human_bytes;
use serde::Serialize;

/// Arguments of `flatrun inspect`.
#[derive(Debug, clap::Args)]
pub struct InspectArgs {
    /// A `.gguf` or `.safetensors` file, a Hugging Face / MLX directory, or
    /// a pulled `OWNER/NAME[:QUANT]` from the hub cache.
    #[arg(value_parser = crate::hub::model_arg)]
    pub path: PathBuf,
    /// List every tensor (canonical name, original name, dtype, shape, bytes, offset).
    #[arg(long)]
    pub tensors: bool,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
    /// Also list the tensors of decoder layer N (see `inspect_plan`).
    #[arg(long, value_name = "N")]
    pub layer: Option<usize>,
    /// Decode one tensor (canonical or original name) and print its value statistics.
    #[arg(long, value_name = "NAME")]
    pub tensor: Option<String>,
    /// With --tensor: write the decoded values as a row-major f32 `.npy` file.
    #[arg(long, value_name = "FILE.npy", requires = "tensor")]
    pub dump: Option<PathBuf>,
}

/// Everything `inspect` reports.
#[derive(Debug, Serialize)]
pub struct Report {
    pub path: PathBuf,
    pub format: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gguf_version: Option<u32>,
    pub files: Vec<PathBuf>,
    pub architecture: Option<String>,
    pub model_name: Option<String>,
    pub hyperparameters: Hyperparameters,
    pub tokenizer: Tokenizer,
    pub chat_template: bool,
    /// `true` when there is no `output` tensor and the logits reuse `embed`.
    pub tied_output: bool,
    pub tensor_count: usize,
    pub tensors_by_type: BTreeMap<String, usize>,
    pub total_bytes: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tensors: Option<Vec<TensorRow>>,
}

/// Key hyperparameters (absent ones are `null`).
#[derive(Debug, Default, Serialize)]
pub struct Hyperparameters {
    pub layers: Option<u64>,
    pub width: Option<u64>,
    pub ffn_width: Option<u64>,
    pub heads: Option<u64>,
    pub kv_heads: Option<u64>,
    pub head_dim: Option<u64>,
    pub context_length: Option<u64>,
    pub rope_base: Option<f64>,
    pub sliding_window: Option<u64>,
    pub vocab_size: Option<u64>,
}

/// Tokenizer kind and size.
#[derive(Debug, Default, Serialize)]
pub struct Tokenizer {
    pub kind: Option<String>,
    pub pre: Option<String>,
    pub size: Option<u64>,
    pub add_bos_token: Option<bool>,
}

/// One tensor of `--tensors`.
#[derive(Debug, Serialize)]
pub struct TensorRow {
    pub name: String,
    pub original_name: String,
    pub dtype: String,
    pub quant: String,
    pub shape: Vec<usize>,
    pub bytes: u64,
    pub offset: u64,
    pub file: usize,
}

/// Run the command: print the report as text or JSON.
pub fn run(args: &InspectArgs) -> Result<()> {
    if let Some(name) = &args.tensor {
        let r = crate::inspect_tensor::inspect_tensor(&args.path, name, args.dump.as_deref())?;
        let text = if args.json {
            serde_json::to_string_pretty(&r)? + "\n"
        } else {
            crate::inspect_tensor::render_text(&r)
        };
        return write_stdout(&text);
    }
    let report = inspect(&args.path, args.tensors)?;
    // The memory plan (and `--layer N`) come from `inspect_plan`.
    let plan = crate::inspect_plan::plan(&args.path, args.layer)?;
    let text = if args.json {
        let mut value = serde_json::to_value(&report)?;
        crate::inspect_plan::attach(&mut value, plan.as_ref())?;
        serde_json::to_string_pretty(&value)? + "\n"
    } else {
        render_text(&report)
            + &plan
                .as_ref()
                .map(crate::inspect_plan::render_text)
                .unwrap_or_default()
    };
    write_stdout(&text)
}

/// Print to stdout; a closed pipe (`flatrun inspect … | head`) is not an error.
fn write_stdout(text: &str) -> Result<()> {
    use std::io::Write;
    match std::io::stdout().lock().write_all(text.as_bytes()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e.into()),
        _ => Ok(()),
    }
}

/// Build the report for `path`.
pub fn inspect(path: &Path, with_tensors: bool) -> Result<Report> {
    let checkpoint = flatrun_model::Checkpoint::open(path)
        .with_context(|| format!("cannot open {}", path.display()))?;
    let backend = checkpoint.backend();
    let gguf_version = backend.format_version();
    // Model facts: GGUF metadata, or config.json + tokenizer files.
    let facts = match checkpoint.side_files() {
        Some(dir) => facts_from_directory(dir)?,
        None => facts_from_gguf_metadata(backend.metadata()),
    };

    let mut tensors_by_type = BTreeMap::new();
    for t in backend.tensors() {
        *tensors_by_type.entry(type_label(t)).or_insert(0) += 1;
    }
    let tensors = with_tensors.then(|| {
        backend
            .tensors()
            .iter()
            .map(|t| TensorRow {
                name: t.name.clone(),
                original_name: t.original_name.clone(),
                dtype: t.dtype.to_string(),
                quant: quant_label(&t.quant),
                shape: t.shape.clone(),
                bytes: t.byte_size,
                offset: t.offset,
                file: t.file_index,
            })
            .collect()
    });
    Ok(Report {
        path: path.to_path_buf(),
        format: backend.name().to_string(),
        gguf_version,
        files: backend.files().to_vec(),
        architecture: facts.architecture,
        model_name: facts.model_name,
        hyperparameters: facts.hyperparameters,
        tokenizer: facts.tokenizer,
        chat_template: facts.chat_template,
        tied_output: backend.contains("embed") && !backend.contains("output"),
        tensor_count: backend.tensors().len(),
        tensors_by_type,
        total_bytes: backend.total_bytes(),
        tensors,
    })
}

/// The type a tensor is counted under: its dtype, or the MLX quant with its
/// bits and group size (`MLX_Q4/g32`).
fn type_label(t: &flatrun_format::TensorInfo) -> String {
    match t.quant {
        flatrun_format::QuantDescriptor::MlxAffine {
            bits, group_size, ..
        } => format!("MLX_Q{bits}/g{group_size}"),
        _ => t.dtype.to_string(),
    }
}

fn quant_label(q: &flatrun_format::QuantDescriptor) -> String {
    match q {
        flatrun_format::QuantDescriptor::None => "none".into(),
        flatrun_format::QuantDescriptor::Ggml(t) => t.to_string(),
        flatrun_format::QuantDescriptor::MlxAffine {
            bits,
            group_size,
            scale_dtype,
        } => {
            format!("mlx affine {bits}-bit, group {group_size}, scales {scale_dtype}")
        }
    }
}

/// What the report says about the model besides its tensors.
#[derive(Default)]
struct ModelFacts {
    architecture: Option<String>,
    model_name: Option<String>,
    hyperparameters: Hyperparameters,
    tokenizer: Tokenizer,
    chat_template: bool,
}

/// Facts from GGUF keys (`{arch}.block_count`, `tokenizer.ggml.*`, …).
fn facts_from_gguf_metadata(m: &flatrun_format::Metadata) -> ModelFacts {
    let arch = m.get_str("general.architecture").map(str::to_string);
    let a = arch.clone().unwrap_or_default();
    let key = |k: &str| format!("{a}.{k}");
    let width = m.get_u64(&key("embedding_length"));
    let heads = m.get_u64(&key("attention.head_count"));
    let tokens = m.get_array_len("tokenizer.ggml.tokens").map(|n| n as u64);
    ModelFacts {
        model_name: m.get_str("general.name").map(str::to_string),
        hyperparameters: Hyperparameters {
            layers: m.get_u64(&key("block_count")),
            width,
            ffn_width: m.get_u64(&key("feed_forward_length")),
            heads,
            kv_heads: m.get_u64(&key("attention.head_count_kv")).or(heads),
            head_dim: m
                .get_u64(&key("attention.key_length"))
                .or_else(|| Some(width? / heads.filter(|&h| h > 0)?)),
            context_length: m.get_u64(&key("context_length")),
            rope_base: m.get_f64(&key("rope.freq_base")),
            sliding_window: m.get_u64(&key("attention.sliding_window")),
            vocab_size: m.get_u64(&key("vocab_size")).or(tokens),
        },
        tokenizer: Tokenizer {
            kind: m.get_str("tokenizer.ggml.model").map(str::to_string),
            pre: m.get_str("tokenizer.ggml.pre").map(str::to_string),
            size: tokens,
            add_bos_token: m.get_bool("tokenizer.ggml.add_bos_token"),
        },
        chat_template: m.get_str("tokenizer.chat_template").is_some(),
        architecture: arch,
    }
}

fn read_json(path: &Path) -> Result<Option<serde_json::Value>> {
    match std::fs::read(path) {
        Ok(bytes) => {
            Ok(Some(serde_json::from_slice(&bytes).with_context(|| {
                format!("{} is not JSON", path.display())
            })?))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e).with_context(|| format!("cannot read {}", path.display())),
    }
}

/// Facts from `config.json`, `tokenizer.json` and `tokenizer_config.json`.
fn facts_from_directory(dir: &Path) -> Result<ModelFacts> {
    let config = read_json(&dir.join("config.json"))?.unwrap_or_default();
    // Multimodal checkpoints keep the language model's settings in `text_config`.
    let text = config.get("text_config").unwrap_or(&config);
    let u = |k: &str| {
        text.get(k)
            .and_then(|v| v.as_u64())
            .or_else(|| config.get(k).and_then(|v| v.as_u64()))
    };
    let width = u("hidden_size");
    let heads = u("num_attention_heads");
    let tokenizer_json = read_json(&dir.join("tokenizer.json"))?;
    let tokenizer_config = read_json(&dir.join("tokenizer_config.json"))?;
    let tokenizer = tokenizer_json
        .as_ref()
        .map(|t| {
            let model = t.get("model");
            let vocab = model.and_then(|m| m.get("vocab"));
            let base = vocab
                .and_then(|v| {
                    v.as_object()
                        .map(|o| o.len())
                        .or_else(|| v.as_array().map(|a| a.len()))
                })
                .unwrap_or(0) as u64;
            let added = t
                .get("added_tokens")
                .and_then(|a| a.as_array())
                .map(|a| {
                    a.iter()
                        .filter_map(|x| x.get("id").and_then(|i| i.as_u64()))
                        .filter(|&id| id >= base)
                        .count()
                })
                .unwrap_or(0) as u64;
            Tokenizer {
                kind: model
                    .and_then(|m| m.get("type"))
                    .and_then(|v| v.as_str())
                    .map(str::to_string),
                pre: None,
                size: Some(base + added),
                add_bos_token: tokenizer_config
                    .as_ref()
                    .and_then(|c| c.get("add_bos_token"))
                    .and_then(|v| v.as_bool()),
            }
        })
        .unwrap_or_default();
    let chat_template = tokenizer_config
        .as_ref()
        .is_some_and(|c| c.get("chat_template").is_some())
        || dir.join("chat_template.jinja").is_file()
        || dir.join("chat_template.json").is_file();
    Ok(ModelFacts {
        architecture: text
            .get("model_type")
            .or_else(|| config.get("model_type"))
            .and_then(|v| v.as_str())
            .map(str::to_string),
        model_name: config
            .get("_name_or_path")
            .and_then(|v| v.as_str())
            .map(str::to_string),
        hyperparameters: Hyperparameters {
            layers: u("num_hidden_layers"),
            width,
            ffn_width: u("intermediate_size"),
            heads,
            kv_heads: u("num_key_value_heads").or(heads),
            head_dim: u("head_dim").or_else(|| Some(width? / heads.filter(|&h| h > 0)?)),
            context_length: u("max_position_embeddings"),
            rope_base: text
                .get("rope_theta")
                .or_else(|| config.get("rope_theta"))
                .and_then(|v| v.as_f64()),
            sliding_window: u("sliding_window"),
            vocab_size: u("vocab_size"),
        },
        tokenizer,
        chat_template,
    })
}

fn opt<T: std::fmt::Display>(v: &Option<T>) -> String {
    v.as_ref()
        .map_or_else(|| "?".to_string(), |v| v.to_string())
}

/// The text form of a report.
pub fn render_text(r: &Report) -> String {
    use std::fmt::Write;
    let h = &r.hyperparameters;
    let mut out = String::new();
    let mut line = |label: &str, value: String| {
        let _ = writeln!(out, "{:<16}{value}", format!("{label}:"));
    };
    line("path", r.path.display().to_string());
    let version = r.gguf_version.map_or(String::new(), |v| format!(" v{v}"));
    line(
        "format",
        format!(
            "{}{version} ({} file{})",
            r.format,
            r.files.len(),
            if r.files.len() == 1 { "" } else { "s" }
        ),
    );
    line("architecture", opt(&r.architecture));
    if let Some(name) = &r.model_name {
        line("name", name.clone());
    }
    line("layers", opt(&h.layers));
    line("width", opt(&h.width));
    line("ffn width", opt(&h.ffn_width));
    line(
        "heads",
        format!(
            "{} (KV heads {}, head dim {})",
            opt(&h.heads),
            opt(&h.kv_heads),
            opt(&h.head_dim)
        ),
    );
    line("context", opt(&h.context_length));
    line("rope base", opt(&h.rope_base));
    if let Some(w) = h.sliding_window {
        line("sliding window", w.to_string());
    }
    line("vocab size", opt(&h.vocab_size));
    line(
        "output head",
        if r.tied_output {
            "tied to embed".into()
        } else {
            "own `output` tensor".into()
        },
    );
    let t = &r.tokenizer;
    let pre = t
        .pre
        .as_ref()
        .map_or(String::new(), |p| format!(" (pre {p})"));
    let bos = t
        .add_bos_token
        .map_or(String::new(), |b| format!(", add_bos_token={b}"));
    line(
        "tokenizer",
        format!("{}{pre}, {} tokens{bos}", opt(&t.kind), opt(&t.size)),
    );
    line(
        "chat template",
        if r.chat_template {
            "yes".into()
        } else {
            "no".into()
        },
    );
    let by_type: Vec<String> = r
        .tensors_by_type
        .iter()
        .map(|(k, v)| format!("{k} {v}"))
        .collect();
    line(
        "tensors",
        format!("{} ({})", r.tensor_count, by_type.join(", ")),
    );
    line(
        "total bytes",
        format!("{} ({})", r.total_bytes, human_bytes(r.total_bytes)),
    );
    if let Some(rows) = &r.tensors {
        let _ = writeln!(out);
        let _ = writeln!(
            out,
            "{:<28} {:<40} {:<8} {:<16} {:>12} {:>12}",
            "canonical", "original", "dtype", "shape", "bytes", "offset"
        );
        for row in rows {
            let shape = format!("{:?}", row.shape);
            let offset = if r.files.len() > 1 {
                format!("{}:{}", row.file, row.offset)
            } else {
                row.offset.to_string()
            };
            let _ = writeln!(
                out,
                "{:<28} {:<40} {:<8} {:<16} {:>12} {:>12}",
                row.name, row.original_name, row.dtype, shape, row.bytes, offset
            );
        }
    }
    out
}
