//! `flatrun quantize` against llama-quantize's output for the synthetic
//! llama3 F16 GGUF (tests/golden/quantize, made by
//! scripts/gen_quantize_golden.sh): every tensor's type and bytes, per mix.

mod common;
// The synthetic llama3 file is the one tests/families.rs checks: the same
// generator, regenerated when missing or stale, sha256-checked against its manifest.
#[allow(dead_code)]
#[path = "../../flatrun-runtime/tests/common/synthetic.rs"]
mod synthetic;

use common::{flatrun, stderr_of};
use flatrun_format::{GgufBackend, StorageBackend};
use std::collections::BTreeMap;
use std::path::PathBuf;

/// The checksum of scripts/gen_quantize_golden.sh.
fn checksum(bytes: &[u8]) -> u64 {
    bytes.iter().enumerate().fold(0u64, |h, (i, &b)| {
        let w = (i as u64).wrapping_mul(0x9E37_79B1).wrapping_add(1);
        h.wrapping_add(u64::from(b).wrapping_mul(w))
    })
}

#[test]
#[cfg_attr(debug_assertions, ignore = "release only: quantizes a 40 MB model")]
fn every_mix_matches_llama_quantize_tensor_for_tensor() {
    let families = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../flatrun-runtime/tests/fixtures/families");
    let Some(input) = synthetic::synthetic_model(
        "llama3-synth-f16.gguf",
        &families,
        "gen_synthetic_models.py",
    ) else {
        return;
    };
    let golden = std::fs::read_to_string(
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("tests/golden/quantize/llama3-synth-f16.txt"),
    )
    .unwrap();
    let mut want: BTreeMap<&str, Vec<(&str, &str, &str)>> = BTreeMap::new();
    for line in golden.lines().filter(|l| !l.starts_with('#')) {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f[1] != "-" {
            want.entry(f[0]).or_default().push((f[1], f[2], f[3]));
        }
    }
    assert!(want.len() >= 9, "golden file lists {} mixes", want.len());
    let dir = tempfile::tempdir().unwrap();
    let mut failures = Vec::new();
    for (mix, tensors) in &want {
        let out = dir.path().join(format!("{mix}.gguf"));
        let run = flatrun()
            .args(["quantize", "-q"])
            .arg(&input)
            .arg(&out)
            .arg(mix)
            .output()
            .unwrap();
        assert!(run.status.success(), "{mix}: {}", stderr_of(&run));
        let gguf = GgufBackend::open(&out).unwrap();
        assert_eq!(gguf.tensors().len(), tensors.len(), "{mix}");
        for (name, ty, sum) in tensors {
            let info = gguf
                .tensors()
                .iter()
                .find(|t| t.original_name == *name)
                .unwrap_or_else(|| panic!("{mix}: no {name}"));
            let handle = gguf.tensor(&info.name).unwrap();
            let got_ty = match info.quant {
                flatrun_format::QuantDescriptor::Ggml(t) => t.to_string(),
                _ => format!("{:?}", info.dtype),
            };
            let got = format!("{:016x}", checksum(handle.bytes()));
            if !got_ty.eq_ignore_ascii_case(ty)
                && !format!("Ggml({ty})").eq_ignore_ascii_case(&got_ty)
            {
                failures.push(format!("{mix} {name}: type {got_ty}, llama-quantize {ty}"));
            } else if got != *sum {
                failures.push(format!("{mix} {name}: {ty} bytes differ"));
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
fn unknown_types_and_non_gguf_inputs_are_one_line_errors() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("in.gguf");
    std::fs::write(&input, b"not a gguf").unwrap();
    let out = dir.path().join("out.gguf");
    for (mix, needle) in [
        ("Q7_X", "unknown quantization type"),
        ("Q4_K_M", "cannot read"),
    ] {
        let run = flatrun()
            .arg("quantize")
            .arg(&input)
            .arg(&out)
            .arg(mix)
            .output()
            .unwrap();
        assert_eq!(run.status.code(), Some(1));
        let err = stderr_of(&run);
        assert!(err.contains(needle), "{err}");
        assert!(err.trim_end().lines().count() <= 2, "{err}");
        assert!(!out.exists());
    }
}
