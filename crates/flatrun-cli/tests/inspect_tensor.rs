//! `flatrun inspect --tensor NAME [--dump FILE.npy]` on a real model: the
//! decoded values agree with the `gguf` Python package's decoder.
//!
//! Expected values made with (gguf 0.17, the venv of scripts/setup-test-env.sh):
//! `gguf.quants.dequantize(t.data, t.tensor_type)` of `blk.0.attn_q.weight` in
//! SmolLM2-135M-Instruct.Q4_1.gguf → shape (576, 576), first values below,
//! min -4.78125, max 5.251953125, mean 0.00017850363144168146.

use std::path::PathBuf;

use assert_cmd::Command;

fn smollm2() -> Option<PathBuf> {
    let dir = std::env::var_os("FLATRUN_MODELS")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
                .join(".cache/flatrun/models")
        });
    let path = dir.join("SmolLM2-135M-Instruct.Q4_1.gguf");
    if path.is_file() {
        return Some(path);
    }
    if std::env::var("FLATRUN_REQUIRE_MODELS").as_deref() == Ok("1") {
        panic!("{} is missing and FLATRUN_REQUIRE_MODELS=1", path.display());
    }
    eprintln!("skipping: {} not found", path.display());
    None
}

#[allow(
    clippy::excessive_precision,
    reason = "the exact f16 values, as the gguf package prints them"
)]
const FIRST: [f32; 8] = [
    -0.0963134765625,
    0.1573486328125,
    -0.0963134765625,
    -0.73046875,
    1.1719970703125,
    -0.0963134765625,
    0.030517578125,
    0.6646728515625,
];

#[test]
#[allow(
    clippy::excessive_precision,
    reason = "the exact f16 values, as the gguf package prints them"
)]
fn tensor_stats_and_npy_dump_match_the_gguf_package() {
    let Some(model) = smollm2() else { return };
    let dir = tempfile::tempdir().unwrap();
    let npy = dir.path().join("q.npy");
    let out = Command::cargo_bin("flatrun")
        .unwrap()
        .arg("inspect")
        .arg(&model)
        .args(["--tensor", "layers.0.attn.q", "--json", "--dump"])
        .arg(&npy)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["original_name"], "blk.0.attn_q.weight");
    assert_eq!(v["dtype"], "Q4_1");
    assert_eq!(v["shape"], serde_json::json!([576, 576]));
    assert_eq!(v["min"].as_f64().unwrap() as f32, -4.78125f32);
    assert_eq!(v["max"].as_f64().unwrap() as f32, 5.251953125f32);
    assert!((v["mean"].as_f64().unwrap() - 0.00017850363144168146).abs() < 1e-9);
    let first: Vec<f32> = serde_json::from_value(v["first"].clone()).unwrap();
    assert_eq!(first, FIRST);

    // The .npy: a v1 header, then 576*576 little-endian f32 in row-major order.
    let bytes = std::fs::read(&npy).unwrap();
    assert_eq!(&bytes[..6], b"\x93NUMPY");
    let header_len = u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
    let header = std::str::from_utf8(&bytes[10..10 + header_len]).unwrap();
    assert!(
        header.contains("'descr': '<f4'") && header.contains("(576, 576)"),
        "{header}"
    );
    let data = &bytes[10 + header_len..];
    assert_eq!(data.len(), 576 * 576 * 4);
    for (i, want) in FIRST.iter().enumerate() {
        let got = f32::from_le_bytes(data[4 * i..4 * i + 4].try_into().unwrap());
        assert_eq!(got, *want);
    }
}

#[test]
fn unknown_tensor_is_a_clear_error() {
    let Some(model) = smollm2() else { return };
    let out = Command::cargo_bin("flatrun")
        .unwrap()
        .arg("inspect")
        .arg(&model)
        .args(["--tensor", "layers.99.attn.q"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("layers.99.attn.q"), "{err}");
}
