#![allow(dead_code)]
//! Locating the real models for tests (shared by several test files).

use std::path::PathBuf;

/// The model file `name` in `$FLATRUN_MODELS` (default
/// `~/.cache/flatrun/models`), or `None` after printing a skip message.
/// With `FLATRUN_REQUIRE_MODELS=1` a missing model fails the test instead.
pub fn model_path(name: &str) -> Option<PathBuf> {
    let dir = std::env::var_os("FLATRUN_MODELS")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let home = std::env::var_os("HOME")
                .map(PathBuf::from)
                .unwrap_or_default();
            home.join(".cache/flatrun/models")
        });
    let path = dir.join(name);
    if path.is_file() {
        return Some(path);
    }
    if std::env::var("FLATRUN_REQUIRE_MODELS").as_deref() == Ok("1") {
        panic!(
            "model {} is missing and FLATRUN_REQUIRE_MODELS=1",
            path.display()
        );
    }
    eprintln!(
        "skipping: model {} not found (set FLATRUN_MODELS)",
        path.display()
    );
    None
}

/// Path of a committed fixture.
pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// A minimal GGUF writer for tests: build headers byte by byte, including
/// deliberately broken ones.
#[allow(dead_code)]
pub mod gguf_writer {
    /// Bytes of a GGUF file under construction.
    #[derive(Default)]
    pub struct GgufBytes {
        pub bytes: Vec<u8>,
    }

    impl GgufBytes {
        pub fn header(version: u32, tensors: u64, kvs: u64) -> Self {
            let mut g = GgufBytes::default();
            g.bytes.extend_from_slice(b"GGUF");
            g.u32(version).u64(tensors).u64(kvs);
            g
        }
        pub fn u8(&mut self, v: u8) -> &mut Self {
            self.bytes.push(v);
            self
        }
        pub fn u32(&mut self, v: u32) -> &mut Self {
            self.bytes.extend_from_slice(&v.to_le_bytes());
            self
        }
        pub fn u64(&mut self, v: u64) -> &mut Self {
            self.bytes.extend_from_slice(&v.to_le_bytes());
            self
        }
        pub fn raw(&mut self, b: &[u8]) -> &mut Self {
            self.bytes.extend_from_slice(b);
            self
        }
        pub fn string(&mut self, s: &str) -> &mut Self {
            self.u64(s.len() as u64).raw(s.as_bytes())
        }
        /// A key with a u32 value.
        pub fn kv_u32(&mut self, key: &str, v: u32) -> &mut Self {
            self.string(key).u32(4).u32(v)
        }
        /// A key with a string value.
        pub fn kv_str(&mut self, key: &str, v: &str) -> &mut Self {
            self.string(key).u32(8).string(v)
        }
        /// A tensor-info entry with `dims` fastest axis first.
        pub fn tensor(
            &mut self,
            name: &str,
            dims: &[u64],
            ggml_type: u32,
            offset: u64,
        ) -> &mut Self {
            self.string(name).u32(dims.len() as u32);
            for &d in dims {
                self.u64(d);
            }
            self.u32(ggml_type).u64(offset)
        }
        /// Pad with zeros to a multiple of `alignment`.
        pub fn align(&mut self, alignment: usize) -> &mut Self {
            while !self.bytes.len().is_multiple_of(alignment) {
                self.bytes.push(0);
            }
            self
        }
        pub fn zeros(&mut self, n: usize) -> &mut Self {
            self.bytes.resize(self.bytes.len() + n, 0);
            self
        }
        pub fn build(&self) -> Vec<u8> {
            self.bytes.clone()
        }
    }
}

/// Build safetensors files by hand (so tests can also write lying ones).
pub mod safetensors_writer {
    /// `(name, dtype, shape, bytes)` → a safetensors file, tensors stored in
    /// the given order, with optional `__metadata__`.
    pub fn safetensors_bytes(
        tensors: &[(&str, &str, Vec<usize>, Vec<u8>)],
        metadata: &[(&str, &str)],
    ) -> Vec<u8> {
        let mut header = serde_json::Map::new();
        if !metadata.is_empty() {
            let m: serde_json::Map<String, serde_json::Value> = metadata
                .iter()
                .map(|(k, v)| (k.to_string(), serde_json::Value::from(*v)))
                .collect();
            header.insert("__metadata__".into(), m.into());
        }
        let mut data = Vec::new();
        for (name, dtype, shape, bytes) in tensors {
            let begin = data.len();
            data.extend_from_slice(bytes);
            header.insert(
                name.to_string(),
                serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [begin, data.len()]}),
            );
        }
        raw_safetensors(&serde_json::Value::from(header).to_string(), &data)
    }

    /// A file from a literal header string and data.
    pub fn raw_safetensors(header: &str, data: &[u8]) -> Vec<u8> {
        let mut out = (header.len() as u64).to_le_bytes().to_vec();
        out.extend_from_slice(header.as_bytes());
        out.extend_from_slice(data);
        out
    }

    /// `n` bytes counting up from `seed`.
    pub fn pattern(n: usize, seed: u8) -> Vec<u8> {
        (0..n)
            .map(|i| (i as u8).wrapping_mul(7).wrapping_add(seed))
            .collect()
    }
}
