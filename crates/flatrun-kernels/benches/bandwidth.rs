//! Decode GEMV against the machine's memory read bandwidth, measured in the same run.
//!
//! ```sh
//! cargo bench -p flatrun-kernels --bench bandwidth                    # 1 and 2 threads, huge pages
//! cargo bench -p flatrun-kernels --bench bandwidth -- --pages small   # 4 KiB pages (like a mapped file)
//! cargo bench -p flatrun-kernels --bench bandwidth -- --threads 1 --reps 9 --formats Q8_0,Q4_K
//! cargo bench -p flatrun-kernels --bench bandwidth -- --gemm          # also GEMM vs GEMV × tokens
//! ```
//!
//! For every fused weight format the bench builds a matrix much larger than the
//! last-level cache (32 MiB here) — Qwen2.5's 151936×896 output head for the formats whose
//! blocks divide 896, a 32768×4096 matrix (two Llama-3-8B FFN projections stacked) for the
//! 256-value K-quant blocks, and MLX affine 4/8-bit (`MLX4/g64`, `MLX8/g64`: groups of 64
//! with bf16 scales and biases, mlx_lm's defaults) on the head shape — and alternates,
//! `--reps` times:
//!
//! 1. **read bandwidth**: a 512 MiB buffer summed with 32-byte integer adds (four
//!    independent accumulators, 128 bytes per step), the buffer cut into one contiguous
//!    part per thread, as many threads as the GEMV's pool; the fastest of three passes;
//! 2. **GEMV**: one token through `Kernels::matmul` on the native backend, the fastest of
//!    three calls; GB/s counts the weight bytes (scales, and MLX biases, included) read once
//!    per call.
//!
//! Each repetition gives a fraction GEMV ÷ bandwidth; the table prints the median and
//! [min–max] over repetitions of bandwidth, GEMV GB/s and the fraction. With one thread it
//! also prints the same fraction from on-CPU time (`CLOCK_THREAD_CPUTIME_ID` of the summing
//! thread and of the GEMV caller, so time slices lost to other jobs on a shared machine do
//! not count; memory traffic of other jobs still does), and on-CPU cycles per weight block
//! (at 2.45 GHz, the nominal clock; a float "block" is 32 values) both for the streamed
//! matrix and for an L2-resident slice of it (192 KiB, called repeatedly), against the
//! cycles per block the on-CPU read bandwidth leaves (`budget`): a format whose resident
//! cycles exceed its budget is compute-bound. Both buffers are anonymous memory, `madvise(MADV_HUGEPAGE)` by default
//! (`--pages small`: `MADV_NOHUGEPAGE`). Real weights are a memory-mapped file in the page
//! cache, mapped with 4 KiB pages: `--pages small` is the closer model of decode.
//!
//! `--gemm` adds a table of one 64-token GEMM against 64 one-token GEMVs per format, on the
//! real projection shapes of `GEMM_SHAPES` (cache-resident: the GEMVs run at their compute
//! rate, repeated 20 times) and on the format's large matrix above ("streamed": its GEMVs read
//! from memory, as decode does).
//!
//! Each thread count runs in its own child process (the kernel pool is sized once per
//! process); the parent prints their tables.

use std::hint::black_box;
use std::process::Command;
use std::time::Instant;

use flatrun_format::GgmlType;
use flatrun_kernels::{Kernels, NativeKernels, Weight, WeightFormat};

/// Nominal clock of the development machine, for cycle figures.
const GHZ: f64 = 2.45;
/// The read-bandwidth buffer: far beyond the 32 MiB last-level cache.
const BANDWIDTH_BYTES: usize = 512 << 20;
/// Tokens of the GEMM comparison (`--gemm`).
const GEMM_TOKENS: usize = 64;

/// The formats with fused kernels and the large matrix each is measured on.
const LARGE: &[(GgmlType, usize, usize)] = &[
    (GgmlType::F32, 151936, 896),
    (GgmlType::F16, 151936, 896),
    (GgmlType::BF16, 151936, 896),
    (GgmlType::Q8_0, 151936, 896),
    (GgmlType::Q5_1, 151936, 896),
    (GgmlType::Q5_0, 151936, 896),
    (GgmlType::Q4_1, 151936, 896),
    (GgmlType::Q4_0, 151936, 896),
    (GgmlType::IQ4_NL, 151936, 896),
    (GgmlType::Q1_0, 151936, 896),
    (GgmlType::Q6_K, 32768, 4096),
    (GgmlType::Q5_K, 32768, 4096),
    (GgmlType::Q4_K, 32768, 4096),
    (GgmlType::Q3_K, 32768, 4096),
    (GgmlType::Q2_K, 32768, 4096),
    (GgmlType::IQ4_XS, 32768, 4096),
];

