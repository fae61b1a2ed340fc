//! Decode throughput of one sequence against a batch of sequences stepped
//! together (`step_batch`): under a residency cap every layer the cap does not
//! keep is read once per step for the whole batch, so the batch's tokens/s
//! should grow almost linearly with its size (capped serving).
//!
//! ```sh
//! cargo run --release -p flatrun-runtime --example batch_decode -- MODEL.gguf [cap=40M] [BATCH] [STEPS]
//! ```
//! Run it inside a memory cgroup to measure the capped case.

use flatrun_runtime::{LoadOptions, Model, Residency, Sequence, StepOptions};
use std::time::Instant;

fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// Decode `steps` tokens for every sequence of `seqs` (already prefilled,
/// next inputs in `next`), stepping them together; returns tokens/s.
fn decode(
    model: &mut Model,
    seqs: &mut [Sequence],
    next: &mut [u32],
    steps: usize,
) -> Result<f64, Box<dyn std::error::Error>> {
    let started = Instant::now();
    for _ in 0..steps {
        let inputs: Vec<[u32; 1]> = next.iter().map(|&t| [t]).collect();
        let mut batch: Vec<(&mut Sequence, &[u32])> = seqs
            .iter_mut()
            .zip(&inputs)
            .map(|(s, t)| (s, &t[..]))
            .collect();
        let outs = model
            .executor_mut()
            .step_batch(&mut batch, StepOptions::default())?;
        for (n, out) in next.iter_mut().zip(outs) {
            *n = argmax(&out.logits);
        }
    }
    Ok((steps * seqs.len()) as f64 / started.elapsed().as_secs_f64())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let path = args
        .next()
        .ok_or("usage: batch_decode MODEL [cap=SIZE] [BATCH] [STEPS]")?;
    let residency: Residency = args.next().as_deref().unwrap_or("cap=40M").parse()?;
    let batch: usize = args.next().map(|s| s.parse()).transpose()?.unwrap_or(8);
    let steps: usize = args.next().map(|s| s.parse()).transpose()?.unwrap_or(8);
    let mut model = Model::load(
        &path,
        LoadOptions {
            residency,
            ctx: Some(256),
            max_batch: 64,
            profile: true,
            ..LoadOptions::default()
        },
    )?;
    let prompts = [
        "The sea at night",
        "A recipe for bread",
        "Why is the sky blue?",
        "def fibonacci(n):",
        "The capital of France",
        "Once upon a time",
        "List three colors:",
        "Hello, my name is",
    ];
    let mut results = Vec::new();
    for size in [1, batch] {
        let mut seqs = Vec::with_capacity(size);
        let mut next = Vec::with_capacity(size);
        for i in 0..size {
            let ids = model
                .tokenizer()?
                .encode(prompts[i % prompts.len()], true, false)?;
            let mut seq = model.executor().new_sequence();
            let t0 = Instant::now();
            let out = model
                .executor_mut()
                .step(&mut seq, &ids, StepOptions::default())?;
            if size == 1 {
                println!(
                    "time to first token: {:.3} s ({} prompt tokens)",
                    t0.elapsed().as_secs_f64(),
                    ids.len()
                );
            }
            next.push(argmax(&out.logits));
            seqs.push(seq);
        }
        model.profiler_mut().reset();
        let tok_s = decode(&mut model, &mut seqs, &mut next, steps)?;
        println!(
            "batch {size}: {tok_s:.2} tokens/s ({steps} steps), I/O wait {:.1}% of step time",
            100.0 * model.profiler().io_wait_share()
        );
        results.push(tok_s);
    }
    println!(
        "RESULT residency={residency:?} single_tok_s={:.3} batch={batch} batch_tok_s={:.3} ratio={:.2}",
        results[0],
        results[1],
        results[1] / results[0]
    );
    Ok(())
}
