#!/usr/bin/env python3
"""Soak a running `flatrun serve` over loopback (Python standard library only).

CLIENTS concurrent clients each send up to REQUESTS streaming requests (or
until DURATION seconds have passed), mixing OpenAI chat, OpenAI completions
and Anthropic messages over a few prompts, all greedy. Per request, with a
fixed seed: DISCONNECT of them hang up mid-stream, MALFORMED send a broken or
oversized body. Checked, and the exit status is 1 if any fails:

- no 5xx answer, no transport error;
- every completed stream ends properly and its text equals the greedy
  reference for its prompt (asked alone, without streaming, before the load):
  nothing lost or duplicated;
- every malformed request gets a 4xx;
- after the load, `/metrics` shows no active sequence and no queue (each
  sequence owns its KV cache, so none is left behind), and the server
  answers a reference prompt identically;
- the server's RSS (from /proc/PID, sampled each second) is flat: the mean of
  the last quarter of the run is within 10% + 16 MiB of the first quarter's.

Prints one JSON summary (counts, p50/p99 latency, time to first token,
throughput, RSS) and writes it to --json-out when given.

    scripts/soak.py --url http://127.0.0.1:8080 --pid PID [--api-key KEY]
        [--clients 16] [--requests 200] [--duration 1800] [--max-tokens 16]
"""

import argparse
import http.client
import json
import random
import statistics
import sys
import threading
import time
import urllib.parse

PROMPTS = [
    "What is the capital of France?",
    "Name a primary colour.",
    "What is 2 + 2?",
    "Say hello.",
    "Give me a word that rhymes with cat.",
]
KINDS = ["openai_chat", "openai_completion", "anthropic"]


