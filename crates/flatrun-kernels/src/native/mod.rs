//! The native backend: fused dequantize×dot kernels, SIMD picked once at run
//! time, rows split over the persistent pool.
//!
//! A matmul call (1) quantizes the activations once to the weights' dot
//! partner into a reused per-thread buffer, (2) splits the rows into chunks
//! over the pool, and (3) in each chunk walks L2-sized groups of rows, and for
//! each group every tile of up to 4 tokens (8 for the legacy formats on x86), so
//! each weight block is unpacked once per tile and stays in cache across tiles.

#[cfg(target_arch = "aarch64")]
mod arm;
mod dispatch;
mod mlx_affine;
mod mlx_float;
mod panel;
pub mod quantize;
mod scalar;
#[cfg(target_arch = "x86_64")]
mod x86;

use std::cell::RefCell;
use std::ops::Range;

use flatrun_format::GgmlType;

use crate::check::{check_dequantize, check_matmul};
use crate::decode::decode_row;
use crate::weight::WeightFormat;
use crate::{
    KernelError, Kernels, MlxActivations, SimdLevel, Weight, clamp_to_host, supported_levels,
};
use dispatch::Dispatch;
use quantize::{BlockQ8, BlockQ8K, QK_K, QK8, quantize_q8, quantize_q8k};

/// Tokens sharing one unpacked weight block. 4 is also the tile of ggml's repacked Q4_K
/// GEMM, whose float order depends on it: a tile of 4 always starts at a multiple of 4.
const TOKEN_TILE: usize = 4;
/// The widest token tile a kernel takes ([`Dispatch::q8_tile`]: the legacy formats on x86,
/// whose float order does not depend on the tile). A multiple of [`TOKEN_TILE`].
const MAX_TOKEN_TILE: usize = 8;
/// Bytes of weight rows walked by all token tiles before moving on (fits L2).
const ROW_GROUP_BYTES: usize = 192 * 1024;
/// Rows per kernel call in the GEMM path (their tile outputs go through a stack buffer).
const TILE_ROWS: usize = 64;
// A panel tile's outputs fit the tile buffer of `run_panels`.
const _: () = assert!(panel::MAX_PANEL_ROWS <= TILE_ROWS);
/// Most matrices [`NativeKernels::matmul_many`] runs as one pool job (Q, K, V; gate, up).
const MAX_SHARED_JOB: usize = 4;
/// From this many tokens per call, Q4_K and Q6_K row groups are repacked into panels
/// (`panel.rs`) where the level has a panel tile: with fewer, too few token tiles share
/// the repacking.
const PANEL_MIN_TOKENS: usize = 16;

/// Fused kernels at one SIMD level.
#[derive(Debug)]
pub struct NativeKernels {
    level: SimdLevel,
    dispatch: Dispatch,
    mlx: MlxActivations,
}

/// How a weight format meets its activations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Partner {
    /// Integer dots against Q8 blocks of 32 (ggml Q8_0/Q8_1).
    Q8,
    /// Integer dots against Q8_K blocks of 256.
    Q8K,
    /// Float dots against the f32 activations.
    F32,
    /// MLX affine against Q8 blocks of 32 (`mlx_affine`, 4/8-bit, behind
    /// [`MlxActivations::Q8`]) or against the f32 activations (`mlx_float`).
    Mlx,
    /// No fused kernel: decode the row to f32, then a float dot.
    DecodeRow,
}

/// How weights of `format` meet their activations (the reference backend rounds
/// its activations by the same choice).
pub(crate) fn partner(format: WeightFormat) -> Partner {
    match format {
        WeightFormat::Ggml(t) => ggml_partner(t),
        WeightFormat::MlxAffine { .. } => match mlx_float::supports(format) {
            Some(_) => Partner::Mlx,
            None => Partner::DecodeRow,
        },
    }
}

/// The GGML formats with fused kernels (at every SIMD level), each with its
/// flatrun-dequant block struct: the block's dot partner
/// ([`flatrun_dequant::BlockFormat::DotPartner`]) says which activations its
/// integer kernels meet. A plain match, so the choice costs what a table
/// lookup does.
const fn ggml_partner(t: GgmlType) -> Partner {
    use GgmlType::*;
    use flatrun_dequant::*;
    match t {
        F32 | F16 | BF16 => Partner::F32,
        Q4_0 => fused::<BlockQ4_0>(),
        Q4_1 => fused::<BlockQ4_1>(),
        Q5_0 => fused::<BlockQ5_0>(),
        Q5_1 => fused::<BlockQ5_1>(),
        Q8_0 => fused::<BlockQ8_0>(),
        IQ4_NL => fused::<BlockIq4Nl>(),
        MXFP4 => fused::<BlockMxfp4>(),
        Q1_0 => fused::<BlockQ1_0>(),
        Q2_K => fused::<BlockQ2K>(),
        Q3_K => fused::<BlockQ3K>(),
        Q4_K => fused::<BlockQ4K>(),
        Q5_K => fused::<BlockQ5K>(),
        Q6_K => fused::<BlockQ6K>(),
        IQ4_XS => fused::<BlockIq4Xs>(),
        _ => Partner::DecodeRow,
    }
}

