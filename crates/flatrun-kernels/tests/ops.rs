//! The f32 operations against direct transcriptions of their definitions
//! (ggml's `ggml_rope_ext` semantics for RoPE).

use flatrun_kernels::ops::{self, AttnConfig, KvSlice, RopeConfig, RopeLayout, RopeScaling};
use half::f16;

fn close(a: &[f32], b: &[f32], tol: f32) {
    assert_eq!(a.len(), b.len());
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            (x - y).abs() <= tol * (1.0 + y.abs()),
            "index {i}: {x} vs {y}"
        );
    }
}

fn cfg(layout: RopeLayout, n_rot: usize, scaling: RopeScaling) -> RopeConfig {
    RopeConfig {
        layout,
        n_rot,
        theta_base: 10000.0,
        scaling,
        freq_factors: None,
    }
}

/// Rotation angle of pair i at position p, no scaling: p · base^(−2i/n_rot).
fn angle(p: usize, i: usize, n_rot: usize, base: f32) -> f32 {
    p as f32 * base.powf(-2.0 * i as f32 / n_rot as f32)
}

#[test]
fn rope_normal_rotates_adjacent_pairs() {
    let (hd, n_rot) = (8, 8);
    let x: Vec<f32> = (0..hd).map(|i| i as f32 + 1.0).collect();
    let mut y = x.clone();
    ops::rope(
        &mut y,
        1,
        hd,
        &[3],
        &cfg(RopeLayout::Normal, n_rot, RopeScaling::None),
    );
    for i in 0..n_rot / 2 {
        let th = angle(3, i, n_rot, 10000.0);
        let (a, b) = (x[2 * i], x[2 * i + 1]);
        close(
            &y[2 * i..2 * i + 2],
            &[a * th.cos() - b * th.sin(), a * th.sin() + b * th.cos()],
            1e-5,
        );
    }
}

#[test]
fn rope_neox_rotates_halves_and_leaves_unrotated_dims() {
    let (hd, n_rot) = (12, 8);
    let x: Vec<f32> = (0..2 * hd).map(|i| (i as f32 * 0.37).sin()).collect();
    let mut y = x.clone();
    ops::rope(
        &mut y,
        2,
        hd,
        &[5],
        &cfg(RopeLayout::Neox, n_rot, RopeScaling::None),
    );
    for h in 0..2 {
        let (xh, yh) = (&x[h * hd..(h + 1) * hd], &y[h * hd..(h + 1) * hd]);
        for i in 0..n_rot / 2 {
            let th = angle(5, i, n_rot, 10000.0);
            let (a, b) = (xh[i], xh[i + n_rot / 2]);
            close(
                &[yh[i], yh[i + n_rot / 2]],
                &[a * th.cos() - b * th.sin(), a * th.sin() + b * th.cos()],
                1e-5,
            );
        }
        assert_eq!(&yh[n_rot..], &xh[n_rot..]);
    }
}

#[test]
fn rope_position_zero_is_identity_and_linear_scaling_divides_positions() {
    let x: Vec<f32> = (0..16).map(|i| i as f32).collect();
    let mut y = x.clone();
    ops::rope(
        &mut y,
        1,
        16,
        &[0],
        &cfg(RopeLayout::Neox, 16, RopeScaling::None),
    );
    close(&y, &x, 1e-6);
    let mut a = x.clone();
    ops::rope(
        &mut a,
        1,
        16,
        &[8],
        &cfg(RopeLayout::Neox, 16, RopeScaling::Linear { factor: 4.0 }),
    );
    let mut b = x.clone();
    ops::rope(
        &mut b,
        1,
        16,
        &[2],
        &cfg(RopeLayout::Neox, 16, RopeScaling::None),
    );
    close(&a, &b, 1e-5);
}

#[test]
fn rope_freq_factors_divide_the_frequency() {
    let x: Vec<f32> = (0..8).map(|i| i as f32 + 0.5).collect();
    let mut a = x.clone();
    let mut c = cfg(RopeLayout::Normal, 8, RopeScaling::None);
    c.freq_factors = Some(vec![2.0; 4]);
    ops::rope(&mut a, 1, 8, &[6], &c);
    let mut b = x.clone();
    ops::rope(
        &mut b,
        1,
        8,
        &[3],
        &cfg(RopeLayout::Normal, 8, RopeScaling::None),
    );
    close(&a, &b, 1e-5);
}