/// Real projection shapes (rows × cols) for the GEMM comparison: SmolLM2 FFN down, Gemma 3
/// 270M FFN down, Qwen2.5-0.5B FFN down, a 1.5B FFN down.
const GEMM_SHAPES: &[(usize, usize)] = &[(576, 1536), (640, 2048), (896, 4864), (1536, 8960)];

#[derive(Clone, Copy, PartialEq)]
enum Pages {
    Huge,
    Small,
}

struct Options {
    threads: Vec<usize>,
    reps: usize,
    pages: Pages,
    formats: Option<Vec<String>>,
    gemm: bool,
}

fn parse_options() -> Options {
    let mut o = Options {
        threads: vec![1, 2],
        reps: 5,
        pages: Pages::Huge,
        formats: None,
        gemm: false,
    };
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < args.len() {
        let value = args.get(i + 1).cloned().unwrap_or_default();
        match args[i].as_str() {
            "--threads" => {
                o.threads = value.split(',').filter_map(|s| s.parse().ok()).collect();
                i += 1;
            }
            "--reps" => {
                o.reps = value.parse().unwrap_or(o.reps).max(1);
                i += 1;
            }
            "--pages" => {
                o.pages = if value == "small" {
                    Pages::Small
                } else {
                    Pages::Huge
                };
                i += 1;
            }
            "--formats" => {
                o.formats = Some(value.split(',').map(|s| s.to_ascii_uppercase()).collect());
                i += 1;
            }
            "--gemm" => o.gemm = true,
            _ => {} // `--bench` and other arguments cargo passes
        }
        i += 1;
    }
    o
}

/// Anonymous memory aligned to 2 MiB, with a transparent-huge-page hint.
struct Buffer {
    map: *mut libc::c_void,
    map_len: usize,
    start: *mut u8,
    len: usize,
}

