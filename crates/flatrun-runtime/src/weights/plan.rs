//! The weight plan: how each layer and the output head reach the kernels,
//! chosen once at load from the residency plan.
//!
//! | mode | layers | output head | streamed reads |
//! |---|---|---|---|
//! | `resident` | kept | kept | — |
//! | `stream` | row chunks of ≤ `stream_chunk_bytes` per matrix, vectors per use; routed experts' rows read on demand | row chunks | through the page cache |
//! | `cap=SIZE`, custom | kept, or streamed whole | kept, or its first rows kept and the rest in chunks | through or around the page cache ([`crate::StreamReads`]) |

use super::{COALESCE_GAP, Mapped, Span, coalesce, row_span};
use crate::error::{Result, RuntimeError};
use crate::memory;
use flatrun_format::{StorageBackend, TensorHandle, TensorInfo};
use flatrun_kernels::Weight;
use flatrun_model::Manifest;
use flatrun_model::arch::{Role, parse_expert_tensor, parse_layer_tensor};
use std::ops::Range;

/// How one layer's weights reach its forward pass.
#[derive(Debug)]
pub(crate) enum LayerLayout {
    /// Nothing to acquire: the layer is left out (`--layers`) or its
    /// matrices were dequantized at load (`--weights f16|f32`).
    Skipped,
    /// In the mapping, kept item `item`; with `experts`, the routed
    /// experts are not part of it but read once routed.
    Kept {
        item: usize,
        experts: Vec<ExpertMatrix>,
    },
    /// Streamed whole: one item holding every tensor of the layer but its
    /// routed experts (`experts`), read once routed.
    Whole {
        item: usize,
        experts: Vec<ExpertMatrix>,
    },
    /// Streamed in row chunks: item `vectors` holds the layer's vectors
    /// (norms, biases, small tensors), each matrix its own chunks.
    Chunked {
        vectors: usize,
        matrices: Vec<ChunkedMatrix>,
        /// Stacked expert matrices: nothing scheduled; the routed experts'
        /// rows are read when a matmul asks for them.
        experts: Vec<ExpertMatrix>,
    },
}

impl LayerLayout {
    /// The routed experts read once routed (none for a skipped layer).
    pub(crate) fn experts(&self) -> &[ExpertMatrix] {
        match self {
            LayerLayout::Kept { experts, .. }
            | LayerLayout::Whole { experts, .. }
            | LayerLayout::Chunked { experts, .. } => experts,
            LayerLayout::Skipped => &[],
        }
    }
}

/// A matrix of routed experts (a stack of them, or one expert's), read by
/// an expert's rows on demand.
#[derive(Debug)]
pub(crate) struct ExpertMatrix {
    /// Address range of its data in the mapping.
    address: Range<usize>,
    row_bytes: usize,
    sources: Sources,
    /// The expert of its first rows (0 for a stack).
    first_expert: usize,
    /// Rows of one expert.
    expert_rows: usize,
    /// Whether it is the experts' last projection (`ffn_down`): once it
    /// has run, the layer is done with that expert.
    pub last: bool,
}

impl ExpertMatrix {
    /// The expert whose rows `rows` are (rows of this matrix).
    pub(crate) fn expert_of(&self, rows: &Range<usize>) -> usize {
        self.first_expert + rows.start / self.expert_rows.max(1)
    }

    /// The file spans of expert `e`'s rows, if this matrix holds them.
    pub(crate) fn expert_spans(&self, e: usize) -> Option<Vec<Span>> {
        let local = e.checked_sub(self.first_expert)?;
        let rows = local * self.expert_rows..(local + 1) * self.expert_rows;
        (rows.end * self.row_bytes <= self.address.len()).then(|| self.spans(rows))
    }

    /// The rows of this matrix that `w` (a view of some of them in the
    /// mapping) covers, if it is one.
    pub(crate) fn rows_of(&self, w: &Weight) -> Option<Range<usize>> {
        let at = w.data.as_ptr() as usize;
        if !self.address.contains(&at) || self.row_bytes == 0 || w.row_bytes() != self.row_bytes {
            return None;
        }
        let start = (at - self.address.start) / self.row_bytes;
        let end = start + w.rows;
        (end * self.row_bytes <= self.address.len()).then_some(start..end)
    }

