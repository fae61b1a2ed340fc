//! Hugging Face SafeTensors mixture-of-experts directories (experts stored
//! one tensor per expert and projection) against GGUFs of the same weights
//! (experts stacked), and through them against llama.cpp.
//!
//! `scripts/gen_hf_moe.py` writes the directories into `$FLATRUN_HF_CKPT`
//! (default `~/.cache/flatrun/hf-ckpt`; `setup-test-env.sh` runs it, and each
//! test reruns it for its variant, a no-op when the directory's stamp
//! matches) from the synthetic checkpoints of `gen_synthetic_moe.py`: the
//! f16 directories hold exactly the tensors of `<family>-synth-f16.gguf`,
//! the file `tests/moe.rs` checks against llama.cpp's logits; the bf16 and
//! f32 ones come with a GGUF of the same tensor types written by the same
//! script. Tensors are stored sorted by name, so one projection's experts are
//! neither adjacent nor in order in the file.
//!
//! Criteria: Flatrun on the directory gives Flatrun-on-the-GGUF's logits at
//! every teacher-forced position of the family's three fixture prompts
//! (arg-max identical everywhere, max |diff| ≤ 1e-4; measured: bit for bit)
//! and the same greedy continuation (ids, and text where the directory's
//! exported tokenizer is a faithful one), in `resident`, `stream`, `cap=`
//! (half the file) and a custom residency that streams every layer but the
//! first whole, native kernels, and resident with the reference kernels.
//! The f16 directories also meet `tests/moe.rs`'s bounds against llama.cpp
//! directly. A directory with an expert missing, an
//! expert of the wrong shape, or a `num_experts` that disagrees with its
//! tensors is refused with a typed error naming the tensor.
//!
//! Run in release mode: `cargo test --release -p flatrun-runtime --test hf_moe -- --nocapture`.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

use common::logits::{Bounds, LogitFixture, all_logits, teacher_forced};
use common::synthetic::{python, synthetic_dir, synthetic_model};
use flatrun_model::ModelError;
use flatrun_runtime::{BackendKind, LoadOptions, Manifest, Model, Residency, RuntimeError};
use serde_json::Value;

/// Serializes the generator: the tests of this binary run on parallel threads.
static GENERATOR: Mutex<()> = Mutex::new(());

/// Greedy tokens compared per variant.
const GREEDY_STEPS: usize = 24;

/// The bounds of `tests/moe.rs` for f16 files against llama.cpp.
const STRICT: Bounds = Bounds {
    argmax_share: 0.99,
    decisive_gap: 1.0,
    decisive_share: 0.99,
    top10_tolerance: 0.5,
    top10_share: 0.99,
    mean_tolerance: 0.05,
    min_positions: 100,
};

fn hf_root() -> PathBuf {
    std::env::var_os("FLATRUN_HF_CKPT")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
                .join(".cache/flatrun/hf-ckpt")
        })
}

/// The family of a variant (`qwen3moe-synth-bf16` → `qwen3moe`).
fn family(variant: &str) -> &str {
    variant.split('-').next().unwrap_or(variant)
}

/// The llama.cpp fixture of the family's f16 GGUF (its prompts are the
/// teacher-forced cases here too).
fn fixture(variant: &str) -> LogitFixture {
    LogitFixture::load(
        &common::fixtures()
            .join("moe")
            .join(format!("{}-synth-f16.logits.json", family(variant))),
    )
}

