//! Helpers shared by the integration tests: finding the real models
//! (here), logit fixtures and their comparison ([`logits`]), synthetic
//! checkpoints ([`synthetic`]).
#![allow(dead_code)]

pub mod logits;
pub mod synthetic;

use std::path::PathBuf;

/// The directory of the real models (`$FLATRUN_MODELS`, default `~/.cache/flatrun/models`).
pub fn models_dir() -> PathBuf {
    match std::env::var_os("FLATRUN_MODELS") {
        Some(d) => PathBuf::from(d),
        None => PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
            .join(".cache/flatrun/models"),
    }
}

/// The path of model `file`, or `None` (after printing a skip message) when
/// it is missing — unless `FLATRUN_REQUIRE_MODELS=1`, then the test fails.
pub fn model(file: &str) -> Option<PathBuf> {
    let path = models_dir().join(file);
    if path.exists() {
        return Some(path);
    }
    if std::env::var("FLATRUN_REQUIRE_MODELS").as_deref() == Ok("1") {
        panic!("{} is missing and FLATRUN_REQUIRE_MODELS=1", path.display());
    }
    eprintln!(
        "skipping: {} not found (run scripts/fetch-models.py)",
        path.display()
    );
    None
}

/// The fixture directory of this crate.
pub fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}
