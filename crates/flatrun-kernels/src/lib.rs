//! flatrun-kernels (skeleton).
