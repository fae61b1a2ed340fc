#!/usr/bin/env python3
"""How many models one `flatrun serve --max-resident SIZE` serves at once.

It makes COPIES distinct copies of MODEL (real copies, so that each has its
own page cache, as distinct models would) in a work directory, starts
`flatrun serve --models-dir DIR --max-resident SIZE` on them, and then:

1. concurrent: one streaming completion per model, all at once, each held
   open until every model has answered its first token, so every model is
   busy at the same time (none can be unloaded to make room): it reports
   how many models got each residency, the planned memory of each kind,
   the server's peak RSS (VmHWM), and decode tokens/s of a resident and a
   streamed model measured alone afterwards;
2. sequential: one short completion per model in turn, so each finds the
   others idle: it reports the loads and unloads (least recently used
   first) and the time a request took when its model had to be loaded.

Usage:
  python benches/serve/capacity.py FLATRUN_BIN MODEL --copies 48
      --max-resident 16G [--ctx 4096] [--workdir DIR] [--keep-copies]
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request


# A prompt whose greedy continuation goes on for a long time (a model that
# ended its answer would be idle, and could be unloaded to make room).
COUNTING = "Count from 1 to 1000: 1, 2, 3, 4, 5,"


def request(base, path, body=None, timeout=600):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        base + path, data=data, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def models(base):
    return request(base, "/v1/models")["data"]


def vm(pid, field):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def metric(base, name):
    text = urllib.request.urlopen(base + "/metrics", timeout=30).read().decode()
    total = 0
    for line in text.splitlines():
        if line.startswith(name):
            total += float(line.split()[-1])
    return total


def decode_rate(base, model, tokens=32):
    """Streamed decode tokens/s from the first to the last token."""
    body = {"model": model, "prompt": COUNTING, "max_tokens": tokens,
            "temperature": 0, "stream": True}
    req = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    stamps = []
    with urllib.request.urlopen(req, timeout=600) as r:
        for raw in r:
            line = raw.decode().strip()
            if line.startswith("data: {"):
                stamps.append(time.perf_counter())
    if len(stamps) < 3:
        return float("nan")
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def gib(n):
    return f"{n / 2**30:.2f} GiB"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("flatrun")
    ap.add_argument("model")
    ap.add_argument("--copies", type=int, default=16)
    ap.add_argument("--max-resident", default="4G")
    ap.add_argument("--ctx", default="4096")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--keep-copies", action="store_true")
    ap.add_argument("--port", default="18431")
    args = ap.parse_args()

    workdir = args.workdir or os.path.join(
        os.path.dirname(os.path.abspath(args.model)), "capacity-copies")
    os.makedirs(workdir, exist_ok=True)
    base_name = os.path.basename(args.model).removesuffix(".gguf")
    names = [f"{base_name}-{i:02d}" for i in range(args.copies)]
    for name in names:
        path = os.path.join(workdir, name + ".gguf")
        if not os.path.exists(path):
            shutil.copyfile(args.model, path)
    size = os.path.getsize(args.model)
    print(f"{args.copies} copies of {os.path.basename(args.model)} ({gib(size)} each) in {workdir}")

    server = subprocess.Popen(
        [args.flatrun, "serve", "--models-dir", workdir, "--max-resident", args.max_resident,
         "--ctx", args.ctx, "--port", args.port, "-q"],
        stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{args.port}"
    log = []
    threading.Thread(target=lambda: log.extend(server.stderr), daemon=True).start()
    try:
        deadline = time.time() + 300
        while True:
            try:
                if urllib.request.urlopen(base + "/health", timeout=5).status == 200:
                    break
            except Exception:
                pass
            if time.time() > deadline or server.poll() is not None:
                sys.exit("server did not come up:\n" + "".join(log))
            time.sleep(0.2)

        # 1. Every model busy at once.
        settled = threading.Condition()
        answering, errors = [], []
        release = threading.Event()

        def hold(name):
            body = {"model": name, "prompt": COUNTING, "max_tokens": 1500,
                    "temperature": 0, "stream": True}
            req = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=1800) as r:
                    for raw in r:
                        if raw.startswith(b"data: {"):
                            break
                    with settled:
                        answering.append(name)
                        settled.notify_all()
                    release.wait(timeout=1800)
            except urllib.error.HTTPError as e:
                with settled:
                    errors.append(f"{name}: {e.code} {e.read().decode()[:200]}")
                    settled.notify_all()
            except Exception as e:  # noqa: BLE001
                with settled:
                    errors.append(f"{name}: {e}")
                    settled.notify_all()

        started = time.perf_counter()
        threads = [threading.Thread(target=hold, args=(n,)) for n in names]
        for t in threads:
            t.start()
        with settled:
            settled.wait_for(lambda: len(answering) + len(errors) == len(names), timeout=1800)
        all_answering = time.perf_counter() - started
        listing = models(base)
        peak = vm(server.pid, "VmHWM")
        rss_busy = vm(server.pid, "VmRSS")
        release.set()
        for t in threads:
            t.join()
        if errors:
            print(f"{len(errors)} requests failed:", *errors[:5], sep="\n  ")
        kinds = {}
        for m in listing:
            s = m.get("status", {})
            if s.get("value") != "loaded":
                kinds.setdefault("unloaded", []).append(0)
                continue
            kind = s.get("residency", "?").split("=")[0]
            kinds.setdefault(kind, []).append(s.get("memory_bytes", 0))
        print(f"\nall {len(names)} busy at once ({len(answering)} answering after {all_answering:.1f} s):")
        for kind, sizes in sorted(kinds.items()):
            print(f"  {kind:9} {len(sizes):3} models, planned {gib(sum(sizes))} "
                  f"({gib(statistics.median(sizes)) if sizes else 0} each, median)")
        print(f"  server RSS {gib(rss_busy)}, peak {gib(peak)} (budget {args.max_resident})")
        resident = [m["id"] for m in listing if m.get("status", {}).get("residency") == "resident"]
        streamed = [m["id"] for m in listing if m.get("status", {}).get("residency", "").startswith(("stream", "cap"))]
        if resident:
            print(f"  decode alone, resident ({resident[0]}): {decode_rate(base, resident[0]):.1f} t/s")
        if streamed:
            s = next(m for m in listing if m["id"] == streamed[0])["status"]["residency"]
            print(f"  decode alone, {s} ({streamed[0]}): {decode_rate(base, streamed[0]):.1f} t/s")

        # 2. One at a time: the others idle, unloaded least recently used first.
        loads0 = metric(base, "flatrun_served_model_loads_total")
        unloads0 = metric(base, "flatrun_served_model_unloads_total")
        cold, warm = [], []
        for name in names:
            loaded = any(m["id"] == name and m.get("status", {}).get("value") == "loaded"
                         for m in models(base))
            t0 = time.perf_counter()
            request(base, "/v1/completions",
                    {"model": name, "prompt": "Hello", "max_tokens": 4, "temperature": 0})
            (warm if loaded else cold).append(time.perf_counter() - t0)
        loads = metric(base, "flatrun_served_model_loads_total") - loads0
        unloads = metric(base, "flatrun_served_model_unloads_total") - unloads0
        print(f"\none request per model in turn: {int(loads)} loads, {int(unloads)} unloads")
        for label, times in (("model loaded", warm), ("model loaded first", cold)):
            if times:
                print(f"  {label:20} {len(times):3} requests, median {statistics.median(times):.2f} s "
                      f"(min {min(times):.2f}, max {max(times):.2f})")
        print(f"  peak RSS {gib(vm(server.pid, 'VmHWM'))}")
    finally:
        server.terminate()
        server.wait(timeout=60)
        if not args.keep_copies and args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
