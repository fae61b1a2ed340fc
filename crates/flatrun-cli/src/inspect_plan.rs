//! The memory plan of `flatrun inspect`: bytes per decoder layer, output
//! head and embedding, and the peak each residency mode implies; and
//! `--layer N`, one layer's tensors.
//!
//! The peak of each mode is the runtime's own `flatrun_runtime::MemoryPlan` (the one
//! `run` checks before loading): weights kept, read buffers of what
//! streams, the KV cache in memory (all of it when resident; the layers in
//! flight when streamed from its file) and the work buffers of a step; the
//! KV cache is sized for the model's whole trained context.

use crate::flags::{human_bytes, residency_name};
use anyhow::{Result, bail};
use flatrun_model::{Checkpoint, Manifest, ModelConfig};
use flatrun_runtime::{KvCache, KvType, LoadOptions, Residency, ResidencyPlan};
use serde::Serialize;
use std::fmt::Write;
use std::path::Path;

/// Bytes of the model's parts and the peak of each residency mode.
#[derive(Debug, Serialize)]
pub struct MemoryPlan {
    pub embedding_bytes: u64,
    pub output_head_bytes: u64,
    pub output_tied: bool,
    pub layer_bytes: Vec<u64>,
    pub largest_layer_bytes: u64,
    pub total_weight_bytes: u64,
    /// Context the KV cache is sized for.
    pub ctx: usize,
    /// f16 KV cache bytes at `ctx`.
    pub kv_cache_bytes: u64,
    pub modes: Vec<ModePeak>,
    /// Memory the process may fill (inside a memory cgroup, its limit less
    /// its usage), when known.
    pub headroom_bytes: Option<u64>,
    /// The residency `run` picks with no `--residency` flag.
    pub default_residency: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub layer: Option<LayerDetail>,
    /// The routed experts of a mixture-of-experts model.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub experts: Option<ExpertPlan>,
}

/// How a mixture-of-experts model's routed experts weigh: what every layer
/// holds, and what one token reads of them.
#[derive(Debug, Serialize)]
pub struct ExpertPlan {
    pub n_expert: usize,
    pub n_used: usize,
    /// Bytes of all routed experts (every layer).
    pub expert_bytes: u64,
    /// Bytes of one expert (all its projections) in the largest layer.
    pub one_expert_bytes: u64,
    /// Bytes of everything else of the layers: attention, norms, routers,
    /// shared experts.
    pub dense_layer_bytes: u64,
    /// Bytes of the experts one token uses (read when none is cached).
    pub used_bytes_per_token: u64,
}

/// The estimated peak of one residency mode.
#[derive(Debug, Serialize)]
pub struct ModePeak {
    pub residency: String,
    pub resident_weight_bytes: u64,
    pub streamed_bytes_per_token: u64,
    pub peak_bytes: u64,
    /// Bytes of routed experts kept after use (mixture-of-experts models
    /// under a cap; part of `resident_weight_bytes`).
    pub expert_cache_bytes: u64,
    /// Bytes of routed experts a token reads on average if its experts
    /// were spread evenly (a cache holding a share of them hits that share).
    pub expert_bytes_per_token: u64,
}

/// One layer's tensors (`--layer N`).
#[derive(Debug, Serialize)]
pub struct LayerDetail {
    pub index: usize,
    pub bytes: u64,
    pub tensors: Vec<LayerTensor>,
}

/// One tensor of a layer.
#[derive(Debug, Serialize)]
pub struct LayerTensor {
    pub name: String,
    pub dtype: String,
    pub shape: Vec<usize>,
    pub bytes: u64,
}

