#!/usr/bin/env python3
"""Stream-mode peak memory across a ladder of model sizes (0.1B to 4B).

Runs `flatrun bench --residency stream` on each synthetic model written by
`gen_ladder.py`, samples the process's RSS (anonymous and file-backed) every
10 ms, and compares the peak's growth with what must grow: the KV cache and
the single largest decoder layer. Flat means: peak RSS minus the KV cache
grows by no more than the layers that may be resident at once do: the one
executing plus the `--prefetch` layers read ahead.

    python benches/race/ladder.py --dir ~/.cache/flatrun/ladder --ctx 1024
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gen_ladder import LADDER, Q4_K_BYTES, QK_K  # noqa: E402
from race import MIB, REPO, run_measured  # noqa: E402


def layer_bytes(size: str) -> int:
    d, _, ff, n_head, n_kv = LADDER[size]
    kv = n_kv * d // n_head
    weights = d * d * 2 + kv * d * 2 + 3 * d * ff
    return weights // QK_K * Q4_K_BYTES + 2 * d * 4


def kv_bytes(size: str, ctx: int) -> int:
    d, n_layer, _, n_head, n_kv = LADDER[size]
    return 2 * n_layer * ctx * n_kv * (d // n_head) * 2  # K and V, f16


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, default=Path.home() / ".cache/flatrun/ladder")
    ap.add_argument("--flatrun", default=str(REPO / "target/release/flatrun"))
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefetch", type=int, default=1, help="layers read ahead (flatrun --prefetch)")
    ap.add_argument("--out", type=Path, default=REPO / "benches/race/results/ladder.json")
    args = ap.parse_args()

    rows = []
    for size in LADDER:
        model = args.dir / f"ladder-{size}-q4_k.gguf"
        if not model.exists():
            print(f"missing {model}: run gen_ladder.py first", file=sys.stderr)
            return 1
        cmd = [args.flatrun, "bench", "-m", str(model), "--residency", "stream", "--ctx", str(args.ctx),
               "--threads", str(args.threads), "--prefetch", str(args.prefetch), "-p", "16", "-n", "16", "-r", "1", "--json", "-q"]
        res = run_measured(cmd)
        if res.returncode != 0:
            print(res.stderr[-2000:], file=sys.stderr)
            return 1
        bench = json.loads(res.stdout)
        tg = next(r["median_tok_s"] for r in bench if r["test"].startswith("tg"))
        rows.append({"size": size, "file_bytes": model.stat().st_size, "peak_rss": res.peak_rss,
                     "peak_anon": res.peak_anon, "peak_file": res.peak_file,
                     "kv_bytes": kv_bytes(size, args.ctx), "largest_layer_bytes": layer_bytes(size),
                     "decode_tok_s": tg})
        print(f"{size}: file {model.stat().st_size / MIB:.0f} MiB, peak RSS {res.peak_rss / MIB:.1f} MiB", file=sys.stderr)

    base = rows[0]
    print(f"| model | file | peak RSS | anon | file-backed | KV cache (ctx {args.ctx}) | largest layer | "
          f"RSS growth | KV + in-flight layers growth | decode t/s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    flat = True
    for r in rows:
        growth = r["peak_rss"] - base["peak_rss"]
        in_flight = 1 + args.prefetch
        allowed = (r["kv_bytes"] - base["kv_bytes"]) + in_flight * (r["largest_layer_bytes"] - base["largest_layer_bytes"])
        flat &= growth <= allowed
        print(f"| {r['size']} | {r['file_bytes'] / MIB:.0f} MiB | {r['peak_rss'] / MIB:.1f} MiB | "
              f"{r['peak_anon'] / MIB:.1f} MiB | {r['peak_file'] / MIB:.1f} MiB | {r['kv_bytes'] / MIB:.1f} MiB | "
              f"{r['largest_layer_bytes'] / MIB:.1f} MiB | {growth / MIB:+.1f} MiB | {allowed / MIB:+.1f} MiB | "
              f"{r['decode_tok_s']:.2f} |")
    print(f"\nflat (growth within KV + {1 + args.prefetch} × largest-layer growth): {'yes' if flat else 'NO'}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"ctx": args.ctx, "prefetch": args.prefetch, "rows": rows, "flat": flat}, indent=2))
    return 0 if flat else 2


if __name__ == "__main__":
    sys.exit(main())
