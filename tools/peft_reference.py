#!/usr/bin/env python3
"""peft's LoRA adapter files on the MoE blocks of transformers, for apex-ffn's tests.

For each MoE family transformers holds (Qwen3-MoE, Qwen2-MoE with its gated
shared expert, OLMoE, Mixtral, DeepSeek-V3 with its shared experts,
gpt-oss), a tiny causal LM of two MoE layers is built from a small config
with random weights (every floating-point tensor in float64), wrapped with
peft's LoRA on the expert projections (`LoraConfig(target_parameters=…)`
on the fused 3-D expert weights, the shared experts' Linear layers by
`target_modules` or `target_parameters`; lora_B drawn at random, as a
trained adapter has it), and run block by block. The families' routers
compute in float32 (softmax(dtype=torch.float), `.float()`,
`.type(torch.float32)`); for a float64 reference each router's own forward
is recompiled with that one cast replaced by the input's dtype (PRECISION
below; every replacement is asserted to apply), nothing else of the
modelling code is changed. Beside them, "apex": apex-ffn's own MoE block as
tools/torch_reference.py defines it in PyTorch (modules experts.{e}.w_gate,
w_up, w_down and shared_experts.{s}.*, one nn.Linear each), wrapped alone
with LoraConfig(target_modules=<its Linear modules>): the names of the
library's apex layout.

    python3 tools/peft_reference.py fixtures DIR [--seed-base N]

writes, for each family F, DIR/F/:
    model/         the base model as save_pretrained writes it (config.json,
                   model.safetensors under the family's checkpoint names, F64);
                   for apex: base.safetensors, the block's state_dict with its
                   configuration under __metadata__ "apex.config"
    adapter/       the adapter as PeftModel.save_pretrained writes it (F64)
    adapter_bf16/  the same adapter saved from the model cast to bfloat16
    io.safetensors x (T × d), r (T × d), and per layer L (apex: L = 0): y.L = block_L(x),
                   dx.L = ∂L/∂x of L = Σ y.L ⊙ r (torch autograd), and
                   grad.<adapter key> = ∂L/∂(that tensor) for its layer
    python3 tools/peft_reference.py check DIR [--tol 1e-10]

for each DIR/F/from_apex/ (an adapter apex-ffn saved, and io.safetensors
with the x and y.L apex-ffn computed): loads DIR/F/model with
AutoModelForCausalLM, the adapter with PeftModel.from_pretrained, checks
that every tensor of the file is in the loaded model exactly (no key
dropped, renamed or converted), and compares each block's output with
y.L (norm-wise relative error ≤ tol). Exit status 0 if all match.

Ties: the inputs are redrawn until every token's K-th/(K+1)-th selection
score gap (and DeepSeek-V3's kept/dropped group-score gap) exceeds 1e-3,
so apex-ffn and torch choose the same experts.
"""

import argparse
import inspect
import json
import os
import shutil
import sys
import textwrap
import types

import torch
import torch.nn.functional as F

try:
    import transformers
    import peft
    from peft import LoraConfig, PeftModel, get_peft_model
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForCausalLM
except ImportError as e:  # the CTest wiring checks the imports; this names what is missing when run by hand
    sys.exit(f"peft_reference.py needs torch, transformers, peft and safetensors: {e}")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_reference  # noqa: E402  (apex-ffn's MoE block in PyTorch)

LAYERS = (0, 1)
TOKENS = 7
MARGIN = 1e-3
BASE = dict(hidden_size=8, num_hidden_layers=len(LAYERS), num_attention_heads=2, num_key_value_heads=1, head_dim=4,
            vocab_size=32, intermediate_size=12, experts_implementation="eager")