    /// The file spans of rows `rows` (data and parts).
    pub(crate) fn spans(&self, rows: Range<usize>) -> Vec<Span> {
        std::iter::once(&self.sources.data)
            .chain(self.sources.scales.iter())
            .chain(self.sources.biases.iter())
            .map(|s| s.span(rows.clone()))
            .collect()
    }

    /// `w`'s rows `rows` with their bytes from an on-demand read.
    pub(crate) fn rows_from<'l>(
        &self,
        w: &Weight,
        rows: Range<usize>,
        read: &'l super::OnDemand,
    ) -> Option<Weight<'l>> {
        let take = |s: &RowSource| {
            let span = s.span(rows.clone());
            read.bytes(span.file, span.offset, span.len)
        };
        Some(Weight {
            format: w.format,
            rows: w.rows,
            cols: w.cols,
            data: take(&self.sources.data)?,
            scales: match &self.sources.scales {
                Some(s) => Some(take(s)?),
                None => None,
            },
            biases: match &self.sources.biases {
                Some(s) => Some(take(s)?),
                None => None,
            },
        })
    }
}

/// Where one part of a matrix (its main data, or MLX scales or biases)
/// lies in the files, row by row.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RowSource {
    file: usize,
    offset: u64,
    row_bytes: usize,
}

impl RowSource {
    fn span(&self, rows: Range<usize>) -> Span {
        row_span(self.file, self.offset, self.row_bytes, rows)
    }
}

/// A matrix streamed in row chunks.
#[derive(Debug)]
pub(crate) struct ChunkedMatrix {
    /// Address of its data in the mapping (how a matmul recognizes it).
    address: usize,
    rows: usize,
    sources: Sources,
    /// (rows, streamed item) of each chunk, in order.
    chunks: Vec<(Range<usize>, usize)>,
}

impl ChunkedMatrix {
    /// Whether `w` is this matrix (the whole of it).
    pub(crate) fn is(&self, w: &Weight) -> bool {
        w.data.as_ptr() as usize == self.address && w.rows == self.rows
    }

    /// The chunks: (rows, streamed item).
    pub(crate) fn chunks(&self) -> &[(Range<usize>, usize)] {
        &self.chunks
    }
}

/// Rows `rows` of `w` (a view of the whole matrix in the mapping) with
/// their bytes taken from a streamed item instead.
pub(crate) fn rows_from<'l>(
    w: &Weight,
    source: &Sources,
    rows: Range<usize>,
    lease: &'l super::Lease,
) -> Option<Weight<'l>> {
    let view = w.row_range(rows.clone()).ok()?;
    let take = |s: &RowSource| {
        let span = s.span(rows.clone());
        lease.bytes(span.file, span.offset, span.len)
    };
    Some(Weight {
        format: view.format,
        rows: view.rows,
        cols: view.cols,
        data: take(&source.data)?,
        scales: match &source.scales {
            Some(s) => Some(take(s)?),
            None => None,
        },
        biases: match &source.biases {
            Some(s) => Some(take(s)?),
            None => None,
        },
    })
}

/// The file locations of a matrix's parts.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Sources {
    data: RowSource,
    scales: Option<RowSource>,
    biases: Option<RowSource>,
}

impl ChunkedMatrix {
    pub(crate) fn sources(&self) -> &Sources {
        &self.sources
    }
}

/// How the output head reaches the kernels: rows `..kept_rows` from the
/// mapping (kept item `kept`), the rest in streamed chunks.
#[derive(Debug)]
pub(crate) struct HeadLayout {
    pub kept: Option<usize>,
    pub kept_rows: usize,
    pub sources: Sources,
    /// (rows, streamed item) of each chunk, in order.
    pub chunks: Vec<(Range<usize>, usize)>,
}

/// The whole plan: how each layer and the head reach the kernels.
#[derive(Debug)]
pub(crate) struct WeightPlan {
    pub layers: Vec<LayerLayout>,
    pub head: HeadLayout,
}

