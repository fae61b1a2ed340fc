//! Finished sequences kept for their KV cache, so that a later prompt that
//! starts the same way (the next turn of a conversation, a shared system
//! prompt or tool schema) copies that prefix instead of recomputing it.
//!
//! The cache holds whole sequences (every token they evaluated, prompt and
//! answer), at most `budget` bytes of KV in all, least recently used first
//! out. A sequence whose tokens begin another cached one's adds nothing
//! (every prompt it could serve, the longer one serves as well), so the
//! shorter of the two is dropped: an agent's growing history keeps one
//! entry, not one per turn. The scheduler looks up the entry sharing the
//! longest prefix with a new prompt and asks the model to fork it.

use crate::batch_model::SeqId;

/// Length of the common prefix of `a` and `b`.
pub(crate) fn common_prefix<'a>(a: impl IntoIterator<Item = &'a u32>, b: &[u32]) -> usize {
    a.into_iter().zip(b).take_while(|(x, y)| x == y).count()
}

struct Entry {
    seq: SeqId,
    tokens: Vec<u32>,
    bytes: u64,
    /// The cache's clock at the last insertion or hit (LRU order).
    used: u64,
}

/// Cached sequences under a byte budget.
pub(crate) struct PrefixCache {
    entries: Vec<Entry>,
    budget: u64,
    clock: u64,
    evictions: u64,
}

impl PrefixCache {
    pub(crate) fn new(budget: u64) -> PrefixCache {
        PrefixCache {
            entries: Vec::new(),
            budget,
            clock: 0,
            evictions: 0,
        }
    }

    /// Whether anything may be kept at all.
    pub(crate) fn enabled(&self) -> bool {
        self.budget > 0
    }

    /// KV bytes of the cached sequences.
    pub(crate) fn bytes(&self) -> u64 {
        self.entries.iter().map(|e| e.bytes).sum()
    }

    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    /// Entries dropped to stay under the budget, since start.
    pub(crate) fn evictions(&self) -> u64 {
        self.evictions
    }

    /// The cached sequence sharing the longest prefix with `prompt`, and
    /// that length (0 when none shares anything).
    pub(crate) fn longest(&self, prompt: &[u32]) -> Option<(SeqId, usize)> {
        self.entries
            .iter()
            .map(|e| (e.seq, common_prefix(&e.tokens, prompt)))
            .filter(|&(_, n)| n > 0)
            .max_by_key(|&(_, n)| n)
    }

    /// Marks `seq` as just used (a hit).
    pub(crate) fn touch(&mut self, seq: SeqId) {
        self.clock += 1;
        if let Some(e) = self.entries.iter_mut().find(|e| e.seq == seq) {
            e.used = self.clock;
        }
    }

    /// Keeps `seq`, whose cache holds `tokens` and occupies `bytes`.
    /// Returns the sequences the caller must free: `seq` itself when it
    /// adds nothing or cannot fit, entries it makes redundant, and the
    /// least recently used ones beyond the budget.
    pub(crate) fn insert(&mut self, seq: SeqId, tokens: Vec<u32>, bytes: u64) -> Vec<SeqId> {
        self.clock += 1;
        let clock = self.clock;
        if tokens.is_empty() || bytes > self.budget {
            return vec![seq];
        }
        if let Some(longer) = self
            .entries
            .iter_mut()
            .find(|e| e.tokens.starts_with(&tokens))
        {
            longer.used = clock;
            return vec![seq];
        }
        let mut freed = Vec::new();
        self.entries.retain(|e| {
            let redundant = tokens.starts_with(&e.tokens);
            if redundant {
                freed.push(e.seq);
            }
            !redundant
        });
        self.entries.push(Entry {
            seq,
            tokens,
            bytes,
            used: clock,
        });
        while self.bytes() > self.budget {
            let Some(oldest) = (0..self.entries.len()).min_by_key(|&i| self.entries[i].used) else {
                break;
            };
            freed.push(self.entries.swap_remove(oldest).seq);
            self.evictions += 1;
        }
        freed
    }

    /// Empties the cache; returns the sequences to free.
    pub(crate) fn clear(&mut self) -> Vec<SeqId> {
        self.entries.drain(..).map(|e| e.seq).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn longest_prefix_wins_and_longer_histories_replace_shorter() {
        let mut cache = PrefixCache::new(1000);
        assert!(cache.insert(SeqId(1), vec![1, 2, 3], 30).is_empty());
        assert!(cache.insert(SeqId(2), vec![1, 9], 20).is_empty());
        assert_eq!(cache.longest(&[1, 2, 3, 4]), Some((SeqId(1), 3)));
        assert_eq!(cache.longest(&[1, 9, 9]), Some((SeqId(2), 2)));
        assert_eq!(cache.longest(&[7]), None);
        // The next turn of conversation 1 makes its first entry redundant.
        assert_eq!(cache.insert(SeqId(3), vec![1, 2, 3, 4, 5], 50), [SeqId(1)]);
        // A prefix of a cached sequence adds nothing.
        assert_eq!(cache.insert(SeqId(4), vec![1, 2], 20), [SeqId(4)]);
        assert_eq!((cache.len(), cache.bytes()), (2, 70));
    }

    #[test]
    fn least_recently_used_goes_first_under_the_budget() {
        let mut cache = PrefixCache::new(100);
        cache.insert(SeqId(1), vec![1], 40);
        cache.insert(SeqId(2), vec![2], 40);
        cache.touch(SeqId(1));
        assert_eq!(cache.insert(SeqId(3), vec![3], 40), [SeqId(2)]);
        assert_eq!(cache.evictions(), 1);
        // Larger than the whole budget: not kept.
        assert_eq!(cache.insert(SeqId(4), vec![4], 101), [SeqId(4)]);
        let mut left = cache.clear();
        left.sort();
        assert_eq!(left, [SeqId(1), SeqId(3)]);
        assert!(!PrefixCache::new(0).enabled());
    }
}
