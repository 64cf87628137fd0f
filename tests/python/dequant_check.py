#!/usr/bin/env python3
"""Bit-exact dequantization check: our engine against PyPI gguf's `gguf.quants.dequantize`.

For every tensor type present in a model, one or two tensors of that type (the first and the
last in file order), plus the token embedding (compared on a few row slices when it is big), are
dequantized by `ringllm debug dequant -m MODEL --tensor NAME -o OUT` (raw little-endian f32 of the
whole tensor, row-major [n_rows, row_len]) and compared with np.array_equal (NaN == NaN).

    check(model_path, ringllm_bin) -> list of mismatch descriptions (empty: all equal)
    python3 tests/python/dequant_check.py MODEL RINGLLM_BIN
"""

import os
import subprocess
import sys
import tempfile
from collections import OrderedDict

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

EMBD = "token_embd.weight"
BIG = 16 * 1024 * 1024  # elements; above this only row slices are compared
SLICE_ROWS = 256


def _shape(t):
    """Row-major shape (reverse of the ggml order GGUFReader reports)."""
    return tuple(int(x) for x in reversed([int(s) for s in t.shape]))


def select_tensors(reader):
    """Names to check: first and last tensor of each type, plus the token embedding."""
    by_type = OrderedDict()
    for t in reader.tensors:
        by_type.setdefault(t.tensor_type.name, []).append(t)
    names = []
    for ts in by_type.values():
        for t in (ts[0], ts[-1]):
            if t.name not in names:
                names.append(t.name)
    if any(t.name == EMBD for t in reader.tensors) and EMBD not in names:
        names.append(EMBD)
    return names


def _row_slices(n_rows):
    if n_rows <= 3 * SLICE_ROWS:
        return [(0, n_rows)]
    mid = (n_rows // 2) // SLICE_ROWS * SLICE_ROWS
    return [(0, SLICE_ROWS), (mid, mid + SLICE_ROWS), (n_rows - SLICE_ROWS, n_rows)]


def _reference_rows(t, r0, r1):
    """gguf's dequantization of rows r0..r1 (elements r0..r1 of a 1-D tensor), flattened."""
    shape = _shape(t)
    if len(shape) == 1:
        return np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(-1)[r0:r1]
    n_rows = int(np.prod(shape[:-1]))
    data = t.data.reshape(n_rows, -1)[r0:r1]  # whole rows: blocks never straddle rows
    return np.asarray(dequantize(data, t.tensor_type), dtype=np.float32).reshape(-1)


def _first_diff(a, b):
    neq = ~((a == b) | (np.isnan(a) & np.isnan(b)))
    idx = np.flatnonzero(neq.reshape(-1))
    return (int(idx[0]), int(len(idx))) if len(idx) else (None, 0)


def check_tensor(reader_tensor, model_path, ringllm_bin, workdir):
    """None when our dequantization equals gguf's, else a one-line description."""
    t = reader_tensor
    name = t.name
    ty = t.tensor_type.name
    shape = _shape(t)
    n = int(np.prod(shape))
    out = os.path.join(workdir, name.replace("/", "_") + ".f32")
    cmd = [str(ringllm_bin), "debug", "dequant", "-m", str(model_path), "--tensor", name, "-o", out]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        return f"{name} ({ty}): `{' '.join(cmd)}` exited {r.returncode}: {r.stderr.strip()[-500:]}"
    size = os.path.getsize(out)
    if size != 4 * n:
        return f"{name} ({ty}): output has {size} bytes, expected {4 * n} (shape {shape})"
    ours_all = np.memmap(out, dtype="<f4", mode="r")
    try:
        if len(shape) == 1:
            slices = [(0, shape[0])]
            row_len = 1
        else:
            row_len = shape[-1]
            n_rows = n // row_len
            slices = _row_slices(n_rows) if n > BIG else [(0, n_rows)]
        for r0, r1 in slices:
            ref = _reference_rows(t, r0, r1)
            ours = np.asarray(ours_all[r0 * row_len:r1 * row_len], dtype=np.float32)
            if np.array_equal(ours, ref, equal_nan=True):
                continue
            i, count = _first_diff(ours, ref)
            flat = r0 * row_len + i
            where = f"index {flat}" + (f" (row {flat // row_len}, col {flat % row_len})" if len(shape) > 1 else "")
            return (f"{name} ({ty}, shape {shape}): {count} of {len(ref)} values differ in rows {r0}..{r1}; "
                    f"first at {where}: ours {ours[i]!r} vs gguf {ref[i]!r}")
    finally:
        del ours_all
        os.remove(out)
    return None


def check(model_path, ringllm_bin, names=None, verbose=False, reader=None):
    """Compares our dequantization with gguf's for the selected tensors of `model_path`.
    Returns a list of mismatch descriptions (empty when everything is bit-identical).
    `reader`: gguf's GGUFReader of that file when the caller has one already (parsing a
    262k-token vocabulary takes seconds)."""
    if reader is None:
        reader = GGUFReader(str(model_path))
    tensors = {t.name: t for t in reader.tensors}
    names = list(names) if names is not None else select_tensors(reader)
    problems = []
    with tempfile.TemporaryDirectory(prefix="dequant_check_") as tmp:
        for name in names:
            if name not in tensors:
                problems.append(f"{name}: no such tensor in {model_path}")
                continue
            msg = check_tensor(tensors[name], model_path, ringllm_bin, tmp)
            if verbose:
                t = tensors[name]
                print(f"{'FAIL' if msg else 'ok  '} {name} {t.tensor_type.name} {_shape(t)}", file=sys.stderr)
            if msg:
                problems.append(msg)
    return problems


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2:
        print("usage: dequant_check.py MODEL RINGLLM_BIN [TENSOR...]", file=sys.stderr)
        return 2
    problems = check(argv[0], argv[1], names=argv[2:] or None, verbose=True)
    for p in problems:
        print(p)
    print("all equal" if not problems else f"{len(problems)} mismatching tensor(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
