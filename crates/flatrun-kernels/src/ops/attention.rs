//! Causal grouped-query attention over an f32 or f16 KV cache.

use std::cell::RefCell;

use half::f16;
use rayon::prelude::*;

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

    /// `q · self[off..off+q.len()]`.
    #[inline]
    fn dot(&self, off: usize, q: &[f32]) -> f32 {
        match self {
            KvSlice::F32(s) => s[off..off + q.len()]
                .iter()
                .zip(q)
                .map(|(&a, &b)| a * b)
                .sum(),
            KvSlice::F16(s) => s[off..off + q.len()]
                .iter()
                .zip(q)
                .map(|(&a, &b)| a.to_f32() * b)
                .sum(),
        }
    }

    /// `acc += p * self[off..off+acc.len()]`.
    #[inline]
    fn axpy(&self, off: usize, p: f32, acc: &mut [f32]) {
        let n = acc.len();
        match self {
            KvSlice::F32(s) => {
                for (a, &v) in acc.iter_mut().zip(&s[off..off + n]) {
                    *a += p * v;
                }
            }
            KvSlice::F16(s) => {
                for (a, &v) in acc.iter_mut().zip(&s[off..off + n]) {
                    *a += p * v.to_f32();
                }
            }
        }
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
    /// Per-worker attention scores (one per cache slot), reused across calls.
    static SCORES: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

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
    let work = n_q * cfg.n_head;
    let n_out = (work * hd).min(out.len());
    let out = &mut out[..n_out];
    crate::threads::pool().install(|| {
        out.par_chunks_mut(hd).enumerate().for_each(|(task, o)| {
            let (i, h) = (task / cfg.n_head, task % cfg.n_head);
            let qv = &q[task * hd..(task + 1) * hd];
            let kvh = (h / group).min(cfg.n_kv_head - 1);
            let qp = q_pos[i];
            SCORES.with(|cell| {
                let mut scores = cell.borrow_mut();
                scores.clear();
                scores.resize(n_slots, f32::NEG_INFINITY);
                // Scores of the visible keys (masked ones stay -inf).
                let mut max = f32::NEG_INFINITY;
                for (j, s) in scores.iter_mut().enumerate() {
                    let kp = key_pos[j];
                    let visible =
                        kp != usize::MAX && kp <= qp && cfg.window.is_none_or(|w| qp - kp < w);
                    if !visible {
                        continue;
                    }
                    let mut x = k.dot(j * kv_stride + kvh * hd, qv) * cfg.scale;
                    if let Some(cap) = cfg.softcap {
                        x = cap * (x / cap).tanh();
                    }
                    *s = x;
                    max = max.max(x);
                }
                o.fill(0.0);
                if max == f32::NEG_INFINITY {
                    return;
                }
                // Softmax weights, then the weighted sum of values.
                let mut sum = 0f32;
                for s in scores.iter_mut() {
                    *s = (*s - max).exp();
                    sum += *s;
                }
                let inv = 1.0 / sum;
                for (j, &p) in scores.iter().enumerate() {
                    if p != 0.0 {
                        v.axpy(j * kv_stride + kvh * hd, p * inv, o);
                    }
                }
            });
        });
    });
}
