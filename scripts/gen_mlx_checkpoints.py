#!/usr/bin/env python3
"""Write MLX checkpoints of the real models, holding exactly the reference's weights.

MLX's own GGUF loader (`mlx.core.load`) turns Q4_0/Q4_1/Q8_0 tensors into MLX
affine triples (`weight` u32-packed, `scales`, `biases`, group 32) without
changing a value: Q4_1 is `d*q + m` (scale d, bias m), Q8_0 `d*(q+128) - 128d`.
This script saves them with `mlx.core.save_safetensors` under mlx-lm's
(Hugging Face) names and layout — llama Q/K rows un-permuted, Gemma norms
without llama.cpp's "+1" (see `hf_layout.py`) — with `config.json` carrying
`quantization: {group_size, bits}` (plus per-module entries where the bits
differ), `tokenizer.json` and `tokenizer_config.json`.

Checkpoints (under ${FLATRUN_MLX_CKPT:-~/.cache/flatrun/mlx-ckpt}):
  smollm2-135m-mlx-q4   SmolLM2-135M-Instruct.Q4_1.gguf as is: 4-bit g32
                        (token embedding 8-bit g32, from its Q8_0).
  gemma3-270m-mlx-q8    Gemma 3 270M requantized to Q8_0 (written alongside as
                        gemma-3-270m.Q8_0.gguf, the reference's input): 8-bit g32.

The Q8_0 requantization runs here, in numpy (`gguf.quants`: dequantize the
Q4_K_M file, quantize every matrix to Q8_0, keep the F32 norms); its bytes equal
`llama-quantize --allow-requantize gemma-3-270m-q4_k_m.gguf OUT Q8_0` (checked in
development; `--check-against FILE` repeats the check).

Idempotent: a checkpoint whose `.done` stamp matches this script's version is
left alone. Usage: gen_mlx_checkpoints.py [--models DIR] [--out DIR] [--only NAME]
"""
import argparse
import json
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_layout  # noqa: E402

VERSION = "1"


def home(*p):
    return os.path.join(os.path.expanduser("~"), *p)


