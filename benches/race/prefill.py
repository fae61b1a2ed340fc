#!/usr/bin/env python3
"""Prefill race: prompt-processing tokens/s of Flatrun against llama.cpp at
several prompt lengths, every weight resident, in one run.

For each round, model and length (ppN, synthetic tokens as `llama-bench -p N`),
`llama-bench -p N -n 0 -r 1 --repack 0,1` and `flatrun bench --residency
resident -p N -n 0 -r 1` run back to back, the one going first alternating
between rounds, so both share the machine's noise. Each tool warms up once
before each timed run (llama-bench's warm-up run, Flatrun's untimed pass).
llama.cpp runs both of its weight layouts: repacked into interleaved tiles (its
default) and as loaded (`--repack 0`, which takes its tiled K-quant GEMM), and
the faster of the two in each round is what Flatrun is held against. Prints
both and Flatrun ÷ llama.cpp's faster per model and length (median [min–max] of
the rounds' ratios) and writes every sample to
`benches/race/results/prefill-latest.json`.

With `--cap`, both run inside a fresh memory cgroup of `--cap-fraction` (0.5)
of the model file, the file's page cache dropped first, cold (no warm-up):
llama.cpp reading its weights through mmap (`-lm mmap --repack 0`, the pages it
cannot keep are re-read), Flatrun with `--residency cap=SIZE`, SIZE = the limit
less its peak anonymous memory in a stream-mode run of the same prompt, less
`--headroom-mib`. Both get a context of the prompt plus 16 tokens.

Example:
    LLAMA_CPP_BIN=~/llama.cpp/build/bin benches/race/prefill.py \\
        --models ~/.cache/flatrun/models --lengths 128 512 2048 --rounds 3
    LLAMA_CPP_BIN=... benches/race/prefill.py --cap --lengths 2048 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import race  # noqa: E402  (the shared runners and ratio helpers)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-bin", default=os.environ.get("LLAMA_CPP_BIN"),
                    help="directory holding llama-bench (default: $LLAMA_CPP_BIN)")
    ap.add_argument("--flatrun", default=str(race.REPO / "target/release/flatrun"), help="flatrun binary")
    ap.add_argument("--models", nargs="+",
                    default=[os.environ.get("FLATRUN_MODELS", str(Path.home() / ".cache/flatrun/models"))],
                    help="GGUF files or directories of them")
    ap.add_argument("--lengths", nargs="+", type=int, default=[128, 512, 2048], help="prompt lengths")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--cap", action="store_true", help="run both inside a memory cgroup (see above)")
    ap.add_argument("--cap-fraction", type=float, default=0.5, help="cgroup limit as a fraction of the file")
    ap.add_argument("--headroom-mib", type=int, default=8, help="Flatrun's cap is this much under the limit")
    ap.add_argument("--out", default=str(race.REPO / "benches/race/results"), help="directory for the JSON")
    args = ap.parse_args()
    if not args.llama_bin:
        sys.exit("set LLAMA_CPP_BIN or pass --llama-bin")
    models = race.find_models(args.models)
    if not models:
        sys.exit("no GGUF models found")

    # "llama" is llama.cpp's faster layout in each round; resident runs also keep both.
    samples: dict[str, dict[int, dict[str, list[float]]]] = {
        m.name: {p: {"flatrun": [], "llama": [], "llama_repack": [], "llama_no_repack": []}
                 for p in args.lengths}
        for m in models
    }
    caps: dict[str, dict[int, str]] = {}
    if args.cap:
        for model in models:
            for p in args.lengths:
                # Flatrun's own anonymous memory at this prompt (KV, activations, buffers).
                _, res = race.flatrun_bench(args, model, p, 0, "stream", extra=["--ctx", str(p + 16)])
                limit = int(model.stat().st_size * args.cap_fraction)
                keep = limit - res.peak_anon - args.headroom_mib * race.MIB
                caps.setdefault(model.name, {})[p] = f"cap={keep // race.MIB}M" if keep > 0 else "stream"
                race.log(f"{model.name} pp{p}: limit {limit / race.MIB:.0f} MiB, Flatrun anonymous peak "
                         f"{res.peak_anon / race.MIB:.0f} MiB -> {caps[model.name][p]}")

    def one(who: str, model: Path, p: int, rnd: int) -> float:
        if not args.cap:
            if who == "flatrun":
                out, _ = race.flatrun_bench(args, model, p, 0, "resident")
                return out[f"pp{p}"]["tok_s"]
            _, res = race.llama_bench(args, model, p, 0, ["--repack", "0,1"])
            by_layout = {bool(r.get("repack")): r["avg_ts"] for r in json.loads(res.stdout)}
            samples[model.name][p]["llama_repack"].append(by_layout[True])
            samples[model.name][p]["llama_no_repack"].append(by_layout[False])
            return max(by_layout.values())
        race.drop_page_cache(model)
        cg = race.Cgroup(int(model.stat().st_size * args.cap_fraction), f"flatrun-prefill-{os.getpid()}-{who}-{rnd}")
        try:
            if who == "flatrun":
                out, _ = race.flatrun_bench(args, model, p, 0, caps[model.name][p], cg,
                                            extra=["--no-warmup", "--ctx", str(p + 16)])
            else:
                out, _ = race.llama_bench(args, model, p, 0,
                                          ["-lm", "mmap", "--repack", "0", "--no-warmup"], cg)
        finally:
            cg.remove()
        return out[f"pp{p}"]["tok_s"]

    failures: dict[str, dict[int, dict[str, int]]] = {}
    for rnd in range(args.rounds):
        for model in models:
            for p in args.lengths:
                flatrun_first = (rnd % 2) == 0
                for who in (["flatrun", "llama"] if flatrun_first else ["llama", "flatrun"]):
                    try:
                        tps = one(who, model, p, rnd)
                    except RuntimeError as e:
                        # Logged with its exit code; under a cgroup, -9 is the OOM killer
                        # (anonymous memory above the limit).
                        failures.setdefault(model.name, {}).setdefault(p, {}).setdefault(who, 0)
                        failures[model.name][p][who] += 1
                        race.log(f"round {rnd + 1}: {model.name} pp{p} {who} FAILED ({str(e).splitlines()[0][:120]})")
                        continue
                    samples[model.name][p][who].append(tps)
                    race.log(f"round {rnd + 1}: {model.name} pp{p} {who} {tps:.1f} t/s")

    if args.cap:
        print("\n| model | prompt | Flatrun t/s | llama.cpp t/s | Flatrun ÷ llama.cpp |")
        print("|---|---:|---:|---:|---:|")
    else:
        print("\n| model | prompt | Flatrun t/s | llama.cpp repacked t/s | llama.cpp `--repack 0` t/s "
              "| Flatrun ÷ llama.cpp's faster |")
        print("|---|---:|---:|---:|---:|---:|")
    for model in models:
        for p in args.lengths:
            s = samples[model.name][p]
            failed = failures.get(model.name, {}).get(p, {})

            def cell(who: str) -> str:
                # llama_repack / llama_no_repack come from the same llama-bench run as "llama".
                fails = failed.get("llama" if who.startswith("llama") else who, 0)
                if not s[who]:
                    return f"failed ({fails} of {args.rounds})"
                v = race.summarize(s[who])
                note = f", failed {fails}×" if fails else ""
                return f"{v['median']:.1f} [{v['min']:.1f}–{v['max']:.1f}]{note}"

            r = race.paired_ratio(s["flatrun"], s["llama"]) if s["flatrun"] and s["llama"] else None
            ratio = f"**{r['median']:.2f}×** [{r['min']:.2f}–{r['max']:.2f}]" if r else "—"
            llama_cells = [cell("llama")] if args.cap else [cell("llama_repack"), cell("llama_no_repack")]
            print(f"| {model.name} | pp{p} | {cell('flatrun')} | {' | '.join(llama_cells)} | {ratio} |")

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    doc = {
        "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "threads": args.threads,
        "rounds": args.rounds,
        "command": " ".join(sys.argv),
        "capped": args.cap,
        "flatrun_residency": caps,
        "samples": samples,
        "failures": failures,
    }
    path = out_dir / ("prefill-capped-latest.json" if args.cap else "prefill-latest.json")
    path.write_text(json.dumps(doc, indent=1))
    race.log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
