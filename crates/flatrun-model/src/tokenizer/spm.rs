//! SentencePiece-style encoding (`tokenizer.ggml.model = llama`): merge the
//! adjacent pair whose concatenation is the highest-scoring vocabulary entry,
//! repeatedly, then fall back to `<0xNN>` byte tokens for what is left.
//!
//! This is custom code rather than the `tokenizers` crate's BPE because a GGUF
//! SentencePiece vocabulary has scores but no merge list, and llama.cpp's
//! result depends on its exact rules: any two adjacent pieces may merge when
//! their concatenation is a token; ties in score go to the leftmost pair; a
//! character that is not a token is spelled in byte tokens. A
//! BPE model with merges derived from scores breaks ties by merge order
//! instead, which changes ids for equal-score tokens (Gemma 3 has many).
//!
//! llama.cpp merges a whole stretch of text at once. Merges only ever build
//! vocabulary tokens, so no merge can join a character `x` to a following
//! `▁` unless some token contains `x▁`; the text can therefore be cut before
//! every other `▁` that follows a character, and each word merged on its
//! own gives exactly the same ids (the pairs of one word never compete with
//! another word's: the best pair of the whole text is the best of its own
//! word, ties go to the leftmost, as within the word). Words repeat, so
//! their ids are cached like the byte-level BPE's pre-tokens.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};
use std::sync::Mutex;

use super::vocab::Vocab;

/// The SentencePiece space.
const SPACE: char = '\u{2581}';

/// A SentencePiece encoder for one vocabulary.
pub(crate) struct SentencePiece {
    /// Characters that some token holds right before a `▁` (Gemma 3: `>`):
    /// the text is not cut between them and a `▁`.
    joined_before_space: Vec<char>,
    /// Ids of words already encoded.
    cache: Mutex<WordCache>,
}

impl Clone for SentencePiece {
    /// A clone starts with an empty cache.
    fn clone(&self) -> Self {
        SentencePiece {
            joined_before_space: self.joined_before_space.clone(),
            cache: Mutex::default(),
        }
    }
}

/// Ids of words seen before, up to a fixed number of entries. Keys come
/// from request text, so the map keeps the standard library's keyed hash.
#[derive(Default)]
struct WordCache {
    ids: HashMap<Box<str>, Box<[u32]>>,
}

impl WordCache {
    const CAPACITY: usize = 50_000;
    const MAX_WORD_BYTES: usize = 48;
}

/// Buffers reused across the words of one `encode` call.
#[derive(Default)]
struct Scratch {
    pieces: Vec<Piece>,
    queue: BinaryHeap<Candidate>,
}

impl SentencePiece {
    pub fn new(vocab: &Vocab) -> SentencePiece {
        let mut joined_before_space = Vec::new();
        for text in vocab.texts.iter() {
            let mut previous: Option<char> = None;
            for c in text.chars() {
                if let Some(p) = previous.filter(|&p| c == SPACE && p != SPACE)
                    && !joined_before_space.contains(&p)
                {
                    joined_before_space.push(p);
                }
                previous = Some(c);
            }
        }
        SentencePiece {
            joined_before_space,
            cache: Mutex::default(),
        }
    }

    /// Encode `text` (spaces already replaced by `▁`) and append the ids.
    pub fn encode(&self, vocab: &Vocab, text: &str, out: &mut Vec<u32>) {
        let mut scratch = Scratch::default();
        // The cache is used by one call at a time; a concurrent call goes without.
        let mut cache = self.cache.try_lock().ok();
        let mut encode_word = |word: &str| {
            let Some(cache) = cache.as_deref_mut() else {
                encode_word(vocab, word, &mut scratch, out);
                return;
            };
            if let Some(ids) = cache.ids.get(word) {
                out.extend_from_slice(ids);
                return;
            }
            let start = out.len();
            encode_word(vocab, word, &mut scratch, out);
            if word.len() <= WordCache::MAX_WORD_BYTES && cache.ids.len() < WordCache::CAPACITY {
                cache.ids.insert(word.into(), out[start..].into());
            }
        };
        // Cut before each `▁` that follows a character no token joins to a `▁`.
        let mut word_start = 0;
        let mut previous: Option<char> = None;
        for (at, c) in text.char_indices() {
            if c == SPACE
                && previous.is_some_and(|p| p != SPACE && !self.joined_before_space.contains(&p))
            {
                encode_word(&text[word_start..at]);
                word_start = at;
            }
            previous = Some(c);
        }
        encode_word(&text[word_start..]);
    }
}

