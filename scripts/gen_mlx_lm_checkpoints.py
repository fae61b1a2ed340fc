#!/usr/bin/env python3
"""MLX directories as mlx-lm writes them, and mlx-lm's own answers on them.

Converts the Hugging Face directories of `gen_hf_checkpoints.py`
(${FLATRUN_HF_CKPT:-~/.cache/flatrun/hf-ckpt}: SmolLM2, Qwen2.5, Gemma 3 and the
synthetic Qwen3 of gen_synthetic_models.py) with the real `mlx_lm.convert`
(`mlx-lm` and `mlx[cpu]`, pinned in `scripts/setup-test-env.sh`) into
${FLATRUN_MLX_CKPT:-~/.cache/flatrun/mlx-ckpt}/lm/<family>-<recipe>:

  recipe        mlx_lm.convert arguments
  q4g64         -q                       (mlx-lm's default: 4-bit, group 64)
  q8g32         -q --q-bits 8 --q-group-size 32
  q3g64         -q --q-bits 3
  mixed36       -q --quant-predicate mixed_3_6   (per-layer 3/6-bit entries)
  q2g128, q5g32, q6g128   (SmolLM2 only: the rest of the widths and groups)
  q4g64-sharded the q4g64 conversion saved in 20 MB shards by mlx-lm's own
                `save_model` (its `make_shards` split at 20 MB instead of 5 GB)

Every directory is what mlx-lm writes (`model.safetensors` +
`model.safetensors.index.json` or shards, `config.json` with `quantization`
and `quantization_config`, tokenizer files); a `.done` stamp holding this
script's version and the pins makes reruns skip.

With `--goldens`, mlx-lm then loads each directory, casts it to float32
(`model.set_dtype(mx.float32)`: f16 scales, biases and norms are exact in f32,
so the reference adds no f16 rounding of its own) and writes
crates/flatrun-runtime/tests/fixtures/mlx-lm/<name>.json: teacher-forced top-10
logits over fixed texts, and greedy continuations (token ids, and the top-2 gap
at every step). The fixture records the command and the sha256 of the weights.

Usage: gen_mlx_lm_checkpoints.py [--hf DIR] [--out DIR] [--only SUBSTR] [--goldens]
"""
import argparse
import hashlib
import json
import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, "..", "crates", "flatrun-runtime", "tests", "fixtures", "mlx-lm")
VERSION = "1 mlx-lm==0.32.2 mlx==0.32.4"

FAMILIES = {
    "smollm2-135m": "smollm2-135m-f16",
    "qwen2.5-0.5b": "qwen2.5-coder-0.5b-f16",
    "gemma3-270m": "gemma-3-270m-f16",
    "qwen3-synth": "qwen3-synth-f16",
}
# recipe -> (bits, group, quant_predicate)
RECIPES = {
    "q4g64": (4, 64, None),
    "q8g32": (8, 32, None),
    "q3g64": (3, 64, None),
    "mixed36": (4, 64, "mixed_3_6"),
}
SMOLLM2_EXTRA = {
    "q2g128": (2, 128, None),
    "q5g32": (5, 32, None),
    "q6g128": (6, 128, None),
}
SHARD_BYTES = 20 << 20

TEACHER_TEXTS = [
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based ink and a wooden press adapted from wine making. "
    "Within fifty years, presses had spread to more than two hundred cities across Europe.",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    a, b = 0, 1\n"
    "    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
]
GREEDY_PROMPTS = ["def quicksort(arr):", "The capital of France is"]
GREEDY_TOKENS = 24
# The larger models get the first text and prompt only, with shorter
# continuations (mlx's CPU evaluation in float32 is slow on a small machine).
SHORT = {"qwen2.5-0.5b": (1, 1, 16), "gemma3-270m": (1, 1, 16)}


def home(*p):
    return os.path.join(os.path.expanduser("~"), *p)


def checkpoints():
    """(name, family HF dir, bits, group, predicate, sharded) of every directory."""
    out = []
    for fam, hf in FAMILIES.items():
        recipes = dict(RECIPES)
        if fam == "smollm2-135m":
            recipes.update(SMOLLM2_EXTRA)
        for r, (bits, group, pred) in recipes.items():
            out.append((f"{fam}-{r}", hf, bits, group, pred, False))
    out.append(("smollm2-135m-q4g64-sharded", FAMILIES["smollm2-135m"], 4, 64, None, True))
    return out