/// The activations a fused kernel for blocks `B` meets: Q8 blocks of 32 for a
/// Q8_0/Q8_1 partner, Q8_K blocks for a Q8_K one.
const fn fused<B: flatrun_dequant::BlockFormat>() -> Partner {
    match <B::DotPartner as flatrun_dequant::BlockFormat>::TYPE {
        GgmlType::Q8_0 | GgmlType::Q8_1 => Partner::Q8,
        GgmlType::Q8_K => Partner::Q8K,
        _ => Partner::DecodeRow,
    }
}

thread_local! {
    /// Caller-side quantized activations, reused across calls.
    static ACTS_Q8: RefCell<Quantized<BlockQ8>> = RefCell::new(Quantized::default());
    static ACTS_Q8K: RefCell<Quantized<BlockQ8K>> = RefCell::new(Quantized::default());
    /// Caller-side activations rounded to f16/bf16 for f16/bf16 weights.
    static ACTS_F32: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    /// Worker-side decoded row for formats without a fused kernel.
    static DECODED_ROW: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    /// Worker-side Q4_K panels of the row group in use.
    static PANELS: RefCell<Vec<panel::Line>> = const { RefCell::new(Vec::new()) };
}

/// A raw output pointer shared by workers that write disjoint elements.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: workers write disjoint (token, row) elements of one live `&mut [f32]`
// while `matmul` blocks on the pool, so no element is shared.
unsafe impl Send for OutPtr {}
// SAFETY: as above.
unsafe impl Sync for OutPtr {}

impl OutPtr {
    /// The element at `i` (a method, so closures capture the whole `Send + Sync` wrapper).
    fn at(self, i: usize) -> *mut f32 {
        self.0.wrapping_add(i)
    }
}

impl NativeKernels {
    /// Kernels at `level`, clamped to what the host supports.
    pub fn new(level: SimdLevel) -> Self {
        Self::with_mlx_activations(level, MlxActivations::default())
    }

    /// Kernels at `level` with MLX weights multiplied as `mlx` says.
    pub fn with_mlx_activations(level: SimdLevel, mlx: MlxActivations) -> Self {
        let level = clamp_to_host(level, &supported_levels());
        NativeKernels {
            level,
            dispatch: Dispatch::for_level(level),
            mlx,
        }
    }

    /// How MLX weights are multiplied.
    pub fn mlx_activations(&self) -> MlxActivations {
        self.mlx
    }

    /// The SIMD level in use.
    pub fn level(&self) -> SimdLevel {
        self.level
    }

    /// Run `kernel(rows, token_tile, tile_out)` over every row group × token tile (of up to
    /// [`TOKEN_TILE`] tokens), rows split over the pool. `kernel` gets whole rows and writes
    /// `tile_out[r * tile.len() + t]`.
    fn for_rows<A: Sync>(
        &self,
        w: &Weight,
        acts: &[A],
        acts_per_token: usize,
        n_tokens: usize,
        out: &mut [f32],
        kernel: impl Fn(&[u8], &[&[A]], &mut [f32]) + Sync,
    ) {
        self.for_rows_tiled(w, acts, acts_per_token, n_tokens, TOKEN_TILE, out, kernel)
    }

    /// [`Self::for_rows`] with tiles of up to `tile` tokens (see [`RowSplit::run`]).
    #[allow(clippy::too_many_arguments)]
    fn for_rows_tiled<A: Sync>(
        &self,
        w: &Weight,
        acts: &[A],
        acts_per_token: usize,
        n_tokens: usize,
        tile: usize,
        out: &mut [f32],
        kernel: impl Fn(&[u8], &[&[A]], &mut [f32]) + Sync,
    ) {
        let split = RowSplit::new(w);
        let out_ptr = OutPtr(out.as_mut_ptr());
        let work =
            |c: usize| split.run(c, w, acts, acts_per_token, n_tokens, tile, out_ptr, &kernel);
        if split.n_chunks <= 1 || crate::threads::threads() <= 1 {
            (0..split.n_chunks).for_each(work);
        } else {
            crate::threads::parallel_for(split.n_chunks, &work);
        }
    }