/// One piece of the text being merged: a byte range plus links to its neighbours.
#[derive(Clone, Copy)]
struct Piece {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

/// A candidate merge of two adjacent pieces.
struct Candidate {
    score: f32,
    left: usize,
    right: usize,
    len: usize,
}

impl PartialEq for Candidate {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Candidate {}
impl PartialOrd for Candidate {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Candidate {
    /// Higher score first; among equal scores the leftmost pair first.
    fn cmp(&self, other: &Self) -> Ordering {
        self.score
            .total_cmp(&other.score)
            .then_with(|| other.left.cmp(&self.left))
    }
}

/// Merge one stretch of text (spaces already replaced by `▁`) and append the ids.
fn encode_word(vocab: &Vocab, text: &str, scratch: &mut Scratch, out: &mut Vec<u32>) {
    // Start with one piece per UTF-8 character.
    let pieces = &mut scratch.pieces;
    pieces.clear();
    for (start, c) in text.char_indices() {
        let index = pieces.len();
        pieces.push(Piece {
            start,
            len: c.len_utf8(),
            prev: index.checked_sub(1),
            next: None,
        });
        if index > 0 {
            pieces[index - 1].next = Some(index);
        }
    }
    if pieces.is_empty() {
        return;
    }
    let queue = &mut scratch.queue;
    queue.clear();
    let try_pair = |left: Option<usize>,
                    right: Option<usize>,
                    pieces: &[Piece],
                    queue: &mut BinaryHeap<Candidate>| {
        let (Some(left), Some(right)) = (left, right) else {
            return;
        };
        let (l, r) = (pieces[left], pieces[right]);
        let joined = &text[l.start..r.start + r.len];
        if let Some(id) = vocab.id(joined) {
            queue.push(Candidate {
                score: vocab.scores[id as usize],
                left,
                right,
                len: joined.len(),
            });
        }
    };
    // Seed the queue with every adjacent pair.
    for i in 1..pieces.len() {
        try_pair(Some(i - 1), Some(i), pieces, queue);
    }
    // Merge the best pair until none is left; stale candidates are skipped.
    while let Some(best) = queue.pop() {
        let (l, r) = (pieces[best.left], pieces[best.right]);
        if l.len == 0 || r.len == 0 || l.len + r.len != best.len || l.next != Some(best.right) {
            continue;
        }
        pieces[best.left].len += r.len;
        pieces[best.right].len = 0;
        pieces[best.left].next = r.next;
        if let Some(n) = r.next {
            pieces[n].prev = Some(best.left);
        }
        try_pair(pieces[best.left].prev, Some(best.left), pieces, queue);
        try_pair(Some(best.left), pieces[best.left].next, pieces, queue);
    }
    // Emit the pieces left to right.
    let mut cursor = Some(0);
    while let Some(i) = cursor {
        let p = pieces[i];
        let piece = &text[p.start..p.start + p.len];
        match vocab.id(piece) {
            Some(id) => out.push(id),
            // Merges only ever build tokens, so an unknown piece is a single
            // character missing from the vocabulary: spell it in bytes.
            // (llama.cpp's re-split along the merges never applies here.)
            None => out.extend(piece.bytes().filter_map(|b| byte_token(vocab, b))),
        }
        cursor = pieces[i].next;
    }
}

/// The `<0xNN>` token of a byte, falling back to a one-byte text token, then to `<unk>`.
pub(crate) fn byte_token(vocab: &Vocab, b: u8) -> Option<u32> {
    vocab
        .id(&format!("<0x{b:02X}>"))
        .or_else(|| std::str::from_utf8(&[b]).ok().and_then(|s| vocab.id(s)))
        .or(vocab.unk)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::vocab::{MetaReader, vocab_from_gguf};
    use flatrun_format::{MetaValue, Metadata};

    /// A small vocabulary with tokens that cross a `▁` (`b▁`, `a▁b`) and
    /// runs of `▁`, scored so that merge order matters.
    fn vocabulary() -> Vocab {
        let mut tokens: Vec<String> = vec!["<unk>".into(), "<s>".into(), "</s>".into()];
        tokens.extend((0..256).map(|b| format!("<0x{b:02X}>")));
        let words = [
            "▁",
            "a",
            "b",
            "c",
            "▁a",
            "ab",
            "▁ab",
            "b▁",
            "a▁b",
            "▁▁",
            "▁▁▁",
            "ba",
            "▁b",
            "ca",
            "abc",
            "c▁▁",
        ];
        tokens.extend(words.iter().map(|w| w.to_string()));
        let n = tokens.len();
        let types = (0..n)
            .map(|i| {
                MetaValue::I32(if i < 3 {
                    3
                } else if i < 259 {
                    6
                } else {
                    1
                })
            })
            .collect();
        // Equal scores in pairs, so ties are broken by position.
        let scores = (0..n).map(|i| MetaValue::F32(-((i / 2) as f32))).collect();
        let md = Metadata {
            entries: vec![
                (
                    "tokenizer.ggml.model".into(),
                    MetaValue::String("llama".into()),
                ),
                (
                    "tokenizer.ggml.tokens".into(),
                    MetaValue::Array(tokens.into_iter().map(MetaValue::String).collect()),
                ),
                ("tokenizer.ggml.token_type".into(), MetaValue::Array(types)),
                ("tokenizer.ggml.scores".into(), MetaValue::Array(scores)),
            ],
        };
        vocab_from_gguf(&MetaReader::new(&md), true).expect("vocabulary")
    }

    /// Cutting the text into words (and caching them) gives exactly the ids
    /// of merging the whole text at once, on random text over an alphabet
    /// that makes words meet `▁`-crossing tokens.
    #[test]
    fn words_merge_like_the_whole_text() {
        let vocab = vocabulary();
        let encoder = SentencePiece::new(&vocab);
        let mut joined = encoder.joined_before_space.clone();
        joined.sort_unstable();
        assert_eq!(joined, ['a', 'b', 'c']);
        let alphabet = ['a', 'b', 'c', SPACE, SPACE, 'é', 'x'];
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for _ in 0..20_000 {
            let len = (next() % 40) as usize;
            let text: String = (0..len)
                .map(|_| alphabet[(next() % alphabet.len() as u64) as usize])
                .collect();
            let mut by_words = Vec::new();
            encoder.encode(&vocab, &text, &mut by_words);
            let mut whole = Vec::new();
            encode_word(&vocab, &text, &mut Scratch::default(), &mut whole);
            assert_eq!(by_words, whole, "{text:?}");
        }
    }
}