#[test]
fn llama3_factors_follow_the_wavelength_bands() {
    // Llama 3.1 8B: base 500000, factor 8, low 1, high 4, original context 8192.
    let f = ops::llama3_freq_factors(128, 500000.0, 8.0, 1.0, 4.0, 8192);
    assert_eq!(f.len(), 64);
    assert_eq!(f[0], 1.0); // shortest wavelength: untouched
    assert_eq!(f[63], 8.0); // longest: divided by the factor
    assert!(f.windows(2).all(|w| w[0] <= w[1]));
}

#[test]
fn yarn_matches_ggml_rope_yarn_transcription() {
    // Transcription of ggml's rope_yarn / ggml_rope_yarn_corr_dims for one pair.
    let (n_rot, base, factor, orig_ctx, beta_fast, beta_slow) =
        (64usize, 10000f32, 4f32, 4096usize, 32f32, 1f32);
    let corr = |rot: f32| {
        n_rot as f32 * (orig_ctx as f32 / (rot * 2.0 * std::f32::consts::PI)).ln()
            / (2.0 * base.ln())
    };
    let lo = corr(beta_fast).floor().max(0.0);
    let hi = corr(beta_slow).ceil().min(n_rot as f32 - 1.0);
    let scaling = RopeScaling::Yarn {
        factor,
        orig_ctx,
        ext_factor: 1.0,
        attn_factor: 1.0,
        beta_fast,
        beta_slow,
    };
    let pos = 1000usize;
    let x: Vec<f32> = (0..n_rot)
        .map(|i| ((i * 13 % 7) as f32 - 3.0) * 0.3)
        .collect();
    let mut y = x.clone();
    ops::rope(
        &mut y,
        1,
        n_rot,
        &[pos],
        &cfg(RopeLayout::Neox, n_rot, scaling),
    );
    let mut theta = pos as f32;
    let theta_scale = base.powf(-2.0 / n_rot as f32);
    for i in 0..n_rot / 2 {
        let extrap = theta;
        let interp = extrap / factor;
        let ramp = 1.0 - (((i as f32) - lo) / (hi - lo).max(0.001)).clamp(0.0, 1.0);
        let th = interp * (1.0 - ramp) + extrap * ramp;
        let m = 1.0 + 0.1 * factor.ln();
        let (a, b) = (x[i], x[i + n_rot / 2]);
        close(
            &[y[i], y[i + n_rot / 2]],
            &[
                (a * th.cos() - b * th.sin()) * m,
                (a * th.sin() + b * th.cos()) * m,
            ],
            1e-4,
        );
        theta *= theta_scale;
    }
}

#[test]
fn norms_activations_softmax() {
    let x = [1.0f32, -2.0, 3.0, -4.0];
    let w = [1.0f32, 0.5, 2.0, 0.0];
    let mut out = [0f32; 4];
    ops::rms_norm(&x, &w, 1e-6, 1.0, &mut out);
    let rms = ((1.0 + 4.0 + 9.0 + 16.0) / 4.0f32 + 1e-6).sqrt();
    close(
        &out,
        &[
            1.0 / rms * 2.0,
            -2.0 / rms * 1.5,
            3.0 / rms * 3.0,
            -4.0 / rms,
        ],
        1e-6,
    );
    let mut rows = [x, x].concat();
    ops::rms_norm_rows(&mut rows, 4, &w, 1e-6, 1.0);
    close(&rows, &[out, out].concat(), 1e-6);

    let mut s = [1.0f32, 2.0, 3.0, f32::NEG_INFINITY];
    ops::softmax(&mut s);
    let e: f32 = (1f32).exp() + (2f32).exp() + (3f32).exp();
    close(
        &s,
        &[(1f32).exp() / e, (2f32).exp() / e, (3f32).exp() / e, 0.0],
        1e-6,
    );

    let mut g = [1.0f32, -1.0];
    ops::swiglu(&mut g, &[2.0, 3.0]);
    close(
        &g,
        &[2.0 / (1.0 + (-1f32).exp()), -3.0 / (1.0 + 1f32.exp())],
        1e-6,
    );
    let mut g = [1.0f32];
    ops::geglu(&mut g, &[2.0]);
    // ggml's GELU goes through an f16 table: within f16 precision of the exact value.
    close(&g, &[2.0 * 0.841_192], 1e-3);
}

