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
import socket
import subprocess
import sys
import time
import urllib.request

N_CTX = 256
N_PREDICT = 600
SYSTEM = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
USER = (
    "<|im_start|>user\nWrite the numbers from 1 to 400, one per line, "
    "nothing else.<|im_end|>\n<|im_start|>assistant\n"
)


def post(port, path, body):
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=1200) as r:
        return json.load(r)


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
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        args.server, "-m", args.model, "-c", str(N_CTX), "-np", "1",
        "--context-shift", "-t", "2", "--port", str(port), "--host", "127.0.0.1",
        "-ctk", "f16", "-ctv", "f16",
    ]
    print(" ".join(cmd), file=sys.stderr)
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open("/tmp/llama-server-shift.log", "w"))
    try:
        for _ in range(600):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except Exception:
                time.sleep(0.5)
        prompt = post(port, "/tokenize", {"content": SYSTEM + USER, "add_special": True})["tokens"]
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
        reply = post(port, "/completion", body)
    finally:
        server.terminate()
        server.wait()
    golden = {
        "model": os.path.basename(args.model),
        "made_by": "scripts/gen_context_shift_golden.py (see tests/data/README.md)",
        "llama_server_command": " ".join(os.path.basename(c) if c == args.server else c for c in cmd),
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