/// The items the plan refers to by index, handed to the engine.
#[derive(Debug)]
pub(crate) struct Items {
    /// Streamed items' spans, in schedule order.
    pub streamed: Vec<Vec<Span>>,
    /// Kept items' mapped ranges.
    pub kept: Vec<Vec<Mapped>>,
}

impl Items {
    /// Bytes the streamed items read per step.
    pub(crate) fn streamed_bytes(&self) -> u64 {
        self.streamed.iter().flatten().map(|s| s.len).sum()
    }
}

/// How a layer the plan does not keep is streamed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Granularity {
    /// One item per layer (fewer, larger reads; a layer's bytes in flight).
    Layer,
    /// Row chunks of at most this many bytes per matrix (a fixed budget in
    /// flight, whatever a layer's size).
    Chunks(usize),
}

/// What the plan is built from.
pub(crate) struct PlanInput<'a> {
    pub backend: &'a dyn StorageBackend,
    pub manifest: &'a Manifest,
    /// Per layer: nothing to acquire (left out, or dequantized at load).
    pub skipped: &'a dyn Fn(usize) -> bool,
    /// Per layer: kept in the mapping.
    pub kept: &'a dyn Fn(usize) -> bool,
    /// Kept layers keep only their dense part, their routed experts read
    /// once routed ([`crate::ResidencyPlan::split_experts`]).
    pub split_experts: bool,
    /// Whether a tensor of a layer is a matrix (streamed in chunks) rather
    /// than a vector (read with the layer's other vectors).
    pub is_matrix: &'a dyn Fn(&TensorInfo) -> bool,
    pub layers: Granularity,
    /// Rows of the head kept in the mapping (all of them: a kept head).
    pub head_kept_rows: usize,
    /// Bytes of one streamed chunk of the head.
    pub head_chunk_bytes: usize,
}

/// Where each byte of `name` is: the data's span and the parts' spans.
struct TensorSpans<'b> {
    handle: TensorHandle<'b>,
    data: Span,
    parts: Vec<(&'static str, Span)>,
}

fn spans_of<'b>(backend: &'b dyn StorageBackend, name: &str) -> Result<TensorSpans<'b>> {
    let handle = backend.tensor(name)?;
    let info = handle.info();
    let data = Span {
        file: info.file_index,
        offset: info.offset,
        len: handle.bytes().len() as u64,
    };
    let parts = backend
        .part_spans(name)
        .into_iter()
        .map(|p| {
            (
                p.name,
                Span {
                    file: p.file_index,
                    offset: p.offset,
                    len: p.byte_size,
                },
            )
        })
        .collect::<Vec<_>>();
    if parts.len() != handle.parts().len() {
        return Err(RuntimeError::StreamRead {
            tensor: name.to_string(),
            what: "its companion arrays have no file location".into(),
        });
    }
    Ok(TensorSpans {
        handle,
        data,
        parts,
    })
}

fn kernel_error(name: &str) -> impl Fn(flatrun_kernels::KernelError) -> RuntimeError + '_ {
    move |source| RuntimeError::Kernel {
        tensor: name.to_string(),
        source,
    }
}

/// Every mapped range of a handle (data and parts).
fn mapped_of(h: &TensorHandle) -> Vec<Mapped> {
    std::iter::once(h.bytes())
        .chain(h.parts().iter().map(|(_, p)| *p))
        .filter(|b| !b.is_empty())
        .map(Mapped::of)
        .collect()
}

/// The row sources of a matrix and the byte count of one of its rows with
/// all its parts.
fn row_sources(t: &TensorSpans, w: &Weight) -> (Sources, usize) {
    let part = |name: &str| {
        t.parts
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, s)| RowSource {
                file: s.file,
                offset: s.offset,
                row_bytes: w.scale_row_bytes(),
            })
    };
    let sources = Sources {
        data: RowSource {
            file: t.data.file,
            offset: t.data.offset,
            row_bytes: w.row_bytes(),
        },
        scales: part("scales"),
        biases: part("biases"),
    };
    let parts = usize::from(sources.scales.is_some()) + usize::from(sources.biases.is_some());
    (sources, w.row_bytes() + parts * w.scale_row_bytes())
}

