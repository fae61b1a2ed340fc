//! A cache that lives in a file keeps little of itself mapped while
//! attention reads it: the passes hand the rows they went past to the cache,
//! which drops their pages. Alone in its binary, so the process's resident
//! set is this test's.

use flatrun_kernels::ops::{self, AttnConfig};
use flatrun_model::ModelConfig;
use flatrun_model::arch::LayerKv;
use flatrun_runtime::{KvBacking, KvCache, KvLayout, KvType, rss};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

const MIB: u64 = 1 << 20;

fn qwen_like() -> ModelConfig {
    ModelConfig::from_hf_json(&serde_json::json!({
        "model_type": "qwen2", "num_hidden_layers": 2, "hidden_size": 768, "intermediate_size": 1024,
        "num_attention_heads": 12, "num_key_value_heads": 2, "head_dim": 64,
        "max_position_embeddings": 40960, "vocab_size": 1000
    }))
    .unwrap()
}

/// Values in [-1, 1) from a seed.
fn values(n: usize, seed: u32) -> Vec<f32> {
    let mut x = seed.wrapping_mul(2_654_435_761).max(1);
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            (x % 2000) as f32 / 1000.0 - 1.0
        })
        .collect()
}

/// The largest growth of the process's file-backed resident set while `f`
/// runs, sampled every 200 µs by another thread.
fn peak_file_growth(f: impl FnOnce()) -> u64 {
    let before = rss().file;
    let (done, peak) = (AtomicBool::new(false), AtomicU64::new(before));
    std::thread::scope(|s| {
        s.spawn(|| {
            while !done.load(Ordering::Relaxed) {
                peak.fetch_max(rss().file, Ordering::Relaxed);
                std::thread::sleep(std::time::Duration::from_micros(200));
            }
        });
        f();
        done.store(true, Ordering::Relaxed);
    });
    peak.load(Ordering::Relaxed).saturating_sub(before)
}

#[test]
fn attention_over_a_file_backed_layer_keeps_little_of_it_mapped() {
    let cfg = qwen_like();
    let (n, chunk) = (32_768, 512);
    let layout = KvLayout {
        backing: KvBacking::File(None),
        ..KvLayout::plain(KvType::F16)
    };
    let mut kv = KvCache::with_layout(&cfg, n + chunk, chunk, &layout);
    assert!(kv.is_file_backed());
    let d = cfg.kv_dim();
    let layer = kv.layer_mut(0).unwrap();
    for start in (0..n).step_by(chunk) {
        let positions: Vec<usize> = (start..start + chunk).collect();
        let k = values(chunk * d, start as u32 + 1);
        let v = values(chunk * d, start as u32 + 2);
        layer.write(&positions, &k, &v).unwrap();
    }
    // 8 MiB of f16 keys and 8 MiB of values, none of it mapped now.
    let written = kv.layer_pages(0).unwrap();
    assert_eq!(written.bytes(), 16 * MIB);
    written.release();

    let attn = AttnConfig {
        n_head: cfg.n_head,
        n_kv_head: cfg.n_kv_head,
        head_dim: cfg.head_dim,
        scale: 0.125,
        window: None,
        softcap: None,
    };
    let layer = kv.layer_mut(0).unwrap();
    let pager = layer.pager().expect("a file-backed layer pages");
    // A prompt's last chunk (the tiles) and one decode step.
    for n_q in [chunk, 1] {
        let q_pos: Vec<usize> = (n - n_q..n).collect();
        let q = values(n_q * cfg.n_head * cfg.head_dim, 7);
        let mut paged = vec![0f32; q.len()];
        let grew = peak_file_growth(|| {
            ops::attention_paged(
                &q,
                &q_pos,
                layer.keys(),
                layer.values(),
                layer.slot_positions(),
                &attn,
                None,
                pager,
                &mut paged,
            )
        });
        // The same numbers as attention over memory.
        let mut plain = vec![1f32; q.len()];
        ops::attention(
            &q,
            &q_pos,
            layer.keys(),
            layer.values(),
            layer.slot_positions(),
            &attn,
            &mut plain,
        );
        assert!(
            plain
                .iter()
                .zip(&paged)
                .all(|(a, b)| a.to_bits() == b.to_bits())
        );
        eprintln!(
            "{n_q} queries: {:.2} MiB of the layer's 16 MiB mapped at most",
            grew as f64 / MIB as f64
        );
        assert!(
            grew < 4 * MIB,
            "{n_q} queries mapped {:.1} MiB of a 16 MiB layer",
            grew as f64 / MIB as f64
        );
    }
}