    /// [`Self::for_rows`] through panels ([`RowSplit::run_panels`]).
    #[allow(clippy::too_many_arguments)]
    fn for_panels<A: Sync>(
        &self,
        w: &Weight,
        acts: (&[A], &[A]),
        acts_per_token: usize,
        n_tokens: usize,
        out: &mut [f32],
        format: (panel::PanelFormat<A>, bool),
        kernel: &(impl Fn(&[u8], &[&[A]], &mut [f32]) + Sync),
    ) {
        let split = RowSplit::new(w);
        let out_ptr = OutPtr(out.as_mut_ptr());
        let work = |c: usize| {
            split.run_panels(
                c,
                w,
                acts,
                acts_per_token,
                n_tokens,
                out_ptr,
                format,
                kernel,
            )
        };
        if split.n_chunks <= 1 || crate::threads::threads() <= 1 {
            (0..split.n_chunks).for_each(work);
        } else {
            crate::threads::parallel_for(split.n_chunks, &work);
        }
    }

    /// The K-quant panel layout and tile for a call of `n_tokens` tokens on `w`, and whether
    /// in the one-token order (as [`Self::q8k_kernel`] picks it), where panels pay.
    fn panel(&self, w: &Weight, n_tokens: usize) -> Option<(panel::PanelFormat<BlockQ8K>, bool)> {
        let WeightFormat::Ggml(t) = w.format else {
            return None;
        };
        let f = panel::panel_format(t, self.dispatch.q4k_panel, self.dispatch.q6k_panel)?;
        panel_call(w, n_tokens, QK_K, f)
    }

    /// [`Self::panel`] for the 32-value formats against Q8 activations.
    fn legacy_panel(
        &self,
        w: &Weight,
        n_tokens: usize,
    ) -> Option<(panel::PanelFormat<BlockQ8>, bool)> {
        let WeightFormat::Ggml(t) = w.format else {
            return None;
        };
        let f = panel::legacy_panel_format(t, self.dispatch.q8_panel)?;
        panel_call(w, n_tokens, QK8, f)
    }

    /// The Q8_K kernel for a call of `n_tokens` tokens (ggml sums wide calls in
    /// another float order: its tiled K-quant kernels).
    fn q8k_kernel(&self, n_tokens: usize) -> dispatch::Q8KRows {
        if n_tokens > 1 && crate::call_order::order_tokens(n_tokens) == 1 {
            self.dispatch.q8k_one
        } else if n_tokens >= dispatch::WIDE_CALL_TOKENS {
            self.dispatch.q8k_wide
        } else {
            self.dispatch.q8k
        }
    }
}

/// Fewer activation values than this are quantized on the calling thread.
const MIN_PARALLEL_QUANTIZE: usize = 16 * 1024;

/// A raw pointer to the quantized blocks, shared by tasks that write disjoint tokens.
struct BlocksPtr<B>(*mut B);
impl<B> Clone for BlocksPtr<B> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<B> Copy for BlocksPtr<B> {}
// SAFETY: tasks write disjoint token ranges of one live `&mut [B]` while
// `quantize_tokens` blocks on the pool, so no block is shared.
unsafe impl<B: Send> Send for BlocksPtr<B> {}
// SAFETY: as above.
unsafe impl<B: Send> Sync for BlocksPtr<B> {}

impl<B> BlocksPtr<B> {
    /// `len` blocks from block `start` (a method, so closures capture the whole wrapper).
    ///
    /// # Safety
    /// `start + len` is inside the slice the pointer came from, and no other live
    /// reference covers those blocks.
    unsafe fn slice<'a>(self, start: usize, len: usize) -> &'a mut [B] {
        // SAFETY: guaranteed by the caller.
        unsafe { std::slice::from_raw_parts_mut(self.0.add(start), len) }
    }
}

/// A thread's quantized activations, and the shared input they are of, if any; with
/// their offset copy for the signed formats' panel tiles (`panel::offset_acts`), made
/// when first asked for (empty until then).
#[derive(Default)]
struct Quantized<B> {
    blocks: Vec<B>,
    offset: Vec<B>,
    of: Option<SharedKey>,
}

/// Activations quantized from a shared input ([`crate::with_shared_input`]).
#[derive(Clone, Copy, PartialEq, Eq)]
struct SharedKey {
    scope: u64,
    n_tokens: usize,
    cols: usize,
}

