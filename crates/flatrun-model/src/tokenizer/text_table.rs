//! Compact tables for the per-token strings of a vocabulary.
//!
//! A 262k-token vocabulary held as `Vec<String>` plus a `HashMap<String, u32>`
//! costs about 60 bytes of allocator overhead per token for each copy (a
//! 24-byte `String`, a heap block of at least 32 bytes, the map's slot), so the
//! token texts, their rendered pieces and the text→id map took ~55 MB for
//! Gemma 3. Here every token's bytes live in one buffer with an end offset per
//! token ([`ByteTable`], [`TextTable`]), and the text→id map is an
//! open-addressing table of ids that compares against the texts it indexes
//! ([`TextIndex`]): about 10 bytes per token plus the text itself.

use std::hash::Hasher;

use super::hash::FastHasher;

/// Byte strings stored end to end: entry `i` is `bytes[ends[i-1]..ends[i]]`.
#[derive(Clone, Debug, Default)]
pub(crate) struct ByteTable {
    bytes: Vec<u8>,
    ends: Vec<u32>,
}

impl ByteTable {
    /// An empty table with room for `entries` entries of `bytes` bytes in all.
    pub fn with_capacity(entries: usize, bytes: usize) -> ByteTable {
        ByteTable {
            bytes: Vec::with_capacity(bytes),
            ends: Vec::with_capacity(entries),
        }
    }

    /// Append one entry. Tables past 4 GiB of bytes are not supported (a
    /// vocabulary is a few MB); the caller's input limits keep it far below.
    pub fn push(&mut self, entry: &[u8]) {
        self.bytes.extend_from_slice(entry);
        self.ends.push(self.bytes.len() as u32);
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        self.ends.len()
    }

    /// Entry `i`, or `None` past the end.
    pub fn get(&self, i: usize) -> Option<&[u8]> {
        let end = *self.ends.get(i)? as usize;
        let start = match i {
            0 => 0,
            _ => self.ends[i - 1] as usize,
        };
        self.bytes.get(start..end)
    }

    /// Release spare capacity.
    pub fn shrink_to_fit(&mut self) {
        self.bytes.shrink_to_fit();
        self.ends.shrink_to_fit();
    }
}

impl FromIterator<Vec<u8>> for ByteTable {
    fn from_iter<I: IntoIterator<Item = Vec<u8>>>(entries: I) -> ByteTable {
        let mut table = ByteTable::default();
        for entry in entries {
            table.push(&entry);
        }
        table.shrink_to_fit();
        table
    }
}

/// UTF-8 strings stored end to end (a [`ByteTable`] whose entries are `str`).
#[derive(Clone, Debug, Default)]
pub(crate) struct TextTable {
    table: ByteTable,
}

impl TextTable {
    /// An empty table with room for `entries` texts of `bytes` bytes in all.
    pub fn with_capacity(entries: usize, bytes: usize) -> TextTable {
        TextTable {
            table: ByteTable::with_capacity(entries, bytes),
        }
    }

    /// Append one text.
    pub fn push(&mut self, text: &str) {
        self.table.push(text.as_bytes());
    }

    /// Number of texts.
    pub fn len(&self) -> usize {
        self.table.len()
    }

    /// Text `i`, or `None` past the end.
    pub fn get(&self, i: usize) -> Option<&str> {
        // Every entry was pushed as a whole `str`, so it is valid UTF-8.
        self.table.get(i).and_then(|b| std::str::from_utf8(b).ok())
    }

    /// The bytes of text `i`, or `None` past the end (no UTF-8 check: for
    /// comparisons on hot paths).
    pub fn get_bytes(&self, i: usize) -> Option<&[u8]> {
        self.table.get(i)
    }

    /// Every text in order.
    pub fn iter(&self) -> impl Iterator<Item = &str> + '_ {
        (0..self.len()).map(move |i| self.get(i).unwrap_or(""))
    }

    /// Release spare capacity.
    pub fn shrink_to_fit(&mut self) {
        self.table.shrink_to_fit();
    }
}

