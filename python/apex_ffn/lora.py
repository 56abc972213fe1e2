"""LoRA adapters on packed experts, trained with any torch optimizer, saved
and loaded in peft's file layout.

    from apex_ffn.packed import pack_experts
    from apex_ffn.lora import add_lora, save_peft, load_peft
    pack_experts(model, "q4_k")
    add_lora(model, r=8, lora_alpha=16)          # the base frozen, the adapters trainable
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    ...
    save_peft(model, "adapter")                  # PeftModel.from_pretrained(float_model, "adapter") loads it
    load_peft(other_packed_model, "adapter")     # and what peft saved

Each experts module gets W_gu' = W_gu + s·B_gu A_gu and W_down' = W_down +
s·B_down A_down per expert, s = lora_alpha / r (√r with rslora); the packed
W never changes. The forward and backward are the library's LoRA layer
over its frozen packed experts (apex_ffn::packed_experts_train), with the
activations kept exact: gradients for the inputs, the routing weights and
every adapter.

Stacked tensors, expert-major (B of gate_up: gate rows, then up rows):
    lora_A_gate_up (E, r, d), lora_B_gate_up (E, 2f, r), lora_A_down (E, r, f), lora_B_down (E, d, r)

peft's layout for transformers' fused experts (target_parameters, peft
0.21's ParamWrapper; docs/adapters.md#peft-adapter-files): per module
``base_model.model.<path>.experts``, gate_up_proj's tensors under
``base_layer.`` when down_proj is targeted too (peft nests the wrappers),

    lora_A  (r·E) × in     row e·r + k     = A_e row k
    lora_B  out × (r·E)    column k·E + e  = B_e column k

with gpt-oss's gate_up rows interleaved (row 2j gate unit j, 2j + 1 up unit j).
"""
import json
import math
import os

import torch
from torch import nn

from . import _core, ops
from .packed import PackedExpertsModule

TARGETS = ("gate_up_proj", "down_proj")


def _targets(where, targets):
    """targets as a tuple, checked: ConfigError for a string (whose letters would be taken for the names), an
    unknown name, and no name at all (adapters on nothing, which peft refuses too: with neither target_modules
    nor target_parameters, get_peft_model raises)."""
    if isinstance(targets, str):
        raise _core.ConfigError(f"{where}: targets {targets!r} is a string, expected a tuple of names, e.g. "
                                f"({targets!r},)")
    try:
        targets = tuple(targets)
    except TypeError:
        raise _core.ConfigError(f"{where}: targets {targets!r}, expected a tuple of gate_up_proj and/or "
                                "down_proj") from None
    for t in targets:
        if t not in TARGETS:
            raise _core.ConfigError(f"{where}: unknown target '{t}', expected gate_up_proj or down_proj")
    if not targets:
        raise _core.ConfigError(f"{where}: no targets, expected gate_up_proj, down_proj or both (adapters on "
                                "nothing would train nothing)")
    return targets


class ExpertsLora(nn.Module):
    """The adapters of one packed experts module (see the module comment for the shapes)."""

    def __init__(self, experts, d_model, d_ffn, r, scale, targets=TARGETS, generator=None):
        super().__init__()
        targets = _targets("apex_ffn.lora", targets)
        if r < 1:
            raise _core.ConfigError(f"apex_ffn.lora: rank {r}, expected >= 1")
        self.r, self.scale, self.targets = r, float(scale), tuple(t for t in TARGETS if t in targets)
        shapes = {"gate_up_proj": (d_model, 2 * d_ffn), "down_proj": (d_ffn, d_model)}
        for t in TARGETS:
            name = t.replace("_proj", "")
            if t in self.targets:
                fan_in, out = shapes[t]
                bound = 1.0 / math.sqrt(fan_in)  # peft's default: kaiming_uniform(a=√5) on A, B zero
                a = torch.empty(experts, r, fan_in).uniform_(-bound, bound, generator=generator)
                self.register_parameter(f"lora_A_{name}", nn.Parameter(a))
                self.register_parameter(f"lora_B_{name}", nn.Parameter(torch.zeros(experts, out, r)))
            else:
                self.register_parameter(f"lora_A_{name}", None)
                self.register_parameter(f"lora_B_{name}", None)

    def run(self, handle, x, ids, w, expert_parallel):
        y, _, _ = ops.packed_experts_train(x, ids, w, self.lora_A_gate_up, self.lora_B_gate_up, self.lora_A_down,
                                           self.lora_B_down, self.scale, handle, expert_parallel)
        return y

    def extra_repr(self):
        return f"r={self.r}, scale={self.scale}, targets={list(self.targets)}"