impl<B: Clone + Default + Send + panel::OffsetActs> Quantized<B> {
    /// The first `n_tokens · cols` values of `x` as blocks of `block` values: quantized
    /// by `quantize` here, unless these blocks already are that input's (the same shared
    /// input, the same shape). With `offset`, also their offset copy (else `blocks` again).
    fn make(
        &mut self,
        x: &[f32],
        n_tokens: usize,
        cols: usize,
        block: usize,
        quantize: fn(&[f32], &mut [B]),
        offset: bool,
    ) -> (&[B], &[B]) {
        let key = crate::shared_input::scope_of(x).map(|scope| SharedKey {
            scope,
            n_tokens,
            cols,
        });
        if key.is_none() || self.of != key {
            self.of = None;
            self.offset.clear();
            self.blocks.clear();
            self.blocks.resize(n_tokens * cols / block, B::default());
            quantize_tokens(&x[..n_tokens * cols], n_tokens, &mut self.blocks, quantize);
            self.of = key;
        }
        if offset && self.offset.len() != self.blocks.len() {
            panel::offset_acts(&self.blocks, &mut self.offset);
        }
        (
            &self.blocks,
            if offset { &self.offset } else { &self.blocks },
        )
    }
}

/// Quantize the `n_tokens` rows of `x` into `out` (the same number of blocks per token),
/// tokens split over the pool when there are many: each token's blocks depend on its row only.
fn quantize_tokens<B: Send>(
    x: &[f32],
    n_tokens: usize,
    out: &mut [B],
    quantize: fn(&[f32], &mut [B]),
) {
    let threads = crate::threads::threads();
    if threads <= 1
        || n_tokens < 2
        || x.len() < MIN_PARALLEL_QUANTIZE
        || !out.len().is_multiple_of(n_tokens)
    {
        return quantize(x, out);
    }
    let (cols, blocks) = (x.len() / n_tokens, out.len() / n_tokens);
    let per_task = n_tokens.div_ceil(2 * threads);
    let base = BlocksPtr(out.as_mut_ptr());
    let task = |c: usize| {
        let tokens = c * per_task..((c + 1) * per_task).min(n_tokens);
        // SAFETY: the token ranges of different tasks are disjoint and inside `out`, which
        // stays mutably borrowed (and otherwise untouched) until `parallel_for` returns.
        let o = unsafe { base.slice(tokens.start * blocks, tokens.len() * blocks) };
        quantize(&x[tokens.start * cols..tokens.end * cols], o);
    };
    crate::threads::parallel_for(n_tokens.div_ceil(per_task), &task);
}

/// How the rows of one matrix are cut into pool tasks.
#[derive(Clone, Copy, Debug)]
struct RowSplit {
    /// Rows per task (the last one may be shorter).
    chunk: usize,
    /// Number of tasks.
    n_chunks: usize,
    /// Rows per L2-sized group walked by every token tile (GEMM).
    group: usize,
}

impl RowSplit {
    fn new(w: &Weight) -> RowSplit {
        let rows = w.rows;
        let rb = w.row_bytes().max(1);
        let n_threads = crate::threads::threads();
        // Enough chunks for the atomic hand-out to balance the threads, each big enough
        // (≥ 16 rows and ≥ 16 KiB of weights) that handing it out is cheap.
        // Whole multiples of 16 rows, so no two tasks write the same 64-byte line of outputs.
        let min_rows = (16 * 1024 / rb).max(16);
        let chunk = rows
            .div_ceil(n_threads * 4)
            .max(min_rows)
            .next_multiple_of(16)
            .min(rows)
            .max(1);
        RowSplit {
            chunk,
            n_chunks: rows.div_ceil(chunk),
            group: (ROW_GROUP_BYTES / rb).clamp(1, chunk),
        }
    }

