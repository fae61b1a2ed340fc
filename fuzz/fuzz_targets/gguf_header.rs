//! See `flatrun_fuzz::gguf_header`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| flatrun_fuzz::gguf_header::run(data));
