//! Reads outside the schedule, in the background: routed experts, asked
//! for as soon as a router (or a prediction of the next one) names them
//! and waited for only when a matmul needs their rows. A few threads, each
//! with its own descriptors, take the requests in order (first asked,
//! first read), so a layer's own experts go to the disk before the next
//! layer's predicted ones, and several requests are in flight at once (a
//! disk serves concurrent requests faster than one after another).

use super::source::CachePolicy;
use super::{Fetched, Files, OnDemand, Span, buffer::AlignedBuffer, buffer_bytes};
use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

/// A read asked for and not necessarily done: wait for it when its bytes
/// are needed. Dropping every handle of a read lets it finish unseen.
pub(crate) struct PendingRead {
    result: Mutex<Option<Result<Arc<OnDemand>, String>>>,
    done: Condvar,
}

impl PendingRead {
    fn new() -> PendingRead {
        PendingRead {
            result: Mutex::new(None),
            done: Condvar::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Option<Result<Arc<OnDemand>, String>>> {
        self.result.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn finish(&self, result: Result<Arc<OnDemand>, String>) {
        *self.lock() = Some(result);
        self.done.notify_all();
    }

    /// The read's bytes, once it is done.
    pub(crate) fn wait(&self) -> Result<Arc<OnDemand>, String> {
        let mut r = self.lock();
        loop {
            if let Some(result) = r.as_ref() {
                return result.clone();
            }
            r = self.done.wait(r).unwrap_or_else(|e| e.into_inner());
        }
    }
}

struct Queue {
    jobs: VecDeque<(Vec<Span>, Arc<PendingRead>)>,
    stop: bool,
}

struct Shared {
    queue: Mutex<Queue>,
    changed: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The background readers.
pub(crate) struct Readers {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
}

impl Readers {
    /// `n` reader threads over the checkpoint files `paths`.
    pub(crate) fn start(paths: &[PathBuf], policy: CachePolicy, n: usize) -> Readers {
        let shared = Arc::new(Shared {
            queue: Mutex::new(Queue {
                jobs: VecDeque::new(),
                stop: false,
            }),
            changed: Condvar::new(),
        });
        let threads = (0..n)
            .filter_map(|i| {
                let shared = shared.clone();
                let files = Files::new(paths.to_vec(), policy);
                std::thread::Builder::new()
                    .name(format!("flatrun-reader-{i}"))
                    .spawn(move || serve(&shared, files))
                    .ok()
            })
            .collect();
        Readers { shared, threads }
    }

    /// Ask for `spans` (one expert's rows, say), read into a buffer of
    /// their own after every request asked for before.
    pub(crate) fn submit(&self, spans: Vec<Span>) -> Arc<PendingRead> {
        let pending = Arc::new(PendingRead::new());
        if self.threads.is_empty() {
            pending.finish(Err("no reader thread could be started".into()));
            return pending;
        }
        self.shared.lock().jobs.push_back((spans, pending.clone()));
        self.shared.changed.notify_one();
        pending
    }
}

impl Drop for Readers {
    fn drop(&mut self) {
        self.shared.lock().stop = true;
        self.shared.changed.notify_all();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// A reader thread: take the oldest request, read it, hand it over; on
/// stop, fail what is left so that no waiter hangs.
fn serve(shared: &Shared, mut files: Files) {
    loop {
        let job = {
            let mut q = shared.lock();
            loop {
                if q.stop {
                    for (_, p) in q.jobs.drain(..) {
                        p.finish(Err("the weight engine stopped".into()));
                    }
                    return;
                }
                if let Some(job) = q.jobs.pop_front() {
                    break job;
                }
                q = shared.changed.wait(q).unwrap_or_else(|e| e.into_inner());
            }
        };
        let (spans, pending) = job;
        let result = match AlignedBuffer::new(buffer_bytes(&spans)) {
            None => Err("cannot allocate a read buffer".to_string()),
            Some(buffer) => {
                let fetched: Fetched = files.read(&spans, buffer);
                match fetched.error.clone() {
                    Some(e) => Err(e),
                    None => Ok(Arc::new(OnDemand { fetched })),
                }
            }
        };
        pending.finish(result);
    }
}
