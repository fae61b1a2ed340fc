#!/usr/bin/env python3
"""How well llama.cpp agrees with itself when only its batch size changes.

The fidelity fixtures (`scripts/gen_logit_fixtures.py`) are llama.cpp's logits with the
whole prompt in one batch (n_batch = 512). Run the same llama.cpp on the same tokens with
n_batch = n_ubatch = B (1, 2, 4) and only the order of its f32 sums changes: the one-token
kernels sum in another order than the tiled ones, and attention runs another path. This
script measures the result against the fixtures, exactly as the runtime's fidelity test
measures Flatrun:
  * teacher-forced: arg-max agreement over all positions and over the decisive ones (top-2
    gap >= 0.25), and |llama.cpp(B) - fixture| over the fixture's top-10 logits;
  * greedy: each fixture prompt prefilled in batches of B, then decoded one token at a
    time; the step where the continuation first leaves the fixture's, with the fixture's
    top-2 gap there.
The fidelity test holds the reference backend (exact math, no imitated order) to this
floor: see `crates/flatrun-runtime/tests/fidelity.rs`.

Usage (not run by CI; needs llama-cpp-python 0.3.36 built for this CPU, the version the
fixtures were made with: `pip install llama-cpp-python==0.3.36`):
  scripts/gen_self_agreement.py [--models DIR] [--batches 1,2,4]
Writes crates/flatrun-runtime/tests/fixtures/llama_cpp_self_agreement.json.
"""
import argparse, json, os, sys

import numpy as np
from llama_cpp import Llama

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, "..", "crates", "flatrun-runtime", "tests", "fixtures")
MODELS = [
    "SmolLM2-135M-Instruct.Q4_1.gguf",
    "gemma-3-270m-q4_k_m.gguf",
    "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
]
DECISIVE_GAP = 0.25


def load(path, batch, ctx, all_logits):
    return Llama(model_path=path, n_ctx=ctx, n_batch=batch, n_ubatch=batch, n_threads=os.cpu_count(),
                 logits_all=all_logits, verbose=False, use_mmap=True)


def teacher_forced(path, fixture, batch):
    llm = load(path, batch, 4096, True)
    agree = total = decisive_agree = decisive = 0
    diffs = []
    for case in fixture["teacher_forced"]:
        tokens, top_ids, top_logits = case["tokens"], case["top_ids"], case["top_logits"]
        llm.reset()
        llm.eval(tokens)
        logits = np.asarray(llm.scores[: len(tokens)], dtype=np.float32)
        for p in range(len(tokens)):
            hit = int(logits[p].argmax()) == top_ids[p][0]
            total += 1
            agree += hit
            if top_logits[p][0] - top_logits[p][1] >= DECISIVE_GAP:
                decisive += 1
                decisive_agree += hit
            diffs += [abs(float(logits[p][i]) - v) for i, v in zip(top_ids[p], top_logits[p])]
    return {
        "argmax_agree": agree, "positions": total,
        "decisive_agree": decisive_agree, "decisive_positions": decisive,
        "top10_mean_abs_diff": round(float(np.mean(diffs)), 4),
        "top10_max_abs_diff": round(float(np.max(diffs)), 4),
    }


def greedy(path, fixture, batch):
    llm = load(path, batch, 512, False)
    out = []
    for case in fixture["greedy"]:
        want, gaps = case["tokens"], case["top2_gap"]
        got = []
        for t in llm.generate(case["prompt_tokens"], temp=0.0, top_k=1, reset=True):
            got.append(t)
            if len(got) == len(want):
                break
        step = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), None)
        out.append({"prompt": case["prompt"], "diverges_at": step,
                    "fixture_top2_gap": None if step is None else gaps[step]})
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=os.environ.get("FLATRUN_MODELS", os.path.expanduser("~/.cache/flatrun/models")))
    ap.add_argument("--batches", default="1,2,4")
    a = ap.parse_args()
    result = {
        "generator": f"scripts/gen_self_agreement.py --batches {a.batches}",
        "reference": "llama.cpp vendored in llama-cpp-python 0.3.36, CPU (the fixtures' build), "
                     f"{os.cpu_count()} threads; fixtures made with n_batch 512",
        "decisive_gap": DECISIVE_GAP,
        "models": {},
    }
    for name in MODELS:
        path = os.path.join(a.models, name)
        fixture = json.load(open(os.path.join(FIXTURES, name[: -len(".gguf")] + ".logits.json")))
        runs = []
        for batch in map(int, a.batches.split(",")):
            run = {"batch": batch, "teacher_forced": teacher_forced(path, fixture, batch),
                   "greedy": greedy(path, fixture, batch)}
            tf = run["teacher_forced"]
            print(f"{name} batch {batch}: arg-max {tf['argmax_agree']}/{tf['positions']}, decisive "
                  f"{tf['decisive_agree']}/{tf['decisive_positions']}, mean |d| {tf['top10_mean_abs_diff']}, "
                  f"greedy divergences {[(g['diverges_at'], g['fixture_top2_gap']) for g in run['greedy'] if g['diverges_at'] is not None]}",
                  file=sys.stderr)
            runs.append(run)
        result["models"][name] = runs
    with open(os.path.join(FIXTURES, "llama_cpp_self_agreement.json"), "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
