//! The float order of calls that carry several tokens.
//!
//! ggml sums some products in another order when one call carries several
//! tokens: f16 attention scores go through llamafile's tinyBLAS (8 lanes
//! instead of `ggml_vec_dot_f16`'s 32), and K-quant weights through its tiled
//! matmul from 8 tokens on. So llama.cpp's logits for a position depend on how
//! many tokens shared its call, and Flatrun follows it by default: its logits
//! equal llama.cpp's for the same calls.
//!
//! Speculative verification needs the opposite. A pass over the pending token
//! and k proposals must give every position the bits a one-token call would,
//! or it would accept tokens that plain decoding does not produce.
//! [`with_one_token_order`] runs a closure with every call made on this thread
//! summing as one-token calls do; the token-tiled matmul kernels already
//! give the one-token kernels' bits, so nothing else changes.

use std::cell::Cell;

thread_local! {
    static ONE_TOKEN_ORDER: Cell<bool> = const { Cell::new(false) };
}

/// Run `f` with every kernel call of this thread summing in the one-token
/// order, whatever number of tokens it carries (restored afterwards, also
/// when `f` panics).
pub fn with_one_token_order<R>(f: impl FnOnce() -> R) -> R {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            ONE_TOKEN_ORDER.with(|c| c.set(self.0));
        }
    }
    let _restore = Restore(ONE_TOKEN_ORDER.with(|c| c.replace(true)));
    f()
}

/// The number of tokens whose float order a call of `n_tokens` follows: 1
/// inside [`with_one_token_order`], else `n_tokens`.
pub(crate) fn order_tokens(n_tokens: usize) -> usize {
    if ONE_TOKEN_ORDER.with(Cell::get) {
        n_tokens.min(1)
    } else {
        n_tokens
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_override_is_scoped() {
        assert_eq!(order_tokens(8), 8);
        with_one_token_order(|| {
            assert_eq!(order_tokens(8), 1);
            with_one_token_order(|| assert_eq!(order_tokens(3), 1));
            assert_eq!(order_tokens(8), 1);
        });
        assert_eq!(order_tokens(8), 8);
    }
}
