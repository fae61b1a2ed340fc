//! Residency policies side by side: stream (one layer resident), a byte cap,
//! a policy of your own (here: keep the first and last quarter of the layers,
//! stream the middle), and fully resident — with decode speed, the plan's
//! streamed bytes per token, the I/O-wait share and the peak RSS of each.
//!
//! ```sh
//! cargo run --release -p flatrun-examples --example custom_residency -- MODEL.gguf 100M
//! ```

use flatrun_runtime::{GenerateOptions, LoadOptions, Manifest, Model, Residency, ResidencyPlan};

/// A custom policy: keep the first and last quarter of the layers resident.
/// It sees every layer's index and size (`m.layers[i].bytes`), so it could as
/// well keep the largest layers, or those a profile says are slowest to read.
fn outer_quarters(m: &Manifest) -> Vec<bool> {
    let n = m.layers.len();
    (0..n).map(|i| i < n / 4 || i >= n - n / 4).collect()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let path = args.next().ok_or("usage: custom_residency MODEL [CAP]")?;
    let cap = flatrun_runtime::parse_size(&args.next().unwrap_or_else(|| "64M".into()))?;

    for (name, policy) in [
        ("stream", Residency::Stream),
        ("cap", Residency::Cap(cap)),
        ("custom: outer quarters", Residency::Custom(outer_quarters)),
        ("resident", Residency::Resident),
    ] {
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
            "{name}: {kept}/{} layers resident ({:.1} MB), {:.1} MB streamed per token",
            plan.resident.len(),
            plan.resident_bytes as f64 / 1e6,
            plan.streamed_bytes_per_token as f64 / 1e6
        );
        let r#gen = model.generate("The history of astronomy", GenerateOptions::greedy(16))?;
        for event in r#gen {
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
