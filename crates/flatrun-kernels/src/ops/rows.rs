//! Row-wise f32 operations split over the thread pool.
//!
//! A prefill step runs its norms, RoPE and gated activation over every token at
//! once (128 × 640 values and more). Each row is independent, so handing out
//! chunks of whole rows to the pool changes no value; small calls (a decode
//! step) stay on the calling thread.

use std::ops::Range;

/// Fewer values than this run inline: the pool hand-off would cost more than it saves.
const MIN_PARALLEL_VALUES: usize = 16 * 1024;
/// Chunks per thread, so a descheduled worker holds up little.
const CHUNKS_PER_THREAD: usize = 2;

/// A raw pointer to the rows, shared by tasks that each take a disjoint range of them.
#[derive(Clone, Copy)]
struct RowsPtr(*mut f32);
// SAFETY: tasks build disjoint sub-slices of one live `&mut [f32]` while
// `par_rows_mut` blocks on the pool, so no element is shared.
unsafe impl Send for RowsPtr {}
// SAFETY: as above.
unsafe impl Sync for RowsPtr {}

impl RowsPtr {
    /// `len` values from element `start` (a method, so closures capture the whole wrapper).
    ///
    /// # Safety
    /// `start + len` is inside the slice the pointer came from, and no other live
    /// reference covers those elements.
    unsafe fn slice<'a>(self, start: usize, len: usize) -> &'a mut [f32] {
        // SAFETY: guaranteed by the caller.
        unsafe { std::slice::from_raw_parts_mut(self.0.add(start), len) }
    }
}

/// Call `f(rows, values)` for consecutive ranges of the `x.len() / row_len` rows of `x`
/// (`values` = those rows), on the pool when the call is big enough. Every row goes to
/// exactly one call, in one piece; a ragged tail shorter than a row is left alone.
pub(crate) fn par_rows_mut(
    x: &mut [f32],
    row_len: usize,
    f: impl Fn(Range<usize>, &mut [f32]) + Sync,
) {
    let n_rows = x.len().checked_div(row_len).unwrap_or(0);
    let threads = crate::threads::threads();
    if threads <= 1 || n_rows < 2 || n_rows * row_len < MIN_PARALLEL_VALUES {
        f(0..n_rows, &mut x[..n_rows * row_len]);
        return;
    }
    let per_chunk = n_rows.div_ceil(threads * CHUNKS_PER_THREAD);
    let n_chunks = n_rows.div_ceil(per_chunk);
    let base = RowsPtr(x.as_mut_ptr());
    let task = |c: usize| {
        let rows = c * per_chunk..((c + 1) * per_chunk).min(n_rows);
        // SAFETY: the row ranges of different tasks are disjoint and inside `x`, which
        // stays mutably borrowed (and otherwise untouched) until `parallel_for` returns.
        let values = unsafe { base.slice(rows.start * row_len, rows.len() * row_len) };
        f(rows, values);
    };
    crate::threads::parallel_for(n_chunks, &task);
}
