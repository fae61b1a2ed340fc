#!/usr/bin/env python3
"""Stream-mode peak memory across a ladder of model sizes (0.1B to 4B).

Runs `flatrun bench --residency stream` on each synthetic model written by
`gen_ladder.py` and samples the process every 10 ms:

* peak RSS: the kernel's own high-water mark (`VmHWM`, anonymous + file-backed
  + shmem) — the figure the target is about;
* anon / file-backed: the largest sampled `RssAnon` / `RssFile`;
* model file mapped: the largest sampled resident size of the process's
  mappings of the model file (`/proc/PID/smaps`): the file's metadata pages
  the tokenizer reads, the embedding rows looked up, and — where stream mode
  maps its chunks (MLX checkpoints) rather than reading them into its
  `(prefetch + 1)` anonymous chunk buffers — the weights in flight and what
  the kernel maps around a faulting page (fault-around blocks, large
  page-cache folios). Either way bounded by `(prefetch + 1) × --stream-chunk`
  plus the metadata and slack.

Target: peak RSS grows by less than the KV cache does, i.e.
peak RSS(size) − peak RSS(0.1b) < KV(size) − KV(0.1b) for every size; PASS or
FAIL is printed per rung. The KV cache is what must grow: K and V in f16,
`n_layer × ctx × n_kv_head × head_dim` each, plus its slot table (one 8-byte
position per slot and layer); the weights in flight must not.

What the KV term means depends on whether the cache's pages are resident.
The runtime gives each cache buffer its own zeroed anonymous mapping, so
positions never written cost no memory at all (the kernel maps a page on
its first write). The script therefore also prints the KV bytes the run writes
(`-p + -n` positions, rounded up to whole pages per layer) and "other
growth" = RSS growth − growth of those written KV bytes: what grew besides
the cache (activations, per-layer tables, mapped file pages). With
`--ctx auto` the cache holds exactly the positions the run uses, so the
target compares against written bytes only: the strict form, where
everything but the cache must not grow at all.

    python benches/race/ladder.py --dir ~/.cache/flatrun/ladder --rounds 3
    python benches/race/ladder.py --ctx 1024     # a large, mostly unwritten cache
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gen_ladder import LADDER, Q4_K_BYTES, QK_K  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
MIB = 1024 * 1024


def layer_bytes(size: str) -> int:
    d, _, ff, n_head, n_kv = LADDER[size]
    kv = n_kv * d // n_head
    weights = d * d * 2 + kv * d * 2 + 3 * d * ff
    return weights // QK_K * Q4_K_BYTES + 2 * d * 4


def kv_bytes(size: str, ctx: int) -> int:
    """K and V (f16) and the slot table (8 bytes a slot) of every layer."""
    d, n_layer, _, n_head, n_kv = LADDER[size]
    return n_layer * ctx * (2 * n_kv * (d // n_head) * 2 + 8)


def kv_written_bytes(size: str, positions: int, page: int = 4096) -> int:
    """The KV bytes `positions` written positions touch: whole pages per layer buffer."""
    d, n_layer, _, n_head, n_kv = LADDER[size]
    pages = lambda b: -(-b // page) * page  # noqa: E731
    return n_layer * (2 * pages(positions * n_kv * (d // n_head) * 2) + pages(positions * 8))


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().rstrip("IB") or "0"
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def status_kib(pid: int) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("VmHWM", "RssAnon", "RssFile"):
                    out[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError):
        pass
    return out


def mapped_bytes(pid: int, path: str) -> int:
    """Resident bytes of `pid`'s mappings of `path` (from /proc/PID/smaps)."""
    total, inside = 0, False
    try:
        with open(f"/proc/{pid}/smaps") as f:
            for line in f:
                head = line.split(None, 5)
                if head and "-" in head[0] and not head[0].endswith(":"):
                    inside = len(head) == 6 and head[5].strip() == path
                elif inside and head and head[0] == "Rss:":
                    total += int(head[1]) * 1024
    except (OSError, ValueError):
        pass
    return total


def metadata_bytes(model: Path) -> int:
    """Bytes before the first tensor: header, metadata (the tokenizer's tables)."""
    import gguf

    return int(gguf.GGUFReader(model).data_offset)


