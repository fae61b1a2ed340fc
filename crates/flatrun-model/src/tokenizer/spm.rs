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

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use super::vocab::Vocab;

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

/// Encode `text` (spaces already replaced by `▁`) and append the ids.
pub(crate) fn encode(vocab: &Vocab, text: &str, out: &mut Vec<u32>) {
    // Start with one piece per UTF-8 character.
    let mut pieces: Vec<Piece> = Vec::with_capacity(text.len());
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
    let mut queue = BinaryHeap::new();
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
        try_pair(Some(i - 1), Some(i), &pieces, &mut queue);
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
        try_pair(pieces[best.left].prev, Some(best.left), &pieces, &mut queue);
        try_pair(Some(best.left), pieces[best.left].next, &pieces, &mut queue);
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
