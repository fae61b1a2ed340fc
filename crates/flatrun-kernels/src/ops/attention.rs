//! Causal grouped-query attention over an f32, f16 or block-quantized
//! (`q8_0`, `q4_0`) KV cache. An f16 or f32 cache is read as ggml's
//! `soft_max` over `kq` reads it (llama.cpp without flash attention). A cache
//! with quantized keys or values is read as llama.cpp reads it, through its
//! CPU flash attention ([`OnlineHead`]): the query is quantized once to Q8_0
//! blocks and each score is an integer dot product per block, scaled by the
//! two blocks' scales; an online softmax; quantized values decoded a row at
//! a time into the weighted sum. No cache row is ever converted as a whole.
//!
//! A cache whose rows live in a file mapping (a streamed KV cache) passes a
//! [`KvPager`] ([`attention_paged`]): every pass over its keys or values
//! tells it, in runs of [`PAGED_RUN_SLOTS`] slots, which rows it has gone
//! past, so their pages can leave the process while the pass goes on, and a
//! tile's scores are kept for fewer query positions at a time
//! ([`PAGED_SCORE_BYTES`]). The resident set then stays flat as the context
//! grows. Only memory depends on it: every number is the same.

use std::cell::RefCell;

use crate::native::quantize::{BlockQ8, QK8, quantize_q8};

use half::f16;
use half::slice::HalfFloatSliceExt;

use super::softmax::{ggml_expf, reduce8, reduce32};

/// Keys or values of the cache: `n_slots × n_kv_head × head_dim`.
#[derive(Clone, Copy, Debug)]
pub enum KvSlice<'a> {
    F32(&'a [f32]),
    F16(&'a [f16]),
    /// ggml Q8_0 blocks (f16 scale, 32 × i8), 34 bytes per 32 values.
    Q8_0(&'a [u8]),
    /// ggml Q4_0 blocks (f16 scale, 32 × 4-bit), 18 bytes per 32 values.
    Q4_0(&'a [u8]),
}

/// Which half of a cache's rows a pass has gone past.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvPart {
    Keys,
    Values,
}

/// A cache whose rows live in a file mapping: told which slots a pass over
/// its keys or values has gone past. It may drop their pages; a row read
/// again later (by another query's pass) faults back in.
pub trait KvPager: Sync {
    /// The pass will not read rows `slots` of `part` again.
    fn passed(&self, part: KvPart, slots: std::ops::Range<usize>);
}

/// Slots a pass goes over before it tells the pager (at 256 f16 values a
/// row, 256 KiB of rows).
pub const PAGED_RUN_SLOTS: usize = 512;

/// A paged cache's tiles keep scores (and slot numbers) for at most about
/// this many bytes per thread, whatever the context: fewer query positions
/// per tile as the context grows, one at least.
pub const PAGED_SCORE_BYTES: usize = 1 << 20;

/// The rows a pass has gone past, handed to the pager in runs.
struct Behind<'p> {
    pager: Option<&'p dyn KvPager>,
    part: KvPart,
    /// The first slot not handed over yet.
    from: usize,
}

impl<'p> Behind<'p> {
    fn new(pager: Option<&'p dyn KvPager>, part: KvPart) -> Self {
        Behind {
            pager,
            part,
            from: 0,
        }
    }

    /// The pass is at `slot` (it will read no slot below it again).
    #[inline]
    fn reach(&mut self, slot: usize) {
        if let Some(p) = self.pager
            && slot >= self.from + PAGED_RUN_SLOTS
        {
            p.passed(self.part, self.from..slot);
            self.from = slot;
        }
    }

    /// The pass is over: slots below `end` go.
    fn finish(&mut self, end: usize) {
        if let Some(p) = self.pager
            && end > self.from
        {
            p.passed(self.part, self.from..end);
            self.from = end;
        }
    }
}

/// Bytes of one Q8_0 block.
const Q8_0_BYTES: usize = 34;
/// Bytes of one Q4_0 block.
const Q4_0_BYTES: usize = 18;

impl KvSlice<'_> {
    fn len(&self) -> usize {
        match self {
            KvSlice::F32(s) => s.len(),
            KvSlice::F16(s) => s.len(),
            KvSlice::Q8_0(b) => b.len() / Q8_0_BYTES * QK8,
            KvSlice::Q4_0(b) => b.len() / Q4_0_BYTES * QK8,
        }
    }

    /// Whether values are stored in blocks of 32.
    fn is_blocks(&self) -> bool {
        matches!(self, KvSlice::Q8_0(_) | KvSlice::Q4_0(_))
    }

    /// The blocks holding values `off..off + n` (`off` and `n` multiples of 32).
    fn blocks(&self, off: usize, n: usize) -> &[u8] {
        let (b, size) = match self {
            KvSlice::Q8_0(b) => (b, Q8_0_BYTES),
            KvSlice::Q4_0(b) => (b, Q4_0_BYTES),
            KvSlice::F32(_) | KvSlice::F16(_) => return &[],
        };
        let (start, end) = (off / QK8 * size, (off + n) / QK8 * size);
        b.get(start..end).unwrap_or(&[])
    }

    /// `x` as this cache's element type would hold it: rounded through f16
    /// for an f16 cache (what ggml does to the other operand of a product
    /// with an f16 matrix), unchanged for f32.
    #[inline]
    fn round(&self, x: f32) -> f32 {
        match self {
            KvSlice::F32(_) | KvSlice::Q8_0(_) | KvSlice::Q4_0(_) => x,
            KvSlice::F16(_) => f16::from_f32(x).to_f32(),
        }
    }

    /// [`Self::round`] of every value of `x`, appended to `out` (f16: converted a slice
    /// piece at a time, which `half` vectorizes; the same round-to-nearest-even values).
    fn round_into(&self, x: &[f32], out: &mut Vec<f32>) {
        match self {
            KvSlice::F32(_) | KvSlice::Q8_0(_) | KvSlice::Q4_0(_) => out.extend_from_slice(x),
            KvSlice::F16(_) => {
                let mut halves = [f16::ZERO; 64];
                let mut floats = [0f32; 64];
                for piece in x.chunks(64) {
                    let n = piece.len();
                    halves[..n].convert_from_f32_slice(piece);
                    halves[..n].convert_to_f32_slice(&mut floats[..n]);
                    out.extend_from_slice(&floats[..n]);
                }
            }
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
            KvSlice::Q8_0(_) | KvSlice::Q4_0(_) => {
                decode_blocks(self, self.blocks(off, n), &mut buf[..n]);
                &buf[..n]
            }
        }
    }

    /// `q · self[off..off+q.len()]`; f16 rows are converted in registers where
    /// the host can (`buf` is scratch for the portable path).
    #[inline]
    fn dot_row(&self, off: usize, q: &[f32], buf: &mut [f32]) -> f32 {
        #[cfg(target_arch = "x86_64")]
        if let KvSlice::F16(s) = self
            && let Some(d) = fused_f16::dot(&s[off..off + q.len()], q)
        {
            return d;
        }
        dot(q, self.row(off, q.len(), buf))
    }

    /// `acc += p · self[off..off+acc.len()]`, converting f16 like [`KvSlice::dot_row`].
    #[inline]
    fn axpy_row(&self, off: usize, p: f32, acc: &mut [f32], buf: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if let KvSlice::F16(s) = self
            && fused_f16::axpy(&s[off..off + acc.len()], p, acc)
        {
            return;
        }
        axpy(p, self.row(off, acc.len(), buf), acc)
    }
}

/// Decode the Q8_0 or Q4_0 blocks `b` into `out` (`32 × blocks` values).
fn decode_blocks(kind: &KvSlice, b: &[u8], out: &mut [f32]) {
    match kind {
        KvSlice::Q8_0(_) => {
            for (blk, o) in b.chunks_exact(Q8_0_BYTES).zip(out.chunks_exact_mut(QK8)) {
                let d = f16::from_le_bytes([blk[0], blk[1]]).to_f32();
                for (x, &q) in o.iter_mut().zip(&blk[2..]) {
                    *x = d * (q as i8) as f32;
                }
            }
        }
        KvSlice::Q4_0(_) => {
            for (blk, o) in b.chunks_exact(Q4_0_BYTES).zip(out.chunks_exact_mut(QK8)) {
                let d = f16::from_le_bytes([blk[0], blk[1]]).to_f32();
                for (j, &q) in blk[2..].iter().enumerate() {
                    o[j] = d * ((q & 0x0f) as i32 - 8) as f32;
                    o[j + 16] = d * ((q >> 4) as i32 - 8) as f32;
                }
            }
        }
        KvSlice::F32(_) | KvSlice::F16(_) => {}
    }
}

/// `Σ k·q` of quantized key blocks `k` (Q8_0 or Q4_0) with a Q8 query in the
/// order of ggml's AVX2 `vec_dot_q8_0_q8_0` / `vec_dot_q4_0_q8_0`, the dot
/// products of its flash attention: per block, eight lanes each take the
/// exact integer sum of four products and add it times `d_k·d_q` with one
/// fused multiply-add; the lanes are then reduced halves first.
#[inline(always)]
fn block_dot_body(kind: &KvSlice, k: &[u8], q: &[BlockQ8]) -> f32 {
    let size = match kind {
        KvSlice::Q8_0(_) => Q8_0_BYTES,
        KvSlice::Q4_0(_) => Q4_0_BYTES,
        KvSlice::F32(_) | KvSlice::F16(_) => return 0.0,
    };
    let mut acc = [0f32; 8];
    let mut vals = [0i32; QK8];
    for (blk, qb) in k.chunks_exact(size).zip(q) {
        let d = f16::from_le_bytes([blk[0], blk[1]]).to_f32() * qb.d;
        match kind {
            KvSlice::Q4_0(_) => {
                for (j, &x) in blk[2..].iter().enumerate() {
                    vals[j] = (x & 0x0f) as i32 - 8;
                    vals[j + 16] = (x >> 4) as i32 - 8;
                }
            }
            _ => {
                for (v, &x) in vals.iter_mut().zip(&blk[2..]) {
                    *v = (x as i8) as i32;
                }
            }
        }
        for (l, a) in acc.iter_mut().enumerate() {
            let sumi: i32 = (4 * l..4 * l + 4).map(|j| vals[j] * qb.qs[j] as i32).sum();
            *a = d.mul_add(sumi as f32, *a);
        }
    }
    let r: [f32; 4] = std::array::from_fn(|i| acc[4 + i] + acc[i]);
    (r[0] + r[2]) + (r[1] + r[3])
}

/// [`block_dot_body`] compiled for AVX2 and FMA (`mul_add` is one instruction).
///
/// # Safety
/// The host must have AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn block_dot_avx2(kind: &KvSlice, k: &[u8], q: &[BlockQ8]) -> f32 {
    block_dot_body(kind, k, q)
}

/// Quantized keys against a Q8 query in flash attention's order.
#[inline]
fn block_dot(kind: &KvSlice, k: &[u8], q: &[BlockQ8]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if super::softmax::avx2_available() {
        // SAFETY: the host has AVX2 and FMA.
        return unsafe { block_dot_avx2(kind, k, q) };
    }
    block_dot_body(kind, k, q)
}

/// One query head over a cache with quantized keys or values, computed as
/// ggml's CPU flash attention computes it (`flash_attn_ext_f16_one_chunk`),
/// which is what llama.cpp runs for a quantized cache: keys in slot order,
/// each score `s = (q·k)·scale` (soft cap: `cap·tanh(s)` with the scale
/// divided by `cap`), an online softmax with libm's `expf` (on a new maximum
/// the running output and sum are scaled by `exp(M_old − M)`, otherwise the
/// key's weight is `exp(s − M)`), values decoded a row at a time and added
/// with fused multiply-adds — into f32, or into f16 for an f16 value cache —
/// then a sink logit if the head has one, and the output divided by the sum.
struct OnlineHead<'a, F: Fn(usize) -> usize> {
    k: &'a KvSlice<'a>,
    v: &'a KvSlice<'a>,
    /// The query head (rounded to f16 for an f16 key cache).
    q: &'a [f32],
    /// The query head as Q8 blocks (quantized key caches).
    q_blocks: &'a [BlockQ8],
    /// Offset of slot `j`'s head in the keys and values.
    offset: F,
    cfg: &'a AttnConfig,
    /// The head's learned sink logit (gpt-oss), joined after the keys.
    sink: Option<f32>,
    /// A paged cache's pager (keys and values are read in one pass).
    pager: Option<&'a dyn KvPager>,
}

