//! Causal grouped-query attention over an f32 or f16 KV cache.

use std::cell::RefCell;

use half::f16;
use half::slice::HalfFloatSliceExt;

use super::softmax::{ggml_expf, reduce32, reduce8};

/// Keys or values of the cache: `n_slots × n_kv_head × head_dim`.
#[derive(Clone, Copy, Debug)]
pub enum KvSlice<'a> {
    F32(&'a [f32]),
    F16(&'a [f16]),
}

impl KvSlice<'_> {
    fn len(&self) -> usize {
        match self {
            KvSlice::F32(s) => s.len(),
            KvSlice::F16(s) => s.len(),
        }
    }

    /// `x` as this cache's element type would hold it: rounded through f16
    /// for an f16 cache (what ggml does to the other operand of a product
    /// with an f16 matrix), unchanged for f32.
    #[inline]
    fn round(&self, x: f32) -> f32 {
        match self {
            KvSlice::F32(_) => x,
            KvSlice::F16(_) => f16::from_f32(x).to_f32(),
        }
    }

    /// `self[off..off+n]` as f32: borrowed for an f32 cache, converted into `buf` for f16.
    #[inline]
    fn row<'b>(&'b self, off: usize, n: usize, buf: &'b mut [f32]) -> &'b [f32] {
        match self {
            KvSlice::F32(s) => &s[off..off + n],
            KvSlice::F16(s) => {
                s[off..off + n].convert_to_f32_slice(&mut buf[..n]);
                &buf[..n]
            }
        }
    }

    /// `q · self[off..off+q.len()]`; f16 rows are converted in registers where
    /// the host can (`buf` is scratch for the portable path).
    #[inline]
    fn dot_row(&self, off: usize, q: &[f32], buf: &mut [f32]) -> f32 {
        #[cfg(target_arch = "x86_64")]
        if let KvSlice::F16(s) = self {
            if let Some(d) = fused_f16::dot(&s[off..off + q.len()], q) {
                return d;
            }
        }
        dot(q, self.row(off, q.len(), buf))
    }

    /// `acc += p · self[off..off+acc.len()]`, converting f16 like [`KvSlice::dot_row`].
    #[inline]
    fn axpy_row(&self, off: usize, p: f32, acc: &mut [f32], buf: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if let KvSlice::F16(s) = self {
            if fused_f16::axpy(&s[off..off + acc.len()], p, acc) {
                return;
            }
        }
        axpy(p, self.row(off, acc.len(), buf), acc)
    }
}

#[cfg(target_arch = "x86_64")]
mod fused_f16 {
    //! f16 rows against f32 vectors with AVX2 + FMA + F16C: eight values per
    //! `vcvtph2ps`, no conversion buffer.

    use half::f16;
    use std::arch::x86_64::*;

    /// Whether the host runs these kernels (the native kernels' AVX2 level or above).
    #[inline]
    fn available() -> bool {
        use crate::SimdLevel::{Avx2, Avx512, Avx512Vnni};
        matches!(crate::simd_level(), Avx2 | Avx512 | Avx512Vnni)
    }

    /// `k · q`, or `None` where the host lacks the instructions.
    #[inline]
    pub(super) fn dot(k: &[f16], q: &[f32]) -> Option<f32> {
        if !available() {
            return None;
        }
        // SAFETY: `available` saw AVX2, FMA and F16C on this host.
        Some(unsafe { dot_avx2(k, q) })
    }

