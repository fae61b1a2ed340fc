//! Teacher-forced logits of a prompt: the top-5 next tokens at every position.
//!
//! ```sh
//! cargo run --release -p flatrun-examples --example inspect_logits -- MODEL.gguf "The quick brown fox"
//! ```

use flatrun_runtime::{LoadOptions, Model, StepOptions};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let path = args.next().ok_or("usage: inspect_logits MODEL PROMPT")?;
    let prompt = args.next().unwrap_or_else(|| "The quick brown fox".into());
    let mut model = Model::load(&path, LoadOptions::default())?;
    let tokens = model.encode(&prompt, true)?;
    let vocab = model.executor().vocab_size();
    let tokenizer = model.tokenizer()?.clone();

    // One batched step over the whole prompt, keeping every position's logits.
    let mut session = model.session();
    let out = session.step_with(
        &tokens,
        StepOptions {
            all_logits: true,
            hidden: true,
            ..Default::default()
        },
    )?;
    let all = out.all_logits.unwrap_or_default();
    for (p, &tok) in tokens.iter().enumerate() {
        let row = &all[p * vocab..(p + 1) * vocab];
        let mut order: Vec<usize> = (0..vocab).collect();
        order.select_nth_unstable_by(5, |&a, &b| row[b].total_cmp(&row[a]));
        order.truncate(5);
        order.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
        let piece = |id: u32| String::from_utf8_lossy(&tokenizer.token_to_piece(id)).into_owned();
        let top: Vec<String> = order
            .iter()
            .map(|&i| format!("{:?} {:.2}", piece(i as u32), row[i]))
            .collect();
        println!("{p:3} {:>16?} → {}", piece(tok), top.join(" | "));
    }
    if let Some(h) = out.hidden {
        println!(
            "last hidden state: {} values, norm {:.3}",
            h.len(),
            h.iter().map(|x| x * x).sum::<f32>().sqrt()
        );
    }
    Ok(())
}
