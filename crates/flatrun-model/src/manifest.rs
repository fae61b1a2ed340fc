//! The layer manifest: which canonical tensors make up each decoder layer and
//! the model's non-layer tensors, with their byte sizes. It is built from a
//! backend's tensor table, so the same code serves GGUF, SafeTensors and MLX;
//! the runtime's scheduler walks it to acquire, prefetch and release weights.

use crate::arch::{Need, Role, expert_tensor, parse_expert_tensor, parse_layer_tensor};
use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use flatrun_format::TensorInfo;
use std::collections::HashMap;

/// One tensor of the manifest.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorEntry {
    /// Canonical name (`layers.3.attn.q`).
    pub name: String,
    /// Row-major logical shape.
    pub shape: Vec<usize>,
    /// Bytes of its data (main array plus MLX scales/biases when known).
    pub bytes: u64,
}

impl TensorEntry {
    /// The role of a per-layer tensor (`None` for the model's other tensors).
    pub fn role(&self) -> Option<Role> {
        parse_layer_tensor(&self.name).map(|(_, role)| role)
    }

    /// Whether it holds routed experts' matrices (stacked, or one expert's).
    pub fn is_experts(&self) -> bool {
        self.role().is_some_and(Role::is_experts)
    }
}

/// The tensors of one decoder layer.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerEntry {
    pub index: usize,
    pub tensors: Vec<TensorEntry>,
    /// Sum of the tensors' bytes.
    pub bytes: u64,
}

impl LayerEntry {
    /// Bytes of its routed experts' matrices (0 in a dense layer).
    pub fn expert_bytes(&self) -> u64 {
        self.tensors
            .iter()
            .filter(|t| t.is_experts())
            .map(|t| t.bytes)
            .sum()
    }

    /// Bytes of everything else: attention, norms, the router, shared
    /// experts (all of a dense layer).
    pub fn dense_bytes(&self) -> u64 {
        self.bytes - self.expert_bytes()
    }
}

/// Every tensor the forward pass reads, grouped by when it reads them.
#[derive(Clone, Debug, PartialEq)]
pub struct Manifest {
    /// Token embedding table `[vocab, n_embd]`.
    pub embed: TensorEntry,
    /// Decoder layers in execution order.
    pub layers: Vec<LayerEntry>,
    /// Final RMS norm.
    pub output_norm: TensorEntry,
    /// Output head `[vocab, n_embd]` (the embedding table when tied).
    pub output: TensorEntry,
    /// Whether the output head is the embedding table.
    pub output_tied: bool,
    /// Optional RoPE frequency factors (Llama 3 GGUF).
    pub rope_freqs: Option<TensorEntry>,
    /// The routed experts of a mixture-of-experts model's layers.
    pub experts: Option<ExpertCounts>,
}

/// How many routed experts a mixture-of-experts layer has and how many of
/// them one token uses: what the share of a layer's expert bytes a token
/// reads follows from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpertCounts {
    pub n_expert: usize,
    pub n_used: usize,
}

impl ExpertCounts {
    /// Bytes of `expert_bytes` (all of a layer's routed experts) that one
    /// token reads: its `n_used` experts.
    pub fn used_bytes(&self, expert_bytes: u64) -> u64 {
        expert_bytes * self.n_used.min(self.n_expert) as u64 / self.n_expert.max(1) as u64
    }
}

/// Canonical name of a per-layer tensor: `layers.{i}.{role}`.
pub use crate::arch::layer_tensor;

impl Manifest {
    /// Build the manifest of `cfg` over a backend's tensor table, checking that
    /// every tensor the architecture needs is present with a plausible shape.
    /// Each layer lists its tensors in the order of
    /// [`crate::arch::Architecture::layer_roles`].
    pub fn build(cfg: &ModelConfig, tensors: &[TensorInfo]) -> Result<Manifest> {
        let tensors_of = tensors;
        let by_name: HashMap<&str, &TensorInfo> =
            tensors.iter().map(|t| (t.name.as_str(), t)).collect();
        let arch = cfg.arch.name();
        let entry = |name: &str| -> Option<TensorEntry> {
            by_name.get(name).map(|t| TensorEntry {
                name: t.name.clone(),
                shape: t.shape.clone(),
                bytes: t.byte_size,
            })
        };
        let require = |name: &str| -> Result<TensorEntry> {
            entry(name).ok_or_else(|| ModelError::MissingTensor {
                arch: arch.to_string(),
                tensor: name.to_string(),
            })
        };

        let embed = require("embed")?;
        let (output, output_tied) = match entry("output") {
            Some(o) => (o, false),
            None => (embed.clone(), true),
        };
        check_matrix(&embed, cfg.n_embd)?;
        check_matrix(&output, cfg.n_embd)?;

        let mut layers = Vec::with_capacity(cfg.n_layer);
        for index in 0..cfg.n_layer {
            let roles = cfg.arch.layer_roles(cfg, index);
            let mut tensors = Vec::with_capacity(roles.len());
            for (role, need) in roles {
                let name = layer_tensor(index, role);
                match need {
                    // Experts stored one tensor per expert (Hugging Face):
                    // every one of them, in expert order.
                    Need::Required if role.is_experts() && entry(&name).is_none() => {
                        tensors.extend(split_experts(cfg, tensors_of, index, role)?)
                    }
                    Need::Required => tensors.push(require(&name)?),
                    Need::Optional => tensors.extend(entry(&name)),
                }
            }
            let bytes = tensors.iter().map(|t| t.bytes).sum();
            layers.push(LayerEntry {
                index,
                tensors,
                bytes,
            });
        }
        Ok(Manifest {
            embed,
            layers,
            output_norm: require("output_norm")?,
            output,
            output_tied,
            rope_freqs: entry("rope_freqs"),
            experts: cfg.moe.as_ref().map(|m| ExpertCounts {
                n_expert: m.n_expert,
                n_used: m.n_expert_used,
            }),
        })
    }

