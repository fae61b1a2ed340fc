//! Writing GGUF v3 files: the key/values, the tensor-info table, then each
//! tensor's bytes at its aligned offset. The file is written under a
//! temporary name next to the target and renamed into place by
//! [`GgufWriter::finish`], so a failure (a full disk, an interrupted run)
//! never leaves a partial file under the final name.

use crate::{GgmlType, MetaValue, Metadata};
use std::fs::File;
use std::io::{self, BufWriter, Seek, Write};
use std::path::{Path, PathBuf};

/// A tensor of the file to write: its name, its ggml dims (fastest axis
/// first) and its type. Its byte size follows from them.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorSpec {
    pub name: String,
    pub dims: Vec<u64>,
    pub ty: GgmlType,
}

impl TensorSpec {
    /// Bytes of the tensor's data (`None` if the dims do not hold whole blocks).
    pub fn byte_size(&self) -> Option<u64> {
        let n = self.dims.iter().try_fold(1u64, |a, &d| a.checked_mul(d))?;
        if self.dims.first().copied().unwrap_or(1) % self.ty.block_size() as u64 != 0 {
            return None;
        }
        self.ty.bytes_for(n)
    }
}

/// GGUF type id of a value (arrays: 9).
fn type_id(v: &MetaValue) -> u32 {
    match v {
        MetaValue::U8(_) => 0,
        MetaValue::I8(_) => 1,
        MetaValue::U16(_) => 2,
        MetaValue::I16(_) => 3,
        MetaValue::U32(_) => 4,
        MetaValue::I32(_) => 5,
        MetaValue::F32(_) => 6,
        MetaValue::Bool(_) => 7,
        MetaValue::String(_) => 8,
        MetaValue::Array(_) => 9,
        MetaValue::U64(_) => 10,
        MetaValue::I64(_) => 11,
        MetaValue::F64(_) => 12,
    }
}

fn put_string(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

/// The bytes of a value, without its type id.
fn put_value(out: &mut Vec<u8>, v: &MetaValue) {
    match v {
        MetaValue::U8(x) => out.push(*x),
        MetaValue::I8(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::Bool(x) => out.push(u8::from(*x)),
        MetaValue::String(s) => put_string(out, s),
        MetaValue::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::Array(items) => {
            // An empty array has no element to name its type: u8 then.
            let elem = items.first().map_or(0, type_id);
            out.extend_from_slice(&elem.to_le_bytes());
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for item in items {
                put_value(out, item);
            }
        }
    }
}

/// The header (key/values and tensor infos, padded to `alignment`) of a
/// file holding `tensors` in this order.
pub fn encode_header(
    metadata: &Metadata,
    tensors: &[TensorSpec],
    alignment: u64,
) -> io::Result<Vec<u8>> {
    let mut out = b"GGUF".to_vec();
    out.extend_from_slice(&3u32.to_le_bytes());
    out.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
    out.extend_from_slice(&(metadata.len() as u64).to_le_bytes());
    for (key, value) in metadata.iter() {
        put_string(&mut out, key);
        out.extend_from_slice(&type_id(value).to_le_bytes());
        put_value(&mut out, value);
    }
    let mut offset = 0u64;
    for t in tensors {
        let size = t.byte_size().ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "tensor {}: dims {:?} do not fit type {}",
                    t.name, t.dims, t.ty
                ),
            )
        })?;
        put_string(&mut out, &t.name);
        out.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
        for d in &t.dims {
            out.extend_from_slice(&d.to_le_bytes());
        }
        out.extend_from_slice(&t.ty.id().to_le_bytes());
        out.extend_from_slice(&offset.to_le_bytes());
        offset = (offset + size).next_multiple_of(alignment);
    }
    out.resize((out.len() as u64).next_multiple_of(alignment) as usize, 0);
    Ok(out)
}

/// A GGUF file being written: create it with every tensor's spec, then
/// give each tensor's bytes in the same order, then [`GgufWriter::finish`].
pub struct GgufWriter {
    out: BufWriter<File>,
    partial: PathBuf,
    target: PathBuf,
    sizes: Vec<u64>,
    names: Vec<String>,
    next: usize,
    alignment: u64,
}

