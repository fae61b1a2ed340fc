//! Property tests: arbitrary bytes and mutated real headers never panic the
//! GGUF or SafeTensors parsers (they return `Ok` or a typed error).

mod common;

use std::path::Path;

use common::safetensors_writer::{pattern, safetensors_bytes};
use flatrun_format::{gguf, safetensors_backend};
use proptest::prelude::*;

fn parse_gguf(bytes: &[u8]) {
    let path = Path::new("prop.gguf");
    if let Ok(h) = gguf::parse_header(path, bytes) {
        let _ = gguf::check_tensor_extents(path, &h.tensors, bytes.len() as u64);
    }
}

fn parse_safetensors(bytes: &[u8]) {
    let _ = safetensors_backend::parse_header(Path::new("prop.safetensors"), bytes);
}

/// The synthetic fixture plus, when present, the whole header (1.8 MB) of a real
/// model (read once).
fn gguf_seeds() -> &'static [Vec<u8>] {
    static SEEDS: std::sync::OnceLock<Vec<Vec<u8>>> = std::sync::OnceLock::new();
    SEEDS.get_or_init(read_gguf_seeds)
}

fn read_gguf_seeds() -> Vec<Vec<u8>> {
    use std::io::Read;
    let mut seeds = vec![std::fs::read(common::fixture("synthetic.gguf")).unwrap()];
    let models = std::env::var_os("FLATRUN_MODELS")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            std::path::PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
                .join(".cache/flatrun/models")
        });
    if let Ok(file) = std::fs::File::open(models.join("SmolLM2-135M-Instruct.Q4_1.gguf")) {
        let mut prefix = Vec::new();
        if file.take(1_800_000).read_to_end(&mut prefix).is_ok() {
            seeds.push(prefix);
        }
    }
    seeds
}

/// A mutation: overwrite, insert or delete bytes at a position.
#[derive(Debug, Clone)]
enum Mutation {
    Set(usize, u8),
    SetU64(usize, u64),
    Insert(usize, u8),
    Truncate(usize),
}

fn apply(mut bytes: Vec<u8>, mutations: &[Mutation]) -> Vec<u8> {
    for m in mutations {
        let len = bytes.len().max(1);
        match *m {
            Mutation::Set(i, b) => {
                if let Some(x) = bytes.get_mut(i % len) {
                    *x = b;
                }
            }
            Mutation::SetU64(i, v) => {
                let i = i % len;
                for (k, b) in v.to_le_bytes().iter().enumerate() {
                    if let Some(x) = bytes.get_mut(i + k) {
                        *x = *b;
                    }
                }
            }
            Mutation::Insert(i, b) => bytes.insert(i % len.min(bytes.len() + 1).max(1), b),
            Mutation::Truncate(i) => bytes.truncate(i % len),
        }
    }
    bytes
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Mutation::Set(i, b)),
        (
            any::<usize>(),
            prop_oneof![any::<u64>(), Just(u64::MAX), Just(1 << 60), 0u64..64]
        )
            .prop_map(|(i, v)| Mutation::SetU64(i, v)),
        (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Mutation::Insert(i, b)),
        any::<usize>().prop_map(Mutation::Truncate),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn gguf_arbitrary_bytes(mut bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        parse_gguf(&bytes);
        // Also with a valid magic and version so the parser gets further.
        let mut prefixed = b"GGUF\x03\x00\x00\x00".to_vec();
        prefixed.append(&mut bytes);
        parse_gguf(&prefixed);
    }

    #[test]
    fn gguf_mutated_headers(seed in 0usize..2, mutations in proptest::collection::vec(mutation(), 1..6)) {
        let seeds = gguf_seeds();
        let bytes = apply(seeds[seed % seeds.len()].clone(), &mutations);
        parse_gguf(&bytes);
    }

    #[test]
    fn safetensors_arbitrary_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        parse_safetensors(&bytes);
        let mut prefixed = (bytes.len() as u64).to_le_bytes().to_vec();
        prefixed.extend_from_slice(&bytes);
        parse_safetensors(&prefixed);
    }

    #[test]
    fn safetensors_mutated_files(mutations in proptest::collection::vec(mutation(), 1..6)) {
        let valid = safetensors_bytes(
            &[
                ("model.layers.0.self_attn.q_proj.weight", "U32", vec![2, 4], pattern(32, 1)),
                ("model.layers.0.self_attn.q_proj.scales", "F16", vec![2, 1], pattern(4, 2)),
                ("model.layers.0.self_attn.q_proj.biases", "F16", vec![2, 1], pattern(4, 3)),
            ],
            &[("format", "mlx")],
        );
        parse_safetensors(&apply(valid, &mutations));
    }
}
