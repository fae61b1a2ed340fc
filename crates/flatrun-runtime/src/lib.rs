//! flatrun-runtime (skeleton).
