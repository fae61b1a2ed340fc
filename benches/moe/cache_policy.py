#!/usr/bin/env python3
"""Compare expert-cache policies on routing traces.

A trace is what `flatrun bench --expert-trace FILE` writes: every
(layer, expert) each layer pass needed, in order. This replays it through
a cache of a given number of experts (all experts of a model have the same
size) under each policy and prints the hit rates:

  lru   give up the least recently used expert (Flatrun's `--expert-policy lru`)
  lfu   give up the expert used least often since load, ties least recently;
        an expert used less often than every cached one is not cached
        (Flatrun's `--expert-policy lfu`, the default)
  opt   Belady's optimum: give up the expert needed again furthest in the
        future (no real policy can know that; the bound on what any can do)

The replay counts uses and recency exactly as the runtime's cache
(`crates/flatrun-runtime/src/weights/experts.rs`) does, so its hit rates are
the ones `flatrun bench` reports for the same trace and cache size (checked
with `--check BENCH_JSON`).

Usage: cache_policy.py TRACE.json [TRACE.json ...] [--sizes 0.05,0.1,0.25,0.5,0.75]
Standard library only.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict


def passes(trace):
    """Split the trace into layer passes (runs of the same layer)."""
    out, cur, layer = [], [], None
    for l, e in trace:
        if l != layer and cur:
            out.append((layer, cur))
            cur = []
        layer = l
        cur.append(e)
    if cur:
        out.append((layer, cur))
    return out


def replay(trace, slots, policy, decode_only_from=0):
    """Hits and lookups of `trace` (list of keys) through `slots` experts."""
    cache = {}  # key -> last use
    uses = defaultdict(int)
    clock = 0
    hits = lookups = 0
    if policy == "opt":
        # Next use of each position, for Belady.
        nxt = [0] * len(trace)
        seen = {}
        for i in range(len(trace) - 1, -1, -1):
            nxt[i] = seen.get(trace[i], float("inf"))
            seen[trace[i]] = i
        next_use = {}
    for i, key in enumerate(trace):
        clock += 1
        uses[key] += 1
        counted = i >= decode_only_from
        lookups += counted
        if policy == "opt":
            if key in cache:
                hits += counted
                next_use[key] = nxt[i]
                continue
            if slots == 0:
                continue
            if len(cache) >= slots:
                victim = max(cache, key=lambda k: next_use[k])
                if next_use[victim] < nxt[i]:
                    continue  # the new one is needed later than any cached
                del cache[victim]
                del next_use[victim]
            cache[key] = clock
            next_use[key] = nxt[i]
            continue
        if key in cache:
            hits += counted
            cache[key] = clock
            continue
        if slots == 0:
            continue
        admitted = True
        while len(cache) >= slots:
            if policy == "lru":
                victim = min(cache, key=lambda k: cache[k])
            else:
                victim = min(cache, key=lambda k: (uses[k], cache[k]))
                if uses[victim] > uses[key]:
                    admitted = False
                    break
            del cache[victim]
        if admitted:
            cache[key] = clock
    return hits, lookups


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--sizes", default="0.05,0.1,0.25,0.5,0.75",
                    help="cache sizes as shares of all the model's experts")
    ap.add_argument("--json", help="write the table here as JSON")
    a = ap.parse_args()
    sizes = [float(s) for s in a.sizes.split(",")]
    rows = []
    for path in a.traces:
        with open(path) as f:
            t = json.load(f)
        trace = [(l, e) for l, e in t["trace"]]
        n_all = t["n_layer"] * t["n_expert"]
        # Decode passes: those with at most n_used experts, after the last
        # larger (prefill) pass.
        ps = passes(trace)
        start, at = 0, 0
        for layer, es in ps:
            at += len(es)
            if len(es) > t["n_used"]:
                start = at
        print(f"\n{path}: {len(trace)} lookups ({len(trace) - start} in decode), "
              f"{t['n_layer']} layers x {t['n_expert']} experts, top-{t['n_used']}")
        print(f"{'cache':>8} {'experts':>8} | {'lru':>6} {'lfu':>6} {'opt':>6}   (decode hit rate)")
        for share in sizes:
            slots = int(n_all * share)
            rates = {}
            for policy in ("lru", "lfu", "opt"):
                h, n = replay(trace, slots, policy, start)
                rates[policy] = h / n if n else 0.0
            print(f"{share:>7.0%} {slots:>8} | {rates['lru']:>6.1%} {rates['lfu']:>6.1%} {rates['opt']:>6.1%}")
            rows.append({"trace": path, "share": share, "slots": slots, **rates})
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
