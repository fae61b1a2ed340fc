//! flatrun-dequant (skeleton).
