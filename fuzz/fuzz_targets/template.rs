//! See `flatrun_fuzz::template`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| flatrun_fuzz::template::run(data));
