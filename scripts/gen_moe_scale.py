#!/usr/bin/env python3
"""Write a synthetic `qwen3moe` GGUF with Qwen3-30B-A3B's shapes, as Q4_K_M.

The scale model of the MoE race (benches/race/moe_scale.py): a file the size
of a real Qwen3-30B-A3B Q4_K_M (about 17 GiB at 48 layers) whose tensors,
metadata and types are what llama.cpp's converter and `llama-quantize` write
for that model, with seeded random weights:

  48 layers, hidden 2048, 32 query / 4 KV heads of 128, per-head q/k RMS norms,
  128 experts of ff 768 stacked as `ffn_{gate,up,down}_exps`, top-8 of a
  softmax router (f32 `ffn_gate_inp`, renormalized as qwen3moe does), RoPE
  theta 1e6, RMS eps 1e-6, Qwen2/Qwen3's 151936-token vocabulary (the
  vocab-only `ggml-vocab-qwen2.gguf` of the test setup, padded with
  `[PADn]` tokens to the embedding rows if it had fewer; end of turn
  `<|im_end|>`, no BOS, as Qwen3's GGUFs).

Tensor types follow `llama_tensor_get_type` for LLAMA_FTYPE_MOSTLY_Q4_K_M:
`output.weight` Q6_K; `attn_v.weight` and `ffn_down_exps.weight` Q6_K on the
`use_more_bits` layers (the first and last eighth and every third layer in
between: 24 of 48), Q4_K elsewhere; every other matrix Q4_K; norms and the
router f32.

Quantized blocks are written directly as bytes: random quants with scales
chosen so each matrix has zero mean and the standard deviation a
`1/sqrt(fan_in)` initialization gives (Q4_K: sub-block scale = min, dmin =
7.5 d, so d·s·q − dmin·s is centred; Q6_K: signed sub-block scales). With
RMS norms before every sublayer the residual stream grows only as the square
root of depth, and the head's logits have a spread of a few units. The text
such a model writes is noise; its shapes, bytes and routing are what matter.

Generation streams tensor by tensor in bounded chunks (about 60 MB of RAM at a
time), is deterministic (seeded per tensor: same script, numpy and gguf
versions give the same bytes), and cached: the file is skipped when it exists
with the size a sidecar `FILE.json` recorded for the same parameters (its
sha256 is recorded too; `--verify` re-hashes the file against it).

Usage:
  gen_moe_scale.py [--out DIR] [--layers N] [--vocab DIR] [--seed S] [--verify]
  gen_moe_scale.py --layers 2     # the ~1.1 GiB CI variant (same shapes, 2 layers)
Prints the path of the file on stdout.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import gguf
from gguf import GGMLQuantizationType as QT

# Qwen3-30B-A3B (config.json of the Hugging Face checkpoint).
SPEC = dict(
    n_layer=48, n_embd=2048, n_head=32, n_head_kv=4, head_dim=128,
    n_expert=128, n_expert_used=8, n_ff_exp=768, n_ff=6144,
    rope_base=1000000.0, eps=1e-6, ctx=40960, n_vocab=151936,
)
# Bumped whenever the bytes this script writes change.
GENERATOR_VERSION = 1
CI_LAYERS = 2  # 1.1 GiB: one Q4_K and one Q6_K ffn_down layer

QK_K = 256
BLOCK_BYTES = {QT.Q4_K: 144, QT.Q6_K: 210}
# Blocks generated per chunk (fixed: the random stream depends on it).
CHUNK_BLOCKS = 1 << 18


def use_more_bits(i: int, n: int) -> bool:
    """llama-quantize's choice of layers that get more bits in the _M mixes."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def plan(n_layer: int) -> list[dict]:
    """Every tensor in file order: name, numpy-order shape (rows last = columns),
    type and the standard deviation (or kind) of its values."""
    s = SPEC
    d, hd = s["n_embd"], s["head_dim"]
    qd, kvd = s["n_head"] * hd, s["n_head_kv"] * hd
    ne, ff = s["n_expert"], s["n_ff_exp"]
    out = [dict(name="token_embd.weight", shape=(s["n_vocab"], d), type=QT.Q4_K, std=1.0)]
    for il in range(n_layer):
        b = f"blk.{il}"
        more = use_more_bits(il, n_layer)
        out += [
            dict(name=f"{b}.attn_norm.weight", shape=(d,), type=QT.F32, std="norm"),
            dict(name=f"{b}.attn_q.weight", shape=(qd, d), type=QT.Q4_K, std=1 / math.sqrt(d)),
            dict(name=f"{b}.attn_k.weight", shape=(kvd, d), type=QT.Q4_K, std=1 / math.sqrt(d)),
            dict(name=f"{b}.attn_v.weight", shape=(kvd, d), type=QT.Q6_K if more else QT.Q4_K,
                 std=1 / math.sqrt(d)),
            dict(name=f"{b}.attn_q_norm.weight", shape=(hd,), type=QT.F32, std="norm"),
            dict(name=f"{b}.attn_k_norm.weight", shape=(hd,), type=QT.F32, std="norm"),
            dict(name=f"{b}.attn_output.weight", shape=(d, qd), type=QT.Q4_K, std=1 / math.sqrt(qd)),
            dict(name=f"{b}.ffn_norm.weight", shape=(d,), type=QT.F32, std="norm"),
            # Router logits with a spread of about 2: top-8 picks are rarely near-ties.
            dict(name=f"{b}.ffn_gate_inp.weight", shape=(ne, d), type=QT.F32, std=2 / math.sqrt(d)),
            dict(name=f"{b}.ffn_gate_exps.weight", shape=(ne, ff, d), type=QT.Q4_K, std=1 / math.sqrt(d)),
            dict(name=f"{b}.ffn_up_exps.weight", shape=(ne, ff, d), type=QT.Q4_K, std=1 / math.sqrt(d)),
            dict(name=f"{b}.ffn_down_exps.weight", shape=(ne, d, ff), type=QT.Q6_K if more else QT.Q4_K,
                 std=2 / math.sqrt(ff)),
        ]
    out += [
        dict(name="output_norm.weight", shape=(d,), type=QT.F32, std="norm"),
        # Logits of spread ~3 over the normalized final hidden state.
        dict(name="output.weight", shape=(s["n_vocab"], d), type=QT.Q6_K, std=3 / math.sqrt(d)),
    ]
    return out