/// Direct attention: for each query and head, softmax over visible keys.
fn naive_attention_sinks(
    q: &[f32],
    q_pos: &[usize],
    k: &[f32],
    v: &[f32],
    key_pos: &[usize],
    c: &AttnConfig,
    sinks: Option<&[f32]>,
) -> Vec<f32> {
    let hd = c.head_dim;
    let mut out = vec![0f32; q_pos.len() * c.n_head * hd];
    for i in 0..q_pos.len() {
        for h in 0..c.n_head {
            let kvh = h / (c.n_head / c.n_kv_head);
            let qv = &q[(i * c.n_head + h) * hd..][..hd];
            let mut w: Vec<(usize, f32)> = Vec::new();
            for (j, &kp) in key_pos.iter().enumerate() {
                if kp == usize::MAX
                    || kp > q_pos[i]
                    || c.window.is_some_and(|win| q_pos[i] - kp >= win)
                {
                    continue;
                }
                let kv = &k[(j * c.n_kv_head + kvh) * hd..][..hd];
                let mut s = qv.iter().zip(kv).map(|(a, b)| a * b).sum::<f32>() * c.scale;
                if let Some(cap) = c.softcap {
                    s = cap * (s / cap).tanh();
                }
                w.push((j, s));
            }
            let sink = sinks.map(|s| s[h]);
            let max = w
                .iter()
                .map(|p| p.1)
                .chain(sink)
                .fold(f32::NEG_INFINITY, f32::max);
            let sum: f32 = w.iter().map(|p| (p.1 - max).exp()).sum::<f32>()
                + sink.map_or(0.0, |s| (s - max).exp());
            for &(j, s) in &w {
                let p = (s - max).exp() / sum;
                for d in 0..hd {
                    out[(i * c.n_head + h) * hd + d] += p * v[(j * c.n_kv_head + kvh) * hd + d];
                }
            }
        }
    }
    out
}

fn naive_attention(
    q: &[f32],
    q_pos: &[usize],
    k: &[f32],
    v: &[f32],
    key_pos: &[usize],
    c: &AttnConfig,
) -> Vec<f32> {
    naive_attention_sinks(q, q_pos, k, v, key_pos, c, None)
}

#[test]
fn attention_sinks_take_a_share_of_each_heads_softmax() {
    let c = AttnConfig {
        n_head: 4,
        n_kv_head: 2,
        head_dim: 8,
        scale: 0.35,
        window: Some(3),
        softcap: None,
    };
    let values =
        |n: usize, s: f32| -> Vec<f32> { (0..n).map(|i| (i as f32 * s).sin() * 1.5).collect() };
    let (k, v, q) = (
        values(5 * 16, 0.71),
        values(5 * 16, 0.37),
        values(2 * 32, 0.53),
    );
    let key_pos = [0, 1, 2, 3, 4];
    let q_pos = [0, 4];
    // One sink far above the scores (the head's output nearly vanishes), one
    // far below (no effect), two near them.
    let sinks = [8.0f32, -30.0, 0.3, -0.5];
    let want = naive_attention_sinks(&q, &q_pos, &k, &v, &key_pos, &c, Some(&sinks));
    let mut out = vec![0f32; want.len()];
    ops::attention_with_sinks(
        &q,
        &q_pos,
        KvSlice::F32(&k),
        KvSlice::F32(&v),
        &key_pos,
        &c,
        Some(&sinks),
        &mut out,
    );
    close(&out, &want, 1e-5);
    let plain = naive_attention(&q, &q_pos, &k, &v, &key_pos, &c);
    assert!(
        out[..8].iter().all(|x| x.abs() < 0.01),
        "a high sink drains head 0"
    );
    close(&out[8..16], &plain[8..16], 1e-5);
    assert!(
        (out[16] - plain[16]).abs() > 1e-3,
        "a near sink changes head 2"
    );
}