# Per family: the config beside BASE, and the LoRA the fixture adapts it with.
FAMILIES = {
    "qwen3_moe": dict(
        config=dict(moe_intermediate_size=6, num_experts=6, num_experts_per_tok=2, norm_topk_prob=True),
        lora=dict(r=2, lora_alpha=5, target_parameters=["experts.gate_up_proj", "experts.down_proj"])),
    "qwen2_moe": dict(  # the shared expert by target_modules, as its Linear layers are adapted in practice
        config=dict(moe_intermediate_size=6, num_experts=6, num_experts_per_tok=2, shared_expert_intermediate_size=5),
        lora=dict(r=3, lora_alpha=4, target_parameters=["experts.gate_up_proj", "experts.down_proj"],
                  target_modules=["shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj"])),
    "olmoe": dict(  # down only: one ParamWrapper, no base_layer in the names
        config=dict(intermediate_size=6, num_experts=6, num_experts_per_tok=3),
        lora=dict(r=2, lora_alpha=3, target_parameters=["experts.down_proj"])),
    "mixtral": dict(  # gate_up only, rank-stabilised scale
        config=dict(intermediate_size=6, num_local_experts=6, num_experts_per_tok=2),
        lora=dict(r=2, lora_alpha=4, use_rslora=True, target_parameters=["experts.gate_up_proj"])),
    "deepseek_v3": dict(  # the shared experts by target_parameters: peft's v4→v5 shim retargets their target_modules
        config=dict(moe_intermediate_size=4, n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=1, n_group=4,
                    topk_group=2, first_k_dense_replace=0, routed_scaling_factor=2.5, norm_topk_prob=True,
                    q_lora_rank=None, kv_lora_rank=4, qk_rope_head_dim=2, qk_nope_head_dim=2, v_head_dim=4),
        lora=dict(r=2, lora_alpha=6, target_parameters=[
            "experts.gate_up_proj", "experts.down_proj", "shared_experts.gate_proj.weight",
            "shared_experts.up_proj.weight", "shared_experts.down_proj.weight"])),
    "gpt_oss": dict(
        config=dict(intermediate_size=6, num_local_experts=6, num_experts_per_tok=2,
                    layer_types=["full_attention"] * len(LAYERS)),
        lora=dict(r=2, lora_alpha=5, use_rslora=True, target_parameters=["experts.gate_up_proj", "experts.down_proj"])),
}

# The routers' float32 casts, replaced by the input's dtype for a float64 reference.
SOFTMAX_F32 = [("dtype=torch.float,", "dtype=router_logits.dtype,")]
PRECISION = {
    "qwen3_moe": SOFTMAX_F32, "qwen2_moe": SOFTMAX_F32, "olmoe": SOFTMAX_F32,
    "mixtral": [("router_logits.float()", "router_logits")],
    "deepseek_v3": [("torch.float32", "hidden_states.dtype")],
    "gpt_oss": [],  # its router keeps the input's dtype
}


def block_of(model, layer):
    return model.get_base_model().model.layers[layer].mlp if isinstance(model, PeftModel) \
        else model.model.layers[layer].mlp


def router_of(family, block):
    return block.router if family == "gpt_oss" else block.gate


def float64_routers(family, model):
    """Each MoE block's router forward recompiled with its float32 casts replaced (PRECISION)."""
    for layer in LAYERS:
        router = router_of(family, block_of(model, layer))
        src = textwrap.dedent(inspect.getsource(type(router).forward))
        for old, new in PRECISION[family]:
            if old not in src:
                raise RuntimeError(f"{family}: the router's forward no longer contains {old!r}; update PRECISION")
            src = src.replace(old, new)
        scope = {}
        exec(compile(src, f"<{family} router, float64>", "exec"), vars(sys.modules[type(router).__module__]), scope)
        router.forward = types.MethodType(scope["forward"], router)


def run_block(family, block, x):
    y = block(x.unsqueeze(0))
    return (y[0] if family == "gpt_oss" else y).squeeze(0)  # GptOssMLP returns (y, router scores)


