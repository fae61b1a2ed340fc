//! The expert cache: routed experts of a mixture-of-experts model kept in
//! memory after they were read, up to a byte budget, so that the experts a
//! router keeps choosing are not read again at every token.
//!
//! An expert is the unit: the rows of all its projections (gate, up, down,
//! with their scales) in one read. A layer pass asks for each expert its
//! tokens chose once ([`super::kernels::ChunkedKernels`] holds them while
//! the layer runs); what is found here is a hit, what is read a miss.
//!
//! When the budget is full an expert is given up by the
//! [`ExpertPolicy`]: the least recently used one, or the one used least
//! often since load. Under `Lfu` an expert that was used less often than
//! every cached one is not cached at all (a cold expert does not push out a
//! hot one).
//!
//! Beside the kept experts, the cache holds the reads started **ahead**:
//! the experts a prediction of the next layer's router named while this
//! layer ran (`ChunkedKernels::routed`). When that layer routes, an expert
//! read ahead is taken from here (its I/O overlapped the previous layer's
//! compute); what the router did not choose is dropped when the layer is
//! done.

use super::OnDemand;
use super::readers::PendingRead;
use crate::options::ExpertPolicy;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

/// (layer, expert).
pub(crate) type ExpertKey = (usize, usize);

struct Entry {
    read: Arc<OnDemand>,
    bytes: u64,
    last_use: u64,
}

#[derive(Default)]
struct State {
    entries: HashMap<ExpertKey, Entry>,
    bytes: u64,
    /// Grows by one per lookup: the recency clock.
    clock: u64,
    /// Lookups per expert since load, cached or not (the frequency `Lfu`
    /// keeps by).
    uses: HashMap<ExpertKey, u64>,
}

/// Experts kept after use, at most `budget` bytes of them.
pub(crate) struct ExpertCache {
    budget: u64,
    policy: ExpertPolicy,
    state: Mutex<State>,
    /// Reads started ahead of their layer's router.
    ahead: Mutex<HashMap<ExpertKey, Arc<PendingRead>>>,
}

impl ExpertCache {
    pub(crate) fn new(budget: u64, policy: ExpertPolicy) -> ExpertCache {
        ExpertCache {
            budget,
            policy,
            state: Mutex::new(State::default()),
            ahead: Mutex::new(HashMap::new()),
        }
    }