def nbytes(t: dict) -> int:
    n = math.prod(t["shape"])
    if t["type"] == QT.F32:
        return 4 * n
    assert t["shape"][-1] % QK_K == 0, t["name"]
    return n // QK_K * BLOCK_BYTES[t["type"]]


def byte_shape(t: dict) -> tuple[int, ...]:
    if t["type"] == QT.F32:
        return t["shape"]
    *lead, cols = t["shape"]
    return (*lead, cols // QK_K * BLOCK_BYTES[t["type"]])


# ---------------------------------------------------------------- blocks


def f16_bytes(x: float) -> np.ndarray:
    return np.frombuffer(np.float16(x).tobytes(), dtype=np.uint8)


def q4_k_blocks(rng: np.random.Generator, nb: int, std: float) -> np.ndarray:
    """`nb` random Q4_K blocks: w = d·s·q − dmin·m with s = m ∈ [16, 31] per
    32 values and dmin = 7.5·d, i.e. d·s·(q − 7.5), q ∈ [0, 15]: mean 0."""
    raw = rng.bit_generator.random_raw(nb * 18).view(np.uint8).reshape(nb, 144)
    s = (raw[:, 4:12] & 15) + np.uint8(16)  # 8 sub-block scales (= mins)
    lo, hi = s[:, 0:4], s[:, 4:8]
    raw[:, 4:8] = lo | ((hi >> 4) << 6)  # scales 0-3, top bits of scales 4-7
    raw[:, 8:12] = lo | ((hi >> 4) << 6)  # mins 0-3, top bits of mins 4-7
    raw[:, 12:16] = (hi & 15) | ((hi & 15) << 4)  # low bits of scales / mins 4-7
    rms_s = math.sqrt(np.mean(np.arange(16, 32, dtype=np.float64) ** 2))
    d = std / (rms_s * math.sqrt((16**2 - 1) / 12))
    raw[:, 0:2] = f16_bytes(d)
    raw[:, 2:4] = f16_bytes(float(np.float16(d)) * 7.5)
    return raw


def q6_k_blocks(rng: np.random.Generator, nb: int, std: float) -> np.ndarray:
    """`nb` random Q6_K blocks: w = d·sc·(q − 32), q ∈ [0, 63], sc = ±[8, 15]
    per 16 values (the sign random: mean 0)."""
    raw = rng.bit_generator.random_raw(nb * 210 // 8 + 1).view(np.uint8)[: nb * 210].reshape(nb, 210)
    b = raw[:, 192:208]
    sc = ((b & 7) + 8).astype(np.int8)
    sc = np.where(b & 0x80, -sc, sc).astype(np.int8)
    raw[:, 192:208] = sc.view(np.uint8)
    rms_s = math.sqrt(np.mean(np.arange(8, 16, dtype=np.float64) ** 2))
    d = std / (rms_s * math.sqrt((64**2 - 1) / 12))
    raw[:, 208:210] = f16_bytes(d)
    return raw


def tensor_chunks(t: dict, rng: np.random.Generator):
    """The bytes of tensor `t`, in chunks of at most CHUNK_BLOCKS blocks."""
    if t["type"] == QT.F32:
        n = math.prod(t["shape"])
        if t["std"] == "norm":
            v = 1.0 + 0.05 * rng.standard_normal(n, dtype=np.float32)
        else:
            v = rng.standard_normal(n, dtype=np.float32) * np.float32(t["std"])
        yield v.astype(np.float32).tobytes()
        return
    total = math.prod(t["shape"]) // QK_K
    gen = q4_k_blocks if t["type"] == QT.Q4_K else q6_k_blocks
    done = 0
    while done < total:
        nb = min(CHUNK_BLOCKS, total - done)
        yield gen(rng, nb, t["std"]).tobytes()
        done += nb


# ---------------------------------------------------------------- file


def add_vocab(writer: gguf.GGUFWriter, vocab_path: Path, n_vocab: int) -> None:
    """The tokenizer of `vocab_path` (a vocab-only GGUF), padded to `n_vocab`
    tokens as the converter pads a vocabulary smaller than the embedding."""
    r = gguf.GGUFReader(str(vocab_path))
    tokens = list(r.fields["tokenizer.ggml.tokens"].contents())
    types = list(r.fields["tokenizer.ggml.token_type"].contents())
    if len(tokens) > n_vocab:
        raise ValueError(f"{vocab_path}: {len(tokens)} tokens, more than the {n_vocab} embedding rows")
    for i in range(len(tokens), n_vocab):
        tokens.append(f"[PAD{i}]")
        types.append(int(gguf.TokenType.UNUSED))
    writer.add_tokenizer_model(r.fields["tokenizer.ggml.model"].contents())
    writer.add_tokenizer_pre(r.fields["tokenizer.ggml.pre"].contents())
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(list(r.fields["tokenizer.ggml.merges"].contents()))
    # As Qwen3's GGUFs: <|im_end|> ends a turn, <|endoftext|> pads, no BOS added.
    ids = {t: i for i, t in enumerate(tokens[151643:151650], start=151643)}
    writer.add_eos_token_id(ids.get("<|im_end|>", 151645))
    writer.add_pad_token_id(ids.get("<|endoftext|>", 151643))
    writer.add_bos_token_id(ids.get("<|endoftext|>", 151643))
    writer.add_add_bos_token(False)
    if "tokenizer.chat_template" in r.fields:
        writer.add_chat_template(r.fields["tokenizer.chat_template"].contents())


def write_model(path: Path, n_layer: int, vocab_path: Path, seed: int) -> tuple[int, str]:
    """Write the model to `path`; returns (size, sha256)."""
    s = SPEC
    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    writer.add_name(f"Qwen3-30B-A3B shapes, synthetic ({n_layer} layers)")
    writer.add_context_length(s["ctx"])
    writer.add_embedding_length(s["n_embd"])
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(s["n_ff"])
    writer.add_head_count(s["n_head"])
    writer.add_head_count_kv(s["n_head_kv"])
    writer.add_key_length(s["head_dim"])
    writer.add_value_length(s["head_dim"])
    writer.add_rope_freq_base(s["rope_base"])
    writer.add_layer_norm_rms_eps(s["eps"])
    writer.add_expert_count(s["n_expert"])
    writer.add_expert_used_count(s["n_expert_used"])
    writer.add_expert_feed_forward_length(s["n_ff_exp"])
    writer.add_file_type(15)  # LLAMA_FTYPE_MOSTLY_Q4_K_M
    writer.add_quantization_version(2)
    add_vocab(writer, vocab_path, s["n_vocab"])

    tensors = plan(n_layer)
    for t in tensors:
        if t["type"] == QT.F32:
            writer.add_tensor_info(t["name"], t["shape"], np.dtype(np.float32), nbytes(t))
        else:
            writer.add_tensor_info(t["name"], byte_shape(t), np.dtype(np.uint8), nbytes(t), raw_dtype=t["type"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    fout = writer.fout[0]
    fout.flush()
    sha = hashlib.sha256(path.read_bytes()[: fout.tell()])
    align = writer.data_alignment

    def put(data: bytes) -> None:
        fout.write(data)
        sha.update(data)

    t0 = time.time()
    written = 0
    total = sum(nbytes(t) for t in tensors)
    for idx, t in enumerate(tensors):
        pad = -fout.tell() % align
        if pad:
            put(bytes(pad))
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, idx])))
        n = 0
        for chunk in tensor_chunks(t, rng):
            put(chunk)
            n += len(chunk)
        assert n == nbytes(t), t["name"]
        written += n
        if sys.stderr.isatty() or idx % 48 == 0 or idx == len(tensors) - 1:
            rate = written / max(time.time() - t0, 1e-9) / 1e6
            print(f"\r  {written / 2**30:6.2f} / {total / 2**30:.2f} GiB ({rate:.0f} MB/s)",
                  end="" if sys.stderr.isatty() else "\n", file=sys.stderr, flush=True)
    pad = -n % align
    if pad:
        put(bytes(pad))
    size = fout.tell()
    writer.close()
    if sys.stderr.isatty():
        print(file=sys.stderr)
    return size, sha.hexdigest()


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(64 << 20):
            h.update(chunk)
    return h.hexdigest()


