//! A Hugging Face SafeTensors checkpoint described as a GGUF, the way
//! llama.cpp's converter (`convert_hf_to_gguf.py --outtype f16`) writes it:
//!
//! * tensors under their GGUF names ([`flatrun_format::names::gguf_name`]),
//!   in the converter's storage types: F32 for vectors, norms and biases,
//!   F16 for every matrix;
//! * llama-family Q/K rows permuted so that llama.cpp's adjacent-pair RoPE
//!   equals the checkpoint's rotate-half one (the converter's `permute`);
//! * Gemma's `1 +` folded into every norm weight (computed in the
//!   checkpoint's f16 when it is f16, as the converter's torch does);
//! * the hyperparameters under `{arch}.*`, checked by reading them back
//!   ([`ModelConfig::from_gguf`] must describe the same model);
//! * the tokenizer and chat template under `tokenizer.*`.
//!
//! [`GgufExport::values`] turns a tensor's decoded values into the values
//! the converted file holds, so a quantizer sees exactly what it would see
//! reading the converter's F16 file.

use crate::checkpoint::Checkpoint;
use crate::config::{ModelConfig, RopeScaling};
use crate::error::{ModelError, Result};
use flatrun_format::names::gguf_name;
use flatrun_format::{DType, GgmlType, MetaValue, Metadata, QuantDescriptor, TensorInfo};

/// What happens to a tensor's values on the way into the GGUF.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Edit {
    /// Copied.
    None,
    /// Rows regrouped per head of `n_head` heads: each head's two halves
    /// interleaved into adjacent pairs.
    PermuteHeads { n_head: usize },
    /// `offset` added to every value.
    AddOffset { offset: f32 },
}

/// One tensor of the GGUF to write.
#[derive(Clone, Debug, PartialEq)]
pub struct ExportTensor {
    /// Its name in the checkpoint's listing (canonical).
    pub source: String,
    /// Its GGUF name.
    pub name: String,
    /// GGML dims, fastest axis first.
    pub dims: Vec<u64>,
    /// The type the converter stores it in (F32 or F16).
    pub ty: GgmlType,
    /// The edit applied to its values.
    pub edit: Edit,
    /// Whether the checkpoint stores it as F16 (the converter then does its
    /// arithmetic in f16).
    pub source_f16: bool,
}

/// A checkpoint's GGUF: metadata and tensors in the checkpoint's order.
#[derive(Clone, Debug)]
pub struct GgufExport {
    pub metadata: Metadata,
    pub tensors: Vec<ExportTensor>,
}

/// Architectures whose Hugging Face checkpoints can be written as GGUF.
const EXPORTABLE: &[&str] = &["llama", "qwen2", "qwen3", "gemma3"];

impl GgufExport {
    /// Describe a Hugging Face checkpoint (opened with [`Checkpoint::open`]).
    pub fn plan(ckpt: &Checkpoint) -> Result<GgufExport> {
        let dir = ckpt.side_files().ok_or_else(|| ModelError::ConfigFile {
            path: ckpt.path().to_path_buf(),
            what: "not a Hugging Face directory (no config.json next to the weights)".into(),
        })?;
        if ckpt.is_gguf() || ckpt.backend().name() == "mlx" {
            return Err(ModelError::ConfigFile {
                path: ckpt.path().to_path_buf(),
                what: format!(
                    "a {} checkpoint: only Hugging Face SafeTensors directories are converted",
                    ckpt.backend().name()
                ),
            });
        }
        let cfg = ckpt.config()?;
        let arch = cfg.arch.name();
        if !EXPORTABLE.contains(&arch) || cfg.moe.is_some() || cfg.delta_net.is_some() {
            return Err(ModelError::UnsupportedArch {
                name: format!("{arch} (as GGUF)"),
                supported: EXPORTABLE.to_vec(),
            });
        }
        let mut metadata = Metadata::new();
        metadata.push("general.architecture", MetaValue::String(arch.into()));
        let name = dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        metadata.push("general.name", MetaValue::String(name));
        for (k, v) in hparams(&cfg)? {
            metadata.push(&k, v);
        }
        for (k, v) in crate::tokenizer::gguf_tokenizer_keys(dir, cfg.vocab_size)? {
            metadata.push(&k, v);
        }
        check_round_trip(&cfg, &metadata)?;

        let permute = arch == "llama";
        let tensors = ckpt
            .backend()
            .tensors()
            .iter()
            .map(|info| export_tensor(info, &cfg, permute))
            .collect::<Result<Vec<_>>>()?;
        Ok(GgufExport { metadata, tensors })
    }

