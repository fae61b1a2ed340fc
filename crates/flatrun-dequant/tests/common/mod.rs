//! Helpers shared by the integration tests: the deterministic generators and
//! checksums of `scripts/gen_dequant_fixtures.py`, and fixture parsing.
#![allow(dead_code)]

pub mod gguf;

use std::path::PathBuf;

use flatrun_dequant::GgmlType;

/// splitmix64, as `SplitMix64` in the generator script.
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        let mut out = Vec::with_capacity(n + 8);
        while out.len() < n {
            out.extend_from_slice(&self.next_u64().to_le_bytes());
        }
        out.truncate(n);
        out
    }
}

/// Position-weighted sum of f32 bit patterns (NaN counted as 0x7FC00000),
/// starting at position `start`.
pub fn checksum_f32(values: &[f32], start: u64) -> u64 {
    let mut sum = 0u64;
    for (i, v) in values.iter().enumerate() {
        let bits = if v.is_nan() { 0x7FC0_0000 } else { v.to_bits() } as u64;
        let w = (start + i as u64).wrapping_mul(2).wrapping_add(1);
        sum = sum.wrapping_add(bits.wrapping_mul(w));
    }
    sum
}

/// Position-weighted sum of bytes.
pub fn checksum_bytes(bytes: &[u8]) -> u64 {
    let mut sum = 0u64;
    for (i, &b) in bytes.iter().enumerate() {
        sum = sum.wrapping_add((b as u64).wrapping_mul(2 * i as u64 + 1));
    }
    sum
}

/// `test_inputs(seed, n_chunks)` of the generator script.
pub fn test_inputs(seed: u64, n_chunks: usize) -> Vec<f32> {
    let mut rng = SplitMix64(seed);
    let mut out = vec![0f32; n_chunks * 256];
    for c in 0..n_chunks {
        let scale = 2f32.powi((c % 17) as i32 - 8);
        let chunk = &mut out[c * 256..(c + 1) * 256];
        for x in chunk.iter_mut() {
            let u = (rng.next_u64() >> 40) as f32 / 16_777_216.0;
            *x = (u * 2.0 - 1.0) * scale;
        }
        match c % 8 {
            3 => chunk.fill(0.0),
            5 => chunk.fill(0.375 * scale),
            6 => {
                chunk.fill(0.0);
                chunk[(c * 37) % 256] = -scale;
            }
            7 => chunk.iter_mut().for_each(|x| *x = -x.abs()),
            _ => {}
        }
    }
    out
}

pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests")
        .join("fixtures")
        .join(name)
}

/// The GGML type named as ggml prints it.
pub fn ggml_type(name: &str) -> GgmlType {
    *GgmlType::ALL
        .iter()
        .find(|t| t.to_string() == name)
        .unwrap_or_else(|| panic!("unknown type {name}"))
}

pub fn hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
        .collect()
}

pub fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// Lines of a fixture file starting with `kind `, split on whitespace.
pub fn records(file: &str, kind: &str) -> Vec<Vec<String>> {
    let text = std::fs::read_to_string(fixture(file)).expect("fixture file");
    text.lines()
        .filter(|l| l.split_whitespace().next() == Some(kind))
        .map(|l| l.split_whitespace().skip(1).map(str::to_owned).collect())
        .collect()
}

/// `$FLATRUN_MODELS` (default `~/.cache/flatrun/models`).
pub fn models_dir() -> PathBuf {
    std::env::var_os("FLATRUN_MODELS")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
                .join(".cache/flatrun/models")
        })
}

/// Whether missing models fail the test (`FLATRUN_REQUIRE_MODELS=1`).
pub fn require_models() -> bool {
    std::env::var("FLATRUN_REQUIRE_MODELS")
        .map(|v| v == "1")
        .unwrap_or(false)
}

/// Bit equality with every NaN equal.
pub fn same_bits(a: f32, b: f32) -> bool {
    (a.is_nan() && b.is_nan()) || a.to_bits() == b.to_bits()
}