/// The variant's directory and the GGUF holding its weights, written when
/// missing or stale; `None` (after a skip message) without the python.
fn prepare(variant: &str) -> Option<(PathBuf, PathBuf)> {
    let f16_source = format!("{}-synth-f16.gguf", family(variant));
    // The f16 source, checked against the sha256 llama.cpp's fixtures were made from.
    let f16 = synthetic_model(
        &f16_source,
        &common::fixtures().join("moe"),
        "gen_synthetic_moe.py",
    )?;
    let py = python();
    let _guard = GENERATOR.lock().unwrap_or_else(|e| e.into_inner());
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../scripts/gen_hf_moe.py");
    let status = Command::new(&py)
        .arg(script)
        .arg("--out")
        .arg(hf_root())
        .arg("--synthetic")
        .arg(synthetic_dir())
        .arg("--only")
        .arg(variant)
        .status()
        .unwrap_or_else(|e| panic!("run gen_hf_moe.py: {e}"));
    assert!(status.success(), "gen_hf_moe.py failed for {variant}");
    let dir = hf_root().join(variant);
    assert!(dir.join("config.json").is_file(), "{}", dir.display());
    let gguf = if variant.contains("-f16") {
        f16
    } else {
        hf_root().join(format!("{variant}.gguf"))
    };
    Some((dir, gguf))
}

fn load(path: &Path, backend: BackendKind, residency: Residency) -> Model {
    let opts = LoadOptions {
        backend,
        residency,
        ..LoadOptions::default()
    };
    Model::load(path, opts).unwrap_or_else(|e| panic!("load {}: {e}", path.display()))
}

fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in row.iter().enumerate() {
        if x > row[best] {
            best = i;
        }
    }
    best as u32
}

/// Greedy decoding: the prompt in one step, then one token per step.
fn greedy(model: &mut Model, prompt: &[u32], steps: usize) -> Vec<u32> {
    let mut session = model.session();
    let mut logits = session.step(prompt).expect("prefill");
    let mut out = Vec::with_capacity(steps);
    for _ in 0..steps {
        let next = argmax(&logits);
        out.push(next);
        logits = session.step(&[next]).expect("decode");
    }
    out
}

/// The directory against its GGUF: teacher-forced logits at every position
/// of the fixture's prompts, and a greedy continuation (ids and text).
fn same_as_gguf(variant: &str, backend: BackendKind, residency: Residency) {
    let Some((dir, gguf)) = prepare(variant) else {
        return;
    };
    let fixture = fixture(variant);
    // Whether the directory's tokenizer.json is a faithful export of the
    // GGUF vocabulary, so that text (not only ids) can be compared: the Qwen2
    // vocabulary's is (as in `hf_parity.rs`). OLMoE's fixture vocabulary
    // names no pre-tokenizer (the GGUF splits digits off as llama.cpp's
    // default does, the export as GPT-2), and the export of Mixtral's
    // vocabulary-only SentencePiece file neither tokenizes nor decodes as
    // the GGUF does; the logits and greedy ids are of the fixture's token
    // ids either way.
    let exported = matches!(family(variant), "qwen3moe" | "qwen2moe");
    let mut hf = load(&dir, backend, residency);
    let mut reference = load(&gguf, backend, residency);
    let vocab = reference.executor().vocab_size();
    if let Residency::Custom(_) = residency {
        let streamed = (0..hf.config().n_layer)
            .filter(|&il| !hf.executor().residency().is_resident(il))
            .count();
        assert!(streamed > 0, "{variant}: no layer is streamed whole");
    }
    assert_eq!(hf.executor().vocab_size(), vocab);
    assert_eq!(
        hf.config().moe,
        reference.config().moe,
        "{variant}: MoE config"
    );
    let (mut positions, mut argmax_same, mut max_diff, mut bit_same) = (0, 0, 0f32, true);
    for case in &fixture.teacher_forced {
        let ours = all_logits(&mut hf, &case.tokens);
        let theirs = all_logits(&mut reference, &case.tokens);
        for (a, b) in ours.chunks_exact(vocab).zip(theirs.chunks_exact(vocab)) {
            positions += 1;
            argmax_same += usize::from(argmax(a) == argmax(b));
            for (x, y) in a.iter().zip(b) {
                max_diff = max_diff.max((x - y).abs());
                bit_same &= x.to_bits() == y.to_bits();
            }
        }
        // The directory's tokenizer.json gives the GGUF tokenizer's ids.
        if let Some(prompt) = case.prompt.as_ref().filter(|_| exported) {
            assert_eq!(
                hf.encode(prompt, true).expect("encode"),
                reference.encode(prompt, true).expect("encode"),
                "{variant}: tokenization of {prompt:?}"
            );
        }
    }
    let prompt = &fixture.teacher_forced[0].tokens;
    let ours = greedy(&mut hf, prompt, GREEDY_STEPS);
    let theirs = greedy(&mut reference, prompt, GREEDY_STEPS);
    let (text, reference_text) = (
        hf.decode(&ours).expect("decode"),
        reference.decode(&theirs).expect("decode"),
    );
    eprintln!(
        "{variant} [{backend:?}, {residency:?}] vs {}: arg-max {argmax_same}/{positions}, \
         max |diff| {max_diff:.2e} (bit-identical: {bit_same}), greedy {}/{GREEDY_STEPS} {text:?}",
        gguf.file_name().unwrap_or_default().to_string_lossy(),
        ours.iter().zip(&theirs).take_while(|(a, b)| a == b).count(),
    );
    assert!(positions >= 100, "{variant}: only {positions} positions");
    assert_eq!(argmax_same, positions, "{variant}: arg-max differs");
    assert!(max_diff <= 1e-4, "{variant}: max |diff| {max_diff}");
    assert_eq!(ours, theirs, "{variant}: greedy continuation differs");
    if exported {
        assert_eq!(text, reference_text, "{variant}: greedy text differs");
    }
}