    /// The values tensor `t` holds in the GGUF, from its decoded values
    /// (`values`, row-major as the checkpoint stores them).
    pub fn values(t: &ExportTensor, mut values: Vec<f32>) -> Vec<f32> {
        let f16 = |v: f32| half::f16::from_f32(v).to_f32();
        match t.edit {
            Edit::None => {}
            Edit::PermuteHeads { n_head } => values = permute_heads(&values, &t.dims, n_head),
            Edit::AddOffset { offset } => {
                for v in &mut values {
                    *v = if t.source_f16 {
                        f16(*v + offset)
                    } else {
                        *v + offset
                    };
                }
            }
        }
        if t.ty == GgmlType::F16 {
            for v in &mut values {
                *v = f16(*v);
            }
        }
        values
    }
}

/// The converter's tensor: name, storage type and edit.
fn export_tensor(info: &TensorInfo, cfg: &ModelConfig, permute: bool) -> Result<ExportTensor> {
    let name = gguf_name(&info.name).ok_or_else(|| ModelError::BadShape {
        tensor: info.original_name.clone(),
        shape: info.shape.clone(),
        expected: "a tensor GGUF has a name for".into(),
    })?;
    let source_ty = match (info.quant, info.dtype) {
        (
            QuantDescriptor::None,
            DType::Ggml(t @ (GgmlType::F32 | GgmlType::F16 | GgmlType::BF16)),
        ) => t,
        _ => {
            return Err(ModelError::BadShape {
                tensor: info.original_name.clone(),
                shape: info.shape.clone(),
                expected: format!("F32, F16 or BF16 values, not {:?}", info.dtype),
            });
        }
    };
    let dims: Vec<u64> = info.shape.iter().rev().map(|&d| d as u64).collect();
    let vector = dims.len() <= 1 || name.ends_with("_norm.weight") || !name.ends_with(".weight");
    let ty = if vector { GgmlType::F32 } else { GgmlType::F16 };
    let is = |stem: &str| info.name.ends_with(stem) || info.name.ends_with(&format!("{stem}.bias"));
    let edit = if permute && is(".attn.q") {
        Edit::PermuteHeads { n_head: cfg.n_head }
    } else if permute && is(".attn.k") {
        Edit::PermuteHeads {
            n_head: cfg.n_kv_head,
        }
    } else if cfg.norm_weight_offset != 0.0 && name.ends_with("norm.weight") {
        Edit::AddOffset {
            offset: cfg.norm_weight_offset,
        }
    } else {
        Edit::None
    };
    if let Edit::PermuteHeads { n_head } = edit {
        let rows = dims.last().copied().unwrap_or(0) as usize;
        if n_head == 0 || dims.len() > 2 || !rows.is_multiple_of(2 * n_head) {
            return Err(ModelError::BadShape {
                tensor: info.original_name.clone(),
                shape: info.shape.clone(),
                expected: format!("rows in {n_head} heads of even size"),
            });
        }
    }
    Ok(ExportTensor {
        source: info.name.clone(),
        name,
        dims,
        ty,
        edit,
        source_f16: source_ty == GgmlType::F16,
    })
}

/// llama.cpp's converter `permute`: the rows of each of `n_head` heads,
/// `[half 0 | half 1]`, become `[h0[0], h1[0], h0[1], h1[1], …]` (a bias is
/// a matrix of one column).
fn permute_heads(values: &[f32], dims: &[u64], n_head: usize) -> Vec<f32> {
    let (cols, rows) = match dims {
        [rows] => (1, *rows as usize),
        [cols, rows, ..] => (*cols as usize, *rows as usize),
        [] => return values.to_vec(),
    };
    let half = rows / n_head / 2;
    let mut out = vec![0.0; values.len()];
    for h in 0..n_head {
        for i in 0..half {
            for part in 0..2 {
                let src = h * 2 * half + part * half + i;
                let dst = h * 2 * half + 2 * i + part;
                out[dst * cols..(dst + 1) * cols]
                    .copy_from_slice(&values[src * cols..(src + 1) * cols]);
            }
        }
    }
    out
}

