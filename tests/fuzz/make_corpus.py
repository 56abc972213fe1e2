#!/usr/bin/env python3
"""Writes the seed corpus of the safetensors fuzz target (standard library only).

    python3 tests/fuzz/make_corpus.py [OUT_DIR]     (default: tests/fuzz/corpus)

Seeds are small valid files covering every branch the loader has (each
convertible dtype, other dtypes, scalars, empty tensors, metadata, tensors
named as SwiGLU(2, 3)'s parameters so a strict load succeeds) and a few
near-misses (wrong size, overlap, gap, bad dtype) for the mutator to start
from.
"""
import json
import os
import struct
import sys

SIZES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "U8": 1, "BOOL": 1}


def file_bytes(entries, metadata=None, pad=True, data_extra=b""):
    """entries: list of (name, dtype, shape, payload bytes or None)."""
    header, data = {}, b""
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, dtype, shape, payload in entries:
        n = SIZES.get(dtype, 4)
        for s in shape:
            n *= s
        payload = payload if payload is not None else bytes((i * 37 + 11) % 256 for i in range(n))
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(payload)]}
        data += payload
    text = json.dumps(header, separators=(",", ":")).encode()
    if pad:
        text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data + data_extra


def f64(*v):
    return struct.pack(f"<{len(v)}d", *v)


def f32(*v):
    return struct.pack(f"<{len(v)}f", *v)


def swiglu(dtype):
    # SwiGLU(d_model = 2, d_ffn = 3): w_gate, w_up [3, 2], w_down [2, 3].
    return [("w_gate.weight", dtype, [3, 2], None), ("w_up.weight", dtype, [3, 2], None),
            ("w_down.weight", dtype, [2, 3], None)]


SEEDS = {
    "swiglu_f64": file_bytes(swiglu("F64"), {"format": "pt"}),
    "swiglu_f32": file_bytes(swiglu("F32")),
    "swiglu_bf16": file_bytes(swiglu("BF16"), {"format": "pt", "apex.config": '{"layer":"SwiGLU"}'}),
    "swiglu_extra": file_bytes(swiglu("F64") + [("expert_bias", "F32", [4], f32(0.1, -0.2, 0.3, -1.0))]),
    "swiglu_wrong_shape": file_bytes([("w_gate.weight", "F64", [2, 3], None), ("w_up.weight", "F64", [3, 2], None),
                                      ("w_down.weight", "F64", [2, 3], None)]),
    "specials_f64": file_bytes([("v", "F64", [6], f64(0.0, -0.0, 1e308, -1e-320, float("inf"), float("nan")))]),
    "scalar_and_empty": file_bytes([("s", "F32", [], f32(3.5)), ("e", "F64", [0, 4], b""), ("z", "BF16", [2, 0], b"")]),
    "mixed_dtypes": file_bytes([("i", "I64", [2], None), ("b", "BOOL", [3], b"\x00\x01\x00"), ("u", "U8", [1, 1], None),
                                ("h", "F16", [2], None), ("x", "F32", [1, 2, 2], None)]),
    "metadata_only": file_bytes([], {"format": "pt", "ünï": "cödé", "empty": ""}),
    "empty_header": struct.pack("<Q", 2) + b"{}",
    "unpadded": file_bytes([("a", "F32", [3], None)], pad=False),
    "near_miss_size": file_bytes([("a", "F32", [3], b"\x00" * 8)]),
    "near_miss_gap": file_bytes([("a", "F32", [1], None)], data_extra=b"\x00\x00"),
    "near_miss_dtype": file_bytes([("a", "F31", [2], b"\x00" * 8)]),
    "rank4": file_bytes([("t", "BF16", [1, 2, 1, 2], None)]),
}


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")
    os.makedirs(out, exist_ok=True)
    for name, data in SEEDS.items():
        with open(os.path.join(out, name + ".safetensors"), "wb") as f:
            f.write(data)
    print(f"wrote {len(SEEDS)} seeds to {out}")


if __name__ == "__main__":
    main()
