//! Byte-level BPE (`tokenizer.ggml.model = gpt2`): the regex pre-tokenizer
//! llama.cpp uses for the vocabulary's `pre` value, the GPT-2 byte alphabet,
//! and merges by rank.
//!
//! The regexes with look-around or anchors run on the `tokenizers` crate's
//! engine (Oniguruma, through its `SysRegex`, exactly what its `Split`
//! pre-tokenizer runs), the others on the `regex` crate (`splitter.rs`:
//! same matches, several times faster on short pieces); the pipeline
//! around them and the merge loop are our own, for speed: the crate's
//! `Tokenizer::encode` carries a per-byte alignment table through every
//! split and allocates a `String` per piece and per token, which made 1 MB
//! of text cost about 2 s. Here a pre-token is a slice of the input, the
//! merge loop works on token ids with reused buffers, and the ids of
//! frequent pre-tokens are cached (most text is made of a few thousand
//! distinct words). The rules are llama.cpp's
//! (`llm_tokenizer_bpe_session`): start from one symbol per byte, repeatedly
//! merge the adjacent pair with the lowest merge rank (the leftmost among
//! equals), and with `ignore_merges` take a whole pre-token that is itself a
//! token as is.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::sync::{Arc, Mutex};

use super::TokenizerError;
use super::byte_level::byte_to_char;
use super::hash::FastMap;
use super::pre_tokenizer::PreTokenizerSpec;
use super::splitter::Splitter;
use super::vocab::Vocab;

/// A byte-level BPE text encoder (special tokens are handled by the caller).
pub(crate) struct ByteLevelBpe {
    /// Split regexes, applied in order, each to the pieces the previous left.
    regexes: Arc<[Splitter]>,
    /// Token of each byte's GPT-2 character (`None`: the byte is dropped).
    byte_ids: [Option<u32>; 256],
    /// `(left, right)` → `(rank, merged token)`.
    merges: FastMap<(u32, u32), (u32, u32)>,
    /// A pre-token that is itself a token skips the merges.
    ignore_merges: bool,
    /// Ids of pre-tokens already encoded.
    cache: Mutex<WordCache>,
}

impl Clone for ByteLevelBpe {
    /// A clone starts with an empty cache.
    fn clone(&self) -> Self {
        ByteLevelBpe {
            regexes: self.regexes.clone(),
            byte_ids: self.byte_ids,
            merges: self.merges.clone(),
            ignore_merges: self.ignore_merges,
            cache: Mutex::default(),
        }
    }
}

/// Ids of pre-tokens seen before, up to a fixed number of entries (later
/// words are not cached). Keys come from request text, so the map keeps
/// the standard library's keyed hash.
#[derive(Default)]
struct WordCache {
    ids: HashMap<Box<str>, Box<[u32]>>,
}

impl WordCache {
    /// Entries kept at most (a few MB at most).
    const CAPACITY: usize = 50_000;
    /// Longer pre-tokens are rare and not worth keeping.
    const MAX_WORD_BYTES: usize = 48;

    fn get(&self, word: &str) -> Option<&[u32]> {
        self.ids.get(word).map(|ids| &ids[..])
    }

    fn insert(&mut self, word: &str, ids: &[u32]) {
        if word.len() <= Self::MAX_WORD_BYTES && self.ids.len() < Self::CAPACITY {
            self.ids.insert(word.into(), ids.into());
        }
    }
}

/// One symbol of the pre-token being merged, in a linked list.
#[derive(Clone, Copy)]
struct Symbol {
    id: u32,
    prev: u32,
    next: u32,
}

/// No neighbour.
const NONE: u32 = u32::MAX;

/// A merge that was possible when it was queued: ordered by rank, then by
/// position (leftmost first), the rest only identifies it.
type Candidate = Reverse<(u32, u32, u32, u32, u32)>;

/// Buffers reused across the pre-tokens of one `encode` call.
#[derive(Default)]
struct Scratch {
    symbols: Vec<Symbol>,
    queue: BinaryHeap<Candidate>,
    mapped: String,
}

