//! Decode throughput of the scalar reference decoders, in GB/s of quantized
//! weights read (criterion's "thrpt"), per GGML type, plus MLX affine.
//!
//! `cargo bench -p flatrun-dequant --bench decode`

use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput, black_box, criterion_group, criterion_main};
use flatrun_dequant::{GgmlType, MlxAffine, ScaleType, dequantize, validate};

/// Deterministic pseudo-random bytes (splitmix64).
fn random_bytes(n: usize, mut state: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(n + 8);
    while out.len() < n {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        out.extend_from_slice(&(z ^ (z >> 31)).to_le_bytes());
    }
    out.truncate(n);
    out
}

/// Random blocks of `ty`, with every block whose scale would be NaN/Inf
/// replaced by an all-zero block (so the timing is of ordinary arithmetic).
fn test_tensor(ty: GgmlType, bytes: usize) -> Vec<u8> {
    let size = ty.type_size();
    let mut data = random_bytes(bytes / size * size, ty.id() as u64);
    for block in data.chunks_exact_mut(size) {
        if validate(ty, block).is_err() {
            block.fill(0);
        }
    }
    data
}

fn bench_ggml(c: &mut Criterion) {
    let mut group = c.benchmark_group("decode");
    group
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1))
        .sample_size(20);
    for &ty in GgmlType::ALL {
        let data = test_tensor(ty, 2 << 20);
        let n = data.len() / ty.type_size() * ty.block_size();
        let mut out = vec![0f32; n];
        group.throughput(Throughput::Bytes(data.len() as u64));
        group.bench_with_input(BenchmarkId::from_parameter(ty), &data, |b, data| {
            b.iter(|| dequantize(ty, black_box(data), &mut out).expect("decode"))
        });
    }
    group.finish();
}

fn bench_mlx(c: &mut Criterion) {
    let mut group = c.benchmark_group("decode_mlx");
    group
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1))
        .sample_size(20);
    for bits in [2u8, 3, 4, 6, 8] {
        let q = MlxAffine::new(bits, 64, ScaleType::F16).expect("params");
        let n = 1 << 21;
        let packed = random_bytes(q.packed_bytes(n), bits as u64);
        let scales: Vec<u8> = (0..n / 64)
            .flat_map(|_| half::f16::from_f32(0.01).to_le_bytes())
            .collect();
        let mut out = vec![0f32; n];
        let weight_bytes = packed.len() + 2 * scales.len();
        group.throughput(Throughput::Bytes(weight_bytes as u64));
        group.bench_function(BenchmarkId::new("affine_g64_f16", bits), |b| {
            b.iter(|| {
                q.dequantize(black_box(&packed), &scales, &scales, &mut out)
                    .expect("decode")
            })
        });
    }
    group.finish();
}

criterion_group!(benches, bench_ggml, bench_mlx);
criterion_main!(benches);
