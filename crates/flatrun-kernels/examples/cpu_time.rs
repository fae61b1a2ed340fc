//! On-CPU time per GEMV (or GEMM) call, single-threaded, per format (insensitive
//! to other load on the machine, unlike wall-clock benches). Linux only. For GEMV
//! against the memory bandwidth of the same run, see `benches/bandwidth.rs`.
//!
//! `cargo run --release -p flatrun-kernels --example cpu_time [rows cols iters [tokens]]`
//! (`CPU_TIME_FORMATS=q4_1,q8_0` limits the formats; with `tokens` > 1 the cycle
//! figure is per 32 weights per token).

use flatrun_format::GgmlType;
use flatrun_kernels::{Kernels, NativeKernels, Weight, WeightFormat};

/// Nanoseconds this thread has spent on a CPU (`CLOCK_THREAD_CPUTIME_ID`: it adds the time
/// since the last scheduler tick, where `/proc/thread-self/schedstat` moves in whole 4 ms
/// ticks on the development VM).
fn thread_cpu_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec.
    if unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) } != 0 {
        return 0;
    }
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let (rows, cols, iters, tokens) = match args[..] {
        [r, c, i] => (r, c, i, 1),
        [r, c, i, t] => (r, c, i, t.max(1)),
        _ => (1536, 2048, 200, 1),
    };
    let only: Option<Vec<String>> = std::env::var("CPU_TIME_FORMATS").ok().map(|s| {
        s.split(',')
            .map(|f| f.trim().to_ascii_lowercase())
            .collect()
    });
    flatrun_kernels::set_threads(1);
    let level = flatrun_kernels::simd_level();
    let k = NativeKernels::new(level);
    println!("{rows} x {cols} x {tokens} tokens, {iters} calls, simd {level}, 1 thread");
    for t in [
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q8_0,
        GgmlType::IQ4_NL,
        GgmlType::Q2_K,
        GgmlType::Q3_K,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
        GgmlType::IQ4_XS,
        GgmlType::F16,
    ] {
        if cols % t.block_size() != 0 {
            continue;
        }
        if let Some(only) = &only
            && !only.contains(&t.traits().name.to_ascii_lowercase())
        {
            continue;
        }
        let n = rows * cols / t.block_size() * t.type_size();
        let mut bytes: Vec<u8> = (0..n)
            .map(|i| ((i * 2654435761usize) >> 13) as u8)
            .collect();
        // Sane f16 scales at the front of each block, or every value for F16.
        let one = half::f16::from_f32(0.01).to_le_bytes();
        let step = if t == GgmlType::F16 { 2 } else { t.type_size() };
        let offsets: &[usize] = match t {
            GgmlType::Q2_K => &[80, 82],
            GgmlType::Q3_K => &[108],
            GgmlType::Q6_K => &[208],
            _ => &[0, 2],
        };
        for blk in bytes.chunks_exact_mut(step) {
            for &o in offsets {
                if o + 2 <= blk.len() {
                    blk[o..o + 2].copy_from_slice(&one);
                }
            }
        }
        let w = Weight::new(WeightFormat::Ggml(t), rows, cols, &bytes, None, None).unwrap();
        let x: Vec<f32> = (0..cols * tokens)
            .map(|i| (i % 17) as f32 * 0.1 - 0.8)
            .collect();
        let mut out = vec![0f32; rows * tokens];
        k.matmul(&w, &x, tokens, &mut out).unwrap();
        let t0 = thread_cpu_ns();
        for _ in 0..iters {
            k.matmul(&w, &x, tokens, &mut out).unwrap();
        }
        let ns = (thread_cpu_ns() - t0) as f64 / iters as f64;
        let weights = (rows * cols * tokens) as f64;
        println!(
            "{:>7}: {:8.1} us/call  {:6.2} GB/s of weights  {:5.3} ns/weight (x2.45 GHz = {:.2} cycles/32 weights)",
            t.traits().name,
            ns / 1e3,
            n as f64 / ns,
            ns / weights,
            ns / weights * 2.45 * 32.0
        );
    }
}
