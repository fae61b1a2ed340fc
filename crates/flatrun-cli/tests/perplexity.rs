//! `flatrun perplexity` on SmolLM2 and the GPL v3 text: llama-perplexity's
//! figure (a committed golden file), every residency mode giving the same
//! value, and a saved base file compared with the same model giving no
//! divergence.

mod common;

use common::{flatrun, smollm2, stderr_of, stdout_of};
use std::path::PathBuf;

fn data(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests")
        .join(name)
}

/// `(per-chunk line, final value, error)` of a llama-perplexity-style output.
fn parse(text: &str) -> (String, f64, f64) {
    let chunks = text
        .lines()
        .find(|l| l.starts_with("[1]"))
        .unwrap_or_else(|| panic!("no chunk line in:\n{text}"))
        .to_string();
    let fin = text
        .lines()
        .find_map(|l| l.strip_prefix("Final estimate: PPL = "))
        .unwrap_or_else(|| panic!("no final estimate in:\n{text}"));
    let mut parts = fin.split(" +/- ");
    let ppl = parts.next().unwrap().parse().unwrap();
    let err = parts.next().unwrap().trim().parse().unwrap();
    (chunks, ppl, err)
}

fn perplexity(model: &std::path::Path, extra: &[&str]) -> String {
    let out = flatrun()
        .arg("perplexity")
        .arg("--model")
        .arg(model)
        .arg("--file")
        .arg(data("data/gpl-3.txt"))
        .args(["--ctx", "128", "--chunks", "4", "-q"])
        .args(extra)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr_of(&out));
    stdout_of(&out)
}

#[test]
#[cfg_attr(debug_assertions, ignore = "release only: runs a real model")]
fn perplexity_matches_llama_perplexity_in_every_residency_mode() {
    let Some(model) = smollm2() else { return };
    let golden = std::fs::read_to_string(data(
        "golden/perplexity/SmolLM2-135M-Instruct.Q4_1.c128.n4.txt",
    ))
    .unwrap();
    let (_, want, want_err) = parse(&golden);
    let resident = perplexity(&model, &["--residency", "resident"]);
    let (chunks, got, err) = parse(&resident);
    assert_eq!(chunks.matches(',').count(), 4, "{resident}");
    // On 4 chunks of 128 tokens this model's figure moves by 1.4% between
    // llama.cpp's own two attention paths (23.32 with flash attention,
    // 23.65 without): the tolerance is that spread, not 0.1%, which holds
    // on longer runs (docs/cli.md).
    let rel = (got - want).abs() / want;
    assert!(rel < 0.015, "flatrun {got} vs llama-perplexity {want}");
    assert!(
        (err - want_err).abs() / want_err < 0.05,
        "error {err} vs {want_err}"
    );
    for mode in ["stream", "cap=40M"] {
        let other = perplexity(&model, &["--residency", mode]);
        assert_eq!(other, resident, "--residency {mode} differs from resident");
    }
}

#[test]
#[cfg_attr(debug_assertions, ignore = "release only: runs a real model")]
fn a_saved_base_compared_with_its_own_model_has_no_divergence() {
    let Some(model) = smollm2() else { return };
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("base.kld");
    let saved = perplexity(&model, &["--kl-divergence-base", base.to_str().unwrap()]);
    let (_, ppl, _) = parse(&saved);
    // The base file is llama.cpp's: magic, n_ctx, n_vocab, n_chunk, tokens, rows.
    let bytes = std::fs::read(&base).unwrap();
    assert_eq!(&bytes[..8], b"_logits_");
    let field = |i: usize| i32::from_le_bytes(bytes[8 + 4 * i..12 + 4 * i].try_into().unwrap());
    assert_eq!((field(0), field(1), field(2)), (128, 49152, 4));
    let rows = 4 * (128 - 1 - 64) * (49152 + 4);
    assert_eq!(bytes.len(), 20 + 4 * 128 * 4 + 2 * rows);

    let out = flatrun()
        .arg("perplexity")
        .arg("--model")
        .arg(&model)
        .args(["--kl-divergence", "--kl-divergence-base"])
        .arg(&base)
        .arg("-q")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr_of(&out));
    let text = stdout_of(&out);
    let value = |label: &str| -> f64 {
        text.lines()
            .find_map(|l| l.strip_prefix(label))
            .unwrap_or_else(|| panic!("no `{label}` in:\n{text}"))
            .trim_start_matches([' ', ':'])
            .split_whitespace()
            .next()
            .unwrap()
            .parse()
            .unwrap()
    };
    assert!((value("Mean PPL(Q)") - ppl).abs() / ppl < 1e-4, "{text}");
    // 16-bit log-probabilities: the base is the model up to rounding.
    assert!(value("Mean    KLD:").abs() < 1e-4, "{text}");
    assert!(value("Same top p:") > 99.0, "{text}");
}

#[test]
fn bad_inputs_are_one_line_errors() {
    let dir = tempfile::tempdir().unwrap();
    let not_base = dir.path().join("x.kld");
    std::fs::write(&not_base, "GGUF....").unwrap();
    let model = dir.path().join("m.gguf");
    std::fs::write(&model, "x").unwrap();
    let out = flatrun()
        .args(["perplexity", "--model"])
        .arg(&model)
        .args(["--kl-divergence", "--kl-divergence-base"])
        .arg(&not_base)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = stderr_of(&out);
    assert!(err.contains("not a log-probability file"), "{err}");
    assert!(err.trim_end().lines().count() <= 2, "{err}");
}