impl<F: Fn(usize) -> usize> OnlineHead<'_, F> {
    fn run(&self, slots: &[usize], row: &mut [f32], o: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if super::softmax::avx2_available() {
            // SAFETY: the host has AVX2, FMA and F16C.
            return unsafe { self.run_avx2(slots, row, o) };
        }
        self.run_body(slots, row, o)
    }

    /// # Safety
    /// The host must have AVX2, FMA and F16C.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn run_avx2(&self, slots: &[usize], row: &mut [f32], o: &mut [f32]) {
        self.run_body(slots, row, o)
    }

    #[inline(always)]
    fn run_body(&self, slots: &[usize], row: &mut [f32], o: &mut [f32]) {
        let hd = o.len();
        let (scale, cap) = match self.cfg.softcap {
            Some(c) if c != 0.0 => (self.cfg.scale / c, Some(c)),
            _ => (self.cfg.scale, None),
        };
        // An f16 value cache accumulates in f16, as ggml's does.
        let half = matches!(self.v, KvSlice::F16(_));
        let round = |x: f32| if half { f16::from_f32(x).to_f32() } else { x };
        let (mut max, mut sum) = (f32::NEG_INFINITY, 0f32);
        o.fill(0.0);
        let mut keys = Behind::new(self.pager, KvPart::Keys);
        let mut values = Behind::new(self.pager, KvPart::Values);
        for &j in slots {
            keys.reach(j);
            values.reach(j);
            let off = (self.offset)(j);
            let qk = match self.k {
                KvSlice::Q8_0(_) | KvSlice::Q4_0(_) => {
                    block_dot(self.k, self.k.blocks(off, hd), self.q_blocks)
                }
                KvSlice::F16(ks) => SumOrder::Single.dot_f16(&ks[off..off + hd], self.q, row),
                KvSlice::F32(_) => self.k.dot_row(off, self.q, row),
            };
            let mut s = qk * scale;
            if let Some(c) = cap {
                s = c * s.tanh();
            }
            let (mut ms, mut vs) = (1f32, 1f32);
            if s > max {
                ms = (max - s).exp();
                max = s;
                for a in o.iter_mut() {
                    *a = round(*a * ms);
                }
            } else {
                vs = (s - max).exp();
            }
            let values = self.v.row(off, hd, row);
            for (a, &x) in o.iter_mut().zip(values) {
                *a = round(x.mul_add(vs, *a));
            }
            sum = sum.mul_add(ms, vs);
        }
        let end = slots.last().map_or(0, |&j| j + 1);
        keys.finish(end);
        values.finish(end);
        // The sink is one more score with no value (in f32 whatever the values' type).
        if let Some(sink) = self.sink {
            let (mut ms, mut vs) = (1f32, 1f32);
            if sink > max {
                ms = (max - sink).exp();
                for a in o.iter_mut() {
                    *a *= ms;
                }
            } else {
                vs = (sink - max).exp();
            }
            sum = sum.mul_add(ms, vs);
        }
        let inv = if sum == 0.0 { 0.0 } else { 1.0 / sum };
        for a in o.iter_mut() {
            *a *= inv;
        }
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

    /// # Safety
    /// The host must have AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dot_avx2(k: &[f16], q: &[f32]) -> f32 {
        // SAFETY: the caller checked AVX2, FMA and F16C (`available`), and every
        // pointer below is offset by less than `n`, the shorter slice's length.
        unsafe {
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
    }

    /// `Σ k·q` with lane `l` of one 8-wide partial sum taking elements `≡ l (mod 8)`, reduced
    /// like ggml's AVX2 horizontal sum (tinyBLAS's order for a batch of queries).
    ///
    /// # Safety
    /// AVX2, FMA and F16C; `k.len() == q.len()`, a multiple of 8.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_lanes8(k: &[f16], q: &[f32]) -> f32 {
        // SAFETY: the caller upholds this function's safety contract (its
        // `# Safety` section), which every unsafe operation below relies on.
        unsafe {
            let (kp, qp) = (k.as_ptr(), q.as_ptr());
            let mut acc = _mm256_setzero_ps();
            // Products of two f16 values are exact in f32, so one FMA equals ggml's mul + add.
            for i in (0..k.len()).step_by(8) {
                let kv = _mm256_cvtph_ps(_mm_loadu_si128(kp.add(i) as *const __m128i));
                acc = _mm256_fmadd_ps(kv, _mm256_loadu_ps(qp.add(i)), acc);
            }
            // Halves, then lanes 0+2 and 1+3, then the two.
            let c = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps::<1>(acc));
            let s = _mm_add_ps(c, _mm_movehl_ps(c, c));
            _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps::<1>(s, s)))
        }
    }

    /// The same with four 8-wide partial sums over runs of 32 (`ggml_vec_dot_f16`'s order
    /// for one query): vectors 0+2 and 1+3, then the two, then halves, then pairs.
    ///
    /// # Safety
    /// AVX2, FMA and F16C; `k.len() == q.len()`, a multiple of 32.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_lanes32(k: &[f16], q: &[f32]) -> f32 {
        // SAFETY: the caller upholds this function's safety contract (its
        // `# Safety` section), which every unsafe operation below relies on.
        unsafe {
            let (kp, qp) = (k.as_ptr(), q.as_ptr());
            let mut acc = [_mm256_setzero_ps(); 4];
            for i in (0..k.len()).step_by(32) {
                for (v, a) in acc.iter_mut().enumerate() {
                    let kv = _mm256_cvtph_ps(_mm_loadu_si128(kp.add(i + 8 * v) as *const __m128i));
                    *a = _mm256_fmadd_ps(kv, _mm256_loadu_ps(qp.add(i + 8 * v)), *a);
                }
            }
            reduce32(&acc)
        }
    }

    /// [`dot_lanes32`]'s reduction of its four partial-sum vectors: vectors 0+2
    /// and 1+3, then the two, then halves, then pairs.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn reduce32(acc: &[__m256; 4]) -> f32 {
        let x = _mm256_add_ps(_mm256_add_ps(acc[0], acc[2]), _mm256_add_ps(acc[1], acc[3]));
        let t = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps::<1>(x));
        let t = _mm_hadd_ps(t, t);
        _mm_cvtss_f32(_mm_hadd_ps(t, t))
    }

    /// Scores of a tile: `out[a · offs.len() + b] = dot_lanes8(k[offs[b]..offs[b] + hd],
    /// q[qoffs[a]..qoffs[a] + hd])` for every query vector `a` and key row `b`, each
    /// dot in [`dot_lanes8`]'s order (so the same bits). Two query vectors and four
    /// keys at a time: eight independent sums, each key's eight converted values used
    /// for both vectors, and the eight sums reduced together.
    ///
    /// # Safety
    /// AVX2, FMA and F16C; `hd` a multiple of 8; every `offs[b] + hd ≤ k.len()`, every
    /// `qoffs[a] + hd ≤ q.len()`, and `out.len() ≥ qoffs.len() · offs.len()`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn tile_dots_lanes8(
        k: &[f16],
        offs: &[usize],
        q: &[f32],
        qoffs: &[usize],
        hd: usize,
        out: &mut [f32],
    ) {
        // SAFETY: the caller upholds this function's safety contract (its
        // `# Safety` section): every row read below starts at an offset it
        // listed and spans `hd` values, and every write is inside `out`.
        unsafe {
            let (kp, qp) = (k.as_ptr(), q.as_ptr());
            let nk = offs.len();
            let pairs = qoffs.len() / 2 * 2;
            let quads = nk / 4 * 4;
            for a in (0..pairs).step_by(2) {
                let (q0, q1) = (qp.add(qoffs[a]), qp.add(qoffs[a + 1]));
                for b in (0..quads).step_by(4) {
                    let r = [
                        kp.add(offs[b]),
                        kp.add(offs[b + 1]),
                        kp.add(offs[b + 2]),
                        kp.add(offs[b + 3]),
                    ];
                    let mut acc = [_mm256_setzero_ps(); 8];
                    for i in (0..hd).step_by(8) {
                        let x0 = _mm256_loadu_ps(q0.add(i));
                        let x1 = _mm256_loadu_ps(q1.add(i));
                        for (c, row) in r.iter().enumerate() {
                            let kv = _mm256_cvtph_ps(_mm_loadu_si128(row.add(i) as *const __m128i));
                            acc[c] = _mm256_fmadd_ps(kv, x0, acc[c]);
                            acc[4 + c] = _mm256_fmadd_ps(kv, x1, acc[4 + c]);
                        }
                    }
                    let sums = reduce8x8(acc);
                    for c in 0..4 {
                        *out.get_unchecked_mut(a * nk + b + c) = sums[c];
                        *out.get_unchecked_mut((a + 1) * nk + b + c) = sums[4 + c];
                    }
                }
                for (b, &o) in offs.iter().enumerate().skip(quads) {
                    let row = std::slice::from_raw_parts(kp.add(o), hd);
                    for (a, qv) in [(a, q0), (a + 1, q1)] {
                        let qv = std::slice::from_raw_parts(qv, hd);
                        *out.get_unchecked_mut(a * nk + b) = dot_lanes8(row, qv);
                    }
                }
            }
            for (a, &qo) in qoffs.iter().enumerate().skip(pairs) {
                let qv = std::slice::from_raw_parts(qp.add(qo), hd);
                for (b, &o) in offs.iter().enumerate() {
                    let row = std::slice::from_raw_parts(kp.add(o), hd);
                    *out.get_unchecked_mut(a * nk + b) = dot_lanes8(row, qv);
                }
            }
        }
    }

    /// `out[i] = k[slots[i] · stride + base ..][..hd] · q` for every slot, each in
    /// [`dot_lanes8`]'s order (`lanes` 8) or [`dot_lanes32`]'s (`lanes` 32): one
    /// query's scores without a call per key.
    ///
    /// # Safety
    /// AVX2, FMA and F16C; `hd` a multiple of `lanes` (8 or 32), `q.len() ≥ hd`,
    /// `out.len() ≥ slots.len()`, and every `slots[i] · stride + base + hd ≤ k.len()`.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn slot_dots(
        k: &[f16],
        stride: usize,
        base: usize,
        hd: usize,
        lanes: usize,
        slots: &[usize],
        q: &[f32],
        out: &mut [f32],
    ) {
        // SAFETY: the caller upholds this function's safety contract (its
        // `# Safety` section): every row read starts at a listed slot's offset.
        unsafe {
            let q = &q[..hd];
            for (o, &j) in out.iter_mut().zip(slots) {
                let row = std::slice::from_raw_parts(k.as_ptr().add(j * stride + base), hd);
                *o = if lanes == 32 {
                    dot_lanes32(row, q)
                } else {
                    dot_lanes8(row, q)
                };
            }
        }
    }

    /// The widest head the f32 tiles below take: a key or value tile of 64 slots is then at
    /// most 32 KiB of f32 and stays in L1 while the task's query vectors go over it.
    /// (Gemma 3's 256-wide heads measured 4% slower through them at 2,048 tokens.)
    pub(super) const WIDE_MAX_HEAD_DIM: usize = 128;

    /// Whether the host has AVX-512 F: the tiles below then run on 512-bit registers over
    /// keys and values converted to f32 once per key tile (shared by the tile's query
    /// vectors), with the same additions in every lane.
    #[inline]
    pub(super) fn wide() -> bool {
        use crate::SimdLevel::{Avx512, Avx512Vnni};
        matches!(crate::simd_level(), Avx512 | Avx512Vnni)
    }

    /// The key rows at `offs` as f32 for [`tile_dots_lanes8_f32`], whole quads only: quad q
    /// takes `4·hd` values from `q·4·hd`, per 8 values i of the head 32 values: keys
    /// 4q and 4q + 1 (values i..i+8 each), then keys 4q + 2 and 4q + 3.
    ///
    /// # Safety
    /// AVX-512 F, F16C; `hd` a multiple of 8; every `offs[b] + hd ≤ k.len()`.
    #[target_feature(enable = "avx2,fma,f16c,avx512f")]
    pub(super) unsafe fn key_quads_f32(k: &[f16], offs: &[usize], hd: usize, out: &mut Vec<f32>) {
        let quads = offs.len() / 4;
        out.clear();
        out.resize(quads * 4 * hd, 0.0);
        // SAFETY: the caller upholds this function's safety contract; every store lies in
        // `out`, sized just above.
        unsafe {
            let (kp, op) = (k.as_ptr(), out.as_mut_ptr());
            for q in 0..quads {
                for i in (0..hd).step_by(8) {
                    for pair in 0..2 {
                        let r0 = kp.add(offs[4 * q + 2 * pair] + i) as *const __m128i;
                        let r1 = kp.add(offs[4 * q + 2 * pair + 1] + i) as *const __m128i;
                        let h = _mm256_inserti128_si256::<1>(
                            _mm256_castsi128_si256(_mm_loadu_si128(r0)),
                            _mm_loadu_si128(r1),
                        );
                        _mm512_storeu_ps(
                            op.add(q * 4 * hd + 4 * i + 16 * pair),
                            _mm512_cvtph_ps(h),
                        );
                    }
                }
            }
        }
    }

    /// [`tile_dots_lanes8`] over keys converted by [`key_quads_f32`] (`kq`): each 512-bit
    /// accumulator holds two keys' eight lanes, so one FMA does two keys' steps, with no
    /// conversion in the loop; four query vectors at a time (two, then one, at the end)
    /// keep eight accumulators, so eight chains of FMAs are in flight. Each lane's FMAs
    /// and the reduction are `dot_lanes8`'s (the same bits). Keys past the last whole
    /// quad go through `dot_lanes8` on the f16 rows, as in `tile_dots_lanes8`.
    ///
    /// # Safety
    /// As [`tile_dots_lanes8`], with AVX-512 F, and `kq` from `key_quads_f32(k, offs, hd, _)`.
    #[target_feature(enable = "avx2,fma,f16c,avx512f")]
    pub(super) unsafe fn tile_dots_lanes8_f32(
        kq: &[f32],
        k: &[f16],
        offs: &[usize],
        q: &[f32],
        qoffs: &[usize],
        hd: usize,
        out: &mut [f32],
    ) {
        // SAFETY: the caller upholds this function's safety contract: every converted quad
        // spans `4·hd` values of `kq`, every row and query read spans `hd` values from a
        // listed offset, and every write is inside `out`.
        unsafe {
            let kp = k.as_ptr();
            let nk = offs.len();
            let quads = nk / 4;
            let mut a = 0;
            while a < qoffs.len() {
                let take = match qoffs.len() - a {
                    1 => 1,
                    2 | 3 => 2,
                    _ => 4,
                };
                for quad in 0..quads {
                    match take {
                        4 => quad_dots::<4, 8>(kq, q, &qoffs[a..], hd, nk, quad, a, out),
                        2 => quad_dots::<2, 4>(kq, q, &qoffs[a..], hd, nk, quad, a, out),
                        _ => quad_dots::<1, 2>(kq, q, &qoffs[a..], hd, nk, quad, a, out),
                    }
                }
                for (b, &o) in offs.iter().enumerate().skip(4 * quads) {
                    let row = std::slice::from_raw_parts(kp.add(o), hd);
                    for (c, &qo) in qoffs[a..a + take].iter().enumerate() {
                        let qv = std::slice::from_raw_parts(q.as_ptr().add(qo), hd);
                        *out.get_unchecked_mut((a + c) * nk + b) = dot_lanes8(row, qv);
                    }
                }
                a += take;
            }
        }
    }

    /// The scores of `N` query vectors (`qoffs[..N]`, rows `a ..` of `out`) with
    /// converted key quad `quad` of [`tile_dots_lanes8_f32`]; `A = 2N` accumulators:
    /// for query `i`, `acc[2i]` holds keys 0 and 1, `acc[2i + 1]` keys 2 and 3.
    ///
    /// # Safety
    /// As [`tile_dots_lanes8_f32`], with `N ≤ qoffs.len()` and `A == 2N`.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f")]
    unsafe fn quad_dots<const N: usize, const A: usize>(
        kq: &[f32],
        q: &[f32],
        qoffs: &[usize],
        hd: usize,
        nk: usize,
        quad: usize,
        a: usize,
        out: &mut [f32],
    ) {
        // SAFETY: as the caller's: the quad spans `4·hd` values of `kq`, each query `hd`
        // values of `q` from its offset, and the writes rows `a .. a + N` of `out`.
        unsafe {
            // Eight query values in both halves of a 512-bit register (a load, no shuffle).
            let both = |p: *const f32| {
                _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_loadu_pd(p as *const f64)))
            };
            let qv: [*const f32; N] = std::array::from_fn(|i| q.as_ptr().add(qoffs[i]));
            let base = kq.as_ptr().add(quad * 4 * hd);
            let mut acc = [_mm512_setzero_ps(); A];
            for i in (0..hd).step_by(8) {
                let k01 = _mm512_loadu_ps(base.add(4 * i));
                let k23 = _mm512_loadu_ps(base.add(4 * i + 16));
                for (n, &p) in qv.iter().enumerate() {
                    let x = both(p.add(i));
                    acc[2 * n] = _mm512_fmadd_ps(k01, x, acc[2 * n]);
                    acc[2 * n + 1] = _mm512_fmadd_ps(k23, x, acc[2 * n + 1]);
                }
            }
            let lo = |v: __m512| _mm512_castps512_ps256(v);
            let hi = |v: __m512| _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
            let b = 4 * quad;
            // Two query vectors per reduction of eight sums.
            for pair in 0..N.div_ceil(2) {
                let (i0, i1) = (2 * pair, (2 * pair + 1).min(N - 1));
                let sums = reduce8x8([
                    lo(acc[2 * i0]),
                    hi(acc[2 * i0]),
                    lo(acc[2 * i0 + 1]),
                    hi(acc[2 * i0 + 1]),
                    lo(acc[2 * i1]),
                    hi(acc[2 * i1]),
                    lo(acc[2 * i1 + 1]),
                    hi(acc[2 * i1 + 1]),
                ]);
                for c in 0..4 {
                    *out.get_unchecked_mut((a + i0) * nk + b + c) = sums[c];
                    *out.get_unchecked_mut((a + i1) * nk + b + c) = sums[4 + c];
                }
            }
        }
    }

    /// Value rows of slots `first .. first + count` (head offset `base`) as f32, `hd` each,
    /// for [`weigh_values_f32`].
    ///
    /// # Safety
    /// AVX-512 F, F16C; `hd` a multiple of 16; every `(first + r) · stride + base + hd ≤ v.len()`.
    #[target_feature(enable = "avx2,fma,f16c,avx512f")]
    pub(super) unsafe fn value_rows_f32(
        v: &[f16],
        stride: usize,
        base: usize,
        first: usize,
        count: usize,
        hd: usize,
        out: &mut Vec<f32>,
    ) {
        out.clear();
        out.resize(count * hd, 0.0);
        // SAFETY: the caller upholds this function's safety contract; stores lie in `out`.
        unsafe {
            let (vp, op) = (v.as_ptr(), out.as_mut_ptr());
            for r in 0..count {
                let row = vp.add((first + r) * stride + base);
                for d in (0..hd).step_by(16) {
                    let h = _mm256_loadu_si256(row.add(d) as *const __m256i);
                    _mm512_storeu_ps(op.add(r * hd + d), _mm512_cvtph_ps(h));
                }
            }
        }
    }

    /// [`weigh_values_f16`] over value rows converted by [`value_rows_f32`] (`vf`, row
    /// `j − first` for slot j), for `N` (1 or 2) query vectors over the same slots, each
    /// with its scores, `inv` and sums: per query the same weights (rounded to f16 and
    /// back) and, in every lane, the same FMAs in slot order, sixteen values of a row per
    /// instruction and each row load serving the `N` queries.
    ///
    /// # Safety
    /// AVX-512 F, FMA, F16C; `hd` a multiple of 16; every `acc[i].len() ≥ lanes · hd` and
    /// `scores[i].len() ≥ slots.len()`; every slot in `first .. first + vf.len() / hd`.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma,f16c,avx512f")]
    pub(super) unsafe fn weigh_values_f32<const N: usize>(
        vf: &[f32],
        first: usize,
        hd: usize,
        lanes: usize,
        slots: &[usize],
        scores: [&[f32]; N],
        inv: [f32; N],
        acc: [&mut [f32]; N],
    ) {
        // SAFETY: the caller upholds this function's safety contract; `w` and `p` hold 64
        // f32 for each vector access.
        unsafe {
            let vp = vf.as_ptr();
            let ap: [*mut f32; N] = std::array::from_fn(|i| acc[i].as_ptr() as *mut f32);
            let n = slots.len();
            let mut w = [[0f32; 64]; N];
            for start in (0..n).step_by(64) {
                let block = &slots[start..(start + 64).min(n)];
                let m = block.len();
                for i in 0..N {
                    let mut p = [0f32; 64];
                    p[..m].copy_from_slice(&scores[i][start..start + m]);
                    let invv = _mm256_set1_ps(inv[i]);
                    for c in (0..m).step_by(8) {
                        let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_mul_ps(
                            _mm256_loadu_ps(p.as_ptr().add(c)),
                            invv,
                        ));
                        _mm256_storeu_ps(w[i].as_mut_ptr().add(c), _mm256_cvtph_ps(h));
                    }
                }
                let grouped = lanes == 8
                    && m.is_multiple_of(8)
                    && block
                        .chunks_exact(8)
                        .all(|g| g[0] % 8 == 0 && g[7] == g[0] + 7);
                if grouped {
                    for d in (0..hd).step_by(16) {
                        let mut sums: [[__m512; 8]; N] = std::array::from_fn(|i| {
                            std::array::from_fn(|t| _mm512_loadu_ps(ap[i].add(t * hd + d)))
                        });
                        for (k, g) in block.chunks_exact(8).enumerate() {
                            for t in 0..8 {
                                let x = _mm512_loadu_ps(vp.add((g[t] - first) * hd + d));
                                for i in 0..N {
                                    let wt = _mm512_set1_ps(w[i][8 * k + t]);
                                    sums[i][t] = _mm512_fmadd_ps(wt, x, sums[i][t]);
                                }
                            }
                        }
                        for i in 0..N {
                            for (t, v) in sums[i].iter().enumerate() {
                                _mm512_storeu_ps(ap[i].add(t * hd + d), *v);
                            }
                        }
                    }
                    continue;
                }
                for (k, &j) in block.iter().enumerate() {
                    let row = vp.add((j - first) * hd);
                    for d in (0..hd).step_by(16) {
                        let x = _mm512_loadu_ps(row.add(d));
                        for i in 0..N {
                            let lane = ap[i].add((j % lanes) * hd + d);
                            let wt = _mm512_set1_ps(w[i][k]);
                            _mm512_storeu_ps(lane, _mm512_fmadd_ps(wt, x, _mm512_loadu_ps(lane)));
                        }
                    }
                }
            }
        }
    }

    /// [`tile_dots_lanes8`] in [`dot_lanes32`]'s order (one query's heads over
    /// a decode step's keys): two query vectors at a time, each key's
    /// converted values used for both.
    ///
    /// # Safety
    /// As [`tile_dots_lanes8`], with `hd` a multiple of 32.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn tile_dots_lanes32(
        k: &[f16],
        offs: &[usize],
        q: &[f32],
        qoffs: &[usize],
        hd: usize,
        out: &mut [f32],
    ) {
        // SAFETY: the caller upholds this function's safety contract (its
        // `# Safety` section): every row read below starts at an offset it
        // listed and spans `hd` values, and every write is inside `out`.
        unsafe {
            let (kp, qp) = (k.as_ptr(), q.as_ptr());
            let nk = offs.len();
            let pairs = qoffs.len() / 2 * 2;
            for a in (0..pairs).step_by(2) {
                let (q0, q1) = (qp.add(qoffs[a]), qp.add(qoffs[a + 1]));
                for (b, &o) in offs.iter().enumerate() {
                    let row = kp.add(o);
                    let mut acc0 = [_mm256_setzero_ps(); 4];
                    let mut acc1 = [_mm256_setzero_ps(); 4];
                    for i in (0..hd).step_by(32) {
                        for v in 0..4 {
                            let kv = _mm256_cvtph_ps(_mm_loadu_si128(
                                row.add(i + 8 * v) as *const __m128i
                            ));
                            acc0[v] =
                                _mm256_fmadd_ps(kv, _mm256_loadu_ps(q0.add(i + 8 * v)), acc0[v]);
                            acc1[v] =
                                _mm256_fmadd_ps(kv, _mm256_loadu_ps(q1.add(i + 8 * v)), acc1[v]);
                        }
                    }
                    *out.get_unchecked_mut(a * nk + b) = reduce32(&acc0);
                    *out.get_unchecked_mut((a + 1) * nk + b) = reduce32(&acc1);
                }
            }
            for (a, &qo) in qoffs.iter().enumerate().skip(pairs) {
                let qv = std::slice::from_raw_parts(qp.add(qo), hd);
                for (b, &o) in offs.iter().enumerate() {
                    let row = std::slice::from_raw_parts(kp.add(o), hd);
                    *out.get_unchecked_mut(a * nk + b) = dot_lanes32(row, qv);
                }
            }
        }
    }

    /// [`dot_lanes8`]'s reduction of eight partial-sum vectors at once: element `c`
    /// of the result is `acc[c]` reduced (halves lane-wise, then lanes 0+2 and 1+3,
    /// then the two), by the same additions in vector lanes.
    #[target_feature(enable = "avx2,fma,f16c")]
    fn reduce8x8(acc: [__m256; 8]) -> [f32; 8] {
        // Halves: x[p] holds acc[2p] + its upper half in its low 128 bits and
        // acc[2p + 1]'s in its high 128 bits (`c` of `dot_lanes8`, four lanes each).
        let half = |a: __m256, b: __m256| {
            _mm256_add_ps(
                _mm256_permute2f128_ps::<0x20>(a, b),
                _mm256_permute2f128_ps::<0x31>(a, b),
            )
        };
        let x = [
            half(acc[0], acc[1]),
            half(acc[2], acc[3]),
            half(acc[4], acc[5]),
            half(acc[6], acc[7]),
        ];
        // Lanes 0+2 and 1+3 of each: per 128-bit half, [s0, s1] of one sum and of
        // the next pair's.
        let pair = |a: __m256, b: __m256| {
            _mm256_add_ps(
                _mm256_shuffle_ps::<0b01_00_01_00>(a, b),
                _mm256_shuffle_ps::<0b11_10_11_10>(a, b),
            )
        };
        let w0 = pair(x[0], x[1]);
        let w1 = pair(x[2], x[3]);
        // s0 + s1: low half sums acc[0], acc[2], acc[4], acc[6]; high half the odd ones.
        let t = _mm256_hadd_ps(w0, w1);
        let mut lanes = [0f32; 8];
        // SAFETY: `lanes` holds eight f32.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), t) };
        [
            lanes[0], lanes[4], lanes[1], lanes[5], lanes[2], lanes[6], lanes[3], lanes[7],
        ]
    }

    /// The weighted values of one query's slots: for each slot `j` of `slots` with
    /// its score `p` of `scores`, `acc[(j % lanes) · hd + d] += round(p · inv) ·
    /// v[j · stride + base + d]`, in slot order, `round` to f16 (the weights rounded
    /// to the values' type) — the additions of [`super::weigh_values`], without a
    /// call per slot.
    ///
    /// # Safety
    /// AVX2, FMA and F16C; `hd` a multiple of 8; `acc.len() ≥ lanes · hd`; every
    /// `j · stride + base + hd ≤ v.len()`.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn weigh_values_f16(
        v: &[f16],
        stride: usize,
        base: usize,
        hd: usize,
        lanes: usize,
        slots: &[usize],
        scores: &[f32],
        inv: f32,
        acc: &mut [f32],
    ) {
        // SAFETY: the caller upholds this function's safety contract (its
        // `# Safety` section); `w` holds eight f32 for each vector store.
        unsafe {
            let (vp, ap) = (v.as_ptr(), acc.as_mut_ptr());
            let n = slots.len().min(scores.len());
            let invv = _mm256_set1_ps(inv);
            // A block of up to 64 slots at a time: their weights rounded to f16
            // and back eight at once (round to nearest even, as `f16::from_f32`).
            let mut w = [0f32; 64];
            for start in (0..n).step_by(64) {
                let block = &slots[start..(start + 64).min(n)];
                let m = block.len();
                let mut p = [0f32; 64];
                p[..m].copy_from_slice(&scores[start..start + m]);
                for c in (0..m).step_by(8) {
                    let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_mul_ps(
                        _mm256_loadu_ps(p.as_ptr().add(c)),
                        invv,
                    ));
                    _mm256_storeu_ps(w.as_mut_ptr().add(c), _mm256_cvtph_ps(h));
                }
                // Groups of eight consecutive slots from a multiple of eight put
                // one product in each lane, in lane order: each lane's partial
                // sums then stay in a register while the block's rows go by.
                let grouped = lanes == 8
                    && m.is_multiple_of(8)
                    && block
                        .chunks_exact(8)
                        .all(|g| g[0] % 8 == 0 && g[7] == g[0] + 7);
                if grouped {
                    for d in (0..hd).step_by(8) {
                        let mut sums: [__m256; 8] =
                            std::array::from_fn(|t| _mm256_loadu_ps(ap.add(t * hd + d)));
                        for (g, ws) in block.chunks_exact(8).zip(w.chunks_exact(8)) {
                            for t in 0..8 {
                                let row = vp.add(g[t] * stride + base + d);
                                let x = _mm256_cvtph_ps(_mm_loadu_si128(row as *const __m128i));
                                sums[t] = _mm256_fmadd_ps(_mm256_set1_ps(ws[t]), x, sums[t]);
                            }
                        }
                        for (t, v) in sums.iter().enumerate() {
                            _mm256_storeu_ps(ap.add(t * hd + d), *v);
                        }
                    }
                    continue;
                }
                for (&j, &wt) in block.iter().zip(&w) {
                    let wv = _mm256_set1_ps(wt);
                    let row = vp.add(j * stride + base);
                    let lane = ap.add((j % lanes) * hd);
                    for d in (0..hd).step_by(8) {
                        let x = _mm256_cvtph_ps(_mm_loadu_si128(row.add(d) as *const __m128i));
                        let a = _mm256_loadu_ps(lane.add(d));
                        _mm256_storeu_ps(lane.add(d), _mm256_fmadd_ps(wv, x, a));
                    }
                }
            }
        }
    }

    /// # Safety
    /// The host must have AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn axpy_avx2(v: &[f16], p: f32, acc: &mut [f32]) {
        // SAFETY: the caller checked AVX2, FMA and F16C (`available`), and every
        // pointer below is offset by less than `n`, the shorter slice's length.
        unsafe {
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
    /// Caller-side queries quantized to Q8 blocks (quantized keys), reused across calls.
    static QUERY_BLOCKS: RefCell<Vec<BlockQ8>> = const { RefCell::new(Vec::new()) };
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

    /// `k · q` for an f16 key row, in this order: in registers on AVX2 hosts when the
    /// length is whole vectors, else through `buf` and [`SumOrder::dot`].
    #[inline]
    fn dot_f16(self, k: &[f16], q: &[f32], buf: &mut [f32]) -> f32 {
        let n = k.len().min(q.len());
        #[cfg(target_arch = "x86_64")]
        if n.is_multiple_of(self.lanes()) && super::softmax::avx2_available() {
            // SAFETY: the host has AVX2, FMA and F16C; both slices hold n values.
            return unsafe {
                match self {
                    SumOrder::Batch => fused_f16::dot_lanes8(&k[..n], &q[..n]),
                    SumOrder::Single => fused_f16::dot_lanes32(&k[..n], &q[..n]),
                }
            };
        }
        k[..n].convert_to_f32_slice(&mut buf[..n]);
        self.dot(&buf[..n], &q[..n])
    }

    /// `out[d] = reduce(acc[l·n + d] for each lane l)`: the per-lane partial sums of the
    /// weighted values, reduced in this order (elementwise over `d`, so it vectorizes).
    fn reduce_lanes(self, acc: &[f32], out: &mut [f32]) {
        let n = out.len();
        let lane = |l: usize| &acc[l * n..(l + 1) * n];
        match self {
            SumOrder::Batch => {
                let a: [&[f32]; 8] = std::array::from_fn(lane);
                for (d, o) in out.iter_mut().enumerate() {
                    // reduce8: halves lane-wise, then 0+2 and 1+3, then the two.
                    let c = [
                        a[0][d] + a[4][d],
                        a[1][d] + a[5][d],
                        a[2][d] + a[6][d],
                        a[3][d] + a[7][d],
                    ];
                    *o = (c[0] + c[2]) + (c[1] + c[3]);
                }
            }
            SumOrder::Single => {
                let a: [&[f32]; 32] = std::array::from_fn(lane);
                for (d, o) in out.iter_mut().enumerate() {
                    // reduce32: vectors 0+2 and 1+3, then the two, then the halves, then pairs.
                    let x: [f32; 8] = std::array::from_fn(|l| {
                        (a[l][d] + a[16 + l][d]) + (a[8 + l][d] + a[24 + l][d])
                    });
                    let t: [f32; 4] = std::array::from_fn(|i| x[i] + x[i + 4]);
                    *o = (t[0] + t[1]) + (t[2] + t[3]);
                }
            }
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
    attention_with_sinks(q, q_pos, k, v, key_pos, cfg, None, out)
}

/// [`attention`] with learned attention sinks (gpt-oss): `sinks[h]` is one
/// more logit in head `h`'s softmax that attends to nothing, so the weights of
/// the real keys sum to less than one (ggml's `soft_max_ext` with sinks: the
/// sink joins the maximum, and `exp(sink − max)` the denominator).
#[allow(clippy::too_many_arguments)]
pub fn attention_with_sinks(
    q: &[f32],
    q_pos: &[usize],
    k: KvSlice,
    v: KvSlice,
    key_pos: &[usize],
    cfg: &AttnConfig,
    sinks: Option<&[f32]>,
    out: &mut [f32],
) {
    attend(
        q,
        q_pos,
        k,
        v,
        key_pos,
        cfg,
        sinks,
        None,
        out,
        Route::DEFAULT,
    )
}

/// [`attention_with_sinks`] over a cache whose rows live in a file mapping:
/// `pager` hears which rows each pass has gone past (see the module's
/// documentation). The same numbers.
#[allow(clippy::too_many_arguments)]
pub fn attention_paged(
    q: &[f32],
    q_pos: &[usize],
    k: KvSlice,
    v: KvSlice,
    key_pos: &[usize],
    cfg: &AttnConfig,
    sinks: Option<&[f32]>,
    pager: &dyn KvPager,
    out: &mut [f32],
) {
    attend(
        q,
        q_pos,
        k,
        v,
        key_pos,
        cfg,
        sinks,
        Some(pager),
        out,
        Route::DEFAULT,
    )
}

/// Which of [`attend`]'s paths may run; every one gives the same numbers.
#[derive(Clone, Copy)]
struct Route {
    /// Several queries over an f16 or f32 cache may take the tiled path.
    tiled: bool,
    /// A paged cache's tiles keep scores for at most this many bytes.
    score_bytes: usize,
}

impl Route {
    const DEFAULT: Route = Route {
        tiled: true,
        score_bytes: PAGED_SCORE_BYTES,
    };
}

/// [`attention_with_sinks`] by `route`.
#[allow(clippy::too_many_arguments)]
fn attend(
    q: &[f32],
    q_pos: &[usize],
    k: KvSlice,
    v: KvSlice,
    key_pos: &[usize],
    cfg: &AttnConfig,
    sinks: Option<&[f32]>,
    pager: Option<&dyn KvPager>,
    out: &mut [f32],
    route: Route,
) {
    let hd = cfg.head_dim;
    // Block-quantized rows must hold whole heads.
    let blocks = k.is_blocks() || v.is_blocks();
    if hd == 0 || cfg.n_head == 0 || cfg.n_kv_head == 0 || (blocks && !hd.is_multiple_of(QK8)) {
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
    k.round_into(&q[..n_tasks * hd], &mut q_rounded);
    let q = &q_rounded[..];
    // Quantized keys: every query head as Q8 blocks, quantized once.
    let mut q_quantized = QUERY_BLOCKS.with(|c| c.take());
    q_quantized.clear();
    if k.is_blocks() {
        q_quantized.resize(q.len() / QK8, BlockQ8::default());
        quantize_q8(&q[..q_quantized.len() * QK8], &mut q_quantized);
    }
    let q_blocks = &q_quantized[..];
    let order = if crate::call_order::order_tokens(n_q) > 1 {
        SumOrder::Batch
    } else {
        SumOrder::Single
    };
    let fused = fused_f16_available(hd);
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
            // A quantized cache is read as llama.cpp's flash attention reads it.
            if blocks {
                let qb = if k.is_blocks() {
                    &q_blocks[task * hd / QK8..(task + 1) * hd / QK8]
                } else {
                    &[][..]
                };
                let head = OnlineHead {
                    k: &k,
                    v: &v,
                    q: qv,
                    q_blocks: qb,
                    offset: |j| j * kv_stride + kvh * hd,
                    cfg,
                    sink: sinks.and_then(|s| s.get(h)).copied(),
                    pager,
                };
                head.run(slots, row, o);
                return;
            }
            // Scores: scale · q·k, soft-capped if asked. A paged cache's
            // rows are read a run at a time, the pager told after each.
            scores.clear();
            let mut max = f32::NEG_INFINITY;
            let run = if pager.is_some() {
                PAGED_RUN_SLOTS
            } else {
                usize::MAX
            };
            let end = slots.last().map_or(0, |&j| j + 1);
            let mut keys_behind = Behind::new(pager, KvPart::Keys);
            #[cfg(target_arch = "x86_64")]
            if let (true, KvSlice::F16(ks)) = (fused && hd.is_multiple_of(order.lanes()), k) {
                scores.resize(slots.len(), 0.0);
                for (piece, out) in slots.chunks(run).zip(scores.chunks_mut(run)) {
                    keys_behind.reach(piece[0]);
                    // SAFETY: `fused` saw AVX2, FMA and F16C; the head dim is whole
                    // runs of the order's lanes; every slot's key row is in the cache.
                    unsafe {
                        fused_f16::slot_dots(
                            ks,
                            kv_stride,
                            kvh * hd,
                            hd,
                            order.lanes(),
                            piece,
                            qv,
                            out,
                        )
                    };
                }
                for x in scores.iter_mut() {
                    *x *= cfg.scale;
                    if let Some(cap) = cfg.softcap {
                        *x = cap * (*x / cap).tanh();
                    }
                    max = max.max(*x);
                }
            }
            for &j in slots.iter().skip(scores.len()) {
                keys_behind.reach(j);
                let off = j * kv_stride + kvh * hd;
                let qk = match k {
                    KvSlice::F16(ks) => order.dot_f16(&ks[off..off + hd], qv, row),
                    KvSlice::F32(_) => k.dot_row(off, qv, row),
                    KvSlice::Q8_0(_) | KvSlice::Q4_0(_) => block_dot(
                        &k,
                        k.blocks(off, hd),
                        &q_blocks[task * hd / QK8..(task + 1) * hd / QK8],
                    ),
                };
                let mut x = qk * cfg.scale;
                if let Some(cap) = cfg.softcap {
                    x = cap * (x / cap).tanh();
                }
                max = max.max(x);
                scores.push(x);
            }
            keys_behind.finish(end);
            let sink = sinks.and_then(|s| s.get(h)).copied();
            let inv = softmax_weights(slots, scores, max, sink);
            VALUE_LANES.with(|cell| {
                let mut acc = cell.borrow_mut();
                acc.clear();
                acc.resize(order.lanes() * hd, 0.0);
                // Runs of a multiple of 64 slots: the value kernels' blocks of
                // 64 fall where they fall over the whole list.
                let mut values_behind = Behind::new(pager, KvPart::Values);
                let pieces = slots.chunks(run).zip(scores.chunks(run));
                #[cfg(target_arch = "x86_64")]
                if let (true, KvSlice::F16(vs)) = (fused, v) {
                    for (piece, weights) in pieces {
                        values_behind.reach(piece[0]);
                        // SAFETY: `fused` saw AVX2, FMA and F16C and a head dim that
                        // is a multiple of 8; `acc` holds `lanes × hd` sums; every
                        // slot's value row is in the cache.
                        unsafe {
                            fused_f16::weigh_values_f16(
                                vs,
                                kv_stride,
                                kvh * hd,
                                hd,
                                order.lanes(),
                                piece,
                                weights,
                                inv,
                                &mut acc,
                            )
                        };
                    }
                    values_behind.finish(end);
                    order.reduce_lanes(&acc, o);
                    return;
                }
                let off = |j: usize| j * kv_stride + kvh * hd;
                for (piece, weights) in pieces {
                    values_behind.reach(piece[0]);
                    weigh_values(&v, order.lanes(), piece, weights, inv, off, &mut acc, row);
                }
                values_behind.finish(end);
                order.reduce_lanes(&acc, o);
            });
        });
    };
    // Several queries over an f16 or f32 cache: in tiles that read each
    // block of keys and values once for a block of queries.
    // A decode step's query heads that share a KV head read its keys
    // together too, when there are KV heads enough to keep every thread busy.
    let grouped_decode = group > 1 && cfg.n_kv_head >= crate::threads::threads();
    if route.tiled && !blocks && (n_q >= 2 || grouped_decode) {
        // A paged cache's tiles: as many positions as keep a thread's
        // scores and slot numbers within the budget. When fewer than a
        // whole tile's fit, the scores stream a key tile at a time instead,
        // and a tile takes as many positions as the budget holds value sums.
        let (tile_queries, streamed) = match pager {
            None => (TILE_QUERIES, false),
            Some(_) => {
                let per_position =
                    written_slots.len().max(1) * group * (size_of::<f32>() + size_of::<usize>());
                let fit = route.score_bytes / per_position;
                if fit >= TILE_QUERIES.min(n_q) {
                    (fit.min(TILE_QUERIES), false)
                } else {
                    let per_position = group * order.lanes() * hd * size_of::<f32>();
                    (
                        (route.score_bytes / per_position).clamp(1, n_q.max(1)),
                        true,
                    )
                }
            }
        };
        let tiles = Tiles {
            pager,
            tile_queries,
            streamed,
            q,
            q_pos,
            k: &k,
            v: &v,
            key_pos,
            written: written_slots,
            cfg,
            sinks,
            order,
            n_q,
            n_tasks,
            group,
            kv_stride,
            out: out_ptr,
            fused,
        };
        tiles.run();
    } else if n_tasks * written_slots.len() * hd * 2 < PARALLEL_WORK {
        // Each task costs about 2 · visible keys · head_dim multiply-adds.
        (0..n_tasks).for_each(task);
    } else {
        crate::threads::parallel_for(n_tasks, &task);
    }
    WRITTEN.with(|c| c.replace(written));
    QUERIES.with(|c| c.replace(q_rounded));
    QUERY_BLOCKS.with(|c| c.replace(q_quantized));
}

