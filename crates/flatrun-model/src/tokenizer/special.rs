//! Cutting text at special tokens before the text is encoded, the way
//! llama.cpp does it: special tokens are tried longest first, each one
//! splitting every remaining stretch of text at its occurrences, left to
//! right. With `parse_special = false` control tokens are left as text, but
//! user-defined tokens are still matched.

use std::collections::HashSet;

use super::hash::FastMap;
use super::vocab::{TokenKind, Vocab};

/// A stretch of the input: plain text to encode, or a special token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Fragment {
    Text { start: usize, end: usize },
    Token(u32),
}

/// One matchable special token.
#[derive(Clone, Debug)]
struct Special {
    id: u32,
    text: String,
    /// A control or unknown token: matched only with `parse_special`.
    needs_parse_special: bool,
    /// Swallow whitespace to the left / right of a match (Phi-3 style).
    lstrip: bool,
    rstrip: bool,
}

/// The special tokens of a vocabulary, longest first, with an index that
/// finds which of them occur in a text without searching for each one.
#[derive(Clone, Debug, Default)]
pub(crate) struct SpecialTokens {
    by_length: Vec<Special>,
    /// For each first byte (the index), the distinct lengths of special
    /// tokens starting with it that are not runs of one byte; empty until built.
    lengths_by_first_byte: Vec<Vec<usize>>,
    /// Special tokens that repeat one byte (`"\n\n"`, four spaces: Gemma 3
    /// has ninety), as `(byte, length, position in by_length)`: such a token
    /// occurs exactly when the text has a run of that byte at least that
    /// long, which one pass finds (probing every space for thirty lengths
    /// took most of Gemma 3's tokenizing time).
    runs: Vec<(u8, usize, usize)>,
    /// Text → position in `by_length` (keys are vocabulary texts, so the
    /// fast unkeyed hash is safe here).
    position: FastMap<String, usize>,
}

impl SpecialTokens {
    /// Collect control, user-defined and unknown tokens. `phi3_rules` gives
    /// every token but `<unk>`, `<s>` and `<|endoftext|>` right-strip (llama.cpp does that for Phi-3 models).
    pub fn from_vocab(vocab: &Vocab, phi3_rules: bool) -> SpecialTokens {
        let mut by_length = Vec::new();
        for (id, text) in vocab.texts.iter().enumerate() {
            let kind = vocab.kinds[id];
            if !matches!(
                kind,
                TokenKind::Control | TokenKind::UserDefined | TokenKind::Unknown
            ) {
                continue;
            }
            let rstrip = phi3_rules && !matches!(text, "<unk>" | "<s>" | "<|endoftext|>");
            by_length.push(Special {
                id: id as u32,
                text: text.to_string(),
                needs_parse_special: kind != TokenKind::UserDefined,
                lstrip: false,
                rstrip,
            });
        }
        Self::from_list(by_length)
    }

    fn from_list(mut by_length: Vec<Special>) -> SpecialTokens {
        by_length.retain(|s| !s.text.is_empty());
        by_length.sort_by_key(|s| std::cmp::Reverse(s.text.len()));
        let mut lengths_by_first_byte: Vec<Vec<usize>> = vec![Vec::new(); 256];
        let mut runs = Vec::new();
        let mut position = FastMap::default();
        for (i, s) in by_length.iter().enumerate() {
            let bytes = s.text.as_bytes();
            let first = bytes[0];
            let first_of_its_text = *position.entry(s.text.clone()).or_insert(i) == i;
            if bytes.iter().all(|&b| b == first) {
                if first_of_its_text {
                    runs.push((first, bytes.len(), i));
                }
            } else {
                let lengths = &mut lengths_by_first_byte[first as usize];
                if !lengths.contains(&bytes.len()) {
                    lengths.push(bytes.len());
                }
            }
        }
        SpecialTokens {
            by_length,
            lengths_by_first_byte,
            runs,
            position,
        }
    }

    /// Positions (in `by_length`) of the special tokens occurring in `text`.
    fn occurring(&self, text: &str, parse_special: bool) -> Vec<usize> {
        let bytes = text.as_bytes();
        let mut found = HashSet::new();
        let wanted = |s: &Special| parse_special || !s.needs_parse_special;
        if !self.runs.is_empty() {
            // The longest run of each byte value.
            let mut longest = [0usize; 256];
            let mut run = 0;
            for (at, &b) in bytes.iter().enumerate() {
                run = if at > 0 && bytes[at - 1] == b {
                    run + 1
                } else {
                    1
                };
                let slot = &mut longest[b as usize];
                *slot = (*slot).max(run);
            }
            for &(b, len, pos) in &self.runs {
                if longest[b as usize] >= len && wanted(&self.by_length[pos]) {
                    found.insert(pos);
                }
            }
        }
        for (at, &b) in bytes.iter().enumerate() {
            let Some(lengths) = self.lengths_by_first_byte.get(b as usize) else {
                continue;
            };
            for &len in lengths {
                let Some(candidate) = text.get(at..at + len) else {
                    continue;
                };
                if let Some(&pos) = self.position.get(candidate)
                    && (parse_special || !self.by_length[pos].needs_parse_special)
                {
                    found.insert(pos);
                }
            }
        }
        let mut found: Vec<usize> = found.into_iter().collect();
        found.sort_unstable();
        found
    }

    /// Cut `text` into plain-text fragments and special tokens.
    pub fn partition(&self, text: &str, parse_special: bool) -> Vec<Fragment> {
        let mut fragments = vec![Fragment::Text {
            start: 0,
            end: text.len(),
        }];
        if text.is_empty() {
            return Vec::new();
        }
        for pos in self.occurring(text, parse_special) {
            let special = &self.by_length[pos];
            let mut next = Vec::with_capacity(fragments.len() + 2);
            for fragment in fragments {
                let Fragment::Text { mut start, end } = fragment else {
                    next.push(fragment);
                    continue;
                };
                // Split this stretch at every occurrence, left to right.
                while let Some(found) = text[start..end].find(special.text.as_str()) {
                    let match_start = start + found;
                    let mut left_end = match_start;
                    if special.lstrip {
                        while left_end > start
                            && text.as_bytes()[left_end - 1].is_ascii_whitespace()
                        {
                            left_end -= 1;
                        }
                    }
                    if left_end > start {
                        next.push(Fragment::Text {
                            start,
                            end: left_end,
                        });
                    }
                    next.push(Fragment::Token(special.id));
                    start = match_start + special.text.len();
                    if special.rstrip {
                        while start < end && text.as_bytes()[start].is_ascii_whitespace() {
                            start += 1;
                        }
                    }
                }
                if start < end {
                    next.push(Fragment::Text { start, end });
                }
            }
            fragments = next;
        }
        fragments
    }
}
