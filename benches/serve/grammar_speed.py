#!/usr/bin/env python3
"""Decode speed with and without grammar-constrained sampling against a
running `flatrun serve` (e.g. on qwen2.5-coder-0.5b-instruct-q4_k_m.gguf).

For each mode it streams a chat answer, and measures the decode rate from
the first to the last token (so prefill does not count): tokens/s =
(completion tokens - 1) / (t_last - t_first). Modes alternate, RUNS times
each; it prints the medians, min/max and the ratio constrained /
unconstrained. From the server's /metrics it also prints what each grammar
mask cost: the mean time computing one (on a thread beside the layers) and
the mean time a step waited for it after the layers were done.

Usage: python benches/serve/grammar_speed.py BASE_URL MODEL [RUNS]
"""

import json
import statistics
import sys
import time
import urllib.request

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "skills": {"type": "array", "items": {"type": "string"}},
        "bio": {"type": "string"},
    },
    "required": ["name", "age", "skills", "bio"],
}
PROMPT = "Describe a fictional software engineer as JSON with name, age, skills and a long bio."


def run(base, model, constrained, max_tokens=96):
    body = {
        "model": model, "stream": True, "temperature": 0, "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": PROMPT}],
        "stream_options": {"include_usage": True},
    }
    if constrained:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "e", "schema": SCHEMA}}
    request = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
    times, tokens = [], 0
    with urllib.request.urlopen(request, timeout=600) as response:
        for line in response:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                times.append(time.perf_counter())
    if tokens < 2 or len(times) < 2:
        raise SystemExit(f"too few tokens ({tokens})")
    return (tokens - 1) / (times[-1] - times[0]), tokens


def metrics(base):
    """The grammar counters of /metrics."""
    values = {}
    with urllib.request.urlopen(base + "/metrics", timeout=60) as response:
        for line in response.read().decode().splitlines():
            if line.startswith("flatrun_grammar_"):
                name, value = line.split()
                values[name] = float(value)
    return values


def main():
    base, model = sys.argv[1].rstrip("/"), sys.argv[2]
    runs = int(sys.argv[3]) if len(sys.argv) > 3 else 5
    run(base, model, False, 8)  # warm up
    rates = {False: [], True: []}
    before = metrics(base)
    for _ in range(runs):
        for constrained in (False, True):
            rate, tokens = run(base, model, constrained)
            rates[constrained].append(rate)
            print(f"{'json_schema' if constrained else 'free':>11}: {rate:6.2f} tokens/s ({tokens} tokens)")
    free, constrained = statistics.median(rates[False]), statistics.median(rates[True])
    for name, values in (("free", rates[False]), ("json_schema", rates[True])):
        print(f"{name:>11}: median {statistics.median(values):.2f} tokens/s, min {min(values):.2f}, max {max(values):.2f}")
    print(f"ratio json_schema / free: {constrained / free:.3f}")
    after = metrics(base)
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    masks = delta.get("flatrun_grammar_masks_total", 0.0)
    if masks:
        compute = delta["flatrun_grammar_mask_seconds_total"] / masks * 1e3
        wait = delta["flatrun_grammar_wait_seconds_total"] / masks * 1e3
        print(f"grammar masks: {masks:.0f}, mean compute {compute:.3f} ms, mean wait after the layers {wait:.3f} ms")


if __name__ == "__main__":
    main()
