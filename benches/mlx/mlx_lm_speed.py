#!/usr/bin/env python3
"""mlx-lm's own CPU speed on an MLX directory: prefill of P tokens and decode of
N tokens (KV-cached, one token per step), R repetitions; prints one JSON line
with the median, min and max tokens/s of each (with `--label L`, two rows of
benches/mlx/speed.sh's markdown table instead).

Usage: mlx_lm_speed.py DIR [-p 128] [-n 64] [-r 3] [--float32] [--label L]
(`--float32` runs it as the goldens of tests/mlx_lm_parity.rs do.)
"""
import argparse
import json
import statistics
import time

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("-p", type=int, default=128)
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("-r", type=int, default=3)
    ap.add_argument("--float32", action="store_true")
    ap.add_argument("--label", help="print markdown rows under this engine label")
    a = ap.parse_args()
    model, _ = load(a.dir)
    if a.float32:
        model.set_dtype(mx.float32)
    prompt = mx.array([[(7 * i + 11) % 1000 + 100 for i in range(a.p)]])
    pp, tg = [], []
    for rep in range(a.r + 1):  # the first is a warm-up
        cache = make_prompt_cache(model)
        t = time.perf_counter()
        logits = model(prompt, cache=cache)
        mx.eval(logits)
        t_pp = time.perf_counter() - t
        tok = mx.argmax(logits[:, -1, :], axis=-1)
        t = time.perf_counter()
        for _ in range(a.n):
            logits = model(tok[:, None], cache=cache)
            tok = mx.argmax(logits[:, -1, :], axis=-1)
            mx.eval(tok)
        t_tg = time.perf_counter() - t
        if rep:
            pp.append(a.p / t_pp)
            tg.append(a.n / t_tg)
    row = lambda v: {"median": statistics.median(v), "min": min(v), "max": max(v)}
    if a.label is None:
        print(json.dumps({"dir": a.dir, "float32": a.float32, "pp": row(pp), "tg": row(tg)}))
        return
    for test, v in ((f"pp{a.p}", row(pp)), (f"tg{a.n}", row(tg))):
        print(f"| {a.label} | {test} | {v['median']:.2f} | {v['min']:.2f} | {v['max']:.2f} | |")


if __name__ == "__main__":
    main()
