//! The persistent thread pool every parallel kernel runs on.
//!
//! A decode step makes a few hundred matmul calls of a few microseconds each,
//! so handing work to the pool must cost far less than that. Like ggml's
//! threadpool, the workers here spin on a shared job counter for a short
//! while after each job (so the next call starts them within a few hundred
//! nanoseconds), then park on a condition variable when the process goes idle.
//! The calling thread takes part in every job, so `threads = n` means `n - 1`
//! workers plus the caller; tasks are handed out one at a time from an atomic
//! counter. A worker joins a job only while it still has tasks to hand out,
//! and the caller waits only for the workers that joined: on a loaded machine a
//! worker the OS has descheduled never holds a call up (the caller simply runs
//! the tasks itself).

use std::cell::UnsafeCell;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, OnceLock, TryLockError};
use std::time::{Duration, Instant};

/// How long an idle worker polls for the next job before it parks.
const SPIN: Duration = Duration::from_micros(300);

static POOL: OnceLock<Pool> = OnceLock::new();

/// Build the global pool with `n` threads (0 = physical cores). Only the first
/// call (or the first kernel call) decides; later calls are ignored.
pub fn set_threads(n: usize) {
    let _ = pool_with(n);
}

/// Number of threads a parallel kernel runs on (the caller included).
pub fn threads() -> usize {
    pool().threads
}

pub(crate) fn pool() -> &'static Pool {
    pool_with(0)
}

fn pool_with(n: usize) -> &'static Pool {
    POOL.get_or_init(|| Pool::start(if n == 0 { physical_cores() } else { n }))
}

/// Run `task(i)` for every `i in 0..n_tasks` on the pool (the caller included), in any order,
/// and return when all have finished. Runs inline when the pool is busy (a nested call, or
/// another thread's job) or has one thread.
pub(crate) fn parallel_for(n_tasks: usize, task: &(dyn Fn(usize) + Sync)) {
    pool().run(n_tasks, task)
}

