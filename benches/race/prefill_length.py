#!/usr/bin/env python3
"""Prefill tokens/s as a real prompt grows: Flatrun (resident and stream)
against llama.cpp at the same lengths, side by side in one run.

The prompt is the first N tokens (default 512, 2048, 8192) of a long real text
(default: crates/flatrun-runtime/tests/fixtures/long_context/python_reference.txt,
64 KB of CPython's reference-manual help text; no repeated filler). Each round
runs, for every length, `flatrun bench --prompt-file F -n 0 -r 1 --no-warmup`
once per residency and llama-server's `/completion` on the same text (its
`timings.prompt_per_second`; one slot, f16 cache, `cache_prompt` false, the
server's other settings its defaults, so flash attention as it chooses), rounds
interleaved. Prints the median and [min-max] of each, the ratio to llama.cpp's,
and each engine's fall with length (t/s at the longest ÷ t/s at the shortest).

    python benches/race/prefill_length.py \\
        --model ~/.cache/flatrun/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf \\
        --llama-server PATH/TO/llama-server [--rounds 3] [--lengths 512,2048,8192]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
from llama_server import LlamaServer  # noqa: E402

TEXT = os.path.join(ROOT, "crates/flatrun-runtime/tests/fixtures/long_context/python_reference.txt")


def flatrun_prefill(binary, model, prompt_file, residency, ctx):
    cmd = [binary, "bench", "-m", model, "--prompt-file", prompt_file, "-n", "0", "-r", "1",
           "--no-warmup", "--residency", residency, "--ctx", str(ctx), "--json", "-q"]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"flatrun failed ({' '.join(cmd)}):\n{out.stderr[-2000:]}")
    row = [r for r in json.loads(out.stdout) if r["test"].startswith("pp")][0]
    return row["tokens"], row["median_tok_s"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--llama-server", required=True)
    ap.add_argument("--text", default=TEXT)
    ap.add_argument("--lengths", default="512,2048,8192")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--residencies", default="resident,stream")
    ap.add_argument("--binary", default=os.path.join(ROOT, "target", "release", "flatrun"))
    ap.add_argument("--out", default=os.path.join(HERE, "results", "prefill-length-latest.json"))
    a = ap.parse_args()
    lengths = [int(x) for x in a.lengths.split(",")]
    residencies = a.residencies.split(",")
    ctx = max(lengths) + 512
    text = open(a.text, encoding="utf-8").read()
    samples = {}  # (engine, length) -> [t/s]
    tokens = {}
    with LlamaServer(a.llama_server, ["-m", a.model, "-c", str(ctx), "-np", "1", "-t", "2",
                                      "-ctk", "f16", "-ctv", "f16"], timeout=7200) as srv:
        # Each length's prompt: the text cut to its first N tokens (llama.cpp's
        # tokenizer; Flatrun's gives the same ids), written back as text.
        ids = srv.post("/tokenize", {"content": text, "add_special": False})["tokens"]
        if len(ids) < max(lengths):
            sys.exit(f"the text has {len(ids)} tokens, fewer than {max(lengths)}")
        prompts = {}
        for n in lengths:
            piece = srv.post("/detokenize", {"tokens": ids[:n]})["content"]
            f = tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False, encoding="utf-8")
            f.write(piece)
            f.close()
            prompts[n] = (f.name, piece)
        for r in range(a.rounds):
            for n in lengths:
                path, piece = prompts[n]
                for res in residencies:
                    t, tps = flatrun_prefill(a.binary, a.model, path, res, ctx)
                    tokens[("flatrun", n)] = t
                    samples.setdefault((f"flatrun {res}", n), []).append(tps)
                    print(f"round {r + 1}: {n} tokens, flatrun {res}: {tps:.1f} t/s ({t} tok)", flush=True)
                reply = srv.post("/completion", {"prompt": piece, "n_predict": 1, "cache_prompt": False,
                                                 "temperature": 0})
                tm = reply["timings"]
                tokens[("llama.cpp", n)] = tm["prompt_n"]
                samples.setdefault(("llama.cpp", n), []).append(tm["prompt_per_second"])
                print(f"round {r + 1}: {n} tokens, llama.cpp: {tm['prompt_per_second']:.1f} t/s "
                      f"({tm['prompt_n']} tok)", flush=True)
        server_cmd = srv.command_line()
    for path, _ in prompts.values():
        os.unlink(path)
    engines = [f"flatrun {r}" for r in residencies] + ["llama.cpp"]
    med = {k: statistics.median(v) for k, v in samples.items()}
    print(f"\nmodel {os.path.basename(a.model)}, 2 threads, {a.rounds} rounds; llama.cpp: {server_cmd}")
    print("| prompt tokens | " + " | ".join(f"{e} t/s" for e in engines) + " | "
          + " | ".join(f"{e} ÷ llama.cpp" for e in engines[:-1]) + " |")
    print("|---:|" + "---:|" * (2 * len(engines) - 1))
    for n in lengths:
        cells = [f"{med[(e, n)]:.1f} [{min(samples[(e, n)]):.1f}–{max(samples[(e, n)]):.1f}]" for e in engines]
        ratios = []
        for e in engines[:-1]:
            rs = [x / y for x, y in zip(samples[(e, n)], samples[("llama.cpp", n)])]
            ratios.append(f"**{statistics.median(rs):.2f}×** [{min(rs):.2f}–{max(rs):.2f}]")
        print(f"| {n} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
    first, last = lengths[0], lengths[-1]
    falls = {e: med[(e, last)] / med[(e, first)] for e in engines}
    print("fall with length (t/s at %d ÷ t/s at %d): " % (last, first)
          + ", ".join(f"{e} {f:.2f}" for e, f in falls.items()))
    report = {
        "model": os.path.basename(a.model),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "rounds": a.rounds,
        "llama_server_command": server_cmd,
        "tokens": {f"{e} {n}": t for (e, n), t in tokens.items()},
        "samples_tok_s": {f"{e} {n}": v for (e, n), v in samples.items()},
        "fall": falls,
    }
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