    fn lock_ahead(&self) -> MutexGuard<'_, HashMap<ExpertKey, Arc<PendingRead>>> {
        self.ahead.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether expert `key` is cached or read ahead already (not counted
    /// as a use).
    pub(crate) fn has(&self, key: ExpertKey) -> bool {
        (self.budget > 0 && self.lock().entries.contains_key(&key))
            || self.lock_ahead().contains_key(&key)
    }

    /// Keep `read`, started before expert `key`'s layer routed.
    pub(crate) fn put_ahead(&self, key: ExpertKey, read: Arc<PendingRead>) {
        self.lock_ahead().insert(key, read);
    }

    /// The read of expert `key` started ahead, if there is one.
    pub(crate) fn take_ahead(&self, key: ExpertKey) -> Option<Arc<PendingRead>> {
        self.lock_ahead().remove(&key)
    }

    /// Drop the reads started ahead for layers other than `keep`: their
    /// layer ran without them. Returns how many were dropped.
    pub(crate) fn drop_ahead_except(&self, keep: usize) -> u64 {
        let mut ahead = self.lock_ahead();
        let before = ahead.len();
        ahead.retain(|(layer, _), _| *layer == keep);
        (before - ahead.len()) as u64
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Expert `key`'s bytes if cached; counts the use either way.
    pub(crate) fn lookup(&self, key: ExpertKey) -> Option<Arc<OnDemand>> {
        if self.budget == 0 {
            return None;
        }
        let mut s = self.lock();
        s.clock += 1;
        let now = s.clock;
        *s.uses.entry(key).or_default() += 1;
        let e = s.entries.get_mut(&key)?;
        e.last_use = now;
        Some(e.read.clone())
    }

    /// Offer expert `key`, just read (`bytes` of buffer), for keeping;
    /// gives up others as the policy says to make room. Returns whether it
    /// was kept.
    pub(crate) fn offer(&self, key: ExpertKey, read: &Arc<OnDemand>, bytes: u64) -> bool {
        if bytes > self.budget {
            return false;
        }
        let mut guard = self.lock();
        let s = &mut *guard;
        if s.entries.contains_key(&key) {
            return true;
        }
        let uses = |s: &State, k: &ExpertKey| s.uses.get(k).copied().unwrap_or(0);
        let mine = uses(s, &key);
        while s.bytes + bytes > self.budget {
            // The victim: least recent, or least often used (then least recent).
            let victim = match self.policy {
                ExpertPolicy::Lru => s.entries.iter().min_by_key(|(_, e)| e.last_use),
                ExpertPolicy::Lfu => s
                    .entries
                    .iter()
                    .min_by_key(|(k, e)| (uses(s, k), e.last_use)),
            }
            .map(|(k, _)| *k);
            let Some(victim) = victim else { break };
            if self.policy == ExpertPolicy::Lfu && uses(s, &victim) > mine {
                return false;
            }
            if let Some(e) = s.entries.remove(&victim) {
                s.bytes -= e.bytes;
            }
        }
        let now = s.clock;
        s.bytes += bytes;
        s.entries.insert(
            key,
            Entry {
                read: read.clone(),
                bytes,
                last_use: now,
            },
        );
        true
    }

    /// Bytes of experts held now.
    pub(crate) fn bytes(&self) -> u64 {
        self.lock().bytes
    }

    /// The budget.
    pub(crate) fn budget(&self) -> u64 {
        self.budget
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::weights::{Fetched, buffer::AlignedBuffer};

    fn read() -> Arc<OnDemand> {
        Arc::new(OnDemand {
            fetched: Fetched {
                buffer: AlignedBuffer::new(16).unwrap(),
                placed: Vec::new(),
                error: None,
            },
        })
    }

    fn run(policy: ExpertPolicy, budget: u64, trace: &[usize]) -> (u64, u64) {
        let cache = ExpertCache::new(budget, policy);
        let (mut hits, mut misses) = (0, 0);
        for &e in trace {
            match cache.lookup((0, e)) {
                Some(_) => hits += 1,
                None => {
                    misses += 1;
                    cache.offer((0, e), &read(), 10);
                }
            }
            assert!(cache.bytes() <= budget);
        }
        (hits, misses)
    }

    #[test]
    fn lru_gives_up_the_least_recently_used() {
        // Room for two: 0 1 0 2 evicts 1, so 1 misses again and 0 hits.
        let cache = ExpertCache::new(20, ExpertPolicy::Lru);
        for e in [0, 1, 0, 2] {
            if cache.lookup((0, e)).is_none() {
                cache.offer((0, e), &read(), 10);
            }
        }
        assert!(cache.lookup((0, 0)).is_some());
        assert!(cache.lookup((0, 1)).is_none());
        assert!(cache.lookup((0, 2)).is_some());
    }

    #[test]
    fn lfu_keeps_hot_experts_through_a_scan() {
        // Two hot experts used often, then a scan of cold ones: LFU keeps
        // the hot ones, LRU loses them.
        let mut trace = Vec::new();
        for _ in 0..5 {
            trace.extend([0, 1]);
        }
        trace.extend(2..10);
        trace.extend([0, 1, 0, 1]);
        let (lfu_hits, _) = run(ExpertPolicy::Lfu, 20, &trace);
        let (lru_hits, _) = run(ExpertPolicy::Lru, 20, &trace);
        assert_eq!(lfu_hits, 8 + 4);
        assert_eq!(lru_hits, 8 + 2);
    }

    #[test]
    fn nothing_is_kept_without_a_budget() {
        assert_eq!(run(ExpertPolicy::Lru, 0, &[0, 0, 0]), (0, 3));
        assert_eq!(run(ExpertPolicy::Lfu, 5, &[0, 0, 0]), (0, 3));
    }
}
