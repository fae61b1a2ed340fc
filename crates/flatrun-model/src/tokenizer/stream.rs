//! Streaming detokenization: text comes out as tokens arrive, but a UTF-8
//! sequence split across tokens (a byte-fallback emoji, a CJK character in
//! byte-level BPE) is held back until it is complete.

use super::{TokenKind, Tokenizer};

/// Turns a stream of ids into text, never emitting a broken UTF-8 sequence.
/// Control tokens are not rendered.
#[derive(Debug)]
pub struct StreamDecoder<'t> {
    tokenizer: &'t Tokenizer,
    /// Bytes of an incomplete UTF-8 sequence waiting for the next token.
    pending: Vec<u8>,
    /// Nothing has been emitted yet (for the SentencePiece leading space).
    at_start: bool,
}

impl<'t> StreamDecoder<'t> {
    pub fn new(tokenizer: &'t Tokenizer) -> StreamDecoder<'t> {
        StreamDecoder {
            tokenizer,
            pending: Vec::new(),
            at_start: true,
        }
    }

    /// Feed one id; returns the text that became complete, if any.
    pub fn push(&mut self, id: u32) -> Option<String> {
        match self.tokenizer.token_kind(id) {
            None | Some(TokenKind::Control | TokenKind::Unknown) => return None,
            _ => {}
        }
        let mut piece = self.tokenizer.pieces.get(id as usize)?;
        // SentencePiece: the space added before the first word is not text.
        if self.at_start && self.tokenizer.strips_leading_space() && piece.first() == Some(&b' ') {
            piece = &piece[1..];
        }
        if !piece.is_empty() {
            self.at_start = false;
        }
        self.pending.extend_from_slice(piece);
        let text = self.take_complete();
        (!text.is_empty()).then_some(text)
    }

    /// Whatever is still held back, with an unfinished sequence as U+FFFD.
    pub fn finish(mut self) -> String {
        let rest = std::mem::take(&mut self.pending);
        String::from_utf8_lossy(&rest).into_owned()
    }

    /// Take the longest prefix of `pending` that is complete text; invalid
    /// bytes become U+FFFD, an incomplete tail stays pending.
    fn take_complete(&mut self) -> String {
        let mut out = String::new();
        let mut consumed = 0;
        loop {
            match std::str::from_utf8(&self.pending[consumed..]) {
                Ok(s) => {
                    out.push_str(s);
                    consumed = self.pending.len();
                    break;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    // The first `valid_up_to` bytes are valid UTF-8 by definition.
                    out.push_str(
                        std::str::from_utf8(&self.pending[consumed..consumed + valid])
                            .unwrap_or_default(),
                    );
                    consumed += valid;
                    match e.error_len() {
                        // An invalid sequence: replace it and go on.
                        Some(bad) => {
                            out.push('\u{fffd}');
                            consumed += bad;
                        }
                        // A sequence cut at the end: wait for more bytes.
                        None => break,
                    }
                }
            }
        }
        self.pending.drain(..consumed);
        out
    }
}