def packed_modules(model):
    found = [(n, m) for n, m in model.named_modules() if isinstance(m, PackedExpertsModule)]
    if not found:
        raise _core.ConfigError(f"apex_ffn.lora: {type(model).__name__} has no packed experts "
                                "(apex_ffn.packed.pack_experts first)")
    return found


def _scale(r, lora_alpha, use_rslora):
    return lora_alpha / math.sqrt(r) if use_rslora else lora_alpha / r


def add_lora(model, r, lora_alpha, targets=TARGETS, use_rslora=False, seed=0, freeze_base=True):
    """Attaches adapters of rank r to every packed experts module (replacing any it had); with freeze_base
    every other parameter of the model stops requiring gradients, as peft does. targets: a tuple of
    gate_up_proj and/or down_proj, at least one. Returns the modules' names."""
    found = packed_modules(model)
    if not isinstance(r, int) or r < 1:
        raise _core.ConfigError(f"apex_ffn.add_lora: rank {r}, expected >= 1")
    # a NaN or infinite alpha would make every adapted output NaN (its scale multiplies B·A, zero or not)
    try:
        finite = math.isfinite(lora_alpha)
    except TypeError:
        finite = False
    if not finite:
        raise _core.ConfigError(f"apex_ffn.add_lora: lora_alpha {lora_alpha!r}, expected a finite number")
    targets = _targets("apex_ffn.add_lora", targets)
    g = torch.Generator().manual_seed(seed)
    made = [ExpertsLora(m.num_experts, m.hidden_dim, m.intermediate_dim, r, _scale(r, lora_alpha, use_rslora),
                        targets, g) for _, m in found]  # every module built before the first is changed
    if freeze_base:
        model.requires_grad_(False)
    for (_, m), lora in zip(found, made):
        m.lora = lora
        m.lora_config = dict(r=r, lora_alpha=lora_alpha, use_rslora=use_rslora)
    return [n for n, _ in found]


# --- peft's file layout ------------------------------------------------------

