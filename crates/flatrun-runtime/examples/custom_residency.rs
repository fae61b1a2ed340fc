//! Residency policies side by side: stream (one layer resident), a byte cap,
//! and fully resident — with decode speed, the plan's streamed bytes per
//! token, the I/O-wait share and the peak RSS of each.
//!
//! ```sh
//! cargo run --release -p flatrun-runtime --example custom_residency -- MODEL.gguf 100M
//! ```

use flatrun_runtime::{residency::ResidencyPlan, GenerateOptions, LoadOptions, Model, Residency};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let path = args.next().ok_or("usage: custom_residency MODEL [CAP]")?;
    let cap = flatrun_runtime::options::parse_size(&args.next().unwrap_or_else(|| "64M".into()))?;

    for policy in [Residency::Stream, Residency::Cap(cap), Residency::Resident] {
        let mut model = Model::load(
            &path,
            LoadOptions {
                residency: policy,
                profile: true,
                trace_memory: true,
                ..LoadOptions::default()
            },
        )?;
        // The plan the policy made over the manifest.
        let plan: &ResidencyPlan = model.executor().residency();
        let kept = plan.resident.iter().filter(|&&r| r).count();
        println!(
            "{policy:?}: {kept}/{} layers resident ({:.1} MB), {:.1} MB streamed per token",
            plan.resident.len(),
            plan.resident_bytes as f64 / 1e6,
            plan.streamed_bytes_per_token as f64 / 1e6
        );
        let gen = model.generate("The history of astronomy", GenerateOptions::greedy(16))?;
        for event in gen {
            event?;
        }
        let p = model.profiler();
        println!(
            "    decode {:.1} tok/s, I/O wait {:.1}%, peak RSS {:.1} MB",
            p.decode_tok_s(),
            100.0 * p.io_wait_share(),
            p.peak_rss.total() as f64 / 1e6
        );
    }
    Ok(())
}