impl ByteLevelBpe {
    /// Build from the vocabulary and the GGUF merge list (`"left right"`, rank = index).
    pub fn new(
        vocab: &Vocab,
        merges: &[String],
        spec: &PreTokenizerSpec,
        pre_name: &str,
    ) -> Result<ByteLevelBpe, TokenizerError> {
        let mut byte_ids = [None; 256];
        for (b, slot) in byte_ids.iter_mut().enumerate() {
            let mut buf = [0u8; 4];
            *slot = vocab.id(byte_to_char(b as u8).encode_utf8(&mut buf));
        }
        let mut ranks: FastMap<(u32, u32), (u32, u32)> = FastMap::default();
        ranks.reserve(merges.len());
        let mut joined = String::new();
        for (rank, merge) in merges.iter().enumerate() {
            // llama.cpp splits at the first space after the first byte.
            let Some(split) = merge.bytes().skip(1).position(|b| b == b' ').map(|p| p + 1) else {
                continue;
            };
            let (Some(left), Some(right)) = (merge.get(..split), merge.get(split + 1..)) else {
                continue;
            };
            joined.clear();
            joined.push_str(left);
            joined.push_str(right);
            // A merge whose parts or result are not tokens can never apply
            // (llama.cpp ignores it too); the first of duplicates wins.
            if let (Some(l), Some(r), Some(m)) =
                (vocab.id(left), vocab.id(right), vocab.id(&joined))
            {
                ranks.entry((l, r)).or_insert((rank as u32, m));
            }
        }
        let regexes = spec
            .regexes
            .iter()
            .enumerate()
            .map(|(index, regex)| {
                Splitter::new(regex).map_err(|what| TokenizerError::BadRegex {
                    pre: pre_name.to_string(),
                    index,
                    what,
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(ByteLevelBpe {
            regexes: regexes.into(),
            byte_ids,
            merges: ranks,
            ignore_merges: spec.ignore_merges,
            cache: Mutex::default(),
        })
    }

    /// Append the ids of one piece of plain text.
    pub fn encode(&self, vocab: &Vocab, text: &str, out: &mut Vec<u32>) {
        if text.is_empty() {
            return;
        }
        let mut scratch = Scratch::default();
        // The cache is used by one call at a time; a concurrent call goes without.
        let mut cache = self.cache.try_lock().ok();
        self.split(0, text, &mut |word| {
            let Some(cache) = cache.as_deref_mut() else {
                self.encode_word(vocab, word, &mut scratch, out);
                return;
            };
            if let Some(ids) = cache.get(word) {
                out.extend_from_slice(ids);
                return;
            }
            let start = out.len();
            self.encode_word(vocab, word, &mut scratch, out);
            cache.insert(word, &out[start..]);
        });
    }

    /// Split `text` with regex `level` and the ones after it, calling `emit`
    /// for each final pre-token, left to right. Every regex cuts a piece into
    /// its matches and the gaps between them (`Split` with `Isolated`).
    fn split<'t>(&self, level: usize, text: &'t str, emit: &mut dyn FnMut(&'t str)) {
        let Some(regex) = self.regexes.get(level) else {
            emit(text);
            return;
        };
        let mut done = 0;
        regex.for_each_match(text, |start, end| {
            if start > done {
                self.split(level + 1, &text[done..start], emit);
            }
            if end > start {
                self.split(level + 1, &text[start..end], emit);
            }
            done = end;
        });
        if done < text.len() {
            self.split(level + 1, &text[done..], emit);
        }
    }

    /// Append the ids of one pre-token.
    fn encode_word(&self, vocab: &Vocab, word: &str, scratch: &mut Scratch, out: &mut Vec<u32>) {
        let bytes = word.as_bytes();
        // A single byte is its own token.
        if let [b] = bytes {
            out.extend(self.byte_ids[*b as usize]);
            return;
        }
        // A pre-token that is a token is taken whole, when the vocabulary says so.
        if self.ignore_merges {
            scratch.mapped.clear();
            scratch
                .mapped
                .extend(bytes.iter().map(|&b| byte_to_char(b)));
            if let Some(id) = vocab.id(&scratch.mapped) {
                out.push(id);
                return;
            }
        }
        // One symbol per byte (bytes without a token are dropped).
        let symbols = &mut scratch.symbols;
        symbols.clear();
        for &b in bytes {
            if let Some(id) = self.byte_ids[b as usize] {
                let index = symbols.len() as u32;
                symbols.push(Symbol {
                    id,
                    prev: index.checked_sub(1).unwrap_or(NONE),
                    next: index + 1,
                });
            }
        }
        let Some(last) = symbols.last_mut() else {
            return;
        };
        last.next = NONE;
        // Queue every adjacent pair that has a merge.
        let queue = &mut scratch.queue;
        queue.clear();
        for left in 0..symbols.len() - 1 {
            self.queue_pair(symbols, left as u32, queue);
        }
        // Merge the best pair until none is left; candidates whose symbols
        // changed since they were queued are stale and skipped.
        while let Some(Reverse((_, left, right, left_id, right_id))) = queue.pop() {
            let (l, r) = (symbols[left as usize], symbols[right as usize]);
            if l.next != right || l.id != left_id || r.id != right_id {
                continue;
            }
            let Some(&(_, merged)) = self.merges.get(&(left_id, right_id)) else {
                continue;
            };
            // The right symbol joins the left one and leaves the list.
            symbols[left as usize].id = merged;
            symbols[left as usize].next = r.next;
            symbols[right as usize].id = NONE;
            symbols[right as usize].prev = NONE;
            symbols[right as usize].next = NONE;
            if r.next != NONE {
                symbols[r.next as usize].prev = left;
            }
            if l.prev != NONE {
                self.queue_pair(symbols, l.prev, queue);
            }
            self.queue_pair(symbols, left, queue);
        }
        // Emit what is left, first to last.
        let mut at = 0;
        while at != NONE {
            out.push(symbols[at as usize].id);
            at = symbols[at as usize].next;
        }
    }

    /// Queue the merge of symbol `left` with its right neighbour, if there is one.
    fn queue_pair(&self, symbols: &[Symbol], left: u32, queue: &mut BinaryHeap<Candidate>) {
        let l = symbols[left as usize];
        if l.next == NONE {
            return;
        }
        let r = symbols[l.next as usize];
        if let Some(&(rank, _)) = self.merges.get(&(l.id, r.id)) {
            queue.push(Reverse((rank, left, l.next, l.id, r.id)));
        }
    }
}