impl GgufWriter {
    /// Start `path` (written as `path.partial` until finished).
    pub fn create(
        path: &Path,
        metadata: &Metadata,
        tensors: &[TensorSpec],
    ) -> io::Result<GgufWriter> {
        let alignment = metadata
            .get_u64("general.alignment")
            .filter(|a| a.is_power_of_two())
            .unwrap_or(32);
        let header = encode_header(metadata, tensors, alignment)?;
        let mut name = path.file_name().unwrap_or_default().to_os_string();
        name.push(".partial");
        let partial = path.with_file_name(name);
        let mut out = BufWriter::with_capacity(1 << 20, File::create(&partial)?);
        out.write_all(&header)?;
        Ok(GgufWriter {
            out,
            partial,
            target: path.to_path_buf(),
            // `encode_header` checked every size.
            sizes: tensors.iter().map(|t| t.byte_size().unwrap_or(0)).collect(),
            names: tensors.iter().map(|t| t.name.clone()).collect(),
            next: 0,
            alignment,
        })
    }

    /// The bytes of the next tensor.
    pub fn write_tensor(&mut self, data: &[u8]) -> io::Result<()> {
        let Some(&size) = self.sizes.get(self.next) else {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "more tensors than the header lists",
            ));
        };
        if data.len() as u64 != size {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "tensor {}: {} bytes given, {size} expected",
                    self.names[self.next],
                    data.len()
                ),
            ));
        }
        self.out.write_all(data)?;
        let pad = size.next_multiple_of(self.alignment) - size;
        self.out.write_all(&vec![0u8; pad as usize])?;
        self.next += 1;
        Ok(())
    }

    /// Flush, sync and rename into place.
    pub fn finish(mut self) -> io::Result<PathBuf> {
        if self.next != self.sizes.len() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{} of {} tensors written", self.next, self.sizes.len()),
            ));
        }
        self.out.flush()?;
        let file = self.out.get_mut();
        file.stream_position()?;
        file.sync_all()?;
        std::fs::rename(&self.partial, &self.target)?;
        self.next = usize::MAX;
        Ok(self.target.clone())
    }
}

impl Drop for GgufWriter {
    fn drop(&mut self) {
        // Not finished: remove the partial file.
        if self.next != usize::MAX {
            let _ = std::fs::remove_file(&self.partial);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::parse_header;

    #[test]
    fn a_written_file_parses_back_with_its_metadata_and_tensors() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.gguf");
        let mut md = Metadata::new();
        md.push("general.architecture", MetaValue::String("llama".into()));
        md.push("x.count", MetaValue::U32(7));
        md.push(
            "x.list",
            MetaValue::Array(vec![
                MetaValue::String("a".into()),
                MetaValue::String("bc".into()),
            ]),
        );
        md.push("x.f", MetaValue::F64(0.25));
        let tensors = vec![
            TensorSpec {
                name: "a.weight".into(),
                dims: vec![32, 2],
                ty: GgmlType::Q8_0,
            },
            TensorSpec {
                name: "b.weight".into(),
                dims: vec![3],
                ty: GgmlType::F32,
            },
        ];
        let mut w = GgufWriter::create(&path, &md, &tensors).unwrap();
        w.write_tensor(&[1u8; 68]).unwrap();
        w.write_tensor(&[2u8; 12]).unwrap();
        w.finish().unwrap();
        let bytes = std::fs::read(&path).unwrap();
        let h = parse_header(&path, &bytes).unwrap();
        assert_eq!(h.metadata, md);
        assert_eq!(h.tensors.len(), 2);
        assert_eq!(h.tensors[0].shape, vec![2, 32]);
        let t1 = &h.tensors[1];
        assert_eq!(
            &bytes[t1.offset as usize..t1.offset as usize + 12],
            &[2u8; 12]
        );
        assert!(!dir.path().join("t.gguf.partial").exists());
    }

    #[test]
    fn an_unfinished_file_leaves_nothing_under_either_name() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.gguf");
        let tensors = vec![TensorSpec {
            name: "a".into(),
            dims: vec![4],
            ty: GgmlType::F32,
        }];
        let w = GgufWriter::create(&path, &Metadata::new(), &tensors).unwrap();
        drop(w);
        assert!(!path.exists());
        assert!(!dir.path().join("t.gguf.partial").exists());
        let mut w = GgufWriter::create(&path, &Metadata::new(), &tensors).unwrap();
        assert!(w.write_tensor(&[0u8; 3]).is_err());
        assert!(w.finish().is_err());
        assert!(!path.exists());
    }
}