impl Buffer {
    fn new(len: usize, pages: Pages) -> Buffer {
        const ALIGN: usize = 2 << 20;
        let map_len = len + ALIGN;
        // SAFETY: a fresh private anonymous mapping; no existing memory is touched.
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert!(map != libc::MAP_FAILED, "mmap of {map_len} bytes failed");
        let start = (map as usize).next_multiple_of(ALIGN) as *mut u8;
        // Transparent huge pages are a Linux feature; elsewhere the pages are the system's.
        #[cfg(target_os = "linux")]
        {
            let advice = match pages {
                Pages::Huge => libc::MADV_HUGEPAGE,
                Pages::Small => libc::MADV_NOHUGEPAGE,
            };
            // SAFETY: `start .. start + len` lies inside the mapping made above; advice only.
            unsafe { libc::madvise(start as *mut libc::c_void, len, advice) };
        }
        #[cfg(not(target_os = "linux"))]
        let _ = pages;
        Buffer {
            map,
            map_len,
            start,
            len,
        }
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: the mapping is live, readable and `len` bytes from `start` are inside it.
        unsafe { std::slice::from_raw_parts(self.start, self.len) }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` makes this the only view.
        unsafe { std::slice::from_raw_parts_mut(self.start, self.len) }
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping made in `new`; no view outlives `self`.
        unsafe { libc::munmap(self.map, self.map_len) };
    }
}

/// xorshift64 bytes.
fn fill_random(bytes: &mut [u8], mut s: u64) {
    for c in bytes.chunks_mut(8) {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        c.copy_from_slice(&s.to_le_bytes()[..c.len()]);
    }
}

/// Random blocks of format `t`, with finite f16 scales (0.01) where its blocks keep them,
/// and values in [−1, 1) for the float formats.
fn fill_weights(t: GgmlType, bytes: &mut [u8]) {
    fill_random(bytes, 0x2545F4914F6CDD1D);
    let value = |b: &[u8]| (u16::from_le_bytes([b[0], b[1]]) as f32 / 32768.0) - 1.0;
    match t {
        GgmlType::F32 => bytes.chunks_exact_mut(4).for_each(|c| {
            let v = value(c);
            c.copy_from_slice(&v.to_le_bytes())
        }),
        GgmlType::F16 => bytes.chunks_exact_mut(2).for_each(|c| {
            let v = half::f16::from_f32(value(c));
            c.copy_from_slice(&v.to_le_bytes())
        }),
        GgmlType::BF16 => bytes.chunks_exact_mut(2).for_each(|c| {
            let v = half::bf16::from_f32(value(c));
            c.copy_from_slice(&v.to_le_bytes())
        }),
        _ => {
            let offsets: &[usize] = match t {
                GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4_K | GgmlType::Q5_K => &[0, 2],
                GgmlType::Q2_K => &[80, 82],
                GgmlType::Q3_K => &[108],
                GgmlType::Q6_K => &[208],
                _ => &[0],
            };
            let scale = half::f16::from_f32(0.01).to_le_bytes();
            for blk in bytes.chunks_exact_mut(t.type_size()) {
                for &o in offsets {
                    blk[o..o + 2].copy_from_slice(&scale);
                }
            }
        }
    }
}

/// Nanoseconds this thread has spent on a CPU (`CLOCK_THREAD_CPUTIME_ID`, which adds the
/// time since the last scheduler tick; `/proc/thread-self/schedstat` moves in whole ticks
/// on this VM, 4 ms).
fn thread_cpu_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec.
    let ok = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) } == 0;
    if ok {
        ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
    } else {
        0
    }
}

/// Wrapping 64-bit sum of `bytes` (a multiple of 128 bytes), four 32-byte accumulators.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn sum_avx2(bytes: &[u8]) -> u64 {
    use std::arch::x86_64::*;
    let mut acc = [_mm256_setzero_si256(); 4];
    for step in bytes.chunks_exact(128) {
        for (k, a) in acc.iter_mut().enumerate() {
            // SAFETY: `step` holds 128 bytes, so bytes 32k .. 32k + 32 are inside it.
            let v = unsafe { _mm256_loadu_si256(step.as_ptr().add(32 * k) as *const __m256i) };
            *a = _mm256_add_epi64(*a, v);
        }
    }
    let s = _mm256_add_epi64(
        _mm256_add_epi64(acc[0], acc[1]),
        _mm256_add_epi64(acc[2], acc[3]),
    );
    let mut lanes = [0u64; 4];
    // SAFETY: `lanes` is 32 writable bytes.
    unsafe { _mm256_storeu_si256(lanes.as_mut_ptr() as *mut __m256i, s) };
    lanes.iter().fold(0, |a, &b| a.wrapping_add(b))
}

/// The same sum, portable (eight u64 lanes LLVM vectorizes).
fn sum_portable(bytes: &[u8]) -> u64 {
    let mut acc = [0u64; 8];
    for step in bytes.chunks_exact(64) {
        for (k, a) in acc.iter_mut().enumerate() {
            let w = u64::from_le_bytes(step[8 * k..8 * k + 8].try_into().unwrap_or([0; 8]));
            *a = a.wrapping_add(w);
        }
    }
    acc.iter().fold(0, |a, &b| a.wrapping_add(b))
}

fn sum_bytes(bytes: &[u8]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 is present.
        return unsafe { sum_avx2(bytes) };
    }
    sum_portable(bytes)
}

/// Read bandwidth (GB/s) of one pass over `buf` by `threads` threads, one contiguous part
/// each: by wall clock, and by the on-CPU time of the slowest thread.
fn read_pass(buf: &[u8], threads: usize) -> (f64, f64) {
    let part = (buf.len() / threads) / 128 * 128;
    let start = Instant::now();
    let (total, cpu_ns) = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|k| {
                let slice = &buf[k * part..(k + 1) * part];
                s.spawn(move || {
                    let c0 = thread_cpu_ns();
                    let sum = sum_bytes(slice);
                    (sum, thread_cpu_ns() - c0)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or((0, 0)))
            .fold((0u64, 0u64), |(s, c), (s1, c1)| {
                (s.wrapping_add(s1), c.max(c1))
            })
    });
    black_box(total);
    let bytes = (part * threads) as f64;
    (
        bytes / start.elapsed().as_secs_f64() / 1e9,
        bytes / cpu_ns.max(1) as f64,
    )
}

/// Fastest of three passes (wall clock; on-CPU).
fn read_bandwidth(buf: &[u8], threads: usize) -> (f64, f64) {
    (0..3)
        .map(|_| read_pass(buf, threads))
        .fold((0f64, 0f64), |(w, c), (w1, c1)| (w.max(w1), c.max(c1)))
}

/// Seconds of the fastest of `calls` calls of `f` (wall clock), and the caller's on-CPU
/// seconds of that call.
fn fastest(calls: usize, mut f: impl FnMut()) -> (f64, f64) {
    let mut best = (f64::INFINITY, 0.0);
    for _ in 0..calls {
        let (t0, c0) = (Instant::now(), thread_cpu_ns());
        f();
        let wall = t0.elapsed().as_secs_f64();
        let cpu = (thread_cpu_ns() - c0) as f64 * 1e-9;
        if wall < best.0 {
            best = (wall, cpu);
        }
    }
    best
}

fn median_min_max(v: &[f64]) -> (f64, f64, f64) {
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    let n = s.len();
    let med = if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    };
    (med, s[0], s[n - 1])
}

fn fmt3((med, lo, hi): (f64, f64, f64), digits: usize) -> String {
    format!("{med:.digits$} [{lo:.digits$}–{hi:.digits$}]")
}

fn selected(o: &Options, t: GgmlType) -> bool {
    o.formats
        .as_ref()
        .is_none_or(|f| f.iter().any(|n| n == t.traits().name))
}

/// One child process: the pool at `threads`, every selected format.
fn run_child(o: &Options, threads: usize) {
    flatrun_kernels::set_threads(threads);
    let threads = flatrun_kernels::threads();
    let level = flatrun_kernels::simd_level();
    let k = NativeKernels::new(level);
    let mut bw_buf = Buffer::new(BANDWIDTH_BYTES, o.pages);
    fill_random(bw_buf.bytes_mut(), 7);
    let pages = match o.pages {
        Pages::Huge => "MADV_HUGEPAGE",
        Pages::Small => "MADV_NOHUGEPAGE",
    };
    println!(
        "\n### {threads} thread(s), simd {level}, {pages}, {} repetitions\n",
        o.reps
    );
    let one = threads == 1;
    println!(
        "| format | matrix | MiB | read bandwidth GB/s | GEMV GB/s | GEMV ÷ bandwidth |{}",
        if one {
            " on-CPU fraction | cycles/block streamed | cycles/block L2-resident | budget cycles/block |"
        } else {
            ""
        }
    );
    println!(
        "|---|---|---:|---|---|---|{}",
        if one { "---|---|---|---:|" } else { "" }
    );
    for &(t, rows, cols) in LARGE {
        if !selected(o, t) {
            continue;
        }
        let bytes_len = rows * cols / t.block_size() * t.type_size();
        let mut wbuf = Buffer::new(bytes_len, o.pages);
        fill_weights(t, wbuf.bytes_mut());
        let data = wbuf.bytes();
        let w = match Weight::new(WeightFormat::Ggml(t), rows, cols, data, None, None) {
            Ok(w) => w,
            Err(e) => {
                println!("| {} | {rows}×{cols} | error: {e} |", t.traits().name);
                continue;
            }
        };
        // A "block" is the format's block, or 32 values of a float format.
        let block_values = t.block_size().max(32);
        let case = Case {
            name: t.traits().name.to_string(),
            w,
            bytes: bytes_len,
            block_values,
            block_bytes: block_values / t.block_size() * t.type_size(),
        };
        measure_gemv(o, &k, threads, bw_buf.bytes(), &case);
    }
    // MLX affine 4- and 8-bit (groups of 64, bf16 scales and biases: mlx_lm's defaults) on the
    // same head shape; the bytes read are the packed values, the scales and the biases.
    for bits in [4u8, 8] {
        let (rows, cols, group) = (151936, 896, 64);
        let name = format!("MLX{bits}/g{group}");
        if !o
            .formats
            .as_ref()
            .is_none_or(|f| f.iter().any(|n| *n == name.to_ascii_uppercase()))
        {
            continue;
        }
        let data_len = rows * cols * bits as usize / 8;
        let groups = rows * cols / group;
        let mut data = Buffer::new(data_len, o.pages);
        fill_random(data.bytes_mut(), 11);
        let mut scales = Buffer::new(groups * 2, o.pages);
        let mut biases = Buffer::new(groups * 2, o.pages);
        for (c, v) in scales
            .bytes_mut()
            .chunks_exact_mut(2)
            .map(|c| (c, 0.01f32))
            .chain(
                biases
                    .bytes_mut()
                    .chunks_exact_mut(2)
                    .map(|c| (c, -0.05f32)),
            )
        {
            c.copy_from_slice(&half::bf16::from_f32(v).to_le_bytes());
        }
        let format = WeightFormat::MlxAffine {
            bits,
            group_size: group as u32,
            scale_dtype: flatrun_format::DType::Ggml(GgmlType::BF16),
        };
        let w = match Weight::new(
            format,
            rows,
            cols,
            data.bytes(),
            Some(scales.bytes()),
            Some(biases.bytes()),
        ) {
            Ok(w) => w,
            Err(e) => {
                println!("| {name} | {rows}×{cols} | error: {e} |");
                continue;
            }
        };
        let case = Case {
            name,
            w,
            bytes: data_len + 4 * groups,
            block_values: group,
            block_bytes: group * bits as usize / 8 + 4,
        };
        measure_gemv(o, &k, threads, bw_buf.bytes(), &case);
    }
    if o.gemm {
        gemm_table(o, &k);
    }
}

/// One GEMV measurement: a weight far larger than the LLC, named, with the bytes one call
/// reads and what a "block" of it is (for cycles per block).
struct Case<'a> {
    name: String,
    w: Weight<'a>,
    bytes: usize,
    block_values: usize,
    block_bytes: usize,
}

/// Print one table row for `case`: read bandwidth and GEMV alternating `o.reps` times; with
/// one thread also on-CPU figures and an L2-resident slice.
fn measure_gemv(o: &Options, k: &NativeKernels, threads: usize, bw: &[u8], case: &Case) {
    let one = threads == 1;
    let Case {
        name,
        w,
        bytes: bytes_len,
        block_values,
        block_bytes,
    } = case;
    let (bytes_len, block_values, block_bytes) = (*bytes_len, *block_values, *block_bytes);
    let (rows, cols) = (w.rows, w.cols);
    let x: Vec<f32> = (0..cols)
        .map(|i| ((i * 7 % 13) as f32 - 6.0) * 0.1)
        .collect();
    let mut out = vec![0f32; rows];
    let gemv = |w: &Weight, out: &mut [f32]| {
        k.matmul(w, black_box(&x), 1, out)
            .expect("matmul of a well-formed weight")
    };
    gemv(w, &mut out); // fault in, warm the pool
    let blocks = (rows * cols / block_values) as f64;
    let (mut bws, mut gbs, mut fracs) = (vec![], vec![], vec![]);
    let (mut bw_cpus, mut cycles, mut cpu_fracs) = (vec![], vec![], vec![]);
    for _ in 0..o.reps {
        let (bw, bw_cpu) = read_bandwidth(bw, threads);
        let (wall, _) = fastest(3, || gemv(w, &mut out));
        let g = bytes_len as f64 / wall / 1e9;
        bws.push(bw);
        gbs.push(g);
        fracs.push(g / bw);
        if one {
            // On-CPU: the fastest of three calls again, by the caller's CPU time.
            let cpu = (0..3)
                .map(|_| {
                    let c0 = thread_cpu_ns();
                    gemv(w, &mut out);
                    (thread_cpu_ns() - c0) as f64 * 1e-9
                })
                .fold(f64::INFINITY, f64::min);
            cycles.push(cpu * GHZ * 1e9 / blocks);
            bw_cpus.push(bw_cpu);
            cpu_fracs.push(bytes_len as f64 / cpu / 1e9 / bw_cpu);
        }
    }
    let mut line = format!(
        "| {name} | {rows}×{cols} | {:.0} | {} | {} | {} |",
        bytes_len as f64 / (1 << 20) as f64,
        fmt3(median_min_max(&bws), 1),
        fmt3(median_min_max(&gbs), 2),
        fmt3(median_min_max(&fracs), 2),
    );
    if one {
        // The first rows of the same matrix, about 192 KiB: they stay in the 512 KiB L2
        // across calls.
        let l2_rows = ((192 << 10) / w.row_bytes()).clamp(1, rows);
        let resident = w.row_range(0..l2_rows).expect("rows inside the matrix");
        let mut out_l2 = vec![0f32; l2_rows];
        let reps = (300 << 20) / (l2_rows * w.row_bytes()).max(1);
        let per_call: Vec<f64> = (0..3)
            .map(|_| {
                let c0 = thread_cpu_ns();
                for _ in 0..reps {
                    gemv(&resident, &mut out_l2);
                }
                (thread_cpu_ns() - c0) as f64 * 1e-9 / reps as f64
            })
            .collect();
        let l2_blocks = blocks * l2_rows as f64 / rows as f64;
        let l2_cycles: Vec<f64> = per_call.iter().map(|s| s * GHZ * 1e9 / l2_blocks).collect();
        let budget = block_bytes as f64 / median_min_max(&bw_cpus).0 * GHZ;
        line += &format!(
            " {} | {} | {} | {budget:.2} |",
            fmt3(median_min_max(&cpu_fracs), 2),
            fmt3(median_min_max(&cycles), 2),
            fmt3(median_min_max(&l2_cycles), 2)
        );
    }
    println!("{line}");
}

/// GEMM (64 tokens) GFLOP/s on real shapes, and its time against 64 GEMVs.
fn gemm_table(o: &Options, k: &NativeKernels) {
    println!(
        "\n| format | matrix | GEMV µs | GEMM{GEMM_TOKENS} ms | GEMM GFLOP/s | {GEMM_TOKENS} × GEMV ÷ GEMM |"
    );
    println!("|---|---|---|---|---|---|");
    for &(t, large_rows, large_cols) in LARGE {
        if !selected(o, t) {
            continue;
        }
        // The real projection shapes (cache-resident: the GEMVs run at their compute rate,
        // the hard comparison), then the format's large matrix, whose GEMVs stream from
        // memory as decode does.
        let large = (large_rows, large_cols);
        for &(rows, cols) in GEMM_SHAPES.iter().chain(std::iter::once(&large)) {
            if cols % t.block_size() != 0 {
                continue;
            }
            let streamed = (rows, cols) == large;
            let mut bytes = vec![0u8; rows * cols / t.block_size() * t.type_size()];
            fill_weights(t, &mut bytes);
            let Ok(w) = Weight::new(WeightFormat::Ggml(t), rows, cols, &bytes, None, None) else {
                continue;
            };
            let xs: Vec<f32> = (0..cols * GEMM_TOKENS)
                .map(|i| ((i * 7 % 13) as f32 - 6.0) * 0.1)
                .collect();
            let mut outs = vec![0f32; rows * GEMM_TOKENS];
            let (mut gemv_us, mut gemm_ms, mut gflops, mut ratio) =
                (vec![], vec![], vec![], vec![]);
            for _ in 0..o.reps {
                let reps = if streamed { 3 } else { 20 };
                let (v, _) = fastest(3, || {
                    for _ in 0..reps {
                        k.matmul(&w, black_box(&xs[..cols]), 1, &mut outs[..rows])
                            .expect("gemv");
                    }
                });
                let (m, _) = fastest(3, || {
                    k.matmul(&w, black_box(&xs), GEMM_TOKENS, &mut outs)
                        .expect("gemm")
                });
                let v = v / reps as f64;
                gemv_us.push(v * 1e6);
                gemm_ms.push(m * 1e3);
                gflops.push(2.0 * (rows * cols * GEMM_TOKENS) as f64 / m / 1e9);
                ratio.push(v * GEMM_TOKENS as f64 / m);
            }
            println!(
                "| {} | {rows}×{cols}{} | {} | {} | {} | {} |",
                t.traits().name,
                if streamed { " (streamed)" } else { "" },
                fmt3(median_min_max(&gemv_us), 1),
                fmt3(median_min_max(&gemm_ms), 2),
                fmt3(median_min_max(&gflops), 1),
                fmt3(median_min_max(&ratio), 2)
            );
        }
    }
}

fn main() {
    let o = parse_options();
    if let Some(t) = std::env::var("FLATRUN_BANDWIDTH_CHILD")
        .ok()
        .and_then(|s| s.parse().ok())
    {
        return run_child(&o, t);
    }
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!(
        "GEMV vs memory read bandwidth; load average at start: {}",
        load.split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" ")
    );
    let exe = std::env::current_exe().expect("path of this bench binary");
    for &t in &o.threads {
        let status = Command::new(&exe)
            .args(std::env::args().skip(1))
            .env("FLATRUN_BANDWIDTH_CHILD", t.to_string())
            .status();
        if !matches!(status, Ok(s) if s.success()) {
            eprintln!("the {t}-thread run failed: {status:?}");
        }
    }
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!(
        "\nload average at end: {}",
        load.split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" ")
    );
}
