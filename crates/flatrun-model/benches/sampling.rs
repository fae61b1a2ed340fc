//! Cost of one sampling step on a 151,936-token vocabulary (Qwen2.5's), with
//! logits shaped like a language model's: a broad bulk around 0 and a few
//! dozen clearly preferred tokens.

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use flatrun_model::sampling::{Sampler, SamplingParams, Xoshiro256};

fn bench(c: &mut Criterion) {
    let mut rng = Xoshiro256::seed_from_u64(1);
    let mut logits: Vec<f32> = (0..151_936)
        .map(|_| {
            // Roughly normal (sum of uniforms), standard deviation ~2.
            let s: f64 = (0..4).map(|_| rng.next_f64()).sum::<f64>() - 2.0;
            (s * 3.5) as f32
        })
        .collect();
    for i in 0..48 {
        logits[(i * 3163 + 11) % 151_936] = 12.0 + (i as f32) * 0.15;
    }
    let history: Vec<u32> = (0..256).map(|i| (i * 577) % 151_936).collect();
    let configs = [
        ("greedy", SamplingParams::default()),
        (
            "temperature",
            SamplingParams {
                temperature: 0.8,
                seed: Some(1),
                ..Default::default()
            },
        ),
        (
            "top_k40_top_p0.95",
            SamplingParams {
                temperature: 0.8,
                top_k: 40,
                top_p: 0.95,
                seed: Some(1),
                ..Default::default()
            },
        ),
        (
            "top_p0.9_only",
            SamplingParams {
                temperature: 0.8,
                top_p: 0.9,
                seed: Some(1),
                ..Default::default()
            },
        ),
        (
            "min_p0.05_penalties",
            SamplingParams {
                temperature: 0.8,
                min_p: 0.05,
                repeat_penalty: 1.1,
                frequency_penalty: 0.1,
                presence_penalty: 0.1,
                penalty_window: 64,
                seed: Some(1),
                ..Default::default()
            },
        ),
    ];
    let mut group = c.benchmark_group("sample_151936");
    for (name, params) in configs {
        let mut sampler = Sampler::new(params);
        let mut scratch = logits.clone();
        group.bench_function(BenchmarkId::from_parameter(name), |b| {
            b.iter(|| {
                scratch.copy_from_slice(&logits);
                sampler.sample(&mut scratch, &history)
            })
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
