#!/usr/bin/env python3
"""Compare two GGUF files tensor by tensor (by name): type, shape and data
bytes, and the metadata keys. Prints one line per difference and a summary;
exits 1 when any tensor differs.

Usage: compare_gguf_tensors.py A.gguf B.gguf
"""
import sys

import numpy as np
from gguf import GGUFReader


def tensors(path):
    r = GGUFReader(path)
    return r, {t.name: t for t in r.tensors}


def main():
    a_path, b_path = sys.argv[1], sys.argv[2]
    ra, a = tensors(a_path)
    rb, b = tensors(b_path)
    bad = 0
    for name in sorted(set(a) | set(b)):
        if name not in a or name not in b:
            print(f"{name}: only in {'B' if name in b else 'A'}")
            bad += 1
            continue
        ta, tb = a[name], b[name]
        if ta.tensor_type != tb.tensor_type or list(ta.shape) != list(tb.shape):
            print(f"{name}: {ta.tensor_type.name}{list(ta.shape)} vs {tb.tensor_type.name}{list(tb.shape)}")
            bad += 1
            continue
        da = np.asarray(ta.data).view(np.uint8).ravel()
        db = np.asarray(tb.data).view(np.uint8).ravel()
        if not np.array_equal(da, db):
            diff = np.count_nonzero(da != db)
            print(f"{name}: {ta.tensor_type.name}: {diff} of {da.size} bytes differ")
            bad += 1
    keys_a = {f.name for f in ra.fields.values()}
    keys_b = {f.name for f in rb.fields.values()}
    for k in sorted(keys_a ^ keys_b):
        print(f"metadata key {k}: only in {'A' if k in keys_a else 'B'}")
    types = {}
    for t in a.values():
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    mix = ", ".join(f"{n} {k}" for k, n in sorted(types.items()))
    print(f"{len(a)} tensors ({mix}): {bad} differ")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
