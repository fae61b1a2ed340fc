//! Activations that several calls share.
//!
//! A streamed matrix is multiplied a row chunk at a time, as its chunks
//! arrive from storage: one `matmul` call per chunk, every one on the same
//! activations, and each would quantize them again (for a prefill's FFN down
//! projection, the same `tokens × 8,960` values once per chunk).
//! [`with_shared_input`] runs a closure during which the caller's slice `x`
//! is borrowed, so it cannot change: the kernels then quantize it for the
//! first call that multiplies it and reuse that for the others. A call on any
//! other slice quantizes its own as always.

use std::cell::Cell;

thread_local! {
    /// The innermost scope on this thread: its number and its slice's address and length.
    static SCOPE: Cell<Option<(u64, usize, usize)>> = const { Cell::new(None) };
    /// Scopes entered on this thread so far (a scope's number is never reused).
    static ENTERED: Cell<u64> = const { Cell::new(0) };
}

/// Run `f` with the kernels free to quantize `x` once for all the calls
/// `f` makes on it from this thread (restored afterwards, also when `f`
/// panics). The numbers are the same as without.
pub fn with_shared_input<R>(x: &[f32], f: impl FnOnce() -> R) -> R {
    struct Restore(Option<(u64, usize, usize)>);
    impl Drop for Restore {
        fn drop(&mut self) {
            SCOPE.with(|c| c.set(self.0));
        }
    }
    let number = ENTERED.with(|c| {
        let n = c.get() + 1;
        c.set(n);
        n
    });
    let scope = (number, x.as_ptr() as usize, x.len());
    let _restore = Restore(SCOPE.with(|c| c.replace(Some(scope))));
    f()
}

/// The number of the scope that shares `x`, if `x` is its slice: activations
/// made from `x` under this number stay valid while the scope lasts, and a
/// later scope has another number.
pub(crate) fn scope_of(x: &[f32]) -> Option<u64> {
    SCOPE
        .with(Cell::get)
        .filter(|&(_, at, len)| at == x.as_ptr() as usize && len == x.len())
        .map(|(number, _, _)| number)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_scope_covers_its_slice_only_while_it_lasts() {
        let x = vec![1.0f32; 8];
        let y = vec![1.0f32; 8];
        assert_eq!(scope_of(&x), None);
        let (outer, inner) = with_shared_input(&x, || {
            let outer = scope_of(&x);
            assert!(outer.is_some());
            // Another slice, or a part of this one, is not shared.
            assert_eq!(scope_of(&y), None);
            assert_eq!(scope_of(&x[..4]), None);
            let inner = with_shared_input(&y, || {
                assert_eq!(scope_of(&x), None);
                scope_of(&y)
            });
            assert_eq!(scope_of(&x), outer);
            (outer, inner)
        });
        assert!(inner.is_some() && inner != outer);
        assert_eq!(scope_of(&x), None);
        // The same slice again: a new number, so nothing made before is reused.
        let again = with_shared_input(&x, || scope_of(&x));
        assert!(again.is_some() && again != outer);
    }
}
