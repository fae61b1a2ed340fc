//! A chat loop: read a line, answer with the model's chat template, repeat.
//!
//! ```sh
//! cargo run --release -p flatrun-runtime --example chat -- MODEL.gguf
//! ```

use flatrun_runtime::{ChatMessage, GenerateOptions, LoadOptions, Model};
use std::io::{BufRead, Write};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = std::env::args().nth(1).ok_or("usage: chat MODEL")?;
    let mut model = Model::load(&path, LoadOptions::default())?;
    let mut history: Vec<ChatMessage> = Vec::new();
    let stdin = std::io::stdin();
    print!("> ");
    std::io::stdout().flush()?;
    for line in stdin.lock().lines() {
        let line = line?;
        if line.trim().is_empty() {
            break;
        }
        history.push(ChatMessage::new("user", line));
        // Render the whole conversation and generate the assistant's turn.
        let prompt = model.apply_chat_template(&history, true)?;
        let ids = model.encode(&prompt, true)?;
        let mut answer = String::new();
        for event in model.generate(ids, GenerateOptions::greedy(256))? {
            let event = event?;
            print!("{}", event.text);
            std::io::stdout().flush()?;
            answer.push_str(&event.text);
        }
        history.push(ChatMessage::new("assistant", answer));
        print!("\n> ");
        std::io::stdout().flush()?;
    }
    Ok(())
}