/// Softmax of one query's visible scores, in place: `scores[i] =
/// ggml_expf(scores[i] − max)` (`max` the largest score, the sink
/// included); returns `1 / Σ` ([`SoftmaxSum`]; `slots[i]` the slot of
/// `scores[i]`).
fn softmax_weights(slots: &[usize], scores: &mut [f32], max: f32, sink: Option<f32>) -> f32 {
    let max = sink.map_or(max, |s| max.max(s));
    exp_shifted(scores, max);
    let mut sum = SoftmaxSum::default();
    sum.add(slots, scores);
    sum.inverse(sink, max)
}

/// The denominator of one query's softmax as ggml's AVX2 `soft_max` sums
/// it: the exponentials of the slots `8m .. 8m + 8` summed as eight lanes
/// in f32 (zeros for slots not seen), those sums accumulated in f64 in slot
/// order, and a sink's `exp(sink − max)` added. It takes the slots in
/// ascending runs, all at once or a key tile at a time, with the same result.
#[derive(Clone, Copy, Default)]
struct SoftmaxSum {
    sum: f64,
    /// The lanes of the group at hand.
    eight: [f32; 8],
    /// The group at hand, `slot / 8` (or none yet).
    group: Option<usize>,
}

impl SoftmaxSum {
    /// Adds `exps[i]`, the exponential of slot `slots[i]`.
    fn add(&mut self, slots: &[usize], exps: &[f32]) {
        let (Some(&first), Some(&last)) = (slots.first(), slots.last()) else {
            return;
        };
        let n = slots.len().min(exps.len());
        // Consecutive slots (a prompt's keys in order): the groups are runs
        // of `exps`, taken without a test per slot.
        if last - first + 1 == slots.len() {
            let mut i = 0;
            while i < n {
                let j = first + i;
                self.enter(j / 8);
                let take = (8 - j % 8).min(n - i);
                self.eight[j % 8..j % 8 + take].copy_from_slice(&exps[i..i + take]);
                i += take;
            }
            return;
        }
        for (&j, &e) in slots.iter().zip(exps) {
            self.enter(j / 8);
            self.eight[j % 8] = e;
        }
    }