#[test]
fn attention_gqa_causal_window_softcap_f32_and_f16() {
    let c = AttnConfig {
        n_head: 4,
        n_kv_head: 2,
        head_dim: 8,
        scale: 0.35,
        window: Some(3),
        softcap: Some(5.0),
    };
    let n_slots = 6;
    let make_values =
        |n: usize, s: f32| -> Vec<f32> { (0..n).map(|i| (i as f32 * s).sin() * 1.5).collect() };
    let k = make_values(n_slots * 2 * 8, 0.71);
    let v = make_values(n_slots * 2 * 8, 0.37);
    // Slot 4 empty, slots out of position order (a ring buffer).
    let key_pos = [3, 4, 0, 1, usize::MAX, 2];
    let q_pos = [2, 4];
    let q = make_values(2 * 4 * 8, 0.53);
    for cfg in [
        c,
        AttnConfig {
            window: None,
            softcap: None,
            ..c
        },
    ] {
        let want = naive_attention(&q, &q_pos, &k, &v, &key_pos, &cfg);
        let mut out = vec![0f32; want.len()];
        ops::attention(
            &q,
            &q_pos,
            KvSlice::F32(&k),
            KvSlice::F32(&v),
            &key_pos,
            &cfg,
            &mut out,
        );
        close(&out, &want, 1e-5);
        let k16: Vec<f16> = k.iter().map(|&x| f16::from_f32(x)).collect();
        let v16: Vec<f16> = v.iter().map(|&x| f16::from_f32(x)).collect();
        ops::attention(
            &q,
            &q_pos,
            KvSlice::F16(&k16),
            KvSlice::F16(&v16),
            &key_pos,
            &cfg,
            &mut out,
        );
        close(&out, &want, 2e-3);
    }
}

/// Head widths that exercise every lane path of the f16 cache kernels
/// (16-wide steps, one 8-wide step, a scalar tail), over enough slots that
/// the call is spread over the pool.
#[test]
fn attention_f16_cache_matches_naive_for_wide_and_ragged_heads() {
    for head_dim in [64, 72, 36] {
        let c = AttnConfig {
            n_head: 6,
            n_kv_head: 2,
            head_dim,
            scale: 1.0 / (head_dim as f32).sqrt(),
            window: None,
            softcap: None,
        };
        let n_slots = 96;
        let make_values =
            |n: usize, s: f32| -> Vec<f32> { (0..n).map(|i| (i as f32 * s).sin() * 1.5).collect() };
        // f16-exact keys and values, so only the products' rounding differs.
        let to_f16 = |x: Vec<f32>| -> Vec<f16> { x.iter().map(|&v| f16::from_f32(v)).collect() };
        let k16 = to_f16(make_values(n_slots * 2 * head_dim, 0.71));
        let v16 = to_f16(make_values(n_slots * 2 * head_dim, 0.37));
        let k: Vec<f32> = k16.iter().map(|x| x.to_f32()).collect();
        let v: Vec<f32> = v16.iter().map(|x| x.to_f32()).collect();
        let key_pos: Vec<usize> = (0..n_slots).collect();
        let q_pos: Vec<usize> = (0..n_slots).step_by(7).collect();
        let q: Vec<f32> = to_f16(make_values(q_pos.len() * 6 * head_dim, 0.53))
            .iter()
            .map(|x| x.to_f32())
            .collect();
        let want = naive_attention(&q, &q_pos, &k, &v, &key_pos, &c);
        let mut out = vec![0f32; want.len()];
        ops::attention(
            &q,
            &q_pos,
            KvSlice::F16(&k16),
            KvSlice::F16(&v16),
            &key_pos,
            &c,
            &mut out,
        );
        close(&out, &want, 2e-3);
    }
}
