//! Prefill attention over an f16 cache on Qwen2.5-0.5B's heads (14 query
//! heads, 2 KV heads of 64) and Qwen2.5-1.5B's (12 query heads, 2 KV heads
//! of 128): the last 512-token chunk of a prompt of 512, 2048 and 8192
//! tokens (its queries see up to that many keys), and one decode step after
//! as many, with the pool's threads; a resident cache, and a paged one (a
//! streamed cache's path, told which rows each pass has gone past). The
//! queries share a direction the first key points along (an attention sink).
//! Prints queries per second.
//!
//! `cargo bench -p flatrun-kernels --bench attention -- --warm-up-time 1 --measurement-time 5`
//! Compare two trees with criterion's baselines (`--save-baseline A`, then `--baseline A`).

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use flatrun_kernels::ops::{AttnConfig, KvPager, KvPart, KvSlice, attention, attention_paged};
use half::f16;

const CHUNK: usize = 512;

/// A pager that drops nothing (the paths' arithmetic alone).
struct Keep;

impl KvPager for Keep {
    fn passed(&self, _: KvPart, _: std::ops::Range<usize>) {}
}

fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        })
        .collect()
}

fn bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("attention_f16");
    for (model, n_head, n_kv, hd) in [("0.5b", 14, 2, 64), ("1.5b", 12, 2, 128)] {
        let cfg = AttnConfig {
            n_head,
            n_kv_head: n_kv,
            head_dim: hd,
            scale: 1.0 / (hd as f32).sqrt(),
            window: None,
            softcap: None,
        };
        for ctx in [512usize, 2048, 8192] {
            // Queries share a direction that the first key points along, as
            // a trained model's attention sink: most queries' largest score
            // is the first key's.
            let shared: Vec<f32> = values(hd, 9).iter().map(|x| 2.0 * x).collect();
            let mut keys = values(ctx * n_kv * hd, 1);
            for (k, s) in keys.iter_mut().zip(shared.iter().cycle()).take(n_kv * hd) {
                *k = 1.5 * s;
            }
            let keys: Vec<f16> = keys.iter().map(|&x| f16::from_f32(x)).collect();
            let vals: Vec<f16> = values(ctx * n_kv * hd, 2)
                .iter()
                .map(|&x| f16::from_f32(x))
                .collect();
            // A decode step and the last chunk of a prefill.
            for n_q in [1, CHUNK] {
                for paged in [false, true] {
                    let case = Case {
                        model,
                        cfg: &cfg,
                        shared: &shared,
                        ctx,
                        n_q,
                        paged,
                    };
                    bench_one(&mut group, &case, &keys, &vals);
                }
            }
        }
    }
    group.finish();
}

struct Case<'a> {
    model: &'a str,
    cfg: &'a AttnConfig,
    /// The queries' shared direction.
    shared: &'a [f32],
    ctx: usize,
    n_q: usize,
    paged: bool,
}

fn bench_one(
    group: &mut criterion::BenchmarkGroup<criterion::measurement::WallTime>,
    case: &Case,
    keys: &[f16],
    vals: &[f16],
) {
    let Case {
        model,
        cfg,
        shared,
        ctx,
        n_q,
        paged,
    } = *case;
    let key_pos: Vec<usize> = (0..ctx).collect();
    let q_pos: Vec<usize> = (ctx - n_q..ctx).collect();
    let mut q = values(n_q * cfg.n_head * cfg.head_dim, 3);
    for (x, s) in q.iter_mut().zip(shared.iter().cycle()) {
        *x += s;
    }
    let mut out = vec![0.0; n_q * cfg.n_head * cfg.head_dim];
    group.throughput(Throughput::Elements(n_q as u64));
    let name = if n_q == 1 { "decode" } else { "chunk512" };
    let cache = if paged { "paged" } else { "resident" };
    group.bench_function(format!("{model}/{name}/{cache}/ctx{ctx}"), |b| {
        b.iter(|| {
            let (k, v) = (KvSlice::F16(keys), KvSlice::F16(vals));
            if paged {
                attention_paged(
                    black_box(&q),
                    &q_pos,
                    k,
                    v,
                    &key_pos,
                    cfg,
                    None,
                    &Keep,
                    &mut out,
                );
            } else {
                attention(black_box(&q), &q_pos, k, v, &key_pos, cfg, &mut out);
            }
            black_box(&out);
        })
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
