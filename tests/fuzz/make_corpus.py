#!/usr/bin/env python3
"""Writes the seed corpora of the fuzz targets (standard library only).

    python3 tests/fuzz/make_corpus.py [OUT_DIR [INDEX_OUT_DIR]]
        (defaults: tests/fuzz/corpus, tests/fuzz/corpus_index)

Seeds are small valid files covering every branch the loader has (each
convertible dtype, other dtypes, scalars, empty tensors, metadata, tensors
named as SwiGLU(2, 3)'s parameters so a strict load succeeds) and a few
near-misses (wrong size, overlap, gap, bad dtype) for the mutator to start
from.

Index seeds (for fuzz_shard_index) are a valid Hugging Face index and the
inputs the index parser must refuse cheaply: nesting just under, at and far
beyond its limit, duplicate keys at each level, numbers beyond 64 bits,
non-string values and file names that leave the folder.
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


def index_bytes(weight_map, metadata=None, raw_metadata=None):
    """An index; raw_metadata (text) replaces the metadata object verbatim."""
    meta = raw_metadata if raw_metadata is not None else json.dumps(metadata or {"total_size": 144})
    return ('{"metadata":' + meta + ',"weight_map":' + json.dumps(weight_map) + "}").encode()


SHARDS = {"w_gate.weight": "model-00001-of-00002.safetensors", "w_up.weight": "model-00001-of-00002.safetensors",
          "w_down.weight": "model-00002-of-00002.safetensors"}
NEST_LIMIT = 16  # kMaxShardIndexNesting


def nested(depth):
    return "[" * depth + "]" * depth


INDEX_SEEDS = {
    "valid": index_bytes(SHARDS, {"total_size": 144, "format": "apex-ffn", "ranks": "2"}),
    "valid_pretty": json.dumps({"metadata": {"total_size": 144}, "weight_map": SHARDS}, indent=2).encode(),
    "empty_map": index_bytes({}),
    "nested_at_limit": index_bytes(SHARDS, raw_metadata='{"x":' + nested(NEST_LIMIT - 2) + "}"),
    "nested_over_limit": index_bytes(SHARDS, raw_metadata='{"x":' + nested(NEST_LIMIT - 1) + "}"),
    "nested_deep_arrays": index_bytes(SHARDS, raw_metadata='{"x":' + nested(5000) + "}"),
    "nested_deep_objects": index_bytes(SHARDS, raw_metadata='{"x":' + '{"x":' * 5000 + "{}" + "}" * 5000 + "}"),
    "nested_unclosed": b'{"metadata":{"x":' + b"[" * 5000,
    "duplicate_tensor": b'{"weight_map":{"a":"s1.safetensors","a":"s2.safetensors"}}',
    "duplicate_weight_map": b'{"weight_map":{"a":"s1.safetensors"},"weight_map":{"b":"s2.safetensors"}}',
    "duplicate_metadata_key": b'{"metadata":{"k":"1","k":"2"},"weight_map":{}}',
    "duplicate_nested_key": b'{"metadata":{"x":[{"y":1,"y":2}]},"weight_map":{}}',
    "huge_numbers": index_bytes(SHARDS, raw_metadata='{"total_size":18446744073709551616,"n":1e400,"m":-1e-400}'),
    "total_size_max": index_bytes(SHARDS, raw_metadata='{"total_size":18446744073709551615}'),
    "total_size_string": index_bytes(SHARDS, raw_metadata='{"total_size":"144"}'),
    "non_string_metadata": index_bytes(SHARDS, raw_metadata='{"n":1.5,"b":true,"z":null,"o":{"a":[1,"x"]}}'),
    "non_string_file": b'{"weight_map":{"a":1,"b":null,"c":["s"],"d":{"e":"f"}}}',
    "metadata_not_object": b'{"metadata":[1,2],"weight_map":{}}',
    "escaping_names": b'{"weight_map":{"a":"../s.safetensors","b":"/etc/passwd","c":"..","d":"","e":"s\\u0000"}}',
    "unicode": '{"weight_map":{"ünï":"cödé.safetensors","\\ud83d\\ude00":"s"}}'.encode(),
    "lone_surrogate": b'{"weight_map":{"\\ud800":"s"}}',
    "not_object": b'[{"weight_map":{}}]',
    "trailing": index_bytes(SHARDS) + b" x",
}


def write_all(out, seeds, suffix):
    os.makedirs(out, exist_ok=True)
    for name, data in seeds.items():
        with open(os.path.join(out, name + suffix), "wb") as f:
            f.write(data)
    print(f"wrote {len(seeds)} seeds to {out}")


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    write_all(sys.argv[1] if len(sys.argv) > 1 else os.path.join(here, "corpus"), SEEDS, ".safetensors")
    write_all(sys.argv[2] if len(sys.argv) > 2 else os.path.join(here, "corpus_index"), INDEX_SEEDS, ".json")


if __name__ == "__main__":
    main()