def requantize_q8_0(src, dst):
    """Write `dst`: the GGUF `src` with every matrix dequantized and requantized to
    Q8_0 (vectors stay F32), metadata copied (`general.file_type` = 7, MOSTLY_Q8_0)."""
    import gguf
    from gguf.quants import quantize
    reader = gguf.GGUFReader(src)
    values_of = hf_layout.Gguf(src)
    arch = reader.fields["general.architecture"].contents()
    tmp = dst + ".tmp"
    writer = gguf.GGUFWriter(tmp, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.alignment"):
            continue
        value = field.contents()
        if name == "general.file_type":
            value = int(gguf.LlamaFileType.MOSTLY_Q8_0)
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, value, vtype, sub)
    for t in reader.tensors:
        values = values_of.tensor_f32(t.name)
        if values.ndim == 2 and values.shape[-1] % 32 == 0:
            writer.add_tensor(t.name, quantize(values, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(t.name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, dst)


def same_tensors(a, b):
    """Whether two GGUF files hold the same tensors (names, types, bytes)."""
    import gguf
    ta = {t.name: t for t in gguf.GGUFReader(a).tensors}
    tb = {t.name: t for t in gguf.GGUFReader(b).tensors}
    if ta.keys() != tb.keys():
        print(f"tensor names differ: {sorted(ta.keys() ^ tb.keys())[:5]}", file=sys.stderr)
        return False
    ok = True
    for name, t in ta.items():
        u = tb[name]
        if t.tensor_type != u.tensor_type or bytes(t.data.tobytes()) != bytes(u.data.tobytes()):
            print(f"{name}: {t.tensor_type.name} vs {u.tensor_type.name}, bytes differ", file=sys.stderr)
            ok = False
    return ok


def mlx_checkpoint(gguf_path, out_dir, npm_cache):
    """Convert a Q4_0/Q4_1/Q8_0 GGUF into an MLX checkpoint directory."""
    import mlx.core as mx
    meta = hf_layout.Gguf(gguf_path).meta
    arch = meta["general.architecture"]
    n_head = meta[f"{arch}.attention.head_count"]
    n_head_kv = meta.get(f"{arch}.attention.head_count_kv", n_head)
    arrays = mx.load(gguf_path)

    tmp = out_dir + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    weights, bits_of = {}, {}
    for gname in sorted({k.rsplit(".", 1)[0] + ".weight" for k in arrays}):
        module = hf_layout.hf_module(gname, arch)
        if module is None:
            continue
        module, _ = module
        w = arrays[gname]
        scales = arrays.get(gname[: -len("weight")] + "scales")
        biases = arrays.get(gname[: -len("weight")] + "biases")
        parts = {"weight": w} if scales is None else {"weight": w, "scales": scales, "biases": biases}
        # Undo llama.cpp's Q/K row permutation (rows, so the same on every part).
        if hf_layout.needs_unpermute(gname, arch):
            heads = n_head if ".attn_q." in gname else n_head_kv
            parts = {k: hf_layout.unpermute_rows(v, heads) for k, v in parts.items()}
        # Gemma norms without the converter's +1 (F32 vectors).
        offset = hf_layout.gemma_norm_offset(gname, arch)
        if offset:
            parts["weight"] = parts["weight"] - offset
        for k, v in parts.items():
            weights[f"{module}.{k}"] = v
        if scales is not None:
            bits_of[module] = 32 * w.shape[-1] // (scales.shape[-1] * 32)
    mx.eval(list(weights.values()))
    mx.save_safetensors(os.path.join(tmp, "model.safetensors"), weights, metadata={"format": "mlx"})

    # config.json: the most common bit width as default, the rest per module.
    counts = {}
    for b in bits_of.values():
        counts[b] = counts.get(b, 0) + 1
    default_bits = max(counts, key=counts.get)
    quant = {"group_size": 32, "bits": default_bits}
    for module, b in sorted(bits_of.items()):
        if b != default_bits:
            quant[module] = {"group_size": 32, "bits": b}
    config = hf_layout.hf_config(meta)
    config["tie_word_embeddings"] = "lm_head.weight" not in weights
    config["quantization"] = quant
    config["quantization_config"] = quant
    config["torch_dtype"] = "float16"
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    hf_layout.write_tokenizer(meta, tmp, npm_cache)
    with open(os.path.join(tmp, ".done"), "w") as f:
        f.write(VERSION + "\n")
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=os.environ.get("FLATRUN_MODELS", home(".cache", "flatrun", "models")))
    ap.add_argument("--out", default=os.environ.get("FLATRUN_MLX_CKPT", home(".cache", "flatrun", "mlx-ckpt")))
    ap.add_argument("--only", help="make only the checkpoints whose name contains this")
    ap.add_argument("--check-against", metavar="GGUF",
                    help="a Q8_0 GGUF from llama-quantize to compare the requantized Gemma file with")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    npm_cache = os.path.join(a.out, ".npm-tokenizers", "gemma3")

    def up_to_date(d):
        stamp = os.path.join(d, ".done")
        return os.path.exists(stamp) and open(stamp).read().strip() == VERSION

    for name in ("smollm2-135m-mlx-q4", "gemma3-270m-mlx-q8"):
        if a.only and a.only not in name:
            continue
        out_dir = os.path.join(a.out, name)
        if name.startswith("gemma3"):
            # The reference's input: the real file requantized to Q8_0, kept next to the checkpoints.
            src = os.path.join(a.models, "gemma-3-270m-q4_k_m.gguf")
            gguf_path = os.path.join(a.out, "gemma-3-270m.Q8_0.gguf")
            if not os.path.exists(gguf_path):
                print(f"mlx-ckpt: requantizing {src} to Q8_0", file=sys.stderr)
                requantize_q8_0(src, gguf_path)
            if a.check_against:
                ok = same_tensors(gguf_path, a.check_against)
                print(f"mlx-ckpt: {gguf_path} {'equals' if ok else 'DIFFERS FROM'} {a.check_against}",
                      file=sys.stderr)
                if not ok:
                    sys.exit(1)
        else:
            gguf_path = os.path.join(a.models, "SmolLM2-135M-Instruct.Q4_1.gguf")
        if up_to_date(out_dir):
            continue
        print(f"mlx-ckpt: writing {out_dir} from {os.path.basename(gguf_path)}", file=sys.stderr)
        mlx_checkpoint(gguf_path, out_dir, npm_cache)
    print(a.out)


if __name__ == "__main__":
    main()