    /// Moves on to group `group`, adding the one at hand.
    #[inline]
    fn enter(&mut self, group: usize) {
        if self.group != Some(group) {
            self.sum += reduce8(&self.eight) as f64;
            self.eight = [0.0; 8];
            self.group = Some(group);
        }
    }

    /// `1 / Σ`, the sink's term added (`max` the softmax's shift).
    fn inverse(mut self, sink: Option<f32>, max: f32) -> f32 {
        self.sum += reduce8(&self.eight) as f64;
        if let Some(s) = sink {
            self.sum += (s - max).exp() as f64;
        }
        (1.0 / self.sum) as f32
    }
}

/// `acc[lane(j)] += round(w · inv) · v[j]` for each slot `j` of `slots` with
/// its weight `w` of `weights`, in order, where lane `j % lanes` holds
/// `head_dim` partial sums (`acc`: `lanes × head_dim`) and `off(j)` is where
/// slot `j`'s value row starts: the weights rounded to the values' type and
/// the lanes as ggml's f16 `kq·v` product sums them.
#[allow(clippy::too_many_arguments)]
fn weigh_values(
    v: &KvSlice,
    lanes: usize,
    slots: &[usize],
    weights: &[f32],
    inv: f32,
    off: impl Fn(usize) -> usize,
    acc: &mut [f32],
    row: &mut [f32],
) {
    let hd = acc.len() / lanes.max(1);
    for (&j, &p) in slots.iter().zip(weights) {
        let lane = &mut acc[(j % lanes) * hd..(j % lanes + 1) * hd];
        v.axpy_row(off(j), v.round(p * inv), lane, row);
    }
}