impl<'a> FromIterator<&'a str> for TextTable {
    fn from_iter<I: IntoIterator<Item = &'a str>>(texts: I) -> TextTable {
        let mut table = TextTable::default();
        for text in texts {
            table.push(text);
        }
        table
    }
}

/// Text → id map over a [`TextTable`]: open addressing with linear probing,
/// slots hold ids (`EMPTY` when free) and a hit is confirmed by comparing
/// the probed id's text. The last id of a duplicated text wins (as in a
/// `HashMap` filled in id order, and llama.cpp's `token_to_id`).
#[derive(Clone, Debug, Default)]
pub(crate) struct TextIndex {
    slots: Vec<u32>,
}

/// The home slot of `text` in a table of `len` (a power of two) slots: the
/// hash's high bits, which are the well-mixed ones of a multiplicative hash.
fn home_slot(text: &str, len: usize) -> usize {
    let bits = len.trailing_zeros();
    match bits {
        0 => 0,
        _ => (hash_text(text) >> (64 - bits)) as usize,
    }
}

/// A free slot.
const EMPTY: u32 = u32::MAX;

fn hash_text(text: &str) -> u64 {
    let mut h = FastHasher::default();
    h.write(text.as_bytes());
    h.finish()
}

impl TextIndex {
    /// Index every text of `texts` (load factor at most 1/2).
    pub fn build(texts: &TextTable) -> TextIndex {
        let size = (texts.len() * 2).next_power_of_two().max(16);
        let mut index = TextIndex {
            slots: vec![EMPTY; size],
        };
        for (id, text) in texts.iter().enumerate() {
            let mask = index.slots.len() - 1;
            let mut slot = home_slot(text, mask + 1);
            loop {
                match index.slots[slot] {
                    EMPTY => {
                        index.slots[slot] = id as u32;
                        break;
                    }
                    other if texts.get_bytes(other as usize) == Some(text.as_bytes()) => {
                        index.slots[slot] = id as u32;
                        break;
                    }
                    _ => slot = (slot + 1) & mask,
                }
            }
        }
        index
    }

    /// The id of `text` in `texts` (the table this index was built from).
    pub fn get(&self, texts: &TextTable, text: &str) -> Option<u32> {
        if self.slots.is_empty() {
            return None;
        }
        let mask = self.slots.len() - 1;
        let mut slot = home_slot(text, mask + 1);
        loop {
            match self.slots[slot] {
                EMPTY => return None,
                id if texts.get_bytes(id as usize) == Some(text.as_bytes()) => return Some(id),
                _ => slot = (slot + 1) & mask,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_round_trip_and_index_finds_last_duplicate() {
        let words = ["a", "", "héllo", "a", "▁the", "<0x0A>"];
        let mut texts = TextTable::with_capacity(words.len(), 16);
        for w in words {
            texts.push(w);
        }
        assert_eq!(texts.len(), words.len());
        assert_eq!(texts.iter().collect::<Vec<_>>(), words);
        assert_eq!(texts.get(words.len()), None);
        let index = TextIndex::build(&texts);
        assert_eq!(index.get(&texts, "a"), Some(3));
        assert_eq!(index.get(&texts, ""), Some(1));
        assert_eq!(index.get(&texts, "héllo"), Some(2));
        assert_eq!(index.get(&texts, "<0x0A>"), Some(5));
        assert_eq!(index.get(&texts, "b"), None);

        let mut bytes = ByteTable::default();
        bytes.push(&[0xff, 0]);
        bytes.push(&[]);
        assert_eq!(bytes.get(0), Some(&[0xff, 0][..]));
        assert_eq!(bytes.get(1), Some(&[][..]));
        assert_eq!(bytes.get(2), None);
    }
}
