#!/usr/bin/env python3
"""The race: Flatrun against llama.cpp, on the same machine, in one run.

Three contests per model, interleaved round by round so both runtimes share
the machine's noise:

1. resident  - prefill (ppN) and decode (tgN) tokens/s, every weight in RAM.
               llama.cpp: `llama-bench` with its defaults.
               Flatrun:   `flatrun bench --residency resident`.
2. capped    - the process inside a memory cgroup capped at a fraction of the
               model file (default 50%), the file's page cache dropped first.
               Decode tokens/s and time to first token (a cold prefill of a
               short prompt). llama.cpp: `-lm mmap --repack 0` (its repacked
               weights could not be paged out); Flatrun: `--residency cap=SIZE`
               with SIZE = cgroup limit - its own steady anonymous memory -
               headroom. Both start cold (`--no-warmup`). The disk's cold read
               bandwidth is measured just before Flatrun's run (O_DIRECT, 4 MiB
               reads of the model file), which gives the I/O floor: the bytes
               Flatrun re-reads per token / that bandwidth; the share of the
               floor reached is reported.
   serving   - (with capped) Flatrun decoding --serve-batch sequences together
               under the same cap, against one: each streamed layer is read once
               per step for the whole batch, so tokens/s should scale.
3. memory    - peak of each run: the cgroup's peak (capped runs) and the
               process's RSS split into anonymous and file-backed.

Output: a table of ratios (Flatrun / llama.cpp) with median, min and max over
the rounds, a JSON file with every sample, and a PNG chart when matplotlib is
available. Uses only the Python standard library otherwise.

Example:
    LLAMA_CPP_BIN=~/llama.cpp/build/bin benches/race/race.py \
        --models ~/.cache/flatrun/models --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MIB = 1024 * 1024


# --------------------------------------------------------------------------
# Process measurement: peak RSS (anon / file) by polling /proc/PID/status.
# --------------------------------------------------------------------------


@dataclass
class RunResult:
    stdout: str
    stderr: str
    returncode: int
    wall_s: float
    peak_rss: int = 0
    peak_anon: int = 0
    peak_file: int = 0
    cgroup_peak: int | None = None
    # (seconds since start, read_bytes of /proc/PID/io): what the process
    # made the kernel read from storage, sampled with the RSS.
    io: list[tuple[float, int]] = field(default_factory=list)
    cgroup_oom_kills: int | None = None

    def read_bytes(self) -> int:
        """Bytes the process read from storage over its whole run."""
        return self.io[-1][1] if self.io else 0

    def read_bytes_last(self, seconds: float) -> int:
        """Bytes read from storage in the last `seconds` of the run (a
        test's own reads, without the load phase before it)."""
        if not self.io:
            return 0
        t_end, b_end = self.io[-1]
        before = [b for t, b in self.io if t <= t_end - seconds]
        return b_end - (before[-1] if before else 0)


def _read_bytes(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/io") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def _status_kib(pid: int) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
                    out[key] = int(rest.split()[0]) * 1024
    except (FileNotFoundError, ProcessLookupError, ValueError):
        pass
    return out


def run_measured(cmd: list[str], cgroup: "Cgroup | None" = None, timeout: float = 1800) -> RunResult:
    """Run `cmd`, sampling its RSS every 10 ms; inside `cgroup` when given."""
    preexec = cgroup.enter if cgroup else None
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=preexec
    )
    peaks = {"rss": 0, "anon": 0, "file": 0}
    io: list[tuple[float, int]] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            s = _status_kib(proc.pid)
            if s:
                peaks["rss"] = max(peaks["rss"], s.get("VmHWM", 0), s.get("VmRSS", 0))
                peaks["anon"] = max(peaks["anon"], s.get("RssAnon", 0))
                peaks["file"] = max(peaks["file"], s.get("RssFile", 0))
            rb = _read_bytes(proc.pid)
            if rb is not None:
                io.append((time.perf_counter() - t0, rb))
            stop.wait(0.01)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    stop.set()
    sampler.join()
    res = RunResult(out, err, proc.returncode, time.perf_counter() - t0)
    res.peak_rss, res.peak_anon, res.peak_file = peaks["rss"], peaks["anon"], peaks["file"]
    res.io = io
    if cgroup:
        res.cgroup_peak = cgroup.peak()
        res.cgroup_oom_kills = cgroup.oom_kills()
    return res


# --------------------------------------------------------------------------
# Memory cgroups (v1 `memory.limit_in_bytes` or v2 `memory.max`), nested under
# this process's own group so no root-level privileges beyond that are needed.
# --------------------------------------------------------------------------


class Cgroup:
    def __init__(self, limit: int, name: str):
        self.limit = limit
        self.path, self.v2 = self._create(name)
        if self.v2:
            (self.path / "memory.max").write_text(str(limit))
            swap = self.path / "memory.swap.max"
            if swap.exists():
                swap.write_text("0")
        else:
            (self.path / "memory.limit_in_bytes").write_text(str(limit))

    @staticmethod
    def _create(name: str) -> tuple[Path, bool]:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            hid, ctrls, rel = line.split(":", 2)
            if "memory" in ctrls.split(","):
                base = Path("/sys/fs/cgroup/memory") / rel.lstrip("/")
                p = base / name
                p.mkdir(exist_ok=True)
                return p, False
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            hid, ctrls, rel = line.split(":", 2)
            if hid == "0":
                base = Path("/sys/fs/cgroup") / rel.lstrip("/")
                p = base / name
                p.mkdir(exist_ok=True)
                return p, True
        raise RuntimeError("no writable memory cgroup (v1 or v2) found")

    def enter(self) -> None:  # runs in the child between fork and exec
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def peak(self) -> int | None:
        f = self.path / ("memory.peak" if self.v2 else "memory.max_usage_in_bytes")
        try:
            return int(f.read_text().split()[0])
        except (OSError, ValueError):
            return None

    def oom_kills(self) -> int | None:
        """Processes the kernel's OOM killer killed in this group (v1
        `memory.oom_control`, v2 `memory.events`); None where not reported."""
        f = self.path / ("memory.events" if self.v2 else "memory.oom_control")
        try:
            for line in f.read_text().splitlines():
                key, _, val = line.partition(" ")
                if key == "oom_kill":
                    return int(val)
        except (OSError, ValueError):
            pass
        return None

    def remove(self) -> None:
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


def drop_page_cache(path: Path) -> None:
    """posix_fadvise(DONTNEED) over the whole file: the next read is cold."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def warm_page_cache(path: Path, chunk: int = 16 * MIB) -> float:
    """Read the whole file through the page cache (the state of a model that
    stays in memory between runs); returns the seconds it took."""
    t0 = time.monotonic()
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        while os.read(fd, chunk):
            pass
    finally:
        os.close(fd)
    return time.monotonic() - t0


# --------------------------------------------------------------------------
# The two runtimes.
# --------------------------------------------------------------------------


def llama_bench(args, model: Path, p: int, n: int, extra: list[str], cgroup=None, reps: int = 1):
    cmd = [str(Path(args.llama_bin) / "llama-bench"), "-m", str(model), "-t", str(args.threads),
           "-p", str(p), "-n", str(n), "-r", str(reps), "-o", "json"] + extra
    res = run_measured(cmd, cgroup)
    if res.returncode != 0:
        raise RuntimeError(f"llama-bench failed ({res.returncode}): {res.stderr[-2000:]}")
    rows = json.loads(res.stdout)
    out = {}
    for r in rows:
        key = f"pp{r['n_prompt']}" if r["n_prompt"] else f"tg{r['n_gen']}"
        out[key] = {"tok_s": r["avg_ts"], "seconds": r["avg_ns"] / 1e9}
    return out, res


def flatrun_bench(args, model: Path, p: int, n: int, residency: str, cgroup=None, reps: int = 1,
                  extra: list[str] | None = None):
    cmd = [args.flatrun, "bench", "-m", str(model), "--threads", str(args.threads),
           "-p", str(p), "-n", str(n), "-r", str(reps), "--residency", residency, "--json", "-q"]
    cmd += extra or []
    res = run_measured(cmd, cgroup)
    if res.returncode != 0:
        raise RuntimeError(f"flatrun bench failed ({res.returncode}): {res.stderr[-2000:]}")
    rows = json.loads(res.stdout)
    out = {}
    for r in rows:
        tps = r["median_tok_s"]
        out[r["test"]] = {"tok_s": tps, "seconds": r["tokens"] / tps if tps else float("inf"),
                          "streamed_bytes_per_token": r.get("streamed_bytes_per_token"),
                          "anon_after_bytes": r.get("anon_after_bytes"), "row": r}
    return out, res


def disk_read_bandwidth(path: Path, block: int = 4 * MIB, spans: list[tuple[int, int]] | None = None) -> float | None:
    """Cold read bandwidth of `path` in bytes/s: O_DIRECT reads of `block`
    bytes into an aligned buffer (the page cache is bypassed, like Flatrun's
    capped reader), sequentially over the whole file, or over `spans`
    ((offset, length) pairs, in their order) when given; None where O_DIRECT
    is unsupported."""
    import mmap

    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except (OSError, AttributeError):
        return None
    try:
        buf = mmap.mmap(-1, block)  # page-aligned
        size = os.fstat(fd).st_size // 4096 * 4096
        if spans is None:
            spans = [(0, size)]
        t0 = time.perf_counter()
        total = 0
        for start, length in spans:
            # O_DIRECT wants 4 KiB-aligned offsets and lengths.
            off = start // 4096 * 4096
            end = min(size, -(-(start + length) // 4096) * 4096)
            while off < end:
                want = min(block, end - off)
                n = os.preadv(fd, [memoryview(buf)[:want]], off)
                if n <= 0:
                    break
                off += n
                total += n
        return total / (time.perf_counter() - t0)
    except OSError:
        return None
    finally:
        os.close(fd)


# --------------------------------------------------------------------------
# Contests.
# --------------------------------------------------------------------------


@dataclass
class Samples:
    values: dict[str, list[float]] = field(default_factory=dict)

    def add(self, key: str, v: float | None) -> None:
        if v is not None:
            self.values.setdefault(key, []).append(v)


def resident_round(args, model: Path, s: Samples, flatrun_first: bool) -> None:
    runs = [("flatrun", lambda: flatrun_bench(args, model, args.prompt, args.gen, "resident")),
            ("llama", lambda: llama_bench(args, model, args.prompt, args.gen, []))]
    if not flatrun_first:
        runs.reverse()
    for who, fn in runs:
        out, res = fn()
        s.add(f"{who}.resident.pp", out[f"pp{args.prompt}"]["tok_s"])
        s.add(f"{who}.resident.tg", out[f"tg{args.gen}"]["tok_s"])
        s.add(f"{who}.resident.peak_rss_mib", res.peak_rss / MIB)
        s.add(f"{who}.resident.peak_anon_mib", res.peak_anon / MIB)
        s.add(f"{who}.resident.peak_file_mib", res.peak_file / MIB)
        log(f"    {who:8s} resident  pp{args.prompt} {out[f'pp{args.prompt}']['tok_s']:8.1f}  "
            f"tg{args.gen} {out[f'tg{args.gen}']['tok_s']:7.1f} t/s  peak RSS {res.peak_rss / MIB:7.1f} MiB "
            f"(anon {res.peak_anon / MIB:.1f})")


def flatrun_anon_overhead(args, model: Path, batch: int = 1) -> tuple[int, int]:
    """Flatrun's own anonymous memory in stream mode (KV, buffers, tokenizer,
    and with `batch` > 1 the logits of every sequence): (steady state after the
    test as the bench reports it, peak while loading)."""
    out, res = flatrun_bench(args, model, args.ttft_prompt if batch == 1 else 0, 4, "stream",
                             extra=["--batch", str(batch)] if batch > 1 else None)
    steady = max((v.get("anon_after_bytes") or 0) for v in out.values())
    return (steady or res.peak_anon), res.peak_anon


def capped_round(args, model: Path, s: Samples, flatrun_first: bool, anon: int, rnd: int,
                 anon_serve: int = 0) -> None:
    size = model.stat().st_size
    limit = int(size * args.cap_fraction)
    keep = max(0, limit - anon - args.headroom_mib * MIB)
    flat_res = f"cap={keep // MIB}M" if keep > 0 else "stream"
    # A batch holds more anonymous memory (each sequence's logits): its cap is
    # sized from its own measurement, so the kept weights still fit.
    keep_serve = max(0, limit - max(anon, anon_serve) - args.headroom_mib * MIB)
    serve_res = f"cap={keep_serve // MIB}M" if keep_serve > 0 else "stream"
    contestants = [
        ("flatrun", lambda p, n, cg: flatrun_bench(args, model, p, n, flat_res, cg,
                                                   extra=["--no-warmup"])),
        ("llama", lambda p, n, cg: llama_bench(args, model, p, n,
                                               ["-lm", "mmap", "--repack", "0", "--no-warmup"], cg)),
    ]
    if "llama" in args.skip:
        contestants = contestants[:1]  # Flatrun alone: its I/O floor and serving scaling
    if not flatrun_first:
        contestants.reverse()
    for who, fn in contestants:
        try:
            # Time to first token: a cold prefill of a short prompt.
            drop_page_cache(model)
            cg = Cgroup(limit, f"flatrun-race-{os.getpid()}-{who}-ttft-{rnd}")
            try:
                out, _ = fn(args.ttft_prompt, 0, cg)
            finally:
                cg.remove()
            ttft = out[f"pp{args.ttft_prompt}"]["seconds"]
            # Decode under the cap, starting cold (Flatrun: with the disk's
            # bandwidth measured right before, for the I/O floor).
            bw = disk_read_bandwidth(model) if who == "flatrun" else None
            drop_page_cache(model)
            cg = Cgroup(limit, f"flatrun-race-{os.getpid()}-{who}-tg-{rnd}")
            try:
                out, res = fn(0, args.capped_gen, cg)
            finally:
                cg.remove()
        except RuntimeError as e:
            # Exit -9 under a cgroup is the OOM killer: anonymous memory above the cap.
            s.add(f"{who}.capped.failures", 1)
            log(f"    {who:8s} capped {limit / MIB:6.0f} MiB: FAILED ({str(e).splitlines()[0][:200]})")
            continue
        tg = out[f"tg{args.capped_gen}"]["tok_s"]
        s.add(f"{who}.capped.tg", tg)
        s.add(f"{who}.capped.ttft_s", ttft)
        s.add(f"{who}.capped.cgroup_peak_mib", (res.cgroup_peak or 0) / MIB)
        s.add(f"{who}.capped.peak_rss_mib", res.peak_rss / MIB)
        s.add(f"{who}.capped.peak_anon_mib", res.peak_anon / MIB)
        s.add(f"{who}.capped.peak_file_mib", res.peak_file / MIB)
        extra = f" ({flat_res})" if who == "flatrun" else ""
        floor = ""
        streamed = out[f"tg{args.capped_gen}"].get("streamed_bytes_per_token")
        if who == "flatrun" and streamed and bw:
            # I/O floor: the tokens/s the disk allows for the bytes re-read per token.
            floor_tg = bw / streamed
            s.add("flatrun.capped.disk_mb_s", bw / 1e6)
            s.add("flatrun.capped.streamed_mib_per_token", streamed / MIB)
            s.add("flatrun.capped.io_floor_tg", floor_tg)
            s.add("flatrun.capped.io_floor_share", tg / floor_tg)
            floor = (f"  [{streamed / MIB:.0f} MiB/token re-read, disk {bw / 1e6:.0f} MB/s: "
                     f"floor {floor_tg:.2f} t/s, {100 * tg / floor_tg:.0f}% of it]")
        log(f"    {who:8s} capped {limit / MIB:6.0f} MiB{extra}: tg{args.capped_gen} {tg:6.2f} t/s  "
            f"TTFT {ttft:6.2f} s  cgroup peak {(res.cgroup_peak or 0) / MIB:6.1f} MiB{floor}")
        if who == "flatrun" and args.serve_batch > 1:
            # Capped serving: the same cap, `serve_batch` sequences stepped together.
            drop_page_cache(model)
            cg = Cgroup(limit, f"flatrun-race-{os.getpid()}-{who}-serve-{rnd}")
            try:
                sout, _ = flatrun_bench(args, model, 0, args.capped_gen, serve_res, cg,
                                        extra=["--no-warmup", "--batch", str(args.serve_batch)])
            except RuntimeError as e:
                s.add("flatrun.serving.failures", 1)
                log(f"    flatrun  serving x{args.serve_batch}: FAILED ({str(e).splitlines()[0][:200]})")
            else:
                btg = sout[f"tg{args.capped_gen}"]["tok_s"]
                s.add("flatrun.serving.batch_tg", btg)
                s.add("flatrun.serving.scaling", btg / tg)
                log(f"    flatrun  serving x{args.serve_batch} {limit / MIB:6.0f} MiB ({serve_res}): {btg:6.2f} t/s "
                    f"= {btg / tg:.2f}x one sequence")
            finally:
                cg.remove()


def summarize(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def paired_ratio(xs: list[float], ys: list[float]) -> dict | None:
    """Round by round x / y, summarized (None when no round has both)."""
    ratios = [x / y for x, y in zip(xs, ys) if y]
    return summarize(ratios) if ratios else None


def print_ratio_table(table: dict[str, dict | None]) -> None:
    """Markdown rows of named `paired_ratio` summaries (the missing ones left out)."""
    print("\n| ratio | median | min | max | rounds |\n|---|---:|---:|---:|---:|")
    for name, r in table.items():
        if r:
            print(f"| {name} | {r['median']:.2f} | {r['min']:.2f} | {r['max']:.2f} | {r['n']} |")


def ratio_rows(model: str, s: Samples) -> list[dict]:
    rows = []
    metrics = [("resident.pp", "resident prefill t/s", True), ("resident.tg", "resident decode t/s", True),
               ("capped.tg", "capped decode t/s", True), ("capped.ttft_s", "capped TTFT s", False),
               ("resident.peak_rss_mib", "resident peak RSS MiB", False),
               ("capped.cgroup_peak_mib", "capped cgroup peak MiB", False)]
    for key, label, higher_better in metrics:
        f, l = s.values.get(f"flatrun.{key}"), s.values.get(f"llama.{key}")
        if not f or not l:
            continue
        # Pair the rounds: ratio per round, then median/min/max of the ratios.
        ratio = paired_ratio(f, l)
        if ratio is None:
            continue
        rows.append({"model": model, "metric": label, "higher_is_better": higher_better,
                     "flatrun": summarize(f), "llama_cpp": summarize(l), "ratio": ratio})
    return rows


def print_table(rows: list[dict]) -> None:
    print("| model | metric | flatrun (median) | llama.cpp (median) | ratio median | ratio min | ratio max |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        llama = f"{r['llama_cpp']['median']:.2f}" if r["llama_cpp"] else "—"
        print(f"| {r['model']} | {r['metric']} | {r['flatrun']['median']:.2f} | {llama} | "
              f"{r['ratio']['median']:.2f}× | {r['ratio']['min']:.2f}× | {r['ratio']['max']:.2f}× |")


def draw_chart(rows: list[dict], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib not installed: no chart (pip install matplotlib)")
        return False
    speed = [r for r in rows if r["metric"].endswith("t/s") and r["llama_cpp"]]
    if not speed:
        return False
    labels = [f"{r['model']}\n{r['metric'].replace(' t/s', '')}" for r in speed]
    med = [r["ratio"]["median"] for r in speed]
    lo = [r["ratio"]["median"] - r["ratio"]["min"] for r in speed]
    hi = [r["ratio"]["max"] - r["ratio"]["median"] for r in speed]
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(speed)), 4.5))
    colors = ["#2b7bba" if m >= 1 else "#d95f02" for m in med]
    ax.bar(range(len(speed)), med, yerr=[lo, hi], color=colors, capsize=4)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(speed)), labels, fontsize=7, rotation=30, ha="right")
    ax.set_ylabel("Flatrun / llama.cpp (tokens/s)")
    ax.set_title("The race: speed ratio, median with min-max over rounds")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def find_models(paths: list[str]) -> list[Path]:
    out = []
    for p in map(Path, paths):
        out += sorted(p.glob("*.gguf")) if p.is_dir() else [p]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-bin", default=os.environ.get("LLAMA_CPP_BIN"),
                    help="llama.cpp build/bin directory with llama-bench (env LLAMA_CPP_BIN)")
    ap.add_argument("--flatrun", default=str(REPO / "target/release/flatrun"), help="flatrun binary")
    ap.add_argument("--models", nargs="+",
                    default=[os.environ.get("FLATRUN_MODELS", str(Path.home() / ".cache/flatrun/models"))],
                    help="GGUF files or directories of them")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--prompt", type=int, default=128, help="prefill tokens (ppN)")
    ap.add_argument("--gen", type=int, default=64, help="decode tokens (tgN)")
    ap.add_argument("--capped-gen", type=int, default=16, help="decode tokens under the cap")
    ap.add_argument("--ttft-prompt", type=int, default=16, help="prompt tokens of the cold TTFT test")
    ap.add_argument("--cap-fraction", type=float, default=0.5, help="cgroup limit as a fraction of the file")
    ap.add_argument("--headroom-mib", type=int, default=8,
                    help="memory left free under the cap beyond Flatrun's own steady anonymous memory")
    ap.add_argument("--serve-batch", type=int, default=8,
                    help="capped serving: sequences decoded together (1 = skip)")
    ap.add_argument("--skip", nargs="*", default=[], choices=["resident", "capped", "llama"],
                    help="contests to skip; `llama` runs Flatrun alone in the capped contest")
    ap.add_argument("--out", default=str(REPO / "benches/race/results"), help="directory for JSON and PNG")
    args = ap.parse_args()

    if not args.llama_bin or not (Path(args.llama_bin) / "llama-bench").exists():
        ap.error("set LLAMA_CPP_BIN (or --llama-bin) to a llama.cpp build/bin directory with llama-bench")
    if not Path(args.flatrun).exists():
        ap.error(f"{args.flatrun} not found: build it with `cargo build --release -p flatrun-cli`")
    models = find_models(args.models)
    if not models:
        ap.error("no models found")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    report = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "threads": args.threads,
              "prompt": args.prompt, "gen": args.gen, "capped_gen": args.capped_gen,
              "cap_fraction": args.cap_fraction, "rounds": args.rounds, "models": {}}
    all_rows = []
    for model in models:
        log(f"== {model.name} ({model.stat().st_size / MIB:.1f} MiB)")
        s = Samples()
        anon, anon_peak = flatrun_anon_overhead(args, model) if "capped" not in args.skip else (0, 0)
        anon_serve = 0
        if anon:
            log(f"  flatrun anonymous memory: {anon / MIB:.1f} MiB steady, {anon_peak / MIB:.1f} MiB peak (loading)")
            if args.serve_batch > 1:
                anon_serve, _ = flatrun_anon_overhead(args, model, args.serve_batch)
                log(f"  flatrun anonymous memory with {args.serve_batch} sequences: {anon_serve / MIB:.1f} MiB steady")
        for rnd in range(args.rounds):
            first = rnd % 2 == 0  # alternate who goes first
            log(f"  round {rnd + 1}/{args.rounds}")
            if "resident" not in args.skip:
                resident_round(args, model, s, first)
            if "capped" not in args.skip:
                capped_round(args, model, s, first, anon, rnd, anon_serve)
        rows = ratio_rows(model.name, s)
        for key, label in (("capped.io_floor_share", "capped share of the I/O floor"),
                           ("serving.scaling", f"capped serving x{args.serve_batch} / x1")):
            v = s.values.get(f"flatrun.{key}")
            if v:
                rows.append({"model": model.name, "metric": label, "higher_is_better": True,
                             "flatrun": summarize(v), "llama_cpp": None, "ratio": summarize(v)})
        all_rows += rows
        report["models"][model.name] = {"file_bytes": model.stat().st_size, "flatrun_stream_anon_bytes": anon,
                                        "flatrun_serve_anon_bytes": anon_serve,
                                        "flatrun_stream_anon_peak_bytes": anon_peak,
                                        "samples": s.values, "ratios": rows}
    print_table(all_rows)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    (out_dir / f"race-{stamp}.json").write_text(json.dumps(report, indent=2))
    shutil.copy(out_dir / f"race-{stamp}.json", out_dir / "latest.json")
    if draw_chart(all_rows, out_dir / "latest.png"):
        log(f"chart: {out_dir / 'latest.png'}")
    log(f"json:  {out_dir / f'race-{stamp}.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