/// Whether the fused f16 tile kernels run here: an AVX2 host (x86_64) and a
/// head dim that is whole vectors of 8.
fn fused_f16_available(hd: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    return hd.is_multiple_of(8) && super::softmax::avx2_available();
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = hd;
        false
    }
}

/// Query positions of one tile of the tiled path (each with every head of
/// its KV head's group).
const TILE_QUERIES: usize = 8;
/// Written slots of one key tile.
const TILE_KEYS: usize = 64;

/// Several queries over an f16 or f32 cache, tile by tile. A task takes
/// one KV head and [`TILE_QUERIES`] positions, so its query vectors are
/// that head's group at those positions; it walks the keys [`TILE_KEYS`]
/// slots at a time, each tile's keys read once for all its vectors (and
/// then each tile's values), instead of every key once per query and head.
///
/// Every number is the one the per-query path computes: a score is the same
/// dot product, a query's visible slots are listed in the same order, the
/// softmax is [`softmax_weights`] over them, and each query's value lanes
/// receive its slots in the same order ([`weigh_values`] over successive
/// key tiles), so the output is bit for bit the same.
struct Tiles<'a> {
    q: &'a [f32],
    q_pos: &'a [usize],
    k: &'a KvSlice<'a>,
    v: &'a KvSlice<'a>,
    key_pos: &'a [usize],
    written: &'a [usize],
    cfg: &'a AttnConfig,
    sinks: Option<&'a [f32]>,
    order: SumOrder,
    n_q: usize,
    /// Query vectors (position × head) that have room in the output.
    n_tasks: usize,
    group: usize,
    kv_stride: usize,
    out: OutPtr,
    /// The fused f16 kernels apply: an AVX2 host and a head dim that is a multiple of 8.
    fused: bool,
    /// A paged cache's pager.
    pager: Option<&'a dyn KvPager>,
    /// Query positions per task ([`TILE_QUERIES`], fewer for a paged cache,
    /// more when it streams).
    tile_queries: usize,
    /// Scores kept a key tile at a time ([`Tiles::streamed_passes`]).
    streamed: bool,
}

