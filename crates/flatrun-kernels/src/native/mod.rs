//! The native backend: fused dequantize×dot kernels, SIMD picked once at run
//! time, rows split over the persistent pool.
//!
//! A matmul call (1) quantizes the activations once to the weights' dot
//! partner into a reused per-thread buffer, (2) splits the rows into chunks
//! over the pool, and (3) in each chunk walks L2-sized groups of rows, and for
//! each group every tile of up to 4 tokens, so each weight block is unpacked
//! once per tile and stays in cache across tiles.

#[cfg(target_arch = "aarch64")]
mod arm;
mod dispatch;
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
use crate::{clamp_to_host, supported_levels, KernelError, Kernels, SimdLevel, Weight};
use dispatch::Dispatch;
use quantize::{quantize_q8, quantize_q8k, BlockQ8, BlockQ8K, QK8, QK_K};

/// Tokens sharing one unpacked weight block.
const TOKEN_TILE: usize = 4;
/// Bytes of weight rows walked by all token tiles before moving on (fits L2).
const ROW_GROUP_BYTES: usize = 192 * 1024;
/// Rows per kernel call in the GEMM path (their tile outputs go through a stack buffer).
const TILE_ROWS: usize = 64;

/// Fused kernels at one SIMD level.
#[derive(Debug)]
pub struct NativeKernels {
    level: SimdLevel,
    dispatch: Dispatch,
}

/// How a weight format meets its activations.
#[derive(Clone, Copy)]
enum Partner {
    /// Integer dots against Q8 blocks of 32 (ggml Q8_0/Q8_1).
    Q8,
    /// Integer dots against Q8_K blocks of 256.
    Q8K,
    /// Float dots against the f32 activations.
    F32,
    /// No fused kernel: decode the row to f32, then a float dot.
    DecodeRow,
}

fn partner(format: WeightFormat) -> Partner {
    use GgmlType::*;
    match format {
        WeightFormat::Ggml(Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | IQ4_NL | Q1_0) => Partner::Q8,
        WeightFormat::Ggml(Q2_K | Q3_K | Q4_K | Q5_K | Q6_K | IQ4_XS) => Partner::Q8K,
        WeightFormat::Ggml(F32 | F16 | BF16) => Partner::F32,
        _ => Partner::DecodeRow,
    }
}

thread_local! {
    /// Caller-side quantized activations, reused across calls.
    static ACTS_Q8: RefCell<Vec<BlockQ8>> = const { RefCell::new(Vec::new()) };
    static ACTS_Q8K: RefCell<Vec<BlockQ8K>> = const { RefCell::new(Vec::new()) };
    /// Caller-side activations rounded to f16/bf16 for f16/bf16 weights.
    static ACTS_F32: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    /// Worker-side decoded row for formats without a fused kernel.
    static DECODED_ROW: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
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
        let level = clamp_to_host(level, &supported_levels());
        NativeKernels {
            level,
            dispatch: Dispatch::for_level(level),
        }
    }

    /// The SIMD level in use.
    pub fn level(&self) -> SimdLevel {
        self.level
    }

    /// Run `kernel(rows, token_tile, tile_out)` over every row group × token tile, rows split
    /// over the pool. `kernel` gets whole rows and writes `tile_out[r * tile.len() + t]`.
    fn for_rows<A: Sync>(
        &self,
        w: &Weight,
        acts: &[A],
        acts_per_token: usize,
        n_tokens: usize,
        out: &mut [f32],
        kernel: impl Fn(&[u8], &[&[A]], &mut [f32]) + Sync,
    ) {
        let rows = w.rows;
        let rb = w.row_bytes().max(1);
        let out_ptr = OutPtr(out.as_mut_ptr());
        let n_threads = crate::threads::threads();
        // Enough chunks for the atomic hand-out to balance the threads, each big enough
        // (≥ 16 rows and ≥ 16 KiB of weights) that handing it out is cheap.
        let min_rows = (16 * 1024 / rb).max(16);
        let chunk = rows.div_ceil(n_threads * 4).max(min_rows).min(rows);
        let n_chunks = rows.div_ceil(chunk);
        let group = (ROW_GROUP_BYTES / rb).clamp(1, chunk);
        let work = |c: usize| {
            let (r0, r1) = (c * chunk, ((c + 1) * chunk).min(rows));
            if n_tokens == 1 {
                // GEMV: the kernel writes straight into this chunk's outputs.
                // SAFETY: rows r0..r1 are inside the `rows`-long output checked by
                // `check_matmul`, and only this chunk writes them.
                let o = unsafe { std::slice::from_raw_parts_mut(out_ptr.at(r0), r1 - r0) };
                kernel(&w.data[r0 * rb..r1 * rb], &[&acts[..acts_per_token]], o);
                return;
            }
            let mut tile_out = [0f32; TOKEN_TILE * TILE_ROWS];
            for g0 in (r0..r1).step_by(group) {
                let g1 = (g0 + group).min(r1);
                for t0 in (0..n_tokens).step_by(TOKEN_TILE) {
                    let nt = TOKEN_TILE.min(n_tokens - t0);
                    let tile: [&[A]; TOKEN_TILE] = std::array::from_fn(|k| {
                        let t = (t0 + k).min(n_tokens - 1);
                        &acts[t * acts_per_token..(t + 1) * acts_per_token]
                    });
                    for s0 in (g0..g1).step_by(TILE_ROWS) {
                        let s1 = (s0 + TILE_ROWS).min(g1);
                        let o = &mut tile_out[..(s1 - s0) * nt];
                        kernel(&w.data[s0 * rb..s1 * rb], &tile[..nt], o);
                        for (r, vals) in (s0..s1).zip(o.chunks_exact(nt)) {
                            for (k, &v) in vals.iter().enumerate() {
                                // SAFETY: (t0+k, r) is inside the n_tokens × rows output
                                // checked by `check_matmul`, and only this chunk writes row r.
                                unsafe { *out_ptr.at((t0 + k) * rows + r) = v };
                            }
                        }
                    }
                }
            }
        };
        if n_chunks <= 1 || n_threads <= 1 {
            (0..n_chunks).for_each(work);
        } else {
            crate::threads::parallel_for(n_chunks, &work);
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
            (Partner::Q8, WeightFormat::Ggml(t)) => {
                // Quantize every token's activations once, into the reused buffer.
                let mut acts = ACTS_Q8.with(|c| c.take());
                acts.clear();
                acts.resize(n_tokens * cols / QK8, BlockQ8::default());
                quantize_q8(x, &mut acts);
                let rb = w.row_bytes();
                self.for_rows(w, &acts, cols / QK8, n_tokens, out, |rows, tile, o| {
                    (d.q8)(t, rows, rb, tile, o)
                });
                ACTS_Q8.with(|c| c.replace(acts));
            }
            (Partner::Q8K, WeightFormat::Ggml(t)) => {
                let mut acts = ACTS_Q8K.with(|c| c.take());
                acts.clear();
                acts.resize(n_tokens * cols / QK_K, BlockQ8K::default());
                quantize_q8k(x, &mut acts);
                let rb = w.row_bytes();
                self.for_rows(w, &acts, cols / QK_K, n_tokens, out, |rows, tile, o| {
                    (d.q8k)(t, rows, rb, tile, o)
                });
                ACTS_Q8K.with(|c| c.replace(acts));
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
