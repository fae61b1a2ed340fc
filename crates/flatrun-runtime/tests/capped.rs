//! Capped residency: the kept layers, the kept first rows of the head and the
//! streamed rest (read into buffers by the weight engine) give the same
//! logits, bit for bit, as a fully resident model — for one sequence and for
//! a batch of sequences stepped together (capped serving), whether the
//! streamed bytes are read around the page cache (`O_DIRECT`) or through it.

mod common;

use flatrun_runtime::{LoadOptions, Model, Residency, Sequence, StepOptions, StreamReads};

/// Logits of a prefill and two decode steps for each of `batch` sequences
/// stepped together (the decode steps), under `residency`, reading streamed
/// layers as `reads` says; also the head bytes kept.
fn logits(
    path: &std::path::Path,
    residency: Residency,
    reads: StreamReads,
    batch: usize,
) -> (Vec<Vec<f32>>, u64) {
    let mut model = Model::load(
        path,
        LoadOptions {
            residency,
            ctx: Some(64),
            stream_reads: reads,
            ..LoadOptions::default()
        },
    )
    .expect("load");
    let kept_head = model.executor().residency().output_kept_bytes;
    if let Residency::Cap(_) = residency {
        let forced = match reads {
            StreamReads::Direct => Some(false),
            StreamReads::PageCache => Some(true),
            StreamReads::Auto => None,
        };
        let path_taken = model.executor().streams_through_page_cache();
        assert!(path_taken.is_some(), "a cap must stream through the reader");
        if forced.is_some() {
            assert_eq!(path_taken, forced, "{reads:?} not in force");
        }
    }
    let ex = model.executor_mut();
    let mut seqs: Vec<Sequence> = (0..batch).map(|_| ex.new_sequence()).collect();
    let mut out = Vec::new();
    for (s, seq) in seqs.iter_mut().enumerate() {
        let prompt: Vec<u32> = (0..12u32).map(|i| 100 + 37 * i + s as u32).collect();
        out.push(
            ex.step(seq, &prompt, StepOptions::default())
                .expect("prefill")
                .logits,
        );
    }
    for t in [5u32, 9] {
        let inputs: Vec<[u32; 1]> = (0..batch).map(|s| [t + s as u32]).collect();
        let mut step: Vec<(&mut Sequence, &[u32])> = seqs
            .iter_mut()
            .zip(&inputs)
            .map(|(s, i)| (s, &i[..]))
            .collect();
        for o in ex
            .step_batch(&mut step, StepOptions::default())
            .expect("decode")
        {
            out.push(o.logits);
        }
    }
    (out, kept_head)
}

fn capped_logits_equal_resident(file: &str, cap: u64, batch: usize) {
    let Some(path) = common::model(file) else {
        return;
    };
    let (resident, _) = logits(&path, Residency::Resident, StreamReads::Auto, batch);
    for reads in [StreamReads::Direct, StreamReads::PageCache] {
        let (capped, kept_head) = logits(&path, Residency::Cap(cap), reads, batch);
        assert!(
            kept_head > 0,
            "{file}: cap {cap} should keep part of the head"
        );
        common::logits::assert_bit_identical(
            &capped,
            &resident,
            &format!("{file}: cap={cap} ({reads:?}) vs resident"),
        );
    }
}

#[test]
fn smollm2_capped_with_part_of_the_head_kept_equals_resident() {
    // 20 MiB: 7 of 30 layers and the first ~1 MiB of the 28.7 MiB head.
    capped_logits_equal_resident("SmolLM2-135M-Instruct.Q4_1.gguf", 20 << 20, 1);
}

#[test]
fn gemma3_capped_batch_with_part_of_the_head_kept_equals_resident() {
    // 80 MiB: every layer and ~7 MiB of the 170 MiB tied head; 3 sequences.
    capped_logits_equal_resident("gemma-3-270m-q4_k_m.gguf", 80 << 20, 3);
}

/// A policy of the caller's own: every other layer kept.
fn even_layers(m: &flatrun_runtime::Manifest) -> Vec<bool> {
    m.layers.iter().map(|l| l.index % 2 == 0).collect()
}