/// Build the plan for `path`; `None` when the architecture is not one the
/// runtime runs (the rest of `inspect` still works then).
pub fn plan(path: &Path, layer: Option<usize>) -> Result<Option<MemoryPlan>> {
    let Ok(checkpoint) = Checkpoint::open(path) else {
        return Ok(None);
    };
    if !checkpoint.is_gguf() && checkpoint.side_files().is_none() {
        return Ok(None);
    }
    let backend = checkpoint.backend();
    let Ok(cfg) = checkpoint.config() else {
        if layer.is_some() {
            bail!(
                "--layer needs a model whose architecture flatrun runs ({})",
                path.display()
            );
        }
        return Ok(None);
    };
    let Ok(manifest) = Manifest::build(&cfg, backend.tensors()) else {
        return Ok(None);
    };
    let detail = match layer {
        None => None,
        Some(i) => {
            let Some(entry) = manifest.layers.get(i) else {
                bail!(
                    "--layer {i}: the model has {} layers (0..={})",
                    manifest.layers.len(),
                    manifest.layers.len().saturating_sub(1)
                );
            };
            let dtype_of = |name: &str| {
                backend
                    .tensors()
                    .iter()
                    .find(|t| t.name == name)
                    .map(|t| t.dtype.to_string())
                    .unwrap_or_else(|| "?".into())
            };
            Some(LayerDetail {
                index: i,
                bytes: entry.bytes,
                tensors: entry
                    .tensors
                    .iter()
                    .map(|t| LayerTensor {
                        name: t.name.clone(),
                        dtype: dtype_of(&t.name),
                        shape: t.shape.clone(),
                        bytes: t.bytes,
                    })
                    .collect(),
            })
        }
    };
    Ok(Some(build(&cfg, &manifest, detail)))
}

fn build(cfg: &ModelConfig, manifest: &Manifest, layer: Option<LayerDetail>) -> MemoryPlan {
    let layer_bytes: Vec<u64> = manifest.layers.iter().map(|l| l.bytes).collect();
    let largest = layer_bytes.iter().copied().max().unwrap_or(0);
    let embedding = manifest.embed.bytes;
    let head = if manifest.output_tied {
        0
    } else {
        manifest.output.bytes
    };
    let total = embedding + head + layer_bytes.iter().sum::<u64>() + manifest.output_norm.bytes;
    let opts = LoadOptions::default();
    let ctx = flatrun_runtime::context_size(cfg, &opts);
    let kv = KvCache::planned_layer_bytes(cfg, ctx, opts.max_batch, KvType::F16, KvType::F16)
        .iter()
        .sum();
    let headroom = flatrun_runtime::memory_headroom();
    let expert_total: u64 = manifest.layers.iter().map(|l| l.expert_bytes()).sum();
    let mode = |policy: Residency| {
        let p = ResidencyPlan::new(policy, manifest);
        let planned = flatrun_runtime::MemoryPlan::new(
            cfg,
            manifest,
            &LoadOptions {
                residency: policy,
                ..opts.clone()
            },
            None,
        );
        let used = manifest.used_expert_bytes_per_token();
        let kept_experts = if p.keeps_experts_whole() {
            expert_total
        } else {
            p.expert_cache_bytes
        };
        let share = kept_experts.min(expert_total) as f64 / expert_total.max(1) as f64;
        ModePeak {
            residency: residency_name(policy),
            resident_weight_bytes: p.resident_bytes,
            streamed_bytes_per_token: p.streamed_bytes_per_token,
            peak_bytes: planned.peak_bytes,
            expert_cache_bytes: p.expert_cache_bytes,
            expert_bytes_per_token: (used as f64 * (1.0 - share)) as u64,
        }
    };
    let experts = manifest.experts.map(|c| ExpertPlan {
        n_expert: c.n_expert,
        n_used: c.n_used,
        expert_bytes: expert_total,
        one_expert_bytes: manifest
            .layers
            .iter()
            .map(|l| l.expert_bytes() / c.n_expert.max(1) as u64)
            .max()
            .unwrap_or(0),
        dense_layer_bytes: manifest.layers.iter().map(|l| l.dense_bytes()).sum(),
        used_bytes_per_token: manifest.used_expert_bytes_per_token(),
    });
    let half = (total / 2).max(largest);
    MemoryPlan {
        embedding_bytes: embedding,
        output_head_bytes: manifest.output.bytes,
        output_tied: manifest.output_tied,
        layer_bytes,
        largest_layer_bytes: largest,
        total_weight_bytes: total,
        ctx,
        kv_cache_bytes: kv,
        modes: vec![
            mode(Residency::Resident),
            mode(Residency::Cap(half)),
            mode(Residency::Stream),
        ],
        headroom_bytes: headroom,
        default_residency: residency_name(flatrun_runtime::MemoryPlan::default_residency(
            cfg, manifest, &opts, headroom,
        )),
        layer,
        experts,
    }
}

