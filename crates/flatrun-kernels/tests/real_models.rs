//! Native against reference on tensors of the real models (skipped when a model is missing,
//! unless FLATRUN_REQUIRE_MODELS=1).

mod common;

use std::path::PathBuf;

use common::Rng;
use flatrun_format::{GgmlType, StorageBackend};
use flatrun_kernels::{
    Kernels, NativeKernels, ReferenceKernels, Weight, WeightFormat, supported_levels,
};

fn models_dir() -> PathBuf {
    std::env::var_os("FLATRUN_MODELS")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let home = std::env::var_os("HOME")
                .map(PathBuf::from)
                .unwrap_or_default();
            home.join(".cache/flatrun/models")
        })
}

fn open(name: &str) -> Option<Box<dyn StorageBackend>> {
    let path = models_dir().join(name);
    if !path.exists() {
        if std::env::var("FLATRUN_REQUIRE_MODELS").as_deref() == Ok("1") {
            panic!("{} is missing and FLATRUN_REQUIRE_MODELS=1", path.display());
        }
        eprintln!("skipping: {} not found", path.display());
        return None;
    }
    Some(flatrun_format::open(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())))
}

/// For each GGML type in the model, its first matrix: 48 rows × 3 tokens, native vs reference.
fn check_model(name: &str) {
    let Some(model) = open(name) else { return };
    let mut seen: Vec<GgmlType> = Vec::new();
    let mut rng = Rng(3);
    for info in model.tensors() {
        let h = model.tensor(&info.name).unwrap();
        let Ok(w) = Weight::from_handle(&h) else {
            continue;
        };
        let WeightFormat::Ggml(t) = w.format else {
            continue;
        };
        if w.rows < 2 || seen.contains(&t) {
            continue;
        }
        seen.push(t);
        let w = w.row_range(0..w.rows.min(48)).unwrap();
        let n = 3;
        let x: Vec<f32> = (0..n * w.cols).map(|_| rng.f32()).collect();
        let mut dense = vec![0f32; w.rows * w.cols];
        ReferenceKernels
            .dequantize_rows(&w, 0..w.rows, &mut dense)
            .unwrap();
        let mut want = vec![0f32; n * w.rows];
        ReferenceKernels.matmul(&w, &x, n, &mut want).unwrap();
        for level in supported_levels() {
            let mut got = vec![0f32; n * w.rows];
            NativeKernels::new(level)
                .matmul(&w, &x, n, &mut got)
                .unwrap();
            for tok in 0..n {
                for r in 0..w.rows {
                    let mag: f32 = (0..w.cols)
                        .map(|c| (dense[r * w.cols + c] * x[tok * w.cols + c]).abs())
                        .sum();
                    let (g, e) = (got[tok * w.rows + r], want[tok * w.rows + r]);
                    assert!(
                        (g - e).abs() <= 5e-3 * mag + 1e-6,
                        "{name} {} ({t:?}) at {level}: token {tok} row {r}: {g} vs {e}",
                        info.name
                    );
                }
            }
        }
        println!(
            "{name}: {} ({:?}) [{} x {}] ok",
            info.name,
            t,
            h.shape()[0],
            w.cols
        );
    }
}

#[test]
fn smollm2_q4_1() {
    check_model("SmolLM2-135M-Instruct.Q4_1.gguf");
}

#[test]
fn qwen25_coder_q4_k_m() {
    check_model("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf");
}

#[test]
fn gemma3_q4_k_m() {
    check_model("gemma-3-270m-q4_k_m.gguf");
}