class Soak:
    def __init__(self, args):
        self.args = args
        url = urllib.parse.urlparse(args.url)
        self.host, self.port = url.hostname, url.port or 80
        self.lock = threading.Lock()
        self.counts = {
            "completed": 0,
            "mismatched": 0,
            "disconnected": 0,
            "malformed_4xx": 0,
            "malformed_other": 0,
            "server_errors": 0,
            "client_errors": 0,
            "transport_errors": 0,
            "unterminated": 0,
        }
        self.failures = []
        self.latencies = []
        self.first_token = []
        self.tokens = 0
        self.reference = {}
        self.rss = []

    # --- HTTP ----------------------------------------------------------
    def headers(self):
        h = {"Content-Type": "application/json"}
        if self.args.api_key:
            h["x-api-key"] = self.args.api_key
        return h

    def connect(self):
        return http.client.HTTPConnection(self.host, self.port, timeout=300)

    def body(self, kind, prompt, stream):
        n = self.args.max_tokens
        if kind == "openai_chat":
            return "/v1/chat/completions", {
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": n, "temperature": 0, "stream": stream,
                "stream_options": {"include_usage": True} if stream else None,
            }
        if kind == "openai_completion":
            return "/v1/completions", {
                "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": stream,
            }
        return "/v1/messages", {
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": n, "temperature": 0, "stream": stream,
        }

    def plain(self, kind, prompt):
        path, body = self.body(kind, prompt, False)
        body = {k: v for k, v in body.items() if v is not None}
        conn = self.connect()
        conn.request("POST", path, json.dumps(body), self.headers())
        response = conn.getresponse()
        data = json.loads(response.read())
        conn.close()
        if response.status != 200:
            raise RuntimeError(f"{kind} reference: {response.status} {data}")
        if kind == "openai_chat":
            return data["choices"][0]["message"]["content"]
        if kind == "openai_completion":
            return data["choices"][0]["text"]
        return "".join(b.get("text", "") for b in data["content"])

    def metric(self, name):
        conn = self.connect()
        conn.request("GET", "/metrics", headers=self.headers())
        text = conn.getresponse().read().decode()
        conn.close()
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == name:
                return float(value)
        raise RuntimeError(f"no metric {name}")

    # --- one streamed request --------------------------------------------
    def stream(self, kind, prompt, hang_up):
        """(outcome, text, tokens, latency, ttft); outcome in ok, disconnected,
        unterminated, status:N."""
        path, body = self.body(kind, prompt, True)
        body = {k: v for k, v in body.items() if v is not None}
        started = time.monotonic()
        conn = self.connect()
        conn.request("POST", path, json.dumps(body), self.headers())
        response = conn.getresponse()
        if response.status != 200:
            detail = response.read()[:300]
            conn.close()
            return f"status:{response.status}", detail.decode(errors="replace"), 0, 0, None
        text, tokens, ttft, done, pieces = [], 0, None, False, 0
        event = None
        while True:
            line = response.fp.readline()
            if not line:
                break
            line = line.decode().rstrip("\r\n")
            if line.startswith("event:"):
                event = line[6:].strip()
                continue
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if "error" in chunk and kind != "anthropic" or event == "error":
                conn.close()
                return "status:stream-error", data, 0, 0, None
            piece = None
            if kind == "openai_chat":
                choices = chunk.get("choices") or [{}]
                piece = choices[0].get("delta", {}).get("content")
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
            elif kind == "openai_completion":
                choices = chunk.get("choices") or [{}]
                piece = choices[0].get("text")
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
            else:
                if chunk.get("type") == "content_block_delta":
                    piece = chunk["delta"].get("text")
                elif chunk.get("type") == "message_delta":
                    tokens = chunk.get("usage", {}).get("output_tokens", tokens)
                elif chunk.get("type") == "message_stop":
                    done = True
                    break
            if piece:
                if ttft is None:
                    ttft = time.monotonic() - started
                text.append(piece)
                pieces += 1
                if hang_up and pieces >= 2:
                    conn.sock.close()
                    conn.close()
                    return "disconnected", "", 0, 0, None
        conn.close()
        latency = time.monotonic() - started
        return ("ok" if done else "unterminated"), "".join(text), tokens, latency, ttft

    def malformed(self, rng):
        path = rng.choice(["/v1/chat/completions", "/v1/completions", "/v1/messages"])
        choice = rng.randrange(5)
        if choice == 0:
            body = b'{"messages": [{"role": "user", "content": "unterminated'
        elif choice == 1:
            body = b'{"messages": "not a list", "max_tokens": "many"}'
        elif choice == 2:
            body = b"\xff\xfe not json at all"
        elif choice == 3:
            body = json.dumps({"messages": [], "prompt": 7, "max_tokens": -1}).encode()
        else:
            body = b'{"prompt": "' + b"x" * (self.args.max_body + 1024) + b'"}'
        conn = self.connect()
        try:
            conn.request("POST", path, body, self.headers())
            status = conn.getresponse().status
        except (ConnectionError, http.client.HTTPException):
            # The server may close an oversized upload before reading it all.
            status = 413 if choice == 4 else 0
        conn.close()
        return status

    # --- the run -----------------------------------------------------------
    def client(self, index, deadline):
        rng = random.Random(self.args.seed * 1000 + index)
        for i in range(self.args.requests):
            if time.monotonic() > deadline:
                return
            roll = rng.random()
            if roll < self.args.malformed:
                status = self.malformed(rng)
                with self.lock:
                    if 400 <= status < 500:
                        self.counts["malformed_4xx"] += 1
                    else:
                        self.counts["malformed_other"] += 1
                        self.failures.append(f"malformed request answered {status}")
                        if status >= 500:
                            self.counts["server_errors"] += 1
                continue
            hang_up = roll < self.args.malformed + self.args.disconnect
            kind = KINDS[(index + i) % len(KINDS)]
            prompt = PROMPTS[rng.randrange(len(PROMPTS))]
            try:
                outcome, text, tokens, latency, ttft = self.stream(kind, prompt, hang_up)
            except (OSError, http.client.HTTPException, ValueError) as e:
                with self.lock:
                    self.counts["transport_errors"] += 1
                    self.failures.append(f"{kind}: {e!r}")
                continue
            with self.lock:
                if outcome == "ok":
                    self.counts["completed"] += 1
                    self.latencies.append(latency)
                    if ttft is not None:
                        self.first_token.append(ttft)
                    self.tokens += tokens
                    if text != self.reference[(kind, prompt)]:
                        self.counts["mismatched"] += 1
                        self.failures.append(
                            f"{kind} {prompt!r}: {text!r} != {self.reference[(kind, prompt)]!r}")
                elif outcome == "disconnected":
                    self.counts["disconnected"] += 1
                elif outcome == "unterminated":
                    self.counts["unterminated"] += 1
                    self.failures.append(f"{kind}: stream ended without its last event")
                else:
                    code = outcome.split(":")[1]
                    key = "server_errors" if not code.isdigit() or int(code) >= 500 else "client_errors"
                    self.counts[key] += 1
                    self.failures.append(f"{kind}: {outcome}: {text}")

    def sample_rss(self, stop):
        while not stop.is_set():
            try:
                with open(f"/proc/{self.args.pid}/status") as f:
                    for line in f:
                        if line.startswith("VmRSS:"):
                            self.rss.append(int(line.split()[1]) * 1024)
            except OSError:
                pass
            stop.wait(1.0)

    def run(self):
        for kind in KINDS:
            for prompt in PROMPTS:
                self.reference[(kind, prompt)] = self.plain(kind, prompt)
        stop = threading.Event()
        sampler = threading.Thread(target=self.sample_rss, args=(stop,), daemon=True)
        if self.args.pid:
            sampler.start()
        started = time.monotonic()
        deadline = started + self.args.duration
        threads = [threading.Thread(target=self.client, args=(i, deadline))
                   for i in range(self.args.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.monotonic() - started
        stop.set()
        # Every hung-up client's sequence (and with it its KV cache) freed.
        freed_in = None
        settle = time.monotonic()
        while time.monotonic() - settle < 30:
            if self.metric("flatrun_active_sequences") == 0 and self.metric("flatrun_queue_depth") == 0:
                freed_in = time.monotonic() - settle
                break
            time.sleep(0.1)
        if freed_in is None:
            self.failures.append("sequences still active 30 s after the load")
        after = self.plain(KINDS[0], PROMPTS[0])
        if after != self.reference[(KINDS[0], PROMPTS[0])]:
            self.failures.append(f"answer after the load differs: {after!r}")
        return self.summary(elapsed, freed_in)

    def summary(self, elapsed, freed_in):
        def pct(values, p):
            if not values:
                return None
            values = sorted(values)
            return round(values[min(len(values) - 1, int(p / 100 * len(values)))], 4)

        quarter = max(1, len(self.rss) // 4)
        rss_first = statistics.mean(self.rss[:quarter]) if self.rss else None
        rss_last = statistics.mean(self.rss[-quarter:]) if self.rss else None
        if rss_first and rss_last > rss_first * 1.10 + 16 * 2**20:
            self.failures.append(f"RSS grew: {rss_first / 2**20:.1f} -> {rss_last / 2**20:.1f} MiB")
        if self.counts["completed"] == 0:
            self.failures.append("no request completed")
        total = sum(self.counts.values())
        return {
            "clients": self.args.clients,
            "requests_sent": total,
            "seconds": round(elapsed, 1),
            **self.counts,
            "latency_p50_s": pct(self.latencies, 50),
            "latency_p99_s": pct(self.latencies, 99),
            "first_token_p50_s": pct(self.first_token, 50),
            "first_token_p99_s": pct(self.first_token, 99),
            "completed_per_second": round(self.counts["completed"] / elapsed, 2),
            "generated_tokens_per_second": round(self.tokens / elapsed, 1),
            "rss_first_quarter_mib": round(rss_first / 2**20, 1) if rss_first else None,
            "rss_last_quarter_mib": round(rss_last / 2**20, 1) if rss_last else None,
            "rss_max_mib": round(max(self.rss) / 2**20, 1) if self.rss else None,
            "slots_freed_after_s": None if freed_in is None else round(freed_in, 2),
            "failures": self.failures[:20],
        }


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", required=True)
    p.add_argument("--pid", type=int, help="the server's pid, for RSS")
    p.add_argument("--api-key")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--requests", type=int, default=200, help="per client")
    p.add_argument("--duration", type=float, default=1800.0, help="seconds at most")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--max-body", type=int, default=4 << 20, help="the server's --max-body")
    p.add_argument("--disconnect", type=float, default=0.10)
    p.add_argument("--malformed", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json-out")
    args = p.parse_args()
    result = Soak(args).run()
    text = json.dumps(result, indent=2)
    print(text)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(text + "\n")
    sys.exit(1 if result["failures"] else 0)


if __name__ == "__main__":
    main()
