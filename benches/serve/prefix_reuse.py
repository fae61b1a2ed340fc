#!/usr/bin/env python3
"""Prompt prefix reuse on an agent-like trace: `flatrun serve` with its
prompt cache and with `--prompt-cache 0`, the same requests to each.

The trace is a conversation of TURNS requests: a system prompt with a tool
schema, then each request resends the whole history plus one new user turn
(as an agent loop does) and the streamed answer (greedy, MAX_TOKENS tokens)
is appended to the history. For each request it records the time to the
first streamed token (TTFT) and the usage's `cached_tokens`; for the whole
trace the wall time, the prompt tokens the server computed
(`flatrun_prompt_tokens_total`) and the bytes the server process read
(`/proc/PID/io`: `rchar`, all reads, and `read_bytes`, from the disk).

Usage:
  python benches/serve/prefix_reuse.py [--turns 20] [--max-tokens 24] FLATRUN_BIN MODEL
      [-- extra serve flags, e.g. --residency stream]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request

SYSTEM = (
    "You are a coding agent working in a repository. Think briefly, then answer in one or two "
    "sentences. You may call these tools: read_file(path), list_dir(path), run_tests(crate), "
    "grep(pattern, path). Tool schema: "
    + json.dumps({
        "read_file": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
        "list_dir": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
        "run_tests": {"type": "object", "properties": {"crate": {"type": "string"}}, "required": ["crate"]},
        "grep": {"type": "object", "properties": {"pattern": {"type": "string"}, "path": {"type": "string"}},
                 "required": ["pattern", "path"]},
    })
)
STEPS = [
    "List the crates of the workspace.", "Which crate holds the HTTP server?",
    "Find where the scheduler admits requests.", "What does prefill_chunk control?",
    "Run the tests of the server crate.", "Two tests failed with a timeout. Why might that be?",
    "Read the scheduler's step function.", "Where are stop strings handled?",
    "Explain how streaming detokenization works.", "Grep for 'context_length_exceeded'.",
    "What status code does an overflow get?", "Suggest a fix for the flaky test.",
    "Write the fix as a short diff.", "Run the tests again.", "All pass now. Summarize the change.",
    "What should the commit message say?", "Are there docs to update?", "Update the docs.",
    "Anything else left?", "Thanks, that is all.",
]


def post(base, path, body, stream=False):
    request = urllib.request.Request(base + path, data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
    return urllib.request.urlopen(request, timeout=1800)


def chat(base, messages, max_tokens):
    body = {"messages": messages, "stream": True, "temperature": 0, "max_tokens": max_tokens,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first, text, usage = None, [], None
    with post(base, "/v1/chat/completions", body) as response:
        for line in response:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                first = first or time.perf_counter()
                text.append(chunk["choices"][0]["delta"]["content"])
    return "".join(text), (first or time.perf_counter()) - start, usage


def metric(base, name):
    with urllib.request.urlopen(base + "/metrics", timeout=60) as response:
        for line in response.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    return 0.0


def proc_io(pid):
    with open(f"/proc/{pid}/io") as f:
        return {k: int(v) for k, v in (line.split(": ") for line in f)}


def start_server(binary, model, flags):
    command = [binary, "serve", "--model", model, "--port", "0", *flags]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in server.stdout:
        sys.stderr.write("  | " + line)
        if "listening on" in line.lower() or "http://" in line:
            base = "http://" + line.split("http://", 1)[1].split()[0].rstrip("/.,")
            break
    else:
        raise SystemExit("the server did not start")
    deadline = time.time() + 600
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(base + "/health", timeout=5) as r:
                if r.status == 200:
                    return server, base
        except Exception:
            time.sleep(0.5)
    raise SystemExit("the server did not load the model")


def trace(binary, model, flags, turns, max_tokens):
    server, base = start_server(binary, model, flags)
    try:
        messages = [{"role": "system", "content": SYSTEM}]
        io_before = proc_io(server.pid)
        started = time.perf_counter()
        rows = []
        for step in STEPS[:turns]:
            messages.append({"role": "user", "content": step})
            text, ttft, usage = chat(base, messages, max_tokens)
            messages.append({"role": "assistant", "content": text})
            cached = usage["prompt_tokens_details"]["cached_tokens"]
            rows.append((usage["prompt_tokens"], cached, ttft))
        wall = time.perf_counter() - started
        io_after = proc_io(server.pid)
        computed = metric(base, "flatrun_prompt_tokens_total")
        return {
            "rows": rows, "wall": wall, "computed": computed,
            "rchar": io_after["rchar"] - io_before["rchar"],
            "read_bytes": io_after["read_bytes"] - io_before["read_bytes"],
        }
    finally:
        server.terminate()
        server.wait(timeout=60)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("binary")
    parser.add_argument("model")
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("flags", nargs=argparse.REMAINDER,
                        help="after --: extra serve flags")
    args = parser.parse_args()
    args.flags = [f for f in args.flags if f != "--"]
    results = {}
    for name, flags in (("no reuse", ["--prompt-cache", "0"]), ("reuse", [])):
        print(f"== {name}", file=sys.stderr)
        results[name] = trace(args.binary, args.model, flags + args.flags, args.turns, args.max_tokens)
    print(f"{'turn':>4} {'prompt':>6} | {'cached':>6} {'TTFT s':>7} | {'cached':>6} {'TTFT s':>7}")
    print(f"{'':>4} {'':>6} | {'no reuse':>14} | {'reuse':>14}")
    for i, (a, b) in enumerate(zip(results["no reuse"]["rows"], results["reuse"]["rows"])):
        print(f"{i + 1:>4} {a[0]:>6} | {a[1]:>6} {a[2]:>7.2f} | {b[1]:>6} {b[2]:>7.2f}")
    for name, r in results.items():
        later = [row[2] for row in r["rows"][1:]]
        print(f"{name:>8}: wall {r['wall']:.1f} s, prompt tokens computed {r['computed']:.0f}, "
              f"TTFT turns 2+ median {statistics.median(later):.2f} s (min {min(later):.2f}, "
              f"max {max(later):.2f}), read {r['rchar'] / 2**20:.0f} MiB "
              f"({r['read_bytes'] / 2**20:.0f} MiB from disk)")
    a, b = results["no reuse"], results["reuse"]
    # From the second request on, the reused prefix covers the whole earlier
    # history but the previous answer (whose KV came from one-token steps and
    # is recomputed so that reuse stays exact): what is computed is that
    # answer, the new turn and the template's few tokens around them.
    for i in range(1, len(b["rows"])):
        prompt, cached, _ = b["rows"][i]
        earlier = b["rows"][i - 1][0]
        assert cached > 0, f"request {i + 1}: nothing reused"
        assert cached <= prompt and cached >= earlier - args.max_tokens - 8, (
            f"request {i + 1}: {cached} of {prompt} tokens reused, the previous prompt had {earlier}")
    print("reuse: every request from the second on reused its history's prefix")
    print(f"reuse / no reuse: wall {b['wall'] / a['wall']:.3f}, prompt tokens computed "
          f"{b['computed'] / a['computed']:.3f}, TTFT median "
          f"{statistics.median(r[2] for r in b['rows'][1:]) / statistics.median(r[2] for r in a['rows'][1:]):.3f}")


if __name__ == "__main__":
    main()