def fingerprint(n_layer: int, seed: int, vocab_path: Path) -> dict:
    return dict(generator_version=GENERATOR_VERSION, n_layer=n_layer, seed=seed, vocab=vocab_path.name,
                gguf=importlib.metadata.version("gguf"),
                numpy=np.__version__, spec=SPEC)


def model_path(out: Path, n_layer: int) -> Path:
    return out / f"qwen3moe-30b-a3b-shapes-{n_layer}L-q4_k_m.gguf"


def describe(n_layer: int) -> dict:
    """Byte counts the race's I/O floor needs, from the plan alone."""
    ts = plan(n_layer)
    per_expert = 0
    experts = 0
    dense = 0
    for t in ts:
        b = nbytes(t)
        if "_exps" in t["name"]:
            experts += b
            per_expert += b // SPEC["n_expert"]
        elif t["name"] != "token_embd.weight":
            dense += b
    return dict(
        n_layer=n_layer, n_expert=SPEC["n_expert"], n_expert_used=SPEC["n_expert_used"],
        expert_bytes=experts, dense_bytes=dense,
        token_embd_bytes=nbytes(ts[0]), token_embd_row_bytes=nbytes(ts[0]) // SPEC["n_vocab"],
        active_expert_bytes_per_token=per_expert * SPEC["n_expert_used"],
        mean_expert_bytes=per_expert / n_layer,
    )


