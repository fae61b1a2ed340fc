//! A fast, unseeded hasher for the tokenizer's lookup tables, whose keys are
//! token texts and token-id pairs from the model file.
//!
//! The standard library's SipHash costs more than the rest of a vocabulary
//! lookup for the short keys a tokenizer hashes (a few bytes, or two ids),
//! and a SentencePiece or BPE encode does one or more lookups per byte of
//! text. This is the multiply-rotate hash of Firefox and rustc ("FxHash").
//! It is not collision resistant, so it is used only for tables whose keys
//! are fixed when the tokenizer is built, never for tables keyed by request
//! text.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// A `HashMap` with [`FastHasher`].
pub(crate) type FastMap<K, V> = HashMap<K, V, BuildHasherDefault<FastHasher>>;

/// The multiply-rotate hasher (see the module docs).
#[derive(Clone, Copy, Default)]
pub(crate) struct FastHasher {
    state: u64,
}

/// An odd constant with well-mixed bits (2^64 / golden ratio, rounded to odd).
const MULTIPLIER: u64 = 0x517c_c1b7_2722_0a95;

impl FastHasher {
    #[inline]
    fn add(&mut self, word: u64) {
        self.state = (self.state.rotate_left(5) ^ word).wrapping_mul(MULTIPLIER);
    }
}

impl Hasher for FastHasher {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for chunk in &mut chunks {
            let mut word = [0u8; 8];
            word.copy_from_slice(chunk);
            self.add(u64::from_le_bytes(word));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut word = [0u8; 8];
            word[..rest.len()].copy_from_slice(rest);
            // The length keeps "a" and "a\0" apart.
            self.add(u64::from_le_bytes(word) ^ ((rest.len() as u64) << 59));
        }
    }

    #[inline]
    fn write_u8(&mut self, i: u8) {
        self.add(i as u64);
    }

    #[inline]
    fn write_u32(&mut self, i: u32) {
        self.add(i as u64);
    }

    #[inline]
    fn write_u64(&mut self, i: u64) {
        self.add(i);
    }

    #[inline]
    fn write_usize(&mut self, i: usize) {
        self.add(i as u64);
    }

    #[inline]
    fn finish(&self) -> u64 {
        self.state
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn looks_up_strings_and_pairs() {
        let mut texts: FastMap<String, u32> = FastMap::default();
        for (i, t) in ["a", "a\0", "ab", "▁the", "abcdefghijkl"]
            .iter()
            .enumerate()
        {
            texts.insert(t.to_string(), i as u32);
        }
        assert_eq!(texts.get("a\0"), Some(&1));
        assert_eq!(texts.get("abcdefghijkl"), Some(&4));
        assert_eq!(texts.get("abcdefghijk"), None);
        let mut pairs: FastMap<(u32, u32), u32> = FastMap::default();
        pairs.insert((1, 2), 3);
        assert_eq!(pairs.get(&(1, 2)), Some(&3));
        assert_eq!(pairs.get(&(2, 1)), None);
    }
}
