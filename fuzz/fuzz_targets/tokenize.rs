//! See `flatrun_fuzz::tokenize`.
#![no_main]

libfuzzer_sys::fuzz_target!(init: { flatrun_fuzz::tokenize::init(); }, |data: &[u8]| flatrun_fuzz::tokenize::run(data));
