//! See `flatrun_fuzz::grammar`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| flatrun_fuzz::grammar::run(data));