    /// Task `c`: rows `c·chunk ..` of `w` against every token, in token tiles of `tile`
    /// (at most [`MAX_TOKEN_TILE`]) while that many are left, then of [`TOKEN_TILE`], then
    /// the rest: every tile of 4 starts at a multiple of 4.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    fn run<A>(
        &self,
        c: usize,
        w: &Weight,
        acts: &[A],
        acts_per_token: usize,
        n_tokens: usize,
        tile: usize,
        out_ptr: OutPtr,
        kernel: &(impl Fn(&[u8], &[&[A]], &mut [f32]) + ?Sized),
    ) {
        let rows = w.rows;
        let rb = w.row_bytes().max(1);
        let (r0, r1) = (c * self.chunk, ((c + 1) * self.chunk).min(rows));
        if n_tokens == 1 {
            // GEMV: the kernel writes straight into this chunk's outputs.
            // SAFETY: rows r0..r1 are inside the `rows`-long output checked by
            // `check_matmul`, and only this chunk writes them.
            let o = unsafe { std::slice::from_raw_parts_mut(out_ptr.at(r0), r1 - r0) };
            kernel(&w.data[r0 * rb..r1 * rb], &[&acts[..acts_per_token]], o);
            return;
        }
        let wide = tile.clamp(TOKEN_TILE, MAX_TOKEN_TILE);
        let mut tile_out = [0f32; MAX_TOKEN_TILE * TILE_ROWS];
        for g0 in (r0..r1).step_by(self.group) {
            let g1 = (g0 + self.group).min(r1);
            let mut t0 = 0;
            while t0 < n_tokens {
                let left = n_tokens - t0;
                let nt = if left >= wide {
                    wide
                } else {
                    left.min(TOKEN_TILE)
                };
                let tokens: [&[A]; MAX_TOKEN_TILE] = std::array::from_fn(|k| {
                    let t = (t0 + k).min(n_tokens - 1);
                    &acts[t * acts_per_token..(t + 1) * acts_per_token]
                });
                for s0 in (g0..g1).step_by(TILE_ROWS) {
                    let s1 = (s0 + TILE_ROWS).min(g1);
                    let o = &mut tile_out[..(s1 - s0) * nt];
                    kernel(&w.data[s0 * rb..s1 * rb], &tokens[..nt], o);
                    scatter(out_ptr, rows, t0, s0, nt, o);
                }
                t0 += nt;
            }
        }
    }

    /// [`Self::run`] for a format with panels (`panel.rs`): each row group's whole panels
    /// are repacked once and multiplied by every full tile of tokens (the format's widest,
    /// then 4) through the panel tile; the group's last rows (fewer than a panel) and the
    /// last tokens (fewer than 4) take `kernel`, the raw-row kernel of the same float
    /// order. The tile reads `panel_acts` ([`panel::PanelFormat::tile_acts`]), the kernel
    /// `acts`.
    #[allow(clippy::too_many_arguments)]
    fn run_panels<'a, A>(
        &self,
        c: usize,
        w: &Weight,
        (acts, panel_acts): (&'a [A], &'a [A]),
        acts_per_token: usize,
        n_tokens: usize,
        out_ptr: OutPtr,
        (format, one_token): (panel::PanelFormat<A>, bool),
        kernel: &(impl Fn(&[u8], &[&[A]], &mut [f32]) + ?Sized),
    ) {
        let rows = w.rows;
        let rb = w.row_bytes().max(1);
        let panel_lines = (rb / format.block_bytes * format.lines_per_block).max(1);
        let (r0, r1) = (c * self.chunk, ((c + 1) * self.chunk).min(rows));
        // Groups of whole panels where a group holds one (chunks are multiples of 16 rows).
        let pr = format.rows;
        let group = match self.group {
            g if g >= pr => g - g % pr,
            g => g,
        };
        let mut tile_out = [0f32; MAX_TOKEN_TILE * TILE_ROWS];
        let mut packed = PANELS.with(|p| p.take());
        for g0 in (r0..r1).step_by(group) {
            let g1 = (g0 + group).min(r1);
            let p1 = g0 + (g1 - g0) / pr * pr;
            (format.repack)(&w.data[g0 * rb..p1 * rb], rb, &mut packed);
            let mut t0 = 0;
            while t0 < n_tokens {
                // The format's widest tile where the tokens left fill it, else 4, else the rest.
                let left = n_tokens - t0;
                let nt = if left >= format.tokens {
                    format.tokens
                } else {
                    left.min(TOKEN_TILE)
                };
                let token_rows = |of: &'a [A]| -> [&'a [A]; MAX_TOKEN_TILE] {
                    std::array::from_fn(|k| {
                        let t = (t0 + k).min(n_tokens - 1);
                        &of[t * acts_per_token..(t + 1) * acts_per_token]
                    })
                };
                let tokens = token_rows(acts);
                // Rows `s0..s1` × this tile's tokens through the raw kernel, 4 tokens a call.
                let raw = |s0: usize, s1: usize, buf: &mut [f32]| {
                    for k0 in (0..nt).step_by(TOKEN_TILE) {
                        let m = (nt - k0).min(TOKEN_TILE);
                        for s in (s0..s1).step_by(TILE_ROWS) {
                            let e = (s + TILE_ROWS).min(s1);
                            let o = &mut buf[..(e - s) * m];
                            kernel(&w.data[s * rb..e * rb], &tokens[k0..k0 + m], o);
                            scatter(out_ptr, rows, t0 + k0, s, m, o);
                        }
                    }
                };
                // The raw kernel from `s0` on (the rows no panel holds, or every row).
                let mut s0 = g0;
                if nt >= TOKEN_TILE {
                    let panel_tokens = token_rows(panel_acts);
                    for (p, lines) in packed[..(p1 - g0) / pr * panel_lines]
                        .chunks_exact(panel_lines)
                        .enumerate()
                    {
                        let o = &mut tile_out[..nt * pr];
                        let r = g0 + p * pr;
                        if (format.tile)(lines, &panel_tokens[..nt], o, one_token) {
                            scatter(out_ptr, rows, t0, r, nt, o);
                        } else {
                            raw(r, r + pr, &mut tile_out);
                        }
                    }
                    s0 = p1;
                }
                raw(s0, g1, &mut tile_out);
                t0 += nt;
            }
        }
        PANELS.with(|p| p.replace(packed));
    }
}

