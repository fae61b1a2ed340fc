#!/usr/bin/env python3
"""Make the runtime's fidelity fixtures from a reference llama.cpp build.

For each model it records, with the reference "oracle" CLI (a thin wrapper over
llama-cpp-python; see the runtime's docs):
  * teacher-forced logits of several prompts: the top-10 ids and values at every
    position (`oracle logits MODEL --prompt P --top 10`);
  * greedy 64-token continuations of five prompts (`oracle generate MODEL --prompt P --n 64`)
    and, per generated step, the reference's top-2 logit gap (from
    `oracle logits MODEL --tokens PROMPT+CONTINUATION --top 2`).

Usage (not run by CI; needs the reference build):
  scripts/gen_logit_fixtures.py --oracle PATH/TO/oracle [--models DIR] [--only NAME]
Writes crates/flatrun-runtime/tests/fixtures/<model>.logits.json.

With `--ctk TYPE --ctv TYPE` (llama.cpp's KV cache types, e.g. q8_0 or q4_0; a
quantized cache runs with flash attention there) every oracle call gets them, and
the fixture is <model>.kv-<ctk>-<ctv>.logits.json (the quantized-cache fidelity tests).
"""
import argparse, json, os, subprocess, sys

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "crates", "flatrun-runtime", "tests", "fixtures")

MODELS = {
    "SmolLM2-135M-Instruct.Q4_1.gguf": "chatml",
    "gemma-3-270m-q4_k_m.gguf": "gemma",
    "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf": "chatml",
}

TEACHER_PROMPTS = [
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based ink and a wooden press adapted from wine making. "
    "Within fifty years, presses had spread to more than two hundred cities across Europe.",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    a, b = 0, 1\n"
    "    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n\nif __name__ == \"__main__\":\n"
    "    print([fibonacci(i) for i in range(10)])\n",
    "Photosynthesis converts light energy into chemical energy. In the light-dependent reactions, "
    "water is split and oxygen is released; in the Calvin cycle, carbon dioxide is fixed into sugars.",
    "Q: A train leaves at 3:15 pm and travels 240 km at 80 km/h. When does it arrive?\n"
    "A: It travels for 240 / 80 = 3 hours, so it arrives at 6:15 pm.\n"
    "Q: If a shirt costs $25 after a 20% discount, what was the original price?\nA:",
    "Les montagnes du Jura s'étendent entre la France et la Suisse. 日本の首都は東京です。 "
    "Emoji test: 🚀✨ and numbers 3.14159, 2,718, 1e-9.",
]

GREEDY_PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def is_prime(n):",
    "The three primary colors are",
    "Water boils at",
]


def chat(kind, user):
    if kind == "gemma":
        return f"<start_of_turn>user\n{user}<end_of_turn>\n<start_of_turn>model\n"
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


def run(oracle, *args):
    cmd = [oracle, *args]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--oracle", required=True, help="path of the reference oracle CLI")
    ap.add_argument("--models", default=os.environ.get("FLATRUN_MODELS", os.path.expanduser("~/.cache/flatrun/models")))
    ap.add_argument("--only")
    ap.add_argument("--no-greedy", action="store_true", help="teacher-forced logits only")
    ap.add_argument("--ctk", help="llama.cpp KV cache type of the keys (default f16)")
    ap.add_argument("--ctv", help="llama.cpp KV cache type of the values (default: --ctk)")
    a = ap.parse_args()
    kv = []
    if a.ctk or a.ctv:
        a.ctk = a.ctk or "f16"
        a.ctv = a.ctv or a.ctk
        kv = ["--ctk", a.ctk, "--ctv", a.ctv]
    os.makedirs(OUT, exist_ok=True)
    for name, kind in MODELS.items():
        if a.only and a.only not in name:
            continue
        path = os.path.join(a.models, name)
        teacher = []
        prompts = TEACHER_PROMPTS + [chat(kind, "Explain in two sentences why the sky is blue.")]
        for p in prompts:
            r = run(a.oracle, "logits", path, "--prompt", p, "--top", "10", *kv)
            teacher.append({
                "prompt": p,
                "tokens": r["tokens"],
                "top_ids": [[i for i, _ in row] for row in r["top"]],
                "top_logits": [[round(v, 4) for _, v in row] for row in r["top"]],
            })
        greedy = []
        for p in [] if a.no_greedy else GREEDY_PROMPTS:
            g = run(a.oracle, "generate", path, "--prompt", p, "--n", "64", *kv)
            ids = g["prompt_tokens"] + g["tokens"]
            r = run(a.oracle, "logits", path, "--tokens", ",".join(map(str, ids)), "--top", "2", *kv)
            n0 = len(g["prompt_tokens"])
            # Gap of the step that produced each generated token (position n0-1+k).
            gaps = [round(r["top"][n0 - 1 + k][0][1] - r["top"][n0 - 1 + k][1][1], 4)
                    for k in range(len(g["tokens"]))]
            greedy.append({"prompt": p, "prompt_tokens": g["prompt_tokens"], "tokens": g["tokens"],
                           "text": g["text"], "top2_gap": gaps})
        fixture = {
            "model": name,
            "generator": "scripts/gen_logit_fixtures.py --oracle ORACLE " + " ".join(kv) + " "
                         "(oracle logits MODEL --prompt P --top 10; oracle generate MODEL --prompt P --n 64; "
                         "oracle logits MODEL --tokens IDS --top 2)",
            "reference": "llama.cpp vendored in llama-cpp-python 0.3.36, CPU",
            "teacher_forced": teacher,
            "greedy": greedy,
        }
        stem = name[: -len(".gguf")]
        if kv:
            fixture["kv_types"] = [a.ctk, a.ctv]
            stem += f".kv-{a.ctk}-{a.ctv}"
        with open(os.path.join(OUT, f"{stem}.logits.json"), "w") as f:
            json.dump(fixture, f, separators=(",", ":"))
        print(name, "positions:", sum(len(t["tokens"]) for t in teacher), file=sys.stderr)


if __name__ == "__main__":
    main()
