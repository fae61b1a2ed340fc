//! See `flatrun_fuzz::dequant`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| flatrun_fuzz::dequant::run(data));