/// The expert matrices of a layer's routed-expert tensors: each a stack of
/// `n_expert` experts, or one expert's own (`layers.3.ffn.up_exps.5`).
fn expert_matrices(stacks: &[TensorSpans], n_expert: usize) -> Result<Vec<ExpertMatrix>> {
    let mut experts = Vec::with_capacity(stacks.len());
    for t in stacks {
        let name = t.handle.name();
        let w = Weight::from_handle(&t.handle).map_err(kernel_error(name))?;
        let (sources, _) = row_sources(t, &w);
        let start = w.data.as_ptr() as usize;
        let (role, own) = match parse_expert_tensor(name) {
            Some((_, role, own)) => (role, own),
            None => continue,
        };
        let (first_expert, expert_rows) = match own {
            Some(e) => (e, w.rows),
            None => (0, w.rows / n_expert),
        };
        experts.push(ExpertMatrix {
            address: start..start + w.data.len(),
            row_bytes: w.row_bytes(),
            sources,
            first_expert,
            expert_rows,
            last: role == Role::FfnDownExps,
        });
    }
    Ok(experts)
}

/// Cut `rows` rows of `row_bytes` bytes (all parts) into chunks of at most
/// `chunk_bytes` (at least one row each), adding one streamed item per chunk.
fn push_chunks(
    sources: &Sources,
    rows: Range<usize>,
    row_bytes: usize,
    chunk_bytes: usize,
    streamed: &mut Vec<Vec<Span>>,
) -> Vec<(Range<usize>, usize)> {
    let per_chunk = (chunk_bytes / row_bytes.max(1)).max(1);
    let mut out = Vec::new();
    let mut r0 = rows.start;
    while r0 < rows.end {
        let r1 = (r0 + per_chunk).min(rows.end);
        let spans = std::iter::once(&sources.data)
            .chain(sources.scales.iter())
            .chain(sources.biases.iter())
            .map(|s| s.span(r0..r1))
            .collect();
        out.push((r0..r1, streamed.len()));
        streamed.push(spans);
        r0 = r1;
    }
    out
}

