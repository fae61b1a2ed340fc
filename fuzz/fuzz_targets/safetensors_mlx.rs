//! See `flatrun_fuzz::safetensors_mlx`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| flatrun_fuzz::safetensors_mlx::run(data));