/// A cap of half the file (for Qwen3-MoE it keeps the head and one layer
/// and streams two whole; for the others every layer and part of the head).
fn cap_of(variant: &str) -> Residency {
    let Some((_, gguf)) = prepare(variant) else {
        return Residency::Cap(32 << 20);
    };
    let bytes = std::fs::metadata(gguf).map_or(64 << 20, |m| m.len());
    Residency::Cap(bytes / 2)
}

/// Layer 0 kept, the other layers (and the head) streamed whole, as under a
/// cap (checked in [`same_as_gguf`]).
fn first_layer_kept(m: &Manifest) -> Vec<bool> {
    (0..m.layers.len()).map(|il| il == 0).collect()
}

/// Every residency of one variant, native kernels; the reference kernels resident.
macro_rules! variant {
    ($name:ident, $variant:literal) => {
        mod $name {
            use super::*;
            #[test]
            #[cfg_attr(debug_assertions, ignore = "needs a release build (--release)")]
            fn resident() {
                same_as_gguf($variant, BackendKind::Native, Residency::Resident);
            }
            #[test]
            #[cfg_attr(debug_assertions, ignore = "needs a release build (--release)")]
            fn stream() {
                same_as_gguf($variant, BackendKind::Native, Residency::Stream);
            }
            #[test]
            #[cfg_attr(debug_assertions, ignore = "needs a release build (--release)")]
            fn cap() {
                same_as_gguf($variant, BackendKind::Native, cap_of($variant));
            }
            #[test]
            #[cfg_attr(debug_assertions, ignore = "needs a release build (--release)")]
            fn layers_streamed_whole() {
                let residency = Residency::Custom(first_layer_kept);
                same_as_gguf($variant, BackendKind::Native, residency);
            }
            #[test]
            #[cfg_attr(debug_assertions, ignore = "needs a release build (--release)")]
            fn reference_kernels() {
                same_as_gguf($variant, BackendKind::Reference, Residency::Resident);
            }
        }
    };
}

variant!(qwen3moe_f16, "qwen3moe-synth-f16");
variant!(qwen3moe_f16_sharded, "qwen3moe-synth-f16-sharded");
variant!(qwen3moe_bf16, "qwen3moe-synth-bf16");
variant!(qwen3moe_f32, "qwen3moe-synth-f32");
variant!(qwen2moe_f16, "qwen2moe-synth-f16");
variant!(olmoe_f16, "olmoe-synth-f16");
variant!(mixtral_f16, "mixtral-synth-f16");

