//! `--profile-detailed`: one row per decoder layer — I/O wait, the time of
//! each op, the layer's total, the megabytes of weights it acquired and,
//! when the KV cache lives in a file, the megabytes of cache it paged in and
//! out — then a row of column totals. Layers left out by `--layers` are listed
//! as skipped. Times are milliseconds summed over every
//! step of the run.

use flatrun_runtime::{LayerSelection, Profiler};
use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::time::Duration;

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// The per-layer table of `profiler` for the layers of `selection`.
pub fn layer_table(profiler: &Profiler, selection: &LayerSelection) -> String {
    let ops: Vec<&'static str> = profiler
        .layers
        .iter()
        .flat_map(|l| l.ops.keys().copied())
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    let width = |name: &str| name.len().max(9);
    let kv = profiler.layers.iter().any(|l| l.kv_bytes_paged > 0);
    let mb = |bytes: u64| bytes as f64 / 1e6;
    let mut s = String::new();
    // Header: layer, io_wait, each op, total, MB read.
    let _ = write!(s, "{:>5} {:>9}", "layer", "io_wait");
    for op in &ops {
        let _ = write!(s, " {:>w$}", op, w = width(op));
    }
    let _ = write!(s, " {:>9} {:>8}", "total", "MB read");
    let _ = writeln!(s, "{}", if kv { "    KV MB" } else { "" });

    let mut column_totals = vec![Duration::ZERO; ops.len()];
    let (mut io_total, mut all_total, mut bytes_total) = (Duration::ZERO, Duration::ZERO, 0u64);
    let mut kv_total = 0u64;
    for (il, layer) in profiler.layers.iter().enumerate() {
        if !selection.runs(il) {
            let _ = writeln!(s, "{il:>5} skipped (--layers)");
            continue;
        }
        let mut total = layer.io_wait;
        let _ = write!(s, "{il:>5} {:>9.2}", ms(layer.io_wait));
        for (k, op) in ops.iter().enumerate() {
            let d = layer.ops.get(op).copied().unwrap_or_default();
            total += d;
            column_totals[k] += d;
            let _ = write!(s, " {:>w$.2}", ms(d), w = width(op));
        }
        let _ = write!(s, " {:>9.2} {:>8.1}", ms(total), mb(layer.bytes_acquired));
        let _ = writeln!(s, "{}", kv_cell(kv, mb(layer.kv_bytes_paged)));
        io_total += layer.io_wait;
        all_total += total;
        bytes_total += layer.bytes_acquired;
        kv_total += layer.kv_bytes_paged;
    }
    // The column totals.
    let _ = write!(s, "{:>5} {:>9.2}", "all", ms(io_total));
    for (k, op) in ops.iter().enumerate() {
        let _ = write!(s, " {:>w$.2}", ms(column_totals[k]), w = width(op));
    }
    let _ = write!(s, " {:>9.2} {:>8.1}", ms(all_total), mb(bytes_total));
    let _ = writeln!(s, "{}", kv_cell(kv, mb(kv_total)));
    s
}

/// The KV column's cell, when the table has that column.
fn kv_cell(shown: bool, mb: f64) -> String {
    if shown {
        format!(" {mb:>8.1}")
    } else {
        String::new()
    }
}
