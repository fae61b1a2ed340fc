//! Streaming detokenization: turns tokens into text pieces as they arrive,
//! never splitting a UTF-8 character and keeping the spacing a tokenizer
//! only produces with left context (SentencePiece's leading spaces).

use crate::batch_model::{ModelError, TextModel};

/// Decodes a growing token sequence into text deltas.
///
/// Each step decodes a short window ending at the newest token and emits the
/// part past what the window's older tokens already produced; a delta that
/// ends in U+FFFD (an incomplete character) is held until more tokens come.
#[derive(Clone, Debug, Default)]
pub struct IncrementalDecoder {
    tokens: Vec<u32>,
    /// Start of the context window (tokens already emitted, kept for context).
    prefix_offset: usize,
    /// End of the tokens whose text was emitted.
    read_offset: usize,
}

impl IncrementalDecoder {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a token; returns the text it releases (possibly empty).
    pub fn push(&mut self, text_model: &dyn TextModel, token: u32) -> Result<String, ModelError> {
        self.tokens.push(token);
        let emitted = text_model.detokenize(&self.tokens[self.prefix_offset..self.read_offset])?;
        let window = text_model.detokenize(&self.tokens[self.prefix_offset..])?;
        if window.ends_with('\u{FFFD}') {
            return Ok(String::new());
        }
        let delta = match window.get(emitted.len()..) {
            Some(delta) if window.starts_with(&emitted) => delta.to_string(),
            // The window re-decoded differently: emit nothing new rather than garble.
            _ => String::new(),
        };
        self.prefix_offset = self.read_offset;
        self.read_offset = self.tokens.len();
        Ok(delta)
    }

    /// Text of tokens still held (an incomplete character at the very end).
    pub fn flush(&mut self, text_model: &dyn TextModel) -> Result<String, ModelError> {
        if self.read_offset == self.tokens.len() {
            return Ok(String::new());
        }
        let emitted = text_model.detokenize(&self.tokens[self.prefix_offset..self.read_offset])?;
        let window = text_model.detokenize(&self.tokens[self.prefix_offset..])?;
        self.prefix_offset = self.read_offset;
        self.read_offset = self.tokens.len();
        Ok(window.get(emitted.len()..).unwrap_or_default().to_string())
    }
}