/// The `{arch}.*` keys of a config.
fn hparams(cfg: &ModelConfig) -> Result<Vec<(String, MetaValue)>> {
    if cfg.rope_scaling != RopeScaling::None {
        return Err(ModelError::BadValue {
            key: "rope_scaling".into(),
            what: "RoPE scaling is not written to GGUF yet; only unscaled RoPE converts".into(),
        });
    }
    let a = cfg.arch.name();
    let mut out: Vec<(String, MetaValue)> = Vec::new();
    let mut put = |k: &str, v: MetaValue| out.push((format!("{a}.{k}"), v));
    let u32_of = |v: usize| MetaValue::U32(v as u32);
    put("block_count", u32_of(cfg.n_layer));
    put("context_length", u32_of(cfg.context_length));
    put("embedding_length", u32_of(cfg.n_embd));
    put("feed_forward_length", u32_of(cfg.n_ff));
    put("attention.head_count", u32_of(cfg.n_head));
    put("attention.head_count_kv", u32_of(cfg.n_kv_head));
    put("rope.freq_base", MetaValue::F32(cfg.rope_theta));
    put(
        "attention.layer_norm_rms_epsilon",
        MetaValue::F32(cfg.rms_eps),
    );
    if cfg.head_dim * cfg.n_head != cfg.n_embd || a == "gemma3" {
        put("attention.key_length", u32_of(cfg.head_dim));
        put("attention.value_length", u32_of(cfg.head_dim));
    }
    if a == "llama" {
        put("vocab_size", u32_of(cfg.vocab_size));
    }
    if a == "llama" || cfg.rope_dims != cfg.head_dim {
        put("rope.dimension_count", u32_of(cfg.rope_dims));
    }
    if let Some(window) = cfg.sliding_window {
        put("attention.sliding_window", u32_of(window));
        if cfg.swa_layers
            != crate::arch::gemma3::swa_layers(cfg.n_layer, crate::arch::gemma3::SWA_PATTERN)
        {
            put(
                "attention.sliding_window_pattern",
                MetaValue::Array(cfg.swa_layers.iter().map(|&b| MetaValue::Bool(b)).collect()),
            );
        }
        put("rope.freq_base_swa", MetaValue::F32(cfg.rope_theta_swa));
    }
    if let Some(cap) = cfg.final_logit_softcap {
        put("final_logit_softcapping", MetaValue::F32(cap));
    }
    Ok(out)
}

/// The GGUF's hyperparameters, read back, must describe the checkpoint's
/// model (but for what the tensors' edits account for: the RoPE layout of
/// permuted Q/K rows, and the norm offset folded into the weights).
fn check_round_trip(cfg: &ModelConfig, metadata: &Metadata) -> Result<()> {
    let back = ModelConfig::from_gguf(metadata)?;
    let mut expected = cfg.clone();
    expected.rope_layout = back.rope_layout;
    expected.norm_weight_offset = 0.0;
    if expected.vocab_size == 0 {
        expected.vocab_size = back.vocab_size;
    }
    if back != expected {
        return Err(ModelError::BadValue {
            key: "config.json".into(),
            what: format!(
                "GGUF metadata cannot express this model: it would read back as {back:?}, not {expected:?}"
            ),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permutation_interleaves_the_halves_of_each_head() {
        // 2 heads of 4 rows, 1 column: rows 0..8.
        let v: Vec<f32> = (0..8).map(|i| i as f32).collect();
        let p = permute_heads(&v, &[1, 8], 2);
        assert_eq!(p, vec![0., 2., 1., 3., 4., 6., 5., 7.]);
        // Whole rows move: 2 columns.
        let v: Vec<f32> = (0..8).map(|i| i as f32).collect();
        let p = permute_heads(&v, &[2, 4], 1);
        assert_eq!(p, vec![0., 1., 4., 5., 2., 3., 6., 7.]);
    }

    #[test]
    fn offsets_round_through_f16_for_f16_sources() {
        let t = ExportTensor {
            source: "layers.0.attn_norm".into(),
            name: "blk.0.attn_norm.weight".into(),
            dims: vec![1],
            ty: GgmlType::F32,
            edit: Edit::AddOffset { offset: 1.0 },
            source_f16: true,
        };
        let w = half::f16::from_f32(0.000_123).to_f32();
        let v = GgufExport::values(&t, vec![w]);
        assert_eq!(v[0], half::f16::from_f32(1.0 + w).to_f32());
        let v = GgufExport::values(
            &ExportTensor {
                source_f16: false,
                ..t
            },
            vec![w],
        );
        assert_eq!(v[0], 1.0 + w);
    }
}
