#!/usr/bin/env python3
"""Reference gpt-oss MoE block, for apex-ffn's tests.

Written from Hugging Face transformers' `models/gpt_oss/modeling_gpt_oss.py`
(GptOssTopKRouter, GptOssExperts, GptOssMLP) and `integrations/mxfp4.py`
(`_convert_moe_packed_tensors`, FP4_VALUES), in float64, with the tensor
names of the gpt-oss checkpoints under the layer prefix "model.layers.1.".

The block, per token x (1 × d):
    logits = x Wᵀ + b                          W: E × d, b: E (router, biased)
    top-K of the logits, softmax over the K selected logits (not over all E)
    gate_up = x @ gate_up_proj[e] + gate_up_proj_bias[e]       gate_up_proj[e]: d × 2f (in × out)
    gate = gate_up[..., ::2].clamp(max=limit)                  even columns
    up   = gate_up[..., 1::2].clamp(-limit, limit)             odd columns
    out  = ((up + 1) · gate · σ(α gate)) @ down_proj[e] + down_proj_bias[e]   down_proj[e]: f × d
    y    = Σ_k w_k out_{e_k}                   α = 1.702, limit = 7.0, no shared expert

    /usr/bin/python3 tools/gpt_oss_reference.py fixtures DIR [--seed-base N]

writes (N = 0 reproduces the committed files in tests/data/)

DIR/family_gpt_oss.safetensors, d=4 f=3 E=6 K=2 T=5, all float64: the weights
under their Hugging Face names, plus
    test.x       T × d   input
    test.y       T × d   block output
    test.dy      T × d   the upstream gradient r of the loss L = Σ y ⊙ r
    test.dx      T × d   ∂L/∂x
    test.experts T × K   selected experts (as float64), best first
    grad.<name>          ∂L/∂<name> for every weight (zeros for an expert no token chose)
The gate/up biases of a few columns are set near ±limit so that the clamps
are active for some selected (token, expert) pairs and inactive for others
(the counts are asserted); every pre-activation is at least 1e-3 from the
clamp limits, so finite differences do not straddle a kink. Expert E-1 gets
a very negative router bias and is chosen by no token (its gradients are 0).
After writing, autograd is checked against central finite differences
(every entry of every gradient, printed).

DIR/family_gpt_oss_mxfp4.safetensors, d=64 f=32 E=4 K=2 T=3: the experts in
the published MXFP4 form (random FP4 codes and E8M0 scales, drawn directly):
    mlp.experts.gate_up_proj_blocks  U8  E × 2f × d/32 × 16
    mlp.experts.gate_up_proj_scales  U8  E × 2f × d/32
    mlp.experts.down_proj_blocks     U8  E × d × f/32 × 16
    mlp.experts.down_proj_scales     U8  E × d × f/32
(rows = output features; byte j of a 32-block holds element 2j in its low
nibble and 2j+1 in its high nibble; value = FP4_VALUES[code] · 2^(scale − 127);
dequantized and transposed to E × in × out), the biases and the router as F32
(values rounded to bfloat16, so exact in BF16, F32 and F64), and
    test.gate_up_proj  F64  E × d × 2f   the dequantized tensors, bit for bit
    test.down_proj     F64  E × f × d    (including the −0.0 of code 8)
    test.x, test.y     F64  T × d        y from the dequantized weights in float64
    test.experts       F64  T × K

Ties: torch.topk does not document which of equal values it returns; x is
redrawn until every token's K-th/(K+1)-th logit gap exceeds 1e-3.
"""

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_reference import save_file  # noqa: E402  (the hand-written safetensors writer)

PREFIX = "model.layers.1."
MARGIN = 1e-3
ALPHA, LIMIT = 1.702, 7.0

ROUTER_W, ROUTER_B = PREFIX + "mlp.router.weight", PREFIX + "mlp.router.bias"
GATE_UP, GATE_UP_B = PREFIX + "mlp.experts.gate_up_proj", PREFIX + "mlp.experts.gate_up_proj_bias"
DOWN, DOWN_B = PREFIX + "mlp.experts.down_proj", PREFIX + "mlp.experts.down_proj_bias"

# "shared": 0 (no shared expert) keeps the config readable by the other families' fixture helpers.
SMALL = dict(d=4, f=3, E=6, K=2, shared=0, alpha=ALPHA, limit=LIMIT)
SMALL_TOKENS = 5
MXFP4 = dict(d=64, f=32, E=4, K=2, shared=0, alpha=ALPHA, limit=LIMIT)
MXFP4_TOKENS = 3

