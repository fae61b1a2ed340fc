#!/usr/bin/env python3
"""Speculative decoding behind the HTTP server: `flatrun serve` against
`llama-server`, in one run.

Both servers serve Qwen2.5-Coder-1.5B-Instruct resident (2 threads, context
4096, greedy), without speculation, with prompt lookup (`flatrun serve
--lookup`, `llama-server --spec-type ngram-simple`) and with the
Qwen2.5-Coder-0.5B draft (`--draft` / `--model-draft`), each proposing up to
`--draft-max` tokens. Each server answers the two prompts of
`benches/race/speculative.py` (`prompts/code_edit.txt`, `prompts/chat.txt`)
through `/v1/chat/completions`, streamed, with the prompt cache off; the
decode speed is the completion tokens after the first over the time from the
first streamed token to the last. With `--concurrent 2` two clients send the
same prompt at once and the figure is their summed decode speed (the batch
scheduler steps both sequences, with their proposals, through each layer
once).

With `--cap`, each server runs inside a memory cgroup of half the target
file (plus the draft's size where one is used), the file's page cache
dropped first, as `speculative.py` caps `flatrun run`: Flatrun with
`--residency cap=` (the cgroup less 160 MiB of its own memory), llama-server
with mmap and no repacking (`-nr`), so its weights page like the file.

Servers are started in turn and rounds interleaved (the order reverses every
other round); the tables give each run's median and min/max over the rounds
and the ratios against the same server without speculation and against
llama-server with the same proposer.

Example:
    LLAMA_CPP_BIN=~/llama.cpp/build/bin benches/race/serve_speculative.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO / "scripts"))
from llama_server import LlamaServer  # noqa: E402

sys.path.insert(0, str(HERE))
from race import MIB, Cgroup, drop_page_cache, paired_ratio, print_ratio_table  # noqa: E402


def stream_decode(port: int, prompt: str, max_tokens: int, extra: dict) -> tuple[int, float]:
    """Completion tokens and decode seconds (first streamed token to the last)."""
    body = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "cache_prompt": False,
        **extra,
    }
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    first = last = None
    tokens = chunks = 0
    with urllib.request.urlopen(req, timeout=1800) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            if event.get("usage"):
                tokens = event["usage"].get("completion_tokens", tokens)
            if any((c.get("delta") or {}).get("content") for c in event.get("choices", [])):
                now = time.perf_counter()
                first = first or now
                last = now
                chunks += 1
    tokens = tokens or chunks
    if first is None or last is None or last <= first or tokens < 2:
        raise RuntimeError(f"no decode to time ({tokens} tokens)")
    return tokens, last - first


def measure(port: int, prompt: str, max_tokens: int, concurrent: int) -> float:
    """Summed decode tokens/s of `concurrent` clients sending `prompt` at once."""
    results: list = [None] * concurrent

    def client(i: int) -> None:
        try:
            results[i] = stream_decode(port, prompt, max_tokens, {})
        except Exception as e:  # reported below
            results[i] = e

    threads = [threading.Thread(target=client, args=(i,)) for i in range(concurrent)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in results:
        if isinstance(r, Exception):
            raise r
    return sum((n - 1) / s for n, s in results)


def serve_round(args, run, binary, sargs, names, prompts, cgroup) -> dict:
    """Start one server (inside `cgroup` when given) and time each prompt."""
    out: dict = {"tps": {}, "counters": {}}
    with LlamaServer(binary, sargs, preexec_fn=cgroup.enter if cgroup else None) as srv:
        # A short warm-up request (first-call costs).
        stream_decode(srv.port, "Hi", 4, {})
        before = spec_counters(srv.port)
        for name in names:
            tps = measure(srv.port, prompts[name], args.max_tokens, args.concurrent)
            out["tps"][name] = tps
            print(f"  {run:16s} {name:10s} {tps:7.2f} t/s", file=sys.stderr)
        after = spec_counters(srv.port)
        out["counters"] = {k: after[k] - before.get(k, 0) for k in after}
    return out


def spec_counters(port: int) -> dict[str, float]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
    except Exception:
        return {}
    out = {}
    for line in text.splitlines():
        if line.startswith("flatrun_speculative_"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    models = Path(os.environ.get("FLATRUN_MODELS", Path.home() / ".cache/flatrun/models"))
    ap.add_argument("--llama-bin", default=os.environ.get("LLAMA_CPP_BIN"))
    ap.add_argument("--flatrun", default=str(REPO / "target/release/flatrun"))
    ap.add_argument("--target", default=str(models / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"))
    ap.add_argument("--draft", default=str(models / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--draft-max", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--concurrent", type=int, default=1)
    ap.add_argument("--skip-llama", action="store_true")
    ap.add_argument("--cap", action="store_true", help="run each server in a cgroup of half the target file")
    ap.add_argument("--out", default=str(HERE / "results" / "serve-speculative-latest.json"))
    args = ap.parse_args()
    if not args.llama_bin and not args.skip_llama:
        ap.error("--llama-bin (or LLAMA_CPP_BIN) is needed unless --skip-llama")
    prompts = {name: (HERE / "prompts" / f"{name}.txt").read_text().strip() for name in ("code_edit", "chat")}
    dmax = str(args.draft_max)
    half = Path(args.target).stat().st_size // 2
    residency = f"cap={max(1, (half - 160 * MIB) // MIB)}M" if args.cap else "resident"
    common_f = ["-m", args.target, "--threads", str(args.threads), "--ctx", "4096",
                "--residency", residency, "-q"]
    common_l = ["-m", args.target, "-t", str(args.threads), "-c", "4096", "-np", str(args.concurrent)]
    if args.cap:
        common_l.append("-nr")
    # (run, binary, args, prompts it answers)
    servers = [
        ("flatrun.plain", args.flatrun, ["serve", *common_f], ["code_edit", "chat"]),
        ("flatrun.lookup", args.flatrun, ["serve", *common_f, "--lookup", "--draft-max", dmax], ["code_edit"]),
        ("flatrun.draft", args.flatrun, ["serve", *common_f, "--draft", args.draft, "--draft-max", dmax], ["chat"]),
    ]
    if not args.skip_llama:
        server = str(Path(args.llama_bin) / "llama-server")
        servers += [
            ("llama.plain", server, common_l, ["code_edit", "chat"]),
            ("llama.lookup", server, [*common_l, "--spec-type", "ngram-simple", "--spec-draft-n-max", dmax],
             ["code_edit"]),
            ("llama.draft", server, [*common_l, "-md", args.draft, "--spec-draft-n-max", dmax], ["chat"]),
        ]
    samples: dict[str, list[float]] = {}
    counters: dict[str, dict] = {}
    for rnd in range(args.rounds):
        print(f"round {rnd + 1}/{args.rounds}", file=sys.stderr)
        order = servers if rnd % 2 == 0 else list(reversed(servers))
        for run, binary, sargs, names in order:
            cgroup = None
            if args.cap:
                drop_page_cache(Path(args.target))
                limit = half + (Path(args.draft).stat().st_size if run.endswith(".draft") else 0)
                cgroup = Cgroup(limit, f"flatrun-serve-spec-{os.getpid()}-{rnd}-{run}")
            try:
                measured = serve_round(args, run, binary, sargs, names, prompts, cgroup)
            finally:
                if cgroup:
                    cgroup.remove()
            for name, tps in measured["tps"].items():
                samples.setdefault(f"{run}.{name}", []).append(tps)
            for k, v in measured["counters"].items():
                counters.setdefault(run, {}).setdefault(k, []).append(v)

    def ratio(a: str, b: str):
        return paired_ratio(samples.get(a, []), samples.get(b, []))

    print(f"\n{args.concurrent} client(s), decode tokens/s (summed)\n")
    print("| run | median | min | max |\n|---|---:|---:|---:|")
    for key, xs in sorted(samples.items()):
        print(f"| {key} | {statistics.median(xs):.2f} | {min(xs):.2f} | {max(xs):.2f} |")
    table = {
        "flatrun lookup / flatrun plain (code edit)": ratio("flatrun.lookup.code_edit", "flatrun.plain.code_edit"),
        "flatrun draft / flatrun plain (chat)": ratio("flatrun.draft.chat", "flatrun.plain.chat"),
        "flatrun lookup / llama-server lookup (code edit)": ratio("flatrun.lookup.code_edit", "llama.lookup.code_edit"),
        "flatrun draft / llama-server draft (chat)": ratio("flatrun.draft.chat", "llama.draft.chat"),
        "llama-server lookup / its plain (code edit)": ratio("llama.lookup.code_edit", "llama.plain.code_edit"),
        "llama-server draft / its plain (chat)": ratio("llama.draft.chat", "llama.plain.chat"),
        "flatrun plain / llama-server plain (chat)": ratio("flatrun.plain.chat", "llama.plain.chat"),
    }
    print_ratio_table(table)
    for run, c in counters.items():
        proposed = sum(c.get("flatrun_speculative_proposed_tokens_total", []))
        accepted = sum(c.get("flatrun_speculative_accepted_tokens_total", []))
        passes = sum(c.get("flatrun_speculative_passes_total", []))
        if passes:
            print(f"{run}: acceptance {accepted / proposed:.2f}, "
                  f"{(accepted + passes) / passes:.2f} tokens per verification pass")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"concurrent": args.concurrent, "cap": args.cap, "samples": samples, "ratios": table,
                               "counters": counters}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