def run_sampled(cmd: list[str], model: Path) -> dict:
    """Run `cmd`, sampling its memory every 10 ms until it exits."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peaks = {"hwm": 0, "anon": 0, "file": 0, "mapped": 0}
    stop = threading.Event()
    path = str(model.resolve())

    def sample() -> None:
        while not stop.is_set():
            s = status_kib(proc.pid)
            if s:
                peaks["hwm"] = max(peaks["hwm"], s.get("VmHWM", 0))
                peaks["anon"] = max(peaks["anon"], s.get("RssAnon", 0))
                peaks["file"] = max(peaks["file"], s.get("RssFile", 0))
                peaks["mapped"] = max(peaks["mapped"], mapped_bytes(proc.pid, path))
            stop.wait(0.01)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, err = proc.communicate()
    stop.set()
    sampler.join()
    return {"returncode": proc.returncode, "stdout": out, "stderr": err, **peaks}


def plot(rows: list[dict], path: Path) -> None:
    """Peak RSS and its parts against model size (skipped without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib unavailable: no ladder chart", file=sys.stderr)
        return
    x = [r["file_bytes"] / MIB for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, label in [("peak_rss", "peak RSS (VmHWM)"), ("peak_anon", "anonymous"), ("kv_bytes", "KV cache (allocated)"),
                       ("kv_written_bytes", "KV written"),
                       ("peak_file", "file-backed"), ("peak_weights_mapped", "model file mapped")]:
        ax.plot(x, [r[key] / MIB for r in rows], marker="o", label=label)
    ax.plot(x, [r["largest_layer_bytes"] / MIB for r in rows], ls=":", color="grey", label="one layer")
    for r, xi in zip(rows, x):
        ax.annotate(r["size"], (xi, r["peak_rss"] / MIB), textcoords="offset points", xytext=(0, 6), ha="center")
    ax.set_xscale("log")
    ax.set_xlabel("model file (MiB, log)")
    ax.set_ylabel("MiB")
    ax.set_title("Flatrun stream mode: peak memory vs model size")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, default=Path.home() / ".cache/flatrun/ladder")
    ap.add_argument("--flatrun", default=str(REPO / "target/release/flatrun"))
    ap.add_argument("--ctx", default="auto",
                    help="context of the run (KV cache size), or `auto` (default): just the positions it uses")
    ap.add_argument("-p", "--n-prompt", type=int, default=16)
    ap.add_argument("-n", "--n-gen", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=1,
                    help="runs per model; the figures are the median run's (by peak RSS), min-max shown")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefetch", type=int, default=1, help="chunks read ahead (flatrun --prefetch)")
    ap.add_argument("--stream-chunk", default=None,
                    help="row-chunk budget (flatrun --stream-chunk; default: flatrun's, 2M)")
    ap.add_argument("--sizes", nargs="+", default=list(LADDER), choices=list(LADDER))
    ap.add_argument("--out", type=Path, default=REPO / "benches/race/results/ladder.json")
    args = ap.parse_args()

    positions = args.n_prompt + args.n_gen
    # bench's own choice without --ctx: the prompt (≥ 8, its warm-up), the generation and one more
    ctx = max(args.n_prompt, 8) + args.n_gen + 1 if args.ctx == "auto" else int(args.ctx)
    rows = []
    for size in args.sizes:
        model = args.dir / f"ladder-{size}-q4_k.gguf"
        if not model.exists():
            print(f"missing {model}: run gen_ladder.py first", file=sys.stderr)
            return 1
        cmd = [args.flatrun, "bench", "-m", str(model), "--residency", "stream", "--ctx", str(ctx),
               "--threads", str(args.threads), "--prefetch", str(args.prefetch),
               "-p", str(args.n_prompt), "-n", str(args.n_gen), "-r", "1", "--json", "-q"]
        if args.stream_chunk:
            cmd += ["--stream-chunk", args.stream_chunk]
        runs = []
        for _ in range(max(args.rounds, 1)):
            res = run_sampled(cmd, model)
            if res["returncode"] != 0:
                print(res["stderr"][-2000:], file=sys.stderr)
                return 1
            bench = json.loads(res["stdout"])
            res["tg"] = next(r["median_tok_s"] for r in bench if r["test"].startswith("tg"))
            res["pp"] = next(r["median_tok_s"] for r in bench if r["test"].startswith("pp"))
            runs.append(res)
            print(f"{size}: file {model.stat().st_size / MIB:.0f} MiB, peak RSS {res['hwm'] / MIB:.1f} MiB, "
                  f"model file mapped {res['mapped'] / MIB:.1f} MiB", file=sys.stderr)
        runs.sort(key=lambda r: r["hwm"])
        res = runs[len(runs) // 2]
        rows.append({"size": size, "file_bytes": model.stat().st_size, "metadata_bytes": metadata_bytes(model),
                     "peak_rss": res["hwm"], "peak_rss_runs": [r["hwm"] for r in runs],
                     "peak_anon": res["anon"], "peak_file": res["file"], "peak_weights_mapped": res["mapped"],
                     "kv_bytes": kv_bytes(size, ctx), "kv_written_bytes": kv_written_bytes(size, positions),
                     "largest_layer_bytes": layer_bytes(size),
                     "prefill_tok_s": res["pp"], "decode_tok_s": res["tg"],
                     "prefill_tok_s_runs": [r["pp"] for r in runs], "decode_tok_s_runs": [r["tg"] for r in runs]})

    base = rows[0]
    budget = (args.prefetch + 1) * parse_size(args.stream_chunk or "2M")
    print(f"| model | file | largest layer | KV cache (ctx {ctx}) | KV written ({positions} pos.) | peak RSS "
          f"(min–max of {max(args.rounds, 1)}) | anon | file-backed | model file mapped | RSS growth | KV growth | "
          f"target | other growth | prefill t/s | decode t/s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:-:|---:|---:|---:|")
    flat = True
    for r in rows:
        growth = r["peak_rss"] - base["peak_rss"]
        kv_growth = r["kv_bytes"] - base["kv_bytes"]
        other = growth - (r["kv_written_bytes"] - base["kv_written_bytes"])
        r["rss_growth"], r["kv_growth"], r["other_growth"] = growth, kv_growth, other
        verdict = "—"
        if r is not base:
            r["pass"] = growth < kv_growth
            flat &= r["pass"]
            verdict = "PASS" if r["pass"] else "FAIL"
        lo, hi = min(r["peak_rss_runs"]), max(r["peak_rss_runs"])
        print(f"| {r['size']} | {r['file_bytes'] / MIB:.0f} MiB | {r['largest_layer_bytes'] / MIB:.1f} MiB | "
              f"{r['kv_bytes'] / MIB:.1f} MiB | {r['kv_written_bytes'] / MIB:.1f} MiB | "
              f"{r['peak_rss'] / MIB:.1f} MiB ({lo / MIB:.1f}–{hi / MIB:.1f}) | {r['peak_anon'] / MIB:.1f} MiB | "
              f"{r['peak_file'] / MIB:.1f} MiB | {r['peak_weights_mapped'] / MIB:.1f} MiB | "
              f"{growth / MIB:+.1f} MiB | {kv_growth / MIB:+.1f} MiB | {verdict} | {other / MIB:+.1f} MiB | "
              f"{r['prefill_tok_s']:.2f} | {r['decode_tok_s']:.2f} |")
    # The mapping also holds the metadata the tokenizer reads (the file's
    # header, before the first tensor) and what the kernel maps around a fault.
    bounded = all(r["peak_weights_mapped"] <= budget + r["metadata_bytes"] + 8 * MIB for r in rows)
    print(f"\ntarget (peak RSS growth < KV cache growth at every size): {'PASS' if flat else 'FAIL'}")
    print(f"model file mapped within (prefetch + 1) × chunk = {budget / MIB:.1f} MiB + metadata + 8 MiB "
          f"(fault-around, page-cache folios): {'yes' if bounded else 'NO'}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    plot(rows, args.out.with_suffix(".png"))
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    args.out.write_text(json.dumps({"ctx": ctx, "positions": positions, "prefetch": args.prefetch,
                                    "stream_chunk": args.stream_chunk, "rounds": args.rounds,
                                    "weights_budget_bytes": budget, "load_average": load,
                                    "measured": time.strftime("%Y-%m-%d %H:%M"), "rows": rows,
                                    "flat": flat, "weights_bounded": bounded}, indent=2))
    return 0 if flat and bounded else 2


if __name__ == "__main__":
    sys.exit(main())
