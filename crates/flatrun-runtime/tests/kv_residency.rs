//! KV cache rings and residency plans, without a model file.

use flatrun_model::arch::LayerKv;
use flatrun_model::manifest::{LayerEntry, TensorEntry};
use flatrun_model::{Manifest, ModelConfig, ModelError};
use flatrun_runtime::{
    KvBacking, KvCache, KvLayout, KvType, LoadOptions, MemoryPlan, Residency, ResidencyPlan,
};

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
        experts: None,
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

/// A Qwen2.5-0.5B-shaped config (24 layers, 2 KV heads of 64, 32k context).
fn qwen_like(head_dim: usize) -> ModelConfig {
    ModelConfig::from_hf_json(&serde_json::json!({
        "model_type": "qwen2", "num_hidden_layers": 24, "hidden_size": 896, "intermediate_size": 4864,
        "num_attention_heads": 14, "num_key_value_heads": 2, "head_dim": head_dim,
        "max_position_embeddings": 32768, "vocab_size": 151936
    }))
    .unwrap()
}

#[test]
fn quantized_caches_take_their_block_sizes() {
    let cfg = qwen_like(64);
    let bytes = |t| KvCache::new(&cfg, 64, 8, t).bytes();
    let values = 24 * 64 * cfg.kv_dim() * 2;
    assert_eq!(bytes(KvType::F32), values * 4);
    assert_eq!(bytes(KvType::F16), values * 2);
    assert_eq!(bytes(KvType::Q8_0), values / 32 * 34);
    assert_eq!(bytes(KvType::Q4_0), values / 32 * 18);
    assert_eq!("Q8_0".parse::<KvType>().unwrap(), KvType::Q8_0);
    assert!("q5_1".parse::<KvType>().is_err());
}

/// Write the same rows into two caches of `layout`s and compare every layer's bytes.
fn same_contents(a: &mut KvCache, b: &mut KvCache, cfg: &ModelConfig, positions: usize) {
    let d = cfg.kv_dim();
    for il in 0..cfg.n_layer {
        for pos in 0..positions {
            let k: Vec<f32> = (0..d)
                .map(|i| ((pos * 31 + i * 7 + il) % 97) as f32 / 9.0 - 5.0)
                .collect();
            let v: Vec<f32> = k.iter().map(|x| -x * 0.5).collect();
            a.layer_mut(il).unwrap().write(&[pos], &k, &v).unwrap();
            b.layer_mut(il).unwrap().write(&[pos], &k, &v).unwrap();
        }
        // Streamed caches drop a layer's pages after use; the data stays.
        for cache in [&*a, &*b] {
            if let Some(pages) = cache.layer_pages(il) {
                assert!(pages.bytes() > 0);
                pages.release();
            }
        }
    }
    // What the engine pages is exactly what was written.
    for cache in [&*a, &*b] {
        let paged: Option<u64> = (0..cfg.n_layer)
            .map(|il| cache.layer_pages(il).map(|p| p.bytes()))
            .sum();
        if let Some(paged) = paged {
            assert!(cache.is_file_backed());
            assert_eq!(paged as usize, cache.used_bytes());
        }
    }
    for il in 0..cfg.n_layer {
        if let Some(pages) = a.layer_pages(il) {
            pages.ahead().start();
        }
        let (la, lb) = (a.layer_mut(il).unwrap(), b.layer_mut(il).unwrap());
        assert_eq!(la.slot_positions(), lb.slot_positions());
        assert_eq!(format!("{:?}", la.keys()), format!("{:?}", lb.keys()));
        assert_eq!(format!("{:?}", la.values()), format!("{:?}", lb.values()));
    }
}

#[test]
fn a_file_backed_cache_holds_what_an_anonymous_one_does() {
    let cfg = gemma_like();
    for kind in [KvType::F32, KvType::F16] {
        let mut anon = KvCache::new(&cfg, 32, 4, kind);
        let dir = tempfile::tempdir().unwrap();
        let layout = KvLayout {
            backing: KvBacking::File(Some(dir.path().join("cache"))),
            ..KvLayout::plain(kind)
        };
        let mut file = KvCache::with_layout(&cfg, 32, 4, &layout);
        assert!(file.is_file_backed() && !anon.is_file_backed());
        same_contents(&mut file, &mut anon, &cfg, 20);
        // The file is unlinked at once: nothing is left in the directory.
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }
    let cfg = qwen_like(64);
    for kind in [KvType::Q8_0, KvType::Q4_0] {
        let mut anon = KvCache::new(&cfg, 40, 4, kind);
        let layout = KvLayout {
            backing: KvBacking::File(None),
            ..KvLayout::plain(kind)
        };
        let mut file = KvCache::with_layout(&cfg, 40, 4, &layout);
        same_contents(&mut file, &mut anon, &cfg, 33);
        // Truncation forgets positions, whatever the type.
        file.truncate(10);
        let held = file.layer_mut(3).unwrap().slot_positions();
        assert!(held.iter().all(|&p| p == usize::MAX || p < 10));
    }
}