/// One job: a borrowed task closure (lifetime erased while the caller waits) and its size.
#[derive(Clone, Copy)]
struct Job {
    task: *const (dyn Fn(usize) + Sync + 'static),
    n_tasks: usize,
}

/// State shared by the caller and the workers.
struct Shared {
    /// Job word: epoch (bits 32..), [`CLOSED`] bit, and the number of workers inside the job
    /// (low bits). Workers join with a compare-and-swap on the current, open epoch.
    state: AtomicU64,
    /// The current job; written only by the submitting caller before it publishes the epoch.
    job: UnsafeCell<Job>,
    /// Next task index to hand out.
    next: AtomicUsize,
    /// A task of the current job panicked in a worker.
    panicked: AtomicBool,
    /// Parked workers wait here for a new epoch.
    sleepers: AtomicUsize,
    park: Mutex<()>,
    wake: Condvar,
}

/// Set in [`Shared::state`] once every task has been handed out: no worker may join any more.
const CLOSED: u64 = 1 << 31;
/// The joined-workers count in [`Shared::state`].
const ACTIVE: u64 = CLOSED - 1;

fn epoch_of(state: u64) -> u64 {
    state >> 32
}

// SAFETY: `job` is written only by the caller that holds `Pool::submit`, while no worker
// is inside a job, before the store (release) that opens the new epoch; a worker reads it
// only after joining that open epoch (acquire compare-and-swap) and before it leaves (the
// release decrement the caller waits for after closing the epoch). The task it points to
// is `Sync`, and alive while the caller waits.
unsafe impl Sync for Shared {}
// SAFETY: as above; the raw pointer is only dereferenced under that protocol.
unsafe impl Send for Shared {}

/// The pool: `threads - 1` spinning/parking workers and a submission lock.
pub(crate) struct Pool {
    threads: usize,
    shared: &'static Shared,
    submit: Mutex<()>,
}

fn noop(_: usize) {}

impl Pool {
    fn start(threads: usize) -> Pool {
        let noop: &'static (dyn Fn(usize) + Sync) = &noop;
        let shared: &'static Shared = Box::leak(Box::new(Shared {
            state: AtomicU64::new(CLOSED),
            job: UnsafeCell::new(Job {
                task: noop as *const _,
                n_tasks: 0,
            }),
            next: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            sleepers: AtomicUsize::new(0),
            park: Mutex::new(()),
            wake: Condvar::new(),
        }));
        let mut started = 1;
        for i in 1..threads.max(1) {
            let spawned = std::thread::Builder::new()
                .name(format!("flatrun-kernel-{i}"))
                .spawn(move || worker(shared));
            if spawned.is_err() {
                break; // run with the threads we have
            }
            started += 1;
        }
        Pool {
            threads: started,
            shared,
            submit: Mutex::new(()),
        }
    }

    fn run(&self, n_tasks: usize, task: &(dyn Fn(usize) + Sync)) {
        if n_tasks == 0 {
            return;
        }
        let inline = || (0..n_tasks).for_each(task);
        if n_tasks == 1 || self.threads == 1 {
            return inline();
        }
        let _guard = match self.submit.try_lock() {
            Ok(g) => g,
            Err(TryLockError::Poisoned(p)) => p.into_inner(),
            Err(TryLockError::WouldBlock) => return inline(),
        };
        let s = self.shared;
        // Publish the job.
        // SAFETY: we hold `submit`, and the previous caller waited until no worker was
        // inside its (closed) job, so nobody reads `job` now. The lifetime is erased only
        // while this call waits for the workers below.
        unsafe {
            let task: *const (dyn Fn(usize) + Sync + '_) = task;
            *s.job.get() = Job {
                task: std::mem::transmute::<
                    *const (dyn Fn(usize) + Sync + '_),
                    *const (dyn Fn(usize) + Sync + 'static),
                >(task),
                n_tasks,
            };
        }
        s.next.store(0, Ordering::Relaxed);
        s.panicked.store(false, Ordering::Relaxed);
        let epoch = epoch_of(s.state.load(Ordering::Relaxed)) + 1;
        s.state.store(epoch << 32, Ordering::SeqCst);
        if s.sleepers.load(Ordering::SeqCst) > 0 {
            let _lock = s.park.lock();
            s.wake.notify_all();
        }
        // Take part until every task is handed out, close the job to latecomers, and wait
        // for the workers that joined to finish their tasks.
        let mine = catch_unwind(AssertUnwindSafe(|| take_tasks(s, task, n_tasks)));
        s.state.fetch_or(CLOSED, Ordering::AcqRel);
        let mut spins = 0u32;
        while s.state.load(Ordering::Acquire) & ACTIVE != 0 {
            spins += 1;
            if spins < 1 << 12 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        if let Err(p) = mine {
            resume_unwind(p);
        }
        if s.panicked.load(Ordering::Relaxed) {
            panic!("a kernel task panicked on a pool thread");
        }
    }
}

/// Hand out and run tasks of the current job until none are left.
fn take_tasks(s: &Shared, task: &(dyn Fn(usize) + Sync), n_tasks: usize) {
    loop {
        let i = s.next.fetch_add(1, Ordering::Relaxed);
        if i >= n_tasks {
            return;
        }
        task(i);
    }
}

/// A worker: wait for a new epoch (spin, then park), join it if it is still open, serve it.
fn worker(s: &'static Shared) {
    let mut seen = epoch_of(s.state.load(Ordering::Acquire));
    loop {
        let state = wait_for_job(s, seen);
        seen = epoch_of(state);
        if !join(s, state) {
            continue; // the caller already handed out every task
        }
        // SAFETY: the caller wrote `job` before opening this epoch, which our join
        // (acquire) observed, and keeps it and its task alive until we leave below.
        let job = unsafe { *s.job.get() };
        // SAFETY: as above, the task outlives this use.
        let task = unsafe { &*job.task };
        if catch_unwind(AssertUnwindSafe(|| take_tasks(s, task, job.n_tasks))).is_err() {
            s.panicked.store(true, Ordering::Relaxed);
        }
        s.state.fetch_sub(1, Ordering::Release);
    }
}

/// Join the job of `state`'s epoch unless it has been closed (or replaced) meanwhile.
fn join(s: &Shared, mut state: u64) -> bool {
    let epoch = epoch_of(state);
    loop {
        if state & CLOSED != 0 || epoch_of(state) != epoch {
            return false;
        }
        match s
            .state
            .compare_exchange_weak(state, state + 1, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) => return true,
            Err(now) => state = now,
        }
    }
}

/// Wait until the epoch moves past `seen`, and return the job word.
fn wait_for_job(s: &Shared, seen: u64) -> u64 {
    let start = Instant::now();
    loop {
        for _ in 0..64 {
            let state = s.state.load(Ordering::Acquire);
            if epoch_of(state) != seen {
                return state;
            }
            std::hint::spin_loop();
        }
        if start.elapsed() > SPIN {
            break;
        }
    }
    // Park until a caller opens a new epoch (it notifies when it sees a sleeper).
    let mut lock = s.park.lock().unwrap_or_else(|p| p.into_inner());
    s.sleepers.fetch_add(1, Ordering::SeqCst);
    loop {
        let state = s.state.load(Ordering::SeqCst);
        if epoch_of(state) != seen {
            s.sleepers.fetch_sub(1, Ordering::SeqCst);
            return state;
        }
        lock = s.wake.wait(lock).unwrap_or_else(|p| p.into_inner());
    }
}

/// Physical cores (distinct `core_cpus_list` entries on Linux; logical CPUs elsewhere).
pub fn physical_cores() -> usize {
    let logical = std::thread::available_parallelism().map_or(1, |n| n.get());
    #[cfg(target_os = "linux")]
    {
        let mut cores = std::collections::BTreeSet::new();
        for cpu in 0..logical.max(1) * 4 {
            let path = format!("/sys/devices/system/cpu/cpu{cpu}/topology/core_cpus_list");
            match std::fs::read_to_string(&path) {
                Ok(s) => {
                    cores.insert(s.trim().to_string());
                }
                Err(_) => continue,
            }
        }
        if !cores.is_empty() {
            return cores.len().min(logical).max(1);
        }
    }
    logical.max(1)
}
