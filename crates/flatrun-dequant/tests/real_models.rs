//! Whole tensors of the real models (and, when present, of the files
//! requantized with the reference `llama-quantize`) decode to exactly the
//! values of ggml's `dequantize_row_*`: checksums in
//! `tests/fixtures/tensors.txt`.
//!
//! Real models come from `$FLATRUN_MODELS`; a missing model skips, unless
//! `FLATRUN_REQUIRE_MODELS=1`. Requantized files come from
//! `$FLATRUN_REQUANT` (default `~/.cache/flatrun/requant`, made by
//! `scripts/gen_dequant_fixtures.py fixtures`) and are skipped when absent.

mod common;

use std::collections::BTreeMap;
use std::path::PathBuf;

use common::*;
use flatrun_dequant::{GgmlType, dequantize_rows, row_bytes};

const REAL_MODELS: &[&str] = &[
    "SmolLM2-135M-Instruct.Q4_1.gguf",
    "gemma-3-270m-q4_k_m.gguf",
    "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
];

fn requant_dir() -> PathBuf {
    std::env::var_os("FLATRUN_REQUANT")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
                .join(".cache/flatrun/requant")
        })
}

/// Decode one tensor in chunks of rows and checksum it.
fn tensor_checksum(file: &mut std::fs::File, t: &gguf::GgufTensor, ty: GgmlType) -> u64 {
    let row_len = t.ne[0] as usize;
    let n_rows: usize = t.ne[1..].iter().product::<u64>() as usize;
    let rb = row_bytes(ty, row_len).unwrap();
    let rows_per_chunk = ((1 << 20) / row_len).max(1);
    let mut sum = 0u64;
    let mut out = vec![0f32; rows_per_chunk * row_len];
    let mut row = 0;
    while row < n_rows {
        let rows = rows_per_chunk.min(n_rows - row);
        let bytes = gguf::read_at(file, t.offset + (row * rb) as u64, rows * rb);
        let out = &mut out[..rows * row_len];
        dequantize_rows(ty, &bytes, row_len, 0..rows, out).unwrap();
        sum = sum.wrapping_add(checksum_f32(out, (row * row_len) as u64));
        row += rows;
    }
    sum
}

#[test]
fn whole_tensors_match_ggml() {
    let recs = records("tensors.txt", "tensor");
    let mut by_file: BTreeMap<String, Vec<&Vec<String>>> = BTreeMap::new();
    for r in &recs {
        by_file.entry(r[0].clone()).or_default().push(r);
    }
    let mut checked_types = std::collections::BTreeSet::new();
    for (file, recs) in &by_file {
        let is_real = REAL_MODELS.contains(&file.as_str());
        let path = if is_real {
            models_dir().join(file)
        } else {
            requant_dir().join(file)
        };
        if !path.exists() {
            if is_real && require_models() {
                panic!("{} missing and FLATRUN_REQUIRE_MODELS=1", path.display());
            }
            eprintln!("skip: {} not present", path.display());
            continue;
        }
        let tensors = gguf::tensors(&path);
        let mut f = std::fs::File::open(&path).unwrap();
        for r in recs {
            let (name, ty) = (&r[1], ggml_type(&r[2]));
            let expected = u64::from_str_radix(&r[4], 16).unwrap();
            let t = tensors
                .iter()
                .find(|t| &t.name == name)
                .unwrap_or_else(|| panic!("{file}: no {name}"));
            assert_eq!(t.type_id, ty.id(), "{file} {name}: type");
            let got = tensor_checksum(&mut f, t, ty);
            assert_eq!(
                got, expected,
                "{file} {name} ({ty}): checksum {got:016x}, ggml {expected:016x}"
            );
            checked_types.insert(ty);
        }
        eprintln!("{file}: {} tensors bit-exact", recs.len());
    }
    eprintln!("types checked on whole tensors: {checked_types:?}");
}
