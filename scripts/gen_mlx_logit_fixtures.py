#!/usr/bin/env python3
"""Reference logits for the MLX parity test (crates/flatrun-runtime/tests/mlx_parity.rs).

An MLX checkpoint made by `gen_mlx_checkpoints.py` holds exactly the weights of
its source GGUF, so the reference runs llama.cpp on that GGUF:
  * smollm2-135m-mlx-q4 <- SmolLM2-135M-Instruct.Q4_1.gguf: the fidelity fixture
    `tests/fixtures/SmolLM2-135M-Instruct.Q4_1.logits.json` already holds its
    logits (same file, same prompts), so nothing is written for it;
  * gemma3-270m-mlx-q8 <- gemma-3-270m.Q8_0.gguf (the requantization written by
    gen_mlx_checkpoints.py): teacher-forced top-10 logits of the fidelity prompts,
    `oracle logits GGUF --prompt P --top 10` per prompt.

Usage (development only; needs the reference build):
  scripts/gen_mlx_logit_fixtures.py --oracle PATH/TO/oracle [--ckpt DIR]
Writes crates/flatrun-runtime/tests/fixtures/mlx/gemma-3-270m.Q8_0.logits.json.
"""
import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from gen_logit_fixtures import TEACHER_PROMPTS, chat, run  # noqa: E402

OUT = os.path.join(HERE, "..", "crates", "flatrun-runtime", "tests", "fixtures", "mlx")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--oracle", required=True)
    ap.add_argument("--ckpt", default=os.environ.get(
        "FLATRUN_MLX_CKPT", os.path.expanduser("~/.cache/flatrun/mlx-ckpt")))
    a = ap.parse_args()
    os.makedirs(OUT, exist_ok=True)
    name = "gemma-3-270m.Q8_0.gguf"
    path = os.path.join(a.ckpt, name)
    teacher = []
    for p in TEACHER_PROMPTS + [chat("gemma", "Explain in two sentences why the sky is blue.")]:
        r = run(a.oracle, "logits", path, "--prompt", p, "--top", "10")
        teacher.append({
            "prompt": p,
            "tokens": r["tokens"],
            "top_ids": [[i for i, _ in row] for row in r["top"]],
            "top_logits": [[round(v, 4) for _, v in row] for row in r["top"]],
        })
    fixture = {
        "model": name,
        "generator": "scripts/gen_mlx_logit_fixtures.py --oracle ORACLE "
                     "(oracle logits gemma-3-270m.Q8_0.gguf --prompt P --top 10)",
        "reference": "llama.cpp vendored in llama-cpp-python 0.3.36, CPU",
        "teacher_forced": teacher,
    }
    out = os.path.join(OUT, name[: -len(".gguf")] + ".logits.json")
    with open(out, "w") as f:
        json.dump(fixture, f, separators=(",", ":"))
    print(out, "positions:", sum(len(t["tokens"]) for t in teacher), file=sys.stderr)


if __name__ == "__main__":
    main()
