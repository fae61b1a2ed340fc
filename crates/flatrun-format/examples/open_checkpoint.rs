//! Open a checkpoint and report how long the header parse took, the tensor
//! count and the first few canonical names.
//!
//! ```sh
//! cargo run --release -p flatrun-format --example open_checkpoint -- MODEL.gguf
//! ```

use std::time::Instant;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let Some(path) = std::env::args_os().nth(1) else {
        eprintln!("usage: open_checkpoint PATH");
        std::process::exit(2);
    };
    // Open: map the file(s) once and parse the header.
    let start = Instant::now();
    let backend = flatrun_format::open(path.as_ref())?;
    let opened = start.elapsed();
    // List: metadata only, no tensor bytes touched.
    println!(
        "{}: {} tensors, {} metadata keys, {} bytes, opened in {:.1} ms",
        backend.name(),
        backend.tensors().len(),
        backend.metadata().len(),
        backend.total_bytes(),
        opened.as_secs_f64() * 1e3
    );
    for t in backend.tensors().iter().take(5) {
        println!("  {:<24} {:<8} {:?}", t.name, t.dtype.to_string(), t.shape);
    }
    Ok(())
}
