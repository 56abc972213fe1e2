#!/usr/bin/env python3
"""Reference MoE blocks of the open MoE families, for apex-ffn's tests.

Each block is written here from its family's public modelling code
(DeepSeek-V3 `inference/model.py` Gate/MoE; Hugging Face
`modeling_mixtral.py` MixtralSparseMoeBlock, `modeling_qwen2_moe.py`
Qwen2MoeSparseMoeBlock, `modeling_qwen3_moe.py` Qwen3MoeSparseMoeBlock,
`modeling_olmoe.py` OlmoeSparseMoeBlock), in float64, with the tensor names
of the family's checkpoints under the layer prefix "model.layers.1.".

    python3 tools/moe_families.py fixtures DIR [--seed-base N]

writes DIR/family_<model_type>.safetensors for each family: the block's
weights under its Hugging Face names, plus
    test.x       T × d   input
    test.y       T × d   block output
    test.dy      T × d   the upstream gradient r of the loss L = Σ y ⊙ r
    test.dx      T × d   ∂L/∂x
    test.experts T × K   selected experts (as float64), best first
    grad.<name>          ∂L/∂<name> for every trained weight
N = 0 reproduces the committed files in tests/data/.

Ties: torch.topk does not document which of equal values it returns; the
C++ router takes the lower index. The inputs are redrawn until every
token's K-th/(K+1)-th expert score gap and its kept/dropped group-score gap
exceed 1e-3, so both choose the same experts and the choice does not
depend on rounding.
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

# Small shapes per family: d, f (routed), E, K, shared width (0: none), groups, topk_group
FAMILIES = {
    "deepseek_v3": dict(d=4, f=2, E=8, K=3, shared=3, groups=4, topk_group=2, scale=2.5),
    "mixtral": dict(d=4, f=2, E=8, K=2, shared=0),
    "qwen2_moe": dict(d=4, f=2, E=8, K=2, shared=3),
    "qwen3_moe": dict(d=4, f=2, E=8, K=3, shared=0),
    "olmoe": dict(d=4, f=2, E=8, K=3, shared=0),
}


def mlp(x, w_gate, w_up, w_down):
    """down(silu(gate(x)) * up(x)); weights as nn.Linear stores them (out × in)."""
    return F.linear(F.silu(F.linear(x, w_gate)) * F.linear(x, w_up), w_down)


def expert_names(family, e):
    if family == "mixtral":
        b = f"{PREFIX}block_sparse_moe.experts.{e}."
        return b + "w1.weight", b + "w3.weight", b + "w2.weight"
    b = f"{PREFIX}mlp.experts.{e}."
    return b + "gate_proj.weight", b + "up_proj.weight", b + "down_proj.weight"


def gate_name(family):
    return PREFIX + ("block_sparse_moe.gate.weight" if family == "mixtral" else "mlp.gate.weight")


def route(family, cfg, logits, bias):
    """(weights T × K, experts T × K best first, margin) as the family computes them."""
    E, K = cfg["E"], cfg["K"]
    if family == "deepseek_v3":
        # Gate.forward: sigmoid, bias for selection only, group-limited top-k.
        scores = logits.sigmoid()
        original = scores
        scores = scores + bias
        G, TG = cfg["groups"], cfg["topk_group"]
        grouped = scores.view(-1, G, E // G)
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # with a bias: sum of the top-2
        gs_sorted = group_scores.sort(dim=-1, descending=True)[0]
        group_margin = (gs_sorted[:, TG - 1] - gs_sorted[:, TG]).min().item()
        keep = group_scores.topk(TG, dim=-1)[1]
        mask = torch.ones(scores.shape[0], G, dtype=torch.bool).scatter_(1, keep, False)
        masked = scores.view(-1, G, E // G).masked_fill(mask.unsqueeze(-1), float("-inf")).flatten(1)
        s_sorted = masked.sort(dim=-1, descending=True)[0]
        margin = min(group_margin, (s_sorted[:, K - 1] - s_sorted[:, K]).min().item())
        idx = masked.topk(K, dim=-1)[1]
        w = original.gather(1, idx)
        # score_func == "sigmoid": renormalise. Hugging Face's DeepseekV3MoE adds
        # 1e-20 to the denominator (inference/model.py does not); apex-ffn
        # follows Hugging Face, identical unless every selected sigma is tiny.
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return w * cfg["scale"], idx, margin
    # Mixtral / Qwen2-MoE / Qwen3-MoE / OLMoE: softmax over all E, top-k.
    probs = F.softmax(logits, dim=1, dtype=torch.float64)
    p_sorted = probs.sort(dim=-1, descending=True)[0]
    margin = (p_sorted[:, K - 1] - p_sorted[:, K]).min().item()
    w, idx = torch.topk(probs, K, dim=-1)
    if family in ("mixtral", "qwen3_moe"):  # Mixtral always; Qwen3 norm_topk_prob = true
        w = w / w.sum(dim=-1, keepdim=True)
    return w, idx, margin


def block(family, cfg, p, x):
    logits = F.linear(x, p[gate_name(family)])
    bias = p.get(PREFIX + "mlp.gate.e_score_correction_bias")
    w, idx, margin = route(family, cfg, logits, bias)
    y = torch.zeros_like(x)
    for e in range(cfg["E"]):
        tok, slot = torch.where(idx == e)
        if tok.numel():
            g, u, dn = (p[n] for n in expert_names(family, e))
            y = y.index_add(0, tok, w[tok, slot, None] * mlp(x[tok], g, u, dn))
    if family == "qwen2_moe":
        b = PREFIX + "mlp.shared_expert."
        sh = mlp(x, p[b + "gate_proj.weight"], p[b + "up_proj.weight"], p[b + "down_proj.weight"])
        y = y + torch.sigmoid(F.linear(x, p[PREFIX + "mlp.shared_expert_gate.weight"])) * sh
    if family == "deepseek_v3":
        b = PREFIX + "mlp.shared_experts."
        y = y + mlp(x, p[b + "gate_proj.weight"], p[b + "up_proj.weight"], p[b + "down_proj.weight"])
    return y, idx, margin


def random_weights(family, cfg, gen):
    d, f, E = cfg["d"], cfg["f"], cfg["E"]

    def u(*shape, scale):
        return (torch.rand(*shape, generator=gen, dtype=torch.float64) * 2 - 1) * scale

    p = {gate_name(family): u(E, d, scale=1.0)}
    for e in range(E):
        g, up, dn = expert_names(family, e)
        p[g], p[up], p[dn] = u(f, d, scale=d ** -0.5), u(f, d, scale=d ** -0.5), u(d, f, scale=f ** -0.5)
    fs = cfg["shared"]
    if family == "qwen2_moe":
        b = PREFIX + "mlp.shared_expert."
        p[PREFIX + "mlp.shared_expert_gate.weight"] = u(1, d, scale=d ** -0.5)
    elif family == "deepseek_v3":
        b = PREFIX + "mlp.shared_experts."
        p[PREFIX + "mlp.gate.e_score_correction_bias"] = u(E, scale=0.05)
    if fs:
        p[b + "gate_proj.weight"], p[b + "up_proj.weight"] = u(fs, d, scale=d ** -0.5), u(fs, d, scale=d ** -0.5)
        p[b + "down_proj.weight"] = u(d, fs, scale=fs ** -0.5)
    return p


def write_family(out_dir, family, seed, tokens=4):
    cfg = FAMILIES[family]
    gen = torch.Generator().manual_seed(seed)
    p = random_weights(family, cfg, gen)
    for _ in range(1000):  # redraw x until no (near-)tie decides a choice
        x = (torch.rand(tokens, cfg["d"], generator=gen, dtype=torch.float64) * 2 - 1) * 1.5
        with torch.no_grad():
            _, _, margin = block(family, cfg, p, x)
        if margin > MARGIN:
            break
    else:
        raise RuntimeError(f"{family}: no input with a routing margin above {MARGIN}")
    trained = {n: t.clone().requires_grad_(not n.endswith("e_score_correction_bias")) for n, t in p.items()}
    xg = x.clone().requires_grad_(True)
    y, idx, _ = block(family, cfg, trained, xg)
    dy = torch.rand(tokens, cfg["d"], generator=gen, dtype=torch.float64) * 2 - 1
    (y * dy).sum().backward()
    tensors = dict(p)
    tensors.update({"test.x": x, "test.y": y.detach(), "test.dy": dy, "test.dx": xg.grad,
                    "test.experts": idx.to(torch.float64)})
    for n, t in trained.items():
        if t.requires_grad:
            tensors["grad." + n] = t.grad if t.grad is not None else torch.zeros_like(t)  # expert not chosen
    meta = {"family": family, "prefix": PREFIX, "config": json.dumps(cfg, sort_keys=True)}
    path = os.path.join(out_dir, f"family_{family}.safetensors")
    save_file(path, tensors, meta)
    return path


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    fx = sub.add_parser("fixtures", help="write family_<name>.safetensors for every family")
    fx.add_argument("dir")
    fx.add_argument("--seed-base", type=int, default=0)
    a = ap.parse_args(argv)
    os.makedirs(a.dir, exist_ok=True)
    for i, family in enumerate(FAMILIES):
        print(write_family(a.dir, family, a.seed_base + 101 + i))
    return 0


if __name__ == "__main__":
    sys.exit(main())