/// A manifest of `n` layers of `layer` bytes and a head of `head` bytes.
fn uniform(n: usize, layer: u64, head: u64) -> Manifest {
    manifest(&vec![layer; n], head)
}

#[test]
fn memory_plan_counts_the_full_context_and_refuses_what_cannot_fit() {
    let cfg = qwen_like(64);
    let m = uniform(24, 10 << 20, 130 << 20);
    let opts = LoadOptions::default();
    // The full trained context by default.
    let plan = MemoryPlan::new(&cfg, &m, &opts, Some(64 << 30));
    assert_eq!(plan.ctx, 32768);
    assert_eq!(plan.kv_bytes, 384 << 20);
    assert!(!plan.kv_streamed);
    assert_eq!(plan.kv_in_memory_bytes, plan.kv_bytes);
    assert!(plan.check().is_ok());
    assert!(plan.summary().contains("32768 tokens"));
    // Resident in 500 MiB: weights 370 MiB + KV 384 MiB do not fit.
    let tight = MemoryPlan::new(&cfg, &m, &opts, Some(500 << 20));
    let err = tight.check().unwrap_err().to_string();
    assert!(err.contains("--ctx") && err.contains("available"), "{err}");
    // A lower context fits.
    let short = LoadOptions {
        ctx: Some(4096),
        ..opts.clone()
    };
    assert!(
        MemoryPlan::new(&cfg, &m, &short, Some(500 << 20))
            .check()
            .is_ok()
    );
    // Streamed, only two layers of the cache are in memory.
    let stream = LoadOptions {
        residency: Residency::Stream,
        ..opts.clone()
    };
    let plan = MemoryPlan::new(&cfg, &m, &stream, Some(500 << 20));
    assert!(plan.kv_streamed);
    assert_eq!(plan.kv_in_memory_bytes, 2 * (16 << 20));
    assert!(plan.check().is_ok());
    // A cap below the read buffers is refused.
    let small_cap = LoadOptions {
        residency: Residency::Cap(5 << 20),
        ..opts.clone()
    };
    assert!(MemoryPlan::new(&cfg, &m, &small_cap, None).check().is_err());
    // A quantized cache needs whole blocks per head.
    let odd = LoadOptions {
        kv_type: KvType::Q8_0,
        ..opts.clone()
    };
    assert!(
        MemoryPlan::new(&qwen_like(40), &m, &odd, None)
            .check()
            .is_err()
    );
    assert!(MemoryPlan::new(&cfg, &m, &odd, None).check().is_ok());
}

#[test]
fn default_residency_plans_from_the_headroom() {
    let cfg = qwen_like(64);
    // Qwen2.5-0.5B-like: 24 × 10 MiB layers, a 130 MiB head (370 MiB).
    let m = uniform(24, 10 << 20, 130 << 20);
    let opts = LoadOptions::default();
    assert_eq!(
        MemoryPlan::default_residency(&cfg, &m, &opts, None),
        Residency::Resident
    );
    assert_eq!(
        MemoryPlan::default_residency(&cfg, &m, &opts, Some(8 << 30)),
        Residency::Resident
    );
    // A 234 MB memory cgroup: a cap of what fits, well above half of it.
    let Residency::Cap(cap) = MemoryPlan::default_residency(&cfg, &m, &opts, Some(234_000_000))
    else {
        panic!("expected a cap");
    };
    assert!(cap > 140 << 20 && cap < 234_000_000, "{cap}");
    let plan = MemoryPlan::new(
        &cfg,
        &m,
        &LoadOptions {
            residency: Residency::Cap(cap),
            ..opts.clone()
        },
        Some(234_000_000),
    );
    assert!(plan.check().is_ok(), "{:?}", plan.check());
    // Hardly any memory: stream.
    assert_eq!(
        MemoryPlan::default_residency(&cfg, &m, &opts, Some(20 << 20)),
        Residency::Stream
    );
}

#[test]
fn a_plan_within_a_budget_is_resident_then_capped_then_streamed() {
    let cfg = qwen_like(64);
    let m = uniform(24, 10 << 20, 130 << 20);
    let opts = LoadOptions {
        ctx: Some(4096),
        ..LoadOptions::default()
    };
    let resident = MemoryPlan::within(&cfg, &m, &opts, 8 << 30);
    assert_eq!(resident.residency, Residency::Resident);
    // Less than the resident plan needs: a cap, and its peak within the budget.
    let budget = resident.peak_bytes - (100 << 20);
    let capped = MemoryPlan::within(&cfg, &m, &opts, budget);
    assert!(matches!(capped.residency, Residency::Cap(_)), "{capped:?}");
    assert!(
        capped.peak_bytes <= budget,
        "{} > {budget}",
        capped.peak_bytes
    );
    assert!(capped.resident_weight_bytes > 200 << 20);
    assert!(capped.check().is_ok());
    // Too little for any kept layer: stream mode, the least a model needs.
    let streamed = MemoryPlan::within(&cfg, &m, &opts, 20 << 20);
    assert_eq!(streamed.residency, Residency::Stream);
    assert!(streamed.peak_bytes < capped.peak_bytes);
}
