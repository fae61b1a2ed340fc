//! See `flatrun_fuzz::tool_calls`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| flatrun_fuzz::tool_calls::run(data));
