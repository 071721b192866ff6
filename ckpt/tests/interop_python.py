"""Reference side of the interop tests: Python's safetensors (with numpy) writes the inputs
and reads what `ckpt export` wrote. Run by tests/interop_python.rs.

    gen DIR                        write DIR/ref.safetensors and a sharded copy with an index
    check ORIG EXPORTED [--as f32] every tensor of ORIG is in EXPORTED with equal values
    check-index ORIG INDEX         the same, for a sharded export and its index json
"""

import json
import os
import sys

import numpy as np
from safetensors.numpy import load_file, save_file

FLOATS = ["float64", "float32", "float16"]
INTS = ["int64", "int32", "int16", "int8", "uint64", "uint32", "uint16", "uint8"]


def tensors():
    rng = np.random.default_rng(7)
    out = {}
    for dt in FLOATS:
        a = rng.standard_normal((33, 17)).astype(dt)
        # Values that must survive bit for bit.
        a[0, :6] = [np.nan, np.inf, -np.inf, -0.0, np.finfo(dt).tiny / 2, np.finfo(dt).max]
        out[f"float.{dt}"] = a
        out[f"float.{dt}.scalar"] = np.array(1.5, dtype=dt)
    for dt in INTS:
        info = np.iinfo(dt)
        a = rng.integers(info.min, info.max, size=(5, 7, 3), dtype=dt, endpoint=True)
        a.flat[0] = info.min
        a.flat[1] = info.max
        out[f"int.{dt}"] = a
    out["bool.mask"] = rng.integers(0, 2, size=(19,)).astype(bool)
    out["empty.f32"] = np.zeros((0, 3), dtype="float32")
    # A tensor that spans several 4 MiB chunks, and names that are not paths.
    out["big/layer.0/../weight"] = rng.standard_normal((1536, 1024)).astype("float32")
    out["model.layers.0.self_attn.q_proj.weight"] = rng.standard_normal((64, 64)).astype("float16")
    return out


def gen(d):
    t = tensors()
    save_file(t, os.path.join(d, "ref.safetensors"), metadata={"format": "pt", "source": "python"})
    names = sorted(t)
    half = len(names) // 2
    parts = {"py-00001-of-00002.safetensors": names[:half], "py-00002-of-00002.safetensors": names[half:]}
    weight_map = {}
    for f, ns in parts.items():
        save_file({n: t[n] for n in ns}, os.path.join(d, f), metadata={"format": "pt"})
        weight_map.update({n: f for n in ns})
    total = sum(a.nbytes for a in t.values())
    with open(os.path.join(d, "py.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh, indent=2)
    print(f"OK {len(t)} tensors")


def same(name, a, b, as_dtype=None):
    converted = bool(as_dtype) and a.dtype.kind == "f"
    if converted:
        with np.errstate(over="ignore"):
            a = a.astype(as_dtype)
    if a.dtype != b.dtype:
        raise SystemExit(f"{name}: dtype {b.dtype}, expected {a.dtype}")
    if a.shape != b.shape:
        raise SystemExit(f"{name}: shape {b.shape}, expected {a.shape}")
    if converted:
        # Converted values: equal as numbers, NaN where NaN, and the same sign of zero (NaN
        # payloads may differ between converters).
        ok = np.array_equal(a, b, equal_nan=True)
        finite = ~np.isnan(a)
        ok = ok and np.array_equal(np.signbit(a[finite]), np.signbit(b[finite]))
    else:
        ok = a.tobytes() == b.tobytes()
    if not ok:
        raise SystemExit(f"{name}: values differ")


def check(orig, exported, as_dtype=None):
    a = load_file(orig)
    b = load_file(exported)
    missing = set(a) - set(b)
    if missing:
        raise SystemExit(f"missing from the export: {sorted(missing)}")
    for k in a:
        same(k, a[k], b[k], as_dtype)
    print(f"OK {len(a)} tensors")


def check_index(orig, index):
    a = load_file(orig)
    with open(index) as fh:
        idx = json.load(fh)
    d = os.path.dirname(index)
    got = {}
    for f in sorted(set(idx["weight_map"].values())):
        for k, v in load_file(os.path.join(d, f)).items():
            if idx["weight_map"][k] != f:
                raise SystemExit(f"{k} is in {f} but the index says {idx['weight_map'][k]}")
            got[k] = v
    if set(got) != set(a):
        raise SystemExit(f"tensor sets differ: {sorted(set(got) ^ set(a))}")
    for k in a:
        same(k, a[k], got[k])
    if idx["metadata"]["total_size"] != sum(v.nbytes for v in a.values()):
        raise SystemExit("total_size is wrong")
    print(f"OK {len(a)} tensors in {len(set(idx['weight_map'].values()))} files")


if __name__ == "__main__":
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "gen":
        gen(args[0])
    elif cmd == "check":
        check(args[0], args[1], args[3] if len(args) > 3 and args[2] == "--as" else None)
    elif cmd == "check-index":
        check_index(args[0], args[1])
    else:
        raise SystemExit(f"unknown command {cmd}")
