#!/usr/bin/env python3
"""GGUF interop with gguf-py (PyPI `gguf`, llama.cpp's own Python package).

    gguf_interop.py write PATH   gguf.GGUFWriter writes the reference file
    gguf_interop.py check PATH   gguf.GGUFReader reads PATH (written by
                                 apex-ffn's gguf::Writer) and compares it
                                 with the reference content
    gguf_interop.py types PATH   gguf.GGUFReader reads PATH, one tensor of
                                 each ggml type written by gguf::Writer: its
                                 size table (GGML_QUANT_SIZES) must agree
                                 with the sizes and offsets apex-ffn wrote

The reference content is stated here and, independently, in
tests/test_gguf.cpp (interop_spec / check_interop_spec): the same keys,
types, values, tensor shapes and bytes. Run from CTest by
tests/gguf_interop.cmake; exits 0 with "SKIP" when gguf cannot be imported.
"""
import sys

try:
    import numpy as np
    import gguf
    from gguf import GGUFValueType as V, GGMLQuantizationType as Q
except ImportError as e:  # pragma: no cover
    print(f"SKIP: gguf-py is not importable ({e}); pip install gguf")
    sys.exit(0)

ARCH = "apexinterop"
SCALARS = [
    ("t.u8", V.UINT8, 200),
    ("t.i8", V.INT8, -100),
    ("t.u16", V.UINT16, 60000),
    ("t.i16", V.INT16, -30000),
    ("t.u32", V.UINT32, 4000000000),
    ("t.i32", V.INT32, -2000000000),
    ("t.f32", V.FLOAT32, 1.5),
    ("t.bool", V.BOOL, True),
    ("t.str", V.STRING, "h\u00e9llo"),
    ("t.u64", V.UINT64, 2**40 + 1),
    ("t.i64", V.INT64, -(2**40)),
    ("t.f64", V.FLOAT64, 0.1),
]
ARRAYS = [
    ("t.arr_i32", V.INT32, [1, -2, 3]),
    ("t.arr_str", V.STRING, ["a", "bb", "ccc"]),
    ("t.arr_f32", V.FLOAT32, [0.5, -0.25]),
]


def tensors():
    """name -> (type, ne in ggml order, raw bytes)."""
    f32 = (np.arange(12, dtype=np.float32) * 0.5).reshape(3, 4)
    f16 = (np.arange(16, dtype=np.uint16) + 0x3C00).view(np.float16).reshape(2, 8)
    q8 = ((np.arange(136, dtype=np.uint32) * 7 + 3) & 0xFF).astype(np.uint8).reshape(2, 68)
    return {
        "t_f32": (Q.F32, [4, 3], f32),
        "t_f16": (Q.F16, [8, 2], f16),
        "t_q8_0": (Q.Q8_0, [64, 2], q8),
    }


def write(path):
    w = gguf.GGUFWriter(path, ARCH)
    for key, vt, val in SCALARS:
        w.add_key_value(key, val, vt)
    for key, st, val in ARRAYS:
        w.add_key_value(key, val, V.ARRAY, sub_type=st)
    for name, (qt, _, arr) in tensors().items():
        w.add_tensor(name, arr, raw_dtype=qt if qt == Q.Q8_0 else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def check(path):
    r = gguf.GGUFReader(path)
    bad = []

    def expect(cond, what):
        if not cond:
            bad.append(what)

    keys = [k for k in r.fields if not k.startswith("GGUF.")]
    want_keys = ["general.architecture"] + [k for k, _, _ in SCALARS] + [k for k, _, _ in ARRAYS]
    expect(keys == want_keys, f"keys {keys} != {want_keys}")
    expect(r.fields["general.architecture"].contents() == ARCH, "general.architecture")
    for key, vt, val in SCALARS:
        f = r.fields.get(key)
        expect(f is not None and f.types == [vt], f"{key}: type {f and f.types} != {vt}")
        if f is None:
            continue
        got = f.contents()
        if vt == V.FLOAT32:
            expect(np.float32(got) == np.float32(val), f"{key}: {got} != {val}")
        else:
            expect(got == val, f"{key}: {got!r} != {val!r}")
    for key, st, val in ARRAYS:
        f = r.fields.get(key)
        expect(f is not None and f.types == [V.ARRAY, st], f"{key}: types {f and f.types}")
        if f is not None:
            expect(f.contents() == val, f"{key}: {f.contents()} != {val}")
    want = tensors()
    expect([t.name for t in r.tensors] == list(want), f"tensors {[t.name for t in r.tensors]}")
    for t in r.tensors:
        if t.name not in want:
            continue
        qt, ne, arr = want[t.name]
        expect(t.tensor_type == qt, f"{t.name}: type {t.tensor_type} != {qt}")
        expect([int(n) for n in t.shape] == ne, f"{t.name}: shape {list(t.shape)} != {ne}")
        expect(np.asarray(t.data).tobytes() == arr.tobytes(), f"{t.name}: bytes differ")
    if bad:
        print("FAIL:\n  " + "\n  ".join(bad))
        return 1
    try:
        from importlib.metadata import version
        ver = version("gguf")
    except Exception:  # pragma: no cover - an unpackaged checkout
        ver = "?"
    print(f"OK: gguf-py {ver} read {path} identically")
    return 0


def types(path):
    """Each tensor is named by its type, filled with its type id, and its
    byte size is stored under "size.<name>"; gguf-py must find the same
    size from its own table and the bytes where apex-ffn put them."""
    r = gguf.GGUFReader(path)
    bad, seen = [], 0
    for t in r.tensors:
        block, nbytes = gguf.GGML_QUANT_SIZES[t.tensor_type]
        n = int(np.prod([int(x) for x in t.shape]))
        want = r.fields["size." + t.name].contents()
        if n // block * nbytes != want or t.n_bytes != want:
            bad.append(f"{t.name}: gguf-py size {t.n_bytes}, apex-ffn {want}")
        elif t.tensor_type.name.lower() != t.name.lower():
            bad.append(f"{t.name}: gguf-py calls type {t.tensor_type.value} {t.tensor_type.name}")
        elif np.asarray(t.data).tobytes() != bytes([t.tensor_type.value]) * want:
            bad.append(f"{t.name}: bytes differ")
        seen += 1
    if bad or seen < 30:
        print(f"FAIL ({seen} tensors):\n  " + "\n  ".join(bad))
        return 1
    print(f"OK: gguf-py agrees with apex-ffn on the size of {seen} tensor types")
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "types":
        sys.exit(types(sys.argv[2]))
    if len(sys.argv) != 3 or sys.argv[1] not in ("write", "check"):
        print(__doc__)
        sys.exit(2)
    if sys.argv[1] == "write":
        write(sys.argv[2])
        print(f"wrote {sys.argv[2]}")
        sys.exit(0)
    sys.exit(check(sys.argv[2]))
