#!/usr/bin/env python3
"""Writes crates/flatrun-runtime/tests/fixtures/long_context/qwen25coder-16k.json:
llama-server's greedy answer to a question about a 16k-token document
(`tests/fixtures/long_context/python_reference.txt`: 72 KB of CPython
3.11's reference-manual help text, `pydoc_data.topics`), as a chat turn of
Qwen2.5-Coder-0.5B-Instruct, for `tests/long_context.rs`.

Usage:
  scripts/gen_long_context_golden.py --server PATH/TO/llama-server \
      --model $FLATRUN_MODELS/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf

Starts llama-server (one slot, context 17408, f16 cache, 2 threads), asks
/tokenize for the prompt's ids, posts them to /completion (greedy,
n_predict 32) and records the ids. Standard library only.
"""
import argparse
import json
import os
import sys

from llama_server import LlamaServer

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, "../crates/flatrun-runtime/tests/fixtures/long_context")
N_CTX = 17408
N_PREDICT = 32
QUESTION = (
    "Using only the reference text above: what does the `assert` statement do when "
    "`__debug__` is false, and which exception does a failing assertion raise? "
    "Answer in two sentences."
)


def prompt_text():
    with open(os.path.join(FIXTURES, "python_reference.txt"), encoding="utf-8") as f:
        document = f.read()
    return (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        f"<|im_start|>user\n{document}\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n"
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", default=os.path.join(FIXTURES, "qwen25coder-16k.json"))
    args = ap.parse_args()
    server_args = ["-m", args.model, "-c", str(N_CTX), "-np", "1", "-t", "2", "-ctk", "f16", "-ctv", "f16"]
    text = prompt_text()
    with LlamaServer(args.server, server_args, timeout=7200) as srv:
        prompt = srv.post("/tokenize", {"content": text, "add_special": True})["tokens"]
        body = {
            "prompt": prompt,
            "n_predict": N_PREDICT,
            "temperature": 0,
            "top_k": 1,
            "cache_prompt": False,
            "return_tokens": True,
            "stream": False,
        }
        reply = srv.post("/completion", body)
    golden = {
        "model": os.path.basename(args.model),
        "made_by": "scripts/gen_long_context_golden.py (see tests/fixtures/long_context/README.md)",
        "llama_server_command": srv.command_line(),
        "n_ctx": N_CTX,
        "question": QUESTION,
        "prompt_tokens": prompt,
        "tokens": reply["tokens"],
        "text": reply["content"],
        "timings": reply.get("timings"),
    }
    with open(args.out, "w") as f:
        json.dump(golden, f)
        f.write("\n")
    print(f"{len(prompt)} prompt tokens; {reply['content']!r}", file=sys.stderr)


if __name__ == "__main__":
    main()
