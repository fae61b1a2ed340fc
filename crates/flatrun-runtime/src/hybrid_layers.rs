//! The executor's side of hybrid stacks (Qwen3.5): per layer, the resident
//! small vectors (norms, conv kernel, decay constants), and one layer step —
//! acquire the layer's matrices, run [`qwen35::forward_layer`], release them
//! when the residency plan streams the layer. The per-sequence memory
//! (KV caches of the attention layers, [`crate::recurrent_state`] of the
//! delta-net layers) comes in through the segments.

use crate::error::{Result, RuntimeError};
use crate::memory;
use crate::profiler::Profiler;
use crate::residency::ResidencyPlan;
use flatrun_format::{StorageBackend, TensorHandle};
use flatrun_kernels::{Kernels, Weight};
use flatrun_model::arch::delta_net::DeltaNetWeights;
use flatrun_model::arch::qwen35::{
    self, GatedAttentionWeights, HybridSegment, Mixer, Qwen35LayerWeights, Qwen35Scratch,
};
use flatrun_model::arch::LayerPlan;
use flatrun_model::manifest::layer_tensor;
use flatrun_model::ModelConfig;
use std::time::Instant;

/// Resident f32 vectors of one layer.
#[derive(Debug)]
struct LayerVectors {
    attn_norm: Vec<f32>,
    /// `post_attention_norm`, in front of the FFN.
    ffn_norm: Vec<f32>,
    kind: MixerVectors,
}

#[derive(Debug)]
enum MixerVectors {
    Attention {
        q_norm: Vec<f32>,
        k_norm: Vec<f32>,
    },
    DeltaNet {
        conv1d: Vec<f32>,
        dt_bias: Vec<f32>,
        a: Vec<f32>,
        norm: Vec<f32>,
    },
}

/// Matrix roles of an attention layer, in the order the weights take them.
const ATTENTION_MATRICES: [&str; 7] = [
    "attn.q", "attn.k", "attn.v", "attn.o", "ffn.gate", "ffn.up", "ffn.down",
];
/// Matrix roles of a delta-net layer, in the order the weights take them.
const DELTA_NET_MATRICES: [&str; 8] = [
    "attn.qkv",
    "attn.gate",
    "ssm.alpha",
    "ssm.beta",
    "ssm.out",
    "ffn.gate",
    "ffn.up",
    "ffn.down",
];

/// The layers of a hybrid model: resident vectors, plans, scratch.
#[derive(Debug)]
pub(crate) struct HybridLayers {
    vectors: Vec<LayerVectors>,
    plans: Vec<LayerPlan>,
    scratch: Qwen35Scratch,
}

/// A 1-D (or small 2-D) tensor as f32, any dtype.
fn read_vector(
    backend: &dyn StorageBackend,
    kernels: &dyn Kernels,
    name: &str,
) -> Result<Vec<f32>> {
    let h = backend.tensor(name)?;
    let w = weight(&h)?;
    let mut out = vec![0.0; w.rows * w.cols];
    kernels
        .dequantize_rows(&w, 0..w.rows, &mut out)
        .map_err(|source| RuntimeError::Kernel {
            tensor: name.to_string(),
            source,
        })?;
    Ok(out)
}

fn weight<'a>(h: &TensorHandle<'a>) -> Result<Weight<'a>> {
    Weight::from_handle(h).map_err(|source| RuntimeError::Kernel {
        tensor: h.name().to_string(),
        source,
    })
}

impl HybridLayers {
    /// Read every layer's small vectors and plan its RoPE and attention.
    pub(crate) fn load(
        backend: &dyn StorageBackend,
        kernels: &dyn Kernels,
        cfg: &ModelConfig,
    ) -> Result<HybridLayers> {
        let read = |il: usize, role: &str| read_vector(backend, kernels, &layer_tensor(il, role));
        let mut vectors = Vec::with_capacity(cfg.n_layer);
        for il in 0..cfg.n_layer {
            let kind = if cfg.is_recurrent(il) {
                MixerVectors::DeltaNet {
                    conv1d: read(il, "ssm.conv1d")?,
                    dt_bias: read(il, "ssm.dt.bias")?,
                    a: read(il, "ssm.a")?,
                    norm: read(il, "ssm.norm")?,
                }
            } else {
                MixerVectors::Attention {
                    q_norm: read(il, "attn.q_norm")?,
                    k_norm: read(il, "attn.k_norm")?,
                }
            };
            vectors.push(LayerVectors {
                attn_norm: read(il, "attn_norm")?,
                ffn_norm: read(il, "post_attn_norm")?,
                kind,
            });
        }
        let plans = (0..cfg.n_layer)
            .map(|il| LayerPlan::new(cfg, il, None))
            .collect();
        Ok(HybridLayers {
            vectors,
            plans,
            scratch: Qwen35Scratch::default(),
        })
    }

    /// Run layer `il` for every token of the step: acquire its matrices,
    /// compute, release them unless the residency plan keeps the layer.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn run_layer(
        &mut self,
        il: usize,
        cfg: &ModelConfig,
        backend: &dyn StorageBackend,
        kernels: &dyn Kernels,
        residency: &ResidencyPlan,
        hidden: &mut [f32],
        positions: &[usize],
        segments: &mut [HybridSegment],
        profiler: &mut Profiler,
    ) -> Result<()> {
        let v = &self.vectors[il];
        let roles: &[&str] = match v.kind {
            MixerVectors::Attention { .. } => &ATTENTION_MATRICES,
            MixerVectors::DeltaNet { .. } => &DELTA_NET_MATRICES,
        };
        // Acquire: open the layer's matrices and fault their pages in.
        let t_io = Instant::now();
        let mut handles = Vec::with_capacity(roles.len());
        for role in roles {
            let h = backend.tensor(&layer_tensor(il, role))?;
            memory::populate(h.bytes());
            handles.push(h);
        }
        profiler.record_io_wait(il, t_io.elapsed());
        let m = handles.iter().map(weight).collect::<Result<Vec<_>>>()?;

        let (mixer, ffn) = match &v.kind {
            MixerVectors::Attention { q_norm, k_norm } => (
                Mixer::Attention(GatedAttentionWeights {
                    q: m[0],
                    k: m[1],
                    v: m[2],
                    o: m[3],
                    q_norm,
                    k_norm,
                }),
                &m[4..7],
            ),
            MixerVectors::DeltaNet {
                conv1d,
                dt_bias,
                a,
                norm,
            } => (
                Mixer::DeltaNet(DeltaNetWeights {
                    qkv: m[0],
                    z: m[1],
                    alpha: m[2],
                    beta: m[3],
                    out: m[4],
                    conv1d,
                    dt_bias,
                    a,
                    norm,
                }),
                &m[5..8],
            ),
        };
        let weights = Qwen35LayerWeights {
            attn_norm: &v.attn_norm,
            mixer,
            ffn_norm: &v.ffn_norm,
            gate: ffn[0],
            up: ffn[1],
            down: ffn[2],
        };
        qwen35::forward_layer(
            cfg,
            &self.plans[il],
            &weights,
            hidden,
            positions,
            segments,
            kernels,
            &mut self.scratch,
            profiler,
        )?;
        // Release: streamed layers give their pages back.
        if !residency.is_resident(il) {
            for h in &handles {
                memory::release(h.bytes());
            }
        }
        Ok(())
    }
}