/// One query vector of a tile: its index `i · n_head + h`, its visible
/// slots and their scores (then weights): all of them, or a key tile's
/// when the tile streams ([`Tiles::streamed_passes`]).
#[derive(Default)]
struct TileQuery {
    index: usize,
    pos: usize,
    slots: Vec<usize>,
    scores: Vec<f32>,
    /// How many slots it sees.
    visible: usize,
    max: f32,
    /// A streamed tile's first guess of the maximum.
    guess: f32,
    /// The softmax's shift: the maximum, the sink included.
    shift: f32,
    /// The softmax's sum, built a key tile at a time.
    sum: SoftmaxSum,
    inv: f32,
}

#[derive(Default)]
struct TileScratch {
    queries: Vec<TileQuery>,
    /// One key tile's scores, `queries.len() × TILE_KEYS` (the fused f16 kernel).
    dots: Vec<f32>,
    /// The key tile's row offsets and the query vectors' offsets.
    key_offs: Vec<usize>,
    query_offs: Vec<usize>,
    /// `queries.len() × lanes × head_dim` partial sums of the values.
    acc: Vec<f32>,
    /// A key tile's rows, and a value tile's, as f32 (the 512-bit tiles).
    keys_f32: Vec<f32>,
    values_f32: Vec<f32>,
    /// Each query's range of its slots in the value tile at hand.
    spans: Vec<(usize, usize)>,
    /// Per query: how many of its slots the value pass has taken.
    cursor: Vec<usize>,
    row: Vec<f32>,
    /// A streamed tile's key tiles that some query sees ([`Tiles::streamed_passes`]).
    seen: Vec<usize>,
}

thread_local! {
    /// Per-worker scratch of the tiled path, reused across calls.
    static TILES: RefCell<TileScratch> = RefCell::new(TileScratch::default());
}