    /// Rows of the embedding table.
    pub fn vocab_size(&self) -> usize {
        self.embed.shape.first().copied().unwrap_or(0)
    }

    /// Bytes of the largest decoder layer.
    pub fn largest_layer_bytes(&self) -> u64 {
        self.layers.iter().map(|l| l.bytes).max().unwrap_or(0)
    }

    /// Bytes of the largest decoder layer without its routed experts: what
    /// streaming a layer whole reads, experts being read only once routed.
    pub fn largest_dense_layer_bytes(&self) -> u64 {
        self.layers
            .iter()
            .map(LayerEntry::dense_bytes)
            .max()
            .unwrap_or(0)
    }

    /// Bytes of the routed experts one token reads across all layers (none
    /// held by a cache).
    pub fn used_expert_bytes_per_token(&self) -> u64 {
        self.experts.map_or(0, |c| {
            self.layers
                .iter()
                .map(|l| c.used_bytes(l.expert_bytes()))
                .sum()
        })
    }

    /// Bytes of every tensor the forward pass reads (the tied head counted once).
    pub fn total_bytes(&self) -> u64 {
        let layers: u64 = self.layers.iter().map(|l| l.bytes).sum();
        let head = if self.output_tied {
            0
        } else {
            self.output.bytes
        };
        layers + self.embed.bytes + head + self.output_norm.bytes
    }
}

/// The tensors of a stacked expert role `role` of layer `layer` stored one
/// per expert (`layers.{layer}.ffn.gate_exps.{e}`), in expert order: exactly
/// the config's `n_expert` of them, each of one expert's shape. A missing
/// expert, an expert of another shape and an expert beyond the config's
/// count are errors naming the tensor.
fn split_experts(
    cfg: &ModelConfig,
    tensors: &[TensorInfo],
    layer: usize,
    role: Role,
) -> Result<Vec<TensorEntry>> {
    let arch = cfg.arch.name();
    let stacked = layer_tensor(layer, role);
    let mut experts: Vec<(usize, &TensorInfo)> = tensors
        .iter()
        .filter_map(|t| match parse_expert_tensor(&t.name) {
            Some((l, r, Some(e))) if l == layer && r == role => Some((e, t)),
            _ => None,
        })
        .collect();
    let (Some(moe), false) = (&cfg.moe, experts.is_empty()) else {
        return Err(ModelError::MissingTensor {
            arch: arch.to_string(),
            tensor: stacked,
        });
    };
    experts.sort_by_key(|&(e, _)| e);
    if let Some(&(e, t)) = experts.iter().find(|(e, _)| *e >= moe.n_expert) {
        return Err(ModelError::ExtraExpert {
            tensor: t.name.clone(),
            expert: e,
            n_expert: moe.n_expert,
        });
    }
    let shape = moe
        .expert_shape(cfg.n_embd, role)
        .expect("a stacked expert role");
    let mut out = Vec::with_capacity(moe.n_expert);
    for e in 0..moe.n_expert {
        let name = expert_tensor(layer, role, e);
        let t = match experts.get(e) {
            Some(&(i, t)) if i == e => t,
            _ => {
                return Err(ModelError::MissingTensor {
                    arch: arch.to_string(),
                    tensor: name,
                });
            }
        };
        if t.shape != shape {
            return Err(ModelError::BadShape {
                tensor: name,
                shape: t.shape.clone(),
                expected: format!("{shape:?} (one of {} experts)", moe.n_expert),
            });
        }
        out.push(TensorEntry {
            name,
            shape: t.shape.clone(),
            bytes: t.byte_size,
        });
    }
    Ok(out)
}

fn check_matrix(t: &TensorEntry, n_embd: usize) -> Result<()> {
    match t.shape.as_slice() {
        [_, cols] if *cols == n_embd => Ok(()),
        _ => Err(ModelError::BadShape {
            tensor: t.name.clone(),
            shape: t.shape.clone(),
            expected: format!("[vocab, {n_embd}]"),
        }),
    }
}