def main() -> int:
    home = Path.home()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=home / ".cache/flatrun/scale")
    ap.add_argument("--layers", type=int, default=SPEC["n_layer"],
                    help=f"decoder layers (48 = Qwen3-30B-A3B; {CI_LAYERS} = the ~1 GiB CI variant)")
    ap.add_argument("--vocab", type=Path,
                    default=Path(os.environ.get("FLATRUN_VOCAB", home / ".cache/flatrun/vocab")))
    ap.add_argument("--seed", type=int, default=3003)
    ap.add_argument("--verify", action="store_true", help="re-hash an existing file against its sidecar")
    ap.add_argument("--describe", action="store_true", help="print the byte counts as JSON and exit")
    a = ap.parse_args()
    if a.describe:
        print(json.dumps(describe(a.layers), indent=2))
        return 0
    vocab = a.vocab / "ggml-vocab-qwen2.gguf"
    a.out.mkdir(parents=True, exist_ok=True)
    path = model_path(a.out, a.layers)
    side = path.with_name(path.name + ".json")
    want = fingerprint(a.layers, a.seed, vocab)
    if path.exists() and side.exists():
        rec = json.loads(side.read_text())
        if rec.get("fingerprint") == want and path.stat().st_size == rec.get("size"):
            if a.verify:
                got = file_sha256(path)
                if got != rec.get("sha256"):
                    print(f"{path}: sha256 {got} != recorded {rec.get('sha256')}; rewriting", file=sys.stderr)
                else:
                    print(f"{path}: sha256 verified", file=sys.stderr)
                    print(path)
                    return 0
            else:
                print(path)
                return 0
    print(f"writing {path}", file=sys.stderr)
    tmp = path.with_name(path.name + ".part")
    t0 = time.time()
    size, sha = write_model(tmp, a.layers, vocab, a.seed)
    tmp.replace(path)
    side.write_text(json.dumps(dict(fingerprint=want, size=size, sha256=sha, describe=describe(a.layers)),
                               indent=2) + "\n")
    print(f"wrote {path}: {size / 2**30:.2f} GiB in {time.time() - t0:.0f} s, sha256 {sha}", file=sys.stderr)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
