//! Memory proofs of the streaming mode, each run in a fresh child process
//! (this test binary re-invoked on `child_run`) so that its peak RSS is its own:
//!
//! * `stream_peak_rss_within_budget`: in `Stream` mode the peak RSS (VmHWM)
//!   stays under largest layer + KV cache + 100 MB, for each real model, and
//!   the weights mapped at any moment (the model file's resident pages in
//!   `/proc/self/smaps`, sampled every 2 ms) stay near the chunk budget
//!   `(prefetch + 1) × stream_chunk_bytes`, far below a layer;
//! * `stream_logits_equal_resident`: the chunked matmuls of `Stream` mode give
//!   bit-identical logits to `Resident` mode;
//! * `qwen2_runs_under_half_file_cgroup_cap`: Qwen2.5-Coder-0.5B generates to
//!   completion inside a memory cgroup capped at half its file size (cgroup
//!   v1 `memory.limit_in_bytes` or v2 `memory.max`, created under this
//!   process's own group; skipped with a message where not writable).
//!
//! Run in release mode: `cargo test --release -p flatrun-runtime --test memory -- --nocapture`.
//! A debug build reports the RSS and cgroup tests as ignored.

mod common;

use flatrun_runtime::{GenerateOptions, LoadOptions, Model, Prefetch, Residency, StepOptions};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

const MB: u64 = 1_000_000;
const CHILD_ENV: &str = "FLATRUN_MEMORY_CHILD_MODEL";

/// Entry point of the child process: the tests below run it (`--ignored
/// child_run`) with the model to load in `FLATRUN_MEMORY_CHILD_MODEL`.
#[test]
#[ignore = "the child process of the memory tests, run by them"]
fn child_run() {
    let Some(model_path) = std::env::var_os(CHILD_ENV) else {
        panic!("{CHILD_ENV} is not set: child_run is started by the memory tests");
    };
    let ctx: usize = std::env::var("FLATRUN_MEMORY_CHILD_CTX")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1024);
    let mut model = Model::load(
        &model_path,
        LoadOptions {
            residency: Residency::Stream,
            prefetch: Prefetch::Ahead { depth: 1 },
            ctx: Some(ctx),
            profile: true,
            trace_memory: true,
            ..LoadOptions::default()
        },
    )
    .expect("load");
    let largest = model.executor().manifest().largest_layer_bytes();
    // The file's header and metadata (the tokenizer reads its tables there).
    let metadata = model
        .executor()
        .backend()
        .tensors()
        .iter()
        .map(|t| t.offset)
        .min()
        .unwrap_or(0);
    // Sample the weights mapped into the process while the model runs.
    let stop = Arc::new(AtomicBool::new(false));
    let mapped_peak = Arc::new(AtomicU64::new(0));
    let sampler = {
        let (stop, peak, path) = (
            stop.clone(),
            mapped_peak.clone(),
            PathBuf::from(&model_path),
        );
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                if let Some(bytes) = flatrun_runtime::mapped_file_rss(&path) {
                    peak.fetch_max(bytes, Ordering::Relaxed);
                }
                std::thread::sleep(std::time::Duration::from_millis(2));
            }
        })
    };
    let prompt = "Write a short poem about the sea and the wind, in four lines.";
    let mut n = 0;
    let mut r#gen = model
        .generate(
            prompt,
            GenerateOptions {
                stop_at_eos: false,
                ..GenerateOptions::greedy(16)
            },
        )
        .expect("generate");
    for ev in r#gen.by_ref() {
        ev.expect("token");
        n += 1;
    }
    let kv = r#gen.sequence().kv_bytes() as u64;
    drop(r#gen);
    stop.store(true, Ordering::Relaxed);
    sampler.join().expect("sampler thread");
    let rss = flatrun_runtime::rss();
    let (cached, total) = model.executor().page_cache_residency();
    let p = model.profiler();
    println!(
        "RESULT peak={} largest_layer={} kv={} tokens={} prefill_tok_s={:.2} decode_tok_s={:.2} io_wait_share={:.3} page_cache={} file={} sample_peak_anon={} sample_peak_file={} mapped_peak={} chunk_budget={} metadata={}",
        rss.peak,
        largest,
        kv,
        n,
        p.prefill_tok_s(),
        p.decode_tok_s(),
        p.io_wait_share(),
        cached,
        total,
        p.peak_rss.anon,
        p.peak_rss.file,
        mapped_peak.load(Ordering::Relaxed),
        2 * LoadOptions::default().stream_chunk_bytes,
        metadata
    );
}