/// The f16 directories against llama.cpp's logits on the same weights
/// (`tests/moe.rs`'s fixture and bounds): SafeTensors to llama.cpp in one step.
#[test]
#[cfg_attr(debug_assertions, ignore = "needs a release build (--release)")]
fn f16_directories_against_llama_cpp() {
    for variant in [
        "qwen3moe-synth-f16",
        "qwen3moe-synth-f16-sharded",
        "qwen2moe-synth-f16",
        "olmoe-synth-f16",
        "mixtral-synth-f16",
    ] {
        let Some((dir, _)) = prepare(variant) else {
            return;
        };
        for residency in [Residency::Resident, Residency::Stream] {
            let mut model = load(&dir, BackendKind::Native, residency);
            let label = format!("{variant} [native, {residency:?}] vs llama.cpp");
            teacher_forced(&mut model, &fixture(variant), label, STRICT).assert_within();
        }
    }
}

/// In stream mode a decode step reads only the routed experts, each one
/// byte range per projection: per layer and token, `k` of the `n_expert`
/// experts' gate, up and down tensors.
#[test]
#[cfg_attr(debug_assertions, ignore = "needs a release build (--release)")]
fn streamed_decode_reads_only_the_routed_experts() {
    let variant = "qwen3moe-synth-bf16";
    let Some((dir, _)) = prepare(variant) else {
        return;
    };
    let mut model = load(&dir, BackendKind::Native, Residency::Stream);
    let moe = model.executor().config().moe.clone().expect("experts");
    let experts: u64 = model
        .executor()
        .manifest()
        .layers
        .iter()
        .flat_map(|l| &l.tensors)
        .filter(|t| t.role().is_some_and(|r| r.is_experts()))
        .map(|t| t.bytes)
        .sum();
    let token = fixture(variant).teacher_forced[0].tokens[0];
    model.session().step(&[token]).expect("one-token step");
    let read: u64 = model
        .executor()
        .profiler
        .layers
        .iter()
        .map(|l| l.expert_bytes_read)
        .sum();
    let want = experts * moe.n_expert_used as u64 / moe.n_expert as u64;
    eprintln!(
        "{variant}: one decode step read {read} of {experts} expert bytes (top-{} of {})",
        moe.n_expert_used, moe.n_expert
    );
    assert_eq!(read, want, "a decode step reads exactly the routed experts");
}

// ---------------------------------------------------------------- broken directories

/// One tensor of a safetensors file: name, dtype, shape, bytes.
type Tensor = (String, String, Vec<usize>, Vec<u8>);
/// A safetensors file's tensors, in file order.
type Tensors = Vec<Tensor>;

fn read_safetensors(path: &Path) -> Tensors {
    let bytes = std::fs::read(path).expect("read safetensors");
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Map<String, Value> =
        serde_json::from_slice(&bytes[8..8 + n]).expect("header JSON");
    let mut out: Vec<(usize, Tensor)> = header
        .into_iter()
        .filter(|(name, _)| name != "__metadata__")
        .map(|(name, v)| {
            let offsets: Vec<usize> = serde_json::from_value(v["data_offsets"].clone()).unwrap();
            let shape: Vec<usize> = serde_json::from_value(v["shape"].clone()).unwrap();
            let data = bytes[8 + n + offsets[0]..8 + n + offsets[1]].to_vec();
            let dtype = v["dtype"].as_str().unwrap().to_string();
            (offsets[0], (name, dtype, shape, data))
        })
        .collect();
    out.sort_by_key(|(offset, _)| *offset);
    out.into_iter().map(|(_, t)| t).collect()
}

