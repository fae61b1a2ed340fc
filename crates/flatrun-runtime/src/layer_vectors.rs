//! The small per-layer tensors (norm weights, biases, q/k norms, Qwen3.5's
//! conv kernels and decay constants) as f32, and the view a running layer
//! gets of its weights ([`LayerView`]).
//!
//! A layer whose matrices stay where they are (resident, kept by a cap, or
//! streamed whole by a cap) keeps f32 copies of its vectors for the whole run.
//! A layer streamed in chunks (`Stream` residency) keeps nothing: its vectors
//! arrive with each run as one streamed item of the weight engine and are
//! converted into one reused set of buffers, so stream mode holds one layer's
//! vectors rather than every layer's (36 layers × 2 norms × 3072 floats =
//! 0.8 MiB at 4B) and maps nothing of the file for them.

use crate::error::{Result, RuntimeError};
use crate::memory;
use crate::weights::Lease;
use flatrun_format::{StorageBackend, TensorHandle};
use flatrun_kernels::{Kernels, Weight};
use flatrun_model::arch::LayerTensors;
use flatrun_model::arch::layer_tensor;
use flatrun_model::arch::moe::Experts;
use flatrun_model::{Manifest, Role};

/// f32 copies of one layer's small tensors, by role.
#[derive(Debug, Default)]
pub(crate) struct LayerVectors {
    /// Indexed by `role as usize`; `None` where the layer has no such vector.
    values: Vec<Option<Vec<f32>>>,
}

impl LayerVectors {
    /// The vector `role`, if the layer has it.
    pub fn get(&self, role: Role) -> Option<&[f32]> {
        self.values.get(role as usize)?.as_deref()
    }
}

/// What a running layer sees of its weights: its matrices (from the mapping,
/// a read buffer or a dense copy) and its vectors.
pub(crate) struct LayerView<'a> {
    pub matrices: &'a [(Role, Weight<'a>)],
    /// The stacked expert roles held one matrix per expert ([`split_experts`]).
    pub experts: &'a [(Role, Vec<Weight<'a>>)],
    pub vectors: &'a LayerVectors,
}

/// The expert roles of `matrices` held as one matrix per expert (a
/// Hugging Face checkpoint's experts, listed in expert order by the
/// manifest): each such role with its matrices. A role with a single
/// matrix is a stack (or a single expert, the same rows either way).
pub(crate) fn split_experts<'a>(matrices: &[(Role, Weight<'a>)]) -> Vec<(Role, Vec<Weight<'a>>)> {
    let mut out: Vec<(Role, Vec<Weight<'a>>)> = Vec::new();
    for &(role, w) in matrices.iter().filter(|(r, _)| r.is_experts()) {
        match out.iter_mut().find(|(r, _)| *r == role) {
            Some((_, ws)) => ws.push(w),
            None => out.push((role, vec![w])),
        }
    }
    out.retain(|(_, ws)| ws.len() > 1);
    out
}

impl LayerTensors for LayerView<'_> {
    fn matrix(&self, role: Role) -> Option<Weight<'_>> {
        self.matrices
            .iter()
            .find(|(r, _)| *r == role)
            .map(|&(_, w)| w)
    }
    fn vector(&self, role: Role) -> Option<&[f32]> {
        self.vectors.get(role)
    }
    fn experts(&self, role: Role) -> Option<Experts<'_>> {
        match self.experts.iter().find(|(r, _)| *r == role) {
            Some((_, ws)) => Some(Experts::Split(ws)),
            None => self.matrix(role).map(Experts::Stacked),
        }
    }
}

/// The vector tensors of a manifest layer: (role, canonical name).
fn vector_tensors(manifest: &Manifest, il: usize) -> impl Iterator<Item = (Role, &str)> {
    manifest
        .layers
        .get(il)
        .into_iter()
        .flat_map(|l| l.tensors.iter())
        .filter_map(|t| {
            let role = t.role()?;
            (!role.is_matrix()).then_some((role, t.name.as_str()))
        })
}

/// Converts a vector to f32: from a streamed item's bytes when the layer is
/// streamed, else through the mapping (whose pages are dropped again).
fn read_vector(
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

/// The vectors of every layer: kept copies, or read per use.
pub(crate) struct LayerVectorStore {
    /// `kept[i]`: layer `i`'s vectors, unless they are read per use.
    kept: Vec<Option<LayerVectors>>,
    /// The vectors of the streamed layer read last (allocations reused).
    current: LayerVectors,
}

impl LayerVectorStore {
    /// Read the vectors of the manifest's first `n_layer` layers, keeping
    /// those for which `keep(i)` holds; the others are read when
    /// [`LayerVectorStore::get`] asks for them (checked here once, so a
    /// missing tensor fails the load).
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
                for (_, name) in vector_tensors(manifest, il) {
                    // Opening a handle touches none of its bytes.
                    backend.tensor(name)?;
                }
                store.kept.push(None);
            }
        }
        Ok(store)
    }

    /// Layer `il`'s vectors if they are kept.
    pub fn kept(&self, il: usize) -> Option<&LayerVectors> {
        self.kept.get(il)?.as_ref()
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
    let mut present = [false; Role::COUNT];
    for (role, _) in vector_tensors(manifest, il) {
        present[role as usize] = true;
    }
    v.values.resize_with(Role::COUNT, || None);
    for (role, slot) in Role::ALL.iter().zip(v.values.iter_mut()) {
        if present[*role as usize] {
            let out = slot.get_or_insert_with(Vec::new);
            read_vector(backend, kernels, &layer_tensor(il, *role), streamed, out)?;
        } else {
            *slot = None;
        }
    }
    Ok(())
}