    /// `acc += p · v`; false (nothing done) where the host lacks the instructions.
    #[inline]
    pub(super) fn axpy(v: &[f16], p: f32, acc: &mut [f32]) -> bool {
        if !available() {
            return false;
        }
        // SAFETY: as in `dot`.
        unsafe { axpy_avx2(v, p, acc) };
        true
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot_avx2(k: &[f16], q: &[f32]) -> f32 {
        let n = k.len().min(q.len());
        let (kp, qp) = (k.as_ptr(), q.as_ptr());
        let (mut a0, mut a1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        let mut i = 0;
        // Each step reads lanes i..i+16 (then i..i+8) of both slices, all < n.
        while i + 16 <= n {
            let k0 = _mm256_cvtph_ps(_mm_loadu_si128(kp.add(i) as *const __m128i));
            let k1 = _mm256_cvtph_ps(_mm_loadu_si128(kp.add(i + 8) as *const __m128i));
            a0 = _mm256_fmadd_ps(k0, _mm256_loadu_ps(qp.add(i)), a0);
            a1 = _mm256_fmadd_ps(k1, _mm256_loadu_ps(qp.add(i + 8)), a1);
            i += 16;
        }
        if i + 8 <= n {
            let k0 = _mm256_cvtph_ps(_mm_loadu_si128(kp.add(i) as *const __m128i));
            a0 = _mm256_fmadd_ps(k0, _mm256_loadu_ps(qp.add(i)), a0);
            i += 8;
        }
        // Horizontal sum of the sixteen partial sums, then the tail.
        let a = _mm256_add_ps(a0, a1);
        let h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps::<1>(a));
        let h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        let h = _mm_add_ss(h, _mm_shuffle_ps::<1>(h, h));
        let mut sum = _mm_cvtss_f32(h);
        for (x, y) in k[i..n].iter().zip(&q[i..n]) {
            sum += x.to_f32() * y;
        }
        sum
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn axpy_avx2(v: &[f16], p: f32, acc: &mut [f32]) {
        let n = v.len().min(acc.len());
        let (vp, ap) = (v.as_ptr(), acc.as_mut_ptr());
        let pv = _mm256_set1_ps(p);
        let mut i = 0;
        // Each step reads and writes lanes i..i+8 < n of both slices.
        while i + 8 <= n {
            let x = _mm256_cvtph_ps(_mm_loadu_si128(vp.add(i) as *const __m128i));
            let a = _mm256_loadu_ps(ap.add(i));
            _mm256_storeu_ps(ap.add(i), _mm256_fmadd_ps(pv, x, a));
            i += 8;
        }
        for (a, x) in acc[i..n].iter_mut().zip(&v[i..n]) {
            *a += p * x.to_f32();
        }
    }
}

/// `Σ a[i]·b[i]` with eight partial sums, so the loop vectorizes.
#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ac
        .remainder()
        .iter()
        .zip(bc.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ac.zip(bc) {
        for k in 0..8 {
            acc[k] += x[k] * y[k];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// `acc += p · v`.
#[inline]
fn axpy(p: f32, v: &[f32], acc: &mut [f32]) {
    for (a, &x) in acc.iter_mut().zip(v) {
        *a += p * x;
    }
}

/// Shape and options of one attention call.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttnConfig {
    pub n_head: usize,
    pub n_kv_head: usize,
    pub head_dim: usize,
    /// Multiplies `q·k` (usually `1/sqrt(head_dim)`).
    pub scale: f32,
    /// Sliding window: key j is visible only if `q_pos - key_pos[j] < window`.
    pub window: Option<usize>,
    /// Logit soft-capping: `s = softcap * tanh(s / softcap)` after scaling.
    pub softcap: Option<f32>,
}

thread_local! {
    /// Per-worker scratch, reused across calls: the visible slots, their scores, and one
    /// key/value row converted to f32.
    static SCRATCH: RefCell<Scratch> = const { RefCell::new(Scratch { slots: Vec::new(), scores: Vec::new(), row: Vec::new() }) };
}

thread_local! {
    /// Caller-side list of the cache's written slots, reused across calls.
    static WRITTEN: RefCell<Vec<usize>> = const { RefCell::new(Vec::new()) };
    /// Caller-side queries rounded to the keys' element type, reused across calls.
    static QUERIES: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    /// Per-worker partial sums of the weighted values, `lanes × head_dim`.
    static VALUE_LANES: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// The summation order of ggml's f16 products (AVX2 build), which we follow
/// with an f16 cache so that roundings, and so llama.cpp's results, match:
/// element `i` of a sum goes to partial sum `i % lanes`, and the partial sums
/// are reduced in a fixed order.
#[derive(Clone, Copy)]
enum SumOrder {
    /// Several queries: llamafile's tinyBLAS, 8 lanes.
    Batch,
    /// One query: `ggml_vec_dot_f16`, four vectors of 8 lanes.
    Single,
}

impl SumOrder {
    fn lanes(self) -> usize {
        match self {
            SumOrder::Batch => 8,
            SumOrder::Single => 32,
        }
    }

    fn reduce(self, partial: &[f32]) -> f32 {
        match self {
            SumOrder::Batch => reduce8(partial),
            SumOrder::Single => reduce32(partial),
        }
    }

    /// `a · b` in this order (the products of two f16 values are exact in f32).
    fn dot(self, a: &[f32], b: &[f32]) -> f32 {
        let lanes = self.lanes();
        let n = a.len().min(b.len());
        let full = n - n % lanes;
        let mut partial = [0f32; 32];
        for (ca, cb) in a[..full]
            .chunks_exact(lanes)
            .zip(b[..full].chunks_exact(lanes))
        {
            for l in 0..lanes {
                partial[l] += ca[l] * cb[l];
            }
        }
        // Leftovers (none for head sizes that are multiples of 32) in f64.
        let rest: f64 = a[full..n]
            .iter()
            .zip(&b[full..n])
            .map(|(x, y)| (x * y) as f64)
            .sum();
        (self.reduce(&partial[..lanes]) as f64 + rest) as f32
    }
}

struct Scratch {
    slots: Vec<usize>,
    scores: Vec<f32>,
    row: Vec<f32>,
}

/// Below this many multiply-adds an attention call runs on the calling thread.
const PARALLEL_WORK: usize = 64 * 1024;

/// Causal GQA: `out[i, h] = softmax_j(scale · q[i,h]·k[j,h/g]) · v[j,h/g]` over the
/// visible keys (see [`AttnConfig`]); query head `h` reads KV head `h / (n_head / n_kv_head)`.
/// A query that sees no key gets zeros. Buffers shorter than the shapes say are
/// treated as holding fewer tokens/slots (never a panic).
pub fn attention(
    q: &[f32],
    q_pos: &[usize],
    k: KvSlice,
    v: KvSlice,
    key_pos: &[usize],
    cfg: &AttnConfig,
    out: &mut [f32],
) {
    let hd = cfg.head_dim;
    if hd == 0 || cfg.n_head == 0 || cfg.n_kv_head == 0 {
        return;
    }
    let group = (cfg.n_head / cfg.n_kv_head).max(1);
    let kv_stride = cfg.n_kv_head * hd;
    let n_slots = key_pos
        .len()
        .min(k.len() / kv_stride)
        .min(v.len() / kv_stride);
    let n_q = q_pos.len().min(q.len() / (cfg.n_head * hd));
    let n_tasks = (n_q * cfg.n_head).min(out.len() / hd);
    let out_ptr = OutPtr(out.as_mut_ptr());
    // The written slots, found once per call (a cache may have thousands of empty ones).
    let mut written = WRITTEN.with(|c| c.take());
    written.clear();
    written.extend((0..n_slots).filter(|&j| key_pos[j] != usize::MAX));
    let written_slots = &written[..];
    // q rounded to the keys' type: ggml multiplies an f16 cache by f16 queries.
    let mut q_rounded = QUERIES.with(|c| c.take());
    q_rounded.clear();
    q_rounded.extend(q[..n_tasks * hd].iter().map(|&x| k.round(x)));
    let q = &q_rounded[..];
    let order = if n_q > 1 {
        SumOrder::Batch
    } else {
        SumOrder::Single
    };
    // One task per (query, head): its output is `out[task*hd..(task+1)*hd]`.
    let task = |task: usize| {
        let (i, h) = (task / cfg.n_head, task % cfg.n_head);
        // SAFETY: task < n_tasks ≤ out.len() / hd, and each task writes only its own head.
        let o = unsafe { std::slice::from_raw_parts_mut(out_ptr.at(task * hd), hd) };
        let qv = &q[task * hd..(task + 1) * hd];
        let kvh = (h / group).min(cfg.n_kv_head - 1);
        let qp = q_pos[i];
        SCRATCH.with(|cell| {
            let mut guard = cell.borrow_mut();
            let Scratch { slots, scores, row } = &mut *guard;
            row.resize(hd, 0.0);
            // The keys this query sees: written slots at or before it, inside the window.
            slots.clear();
            slots.extend(written_slots.iter().copied().filter(|&j| {
                let kp = key_pos[j];
                kp <= qp && cfg.window.is_none_or(|w| qp - kp < w)
            }));
            o.fill(0.0);
            if slots.is_empty() {
                return;
            }
            // Scores: scale · q·k, soft-capped if asked.
            scores.clear();
            let mut max = f32::NEG_INFINITY;
            for &j in slots.iter() {
                let off = j * kv_stride + kvh * hd;
                let qk = match k {
                    KvSlice::F16(_) => order.dot(k.row(off, hd, row), qv),
                    KvSlice::F32(_) => k.dot_row(off, qv, row),
                };
                let mut x = qk * cfg.scale;
                if let Some(cap) = cfg.softcap {
                    x = cap * (x / cap).tanh();
                }
                max = max.max(x);
                scores.push(x);
            }
            // Softmax weights with ggml's expf; their sum is taken 8 slots
            // at a time in f32, accumulated in f64 (ggml's AVX2 soft_max).
            let mut sum = 0f64;
            let mut eight = [0f32; 8];
            let mut chunk = usize::MAX;
            for (&j, s) in slots.iter().zip(scores.iter_mut()) {
                *s = ggml_expf(*s - max);
                if j / 8 != chunk {
                    sum += reduce8(&eight) as f64;
                    eight = [0.0; 8];
                    chunk = j / 8;
                }
                eight[j % 8] = *s;
            }
            sum += reduce8(&eight) as f64;
            let inv = (1.0 / sum) as f32;
            // Weighted sum of values, the weights rounded to the values' type
            // as ggml's f16 `kq·v` product does, summed in ggml's lane order.
            let lanes = order.lanes();
            VALUE_LANES.with(|cell| {
                let mut acc = cell.borrow_mut();
                acc.clear();
                acc.resize(lanes * hd, 0.0);
                for (&j, &p) in slots.iter().zip(scores.iter()) {
                    let lane = &mut acc[(j % lanes) * hd..(j % lanes + 1) * hd];
                    v.axpy_row(j * kv_stride + kvh * hd, v.round(p * inv), lane, row);
                }
                let mut partial = [0f32; 32];
                for (d, od) in o.iter_mut().enumerate() {
                    for (l, pl) in partial[..lanes].iter_mut().enumerate() {
                        *pl = acc[l * hd + d];
                    }
                    *od = order.reduce(&partial[..lanes]);
                }
            });
        });
    };
    // Each task costs about 2 · visible keys · head_dim multiply-adds.
    if n_tasks * written_slots.len() * hd * 2 < PARALLEL_WORK {
        (0..n_tasks).for_each(task);
    } else {
        crate::threads::parallel_for(n_tasks, &task);
    }
    WRITTEN.with(|c| c.replace(written));
    QUERIES.with(|c| c.replace(q_rounded));
}

/// A raw output pointer shared by tasks that write disjoint heads.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: tasks write disjoint `head_dim` runs of one live `&mut [f32]` while
// `attention` waits for them, so no element is shared.
unsafe impl Send for OutPtr {}
// SAFETY: as above.
unsafe impl Sync for OutPtr {}

impl OutPtr {
    /// The element at `i` (a method, so closures capture the whole wrapper).
    fn at(self, i: usize) -> *mut f32 {
        self.0.wrapping_add(i)
    }
}
