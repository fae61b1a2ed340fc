//! `ops::rope_shift`, the re-rotation of a context shift: rows rotated at
//! position p and shifted by −d equal rows rotated at p − d, shifting by +a
//! then −a gives the row back, and YaRN's magnitude is not applied twice.

use flatrun_kernels::ops::{self, RopeConfig, RopeLayout, RopeScaling};

const HEAD_DIM: usize = 64;
const N_HEADS: usize = 3;

/// A row of `N_HEADS` heads with values in [−1, 1] that differ per head.
fn row(seed: usize) -> Vec<f32> {
    (0..N_HEADS * HEAD_DIM)
        .map(|i| (((i * 7919 + seed * 104729) % 2001) as f32 / 1000.0) - 1.0)
        .collect()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn yarn() -> RopeScaling {
    // gpt-oss's settings: factor 32 over 4096 trained positions.
    RopeScaling::Yarn {
        factor: 32.0,
        orig_ctx: 4096,
        ext_factor: 1.0,
        attn_factor: 1.0,
        beta_fast: 32.0,
        beta_slow: 1.0,
    }
}

/// Every layout × rotated dims × scaling a checkpoint can have.
fn configs() -> Vec<RopeConfig> {
    let mut out = Vec::new();
    for layout in [RopeLayout::Normal, RopeLayout::Neox] {
        for n_rot in [HEAD_DIM, HEAD_DIM / 4] {
            for scaling in [
                RopeScaling::None,
                RopeScaling::Linear { factor: 4.0 },
                yarn(),
                RopeScaling::Llama3 {
                    factor: 8.0,
                    low_freq_factor: 1.0,
                    high_freq_factor: 4.0,
                    orig_ctx: 32,
                },
            ] {
                out.push(RopeConfig {
                    layout,
                    n_rot,
                    theta_base: 10000.0,
                    scaling,
                    freq_factors: None,
                });
            }
        }
    }
    // A `rope_freqs` tensor.
    out.push(RopeConfig {
        layout: RopeLayout::Normal,
        n_rot: HEAD_DIM,
        theta_base: 500000.0,
        scaling: RopeScaling::None,
        freq_factors: Some((0..HEAD_DIM / 2).map(|i| 1.0 + i as f32 / 8.0).collect()),
    });
    out
}

#[test]
fn shifting_by_a_then_minus_a_gives_the_row_back() {
    for cfg in configs() {
        for a in [1i64, 7, 100, 1000] {
            let x = row(a as usize);
            let mut y = x.clone();
            ops::rope_shift(&mut y, N_HEADS, HEAD_DIM, a, &cfg);
            assert!(max_diff(&x, &y) > 1e-3, "{cfg:?}: +{a} changed nothing");
            ops::rope_shift(&mut y, N_HEADS, HEAD_DIM, -a, &cfg);
            // Each pair is rotated twice in f32: a few ulps of |x| ≤ 1.
            let d = max_diff(&x, &y);
            assert!(d <= 4.0 * f32::EPSILON, "{cfg:?}: ±{a}: off by {d:e}");
        }
    }
}

#[test]
fn rope_at_p_then_shift_by_minus_d_is_rope_at_p_minus_d() {
    for cfg in configs() {
        // Two tokens per call: the shift moves every token of the slice.
        for (p, d) in [(5usize, 1usize), (17, 16), (40, 3), (63, 40), (64, 64)] {
            let x: Vec<f32> = [row(p), row(p + 1)].concat();
            let mut shifted = x.clone();
            ops::rope(&mut shifted, N_HEADS, HEAD_DIM, &[p, p + 1], &cfg);
            ops::rope_shift(&mut shifted, N_HEADS, HEAD_DIM, -(d as i64), &cfg);
            let mut direct = x.clone();
            ops::rope(&mut direct, N_HEADS, HEAD_DIM, &[p - d, p + 1 - d], &cfg);
            let diff = max_diff(&shifted, &direct);
            assert!(diff <= 1e-5, "{cfg:?}: p={p} d={d}: off by {diff:e}");
            // The unrotated tail of a partial rotation passes through.
            if cfg.n_rot < HEAD_DIM {
                for t in 0..2 * N_HEADS {
                    let tail = t * HEAD_DIM + cfg.n_rot..(t + 1) * HEAD_DIM;
                    assert_eq!(shifted[tail.clone()], x[tail]);
                }
            }
        }
    }
}

#[test]
fn a_yarn_shift_is_a_pure_rotation() {
    // YaRN's rope scales cos and sin by mscale = 1 + 0.1·ln(factor) (here
    // ≈ 1.35): a shifted key must keep that magnitude, not gain it twice.
    let cfg = RopeConfig {
        layout: RopeLayout::Neox,
        n_rot: HEAD_DIM,
        theta_base: 150000.0,
        scaling: yarn(),
        freq_factors: None,
    };
    let norm = |v: &[f32]| v.iter().map(|x| x * x).sum::<f32>().sqrt();
    let mut x = row(3);
    let before = norm(&x);
    ops::rope(&mut x, N_HEADS, HEAD_DIM, &[50], &cfg);
    let roped = norm(&x);
    assert!((roped / before - (1.0 + 0.1 * 32f32.ln())).abs() < 1e-4);
    ops::rope_shift(&mut x, N_HEADS, HEAD_DIM, -20, &cfg);
    assert!(
        (norm(&x) - roped).abs() <= 1e-5 * roped,
        "the shift rescaled the row"
    );
}

#[test]
fn zero_delta_and_empty_inputs_change_nothing() {
    let cfg = &configs()[0];
    let x = row(1);
    let mut y = x.clone();
    ops::rope_shift(&mut y, N_HEADS, HEAD_DIM, 0, cfg);
    assert_eq!(x, y);
    ops::rope_shift(&mut [], N_HEADS, HEAD_DIM, 5, cfg);
    ops::rope_shift(&mut y, 0, HEAD_DIM, 5, cfg);
    assert_eq!(x, y);
    // A partial token at the end is left alone.
    let mut z = [x.clone(), vec![0.5; 10]].concat();
    ops::rope_shift(&mut z, N_HEADS, HEAD_DIM, 9, cfg);
    assert_eq!(&z[x.len()..], &[0.5; 10]);
}
