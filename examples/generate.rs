//! Generate text from a prompt, streaming it to stdout.
//!
//! ```sh
//! cargo run --release -p flatrun-examples --example generate -- MODEL.gguf "The capital of France is" [max_new] [stream|resident|cap=SIZE]
//! ```

use flatrun_runtime::{GenerateOptions, LoadOptions, Model, Residency};
use std::io::Write;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let model_path = args
        .next()
        .ok_or("usage: generate MODEL PROMPT [MAX_NEW] [RESIDENCY]")?;
    let prompt = args
        .next()
        .unwrap_or_else(|| "The capital of France is".to_string());
    let max_new: usize = args.next().map_or(Ok(32), |s| s.parse())?;
    let residency: Residency = args.next().map_or(Ok(Residency::Resident), |s| s.parse())?;

    let mut model = Model::load(
        &model_path,
        LoadOptions {
            residency,
            ..LoadOptions::default()
        },
    )?;
    print!("{prompt}");
    for event in model.generate(prompt.as_str(), GenerateOptions::greedy(max_new))? {
        print!("{}", event?.text);
        std::io::stdout().flush()?;
    }
    println!();
    eprintln!("{}", model.profiler().summary());
    Ok(())
}
