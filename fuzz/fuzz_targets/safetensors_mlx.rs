//! Fuzz the SafeTensors header parser and the MLX triple folding: the first
//! byte picks the MLX quantization (bits, group size); the rest is a
//! safetensors file.
#![no_main]

use std::path::Path;

use flatrun_format::mlx_backend::{
    fold_quantized_tensors, MlxQuantConfig, MlxQuantization, MLX_BITS,
};
use flatrun_format::safetensors_backend::parse_header;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&selector, file)) = data.split_first() else {
        return;
    };
    let path = Path::new("fuzz.safetensors");
    let Ok(header) = parse_header(path, file) else {
        return;
    };
    let quant = MlxQuantConfig {
        default: Some(MlxQuantization {
            bits: MLX_BITS[(selector & 7) as usize % MLX_BITS.len()],
            group_size: [32, 64, 128, 0][(selector >> 3) as usize & 3],
        }),
        overrides: Default::default(),
    };
    let _ = fold_quantized_tensors(Path::new("fuzz-dir"), &header.tensors, &quant);
});