#[test]
fn custom_policy_keeps_the_chosen_layers_and_equals_resident() {
    let Some(path) = common::model("SmolLM2-135M-Instruct.Q4_1.gguf") else {
        return;
    };
    let model = Model::load(
        &path,
        LoadOptions {
            residency: Residency::Custom(even_layers),
            ctx: Some(64),
            ..LoadOptions::default()
        },
    )
    .expect("load");
    let plan = model.executor().residency();
    let expected: Vec<bool> = (0..plan.resident.len()).map(|i| i % 2 == 0).collect();
    assert_eq!(
        plan.resident, expected,
        "the plan keeps exactly the chosen layers"
    );
    assert!(!plan.output_resident && plan.streamed_bytes_per_token > 0);
    drop(model);
    let (custom, _) = logits(&path, Residency::Custom(even_layers), StreamReads::Auto, 2);
    let (resident, _) = logits(&path, Residency::Resident, StreamReads::Auto, 2);
    common::logits::assert_bit_identical(&custom, &resident, "custom policy vs resident");
}

/// `residency` gives the resident logits bit for bit on the checkpoint at
/// `path` (one sequence and a batch of two), reading streamed weights
/// around and through the page cache.
fn residency_equals_resident(path: &std::path::Path, residency: Residency, what: &str) {
    for batch in [1, 2] {
        let (resident, _) = logits(path, Residency::Resident, StreamReads::Auto, batch);
        for reads in [StreamReads::Direct, StreamReads::PageCache] {
            let (other, _) = logits(path, residency, reads, batch);
            common::logits::assert_bit_identical(
                &other,
                &resident,
                &format!("{what}: {residency:?} ({reads:?}), batch {batch} vs resident"),
            );
        }
    }
}

/// The synthetic Qwen3.5 checkpoint (written by its generator when missing).
fn qwen35() -> Option<std::path::PathBuf> {
    common::synthetic::synthetic_model(
        "qwen35-synth-q8_0.gguf",
        &common::fixtures().join("qwen35"),
        "gen_synthetic_qwen35.py",
    )
}

#[test]
#[cfg_attr(debug_assertions, ignore = "needs a release build (--release)")]
fn qwen35_capped_equals_resident() {
    // Recurrent delta-net layers and gated attention: every other layer
    // streamed whole through the read buffers (the rest kept), and a cap of
    // half the file.
    let Some(path) = qwen35() else { return };
    residency_equals_resident(&path, Residency::Custom(even_layers), "qwen35");
    let bytes = std::fs::metadata(&path).expect("size").len();
    residency_equals_resident(&path, Residency::Cap(bytes / 2), "qwen35");
}

#[test]
#[cfg_attr(debug_assertions, ignore = "needs a release build (--release)")]
fn qwen35_streamed_equals_resident() {
    let Some(path) = qwen35() else { return };
    residency_equals_resident(&path, Residency::Stream, "qwen35");
}

/// The MLX checkpoint `name` under `$FLATRUN_MLX_CKPT` (made by
/// `scripts/gen_mlx_checkpoints.py`), or `None` after a skip message
/// unless `FLATRUN_REQUIRE_MODELS=1`.
fn mlx_checkpoint(name: &str) -> Option<std::path::PathBuf> {
    let dir = std::env::var_os("FLATRUN_MLX_CKPT")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            std::path::PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
                .join(".cache/flatrun/mlx-ckpt")
        })
        .join(name);
    if dir.join(".done").exists() {
        return Some(dir);
    }
    assert!(
        !common::synthetic::require_models(),
        "{} is missing and FLATRUN_REQUIRE_MODELS=1",
        dir.display()
    );
    eprintln!("skipping: {} not found", dir.display());
    None
}

#[test]
#[cfg_attr(debug_assertions, ignore = "needs a release build (--release)")]
fn mlx_capped_and_streamed_equal_resident() {
    // MLX weights carry their scales and biases as companion arrays; streamed
    // chunks and layers read all three from the files.
    let Some(dir) = mlx_checkpoint("smollm2-135m-mlx-q4") else {
        return;
    };
    residency_equals_resident(&dir, Residency::Stream, "smollm2 mlx");
    residency_equals_resident(&dir, Residency::Cap(24 << 20), "smollm2 mlx");
}