impl Tiles<'_> {
    fn run(&self) {
        let n_blocks = self.n_q.div_ceil(self.tile_queries);
        let n_tasks = self.cfg.n_kv_head * n_blocks;
        let work = self.n_tasks * self.written.len() * self.cfg.head_dim * 2;
        if work < PARALLEL_WORK {
            (0..n_tasks).for_each(|t| self.task(t % self.cfg.n_kv_head, t / self.cfg.n_kv_head));
        } else {
            crate::threads::parallel_for(n_tasks, &|t| {
                self.task(t % self.cfg.n_kv_head, t / self.cfg.n_kv_head)
            });
        }
    }

    /// KV head `g` over query positions `block · tile_queries ..`.
    fn task(&self, g: usize, block: usize) {
        let hd = self.cfg.head_dim;
        TILES.with(|cell| {
            let mut guard = cell.borrow_mut();
            let s = &mut *guard;
            s.row.resize(hd, 0.0);
            let n = self.gather(g, block, &mut s.queries);
            if n == 0 {
                return;
            }
            s.query_offs.clear();
            s.query_offs
                .extend(s.queries[..n].iter().map(|tq| tq.index * hd));
            s.acc.clear();
            s.acc.resize(n * self.order.lanes() * hd, 0.0);
            if self.streamed {
                self.streamed_passes(g, n, s);
            } else {
                self.stored_passes(g, n, s);
            }
            let lanes = self.order.lanes();
            for (tq, lanes_acc) in s.queries[..n].iter().zip(s.acc.chunks_exact(lanes * hd)) {
                // SAFETY: index < n_tasks ≤ out.len() / hd, and each query
                // vector belongs to exactly one task (its position's block
                // and its head's KV head), which writes only its own head.
                let o = unsafe { std::slice::from_raw_parts_mut(self.out.at(tq.index * hd), hd) };
                if tq.visible == 0 {
                    o.fill(0.0);
                } else {
                    self.order.reduce_lanes(lanes_acc, o);
                }
            }
        });
    }

    /// The tile's query vectors, the heads reading KV head `g` at the
    /// block's positions, into the first entries of `queries`; returns how many.
    fn gather(&self, g: usize, block: usize, queries: &mut Vec<TileQuery>) -> usize {
        let cfg = self.cfg;
        let mut n = 0;
        let first = block * self.tile_queries;
        for i in first..(first + self.tile_queries).min(self.n_q) {
            for h in 0..cfg.n_head {
                let index = i * cfg.n_head + h;
                if (h / self.group).min(cfg.n_kv_head - 1) != g || index >= self.n_tasks {
                    continue;
                }
                if queries.len() == n {
                    queries.push(TileQuery::default());
                }
                let tq = &mut queries[n];
                tq.index = index;
                tq.pos = self.q_pos[i];
                tq.slots.clear();
                tq.scores.clear();
                tq.max = f32::NEG_INFINITY;
                tq.visible = 0;
                tq.sum = SoftmaxSum::default();
                n += 1;
            }
        }
        n
    }

    /// Every score in memory: the scores of all key tiles, each query's
    /// softmax over them, then the weighted values a key tile at a time.
    fn stored_passes(&self, g: usize, n: usize, s: &mut TileScratch) {
        let end = self.written.last().map_or(0, |&j| j + 1);
        let last_pos = s.queries[..n].iter().map(|t| t.pos).max().unwrap_or(0);
        let mut keys_behind = Behind::new(self.pager, KvPart::Keys);
        for tile in self.written.chunks(TILE_KEYS) {
            keys_behind.reach(tile[0]);
            if tile.iter().all(|&j| self.key_pos[j] > last_pos) {
                continue;
            }
            self.score_tile(g, tile, n, s);
        }
        keys_behind.finish(end);
        for tq in s.queries[..n].iter_mut() {
            if tq.visible > 0 {
                tq.inv = softmax_weights(&tq.slots, &mut tq.scores, tq.max, self.sink(tq.index));
            }
        }
        s.cursor.clear();
        s.cursor.resize(n, 0);
        let mut values_behind = Behind::new(self.pager, KvPart::Values);
        for tile in self.written.chunks(TILE_KEYS) {
            values_behind.reach(tile[0]);
            self.weigh_tile(g, tile, n, s);
        }
        values_behind.finish(end);
    }

    /// Scores for one key tile at a time, never the whole context's, in
    /// memory that does not grow with the context and with each key and
    /// value row read for a tile of many query positions, not a few:
    ///
    /// 1. A guess of each query's maximum from the key tiles most likely to
    ///    hold it: the first (where attention sinks are) and the last it
    ///    sees (its neighbourhood).
    /// 2. A pass over the keys for each query's true maximum and its sum
    ///    with the guess as the shift: right wherever the guess was.
    /// 3. For the queries whose maximum lay elsewhere, a second pass for
    ///    the sum with the true maximum.
    /// 4. A pass that weighs the values.
    ///
    /// Every score is computed again as it was, so the numbers are
    /// [`Tiles::stored_passes`]' (the same scores, exponentials and sums,
    /// in the same order).
    fn streamed_passes(&self, g: usize, n: usize, s: &mut TileScratch) {
        let end = self.written.last().map_or(0, |&j| j + 1);
        let last_pos = s.queries[..n].iter().map(|t| t.pos).max().unwrap_or(0);
        let hd = self.cfg.head_dim;
        // The key tiles some query of the block sees, by their first index in `written`.
        let tile = |a: usize| &self.written[a..(a + TILE_KEYS).min(self.written.len())];
        let mut seen = std::mem::take(&mut s.seen);
        seen.clear();
        seen.extend(
            (0..self.written.len())
                .step_by(TILE_KEYS)
                .filter(|&a| tile(a).iter().any(|&j| self.key_pos[j] <= last_pos)),
        );
        let restart = |s: &mut TileScratch, n: usize| {
            for tq in s.queries[..n].iter_mut() {
                tq.slots.clear();
                tq.scores.clear();
            }
        };
        // 1. The guess, from the first and last two tiles seen (each once, in order).
        if let Some(last) = seen.len().checked_sub(1) {
            let likely = [0, last.saturating_sub(1), last];
            for (k, &i) in likely.iter().enumerate() {
                if k == 0 || likely[k - 1] != i {
                    restart(s, n);
                    self.score_tile(g, tile(seen[i]), n, s);
                }
            }
        }
        let shift = |tq: &TileQuery| self.sink(tq.index).map_or(tq.max, |sink| tq.max.max(sink));
        for tq in s.queries[..n].iter_mut() {
            tq.guess = tq.max;
            tq.shift = shift(tq);
        }
        // A pass over the keys for the first `m` queries, adding to the sums of
        // those whose maximum is still their guess (all of them, `guessed` false).
        let sum_pass = |s: &mut TileScratch, m: usize, guessed: bool| {
            let mut keys_behind = Behind::new(self.pager, KvPart::Keys);
            for &a in &seen {
                let tile = tile(a);
                keys_behind.reach(tile[0]);
                restart(s, m);
                self.score_tile(g, tile, m, s);
                for tq in s.queries[..m].iter_mut() {
                    if !guessed || tq.max == tq.guess {
                        exp_shifted(&mut tq.scores, tq.shift);
                        tq.sum.add(&tq.slots, &tq.scores);
                    }
                }
            }
            keys_behind.finish(end);
        };
        // 2. Maxima, and sums where the guess holds.
        sum_pass(s, n, true);
        // 3. The other sums: those queries first, and a pass over them alone.
        s.queries[..n].sort_by_key(|tq| tq.max == tq.guess);
        let missed = s.queries[..n]
            .iter()
            .take_while(|tq| tq.max != tq.guess)
            .count();
        s.query_offs.clear();
        s.query_offs
            .extend(s.queries[..missed].iter().map(|tq| tq.index * hd));
        if missed > 0 {
            for tq in s.queries[..missed].iter_mut() {
                tq.shift = shift(tq);
                tq.sum = SoftmaxSum::default();
            }
            sum_pass(s, missed, false);
        }
        s.query_offs.clear();
        s.query_offs
            .extend(s.queries[..n].iter().map(|tq| tq.index * hd));
        for tq in s.queries[..n].iter_mut() {
            tq.inv = tq.sum.inverse(self.sink(tq.index), tq.shift);
        }
        // 4. The weighted values.
        let mut keys_behind = Behind::new(self.pager, KvPart::Keys);
        let mut values_behind = Behind::new(self.pager, KvPart::Values);
        for &a in &seen {
            let tile = tile(a);
            keys_behind.reach(tile[0]);
            values_behind.reach(tile[0]);
            restart(s, n);
            self.score_tile(g, tile, n, s);
            for tq in s.queries[..n].iter_mut() {
                exp_shifted(&mut tq.scores, tq.shift);
            }
            s.cursor.clear();
            s.cursor.resize(n, 0);
            self.weigh_tile(g, tile, n, s);
        }
        keys_behind.finish(end);
        values_behind.finish(end);
        s.seen = seen;
    }

    /// The attention sink of query vector `index`'s head, if the model has them.
    fn sink(&self, index: usize) -> Option<f32> {
        self.sinks
            .and_then(|s| s.get(index % self.cfg.n_head))
            .copied()
    }

    /// Appends each query's visible slots of key tile `tile` and their
    /// scores (`scale · q·k`, soft-capped) to its lists, and raises its maximum.
    fn score_tile(&self, g: usize, tile: &[usize], n: usize, s: &mut TileScratch) {
        let cfg = self.cfg;
        let hd = cfg.head_dim;
        let lanes = self.order.lanes();
        let off = |j: usize| j * self.kv_stride + g * hd;
        let TileScratch {
            queries,
            dots,
            key_offs,
            query_offs,
            keys_f32,
            row,
            ..
        } = s;
        let queries = &mut queries[..n];
        let visible = |qp: usize, kp: usize| kp <= qp && cfg.window.is_none_or(|w| qp - kp < w);
        // An f16 cache in tinyBLAS's order on an AVX2 host: a tile's scores
        // for every query vector at once, by the fused kernel.
        let fused_keys = match self.k {
            KvSlice::F16(ks) if self.fused && hd.is_multiple_of(lanes) => Some(*ks),
            _ => None,
        };
        // Only the x86_64 kernels read the offsets.
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (&key_offs, &query_offs, &keys_f32);
        #[cfg(target_arch = "x86_64")]
        if let Some(ks) = fused_keys {
            key_offs.clear();
            key_offs.extend(tile.iter().map(|&j| off(j)));
            dots.resize(queries.len() * tile.len(), 0.0);
            // SAFETY: `fused` saw AVX2, FMA and F16C and a head dim that is a
            // multiple of 8; every key row (a written slot) and query vector
            // (a task below `n_tasks`) lies inside its slice, and `dots`
            // holds a score for each pair.
            unsafe {
                match self.order {
                    SumOrder::Batch if fused_f16::wide() && hd <= fused_f16::WIDE_MAX_HEAD_DIM => {
                        fused_f16::key_quads_f32(ks, key_offs, hd, keys_f32);
                        fused_f16::tile_dots_lanes8_f32(
                            keys_f32, ks, key_offs, self.q, query_offs, hd, dots,
                        )
                    }
                    SumOrder::Batch => {
                        fused_f16::tile_dots_lanes8(ks, key_offs, self.q, query_offs, hd, dots)
                    }
                    SumOrder::Single => {
                        fused_f16::tile_dots_lanes32(ks, key_offs, self.q, query_offs, hd, dots)
                    }
                }
            };
        }
        // The tile's lowest and highest key positions: a query that
        // sees the whole tile takes its scores at once.
        let (lo, hi) = tile.iter().fold((usize::MAX, 0), |(lo, hi), &j| {
            (lo.min(self.key_pos[j]), hi.max(self.key_pos[j]))
        });
        for (a, tq) in queries.iter_mut().enumerate() {
            let qv = &self.q[tq.index * hd..(tq.index + 1) * hd];
            let sees_all = hi <= tq.pos && cfg.window.is_none_or(|w| tq.pos - lo < w);
            if sees_all && fused_keys.is_some() && cfg.softcap.is_none() {
                // The same scores, maximum and order as slot by slot below.
                let start = tq.scores.len();
                tq.slots.extend_from_slice(tile);
                let row_dots = &dots[a * tile.len()..(a + 1) * tile.len()];
                tq.scores.extend(row_dots.iter().map(|&qk| qk * cfg.scale));
                tq.max = tq.scores[start..].iter().fold(tq.max, |m, &x| m.max(x));
                tq.visible += tile.len();
                continue;
            }
            for (b, &j) in tile.iter().enumerate() {
                if !visible(tq.pos, self.key_pos[j]) {
                    continue;
                }
                let o = off(j);
                let qk = match (fused_keys, self.k) {
                    (Some(_), _) => dots[a * tile.len() + b],
                    (None, KvSlice::F16(ks)) => self.order.dot_f16(&ks[o..o + hd], qv, row),
                    (None, _) => self.k.dot_row(o, qv, row),
                };
                let mut x = qk * cfg.scale;
                if let Some(cap) = cfg.softcap {
                    x = cap * (x / cap).tanh();
                }
                tq.max = tq.max.max(x);
                tq.slots.push(j);
                tq.scores.push(x);
                tq.visible += 1;
            }
        }
    }

    /// Adds key tile `tile`'s weighted values to each query's value lanes:
    /// its slots in the tile, from its cursor on, with their weights
    /// (`scores · inv`).
    fn weigh_tile(&self, g: usize, tile: &[usize], n: usize, s: &mut TileScratch) {
        let hd = self.cfg.head_dim;
        let lanes = self.order.lanes();
        let off = |j: usize| j * self.kv_stride + g * hd;
        let TileScratch {
            queries,
            acc,
            values_f32,
            spans,
            cursor,
            row,
            ..
        } = s;
        let queries = &queries[..n];
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (&values_f32, &spans);
        let end = tile[tile.len() - 1];
        // Consecutive slots on an AVX-512 host: the tile's value rows converted once
        // for every query vector.
        #[cfg(target_arch = "x86_64")]
        let wide_values = match self.v {
            KvSlice::F16(vs)
                if self.fused
                    && fused_f16::wide()
                    && hd <= fused_f16::WIDE_MAX_HEAD_DIM
                    && hd.is_multiple_of(16)
                    && end - tile[0] + 1 == tile.len() =>
            {
                // SAFETY: `wide` saw AVX-512 F (and `fused` F16C); the slots
                // `tile[0] ..= end` are written, so their rows lie inside the cache.
                unsafe {
                    fused_f16::value_rows_f32(
                        vs,
                        self.kv_stride,
                        g * hd,
                        tile[0],
                        tile.len(),
                        hd,
                        values_f32,
                    )
                };
                true
            }
            _ => false,
        };
        #[cfg(target_arch = "x86_64")]
        if wide_values {
            // Each query's slots in this tile, then pairs of queries over the same
            // slots (every query that sees the whole tile) through one pass.
            spans.clear();
            for (tq, at) in queries.iter().zip(cursor.iter_mut()) {
                let start = *at;
                while *at < tq.slots.len() && tq.slots[*at] <= end {
                    *at += 1;
                }
                spans.push((start, *at));
            }
            let mut rest: &mut [f32] = &mut acc[..];
            let mut i = 0;
            while i < queries.len() {
                let (s0, e0) = spans[i];
                let pair = i + 1 < queries.len() && {
                    let (s1, e1) = spans[i + 1];
                    queries[i].slots[s0..e0] == queries[i + 1].slots[s1..e1]
                };
                let take = if pair { 2 } else { 1 };
                let (mine, next) = std::mem::take(&mut rest).split_at_mut(take * lanes * hd);
                rest = next;
                let slots = &queries[i].slots[s0..e0];
                // SAFETY: as for `value_rows_f32` above; each query's sums hold
                // `lanes × hd` values, its scores cover its slots, and every slot
                // lies in the tile.
                unsafe {
                    if pair {
                        let (a0, a1) = mine.split_at_mut(lanes * hd);
                        let (s1, e1) = spans[i + 1];
                        fused_f16::weigh_values_f32::<2>(
                            values_f32,
                            tile[0],
                            hd,
                            lanes,
                            slots,
                            [&queries[i].scores[s0..e0], &queries[i + 1].scores[s1..e1]],
                            [queries[i].inv, queries[i + 1].inv],
                            [a0, a1],
                        )
                    } else {
                        fused_f16::weigh_values_f32::<1>(
                            values_f32,
                            tile[0],
                            hd,
                            lanes,
                            slots,
                            [&queries[i].scores[s0..e0]],
                            [queries[i].inv],
                            [mine],
                        )
                    }
                };
                i += take;
            }
            return;
        }
        for ((tq, at), lanes_acc) in queries
            .iter()
            .zip(cursor.iter_mut())
            .zip(acc.chunks_exact_mut(lanes * hd))
        {
            let start = *at;
            while *at < tq.slots.len() && tq.slots[*at] <= end {
                *at += 1;
            }
            #[cfg(target_arch = "x86_64")]
            if let (true, KvSlice::F16(vs)) = (self.fused, self.v) {
                // SAFETY: `fused` saw AVX2, FMA and F16C and a head dim that
                // is a multiple of 8; `lanes_acc` holds `lanes × hd` sums and
                // every slot's value row lies inside the cache.
                unsafe {
                    fused_f16::weigh_values_f16(
                        vs,
                        self.kv_stride,
                        g * hd,
                        hd,
                        lanes,
                        &tq.slots[start..*at],
                        &tq.scores[start..*at],
                        tq.inv,
                        lanes_acc,
                    )
                };
                continue;
            }
            weigh_values(
                self.v,
                lanes,
                &tq.slots[start..*at],
                &tq.scores[start..*at],
                tq.inv,
                off,
                lanes_acc,
                row,
            );
        }
    }
}

/// `s = ggml_expf(s − max)` for every score (eight at a time on AVX2 hosts, same values).
fn exp_shifted(scores: &mut [f32], max: f32) {
    // Only x86_64 has a SIMD version that advances `done`.
    #[cfg_attr(not(target_arch = "x86_64"), allow(unused_mut))]
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if super::softmax::avx2_available() {
        // SAFETY: the host has AVX2, FMA and F16C.
        done = unsafe { exp_shifted_avx2(scores, max) };
    }
    for s in &mut scores[done..] {
        *s = ggml_expf(*s - max);
    }
}

