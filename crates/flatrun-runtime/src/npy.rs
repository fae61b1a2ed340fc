//! Writing f32 matrices as NumPy `.npy` files (for `--dump-logits`).

use std::io::Write;
use std::path::Path;

/// Write `data` (`rows × cols`, row-major) as a little-endian f32 `.npy`.
pub fn write_f32_matrix(
    path: &Path,
    data: &[f32],
    rows: usize,
    cols: usize,
) -> std::io::Result<()> {
    let mut header =
        format!("{{'descr': '<f4', 'fortran_order': False, 'shape': ({rows}, {cols}), }}");
    // Magic (6) + version (2) + header length (2) + header, padded to 64 with '\n' last.
    let unpadded = 10 + header.len() + 1;
    header.push_str(&" ".repeat(unpadded.next_multiple_of(64) - unpadded));
    header.push('\n');
    let mut out = std::io::BufWriter::new(std::fs::File::create(path)?);
    out.write_all(b"\x93NUMPY\x01\x00")?;
    out.write_all(&(header.len() as u16).to_le_bytes())?;
    out.write_all(header.as_bytes())?;
    for v in data {
        out.write_all(&v.to_le_bytes())?;
    }
    out.flush()
}
