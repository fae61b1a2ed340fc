//! `--weights keep|f16|f32` and `--layers RANGE` on SmolLM2, through the
//! logits dump (`--dump-logits`, teacher-forced prompt positions only), and
//! `--profile-detailed`'s per-layer table.
//!
//! Tolerances (measured on this prompt, SmolLM2-135M Q4_1, logits up to ~33):
//! - reference backend: f32 vs quantized weights within 3.0 (the reference kernels now quantize activations to 8 bits for
//!   quantized weights, like ggml; measured 1.53 max, 0.20 mean); f16 vs f32
//!   weights within 0.4 with the same argmax (measured 0.19 max, 0.02 mean).
//! - native backend: the fused kernels quantize activations to 8 bits, the
//!   F32/F16 paths do not, so keep vs f32/f16 differ by at most 3.0 (measured
//!   1.68 max, 0.22 mean) with the same argmax at every position.

mod common;

use common::{flatrun, smollm2, stderr_of, stdout_of};
use std::path::{Path, PathBuf};

const PROMPT: &str = "The quick brown fox jumps over the lazy dog. In 1969, the first humans landed on the Moon, and";

/// A `[rows, cols]` little-endian f32 `.npy` matrix.
fn read_npy(path: &Path) -> (usize, usize, Vec<f32>) {
    let bytes = std::fs::read(path).unwrap();
    assert_eq!(&bytes[..6], b"\x93NUMPY", "not an npy file");
    let header_len = u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
    let header = std::str::from_utf8(&bytes[10..10 + header_len]).unwrap();
    assert!(header.contains("<f4"), "{header}");
    let shape = &header[header.find("'shape': (").unwrap() + 10..];
    let shape = &shape[..shape.find(')').unwrap()];
    let dims: Vec<usize> = shape
        .split(',')
        .filter(|s| !s.trim().is_empty())
        .map(|s| s.trim().parse().unwrap())
        .collect();
    let data: Vec<f32> = bytes[10 + header_len..]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    assert_eq!(data.len(), dims[0] * dims[1]);
    (dims[0], dims[1], data)
}

/// The prompt positions' logits with these extra flags.
fn prompt_logits(model: &Path, dir: &Path, name: &str, flags: &[&str]) -> (usize, usize, Vec<f32>) {
    let npy: PathBuf = dir.join(format!("{name}.npy"));
    let out = flatrun()
        .arg("run")
        .arg("--model")
        .arg(model)
        .args(["--prompt", PROMPT, "--max-new", "0", "-q", "--dump-logits"])
        .arg(&npy)
        .args(flags)
        .output()
        .unwrap();
    assert!(out.status.success(), "{name}: {}", stderr_of(&out));
    read_npy(&npy)
}

struct Diff {
    max: f32,
    mean: f32,
    same_argmax: bool,
}

fn diff(a: &(usize, usize, Vec<f32>), b: &(usize, usize, Vec<f32>)) -> Diff {
    assert_eq!((a.0, a.1), (b.0, b.1), "shapes differ");
    let cols = a.1;
    let d: Vec<f32> = a.2.iter().zip(&b.2).map(|(x, y)| (x - y).abs()).collect();
    let argmax = |row: &[f32]| {
        row.iter()
            .enumerate()
            .fold(
                (0, f32::MIN),
                |best, (i, &v)| if v > best.1 { (i, v) } else { best },
            )
            .0
    };
    let same_argmax =
        a.2.chunks(cols)
            .zip(b.2.chunks(cols))
            .all(|(x, y)| argmax(x) == argmax(y));
    Diff {
        max: d.iter().copied().fold(0.0, f32::max),
        mean: d.iter().sum::<f32>() / d.len() as f32,
        same_argmax,
    }
}

#[test]
fn dense_weights_match_quantized_ones_on_the_reference_backend() {
    let Some(model) = smollm2() else { return };
    let dir = tempfile::tempdir().unwrap();
    let reference = ["--backend", "reference"];
    let keep = prompt_logits(&model, dir.path(), "keep", &reference);
    let f32 = prompt_logits(
        &model,
        dir.path(),
        "f32",
        &[&reference[..], &["--weights", "f32"]].concat(),
    );
    let f16 = prompt_logits(
        &model,
        dir.path(),
        "f16",
        &[&reference[..], &["--weights", "f16"]].concat(),
    );
    let d32 = diff(&keep, &f32);
    eprintln!("reference f32 vs keep: max {} mean {}", d32.max, d32.mean);
    assert!(
        d32.max <= 3.0,
        "reference f32 vs keep: max {} mean {}",
        d32.max,
        d32.mean
    );
    let d16 = diff(&f32, &f16);
    eprintln!("reference f16 vs f32: max {} mean {}", d16.max, d16.mean);
    assert!(
        d16.max <= 0.4 && d16.same_argmax,
        "reference f16 vs f32: max {} mean {}",
        d16.max,
        d16.mean
    );
}

#[test]
fn dense_weights_are_close_to_quantized_ones_on_the_native_backend() {
    let Some(model) = smollm2() else { return };
    let dir = tempfile::tempdir().unwrap();
    let keep = prompt_logits(&model, dir.path(), "keep", &[]);
    for mode in ["f32", "f16"] {
        let dense = prompt_logits(&model, dir.path(), mode, &["--weights", mode]);
        let d = diff(&keep, &dense);
        eprintln!("native {mode} vs keep: max {} mean {}", d.max, d.mean);
        assert!(
            d.max <= 3.0 && d.mean <= 0.5 && d.same_argmax,
            "native {mode} vs keep: max {} mean {} same argmax {}",
            d.max,
            d.mean,
            d.same_argmax
        );
    }
}

