#!/usr/bin/env python3
"""Writes crates/flatrun-server/tests/data/logprobs_qwen05b.json: llama.cpp's
greedy continuation of a completion prompt on Qwen2.5-Coder-0.5B-Instruct
Q4_K_M and, for every generated token, its log-probability and the five
most likely tokens, from llama.cpp's teacher-forced logits (log-softmax of
the raw logits, as the OpenAI API reports logprobs).

Needs the reference oracle (llama.cpp); the committed JSON is what the
tests read, so the project itself never needs the oracle.

Usage: python scripts/gen_logprob_golden.py ORACLE MODEL.gguf
  e.g. python scripts/gen_logprob_golden.py /work/shared/oracle/oracle \
       ~/.cache/flatrun/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
"""

import json
import os
import subprocess
import sys
import tempfile

import numpy as np

PROMPT = "def fibonacci(n):"
N = 16
TOP = 5


def main():
    oracle, model = sys.argv[1], sys.argv[2]
    gen = json.loads(
        subprocess.check_output([oracle, "generate", model, "--prompt", PROMPT, "--n", str(N)]).decode().strip().splitlines()[-1]
    )
    ids = gen["prompt_tokens"] + gen["tokens"]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "logits.npy")
        subprocess.check_call(
            [oracle, "logits", model, "--tokens", ",".join(map(str, ids)), "--out", out],
            stdout=subprocess.DEVNULL,
        )
        logits = np.load(out).astype(np.float64)
    n_prompt = len(gen["prompt_tokens"])
    steps = []
    for i, token in enumerate(gen["tokens"]):
        row = logits[n_prompt + i - 1]
        m = row.max()
        lse = m + np.log(np.exp(row - m).sum())
        lp = row - lse
        top = np.argsort(-lp, kind="stable")[:TOP]
        steps.append({
            "token": token,
            "logprob": float(lp[token]),
            "top": [[int(t), float(lp[t])] for t in top],
        })
    golden = {
        "command": "python scripts/gen_logprob_golden.py ORACLE qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        "model": os.path.basename(model),
        "prompt": PROMPT,
        "prompt_tokens": gen["prompt_tokens"],
        "text": gen["text"],
        "steps": steps,
    }
    path = os.path.join(os.path.dirname(__file__), "..", "crates/flatrun-server/tests/data/logprobs_qwen05b.json")
    with open(path, "w") as f:
        json.dump(golden, f, indent=1)
        f.write("\n")
    print(f"wrote {path}: {len(steps)} tokens, text {gen['text']!r}")


if __name__ == "__main__":
    main()