/// `format` for a call of `n_tokens` tokens on `w` (blocks of `block` values), and whether
/// in the one-token order, where panels pay and keep the call's order.
fn panel_call<A>(
    w: &Weight,
    n_tokens: usize,
    block: usize,
    format: panel::PanelFormat<A>,
) -> Option<(panel::PanelFormat<A>, bool)> {
    let one_token = crate::call_order::order_tokens(n_tokens) == 1;
    let whole_blocks =
        w.cols.is_multiple_of(block) && w.row_bytes() == w.cols / block * format.block_bytes;
    (whole_blocks && n_tokens >= PANEL_MIN_TOKENS && (format.one_token || !one_token))
        .then_some((format, one_token))
}

/// Store a kernel's tile outputs (`o[i·nt + k]` = row `s0 + i`, token `t0 + k`) into the
/// `n_tokens × rows` output. Token by token, so the stores run along each token's output
/// row (row by row they hop between `nt` rows: a store-bound scatter).
#[inline]
fn scatter(out_ptr: OutPtr, rows: usize, t0: usize, s0: usize, nt: usize, o: &[f32]) {
    for k in 0..nt {
        let dst = out_ptr.at((t0 + k) * rows + s0);
        for (i, vals) in o.chunks_exact(nt).enumerate() {
            // SAFETY: (t0+k, s0+i) is inside the n_tokens × rows output checked by
            // `check_matmul` (the caller's rows and tokens), and only this chunk writes row s0+i.
            unsafe { *dst.add(i) = vals[k] };
        }
    }
}

