//! A chat loop: read a line, answer with the model's chat template, repeat.
//! Each turn feeds only the tokens after the part of the conversation the KV
//! cache already holds, so a long chat does not re-read its history.
//!
//! ```sh
//! cargo run --release -p flatrun-examples --example chat -- MODEL.gguf
//! ```

use flatrun_runtime::{ChatMessage, GenerateOptions, LoadOptions, Model};
use std::io::{BufRead, Write};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = std::env::args().nth(1).ok_or("usage: chat MODEL")?;
    let mut model = Model::load(&path, LoadOptions::default())?;
    let mut history: Vec<ChatMessage> = Vec::new();
    let mut seq = model.new_sequence();
    let stdin = std::io::stdin();
    print!("> ");
    std::io::stdout().flush()?;
    for line in stdin.lock().lines() {
        let line = line?;
        if line.trim().is_empty() {
            break;
        }
        history.push(ChatMessage::new("user", line));
        // Render the whole conversation, then keep the cached tokens it starts with
        // (at least the last prompt token is always fed again, to get its logits).
        let prompt = model.encode(&model.apply_chat_template(&history, true)?, true)?;
        let cached = seq
            .tokens()
            .iter()
            .zip(&prompt)
            .take_while(|(a, b)| a == b)
            .count()
            .min(prompt.len().saturating_sub(1));
        seq.truncate(cached);
        let new_tokens = prompt[cached..].to_vec();

        let mut answer = String::new();
        let mut generation = model.generate_in(seq, new_tokens, GenerateOptions::greedy(256))?;
        for event in &mut generation {
            let event = event?;
            print!("{}", event.text);
            std::io::stdout().flush()?;
            answer.push_str(&event.text);
        }
        seq = generation.into_sequence();
        history.push(ChatMessage::new("assistant", answer));
        print!("\n> ");
        std::io::stdout().flush()?;
    }
    Ok(())
}
