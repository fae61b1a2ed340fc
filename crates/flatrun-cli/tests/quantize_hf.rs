//! `flatrun quantize DIR OUT Q4_K_M` on Hugging Face SafeTensors directories
//! against llama.cpp's own tools on the same directory
//! (`convert_hf_to_gguf.py --outtype f16`, then Q4_K_M; the goldens in
//! tests/golden/quantize/*-Q4_K_M.txt, made by
//! scripts/gen_hf_quantize_golden.sh): every tensor's name, type and bytes,
//! and the logits of a fixed prompt through the converted file.

mod common;

use common::{flatrun, hf_checkpoint, stderr_of};
use flatrun_format::{GgufBackend, QuantDescriptor, StorageBackend};
use sha2::{Digest, Sha256};
use std::path::PathBuf;

/// The checksum of scripts/gen_quantize_golden.sh.
fn checksum(bytes: &[u8]) -> u64 {
    bytes.iter().enumerate().fold(0u64, |h, (i, &b)| {
        let w = (i as u64).wrapping_mul(0x9E37_79B1).wrapping_add(1);
        h.wrapping_add(u64::from(b).wrapping_mul(w))
    })
}

fn check(variant: &str) {
    let Some(dir) = hf_checkpoint(variant) else {
        return;
    };
    let golden_path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join(format!("tests/golden/quantize/{variant}-Q4_K_M.txt"));
    let golden = std::fs::read_to_string(&golden_path).unwrap();
    let work = tempfile::tempdir().unwrap();
    let out = work.path().join("q.gguf");
    let run = flatrun()
        .args(["quantize", "-q"])
        .arg(&dir)
        .arg(&out)
        .arg("Q4_K_M")
        .output()
        .unwrap();
    assert!(run.status.success(), "{}", stderr_of(&run));

    let gguf = GgufBackend::open(&out).unwrap();
    let mut failures = Vec::new();
    let mut want_logits = None;
    let mut listed = 0;
    for line in golden
        .lines()
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
    {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f[0] == "logits-sha256" {
            let prompt = line.split_once("prompt: ").map(|(_, p)| p.to_string());
            want_logits = Some((f[1].to_string(), prompt.unwrap()));
            continue;
        }
        listed += 1;
        let (name, ty, sum) = (f[0], f[1], f[2]);
        let Some(info) = gguf.tensors().iter().find(|t| t.original_name == name) else {
            failures.push(format!("{name}: missing"));
            continue;
        };
        let got_ty = match info.quant {
            QuantDescriptor::Ggml(t) => t.to_string(),
            _ => match info.dtype {
                flatrun_format::DType::Ggml(t) => t.to_string(),
                other => format!("{other:?}"),
            },
        };
        let got = format!(
            "{:016x}",
            checksum(gguf.tensor(&info.name).unwrap().bytes())
        );
        if !got_ty.eq_ignore_ascii_case(ty) {
            failures.push(format!("{name}: type {got_ty}, llama.cpp {ty}"));
        } else if got != sum {
            failures.push(format!("{name}: {ty} bytes differ"));
        }
    }
    assert_eq!(gguf.tensors().len(), listed, "tensor count");
    assert!(failures.is_empty(), "{variant}: {failures:#?}");

    if let Some((sha, prompt)) = want_logits {
        let npy = work.path().join("logits.npy");
        let run = flatrun()
            .args(["run", "--quiet", "--max-new", "0", "--threads", "1"])
            .arg("--model")
            .arg(&out)
            .args(["--prompt", &prompt])
            .arg("--dump-logits")
            .arg(&npy)
            .output()
            .unwrap();
        assert!(run.status.success(), "{}", stderr_of(&run));
        let got = format!("{:x}", Sha256::digest(std::fs::read(&npy).unwrap()));
        assert_eq!(
            got, sha,
            "{variant}: logits differ from those of llama.cpp's conversion"
        );
    }
}

#[test]
#[cfg_attr(debug_assertions, ignore = "release only: quantizes a 135M model")]
fn smollm2_matches_llama_cpp_conversion() {
    check("smollm2-135m-f16");
}

#[test]
#[ignore = "slow (a 0.5B model, ~30 s): run on demand with --ignored"]
fn qwen2_matches_llama_cpp_conversion() {
    check("qwen2.5-coder-0.5b-f16");
}

#[test]
#[ignore = "slow (a 270M model with a 262k vocabulary): run on demand with --ignored"]
fn gemma3_matches_llama_cpp_conversion() {
    check("gemma-3-270m-f16");
}

#[test]
fn a_directory_without_a_checkpoint_is_a_one_line_error() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.gguf");
    let run = flatrun()
        .arg("quantize")
        .arg(dir.path())
        .arg(&out)
        .arg("Q4_K_M")
        .output()
        .unwrap();
    assert_eq!(run.status.code(), Some(1));
    let err = stderr_of(&run);
    assert!(err.contains("cannot read"), "{err}");
    assert!(err.trim_end().lines().count() <= 2, "{err}");
    assert!(!out.exists());
}