impl Kernels for NativeKernels {
    fn name(&self) -> &'static str {
        "native"
    }

    fn matmul(
        &self,
        w: &Weight,
        x: &[f32],
        n_tokens: usize,
        out: &mut [f32],
    ) -> Result<(), KernelError> {
        check_matmul(w, x, n_tokens, out)?;
        if n_tokens == 0 || w.rows == 0 {
            return Ok(());
        }
        let cols = w.cols;
        let d = self.dispatch;
        match (partner(w.format), w.format) {
            (Partner::Mlx, _)
                if self.mlx == MlxActivations::Q8 && mlx_affine::supports(w.format).is_some() =>
            {
                self.matmul_mlx(w, x, n_tokens, out)?
            }
            (Partner::Mlx, _) => self.matmul_mlx_f32(w, x, n_tokens, out)?,
            (Partner::Q8, WeightFormat::Ggml(t)) => {
                // Quantize every token's activations once, into the reused buffer.
                let mut quantized = ACTS_Q8.with(|c| c.take());
                let panel = self.legacy_panel(w, n_tokens);
                let offset = panel.is_some_and(|f| f.0.offset_acts);
                let both = quantized.make(x, n_tokens, cols, QK8, quantize_q8, offset);
                let rb = w.row_bytes();
                let per_token = cols / QK8;
                let kernel =
                    |rows: &[u8], tile: &[&[BlockQ8]], o: &mut [f32]| (d.q8)(t, rows, rb, tile, o);
                match panel {
                    Some(format) => {
                        self.for_panels(w, both, per_token, n_tokens, out, format, &kernel)
                    }
                    None => {
                        self.for_rows_tiled(w, both.0, per_token, n_tokens, d.q8_tile, out, kernel)
                    }
                }
                ACTS_Q8.with(|c| c.replace(quantized));
            }
            (Partner::Q8K, WeightFormat::Ggml(t)) => {
                let mut quantized = ACTS_Q8K.with(|c| c.take());
                let panel = self.panel(w, n_tokens);
                let offset = panel.is_some_and(|f| f.0.offset_acts);
                let both = quantized.make(x, n_tokens, cols, QK_K, quantize_q8k, offset);
                let rb = w.row_bytes();
                let q8k = self.q8k_kernel(n_tokens);
                let kernel =
                    |rows: &[u8], tile: &[&[BlockQ8K]], o: &mut [f32]| q8k(t, rows, rb, tile, o);
                match panel {
                    Some(format) => {
                        self.for_panels(w, both, cols / QK_K, n_tokens, out, format, &kernel)
                    }
                    None => self.for_rows(w, both.0, cols / QK_K, n_tokens, out, kernel),
                }
                ACTS_Q8K.with(|c| c.replace(quantized));
            }
            (Partner::F32, WeightFormat::Ggml(t)) => {
                let rb = w.row_bytes();
                // ggml multiplies f16 (bf16) weights by f16 (bf16) activations.
                let mut rounded = ACTS_F32.with(|c| c.take());
                rounded.clear();
                let x = match t {
                    GgmlType::F16 => {
                        rounded.extend(x.iter().map(|&v| half::f16::from_f32(v).to_f32()));
                        &rounded[..]
                    }
                    GgmlType::BF16 => {
                        rounded.extend(x.iter().map(|&v| half::bf16::from_f32(v).to_f32()));
                        &rounded[..]
                    }
                    _ => x,
                };
                self.for_rows(w, x, cols, n_tokens, out, |rows, tile, o| {
                    (d.f32)(t, rows, rb, tile, o)
                });
                ACTS_F32.with(|c| c.replace(rounded));
            }
            _ => {
                // Decode each row into a per-worker buffer, then a float dot.
                let rb = w.row_bytes().max(1);
                let failure = std::sync::Mutex::new(None);
                self.for_rows(w, x, cols, n_tokens, out, |rows, tile, o| {
                    let r0 = (rows.as_ptr() as usize - w.data.as_ptr() as usize) / rb;
                    let nt = tile.len();
                    DECODED_ROW.with(|c| {
                        let mut buf = c.take();
                        buf.resize(cols, 0.0);
                        for (i, o) in o.chunks_exact_mut(nt).take(rows.len() / rb).enumerate() {
                            match decode_row(w, r0 + i, &mut buf) {
                                Ok(()) => {
                                    let row: &[u8] = bytemuck::cast_slice(&buf);
                                    (d.f32)(GgmlType::F32, row, row.len(), tile, o)
                                }
                                Err(e) => {
                                    o.fill(0.0);
                                    if let Ok(mut f) = failure.lock() {
                                        f.get_or_insert(e);
                                    }
                                }
                            }
                        }
                        c.replace(buf);
                    });
                });
                if let Some(e) = failure.into_inner().ok().flatten() {
                    return Err(e);
                }
            }
        }
        Ok(())
    }

    fn matmul_many(
        &self,
        ws: &[&Weight],
        x: &[f32],
        n_tokens: usize,
        outs: &mut [&mut [f32]],
    ) -> Result<(), KernelError> {
        // Integer-dot formats and F32 share one job; anything else goes one matrix at a time.
        let shared = |w: &&Weight| {
            matches!(
                (partner(w.format), w.format),
                (Partner::Q8 | Partner::Q8K, WeightFormat::Ggml(_))
                    | (Partner::F32, WeightFormat::Ggml(GgmlType::F32))
            )
        };
        let cols = ws.first().map_or(0, |w| w.cols);
        crate::check_output_list(ws, outs.len())?;
        if ws.len() > MAX_SHARED_JOB
            || n_tokens == 0
            || !ws.iter().all(|w| shared(w) && w.cols == cols)
        {
            for (w, out) in ws.iter().zip(outs.iter_mut()) {
                self.matmul(w, x, n_tokens, out)?;
            }
            return Ok(());
        }
        for (w, out) in ws.iter().zip(outs.iter()) {
            check_matmul(w, x, n_tokens, out)?;
        }
        // Quantize the activations once per dot partner the matrices need.
        let needs = |p: fn(Partner) -> bool| ws.iter().any(|w| p(partner(w.format)));
        let mut q8_quantized = ACTS_Q8.with(|c| c.take());
        let q8_offset = ws.iter().any(|w| {
            self.legacy_panel(w, n_tokens)
                .is_some_and(|f| f.0.offset_acts)
        });
        let (q8, q8_offset_acts): (&[BlockQ8], &[BlockQ8]) = if needs(|p| matches!(p, Partner::Q8))
        {
            q8_quantized.make(x, n_tokens, cols, QK8, quantize_q8, q8_offset)
        } else {
            (&[], &[])
        };
        let mut q8k_quantized = ACTS_Q8K.with(|c| c.take());
        let q8k_offset = ws
            .iter()
            .any(|w| self.panel(w, n_tokens).is_some_and(|f| f.0.offset_acts));
        let (q8k, q8k_offset_acts): (&[BlockQ8K], &[BlockQ8K]) =
            if needs(|p| matches!(p, Partner::Q8K)) {
                q8k_quantized.make(x, n_tokens, cols, QK_K, quantize_q8k, q8k_offset)
            } else {
                (&[], &[])
            };
        // Task g of the joint job is chunk g − first[i] of matrix i.
        let mut splits = [RowSplit {
            chunk: 1,
            n_chunks: 0,
            group: 1,
        }; MAX_SHARED_JOB];
        let mut first = [0usize; MAX_SHARED_JOB + 1];
        let mut out_ptrs = [OutPtr(std::ptr::null_mut()); MAX_SHARED_JOB];
        for (i, (w, out)) in ws.iter().zip(outs.iter_mut()).enumerate() {
            splits[i] = RowSplit::new(w);
            first[i + 1] = first[i] + splits[i].n_chunks;
            out_ptrs[i] = OutPtr(out.as_mut_ptr());
        }
        let total = first[ws.len()];
        let (d, q8k_rows) = (self.dispatch, self.q8k_kernel(n_tokens));
        let (q8_acts, q8k_acts) = (q8, q8k);
        let task = |g: usize| {
            let i = (0..ws.len()).rfind(|&i| first[i] <= g).unwrap_or(0);
            let (w, c) = (ws[i], g - first[i]);
            let WeightFormat::Ggml(t) = w.format else {
                return;
            };
            let rb = w.row_bytes();
            match partner(w.format) {
                Partner::Q8 => {
                    let kernel = |rows: &[u8], tile: &[&[BlockQ8]], o: &mut [f32]| {
                        (d.q8)(t, rows, rb, tile, o)
                    };
                    match self.legacy_panel(w, n_tokens) {
                        Some(format) => splits[i].run_panels(
                            c,
                            w,
                            (q8_acts, format.0.tile_acts(q8_acts, q8_offset_acts)),
                            cols / QK8,
                            n_tokens,
                            out_ptrs[i],
                            format,
                            &kernel,
                        ),
                        None => splits[i].run(
                            c,
                            w,
                            q8_acts,
                            cols / QK8,
                            n_tokens,
                            d.q8_tile,
                            out_ptrs[i],
                            &kernel,
                        ),
                    }
                }
                Partner::Q8K => {
                    let kernel = |rows: &[u8], tile: &[&[BlockQ8K]], o: &mut [f32]| {
                        q8k_rows(t, rows, rb, tile, o)
                    };
                    match self.panel(w, n_tokens) {
                        Some(tile) => splits[i].run_panels(
                            c,
                            w,
                            (q8k_acts, tile.0.tile_acts(q8k_acts, q8k_offset_acts)),
                            cols / QK_K,
                            n_tokens,
                            out_ptrs[i],
                            tile,
                            &kernel,
                        ),
                        None => splits[i].run(
                            c,
                            w,
                            q8k_acts,
                            cols / QK_K,
                            n_tokens,
                            TOKEN_TILE,
                            out_ptrs[i],
                            &kernel,
                        ),
                    }
                }
                _ => splits[i].run(
                    c,
                    w,
                    x,
                    cols,
                    n_tokens,
                    TOKEN_TILE,
                    out_ptrs[i],
                    &|rows: &[u8], tile: &[&[f32]], o: &mut [f32]| (d.f32)(t, rows, rb, tile, o),
                ),
            }
        };
        if total <= 1 || crate::threads::threads() <= 1 {
            (0..total).for_each(task);
        } else {
            crate::threads::parallel_for(total, &task);
        }
        ACTS_Q8.with(|c| c.replace(q8_quantized));
        ACTS_Q8K.with(|c| c.replace(q8k_quantized));
        Ok(())
    }

    fn dequantize_rows(
        &self,
        w: &Weight,
        rows: Range<usize>,
        out: &mut [f32],
    ) -> Result<(), KernelError> {
        check_dequantize(w, &rows, out)?;
        for (i, r) in rows.enumerate() {
            decode_row(w, r, &mut out[i * w.cols..(i + 1) * w.cols])?;
        }
        Ok(())
    }
}
