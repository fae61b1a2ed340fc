//! A minimal GGUF reader for the tests: tensor names, types, shapes and data
//! offsets (the storage crate owns the real parser).

use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::path::Path;

pub struct GgufTensor {
    pub name: String,
    pub type_id: u32,
    /// ggml order: ne[0] is the row length.
    pub ne: Vec<u64>,
    /// Absolute byte offset of the data.
    pub offset: u64,
}

fn u32_(r: &mut impl Read) -> u32 {
    let mut b = [0; 4];
    r.read_exact(&mut b).unwrap();
    u32::from_le_bytes(b)
}

fn u64_(r: &mut impl Read) -> u64 {
    let mut b = [0; 8];
    r.read_exact(&mut b).unwrap();
    u64::from_le_bytes(b)
}

fn string(r: &mut impl Read) -> String {
    let n = u64_(r) as usize;
    let mut b = vec![0; n];
    r.read_exact(&mut b).unwrap();
    String::from_utf8_lossy(&b).into_owned()
}

fn skip_value(r: &mut impl Read, t: u32) -> Option<u64> {
    let scalar = |t: u32| match t {
        0 | 1 | 7 => Some(1),
        2 | 3 => Some(2),
        4..=6 => Some(4),
        10..=12 => Some(8),
        _ => None,
    };
    match t {
        8 => {
            string(r);
            None
        }
        9 => {
            let et = u32_(r);
            let n = u64_(r);
            for _ in 0..n {
                skip_value(r, et);
            }
            None
        }
        4 => Some(u32_(r) as u64),
        _ => {
            let n = scalar(t).expect("GGUF value type");
            let mut b = vec![0; n];
            r.read_exact(&mut b).unwrap();
            None
        }
    }
}

pub fn tensors(path: &Path) -> Vec<GgufTensor> {
    let mut r = BufReader::new(File::open(path).unwrap());
    assert_eq!(u32_(&mut r), 0x4655_4747, "GGUF magic");
    let _version = u32_(&mut r);
    let n_tensors = u64_(&mut r);
    let n_kv = u64_(&mut r);
    let mut alignment = 32u64;
    for _ in 0..n_kv {
        let key = string(&mut r);
        let t = u32_(&mut r);
        let v = skip_value(&mut r, t);
        if key == "general.alignment" {
            alignment = v.unwrap_or(32);
        }
    }
    let mut out = Vec::new();
    for _ in 0..n_tensors {
        let name = string(&mut r);
        let nd = u32_(&mut r);
        let ne = (0..nd).map(|_| u64_(&mut r)).collect();
        let type_id = u32_(&mut r);
        let offset = u64_(&mut r);
        out.push(GgufTensor {
            name,
            type_id,
            ne,
            offset,
        });
    }
    let pos = r.stream_position().unwrap();
    let data_start = pos.div_ceil(alignment) * alignment;
    for t in &mut out {
        t.offset += data_start;
    }
    out
}

/// Read `len` bytes at `offset`.
pub fn read_at(file: &mut File, offset: u64, len: usize) -> Vec<u8> {
    let mut buf = vec![0; len];
    file.seek(SeekFrom::Start(offset)).unwrap();
    file.read_exact(&mut buf).unwrap();
    buf
}
