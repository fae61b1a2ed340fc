#!/usr/bin/env python3
"""Peak memory and decode speed as the context grows: the streamed KV cache
against the resident one.

For each context length N (default 1024, 8192, 32768 tokens) the script feeds
the first N tokens (about: `--chars-per-token`, 4.4 for English prose and
Qwen2.5's tokenizer) of a long real text (`--text`; by default CPython's
reference-manual help text, `pydoc_data.topics`, which every CPython install
carries: 465k characters, about 100k tokens, in sorted topic order; not
repeated filler) to
`flatrun run --ctx 1.25N+64 -n 32`, once per residency (`stream`: weights and KV
cache streamed, the cache from its file; `resident`: everything in memory,
the cache in anonymous memory), and prints the peak RSS (`VmHWM`) and the
prefill and decode tokens/s the run reports. With `--llama-bench PATH` it also runs
`llama-bench -p 0 -n 32 -d N -ctk T -ctv T` (decode at depth N, the same cache
type) for llama.cpp's tokens/s beside ours.

Target: in stream mode peak RSS grows by less than 10% from the first rung
to the last, while the resident cache grows by the KV bytes.

    python benches/race/kv_ladder.py --model ~/.cache/flatrun/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf \\
        [--text book.txt] --ctx 1024,8192,32768 [--llama-bench PATH] [--kv-type f16]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))


def run_flatrun(binary, model, prompt_file, ctx, residency, kv_type):
    cmd = [binary, "run", "-m", model, "--prompt-file", prompt_file, "-n", "32",
           "--ctx", str(ctx + ctx // 4 + 64), "--residency", residency, "--kv-type", kv_type]
    out = subprocess.run(cmd, capture_output=True, text=True)
    text = out.stderr + out.stdout
    m = re.search(r"prompt (\d+) tok, generated (\d+) tok, prefill ([\d.]+) tok/s, decode ([\d.]+) tok/s, "
                  r"peak RSS ([\d.]+) (KiB|MiB|GiB)", text)
    if not m:
        sys.exit(f"flatrun failed ({' '.join(cmd)}):\n{text[-2000:]}")
    scale = {"KiB": 1 / 1024, "MiB": 1, "GiB": 1024}[m.group(6)]
    return int(m.group(1)), float(m.group(3)), float(m.group(4)), float(m.group(5)) * scale


def run_llama(bench, model, depth, kv_type):
    cmd = [bench, "-m", model, "-p", "0", "-n", "32", "-d", str(depth), "-t", "2", "-r", "1",
           "-ctk", kv_type, "-ctv", kv_type, "-o", "csv"]
    if kv_type != "f16":
        cmd += ["-fa", "1"]
    out = subprocess.run(cmd, capture_output=True, text=True)
    rows = [l for l in out.stdout.splitlines() if l and not l.startswith("build:")]
    if len(rows) < 2:
        return None
    header = [h.strip('"') for h in rows[0].split(",")]
    values = [v.strip('"') for v in rows[-1].split(",")]
    return float(dict(zip(header, values)).get("avg_ts", "nan"))


def reference_text():
    """CPython's reference-manual help text, every topic in sorted order."""
    from pydoc_data.topics import topics
    return "\n\n".join(topics[k] for k in sorted(topics))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--text", help="a long real text (plain UTF-8); default: pydoc_data.topics")
    ap.add_argument("--chars-per-token", type=float, default=4.4)
    ap.add_argument("--ctx", default="1024,8192,32768")
    ap.add_argument("--kv-type", default="f16")
    ap.add_argument("--binary", default=os.path.join(ROOT, "target", "release", "flatrun"))
    ap.add_argument("--llama-bench")
    ap.add_argument("--residencies", default="stream,resident")
    a = ap.parse_args()
    text = open(a.text, encoding="utf-8", errors="replace").read() if a.text else reference_text()
    rungs = [int(x) for x in a.ctx.split(",")]
    results = {}
    print(f"model {os.path.basename(a.model)}, kv {a.kv_type}")
    print("| context | residency | prompt tokens | peak RSS MiB | prefill tok/s | decode tok/s | llama.cpp decode tok/s |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for n in rungs:
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
            if len(text) < n * a.chars_per_token:
                sys.exit(f"the text is too short for {n} tokens")
            f.write(text[: int(n * a.chars_per_token)])
            prompt = f.name
        llama = run_llama(a.llama_bench, a.model, n, a.kv_type) if a.llama_bench else None
        for r in a.residencies.split(","):
            tokens, prefill, tps, peak = run_flatrun(a.binary, a.model, prompt, n, r, a.kv_type)
            results[(n, r)] = peak
            ll = f"{llama:.2f}" if llama else "-"
            print(f"| {n} | {r} | {tokens} | {peak:.1f} | {prefill:.1f} | {tps:.2f} | {ll} |", flush=True)
        os.unlink(prompt)
    for r in a.residencies.split(","):
        first, last = results[(rungs[0], r)], results[(rungs[-1], r)]
        growth = (last - first) / first
        verdict = "" if r != "stream" else ("  PASS (< 10%)" if growth < 0.10 else "  FAIL (>= 10%)")
        print(f"{r}: peak RSS {first:.1f} -> {last:.1f} MiB ({growth * 100:+.1f}%){verdict}")


if __name__ == "__main__":
    main()
