#!/usr/bin/env python3
"""Speculative decoding, Flatrun against llama.cpp, in one run.

On Qwen2.5-Coder-1.5B (the target) with two prompts no test tunes to
(`prompts/code_edit.txt`: a 60-line function to give back with one variable
renamed; `prompts/chat.txt`: an open question), both wrapped in the model's
ChatML turn, greedy, 2 threads:

- capped:   the process in a memory cgroup of half the target file (plus the
            draft file's size when a draft is used), page cache dropped first.
            Flatrun plain (`--residency cap=...`), with `--lookup` on the
            code-edit prompt and with `--draft` Qwen2.5-Coder-0.5B on the chat
            prompt; llama.cpp's own `llama-lookup` and `llama-speculative` (mmap,
            no repacking, so its weights can be paged like the file) under the
            same cgroup with the same proposer and draft length.
- resident: no cap; Flatrun plain and with the draft on the chat prompt,
            `llama-speculative` with its defaults.

Rounds are interleaved; the table gives each ratio's median, min and max, and
the acceptance rates and tokens per pass. Uses race.py's cgroup and
measurement helpers.

Example:
    LLAMA_CPP_BIN=~/llama.cpp/build/bin benches/race/speculative.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from race import (  # noqa: E402
    MIB, REPO, Cgroup, drop_page_cache, log, paired_ratio, print_ratio_table, run_measured)

HERE = Path(__file__).resolve().parent
CHATML = ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
          "<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n")


def chat_prompt_file(name: str, tmp: Path) -> Path:
    text = (HERE / "prompts" / name).read_text()
    out = tmp / name
    out.write_text(CHATML.format(text.strip()))
    return out


def flatrun(args, model: Path, prompt: Path, n: int, residency: str, extra: list[str], cgroup=None):
    cmd = [args.flatrun, "bench", "-m", str(model), "--prompt-file", str(prompt), "-n", str(n),
           "-r", "1", "--threads", str(args.threads), "--residency", residency, "--ctx", "2048",
           "--json", "-q", "--no-warmup"] + extra
    res = run_measured(cmd, cgroup)
    if res.returncode != 0:
        raise RuntimeError(f"flatrun failed ({res.returncode}): {res.stderr[-1500:]}")
    row = next(r for r in json.loads(res.stdout) if r["test"].startswith("tg"))
    spec = row.get("speculative") or {}
    return {"tg": row["median_tok_s"], "accept": spec.get("acceptance_rate"),
            "per_pass": spec.get("tokens_per_pass")}, res


def llama(args, tool: str, model: Path, prompt: Path, n: int, extra: list[str], cgroup=None):
    cmd = [str(Path(args.llama_bin) / tool), "-m", str(model), "-f", str(prompt), "-n", str(n),
           "-t", str(args.threads), "-c", "2048", "--temp", "0", "--spec-draft-n-max", str(args.draft_max)] + extra
    res = run_measured(cmd, cgroup)
    text = res.stdout + res.stderr
    m = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", text)
    if res.returncode != 0 or not m:
        raise RuntimeError(f"{tool} failed ({res.returncode}): {text[-1500:]}")
    acc = re.search(r"accept\s*=\s*([\d.]+)%", text)
    return {"tg": int(m.group(1)) / float(m.group(2)),
            "accept": float(acc.group(1)) / 100 if acc else None, "per_pass": None}, res


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
    ap.add_argument("--capped-gen", type=int, default=64)
    ap.add_argument("--resident-gen", type=int, default=128)
    ap.add_argument("--skip", nargs="*", default=[], choices=["capped", "resident", "llama"])
    ap.add_argument("--out", default=str(HERE / "results"))
    args = ap.parse_args()
    if not args.llama_bin and "llama" not in args.skip:
        ap.error("--llama-bin (or LLAMA_CPP_BIN) is needed unless --skip llama")
    target, draft = Path(args.target), Path(args.draft)
    samples: dict[str, list[float]] = {}

    def add(key, value):
        if value is not None:
            samples.setdefault(key, []).append(value)

    with tempfile.TemporaryDirectory() as tmp:
        code = chat_prompt_file("code_edit.txt", Path(tmp))
        chat = chat_prompt_file("chat.txt", Path(tmp))
        half = target.stat().st_size // 2
        dmax = ["--draft-max", str(args.draft_max)]
        for rnd in range(args.rounds):
            log(f"round {rnd + 1}/{args.rounds}")
            runs = []
            if "capped" not in args.skip:
                limit_draft = half + draft.stat().st_size
                # Flatrun keeps what the cap allows and streams the rest; its own
                # anonymous memory (KV, buffers, the draft) is left out of the cap.
                cap = f"cap={max(1, (half - 160 * MIB) // MIB)}M"
                cap_d = f"cap={max(1, (half - 160 * MIB) // MIB)}M"
                n = args.capped_gen
                runs += [
                    ("capped.flatrun.plain.code", half, lambda cg: flatrun(args, target, code, n, cap, [], cg)),
                    ("capped.flatrun.lookup.code", half,
                     lambda cg: flatrun(args, target, code, n, cap, ["--lookup"] + dmax, cg)),
                    ("capped.flatrun.plain.chat", half, lambda cg: flatrun(args, target, chat, n, cap, [], cg)),
                    ("capped.flatrun.draft.chat", limit_draft,
                     lambda cg: flatrun(args, target, chat, n, cap_d, ["--draft", str(draft)] + dmax, cg)),
                ]
                if "llama" not in args.skip:
                    nomap = ["-nr"]  # no repacking: weights stay pageable file memory
                    runs += [
                        ("capped.llama.lookup.code", half,
                         lambda cg: llama(args, "llama-lookup", target, code, n, nomap, cg)),
                        ("capped.llama.draft.chat", limit_draft,
                         lambda cg: llama(args, "llama-speculative", target, chat, n,
                                          nomap + ["-md", str(draft)], cg)),
                    ]
            if "resident" not in args.skip:
                n = args.resident_gen
                runs += [
                    ("resident.flatrun.plain.chat", None,
                     lambda cg: flatrun(args, target, chat, n, "resident", [], cg)),
                    ("resident.flatrun.draft.chat", None,
                     lambda cg: flatrun(args, target, chat, n, "resident", ["--draft", str(draft)] + dmax, cg)),
                    ("resident.flatrun.lookup.code", None,
                     lambda cg: flatrun(args, target, code, n, "resident", ["--lookup"] + dmax, cg)),
                    ("resident.flatrun.plain.code", None,
                     lambda cg: flatrun(args, target, code, n, "resident", [], cg)),
                ]
                if "llama" not in args.skip:
                    runs += [
                        ("resident.llama.draft.chat", None,
                         lambda cg: llama(args, "llama-speculative", target, chat, n, ["-md", str(draft)], cg)),
                        ("resident.llama.lookup.code", None,
                         lambda cg: llama(args, "llama-lookup", target, code, n, [], cg)),
                    ]
            if rnd % 2:
                runs.reverse()
            for key, limit, fn in runs:
                cg = None
                try:
                    if limit:
                        drop_page_cache(target)
                        cg = Cgroup(limit, f"flatrun-spec-{os.getpid()}-{rnd}-{key}")
                    out, res = fn(cg)
                except RuntimeError as e:
                    add(key + ".failures", 1)
                    log(f"  {key:32s} FAILED: {str(e).splitlines()[-1][:200]}")
                    continue
                finally:
                    if cg:
                        cg.remove()
                add(key + ".tg", out["tg"])
                add(key + ".accept", out["accept"])
                add(key + ".per_pass", out["per_pass"])
                peak = (res.cgroup_peak or res.peak_rss) / MIB
                log(f"  {key:32s} {out['tg']:7.2f} t/s  accept {out['accept'] if out['accept'] is not None else '-'}"
                    f"  per pass {out['per_pass'] or '-'}  peak {peak:.0f} MiB")

    def ratio(a, b):
        return paired_ratio(samples.get(a + ".tg", []), samples.get(b + ".tg", []))

    table = {
        "capped lookup / own plain (code edit)": ratio("capped.flatrun.lookup.code", "capped.flatrun.plain.code"),
        "capped draft / own plain (chat)": ratio("capped.flatrun.draft.chat", "capped.flatrun.plain.chat"),
        "capped lookup / llama-lookup (code edit)": ratio("capped.flatrun.lookup.code", "capped.llama.lookup.code"),
        "capped draft / llama-speculative (chat)": ratio("capped.flatrun.draft.chat", "capped.llama.draft.chat"),
        "resident draft / own plain (chat)": ratio("resident.flatrun.draft.chat", "resident.flatrun.plain.chat"),
        "resident lookup / own plain (code edit)": ratio("resident.flatrun.lookup.code", "resident.flatrun.plain.code"),
        "resident draft / llama-speculative (chat)": ratio("resident.flatrun.draft.chat", "resident.llama.draft.chat"),
        "resident lookup / llama-lookup (code edit)": ratio("resident.flatrun.lookup.code", "resident.llama.lookup.code"),
    }
    print_ratio_table(table)
    print("\n| run | tok/s (median) | acceptance (median) | tokens per pass (median) |\n|---|---:|---:|---:|")
    for key in sorted({k.rsplit(".", 1)[0] for k in samples}):
        tg = samples.get(key + ".tg")
        if not tg:
            continue
        acc = samples.get(key + ".accept")
        pp = samples.get(key + ".per_pass")
        print(f"| {key} | {statistics.median(tg):.2f} | "
              f"{statistics.median(acc) if acc else float('nan'):.3f} | "
              f"{statistics.median(pp) if pp else float('nan'):.2f} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "speculative.json").write_text(json.dumps({"samples": samples, "ratios": table}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