def selection_margin(family, cfg, block, x):
    """Smallest gap between the K-th and (K+1)-th selection score (and group score) over the tokens of x."""
    router = router_of(family, block)
    K = cfg.num_experts_per_tok
    logits = F.linear(x, router.weight, getattr(router, "bias", None) if family == "gpt_oss" else None)
    if family != "deepseek_v3":  # softmax families and gpt-oss: the order of the logits decides
        s = logits.sort(dim=-1, descending=True)[0]
        return (s[:, K - 1] - s[:, K]).min().item()
    scores = logits.sigmoid() + router.e_score_correction_bias
    G, TG, E = cfg.n_group, cfg.topk_group, cfg.n_routed_experts
    group = scores.view(-1, G, E // G).topk(2, dim=-1)[0].sum(dim=-1)
    gs = group.sort(dim=-1, descending=True)[0]
    keep = group.topk(TG, dim=-1)[1]
    drop = torch.ones_like(group, dtype=torch.bool).scatter_(1, keep, False)
    masked = scores.view(-1, G, E // G).masked_fill(drop.unsqueeze(-1), float("-inf")).flatten(1)
    s = masked.sort(dim=-1, descending=True)[0]
    return min((gs[:, TG - 1] - gs[:, TG]).min().item(), (s[:, K - 1] - s[:, K]).min().item())


def build_model(family, seed):
    """The tiny causal LM in float64, its MoE blocks redrawn at a scale where the experts matter."""
    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(family, **{**BASE, **FAMILIES[family]["config"]})
    model = AutoModelForCausalLM.from_config(cfg).double().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in LAYERS:
            for name, t in block_of(model, layer).state_dict(keep_vars=True).items():
                fan_in = t.shape[-1] if t.dim() >= 2 else 1
                scale = 0.05 if "correction_bias" in name else (0.3 if t.dim() == 1 or "bias" in name
                                                                 else fan_in ** -0.5 * 1.5)
                t.copy_((torch.rand(t.shape, generator=gen, dtype=torch.float64) * 2 - 1) * scale)
    return cfg, model


def draw_input(family, cfg, model, gen):
    for _ in range(1000):  # redraw x until no (near-)tie decides a choice in any layer
        x = (torch.rand(TOKENS, cfg.hidden_size, generator=gen, dtype=torch.float64) * 2 - 1) * 1.5
        with torch.no_grad():
            if min(selection_margin(family, cfg, block_of(model, L), x) for L in LAYERS) > MARGIN:
                return x
    raise RuntimeError(f"{family}: no input with a routing margin above {MARGIN}")


def lora_names(model):
    """peft's parameter name → its key in adapter_model.safetensors."""
    return {n: n.replace(".default", "") for n, _ in model.named_parameters() if ".lora_" in n}


def write_family(root, family, seed):
    out = os.path.join(root, family)
    shutil.rmtree(out, ignore_errors=True)
    cfg, model = build_model(family, seed)
    model.save_pretrained(os.path.join(out, "model"))
    gen = torch.Generator().manual_seed(seed + 1)
    x = draw_input(family, cfg, model, gen)
    r = torch.rand(TOKENS, cfg.hidden_size, generator=gen, dtype=torch.float64) * 2 - 1
    pm = get_peft_model(model, LoraConfig(**FAMILIES[family]["lora"]))
    keys = lora_names(pm)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if ".lora_B." in n:  # peft starts B at 0; a trained adapter's B is not
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.5)
    pm.save_pretrained(os.path.join(out, "adapter"))
    float64_routers(family, pm)
    io = {"x": x, "r": r}
    params = dict(pm.named_parameters())
    for L in LAYERS:
        xg = x.clone().requires_grad_(True)
        y = run_block(family, block_of(pm, L), xg)
        (y * r).sum().backward()
        io[f"y.{L}"], io[f"dx.{L}"] = y.detach(), xg.grad
    for n, key in keys.items():
        io["grad." + key] = params[n].grad
    save_file(io, os.path.join(out, "io.safetensors"), metadata={"family": family, "layers": "0,1"})
    pm.to(torch.bfloat16).save_pretrained(os.path.join(out, "adapter_bf16"))
    return out


APEX = dict(layer="MoEFFN", d_model=8, d_ffn=6, n_experts=6, n_active=2, n_shared=1)
APEX_LORA = dict(r=3, lora_alpha=4, target_modules=r"(experts\.[0-9]+\.(w_gate|w_up|w_down)|"
                                                  r"shared_experts\.[0-9]+\.(w_gate|w_up|w_down))")


def apex_block(base_file=None, seed=0):
    """tools/torch_reference.py's MoEFFN in float64: random weights, or those of base_file (expert_bias 0)."""
    block = torch_reference.build(APEX).double().eval()
    with torch.no_grad():
        if base_file:
            block.load_state_dict(load_file(base_file), strict=False)  # expert_bias is not stored: 0
        else:
            gen = torch.Generator().manual_seed(seed)
            for t in block.parameters():
                t.copy_((torch.rand(t.shape, generator=gen, dtype=torch.float64) * 2 - 1) * t.shape[-1] ** -0.5 * 1.5)
    return block


def write_apex(root, seed):
    out = os.path.join(root, "apex")
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    block = apex_block(seed=seed)
    base = {k: v for k, v in block.state_dict().items() if k != "expert_bias"}
    torch_reference.save_file(os.path.join(out, "base.safetensors"), base, {"apex.config": json.dumps(APEX)})
    gen = torch.Generator().manual_seed(seed + 1)
    K = APEX["n_active"]
    for _ in range(1000):
        x = (torch.rand(TOKENS, APEX["d_model"], generator=gen, dtype=torch.float64) * 2 - 1) * 1.5
        s = block.router(x).detach().sort(dim=-1, descending=True)[0]
        if (s[:, K - 1] - s[:, K]).min().item() > MARGIN:
            break
    else:
        raise RuntimeError(f"apex: no input with a routing margin above {MARGIN}")
    r = torch.rand(TOKENS, APEX["d_model"], generator=gen, dtype=torch.float64) * 2 - 1
    pm = get_peft_model(block, LoraConfig(**APEX_LORA))
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if ".lora_B." in n:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.5)
    pm.save_pretrained(os.path.join(out, "adapter"))
    xg = x.clone().requires_grad_(True)
    y = pm(xg)
    (y * r).sum().backward()
    io = {"x": x, "r": r, "y.0": y.detach(), "dx.0": xg.grad}
    params = dict(pm.named_parameters())
    for n, key in lora_names(pm).items():
        io["grad." + key] = params[n].grad
    save_file(io, os.path.join(out, "io.safetensors"), metadata={"family": "apex", "layers": "0"})
    pm.to(torch.bfloat16).save_pretrained(os.path.join(out, "adapter_bf16"))
    return out


def rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def load_base(folder):
    """The saved model in float64. Parameters a module creates in float32 on purpose (DeepSeek-V3's router
    weight and correction bias) load rounded to float32; they are read again from the file, unrounded."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64, experts_implementation="eager")
    model = model.double().eval()
    stored = load_file(os.path.join(folder, "model.safetensors"))
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if name in stored:
                t.copy_(stored[name])
    return model


def check_apex(root, tol):
    src = os.path.join(root, "apex", "from_apex")
    pm = PeftModel.from_pretrained(apex_block(os.path.join(root, "apex", "base.safetensors")),
                                   os.path.join(src, "adapter"))
    ok = same_as_file(pm, "apex", os.path.join(src, "adapter"))
    io = load_file(os.path.join(src, "io.safetensors"))
    with torch.no_grad():
        e = rel(pm(io["x"]), io["y.0"])
    print(f"apex block: peft on apex-ffn's adapter, rel error {e:.3e}")
    return ok and e <= tol


def same_as_file(pm, family, adapter):
    """Whether every tensor of the adapter file is in the loaded model, exactly, and no other."""
    file = load_file(os.path.join(adapter, "adapter_model.safetensors"))
    loaded = get_peft_model_state_dict(pm)
    ok = True
    if set(file) != set(loaded):
        print(f"{family}: keys differ: only in the file {sorted(set(file) - set(loaded))[:6]}, "
              f"only in the model {sorted(set(loaded) - set(file))[:6]}")
        ok = False
    for k in sorted(set(file) & set(loaded)):
        if not torch.equal(file[k].to(loaded[k].dtype), loaded[k]):
            print(f"{family}: {k} differs from the file after loading")
            ok = False
    return ok


def check_family(root, family, tol):
    if family == "apex":
        return check_apex(root, tol)
    src = os.path.join(root, family, "from_apex")
    model = load_base(os.path.join(root, family, "model"))
    pm = PeftModel.from_pretrained(model, os.path.join(src, "adapter"))
    ok = same_as_file(pm, family, os.path.join(src, "adapter"))
    float64_routers(family, pm)
    io = load_file(os.path.join(src, "io.safetensors"))
    with torch.no_grad():
        for L in LAYERS:
            e = rel(run_block(family, block_of(pm, L), io["x"]), io[f"y.{L}"])
            print(f"{family} layer {L}: peft on apex-ffn's adapter, rel error {e:.3e}")
            ok = ok and e <= tol
    return ok


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    fx = sub.add_parser("fixtures", help="write DIR/<family>/ for every family")
    fx.add_argument("dir")
    fx.add_argument("--seed-base", type=int, default=0)
    ck = sub.add_parser("check", help="load apex-ffn's adapters DIR/<family>/from_apex with peft and compare")
    ck.add_argument("dir")
    ck.add_argument("--tol", type=float, default=1e-10)
    a = ap.parse_args(argv)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, peft {peft.__version__}")
    if a.cmd == "fixtures":
        os.makedirs(a.dir, exist_ok=True)
        for i, family in enumerate(FAMILIES):
            print(write_family(a.dir, family, a.seed_base + 301 + 10 * i))
        print(write_apex(a.dir, a.seed_base + 401))
        return 0
    families = [f for f in list(FAMILIES) + ["apex"] if os.path.isdir(os.path.join(a.dir, f, "from_apex"))]
    if not families:
        print(f"no DIR/<family>/from_apex folders in {a.dir}")
        return 1
    return 0 if all([check_family(a.dir, f, a.tol) for f in families]) else 1


if __name__ == "__main__":
    sys.exit(main())