/// Run `child_run` in a new process (optionally through `wrapper`) and parse its RESULT line.
fn spawn_child(
    model: &Path,
    ctx: usize,
    cgroup_procs: Option<&Path>,
) -> Option<Vec<(String, f64)>> {
    let exe = std::env::current_exe().expect("test binary");
    let mut cmd = match cgroup_procs {
        // Join the cgroup before exec, so every page the child touches is charged there.
        Some(procs) => {
            let mut c = Command::new("sh");
            c.arg("-c")
                .arg(format!(
                    "echo $$ > '{}' && exec \"$0\" \"$@\"",
                    procs.display()
                ))
                .arg(&exe);
            c
        }
        None => Command::new(&exe),
    };
    cmd.args([
        "child_run",
        "--exact",
        "--ignored",
        "--nocapture",
        "--test-threads=1",
    ])
    .env(CHILD_ENV, model)
    .env("FLATRUN_MEMORY_CHILD_CTX", ctx.to_string());
    let out = cmd.output().expect("spawn child");
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        eprintln!(
            "child failed ({}):\n{stdout}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        return None;
    }
    let line = stdout
        .lines()
        .find_map(|l| l.split_once("RESULT ").map(|(_, r)| r))?;
    Some(
        line.split_whitespace()
            .filter_map(|kv| kv.split_once('='))
            .filter_map(|(k, v)| v.parse().ok().map(|v| (k.to_string(), v)))
            .collect(),
    )
}

fn field(r: &[(String, f64)], k: &str) -> f64 {
    r.iter().find(|(n, _)| n == k).map_or(f64::NAN, |(_, v)| *v)
}

/// Stream-mode peak RSS of one model against largest layer + KV + 100 MB.
fn stream_peak_rss_within_budget(file: &str) {
    let Some(path) = common::model(file) else {
        return;
    };
    let r = spawn_child(&path, 1024, None).expect("child run");
    let (peak, largest, kv) = (
        field(&r, "peak"),
        field(&r, "largest_layer"),
        field(&r, "kv"),
    );
    let budget = largest + kv + 100.0 * MB as f64;
    eprintln!(
        "{file}: stream peak RSS {:.1} MB (budget {:.1} MB = layer {:.1} + KV {:.1} + 100), file {:.1} MB, \
         prefill {:.1} tok/s, decode {:.1} tok/s, I/O wait {:.1}%",
        peak / 1e6,
        budget / 1e6,
        largest / 1e6,
        kv / 1e6,
        std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0) as f64 / 1e6,
        field(&r, "prefill_tok_s"),
        field(&r, "decode_tok_s"),
        100.0 * field(&r, "io_wait_share")
    );
    assert!(
        peak < budget,
        "{file}: peak RSS {peak} over budget {budget}"
    );
    // The model file mapped at once: (prefetch + 1) weight chunks, the
    // metadata the tokenizer reads, and what the kernel maps along with a
    // faulting page (64 KiB fault-around blocks; on 6.x kernels whole large
    // page-cache folios, up to 2 MiB, on either side): measured ≤ 4.1 MiB.
    let (mapped, chunks) = (field(&r, "mapped_peak"), field(&r, "chunk_budget"));
    let slack = field(&r, "metadata") + 8.0 * (1 << 20) as f64;
    eprintln!(
        "{file}: weights mapped at most {:.1} MiB (chunk budget {:.1} MiB, largest layer {:.1} MiB)",
        mapped / (1 << 20) as f64,
        chunks / (1 << 20) as f64,
        largest / (1 << 20) as f64
    );
    assert!(
        mapped <= chunks + slack,
        "{file}: {mapped} bytes of weights mapped at once, over the chunk budget {chunks} + {slack}"
    );
}

#[test]
#[cfg_attr(debug_assertions, ignore = "needs a release build (--release)")]
fn smollm2_stream_peak_rss_within_budget() {
    stream_peak_rss_within_budget("SmolLM2-135M-Instruct.Q4_1.gguf");
}

// The 262k/152k-vocabulary models fit the budget because the tokenizer keeps
// their token tables compact (`tokenizer/text_table.rs`), not one `String`
// per token.
#[test]
#[cfg_attr(debug_assertions, ignore = "needs a release build (--release)")]
fn gemma3_stream_peak_rss_within_budget() {
    stream_peak_rss_within_budget("gemma-3-270m-q4_k_m.gguf");
}

#[test]
#[cfg_attr(debug_assertions, ignore = "needs a release build (--release)")]
fn qwen2_stream_peak_rss_within_budget() {
    stream_peak_rss_within_budget("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf");
}

