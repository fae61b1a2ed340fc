//! The small per-layer vectors (norm weights, biases, q/k norms) as f32.
//!
//! A layer whose matrices stay where they are (resident, kept by a cap, or
//! read whole by the cap's stream reader) keeps f32 copies of its vectors for
//! the whole run. A layer streamed in chunks (`Stream` residency) keeps
//! nothing: its vectors arrive with each run as one streamed item of the
//! weight engine and are converted into one reused set of buffers, so stream
//! mode holds one layer's vectors rather than every layer's (36 layers × 2
//! norms × 3072 floats = 0.8 MiB at 4B) and maps nothing of the file for them.

use crate::error::{Result, RuntimeError};
use crate::memory;
use crate::weights::Lease;
use flatrun_format::{StorageBackend, TensorHandle};
use flatrun_kernels::{Kernels, Weight};
use flatrun_model::manifest::layer_tensor;
use flatrun_model::Manifest;

/// f32 copies of one layer's small vectors (norms, biases).
#[derive(Debug, Default)]
pub(crate) struct LayerVectors {
    pub attn_norm: Vec<f32>,
    pub ffn_norm: Vec<f32>,
    pub q_bias: Option<Vec<f32>>,
    pub k_bias: Option<Vec<f32>>,
    pub v_bias: Option<Vec<f32>>,
    pub o_bias: Option<Vec<f32>>,
    pub q_norm: Option<Vec<f32>>,
    pub k_norm: Option<Vec<f32>>,
    pub post_attn_norm: Option<Vec<f32>>,
    pub post_ffn_norm: Option<Vec<f32>>,
}

/// The optional vectors, by role, and where [`LayerVectors`] keeps each.
const OPTIONAL_ROLES: [&str; 8] = [
    "attn.q.bias",
    "attn.k.bias",
    "attn.v.bias",
    "attn.o.bias",
    "attn.q_norm",
    "attn.k_norm",
    "post_attn_norm",
    "post_ffn_norm",
];

impl LayerVectors {
    fn optional_mut(&mut self, role: &str) -> Option<&mut Option<Vec<f32>>> {
        Some(match role {
            "attn.q.bias" => &mut self.q_bias,
            "attn.k.bias" => &mut self.k_bias,
            "attn.v.bias" => &mut self.v_bias,
            "attn.o.bias" => &mut self.o_bias,
            "attn.q_norm" => &mut self.q_norm,
            "attn.k_norm" => &mut self.k_norm,
            "post_attn_norm" => &mut self.post_attn_norm,
            "post_ffn_norm" => &mut self.post_ffn_norm,
            _ => return None,
        })
    }
}

/// Converts vectors to f32: from a streamed item's bytes when the layer is
/// streamed, else through the mapping (whose pages are dropped again).
struct VectorReader;

impl VectorReader {
    /// `out = name` as f32, reusing `out`'s allocation.
    fn read(
        backend: &dyn StorageBackend,
        kernels: &dyn Kernels,
        name: &str,
        streamed: Option<&Lease>,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        let kernel_error = |source| RuntimeError::Kernel {
            tensor: name.to_string(),
            source,
        };
        let h = backend.tensor(name)?;
        let info = h.info();
        if let Some(lease) = streamed {
            let bytes = lease
                .bytes(info.file_index, info.offset, h.bytes().len() as u64)
                .ok_or_else(|| RuntimeError::StreamRead {
                    tensor: name.to_string(),
                    what: "not in the layer's streamed vectors".into(),
                })?;
            let read = TensorHandle::new(info, bytes, Vec::new());
            let w = Weight::from_handle(&read).map_err(kernel_error)?;
            out.resize(w.rows * w.cols, 0.0); // every value is overwritten
            return kernels
                .dequantize_rows(&w, 0..w.rows, out)
                .map_err(kernel_error);
        }
        let w = Weight::from_handle(&h).map_err(kernel_error)?;
        out.resize(w.rows * w.cols, 0.0);
        let result = kernels.dequantize_rows(&w, 0..w.rows, out);
        memory::release(h.bytes());
        result.map_err(kernel_error)
    }
}

/// The vectors of every layer: kept copies, or read per use.
pub(crate) struct LayerVectorStore {
    /// `kept[i]`: layer `i`'s vectors, unless they are read per use.
    kept: Vec<Option<LayerVectors>>,
    /// The vectors of the streamed layer read last (allocations reused).
    current: LayerVectors,
}

impl LayerVectorStore {
    /// Read the vectors of `n_layer` layers, keeping those for which
    /// `keep(i)` holds; the others are read when [`LayerVectorStore::get`]
    /// asks for them (checked here once, so a missing tensor fails the load).
    pub fn load(
        backend: &dyn StorageBackend,
        kernels: &dyn Kernels,
        manifest: &Manifest,
        n_layer: usize,
        keep: impl Fn(usize) -> bool,
    ) -> Result<LayerVectorStore> {
        let mut store = LayerVectorStore {
            kept: Vec::with_capacity(n_layer),
            current: LayerVectors::default(),
        };
        for il in 0..n_layer {
            let mut v = LayerVectors::default();
            if keep(il) {
                read_layer(backend, kernels, manifest, il, None, &mut v)?;
                store.kept.push(Some(v));
            } else {
                for role in ["attn_norm", "ffn_norm"] {
                    // Opening a handle touches none of its bytes.
                    backend.tensor(&layer_tensor(il, role))?;
                }
                store.kept.push(None);
            }
        }
        Ok(store)
    }

    /// The vectors of layer `il`: its kept copies, or converted now from
    /// `streamed`, the layer's streamed vectors.
    pub fn get(
        &mut self,
        backend: &dyn StorageBackend,
        kernels: &dyn Kernels,
        manifest: &Manifest,
        il: usize,
        streamed: Option<&Lease>,
    ) -> Result<&LayerVectors> {
        if self.kept.get(il).is_some_and(|v| v.is_some()) {
            return Ok(self.kept[il].as_ref().expect("checked just above"));
        }
        read_layer(backend, kernels, manifest, il, streamed, &mut self.current)?;
        Ok(&self.current)
    }
}

/// Read layer `il`'s vectors into `v` (reusing its buffers).
fn read_layer(
    backend: &dyn StorageBackend,
    kernels: &dyn Kernels,
    manifest: &Manifest,
    il: usize,
    streamed: Option<&Lease>,
    v: &mut LayerVectors,
) -> Result<()> {
    let present = |name: &str| {
        manifest
            .layers
            .get(il)
            .is_some_and(|l| l.tensors.iter().any(|t| t.name == name))
    };
    let read =
        |name: &str, out: &mut Vec<f32>| VectorReader::read(backend, kernels, name, streamed, out);
    read(&layer_tensor(il, "attn_norm"), &mut v.attn_norm)?;
    read(&layer_tensor(il, "ffn_norm"), &mut v.ffn_norm)?;
    for role in OPTIONAL_ROLES {
        let name = layer_tensor(il, role);
        let Some(slot) = v.optional_mut(role) else {
            continue;
        };
        if present(&name) {
            read(&name, slot.get_or_insert_with(Vec::new))?;
        } else {
            *slot = None;
        }
    }
    Ok(())
}
