//! KV cache rings and residency plans, without a model file.

use flatrun_model::arch::LayerKv;
use flatrun_model::manifest::{LayerEntry, TensorEntry};
use flatrun_model::{Manifest, ModelConfig, ModelError};
use flatrun_runtime::{KvCache, KvType, Residency, ResidencyPlan};

fn gemma_like() -> ModelConfig {
    ModelConfig::from_hf_json(&serde_json::json!({
        "model_type": "gemma3_text", "num_hidden_layers": 6, "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8, "sliding_window": 4,
        "max_position_embeddings": 64
    }))
    .unwrap()
}

#[test]
fn windowed_layers_use_a_ring_and_full_layers_fail_when_full() {
    let cfg = gemma_like();
    let mut kv = KvCache::new(&cfg, 16, 2, KvType::F32);
    let row = vec![1.0f32; cfg.kv_dim()];
    // Layer 0 is windowed: window 4 + batch 2 = 6 slots, reused modulo 6.
    let ring = kv.layer_mut(0).unwrap();
    assert_eq!(ring.slots(), 6);
    for pos in 0..16 {
        ring.write(&[pos], &row, &row).unwrap();
    }
    let mut held: Vec<usize> = ring.slot_positions().to_vec();
    held.sort_unstable();
    assert_eq!(held, vec![10, 11, 12, 13, 14, 15]);
    // Layer 5 is global: one slot per position, an error past the context.
    let full = kv.layer_mut(5).unwrap();
    assert_eq!(full.slots(), 16);
    for pos in 0..16 {
        full.write(&[pos], &row, &row).unwrap();
    }
    assert!(matches!(
        full.write(&[16], &row, &row),
        Err(ModelError::KvFull { layer: 5, .. })
    ));
}

#[test]
fn f16_cache_is_half_the_bytes() {
    let cfg = gemma_like();
    let f16 = KvCache::new(&cfg, 16, 2, KvType::F16).bytes();
    let f32 = KvCache::new(&cfg, 16, 2, KvType::F32).bytes();
    assert_eq!(f16 * 2, f32);
}

fn entry(name: &str, bytes: u64) -> TensorEntry {
    TensorEntry {
        name: name.into(),
        shape: vec![1, 1],
        bytes,
    }
}

fn manifest(layer_bytes: &[u64], head: u64) -> Manifest {
    Manifest {
        embed: entry("embed", head),
        layers: layer_bytes
            .iter()
            .enumerate()
            .map(|(i, &b)| LayerEntry {
                index: i,
                tensors: vec![entry("x", b)],
                bytes: b,
            })
            .collect(),
        output_norm: entry("output_norm", 4),
        output: entry("output", head),
        output_tied: false,
        rope_freqs: None,
    }
}

#[test]
fn cap_keeps_the_largest_items_that_fit() {
    let m = manifest(&[10, 30, 20, 30], 50);
    let plan = ResidencyPlan::new(Residency::Cap(70), &m);
    // 50 (head) + 20 would also fit 70, but greedy by size keeps head 50, then nothing of 30 fits… 50+20=70.
    assert!(plan.output_resident);
    assert_eq!(plan.resident, vec![false, false, true, false]);
    assert_eq!(plan.resident_bytes, 70);
    assert_eq!(plan.streamed_bytes_per_token, 140 - 70);

    let stream = ResidencyPlan::new(Residency::Stream, &m);
    assert_eq!(stream.resident_bytes, 0);
    let all = ResidencyPlan::new(Residency::Resident, &m);
    assert_eq!(all.streamed_bytes_per_token, 0);
}

#[test]
fn residency_parses() {
    assert_eq!("stream".parse::<Residency>().unwrap(), Residency::Stream);
    assert_eq!(
        "resident".parse::<Residency>().unwrap(),
        Residency::Resident
    );
    assert_eq!(
        "cap=300M".parse::<Residency>().unwrap(),
        Residency::Cap(300 << 20)
    );
    assert!("cap=lots".parse::<Residency>().is_err());
}

#[test]
fn cap_gives_what_is_left_to_the_first_rows_of_a_head_that_does_not_fit() {
    let m = manifest(&[10, 30, 20, 30], 200);
    let plan = ResidencyPlan::new(Residency::Cap(100), &m);
    // Every layer (90) fits, the head (200) does not: its first 10 bytes are kept.
    assert!(!plan.output_resident);
    assert_eq!(plan.resident, vec![true; 4]);
    assert_eq!(plan.output_kept_bytes, 10);
    assert_eq!(plan.resident_bytes, 100);
    assert_eq!(plan.streamed_bytes_per_token, 290 - 100);
    // Rounded down to whole rows of 4 bytes: 2 rows, 8 bytes.
    let (rows_plan, rows) = plan.clone().with_head_rows(4);
    assert_eq!(rows, 2);
    assert_eq!(rows_plan.output_kept_bytes, 8);
    assert_eq!(rows_plan.resident_bytes, 98);
    assert_eq!(rows_plan.streamed_bytes_per_token, 192);
    // Paths that stream the head whole keep none of it.
    let whole = plan.without_partial_head();
    assert_eq!(whole.output_kept_bytes, 0);
    assert_eq!(whole.resident_bytes, 90);
    assert_eq!(whole.streamed_bytes_per_token, 200);
    // A kept head leaves nothing partial.
    let kept = ResidencyPlan::new(Residency::Cap(75), &manifest(&[10, 30, 20, 30], 50));
    assert!(kept.output_resident);
    assert_eq!(kept.output_kept_bytes, 0);
}