def _b_rows(m, target, out):
    """peft's lora_B row o → the stacked B's row (gpt-oss's gate_up: gate and up interleaved)."""
    if target != "gate_up_proj" or not m.layout.interleaved:
        return torch.arange(out)
    o = torch.arange(out)
    return torch.where(o % 2 == 0, o // 2, m.intermediate_dim + o // 2)


def _keys(name, target, targets):
    nested = "base_layer." if target == "gate_up_proj" and "down_proj" in targets else ""
    base = f"base_model.model.{name}.{nested}"
    return base + "lora_A.weight", base + "lora_B.weight"


def peft_tensors(model):
    """{key: tensor} of every adapter in peft's layout (see the module comment)."""
    out = {}
    for name, m in packed_modules(model):
        if m.lora is None:
            raise _core.ConfigError(f"apex_ffn.save_peft: {name} has no adapters (add_lora first)")
        for t in m.lora.targets:
            short = t.replace("_proj", "")
            a, b = getattr(m.lora, f"lora_A_{short}").detach(), getattr(m.lora, f"lora_B_{short}").detach()
            e, out_rows, r = b.shape
            ka, kb = _keys(name, t, m.lora.targets)
            out[ka] = a.reshape(e * r, a.shape[2]).contiguous()
            out[kb] = b[:, _b_rows(m, t, out_rows)].permute(1, 2, 0).reshape(out_rows, r * e).contiguous()
    return out


def _target_parameters(model):
    params = []
    for name, m in packed_modules(model):
        path = name.split(".")
        # the path below the decoder layer (…layers.<i>.mlp.experts → mlp.experts), as peft matches it
        tail = ".".join(path[next((i + 1 for i in range(len(path) - 1, -1, -1) if path[i].isdigit()), 0):])
        for t in m.lora.targets:
            if f"{tail}.{t}" not in params:
                params.append(f"{tail}.{t}")
    return params


def save_peft(model, folder, base_model_name_or_path=None, task_type="CAUSAL_LM"):
    """Writes adapter_config.json and adapter_model.safetensors as peft's save_pretrained does."""
    from safetensors.torch import save_file
    found = packed_modules(model)
    configs = {json.dumps(getattr(m, "lora_config", None), sort_keys=True) for _, m in found}
    for name, m in found:
        if m.lora is None:
            raise _core.ConfigError(f"apex_ffn.save_peft: {name} has no adapters (add_lora first)")
    if len(configs) != 1:
        raise _core.ConfigError("apex_ffn.save_peft: every packed experts module needs adapters of one rank and alpha")
    cfg = found[0][1].lora_config
    if base_model_name_or_path is None:
        base_model_name_or_path = getattr(getattr(model, "config", None), "_name_or_path", "") or ""
    text = _core.peft_config_text(cfg["r"], float(cfg["lora_alpha"]), cfg["use_rslora"], _target_parameters(model),
                                  base_model_name_or_path, task_type or "")
    tensors = peft_tensors(model)
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        f.write(text)


def load_peft(model, folder):
    """Reads a peft adapter folder into the model's packed experts (adapters made as the config says).
    Every tensor is checked before the first module changes: an error leaves the model as it was."""
    from safetensors import SafetensorError, safe_open
    cfg = _core.read_peft_config(str(folder))
    targets = [t for t in TARGETS if any(p.endswith("experts." + t) for p in cfg["target_parameters"])]
    others = [p for p in cfg["target_parameters"] if not p.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    if others or cfg["target_modules"] or cfg["target_modules_regex"] or not targets:
        raise _core.ConfigError(f"apex_ffn.load_peft: {folder}: the adapter targets "
                                f"{others + cfg['target_modules'] or cfg['target_modules_regex'] or 'nothing'} "
                                "besides the experts' gate_up_proj and down_proj; only adapters on the packed "
                                "experts are read")
    found = packed_modules(model)
    path = os.path.join(str(folder), "adapter_model.safetensors")
    if not os.path.isfile(path):
        raise _core.FormatError(f"apex_ffn.load_peft: {folder} has no adapter_model.safetensors")
    r = int(cfg["r"])
    staged = []
    try:
        opened = safe_open(path, framework="pt")
    except SafetensorError as err:  # a truncated or corrupt file: the library's FormatError, naming it
        raise _core.FormatError(f"apex_ffn.load_peft: {path} is not a safetensors file that can be read: {err}"
                                ) from None
    with opened as f:
        keys = set(f.keys())
        used = set()
        for name, m in found:
            lora = ExpertsLora(m.num_experts, m.hidden_dim, m.intermediate_dim, r, cfg["scale"], targets)
            e, f_, d = m.num_experts, m.intermediate_dim, m.hidden_dim
            for t in targets:
                short = t.replace("_proj", "")
                fan_in, out = (d, 2 * f_) if t == "gate_up_proj" else (f_, d)
                ka, kb = _keys(name, t, targets)
                for k, shape in ((ka, (r * e, fan_in)), (kb, (out, r * e))):
                    if k not in keys:
                        raise _core.FormatError(f"apex_ffn.load_peft: {path} has no tensor '{k}' for {name}")
                    got = tuple(f.get_slice(k).get_shape())
                    if got != shape:
                        raise _core.ShapeError(f"apex_ffn.load_peft: tensor '{k}' has shape {got}, expected {shape} "
                                               f"({name}: {e} experts, rank {r})")
                    used.add(k)
                a = f.get_tensor(ka).float().reshape(e, r, fan_in)
                b_peft = f.get_tensor(kb).float().reshape(out, r, e).permute(2, 0, 1)
                b = torch.empty_like(b_peft)
                b[:, _b_rows(m, t, out)] = b_peft
                for k, v in ((ka, a), (kb, b)):
                    if not torch.isfinite(v).all():
                        raise _core.ValueError(f"apex_ffn.load_peft: tensor '{k}' contains NaN or Inf")
                with torch.no_grad():
                    getattr(lora, f"lora_A_{short}").copy_(a)
                    getattr(lora, f"lora_B_{short}").copy_(b)
            staged.append((m, lora))
        extra = sorted(keys - used)
        if extra:
            raise _core.ConfigError(f"apex_ffn.load_peft: {path} holds tensors the model's packed experts do not "
                                    f"have, e.g. '{extra[0]}' ({len(extra)} in all)")
    for m, lora in staged:
        m.lora = lora
        m.lora_config = dict(r=r, lora_alpha=cfg["lora_alpha"], use_rslora=cfg["use_rslora"])
    return [n for n, _ in found]
