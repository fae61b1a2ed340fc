//! GEMV GB/s and GEMM GFLOP/s of the native kernels per format on real model
//! shapes (also a speculative verification pass of 9 tokens in the one-token
//! order, `verify9`), plus the machine's memory read bandwidth measured in
//! the same run.
//!
//! `cargo bench -p flatrun-kernels --bench matmul -- --warm-up-time 1 --measurement-time 3`
//! Filter with a format name (`-- Q4_K`). `FLATRUN_THREADS` sets the pool size.
//! `benches/bandwidth.rs` is the issue-4 measurement: GEMV on matrices larger than the LLC
//! against the read bandwidth, repeated and interleaved, with median and range.

use std::hint::black_box;
use std::time::Instant;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use flatrun_format::GgmlType;
use flatrun_kernels::{BackendKind, Weight, WeightFormat, backend};
use half::f16;

/// (rows, cols) of real projections (rows = output features): SmolLM2 FFN down (576×1536),
/// Gemma 3 270M FFN down (640×2048), Qwen2.5-0.5B FFN down (896×4864), a 1.5B FFN down
/// (1536×8960), and Qwen2.5's output head (151936×896, 122 MiB as Q8_0: far beyond the LLC).
const SHAPES: &[(usize, usize)] = &[
    (576, 1536),
    (640, 2048),
    (896, 4864),
    (1536, 8960),
    (151936, 896),
];
const FORMATS: &[GgmlType] = &[
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q8_0,
    GgmlType::Q4_K,
    GgmlType::Q6_K,
    GgmlType::Q4_0,
    GgmlType::IQ4_NL,
    GgmlType::F16,
];
const PREFILL_TOKENS: usize = 64;
/// Positions of a verification pass (the pending token and 8 proposals).
const VERIFY_TOKENS: usize = 9;

fn random_weights(t: GgmlType, rows: usize, cols: usize) -> Vec<u8> {
    let n = rows * cols / t.block_size() * t.type_size();
    let mut s = 0x2545F4914F6CDD1Du64;
    let mut bytes: Vec<u8> = (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 32) as u8
        })
        .collect();
    // Finite f16 scales wherever they sit (just make every f16-aligned pair sane for F16).
    let scale = f16::from_f32(0.01).to_le_bytes();
    match t {
        GgmlType::F16 => bytes
            .chunks_exact_mut(2)
            .for_each(|c| c.copy_from_slice(&scale)),
        _ => {
            let offs: &[usize] = match t {
                GgmlType::Q4_1 | GgmlType::Q4_K | GgmlType::Q5_K => &[0, 2],
                GgmlType::Q6_K => &[208],
                _ => &[0],
            };
            for blk in bytes.chunks_exact_mut(t.type_size()) {
                for &o in offs {
                    blk[o..o + 2].copy_from_slice(&scale);
                }
            }
        }
    }
    bytes
}

/// Single pass read bandwidth over a buffer much larger than the LLC, all pool threads.
fn memory_read_bandwidth() -> f64 {
    use rayon::prelude::*;
    // 512 MiB: far beyond the last-level cache.
    let words = 64 << 20;
    let buf: Vec<u64> = (0..words as u64).collect();
    let mut best = 0f64;
    for _ in 0..5 {
        let t = Instant::now();
        let s: u64 = buf
            .par_chunks(1 << 16)
            .map(|c| c.iter().fold(0u64, |a, &b| a ^ b))
            .reduce(|| 0, |a, b| a ^ b);
        black_box(s);
        let gbs = (words * 8) as f64 / t.elapsed().as_secs_f64() / 1e9;
        best = best.max(gbs);
    }
    best
}

