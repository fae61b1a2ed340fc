//! Closing a large handle returns its pages (`MADV_DONTNEED`): the
//! process's file-backed resident set falls. One test in its own process so
//! nothing else maps files meanwhile.

mod common;

use common::gguf_writer::GgufBytes;

/// File-backed resident bytes of this process: `Rss - Anonymous` from
/// `/proc/self/smaps_rollup` (exact page-table walk, unlike the batched
/// counters of `/proc/self/status`), or `None` where unavailable.
fn rss_file_bytes() -> Option<u64> {
    let rollup = std::fs::read_to_string("/proc/self/smaps_rollup").ok()?;
    let field = |name: &str| -> Option<u64> {
        let line = rollup.lines().find(|l| l.starts_with(name))?;
        line.split_whitespace()
            .nth(1)?
            .parse::<u64>()
            .ok()
            .map(|kb| kb * 1024)
    };
    Some(field("Rss:")?.saturating_sub(field("Anonymous:")?))
}

#[test]
fn closing_handles_drops_file_backed_rss() {
    if rss_file_bytes().is_none() {
        eprintln!("skipping: no /proc/self/smaps_rollup on this platform");
        return;
    }
    // Two F32 tensors of 4 MiB each, plus a small one under the threshold.
    const N: u64 = 1 << 20;
    let mut g = GgufBytes::header(3, 3, 0);
    g.tensor("blk.0.ffn_up.weight", &[N], 0, 0)
        .tensor("blk.0.ffn_down.weight", &[N], 0, 4 * N)
        .tensor("blk.0.attn_norm.weight", &[1024], 0, 8 * N)
        .align(32);
    let mut bytes = g.build();
    let data_start = bytes.len();
    bytes.resize(data_start + 8 * N as usize + 4096, 0);
    for (i, b) in bytes[data_start..].iter_mut().enumerate() {
        *b = (i % 251) as u8;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("big.gguf");
    std::fs::write(&path, &bytes).unwrap();
    drop(bytes);

    let backend = flatrun_format::open(&path).unwrap();
    let before = rss_file_bytes().unwrap();

    // Touch every byte of both large tensors.
    let names = ["layers.0.ffn.up", "layers.0.ffn.down"];
    backend.advise_willneed(&names);
    let mut checksum = 0u64;
    let handles: Vec<_> = names.iter().map(|n| backend.tensor(n).unwrap()).collect();
    for h in &handles {
        checksum += h.bytes().iter().map(|&b| b as u64).sum::<u64>();
    }
    assert!(checksum > 0);
    // At least 4 MiB more: reading the header may already have mapped a
    // large page-cache folio (up to 2 MiB) of the data.
    let touched = rss_file_bytes().unwrap();
    eprintln!("file-backed RSS: before {before} B, after touching {touched} B");
    assert!(
        touched >= before + 4 * N,
        "touching 8 MiB should raise file-backed RSS ({before} -> {touched})"
    );

    // Close them: the pages go back.
    for h in handles {
        h.close();
    }
    let after = rss_file_bytes().unwrap();
    eprintln!(
        "file-backed RSS: after closing {after} B (dropped {} B)",
        touched.saturating_sub(after)
    );
    assert!(
        after + 7 * N <= touched,
        "closing should drop ≥ 7 MiB ({touched} -> {after})"
    );

    // Bytes are still readable afterwards (re-faulted from the file).
    let again = backend.tensor("layers.0.ffn.up").unwrap();
    assert_eq!(again.bytes()[1000], (1000 % 251) as u8);
    // A small handle keeps its pages on close (below the threshold): no-op, no crash.
    backend.tensor("layers.0.attn_norm").unwrap().close();
}
