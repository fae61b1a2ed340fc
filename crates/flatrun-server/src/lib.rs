//! flatrun-server (skeleton).