/// The whole vectors of [`exp_shifted`]; returns how many scores it did.
///
/// # Safety
/// The host must have AVX2, FMA and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn exp_shifted_avx2(scores: &mut [f32], max: f32) -> usize {
    // SAFETY: the caller upholds this function's safety contract (its
    // `# Safety` section), which every unsafe operation below relies on.
    unsafe {
        use std::arch::x86_64::*;
        let n8 = scores.len() / 8 * 8;
        let p = scores.as_mut_ptr();
        let m = _mm256_set1_ps(max);
        // Each step reads and writes lanes i..i+8 ≤ n8.
        for i in (0..n8).step_by(8) {
            let x = _mm256_sub_ps(_mm256_loadu_ps(p.add(i)), m);
            _mm256_storeu_ps(p.add(i), super::softmax::expf_avx2::expf8(x));
        }
        n8
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Values that stress the roundings: a wide spread of magnitudes and signs.
    fn values(n: usize, seed: u32) -> Vec<f32> {
        let mut x = seed.wrapping_mul(2_654_435_761).max(1);
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                let m = (x % 20_000) as f32 / 1000.0 - 10.0;
                m * (1.0 + (x >> 28) as f32)
            })
            .collect()
    }

    /// The tiled path gives the per-query path's outputs bit for bit:
    /// f16 and f32 caches, grouped heads, a head count that is not a
    /// multiple of the KV heads', causal and windowed, soft-capped, with
    /// sinks, written slots out of position order (a ring) and empty ones,
    /// more slots than one key tile and more queries than one query tile.
    /// Records every run of rows it hears of.
    #[derive(Default)]
    struct Recorder(std::sync::Mutex<Vec<(KvPart, std::ops::Range<usize>)>>);

    impl KvPager for Recorder {
        fn passed(&self, part: KvPart, slots: std::ops::Range<usize>) {
            self.0.lock().unwrap().push((part, slots));
        }
    }

    /// Every route of a paged cache: scores kept for whole tiles, by
    /// default, streamed a key tile at a time (one query position per
    /// tile), and one query at a time.
    const PAGED_ROUTES: [Route; 4] = [
        Route {
            tiled: true,
            score_bytes: 1 << 24,
        },
        Route::DEFAULT,
        Route {
            tiled: true,
            score_bytes: 4096,
        },
        Route {
            tiled: false,
            score_bytes: PAGED_SCORE_BYTES,
        },
    ];

    #[test]
    fn paged_attention_gives_the_same_numbers_and_passes_every_row() {
        // 2,100 written slots: more than a paged tile keeps scores for at
        // 8 positions (fewer positions per tile), and several runs per pass.
        let n_slots = 2100;
        for (hd, (n_head, n_kv)) in [(64, (12, 2)), (64, (4, 1)), (128, (5, 5))] {
            let cfg = AttnConfig {
                n_head,
                n_kv_head: n_kv,
                head_dim: hd,
                scale: 0.125,
                window: None,
                softcap: None,
            };
            // A ring's rotated order with holes, as a long prompt's cache may hold.
            let key_pos: Vec<usize> = (0..n_slots)
                .map(|j| {
                    if j % 97 == 5 {
                        usize::MAX
                    } else {
                        (j * 7 + 11) % n_slots
                    }
                })
                .collect();
            let kf = values(n_slots * n_kv * hd, 2);
            let vf = values(n_slots * n_kv * hd, 3);
            let kh: Vec<f16> = kf.iter().map(|&x| f16::from_f32(x)).collect();
            let vh: Vec<f16> = vf.iter().map(|&x| f16::from_f32(x)).collect();
            let kq = flatrun_dequant::quantize_to_vec(flatrun_format::GgmlType::Q8_0, &kf)
                .expect("whole blocks");
            for n_q in [1, 13, 40] {
                let q_pos: Vec<usize> = (0..n_q).map(|i| n_slots - n_q + i).collect();
                let q = values(n_q * n_head * hd, 1);
                for (k, v) in [
                    (KvSlice::F16(&kh), KvSlice::F16(&vh)),
                    (KvSlice::F32(&kf), KvSlice::F32(&vf)),
                    (KvSlice::Q8_0(&kq), KvSlice::F16(&vh)),
                ] {
                    for route in PAGED_ROUTES {
                        let mut plain = vec![1.0; n_q * n_head * hd];
                        let mut paged = vec![2.0; n_q * n_head * hd];
                        let pager = Recorder::default();
                        attend(
                            &q, &q_pos, k, v, &key_pos, &cfg, None, None, &mut plain, route,
                        );
                        attend(
                            &q,
                            &q_pos,
                            k,
                            v,
                            &key_pos,
                            &cfg,
                            None,
                            Some(&pager),
                            &mut paged,
                            route,
                        );
                        let what = format!(
                            "{n_head}/{n_kv} heads, {n_q} queries, tiled {}, {} score bytes, {k:?}",
                            route.tiled, route.score_bytes
                        );
                        assert!(
                            plain
                                .iter()
                                .zip(&paged)
                                .all(|(a, b)| a.to_bits() == b.to_bits()),
                            "{what}"
                        );
                        // Every written row was handed over, keys and values,
                        // in runs no longer than a pass needs.
                        let runs = pager.0.into_inner().unwrap();
                        for part in [KvPart::Keys, KvPart::Values] {
                            let mut seen = vec![false; n_slots];
                            for (_, r) in runs.iter().filter(|(p, _)| *p == part) {
                                seen[r.clone()].iter_mut().for_each(|s| *s = true);
                            }
                            let missed = (0..n_slots)
                                .filter(|&j| key_pos[j] != usize::MAX && !seen[j])
                                .count();
                            assert_eq!(missed, 0, "{what}, {part:?}");
                        }
                        assert!(
                            runs.len() >= 4 * n_kv.min(n_head),
                            "{what}: {} runs",
                            runs.len()
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn tiled_attention_equals_the_per_query_path() {
        for (hd, ring, (n_head, n_kv)) in [
            (64, true, (14, 2)),
            (64, true, (4, 4)),
            (64, true, (5, 2)),
            (64, false, (14, 2)),
            (128, false, (12, 2)),
            (128, true, (5, 2)),
            (256, true, (4, 1)),
            (40, true, (5, 2)),
        ] {
            for (window, softcap, with_sinks) in [
                (None, None, false),
                (Some(37), None, false),
                (None, Some(30.0), true),
            ] {
                let cfg = AttnConfig {
                    n_head,
                    n_kv_head: n_kv,
                    head_dim: hd,
                    scale: 0.125,
                    window,
                    softcap,
                };
                let n_slots = 150;
                for n_q in [19, 1] {
                    // Slots hold positions in a rotated order, some never written.
                    // (Or in order, all written: a prompt's prefill.)
                    let key_pos: Vec<usize> = (0..n_slots)
                        .map(|j| match ring {
                            false => j,
                            true if j % 23 == 5 => usize::MAX,
                            true => (j * 7 + 11) % n_slots,
                        })
                        .collect();
                    let q_pos: Vec<usize> = (0..n_q).map(|i| n_slots - n_q + i).collect();
                    let q = values(n_q * n_head * hd, 1);
                    let kf = values(n_slots * n_kv * hd, 2);
                    let vf = values(n_slots * n_kv * hd, 3);
                    let kh: Vec<f16> = kf.iter().map(|&x| f16::from_f32(x)).collect();
                    let vh: Vec<f16> = vf.iter().map(|&x| f16::from_f32(x)).collect();
                    let sinks: Vec<f32> = (0..n_head).map(|h| h as f32 * 0.3 - 1.0).collect();
                    let sinks = with_sinks.then_some(&sinks[..]);
                    for (k, v) in [
                        (KvSlice::F16(&kh), KvSlice::F16(&vh)),
                        (KvSlice::F32(&kf), KvSlice::F32(&vf)),
                    ] {
                        // Each run's output starts from its own value, so that a
                        // place no run writes still differs.
                        let run = |route: Route, pager: Option<&dyn KvPager>, fill: f32| {
                            let mut out = vec![fill; n_q * n_head * hd];
                            attend(
                                &q, &q_pos, k, v, &key_pos, &cfg, sinks, pager, &mut out, route,
                            );
                            out
                        };
                        let tiled = run(Route::DEFAULT, None, 1.0);
                        let unpaged = Route {
                            tiled: false,
                            ..Route::DEFAULT
                        };
                        let per_query = run(unpaged, None, 2.0);
                        // A paged cache's tiles with scores streamed a key
                        // tile at a time: one query position, then several.
                        let streamed = [4096, 16384].map(|score_bytes| {
                            let route = Route {
                                tiled: true,
                                score_bytes,
                            };
                            run(route, Some(&Recorder::default()), 3.0)
                        });
                        for (path, out) in [
                            ("tiled", &tiled),
                            ("streamed", &streamed[0]),
                            ("streamed", &streamed[1]),
                        ] {
                            let differ = out
                                .iter()
                                .zip(&per_query)
                                .filter(|(a, b)| a.to_bits() != b.to_bits())
                                .count();
                            assert_eq!(
                                differ, 0,
                                "{path}: head dim {hd}, {n_head}/{n_kv} heads, {n_q} queries, ring {ring}, window {window:?}, softcap {softcap:?}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// The fused f16 value kernel adds what [`weigh_values`] adds, in its
    /// order: 8 and 32 lanes, runs of whole groups of eight and scattered slots.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn fused_weighted_values_equal_the_slot_by_slot_sums() {
        if !fused_f16_available(64) {
            return;
        }
        let (hd, n_kv, n_slots) = (64, 2, 300);
        let stride = n_kv * hd;
        let vf = values(n_slots * stride, 7);
        let vh: Vec<f16> = vf.iter().map(|&x| f16::from_f32(x)).collect();
        let v = KvSlice::F16(&vh);
        let consecutive: Vec<usize> = (0..200).collect();
        let scattered: Vec<usize> = (3..n_slots).filter(|j| j % 5 != 1).collect();
        let shifted: Vec<usize> = (5..205).collect();
        for slots in [&consecutive, &scattered, &shifted] {
            let scores: Vec<f32> = values(slots.len(), 9).iter().map(|x| x.abs()).collect();
            for lanes in [8usize, 32] {
                for base in [0, hd] {
                    let mut want = vec![0.25f32; lanes * hd];
                    let mut got = want.clone();
                    let mut row = vec![0f32; hd];
                    let off = |j: usize| j * stride + base;
                    weigh_values(&v, lanes, slots, &scores, 0.37, off, &mut want, &mut row);
                    // SAFETY: checked AVX2 above; 64 is a multiple of 8; `got` holds
                    // lanes × hd sums; every slot's row is inside `vh`.
                    unsafe {
                        fused_f16::weigh_values_f16(
                            &vh, stride, base, hd, lanes, slots, &scores, 0.37, &mut got,
                        )
                    };
                    let differ = want
                        .iter()
                        .zip(&got)
                        .filter(|(a, b)| a.to_bits() != b.to_bits())
                        .count();
                    assert_eq!(
                        differ,
                        0,
                        "{lanes} lanes, base {base}, {} slots",
                        slots.len()
                    );
                }
            }
        }
    }

    #[test]
    fn vector_dots_equal_the_ordered_scalar_dots() {
        for (hd, seed) in [
            (32usize, 1u32),
            (64, 2),
            (128, 3),
            (256, 4),
            (72, 5),
            (40, 6),
        ] {
            let k16: Vec<f16> = values(hd, seed).iter().map(|&v| f16::from_f32(v)).collect();
            let q: Vec<f32> = values(hd, seed + 100)
                .iter()
                .map(|&v| f16::from_f32(v).to_f32())
                .collect();
            let k32: Vec<f32> = k16.iter().map(|v| v.to_f32()).collect();
            let mut buf = vec![0f32; hd];
            for order in [SumOrder::Batch, SumOrder::Single] {
                let want = order.dot(&k32, &q);
                let got = order.dot_f16(&k16, &q, &mut buf);
                assert_eq!(got.to_bits(), want.to_bits(), "head dim {hd}");
            }
        }
    }

    #[test]
    fn vector_exp_equals_scalar_exp() {
        let mut scores: Vec<f32> = (0..4003).map(|i| (i as f32 - 3000.0) * 0.07).collect();
        scores.extend([f32::NEG_INFINITY, -200.0, -88.5, -87.0, 0.0, -0.0, 88.0]);
        let want: Vec<f32> = scores.iter().map(|&s| ggml_expf(s - 1.5)).collect();
        exp_shifted(&mut scores, 1.5);
        for (g, w) in scores.iter().zip(&want) {
            assert_eq!(g.to_bits(), w.to_bits());
        }
    }

    #[test]
    fn quantized_key_dots_equal_the_decoded_dots() {
        use flatrun_format::GgmlType;
        for (ty, seed) in [(GgmlType::Q8_0, 7u32), (GgmlType::Q4_0, 8)] {
            let k = values(128, seed);
            let q = values(128, seed + 50);
            let bytes = flatrun_dequant::quantize_to_vec(ty, &k).unwrap();
            let slice = match ty {
                GgmlType::Q8_0 => KvSlice::Q8_0(&bytes),
                _ => KvSlice::Q4_0(&bytes),
            };
            let mut qb = vec![BlockQ8::default(); 4];
            quantize_q8(&q, &mut qb);
            let q_decoded: Vec<f32> = qb
                .iter()
                .flat_map(|b| b.qs.iter().map(move |&x| b.d * x as f32))
                .collect();
            let mut decoded = vec![0f32; 128];
            decode_blocks(&slice, &bytes, &mut decoded);
            let want: f64 = decoded
                .iter()
                .zip(&q_decoded)
                .map(|(a, b)| (*a as f64) * (*b as f64))
                .sum();
            let scalar = block_dot_body(&slice, &bytes, &qb);
            let fast = block_dot(&slice, &bytes, &qb);
            assert_eq!(scalar.to_bits(), fast.to_bits(), "{ty}");
            assert!(
                (scalar as f64 - want).abs() <= 1e-4 * want.abs().max(1.0),
                "{ty}: {scalar} vs {want}"
            );
            // The decoded values are the quantizer's reconstruction.
            let reference = flatrun_dequant::dequantize_to_vec(ty, &bytes).unwrap();
            assert_eq!(decoded, reference, "{ty}");
        }
    }
}