/// Make a memory cgroup capped at `limit` bytes under this process's own
/// group; returns its directory and its `cgroup.procs`.
fn make_cgroup(limit: u64) -> Result<(PathBuf, PathBuf), String> {
    let own = std::fs::read_to_string("/proc/self/cgroup").map_err(|e| e.to_string())?;
    let name = format!("flatrun-memtest-{}", std::process::id());
    // cgroup v1: a `memory` controller line.
    if let Some(rel) = own.lines().find_map(|l| {
        let mut parts = l.splitn(3, ':');
        let (_, ctrl, path) = (parts.next()?, parts.next()?, parts.next()?);
        ctrl.split(',')
            .any(|c| c == "memory")
            .then(|| path.to_string())
    }) {
        let dir = Path::new("/sys/fs/cgroup/memory")
            .join(rel.trim_start_matches('/'))
            .join(&name);
        std::fs::create_dir(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        std::fs::write(dir.join("memory.limit_in_bytes"), limit.to_string())
            .map_err(|e| format!("memory.limit_in_bytes: {e}"))?;
        return Ok((dir.clone(), dir.join("cgroup.procs")));
    }
    // cgroup v2: the `0::` line.
    let rel = own
        .lines()
        .find_map(|l| l.strip_prefix("0::"))
        .ok_or("no cgroup line")?;
    let dir = Path::new("/sys/fs/cgroup")
        .join(rel.trim_start_matches('/'))
        .join(&name);
    std::fs::create_dir(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    std::fs::write(dir.join("memory.max"), limit.to_string())
        .map_err(|e| format!("memory.max: {e}"))?;
    Ok((dir.clone(), dir.join("cgroup.procs")))
}

#[test]
#[cfg_attr(debug_assertions, ignore = "needs a release build (--release)")]
fn qwen2_runs_under_half_file_cgroup_cap() {
    let Some(path) = common::model("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf") else {
        return;
    };
    let file_size = std::fs::metadata(&path).expect("stat").len();
    let limit = file_size / 2;
    let (dir, procs) = match make_cgroup(limit) {
        Ok(c) => c,
        Err(why) => {
            eprintln!("skipping: cannot create a memory cgroup ({why})");
            return;
        }
    };
    let result = spawn_child(&path, 512, Some(&procs));
    let max_usage = std::fs::read_to_string(dir.join("memory.max_usage_in_bytes"))
        .or_else(|_| std::fs::read_to_string(dir.join("memory.peak")))
        .unwrap_or_default();
    let _ = std::fs::remove_dir(&dir);
    let r = result.expect("the capped child did not finish");
    eprintln!(
        "qwen2.5-coder-0.5b under a {:.1} MB cap (file {:.1} MB): {} tokens, prefill {:.2} tok/s, decode {:.2} tok/s, \
         I/O wait {:.1}%, cgroup peak {} bytes, child VmHWM {:.1} MB",
        limit as f64 / 1e6,
        file_size as f64 / 1e6,
        field(&r, "tokens"),
        field(&r, "prefill_tok_s"),
        field(&r, "decode_tok_s"),
        100.0 * field(&r, "io_wait_share"),
        max_usage.trim(),
        field(&r, "peak") / 1e6
    );
    assert!(field(&r, "tokens") >= 16.0);
}

/// Stream mode multiplies every matrix in row chunks (the weight engine, `src/weights/`),
/// resident mode in one call: the logits must be the same bits.
fn stream_logits_equal_resident(file: &str, chunk_bytes: usize) {
    let Some(path) = common::model(file) else {
        return;
    };
    let prompt: Vec<u32> = (0..12u32).map(|i| 100 + 37 * i).collect();
    let logits = |residency: Residency| -> Vec<Vec<f32>> {
        let mut model = Model::load(
            &path,
            LoadOptions {
                residency,
                ctx: Some(64),
                stream_chunk_bytes: chunk_bytes,
                ..LoadOptions::default()
            },
        )
        .expect("load");
        let ex = model.executor_mut();
        let mut seq = ex.new_sequence();
        // A prefill (GEMM path), then two decode steps (GEMV path).
        let mut out = vec![
            ex.step(&mut seq, &prompt, StepOptions::default())
                .expect("prefill")
                .logits,
        ];
        for t in [5u32, 9] {
            out.push(
                ex.step(&mut seq, &[t], StepOptions::default())
                    .expect("decode")
                    .logits,
            );
        }
        out
    };
    let (streamed, resident) = (logits(Residency::Stream), logits(Residency::Resident));
    common::logits::assert_bit_identical(
        &streamed,
        &resident,
        &format!("{file}: stream vs resident"),
    );
}

#[test]
fn smollm2_stream_logits_equal_resident() {
    // 64 KiB chunks: every matrix of SmolLM2 is cut into several.
    stream_logits_equal_resident("SmolLM2-135M-Instruct.Q4_1.gguf", 64 << 10);
}

#[test]
fn qwen2_stream_logits_equal_resident() {
    stream_logits_equal_resident("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", 1 << 20);
}
