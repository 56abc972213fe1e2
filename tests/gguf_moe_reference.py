#!/usr/bin/env python3
"""GGUF MoE blocks written by llama.cpp's own Python writer (PyPI `gguf`,
gguf-py), with a reference output computed in numpy by llama.cpp's
build_moe_ffn rules, for tests/test_gguf_moe_python.cpp.

    gguf_moe_reference.py OUTDIR

For every architecture (qwen3moe, qwen2moe, olmoe, llama with experts,
deepseek2) and tensor type (F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q6_K, MXFP4) it
writes OUTDIR/<arch>_<type>.gguf (block 1 of 2; deepseek2's block 0 is a
leading dense block), <arch>_<type>.x (N x d float32 input) and .y (N x d
float64 output of block 1's MoE from the dequantized weights). Q4_K and Q6_K
have no quantizer in gguf-py: their blocks are random codes with finite
scales, dequantized by gguf-py. Exits 0 with a message when gguf or numpy is
missing (the C++ test then skips)."""

import os
import sys

try:
    import numpy as np
    import gguf
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize, quantize
except ImportError as e:  # pragma: no cover
    print(f"SKIP: {e}: the PyPI packages gguf and numpy are needed")
    sys.exit(0)

D, F, E, K, N, LAYER = 256, 256, 8, 2, 7, 1
TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K", "Q6_K", "MXFP4"]


