#!/usr/bin/env python3
"""Writes crates/flatrun-server/tests/data/context_shift_qwen25coder.json:
llama-server's greedy token ids for one prompt with a 256-token context and
`--context-shift`, generating well past the context (several shifts).

Usage:
  scripts/gen_context_shift_golden.py --server PATH/TO/llama-server \
      --model $FLATRUN_MODELS/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf

Starts llama-server on a free port (one slot, f16 cache, 2 threads), asks
/tokenize for the prompt's ids, posts them to /completion (greedy, n_keep =
the whole prompt, n_predict) and records the generated ids. Standard library only.
"""
import argparse
import json
import os
import sys

from llama_server import LlamaServer

N_CTX = 256
N_PREDICT = 600
SYSTEM = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
USER = (
    "<|im_start|>user\nWrite the numbers from 1 to 400, one per line, "
    "nothing else.<|im_end|>\n<|im_start|>assistant\n"
)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument(
        "--out",
        default=os.path.join(
            os.path.dirname(__file__),
            "../crates/flatrun-server/tests/data/context_shift_qwen25coder.json",
        ),
    )
    args = ap.parse_args()
    server_args = [
        "-m", args.model, "-c", str(N_CTX), "-np", "1",
        "--context-shift", "-t", "2", "-ctk", "f16", "-ctv", "f16",
    ]
    with LlamaServer(args.server, server_args) as srv:
        prompt = srv.post("/tokenize", {"content": SYSTEM + USER, "add_special": True})["tokens"]
        # The whole prompt stays (the instruction too), so the answer goes
        # on counting through every shift.
        body = {
            "prompt": prompt,
            "n_predict": N_PREDICT,
            "n_keep": len(prompt),
            "temperature": 0,
            "top_k": 1,
            "cache_prompt": False,
            "return_tokens": True,
            "stream": False,
        }
        reply = srv.post("/completion", body)
    golden = {
        "model": os.path.basename(args.model),
        "made_by": "scripts/gen_context_shift_golden.py (see tests/data/README.md)",
        "llama_server_command": srv.command_line(),
        "request": body | {"prompt": "prompt_tokens"},
        "n_ctx": N_CTX,
        "n_keep": len(prompt),
        "n_predict": N_PREDICT,
        "prompt": SYSTEM + USER,
        "prompt_tokens": prompt,
        "tokens": reply["tokens"],
        "text": reply["content"],
        "stop_type": reply.get("stop_type"),
        "truncated": reply.get("truncated"),
    }
    with open(args.out, "w") as f:
        json.dump(golden, f, indent=1)
        f.write("\n")
    print(f"{len(reply['tokens'])} tokens, truncated={reply.get('truncated')}", file=sys.stderr)


if __name__ == "__main__":
    main()
