//! See `flatrun_fuzz::server_request`.
#![no_main]

libfuzzer_sys::fuzz_target!(init: { flatrun_fuzz::server_request::init(); }, |data: &[u8]| flatrun_fuzz::server_request::run(data));