impl WeightPlan {
    /// Plan `input`, with its items in the order a step uses them.
    pub(crate) fn build(input: &PlanInput) -> Result<(WeightPlan, Items)> {
        let b = input.backend;
        let n_expert = input.manifest.experts.map_or(1, |c| c.n_expert.max(1));
        let mut streamed: Vec<Vec<Span>> = Vec::new();
        let mut kept: Vec<Vec<Mapped>> = Vec::new();
        let mut layers = Vec::with_capacity(input.manifest.layers.len());
        for layer in &input.manifest.layers {
            let il = layer.index;
            if (input.skipped)(il) {
                layers.push(LayerLayout::Skipped);
                continue;
            }
            let tensors = layer
                .tensors
                .iter()
                .map(|t| spans_of(b, &t.name))
                .collect::<Result<Vec<_>>>()?;
            let is_experts = |t: &TensorSpans| {
                parse_layer_tensor(t.handle.name()).is_some_and(|(_, r)| r.is_experts())
            };
            if (input.kept)(il) {
                // Kept whole, or its dense part with the experts on demand.
                let (stacks, tensors): (Vec<_>, Vec<_>) = if input.split_experts {
                    tensors.into_iter().partition(|t| is_experts(t))
                } else {
                    (Vec::new(), tensors)
                };
                kept.push(tensors.iter().flat_map(|t| mapped_of(&t.handle)).collect());
                layers.push(LayerLayout::Kept {
                    item: kept.len() - 1,
                    experts: expert_matrices(&stacks, n_expert)?,
                });
                continue;
            }
            match input.layers {
                Granularity::Layer => {
                    let (stacks, tensors): (Vec<_>, Vec<_>) =
                        tensors.into_iter().partition(|t| is_experts(t));
                    let spans = tensors
                        .iter()
                        .flat_map(|t| std::iter::once(t.data).chain(t.parts.iter().map(|p| p.1)))
                        .collect();
                    streamed.push(coalesce(spans, COALESCE_GAP));
                    layers.push(LayerLayout::Whole {
                        item: streamed.len() - 1,
                        experts: expert_matrices(&stacks, n_expert)?,
                    });
                }
                Granularity::Chunks(chunk_bytes) => {
                    let (matrices, vectors): (Vec<_>, Vec<_>) = tensors
                        .into_iter()
                        .partition(|t| (input.is_matrix)(t.handle.info()));
                    let (stacks, matrices): (Vec<_>, Vec<_>) =
                        matrices.into_iter().partition(|t| {
                            parse_layer_tensor(t.handle.name()).is_some_and(|(_, r)| r.is_experts())
                        });
                    let experts = expert_matrices(&stacks, n_expert)?;
                    let vector_spans = vectors
                        .iter()
                        .flat_map(|t| std::iter::once(t.data).chain(t.parts.iter().map(|p| p.1)))
                        .collect();
                    streamed.push(coalesce(vector_spans, COALESCE_GAP));
                    let vectors = streamed.len() - 1;
                    let mut chunked = Vec::with_capacity(matrices.len());
                    for t in &matrices {
                        let name = t.handle.name();
                        let w = Weight::from_handle(&t.handle).map_err(kernel_error(name))?;
                        let (sources, row_bytes) = row_sources(t, &w);
                        let chunks =
                            push_chunks(&sources, 0..w.rows, row_bytes, chunk_bytes, &mut streamed);
                        chunked.push(ChunkedMatrix {
                            address: w.data.as_ptr() as usize,
                            rows: w.rows,
                            sources,
                            chunks,
                        });
                    }
                    layers.push(LayerLayout::Chunked {
                        vectors,
                        matrices: chunked,
                        experts,
                    });
                }
            }
        }
        // The head: its kept rows from the mapping, the rest in chunks.
        let head = spans_of(b, &input.manifest.output.name)?;
        let w = Weight::from_handle(&head.handle).map_err(kernel_error(head.handle.name()))?;
        let kept_rows = input.head_kept_rows.min(w.rows);
        let (sources, row_bytes) = row_sources(&head, &w);
        let head_kept = (kept_rows > 0).then(|| {
            let view = w.row_range(0..kept_rows).expect("rows within the head");
            let ranges = [Some(view.data), view.scales, view.biases]
                .into_iter()
                .flatten()
                .filter(|b| !b.is_empty())
                .map(Mapped::of)
                .collect();
            kept.push(ranges);
            kept.len() - 1
        });
        let chunks = push_chunks(
            &sources,
            kept_rows..w.rows,
            row_bytes,
            input.head_chunk_bytes,
            &mut streamed,
        );
        let plan = WeightPlan {
            layers,
            head: HeadLayout {
                kept: head_kept,
                kept_rows,
                sources,
                chunks,
            },
        };
        Ok((plan, Items { streamed, kept }))
    }
}

/// Per file of `backend`: the page-aligned address range spanned by its
/// tensors, which lies inside that file's one read-only mapping (so
/// releasing pages in it never touches another mapping). Empty ranges for
/// files without tensors.
pub(crate) fn file_bounds(backend: &dyn StorageBackend) -> Vec<Range<usize>> {
    let page = memory::page_size();
    let mut bounds: Vec<Option<(usize, usize)>> = vec![None; backend.files().len()];
    for info in backend.tensors() {
        let Ok(h) = backend.tensor(&info.name) else {
            continue;
        };
        let bytes = h.bytes();
        if bytes.is_empty() {
            continue;
        }
        let (lo, hi) = (
            bytes.as_ptr() as usize,
            bytes.as_ptr() as usize + bytes.len(),
        );
        if let Some(slot) = bounds.get_mut(info.file_index) {
            *slot = Some(match *slot {
                Some((a, b)) => (a.min(lo), b.max(hi)),
                None => (lo, hi),
            });
        }
    }
    bounds
        .into_iter()
        .map(|b| b.map_or(0..0, |(lo, hi)| lo / page * page..hi.div_ceil(page) * page))
        .collect()
}