# integrations/mxfp4.py: the E2M1 value of each 4-bit code (bit 3 = sign).
FP4_VALUES = [+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


# ───────────────────────────────── the block ─────────────────────────────────

def route(x, w, b, K):
    """GptOssTopKRouter: (logits T × E, weights T × K, experts T × K best first, margin)."""
    logits = F.linear(x, w, b)  # T × E
    top, idx = torch.topk(logits, K, dim=-1)  # T × K each
    weights = F.softmax(top, dim=1, dtype=top.dtype)  # over the K selected logits only
    s = logits.sort(dim=-1, descending=True)[0]
    margin = (s[:, K - 1] - s[:, K]).min().item() if K < logits.shape[1] else float("inf")
    return logits, weights, idx, margin


def pre_activations(x, gate_up, gate_up_b):
    """x (N × d) @ gate_up (d × 2f) + bias: (gate N × f, up N × f) before the clamps."""
    gu = x @ gate_up + gate_up_b  # N × 2f
    return gu[..., ::2], gu[..., 1::2]  # interleaved: gate = even columns, up = odd


def expert(x, gate_up, gate_up_b, down, down_b):
    """GptOssExperts for one expert: N × d → N × d."""
    gate, up = pre_activations(x, gate_up, gate_up_b)
    gate = gate.clamp(max=LIMIT)  # one-sided: a very negative gate already gives glu ≈ 0
    up = up.clamp(min=-LIMIT, max=LIMIT)
    glu = gate * torch.sigmoid(gate * ALPHA)
    return ((up + 1) * glu) @ down + down_b  # N × f @ f × d


def block(cfg, p, x):
    """GptOssMLP on x (T × d): (y T × d, experts T × K, routing margin)."""
    _, w, idx, margin = route(x, p[ROUTER_W], p[ROUTER_B], cfg["K"])
    y = torch.zeros_like(x)
    for e in range(cfg["E"]):
        tok, slot = torch.where(idx == e)
        if tok.numel():
            out = expert(x[tok], p[GATE_UP][e], p[GATE_UP_B][e], p[DOWN][e], p[DOWN_B][e])
            y = y.index_add(0, tok, w[tok, slot, None] * out)
    return y, idx, margin


def clamp_stats(cfg, p, x, idx):
    """Counts of the selected pre-activations by clamp region, and the least distance to a limit."""
    n = dict(gate_clamped=0, gate_free=0, up_above=0, up_below=0, up_free=0)
    dist = float("inf")
    for e in range(cfg["E"]):
        gate, up = pre_activations(x, p[GATE_UP][e], p[GATE_UP_B][e])  # every token, chosen or not
        dist = min(dist, (gate - LIMIT).abs().min().item(), (up.abs() - LIMIT).abs().min().item())
        sel = (idx == e).any(dim=1)
        g, u = gate[sel], up[sel]
        n["gate_clamped"] += int((g > LIMIT).sum())
        n["gate_free"] += int((g < LIMIT).sum())
        n["up_above"] += int((u > LIMIT).sum())
        n["up_below"] += int((u < -LIMIT).sum())
        n["up_free"] += int((u.abs() < LIMIT).sum())
    return n, dist


# ───────────────────────────── small float64 fixture ─────────────────────────────

def small_weights(cfg, gen):
    d, f, E = cfg["d"], cfg["f"], cfg["E"]

    def u(*shape, scale):
        return (torch.rand(*shape, generator=gen, dtype=torch.float64) * 2 - 1) * scale

    p = {ROUTER_W: u(E, d, scale=1.0), ROUTER_B: u(E, scale=0.5),
         GATE_UP: u(E, d, 2 * f, scale=d ** -0.5), GATE_UP_B: u(E, 2 * f, scale=0.5),
         DOWN: u(E, f, d, scale=f ** -0.5), DOWN_B: u(E, d, scale=0.5)}
    p[ROUTER_B][E - 1] = -20.0  # the last expert is chosen by no token: its gradients are zero
    # Put gate column 0 (gate_up column 0) near +limit and up columns 0 and 1
    # (gate_up columns 1 and 3) near +limit and −limit, so x decides which side.
    p[GATE_UP_B][:, 0] = LIMIT + u(E, scale=1.0)
    p[GATE_UP_B][:, 1] = LIMIT + u(E, scale=1.0)
    p[GATE_UP_B][:, 3] = -LIMIT + u(E, scale=1.0)
    return p


def write_small(out_dir, seed, tokens=SMALL_TOKENS):
    cfg = SMALL
    gen = torch.Generator().manual_seed(seed)
    for _ in range(1000):  # redraw until the routing has margins and the clamps are mixed
        p = small_weights(cfg, gen)
        x = (torch.rand(tokens, cfg["d"], generator=gen, dtype=torch.float64) * 2 - 1) * 1.5
        with torch.no_grad():
            _, idx, margin = block(cfg, p, x)
        n, dist = clamp_stats(cfg, p, x, idx)
        if (margin > MARGIN and dist > MARGIN and min(n.values()) >= 2
                and not (idx == cfg["E"] - 1).any()):
            break
    else:
        raise RuntimeError(f"gpt_oss: no draw with margins above {MARGIN} and mixed clamps")
    print(f"  routing margin {margin:.3g}, least distance to a clamp limit {dist:.3g}")
    print(f"  selected pre-activations: {n}")
    assert n["gate_clamped"] >= 2 and n["gate_free"] >= 2, n
    assert n["up_above"] >= 2 and n["up_below"] >= 2 and n["up_free"] >= 2, n
    assert margin > MARGIN and dist > MARGIN

    trained = {k: t.clone().requires_grad_(True) for k, t in p.items()}
    xg = x.clone().requires_grad_(True)
    y, idx, _ = block(cfg, trained, xg)
    dy = torch.rand(tokens, cfg["d"], generator=gen, dtype=torch.float64) * 2 - 1
    (y * dy).sum().backward()
    tensors = dict(p)
    tensors.update({"test.x": x, "test.y": y.detach(), "test.dy": dy, "test.dx": xg.grad,
                    "test.experts": idx.to(torch.float64)})
    for k, t in trained.items():
        tensors["grad." + k] = t.grad if t.grad is not None else torch.zeros_like(t)
    unused = trained[GATE_UP].grad[cfg["E"] - 1]
    assert unused.abs().max().item() == 0.0 and trained[ROUTER_W].grad[cfg["E"] - 1].abs().max().item() == 0.0
    meta = {"family": "gpt_oss", "prefix": PREFIX, "config": json.dumps(cfg, sort_keys=True)}
    path = os.path.join(out_dir, "family_gpt_oss.safetensors")
    save_file(path, tensors, meta)
    return path, tensors


def finite_difference_check(tensors, cfg=SMALL, h=1e-6, tol=1e-7):
    """Autograd gradients of the written fixture against central differences, every entry.

    The step h is far below the 1e-3 margins, so no step crosses a clamp limit
    or changes the routing (asserted); the error is relative to max(1, |grad|).
    """
    p = {k: tensors[k].clone() for k in (ROUTER_W, ROUTER_B, GATE_UP, GATE_UP_B, DOWN, DOWN_B)}
    x, dy = tensors["test.x"].clone(), tensors["test.dy"]
    idx0 = tensors["test.experts"].long()

    def loss():
        with torch.no_grad():
            y, idx, _ = block(cfg, p, x)
        assert torch.equal(idx, idx0), "a finite-difference step changed the routing"
        return (y * dy).sum().item()

    worst = 0.0
    for name, t, g in [("x", x, tensors["test.dx"])] + [(k, p[k], tensors["grad." + k]) for k in p]:
        flat, gflat = t.view(-1), g.reshape(-1)
        err, zeros = 0.0, 0
        for i in range(flat.numel()):
            keep = flat[i].item()
            flat[i] = keep + h
            up = loss()
            flat[i] = keep - h
            dn = loss()
            flat[i] = keep
            fd, ad = (up - dn) / (2 * h), gflat[i].item()
            err = max(err, abs(fd - ad) / max(1.0, abs(ad)))
            zeros += ad == 0.0
        worst = max(worst, err)
        short = name.replace(PREFIX, "")
        print(f"  dL/d {short:27s} {flat.numel():3d} entries ({zeros:3d} exactly 0): "
              f"autograd vs central difference, max rel err {err:.1e}")
    assert worst < tol, f"finite differences disagree with autograd: {worst:.3g}"
    return worst


# ─────────────────────────────── MXFP4 fixture ───────────────────────────────

def dequantize(blocks, scales):
    """`_convert_moe_packed_tensors` in float64: blocks E × R × G × 16, scales E × R × G → E × 32G × R."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float64)
    *prefix, G, B = blocks.shape
    rows = blocks.reshape(-1, B)  # (E·R·G) × 16 bytes
    exp = (scales.to(torch.int32) - 127).reshape(-1, 1)
    out = torch.empty(rows.shape[0], 2 * B, dtype=torch.float64)
    out[:, 0::2] = lut[(rows & 0x0F).long()]  # low nibble: element 2j of the 32-block
    out[:, 1::2] = lut[(rows >> 4).long()]  # high nibble: element 2j + 1
    out = torch.ldexp(out, exp)  # exact: a 2-bit significand times a power of two
    return out.reshape(*prefix, G * 2 * B).transpose(1, 2).contiguous()  # rows (out) ↔ in


def dequantize_by_element(blocks, scales):
    """The same map written element by element, as an independent check of `dequantize`."""
    E, R, G, B = blocks.shape
    out = torch.empty(E, G * 2 * B, R, dtype=torch.float64)
    b, s = blocks.tolist(), scales.tolist()
    for e in range(E):
        for r in range(R):
            for g in range(G):
                for i in range(2 * B):
                    byte = b[e][r][g][i // 2]
                    code = byte & 0x0F if i % 2 == 0 else byte >> 4
                    out[e, g * 2 * B + i, r] = FP4_VALUES[code] * 2.0 ** (s[e][r][g] - 127)
    return out


def bf16_exact(t):
    """float32 values representable in bfloat16 (the dtype of the published non-expert tensors)."""
    return t.to(torch.bfloat16).to(torch.float32)


def write_mxfp4(out_dir, seed, tokens=MXFP4_TOKENS):
    cfg = MXFP4
    d, f, E = cfg["d"], cfg["f"], cfg["E"]
    assert d % 32 == 0 and f % 32 == 0
    gen = torch.Generator().manual_seed(seed)

    def u(*shape, scale):
        return (torch.rand(*shape, generator=gen, dtype=torch.float64) * 2 - 1) * scale

    def codes(*shape):  # any byte: two uniform 4-bit codes, −0.0 (code 8) included
        return torch.randint(0, 256, shape, generator=gen, dtype=torch.int64).to(torch.uint8)

    def exps(*shape):  # E8M0 scales 2^-7 … 2^3
        return torch.randint(120, 131, shape, generator=gen, dtype=torch.int64).to(torch.uint8)

    q = {PREFIX + "mlp.experts.gate_up_proj_blocks": codes(E, 2 * f, d // 32, 16),
         PREFIX + "mlp.experts.gate_up_proj_scales": exps(E, 2 * f, d // 32),
         PREFIX + "mlp.experts.down_proj_blocks": codes(E, d, f // 32, 16),
         PREFIX + "mlp.experts.down_proj_scales": exps(E, d, f // 32)}
    dense = {k: bf16_exact(v) for k, v in {
        ROUTER_W: u(E, d, scale=d ** -0.5), ROUTER_B: u(E, scale=0.5),
        GATE_UP_B: u(E, 2 * f, scale=2.0), DOWN_B: u(E, d, scale=0.5)}.items()}
    gate_up = dequantize(q[PREFIX + "mlp.experts.gate_up_proj_blocks"], q[PREFIX + "mlp.experts.gate_up_proj_scales"])
    down = dequantize(q[PREFIX + "mlp.experts.down_proj_blocks"], q[PREFIX + "mlp.experts.down_proj_scales"])
    assert gate_up.shape == (E, d, 2 * f) and down.shape == (E, f, d)
    for mine, ref in ((gate_up, dequantize_by_element(q[PREFIX + "mlp.experts.gate_up_proj_blocks"],
                                                      q[PREFIX + "mlp.experts.gate_up_proj_scales"])),
                      (down, dequantize_by_element(q[PREFIX + "mlp.experts.down_proj_blocks"],
                                                   q[PREFIX + "mlp.experts.down_proj_scales"]))):
        assert torch.equal(mine.view(torch.int64), ref.view(torch.int64)), "dequantization disagrees"
    p = {k: v.to(torch.float64) for k, v in dense.items()}
    p[GATE_UP], p[DOWN] = gate_up, down
    for _ in range(1000):
        x = u(tokens, d, scale=0.15)  # small: the dequantized weights reach 6 · 2^3
        with torch.no_grad():
            y, idx, margin = block(cfg, p, x)
        n, _ = clamp_stats(cfg, p, x, idx)
        if margin > MARGIN and min(n.values()) >= 1:  # every clamp region visited
            break
    else:
        raise RuntimeError(f"gpt_oss mxfp4: no input with a routing margin above {MARGIN} and mixed clamps")
    print(f"  routing margin {margin:.3g}; selected pre-activations: {n}")
    tensors = dict(q)
    tensors.update(dense)
    tensors.update({"test.gate_up_proj": gate_up, "test.down_proj": down, "test.x": x, "test.y": y,
                    "test.experts": idx.to(torch.float64)})
    meta = {"family": "gpt_oss", "prefix": PREFIX, "config": json.dumps(cfg, sort_keys=True),
            "experts_format": "mxfp4"}
    path = os.path.join(out_dir, "family_gpt_oss_mxfp4.safetensors")
    save_file(path, tensors, meta)
    return path


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    fx = sub.add_parser("fixtures", help="write family_gpt_oss.safetensors and family_gpt_oss_mxfp4.safetensors")
    fx.add_argument("dir")
    fx.add_argument("--seed-base", type=int, default=0)
    a = ap.parse_args(argv)
    os.makedirs(a.dir, exist_ok=True)
    path, tensors = write_small(a.dir, a.seed_base + 201)
    print(path)
    print("  self-check of the reference's gradients:")
    finite_difference_check(tensors)
    print(write_mxfp4(a.dir, a.seed_base + 202))
    return 0


if __name__ == "__main__":
    sys.exit(main())
