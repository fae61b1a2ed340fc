//! The row-wise ops split big calls over the thread pool; the values must be those of the
//! same op applied a row (or a small piece) at a time, on the calling thread, bit for bit.

use flatrun_kernels::ops::{self, RopeConfig, RopeLayout, RopeScaling};

/// Deterministic values in about [-4, 4).
fn values(n: usize, seed: u32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(2654435761).max(1);
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            (s % 8192) as f32 / 1024.0 - 4.0
        })
        .collect()
}

fn assert_bits(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len());
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        assert_eq!(a.to_bits(), b.to_bits(), "{what}: element {i}: {a} vs {b}");
    }
}

#[test]
fn big_calls_equal_row_at_a_time() {
    flatrun_kernels::set_threads(2);
    // 128 tokens of a 640-wide model: well past the threshold for splitting.
    let (n, dim) = (128, 640);
    let x = values(n * dim, 1);
    let weight = values(dim, 2);

    let mut whole = x.clone();
    ops::rms_norm_rows(&mut whole, dim, &weight, 1e-6, 0.0);
    let mut by_row = vec![0f32; n * dim];
    for (row, out) in x.chunks_exact(dim).zip(by_row.chunks_exact_mut(dim)) {
        ops::rms_norm(row, &weight, 1e-6, 0.0, out);
    }
    assert_bits(&whole, &by_row, "rms_norm_rows");

    for layout in [RopeLayout::Normal, RopeLayout::Neox] {
        let cfg = RopeConfig {
            layout,
            n_rot: 64,
            theta_base: 10000.0,
            scaling: RopeScaling::None,
            freq_factors: None,
        };
        let (heads, hd) = (4, 80);
        let positions: Vec<usize> = (0..n).map(|t| 3 * t + 1).collect();
        let q = values(n * heads * hd, 3);
        let mut whole = q.clone();
        ops::rope(&mut whole, heads, hd, &positions, &cfg);
        let mut by_token = q.clone();
        for (t, token) in by_token.chunks_exact_mut(heads * hd).enumerate() {
            ops::rope(token, heads, hd, &positions[t..t + 1], &cfg);
        }
        assert_bits(&whole, &by_token, "rope");
    }

    // Gated activations: a ragged length (not a multiple of the pieces or of 8 lanes).
    let len = n * 2048 + 13;
    let (gate, up) = (values(len, 4), values(len, 5));
    for (name, op) in [
        ("geglu", ops::geglu as fn(&mut [f32], &[f32])),
        ("swiglu", ops::swiglu),
    ] {
        let mut whole = gate.clone();
        op(&mut whole, &up);
        let mut pieces = gate.clone();
        for (g, u) in pieces.chunks_mut(100).zip(up.chunks(100)) {
            op(g, u);
        }
        assert_bits(&whole, &pieces, name);
    }
}
