#!/usr/bin/env python3
"""Writes the seed corpus of fuzz_gguf into tests/fuzz/corpus_gguf/.

Small valid GGUF files covering every value type, nested arrays, several
tensor types, a custom alignment and version 2, and near-valid ones (each
one field wrong) so the fuzzer starts next to every check. Written field by
field with struct (no gguf-py needed), deterministically: running it again
gives the same bytes.

    python3 tests/fuzz/make_gguf_corpus.py
"""
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "corpus_gguf")

U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = range(13)
PACK = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f", BOOL: "<B",
        U64: "<Q", I64: "<q", F64: "<d"}
# ggml type id -> (block elements, block bytes), a few of them
TYPES = {0: (1, 4), 1: (1, 2), 2: (32, 18), 8: (32, 34), 12: (256, 144), 14: (256, 210), 30: (1, 2), 39: (32, 17)}


def s(x):
    b = x.encode() if isinstance(x, str) else x
    return struct.pack("<Q", len(b)) + b


def val(t, v):
    if t == STR:
        return s(v)
    if t == ARR:
        et, items = v
        return struct.pack("<IQ", et, len(items)) + b"".join(val(et, i) for i in items)
    return struct.pack(PACK[t], v)


def kv(key, t, v):
    return s(key) + struct.pack("<I", t) + val(t, v)


def gguf(kvs, tensors, align=32, version=3, data_fill=0x5A, offsets=None):
    """tensors: (name, type, ne); offsets laid out as ggml does unless given."""
    infos, data, off = b"", b"", 0
    for k, (name, t, ne) in enumerate(tensors):
        blk, nb = TYPES[t]
        n = 1
        for e in ne:
            n *= e
        size = n // blk * nb
        infos += s(name) + struct.pack("<I", len(ne)) + b"".join(struct.pack("<Q", e) for e in ne)
        infos += struct.pack("<IQ", t, off if offsets is None else offsets[k])
        chunk = bytes((data_fill + i * 13) & 0xFF for i in range(size))
        pad = (-size) % align
        data += chunk + b"\0" * pad
        off += size + pad
    head = b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(kvs)) + b"".join(kvs) + infos
    head += b"\0" * ((-len(head)) % align)
    return head + data


def main():
    os.makedirs(OUT, exist_ok=True)
    arch = kv("general.architecture", STR, "qwen3moe")
    every = [arch] + [kv("k.%d" % t, t, v) for t, v in
                      [(U8, 200), (I8, -3), (U16, 60000), (I16, -300), (U32, 4000000000), (I32, -5),
                       (F32, 1.5), (BOOL, 1), (STR, "h\u00e9"), (U64, 2**40), (I64, -2**40), (F64, 0.1)]]
    files = {
        "valid_empty": gguf([], []),
        "valid_every_value_type": gguf(every, []),
        "valid_arrays": gguf([arch, kv("tokens", ARR, (STR, ["<s>", "a", ""])),
                              kv("scores", ARR, (F32, [0.0, -1.5])),
                              kv("nested", ARR, (ARR, [(U16, [1, 2]), (STR, ["x"]), (ARR, [(BOOL, [0])])]))], []),
        "valid_tensors": gguf([arch, kv("qwen3moe.expert_count", U32, 4)],
                              [("a", 0, [2, 3]), ("b", 8, [32]), ("c", 1, [3]), ("d", 30, [1, 1, 1, 2])]),
        "valid_quant": gguf([arch], [("q4k", 12, [256]), ("q6k", 14, [256]), ("mx", 39, [32, 2]), ("q40", 2, [32])]),
        "valid_align64": gguf([kv("general.alignment", U32, 64), arch], [("a", 0, [5]), ("b", 0, [7])], align=64),
        "valid_v2": gguf([arch], [("a", 0, [4])], version=2),
        "valid_empty_tensor": gguf([arch], [("z", 0, [0, 4]), ("a", 0, [1])]),
    }
    t = files["valid_tensors"]
    files["bad_magic"] = b"GGUG" + t[4:]
    files["bad_version1"] = t[:4] + struct.pack("<I", 1) + t[8:]
    files["bad_big_endian"] = t[:4] + struct.pack(">I", 3) + t[8:]
    files["bad_truncated"] = t[: len(t) - 30]  # into the last tensor, not just its padding
    files["bad_alignment3"] = gguf([kv("general.alignment", U32, 3)], [])
    files["bad_bool"] = gguf([kv("b", BOOL, 2)], [])
    files["bad_dup_key"] = gguf([kv("k", U8, 1), kv("k", U8, 2)], [])
    files["bad_depth"] = gguf([kv("d", ARR, (ARR, [(ARR, [(ARR, [(ARR, [(U8, [1])])])])]))], [])
    files["bad_offset"] = gguf([arch], [("a", 0, [5]), ("b", 0, [7])], offsets=[0, 20])
    files["bad_overlap"] = gguf([arch], [("a", 0, [5]), ("b", 0, [7])], offsets=[0, 0])
    files["bad_row_length"] = gguf([arch], [("a", 0, [2])]).replace(
        struct.pack("<QIQ", 2, 0, 0), struct.pack("<QIQ", 33, 8, 0))
    files["bad_n_dims"] = gguf([arch], [("a", 0, [1, 1, 1, 1, 2])])
    files["bad_type"] = gguf([arch], [("a", 0, [2])]).replace(struct.pack("<QIQ", 2, 0, 0), struct.pack("<QIQ", 2, 4, 0))
    for name, data in files.items():
        with open(os.path.join(OUT, name + ".gguf"), "wb") as f:
            f.write(data)
    print(f"wrote {len(files)} files to {OUT}")


if __name__ == "__main__":
    main()