def random_k_blocks(rng, qtype, rows, cols):
    """Random Q4_K / Q6_K rows (uint8) of random codes, their fp16 scales set
    so the dequantized weights have an rms near 0.05 (as the other types)."""
    block_bytes = {Q.Q4_K: 144, Q.Q6_K: 210}[qtype]
    nb = cols // 256
    raw = rng.integers(0, 256, size=(rows, nb, block_bytes), dtype=np.uint8)
    where = slice(0, 4) if qtype == Q.Q4_K else slice(208, 210)  # d, dmin first; Q6_K: d last
    scales = rng.uniform(0.5, 1.0, size=(rows, nb, (where.stop - where.start) // 2))
    for _ in range(2):  # fit the scale, then round it to fp16 again
        raw[:, :, where] = scales.astype(np.float16).view(np.uint8).reshape(rows, nb, -1)
        rms = np.sqrt(np.mean(dequantize(raw.reshape(rows, -1), qtype).astype(np.float64) ** 2))
        scales = scales * (0.05 / rms)
    raw[:, :, where] = scales.astype(np.float16).view(np.uint8).reshape(rows, nb, -1)
    return raw.reshape(rows, nb * block_bytes)


def make_matrix(rng, tname, rows, cols):
    """(bytes array for the writer, raw_dtype or None, float64 dequantized rows x cols)."""
    w = rng.standard_normal((rows, cols)).astype(np.float32) * 0.05
    if tname == "F32":
        return w, None, w.astype(np.float64)
    if tname == "F16":
        h = w.astype(np.float16)
        return h, None, h.astype(np.float64)
    qtype = Q[tname]
    q = random_k_blocks(rng, qtype, rows, cols) if qtype in (Q.Q4_K, Q.Q6_K) else quantize(w, qtype)
    return q, qtype, dequantize(q, qtype).astype(np.float64).reshape(rows, cols)


def stacked(rng, tname, n, rows, cols):
    """n matrices rows x cols as one 3-D tensor (numpy shape n, rows, cols[bytes])."""
    parts = [make_matrix(rng, tname, rows, cols) for _ in range(n)]
    data = np.stack([p[0] for p in parts])
    return data, parts[0][1], [p[2] for p in parts]


def silu(v):
    return v / (1.0 + np.exp(-v))


def expert(x, g, u, dn):
    return (silu(x @ g.T) * (x @ u.T)) @ dn.T


def reference(x, arch, t):
    """llama.cpp's build_moe_ffn (llama-graph.cpp) for this block, in float64."""
    logits = x @ t["router"].T
    if arch["sigmoid"]:
        p = 1.0 / (1.0 + np.exp(-logits))
    else:
        p = np.exp(logits - logits.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
    sel = p + t["bias"] if t.get("bias") is not None else p.copy()
    if arch.get("groups", 1) > 1:
        g, gu = arch["groups"], arch["groups_used"]
        grp = sel.reshape(N, g, E // g)
        score = np.sort(grp, axis=2)[:, :, -2:].sum(axis=2)
        keep = np.argsort(-score, axis=1, kind="stable")[:, :gu]
        mask = np.full((N, g), True)
        for i in range(N):
            mask[i, keep[i]] = False
        grp = np.where(mask[:, :, None], -np.inf, grp)
        sel = grp.reshape(N, E)
    y = np.zeros((N, D))
    for i in range(N):
        idx = np.argsort(-sel[i], kind="stable")[:K]
        w = p[i, idx]
        if arch["norm"]:
            w = w / w.sum()
        w = w * arch.get("scale", 1.0)
        for k, e in enumerate(idx):
            y[i] += w[k] * expert(x[i:i + 1], t["gate"][e], t["up"][e], t["down"][e])[0]
    if "sg" in t:
        s = expert(x, t["sg"], t["su"], t["sd"])
        if "shared_gate" in t:
            s = s * (1.0 / (1.0 + np.exp(-(x @ t["shared_gate"]))))[:, None]
        y += s
    return y


ARCHS = {
    "qwen3moe": dict(width="expert_feed_forward_length", norm=True, sigmoid=False),
    "qwen2moe": dict(width="expert_feed_forward_length", norm=False, sigmoid=False, shared=512, gated=True),
    "olmoe": dict(width="feed_forward_length", norm=False, sigmoid=False),
    "llama": dict(width="feed_forward_length", norm=True, sigmoid=False),
    "deepseek2": dict(width="expert_feed_forward_length", norm=True, sigmoid=True, shared=512, scale=2.5,
                      groups=4, groups_used=2),
}


def write(outdir, name, spec, tname, seed):
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(os.path.join(outdir, f"{name}_{tname}.gguf"), name)
    w.add_block_count(LAYER + 1)
    w.add_embedding_length(D)
    w.add_uint32(f"{name}.{spec['width']}", F)
    w.add_expert_count(E)
    w.add_expert_used_count(K)
    w.add_layer_norm_rms_eps(1e-6)
    t = {}
    blk = f"blk.{LAYER}."
    t["router"] = rng.standard_normal((E, D)).astype(np.float32)
    w.add_tensor(blk + "ffn_gate_inp.weight", t["router"])
    for key, tensor, rows, cols in (("gate", "ffn_gate_exps", F, D), ("up", "ffn_up_exps", F, D),
                                    ("down", "ffn_down_exps", D, F)):
        data, raw, mats = stacked(rng, tname, E, rows, cols)
        t[key] = mats
        w.add_tensor(blk + tensor + ".weight", data, raw_dtype=raw)
    if "shared" in spec:
        fs = spec["shared"]
        for key, tensor, rows, cols in (("sg", "ffn_gate_shexp", fs, D), ("su", "ffn_up_shexp", fs, D),
                                        ("sd", "ffn_down_shexp", D, fs)):
            data, raw, mat = make_matrix(rng, tname, rows, cols)
            t[key] = mat
            w.add_tensor(blk + tensor + ".weight", data, raw_dtype=raw)
    if spec.get("gated"):
        w.add_expert_shared_feed_forward_length(spec["shared"])
        t["shared_gate"] = rng.standard_normal(D).astype(np.float32)
        w.add_tensor(blk + "ffn_gate_inp_shexp.weight", t["shared_gate"])
    if name == "deepseek2":
        w.add_leading_dense_block_count(1)
        w.add_expert_shared_count(spec["shared"] // F)
        w.add_expert_weights_scale(spec["scale"])
        w.add_expert_weights_norm(True)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_uint32(f"{name}.expert_group_count", spec["groups"])
        w.add_uint32(f"{name}.expert_group_used_count", spec["groups_used"])
        t["bias"] = (rng.standard_normal(E) * 0.1).astype(np.float32)
        w.add_tensor(blk + "exp_probs_b.bias", t["bias"])
    w.add_tensor(blk + "ffn_norm.weight", (1.0 + 0.1 * rng.standard_normal(D)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    x = rng.standard_normal((N, D)).astype(np.float32)
    x.tofile(os.path.join(outdir, f"{name}_{tname}.x"))
    reference(x.astype(np.float64), spec, t).tofile(os.path.join(outdir, f"{name}_{tname}.y"))


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    outdir = sys.argv[1]
    os.makedirs(outdir, exist_ok=True)
    seed = 100
    for name, spec in ARCHS.items():
        for tname in TYPES:
            write(outdir, name, spec, tname, seed)
            seed += 1
    print(f"wrote {len(ARCHS) * len(TYPES)} GGUF blocks to {outdir}")


if __name__ == "__main__":
    main()