def convert(hf_dir, out_dir, bits, group, pred, sharded):
    import mlx_lm.utils as utils
    from mlx_lm.convert import convert as mlx_convert
    tmp = out_dir + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    make_shards = utils.make_shards

    def small_shards(weights, max_file_size_gb=5):
        # mlx-lm's make_shards takes whole gigabytes; the same split at SHARD_BYTES.
        shards, shard, size = [], {}, 0
        for k, v in weights.items():
            if shard and size + v.nbytes > SHARD_BYTES:
                shards.append(shard)
                shard, size = {}, 0
            shard[k] = v
            size += v.nbytes
        shards.append(shard)
        return shards

    if sharded:
        utils.make_shards = small_shards
    try:
        mlx_convert(hf_path=hf_dir, mlx_path=tmp, quantize=True, q_group_size=group, q_bits=bits,
                    quant_predicate=pred)
    finally:
        utils.make_shards = make_shards
    with open(os.path.join(tmp, ".done"), "w") as f:
        f.write(VERSION + "\n")
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)


def weights_sha256(d):
    h = hashlib.sha256()
    for n in sorted(os.listdir(d)):
        if n.endswith(".safetensors"):
            with open(os.path.join(d, n), "rb") as f:
                for chunk in iter(lambda: f.read(1 << 22), b""):
                    h.update(chunk)
    return h.hexdigest()


def goldens(name, d):
    import mlx.core as mx
    import numpy as np
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache
    model, tok = load(d)
    model.set_dtype(mx.float32)

    def logits(ids, cache=None):
        out = model(mx.array([ids]), cache=cache)
        return np.array(out[0].astype(mx.float32))

    n_texts, n_prompts, n_tokens = SHORT.get(name.rsplit("-", 1)[0], (None, None, GREEDY_TOKENS))
    teacher = []
    for text in TEACHER_TEXTS[:n_texts]:
        ids = tok.encode(text)
        lg = logits(ids)
        top = np.argsort(-lg, axis=-1, kind="stable")[:, :10]
        teacher.append({
            "prompt": text,
            "tokens": [int(i) for i in ids],
            "top_ids": [[int(i) for i in row] for row in top],
            "top_logits": [[round(float(lg[p, i]), 4) for i in row] for p, row in enumerate(top)],
        })
    greedy = []
    for text in GREEDY_PROMPTS[:n_prompts]:
        ids = tok.encode(text)
        prompt = list(ids)
        gen, gaps = [], []
        cache = make_prompt_cache(model)
        step = ids
        for _ in range(n_tokens):
            last = logits(step, cache)[-1]
            a, b = np.argsort(-last, kind="stable")[:2]
            gen.append(int(a))
            gaps.append(round(float(last[a] - last[b]), 4))
            step = [int(a)]
        greedy.append({"prompt": text, "tokens": [int(i) for i in prompt], "generated": gen, "gaps": gaps})
    fixture = {
        "model": name,
        "generator": f"scripts/gen_mlx_lm_checkpoints.py --goldens --only {name}",
        "reference": "mlx-lm 0.32.2 on mlx[cpu] 0.32.4, model.set_dtype(mx.float32), KV-cached greedy steps",
        "weights_sha256": weights_sha256(d),
        "teacher_forced": teacher,
        "greedy": greedy,
    }
    os.makedirs(FIXTURES, exist_ok=True)
    with open(os.path.join(FIXTURES, name + ".json"), "w") as f:
        json.dump(fixture, f, separators=(",", ":"))
        f.write("\n")
    print(f"mlx-lm golden: {name}: {sum(len(t['tokens']) for t in teacher)} positions", file=sys.stderr)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hf", default=os.environ.get("FLATRUN_HF_CKPT", home(".cache", "flatrun", "hf-ckpt")))
    ap.add_argument("--out", default=os.environ.get("FLATRUN_MLX_CKPT", home(".cache", "flatrun", "mlx-ckpt")))
    ap.add_argument("--only", help="only the directories whose name contains this")
    ap.add_argument("--goldens", action="store_true", help="also write mlx-lm's reference fixtures")
    a = ap.parse_args()
    root = os.path.join(a.out, "lm")
    os.makedirs(root, exist_ok=True)
    for name, hf, bits, group, pred, sharded in checkpoints():
        if a.only and a.only not in name:
            continue
        src = os.path.join(a.hf, hf)
        if not os.path.exists(os.path.join(src, "config.json")):
            print(f"mlx-lm: {src} missing (run gen_hf_checkpoints.py); skipping {name}", file=sys.stderr)
            continue
        d = os.path.join(root, name)
        stamp = os.path.join(d, ".done")
        if not (os.path.exists(stamp) and open(stamp).read().strip() == VERSION):
            print(f"mlx-lm: converting {hf} -> {name}", file=sys.stderr)
            convert(src, d, bits, group, pred, sharded)
        if a.goldens:
            goldens(name, d)
        else:
            fixture = os.path.join(FIXTURES, name + ".json")
            if os.path.exists(fixture):
                want = json.load(open(fixture)).get("weights_sha256")
                if want and want != weights_sha256(d):
                    print(f"mlx-lm: WARNING: {name}: weights differ from those of {fixture}",
                          file=sys.stderr)
    print(root)


if __name__ == "__main__":
    main()
