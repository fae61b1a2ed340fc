//! Heap buffers aligned for direct I/O.

use super::source::DIRECT_ALIGN;

/// A zero-initialized heap buffer whose address is [`DIRECT_ALIGN`]-aligned
/// (kernels may also load whole vectors from it).
pub(crate) struct AlignedBuffer {
    ptr: std::ptr::NonNull<u8>,
    len: usize,
}

// SAFETY: the buffer owns its allocation exclusively (like a `Vec<u8>`); it
// moves between the read-ahead thread and the executor, and only its current
// holder touches it.
unsafe impl Send for AlignedBuffer {}
// SAFETY: through `&AlignedBuffer` its bytes can only be read (`as_slice`);
// writing takes `&mut self`, so shared references never race with a write.
unsafe impl Sync for AlignedBuffer {}

impl AlignedBuffer {
    fn layout(len: usize) -> Option<std::alloc::Layout> {
        std::alloc::Layout::from_size_align(len.max(1), DIRECT_ALIGN as usize).ok()
    }

    /// A zeroed buffer of `len` bytes, or `None` when it cannot be
    /// allocated. Untouched pages cost nothing until first written.
    pub(crate) fn new(len: usize) -> Option<AlignedBuffer> {
        let layout = Self::layout(len)?;
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { std::alloc::alloc_zeroed(layout) };
        std::ptr::NonNull::new(raw).map(|ptr| AlignedBuffer { ptr, len })
    }

    pub(crate) fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` points to `len` initialized (zeroed, then read into)
        // bytes owned by this buffer.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    pub(crate) fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`, and `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuffer {
    fn drop(&mut self) {
        if let Some(layout) = Self::layout(self.len) {
            // SAFETY: allocated in `new` with this same layout.
            unsafe { std::alloc::dealloc(self.ptr.as_ptr(), layout) };
        }
    }
}
