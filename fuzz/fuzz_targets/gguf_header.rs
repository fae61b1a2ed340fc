//! Fuzz the GGUF parser: any bytes must give `Ok` or a typed error.
#![no_main]

use std::path::Path;

use flatrun_format::gguf::{check_tensor_extents, parse_header};
use flatrun_format::names::canonical_layer_index;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let path = Path::new("fuzz.gguf");
    let Ok(header) = parse_header(path, data) else {
        return;
    };
    let _ = check_tensor_extents(path, &header.tensors, data.len() as u64);
    // Exercise the typed getters on every key.
    for (key, _) in header.metadata.iter() {
        let _ = header.metadata.get_u64(key);
        let _ = header.metadata.get_f32(key);
        let _ = header.metadata.get_str_array(key);
        let _ = header.metadata.get_i32_array(key);
        let _ = header.metadata.require_f32_array(key);
    }
    for t in &header.tensors {
        let _ = canonical_layer_index(&t.name);
        let _ = t.n_elements();
    }
});
