//! Read-ahead of upcoming layers on a background thread, so that disk I/O
//! overlaps compute: while layer `i` runs, layers `i+1 ..= i+depth` are
//! populated (`MADV_POPULATE_READ`, falling back to touching each page).

use crate::memory;
use flatrun_format::StorageBackend;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;

/// A background thread that faults requested layers into memory.
pub struct Prefetcher {
    /// (layer, ticket): read `layer` ahead unless the executor's cursor has
    /// already reached `ticket` (a stale request would re-map pages the
    /// executor just released).
    requests: Option<Sender<(usize, u64)>>,
    cursor: Arc<AtomicU64>,
    worker: Option<JoinHandle<()>>,
}

impl Prefetcher {
    /// Start the thread. `layer_tensors[i]` lists the names of layer `i`'s
    /// tensors; index `layer_tensors.len() - 1` may be used for the head.
    pub fn start(backend: Arc<dyn StorageBackend>, layer_tensors: Vec<Vec<String>>) -> Prefetcher {
        let (tx, rx) = channel::<(usize, u64)>();
        let cursor = Arc::new(AtomicU64::new(0));
        let seen = cursor.clone();
        let worker = std::thread::Builder::new()
            .name("flatrun-prefetch".into())
            .spawn(move || {
                for (layer, ticket) in rx {
                    if seen.load(Ordering::Acquire) >= ticket {
                        continue;
                    }
                    let Some(names) = layer_tensors.get(layer) else {
                        continue;
                    };
                    for name in names {
                        // A missing tensor is reported by the executor when it
                        // acquires the layer; read-ahead just skips it.
                        if let Ok(h) = backend.tensor(name) {
                            memory::populate(h.bytes());
                            for part in ["scales", "biases"] {
                                if let Some(p) = h.part(part) {
                                    memory::populate(p);
                                }
                            }
                        }
                    }
                }
            })
            .ok();
        Prefetcher {
            requests: worker.as_ref().map(|_| tx),
            cursor,
            worker,
        }
    }

    /// Ask for `layer` to be read ahead, as the executor's acquisition
    /// number `ticket` (ignored once the executor got there first).
    pub fn request(&self, layer: usize, ticket: u64) {
        if let Some(tx) = &self.requests {
            let _ = tx.send((layer, ticket));
        }
    }

    /// The executor is acquiring its acquisition number `ticket`.
    pub fn advance(&self, ticket: u64) {
        self.cursor.store(ticket, Ordering::Release);
    }
}

impl Drop for Prefetcher {
    fn drop(&mut self) {
        // Closing the channel ends the thread's loop.
        self.requests.take();
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}