/// The plan as text, appended to the `inspect` report.
pub fn render_text(plan: &MemoryPlan) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "\nmemory plan (KV cache f16 at the full context of {} tokens: {}; --ctx and --kv-type lower it)",
        plan.ctx,
        human_bytes(plan.kv_cache_bytes)
    );
    let _ = writeln!(s, "  embedding     {}", human_bytes(plan.embedding_bytes));
    let _ = writeln!(
        s,
        "  output head   {}{}",
        human_bytes(plan.output_head_bytes),
        if plan.output_tied {
            " (tied to the embedding)"
        } else {
            ""
        }
    );
    let min = plan.layer_bytes.iter().copied().min().unwrap_or(0);
    let _ = writeln!(
        s,
        "  layers        {} × {}{}",
        plan.layer_bytes.len(),
        human_bytes(plan.largest_layer_bytes),
        if min != plan.largest_layer_bytes {
            format!(" (smallest {})", human_bytes(min))
        } else {
            String::new()
        }
    );
    let _ = writeln!(
        s,
        "  total weights {}",
        human_bytes(plan.total_weight_bytes)
    );
    if let Some(e) = &plan.experts {
        let _ = writeln!(
            s,
            "  experts       {} per layer, {} used per token: {} in all ({} each), dense parts {}; a token uses {}",
            e.n_expert,
            e.n_used,
            human_bytes(e.expert_bytes),
            human_bytes(e.one_expert_bytes),
            human_bytes(e.dense_layer_bytes),
            human_bytes(e.used_bytes_per_token)
        );
    }
    let _ = writeln!(
        s,
        "  {:<16} {:>12} {:>16} {:>12}",
        "residency", "resident", "streamed/token", "peak"
    );
    for m in &plan.modes {
        let _ = write!(
            s,
            "  {:<16} {:>12} {:>16} {:>12}",
            m.residency,
            human_bytes(m.resident_weight_bytes),
            human_bytes(m.streamed_bytes_per_token),
            human_bytes(m.peak_bytes)
        );
        if plan.experts.is_some() && m.streamed_bytes_per_token > 0 {
            let _ = write!(
                s,
                "   expert cache {}, experts read/token ≈{} (spread evenly)",
                human_bytes(m.expert_cache_bytes),
                human_bytes(m.expert_bytes_per_token)
            );
        }
        s.push('\n');
    }
    let _ = writeln!(
        s,
        "  default         {}{}",
        plan.default_residency,
        match plan.headroom_bytes {
            Some(h) => format!(" (memory available: {})", human_bytes(h)),
            None => String::new(),
        }
    );
    if let Some(layer) = &plan.layer {
        let _ = writeln!(s, "\nlayer {} ({}):", layer.index, human_bytes(layer.bytes));
        for t in &layer.tensors {
            let _ = writeln!(
                s,
                "  {:<28} {:<8} {:<16} {:>12}",
                t.name,
                t.dtype,
                format!("{:?}", t.shape),
                human_bytes(t.bytes)
            );
        }
    }
    s
}

/// Add the plan to the JSON report as `memory_plan`.
pub fn attach(report: &mut serde_json::Value, plan: Option<&MemoryPlan>) -> Result<()> {
    if let (Some(plan), Some(object)) = (plan, report.as_object_mut()) {
        object.insert("memory_plan".into(), serde_json::to_value(plan)?);
    }
    Ok(())
}
