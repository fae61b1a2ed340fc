#!/usr/bin/env python3
"""The MoE scale race: a Qwen3-30B-A3B-shaped Q4_K_M model (17.3 GiB,
scripts/gen_moe_scale.py) on a host that holds a fraction of it, Flatrun
against llama.cpp in one run, interleaved round by round (who goes first
alternates). Contests:

1. capped  - each runtime in a fresh memory cgroup (default 4 GiB; page cache
             is charged to it, so it behaves like a host with that much RAM),
             the model file's page cache dropped before each run. Decode
             tokens/s, the cgroup's peak and OOM kills, and the bytes each
             process read from storage per decoded token (/proc/PID/io
             read_bytes over the decode test alone: the tail of the run lasting
             tokens / (tokens/s)). llama.cpp: `llama-bench -lm mmap --repack 0`
             (repacked weights would be anonymous memory the cap cannot page
             out). Flatrun: `flatrun bench --residency cap=SIZE`, SIZE = the
             cgroup limit - its steady anonymous memory (a stream-mode bench's
             `anon_after_bytes`) - headroom. Both run one untimed token first
             (llama-bench: a `pp1` test, Flatrun: its prompt step) and then the
             timed decode `tgN`, without a warm-up pass.
   floor   - the disk's cold read bandwidth (O_DIRECT, measured before every
             Flatrun run: 4 MiB sequential reads, and reads of the expert
             slices of random (layer, expert) pairs, the shape of an expert
             cache miss), and the I/O floor: the active expert bytes per token
             not held by the expert cache ÷ the expert-read bandwidth, with the
             share of it Flatrun reaches. Held = the hit rate Flatrun reports,
             else the cache's share of all experts (the expected hit rate of
             uniformly spread routing).
2. sweep   - Flatrun alone under cgroup limits of 2, 4 and 8 GiB, per
             `--expert-policy` (lru, lfu) when the binary has the flag:
             tokens/s, hit rate, bytes read per token.
3. resident - no cgroup limit beyond a guard for the host, the file read
             into the page cache before every run: `flatrun bench
             --residency resident` against llama-bench's faster layout of
             the round (its default mmap with repacked weights, or
             `--repack 0`), decode tokens/s (target ≥ 1.0×).

Output: a table of Flatrun ÷ llama.cpp ratios and Flatrun-only figures with
median, min and max over the rounds (ratios paired per round), and a JSON
file with every sample in benches/race/results/ (moe-scale-STAMP.json and
moe-scale-latest.json). Uses race.py's helpers.

Example:
    LLAMA_CPP_BIN=~/llama.cpp/build/bin benches/race/moe_scale.py --rounds 3
    benches/race/moe_scale.py --layers 2 --rounds 1   # the 1.1 GiB variant: a quick check
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import race  # noqa: E402
from race import MIB, Cgroup, Samples, drop_page_cache, log, run_measured, summarize  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
GIB = 1024 * MIB


# --------------------------------------------------------------------------
# The model: its file (generated when missing) and the byte counts the floor needs.
# --------------------------------------------------------------------------


def model_facts(path: Path) -> dict:
    """Bytes of the experts, the dense weights and the expert slices of
    `path`, read from its GGUF header."""
    import gguf

    r = gguf.GGUFReader(str(path))
    arch = r.fields["general.architecture"].contents()
    k = int(r.fields[f"{arch}.expert_used_count"].contents())
    n_expert = int(r.fields[f"{arch}.expert_count"].contents())
    n_layer = int(r.fields[f"{arch}.block_count"].contents())
    experts = dense = embd = active = 0
    slices: dict[int, list[tuple[int, int]]] = {}  # layer -> (offset, bytes of one expert) per stack
    for t in r.tensors:
        nb = int(t.n_bytes)
        if "_exps." in t.name:
            experts += nb
            per = nb // n_expert
            active += per * k
            layer = int(t.name.split(".")[1])
            slices.setdefault(layer, []).append((int(t.data_offset), per))
        elif t.name == "token_embd.weight":
            embd += nb
        else:
            dense += nb
    return dict(file_bytes=path.stat().st_size, n_layer=n_layer, n_expert=n_expert, n_expert_used=k,
                expert_bytes=experts, dense_bytes=dense, token_embd_bytes=embd,
                active_expert_bytes_per_token=active, expert_slices=slices)


def expert_read_spans(facts: dict, total: int, seed: int) -> list[tuple[int, int]]:
    """(offset, length) of the gate/up/down slices of random (layer, expert)
    pairs, about `total` bytes: the reads an expert cache miss makes."""
    rng = random.Random(seed)
    spans: list[tuple[int, int]] = []
    got = 0
    layers = sorted(facts["expert_slices"])
    while got < total:
        layer = rng.choice(layers)
        e = rng.randrange(facts["n_expert"])
        for off, per in facts["expert_slices"][layer]:
            spans.append((off + e * per, per))
            got += per
    return spans


# --------------------------------------------------------------------------
# Runs.
# --------------------------------------------------------------------------


def flatrun_has(args, flag: str) -> bool:
    out = subprocess.run([args.flatrun, "bench", "--help"], capture_output=True, text=True)
    return flag in out.stdout


def flatrun_run(args, residency: str, n: int, cgroup=None, extra=None, p: int = 0):
    """`flatrun bench` -p p -n n, one repetition, no warm-up; returns (tg row
    or None, RunResult); raises RuntimeError when the process failed."""
    cmd = [args.flatrun, "bench", "-m", str(args.model), "--threads", str(args.threads), "-p", str(p),
           "-n", str(n), "-r", "1", "--residency", residency, "--json", "-q"] + (extra or []) + args.flatrun_args
    res = run_measured(cmd, cgroup, timeout=args.timeout)
    if res.returncode != 0:
        raise RuntimeError(f"flatrun bench failed ({res.returncode}; OOM kills in the cgroup: "
                           f"{res.cgroup_oom_kills}): {res.stderr[-1500:]}")
    rows = json.loads(res.stdout)
    tg = next((r for r in rows if r["test"] == f"tg{n}"), None)
    return tg, res


def llama_run(args, n: int, extra: list[str], cgroup=None, p: int = 1):
    """llama-bench -p p (a separate test, untimed for us) and -n n; returns
    (tg tokens/s, RunResult)."""
    cmd = [str(Path(args.llama_bin) / "llama-bench"), "-m", str(args.model), "-t", str(args.threads),
           "-p", str(p), "-n", str(n), "-r", "1", "-o", "json"] + extra
    res = run_measured(cmd, cgroup, timeout=args.timeout)
    if res.returncode != 0:
        raise RuntimeError(f"llama-bench failed ({res.returncode}; OOM kills in the cgroup: "
                           f"{res.cgroup_oom_kills}): {res.stderr[-1500:]}")
    rows = json.loads(res.stdout)
    tg = next(r for r in rows if r["n_gen"] == n and not r["n_prompt"])
    return tg["avg_ts"], res


def anon_overhead(args) -> int:
    """Flatrun's steady anonymous memory in stream mode (KV, buffers,
    tokenizer): what a cap must leave it beside the weights."""
    tg, res = flatrun_run(args, "stream", 2)
    return (tg or {}).get("anon_after_bytes") or res.peak_anon


def expert_fields(row: dict | None) -> dict:
    """The numbers of a bench row's `experts` object (hits, misses,
    hit_rate, bytes_read_per_token, used_bytes_per_token, cache_bytes,
    cache_budget_bytes), prefixed `expert_`; empty for a binary without it."""
    e = (row or {}).get("experts") or {}
    return {f"expert_{k}": v for k, v in e.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def hit_rate(fields: dict) -> float | None:
    h, m = fields.get("expert_hits"), fields.get("expert_misses")
    if h is not None and m is not None and h + m:
        return h / (h + m)
    return None


def policy_flags(policy: str) -> list[str]:
    return [] if policy == "default" else ["--expert-policy", policy]


def capped_flatrun(args, limit: int, anon: int, policy: str, tag: str, s: Samples, key: str,
                   facts: dict, measure_bw: bool) -> float | None:
    """One cold Flatrun decode under a cgroup of `limit`; records under `key`."""
    keep = max(0, limit - anon - args.headroom_mib * MIB)
    residency = f"cap={keep // MIB}M" if keep > 0 else "stream"
    bw_seq = bw_exp = None
    if measure_bw:
        drop_page_cache(args.model)
        bw_seq = race.disk_read_bandwidth(args.model, spans=[(facts["dense_bytes"] // 2, args.bw_bytes)])
        bw_exp = race.disk_read_bandwidth(args.model, block=4 * MIB,
                                          spans=expert_read_spans(facts, args.bw_bytes, sum(map(ord, tag))))
    drop_page_cache(args.model)
    cg = Cgroup(limit, f"flatrun-moe-{os.getpid()}-{tag}")
    try:
        tg, res = flatrun_run(args, residency, args.gen, cg, ["--no-warmup"] + policy_flags(policy))
    except RuntimeError as e:
        s.add(f"{key}.failures", 1)
        log(f"    flatrun  {limit / GIB:g} GiB ({residency}, {policy}): FAILED ({str(e)[:300]})")
        return None
    finally:
        cg.remove()
    tps = tg["median_tok_s"]
    decode_s = args.gen / tps
    per_token = res.read_bytes_last(decode_s) / args.gen
    s.add(f"{key}.tg", tps)
    s.add(f"{key}.read_mib_per_token", per_token / MIB)
    s.add(f"{key}.read_total_mib", res.read_bytes() / MIB)
    s.add(f"{key}.cgroup_peak_mib", (res.cgroup_peak or 0) / MIB)
    s.add(f"{key}.oom_kills", res.cgroup_oom_kills or 0)
    s.add(f"{key}.peak_anon_mib", res.peak_anon / MIB)
    fields = expert_fields(tg)
    for k, v in fields.items():
        s.add(f"{key}.{k}", v)
    hr = hit_rate(fields)
    s.add(f"{key}.hit_rate", hr)
    cache = fields.get("expert_cache_budget_bytes")
    if cache is None:
        # Not reported: what the cap leaves after the dense weights.
        cache = max(0, keep - facts["dense_bytes"])
    s.add(f"{key}.expert_cache_mib", cache / MIB)
    # Not held by the cache: the active experts' bytes times the miss rate
    # Flatrun counted (what it read beyond that, experts read ahead and not
    # chosen, is its own cost), else the active experts beyond the cache's
    # share of all experts.
    if hr is not None:
        missed = facts["active_expert_bytes_per_token"] * (1 - hr)
    else:
        missed = facts["active_expert_bytes_per_token"] * (1 - min(1.0, cache / facts["expert_bytes"]))
    s.add(f"{key}.uniform_hit_rate", min(1.0, cache / facts["expert_bytes"]))
    line = (f"    flatrun  {limit / GIB:g} GiB ({residency}, {policy}): tg{args.gen} {tps:6.3f} t/s, "
            f"read {per_token / MIB:7.1f} MiB/token, cgroup peak {(res.cgroup_peak or 0) / MIB:6.0f} MiB, "
            f"OOM kills {res.cgroup_oom_kills}")
    if hr is not None:
        line += (f", experts: hit rate {hr:.3f}, {fields.get('expert_bytes_read_per_token', 0) / MIB:.0f} MiB "
                 f"read/token, cache {fields.get('expert_cache_bytes', 0) / MIB:.0f} of {cache / MIB:.0f} MiB")
    if bw_exp:
        s.add(f"{key}.disk_seq_mb_s", bw_seq / 1e6 if bw_seq else None)
        s.add(f"{key}.disk_expert_mb_s", bw_exp / 1e6)
        floor = bw_exp / missed if missed > 0 else None
        s.add(f"{key}.missed_expert_mib_per_token", missed / MIB)
        if floor:
            s.add(f"{key}.io_floor_tg", floor)
            s.add(f"{key}.io_floor_share", tps / floor)
            line += (f"\n             [{missed / MIB:.0f} MiB/token of experts not held, disk {bw_exp / 1e6:.0f} MB/s "
                     f"(expert slices; {(bw_seq or 0) / 1e6:.0f} MB/s sequential): floor {floor:.3f} t/s, "
                     f"{100 * tps / floor:.0f}% of it]")
    log(line)
    return tps


def capped_llama(args, limit: int, tag: str, s: Samples, key: str) -> float | None:
    drop_page_cache(args.model)
    cg = Cgroup(limit, f"flatrun-moe-{os.getpid()}-{tag}")
    try:
        tps, res = llama_run(args, args.llama_gen, ["-lm", "mmap", "--repack", "0", "--no-warmup"], cg)
    except RuntimeError as e:
        s.add(f"{key}.failures", 1)
        log(f"    llama    {limit / GIB:g} GiB: FAILED ({str(e)[:300]})")
        return None
    finally:
        cg.remove()
    per_token = res.read_bytes_last(args.llama_gen / tps) / args.llama_gen
    s.add(f"{key}.tg", tps)
    s.add(f"{key}.read_mib_per_token", per_token / MIB)
    s.add(f"{key}.read_total_mib", res.read_bytes() / MIB)
    s.add(f"{key}.cgroup_peak_mib", (res.cgroup_peak or 0) / MIB)
    s.add(f"{key}.oom_kills", res.cgroup_oom_kills or 0)
    s.add(f"{key}.peak_anon_mib", res.peak_anon / MIB)
    log(f"    llama    {limit / GIB:g} GiB (mmap, no repack): tg{args.llama_gen} {tps:6.3f} t/s, "
        f"read {per_token / MIB:7.1f} MiB/token, cgroup peak {(res.cgroup_peak or 0) / MIB:6.0f} MiB, "
        f"OOM kills {res.cgroup_oom_kills}")
    return tps


def resident_round(args, s: Samples, flatrun_first: bool, guard: int, rnd: int) -> None:
    """Each runtime with the whole file in the page cache first (read again
    before every run: llama.cpp's repacked copy evicts it), so no run pays
    for cold reads. llama.cpp runs in both layouts, mmap with its repacked
    weights (its default) and without (`--repack 0`); its faster one is the
    one compared."""

    def flat():
        cg = Cgroup(guard, f"flatrun-moe-{os.getpid()}-res-f{rnd}")
        try:
            tg, res = flatrun_run(args, "resident", args.resident_gen, cg)
        finally:
            cg.remove()
        return tg["median_tok_s"], res

    def llama(extra: list[str], tag: str):
        def run():
            cg = Cgroup(guard, f"flatrun-moe-{os.getpid()}-res-{tag}{rnd}")
            try:
                return llama_run(args, args.resident_gen, extra, cg)
            finally:
                cg.remove()
        return run

    runs = [("flatrun", "flatrun", flat)]
    if "llama" not in args.skip:
        runs += [("llama", "llama.repack", llama([], "lr")), ("llama", "llama.norepack", llama(["--repack", "0"], "ln"))]
    if not flatrun_first:
        runs.reverse()
    best: float | None = None
    for who, key, fn in runs:
        secs = race.warm_page_cache(args.model)
        try:
            tps, res = fn()
        except RuntimeError as e:
            s.add(f"{key}.resident.failures", 1)
            log(f"    {key:14s} resident: FAILED ({str(e)[:300]})")
            continue
        if who == "llama":
            best = max(best or 0.0, tps)
        else:
            s.add("flatrun.resident.tg", tps)
        s.add(f"{key}.resident.layout_tg", tps)
        s.add(f"{key}.resident.peak_rss_mib", res.peak_rss / MIB)
        s.add(f"{key}.resident.peak_anon_mib", res.peak_anon / MIB)
        s.add(f"{key}.resident.cgroup_peak_mib", (res.cgroup_peak or 0) / MIB)
        log(f"    {key:14s} resident: tg{args.resident_gen} {tps:7.2f} t/s, peak RSS {res.peak_rss / MIB:7.0f} MiB "
            f"(anon {res.peak_anon / MIB:.0f}), cgroup peak {(res.cgroup_peak or 0) / MIB:.0f} MiB "
            f"[page cache warmed in {secs:.0f} s]")
    if best is not None:
        s.add("llama.resident.tg", best)


# --------------------------------------------------------------------------
# Summary.
# --------------------------------------------------------------------------


def paired(a: list[float] | None, b: list[float] | None) -> list[float]:
    return [x / y for x, y in zip(a or [], b or []) if y]


def rows_of(s: Samples, args, policies: list[str]) -> list[dict]:
    v = s.values
    rows = []

    def ratio(label, fk, lk, higher=True):
        r = paired(v.get(fk), v.get(lk))
        if r:
            rows.append({"metric": label, "higher_is_better": higher, "flatrun": summarize(v[fk]),
                         "llama_cpp": summarize(v[lk]), "ratio": summarize(r)})

    def alone(label, k, scale=1.0):
        if v.get(k):
            vals = [x * scale for x in v[k]]
            rows.append({"metric": label, "flatrun": summarize(vals), "llama_cpp": None, "ratio": None})

    cap = f"{args.cap_gib:g} GiB"
    ratio(f"capped {cap} decode t/s", "flatrun.capped.tg", "llama.capped.tg")
    ratio(f"capped {cap} MiB read per token", "flatrun.capped.read_mib_per_token",
          "llama.capped.read_mib_per_token", higher=False)
    ratio(f"capped {cap} cgroup peak MiB", "flatrun.capped.cgroup_peak_mib", "llama.capped.cgroup_peak_mib",
          higher=False)
    alone(f"capped {cap} Flatrun expert hit rate", "flatrun.capped.hit_rate")
    alone(f"capped {cap} I/O floor t/s", "flatrun.capped.io_floor_tg")
    alone(f"capped {cap} Flatrun share of the I/O floor", "flatrun.capped.io_floor_share")
    alone("disk MB/s, expert slices (O_DIRECT)", "flatrun.capped.disk_expert_mb_s")
    alone("disk MB/s, sequential 4 MiB (O_DIRECT)", "flatrun.capped.disk_seq_mb_s")
    for gib in args.sweep_gib:
        for pol in policies:
            key = f"flatrun.sweep.{gib:g}G.{pol}"
            alone(f"sweep {gib:g} GiB {pol}: decode t/s", f"{key}.tg")
            alone(f"sweep {gib:g} GiB {pol}: hit rate", f"{key}.hit_rate")
            alone(f"sweep {gib:g} GiB {pol}: MiB read per token", f"{key}.read_mib_per_token")
    ratio("resident decode t/s", "flatrun.resident.tg", "llama.resident.tg")
    ratio("resident decode t/s, llama.cpp repacked", "flatrun.resident.tg", "llama.repack.resident.layout_tg")
    ratio("resident decode t/s, llama.cpp --repack 0", "flatrun.resident.tg", "llama.norepack.resident.layout_tg")
    ratio("resident peak RSS MiB (llama.cpp repacked)", "flatrun.resident.peak_rss_mib",
          "llama.repack.resident.peak_rss_mib", higher=False)
    return rows


def print_table(rows: list[dict]) -> None:
    print("| metric | flatrun median [min–max] | llama.cpp median [min–max] | ratio median | ratio min | ratio max |")
    print("|---|---:|---:|---:|---:|---:|")

    def fmt(d):
        if not d:
            return "—"
        return f"{d['median']:.3g} [{d['min']:.3g}–{d['max']:.3g}] (n={d['n']})"

    for r in rows:
        q = r["ratio"]
        ratios = (f"{q['median']:.2f}× | {q['min']:.2f}× | {q['max']:.2f}×" if q else "— | — | —")
        print(f"| {r['metric']} | {fmt(r['flatrun'])} | {fmt(r['llama_cpp'])} | {ratios} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-bin", default=os.environ.get("LLAMA_CPP_BIN"),
                    help="llama.cpp build/bin directory with llama-bench (env LLAMA_CPP_BIN)")
    ap.add_argument("--flatrun", default=str(REPO / "target/release/flatrun"), help="flatrun binary")
    ap.add_argument("--flatrun-args", nargs="*", default=[],
                    help="more flags for every `flatrun bench` (e.g. --no-expert-prefetch)")
    ap.add_argument("--model", type=Path, help="the GGUF [default: scripts/gen_moe_scale.py's, written if missing]")
    ap.add_argument("--layers", type=int, default=48, help="layers of the generated model (2: the CI variant)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--cap-gib", type=float, default=4.0, help="cgroup limit of the capped race")
    ap.add_argument("--sweep-gib", type=float, nargs="*", default=[2.0, 4.0, 8.0],
                    help="cgroup limits of the Flatrun sweep")
    ap.add_argument("--gen", type=int, default=16, help="Flatrun decode tokens under a cap")
    ap.add_argument("--llama-gen", type=int, default=16, help="llama.cpp decode tokens under the cap")
    ap.add_argument("--resident-gen", type=int, default=32, help="decode tokens of the resident contest")
    ap.add_argument("--headroom-mib", type=int, default=64,
                    help="memory left free under the cap beyond Flatrun's steady anonymous memory")
    ap.add_argument("--bw-bytes", type=int, default=1024 * MIB, help="bytes read by each bandwidth measurement")
    ap.add_argument("--skip", nargs="*", default=[], choices=["capped", "llama", "sweep", "resident"])
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--out", default=str(REPO / "benches/race/results"))
    args = ap.parse_args()

    need_llama = "llama" not in args.skip and not {"capped", "resident"} <= set(args.skip)
    if need_llama and (not args.llama_bin or not (Path(args.llama_bin) / "llama-bench").exists()):
        ap.error("set LLAMA_CPP_BIN (or --llama-bin) to a llama.cpp build/bin with llama-bench, or --skip llama")
    if not Path(args.flatrun).exists():
        ap.error(f"{args.flatrun} not found: build it with `cargo build --release -p flatrun-cli`")
    if args.model is None:
        gen = subprocess.run([sys.executable, str(REPO / "scripts/gen_moe_scale.py"), "--layers", str(args.layers)],
                             stdout=subprocess.PIPE, text=True, check=True)
        args.model = Path(gen.stdout.strip().splitlines()[-1])
    facts = model_facts(args.model)
    log(f"== {args.model.name}: {facts['file_bytes'] / GIB:.2f} GiB, experts {facts['expert_bytes'] / GIB:.2f} GiB, "
        f"dense {facts['dense_bytes'] / MIB:.0f} MiB, active experts {facts['active_expert_bytes_per_token'] / MIB:.0f} "
        f"MiB/token ({facts['n_expert_used']} of {facts['n_expert']} per layer)")
    policies = ["lru", "lfu"] if flatrun_has(args, "--expert-policy") else ["default"]
    log(f"  flatrun: {args.flatrun} (expert policies: {', '.join(policies)})")

    s = Samples()
    anon = anon_overhead(args) if {"capped", "sweep"} - set(args.skip) else 0
    log(f"  flatrun steady anonymous memory (stream mode): {anon / MIB:.1f} MiB")
    mem_total = int(next(l for l in Path("/proc/meminfo").read_text().splitlines()
                         if l.startswith("MemTotal")).split()[1]) * 1024
    guard = mem_total - 2 * GIB  # resident runs: an OOM kills the run, not the host
    limit = int(args.cap_gib * GIB)
    for rnd in range(args.rounds):
        first = rnd % 2 == 0
        log(f"  round {rnd + 1}/{args.rounds}")
        if "capped" not in args.skip:
            runs = [lambda: capped_flatrun(args, limit, anon, policies[-1], f"cap-f{rnd}", s, "flatrun.capped",
                                           facts, True)]
            if "llama" not in args.skip:
                runs.append(lambda: capped_llama(args, limit, f"cap-l{rnd}", s, "llama.capped"))
            for fn in runs if first else runs[::-1]:
                fn()
        if "sweep" not in args.skip:
            for gib in args.sweep_gib:
                for pol in policies if first else policies[::-1]:
                    capped_flatrun(args, int(gib * GIB), anon, pol, f"sw{gib:g}-{pol}-{rnd}", s,
                                   f"flatrun.sweep.{gib:g}G.{pol}", facts, False)
        if "resident" not in args.skip:
            if "llama" in args.skip:
                log("    (resident: llama skipped)")
            resident_round(args, s, first, guard, rnd)

    rows = rows_of(s, args, policies)
    print_table(rows)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    report = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "model": args.model.name,
              "facts": {k: v for k, v in facts.items() if k != "expert_slices"}, "threads": args.threads,
              "rounds": args.rounds, "cap_gib": args.cap_gib, "sweep_gib": args.sweep_gib, "gen": args.gen,
              "llama_gen": args.llama_gen, "resident_gen": args.resident_gen, "headroom_mib": args.headroom_mib,
              "flatrun_stream_anon_bytes": anon, "policies": policies, "samples": s.values, "rows": rows}
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = out_dir / f"moe-scale-{stamp}.json"
    path.write_text(json.dumps(report, indent=2))
    shutil.copy(path, out_dir / "moe-scale-latest.json")
    log(f"json:  {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