fn bench(c: &mut Criterion) {
    if let Some(n) = std::env::var("FLATRUN_THREADS")
        .ok()
        .and_then(|s| s.parse().ok())
    {
        flatrun_kernels::set_threads(n);
    }
    let bw = memory_read_bandwidth();
    eprintln!(
        "memory read bandwidth: {bw:.1} GB/s ({} threads, simd {})",
        flatrun_kernels::threads(),
        flatrun_kernels::simd_level()
    );
    let k = backend(BackendKind::Native);
    for &t in FORMATS {
        for &(rows, cols) in SHAPES {
            if cols % t.block_size() != 0 {
                continue;
            }
            let bytes = random_weights(t, rows, cols);
            let w = Weight::new(WeightFormat::Ggml(t), rows, cols, &bytes, None, None).unwrap();
            let name = t.traits().name;
            // GEMV: one token, throughput = weight bytes read.
            let x: Vec<f32> = (0..cols)
                .map(|i| ((i * 7 % 13) as f32 - 6.0) * 0.1)
                .collect();
            let mut out = vec![0f32; rows];
            let mut g = c.benchmark_group(format!("gemv/{name}"));
            g.throughput(Throughput::Bytes(bytes.len() as u64));
            g.bench_function(format!("{rows}x{cols}"), |b| {
                b.iter(|| k.matmul(&w, black_box(&x), 1, &mut out).unwrap())
            });
            g.finish();
            // GEMM: PREFILL_TOKENS tokens, throughput in elements = multiply-adds (×2 = FLOP).
            if rows * cols <= 20_000_000 {
                let xs: Vec<f32> = (0..cols * PREFILL_TOKENS)
                    .map(|i| ((i * 7 % 13) as f32 - 6.0) * 0.1)
                    .collect();
                let mut outs = vec![0f32; rows * PREFILL_TOKENS];
                let mut g = c.benchmark_group(format!("gemm{PREFILL_TOKENS}/{name}"));
                g.throughput(Throughput::Elements(
                    2 * (rows * cols * PREFILL_TOKENS) as u64,
                ));
                g.bench_function(format!("{rows}x{cols}"), |b| {
                    b.iter(|| {
                        k.matmul(&w, black_box(&xs), PREFILL_TOKENS, &mut outs)
                            .unwrap()
                    })
                });
                g.finish();
                // A speculative verification pass: the pending token and 8
                // proposals, every one in the one-token order.
                let n = VERIFY_TOKENS;
                let mut outs = vec![0f32; rows * n];
                let mut g = c.benchmark_group(format!("verify{n}/{name}"));
                g.throughput(Throughput::Elements(2 * (rows * cols * n) as u64));
                g.bench_function(format!("{rows}x{cols}"), |b| {
                    b.iter(|| {
                        flatrun_kernels::with_one_token_order(|| {
                            k.matmul(&w, black_box(&xs[..cols * n]), n, &mut outs)
                        })
                        .unwrap()
                    })
                });
                g.finish();
            }
        }
    }
}

/// MLX affine layouts with fused kernels: (bits, group size), f16 scales and biases.
const MLX_FORMATS: &[(u8, usize)] = &[(4, 32), (4, 64), (8, 32), (8, 64)];

/// The same GEMV/GEMM measurements for the fused MLX kernels (filter with `-- MLX`);
/// GB/s count the packed values plus the scales and biases.
fn bench_mlx(c: &mut Criterion) {
    let k = backend(BackendKind::Native);
    for &(bits, group) in MLX_FORMATS {
        let format = WeightFormat::MlxAffine {
            bits,
            group_size: group as u32,
            scale_dtype: flatrun_format::DType::Ggml(GgmlType::F16),
        };
        for &(rows, cols) in SHAPES {
            // Random packed values (xorshift), f16 scales of 0.01 and biases of −0.05.
            let mut st = 0x2545F4914F6CDD1Du64;
            let data: Vec<u8> = (0..rows * cols * bits as usize / 8)
                .map(|_| {
                    st ^= st << 13;
                    st ^= st >> 7;
                    st ^= st << 17;
                    (st >> 32) as u8
                })
                .collect();
            let n_groups = rows * cols / group;
            let scales: Vec<u8> = (0..n_groups)
                .flat_map(|_| f16::from_f32(0.01).to_le_bytes())
                .collect();
            let biases: Vec<u8> = (0..n_groups)
                .flat_map(|_| f16::from_f32(-0.05).to_le_bytes())
                .collect();
            let w = Weight::new(format, rows, cols, &data, Some(&scales), Some(&biases)).unwrap();
            let bytes = data.len() + scales.len() + biases.len();
            let name = format!("MLX{bits}g{group}");
            let x: Vec<f32> = (0..cols)
                .map(|i| ((i * 7 % 13) as f32 - 6.0) * 0.1)
                .collect();
            let mut out = vec![0f32; rows];
            let mut g = c.benchmark_group(format!("gemv/{name}"));
            g.throughput(Throughput::Bytes(bytes as u64));
            g.bench_function(format!("{rows}x{cols}"), |b| {
                b.iter(|| k.matmul(&w, black_box(&x), 1, &mut out).unwrap())
            });
            g.finish();
            if rows * cols <= 20_000_000 {
                let xs: Vec<f32> = (0..cols * PREFILL_TOKENS)
                    .map(|i| ((i * 7 % 13) as f32 - 6.0) * 0.1)
                    .collect();
                let mut outs = vec![0f32; rows * PREFILL_TOKENS];
                let mut g = c.benchmark_group(format!("gemm{PREFILL_TOKENS}/{name}"));
                g.throughput(Throughput::Elements(
                    2 * (rows * cols * PREFILL_TOKENS) as u64,
                ));
                g.bench_function(format!("{rows}x{cols}"), |b| {
                    b.iter(|| {
                        k.matmul(&w, black_box(&xs), PREFILL_TOKENS, &mut outs)
                            .unwrap()
                    })
                });
                g.finish();
            }
        }
    }
}

criterion_group!(benches, bench, bench_mlx);
criterion_main!(benches);