fn write_safetensors(path: &Path, tensors: &Tensors) {
    let mut header = serde_json::Map::new();
    let mut offset = 0;
    for (name, dtype, shape, data) in tensors {
        header.insert(
            name.clone(),
            serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + data.len()]}),
        );
        offset += data.len();
    }
    let mut text = serde_json::to_vec(&header).unwrap();
    text.resize(text.len().div_ceil(8) * 8, b' ');
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&text);
    for (_, _, _, data) in tensors {
        out.extend_from_slice(data);
    }
    std::fs::write(path, out).expect("write safetensors");
}

/// A copy of the f16 Qwen3-MoE directory with its tensors and config edited.
fn broken(
    edit_tensors: impl FnOnce(&mut Tensors),
    edit_config: impl FnOnce(&mut Value),
) -> Option<tempfile::TempDir> {
    let (dir, _) = prepare("qwen3moe-synth-f16")?;
    let out = tempfile::tempdir().expect("tempdir");
    for file in [
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        std::fs::copy(dir.join(file), out.path().join(file)).expect("copy");
    }
    let mut config: Value =
        serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
    edit_config(&mut config);
    std::fs::write(out.path().join("config.json"), config.to_string()).unwrap();
    let mut tensors = read_safetensors(&dir.join("model.safetensors"));
    edit_tensors(&mut tensors);
    write_safetensors(&out.path().join("model.safetensors"), &tensors);
    Some(out)
}

fn load_error(dir: &Path) -> ModelError {
    match Model::load(dir, LoadOptions::default()) {
        Ok(_) => panic!("{} loaded", dir.display()),
        Err(RuntimeError::Model(e)) => e,
        Err(other) => panic!("not a model error: {other}"),
    }
}

#[test]
fn a_missing_expert_is_a_typed_error() {
    let Some(dir) = broken(
        |t| t.retain(|(name, ..)| name != "model.layers.1.mlp.experts.5.up_proj.weight"),
        |_| {},
    ) else {
        return;
    };
    match load_error(dir.path()) {
        ModelError::MissingTensor { tensor, .. } => {
            assert_eq!(tensor, "layers.1.ffn.up_exps.5")
        }
        other => panic!("unexpected error: {other}"),
    }
}

#[test]
fn an_expert_of_the_wrong_shape_is_a_typed_error() {
    let Some(dir) = broken(
        |t| {
            let (_, _, shape, data) = t
                .iter_mut()
                .find(|(name, ..)| name == "model.layers.2.mlp.experts.11.down_proj.weight")
                .expect("expert tensor");
            // Half its columns.
            let (rows, cols) = (shape[0], shape[1]);
            let row = cols * 2;
            *data = data
                .chunks_exact(row)
                .flat_map(|r| &r[..row / 2])
                .copied()
                .collect();
            *shape = vec![rows, cols / 2];
        },
        |_| {},
    ) else {
        return;
    };
    match load_error(dir.path()) {
        ModelError::BadShape { tensor, shape, .. } => {
            assert_eq!(tensor, "layers.2.ffn.down_exps.11");
            assert_eq!(shape, [128, 32]);
        }
        other => panic!("unexpected error: {other}"),
    }
}

#[test]
fn num_experts_disagreeing_with_the_tensors_is_a_typed_error() {
    // Fewer experts declared than stored.
    let Some(dir) = broken(|_| {}, |c| c["num_experts"] = 12.into()) else {
        return;
    };
    match load_error(dir.path()) {
        ModelError::ExtraExpert {
            tensor,
            expert,
            n_expert,
        } => {
            assert_eq!(
                (tensor.as_str(), expert, n_expert),
                ("layers.0.ffn.gate_exps.12", 12, 12)
            );
        }
        other => panic!("unexpected error: {other}"),
    }
    // More declared than stored.
    let Some(dir) = broken(|_| {}, |c| c["num_experts"] = 20.into()) else {
        return;
    };
    match load_error(dir.path()) {
        ModelError::MissingTensor { tensor, .. } => {
            assert_eq!(tensor, "layers.0.ffn.gate_exps.16")
        }
        other => panic!("unexpected error: {other}"),
    }
}
