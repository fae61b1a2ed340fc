//! Prefill attention over an f16 cache on Qwen2.5-0.5B's heads (14 query
//! heads, 2 KV heads of 64): the last 512-token chunk of a prompt of 512,
//! 2048 and 8192 tokens (its queries see up to that many keys), and one
//! decode step after as many, with the pool's threads. Prints queries per second.
//!
//! `cargo bench -p flatrun-kernels --bench attention -- --warm-up-time 1 --measurement-time 5`
//! Compare two trees with criterion's baselines (`--save-baseline A`, then `--baseline A`).

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use flatrun_kernels::ops::{AttnConfig, KvSlice, attention};
use half::f16;

const N_HEAD: usize = 14;
const N_KV: usize = 2;
const HEAD_DIM: usize = 64;
const CHUNK: usize = 512;

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
    let cfg = AttnConfig {
        n_head: N_HEAD,
        n_kv_head: N_KV,
        head_dim: HEAD_DIM,
        scale: 1.0 / (HEAD_DIM as f32).sqrt(),
        window: None,
        softcap: None,
    };
    let mut group = c.benchmark_group("attention_f16");
    for ctx in [512usize, 2048, 8192] {
        let keys: Vec<f16> = values(ctx * N_KV * HEAD_DIM, 1)
            .iter()
            .map(|&x| f16::from_f32(x))
            .collect();
        let vals: Vec<f16> = values(ctx * N_KV * HEAD_DIM, 2)
            .iter()
            .map(|&x| f16::from_f32(x))
            .collect();
        // A decode step (one query, the per-query path) and the last chunk of a prefill.
        for n_q in [1, CHUNK] {
            bench_one(&mut group, &cfg, ctx, n_q, &keys, &vals);
        }
    }
    group.finish();
}

fn bench_one(
    group: &mut criterion::BenchmarkGroup<criterion::measurement::WallTime>,
    cfg: &AttnConfig,
    ctx: usize,
    n_q: usize,
    keys: &[f16],
    vals: &[f16],
) {
    let key_pos: Vec<usize> = (0..ctx).collect();
    let q_pos: Vec<usize> = (ctx - n_q..ctx).collect();
    let q = values(n_q * N_HEAD * HEAD_DIM, 3);
    let mut out = vec![0.0; n_q * N_HEAD * HEAD_DIM];
    group.throughput(Throughput::Elements(n_q as u64));
    let name = if n_q == 1 { "decode" } else { "chunk512" };
    group.bench_function(format!("{name}/ctx{ctx}"), |b| {
        b.iter(|| {
            attention(
                black_box(&q),
                &q_pos,
                KvSlice::F16(keys),
                KvSlice::F16(vals),
                &key_pos,
                cfg,
                &mut out,
            );
            black_box(&out);
        })
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
