//! The persistent thread pool every parallel kernel runs on.

use std::sync::OnceLock;

static POOL: OnceLock<rayon::ThreadPool> = OnceLock::new();

/// Build the global pool with `n` workers (0 = physical cores). Only the first
/// call (or the first kernel call) decides; later calls are ignored.
pub fn set_threads(n: usize) {
    let _ = pool_with(n);
}

/// Number of workers in the pool (building it with the default if needed).
pub fn threads() -> usize {
    pool().current_num_threads()
}

pub(crate) fn pool() -> &'static rayon::ThreadPool {
    pool_with(0)
}

fn pool_with(n: usize) -> &'static rayon::ThreadPool {
    POOL.get_or_init(|| {
        let n = if n == 0 { physical_cores() } else { n };
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .thread_name(|i| format!("flatrun-kernel-{i}"))
            .build()
            .or_else(|_| rayon::ThreadPoolBuilder::new().num_threads(1).build())
            .unwrap_or_else(|e| panic!("cannot start even one kernel thread: {e}"))
    })
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
