#!/usr/bin/env python3
"""GGUF MoE blocks written by llama.cpp's own Python writer (PyPI `gguf`,
gguf-py), with a reference output computed in numpy by llama.cpp's
build_moe_ffn rules, for tests/test_gguf_moe_python.cpp.

    gguf_moe_reference.py OUTDIR

For every architecture (qwen3moe, qwen2moe, olmoe, llama with experts,
deepseek2, gpt-oss) and tensor type (F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q6_K, MXFP4) it
writes OUTDIR/<arch>_<type>.gguf (block 1 of 2; deepseek2's block 0 is a
leading dense block), <arch>_<type>.x (N x d float32 input) and .y (N x d
float64 output of block 1's MoE from the dequantized weights). Q4_K and Q6_K
have no quantizer in gguf-py: their blocks are random codes with finite
scales, dequantized by gguf-py.

gpt-oss follows llama.cpp's convert_hf_to_gguf.py GptOssModel: Hugging Face's
interleaved gate_up_proj (rows 0, 2, 4, ... gate; 1, 3, 5, ... up) and its
bias are split into ffn_gate_exps / ffn_up_exps and their biases; the router
bias is ffn_gate_inp.bias; the FFN norm is post_attention_norm. Its MXFP4
experts start as Hugging Face's MXFP4 blocks (two codes a byte, element 2i in
the low nibble of byte i, an E8M0 scale per 32) and are repacked into ggml's
order (element i low, i + 16 high, the scale byte first), as the converter
does; the reference dequantizes Hugging Face's blocks (integrations/mxfp4.py's
rule), so the repack is checked too. Its reference is llama.cpp's OPENAI_MOE
graph: top-K of the biased logits, softmax over the K (SOFTMAX_WEIGHT), the
swiglu_oai activation with alpha 1.702, limit 7, and the biases. Exits 0 with a message when gguf or numpy is
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


ALPHA, LIMIT = 1.702, 7.0  # llama.cpp's LLM_FFN_SWIGLU_OAI_MOE constants
FP4 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])


def hf_mxfp4(rng, rows, cols):
    """Hugging Face MXFP4 (blocks rows x cols/32 x 16 uint8, scales rows x cols/32
    uint8) and its dequantized rows x cols, by transformers' rule."""
    blocks = rng.integers(0, 256, size=(rows, cols // 32, 16), dtype=np.uint8)
    scales = rng.integers(119, 124, size=(rows, cols // 32), dtype=np.uint8)
    vals = np.empty((rows, cols // 32, 32))
    vals[..., 0::2] = FP4[blocks & 0x0F]
    vals[..., 1::2] = FP4[blocks >> 4]
    vals *= np.exp2(scales.astype(np.float64) - 127)[..., None]
    return blocks, scales, vals.reshape(rows, cols)


def ggml_mxfp4(blocks, scales):
    """The converter's repack: codes of element i and i + 16 in one byte (low,
    high), the scale byte first: ggml's block_mxfp4 rows (uint8)."""
    codes = np.empty(blocks.shape[:-1] + (32,), dtype=np.uint8)
    codes[..., 0::2], codes[..., 1::2] = blocks & 0x0F, blocks >> 4
    packed = codes[..., :16] | (codes[..., 16:] << 4)
    out = np.concatenate([scales[..., None], packed], axis=-1)
    return out.reshape(blocks.shape[0], -1)


def gpt_oss_expert(x, g, u, dn, bg, bu, bd):
    gate = np.minimum(x @ g.T + bg, LIMIT)
    up = np.clip(x @ u.T + bu, -LIMIT, LIMIT)
    return ((up + 1.0) * gate / (1.0 + np.exp(-ALPHA * gate))) @ dn.T + bd


def gpt_oss_reference(x, t):
    """llama.cpp's OPENAI_MOE block: top-K of x R^T + b_r, softmax over the K."""
    logits = x @ t["router"].T + t["router_b"]
    y = np.zeros((N, D))
    for i in range(N):
        idx = np.argsort(-logits[i], kind="stable")[:K]
        w = np.exp(logits[i, idx] - logits[i, idx].max())
        w /= w.sum()
        for k, e in enumerate(idx):
            y[i] += w[k] * gpt_oss_expert(x[i:i + 1], t["gate"][e], t["up"][e], t["down"][e], t["bg"][e], t["bu"][e],
                                          t["bd"][e])[0]
    return y


def gpt_oss_weights(rng, tname):
    """Hugging Face's experts (gate_up interleaved), split as the converter does:
    (gate, up, down tensors for the writer, raw dtype, float64 gate, up, down)."""
    if tname == "MXFP4":
        gu_b, gu_s, gu = zip(*[hf_mxfp4(rng, 2 * F, D) for _ in range(E)])
        dn_b, dn_s, dn = zip(*[hf_mxfp4(rng, D, F) for _ in range(E)])
        gu_b, gu_s, dn_b, dn_s = map(np.stack, (gu_b, gu_s, dn_b, dn_s))
        data = [np.stack([ggml_mxfp4(b[i], s[i]) for i in range(E)])
                for b, s in ((gu_b[:, ::2], gu_s[:, ::2]), (gu_b[:, 1::2], gu_s[:, 1::2]), (dn_b, dn_s))]
        mats = [[m[::2] for m in gu], [m[1::2] for m in gu], list(dn)]
        for d, m in zip(data, mats):  # gguf-py reads the repacked rows as the Hugging Face values
            assert np.array_equal(dequantize(d.reshape(-1, d.shape[-1]), Q.MXFP4).astype(np.float64).reshape(
                E, -1, m[0].shape[1]), np.stack(m))
        return data, Q.MXFP4, mats
    data, mats, raw = [], [], None
    for rows, cols in ((F, D), (F, D), (D, F)):
        d, raw, m = stacked(rng, tname, E, rows, cols)
        data.append(d), mats.append(m)
    return data, raw, mats


def write_gpt_oss(outdir, tname, seed):
    name = "gpt-oss"
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(os.path.join(outdir, f"{name}_{tname}.gguf"), name)
    w.add_block_count(LAYER + 1)
    w.add_embedding_length(D)
    w.add_expert_feed_forward_length(F)
    w.add_expert_count(E)
    w.add_expert_used_count(K)
    w.add_layer_norm_rms_eps(1e-5)
    blk = f"blk.{LAYER}."
    t = {"router": rng.standard_normal((E, D)).astype(np.float32),
         "router_b": (rng.standard_normal(E) * 0.5).astype(np.float32)}
    w.add_tensor(blk + "ffn_gate_inp.weight", t["router"])
    w.add_tensor(blk + "ffn_gate_inp.bias", t["router_b"])
    data, raw, (t["gate"], t["up"], t["down"]) = gpt_oss_weights(rng, tname)
    for tensor, d in zip(("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"), data):
        w.add_tensor(blk + tensor + ".weight", d, raw_dtype=raw)
    gate_up_b = (rng.standard_normal((E, 2 * F)) * 0.5).astype(np.float32)  # interleaved, as Hugging Face's
    t["bg"], t["bu"] = gate_up_b[:, ::2].copy(), gate_up_b[:, 1::2].copy()
    t["bd"] = (rng.standard_normal((E, D)) * 0.1).astype(np.float32)
    for tensor, b in (("ffn_gate_exps", t["bg"]), ("ffn_up_exps", t["bu"]), ("ffn_down_exps", t["bd"])):
        w.add_tensor(blk + tensor + ".bias", b)
    w.add_tensor(blk + "post_attention_norm.weight", (1.0 + 0.1 * rng.standard_normal(D)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    x = (rng.standard_normal((N, D)) * 4).astype(np.float32)  # large enough that the clamps act
    x.tofile(os.path.join(outdir, f"{name}_{tname}.x"))
    t = {k: (np.asarray(v, dtype=np.float64) if not isinstance(v, list) else v) for k, v in t.items()}
    gpt_oss_reference(x.astype(np.float64), t).tofile(os.path.join(outdir, f"{name}_{tname}.y"))


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
    for tname in TYPES:
        write_gpt_oss(outdir, tname, seed)
        seed += 1
    print(f"wrote {(len(ARCHS) + 1) * len(TYPES)} GGUF blocks to {outdir}")


if __name__ == "__main__":
    main()
