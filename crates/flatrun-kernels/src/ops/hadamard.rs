//! The normalized Walsh–Hadamard transform, applied in place to every piece
//! of `n` values of a row: `x ← H_n · x / √n` with `H_n` in Sylvester's
//! (natural) order. `H_n / √n` is orthogonal and its own inverse, so
//! rotating queries and keys leaves their dot products unchanged, and
//! rotating values and then the attention output leaves the output
//! unchanged: only the error of quantizing the rotated rows differs.
//!
//! Quantized KV caches store rotated keys and values, as llama.cpp does, to
//! spread outlier channels over a block before it is quantized. The order
//! of operations is ggml's (`ggml_compute_forward_fwht`): each value is
//! first multiplied by `1/√n` in f32, then butterflies `(u + v, u − v)` of
//! span 1, 2, 4, … `n/2`. Each butterfly is one exact-order f32 operation
//! per element, so the result does not depend on how the loop is split.

/// Rotate each consecutive piece of `n` values of `x` (`n` a power of two;
/// `x.len()` a multiple of `n`). A trailing piece shorter than `n` is left
/// as it is.
pub fn hadamard(x: &mut [f32], n: usize) {
    debug_assert!(n.is_power_of_two(), "a Hadamard size is a power of two");
    if n < 2 || !n.is_power_of_two() {
        return;
    }
    let scale = 1.0f32 / (n as f32).sqrt();
    for piece in x.chunks_exact_mut(n) {
        for v in piece.iter_mut() {
            *v *= scale;
        }
        let mut len = 1;
        while len < n {
            for pair in piece.chunks_exact_mut(2 * len) {
                let (lo, hi) = pair.split_at_mut(len);
                for (u, v) in lo.iter_mut().zip(hi.iter_mut()) {
                    let (a, b) = (*u, *v);
                    *u = a + b;
                    *v = a - b;
                }
            }
            len <<= 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `H_n` by its definition: entry (i, j) is (−1)^popcount(i & j).
    fn dense(n: usize, x: &[f32]) -> Vec<f64> {
        (0..n)
            .map(|i| {
                (0..n)
                    .map(|j| {
                        let s = if (i & j).count_ones() % 2 == 0 {
                            1.0
                        } else {
                            -1.0
                        };
                        s * x[j] as f64
                    })
                    .sum::<f64>()
                    / (n as f64).sqrt()
            })
            .collect()
    }

    #[test]
    fn matches_the_dense_matrix_and_is_its_own_inverse() {
        for n in [2usize, 4, 64, 128, 256] {
            let x: Vec<f32> = (0..2 * n)
                .map(|i| ((i * 37 % 11) as f32 - 5.0) * 0.3)
                .collect();
            let mut y = x.clone();
            hadamard(&mut y, n);
            for (piece, out) in x.chunks(n).zip(y.chunks(n)) {
                for (a, b) in dense(n, piece).iter().zip(out) {
                    assert!((a - *b as f64).abs() < 1e-4, "n={n}: {a} vs {b}");
                }
            }
            hadamard(&mut y, n);
            for (a, b) in x.iter().zip(&y) {
                assert!((a - b).abs() < 1e-5, "n={n}: not an involution");
            }
        }
    }

    #[test]
    fn a_short_tail_is_left_alone() {
        let mut x = vec![1.0f32; 70];
        hadamard(&mut x, 64);
        assert_eq!(&x[64..], &[1.0; 6]);
        assert_eq!(x[0], 8.0);
    }
}