#[test]
fn dense_weights_are_reported_and_refused_when_streaming() {
    let Some(model) = smollm2() else { return };
    let out = flatrun()
        .arg("--model")
        .arg(&model)
        .args(["--prompt", "Hi", "-n", "2", "--weights", "f16"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr_of(&out));
    assert!(
        stderr_of(&out).contains("layers dequantized to f16"),
        "{}",
        stderr_of(&out)
    );
    let out = flatrun()
        .arg("--model")
        .arg(&model)
        .args([
            "--prompt",
            "Hi",
            "--weights",
            "f32",
            "--residency",
            "stream",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = stderr_of(&out);
    assert!(
        err.contains("--weights f32 needs --residency resident") && err.contains("hint:"),
        "{err}"
    );
    // A cap that cannot hold every layer is refused by the runtime, naming a layer.
    let out = flatrun()
        .arg("--model")
        .arg(&model)
        .args([
            "--prompt",
            "Hi",
            "--weights",
            "f16",
            "--residency",
            "cap=20M",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr_of(&out).contains("streams layer"),
        "{}",
        stderr_of(&out)
    );
}

#[test]
fn the_full_layer_range_equals_the_default() {
    let Some(model) = smollm2() else { return };
    let dir = tempfile::tempdir().unwrap();
    let all = prompt_logits(&model, dir.path(), "all", &[]);
    let range = prompt_logits(&model, dir.path(), "range", &["--layers", "0-29"]);
    assert_eq!(all.2, range.2, "--layers 0-29 must equal the default");
}

#[test]
fn a_layer_subset_changes_logits_and_reads_only_its_layers() {
    let Some(model) = smollm2() else { return };
    let dir = tempfile::tempdir().unwrap();
    let all = prompt_logits(&model, dir.path(), "all", &[]);
    let first = prompt_logits(&model, dir.path(), "first", &["--layers", "0-11"]);
    assert!(
        diff(&all, &first).max > 1.0,
        "a subset should change the logits"
    );

    // Streamed, every step acquires the layers it runs: the per-layer table
    // shows bytes for 0-3 and 8-11 only, and the others as skipped.
    let out = flatrun()
        .arg("--model")
        .arg(&model)
        .args([
            "--prompt",
            "Hello there",
            "-n",
            "3",
            "--residency",
            "stream",
            "--layers",
            "0-3,8-11",
            "--profile-detailed",
        ])
        .output()
        .unwrap();
    let err = stderr_of(&out);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("layers:    0-3,8-11 only (8 of 30)"), "{err}");
    let header = err
        .lines()
        .find(|l| l.trim_start().starts_with("layer") && l.contains("io_wait"))
        .unwrap_or_else(|| panic!("no per-layer table:\n{err}"));
    assert!(
        header.contains("total") && header.contains("MB read"),
        "{header}"
    );
    let mut ran = 0;
    for il in 0..30 {
        let row = err
            .lines()
            .find(|l| l.split_whitespace().next() == Some(&il.to_string()))
            .unwrap_or_else(|| panic!("no row for layer {il}:\n{err}"));
        let runs = il <= 3 || (8..=11).contains(&il);
        if runs {
            // "MB read" is the last column, or the one before "KV MB" (a
            // KV cache in a file: stream mode).
            let cells: Vec<&str> = row.split_whitespace().collect();
            let at = cells.len() - if header.ends_with("KV MB") { 2 } else { 1 };
            let mb: f64 = cells[at].parse().unwrap();
            assert!(mb > 1.0, "layer {il} read nothing: {row}");
            // The streamed KV cache paged its keys and values (the column
            // shows once some layer did; a short prompt's are kilobytes).
            assert!(header.ends_with("KV MB"), "{header}");
            ran += 1;
        } else {
            assert!(
                row.contains("skipped"),
                "layer {il} should be skipped: {row}"
            );
        }
    }
    assert_eq!(ran, 8);
}

#[test]
fn bad_layer_ranges_are_refused() {
    let Some(model) = smollm2() else { return };
    for (range, needle) in [
        ("0-30", "names layer 30, but the model has 30 layers"),
        ("5-2", "not a layer range"),
        ("a", "not a layer range"),
    ] {
        let out = flatrun()
            .arg("--model")
            .arg(&model)
            .args(["--prompt", "Hi", "--layers", range])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(1), "{range}");
        let err = stderr_of(&out);
        assert!(err.contains(needle), "{range}: {err}");
        assert!(err.lines().count() <= 2, "{err}");
        assert!(stdout_of(&out).is_empty());
    }
}

#[test]
fn profile_detailed_adds_a_per_layer_table() {
    let Some(model) = smollm2() else { return };
    let out = flatrun()
        .arg("--model")
        .arg(&model)
        .args(["--prompt", "Hi", "-n", "2", "--profile-detailed"])
        .output()
        .unwrap();
    let err = stderr_of(&out);
    assert!(out.status.success(), "{err}");
    // The summary, then one row per layer and a totals row.
    assert!(err.contains("I/O wait share"), "{err}");
    let header = err
        .lines()
        .find(|l| l.trim_start().starts_with("layer") && l.contains("io_wait"))
        .unwrap_or_else(|| panic!("no per-layer table:\n{err}"));
    assert!(
        header.contains("matmul") || header.contains("attention"),
        "{header}"
    );
    assert!(
        err.lines().any(|l| l.trim_start().starts_with("29 ")),
        "{err}"
    );
    assert!(
        err.lines().any(|l| l.trim_start().starts_with("all ")),
        "{err}"
    );
    // --profile alone has no per-layer table.
    let out = flatrun()
        .arg("--model")
        .arg(&model)
        .args(["--prompt", "Hi", "-n", "2", "--profile"])
        .output()
        .unwrap();
    assert!(!stderr_of(&out).contains("MB read"));
}
