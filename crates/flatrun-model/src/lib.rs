//! flatrun-model (skeleton).
