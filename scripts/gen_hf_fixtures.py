#!/usr/bin/env python3
"""Make the reference logits of the Hugging Face parity tests (crates/flatrun-runtime/tests/hf_parity.rs).

The HF checkpoints of scripts/gen_hf_checkpoints.py hold each real GGUF's weights
dequantized to f16. The same weights as a GGUF come from the reference build's
requantizer, and the reference's logits on that file are what the HF directories
must reproduce:

  llama-quantize --allow-requantize $FLATRUN_MODELS/<model>.gguf /tmp/<model>-f16.gguf F16
  oracle logits /tmp/<model>-f16.gguf --prompt P --top 10      (for each prompt P)

with the teacher-forced prompts of scripts/gen_logit_fixtures.py (the five texts and
one chat turn). The f16 tensors of the requantized GGUF equal, bit for bit, the f16
tensors gen_hf_checkpoints.py writes (after the name mapping and Q/K un-permutation;
`--check` verifies that for every F16 tensor); only its 1-D norm weights differ
(F32 in the GGUF, f16 in the HF file).

Usage (not run by CI; needs the reference build):
  scripts/gen_hf_fixtures.py --oracle PATH/TO/oracle --quantize PATH/TO/llama-quantize [--check] [--only NAME]
Writes crates/flatrun-runtime/tests/fixtures/hf/<model>-f16.logits.json.
"""
import argparse, json, os, struct, subprocess, sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import gen_hf_checkpoints as ckpt  # noqa: E402
import hf_layout  # noqa: E402
from gen_logit_fixtures import TEACHER_PROMPTS, MODELS, chat  # noqa: E402

OUT = os.path.join(HERE, "..", "crates", "flatrun-runtime", "tests", "fixtures", "hf")


def run(cmd):
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def read_safetensors(path):
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack_from("<Q", blob)
    header = json.loads(blob[8:8 + n])
    base = 8 + n
    return {k: blob[base + v["data_offsets"][0]:base + v["data_offsets"][1]]
            for k, v in header.items() if k != "__metadata__"}


def check_bits(ref_gguf, hf_file):
    """Count the F16 tensors of the reference GGUF equal bit for bit to the HF file's."""
    ref = hf_layout.Gguf(ref_gguf)
    arch = ref.meta["general.architecture"]
    n_head = ref.arch_key("attention.head_count")
    n_kv = ref.arch_key("attention.head_count_kv", n_head)
    hf = read_safetensors(hf_file)
    same = total = 0
    for name, (ggml_type, ne, offset) in ref.tensors.items():
        target = hf_layout.hf_name(name, arch)
        if target is None or ggml_type != 1:
            continue
        w = np.frombuffer(ref.buf, dtype="<f2", count=int(np.prod(ne)), offset=ref.data_start + offset)
        w = w.reshape(list(reversed(ne)))
        if arch == "llama" and name.endswith("attn_q.weight"):
            w = hf_layout.unpermute_rows(w, n_head)
        elif arch == "llama" and name.endswith("attn_k.weight"):
            w = hf_layout.unpermute_rows(w, n_kv)
        total += 1
        same += np.array_equal(np.ascontiguousarray(w).view("<u2").ravel(), np.frombuffer(hf[target], "<u2"))
    return same, total


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--oracle", required=True)
    ap.add_argument("--quantize", required=True, help="the reference build's llama-quantize")
    ap.add_argument("--models", default=os.environ.get("FLATRUN_MODELS", os.path.expanduser("~/.cache/flatrun/models")))
    ap.add_argument("--hf", default=os.environ.get("FLATRUN_HF_CKPT", os.path.expanduser("~/.cache/flatrun/hf-ckpt")))
    ap.add_argument("--work", default="/tmp/flatrun-hf-ref")
    ap.add_argument("--check", action="store_true", help="compare the f16 bits with the HF checkpoints")
    ap.add_argument("--only")
    a = ap.parse_args()
    os.makedirs(OUT, exist_ok=True)
    os.makedirs(a.work, exist_ok=True)
    for name, kind in MODELS.items():
        if a.only and a.only not in name:
            continue
        stem = name[: -len(".gguf")]
        f16 = os.path.join(a.work, f"{stem}-f16.gguf")
        if not os.path.exists(f16):
            run([a.quantize, "--allow-requantize", os.path.join(a.models, name), f16, "F16"])
        if a.check:
            variant = next(v for v, (src, dt, shards) in ckpt.VARIANTS.items()
                           if src == name and dt == "f16" and shards == 1)
            same, total = check_bits(f16, os.path.join(a.hf, variant, "model.safetensors"))
            print(f"{name}: {same}/{total} F16 tensors bit-identical to {variant}", file=sys.stderr)
        teacher = []
        for p in TEACHER_PROMPTS + [chat(kind, "Explain in two sentences why the sky is blue.")]:
            r = json.loads(run([a.oracle, "logits", f16, "--prompt", p, "--top", "10"]))
            teacher.append({
                "prompt": p,
                "tokens": r["tokens"],
                "top_ids": [[i for i, _ in row] for row in r["top"]],
                "top_logits": [[round(v, 4) for _, v in row] for row in r["top"]],
            })
        fixture = {
            "model": f"{stem}-f16.gguf",
            "generator": "scripts/gen_hf_fixtures.py --oracle ORACLE --quantize LLAMA_QUANTIZE "
                         "(llama-quantize --allow-requantize MODEL.gguf MODEL-f16.gguf F16; "
                         "oracle logits MODEL-f16.gguf --prompt P --top 10)",
            "reference": "llama.cpp vendored in llama-cpp-python 0.3.36, CPU",
            "teacher_forced": teacher,
        }
        with open(os.path.join(OUT, f"{stem}-f16.logits.json"), "w") as f:
            json.dump(fixture, f, separators=(",", ":"))
        print(name, "positions:", sum(len(t["tokens"]) for t in teacher), file=sys.stderr)


if __name__ == "__main__":
    main()
